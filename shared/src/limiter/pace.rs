//! The budget ladder's queue rung on a fixed window: past its line (a
//! share of the window's limit) the rest of the window is released
//! evenly until the window ends, so spend steps down to a steady pace
//! instead of running into the wall. A call ahead of that pace waits
//! until the pace reaches it (in the policy's queue) or its deadline
//! passes; before the line nothing changes.

use crate::time::{Instant, Span};

/// The count past which a window's rest is paced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pace {
    line: u64,
}

impl Pace {
    /// The pace of a window of `limit` past the share `at` of it (in
    /// (0, 1); validation refuses others): none where the line leaves no
    /// rest to pace.
    pub fn past(limit: u64, at: f64) -> Option<Self> {
        if !(at > 0.0 && at < 1.0) {
            return None;
        }
        // `at` is in (0, 1): the product is within `limit`.
        let line = (limit as f64 * at).floor() as u64;
        (line < limit).then_some(Self { line })
    }

    /// When a window from `start` to `end` of `limit` lets its count reach
    /// `need` (at most `limit`): at once up to the line, past it as the
    /// rest is released, `need` at the share of the window
    /// `(need - line) / (limit - line)`.
    pub fn reaches(&self, start: Instant, end: Instant, limit: u64, need: u64) -> Instant {
        if need <= self.line || limit <= self.line {
            return start;
        }
        let rest = u128::from(limit - self.line);
        let over = u128::from(need.min(limit) - self.line);
        let length = u128::from(end.since(start).as_nanos());
        let into = super::ceil_div(length * over, rest);
        start + Span::from_nanos(u64::try_from(into).unwrap_or(u64::MAX))
    }

    /// The line, in the window's units.
    pub fn line(&self) -> u64 {
        self.line
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const T0: Instant = Instant::from_nanos(1_800_000_000 * 1_000_000_000);

    #[test]
    fn past_the_line_the_rest_is_released_evenly_to_the_windows_end() {
        let pace = Pace::past(100, 0.8).expect("a pace");
        assert_eq!(pace.line(), 80);
        let end = T0 + Span::from_secs(100);
        assert_eq!(pace.reaches(T0, end, 100, 80), T0);
        assert_eq!(pace.reaches(T0, end, 100, 81), T0 + Span::from_secs(5));
        assert_eq!(pace.reaches(T0, end, 100, 90), T0 + Span::from_secs(50));
        assert_eq!(pace.reaches(T0, end, 100, 100), end);
        assert_eq!(pace.reaches(T0, end, 100, 500), end, "never past the end");
    }

    #[test]
    fn a_line_at_the_wall_or_outside_the_limit_paces_nothing() {
        for at in [0.0, 1.0, -0.5, 2.0, f64::NAN, f64::INFINITY] {
            assert_eq!(Pace::past(100, at), None, "{at}");
        }
        assert_eq!(Pace::past(1, 0.5).map(|p| p.line()), Some(0));
    }

    #[test]
    fn a_paced_window_admits_to_its_line_then_one_call_per_share_of_the_rest() {
        use crate::limiter::{Decision, FixedWindow, FixedWindowState};
        let len = Span::from_secs(100);
        let window = FixedWindow::new(10, len).paced_past(0.5);
        let mut state = FixedWindowState::default();
        for _ in 0..5 {
            assert!(window.try_acquire(&mut state, T0, 1).is_admit());
        }
        match window.try_acquire(&mut state, T0, 1) {
            Decision::Deny { retry_after, .. } => assert_eq!(retry_after, Span::from_secs(20)),
            other => panic!("the sixth goes at a fifth of the window: {other:?}"),
        }
        assert!(window
            .try_acquire(&mut state, T0 + Span::from_secs(20), 1)
            .is_admit());
        // A call of the whole rest waits for the window's end.
        match window.try_acquire(&mut state, T0 + Span::from_secs(20), 4) {
            Decision::Deny { retry_after, .. } => assert_eq!(retry_after, Span::from_secs(80)),
            other => panic!("{other:?}"),
        }
        // Past the wall: the next window's line first, at once.
        match window.try_acquire(&mut state, T0 + Span::from_secs(20), 5) {
            Decision::Deny { retry_after, .. } => assert_eq!(retry_after, Span::from_secs(80)),
            other => panic!("{other:?}"),
        }
        let next = T0 + len;
        assert!(window.try_acquire(&mut state, next, 5).is_admit());
    }

    proptest! {
        /// Through the limiter, whatever calls come when: what a window
        /// admitted by any instant is within its line and the rest
        /// released by then, and never more than its limit.
        #[test]
        fn a_paced_window_never_admits_ahead_of_its_pace(
            at in 0.05f64..0.95,
            limit in 1u64..200,
            calls in proptest::collection::vec((0u64..100_000, 1u64..8), 1..300),
        ) {
            use crate::limiter::{FixedWindow, FixedWindowState};
            let len = Span::from_secs(100);
            let window = FixedWindow::new(limit, len).paced_past(at);
            let pace = Pace::past(limit, at).expect("a pace");
            let mut calls = calls;
            calls.sort_unstable();
            let mut state = FixedWindowState::default();
            let mut admitted = 0u64;
            for (ms, cost) in calls {
                let now = T0 + Span::from_millis(ms);
                if window.try_acquire(&mut state, now, cost).is_admit() {
                    admitted += cost;
                }
                let released = u128::from(pace.line())
                    + u128::from(limit - pace.line()) * u128::from(now.since(T0).as_nanos())
                        / u128::from(len.as_nanos());
                prop_assert!(u128::from(admitted) <= released.max(u128::from(pace.line())));
                prop_assert!(admitted <= limit);
            }
        }


        /// The pace never lets a count out before its time, reaches the
        /// limit at the window's end, and lets more out the later it is.
        #[test]
        fn the_pace_grows_with_the_count_and_ends_with_the_window(
            limit in 1u64..10_000_000_000,
            at in 0.01f64..0.99,
            length in 1u64..40_000_000_000_000_000,
            need in 0u64..10_000_000_000,
        ) {
            let Some(pace) = Pace::past(limit, at) else { return Ok(()) };
            let end = T0 + Span::from_nanos(length);
            let need = need.min(limit);
            let at_need = pace.reaches(T0, end, limit, need);
            prop_assert!(at_need >= T0 && at_need <= end);
            prop_assert_eq!(pace.reaches(T0, end, limit, limit), end);
            if need < limit {
                prop_assert!(pace.reaches(T0, end, limit, need + 1) >= at_need);
            }
            // What the pace has released by `at_need` covers `need`.
            if need > pace.line() {
                let released = u128::from(pace.line())
                    + u128::from(limit - pace.line()) * u128::from(at_need.since(T0).as_nanos())
                        / u128::from(length);
                prop_assert!(released >= u128::from(need));
            }
        }
    }
}
