//! Listening to the provider over many seeds: an adaptive limit whose
//! provider's limit drops without a word.

use sluice_shared::time::Span;
use sluice_sim::callers::{Caller, RetryAfter, Shape};
use sluice_sim::property::{for_seeds, Failure};
use sluice_sim::provider::ProviderShape;
use sluice_sim::world::{run, Faults, Outcome, Scenario};

const ADAPTIVE: &str = r#"{"version": 1, "policies": [
    {"name": "api", "match": {"host": "api.bank.example"},
     "rate": {"requests": 100000, "period": "1s"},
     "on_limit": {"action": "queue", "max_wait": "30s", "max_queue": 1000},
     "limits": [{"name": "requests", "rate": {"requests": 30, "period": "1s"},
                 "provider": {"adaptive": true}}]}]}"#;

/// Answer times the seed picks from: 5 to 40 ms up to 100 to 200 ms.
const LATENCIES: [(u64, u64); 4] = [(5, 40), (20, 120), (60, 100), (100, 200)];

/// How far ahead of Envoy's the provider's calendar seconds may run: its
/// clock set by NTP, and the trip to it, within a region.
const TRIP_AHEAD: Span = Span::from_millis(10);

/// How far ahead the seed sets the provider's clock, up to `most_ahead`
/// (in whole milliseconds, spread over the seeds independently of the
/// answer times they pick).
fn clock_ahead(seed: u64, most_ahead: Span) -> Span {
    Span::from_millis(seed.wrapping_mul(7919) % (most_ahead.as_millis() + 1))
}

/// The provider allows 30 a second, then from 2 s on 12, counting the
/// calls it refuses and answering them (as late as any answer) 429 with
/// `Retry-After: 1`; 24 callers wait their turn in Sluice's queue. Its
/// calendar seconds run ahead of Envoy's by up to `most_ahead` (drawn
/// by the seed). Returns the run, and from the drop on: calls refused,
/// calls served, and the mean served a second from 20 s after it.
fn after_a_hidden_drop(seed: u64, most_ahead: Span) -> Result<(Outcome, u64, u64, f64), Failure> {
    let (low, high) = LATENCIES[(seed % 4) as usize];
    let scenario = Scenario {
        workers: 1 + (seed / 4 % 4) as usize,
        policies: ADAPTIVE.to_string(),
        provider: ProviderShape {
            change: Some((Span::from_secs(2), 12)),
            counts_refused: true,
            clock_ahead: clock_ahead(seed, most_ahead),
            ..ProviderShape::calls(30, (Span::from_millis(low), Span::from_millis(high)))
        },
        callers: vec![Caller {
            tenant: "all".into(),
            host: "api.bank.example".into(),
            connections: 24,
            shape: Shape::Greedy {
                backoff: Span::from_millis(10),
                heeds: RetryAfter::Ignored,
            },
            llm: None,
            envoy: 0,
            active: Vec::new(),
        }],
        duration: Span::from_secs(45),
        faults: Faults::default(),
        fleet: None,
        pool: None,
    };
    let outcome = run(&scenario, seed).map_err(|e| panic!("{e}"))?;
    let after: Vec<_> = outcome.provider.seconds.values().skip(3).collect();
    let served: u64 = after.iter().map(|s| s.served).sum();
    let refused: u64 = after.iter().map(|s| s.refused).sum();
    let settled: Vec<u64> = after.iter().skip(20).take(20).map(|s| s.served).collect();
    let mean = settled.iter().sum::<u64>() as f64 / settled.len().max(1) as f64;
    Ok((outcome, refused, served, mean))
}

