//! The filter's clock. Envoy gives a VM only the wall clock, which NTP or an
//! operator can step. Limits measured on it would then break: a step back
//! of Δ would refuse every rate-limited call for about Δ (and stop syncing),
//! a step forward past a lease's TTL would take slots from calls still in
//! flight, a fleet share would outlive its lease while the admin hands it
//! to others.
//!
//! So each worker keeps a clock of its own on top of the wall clock: it
//! never goes back (a step back is absorbed: time goes on from where it
//! was), and one reading moves it at most [`MAX_STEP`] ahead of the
//! previous one unless the monotonic clock saw that much time pass (a
//! bigger step forward is absorbed the same way). A worker reads the clock
//! at least every tick (100 ms), but a VM or an Envoy stalled for longer
//! (a loaded machine, a stopped process) reads it late: real time passed,
//! and the clock must move as far, or its windows would lag the
//! provider's (which count in wall-clock time) until it slewed back, some
//! ten seconds, letting through a window's worth more than the limit
//! (seen through Envoy: a stall of 1.9 s put a provider's 2 s windows
//! 1 341 tokens over). So a reading also reads the monotonic clock, when
//! it would move the clock more than [`MAX_STEP`] and once per
//! [`ANCHOR_EVERY`] otherwise (a host call a tenth of a second, not one a
//! call), and only a wall clock that moved further than it did is a step.
//! The workers' clocks then differ by at most about one tick, the
//! precision shared state already lives with. After a step the clock slews
//! back toward the wall clock, by a tenth of the time that passes (as
//! `adjtime` does), so workers that absorbed a step differently, or a VM
//! that stalled, come back in line without ever going back.

use std::cell::Cell;

use sluice_shared::time::{Instant, Span};

use crate::host::{Host, Level, SetError};

/// The most one reading moves the clock ahead of the previous one.
pub const MAX_STEP: Span = Span::from_secs(1);

/// How often a reading also reads the monotonic clock, to know how much
/// real time passed since when a later reading jumps.
pub const ANCHOR_EVERY: Span = Span::from_millis(100);

/// Calls that may decide on the clock's last reading instead of reading it
/// (a host call, a quarter of what Sluice adds per call far from its
/// limits: docs/PERFORMANCE.md), while calls come at most [`DENSE`] apart.
/// Such a call only spends a prefetch (anything that goes to shared data
/// reads the clock first), so a prefetch that lapsed since the reading is
/// spent by at most this many calls past its lifetime, whatever time passed.
pub const MAX_REUSES: u32 = 3;

/// Calls this close together on average (since the previous reading) let
/// the next [`MAX_REUSES`] reuse a reading: they then come within about
/// 1 ms of it, a fifth of a prefetch's lifetime
/// ([`sluice_filter_core::bucket::PREFETCH_TTL`]). Sparser calls read the clock
/// each time, as every call did before.
pub const DENSE: Span = Span::from_nanos(333_333);

#[derive(Debug, Default)]
pub struct Clock {
    /// Added to the wall clock, in nanoseconds.
    offset: Cell<i128>,
    /// The last reading: (the wall clock, the clock).
    last: Cell<Option<(Instant, Instant)>>,
    /// Slowed time (plugin `time_scale`), for measuring under callgrind.
    dilation: Cell<Option<Dilation>>,
    /// Calls that may still reuse the last reading (see [`MAX_REUSES`]).
    reuses_left: Cell<u32>,
    /// Calls that reused it.
    reused: Cell<u32>,
    /// The last reading that also read the monotonic clock.
    anchor: Cell<Option<Anchor>>,
}

/// A reading of the wall clock, the monotonic clock and this clock at once.
#[derive(Debug, Clone, Copy)]
struct Anchor {
    wall: Instant,
    monotonic: Instant,
    now: Instant,
}

impl Anchor {
    /// The real time since the anchor, when the wall clock moved further
    /// than it by more than [`MAX_STEP`]; None when it did not (the
    /// readings paused, time did not jump) or went back.
    fn jumped(&self, wall: Instant, monotonic: Instant) -> Option<Span> {
        let real = monotonic.since(self.monotonic);
        (wall >= self.wall && wall.since(self.wall) > real + MAX_STEP).then_some(real)
    }
}

