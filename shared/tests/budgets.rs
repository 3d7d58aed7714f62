//! A budget given back after a restart: a fresh limit state takes what the
//! admin's record says was spent, so the limit holds what it held before
//! (less its refill since), and no record, however broken, takes more than
//! the limit's size or dates from the future.

use proptest::prelude::*;
use sluice_shared::limiter::{FixedWindow, RateLimiter, SlidingWindow, TokenBucket};
use sluice_shared::time::{Instant, Span};
use sluice_wire::sync::HeldBudget;

const DAY: Span = Span::from_secs(86_400);
/// 2027-01-15T12:00:00Z: mid-day, so a daily window started 12 h ago.
const NOW: Instant =
    Instant::from_millis(1_800_000_000_000 - (1_800_000_000_000 % 86_400_000) + 43_200_000);

fn daily(kind: u8, size: u64) -> RateLimiter {
    match kind % 3 {
        0 => RateLimiter::TokenBucket(TokenBucket::new(size, DAY, size, None)),
        1 => RateLimiter::FixedWindow(FixedWindow::new(size, DAY)),
        _ => RateLimiter::SlidingWindow(SlidingWindow::new(size, DAY)),
    }
}

#[test]
fn a_daily_window_restored_the_same_day_holds_what_it_held() {
    let limit = daily(1, 1_000);
    let record = HeldBudget {
        available: 700,
        size: 1_000,
        at_ms: (NOW - Span::from_secs(60)).as_millis(),
        ..HeldBudget::default()
    };
    let mut state = limit.initial_state();
    limit.restore_spent(
        &mut state,
        record.spent(),
        Instant::from_millis(record.at_ms),
        NOW,
    );
    assert_eq!(limit.available(&state, NOW), 700);
}

#[test]
fn yesterdays_record_leaves_todays_window_full() {
    let limit = daily(1, 1_000);
    let yesterday = NOW - DAY;
    let mut state = limit.initial_state();
    limit.restore_spent(&mut state, 1_000, yesterday, NOW);
    assert_eq!(limit.available(&state, NOW), 1_000);
}

#[test]
fn a_token_bucket_gets_back_its_refill_since_the_record() {
    // 86 400 a day: one token a second; 600 spent 100 s ago: 500 short now.
    let limit = daily(0, 86_400);
    let mut state = limit.initial_state();
    limit.restore_spent(&mut state, 600, NOW - Span::from_secs(100), NOW);
    assert_eq!(limit.available(&state, NOW), 86_400 - 500);
}

#[test]
fn a_bigger_budget_keeps_what_was_spent_of_the_smaller() {
    let limit = daily(1, 2_000);
    let record = HeldBudget {
        available: 100,
        size: 1_000,
        at_ms: NOW.as_millis(),
        ..HeldBudget::default()
    };
    let mut state = limit.initial_state();
    limit.restore_spent(
        &mut state,
        record.spent(),
        Instant::from_millis(record.at_ms),
        NOW,
    );
    assert_eq!(limit.available(&state, NOW), 1_100);
}

proptest! {
    #[test]
    fn no_record_takes_more_than_the_limit_or_lasts_past_its_period(
        kind in 0u8..3,
        size in 1u64..1_000_000,
        spent in any::<u64>(),
        at_ms in any::<u64>(),
    ) {
        let limit = daily(kind, size);
        let mut state = limit.initial_state();
        let at = Instant::from_millis(at_ms);
        limit.restore_spent(&mut state, spent, at, NOW);
        let now_left = limit.available(&state, NOW);
        prop_assert!(now_left <= size);
        // Taken at `at` (or now, for a record from the future): what is
        // left never falls below what that spend leaves.
        prop_assert!(now_left >= size.saturating_sub(spent));
        // Two periods on, whatever the record said is over.
        let later = NOW + DAY + DAY;
        prop_assert_eq!(limit.available(&state, later), size);
    }
}
