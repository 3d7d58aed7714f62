//! Pure limiter algorithms. No clock and no I/O: `now` comes in as an
//! [`Instant`], state comes in and goes out as small byte strings that the
//! filter keeps in Envoy shared data and swaps by compare-and-swap.
//!
//! Every operation tolerates any input: time going backwards, zero or huge
//! costs, and bytes that are not a valid state. Arithmetic is checked or
//! saturating, so nothing overflows or panics.

pub mod concurrency;
mod edges;
pub mod pace;
pub mod stack;
pub mod token_bucket;
pub mod window;

pub use concurrency::{ConcurrencyLimit, Lease, LeaseTable};
pub use stack::{StackedOutcome, StackedTake, Standing, StepResult};
pub use token_bucket::{TokenBucket, TokenBucketState, Warmup};
pub use window::{FixedWindow, FixedWindowState, SlidingWindow, SlidingWindowState};

use crate::policy::rate::{Algorithm, ConcurrencySpec, RateSpec};
use crate::time::{Instant, Span};

/// The outcome of asking to go now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Admit {
        /// Requests (tokens) still available right after this one.
        remaining: u64,
        /// Until the limit is fully available again.
        reset_after: Span,
    },
    Deny {
        /// Until a request of the same cost could pass (at least 1 ns).
        retry_after: Span,
        reset_after: Span,
    },
}

impl Decision {
    pub fn is_admit(&self) -> bool {
        matches!(self, Decision::Admit { .. })
    }
}

/// The outcome of asking for a turn (queue mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reservation {
    /// The turn is at this instant (`now` when it is immediate).
    At { instant: Instant },
    /// The turn would be further away than the allowed wait; nothing was
    /// reserved. `retry_after`: how much sooner the turn would have to be.
    Deny { retry_after: Span },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("state has {found} bytes, expected {expected}")]
    Length { expected: usize, found: usize },
    #[error("unknown state tag {0}")]
    UnknownTag(u8),
    #[error("state belongs to another algorithm")]
    AlgorithmMismatch,
}

pub(crate) fn ceil_div(numerator: u128, denominator: u128) -> u128 {
    if denominator == 0 {
        return u128::MAX;
    }
    numerator.div_ceil(denominator)
}

/// A rate limiter built from a validated [`RateSpec`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RateLimiter {
    TokenBucket(TokenBucket),
    FixedWindow(FixedWindow),
    SlidingWindow(SlidingWindow),
}

/// The state of any rate limiter; encodes with a leading tag byte so a state
/// left by a different algorithm (after a policy edit) is recognised.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RateState {
    TokenBucket(TokenBucketState),
    FixedWindow(FixedWindowState),
    SlidingWindow(SlidingWindowState),
}

const TAG_TOKEN_BUCKET: u8 = 1;
const TAG_FIXED_WINDOW: u8 = 2;
const TAG_SLIDING_WINDOW: u8 = 3;

impl RateState {
    pub fn encode(&self) -> Vec<u8> {
        let (tag, body): (u8, &[u8]) = match self {
            RateState::TokenBucket(s) => (TAG_TOKEN_BUCKET, &s.encode()),
            RateState::FixedWindow(s) => (TAG_FIXED_WINDOW, &s.encode()),
            RateState::SlidingWindow(s) => (TAG_SLIDING_WINDOW, &s.encode()),
        };
        let mut out = Vec::with_capacity(1 + body.len());
        out.push(tag);
        out.extend_from_slice(body);
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        let (tag, body) = bytes.split_first().ok_or(DecodeError::Length {
            expected: 1,
            found: 0,
        })?;
        match *tag {
            TAG_TOKEN_BUCKET => TokenBucketState::decode(body).map(RateState::TokenBucket),
            TAG_FIXED_WINDOW => FixedWindowState::decode(body).map(RateState::FixedWindow),
            TAG_SLIDING_WINDOW => SlidingWindowState::decode(body).map(RateState::SlidingWindow),
            other => Err(DecodeError::UnknownTag(other)),
        }
    }
}

impl RateLimiter {
    pub fn from_spec(spec: &RateSpec) -> Self {
        let period = spec.period.as_span();
        match spec.algorithm {
            Algorithm::TokenBucket => RateLimiter::TokenBucket(TokenBucket::new(
                spec.requests,
                period,
                spec.effective_burst(),
                spec.warmup.as_ref().map(|w| Warmup {
                    period: w.period.as_span(),
                    cold_factor: w.cold_factor,
                }),
            )),
            Algorithm::FixedWindow => RateLimiter::FixedWindow(match spec.calendar() {
                Some(calendar) => FixedWindow::calendar(spec.requests, calendar),
                None => FixedWindow::new(spec.requests, period),
            }),
            Algorithm::SlidingWindow => {
                RateLimiter::SlidingWindow(SlidingWindow::new(spec.requests, period))
            }
        }
    }

