//! Window counters, aligned to multiples of the period since the epoch so
//! every worker and every Envoy agrees on window edges.
//!
//! A window may count more than its limit: a cost learnt after its calls
//! went (`charge`). That debt is carried into the windows that follow,
//! each paying off a limit's worth, so a caller cannot shed it at a
//! window's edge.
//!
//! A state's window may lie ahead of `now`: reservations (queue mode) fill
//! windows in order and move the state forward. A caller asking for an
//! immediate admission while a later window is being filled is refused, so
//! nobody jumps the queue. A clock that goes back lands in the same case and
//! is refused too: going back never hands out fresh counts.

use std::sync::Arc;

use super::edges::{align, windows_between, Edges};
use super::pace::Pace;
use super::{ceil_div, Decision, DecodeError, Reservation};
use crate::calendar::Calendar;
use crate::time::{Instant, Span};

fn read_u64(bytes: &[u8], at: usize) -> u64 {
    bytes
        .get(at..at + 8)
        .and_then(|b| b.try_into().ok())
        .map_or(0, u64::from_le_bytes)
}

fn check_len(bytes: &[u8], expected: usize) -> Result<(), DecodeError> {
    if bytes.len() == expected {
        Ok(())
    } else {
        Err(DecodeError::Length {
            expected,
            found: bytes.len(),
        })
    }
}

/// At most `limit` per aligned window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FixedWindow {
    limit: u64,
    edges: Edges,
    /// The queue rung: past its line the rest of a window is paced.
    pace: Option<Pace>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FixedWindowState {
    pub window_start: Instant,
    pub count: u64,
}

impl FixedWindowState {
    pub const ENCODED_LEN: usize = 16;

    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        let mut out = [0u8; Self::ENCODED_LEN];
        out[..8].copy_from_slice(&self.window_start.as_nanos().to_le_bytes());
        out[8..].copy_from_slice(&self.count.to_le_bytes());
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        check_len(bytes, Self::ENCODED_LEN)?;
        Ok(Self {
            window_start: Instant::from_nanos(read_u64(bytes, 0)),
            count: read_u64(bytes, 8),
        })
    }
}

impl FixedWindow {
    pub fn new(limit: u64, period: Span) -> Self {
        Self {
            limit: limit.max(1),
            edges: Edges::Every(period.max(Span::from_nanos(1))),
            pace: None,
        }
    }

    /// At most `limit` per window of `calendar`.
    pub fn calendar(limit: u64, calendar: Calendar) -> Self {
        Self {
            limit: limit.max(1),
            edges: Edges::Calendar(Arc::new(calendar)),
            pace: None,
        }
    }

    /// Paces the rest of each window past the share `at` of it (see
    /// [`Pace`]); a share outside (0, 1) paces nothing.
    pub fn paced_past(mut self, at: f64) -> Self {
        self.pace = Pace::past(self.limit, at);
        self
    }

    /// Whether it paces the rest of its windows.
    pub fn is_paced(&self) -> bool {
        self.pace.is_some()
    }

    /// When the window starting at `start` lets its count reach `need`:
    /// its start, or later past the queue rung's line.
    fn paced_at(&self, start: Instant, need: u64) -> Instant {
        match &self.pace {
            Some(pace) => pace.reaches(start, self.edges.after(start, 1), self.limit, need),
            None => start,
        }
    }

    /// The calendar its windows follow, if any.
    pub fn calendar_edges(&self) -> Option<&Calendar> {
        match &self.edges {
            Edges::Every(_) => None,
            Edges::Calendar(c) => Some(c),
        }
    }

    /// The window `now` belongs to, with its count: when the state's
    /// window is over, what it counted beyond the limit less a limit's
    /// worth for each window since.
    fn current(&self, state: &FixedWindowState, now: Instant) -> FixedWindowState {
        let start = self.edges.align(now);
        if state.window_start >= start {
            return *state;
        }
        let windows = self.edges.between(state.window_start, start);
        FixedWindowState {
            window_start: start,
            count: state
                .count
                .saturating_sub(self.limit.saturating_mul(windows)),
        }
    }

