//! Pauses in a provider table: one this Envoy's provider asked for, or
//! one another Envoy's did, relayed by the admin (the same pause within a
//! slack, never longer than `max_pause`).

use super::*;

/// A pause that began or grew: when it ends now, and whether it began
/// (none was running) rather than grew. A pause that grows is the same
/// pause: the provider refused again while it ran, or the admin relayed
/// it again with a later end (the sync's trip took longer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PauseSet {
    pub until: Instant,
    pub began: bool,
}

/// Why a limit was paused: the provider's status on the answer that
/// asked for it, and whether another Envoy saw that answer (relayed by
/// the admin in fleet mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PauseWhy {
    /// 0: not said.
    pub status: u16,
    pub relayed: bool,
    /// It ends with a probe (`super::super::probe`): a pool member's
    /// refusal of one attempt began it, heard by the attempts filter.
    pub probe: bool,
    /// It is a probe's hold, not a provider's word: never relayed.
    pub hold: bool,
}

impl ProviderTable {
    /// Until when `owner` is paused at `now` (None: it is not): never
    /// longer than `max_pause` after the pause began, whatever the entry
    /// says, and never for a pause that begins in the future.
    pub fn paused_until(&self, owner: u64, now: Instant, max_pause: Span) -> Option<Instant> {
        let row = self.row(owner)?;
        if row.pause_since > now + CLOCK_SKEW {
            return None;
        }
        let until = row.pause_until.min(row.pause_since + max_pause);
        (until > now).then_some(until)
    }

    /// Pauses `owner` from `now` for `wait`, as this Envoy's provider
    /// asked. Returns whether the table changed.
    pub fn pause(&mut self, owner: u64, now: Instant, wait: Span) -> bool {
        let (changed, _) =
            self.hear_pause(owner, now, wait, PauseWhy::default(), Span::MAX, Span::ZERO);
        changed
    }

    /// A provider answered `why.status` with a wait of `wait` at `now`:
    /// this Envoy's own, or another's relayed by the admin
    /// (`why.relayed`; `max_pause` and `slack` are for relayed news, see
    /// `pause_relayed`). Returns whether the table changed, and what
    /// became of the pause when one began or grew.
    pub fn hear_pause(
        &mut self,
        owner: u64,
        now: Instant,
        wait: Span,
        why: PauseWhy,
        max_pause: Span,
        slack: Span,
    ) -> (bool, Option<PauseSet>) {
        if why.relayed {
            self.pause_relayed(owner, now, wait, why.status, max_pause, slack)
        } else {
            let set = self.pause_here(owner, now, wait, why);
            (set.is_some(), set)
        }
    }

    /// This Envoy's provider paused `owner`: a pause already running
    /// longer is kept. Returns what became of the pause, if it changed.
    pub(super) fn pause_here(
        &mut self,
        owner: u64,
        now: Instant,
        wait: Span,
        why: PauseWhy,
    ) -> Option<PauseSet> {
        let until = now + wait;
        let row = self.row_mut(owner, now);
        let running = row.pause_until > now && row.pause_since <= now + CLOCK_SKEW;
        if !why.relayed {
            // The provider itself refused: relayed news is believed anew.
            row.relayed.reset();
        }
        if running && row.pause_until >= until {
            return None;
        }
        row.pause_since = now;
        row.pause_until = until;
        row.pause_why = why;
        Some(PauseSet {
            until,
            began: !running,
        })
    }

    /// The admin relayed that another Envoy's provider paused `owner` for
    /// `wait` (`status`: its answer). Held at most as long as the stretch
    /// of such news allows ([`RelayedStretch`]); a pause already running
    /// keeps its start, so `max_pause` counts from it. News ending within
    /// `slack` of the last pause's end, running or just over, is that
    /// pause. Returns
    /// whether the table changed, and what became of the pause when one
    /// began or grew.
    pub(super) fn pause_relayed(
        &mut self,
        owner: u64,
        now: Instant,
        wait: Span,
        status: u16,
        max_pause: Span,
        slack: Span,
    ) -> (bool, Option<PauseSet>) {
        let running = self.paused_until(owner, now, max_pause);
        let row = self.row_mut(owner, now);
        // The pause that ran last, running still or just over: news of
        // one ending within `slack` of it is that pause, re-relayed by a
        // sync whose answer left the admin before this Envoy's clock
        // ended it, never a pause of its own.
        let last_end = (row.pause_since <= now + CLOCK_SKEW)
            .then(|| row.pause_until.min(row.pause_since + max_pause));
        let before = row.relayed;
        let heard = row.relayed.hear(now, wait, max_pause);
        let changed = row.relayed != before;
        let Some(until) = heard else {
            return (changed, None);
        };
        if last_end.is_some_and(|end| end + slack >= until) {
            return (changed, None);
        }
        if running.is_none() {
            row.pause_since = now;
        }
        row.pause_until = until;
        row.pause_why = PauseWhy {
            status,
            relayed: true,
            ..PauseWhy::default()
        };
        (
            true,
            Some(PauseSet {
                until,
                began: running.is_none(),
            }),
        )
    }
}
