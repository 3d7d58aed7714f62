//! Token bucket as GCRA: the whole state is the theoretical arrival time
//! (TAT), the instant at which the bucket would be full again.
//!
//! Exactness: one token is worth `period / requests` nanoseconds, usually not
//! a whole number. Rounding that per request drifts (seed 002's complaint
//! about Guava's resync). Instead every computation runs in "scaled" time, in
//! units of `1 / requests` ns, where one token is exactly `period` units. The
//! TAT is stored as whole nanoseconds plus the remainder in those units.
//!
//! Admission (cost c, burst b, P = period, all scaled): with
//! `debt = max(tat, now) - now`, admit iff `debt <= (b - c)·P`, then
//! `tat = max(tat, now) + c·P·f`, where `f >= 1` is the warm-up factor.
//! Because every admission pushes the TAT by at least c·P, at most
//! `b + rate·T` tokens pass in any interval of length T.

use super::{ceil_div, Decision, DecodeError, Reservation};
use crate::time::{Instant, Span};

/// A token bucket limiter's fixed parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenBucket {
    requests: u64,
    period: Span,
    burst: u64,
    warmup: Option<Warmup>,
    /// What one token is worth, in picoseconds (at least 1): the terms a
    /// state is written in, compared on every read ([`Self::in_its_terms`]),
    /// so computed once here rather than divided out per call.
    token_ps: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Warmup {
    pub period: Span,
    pub cold_factor: u32,
}

/// The shared state: 32 bytes in shared data.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TokenBucketState {
    /// Whole nanoseconds of the TAT.
    pub tat_ns: u64,
    /// The TAT's remainder below one nanosecond, in units of 1/requests ns.
    pub tat_frac: u32,
    /// When the current warm-up ramp started (0: never).
    pub ramp_start_ns: u64,
    /// What one token was worth (picoseconds) and the burst, when the TAT
    /// was last written (0: not recorded, a state of an older filter):
    /// a bucket whose rate changed since (a fleet share, an edit) is read
    /// in its new terms ([`TokenBucket::in_its_terms`]).
    pub token_ps: u64,
    pub burst: u32,
}

impl TokenBucketState {
    pub const ENCODED_LEN: usize = 32;
    /// The length a filter before `token_ps` wrote.
    const LEGACY_LEN: usize = 20;

    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        let mut out = [0u8; Self::ENCODED_LEN];
        out[..8].copy_from_slice(&self.tat_ns.to_le_bytes());
        out[8..12].copy_from_slice(&self.tat_frac.to_le_bytes());
        out[12..20].copy_from_slice(&self.ramp_start_ns.to_le_bytes());
        out[20..28].copy_from_slice(&self.token_ps.to_le_bytes());
        out[28..].copy_from_slice(&self.burst.to_le_bytes());
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        if bytes.len() != Self::ENCODED_LEN && bytes.len() != Self::LEGACY_LEN {
            return Err(DecodeError::Length {
                expected: Self::ENCODED_LEN,
                found: bytes.len(),
            });
        }
        let u64_at = |at: usize| {
            bytes
                .get(at..at + 8)
                .and_then(|b| b.try_into().ok())
                .map_or(0, u64::from_le_bytes)
        };
        let u32_at = |at: usize| {
            bytes
                .get(at..at + 4)
                .and_then(|b| b.try_into().ok())
                .map_or(0, u32::from_le_bytes)
        };
        Ok(Self {
            tat_ns: u64_at(0),
            tat_frac: u32_at(8),
            ramp_start_ns: u64_at(12),
            token_ps: u64_at(20),
            burst: u32_at(28),
        })
    }
}

/// What an admission computed, before it is committed.
struct Step {
    /// Scaled debt beyond what admission allows (0 when admitted now).
    excess: u128,
    new_tat: u128,
    ramp_start_ns: u64,
}