/// The wall clock slowed to `scale` of real time from `origin` (its first
/// reading) on.
#[derive(Debug, Clone, Copy)]
struct Dilation {
    scale: f64,
    origin: Option<Instant>,
}

/// The share of the time passing by which the offset shrinks.
const SLEW_DIVISOR: i128 = 10;

/// Steps of the wall clock the clock absorbed (for a log line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    Back(Span),
    Forward(Span),
}

impl Clock {
    /// Runs the clock at `scale` (0 < scale ≤ 1) of real time from the next
    /// reading on; 1 is real time.
    pub fn set_scale(&self, scale: f64) {
        let dilation = (scale.is_finite() && scale > 0.0 && scale < 1.0).then_some(Dilation {
            scale,
            origin: None,
        });
        self.dilation.set(dilation);
    }

    /// The clock's last reading, without reading the wall clock (a host
    /// call): as recent as this worker's last request or tick.
    pub fn last_reading(&self) -> Option<Instant> {
        self.last.get().map(|(_, now)| now)
    }

    /// The last reading, for a call that only spends a prefetch, while
    /// readings come densely and fewer than [`MAX_REUSES`] calls reused it;
    /// otherwise nothing, and the caller reads the clock.
    pub fn reuse(&self) -> Option<Instant> {
        let left = self.reuses_left.get();
        if left == 0 {
            return None;
        }
        self.reuses_left.set(left - 1);
        self.reused.set(self.reused.get() + 1);
        self.last_reading()
    }

    /// The real time a span of this clock's time takes.
    pub fn real_span(&self, span: Span) -> Span {
        match self.dilation.get() {
            Some(d) => {
                Span::from_nanos((span.as_nanos() as f64 / d.scale).min(u64::MAX as f64) as u64)
            }
            None => span,
        }
    }

    /// The wall clock's reading, slowed when a scale is set.
    fn dilated(&self, wall: Instant) -> Instant {
        let Some(mut d) = self.dilation.get() else {
            return wall;
        };
        let origin = *d.origin.get_or_insert(wall);
        self.dilation.set(Some(d));
        if wall <= origin {
            return wall;
        }
        origin + Span::from_nanos(((wall - origin).as_nanos() as f64 * d.scale) as u64)
    }

    /// The time now, given the wall clock's reading and a way to read the
    /// monotonic clock (None where the host has none); the step it
    /// absorbed, if any.
    pub fn read(
        &self,
        wall: Instant,
        monotonic: impl FnOnce() -> Option<Instant>,
    ) -> (Instant, Option<Step>) {
        let wall = self.dilated(wall);
        let mut offset = self.offset.get();
        if let Some((last_wall, _)) = self.last.get() {
            // Slew: the offset shrinks by a tenth of the time that passed.
            let slew = i128::from((wall - last_wall).as_nanos()) / SLEW_DIVISOR;
            offset = if offset > 0 {
                (offset - slew).max(0)
            } else {
                (offset + slew).min(0)
            };
            self.offset.set(offset);
        }
        let shifted = i128::from(wall.as_nanos()) + offset;
        let candidate = Instant::from_nanos(shifted.clamp(0, i128::from(u64::MAX)) as u64);
        let anchor = self.anchor.get();
        let last = self.last.get().map(|(_, now)| now);
        let suspect = last.is_some_and(|last| candidate > last && candidate - last > MAX_STEP);
        let stale = anchor.is_none_or(|a| wall < a.wall || wall.since(a.wall) >= ANCHOR_EVERY);
        // A slowed clock (for callgrind) runs apart from real time.
        let monotonic = if (suspect || stale) && self.dilation.get().is_none() {
            monotonic()
        } else {
            None
        };
        let Some(last) = last else {
            self.last.set(Some((wall, candidate)));
            self.anchor_at(wall, monotonic, candidate);
            return (candidate, None);
        };
        let (now, step) = if candidate < last {
            (last, Some(Step::Back(last - candidate)))
        } else if suspect {
            match (anchor, monotonic) {
                (Some(a), Some(m)) => match a.jumped(wall, m) {
                    None => (candidate, None),
                    Some(real) => {
                        let now = (a.now + real).max(last);
                        (now, Some(Step::Forward(candidate - now)))
                    }
                },
                _ => (
                    last + MAX_STEP,
                    Some(Step::Forward(candidate - last - MAX_STEP)),
                ),
            }
        } else {
            (candidate, None)
        };
        if step.is_some() {
            // From now on the wall clock reads as `now` does.
            self.offset
                .set(i128::from(now.as_nanos()) - i128::from(wall.as_nanos()));
        }
        self.last.set(Some((wall, now)));
        self.anchor_at(wall, monotonic, now);
        // The calls the previous reading served: the one that took it, and
        // those that reused it.
        let served = 1 + self.reused.replace(0);
        let dense = step.is_none() && now - last <= DENSE.saturating_mul(u64::from(served));
        self.reuses_left.set(if dense { MAX_REUSES } else { 0 });
        (now, step)
    }

