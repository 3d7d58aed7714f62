//! Pools over many seeds: two deployments of one API behind a pool, as
//! `envoy/pool.yaml` routes and retries (a 429 tried once more on the
//! other member). When one member's quota drops to 0 and it says so with
//! `Retry-After: 30`, Sluice routes around it: almost no call sees the
//! provider's 429, and the other member's room is used. Where the member
//! clusters run the attempts filter (`role: attempts`), the member that
//! refused is paused for all of its 30 s, Envoy's retries or not.

use sluice_shared::time::{Instant, Span};
use sluice_sim::callers::{Caller, Shape};
use sluice_sim::pool::{PoolMember, PoolRoutes};
use sluice_sim::property::{for_seeds, verdict};
use sluice_sim::provider::ProviderShape;
use sluice_sim::world::{run, Faults, Outcome, Scenario};

/// Each deployment's calls per calendar second.
const PROVIDER_PER_SECOND: u64 = 50;
/// Each member's limit in Sluice: its burst kept within the provider's
/// calendar second.
const MEMBER_PER_SECOND: u64 = 48;
/// What the callers send a second: more than one member's room, less
/// than both.
const CALLS_PER_SECOND: u64 = 80;
const RUN: Span = Span::from_secs(12);

fn member(name: &str) -> String {
    format!(
        r#"{{"name": "{name}", "cluster": "llm-{name}",
            "limits": [{{"name": "{name}-rps", "rate": {{"requests": {MEMBER_PER_SECOND}, "period": "1s", "burst": 2}},
                         "provider": {{"max_pause": "60s"}}}}]}}"#
    )
}

/// The seed's pool: answers in 5 ms to 40, 100 or 200 ms; east's quota
/// drops to 0 between 3 and 5 s in, its 429s saying `Retry-After: 30`.
fn east_drops_to_zero(seed: u64) -> Scenario {
    east_drops_to_zero_for(seed, RUN, false)
}

/// [`east_drops_to_zero`] for `run`, the attempts filter configured or not.
fn east_drops_to_zero_for(seed: u64, run: Span, attempts_heard: bool) -> Scenario {
    let slowest = [40, 100, 200][(seed / 4 % 3) as usize];
    let latency = (Span::from_millis(5), Span::from_millis(slowest));
    let drop = Span::from_millis(3_000 + seed / 12 % 2_000);
    let connections = [24, 40][(seed / 2_000 % 2) as usize];
    let mut east = ProviderShape::calls(PROVIDER_PER_SECOND, latency);
    east.change = Some((drop, 0));
    east.retry_after = Some(30);
    let west = ProviderShape::calls(PROVIDER_PER_SECOND, latency);
    Scenario {
        workers: 1 + (seed % 4) as usize,
        policies: format!(
            r#"{{"version": 1, "policies": [{{"name": "llm", "match": {{"host": "api.llm.example"}},
                "rate": {{"requests": 1000, "period": "1s"}},
                "pool": {{"members": [{}, {}]}}}}]}}"#,
            member("east"),
            member("west")
        ),
        // Unused: every call goes to a member.
        provider: west.clone(),
        callers: vec![Caller {
            tenant: "caller".into(),
            host: "api.llm.example".into(),
            connections,
            shape: Shape::Steady {
                every: Span::from_millis(1000 * connections as u64 / CALLS_PER_SECOND),
            },
            llm: None,
            envoy: 0,
            active: Vec::new(),
        }],
        duration: run,
        faults: Faults::default(),
        fleet: None,
        pool: Some(PoolRoutes {
            route_header: "x-sluice-member".into(),
            members: vec![
                PoolMember {
                    name: "east".into(),
                    cluster: "llm-east".into(),
                    provider: east,
                },
                PoolMember {
                    name: "west".into(),
                    cluster: "llm-west".into(),
                    provider: west,
                },
            ],
            attempts_heard,
        }),
    }
}

fn metric(outcome: &Outcome, name: &str) -> i64 {
    outcome.metrics.get(name).copied().unwrap_or(0)
}

/// The run's second (the trace's) an instant falls in.
fn second_of(outcome: &Outcome, at: Instant) -> u64 {
    outcome.trace.second_of(at)
}

fn routed_around(outcome: &Outcome) -> Result<(), String> {
    routed_around_in(outcome, RUN)
}