    /// How many windows after `cur`'s the first with room for `cost` is
    /// (0: `cur` itself): each window pays a limit's worth of debt.
    fn windows_to_room(&self, cur: &FixedWindowState, cost: u64) -> u64 {
        let need = u128::from(cur.count) + u128::from(cost);
        let limit = u128::from(self.limit);
        if need <= limit {
            return 0;
        }
        u64::try_from(ceil_div(need - limit, limit)).unwrap_or(u64::MAX)
    }

    /// The start of the window `windows` after `cur`'s.
    fn window_after(&self, cur: &FixedWindowState, windows: u64) -> Instant {
        self.edges.after(cur.window_start, windows)
    }

    pub fn try_acquire(&self, state: &mut FixedWindowState, now: Instant, cost: u64) -> Decision {
        let cur = self.current(state, now);
        let window_end = self.edges.after(cur.window_start, 1);
        let ahead = cur.window_start > now;
        let need = cur.count.saturating_add(cost);
        let fits = need <= self.limit;
        let paced_at = if fits {
            self.paced_at(cur.window_start, need)
        } else {
            // The first window with room, where its count may be paced.
            let windows = self.windows_to_room(&cur, cost).max(1);
            let carried = cur
                .count
                .saturating_sub(self.limit.saturating_mul(windows))
                .saturating_add(cost);
            self.paced_at(self.window_after(&cur, windows), carried)
        };
        if ahead || !fits || paced_at > now {
            let retry_at = paced_at;
            return Decision::Deny {
                retry_after: (retry_at - now).max(Span::from_nanos(1)),
                reset_after: window_end - now,
            };
        }
        *state = FixedWindowState {
            window_start: cur.window_start,
            count: cur.count + cost,
        };
        Decision::Admit {
            remaining: self.limit - state.count,
            reset_after: window_end - now,
        }
    }

    /// Gives back `tokens` a call took at `taken_at`, if the window that
    /// counted them is still the state's; a window that ended took its
    /// count with it.
    pub fn refund(&self, state: &mut FixedWindowState, taken_at: Instant, tokens: u64) {
        if self.edges.align(taken_at) == state.window_start {
            state.count = state.count.saturating_sub(tokens);
        }
    }

    /// Counts `tokens` in the window of `now` whatever it holds (a cost
    /// learnt after the call went): past the limit the window refuses until
    /// it ends.
    pub fn charge(&self, state: &mut FixedWindowState, now: Instant, tokens: u64) {
        let cur = self.current(state, now);
        *state = FixedWindowState {
            count: cur.count.saturating_add(tokens),
            ..cur
        };
    }

    /// The earliest window with room takes the request; it goes at that
    /// window's start (or now, if that is the current window).
    pub fn reserve(
        &self,
        state: &mut FixedWindowState,
        now: Instant,
        cost: u64,
        max_wait: Span,
    ) -> Reservation {
        let cur = self.current(state, now);
        let windows = self.windows_to_room(&cur, cost);
        let next = FixedWindowState {
            window_start: self.window_after(&cur, windows),
            count: cur
                .count
                .saturating_sub(self.limit.saturating_mul(windows))
                .saturating_add(cost)
                .min(self.limit.max(cost)),
        };
        let instant = self.paced_at(next.window_start, next.count).max(now);
        let wait = instant - now;
        if wait > max_wait {
            return Reservation::Deny {
                retry_after: wait - max_wait,
            };
        }
        *state = next;
        Reservation::At { instant }
    }

    pub fn available(&self, state: &FixedWindowState, now: Instant) -> u64 {
        let cur = self.current(state, now);
        if cur.window_start > now {
            0
        } else {
            self.limit.saturating_sub(cur.count)
        }
    }

    /// How long until the window counting calls now ends, or the last
    /// window its debt reaches (0: none counted).
    pub fn until_reset(&self, state: &FixedWindowState, now: Instant) -> Span {
        let cur = self.current(state, now);
        if cur.count == 0 {
            return Span::ZERO;
        }
        let windows = ceil_div(u128::from(cur.count), u128::from(self.limit));
        let windows = u64::try_from(windows).unwrap_or(u64::MAX);
        self.window_after(&cur, windows).since(now)
    }

    pub fn is_idle(&self, state: &FixedWindowState, now: Instant) -> bool {
        self.current(state, now).count == 0
    }
}

/// The current window's count plus the previous window's, weighted by how
/// much of the previous window still overlaps the last `period`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlidingWindow {
    limit: u64,
    period: Span,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlidingWindowState {
    pub window_start: Instant,
    pub current: u64,
    pub previous: u64,
}