    fn anchor_at(&self, wall: Instant, monotonic: Option<Instant>, now: Instant) {
        if let Some(monotonic) = monotonic {
            self.anchor.set(Some(Anchor {
                wall,
                monotonic,
                now,
            }));
        }
    }
}

/// A host whose clock is the worker's [`Clock`]: everything else goes to
/// the host it wraps.
pub struct Clocked<'a, H: ?Sized> {
    pub host: &'a H,
    pub clock: &'a Clock,
}

impl<H: Host + ?Sized> Host for Clocked<'_, H> {
    fn now(&self) -> Instant {
        let (now, step) = self.clock.read(self.host.now(), || self.host.monotonic());
        if let Some(step) = step {
            self.host.log(
                Level::Warn,
                &format!("sluice: the wall clock stepped ({step:?}); limits keep their own time"),
            );
        }
        now
    }

    fn monotonic(&self) -> Option<Instant> {
        self.host.monotonic()
    }

    fn shared_get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        self.host.shared_get(key)
    }

    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        self.host.shared_set(key, value, cas)
    }

    fn log(&self, level: Level, message: &str) {
        self.host.log(level, message);
    }

    fn define_counter(&self, name: &str) -> Option<u32> {
        self.host.define_counter(name)
    }

    fn define_gauge(&self, name: &str) -> Option<u32> {
        self.host.define_gauge(name)
    }

    fn increment_metric(&self, id: u32, delta: i64) {
        self.host.increment_metric(id, delta);
    }

    fn reply(&self, context_id: u32, status: u32, headers: &[(&str, &str)], body: &[u8]) -> bool {
        self.host.reply(context_id, status, headers, body)
    }

    fn remove_request_header(&self, name: &str) {
        self.host.remove_request_header(name);
    }

    fn set_log_field(&self, context_id: u32, field: &str, value: &str) -> bool {
        self.host.set_log_field(context_id, field, value)
    }

    fn set_request_header(&self, context_id: u32, name: &str, value: &str) -> bool {
        self.host.set_request_header(context_id, name, value)
    }

    fn replace_request_body(&self, old_len: usize, body: &[u8]) -> bool {
        self.host.replace_request_body(old_len, body)
    }

    fn resume(&self, context_id: u32) -> bool {
        self.host.resume(context_id)
    }

    fn set_tick_period(&self, period: Span) {
        self.host.set_tick_period(self.clock.real_span(period));
    }

    fn random_bytes(&self, buf: &mut [u8]) -> bool {
        self.host.random_bytes(buf)
    }

    fn dispatch_http_call(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout: Span,
    ) -> Option<u32> {
        self.host
            .dispatch_http_call(cluster, headers, body, self.clock.real_span(timeout))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: Instant = Instant::from_nanos(1_800_000_000_000_000_000);

    fn ms(n: u64) -> Span {
        Span::from_millis(n)
    }

    /// A host without a monotonic clock.
    fn no_monotonic() -> Option<Instant> {
        None
    }

    /// The monotonic clock's origin: anything, its own.
    const M0: Instant = Instant::from_nanos(5_000_000);

    #[test]
    fn a_pause_in_readings_is_time_that_passed_not_a_step() {
        // An Envoy stopped for 1.9 s: both clocks moved as far.
        let c = Clock::default();
        c.read(T0, || Some(M0));
        let later = T0 + ms(1900);
        assert_eq!(c.read(later, || Some(M0 + ms(1900))), (later, None));
        assert_eq!(
            c.read(later + ms(100), || Some(M0 + ms(2000))).0,
            later + ms(100)
        );
    }

    #[test]
    fn a_step_forward_during_a_pause_moves_the_clock_by_the_real_time() {
        let c = Clock::default();
        c.read(T0, || Some(M0));
        let ahead = T0 + Span::from_secs(3600);
        let (now, step) = c.read(ahead, || Some(M0 + ms(1900)));
        assert_eq!(now, T0 + ms(1900));
        assert_eq!(step, Some(Step::Forward(Span::from_secs(3600) - ms(1900))));
        // Then it slews toward the wall clock, a tenth faster.
        assert_eq!(
            c.read(ahead + ms(100), || Some(M0 + ms(2000))).0,
            T0 + ms(2010)
        );
    }

    #[test]
    fn a_step_forward_within_a_pause_counts_from_the_last_anchor() {
        // Readings 10 ms apart read the monotonic clock once per
        // ANCHOR_EVERY; a later jump measures real time from the last
        // anchor, not from the last reading.
        let c = Clock::default();
        c.read(T0, || Some(M0));
        for i in 1..=15u64 {
            c.read(T0 + ms(10 * i), || Some(M0 + ms(10 * i)));
        }
        let (now, step) = c.read(T0 + Span::from_secs(60), || Some(M0 + ms(650)));
        assert_eq!(now, T0 + ms(650));
        assert!(matches!(step, Some(Step::Forward(_))));
    }

    #[test]
    fn the_monotonic_clock_is_read_once_per_anchor_period() {
        let c = Clock::default();
        let reads = Cell::new(0u32);
        let monotonic = |at: Instant| {
            reads.set(reads.get() + 1);
            Some(at)
        };
        // One second of readings 1 ms apart.
        for i in 0..1000u64 {
            let wall = T0 + ms(i);
            c.read(wall, || monotonic(M0 + ms(i)));
        }
        assert_eq!(reads.get(), 10, "the first reading, then one per 100 ms");
    }

    proptest::proptest! {
        /// Whatever the pauses between readings, while the wall clock
        /// does not step the clock is the wall clock.
        #[test]
        fn without_steps_the_clock_is_the_wall_clock(
            gaps in proptest::collection::vec(0u64..10_000_000_000, 1..60)
        ) {
            let c = Clock::default();
            let (mut wall, mut mono) = (T0, M0);
            c.read(wall, || Some(mono));
            for gap in gaps {
                wall += Span::from_nanos(gap);
                mono += Span::from_nanos(gap);
                proptest::prop_assert_eq!(c.read(wall, || Some(mono)), (wall, None));
            }
        }
    }

    #[test]
    fn follows_the_wall_clock_while_it_behaves() {
        let c = Clock::default();
        assert_eq!(c.read(T0, no_monotonic), (T0, None));
        assert_eq!(c.read(T0 + ms(100), no_monotonic), (T0 + ms(100), None));
        assert_eq!(c.read(T0 + ms(900), no_monotonic), (T0 + ms(900), None));
    }

    #[test]
    fn a_step_back_is_absorbed_and_time_goes_on() {
        let c = Clock::default();
        c.read(T0, no_monotonic);
        let back = T0 - Span::from_secs(3600);
        assert_eq!(
            c.read(back, no_monotonic),
            (T0, Some(Step::Back(Span::from_secs(3600))))
        );
        // Real time passes on the stepped wall clock; the clock follows it,
        // a tenth slower while it slews back toward the wall clock.
        assert_eq!(c.read(back + ms(100), no_monotonic), (T0 + ms(90), None));
    }

    #[test]
    fn a_step_forward_moves_at_most_one_step() {
        let c = Clock::default();
        c.read(T0, no_monotonic);
        let ahead = T0 + Span::from_secs(3600);
        let (now, step) = c.read(ahead, no_monotonic);
        assert_eq!(now, T0 + MAX_STEP);
        assert_eq!(step, Some(Step::Forward(Span::from_secs(3599))));
        // A tenth faster while it catches up.
        assert_eq!(
            c.read(ahead + ms(100), no_monotonic),
            (T0 + MAX_STEP + ms(110), None)
        );
    }

    #[test]
    fn after_a_step_the_clock_slews_back_to_the_wall_clock() {
        let c = Clock::default();
        c.read(T0, no_monotonic);
        let ahead = T0 + Span::from_secs(5);
        c.read(ahead, no_monotonic);
        // Ticks every 100 ms: the 4 s lag shrinks by 10 ms each.
        let mut wall = ahead;
        for _ in 0..400 {
            wall += ms(100);
            c.read(wall, no_monotonic);
        }
        assert_eq!(c.read(wall, no_monotonic).0, wall, "caught up after 40 s");
    }

    #[test]
    fn a_scaled_clock_runs_slower_and_its_spans_take_longer() {
        let c = Clock::default();
        c.set_scale(0.02);
        assert_eq!(c.read(T0, no_monotonic).0, T0);
        assert_eq!(c.read(T0 + Span::from_secs(1), no_monotonic).0, T0 + ms(20));
        assert_eq!(
            c.read(T0 + Span::from_secs(50), no_monotonic).0,
            T0 + Span::from_secs(1)
        );
        assert_eq!(c.real_span(ms(10)), ms(500));
        // Still never back, and garbage does not panic.
        assert_eq!(c.read(T0, no_monotonic).0, T0 + Span::from_secs(1));
        c.read(Instant::MAX, no_monotonic);
        // Stretching a huge span saturates rather than wraps.
        assert_eq!(c.real_span(Span::from_nanos(u64::MAX)).as_nanos(), u64::MAX);
        // Out-of-range scales mean real time.
        for bad in [0.0, -1.0, 1.0, 2.0, f64::NAN, f64::INFINITY] {
            let c = Clock::default();
            c.set_scale(bad);
            assert_eq!(c.real_span(ms(10)), ms(10));
            c.read(T0, no_monotonic);
            assert_eq!(c.read(T0 + ms(100), no_monotonic).0, T0 + ms(100));
        }
    }

    #[test]
    fn a_reading_is_reused_by_a_few_calls_only_while_readings_come_densely() {
        let c = Clock::default();
        assert_eq!(c.reuse(), None, "nothing read yet");
        c.read(T0, no_monotonic);
        assert_eq!(c.reuse(), None, "one reading says nothing of density");
        // Sparse: 10 ms apart.
        c.read(T0 + ms(10), no_monotonic);
        assert_eq!(c.reuse(), None);
        // Dense: 200 µs apart; then MAX_REUSES calls reuse it, however late.
        let dense = T0 + ms(10) + Span::from_nanos(200_000);
        c.read(dense, no_monotonic);
        for _ in 0..MAX_REUSES {
            assert_eq!(c.reuse(), Some(dense));
        }
        assert_eq!(c.reuse(), None, "then the clock is read again");
        // Density is per call: 1.2 ms after a reading four calls used is
        // 300 µs a call (dense); after a reading one call used, it is not.
        let later = dense + Span::from_nanos(1_200_000);
        c.read(later, no_monotonic);
        assert_eq!(c.reuse(), Some(later));
        c.read(later + Span::from_nanos(100_000), no_monotonic);
        c.read(later + Span::from_nanos(1_300_000), no_monotonic);
        assert_eq!(c.reuse(), None);
        // A fresh reading after a pause ends reuse at once.
        let resumed = later + ms(2);
        c.read(resumed, no_monotonic);
        c.read(resumed + Span::from_nanos(100_000), no_monotonic);
        assert_eq!(c.reuse(), Some(resumed + Span::from_nanos(100_000)));
        c.read(resumed + ms(50), no_monotonic);
        assert_eq!(c.reuse(), None);
        // So does a step of the wall clock, even a dense one.
        c.read(resumed + ms(50) + Span::from_nanos(1), no_monotonic);
        c.read(T0, no_monotonic);
        assert_eq!(c.reuse(), None, "a step back is not a dense reading");
    }

    #[test]
    fn never_goes_back_whatever_the_wall_clock_does() {
        let c = Clock::default();
        let mut last = c.read(T0, no_monotonic).0;
        let mut wall = T0;
        for i in 0..1000u64 {
            wall = match i % 7 {
                0 => wall - Span::from_secs(i),
                3 => wall + Span::from_secs(i * 10),
                _ => wall + ms(7),
            };
            let (now, _) = c.read(wall, no_monotonic);
            assert!(now >= last);
            assert!(now - last <= MAX_STEP);
            last = now;
        }
        // Garbage readings do not panic.
        c.read(Instant::EPOCH, no_monotonic);
        c.read(Instant::MAX, no_monotonic);
    }
}
