//! An adaptive rate for a provider that says only "429": cut on a
//! refusal, recover toward the limit's own rate along a cubic curve (as
//! AWS SDKs' adaptive retry mode does, CUBIC: `rate × 0.7` on a throttle,
//! then `0.4·(t − K)³ + w_max`). Kept in the provider's shared-data row, so
//! every worker sends at the rate learned by any of them; a refusal cuts
//! once per overload (a burst of 429s from calls that went before the
//! cut, or within a quarter second of it, cuts once);
//! and a `Retry-After` on the refusal pauses on top (see the table).
//!
//! With a provider that pauses (`Retry-After`) and counts in windows,
//! the refusals say more than "too fast", and the cut listens:
//! - refused while still climbing back from such a pause, the limit is
//!   well below what the last cut thought: the cut is deeper (× 0.5);
//! - refused probing a little above the rate that drew the last refusal,
//!   that rate is known: each such cut is gentler (× 0.85, then closer to
//!   it), the curve climbs back only to a little under it (× 0.97),
//!   holds there (10 s, four times longer at each repeat) and probes
//!   above it more slowly (the curve stretched twice as long each time);
//!   refused while holding, it holds a little lower;
//! - a refusal after a pause at least as long as the limit's period
//!   bounds the provider's limit outright: everything it counted in its
//!   window went after the pause, so it allows at most what went since;
//!   within a period of resuming that is one window's count, and the
//!   limit is known from it as from repeats (climb to just under, hold);
//! - the curve starts when the pause ends, not while nothing may go, and
//!   the first call then goes alone;
//! - the row keeps its count at the start of each window the clock aligns
//!   (as a provider's counter keyed by `floor(now / period)` has them) and
//!   each call keeps when it went: two refusals in a row after as many
//!   calls in their windows make the limit known as that many, however
//!   late the refusals come back.
//!
//! Measured in the simulator (`tests/sim/tests/listening.rs`, 1 000
//! seeds, answers of 5 to 200 ms): see docs/RELIABILITY.md.
//!
//! Measured against a provider whose 30 a second drops to 12, counting
//! refused calls and answering `Retry-After: 1`: docs/BENCHMARKS.md,
//! section 11.

use crate::time::{Instant, Span};

/// The rate after a throttle: `BETA × w_max`.
pub const BETA: f64 = 0.7;
/// CUBIC's scaling constant (AWS's).
pub const SCALE: f64 = 0.4;
/// The send rate is measured over this long, smoothed by `SMOOTH`.
pub const MEASURE_EVERY: Span = Span::from_millis(500);
pub const SMOOTH: f64 = 0.8;
/// Refusals this soon after a cut are of the same overload.
pub const CUT_GUARD: Span = Span::from_millis(250);
/// The lowest rate a throttle cuts to, per second (AWS's floor).
pub const FLOOR_PER_SECOND: f64 = 0.5;
/// A cut another Envoy made is followed only this soon after it.
pub const RELAYED_CUT_FRESH: Span = Span::from_secs(5);
/// How many calls may go at once ahead of the adapted pace.
pub const AHEAD: f64 = 2.0;
/// Refusals probing above the rate that drew the last (up to this many
/// times it) make it known; at most `MAX_HITS` in a row count.
pub const SAME_CEILING: f64 = 1.25;
pub const MAX_HITS: u64 = 5;
/// How far under a known rate the curve climbs back to before it holds.
pub const UNDER_KNOWN: f64 = 0.97;
/// The cut of a refusal drawn while climbing back after the last.
pub const DEEPER: f64 = 0.5;
/// The gentlest cut of a known rate.
pub const GENTLEST: f64 = UNDER_KNOWN;
/// How long the curve holds under a known rate, at the first repeat.
pub const HOLD: Span = Span::from_secs(10);

/// What a refusal said beside itself, for the cut: the limit's own rate
/// per second (`full`), the wait the provider asked for, and the limit's
/// period (a wait at least this long empties a window of that length).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Throttle {
    pub full: f64,
    pub wait: Span,
    pub period: Span,
}

impl Throttle {
    /// A refusal that asked for no wait.
    pub fn plain(full: f64) -> Self {
        Self {
            full,
            wait: Span::ZERO,
            period: Span::ZERO,
        }
    }
}

/// A pace (this one's and the provider table's) is checked at least this
/// far ahead: each Envoy worker reads time once per turn of its event loop,
/// so workers' "now" differ by up to a few milliseconds under load; a pace
/// finer than that would refuse calls only because another worker's clock
/// read later.
pub const PACE_SKEW: Span = Span::from_millis(10);