    /// Paces the rest of each window past the share `at` of it (the queue
    /// rung, see [`pace`]): only a fixed window has windows to pace.
    pub fn paced_past(self, at: f64) -> Self {
        match self {
            RateLimiter::FixedWindow(w) => RateLimiter::FixedWindow(w.paced_past(at)),
            other => other,
        }
    }

    /// Whether it paces the rest of its windows (a queue rung).
    pub fn is_paced(&self) -> bool {
        matches!(self, RateLimiter::FixedWindow(w) if w.is_paced())
    }

    /// `at` (rounded up to the second) as the clock its windows follow
    /// shows it: a calendar's zone
    /// (`2026-03-30T00:00:00+02:00[Europe/Berlin]`), else UTC
    /// (`2026-03-29T22:00:00Z`).
    pub fn clock_text(&self, at: Instant) -> String {
        let whole = Instant::from_nanos(
            at.as_nanos()
                .div_ceil(crate::time::NANOS_PER_SEC)
                .saturating_mul(crate::time::NANOS_PER_SEC),
        );
        let calendar = match self {
            RateLimiter::FixedWindow(w) => w.calendar_edges(),
            _ => None,
        };
        crate::calendar::clock_text(calendar, whole)
    }

    /// The start of the calendar window `now` is in, for a limit of a
    /// calendar period (None for any other).
    pub fn calendar_window_start(&self, now: Instant) -> Option<Instant> {
        match self {
            RateLimiter::FixedWindow(w) => w.calendar_edges().and_then(|c| c.window(now).ok()),
            _ => None,
        }
        .map(|w| w.start)
    }

    /// The state of a limiter nobody used yet: full.
    pub fn initial_state(&self) -> RateState {
        match self {
            RateLimiter::TokenBucket(_) => RateState::TokenBucket(TokenBucketState::default()),
            RateLimiter::FixedWindow(_) => RateState::FixedWindow(FixedWindowState::default()),
            RateLimiter::SlidingWindow(_) => {
                RateState::SlidingWindow(SlidingWindowState::default())
            }
        }
    }

    /// Decodes a stored state for this limiter. A state of another algorithm
    /// is an error the caller decides on (usually: start from
    /// [`Self::initial_state`], as the algorithm changed).
    pub fn decode_state(&self, bytes: &[u8]) -> Result<RateState, DecodeError> {
        let state = RateState::decode(bytes)?;
        if self.accepts(&state) {
            Ok(state)
        } else {
            Err(DecodeError::AlgorithmMismatch)
        }
    }

    fn accepts(&self, state: &RateState) -> bool {
        matches!(
            (self, state),
            (RateLimiter::TokenBucket(_), RateState::TokenBucket(_))
                | (RateLimiter::FixedWindow(_), RateState::FixedWindow(_))
                | (RateLimiter::SlidingWindow(_), RateState::SlidingWindow(_))
        )
    }

    fn fit(&self, state: &mut RateState) {
        if !self.accepts(state) {
            *state = self.initial_state();
        }
    }

    pub fn try_acquire(&self, state: &mut RateState, now: Instant, cost: u64) -> Decision {
        self.fit(state);
        match (self, state) {
            (RateLimiter::TokenBucket(l), RateState::TokenBucket(s)) => l.try_acquire(s, now, cost),
            (RateLimiter::FixedWindow(l), RateState::FixedWindow(s)) => l.try_acquire(s, now, cost),
            (RateLimiter::SlidingWindow(l), RateState::SlidingWindow(s)) => {
                l.try_acquire(s, now, cost)
            }
            _ => unreachable_deny(),
        }
    }

    pub fn reserve(
        &self,
        state: &mut RateState,
        now: Instant,
        cost: u64,
        max_wait: Span,
    ) -> Reservation {
        self.fit(state);
        match (self, state) {
            (RateLimiter::TokenBucket(l), RateState::TokenBucket(s)) => {
                l.reserve(s, now, cost, max_wait)
            }
            (RateLimiter::FixedWindow(l), RateState::FixedWindow(s)) => {
                l.reserve(s, now, cost, max_wait)
            }
            (RateLimiter::SlidingWindow(l), RateState::SlidingWindow(s)) => {
                l.reserve(s, now, cost, max_wait)
            }
            _ => Reservation::Deny {
                retry_after: Span::from_secs(1),
            },
        }
    }