impl TokenBucket {
    /// `requests` and `period` of 0 are lifted to 1 so that an unvalidated
    /// value cannot divide by zero; validation refuses them anyway.
    pub fn new(requests: u64, period: Span, burst: u64, warmup: Option<Warmup>) -> Self {
        let requests = requests.clamp(1, u64::from(u32::MAX));
        let period = period.max(Span::from_nanos(1));
        let token_ps = u128::from(period.as_nanos()) * 1_000 / u128::from(requests);
        Self {
            requests,
            period,
            burst: burst.max(1),
            warmup: warmup.map(|w| Warmup {
                period: w.period.max(Span::from_nanos(1)),
                cold_factor: w.cold_factor.max(1),
            }),
            token_ps: u64::try_from(token_ps).unwrap_or(u64::MAX).max(1),
        }
    }

    pub fn burst(&self) -> u64 {
        self.burst
    }

    /// How long an empty bucket takes to fill.
    fn full_refill(&self) -> Span {
        let scaled = u128::from(self.burst) * u128::from(self.period.as_nanos());
        self.scaled_to_span(scaled)
    }

    /// The period `requests` tokens refill over.
    pub fn period(&self) -> Span {
        self.period
    }

    fn scale(&self) -> u128 {
        u128::from(self.requests)
    }

    /// The TAT in this bucket's terms ([`Self::in_its_terms`]), scaled.
    fn tat_scaled(&self, state: &TokenBucketState) -> u128 {
        let state = self.in_its_terms(state);
        // A remainder from a state of no recorded terms and a larger
        // `requests` is clamped: the TAT keeps its whole nanoseconds.
        let frac = u128::from(state.tat_frac).min(self.scale() - 1);
        u128::from(state.tat_ns) * self.scale() + frac
    }

    fn state_at(&self, tat_scaled: u128, ramp_start_ns: u64) -> TokenBucketState {
        let scale = self.scale();
        let whole = tat_scaled / scale;
        TokenBucketState {
            tat_ns: u64::try_from(whole).unwrap_or(u64::MAX),
            tat_frac: u32::try_from(tat_scaled % scale).unwrap_or(0),
            ramp_start_ns,
            token_ps: self.token_ps,
            burst: u32::try_from(self.burst).unwrap_or(u32::MAX),
        }
    }

    /// `state` read in this bucket's terms. A state written under another
    /// rate or burst (a fleet share that changed, an edited policy) is
    /// empty at the same instant in both: it refills at this rate from
    /// then on, up to this burst. Kept in plain time instead, the debt of
    /// a tiny rate outlived it: two calls at a share of 0.4 a second owed
    /// five seconds, and the Envoy refused every call for four seconds
    /// after its share grew to 7 a second (the simulator's fleet, seed 201
    /// of `tests/sim/tests/fleet_shares.rs`). A backlog (calls queued, costs
    /// charged after they went) stays where it was: what waits keeps its
    /// turn, and nothing queued after it goes sooner.
    pub fn in_its_terms(&self, state: &TokenBucketState) -> TokenBucketState {
        let burst = u32::try_from(self.burst).unwrap_or(u32::MAX);
        if state.token_ps == 0 || (state.token_ps == self.token_ps && state.burst == burst) {
            return *state;
        }
        let tat_ps = u128::from(state.tat_ns) * 1_000;
        let was_full = u128::from(state.burst) * u128::from(state.token_ps);
        let Some(empty_at_ps) = tat_ps.checked_sub(was_full) else {
            // Full since before the clock's start.
            return TokenBucketState {
                token_ps: self.token_ps,
                burst,
                ..*state
            };
        };
        let full = u128::from(self.burst) * u128::from(self.token_ps);
        let tat_ns = (empty_at_ps + full).div_ceil(1_000);
        TokenBucketState {
            tat_ns: u64::try_from(tat_ns).unwrap_or(u64::MAX),
            tat_frac: 0,
            ramp_start_ns: state.ramp_start_ns,
            token_ps: self.token_ps,
            burst,
        }
    }

    /// The warm-up factor as (numerator, denominator), and the ramp start.
    fn warm_factor(&self, state: &TokenBucketState, now: u64) -> ((u128, u128), u64) {
        let Some(w) = self.warmup else {
            return ((1, 1), state.ramp_start_ns);
        };
        let state = self.in_its_terms(state);
        let warmup_ns = w.period.as_nanos();
        // Idle for a whole warm-up period after the bucket filled: cold again.
        let cold = now >= state.tat_ns.saturating_add(warmup_ns);
        let ramp_start = if cold { now } else { state.ramp_start_ns };
        // A clock that went back before the ramp start counts as coldest.
        let elapsed = now.saturating_sub(ramp_start);
        if elapsed >= warmup_ns {
            return ((1, 1), ramp_start);
        }
        let period = u128::from(warmup_ns);
        let cf = u128::from(w.cold_factor);
        // Linear from `cold_factor` down to 1 over the ramp.
        let numerator = cf * period - (cf - 1) * u128::from(elapsed);
        ((numerator, period), ramp_start)
    }