/// An adaptive limit as its rows see it: its own rate per second (which
/// the adapted rate climbs back to) and the period its provider counts
/// in.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdaptiveLimit {
    pub full: f64,
    pub period: Span,
}

/// Where news of a refusal came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Heard {
    /// This Envoy's own call, which went at `sent` with the row's count
    /// then at `admitted` tokens (the call's among them).
    Here { admitted: u64, sent: Instant },
    /// Another Envoy's, relayed by the admin.
    Relayed,
}

/// The adaptive part of one row. A rate of 0 means "not adapted": the
/// limit's own rate holds.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Adaptive {
    /// The rate just after the last cut, tokens per second (0: none).
    pub cut_to: f64,
    /// The rate the last cut was taken from.
    pub w_max: f64,
    pub cut_at: Instant,
    /// The row's count of admitted tokens at the cut: refusals of calls
    /// that went before it are of the same overload, and cut no further.
    pub cut_after: u64,
    /// Smoothed send rate, tokens per second.
    pub measured: f64,
    pub measure_start: Instant,
    pub measure_count: u64,
    /// When the next token may go at the adapted pace.
    pub next: Instant,
    /// Cuts in a row near one rate (0: the rate is not known).
    pub hits: u64,
    /// When the curve starts: the cut, or the end of the pause it came
    /// with.
    pub curve_from: Instant,
    /// The row's count of admitted tokens when calls resumed after a
    /// pause as long as the limit's period (0: none; `AWAITING`: the
    /// pause still runs).
    pub resumed: u64,
    /// The provider's window as the clock aligns it (a fixed window's
    /// counter is keyed by `floor(now / period)`): when the current one
    /// began, and the row's count then and at the start of the one
    /// before it.
    pub window_start: Instant,
    pub window_from: u64,
    pub previous_from: u64,
    /// What went before the last refused call in its clock-aligned
    /// window, plus one (0: not known).
    pub last_in_window: u64,
}

/// The curve after a cut (see `Adaptive::curve`).
struct Curve {
    target: f64,
    scale: f64,
    /// Seconds from its start to `target`.
    k: f64,
    /// Seconds it holds at `target` after `k`.
    hold: f64,
}

/// `Adaptive::resumed` while the pause runs.
const AWAITING: u64 = u64::MAX;

impl Adaptive {
    /// The rate in force at `now`, at most `full` (the limit's own rate
    /// per second). None: not adapted.
    pub fn rate(&self, now: Instant, full: f64) -> Option<f64> {
        if self.cut_to <= 0.0 || !self.cut_to.is_finite() || !self.w_max.is_finite() {
            return None;
        }
        let curve = self.curve();
        let mut t = self.on_curve(now);
        if t > curve.k {
            t = (t - curve.hold).max(curve.k);
        }
        let rate = curve.scale * (t - curve.k).powi(3) + curve.target;
        let floor = FLOOR_PER_SECOND.min(full);
        let rate = rate.max(floor);
        (rate < full).then_some(rate)
    }

    /// The curve since the last cut: where it climbs back to, how fast,
    /// when it is there (`k`, seconds from its start) and how long it
    /// holds there before probing above.
    fn curve(&self) -> Curve {
        let hits = self.hits.min(MAX_HITS);
        let (target, scale, hold) = if hits == 0 {
            (self.w_max, SCALE, 0.0)
        } else {
            // Each repeat stretches the curve twice as long, and holds
            // four times as long.
            (
                self.w_max * UNDER_KNOWN,
                SCALE / 8f64.powi(hits as i32),
                HOLD.as_secs_f64() * 4f64.powi(hits as i32 - 1),
            )
        };
        let k = ((target - self.cut_to).max(0.0) / scale).cbrt();
        Curve {
            target,
            scale,
            k,
            hold,
        }
    }

    /// Seconds along the curve at `now`.
    fn on_curve(&self, now: Instant) -> f64 {
        now.since(self.curve_from.max(self.cut_at)).as_secs_f64()
    }

    /// A call is about to go at `now` with the row's count at `admitted`
    /// (before it): the count at the start of the clock-aligned window of
    /// `period` it falls in is kept, and that of the window before.
    pub fn mark_window(&mut self, now: Instant, period: Span, admitted: u64) {
        if period.is_zero() {
            return;
        }
        let start = Instant::from_nanos(now.as_nanos() / period.as_nanos() * period.as_nanos());
        if start <= self.window_start {
            return;
        }
        // Nothing went in a window between: the one before began (and
        // ended) at this count.
        self.previous_from = if start == self.window_start + period {
            self.window_from
        } else {
            admitted
        };
        self.window_start = start;
        self.window_from = admitted;
    }