    /// What an admission of `cost` takes: a token bucket takes at least
    /// one token (no call is free of the rate), a window counts `cost`.
    pub fn taken(&self, cost: u64) -> u64 {
        match self {
            RateLimiter::TokenBucket(_) => cost.max(1),
            RateLimiter::FixedWindow(_) | RateLimiter::SlidingWindow(_) => cost,
        }
    }

    /// Gives back `tokens` taken at `taken_at` and not used (see each
    /// algorithm's `refund`). A state of another algorithm holds nothing of
    /// them: it is left alone.
    pub fn refund(&self, state: &mut RateState, taken_at: Instant, now: Instant, tokens: u64) {
        match (self, state) {
            (RateLimiter::TokenBucket(l), RateState::TokenBucket(s)) => l.refund(s, now, tokens),
            (RateLimiter::FixedWindow(l), RateState::FixedWindow(s)) => {
                l.refund(s, taken_at, tokens)
            }
            (RateLimiter::SlidingWindow(l), RateState::SlidingWindow(s)) => {
                l.refund(s, taken_at, tokens)
            }
            _ => {}
        }
    }

    /// Takes `tokens` whatever the limit holds: a cost known only after the
    /// call went, paid by the calls that follow.
    pub fn charge(&self, state: &mut RateState, now: Instant, tokens: u64) {
        self.fit(state);
        match (self, state) {
            (RateLimiter::TokenBucket(l), RateState::TokenBucket(s)) => l.charge(s, now, tokens),
            (RateLimiter::FixedWindow(l), RateState::FixedWindow(s)) => l.charge(s, now, tokens),
            (RateLimiter::SlidingWindow(l), RateState::SlidingWindow(s)) => {
                l.charge(s, now, tokens)
            }
            _ => {}
        }
    }

    /// Takes from `state` what this limit's earlier life had spent by `at`
    /// (a budget the admin held while this Envoy restarted). A record that
    /// is broken or hostile can take no more than the limit's size and
    /// cannot date from after `now`: it never makes debt or a future state.
    pub fn restore_spent(&self, state: &mut RateState, spent: u64, at: Instant, now: Instant) {
        self.fit(state);
        let size = self.available(&self.initial_state(), now);
        if spent == 0 {
            return;
        }
        self.charge(state, at.min(now), spent.min(size));
    }

    /// Tokens available now, for utilization reports.
    pub fn available(&self, state: &RateState, now: Instant) -> u64 {
        match (self, state) {
            (RateLimiter::TokenBucket(l), RateState::TokenBucket(s)) => l.available(s, now),
            (RateLimiter::FixedWindow(l), RateState::FixedWindow(s)) => l.available(s, now),
            (RateLimiter::SlidingWindow(l), RateState::SlidingWindow(s)) => l.available(s, now),
            _ => 0,
        }
    }

    /// How long until the limit holds its whole quota again: the `t` of
    /// the `RateLimit` field.
    pub fn until_reset(&self, state: &RateState, now: Instant) -> Span {
        match (self, state) {
            (RateLimiter::TokenBucket(l), RateState::TokenBucket(s)) => l.until_full(s, now),
            (RateLimiter::FixedWindow(l), RateState::FixedWindow(s)) => l.until_reset(s, now),
            (RateLimiter::SlidingWindow(l), RateState::SlidingWindow(s)) => l.until_reset(s, now),
            _ => Span::ZERO,
        }
    }

    /// True when the state says nothing a fresh state would not: its place
    /// (e.g. a per-key bucket) can be reused without giving anything away.
    pub fn is_idle(&self, state: &RateState, now: Instant) -> bool {
        match (self, state) {
            (RateLimiter::TokenBucket(l), RateState::TokenBucket(s)) => l.is_idle(s, now),
            (RateLimiter::FixedWindow(l), RateState::FixedWindow(s)) => l.is_idle(s, now),
            (RateLimiter::SlidingWindow(l), RateState::SlidingWindow(s)) => l.is_idle(s, now),
            _ => true,
        }
    }
}

// `fit` makes the pair match; this only keeps the match exhaustive without a
// panic path.
fn unreachable_deny() -> Decision {
    Decision::Deny {
        retry_after: Span::from_secs(1),
        reset_after: Span::ZERO,
    }
}

