//! Budgets of a calendar `period`, as a policy writes them, through the
//! limiter the filter runs: each renews at the exact instant the zone's
//! wall clock turns to a new day or month, across daylight-saving changes
//! in both directions and months of 28 to 31 days; a debt and a queued
//! call go on into the calendar windows that follow.

use proptest::prelude::*;
use sluice_shared::limiter::{Decision, RateLimiter, Reservation};
use sluice_shared::policy::rate::RateSpec;
use sluice_shared::time::{Instant, Span};

fn limit(requests: u64, period: &str, zone: &str) -> RateLimiter {
    let spec: RateSpec = serde_json::from_str(&format!(
        r#"{{"algorithm": "fixed_window", "requests": {requests},
            "period": "{period}", "time_zone": "{zone}"}}"#
    ))
    .unwrap_or_else(|e| panic!("{period} {zone}: {e}"));
    RateLimiter::from_spec(&spec)
}

/// An instant from RFC 3339 text with its offset.
fn at(text: &str) -> Instant {
    let ts: jiff::Timestamp = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
    Instant::from_nanos(u64::try_from(ts.as_nanosecond()).unwrap_or(0))
}

/// Spends the whole budget at `spent_at`, then checks the refusal says it
/// renews at `renews` and that it does: refused 1 ms before, admitted at.
fn renews_exactly(limit: &RateLimiter, size: u64, spent_at: &str, renews: &str) {
    let (now, renews) = (at(spent_at), at(renews));
    let mut state = limit.initial_state();
    assert!(
        limit.try_acquire(&mut state, now, size).is_admit(),
        "{spent_at}"
    );
    match limit.try_acquire(&mut state, now, 1) {
        Decision::Deny {
            retry_after,
            reset_after,
        } => {
            assert_eq!(
                now + retry_after,
                renews,
                "retry after, spent at {spent_at}"
            );
            assert_eq!(
                now + reset_after,
                renews,
                "reset after, spent at {spent_at}"
            );
        }
        other => panic!("{spent_at}: admitted past the budget: {other:?}"),
    }
    let just_before = renews - Span::from_millis(1);
    assert!(
        !limit.try_acquire(&mut state, just_before, 1).is_admit(),
        "{spent_at}: renewed before {renews:?}"
    );
    assert!(
        limit.try_acquire(&mut state, renews, size).is_admit(),
        "{spent_at}: not renewed at {renews:?}"
    );
}

#[test]
fn a_day_renews_at_local_midnight_on_23_and_25_hour_days() {
    let berlin = limit(3, "calendar_day", "Europe/Berlin");
    // Spring forward (2026-03-29, 02:00 -> 03:00): the day has 23 hours.
    renews_exactly(
        &berlin,
        3,
        "2026-03-29T00:30:00+01:00",
        "2026-03-30T00:00:00+02:00",
    );
    renews_exactly(
        &berlin,
        3,
        "2026-03-29T03:00:00+02:00",
        "2026-03-30T00:00:00+02:00",
    );
    // Fall back (2026-10-25, 03:00 -> 02:00): 25 hours; spent in the
    // repeated hour, the first time and the second.
    renews_exactly(
        &berlin,
        3,
        "2026-10-25T02:30:00+02:00",
        "2026-10-26T00:00:00+01:00",
    );
    renews_exactly(
        &berlin,
        3,
        "2026-10-25T02:30:00+01:00",
        "2026-10-26T00:00:00+01:00",
    );
    let new_york = limit(5, "calendar_day", "America/New_York");
    renews_exactly(
        &new_york,
        5,
        "2026-03-08T23:59:00-04:00",
        "2026-03-09T00:00:00-04:00",
    );
    renews_exactly(
        &new_york,
        5,
        "2026-11-01T01:30:00-05:00",
        "2026-11-02T00:00:00-05:00",
    );
}

#[test]
fn a_day_whose_midnight_does_not_exist_starts_when_the_clock_resumes() {
    // Havana springs forward at midnight (2026-03-08, 00:00 -> 01:00): the
    // day begins at 01:00.
    renews_exactly(
        &limit(1, "calendar_day", "America/Havana"),
        1,
        "2026-03-07T12:00:00-05:00",
        "2026-03-08T01:00:00-04:00",
    );
}

#[test]
fn a_month_renews_on_the_first_whatever_its_length() {
    let tokyo = limit(10, "calendar_month", "Asia/Tokyo");
    for (spent, first) in [
        // 31, 30, 28 and 29 days.
        ("2027-01-31T23:59:59+09:00", "2027-02-01T00:00:00+09:00"),
        ("2027-04-15T00:00:00+09:00", "2027-05-01T00:00:00+09:00"),
        ("2027-02-28T12:00:00+09:00", "2027-03-01T00:00:00+09:00"),
        ("2028-02-29T12:00:00+09:00", "2028-03-01T00:00:00+09:00"),
        ("2027-12-31T23:00:00+09:00", "2028-01-01T00:00:00+09:00"),
    ] {
        renews_exactly(&tokyo, 10, spent, first);
    }
    // A month across a clock change: Berlin's October 2026 has 31 days
    // and 745 hours.
    let berlin = limit(10, "calendar_month", "Europe/Berlin");
    renews_exactly(
        &berlin,
        10,
        "2026-10-01T00:00:00+02:00",
        "2026-11-01T00:00:00+01:00",
    );
}