    /// A call counted with the row's count at `admitted` did not go after
    /// all: its window holds `cost` fewer tokens (the count itself stays,
    /// as calls' places in it do).
    pub fn given_back(&mut self, admitted: u64, cost: u64) {
        if admitted > self.window_from {
            self.window_from = self.window_from.saturating_add(cost);
        } else if admitted > self.previous_from {
            self.previous_from = self.previous_from.saturating_add(cost);
        }
    }

    /// How many tokens went before the call that went at `sent` with the
    /// row's count at `admitted`, within its clock-aligned window of
    /// `period`; None when that window is no longer kept.
    fn went_in_window(&self, sent: Instant, admitted: u64, period: Span) -> Option<u64> {
        if period.is_zero() || self.window_start == Instant::EPOCH {
            return None;
        }
        let into = sent.as_nanos() % period.as_nanos();
        let start = Instant::from_nanos(sent.as_nanos() - into);
        let from = if start == self.window_start {
            self.window_from
        } else if start + period == self.window_start {
            self.previous_from
        } else {
            return None;
        };
        (admitted > from).then(|| admitted - from - 1)
    }

    /// What went before this Envoy's refused call in its clock-aligned
    /// window of `period`, when it may be the provider's window: a window
    /// the clock does not align would hold some of the calls counted in
    /// the one before, and one that held more than this one did without
    /// a refusal says so.
    fn aligned_in_window(&self, heard: Heard, period: Span) -> Option<u64> {
        let Heard::Here { admitted, sent } = heard else {
            return None;
        };
        let went = self.went_in_window(sent, admitted, period)?;
        self.went_in_window_before(sent, period)
            .is_none_or(|before| went >= before)
            .then_some(went)
    }

    /// How many tokens went in the whole clock-aligned window of `period`
    /// before the one `sent` falls in, when that is the current one.
    fn went_in_window_before(&self, sent: Instant, period: Span) -> Option<u64> {
        let start = sent.as_nanos().checked_div(period.as_nanos())? * period.as_nanos();
        (Instant::from_nanos(start) == self.window_start)
            .then(|| self.window_from.saturating_sub(self.previous_from))
    }

    /// Counts `cost` tokens sent at `now` into the measured send rate.
    pub fn sent(&mut self, now: Instant, cost: u64) {
        let elapsed = now.since(self.measure_start);
        if elapsed >= MEASURE_EVERY {
            let rate = self.measure_count as f64 / elapsed.as_secs_f64();
            self.measured = if self.measured > 0.0 {
                SMOOTH * rate + (1.0 - SMOOTH) * self.measured
            } else {
                rate
            };
            self.measure_start = now;
            self.measure_count = 0;
        }
        self.measure_count = self.measure_count.saturating_add(cost);
    }

    /// Whether `cost` tokens may go at `now` at the adapted pace (`full`:
    /// the limit's own rate per second); if so, takes them. Otherwise,
    /// when they may.
    pub fn admit(&mut self, now: Instant, cost: u64, full: f64) -> Result<(), Instant> {
        let Some(rate) = self.rate(now, full) else {
            if self.cut_to > 0.0 {
                // Recovered: the limit's own rate holds again.
                self.cut_to = 0.0;
                self.hits = 0;
            }
            return Ok(());
        };
        let every = 1.0 / rate;
        let ahead = Span::from_nanos((every * AHEAD * 1e9) as u64).max(PACE_SKEW);
        if self.next > now + ahead {
            return Err(Instant::from_nanos(self.next.as_nanos() - ahead.as_nanos()));
        }
        let step = Span::from_nanos((every * cost as f64 * 1e9).min(u64::MAX as f64) as u64);
        self.next = self.next.max(now) + step;
        Ok(())
    }