impl ConcurrencyLimit {
    pub fn from_spec(spec: &ConcurrencySpec) -> Self {
        Self {
            max_in_flight: spec.max_in_flight,
            reserved_for_high: spec.reserved_for_high,
            lease_ttl: spec.lease_ttl.as_span(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::duration::DurationMs;

    fn spec(algorithm: Algorithm) -> RateSpec {
        RateSpec {
            algorithm,
            requests: 5,
            period: DurationMs::from_secs(1).into(),
            time_zone: None,
            burst: None,
            warmup: None,
        }
    }

    #[test]
    fn state_of_another_algorithm_is_recognised_and_replaced() {
        let bucket = RateLimiter::from_spec(&spec(Algorithm::TokenBucket));
        let window = RateLimiter::from_spec(&spec(Algorithm::FixedWindow));
        let mut state = window.initial_state();
        let t = Instant::from_nanos(10);
        assert!(window.try_acquire(&mut state, t, 1).is_admit());
        let bytes = state.encode();
        assert_eq!(
            bucket.decode_state(&bytes),
            Err(DecodeError::AlgorithmMismatch)
        );
        assert_eq!(window.decode_state(&bytes), Ok(state));
        // Handing the wrong state to a limiter does not panic.
        assert!(bucket.try_acquire(&mut state, t, 1).is_admit());
        assert!(matches!(state, RateState::TokenBucket(_)));
    }

    proptest::proptest! {
        /// A cost learnt after the calls went (`charge`) beyond what a
        /// limit holds is paid by the calls that follow, whatever the
        /// algorithm: no window edge, nor a bucket's refill, sheds it.
        #[test]
        fn debt_is_paid_by_the_calls_that_follow_for_every_algorithm(
            algorithm in proptest::prop_oneof![
                proptest::prelude::Just(Algorithm::TokenBucket),
                proptest::prelude::Just(Algorithm::FixedWindow),
                proptest::prelude::Just(Algorithm::SlidingWindow),
            ],
            limit in 1u64..50,
            debt_windows in 0u64..4,
            extra in 0u64..50,
            start_ms in 0u64..1000,
        ) {
            const WINDOWS: u64 = 6;
            let spec = RateSpec {
                algorithm,
                requests: limit,
                period: DurationMs::from_secs(1).into(),
                time_zone: None,
                burst: None,
                warmup: None,
            };
            let limiter = RateLimiter::from_spec(&spec);
            let mut state = limiter.initial_state();
            let t0 = Instant::from_millis(1_800_000_000_000) + Span::from_millis(start_ms);
            // The whole limit taken, then a debt of a few windows' worth.
            let mut taken = 0;
            while limiter.try_acquire(&mut state, t0, 1).is_admit() {
                taken += 1;
            }
            let debt = debt_windows * limit + extra;
            limiter.charge(&mut state, t0, debt);
            // Then calls of 1 every hundredth of a period, WINDOWS periods.
            let mut admitted = 0u64;
            for i in 1..=WINDOWS * 100 {
                if limiter.try_acquire(&mut state, t0 + Span::from_millis(10 * i), 1).is_admit() {
                    admitted += 1;
                }
            }
            // What WINDOWS more periods hold, less the debt; a window's
            // worth of slack for where t0 falls in its window (and the
            // sliding window's weighing).
            let bound = (WINDOWS * limit + limit).saturating_sub(debt);
            proptest::prop_assert!(
                admitted <= bound,
                "{algorithm:?} limit {limit}: took {taken}, debt {debt}, then {admitted} admitted (at most {bound})"
            );
        }
    }

    #[test]
    fn a_fixed_window_carries_its_debt_to_the_windows_after() {
        let window = RateLimiter::from_spec(&spec(Algorithm::FixedWindow));
        let mut state = window.initial_state();
        let t0 = Instant::from_millis(1_800_000_000_000);
        window.charge(&mut state, t0, 12);
        // 12 in a window of 5: the next window owes 7 - 5 = 2 more, the
        // one after has 3 left.
        assert!(!window
            .try_acquire(&mut state, t0 + Span::from_secs(1), 1)
            .is_admit());
        assert_eq!(window.available(&state, t0 + Span::from_secs(2)), 3);
        assert_eq!(window.until_reset(&state, t0), Span::from_secs(3));
        match window.try_acquire(&mut state, t0 + Span::from_millis(1500), 1) {
            Decision::Deny { retry_after, .. } => assert_eq!(retry_after, Span::from_millis(500)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn garbage_states_are_errors() {
        assert!(RateState::decode(&[]).is_err());
        assert_eq!(
            RateState::decode(&[9, 1, 2]),
            Err(DecodeError::UnknownTag(9))
        );
        assert!(RateState::decode(&[1, 1, 2]).is_err());
    }
}