    fn step(&self, state: &TokenBucketState, now: u64, cost: u64) -> Step {
        let scale = self.scale();
        let period = u128::from(self.period.as_nanos());
        let cost = u128::from(cost.max(1));
        let burst = u128::from(self.burst);
        let now_scaled = u128::from(now) * scale;
        let tat = self.tat_scaled(state);
        let base = tat.max(now_scaled);
        let debt = base - now_scaled;
        let allowance = burst.saturating_sub(cost).saturating_mul(period);
        let ((num, den), ramp_start_ns) = self.warm_factor(state, now);
        let increment = ceil_div(cost.saturating_mul(period).saturating_mul(num), den);
        Step {
            excess: debt.saturating_sub(allowance),
            new_tat: base.saturating_add(increment),
            ramp_start_ns,
        }
    }

    fn remaining_after(&self, tat_scaled: u128, now: u64) -> u64 {
        let period = u128::from(self.period.as_nanos());
        let now_scaled = u128::from(now) * self.scale();
        let capacity = u128::from(self.burst) * period;
        let used = tat_scaled.saturating_sub(now_scaled);
        u64::try_from(capacity.saturating_sub(used) / period).unwrap_or(u64::MAX)
    }

    fn scaled_to_span(&self, scaled: u128) -> Span {
        Span::from_nanos(u64::try_from(ceil_div(scaled, self.scale())).unwrap_or(u64::MAX))
    }

    /// Admits `cost` tokens now or refuses; on admission `state` is updated.
    pub fn try_acquire(&self, state: &mut TokenBucketState, now: Instant, cost: u64) -> Decision {
        let now = now.as_nanos();
        if cost > self.burst {
            // More than the bucket holds: no wait makes it fit (a full
            // bucket would otherwise let it through, past the burst).
            return Decision::Deny {
                retry_after: self.full_refill(),
                reset_after: Span::ZERO,
            };
        }
        let step = self.step(state, now, cost);
        if step.excess > 0 {
            let tat = self.tat_scaled(state);
            return Decision::Deny {
                retry_after: self.scaled_to_span(step.excess).max(Span::from_nanos(1)),
                reset_after: self
                    .scaled_to_span(tat.saturating_sub(u128::from(now) * self.scale())),
            };
        }
        *state = self.state_at(step.new_tat, step.ramp_start_ns);
        Decision::Admit {
            remaining: self.remaining_after(step.new_tat, now),
            reset_after: self
                .scaled_to_span(step.new_tat.saturating_sub(u128::from(now) * self.scale())),
        }
    }

    /// Reserves the caller's turn (Guava's `reserve`): the returned instant
    /// is when it may go; later callers get later instants. Refused, without
    /// touching the state, if the turn is more than `max_wait` away.
    pub fn reserve(
        &self,
        state: &mut TokenBucketState,
        now: Instant,
        cost: u64,
        max_wait: Span,
    ) -> Reservation {
        if cost > self.burst {
            return Reservation::Deny {
                retry_after: self.full_refill(),
            };
        }
        let step = self.step(state, now.as_nanos(), cost);
        let wait = self.scaled_to_span(step.excess);
        if wait > max_wait {
            return Reservation::Deny {
                retry_after: wait - max_wait,
            };
        }
        *state = self.state_at(step.new_tat, step.ramp_start_ns);
        Reservation::At {
            instant: now + wait,
        }
    }