/// Checks a run against the most refused (per thousand) and the least
/// part of the 12 a second served once settled.
fn holds(
    seed: u64,
    most_ahead: Span,
    (most_refused, least_used): (u64, f64),
) -> Result<Outcome, Failure> {
    let (low, high) = LATENCIES[(seed % 4) as usize];
    let (outcome, refused, served, mean) = after_a_hidden_drop(seed, most_ahead)?;
    if refused * 1000 > most_refused * (served + refused) || mean < least_used * 12.0 {
        let why = format!(
            "answers {low}-{high} ms, the provider's clock {} ms ahead: refused {refused} of {} \
             ({:.2} %), settled at {mean:.1}/s of 12",
            clock_ahead(seed, most_ahead).as_millis(),
            served + refused,
            100.0 * refused as f64 / (served + refused).max(1) as f64
        );
        return Err(Failure::new(outcome, why));
    }
    Ok(outcome)
}

/// Run at 1 000 seeds in `make test`, as every property: a run of 45
/// virtual seconds takes about 0.11 s of CPU (1 000 seeds: 114
/// CPU-seconds, 57 s on 2 cores, `SLUICE_SIM_SEEDS` unset).
///
/// What holds today, kept from getting worse: after the drop the
/// provider refuses at most 2 % of the calls, and from 20 s after it
/// Sluice serves at least 80 % of the 12 a second (over 1 000 seeds,
/// the provider's clock 0-10 ms ahead: at most 1.97 % refused, 92
/// seeds over 1 %, 140 before the narrowing of a known limit by a later
/// refusal was kept in shared data; at least 9.7 a second, 39 seeds
/// under 90 %). Before the clock-aligned
/// window count and the send time of refused calls (issue 50), 182 of
/// 200 seeds refused more than 1 %, up to 4.5 %, serving 9.8 a second.
#[test]
fn an_adaptive_limit_finds_a_hidden_drop_at_any_answer_time() {
    for_seeds(
        "listening::an_adaptive_limit_finds_a_hidden_drop_at_any_answer_time",
        |seed| holds(seed, TRIP_AHEAD, (20, 0.8)),
    );
}

/// The bound issue 50 asks for: at most 1 % refused and 90 % served.
/// Holds at 5-40 ms answers; at 20-200 ms 77 seeds in 750 refuse
/// 1.02-1.97 % (12 at 20-120 ms, 9 at 60-100, 56 at 100-200: calls
/// already in flight when the first refusal of the second overload comes
/// back are refused too, 3 or 4 of ~470, with one or two probes above
/// the known limit later), and 27 in 1 000 settle under 10.8 a second.
/// (92 and 39 before a probe refused after its pace had climbed past the
/// ceiling kept the known rate: seed 6 forgot it, climbed back to 13 a
/// second and drew another refusal.)
#[test]
#[ignore = "issue 50: at 20-200 ms answers 12 % of seeds refuse 1.02-1.97 %; run with --ignored"]
fn an_adaptive_limit_refuses_at_most_one_percent_at_any_answer_time() {
    for_seeds(
        "listening::an_adaptive_limit_refuses_at_most_one_percent_at_any_answer_time",
        |seed| holds(seed, TRIP_AHEAD, (10, 0.9)),
    );
}

/// A provider whose seconds begin anywhere in Envoy's (its window keyed
/// by when it started, or by a clock far off): the limit learned from
/// the count in each of Envoy's clock-aligned seconds is then that of a
/// window straddling two of the provider's. Of 200 seeds, 28 refuse
/// more than 2 % (up to 4.03 %) and 35 settle under 80 % of the 12 a
/// second (down to 5.8): a known gap (see docs/RELIABILITY.md). The
/// end-to-end test once met it: its provider counted seconds from its
/// own start, and a run held 7 a second for 48 s.
#[test]
#[ignore = "a known gap: with the provider's seconds at any phase of Envoy's, about a quarter of seeds refuse over 2 % or settle under 80 %; run with --ignored"]
fn an_adaptive_limit_finds_a_hidden_drop_whatever_the_phase_of_the_providers_seconds() {
    for_seeds(
        "listening::an_adaptive_limit_finds_a_hidden_drop_whatever_the_phase_of_the_providers_seconds",
        |seed| holds(seed, Span::from_millis(999), (20, 0.8)),
    );
}