    /// A provider refused a call at `at` (`heard`: this Envoy's call, or
    /// another's; `now_admitted`: the row's count now; `throttle`: the
    /// limit's own rate per second and period, and the wait the refusal
    /// asked for): the rate is cut, once per overload. Returns whether it
    /// was.
    pub fn throttled(
        &mut self,
        at: Instant,
        heard: Heard,
        now_admitted: u64,
        throttle: Throttle,
    ) -> bool {
        let full = throttle.full;
        let same_overload = match heard {
            // Not for calls that went before the last cut, nor within a
            // measuring round of it (a provider's window stays full until
            // it turns, whatever the rate meanwhile).
            Heard::Here { admitted, .. } => {
                self.cut_to > 0.0
                    && (admitted <= self.cut_after || at.since(self.cut_at) < CUT_GUARD)
            }
            // Any cut made since (or just before) is this one or a newer
            // one; the admin relays the same cut at every sync for a while.
            Heard::Relayed => self.cut_at > Instant::EPOCH && at < self.cut_at + CUT_GUARD,
        };
        if same_overload {
            self.narrow(heard, throttle.period);
            return false;
        }
        let floor = FLOOR_PER_SECOND.min(full);
        let adapting = self.rate(at, full);
        let current = adapting.unwrap_or(full);
        let measured = if self.measured > 0.0 {
            self.measured
        } else {
            current
        };
        let mut w_max = current.min(measured).max(floor);
        // Whether the calls since a pause bound the provider's limit
        // below what the rates say: then that limit is known.
        let mut bounded = false;
        let period = throttle.period.as_secs_f64();
        if let (Heard::Here { admitted, sent }, Some(since), true) =
            (heard, self.resumed_from(), period > 0.0)
        {
            // All the provider counted in its window went after the
            // pause: it allows at most what went before this call.
            let went = admitted.saturating_sub(since).saturating_sub(1);
            let bound = (went as f64 / period).max(floor);
            // For a call that went within a period of resuming, the bound
            // is what one window holds; later, it only caps the rate. (When
            // the call went, not when its refusal came back: answers that
            // take long would otherwise fall past the period.)
            bounded = bound < w_max && sent.since(self.curve_from) <= throttle.period;
            w_max = w_max.min(bound);
        }
        if let Heard::Here { admitted, sent } = heard {
            // Two refusals in a row with as much before them in their
            // clock-aligned windows: the provider's window is the clock's
            // and holds that much; the limit is known from it.
            let in_window = self.went_in_window(sent, admitted, throttle.period);
            let last = self.last_in_window.checked_sub(1);
            let aligned = self.aligned_in_window(heard, throttle.period);
            if let (Some(now_went), Some(last)) = (aligned, last) {
                if now_went.abs_diff(last) <= (now_went / 10).max(1) && period > 0.0 {
                    let bound = (now_went.max(last) as f64 / period).max(floor).min(full);
                    bounded = true;
                    w_max = w_max.min(bound);
                }
            }
            self.last_in_window = in_window.map_or(0, |w| w.saturating_add(1));
        }
        let curve = self.curve();
        let t = self.on_curve(at);
        let paused = !throttle.period.is_zero() && throttle.wait >= throttle.period;
        let known = self.w_max;
        // What the rate is cut to, as a part of the new `w_max`.
        let cut = match adapting {
            // The provider's count bounds its limit: climb back to just
            // under the bound and hold there, as under a rate known by
            // repeats (the curve would otherwise climb past it and draw
            // the next refusal).
            _ if bounded => {
                // The same bound again (probing above it after a hold):
                // known more surely, held longer.
                let again = self.hits > 0 && w_max <= known * SAME_CEILING;
                self.hits = if again {
                    (self.hits + 1).min(MAX_HITS)
                } else {
                    self.hits.max(1)
                };
                (1.0 - (1.0 - BETA) / 2f64.powi(self.hits as i32)).min(GENTLEST)
            }
            // Refused while climbing back to or holding under a known
            // rate: it is a little lower than thought. No dip: the hold
            // goes on lower.
            Some(_) if self.hits > 0 && t < curve.k + curve.hold => {
                w_max = w_max.min(known * UNDER_KNOWN);
                UNDER_KNOWN
            }
            // Refused while climbing back from a pause: the provider's
            // limit is well below where the last cut thought; a deeper
            // cut. (Without a pause the climb is only a little early.)
            Some(_) if t < curve.k => {
                self.hits = 0;
                if paused {
                    DEEPER
                } else {
                    BETA
                }
            }
            // Refused probing a little above the rate that drew the last
            // refusal: that rate still holds, each time more surely. The
            // rate calls went at, not the pace allowed when the refusal
            // came back: the probe's curve climbs faster each second, and
            // its pace had passed the ceiling (15.2 a second of a known 12)
            // when a call sent at 13 was refused; the known rate was then
            // forgotten, the climb back went to 13 a second and drew
            // another refusal (`sluice-sim`'s `listening`, seed 6).
            Some(_) if current.min(measured) <= known * SAME_CEILING => {
                self.hits = (self.hits + 1).min(MAX_HITS);
                w_max = w_max.min(known);
                (1.0 - (1.0 - BETA) / 2f64.powi(self.hits as i32)).min(GENTLEST)
            }
            _ => {
                self.hits = 0;
                BETA
            }
        };
        self.w_max = w_max;
        self.cut_to = (w_max * cut).max(floor);
        self.cut_at = at;
        self.cut_after = now_admitted;
        // The curve starts when calls may go again: `rate(curve_from)`
        // is `cut_to`, and the first call then goes alone, not with the
        // calls allowed ahead.
        self.curve_from = at + throttle.wait;
        let ahead = Span::from_nanos((AHEAD / self.cut_to * 1e9) as u64).max(PACE_SKEW);
        self.next = self.next.max(self.curve_from + ahead);
        self.resumed = if paused { AWAITING } else { 0 };
        true
    }

