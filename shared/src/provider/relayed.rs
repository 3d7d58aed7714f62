//! How long news relayed from other Envoys may hold a limit paused.
//!
//! A provider's pause seen first-hand is believed up to the limit's
//! `max_pause`. News of one is second-hand: it comes from whoever holds
//! the sync token, and re-reported at every sync it could renew itself for
//! ever. So relayed news comes in stretches: news heard less than
//! `max_pause` after the news before belongs to the same stretch, and a
//! stretch holds the limit at most `max_pause` from its first news. A
//! stretch ends only when the news goes quiet for `max_pause` (a real
//! pause's news stops when the pause does), or when the limit sees a
//! refusal first-hand (the provider itself confirms: see
//! [`RelayedStretch::reset`]).
//!
//! One rule, kept by the admin for what it relays and by every Envoy for
//! what it takes: news re-reported without end holds the limit for
//! `max_pause` in total; news that stops and starts again holds it at most
//! half the time.

use crate::time::{Instant, Span};

/// One limit's stretch of relayed pause news.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RelayedStretch {
    /// When the stretch's first news was heard (`EPOCH`: none yet).
    pub began: Instant,
    /// When news was last heard, taken or not.
    pub heard: Instant,
}

impl RelayedStretch {
    /// News of a pause of `wait` heard at `now`: until when it may hold
    /// the limit, None when this stretch has held it `max_pause` already.
    pub fn hear(&mut self, now: Instant, wait: Span, max_pause: Span) -> Option<Instant> {
        if self.begins_anew(now, max_pause) {
            self.began = now;
        }
        self.heard = self.heard.max(now);
        let until = (now + wait).min(self.began + max_pause);
        (until > now).then_some(until)
    }

    /// Whether news heard at `now` begins a stretch: none was heard yet,
    /// or none for `max_pause`. A clock gone back is the same stretch,
    /// never a fresh one.
    pub fn begins_anew(&self, now: Instant, max_pause: Span) -> bool {
        self.heard == Instant::EPOCH || self.heard + max_pause <= now
    }

    /// The limit saw a refusal first-hand: the next news begins a stretch
    /// of its own.
    pub fn reset(&mut self) {
        *self = Self::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const T0: Instant = Instant::from_millis(1_700_000_000_000);
    const MAX: Span = Span::from_secs(2);

    fn ms(n: u64) -> Span {
        Span::from_millis(n)
    }

    #[test]
    fn news_renewed_at_every_sync_holds_for_max_pause_in_total() {
        let mut stretch = RelayedStretch::default();
        let mut held = Span::ZERO;
        // A minute of syncs every 200 ms, each saying "60 s more".
        for i in 0..300 {
            let now = T0 + ms(200 * i);
            if let Some(until) = stretch.hear(now, Span::from_secs(60), MAX) {
                held = held.max(until.since(T0));
            }
        }
        assert_eq!(held, MAX);
    }

    #[test]
    fn news_that_went_quiet_begins_a_new_stretch_and_a_first_hand_refusal_too() {
        let mut stretch = RelayedStretch::default();
        assert_eq!(stretch.hear(T0, ms(1500), MAX), Some(T0 + ms(1500)));
        // Heard again within max_pause: the same stretch, capped.
        assert_eq!(
            stretch.hear(T0 + ms(1600), ms(1500), MAX),
            Some(T0 + ms(2000))
        );
        assert_eq!(stretch.hear(T0 + ms(2100), ms(1500), MAX), None);
        // Quiet for max_pause: a new provider pause is news again.
        let later = T0 + ms(2100) + MAX;
        assert_eq!(stretch.hear(later, ms(500), MAX), Some(later + ms(500)));
        // Before it went quiet, the limit's own refusal: fresh again.
        let mut stretch = RelayedStretch::default();
        stretch.hear(T0, ms(5000), MAX);
        stretch.hear(T0 + ms(1000), ms(5000), MAX);
        assert_eq!(stretch.hear(T0 + ms(2500), ms(1000), MAX), None);
        stretch.reset();
        assert_eq!(
            stretch.hear(T0 + ms(2600), ms(1000), MAX),
            Some(T0 + ms(3600))
        );
    }

    proptest! {
        /// However news comes (any times, any waits, clocks going back),
        /// a stretch never holds past its first news plus max_pause, and
        /// news that never goes quiet holds at most max_pause after the
        /// first.
        #[test]
        fn a_stretch_never_holds_past_max_pause_from_its_start(
            steps in proptest::collection::vec((0u64..3000, 0u64..100_000), 1..200),
        ) {
            let mut stretch = RelayedStretch::default();
            let mut now = T0;
            let mut first: Option<Instant> = None;
            for (gap, wait) in steps {
                // Gaps shorter than max_pause: never quiet after the first.
                now += ms(gap % 1999);
                let until = stretch.hear(now, ms(wait), MAX);
                let start = *first.get_or_insert(now);
                if let Some(until) = until {
                    prop_assert!(until <= start + MAX);
                    prop_assert!(until > now);
                }
            }
        }
    }
}