impl SlidingWindowState {
    pub const ENCODED_LEN: usize = 24;

    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        let mut out = [0u8; Self::ENCODED_LEN];
        out[..8].copy_from_slice(&self.window_start.as_nanos().to_le_bytes());
        out[8..16].copy_from_slice(&self.current.to_le_bytes());
        out[16..].copy_from_slice(&self.previous.to_le_bytes());
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        check_len(bytes, Self::ENCODED_LEN)?;
        Ok(Self {
            window_start: Instant::from_nanos(read_u64(bytes, 0)),
            current: read_u64(bytes, 8),
            previous: read_u64(bytes, 16),
        })
    }
}

impl SlidingWindow {
    pub fn new(limit: u64, period: Span) -> Self {
        Self {
            limit: limit.max(1),
            period: period.max(Span::from_nanos(1)),
        }
    }

    fn current(&self, state: &SlidingWindowState, now: Instant) -> SlidingWindowState {
        let start = align(now, self.period);
        if state.window_start >= start {
            return *state;
        }
        self.roll(
            state,
            windows_between(state.window_start, start, self.period),
        )
    }

    /// `state` `windows` windows on: a window weighs at most a limit's
    /// worth as the previous one; what it counted beyond is debt carried
    /// into the current, less a limit's worth for each window between.
    fn roll(&self, state: &SlidingWindowState, windows: u64) -> SlidingWindowState {
        if windows == 0 {
            return *state;
        }
        let paid = |n: u64| self.limit.saturating_mul(n);
        SlidingWindowState {
            window_start: state.window_start + self.period.saturating_mul(windows),
            current: state.current.saturating_sub(paid(windows)),
            previous: state
                .current
                .saturating_sub(paid(windows - 1))
                .min(self.limit),
        }
    }

    /// The first window after `cur` in which `cost` could fit once the
    /// debt carried there is paid (at least 1).
    fn first_window_with_room(&self, cur: &SlidingWindowState, cost: u64) -> u64 {
        let need = u128::from(cur.current) + u128::from(cost);
        let limit = u128::from(self.limit);
        let windows = ceil_div(need.saturating_sub(limit), limit).max(1);
        u64::try_from(windows).unwrap_or(u64::MAX)
    }

    /// The smallest offset `e` into the window at which `cost` more fits:
    /// `previous·(P − e) + (current + cost)·P ≤ limit·P`. None if it fits
    /// nowhere in this window.
    fn earliest_offset(&self, previous: u64, current: u64, cost: u64) -> Option<Span> {
        let period = u128::from(self.period.as_nanos());
        let used = u128::from(current).saturating_add(u128::from(cost));
        let limit = u128::from(self.limit);
        if used > limit {
            return None;
        }
        let previous = u128::from(previous);
        if previous == 0 {
            return Some(Span::ZERO);
        }
        // previous·(P − e) ≤ (limit − used)·P  ⇔  e ≥ P − (limit − used)·P / previous
        let slack = (limit - used) * period / previous;
        let e = period.saturating_sub(slack);
        // At the last nanosecond the previous window's weight is 1/P of it;
        // past that the next window starts.
        if e < period {
            u64::try_from(e).ok().map(Span::from_nanos)
        } else {
            None
        }
    }

    pub fn try_acquire(&self, state: &mut SlidingWindowState, now: Instant, cost: u64) -> Decision {
        let cur = self.current(state, now);
        let window_end = cur.window_start + self.period;
        let reset_after = window_end - now;
        if cur.window_start > now {
            return Decision::Deny {
                retry_after: (cur.window_start - now).max(Span::from_nanos(1)),
                reset_after,
            };
        }
        let offset = now - cur.window_start;
        match self.earliest_offset(cur.previous, cur.current, cost) {
            Some(e) if e <= offset => {
                *state = SlidingWindowState {
                    current: cur.current + cost,
                    ..cur
                };
                Decision::Admit {
                    remaining: self.available(state, now),
                    reset_after,
                }
            }
            Some(e) => Decision::Deny {
                retry_after: (e - offset).max(Span::from_nanos(1)),
                reset_after,
            },
            None => {
                // Fits in the first window the debt leaves room in, at
                // that offset, or else at the start of the one after.
                let first = self.first_window_with_room(&cur, cost);
                let later = self.roll(&cur, first);
                let retry_at = match self.earliest_offset(later.previous, later.current, cost) {
                    Some(e) => later.window_start + e,
                    None => later.window_start + self.period,
                };
                Decision::Deny {
                    retry_after: (retry_at - now).max(Span::from_nanos(1)),
                    reset_after,
                }
            }
        }
    }