    /// Another refusal of the overload the last cut was for: answers come
    /// back out of order, and a call that went earlier in the same
    /// clock-aligned window says the provider allowed less before it.
    /// A limit known from a window's count (`hits`) follows the lowest
    /// such count (never below half of it: a provider's window need not
    /// be the clock's), without a second cut.
    fn narrow(&mut self, heard: Heard, period: Span) {
        let Heard::Here { admitted, sent } = heard else {
            return;
        };
        if self.hits == 0 || self.w_max <= 0.0 || period.is_zero() {
            return;
        }
        let Some(went) = self.went_in_window(sent, admitted, period) else {
            return;
        };
        let bound = went as f64 / period.as_secs_f64();
        if bound < self.w_max && bound >= self.w_max / 2.0 {
            let ratio = bound / self.w_max;
            self.w_max = bound;
            self.cut_to *= ratio;
        }
    }

    /// The row's count when calls resumed after a pause as long as the
    /// limit's period, once they did.
    fn resumed_from(&self) -> Option<u64> {
        if self.resumed == AWAITING {
            return None;
        }
        self.resumed.checked_sub(1)
    }

    /// A call is about to go at `now` with the row's count at
    /// `admitted` (before it): the first after a pause marks the count.
    pub fn resuming(&mut self, now: Instant, admitted: u64) {
        // Calls go only once the pause is over.
        if self.resumed == AWAITING && now >= self.cut_at {
            self.resumed = admitted.saturating_add(1).min(AWAITING - 1);
        }
    }

    pub const WORDS: usize = 15;

    pub fn words(&self) -> [u64; Self::WORDS] {
        [
            self.cut_to.to_bits(),
            self.w_max.to_bits(),
            self.cut_at.as_nanos(),
            self.cut_after,
            self.measured.to_bits(),
            self.measure_start.as_nanos(),
            self.measure_count,
            self.next.as_nanos(),
            self.hits,
            self.curve_from.as_nanos(),
            self.resumed,
            self.window_start.as_nanos(),
            self.window_from,
            self.previous_from,
            self.last_in_window,
        ]
    }

