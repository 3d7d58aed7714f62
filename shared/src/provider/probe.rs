//! A pool member Envoy's retries steered calls away from (its refusals'
//! `Retry-After` went to Envoy's retry, never to Sluice) is paused, and
//! when the pause ends it is probed, as a circuit breaker half-open: one
//! call goes to it while the member stays passed over for as long as it
//! was last paused, and only its own answer to a call opens it to all
//! again. Without this, every worker sent it calls the moment the pause
//! ended, each a retry on the other members beyond their room (a
//! provider's 429 there, and a second of that member paused in turn).
//!
//! Only the limit's row says which: a pause with no status, not relayed,
//! is one Envoy's retry began; one marked `probe` a member's refusal of
//! an attempt began, heard by the attempts filter with its status and
//! wait (the filter's `listened::Hearing::Attempt`: it too ends with a
//! probe, or every worker's calls would go to the member at once, each
//! retried elsewhere if it still refuses). The refusals a provider
//! answered to the deciding filter itself, with or without a wait, carry
//! their status and end without a probe. A probe's hold is marked `hold`:
//! it is no provider's word, and is never relayed to other Envoys (they
//! would wait it out without probing).

use super::table::{ProviderTable, Row};
use crate::time::{Instant, Span};

/// How long the row's pause running (or last run) lasts, when Envoy's
/// retry began it (no status, not relayed) and no answer of the member's
/// own has ended it since (None otherwise): the one test every probe
/// decision starts from.
fn retried_away_pause(row: &Row) -> Option<Span> {
    let last = row.pause_until.since(row.pause_since);
    let why = row.pause_why;
    let probed = !why.relayed && (why.status == 0 || why.probe);
    (probed && !last.is_zero()).then_some(last)
}

impl ProviderTable {
    /// Whether a call to `owner` now would be a probe: its last pause was
    /// Envoy's retry's, and has ended.
    pub fn probe_due(&self, owner: u64, now: Instant) -> bool {
        self.row(owner)
            .is_some_and(|row| retried_away_pause(row).is_some() && row.pause_until <= now)
    }

    /// A call is about to go to `owner`: when a probe is due
    /// ([`Self::probe_due`]), the last pause is begun again for as long,
    /// so that no other call follows this one until its answer
    /// ([`Self::end_probe`]). Returns the hold begun (None: no probe due,
    /// the call goes as any other).
    pub fn begin_probe(&mut self, owner: u64, now: Instant) -> Option<Span> {
        let last = self
            .row(owner)
            .filter(|row| row.pause_until <= now)
            .and_then(retried_away_pause)?;
        let row = self.row_mut(owner, now);
        // The hold begins just before the probe goes: the probe went
        // after it, as a call sent in the very instant a refusal's pause
        // began did not.
        row.pause_since = Instant::from_nanos(now.as_nanos().saturating_sub(1));
        row.pause_until = row.pause_since + last;
        row.pause_why.hold = true;
        Some(last)
    }

    /// The member answered a call sent at `sent` itself: when the call
    /// went after the pause running (or last run) began (the probe), that
    /// pause ends now and its calls go as any other's again; a call that
    /// went before (in flight when the member began refusing) ends
    /// nothing. Returns whether the table changed.
    pub fn end_probe(&mut self, owner: u64, sent: Instant, now: Instant) -> bool {
        let began_before = self
            .row(owner)
            .is_some_and(|row| retried_away_pause(row).is_some() && sent > row.pause_since);
        if !began_before {
            return false;
        }
        let row = self.row_mut(owner, now);
        row.pause_since = now;
        row.pause_until = now;
        true
    }