    /// Gives back `tokens` a call took at `taken_at`, from the window that
    /// counted them while it still weighs: the current or the previous one.
    pub fn refund(&self, state: &mut SlidingWindowState, taken_at: Instant, tokens: u64) {
        let taken_in = align(taken_at, self.period);
        if taken_in == state.window_start {
            state.current = state.current.saturating_sub(tokens);
        } else if taken_in + self.period == state.window_start {
            state.previous = state.previous.saturating_sub(tokens);
        }
    }

    /// Counts `tokens` in the window of `now` whatever it holds (a cost
    /// learnt after the call went).
    pub fn charge(&self, state: &mut SlidingWindowState, now: Instant, tokens: u64) {
        let cur = self.current(state, now);
        *state = SlidingWindowState {
            current: cur.current.saturating_add(tokens),
            ..cur
        };
    }

    pub fn reserve(
        &self,
        state: &mut SlidingWindowState,
        now: Instant,
        cost: u64,
        max_wait: Span,
    ) -> Reservation {
        let cur = self.current(state, now);
        let mut window = cur;
        let mut offset = now - window.window_start;
        // The request fits in this window, or else in the first the debt
        // leaves room in, or the next, or at the latest at the start of the
        // one after (where the weighted count is only this request).
        for attempt in 0..4 {
            if attempt == 1 {
                window = self.roll(&cur, self.first_window_with_room(&cur, cost));
                offset = Span::ZERO;
            } else if attempt > 1 {
                window = self.roll(&window, 1);
            }
            if let Some(e) = self.earliest_offset(window.previous, window.current, cost) {
                let instant = (window.window_start + e.max(offset)).max(now);
                let wait = instant - now;
                if wait > max_wait {
                    return Reservation::Deny {
                        retry_after: wait - max_wait,
                    };
                }
                *state = SlidingWindowState {
                    current: window.current + cost,
                    ..window
                };
                return Reservation::At { instant };
            }
        }
        // Only a cost above the limit gets here; validation prevents it.
        Reservation::Deny {
            retry_after: max_wait + self.period,
        }
    }

    /// Requests that would fit now, by the weighted estimate.
    pub fn available(&self, state: &SlidingWindowState, now: Instant) -> u64 {
        let cur = self.current(state, now);
        if cur.window_start > now {
            return 0;
        }
        let period = u128::from(self.period.as_nanos());
        let remaining_share =
            period.saturating_sub(u128::from((now - cur.window_start).as_nanos()));
        let weighted_previous = ceil_div(u128::from(cur.previous) * remaining_share, period);
        let used = weighted_previous.saturating_add(u128::from(cur.current));
        u64::try_from(u128::from(self.limit).saturating_sub(used)).unwrap_or(0)
    }

    /// How long until nothing counted now weighs any more: the end of the
    /// window after the current one when the current counts calls, the
    /// current's end when only the previous does.
    pub fn until_reset(&self, state: &SlidingWindowState, now: Instant) -> Span {
        let cur = self.current(state, now);
        let end = if cur.current > 0 {
            // The windows its debt reaches, and the one it then weighs on.
            let windows = ceil_div(u128::from(cur.current), u128::from(self.limit));
            let windows = u64::try_from(windows).unwrap_or(u64::MAX);
            cur.window_start + self.period.saturating_mul(windows.saturating_add(1))
        } else if cur.previous > 0 {
            cur.window_start + self.period
        } else {
            return Span::ZERO;
        };
        end.since(now)
    }

