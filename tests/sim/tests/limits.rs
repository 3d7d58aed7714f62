//! Limits against a provider over many seeds: a rate held per calendar
//! second, and nothing a call holds outliving it whatever faults the
//! seed injects.

use sluice_shared::time::Span;
use sluice_sim::callers::{Caller, RetryAfter, Shape};
use sluice_sim::property::{for_seeds, provider_refused_none, Failure};
use sluice_sim::provider::ProviderShape;
use sluice_sim::world::{run, Faults, Outcome, Pause, Scenario};

fn callers(seed: u64) -> Vec<Caller> {
    let greedy = [1, 4, 16, 32][(seed / 4 % 4) as usize];
    vec![
        Caller {
            tenant: "greedy".into(),
            host: "api.bank.example".into(),
            connections: greedy,
            shape: Shape::Greedy {
                backoff: Span::from_millis(10 + seed / 16 % 3 * 20),
                heeds: RetryAfter::Ignored,
            },
            llm: None,
            envoy: 0,
            active: Vec::new(),
        },
        Caller {
            tenant: "paced".into(),
            host: "api.bank.example".into(),
            connections: 1 + (seed / 48 % 4) as usize,
            shape: Shape::Paced {
                every: Span::from_millis(50),
            },
            llm: None,
            envoy: 0,
            active: Vec::new(),
        },
    ]
}

/// A provider allowing 100 calls per calendar second behind a policy of
/// 95 a second with `rate` (the rest of its `rate` object), greedy and
/// paced callers for `duration` and the seed's `faults`: the provider
/// never refuses, and never serves more than 100 in a calendar second.
fn calendar_seconds_held(
    seed: u64,
    rate: &str,
    duration: Span,
    faults: Faults,
) -> Result<Outcome, Failure> {
    let scenario = Scenario {
        workers: 1 + (seed % 4) as usize,
        policies: format!(
            r#"{{"version": 1, "policies": [
                {{"name": "bank", "match": {{"host": "api.bank.example"}},
                 "rate": {{"requests": 95, "period": "1s", {rate}}}}}]}}"#
        ),
        provider: ProviderShape::calls(100, (Span::from_millis(5), Span::from_millis(200))),
        callers: callers(seed),
        duration,
        faults,
        fleet: None,
        pool: None,
    };
    let outcome = provider_refused_none(run(&scenario, seed).map_err(|e| panic!("{e}"))?)?;
    let most = outcome
        .provider
        .seconds
        .values()
        .map(|s| s.served)
        .max()
        .unwrap_or(0);
    if most > 100 {
        return Err(Failure::new(
            outcome,
            format!("{most} in a calendar second"),
        ));
    }
    Ok(outcome)
}

/// A token bucket of 95 a second (burst 5): however many workers and
/// callers, each calendar second stays inside the provider's 100.
#[test]
fn a_rate_below_the_providers_keeps_every_calendar_second_inside_it() {
    for_seeds(
        "limits::a_rate_below_the_providers_keeps_every_calendar_second_inside_it",
        |seed| calendar_seconds_held(seed, r#""burst": 5"#, Span::from_secs(4), Faults::default()),
    );
}

/// A fixed window of 95 a second, and Envoy paused for 1.1 to 3 s
/// (stopped, or a machine too loaded to run it) while callers wait: its
/// workers read the wall clock late, take that for time that passed, and
/// their windows stay on the provider's seconds. (Before the workers'
/// clocks read the monotonic clock they took such a pause for a step of
/// the wall clock, absorbed all but a second of it and lagged the
/// provider's seconds for ten times as long.)
#[test]
fn a_paused_envoy_keeps_every_calendar_second_inside_the_providers() {
    for_seeds(
        "limits::a_paused_envoy_keeps_every_calendar_second_inside_the_providers",
        |seed| {
            let pause = Pause {
                envoy: 0,
                at: Span::from_millis(1_000 + seed * 7_919 % 2_000),
                lasting: Span::from_millis(1_100 + seed * 104_729 % 1_900),
            };
            let faults = Faults {
                pauses: vec![pause],
                ..Faults::default()
            };
            calendar_seconds_held(
                seed,
                r#""algorithm": "fixed_window""#,
                Span::from_secs(6),
                faults,
            )
        },
    );
}

/// Calls in flight (4 at most, as the provider allows) and a queue, with
/// shared-data writes failing by seed: the provider never has more than
/// 4 at once, and after the callers stop and their calls end, no stream,
/// slot or queued call is left.
#[test]
fn slots_hold_the_providers_concurrency_and_nothing_outlives_its_call() {
    for_seeds(
        "limits::slots_hold_the_providers_concurrency_and_nothing_outlives_its_call",
        |seed| {
            let scenario = Scenario {
                workers: 1 + (seed % 4) as usize,
                policies: r#"{"version": 1, "policies": [
                    {"name": "bank", "match": {"host": "api.bank.example"},
                     "rate": {"requests": 50, "period": "1s", "burst": 5},
                     "concurrency": {"max_in_flight": 4, "lease_ttl": "5s"},
                     "on_limit": {"action": "queue", "max_wait": "300ms", "max_queue": 20}}]}"#
                    .to_string(),
                provider: ProviderShape {
                    max_in_flight: Some(4),
                    ..ProviderShape::calls(1000, (Span::from_millis(5), Span::from_millis(200)))
                },
                callers: callers(seed),
                duration: Span::from_secs(3),
                faults: Faults {
                    write_failure: [0.0, 0.01, 0.1][(seed % 3) as usize],
                    ..Faults::default()
                },
                fleet: None,
                pool: None,
            };
            let outcome = run(&scenario, seed).map_err(|e| panic!("{e}"))?;
            if outcome.provider.refused() > 0 {
                let why = format!(
                    "the provider, allowing 4 in flight, refused {} (at most {} at once); {} writes failed",
                    outcome.provider.refused(),
                    outcome.provider.most_in_flight,
                    outcome.failed_writes
                );
                return Err(Failure::new(outcome, why));
            }
            let left = (
                outcome.left_open,
                outcome.left_in_flight,
                outcome.left_waiting,
            );
            if left != (0, 0, 0) {
                let why = format!(
                    "left (streams, in flight, waiting) {left:?}; {} writes failed",
                    outcome.failed_writes
                );
                return Err(Failure::new(outcome, why));
            }
            Ok(outcome)
        },
    );
}
