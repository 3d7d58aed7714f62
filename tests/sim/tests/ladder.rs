//! The budget ladder's queue rung over many seeds: a window paced past
//! its line never lets more through by any second than its line and the
//! rest released by then, and greedy callers still use all of it.

use sluice_shared::time::Span;
use sluice_sim::callers::{Caller, RetryAfter, Shape};
use sluice_sim::property::{for_seeds_by_default, provider_refused_none, Failure};
use sluice_sim::provider::ProviderShape;
use sluice_sim::world::{run, Faults, Outcome, Scenario};

/// The simulated clock starts within this second, a multiple of the
/// window: windows begin at its multiples of 10 s.
const FIRST_SECOND: u64 = 1_800_000_000;
const WINDOW_SECS: u64 = 10;
const LIMIT: u64 = 200;
const LINE: u64 = 100;

fn callers(seed: u64) -> Vec<Caller> {
    vec![
        Caller {
            tenant: "greedy".into(),
            host: "api.llm.example".into(),
            connections: [8, 16, 32, 64][(seed % 4) as usize],
            shape: Shape::Greedy {
                backoff: Span::from_millis(10 + seed / 4 % 3 * 40),
                heeds: if seed / 12 % 2 == 0 {
                    RetryAfter::Ignored
                } else {
                    RetryAfter::Heeded
                },
            },
            llm: None,
            envoy: 0,
            active: Vec::new(),
        },
        Caller {
            tenant: "steady".into(),
            host: "api.llm.example".into(),
            connections: 1 + (seed / 24 % 3) as usize,
            shape: Shape::Paced {
                every: Span::from_millis(20 + seed / 72 % 4 * 30),
            },
            llm: None,
            envoy: 0,
            active: Vec::new(),
        },
    ]
}

/// 200 calls per 10 s window, paced past half (10 a second), calls held
/// up to `max_wait`, for two windows and the start of a third.
fn paced(seed: u64) -> Result<Outcome, Failure> {
    let max_wait = ["300ms", "2s", "10s"][(seed / 7 % 3) as usize];
    let scenario = Scenario {
        workers: 1 + (seed / 3 % 4) as usize,
        policies: format!(
            r#"{{"version": 1, "policies": [
                {{"name": "llm", "match": {{"host": "api.llm.example"}},
                 "rate": {{"requests": 1000, "period": "1s"}},
                 "on_limit": {{"action": "queue", "max_wait": "{max_wait}", "max_queue": 100}},
                 "limits": [{{"name": "paced", "queue": {{"at": 0.5}},
                   "rate": {{"requests": {LIMIT}, "period": "{WINDOW_SECS}s", "algorithm": "fixed_window"}}}}]}}]}}"#
        ),
        provider: ProviderShape::calls(10_000, (Span::from_millis(5), Span::from_millis(200))),
        callers: callers(seed),
        duration: Span::from_secs(2 * WINDOW_SECS + 3),
        faults: Faults::default(),
        fleet: None,
        pool: None,
    };
    let outcome = provider_refused_none(run(&scenario, seed).map_err(|e| panic!("{e}"))?)?;
    for window in 0..3 {
        let first = FIRST_SECOND + window * WINDOW_SECS;
        let mut served = 0;
        for second in 0..WINDOW_SECS {
            served += outcome
                .provider
                .seconds
                .get(&(first + second))
                .map_or(0, |s| s.served);
            // By the end of this second the pace has released the line
            // and the rest's share of the seconds gone.
            let released = LINE + (LIMIT - LINE) * (second + 1) / WINDOW_SECS;
            if served > released {
                return Err(Failure::new(
                    outcome,
                    format!(
                        "window {window}: {served} served by the end of its second {second}, {released} released"
                    ),
                ));
            }
        }
        // Greedy callers take every call the pace releases but the last,
        // whose turn is the window's end (the next window's start).
        if window < 2 && served + 2 < LIMIT {
            let by_second: Vec<u64> = (0..WINDOW_SECS)
                .map(|s| {
                    outcome
                        .provider
                        .seconds
                        .get(&(first + s))
                        .map_or(0, |s| s.served)
                })
                .collect();
            return Err(Failure::new(
                outcome,
                format!("window {window}: {served} of {LIMIT} used, by second: {by_second:?}"),
            ));
        }
    }
    Ok(outcome)
}

#[test]
fn a_paced_window_never_runs_ahead_of_its_pace_and_greedy_callers_use_it_all() {
    // Runs of 23 s of virtual time: 200 seeds (`make soak` runs 100 times
    // more).
    for_seeds_by_default(
        "ladder::a_paced_window_never_runs_ahead_of_its_pace_and_greedy_callers_use_it_all",
        200,
        paced,
    );
}
