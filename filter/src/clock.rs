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
//! previous one (a bigger step forward is absorbed the same way). A worker
//! reads the clock at least every tick (100 ms), so real time never moves
//! it as far; only a step of the wall clock, or a VM stalled for longer,
//! does. The workers' clocks then differ by at most about one tick, the
//! precision shared state already lives with. After a step the clock slews
//! back toward the wall clock, by a tenth of the time that passes (as
//! `adjtime` does), so workers that absorbed a step differently, or a VM
//! that stalled, come back in line without ever going back.

use std::cell::Cell;

use sluice_shared::time::{Instant, Span};

use crate::host::{Host, Level, SetError};

/// The most one reading moves the clock ahead of the previous one.
pub const MAX_STEP: Span = Span::from_secs(1);

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

    /// The time now, given the wall clock's reading; the step it absorbed,
    /// if any.
    pub fn read(&self, wall: Instant) -> (Instant, Option<Step>) {
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
        let Some((_, last)) = self.last.get() else {
            self.last.set(Some((wall, candidate)));
            return (candidate, None);
        };
        let (now, step) = if candidate < last {
            (last, Some(Step::Back(last - candidate)))
        } else if candidate - last > MAX_STEP {
            (
                last + MAX_STEP,
                Some(Step::Forward(candidate - last - MAX_STEP)),
            )
        } else {
            (candidate, None)
        };
        if step.is_some() {
            // From now on the wall clock reads as `now` does.
            self.offset
                .set(i128::from(now.as_nanos()) - i128::from(wall.as_nanos()));
        }
        self.last.set(Some((wall, now)));
        // The calls the previous reading served: the one that took it, and
        // those that reused it.
        let served = 1 + self.reused.replace(0);
        let dense = step.is_none() && now - last <= DENSE.saturating_mul(u64::from(served));
        self.reuses_left.set(if dense { MAX_REUSES } else { 0 });
        (now, step)
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
        let (now, step) = self.clock.read(self.host.now());
        if let Some(step) = step {
            self.host.log(
                Level::Warn,
                &format!("sluice: the wall clock stepped ({step:?}); limits keep their own time"),
            );
        }
        now
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

    #[test]
    fn follows_the_wall_clock_while_it_behaves() {
        let c = Clock::default();
        assert_eq!(c.read(T0), (T0, None));
        assert_eq!(c.read(T0 + ms(100)), (T0 + ms(100), None));
        assert_eq!(c.read(T0 + ms(900)), (T0 + ms(900), None));
    }

    #[test]
    fn a_step_back_is_absorbed_and_time_goes_on() {
        let c = Clock::default();
        c.read(T0);
        let back = T0 - Span::from_secs(3600);
        assert_eq!(c.read(back), (T0, Some(Step::Back(Span::from_secs(3600)))));
        // Real time passes on the stepped wall clock; the clock follows it,
        // a tenth slower while it slews back toward the wall clock.
        assert_eq!(c.read(back + ms(100)), (T0 + ms(90), None));
    }

    #[test]
    fn a_step_forward_moves_at_most_one_step() {
        let c = Clock::default();
        c.read(T0);
        let ahead = T0 + Span::from_secs(3600);
        let (now, step) = c.read(ahead);
        assert_eq!(now, T0 + MAX_STEP);
        assert_eq!(step, Some(Step::Forward(Span::from_secs(3599))));
        // A tenth faster while it catches up.
        assert_eq!(c.read(ahead + ms(100)), (T0 + MAX_STEP + ms(110), None));
    }

    #[test]
    fn after_a_step_the_clock_slews_back_to_the_wall_clock() {
        let c = Clock::default();
        c.read(T0);
        let ahead = T0 + Span::from_secs(5);
        c.read(ahead);
        // Ticks every 100 ms: the 4 s lag shrinks by 10 ms each.
        let mut wall = ahead;
        for _ in 0..400 {
            wall += ms(100);
            c.read(wall);
        }
        assert_eq!(c.read(wall).0, wall, "caught up after 40 s");
    }

    #[test]
    fn a_scaled_clock_runs_slower_and_its_spans_take_longer() {
        let c = Clock::default();
        c.set_scale(0.02);
        assert_eq!(c.read(T0).0, T0);
        assert_eq!(c.read(T0 + Span::from_secs(1)).0, T0 + ms(20));
        assert_eq!(c.read(T0 + Span::from_secs(50)).0, T0 + Span::from_secs(1));
        assert_eq!(c.real_span(ms(10)), ms(500));
        // Still never back, and garbage does not panic.
        assert_eq!(c.read(T0).0, T0 + Span::from_secs(1));
        c.read(Instant::MAX);
        // Stretching a huge span saturates rather than wraps.
        assert_eq!(c.real_span(Span::from_nanos(u64::MAX)).as_nanos(), u64::MAX);
        // Out-of-range scales mean real time.
        for bad in [0.0, -1.0, 1.0, 2.0, f64::NAN, f64::INFINITY] {
            let c = Clock::default();
            c.set_scale(bad);
            assert_eq!(c.real_span(ms(10)), ms(10));
            c.read(T0);
            assert_eq!(c.read(T0 + ms(100)).0, T0 + ms(100));
        }
    }

    #[test]
    fn a_reading_is_reused_by_a_few_calls_only_while_readings_come_densely() {
        let c = Clock::default();
        assert_eq!(c.reuse(), None, "nothing read yet");
        c.read(T0);
        assert_eq!(c.reuse(), None, "one reading says nothing of density");
        // Sparse: 10 ms apart.
        c.read(T0 + ms(10));
        assert_eq!(c.reuse(), None);
        // Dense: 200 µs apart; then MAX_REUSES calls reuse it, however late.
        let dense = T0 + ms(10) + Span::from_nanos(200_000);
        c.read(dense);
        for _ in 0..MAX_REUSES {
            assert_eq!(c.reuse(), Some(dense));
        }
        assert_eq!(c.reuse(), None, "then the clock is read again");
        // Density is per call: 1.2 ms after a reading four calls used is
        // 300 µs a call (dense); after a reading one call used, it is not.
        let later = dense + Span::from_nanos(1_200_000);
        c.read(later);
        assert_eq!(c.reuse(), Some(later));
        c.read(later + Span::from_nanos(100_000));
        c.read(later + Span::from_nanos(1_300_000));
        assert_eq!(c.reuse(), None);
        // A fresh reading after a pause ends reuse at once.
        let resumed = later + ms(2);
        c.read(resumed);
        c.read(resumed + Span::from_nanos(100_000));
        assert_eq!(c.reuse(), Some(resumed + Span::from_nanos(100_000)));
        c.read(resumed + ms(50));
        assert_eq!(c.reuse(), None);
        // So does a step of the wall clock, even a dense one.
        c.read(resumed + ms(50) + Span::from_nanos(1));
        c.read(T0);
        assert_eq!(c.reuse(), None, "a step back is not a dense reading");
    }

    #[test]
    fn never_goes_back_whatever_the_wall_clock_does() {
        let c = Clock::default();
        let mut last = c.read(T0).0;
        let mut wall = T0;
        for i in 0..1000u64 {
            wall = match i % 7 {
                0 => wall - Span::from_secs(i),
                3 => wall + Span::from_secs(i * 10),
                _ => wall + ms(7),
            };
            let (now, _) = c.read(wall);
            assert!(now >= last);
            assert!(now - last <= MAX_STEP);
            last = now;
        }
        // Garbage readings do not panic.
        c.read(Instant::EPOCH);
        c.read(Instant::MAX);
    }
}
