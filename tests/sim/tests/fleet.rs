//! Fleet mode over many seeds: Envoys sharing a global limit through the
//! admin's real ledgers, the sync carried with latency, loss and
//! reordering; Envoys killed and the admin unreachable by seed. The setup
//! of docs/FLEET.md's measurements: a global 290 calls a second (burst 6)
//! in front of a provider refusing past 300 in a calendar second.

use sluice_shared::time::Span;
use sluice_sim::callers::{Caller, Shape};
use sluice_sim::fleet::Fleet;
use sluice_sim::property::{for_seeds, Failure};
use sluice_sim::provider::ProviderShape;
use sluice_sim::world::{run, Faults, Kill, Outcome, Scenario};

const LIMIT: u64 = 290;

const GLOBAL: &str = r#"{"version": 1, "policies": [
    {"name": "llm", "match": {"host": "api.llm.example"}, "scope": "global", "share_lease": "2s",
     "rate": {"requests": 290, "period": "1s", "burst": 6}}]}"#;

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

/// More than any share: 32 connections, each again 20 ms after a refusal.
fn busy(tenant: &str, envoy: usize) -> Caller {
    let backoff = Span::from_millis(20);
    caller(tenant, envoy, 32, Shape::Greedy { backoff })
}

/// `per_second` calls a second, steadily, over four connections.
fn steady(tenant: &str, envoy: usize, per_second: u64) -> Caller {
    let every = Span::from_millis(4_000 / per_second);
    caller(tenant, envoy, 4, Shape::Steady { every })
}

/// What the seed picks of the fleet: its sync interval, the network's
/// latency each way, lost messages, whether Envoys hold a watch.
fn fleet(seed: u64, envoys: usize) -> Fleet {
    Fleet {
        envoys,
        interval: Span::from_millis([200, 200, 500][(seed % 3) as usize]),
        latency: [
            (Span::from_millis(1), Span::from_millis(5)),
            (Span::from_millis(5), Span::from_millis(50)),
        ][(seed / 3 % 2) as usize],
        loss: 0.0,
        push: seed / 6 % 2 == 0,
    }
}

fn provider() -> ProviderShape {
    ProviderShape {
        per_second: 300,
        latency: (Span::from_millis(5), Span::from_millis(60)),
        retry_after: true,
        max_in_flight: None,
        change: None,
        counts_refused: false,
        tokens: None,
    }
}

fn scenario(seed: u64, envoys: usize, callers: Vec<Caller>, duration: Span) -> Scenario {
    Scenario {
        workers: 1 + (seed / 12 % 2) as usize,
        policies: GLOBAL.to_string(),
        provider: provider(),
        callers,
        duration,
        faults: Faults::default(),
        fleet: Some(fleet(seed, envoys)),
    }
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

/// Seconds `from..to` used at least `percent` of the limit.
fn used(outcome: &Outcome, (from, to): (u64, u64), percent: u64) -> Result<(), String> {
    let used = served(outcome, from, to);
    let limit = LIMIT * (to - from);
    if used * 100 < limit * percent {
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
    for_seeds(
        "fleet::uneven_load_uses_the_global_limit_and_the_shares_never_exceed_it",
        |seed| {
            let envoys = 2 + (seed / 24 % 3) as usize;
            let mut callers = vec![busy("e0", 0)];
            callers.extend((1..envoys).map(|e| steady(&format!("e{e}"), e, 50)));
            let outcome = run(&scenario(seed, envoys, callers, Span::from_secs(12)), seed)
                .map_err(|e| panic!("{e}"))?;
            let checked = within_the_limit(&outcome)
                .and_then(|()| used(&outcome, (settled_from(seed), 12), 98));
            match checked {
                Ok(()) => Ok(outcome),
                Err(why) => Err(Failure::new(outcome, why)),
            }
        },
    );
}

/// 400 a second moves between three Envoys every 5 s, the other two
/// steady at 50.
#[test]
fn moving_load_uses_the_global_limit() {
    for_seeds("fleet::moving_load_uses_the_global_limit", |seed| {
        let mut callers = Vec::new();
        for e in 0..3 {
            let mut moving = busy(&format!("busy{e}"), e);
            // Busy in seconds 5e..5e+5, 15+5e..20+5e.
            moving.active = vec![
                (Span::from_secs(5 * e as u64), Span::from_secs(5)),
                (Span::from_secs(15 + 5 * e as u64), Span::from_secs(5)),
            ];
            callers.push(moving);
            callers.push(steady(&format!("e{e}"), e, 50));
        }
        // Load that moves is followed within syncs, room freed told at
        // once through the watches: docs/FLEET.md's 200 ms and push.
        // (Without push, 94.3-96.0 % over 240 seeds: freed room waits for
        // the others' next sync; at 500 ms each move costs over a second.)
        let mut scenario = scenario(seed, 3, callers, Span::from_secs(25));
        if let Some(fleet) = scenario.fleet.as_mut() {
            fleet.interval = Span::from_millis(200);
            fleet.push = true;
        }
        let outcome = run(&scenario, seed).map_err(|e| panic!("{e}"))?;
        let checked = within_the_limit(&outcome).and_then(|()| used(&outcome, (3, 25), 95));
        match checked {
            Ok(()) => Ok(outcome),
            Err(why) => Err(Failure::new(outcome, why)),
        }
    });
}

/// The busy Envoy is killed (its callers go to the others, as a balancer
/// in front sends them) and comes back: its share moves to the others
/// within a lease and back within two syncs of its return, and nothing
/// refuses past the limit meanwhile.
#[test]
fn a_dead_envoys_share_moves_and_comes_back() {
    for_seeds("fleet::a_dead_envoys_share_moves_and_comes_back", |seed| {
        let envoys = 2 + (seed / 24 % 2) as usize;
        let mut callers = vec![busy("e0", 0)];
        callers.extend((1..envoys).map(|e| steady(&format!("e{e}"), e, 50)));
        let mut scenario = scenario(seed, envoys, callers, Span::from_secs(20));
        scenario.faults.kills = vec![Kill {
            envoy: 0,
            at: Span::from_millis(8_000 + seed % 7 * 100),
            down_for: Span::from_secs(5),
        }];
        let outcome = run(&scenario, seed).map_err(|e| panic!("{e}"))?;
        // Killed at 8.0-8.6 s; a lease (2 s) later the others use the limit.
        let checked = within_the_limit(&outcome)
            .and_then(|()| used(&outcome, (settled_from(seed), 8), 98))
            .and_then(|()| used(&outcome, (11, 13), 95))
            // Back at 13.0-13.6 s: two syncs later it has its part again.
            .and_then(|()| used(&outcome, (15, 20), 95));
        match checked {
            Ok(()) => Ok(outcome),
            Err(why) => Err(Failure::new(outcome, why)),
        }
    });
}
