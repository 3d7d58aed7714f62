//! The clock leases are measured on. The wall clock can be stepped (NTP,
//! an operator, a VM resumed): stepped back, every lease would look longer
//! and room would be given out twice; stepped forward, live leases would
//! look over. So the wall clock is read once, at start, and time moves on
//! by the monotonic clock from there. Replicas each anchor at their own
//! start, so they differ by no more than their wall clocks did then.

use sluice_shared::time::{Instant, Span};

#[derive(Debug, Clone, Copy)]
pub struct MonotonicWall {
    wall_at_start: Instant,
    started: std::time::Instant,
}

impl MonotonicWall {
    /// Anchored at the wall clock now.
    pub fn now_anchored() -> Self {
        Self::anchored(
            Instant::from_system(std::time::SystemTime::now()),
            std::time::Instant::now(),
        )
    }

    /// Anchored at `wall` as read at `started`.
    pub fn anchored(wall: Instant, started: std::time::Instant) -> Self {
        Self {
            wall_at_start: wall,
            started,
        }
    }

    pub fn now(&self) -> Instant {
        self.at(std::time::Instant::now())
    }

    /// The anchor: when this clock started.
    pub fn at_start(&self) -> Instant {
        self.wall_at_start
    }

    /// The time at monotonic instant `then` (never before the anchor).
    pub fn at(&self, then: std::time::Instant) -> Instant {
        self.wall_at_start + Span::from_duration(then.saturating_duration_since(self.started))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn moves_with_the_monotonic_clock_whatever_the_wall_clock_does() {
        let start = std::time::Instant::now();
        let wall = Instant::from_millis(1_800_000_000_000);
        let clock = MonotonicWall::anchored(wall, start);
        assert_eq!(clock.at(start), wall);
        // Five seconds on: five seconds later, though the wall clock may
        // since have been stepped an hour either way.
        let later = start + Duration::from_secs(5);
        assert_eq!(clock.at(later), wall + Span::from_secs(5));
        // Readings never go back, and a reading from before the anchor is
        // the anchor.
        let mut last = clock.at(start);
        for ms in [1, 1, 7, 500, 500, 10_000] {
            let now = clock.at(start + Duration::from_millis(ms));
            assert!(now >= last);
            last = now;
        }
        assert_eq!(
            clock.at(start - Duration::from_millis(1).min(start.elapsed())),
            wall
        );
    }

    #[test]
    fn starts_at_the_wall_clock() {
        let clock = MonotonicWall::now_anchored();
        let wall = Instant::from_system(std::time::SystemTime::now());
        let apart = if clock.now() > wall {
            clock.now() - wall
        } else {
            wall - clock.now()
        };
        assert!(apart < Span::from_secs(1), "{apart:?}");
    }
}
