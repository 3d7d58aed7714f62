//! A provider whose window slides: what a call used comes back one window
//! after the call went, not all at once at a reset. Its answers say so
//! by their reset: a fixed window's reset stays put until the window
//! turns (then jumps a whole window), while a sliding window's (or a
//! token bucket's, "when the count is whole again") moves on with every
//! call. Once that is seen, Sluice keeps the window itself: every token
//! it sent, by when it went ([`SentWindow`]), plus what the provider
//! counted that Sluice did not send (`other`, from each answer). A
//! count that is only the provider's "remaining until the reset",
//! spread evenly to the reset, would leave unused all that frees on the
//! way (measured: 71-74 % of a sliding quota).
//!
//! Taking a fixed window for a sliding one stays within the provider's
//! limit: Sluice then holds each token a whole window, at least as long
//! as any fixed window does (see the property test in the table).

use crate::time::{Instant, Span};

/// Slots of the sent-token ring: a token counts until its slot's end
/// plus the window, at most a slot (1/31 of the window) after the
/// provider frees it.
pub const SLOTS: usize = 32;
const SLOTS_U64: u64 = SLOTS as u64;
/// A window shorter than this is not watched: resets in whole seconds
/// (IETF `t`, epoch seconds) cannot tell a moving end from rounding in
/// it.
pub const MIN_WINDOW: Span = Span::from_secs(10);
/// How far an answer's reset must move past the last one seen to count
/// as moving: more than two whole-second roundings.
pub const MOVE_MIN: Span = Span::from_secs(2);
/// Moves seen in a row before the window is taken as sliding.
pub const EVIDENCE: u8 = 2;

/// What Sluice sent to one provider limit over its last window, in
/// [`SLOTS`] slots of `window / (SLOTS - 1)` each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SentWindow {
    /// The newest slot written, counted from the epoch.
    pub head: u64,
    pub slots: [u64; SLOTS],
}

fn slot_len(window: Span) -> Option<u64> {
    // Rounded up: a slot's tokens never free before the provider's.
    (window >= MIN_WINDOW).then(|| window.as_nanos().div_ceil(SLOTS_U64 - 1))
}

impl SentWindow {
    /// The slot `now` falls in, and whether `head` is believable beside
    /// it (a head further ahead than a slot of clock skew was written by
    /// no worker: the ring reads as empty).
    fn at(&self, now: Instant, window: Span) -> Option<(u64, bool)> {
        let len = slot_len(window)?;
        let slot = now.as_nanos() / len;
        Some((slot, self.head <= slot.saturating_add(1)))
    }

    /// Counts `cost` tokens sent at `now`.
    pub fn add(&mut self, now: Instant, window: Span, cost: u64) {
        let Some((slot, sane)) = self.at(now, window) else {
            return;
        };
        if !sane || slot.saturating_sub(self.head) >= SLOTS_U64 {
            self.slots = [0; SLOTS];
            self.head = slot;
        }
        while self.head < slot {
            self.head += 1;
            self.slots[(self.head % SLOTS_U64) as usize] = 0;
        }
        // A worker whose clock reads a little behind another's writes
        // into the newest slot: freed a little later, never earlier.
        let i = (self.head % SLOTS_U64) as usize;
        self.slots[i] = self.slots[i].saturating_add(cost);
    }

    /// A call that went at `at` counted `from` tokens and used `to`: its
    /// slot holds the difference, while the ring still holds the slot.
    pub fn settle(&mut self, at: Instant, window: Span, from: u64, to: u64) {
        let Some(len) = slot_len(window) else {
            return;
        };
        let slot = at.as_nanos() / len;
        if slot > self.head || self.head - slot >= SLOTS_U64 {
            return;
        }
        let i = (slot % SLOTS_U64) as usize;
        self.slots[i] = self.slots[i].saturating_sub(from).saturating_add(to);
    }

    /// Takes back `cost` tokens of a call that did not go after all,
    /// from the newest slots.
    pub fn remove(&mut self, cost: u64) {
        let mut left = cost;
        for back in 0..SLOTS_U64 {
            let i = (self.head.wrapping_sub(back) % SLOTS_U64) as usize;
            let taken = self.slots[i].min(left);
            self.slots[i] -= taken;
            left -= taken;
            if left == 0 {
                break;
            }
        }
    }