#[test]
fn weeks_quarters_and_years_renew_on_their_first_local_day() {
    renews_exactly(
        &limit(2, "calendar_week", "Europe/London"),
        2,
        "2026-03-29T12:00:00+01:00",
        "2026-03-30T00:00:00+01:00",
    );
    renews_exactly(
        &limit(2, "calendar_quarter", "UTC"),
        2,
        "2026-02-14T09:00:00Z",
        "2026-04-01T00:00:00Z",
    );
    renews_exactly(
        &limit(2, "calendar_year", "Australia/Sydney"),
        2,
        "2026-06-30T10:00:00+10:00",
        "2027-01-01T00:00:00+11:00",
    );
}

#[test]
fn a_debt_learnt_after_the_calls_is_paid_by_the_months_that_follow() {
    // 100 a month; an answer's cost of 250 learnt on 30 January: February
    // (28 days) pays 100 of what is owed, March the rest.
    let monthly = limit(100, "calendar_month", "UTC");
    let mut state = monthly.initial_state();
    monthly.charge(&mut state, at("2027-01-30T10:00:00Z"), 250);
    for refused in ["2027-01-31T00:00:00Z", "2027-02-27T23:00:00Z"] {
        match monthly.try_acquire(&mut state, at(refused), 1) {
            Decision::Deny { retry_after, .. } => {
                assert_eq!(at(refused) + retry_after, at("2027-03-01T00:00:00Z"))
            }
            other => panic!("{refused}: {other:?}"),
        }
    }
    // March holds what January owed beyond February: 50 left.
    let march = at("2027-03-01T00:00:00Z");
    assert_eq!(monthly.available(&state, march), 50);
    assert!(!monthly.try_acquire(&mut state, march, 51).is_admit());
    assert!(monthly.try_acquire(&mut state, march, 50).is_admit());
}

#[test]
fn a_queued_call_goes_at_local_midnight() {
    let berlin = limit(1, "calendar_day", "Europe/Berlin");
    let mut state = berlin.initial_state();
    let now = at("2026-10-25T22:00:00+01:00");
    assert!(berlin.try_acquire(&mut state, now, 1).is_admit());
    assert_eq!(
        berlin.reserve(&mut state, now, 1, Span::from_secs(7_200)),
        Reservation::At {
            instant: at("2026-10-26T00:00:00+01:00")
        }
    );
    // The next day is taken by the queued call: one more waits a day more.
    assert!(matches!(
        berlin.reserve(&mut state, now, 1, Span::from_secs(7_200)),
        Reservation::Deny { .. }
    ));
}

#[test]
fn what_a_day_spent_counts_in_its_month_after_an_edit_to_calendar_month() {
    let daily = limit(5, "calendar_day", "UTC");
    let mut state = daily.initial_state();
    assert!(daily
        .try_acquire(&mut state, at("2027-05-20T10:00:00Z"), 5)
        .is_admit());
    let monthly = limit(5, "calendar_month", "UTC");
    for refused in ["2027-05-20T11:00:00Z", "2027-05-31T23:59:59Z"] {
        assert!(!monthly.try_acquire(&mut state, at(refused), 1).is_admit());
    }
    assert!(monthly
        .try_acquire(&mut state, at("2027-06-01T00:00:00Z"), 5)
        .is_admit());
}

proptest! {
    /// Any instant from 1970 to 2500, any zone of a few with odd rules:
    /// a spent budget says it renews at the window's end, which is later
    /// than now and no more than the unit's longest window away, and it
    /// does renew there; the window before it ends where it starts.
    #[test]
    fn any_instant_renews_at_its_windows_end(
        secs in 0u64..16_725_225_600,
        zone in prop::sample::select(vec![
            "UTC", "Europe/Berlin", "America/New_York", "Australia/Lord_Howe",
            "Asia/Kathmandu", "Pacific/Apia", "America/Havana", "Africa/Casablanca",
        ]),
        unit in prop::sample::select(vec![
            ("calendar_day", 25u64), ("calendar_week", 7 * 24 + 1),
            ("calendar_month", 31 * 24 + 1), ("calendar_year", 366 * 24 + 1),
        ]),
    ) {
        let limiter = limit(1, unit.0, zone);
        let now = Instant::from_nanos(secs * 1_000_000_000);
        let mut state = limiter.initial_state();
        prop_assert!(limiter.try_acquire(&mut state, now, 1).is_admit());
        let Decision::Deny { retry_after, .. } = limiter.try_acquire(&mut state, now, 1) else {
            return Err(TestCaseError::fail("admitted past the budget"));
        };
        prop_assert!(retry_after > Span::ZERO);
        prop_assert!(retry_after <= Span::from_secs(unit.1 * 3_600));
        let renews = now + retry_after;
        prop_assert!(!limiter.try_acquire(&mut state, renews - Span::from_nanos(1), 1).is_admit());
        prop_assert!(limiter.try_acquire(&mut state, renews, 1).is_admit());
    }
}
