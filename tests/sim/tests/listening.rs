//! Listening to the provider over many seeds: an adaptive limit whose
//! provider's limit drops without a word.

use sluice_shared::time::Span;
use sluice_sim::callers::{Caller, Shape};
use sluice_sim::property::{for_seeds, Failure};
use sluice_sim::provider::ProviderShape;
use sluice_sim::world::{run, Faults, Scenario};

const ADAPTIVE: &str = r#"{"version": 1, "policies": [
    {"name": "api", "match": {"host": "api.bank.example"},
     "rate": {"requests": 100000, "period": "1s"},
     "on_limit": {"action": "queue", "max_wait": "30s", "max_queue": 1000},
     "limits": [{"name": "requests", "rate": {"requests": 30, "period": "1s"},
                 "provider": {"adaptive": true}}]}]}"#;

/// Answer times the seed picks from: 5 to 40 ms up to 100 to 200 ms.
const LATENCIES: [(u64, u64); 4] = [(5, 40), (20, 120), (60, 100), (100, 200)];

/// The provider allows 30 a second, then from 2 s on 12, counting the
/// calls it refuses and answering them 429 with `Retry-After: 1`; 24
/// callers wait their turn in Sluice's queue. After the drop the provider
/// refuses at most 1 % of the calls, and from 20 s after it Sluice serves
/// at least 90 % of the 12 a second.
#[test]
#[ignore = "issue 50: fails today (refuses up to a few % at 60-200 ms answers); run with --ignored"]
fn an_adaptive_limit_finds_a_hidden_drop_at_any_answer_time() {
    for_seeds(
        "listening::an_adaptive_limit_finds_a_hidden_drop_at_any_answer_time",
        |seed| {
            let (low, high) = LATENCIES[(seed % 4) as usize];
            let scenario = Scenario {
                workers: 1 + (seed / 4 % 4) as usize,
                policies: ADAPTIVE.to_string(),
                provider: ProviderShape {
                    per_second: 30,
                    latency: (Span::from_millis(low), Span::from_millis(high)),
                    retry_after: true,
                    max_in_flight: None,
                    change: Some((Span::from_secs(2), 12)),
                    counts_refused: true,
                },
                callers: vec![Caller {
                    tenant: "all".into(),
                    host: "api.bank.example".into(),
                    connections: 24,
                    shape: Shape::Greedy {
                        backoff: Span::from_millis(10),
                    },
                }],
                duration: Span::from_secs(45),
                faults: Faults::default(),
            };
            let outcome = run(&scenario, seed).map_err(|e| panic!("{e}"))?;
            let after: Vec<_> = outcome.provider.seconds.values().skip(3).collect();
            let served: u64 = after.iter().map(|s| s.served).sum();
            let refused: u64 = after.iter().map(|s| s.refused).sum();
            let settled: Vec<u64> = after.iter().skip(20).take(20).map(|s| s.served).collect();
            let mean = settled.iter().sum::<u64>() as f64 / settled.len().max(1) as f64;
            if refused * 100 > served + refused || mean < 0.9 * 12.0 {
                let why = format!(
                    "answers {low}-{high} ms: refused {refused} of {} ({:.2} %), settled at {mean:.1}/s of 12",
                    served + refused,
                    100.0 * refused as f64 / (served + refused).max(1) as f64
                );
                return Err(Failure::new(outcome, why));
            }
            Ok(outcome)
        },
    );
}