    /// The counted slots at `now`, oldest first: (slot number, tokens).
    fn counted(&self, now: Instant, window: Span) -> impl Iterator<Item = (u64, u64)> + '_ {
        let (oldest, head) = match self.at(now, window) {
            Some((slot, true)) => (
                slot.saturating_sub(SLOTS_U64 - 1)
                    .max(self.head.saturating_sub(SLOTS_U64 - 1)),
                self.head,
            ),
            _ => (1, 0),
        };
        (oldest..=head).map(|s| (s, self.slots[(s % SLOTS_U64) as usize]))
    }

    /// Tokens sent within the window before `now` (a slot's tokens count
    /// until its end plus the window).
    pub fn in_window(&self, now: Instant, window: Span) -> u64 {
        self.counted(now, window)
            .fold(0u64, |sum, (_, tokens)| sum.saturating_add(tokens))
    }

    /// When at most `keep` of the tokens counted at `now` still count
    /// (None: not before more is sent, never by this ring alone).
    pub fn down_to(&self, now: Instant, window: Span, keep: u64) -> Option<Instant> {
        let len = slot_len(window)?;
        let mut left = self.in_window(now, window);
        if left <= keep {
            return Some(now);
        }
        for (slot, tokens) in self.counted(now, window) {
            left = left.saturating_sub(tokens);
            if left <= keep {
                let freed = slot.saturating_add(SLOTS_U64).saturating_mul(len);
                return Some(Instant::from_nanos(freed).max(now));
            }
        }
        None
    }

    pub fn words(&self) -> [u64; SLOTS + 1] {
        let mut out = [0; SLOTS + 1];
        out[0] = self.head;
        out[1..].copy_from_slice(&self.slots);
        out
    }

    pub fn from_words(words: [u64; SLOTS + 1]) -> Self {
        let mut slots = [0; SLOTS];
        slots.copy_from_slice(&words[1..]);
        Self {
            head: words[0],
            slots,
        }
    }
}

/// Whether answers' resets move with the calls: `end_seen` the last reset
/// that counted, `moves` how many moved in a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EndWatch {
    pub end_seen: Instant,
    pub moves: u8,
}

impl EndWatch {
    /// `moves` as a word; more than the evidence needed reads as that.
    pub fn word(&self) -> u64 {
        u64::from(self.moves)
    }

    pub fn from_word(word: u64) -> Self {
        Self {
            end_seen: Instant::EPOCH,
            moves: u8::try_from(word).unwrap_or(u8::MAX).min(EVIDENCE),
        }
    }

    /// An answer (newer than any followed) says the count is whole again
    /// at `end`. Returns whether anything changed.
    pub fn saw(&mut self, end: Instant, window: Span) -> bool {
        if window < MIN_WINDOW {
            return false;
        }
        let before = *self;
        if self.end_seen == Instant::EPOCH || end + MOVE_MIN < self.end_seen {
            // The first reset seen, or one that came back (the window
            // emptied and began again): watched from here.
            self.end_seen = end;
        } else if end > self.end_seen {
            let moved = end.since(self.end_seen);
            if moved > MOVE_MIN {
                // A move of half a window or more is a fixed window
                // turning, or a sliding one heard from again after a
                // while (calls held back): evidence of neither. (Taking
                // a fixed window for a sliding one stays within it.)
                if moved < window.div(2) {
                    self.moves = self.moves.saturating_add(1).min(EVIDENCE);
                }
                self.end_seen = end;
            }
        }
        *self != before
    }