    /// How long to pass `owner` over when Envoy retried a call sent to it
    /// at `sent` on another member: `first` after a call that went no
    /// later than the pause running (or last run) began (it was in flight
    /// when the member began refusing: the pause stands as it is) or
    /// after one answered by the member itself; twice the last pause, at
    /// most `most`, when the call was the probe (a deployment down for
    /// long is probed ever less often).
    pub fn retried_away_wait(
        &self,
        owner: u64,
        sent: Instant,
        (first, most): (Span, Span),
    ) -> Span {
        self.row(owner)
            .filter(|row| sent > row.pause_since)
            .and_then(retried_away_pause)
            .map_or(first, |last| last.saturating_mul(2).max(first).min(most))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::PauseWhy;

    const NOW: Instant = Instant::from_millis(1_700_000_000_000);
    const CAP: Span = Span::from_secs(300);

    fn secs(s: u64) -> Span {
        Span::from_secs(s)
    }

    #[test]
    fn a_probe_is_due_only_after_a_pause_envoys_retry_began() {
        let mut table = ProviderTable::default();
        assert_eq!(table.begin_probe(0, NOW), None, "never paused");
        table.pause(0, NOW, secs(2));
        assert_eq!(table.begin_probe(0, NOW + secs(1)), None, "still paused");
        let ended = NOW + secs(3);
        assert_eq!(table.begin_probe(0, ended), Some(secs(2)));
        let held = table
            .paused_until(0, ended, CAP)
            .map(|until| until.since(ended));
        assert!(
            held.is_some_and(|h| secs(2) - h <= Span::from_nanos(1)),
            "held for as long as it was paused: {held:?}"
        );
        assert_eq!(
            table.begin_probe(0, ended + Span::from_millis(10)),
            None,
            "one probe at a time"
        );
        // Its hold ends unanswered: another probe is due.
        assert_eq!(table.begin_probe(0, ended + secs(2)), Some(secs(2)));
    }

    #[test]
    fn a_probe_answered_by_the_member_opens_it_to_all() {
        let mut table = ProviderTable::default();
        table.pause(0, NOW, secs(1));
        let probe = NOW + secs(1);
        assert_eq!(table.begin_probe(0, probe), Some(secs(1)));
        let answered = probe + Span::from_millis(150);
        assert!(
            !table.end_probe(0, NOW - Span::from_millis(50), answered),
            "a call in flight before the pause proves nothing"
        );
        assert!(table.end_probe(0, probe, answered));
        assert_eq!(table.paused_until(0, answered, CAP), None);
        assert_eq!(table.begin_probe(0, answered), None, "no probe due");
        assert!(!table.end_probe(0, probe, answered), "nothing to end");
        assert_eq!(ProviderTable::decode(&table.encode()), Some(table));
    }

    #[test]
    fn only_a_failed_probe_doubles_the_pause() {
        const FIRST: Span = Span::from_secs(1);
        const MOST: Span = Span::from_secs(30);
        let mut table = ProviderTable::default();
        assert_eq!(
            table.retried_away_wait(0, NOW, (FIRST, MOST)),
            FIRST,
            "never paused"
        );
        let in_flight = NOW - Span::from_millis(100);
        table.pause(0, NOW, FIRST);
        for sent in [in_flight, NOW] {
            assert_eq!(
                table.retried_away_wait(0, sent, (FIRST, MOST)),
                FIRST,
                "a call in flight when the pause began, or sent in its instant"
            );
        }
        let mut at = NOW;
        for want in [2, 4, 8, 16, 30, 30] {
            at += secs(40);
            let hold = table.begin_probe(0, at).expect("a probe is due");
            let wait = table.retried_away_wait(0, at, (FIRST, MOST));
            assert_eq!(wait, secs(want), "after a hold of {hold:?}");
            table.pause(0, at, wait);
        }
        at += secs(40);
        table.begin_probe(0, at);
        assert!(table.end_probe(0, at, at + Span::from_millis(20)));
        assert_eq!(
            table.retried_away_wait(0, at + secs(1), (FIRST, MOST)),
            FIRST,
            "a refusal after a served call starts over"
        );
    }

    /// A pause an attempt's refusal began (`probe`) keeps its status and
    /// ends with a probe; the probe's hold is marked as such.
    #[test]
    fn an_attempts_pause_ends_with_a_probe_whose_hold_is_marked() {
        let mut table = ProviderTable::default();
        let why = PauseWhy {
            status: 429,
            probe: true,
            ..PauseWhy::default()
        };
        table.hear_pause(0, NOW, secs(30), why, CAP, Span::ZERO);
        assert!(!table.probe_due(0, NOW + secs(29)));
        assert!(table.probe_due(0, NOW + secs(30)));
        assert_eq!(table.begin_probe(0, NOW + secs(30)), Some(secs(30)));
        let state = table.state(0, NOW + secs(31), CAP, None);
        let (_, _, held) = state.paused.expect("held for the probe");
        assert_eq!((held.status, held.probe, held.hold), (429, true, true));
        assert!(table.end_probe(0, NOW + secs(30), NOW + secs(31)));
        assert_eq!(table.paused_until(0, NOW + secs(31), CAP), None);
        assert_eq!(ProviderTable::decode(&table.encode()), Some(table));
    }

    #[test]
    fn a_providers_own_pause_is_never_probed_nor_ended_by_an_answer() {
        let mut table = ProviderTable::default();
        let why = PauseWhy {
            status: 429,
            relayed: false,
            ..PauseWhy::default()
        };
        table.hear_pause(0, NOW, secs(5), why, CAP, Span::ZERO);
        assert!(
            !table.end_probe(0, NOW, NOW + secs(1)),
            "the provider said 5 s"
        );
        assert_eq!(
            table.paused_until(0, NOW + secs(1), CAP),
            Some(NOW + secs(5))
        );
        assert_eq!(table.begin_probe(0, NOW + secs(6)), None);
        let relayed = PauseWhy {
            status: 0,
            relayed: true,
            ..PauseWhy::default()
        };
        let mut table = ProviderTable::default();
        table.hear_pause(0, NOW, secs(5), relayed, CAP, Span::ZERO);
        assert_eq!(table.begin_probe(0, NOW + secs(6)), None);
    }
}