    /// From [`Self::words`]; non-finite or negative rates read as "not
    /// adapted" (a broken entry never stops calls).
    pub fn from_words(w: [u64; Self::WORDS]) -> Self {
        let rate = |bits: u64| {
            let r = f64::from_bits(bits);
            if r.is_finite() && r >= 0.0 {
                r
            } else {
                0.0
            }
        };
        Self {
            cut_to: rate(w[0]),
            w_max: rate(w[1]),
            cut_at: Instant::from_nanos(w[2]),
            cut_after: w[3],
            measured: rate(w[4]),
            measure_start: Instant::from_nanos(w[5]),
            measure_count: w[6],
            next: Instant::from_nanos(w[7]),
            hits: w[8].min(MAX_HITS),
            curve_from: Instant::from_nanos(w[9]),
            resumed: w[10],
            window_start: Instant::from_nanos(w[11]),
            window_from: w[12],
            previous_from: w[13],
            last_in_window: w[14],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const NOW: Instant = Instant::from_millis(1_700_000_000_000);

    #[test]
    fn a_throttle_cuts_to_seven_tenths_and_the_curve_recovers_to_the_full_rate() {
        let mut a = Adaptive::default();
        assert_eq!(a.rate(NOW, 100.0), None);
        for ms in 0..1000 {
            a.sent(NOW + Span::from_millis(ms), 1);
        }
        assert!(a.throttled(
            NOW + Span::from_secs(1),
            Heard::Here {
                admitted: 10,
                sent: NOW
            },
            1000,
            Throttle::plain(100.0)
        ));
        let at = |s: f64| {
            a.rate(
                NOW + Span::from_secs(1) + Span::from_nanos((s * 1e9) as u64),
                100.0,
            )
        };
        let cut = at(0.0).unwrap_or(0.0);
        assert!((cut - 0.7 * a.w_max).abs() < 0.5, "{cut} of {}", a.w_max);
        // K = ∛(w_max · 0.3 / 0.4): back at w_max then.
        let k = (a.w_max * 0.3 / 0.4).cbrt();
        assert!((at(k).unwrap_or(100.0) - a.w_max).abs() < 0.01);
        assert!(at(k + 20.0).is_none(), "recovered past the full rate");
    }

    #[test]
    fn refusals_of_one_overload_cut_once() {
        let mut a = Adaptive::default();
        assert!(a.throttled(
            NOW,
            Heard::Here {
                admitted: 5,
                sent: NOW
            },
            10,
            Throttle::plain(100.0)
        ));
        let once = a.rate(NOW, 100.0);
        // Calls that went before the cut (admitted ≤ 10) refused too:
        for admitted in 1..=10 {
            assert!(!a.throttled(
                NOW,
                Heard::Here {
                    admitted,
                    sent: NOW
                },
                12,
                Throttle::plain(100.0)
            ));
        }
        assert_eq!(a.rate(NOW, 100.0), once);
        // One that went after the cut, refused within a quarter second
        // of it, is the same overload; later, it cuts again.
        assert!(!a.throttled(
            NOW + Span::from_millis(200),
            Heard::Here {
                admitted: 11,
                sent: NOW
            },
            12,
            Throttle::plain(100.0)
        ));
        let later = NOW + CUT_GUARD;
        assert!(a.throttled(
            later,
            Heard::Here {
                admitted: 11,
                sent: NOW
            },
            12,
            Throttle::plain(100.0)
        ));
        assert!(a.rate(later, 100.0) < once);
    }

    #[test]
    fn a_relayed_cut_of_an_overload_this_row_already_cut_for_is_skipped() {
        let mut a = Adaptive::default();
        assert!(a.throttled(
            NOW,
            Heard::Here {
                admitted: 5,
                sent: NOW
            },
            10,
            Throttle::plain(100.0)
        ));
        let once = a.rate(NOW, 100.0);
        // Another Envoy saw the same overload 100 ms later.
        assert!(!a.throttled(
            NOW + Span::from_millis(100),
            Heard::Relayed,
            12,
            Throttle::plain(100.0)
        ));
        assert_eq!(a.rate(NOW, 100.0), once);
        // A later one, past the guard, is a new overload.
        assert!(a.throttled(NOW + CUT_GUARD, Heard::Relayed, 12, Throttle::plain(100.0)));
        assert!(a.rate(NOW + CUT_GUARD, 100.0) < once);
        // Even once recovered, the same news does not cut again.
        a.cut_to = 0.0;
        assert!(!a.throttled(NOW + CUT_GUARD, Heard::Relayed, 12, Throttle::plain(100.0)));
    }

    const PAUSING: Throttle = Throttle {
        full: 30.0,
        wait: Span::from_secs(1),
        period: Span::from_secs(1),
    };

    /// Sent 30 in a second, then refused and paused 1 s: the row and when
    /// the pause ends.
    fn refused_and_paused_at_thirty_a_second() -> (Adaptive, Instant) {
        let mut a = Adaptive::default();
        for ms in 0..1000 {
            a.sent(NOW + Span::from_millis(ms), 1);
        }
        assert!(a.throttled(
            NOW + Span::from_secs(1),
            Heard::Here {
                admitted: 30,
                sent: NOW
            },
            30,
            PAUSING
        ));
        (a, NOW + Span::from_secs(2))
    }

    #[test]
    fn after_a_pause_a_refusal_bounds_the_limit_by_what_went_since() {
        let (mut a, resumed) = refused_and_paused_at_thirty_a_second();
        assert!(
            a.admit(resumed - Span::from_millis(1), 1, 30.0).is_err(),
            "paused"
        );
        // The first call after the pause marks the count (30); the 13th
        // after it is refused: the provider allows at most 12 a second.
        a.resuming(resumed, 30);
        let at = resumed + Span::from_millis(600);
        assert!(a.throttled(
            at,
            Heard::Here {
                admitted: 43,
                sent: NOW
            },
            43,
            PAUSING
        ));
        assert!((a.w_max - 12.0).abs() < 1e-9, "{}", a.w_max);
        assert!(a.rate(at, 30.0).is_some_and(|r| r < 12.0));
        // That bound is known: the curve climbs back to just under it and
        // holds there (the hold a repeat would earn), not past it.
        assert_eq!(a.hits, 1);
        let held = (1..=14).map(|s| a.rate(at + Span::from_secs(s), 30.0));
        for (s, rate) in (1..).zip(held) {
            assert!(rate.is_some_and(|r| r < 12.0), "{s} s after: {rate:?}");
        }
    }

    #[test]
    fn a_refusal_more_than_a_period_after_resuming_bounds_the_limit_but_does_not_make_it_known() {
        let (mut a, resumed) = refused_and_paused_at_thirty_a_second();
        a.resuming(resumed, 30);
        // 24 went in 1.3 s: they may span two of the provider's windows.
        let at = resumed + Span::from_millis(1_300);
        let heard = Heard::Here {
            admitted: 55,
            sent: at,
        };
        assert!(a.throttled(at, heard, 55, PAUSING));
        assert!(a.w_max <= 24.0, "{}", a.w_max);
        assert_eq!(a.hits, 0);
    }

    #[test]
    fn a_refusal_heard_late_counts_from_when_its_call_went() {
        // The same call, sent 0.9 s after resuming, its 429 back 0.4 s
        // later: what went since is one window's, as if heard at once.
        let (mut a, resumed) = refused_and_paused_at_thirty_a_second();
        a.resuming(resumed, 30);
        let sent = resumed + Span::from_millis(900);
        let heard = Heard::Here { admitted: 43, sent };
        assert!(a.throttled(sent + Span::from_millis(400), heard, 50, PAUSING));
        assert!((a.w_max - 12.0).abs() < 1e-9, "{}", a.w_max);
        assert_eq!(a.hits, 1);
    }

    /// Calls at `per_second` through `seconds` whole seconds of the clock
    /// from `from`, each marking its window: the row, its count, and when
    /// the last went.
    fn sent_evenly(
        a: &mut Adaptive,
        from: Instant,
        per_second: u64,
        seconds: u64,
    ) -> (u64, Instant) {
        let mut admitted = 0;
        let mut last = from;
        for i in 0..per_second * seconds {
            last = from + Span::from_nanos(i * 1_000_000_000 / per_second);
            a.mark_window(last, PAUSING.period, admitted);
            admitted += 1;
        }
        (admitted, last)
    }

    #[test]
    fn two_refusals_after_as_many_in_their_clock_windows_make_the_limit_known() {
        let mut a = Adaptive::default();
        let start = NOW + Span::from_millis(1);
        let (admitted, _) = sent_evenly(&mut a, start, 20, 3);
        // Refused as the 13th call of a second, twice: 12 a second.
        let refused_13th = |a: &mut Adaptive, second: u64, admitted: u64| {
            let sent = NOW + Span::from_secs(second) + Span::from_millis(620);
            for i in 0..13 {
                a.mark_window(
                    NOW + Span::from_secs(second) + Span::from_millis(i * 50),
                    PAUSING.period,
                    admitted + i,
                );
            }
            let heard = Heard::Here {
                admitted: admitted + 13,
                sent,
            };
            let throttle = Throttle {
                wait: Span::ZERO,
                ..PAUSING
            };
            a.throttled(sent, heard, admitted + 13, throttle)
                .then_some(admitted + 13)
        };
        let first = refused_13th(&mut a, 3, admitted);
        assert!(first.is_some());
        assert_eq!(a.hits, 0, "one refusal alone does not tell the window");
        let second = refused_13th(&mut a, 9, first.unwrap_or_default());
        assert!(second.is_some());
        assert_eq!(a.hits, 1);
        assert!((a.w_max - 12.0).abs() < 1e-9, "{}", a.w_max);
    }

    #[test]
    fn calls_given_back_leave_their_window() {
        let mut a = Adaptive::default();
        let at = NOW + Span::from_millis(700);
        a.mark_window(NOW, PAUSING.period, 0);
        // Ten went, two of them did not go after all.
        a.given_back(4, 1);
        a.given_back(9, 1);
        assert_eq!(a.went_in_window(at, 11, PAUSING.period), Some(8));
        // The window before is kept once the next begins; older ones not.
        a.mark_window(NOW + Span::from_secs(1), PAUSING.period, 12);
        assert_eq!(a.went_in_window(at, 11, PAUSING.period), Some(8));
        a.mark_window(NOW + Span::from_secs(2), PAUSING.period, 12);
        assert_eq!(a.went_in_window(at, 11, PAUSING.period), None);
    }

    #[test]
    fn refused_while_climbing_back_cuts_deeper_and_probing_above_makes_it_known() {
        let mut a = Adaptive::default();
        a.throttled(
            NOW,
            Heard::Here {
                admitted: 1,
                sent: NOW,
            },
            1,
            PAUSING,
        );
        assert_eq!(a.hits, 0);
        // 0.5 s after the pause, still climbing from 21 to 30: cut to
        // half. Without a pause, the same refusal cuts as ever.
        let mut unpaused = a;
        let climbing = NOW + Span::from_millis(1_500);
        let current = a.rate(climbing, 30.0).unwrap_or(0.0);
        assert!(a.throttled(
            climbing,
            Heard::Here {
                admitted: 5,
                sent: NOW
            },
            5,
            PAUSING
        ));
        assert!((a.cut_to - 0.5 * a.w_max).abs() < 1e-9 && a.w_max <= current);
        assert_eq!(a.hits, 0);
        unpaused.throttled(
            climbing,
            Heard::Here {
                admitted: 5,
                sent: NOW,
            },
            5,
            Throttle::plain(30.0),
        );
        assert!((unpaused.cut_to - BETA * unpaused.w_max).abs() < 1e-9);
        // Back past the rate that drew it: the next refusal makes it
        // known; the curve then holds under it.
        let w = a.w_max;
        let k = ((a.w_max - a.cut_to) / SCALE).cbrt();
        let past = climbing + Span::from_nanos(((1.0 + k + 0.8) * 1e9) as u64);
        assert!(a
            .rate(past, 30.0)
            .is_some_and(|r| r > w && r < w * SAME_CEILING));
        assert!(a.throttled(
            past,
            Heard::Here {
                admitted: 99,
                sent: NOW
            },
            99,
            PAUSING
        ));
        assert_eq!(a.hits, 1);
        let held = past + Span::from_secs(9);
        let rate = a.rate(held, 30.0).unwrap_or(0.0);
        assert!(
            (rate - a.w_max * UNDER_KNOWN).abs() < 0.05,
            "{rate} of {}",
            a.w_max
        );
    }

    /// A probe above a known rate refused when its pace had climbed past
    /// the ceiling, though calls went at a rate within it: the rate stays
    /// known, held longer (it was forgotten, the climb back went to 13 a
    /// second of 12 and drew another refusal: `sluice-sim`'s `listening`).
    #[test]
    fn a_probe_refused_after_its_pace_passed_the_ceiling_keeps_the_rate_known() {
        let mut a = Adaptive {
            cut_to: 10.2,
            w_max: 12.0,
            cut_at: NOW,
            curve_from: NOW,
            hits: 1,
            measured: 13.1,
            measure_start: NOW,
            ..Adaptive::default()
        };
        let at = NOW + Span::from_millis(17_500);
        assert!(a.rate(at, 30.0).is_some_and(|r| r > 12.0 * SAME_CEILING));
        let heard = Heard::Here {
            admitted: 500,
            sent: at - Span::from_millis(80),
        };
        assert!(a.throttled(at, heard, 500, PAUSING));
        assert_eq!(a.hits, 2);
        assert!((a.w_max - 12.0).abs() < 1e-9, "{}", a.w_max);
    }

    #[test]
    fn the_adapted_pace_lets_that_many_a_second_through() {
        let mut a = Adaptive::default();
        a.throttled(
            NOW,
            Heard::Here {
                admitted: 1,
                sent: NOW,
            },
            1,
            Throttle::plain(57.0),
        );
        // Cut to 0.7 × 57 ≈ 40; over the next second the curve climbs
        // to 0.4·(1 − ∛42.75)³ + 57 ≈ 50.8: about 46 on average, plus the
        // 2 allowed ahead.
        let went = (0..10_000)
            .filter(|i| {
                a.admit(NOW + Span::from_nanos(i * 100_000), 1, 57.0)
                    .is_ok()
            })
            .count();
        assert!((45..=49).contains(&went), "{went}");
    }

    proptest! {
        #[test]
        fn the_rate_stays_between_the_floor_and_the_full_rate(
            events in proptest::collection::vec((0u8..3, 0u64..3_000, 1u64..5), 1..100),
            full in 0.1f64..10_000.0,
        ) {
            let mut a = Adaptive::default();
            let mut now = NOW;
            let mut admitted = 0;
            for (event, advance, cost) in events {
                now += Span::from_millis(advance);
                if event == 0 && a.admit(now, cost, full).is_ok() {
                    admitted += cost;
                    a.sent(now, cost);
                } else if event == 1 {
                    // Some refusals ask for a pause of up to 2 s.
                    let throttle = Throttle {
                        full,
                        wait: Span::from_millis(advance % 2_000),
                        period: Span::from_secs(1),
                    };
                    a.throttled(now, Heard::Here { admitted, sent: now }, admitted, throttle);
                }
                if let Some(rate) = a.rate(now, full) {
                    prop_assert!(rate < full);
                    prop_assert!(rate >= FLOOR_PER_SECOND.min(full) - 1e-9);
                }
                prop_assert_eq!(Adaptive::from_words(a.words()), a);
            }
        }

        #[test]
        fn any_words_read_without_panic(words in proptest::array::uniform15(any::<u64>()), cost in 0u64..1000) {
            let mut a = Adaptive::from_words(words);
            let _ = a.rate(NOW, 100.0);
            let _ = a.admit(NOW, cost, 100.0);
            let _ = a.throttled(NOW, Heard::Here { admitted: 1, sent: NOW }, 2, Throttle::plain(100.0));
        }
    }
}
