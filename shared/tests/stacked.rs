//! Several limits on one call, all or nothing, with 4 workers whose steps
//! interleave in any order (each step is one compare-and-swap on one
//! limit's state, as in the filter). With the clock held still, every
//! limit's use at the end is exactly the costs of the calls it admitted:
//! a call refused by any limit kept nothing from the others, and no limit
//! ever gave more than it holds.

use proptest::prelude::*;
use sluice_shared::limiter::{
    FixedWindow, RateLimiter, RateState, SlidingWindow, StackedOutcome, StackedTake, TokenBucket,
};
use sluice_shared::time::{Instant, Span};

const WORKERS: usize = 4;
const NOW: Instant = Instant::from_nanos(1_800_000_000 * 1_000_000_000);

/// A limit that does not refill while the test runs (the clock stands
/// still), so what it holds is a plain count.
fn limiter(kind: u8, size: u64) -> RateLimiter {
    let hour = Span::from_secs(3600);
    match kind % 3 {
        0 => RateLimiter::TokenBucket(TokenBucket::new(1, hour, size, None)),
        1 => RateLimiter::FixedWindow(FixedWindow::new(size, hour)),
        _ => RateLimiter::SlidingWindow(SlidingWindow::new(size, hour)),
    }
}

/// How much of `size` the state has used.
fn used(limiter: &RateLimiter, state: &RateState, size: u64) -> u64 {
    size - limiter.available(state, NOW).min(size)
}

/// Each limit's kind and size.
type Limits = Vec<(u8, u64)>;
/// Per worker, its calls; per call, its cost on each limit.
type Calls = Vec<Vec<Vec<u64>>>;
/// Which worker steps next.
type Schedule = Vec<usize>;