    pub fn slides(&self) -> bool {
        self.moves >= EVIDENCE
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const NOW: Instant = Instant::from_millis(1_700_000_000_000);
    const W: Span = Span::from_secs(60);

    #[test]
    fn a_token_counts_for_a_window_and_at_most_a_slot_more() {
        let mut sent = SentWindow::default();
        sent.add(NOW, W, 10);
        sent.add(NOW + Span::from_secs(30), W, 5);
        assert_eq!(sent.in_window(NOW + Span::from_secs(59), W), 15);
        let slot = Span::from_secs(4);
        assert_eq!(sent.in_window(NOW + W + slot, W), 5, "freed within a slot");
        let freed = sent.down_to(NOW + Span::from_secs(31), W, 5);
        assert!(freed.is_some_and(|t| t >= NOW + W && t <= NOW + W + slot));
        assert_eq!(sent.in_window(NOW + Span::from_secs(95), W), 0);
        assert_eq!(sent.down_to(NOW, W, 100), Some(NOW));
    }

    #[test]
    fn short_windows_are_not_kept_and_taken_back_tokens_free_at_once() {
        let mut sent = SentWindow::default();
        sent.add(NOW, Span::from_secs(1), 10);
        assert_eq!(sent.in_window(NOW, Span::from_secs(1)), 0);
        sent.add(NOW, W, 10);
        sent.add(NOW + Span::from_secs(5), W, 3);
        sent.remove(5);
        assert_eq!(sent.in_window(NOW + Span::from_secs(5), W), 8);
    }

    #[test]
    fn a_settled_call_holds_what_it_used_in_its_slot_while_the_ring_has_it() {
        let mut sent = SentWindow::default();
        sent.add(NOW, W, 800);
        sent.add(NOW + Span::from_secs(20), W, 800);
        // The first used 300 of its 800, the second 1 000.
        sent.settle(NOW, W, 800, 300);
        sent.settle(NOW + Span::from_secs(20), W, 800, 1_000);
        assert_eq!(sent.in_window(NOW + Span::from_secs(30), W), 1_300);
        assert_eq!(sent.in_window(NOW + Span::from_secs(65), W), 1_000);
        // A call whose slot has left the ring, or from no worker's
        // clock, changes nothing.
        sent.settle(NOW, W, 300, 0);
        sent.settle(NOW + Span::from_secs(3_600), W, 0, 5);
        assert_eq!(sent.in_window(NOW + Span::from_secs(65), W), 1_000);
    }

    #[test]
    fn a_head_from_the_future_reads_as_nothing_sent() {
        let sent = SentWindow {
            head: u64::MAX,
            slots: [u64::MAX; SLOTS],
        };
        assert_eq!(sent.in_window(NOW, W), 0);
        let mut written = sent;
        written.add(NOW, W, 7);
        assert_eq!(written.in_window(NOW, W), 7);
    }

    #[test]
    fn resets_that_move_with_calls_slide_and_a_turning_window_does_not() {
        let mut watch = EndWatch::default();
        for s in 0..4 {
            watch.saw(NOW + W + Span::from_secs(3 * s), W);
        }
        assert!(watch.slides());
        // A fixed window: the same end (whole-second jitter, written
        // nowhere), then a turn.
        let mut fixed = EndWatch::default();
        assert!(fixed.saw(NOW, W));
        for ms in [900, 400, 1000, 0] {
            assert!(!fixed.saw(NOW + Span::from_millis(ms), W));
        }
        fixed.saw(NOW + W, W);
        fixed.saw(NOW + W + Span::from_millis(700), W);
        assert!(!fixed.slides());
        // Short windows are never watched.
        let mut short = EndWatch::default();
        for s in 0..10 {
            short.saw(NOW + Span::from_secs(3 * s), Span::from_secs(5));
        }
        assert!(!short.slides());
    }

    proptest! {
        /// Whatever is sent when, the ring counts every token for at
        /// least the window after it went, and none longer than a slot
        /// past that.
        #[test]
        fn tokens_count_a_window_and_no_more_than_a_slot_beyond(
            sends in proptest::collection::vec((0u64..200_000, 1u64..1000), 1..60),
            probe_ms in 0u64..300_000,
        ) {
            let mut sorted = sends;
            sorted.sort();
            let mut sent = SentWindow::default();
            for (at, cost) in &sorted {
                sent.add(NOW + Span::from_millis(*at), W, *cost);
            }
            let last = sorted.last().map_or(0, |s| s.0);
            let probe = last + probe_ms;
            let now = NOW + Span::from_millis(probe);
            let must: u64 = sorted.iter().filter(|(at, _)| at + 60_000 > probe).map(|s| s.1).sum();
            let may: u64 = sorted.iter().filter(|(at, _)| at + 64_000 > probe).map(|s| s.1).sum();
            let counted = sent.in_window(now, W);
            prop_assert!(counted >= must, "{} < {}", counted, must);
            prop_assert!(counted <= may, "{} > {}", counted, may);
        }
    }
}