    pub fn is_idle(&self, state: &SlidingWindowState, now: Instant) -> bool {
        let cur = self.current(state, now);
        cur.current == 0 && cur.previous == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: Span = Span::from_secs(1);
    const T0: Instant = Instant::from_nanos(1_800_000_000 * 1_000_000_000);

    fn ns(n: u64) -> Span {
        Span::from_nanos(n)
    }

    fn secs(n: u64) -> Span {
        Span::from_secs(n)
    }

    fn admitted(d: Decision) -> bool {
        matches!(d, Decision::Admit { .. })
    }

    #[test]
    fn fixed_window_counts_per_aligned_window() {
        let fw = FixedWindow::new(10, SEC);
        let mut s = FixedWindowState::default();
        let n = (0..20)
            .filter(|_| admitted(fw.try_acquire(&mut s, T0 + ns(500), 1)))
            .count();
        assert_eq!(n, 10);
        match fw.try_acquire(&mut s, T0 + ns(500), 1) {
            Decision::Deny { retry_after, .. } => assert_eq!(retry_after, SEC - ns(500)),
            other => panic!("{other:?}"),
        }
        assert!(admitted(fw.try_acquire(&mut s, T0 + SEC, 1)));
    }

    #[test]
    fn fixed_window_reservations_fill_windows_in_order() {
        let fw = FixedWindow::new(2, SEC);
        let mut s = FixedWindowState::default();
        let mut at = Vec::new();
        while let Reservation::At { instant } = fw.reserve(&mut s, T0 + ns(10), 1, secs(3)) {
            at.push(instant - T0);
        }
        assert_eq!(
            at,
            vec![ns(10), ns(10), SEC, SEC, secs(2), secs(2), secs(3), secs(3)]
        );
        // Somebody asking to go right now must not jump that queue.
        assert!(!admitted(fw.try_acquire(&mut s, T0 + SEC + ns(1), 1)));
    }

    #[test]
    fn sliding_window_weighs_the_previous_window() {
        let sw = SlidingWindow::new(10, SEC);
        let mut s = SlidingWindowState::default();
        for _ in 0..10 {
            assert!(admitted(sw.try_acquire(&mut s, T0 + SEC.div(2), 1)));
        }
        // A quarter into the next window, 75 % of the previous 10 still count.
        let t = T0 + SEC + SEC.div(4);
        let n = (0..10)
            .filter(|_| admitted(sw.try_acquire(&mut s, t, 1)))
            .count();
        assert_eq!(n, 2);
        match sw.try_acquire(&mut s, t, 1) {
            // 7.5 + 2 + 1 > 10 until previous·(P − e)/P ≤ 7, i.e. e ≥ 0.3 s.
            Decision::Deny { retry_after, .. } => {
                assert_eq!(retry_after, SEC.saturating_mul(3).div(10) - SEC.div(4))
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn sliding_window_reservations_are_ordered() {
        let sw = SlidingWindow::new(5, SEC);
        let mut s = SlidingWindowState::default();
        let mut last = Instant::EPOCH;
        let mut n = 0;
        while let Reservation::At { instant } = sw.reserve(&mut s, T0, 1, secs(5)) {
            assert!(instant >= last);
            last = instant;
            n += 1;
        }
        // Six windows touched (0 s..5 s), at most five each; the weighted
        // previous window costs some of the first ones.
        assert!((20..=30).contains(&n), "reserved {n}");
    }

    #[test]
    fn clock_going_back_gives_no_fresh_count() {
        let fw = FixedWindow::new(3, SEC);
        let mut f = FixedWindowState::default();
        let sw = SlidingWindow::new(3, SEC);
        let mut s = SlidingWindowState::default();
        for _ in 0..3 {
            assert!(admitted(fw.try_acquire(&mut f, T0 + secs(5), 1)));
            assert!(admitted(sw.try_acquire(&mut s, T0 + secs(5), 1)));
        }
        assert!(!admitted(fw.try_acquire(&mut f, T0, 1)));
        assert!(!admitted(sw.try_acquire(&mut s, T0, 1)));
    }

    #[test]
    fn states_round_trip() {
        let f = FixedWindowState {
            window_start: Instant::from_nanos(9),
            count: u64::MAX,
        };
        assert_eq!(FixedWindowState::decode(&f.encode()).unwrap(), f);
        let s = SlidingWindowState {
            window_start: Instant::from_nanos(1),
            current: 2,
            previous: 3,
        };
        assert_eq!(SlidingWindowState::decode(&s.encode()).unwrap(), s);
        assert!(SlidingWindowState::decode(&f.encode()).is_err());
    }
}