fn scenario() -> impl Strategy<Value = (Limits, Calls, Schedule)> {
    (1usize..=4).prop_flat_map(|limits| {
        (
            prop::collection::vec((0u8..3, 1u64..30), limits),
            prop::collection::vec(
                prop::collection::vec(prop::collection::vec(0u64..8, limits), 0..12),
                WORKERS,
            ),
            prop::collection::vec(0usize..WORKERS, 0..400),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("SLUICE_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(2_000)
    ))]

    #[test]
    fn a_refused_call_keeps_nothing_and_no_limit_gives_more_than_it_holds(
        (specs, calls, schedule) in scenario()
    ) {
        let limiters: Vec<RateLimiter> = specs.iter().map(|(k, s)| limiter(*k, *s)).collect();
        let mut states: Vec<RateState> = limiters.iter().map(RateLimiter::initial_state).collect();
        let mut queues: Vec<std::collections::VecDeque<Vec<u64>>> =
            calls.iter().map(|c| c.iter().cloned().collect()).collect();
        let mut current: Vec<Option<(Vec<u64>, StackedTake)>> = vec![None; WORKERS];
        let mut admitted = vec![0u64; limiters.len()];
        let mut outcomes = Vec::new();
        // The schedule picks who steps next; then everyone finishes.
        let finish = (0..WORKERS).cycle().take(WORKERS * 200);
        for worker in schedule.into_iter().chain(finish) {
            if current[worker].is_none() {
                if let Some(costs) = queues[worker].pop_front() {
                    current[worker] = Some((costs.clone(), StackedTake::new(costs, NOW)));
                }
            }
            let Some((costs, take)) = current[worker].as_mut() else { continue };
            if let Some(limit) = take.next_limit() {
                let step = take.apply(&limiters[limit], &mut states[limit]);
                take.advance(step);
                for (i, size) in specs.iter().map(|(_, s)| *s).enumerate() {
                    prop_assert!(
                        used(&limiters[i], &states[i], size) <= size,
                        "limit {i} gave more than its {size}"
                    );
                }
            }
            if let Some(outcome) = take.outcome() {
                if outcome == StackedOutcome::Admitted {
                    for (i, c) in costs.iter().enumerate() {
                        admitted[i] += limiters[i].taken(*c);
                    }
                }
                outcomes.push(outcome);
                current[worker] = None;
            }
        }
        prop_assert!(current.iter().all(Option::is_none), "every call ended");
        prop_assert!(queues.iter().all(|q| q.is_empty()));
        for (i, (_, size)) in specs.iter().enumerate() {
            prop_assert_eq!(
                used(&limiters[i], &states[i], *size),
                admitted[i],
                "limit {} holds exactly what its admitted calls took", i
            );
        }
        // A call that could never fit is refused, never admitted.
        for outcome in &outcomes {
            if let StackedOutcome::Refused { retry_after, .. } = outcome {
                prop_assert!(*retry_after > Span::ZERO);
            }
        }
    }
}

/// The second limit refuses: the first limit's count is back where it was,
/// and the refusal names the second limit with the longest wait of the
/// limits that would refuse.
#[test]
fn a_refusal_by_the_second_limit_gives_the_first_its_tokens_back() {
    let per_second = RateLimiter::TokenBucket(TokenBucket::new(10, Span::from_secs(1), 10, None));
    let per_minute = RateLimiter::TokenBucket(TokenBucket::new(2, Span::from_secs(60), 2, None));
    let per_hour = RateLimiter::FixedWindow(FixedWindow::new(1, Span::from_secs(3600)));
    let limiters = [per_second, per_minute, per_hour];
    let mut states: Vec<RateState> = limiters.iter().map(RateLimiter::initial_state).collect();
    let run = |states: &mut Vec<RateState>| {
        let mut take = StackedTake::new(vec![1, 1, 0], NOW);
        while let Some(limit) = take.next_limit() {
            let step = take.apply(&limiters[limit], &mut states[limit]);
            take.advance(step);
        }
        take.outcome()
    };
    assert_eq!(run(&mut states), Some(StackedOutcome::Admitted));
    assert_eq!(run(&mut states), Some(StackedOutcome::Admitted));
    let before = limiters[0].available(&states[0], NOW);
    match run(&mut states) {
        Some(StackedOutcome::Refused { limit, retry_after }) => {
            assert_eq!(limit, 1);
            assert_eq!(retry_after, Span::from_secs(30));
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert_eq!(limiters[0].available(&states[0], NOW), before);
}

/// Costs learnt after the call: a refund gives back what was not used, a
/// charge beyond the bucket becomes debt that holds the next calls back.
#[test]
fn refunds_and_debts_move_the_bucket_and_never_past_full() {
    let bucket = RateLimiter::TokenBucket(TokenBucket::new(100, Span::from_secs(60), 100, None));
    let mut state = bucket.initial_state();
    assert!(bucket.try_acquire(&mut state, NOW, 60).is_admit());
    bucket.refund(&mut state, NOW, NOW, 50);
    assert_eq!(bucket.available(&state, NOW), 90);
    bucket.refund(&mut state, NOW, NOW, 1_000);
    assert_eq!(bucket.available(&state, NOW), 100, "never past full");
    bucket.charge(&mut state, NOW, 150);
    assert_eq!(bucket.available(&state, NOW), 0);
    assert!(!bucket.try_acquire(&mut state, NOW, 1).is_admit());
    // 50 tokens of debt: 30 s until the bucket holds 0 again, 31 s until 1.
    assert!(!bucket
        .try_acquire(&mut state, NOW + Span::from_secs(30), 1)
        .is_admit());
    assert!(bucket
        .try_acquire(&mut state, NOW + Span::from_millis(30_600), 1)
        .is_admit());

    let window = RateLimiter::FixedWindow(FixedWindow::new(10, Span::from_secs(60)));
    let mut state = window.initial_state();
    assert!(window.try_acquire(&mut state, NOW, 8).is_admit());
    window.refund(&mut state, NOW, NOW, 5);
    assert_eq!(window.available(&state, NOW), 7);
    // Taken in a window that has ended: nothing to give back.
    window.refund(&mut state, NOW - Span::from_secs(60), NOW, 3);
    assert_eq!(window.available(&state, NOW), 7);
    window.charge(&mut state, NOW, 20);
    assert_eq!(window.available(&state, NOW), 0);
}

proptest! {
    /// Whatever came before, taking `cost` and giving it back at once leaves
    /// every limit as available as it was, and a refund never fills a
    /// limit past its size.
    #[test]
    fn a_take_given_back_at_once_changes_nothing(
        kind in 0u8..3,
        size in 1u64..1_000,
        history in prop::collection::vec((0u64..50, 0u64..120_000), 0..20),
        cost in 0u64..60,
        extra_refund in 0u64..2_000,
    ) {
        let limiter = {
            let minute = Span::from_secs(60);
            match kind {
                0 => RateLimiter::TokenBucket(TokenBucket::new(size, minute, size, None)),
                1 => RateLimiter::FixedWindow(FixedWindow::new(size, minute)),
                _ => RateLimiter::SlidingWindow(SlidingWindow::new(size, minute)),
            }
        };
        let mut state = limiter.initial_state();
        let mut at = NOW;
        for (c, gap_ms) in history {
            at += Span::from_millis(gap_ms);
            if !limiter.try_acquire(&mut state, at, c).is_admit() {
                limiter.charge(&mut state, at, c);
            }
        }
        let before = limiter.available(&state, at);
        let mut copy = state;
        if limiter.try_acquire(&mut copy, at, cost).is_admit() {
            limiter.refund(&mut copy, at, at, limiter.taken(cost));
            prop_assert_eq!(limiter.available(&copy, at), before);
        }
        limiter.refund(&mut copy, at, at, extra_refund);
        prop_assert!(limiter.available(&copy, at) <= size);
    }
}