    /// Gives back `tokens` a call took and did not use (refused by another
    /// limit, or its real cost came out lower): the TAT moves back by their
    /// worth, never before `now` (a full bucket holds no more than `burst`).
    /// Warm-up is not undone: a refund during a ramp gives back the tokens'
    /// plain worth, which is at most what they took.
    pub fn refund(&self, state: &mut TokenBucketState, now: Instant, tokens: u64) {
        let worth = u128::from(tokens).saturating_mul(u128::from(self.period.as_nanos()));
        let now_scaled = u128::from(now.as_nanos()) * self.scale();
        let tat = self.tat_scaled(state);
        if tat <= now_scaled {
            return;
        }
        let new_tat = tat.saturating_sub(worth).max(now_scaled);
        *state = self.state_at(new_tat, state.ramp_start_ns);
    }

    /// Takes `tokens` whatever the bucket holds (a cost learnt after the
    /// call went): beyond the bucket they become debt that delays the calls
    /// that follow ("pay later"), never the one that already went.
    pub fn charge(&self, state: &mut TokenBucketState, now: Instant, tokens: u64) {
        let worth = u128::from(tokens).saturating_mul(u128::from(self.period.as_nanos()));
        let now_scaled = u128::from(now.as_nanos()) * self.scale();
        let base = self.tat_scaled(state).max(now_scaled);
        *state = self.state_at(base.saturating_add(worth), state.ramp_start_ns);
    }

    /// Tokens available now without changing anything (for utilization).
    pub fn available(&self, state: &TokenBucketState, now: Instant) -> u64 {
        self.remaining_after(self.tat_scaled(state), now.as_nanos())
    }

    /// How long until the bucket is full again (0: it is).
    pub fn until_full(&self, state: &TokenBucketState, now: Instant) -> Span {
        let state = self.in_its_terms(state);
        Span::from_nanos(state.tat_ns.saturating_sub(now.as_nanos()))
    }

