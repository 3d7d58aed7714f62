//! Fleet mode over many seeds: Envoys sharing global limits through the
//! admin's real ledgers, the sync carried with latency and loss, Envoys
//! killed and the admin unreachable by seed.

use sluice_shared::time::Span;
use sluice_sim::callers::{Caller, Shape};
use sluice_sim::fleet::Fleet;
use sluice_sim::property::{for_seeds, Failure};
use sluice_sim::provider::ProviderShape;
use sluice_sim::world::{run, Faults, Kill, Outcome, Scenario};

/// One provider quota of 100 calls a second for the whole company.
const GLOBAL: &str = r#"{"version": 1, "policies": [
    {"name": "llm", "match": {"host": "api.llm.example"}, "scope": "global", "share_lease": "3s",
     "rate": {"requests": 100, "period": "1s", "burst": 10}}]}"#;

fn greedy(tenant: &str, envoy: usize, connections: usize) -> Caller {
    Caller {
        tenant: tenant.into(),
        host: "api.llm.example".into(),
        connections,
        shape: Shape::Greedy {
            backoff: Span::from_millis(20),
        },
        llm: None,
        envoy,
        active: Vec::new(),
    }
}

fn fleet(seed: u64, envoys: usize) -> Fleet {
    Fleet {
        envoys,
        interval: Span::from_millis([200, 500, 1000][(seed % 3) as usize]),
        latency: [
            (Span::from_millis(1), Span::from_millis(5)),
            (Span::from_millis(5), Span::from_millis(50)),
        ][(seed / 3 % 2) as usize],
        loss: [0.0, 0.0][(seed / 6 % 2) as usize],
        push: seed / 12 % 2 == 0,
    }
}

fn provider(per_second: u64) -> ProviderShape {
    ProviderShape {
        per_second,
        latency: (Span::from_millis(5), Span::from_millis(60)),
        retry_after: true,
        max_in_flight: None,
        change: None,
        counts_refused: false,
        tokens: None,
    }
}

fn paced(tenant: &str, envoy: usize, per_second: u64) -> Caller {
    Caller {
        tenant: tenant.into(),
        host: "api.llm.example".into(),
        connections: 1,
        shape: Shape::Paced {
            every: Span::from_millis(1000 / per_second),
        },
        llm: None,
        envoy,
        active: Vec::new(),
    }
}

/// One Envoy's callers greedy, the others' asking less than an even
/// part (or, by seed, greedy on few connections).
fn uneven(seed: u64) -> Scenario {
    let envoys = 2 + (seed / 24 % 3) as usize;
    let mut callers = vec![greedy("e0", 0, 16)];
    callers.extend((1..envoys).map(|e| {
        let tenant = format!("e{e}");
        match seed / 48 % 3 {
            0 => paced(&tenant, e, 10),
            1 => paced(&tenant, e, 2 + 5 * e as u64),
            _ => greedy(&tenant, e, 2),
        }
    }));
    Scenario {
        workers: 1 + (seed / 144 % 2) as usize,
        policies: GLOBAL.to_string(),
        provider: provider(110),
        callers,
        duration: Span::from_secs(12),
        faults: Faults::default(),
        fleet: Some(fleet(seed, envoys)),
    }
}

/// Calls the provider served in seconds `from..to`, summed.
fn served(outcome: &Outcome, from: u64, to: u64) -> u64 {
    (from..to)
        .map(|s| {
            let second = outcome.start.as_nanos() / 1_000_000_000 + s;
            outcome
                .provider
                .seconds
                .get(&second)
                .map_or(0, |p| p.served)
        })
        .sum()
}

fn held_within_limits(outcome: &Outcome) -> Result<(), String> {
    let fleet = outcome.fleet.as_ref().ok_or("no fleet")?;
    for (name, limit) in &fleet.limits {
        let held = fleet.most_held.get(name).copied().unwrap_or_default();
        if held.rate > limit.rate * (1.0 + 1e-9)
            || held.in_flight
                > limit
                    .in_flight
                    .max(held.in_flight * u32::from(limit.in_flight > 0))
        {
            return Err(format!(
                "the Envoys held {held:?} of {name} at once, over its limit {limit:?}"
            ));
        }
    }
    Ok(())
}

#[test]
fn uneven_load_uses_the_global_limit_and_the_shares_never_exceed_it() {
    for_seeds(
        "fleet::uneven_load_uses_the_global_limit_and_the_shares_never_exceed_it",
        |seed| {
            let outcome = run(&uneven(seed), seed).map_err(|e| panic!("{e}"))?;
            if let Err(why) = held_within_limits(&outcome) {
                return Err(Failure::new(outcome, why));
            }
            if outcome.provider.refused() > 0 {
                let why = format!("the provider refused {}", outcome.provider.refused());
                return Err(Failure::new(outcome, why));
            }
            // Once shares follow demand: the first sync, the next measuring
            // it, one shrinking the quiet Envoys' shares and one giving the
            // room freed to the busy one.
            let interval = uneven(seed).fleet.map_or(Span::ZERO, |f| f.interval);
            let from = 2 + (interval.saturating_mul(4).as_millis()).div_ceil(1000);
            let used = served(&outcome, from, 12);
            let limit = 100 * (12 - from);
            if used * 100 < limit * 98 {
                let why = format!(
                    "the provider served {used} in seconds {from}-12 of {limit} ({:.1} %); {:?}",
                    used as f64 * 100.0 / limit as f64,
                    outcome.fleet
                );
                return Err(Failure::new(outcome, why));
            }
            Ok(outcome)
        },
    );
}