fn routed_around_in(outcome: &Outcome, run: Span) -> Result<(), String> {
    let (east, west) = (&outcome.members[0], &outcome.members[1]);
    let dropped = east
        .changes_at()
        .ok_or("east had no call before its drop")?;
    let first_after = second_of(outcome, dropped) + 1;
    let end = second_of(outcome, outcome.start + run);
    // Before it, both members serve all that is sent.
    let before = outcome.trace.tenant("caller", 0, first_after - 1);
    let refused: u64 = before.refused.values().sum();
    if refused + before.provider_429 > 0 || east.served() < 100 {
        return Err(format!(
            "before the drop Sluice refused {refused} of {} calls, the members {}; east served {} in all",
            before.sent,
            before.provider_429,
            east.served()
        ));
    }
    // What the callers saw: a member's 429 that Envoy did not try again
    // on the other member (or that the other refused too).
    let after = outcome.trace.tenant("caller", first_after - 1, end + 1);
    let seen_429 = after.provider_429 - after.retried;
    if seen_429 * 1000 >= after.sent * 5 {
        return Err(format!(
            "after the drop {seen_429} of {} calls saw a provider's 429 ({} retried on the other member)",
            after.sent, after.retried
        ));
    }
    // West's calendar seconds wholly after the drop, but the last (the
    // callers stop in it): its room used, at least 95 % of it in all and
    // in each second. The first only holds its room less the calls Envoy
    // retried on west during the drop: Sluice charged them to west as
    // they were served (beyond its burst, as a debt the next calls repay).
    let calendar = outcome.start.as_nanos() / 1_000_000_000;
    let served: Vec<u64> = (first_after..end)
        .map(|s| west.seconds.get(&(calendar + s)).map_or(0, |p| p.served))
        .collect();
    let during_drop = outcome
        .trace
        .tenant("caller", first_after - 1, first_after + 1)
        .retried;
    let first_room = MEMBER_PER_SECOND.saturating_sub(during_drop);
    let total: u64 = served.iter().sum();
    let short = served.len() < 5
        || total * 100 < 95 * MEMBER_PER_SECOND * served.len() as u64
        || served.first().is_some_and(|n| n * 100 < 95 * first_room)
        || served
            .iter()
            .skip(1)
            .any(|n| n * 100 < 95 * MEMBER_PER_SECOND);
    if short {
        return Err(format!(
            "west served {served:?} a second after the drop (its room {MEMBER_PER_SECOND}, \
             {during_drop} retried on it during the drop)"
        ));
    }
    if metric(outcome, "sluice.limit.east-rps.paused") < 1 {
        return Err("east was never paused".into());
    }
    // Each call Envoy tried on another member is counted there once.
    let retried = outcome.trace.tenant("caller", 0, end + 60).retried;
    let counted = metric(outcome, "sluice.limit.east-rps.pool_retried")
        + metric(outcome, "sluice.limit.west-rps.pool_retried");
    if u64::try_from(counted).ok() != Some(retried) {
        return Err(format!(
            "Envoy retried {retried} calls on the other member, Sluice counted {counted}"
        ));
    }
    if (
        outcome.left_open,
        outcome.left_in_flight,
        outcome.left_waiting,
    ) != (0, 0, 0)
    {
        return Err(format!(
            "left after the drain: {} streams, {} in flight, {} waiting",
            outcome.left_open, outcome.left_in_flight, outcome.left_waiting
        ));
    }
    Ok(())
}

#[test]
fn a_member_that_drops_to_zero_is_routed_around() {
    for_seeds(
        "pool_routing::a_member_that_drops_to_zero_is_routed_around",
        |seed| {
            let outcome = run(&east_drops_to_zero(seed), seed).map_err(|e| panic!("{e}"))?;
            let checked = routed_around(&outcome);
            verdict(outcome, checked)
        },
    );
}

/// Long enough to see east's 30 s end.
const LONG_RUN: Span = Span::from_secs(40);

/// With the attempts filter, east's first refusal pauses it for its 30 s
/// (heard within an answer's latency of it): no call reaches east from the
/// second calendar second after the one it first refused in, to the 29th,
/// and one does within 3 s of the 30 s (its probe; its quota is still 0,
/// so that one is refused and heard too). And the pool is routed around
/// as without it.
fn paused_for_its_wait(outcome: &Outcome) -> Result<(), String> {
    let east = &outcome.members[0];
    let (first_refused, _) = east
        .seconds
        .iter()
        .find(|(_, s)| s.refused > 0)
        .ok_or("east refused no call")?;
    let calls = |second: u64| {
        east.seconds
            .get(&second)
            .map_or(0, |s| s.served + s.refused)
    };
    let during: Vec<(u64, u64)> = (first_refused + 2..=first_refused + 29)
        .map(|s| (s - first_refused, calls(s)))
        .filter(|(_, n)| *n > 0)
        .collect();
    if !during.is_empty() {
        return Err(format!(
            "east got calls during its 30 s (seconds after its first refusal, calls): {during:?}"
        ));
    }
    if (first_refused + 30..first_refused + 33).all(|s| calls(s) == 0) {
        return Err("east got no call within 3 s of its 30 s".into());
    }
    routed_around_in(outcome, LONG_RUN)
}

#[test]
fn a_refusal_heard_per_attempt_pauses_its_member_for_its_wait() {
    for_seeds(
        "pool_routing::a_refusal_heard_per_attempt_pauses_its_member_for_its_wait",
        |seed| {
            let scenario = east_drops_to_zero_for(seed, LONG_RUN, true);
            let outcome = run(&scenario, seed).map_err(|e| panic!("{e}"))?;
            let checked = paused_for_its_wait(&outcome);
            verdict(outcome, checked)
        },
    );
}