    /// True when the bucket is full and no warm-up is under way, so the
    /// state carries no information and its place can be given to another key.
    pub fn is_idle(&self, state: &TokenBucketState, now: Instant) -> bool {
        let state = self.in_its_terms(state);
        let now = now.as_nanos();
        let full = state.tat_ns < now;
        match self.warmup {
            None => full,
            Some(w) => now >= state.tat_ns.saturating_add(w.period.as_nanos()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: Span = Span::from_secs(1);
    const T0: Instant = Instant::from_nanos(1_800_000_000 * 1_000_000_000);

    fn ms(n: u64) -> Span {
        Span::from_millis(n)
    }

    fn admitted(d: Decision) -> bool {
        matches!(d, Decision::Admit { .. })
    }

    #[test]
    fn full_bucket_lets_burst_through_then_refills_at_rate() {
        let tb = TokenBucket::new(100, SEC, 20, None);
        let mut s = TokenBucketState::default();
        let passed = (0..50)
            .filter(|_| admitted(tb.try_acquire(&mut s, T0, 1)))
            .count();
        assert_eq!(passed, 20);
        // 10 ms later exactly one token came back.
        assert!(admitted(tb.try_acquire(&mut s, T0 + ms(10), 1)));
        assert!(!admitted(tb.try_acquire(&mut s, T0 + ms(10), 1)));
    }

    #[test]
    fn deny_reports_when_to_retry_and_changes_nothing() {
        let tb = TokenBucket::new(10, SEC, 1, None);
        let mut s = TokenBucketState::default();
        assert!(admitted(tb.try_acquire(&mut s, T0, 1)));
        let before = s;
        match tb.try_acquire(&mut s, T0 + ms(30), 1) {
            Decision::Deny { retry_after, .. } => assert_eq!(retry_after, ms(70)),
            other => panic!("expected deny, got {other:?}"),
        }
        assert_eq!(s, before);
        assert!(admitted(tb.try_acquire(&mut s, T0 + ms(100), 1)));
    }

    #[test]
    fn a_cost_above_the_burst_is_refused_even_from_a_full_bucket() {
        let tb = TokenBucket::new(10, SEC, 4, None);
        let mut s = TokenBucketState::default();
        assert!(!admitted(tb.try_acquire(&mut s, T0, 5)));
        assert!(matches!(
            tb.reserve(&mut s, T0, 5, Span::MAX),
            Reservation::Deny { .. }
        ));
        assert_eq!(s, TokenBucketState::default(), "nothing taken");
        assert!(admitted(tb.try_acquire(&mut s, T0, 4)));
    }

    #[test]
    fn weighted_request_takes_several_tokens() {
        let tb = TokenBucket::new(10, SEC, 10, None);
        let mut s = TokenBucketState::default();
        assert!(admitted(tb.try_acquire(&mut s, T0, 7)));
        assert!(!admitted(tb.try_acquire(&mut s, T0, 4)));
        assert!(admitted(tb.try_acquire(&mut s, T0, 3)));
    }

    #[test]
    fn fractional_interval_does_not_drift() {
        // 3 per second: 333_333_333.33.. ns per token. A backlogged caller's
        // k-th turn must be exactly ceil(k * P / 3) after the start, however
        // large k gets: rounding the interval per request would be off by
        // a millisecond after three million requests.
        let tb = TokenBucket::new(3, SEC, 1, None);
        let mut s = TokenBucketState::default();
        for k in 0..3_000_000u64 {
            let expected =
                T0 + Span::from_nanos((u128::from(k) * 1_000_000_000).div_ceil(3) as u64);
            match tb.reserve(&mut s, T0, 1, Span::MAX) {
                Reservation::At { instant } => assert_eq!(instant, expected, "turn {k}"),
                other => panic!("turn {k}: {other:?}"),
            }
        }
    }

    #[test]
    fn clock_going_back_gives_no_tokens() {
        let tb = TokenBucket::new(10, SEC, 5, None);
        let mut s = TokenBucketState::default();
        for _ in 0..5 {
            assert!(admitted(tb.try_acquire(&mut s, T0, 1)));
        }
        assert!(!admitted(tb.try_acquire(
            &mut s,
            T0 - SEC.saturating_mul(10),
            1
        )));
        assert!(!admitted(tb.try_acquire(&mut s, Instant::EPOCH, 1)));
    }

    #[test]
    fn reservations_are_spaced_fifo_and_bounded() {
        let tb = TokenBucket::new(50, SEC, 1, None);
        let mut s = TokenBucketState::default();
        let mut instants = Vec::new();
        for _ in 0..200 {
            match tb.reserve(&mut s, T0, 1, SEC.saturating_mul(2)) {
                Reservation::At { instant } => instants.push(instant),
                Reservation::Deny { .. } => break,
            }
        }
        assert_eq!(instants.len(), 101, "0 ms .. 2000 ms at 20 ms spacing");
        for pair in instants.windows(2) {
            assert_eq!(pair[1] - pair[0], ms(20));
        }
        assert!(matches!(
            tb.reserve(&mut s, T0, 1, SEC.saturating_mul(2)),
            Reservation::Deny { .. }
        ));
    }

    #[test]
    fn warmup_starts_slow_and_reaches_full_rate() {
        let w = Warmup {
            period: SEC.saturating_mul(10),
            cold_factor: 4,
        };
        let tb = TokenBucket::new(100, SEC, 1, Some(w));
        let mut s = TokenBucketState::default();
        let count_in = |s: &mut TokenBucketState, from: Instant, to: Instant| {
            let mut n = 0;
            let mut t = from;
            while t < to {
                if admitted(tb.try_acquire(s, t, 1)) {
                    n += 1;
                }
                t += ms(1);
            }
            n
        };
        let secs = |n: u64| SEC.saturating_mul(n);
        let first_second = count_in(&mut s, T0, T0 + SEC);
        let _ = count_in(&mut s, T0 + SEC, T0 + secs(10));
        let after_ramp = count_in(&mut s, T0 + secs(10), T0 + secs(11));
        assert!(
            (25..=32).contains(&first_second),
            "cold second admitted {first_second}"
        );
        assert!(
            (99..=101).contains(&after_ramp),
            "warm second admitted {after_ramp}"
        );
        // Idle again for the warm-up period: cold again.
        let cold_again = count_in(&mut s, T0 + secs(30), T0 + secs(31));
        assert!(
            (25..=32).contains(&cold_again),
            "re-cooled second admitted {cold_again}"
        );
    }

    #[test]
    fn warmup_never_locks_out_a_full_cost_request() {
        let w = Warmup {
            period: SEC,
            cold_factor: 10,
        };
        let tb = TokenBucket::new(10, SEC, 2, Some(w));
        let mut s = TokenBucketState::default();
        assert!(admitted(tb.try_acquire(&mut s, T0, 2)));
    }

    #[test]
    fn state_round_trips_and_rejects_wrong_length() {
        let s = TokenBucketState {
            tat_ns: u64::MAX - 3,
            tat_frac: 7,
            ramp_start_ns: 42,
            token_ps: 9,
            burst: 3,
        };
        assert_eq!(TokenBucketState::decode(&s.encode()).unwrap(), s);
        assert!(TokenBucketState::decode(&[1, 2, 3]).is_err());
        // An older filter's 20 bytes: no terms recorded.
        let legacy = TokenBucketState::decode(&s.encode()[..20]).unwrap();
        assert_eq!(
            (legacy.tat_ns, legacy.token_ps, legacy.burst),
            (s.tat_ns, 0, 0)
        );
    }

    /// The simulator's fleet, seed 201: a share of 0.4 a second took two
    /// calls (five seconds of debt at that rate), then grew to 7 a second.
    /// Read in the new terms the bucket is empty when it was and refills at
    /// 7 a second; the debt kept in plain time refused everything for 4 s.
    #[test]
    fn a_bucket_whose_rate_grew_refills_at_the_new_rate() {
        let tiny = TokenBucket::new(1_440, Span::from_secs(3_600), 2, None);
        let mut s = TokenBucketState::default();
        assert!(admitted(tiny.try_acquire(&mut s, T0, 1)));
        assert!(admitted(tiny.try_acquire(&mut s, T0, 1)));
        assert!(!admitted(tiny.try_acquire(&mut s, T0 + ms(500), 1)));
        let grown = TokenBucket::new(25_200, Span::from_secs(3_600), 2, None);
        // 200 ms after the bucket emptied: 1.4 tokens at 7 a second.
        assert!(admitted(grown.try_acquire(&mut s, T0 + ms(200), 1)));
        assert!(!admitted(grown.try_acquire(&mut s, T0 + ms(200), 1)));
        // Then one every 1/7 s.
        assert!(admitted(grown.try_acquire(&mut s, T0 + ms(343), 1)));
        assert!(!admitted(grown.try_acquire(&mut s, T0 + ms(343), 1)));
        // A shrunk rate reads the same instant as empty: nothing for free.
        let shrunk = TokenBucket::new(3_600, Span::from_secs(3_600), 2, None);
        assert!(!admitted(shrunk.try_acquire(&mut s, T0 + ms(400), 1)));
        assert!(admitted(shrunk.try_acquire(&mut s, T0 + ms(1_343), 1)));
    }

    /// Calls queued under the old rate keep their turns: the first call
    /// reserved after the rate grew goes after them, not before.
    #[test]
    fn a_backlog_keeps_its_place_when_the_rate_changes() {
        let slow = TokenBucket::new(1, SEC, 1, None);
        let mut s = TokenBucketState::default();
        let mut last = T0;
        for _ in 0..5 {
            match slow.reserve(&mut s, T0, 1, Span::MAX) {
                Reservation::At { instant } => last = instant,
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(last, T0 + SEC.saturating_mul(4));
        let fast = TokenBucket::new(100, SEC, 1, None);
        match fast.reserve(&mut s, T0, 1, Span::MAX) {
            Reservation::At { instant } => {
                assert!(
                    instant >= last && instant <= last + ms(10),
                    "{instant:?} after {last:?}"
                )
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn extreme_inputs_do_not_panic() {
        let tb = TokenBucket::new(u64::MAX, Span::MAX, u64::MAX, None);
        let mut s = TokenBucketState {
            tat_ns: u64::MAX,
            tat_frac: u32::MAX,
            ramp_start_ns: u64::MAX,
            token_ps: u64::MAX,
            burst: u32::MAX,
        };
        let _ = tb.try_acquire(&mut s, Instant::MAX, u64::MAX);
        let _ = tb.reserve(&mut s, Instant::EPOCH, u64::MAX, Span::MAX);
        let tb = TokenBucket::new(
            0,
            Span::ZERO,
            0,
            Some(Warmup {
                period: Span::ZERO,
                cold_factor: 0,
            }),
        );
        let _ = tb.try_acquire(&mut s, Instant::EPOCH, 0);
    }
}
