//! What Sluice learned from a provider about one limit (or one group of a
//! keyed limit's keys), as kept in shared data for every worker: pauses
//! the provider asked for, and the provider's own count of what is left.
//!
//! Following the count: the answer to call X says `remaining` R as the
//! provider counted when it answered X. Calls Sluice admitted after X may
//! not be in R yet, so the calls that may still go before the provider's
//! reset are R minus those admitted since X (each row counts the tokens
//! it admitted, `admitted`; a call remembers the count when it went). An
//! answer replaces what an answer to an earlier call said, never what a
//! later one said, so any number of workers reading answers in any order
//! converge on the newest without subtracting the same calls twice.

use super::adaptive::{Adaptive, AdaptiveLimit, Heard, Throttle, PACE_SKEW, RELAYED_CUT_FRESH};
use super::relayed::RelayedStretch;
use super::sliding::{EndWatch, SentWindow, SLOTS};
use crate::time::{Instant, Span};

/// One owner's row: its key's hash (0 for an unkeyed limit).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Row {
    pub owner: u64,
    pub pause_since: Instant,
    pub pause_until: Instant,
    /// Why the pause running (or last run) began.
    pub pause_why: PauseWhy,
    /// Tokens admitted while following the provider's count.
    pub admitted: u64,
    /// Tokens that may still go before `allowance_until` (the provider's
    /// reset), as the newest answer said.
    pub allowance: u64,
    pub allowance_until: Instant,
    /// `admitted` when the call whose answer set the allowance went.
    pub allowance_from: u64,
    /// The provider's limit per window, once an answer said it (0: not
    /// said): when the reset passes, that much is expected again.
    pub provider_limit: u64,
    pub window: Span,
    /// What is allowed goes evenly until the reset (so that others sharing
    /// the provider's quota find some left): the next call goes at
    /// `pace_next`, each token pushing it `pace_every` further.
    pub pace_next: Instant,
    pub pace_every: Span,
    /// The rate learned from refusals (`adaptive`).
    pub adaptive: Adaptive,
    /// The stretch of pause news other Envoys' providers gave it.
    pub relayed: RelayedStretch,
    /// What went over the last window, and whether the provider's window
    /// slides (see `sliding`): then what may go is the provider's limit
    /// less what went within a window and `other`, what the provider
    /// counted that Sluice did not send (until the reset).
    pub sent: SentWindow,
    pub watch: EndWatch,
    pub other: u64,
    /// What the ring held beyond the provider's count at the last answer
    /// followed (estimates of calls not yet settled, a slot's rounding):
    /// a settled call's estimate above its use repays this before it
    /// goes to `other`.
    pub overcount: u64,
    /// The count in force is a guess made when a reset passed (the
    /// provider's limit again), not an answer's: until an answer about
    /// the new window says otherwise, what Sluice sent within the last
    /// window also holds (a reset that said when the oldest tokens free
    /// frees only those).
    pub rolled_over: bool,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct ProviderTable {
    rows: Vec<Row>,
}

/// How far ahead of a reader's clock a pause may have begun: the workers'
/// clocks differ by about one tick; a pause "beginning" later than this
/// was written by no worker and is ignored.
pub const CLOCK_SKEW: Span = Span::from_secs(1);

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
}

impl PauseWhy {
    const RELAYED: u64 = 1 << 16;

    fn word(self) -> u64 {
        u64::from(self.status) | if self.relayed { Self::RELAYED } else { 0 }
    }

    fn from_word(word: u64) -> Self {
        PauseWhy {
            status: (word & 0xffff) as u16,
            relayed: word & Self::RELAYED != 0,
        }
    }
}

/// What one row says now, for reports: the provider's count, a pause in
/// force, the adapted rate.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RowState {
    /// Tokens the provider's count still allows before its reset (None:
    /// no count in force).
    pub remaining: Option<u64>,
    /// That reset.
    pub count_until: Option<Instant>,
    /// The provider's limit per window, once said.
    pub provider_limit: Option<u64>,
    /// The pause in force: since when, until when, and why.
    pub paused: Option<(Instant, Instant, PauseWhy)>,
    /// The adapted rate per second (None: the limit's own rate holds).
    pub rate: Option<f64>,
    /// When the rate was last cut.
    pub cut_at: Option<Instant>,
}

/// What the provider's count says of a call about to go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Allowed {
    /// It may go; `admitted` is the row's count with it (remembered by the
    /// call, for its answer).
    Yes { admitted: u64 },
    /// The provider has nothing left for it until `until`.
    No { until: Instant },
}

/// The provider's count as one answer gave it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Count {
    pub remaining: u64,
    /// When the provider's count is full again.
    pub reset_in: Span,
    /// Its limit per `window`, when it says it.
    pub limit: Option<u64>,
    pub window: Span,
}

/// How many tokens ahead of an even pace calls may go: a few calls that
/// arrive together are not refused for it.
pub const PACE_AHEAD: u64 = 4;
impl Row {
    /// Whether the provider's window slides, and its limit is known.
    fn slides(&self) -> bool {
        self.provider_limit > 0 && self.watch.slides()
    }

    /// What a sliding window holds at `now`: Sluice's own tokens within
    /// it and the others' the last answer counted (gone at the reset).
    fn window_used(&self, now: Instant) -> u64 {
        let other = if self.allowance_until > now {
            self.other
        } else {
            0
        };
        self.sent.in_window(now, self.window).saturating_add(other)
    }

    /// When a sliding window has room for `cost` (None: never, as
    /// things stand).
    fn window_room_at(&self, now: Instant, cost: u64) -> Option<Instant> {
        let keep = |other: u64| self.provider_limit.checked_sub(cost)?.checked_sub(other);
        let with_other = keep(self.other).and_then(|k| self.sent.down_to(now, self.window, k));
        let after_reset = keep(0)
            .and_then(|k| self.sent.down_to(now, self.window, k))
            .map(|at| at.max(self.allowance_until));
        match (with_other, after_reset) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// An answer to a call that went at `admitted`, `since` tokens ago,
    /// says `remaining` until `until`, of a sliding window: what it
    /// counted beyond Sluice's own tokens is others'. Returns whether
    /// that is worth writing (others' share changed, or the reset moved
    /// on past the watch's step).
    fn follow_window(
        &mut self,
        (admitted, since): (u64, u64),
        remaining: u64,
        until: Instant,
        now: Instant,
    ) -> bool {
        let ours = self.sent.in_window(now, self.window).saturating_sub(since);
        let counted = self.provider_limit.saturating_sub(remaining);
        let other = counted.saturating_sub(ours);
        self.overcount = ours.saturating_sub(counted);
        let worth = other != self.other || until > self.allowance_until + super::sliding::MOVE_MIN;
        self.other = other;
        self.allowance = remaining.saturating_sub(since);
        self.allowance_until = self.allowance_until.max(until);
        self.allowance_from = admitted;
        worth
    }

    /// A call the answer last followed counted as the provider did (what
    /// it used, or nothing: a 429) settled from `estimate` to `used`
    /// while the ring held its estimate: what the ring now drops (or
    /// gains) was in the others' part the answer left, unless it was in
    /// what the ring held beyond the provider's count. Else a settled
    /// call made room the provider does not have: each refused call's
    /// estimate back let the next one go into the full window (the
    /// simulator: 787 of 1 242 calls refused, 7 a second per key).
    fn settle_counted(&mut self, estimate: u64, used: u64) {
        if estimate >= used {
            let dropped = estimate - used;
            let repaid = dropped.min(self.overcount);
            self.overcount -= repaid;
            self.other = self.other.saturating_add(dropped - repaid);
        } else {
            let gained = used - estimate;
            let taken = gained.min(self.other);
            self.other -= taken;
            self.overcount = self.overcount.saturating_add(gained - taken);
        }
    }

    /// Past the reset of a provider that said its limit: its next window
    /// holds that limit again, paced over the window.
    fn roll_over(&mut self, now: Instant) {
        if self.slides()
            || self.allowance_until > now
            || self.allowance_until == Instant::EPOCH
            || self.provider_limit == 0
            || self.window.is_zero()
        {
            return;
        }
        let behind = now.since(self.allowance_until).as_nanos();
        let windows = behind / self.window.as_nanos() + 1;
        let start = self.allowance_until + self.window.saturating_mul(windows - 1);
        self.allowance_until = start + self.window;
        self.allowance = self.provider_limit;
        self.pace_every = self.window.div(self.provider_limit);
        self.pace_next = start;
        self.rolled_over = true;
    }

    /// Whether a call of `cost` finds the tokens Sluice sent within the
    /// last window leaving room, while the count is a roll-over's guess:
    /// Err(when they will).
    fn room_after_roll_over(&self, now: Instant, cost: u64) -> Result<(), Instant> {
        if !self.rolled_over
            || self.sent.in_window(now, self.window).saturating_add(cost) <= self.provider_limit
        {
            return Ok(());
        }
        Err(self
            .provider_limit
            .checked_sub(cost)
            .and_then(|keep| self.sent.down_to(now, self.window, keep))
            .unwrap_or(self.allowance_until))
    }
}

/// The bit of a row's watch word that holds `rolled_over` (the watch's
/// own count of moves takes the low byte).
const ROLLED_OVER_BIT: u32 = 32;

impl ProviderTable {
    pub const MAX_ROWS: usize = 8;
    const VERSION: u8 = 10;
    const ROW_LEN: usize = (15 + Adaptive::WORDS + 3 + SLOTS + 1) * 8;

    pub fn rows(&self) -> &[Row] {
        &self.rows
    }

    pub fn row(&self, owner: u64) -> Option<&Row> {
        self.rows.iter().find(|r| r.owner == owner)
    }

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
        let (changed, _) = self.hear_pause(
            owner,
            (now, wait),
            PauseWhy::default(),
            (Span::MAX, Span::ZERO),
        );
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
        (now, wait): (Instant, Span),
        why: PauseWhy,
        (max_pause, slack): (Span, Span),
    ) -> (bool, Option<PauseSet>) {
        if why.relayed {
            self.pause_relayed(owner, (now, wait), why.status, (max_pause, slack))
        } else {
            let set = self.pause_here(owner, now, wait, why);
            (set.is_some(), set)
        }
    }

    /// This Envoy's provider paused `owner`: a pause already running
    /// longer is kept. Returns what became of the pause, if it changed.
    fn pause_here(
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
    /// keeps its start, so `max_pause` counts from it. A pause running
    /// to within `slack` of the news' end is the same pause. Returns
    /// whether the table changed, and what became of the pause when one
    /// began or grew.
    fn pause_relayed(
        &mut self,
        owner: u64,
        (now, wait): (Instant, Span),
        status: u16,
        (max_pause, slack): (Span, Span),
    ) -> (bool, Option<PauseSet>) {
        let running = self.paused_until(owner, now, max_pause);
        let row = self.row_mut(owner, now);
        let before = row.relayed;
        let heard = row.relayed.hear(now, wait, max_pause);
        let changed = row.relayed != before;
        let Some(until) = heard else {
            return (changed, None);
        };
        if running.is_some_and(|r| r + slack >= until) {
            return (changed, None);
        }
        if running.is_none() {
            row.pause_since = now;
        }
        row.pause_until = until;
        row.pause_why = PauseWhy {
            status,
            relayed: true,
        };
        (
            true,
            Some(PauseSet {
                until,
                began: running.is_none(),
            }),
        )
    }

    /// A provider refused a call at `at` (by this Envoy's clock;
    /// `heard`: this Envoy's call or another's; `throttle`: the limit's
    /// own rate and period, and the wait the refusal asked for): the
    /// adapted rate is cut, once per overload, and for relayed news only
    /// while it is fresh. Returns whether it was.
    pub fn throttled(
        &mut self,
        owner: u64,
        (heard, at): (Heard, Instant),
        now: Instant,
        throttle: Throttle,
    ) -> bool {
        if heard == Heard::Relayed && at + RELAYED_CUT_FRESH < now {
            return false;
        }
        let row = self.row_mut(owner, now);
        let now_admitted = row.admitted;
        row.adaptive
            .throttled(at.min(now), heard, now_admitted, throttle)
    }

    /// What `owner`'s row says at `now` (`max_pause`: the limit's cap;
    /// `full`: its own rate per second, when it adapts).
    pub fn state(&self, owner: u64, now: Instant, max_pause: Span, full: Option<f64>) -> RowState {
        let Some(row) = self.row(owner) else {
            return RowState::default();
        };
        let counted = row.allowance_until > now;
        let remaining = if row.slides() {
            Some(row.provider_limit.saturating_sub(row.window_used(now)))
        } else {
            counted.then_some(row.allowance)
        };
        RowState {
            remaining,
            count_until: counted.then_some(row.allowance_until),
            provider_limit: (row.provider_limit > 0).then_some(row.provider_limit),
            paused: self
                .paused_until(owner, now, max_pause)
                .map(|until| (row.pause_since, until, row.pause_why)),
            rate: full.and_then(|f| row.adaptive.rate(now, f)),
            cut_at: (row.adaptive.cut_at > Instant::EPOCH).then_some(row.adaptive.cut_at),
        }
    }

    /// Whether a call costing `cost` may go by the provider's count, and
    /// if so counts it. Past the reset, a provider that said its limit has
    /// that much again for its next window; one that did not allows
    /// anything (the limit's own rate decides) until its next answer.
    ///
    /// `adaptive`: the limit's own rate and period, when it adapts to
    /// refusals: the call must also fit the adapted pace.
    pub fn admit(
        &mut self,
        owner: u64,
        now: Instant,
        cost: u64,
        adaptive: Option<AdaptiveLimit>,
    ) -> Allowed {
        let row = self.row_mut(owner, now);
        row.roll_over(now);
        let slides = row.slides();
        // A sliding window needs no pace: what it frees is what went a
        // window ago.
        let counted = !slides && row.allowance_until > now;
        let ahead = row.pace_every.saturating_mul(PACE_AHEAD).max(PACE_SKEW);
        if slides && row.window_used(now).saturating_add(cost) > row.provider_limit {
            return Allowed::No {
                until: row.window_room_at(now, cost).unwrap_or(now + row.window),
            };
        }
        if counted {
            if row.allowance < cost {
                return Allowed::No {
                    until: row.allowance_until,
                };
            }
            if let Err(until) = row.room_after_roll_over(now, cost) {
                return Allowed::No { until };
            }
            if row.pace_next > now + ahead {
                return Allowed::No {
                    until: Instant::from_nanos(row.pace_next.as_nanos() - ahead.as_nanos()),
                };
            }
        }
        if let Some(limit) = adaptive {
            row.adaptive.resuming(now, row.admitted);
            if let Err(until) = row.adaptive.admit(now, cost, limit.full) {
                return Allowed::No { until };
            }
            row.adaptive.mark_window(now, limit.period, row.admitted);
            row.adaptive.sent(now, cost);
        }
        if counted {
            row.allowance -= cost;
            row.pace_next = row.pace_next.max(now) + row.pace_every.saturating_mul(cost);
        }
        let window = row.window;
        row.sent.add(now, window, cost);
        row.admitted = row.admitted.saturating_add(cost);
        Allowed::Yes {
            admitted: row.admitted,
        }
    }

    /// A call that went (when the row's count was `admitted`, with it)
    /// did not after all: its tokens go back to the allowance it took
    /// them from, if that allowance still holds.
    pub fn give_back(&mut self, owner: u64, admitted: u64, cost: u64, now: Instant) {
        if let Some(row) = self.rows.iter_mut().find(|r| r.owner == owner) {
            row.sent.remove(cost);
            row.adaptive.given_back(admitted, cost);
            if row.allowance_until > now && row.allowance_from < admitted {
                row.allowance = row.allowance.saturating_add(cost);
                let back = row.pace_every.saturating_mul(cost).as_nanos();
                row.pace_next =
                    Instant::from_nanos(row.pace_next.as_nanos().saturating_sub(back)).max(now);
            }
        }
    }

    /// A call that went at `sent` with the row's count at `admitted` was
    /// counted `estimate` tokens and, its answer read, used `used`: what
    /// Sluice keeps of the provider's count holds what it used (a window
    /// Sluice keeps, or a count in force that took the estimate off).
    /// Returns whether the row changed.
    pub fn settle(
        &mut self,
        owner: u64,
        (admitted, sent): (u64, Instant),
        (estimate, used): (u64, u64),
        now: Instant,
    ) -> bool {
        let Some(row) = self.rows.iter_mut().find(|r| r.owner == owner) else {
            return false;
        };
        if estimate == used {
            return false;
        }
        let before = *row;
        row.sent.settle(sent, row.window, (estimate, used));
        if row.slides() && row.allowance_until > now && admitted <= row.allowance_from {
            row.settle_counted(estimate, used);
        }
        if row.allowance_until > now && row.allowance_from < admitted {
            row.allowance = row.allowance.saturating_add(estimate).saturating_sub(used);
        }
        *row != before
    }

    /// The answer to a call that went with the row's count at `admitted`
    /// said `count`. Returns whether the row changed.
    pub fn follow(&mut self, owner: u64, admitted: u64, count: Count, now: Instant) -> bool {
        let row = self.row_mut(owner, now);
        let until = now + count.reset_in;
        // Every answer's reset is watched, even one whose count is not
        // followed below: a window whose reset says when its oldest
        // tokens free moves its reset on by a little at every answer,
        // and only after its first minute. By then the row has rolled
        // over into a window of its own, a whole window ahead, and such
        // resets all read as about a window that turned; unwatched, the
        // window was never seen to slide (the simulator: 62-65 % of a
        // sliding quota used). A fixed window's stale answers say an
        // end that came back, which is evidence of nothing.
        let watched = count.limit.is_some() && row.watch.saw(until, count.window);
        let active = row.allowance_until > now;
        if active && admitted < row.allowance_from {
            // An earlier call's answer, read after a later one's.
            return watched;
        }
        let stale_by = row.window.div(4);
        if active && until + stale_by < row.allowance_until {
            // About a window that already turned (a call that went just
            // before the reset): the window now running is not its.
            return watched;
        }
        // An answer about the window in force: no more guessing.
        let guessed = std::mem::take(&mut row.rolled_over);
        let watched = watched || guessed;
        let since = row.admitted.saturating_sub(admitted);
        let allowance = count.remaining.saturating_sub(since);
        let window = count.window;
        if row.slides() && count.limit.is_none_or(|l| l == row.provider_limit) {
            return row.follow_window((admitted, since), count.remaining, until, now) || watched;
        }
        let turn = if stale_by.is_zero() {
            count.reset_in.div(4)
        } else {
            stale_by
        };
        let same_limit = count.limit.is_none_or(|l| l == row.provider_limit);
        if active && allowance >= row.allowance && until <= row.allowance_until + turn && same_limit
        {
            // Nothing stricter, nor a new window: what the row holds
            // stands (far from the provider's limit, most answers say
            // this, and not writing them keeps workers from contending).
            // A reset said later than the row's is kept, though: a
            // window that slides (or a bucket) is whole only then, and
            // rolling over at the earlier one would send into a window
            // still holding calls. (A fixed window's resets differ by
            // the answers' jitter: a new latest is rare.)
            if until > row.allowance_until {
                row.allowance_until = until;
                return true;
            }
            return watched;
        }
        let before = *row;
        row.allowance = allowance;
        row.allowance_until = until;
        row.allowance_from = admitted;
        if let Some(limit) = count.limit.filter(|&l| l > 0) {
            row.provider_limit = limit;
            if row.window != window {
                // Slots of another length say nothing of this window (nor
                // do none, before any answer said it). Of what the
                // provider counts now, what Sluice admitted is taken as
                // sent now: freed later than the provider frees it,
                // never earlier.
                row.sent = SentWindow::default();
                let ours = row.admitted.min(limit.saturating_sub(count.remaining));
                row.sent.add(now, window, ours);
            }
            row.window = window;
        }
        row.pace_every = count.reset_in.div(row.allowance.max(1));
        // Calls already sent ahead of the pace stay ahead: every answer
        // does not grant a new burst.
        row.pace_next = row.pace_next.max(now);
        *row != before
    }

    /// The row of `owner`, made if missing: a full table first drops rows
    /// with nothing running, then the one whose pause and count end
    /// first.
    pub(super) fn row_mut(&mut self, owner: u64, now: Instant) -> &mut Row {
        if let Some(i) = self.rows.iter().position(|r| r.owner == owner) {
            return &mut self.rows[i];
        }
        if self.rows.len() >= Self::MAX_ROWS {
            self.rows
                .retain(|r| r.pause_until > now || r.allowance_until > now);
        }
        if self.rows.len() >= Self::MAX_ROWS {
            if let Some(first) = self
                .rows
                .iter()
                .enumerate()
                .min_by_key(|(_, r)| r.pause_until.max(r.allowance_until))
                .map(|(i, _)| i)
            {
                self.rows.swap_remove(first);
            }
        }
        self.rows.push(Row {
            owner,
            ..Row::default()
        });
        let last = self.rows.len() - 1;
        &mut self.rows[last]
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(1 + self.rows.len() * Self::ROW_LEN);
        out.push(Self::VERSION);
        for r in &self.rows {
            for word in [
                r.owner,
                r.pause_since.as_nanos(),
                r.pause_until.as_nanos(),
                r.pause_why.word(),
                r.admitted,
                r.allowance,
                r.allowance_until.as_nanos(),
                r.allowance_from,
                r.provider_limit,
                r.window.as_nanos(),
                r.pace_next.as_nanos(),
                r.pace_every.as_nanos(),
                r.relayed.began.as_nanos(),
                r.relayed.heard.as_nanos(),
                r.other,
                r.overcount,
                r.watch.end_seen.as_nanos(),
                r.watch.word() | u64::from(r.rolled_over) << ROLLED_OVER_BIT,
            ]
            .into_iter()
            .chain(r.adaptive.words())
            .chain(r.sent.words())
            {
                out.extend_from_slice(&word.to_le_bytes());
            }
        }
        out
    }

    /// Bytes that are no table (garbage, another version) read as an
    /// empty one: a broken entry must never stop calls.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let (&version, rest) = bytes.split_first()?;
        if version != Self::VERSION
            || rest.len() % Self::ROW_LEN != 0
            || rest.len() / Self::ROW_LEN > Self::MAX_ROWS
        {
            return None;
        }
        let rows = rest
            .chunks_exact(Self::ROW_LEN)
            .map(|c| {
                let mut words = c
                    .chunks_exact(8)
                    .filter_map(|w| w.try_into().ok().map(u64::from_le_bytes));
                let mut next = || words.next();
                let watch_word;
                Some(Row {
                    owner: next()?,
                    pause_since: Instant::from_nanos(next()?),
                    pause_until: Instant::from_nanos(next()?),
                    pause_why: PauseWhy::from_word(next()?),
                    admitted: next()?,
                    allowance: next()?,
                    allowance_until: Instant::from_nanos(next()?),
                    allowance_from: next()?,
                    provider_limit: next()?,
                    window: Span::from_nanos(next()?),
                    pace_next: Instant::from_nanos(next()?),
                    pace_every: Span::from_nanos(next()?),
                    relayed: RelayedStretch {
                        began: Instant::from_nanos(next()?),
                        heard: Instant::from_nanos(next()?),
                    },
                    other: next()?,
                    overcount: next()?,
                    watch: {
                        let end_seen = Instant::from_nanos(next()?);
                        watch_word = next()?;
                        EndWatch {
                            end_seen,
                            ..EndWatch::from_word(watch_word & !(1 << ROLLED_OVER_BIT))
                        }
                    },
                    rolled_over: watch_word >> ROLLED_OVER_BIT & 1 == 1,
                    adaptive: {
                        let mut words = [0u64; Adaptive::WORDS];
                        for word in &mut words {
                            *word = next()?;
                        }
                        Adaptive::from_words(words)
                    },
                    sent: {
                        let mut sent = [0u64; SLOTS + 1];
                        for word in &mut sent {
                            *word = next()?;
                        }
                        SentWindow::from_words(sent)
                    },
                })
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Self { rows })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const NOW: Instant = Instant::from_millis(1_700_000_000_000);
    const CAP: Span = Span::from_secs(300);

    fn count(remaining: u64, reset_ms: u64) -> Count {
        Count {
            remaining,
            reset_in: Span::from_millis(reset_ms),
            limit: None,
            window: Span::ZERO,
        }
    }

    #[test]
    fn a_pause_holds_its_owner_only_and_a_longer_one_wins() {
        let mut table = ProviderTable::default();
        assert!(table.pause(7, NOW, Span::from_secs(3)));
        assert_eq!(
            table.paused_until(7, NOW, CAP),
            Some(NOW + Span::from_secs(3))
        );
        assert_eq!(table.paused_until(8, NOW, CAP), None);
        assert!(
            !table.pause(7, NOW, Span::from_secs(1)),
            "a shorter pause changes nothing"
        );
        assert!(table.pause(7, NOW, Span::from_secs(5)));
        assert_eq!(table.paused_until(7, NOW + Span::from_secs(5), CAP), None);
        assert_eq!(ProviderTable::decode(&table.encode()), Some(table));
    }

    #[test]
    fn the_state_says_why_a_pause_runs_and_what_the_count_leaves() {
        let mut table = ProviderTable::default();
        let why = PauseWhy {
            status: 429,
            relayed: true,
        };
        let heard = table.hear_pause(0, (NOW, Span::from_secs(3)), why, (CAP, Span::ZERO));
        let began = PauseSet {
            until: NOW + Span::from_secs(3),
            began: true,
        };
        assert_eq!(heard, (true, Some(began)));
        let Allowed::Yes { admitted } = table.admit(0, NOW, 1, None) else {
            panic!()
        };
        table.follow(
            0,
            admitted,
            Count {
                remaining: 7,
                reset_in: Span::from_secs(1),
                limit: Some(40),
                window: Span::from_secs(1),
            },
            NOW,
        );
        let state = table.state(0, NOW + Span::from_millis(500), CAP, None);
        assert_eq!(state.remaining, Some(7));
        assert_eq!(state.provider_limit, Some(40));
        assert_eq!(state.paused, Some((NOW, NOW + Span::from_secs(3), why)));
        assert_eq!(state.rate, None);
        let decoded = ProviderTable::decode(&table.encode()).unwrap_or_default();
        assert_eq!(
            decoded.state(0, NOW, CAP, None).paused.map(|p| p.2),
            Some(why)
        );
        let later = table.state(0, NOW + Span::from_secs(4), CAP, None);
        assert_eq!((later.paused, later.provider_limit), (None, Some(40)));
        assert_eq!(table.state(9, NOW, CAP, None), RowState::default());
    }

    #[test]
    fn a_cut_another_envoy_made_is_followed_once_while_fresh() {
        let mut table = ProviderTable::default();
        let full = 100.0;
        let at = NOW - Span::from_millis(400);
        assert!(table.throttled(0, (Heard::Relayed, at), NOW, Throttle::plain(full)));
        let rate = table.state(0, NOW, CAP, Some(full)).rate;
        assert!(rate.is_some_and(|r| r < full), "{rate:?}");
        // The admin relays it again at the next sync: no second cut.
        assert!(!table.throttled(
            0,
            (Heard::Relayed, at),
            NOW + Span::from_secs(1),
            Throttle::plain(full)
        ));
        // Old news is not followed.
        let mut fresh = ProviderTable::default();
        assert!(!fresh.throttled(
            0,
            (Heard::Relayed, NOW - Span::from_secs(6)),
            NOW,
            Throttle::plain(full)
        ));
        // A time from the future is taken as now.
        assert!(fresh.throttled(
            0,
            (Heard::Relayed, NOW + Span::from_secs(3600)),
            NOW,
            Throttle::plain(full)
        ));
        assert_eq!(fresh.state(0, NOW, CAP, Some(full)).cut_at, Some(NOW));
    }

    #[test]
    fn a_full_table_drops_what_ends_first() {
        let mut table = ProviderTable::default();
        for owner in 0..ProviderTable::MAX_ROWS as u64 {
            table.pause(owner, NOW, Span::from_secs(10 + owner));
        }
        table.pause(99, NOW, Span::from_secs(5));
        assert_eq!(table.rows().len(), ProviderTable::MAX_ROWS);
        assert_eq!(table.paused_until(0, NOW, CAP), None);
        assert!(table.paused_until(99, NOW, CAP).is_some());
    }

    #[test]
    fn broken_entries_pause_nothing() {
        for bytes in [&b""[..], b"\x01", b"\x05\x00", &[5u8; 1 + 160 * 9]] {
            assert!(ProviderTable::decode(bytes).is_none());
        }
        let mut table = ProviderTable::default();
        table.rows.push(Row {
            pause_since: NOW + Span::from_secs(3600),
            pause_until: Instant::MAX,
            ..Row::default()
        });
        assert_eq!(
            table.paused_until(0, NOW, CAP),
            None,
            "begins in the future"
        );
        table.rows[0].pause_since = NOW;
        assert_eq!(table.paused_until(0, NOW, CAP), Some(NOW + CAP), "capped");
    }

    #[test]
    fn the_answer_caps_what_goes_until_the_reset_less_what_went_since() {
        let mut table = ProviderTable::default();
        // Call X goes (count 1), then 3 more (count 4) before X's answer
        // says 5 are left until the reset in 1 s.
        let Allowed::Yes { admitted: x } = table.admit(0, NOW, 1, None) else {
            panic!()
        };
        for _ in 0..3 {
            table.admit(0, NOW, 1, None);
        }
        assert!(table.follow(0, x, count(5, 1000), NOW));
        // 5 - 3 admitted since X: 2 more may go.
        assert!(matches!(table.admit(0, NOW, 1, None), Allowed::Yes { .. }));
        assert!(matches!(table.admit(0, NOW, 1, None), Allowed::Yes { .. }));
        assert_eq!(
            table.admit(0, NOW, 1, None),
            Allowed::No {
                until: NOW + Span::from_secs(1)
            }
        );
        // The reset passes: the provider's window turned.
        let later = NOW + Span::from_millis(1000);
        assert!(matches!(
            table.admit(0, later, 1, None),
            Allowed::Yes { .. }
        ));
    }

    #[test]
    fn an_earlier_calls_answer_read_late_changes_nothing() {
        let mut table = ProviderTable::default();
        let Allowed::Yes { admitted: a } = table.admit(0, NOW, 1, None) else {
            panic!()
        };
        let Allowed::Yes { admitted: b } = table.admit(0, NOW, 1, None) else {
            panic!()
        };
        assert!(table.follow(0, b, count(10, 1000), NOW));
        // A's answer (older: it says 11 left) comes after B's.
        assert!(!table.follow(0, a, count(11, 1000), NOW));
        assert_eq!(table.row(0).map(|r| r.allowance), Some(10));
        // The same answer read by a second worker: no change, no double count.
        assert!(!table.follow(0, b, count(10, 1000), NOW));
        assert_eq!(table.row(0).map(|r| r.allowance), Some(10));
    }

    #[test]
    fn a_call_given_back_returns_its_tokens_to_the_allowance() {
        let mut table = ProviderTable::default();
        let Allowed::Yes { admitted } = table.admit(0, NOW, 1, None) else {
            panic!()
        };
        table.follow(0, admitted, count(2, 1000), NOW);
        let Allowed::Yes { admitted } = table.admit(0, NOW, 2, None) else {
            panic!()
        };
        assert!(matches!(table.admit(0, NOW, 1, None), Allowed::No { .. }));
        table.give_back(0, admitted, 2, NOW);
        assert!(matches!(table.admit(0, NOW, 2, None), Allowed::Yes { .. }));
    }

    #[test]
    fn past_the_reset_the_providers_limit_is_expected_again_and_paced() {
        let mut table = ProviderTable::default();
        let Allowed::Yes { admitted } = table.admit(0, NOW, 1, None) else {
            panic!()
        };
        let said = Count {
            remaining: 0,
            reset_in: Span::from_millis(200),
            limit: Some(40),
            window: Span::from_secs(1),
        };
        table.follow(0, admitted, said, NOW);
        assert!(matches!(table.admit(0, NOW, 1, None), Allowed::No { .. }));
        // The next window holds 40, one every 25 ms (4 may go ahead).
        let next = NOW + Span::from_millis(200);
        let went = (0..100)
            .filter(|_| matches!(table.admit(0, next, 1, None), Allowed::Yes { .. }))
            .count();
        assert_eq!(went, 5, "an even pace, a few ahead");
        let mut went_in_window = went;
        for ms in 1..1000 {
            let at = next + Span::from_millis(ms);
            if matches!(table.admit(0, at, 1, None), Allowed::Yes { .. }) {
                went_in_window += 1;
            }
        }
        assert_eq!(went_in_window, 40, "the window's 40, no more");
    }

    #[test]
    fn an_answer_about_a_window_that_turned_does_not_refill_the_next() {
        let mut table = ProviderTable::default();
        let said = |remaining, reset_ms| Count {
            remaining,
            reset_in: Span::from_millis(reset_ms),
            limit: Some(40),
            window: Span::from_secs(1),
        };
        let Allowed::Yes { admitted: first } = table.admit(0, NOW, 1, None) else {
            panic!()
        };
        let Allowed::Yes { admitted: last } = table.admit(0, NOW, 1, None) else {
            panic!()
        };
        table.follow(0, first, said(0, 100), NOW);
        // The window turns: 40 again, paced.
        let next = NOW + Span::from_millis(100);
        assert!(matches!(table.admit(0, next, 1, None), Allowed::Yes { .. }));
        // The last call of the old window answers late: "0 left, reset in 2 ms".
        assert!(!table.follow(0, last, said(0, 2), next + Span::from_millis(8)));
        let row = table.row(0).copied().unwrap_or_default();
        assert_eq!(row.allowance, 39);
        assert_eq!(row.allowance_until, next + Span::from_secs(1));
    }

    #[test]
    fn answers_far_from_the_limit_change_nothing() {
        let mut table = ProviderTable::default();
        // A fixed window: each answer's reset is the same instant (a
        // millisecond's jitter either way).
        let said = |remaining| Count {
            remaining,
            reset_in: Span::from_secs(60) - Span::from_millis(remaining % 3),
            limit: Some(1_000_000),
            window: Span::from_secs(60),
        };
        let Allowed::Yes { admitted: first } = table.admit(0, NOW, 1, None) else {
            panic!()
        };
        assert!(table.follow(0, first, said(999_000), NOW));
        let mut later = Vec::new();
        for _ in 0..10 {
            if let Allowed::Yes { admitted } = table.admit(0, NOW, 1, None) {
                later.push(admitted);
            }
        }
        // Each later call's answer is as loose as what the row holds.
        for (i, admitted) in later.iter().enumerate() {
            assert!(!table.follow(0, *admitted, said(999_000 - 1 - i as u64), NOW));
        }
        // A reset that moves on (a sliding window's, a bucket's) is kept:
        // the count is whole only then.
        let moved = Count {
            reset_in: Span::from_secs(61),
            ..said(999_000)
        };
        let last = later.last().copied().unwrap_or(first);
        assert!(table.follow(0, last, moved, NOW));
        assert_eq!(
            table.row(0).map(|r| r.allowance_until),
            Some(NOW + Span::from_secs(61))
        );
        // A stricter one is written.
        let last = later.last().copied().unwrap_or(first);
        assert!(table.follow(0, last, said(500), NOW + Span::from_millis(20)));
        assert_eq!(table.row(0).map(|r| r.allowance), Some(500));
    }

    /// A provider allowing `quota` tokens in any window of `window`
    /// (sliding) or in each calendar window (fixed), answering as OpenAI
    /// does: its limit, what is left, and when the count is whole again.
    struct WindowProvider {
        quota: u64,
        window: Span,
        sliding: bool,
        /// A sliding window's reset says when its oldest tokens free,
        /// not when it is whole again.
        oldest_free: bool,
        log: Vec<(Instant, u64)>,
    }

    impl WindowProvider {
        fn counts(&self, at: Instant, now: Instant) -> bool {
            if self.sliding {
                at + self.window > now
            } else {
                at.as_nanos() / self.window.as_nanos() == now.as_nanos() / self.window.as_nanos()
            }
        }

        /// A call of `cost` arrives at `now`: whether it is served, and
        /// the answer's count.
        fn call(&mut self, now: Instant, cost: u64) -> (bool, Count) {
            let used: u64 = self
                .log
                .iter()
                .filter(|(at, _)| self.counts(*at, now))
                .map(|c| c.1)
                .sum();
            let served = used + cost <= self.quota;
            if served {
                self.log.push((now, cost));
            }
            let used = used + if served { cost } else { 0 };
            let counted = || self.log.iter().filter(|(at, _)| self.counts(*at, now));
            let whole_at = if self.sliding {
                let reset_from = if self.oldest_free {
                    counted().next()
                } else {
                    counted().next_back()
                };
                reset_from.map_or(now, |(at, _)| *at + self.window)
            } else {
                let w = self.window.as_nanos();
                Instant::from_nanos((now.as_nanos() / w + 1) * w)
            };
            let count = Count {
                remaining: self.quota.saturating_sub(used),
                reset_in: whole_at.since(now),
                limit: Some(self.quota),
                window: self.window,
            };
            (served, count)
        }
    }

    fn sliding(quota: u64) -> WindowProvider {
        WindowProvider {
            quota,
            window: Span::from_secs(60),
            sliding: true,
            oldest_free: false,
            log: Vec::new(),
        }
    }

    /// Sends `cost` every `every` for `seconds`, reading each answer at
    /// once: the tokens the provider served in the last minute, and how
    /// many calls it refused.
    fn steady(
        provider: &mut WindowProvider,
        table: &mut ProviderTable,
        (every, cost): (Span, u64),
        seconds: u64,
    ) -> (u64, u64) {
        steady_estimated(provider, table, (every, cost, cost), seconds)
    }

    /// As [`steady`], each call counted at `estimate` and using `cost`,
    /// settled when its answer is read.
    fn steady_estimated(
        provider: &mut WindowProvider,
        table: &mut ProviderTable,
        (every, estimate, cost): (Span, u64, u64),
        seconds: u64,
    ) -> (u64, u64) {
        let mut refused = 0;
        let mut now = NOW;
        while now < NOW + Span::from_secs(seconds) {
            if let Allowed::Yes { admitted } = table.admit(0, now, estimate, None) {
                let (served, count) = provider.call(now, cost);
                refused += u64::from(!served);
                table.follow(0, admitted, count, now);
                table.settle(0, (admitted, now), (estimate, cost), now);
            }
            now += every;
        }
        let last_minute = provider
            .log
            .iter()
            .filter(|(at, _)| *at + Span::from_secs(60) > now)
            .map(|c| c.1)
            .sum();
        (last_minute, refused)
    }

    #[test]
    fn calls_estimated_above_their_use_still_use_a_sliding_window() {
        // Each call estimated at 160 tokens and using 100 (an LLM's
        // max_tokens against its answer): settled, what Sluice keeps of
        // the window holds what was used. Without settling it held the
        // estimates and the provider served 12 500 of its 20 000.
        let mut provider = sliding(20_000);
        let mut table = ProviderTable::default();
        let (used, refused) = steady_estimated(
            &mut provider,
            &mut table,
            (Span::from_millis(150), 160, 100),
            300,
        );
        assert_eq!(refused, 0);
        assert!(used >= 19_000, "{used} of the last minute's 20 000");
    }

    #[test]
    fn a_refused_calls_estimate_back_makes_no_room_in_a_full_sliding_window() {
        let mut provider = sliding(1_000);
        let mut table = ProviderTable::default();
        steady(&mut provider, &mut table, (Span::from_millis(500), 10), 50);
        assert!(table.row(0).is_some_and(|r| r.watch.slides()));
        // Someone else takes all the window has left; Sluice's next call
        // is refused, and its answer says nothing is left.
        let now = NOW + Span::from_secs(50);
        let left = table.state(0, now, CAP, None).remaining.unwrap_or_default();
        provider.log.push((now, left));
        let Allowed::Yes { admitted } = table.admit(0, now, 10, None) else {
            panic!("Sluice's count has room for it");
        };
        let (served, count) = provider.call(now, 10);
        assert!(!served);
        table.follow(0, admitted, count, now);
        // Refused, it used nothing: settled so, its estimate leaves the
        // window Sluice keeps, and the others' part takes it.
        table.settle(0, (admitted, now), (10, 0), now);
        assert!(
            matches!(table.admit(0, now, 10, None), Allowed::No { .. }),
            "{:?}",
            table.row(0)
        );
    }

    #[test]
    fn a_settled_call_gives_a_count_in_force_what_it_did_not_use() {
        let mut table = ProviderTable::default();
        let Allowed::Yes { admitted } = table.admit(0, NOW, 1, None) else {
            panic!("the first call goes");
        };
        assert!(table.follow(0, admitted, count(1_000, 60_000), NOW));
        let Allowed::Yes { admitted } = table.admit(0, NOW, 800, None) else {
            panic!("800 of 1 000 go");
        };
        assert_eq!(table.state(0, NOW, CAP, None).remaining, Some(200));
        assert!(table.settle(0, (admitted, NOW), (800, 300), NOW));
        assert_eq!(table.state(0, NOW, CAP, None).remaining, Some(700));
        // A call that went before the answer setting the count was in it
        // already, as the provider counted it.
        assert!(!table.settle(0, (1, NOW), (1, 0), NOW));
        assert_eq!(table.state(0, NOW, CAP, None).remaining, Some(700));
    }

    #[test]
    fn a_sliding_window_is_used_as_it_frees() {
        // 20 000 tokens in any minute; callers ask for twice that. Its
        // reset says when it is whole again, or when its oldest tokens
        // free: that one stays put for the first minute (the oldest are
        // the first call's), then creeps on by a call's spacing at each
        // answer, by then a whole window before the end of the window
        // Sluice rolled over into.
        for oldest_free in [false, true] {
            let mut provider = WindowProvider {
                oldest_free,
                ..sliding(20_000)
            };
            let mut table = ProviderTable::default();
            let (used, refused) = steady(
                &mut provider,
                &mut table,
                (Span::from_millis(150), 100),
                300,
            );
            assert_eq!(refused, 0, "oldest free: {oldest_free}");
            assert!(
                used >= 19_000,
                "{used} of the last minute's 20 000 (oldest free: {oldest_free})"
            );
            assert!(table.row(0).is_some_and(|r| r.watch.slides()));
        }
        // A fixed window's resets do not move: its count is followed as
        // before, and what it serves is at most its quota.
        let mut fixed = WindowProvider {
            sliding: false,
            ..sliding(20_000)
        };
        let mut table = ProviderTable::default();
        let (_, refused) = steady(&mut fixed, &mut table, (Span::from_millis(150), 100), 300);
        assert_eq!(refused, 0);
        assert!(table.row(0).is_some_and(|r| !r.watch.slides()));
    }

    #[test]
    fn others_counted_in_a_sliding_window_hold_until_its_reset() {
        let mut provider = sliding(1_000);
        // Someone else took 600 just now.
        provider.log.push((NOW, 600));
        let mut table = ProviderTable::default();
        let (_, refused) = steady(&mut provider, &mut table, (Span::from_millis(500), 10), 50);
        assert_eq!(refused, 0);
        let row = table.row(0).copied().unwrap_or_default();
        assert!(row.watch.slides());
        // Others' 600, and the first call, sent before any answer said
        // the window: what the ring does not hold is counted as others'.
        assert!((600..=610).contains(&row.other), "{row:?}");
        let state = table.state(0, NOW + Span::from_secs(50), CAP, None);
        assert!(state.remaining.is_some_and(|r| r < 400), "{state:?}");
    }

    /// A provider allowing 30 calls per calendar second, then 12 from 2 s
    /// on, counting refused calls too and answering them 429 with
    /// `Retry-After: 1`; Sluice's adaptive limit is told 30 a second and
    /// has calls waiting always. Answers take `latency` and up to
    /// `jitter` more. Returns per second (served, refused).
    /// `phase`: how far into a second of the clock the calls begin;
    /// `offset`: how far the provider's seconds run ahead of the clock's
    /// (0: its windows are the clock's, as a counter keyed by
    /// `floor(now / period)` has them).
    fn against_a_dropping_provider(
        seconds: u64,
        (phase, offset): (Span, Span),
        latency: Span,
        jitter: Span,
    ) -> Vec<(u64, u64)> {
        // Each answer takes `latency` and up to `jitter` more, drawn
        // from a fixed sequence so that a run repeats.
        let mut draw = phase.as_nanos() | 1;
        let full = 30.0;
        let throttle = Throttle {
            full,
            wait: Span::from_secs(1),
            period: Span::from_secs(1),
        };
        let adaptive = AdaptiveLimit {
            full,
            period: throttle.period,
        };
        let mut table = ProviderTable::default();
        let mut windows = vec![(0u64, 0u64); seconds as usize + 2];
        let mut in_flight: Vec<(Instant, u64, bool, Instant)> = Vec::new();
        let mut own_next = NOW + phase;
        let mut now = NOW + phase;
        while now < NOW + phase + Span::from_secs(seconds) {
            let answered: Vec<_> = in_flight.iter().filter(|c| c.0 <= now).copied().collect();
            in_flight.retain(|c| c.0 > now);
            for (_, admitted, refused, sent) in answered {
                if refused {
                    table.throttled(0, (Heard::Here { admitted, sent }, now), now, throttle);
                    table.pause(0, now, throttle.wait);
                }
            }
            if table.paused_until(0, now, CAP).is_none() && own_next <= now {
                if let Allowed::Yes { admitted } = table.admit(0, now, 1, Some(adaptive)) {
                    own_next = own_next.max(now) + Span::from_nanos(1_000_000_000 / 30);
                    let second = (now.since(NOW) + offset).as_secs() as usize;
                    let limit = if second < 2 { 30 } else { 12 };
                    let w = &mut windows[second];
                    let refused = w.0 + w.1 >= limit;
                    if refused {
                        w.1 += 1;
                    } else {
                        w.0 += 1;
                    }
                    draw = draw.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                    let extra = (draw >> 33) % (jitter.as_nanos() + 1);
                    in_flight.push((
                        now + latency + Span::from_nanos(extra),
                        admitted,
                        refused,
                        now,
                    ));
                }
            }
            now += Span::from_nanos(500_000);
        }
        windows
    }

    /// Runs against providers whose windows are offset from the clock by
    /// `offsets` (ms), the calls beginning anywhere in a second and the
    /// answers taking 5 to 40 ms, alike or not; checks each run.
    fn after_a_drop(offsets: &[u64], check: impl Fn(&[(u64, u64)], &str)) {
        let latencies = [(5u64, 0u64), (10, 0), (20, 0), (40, 0), (5, 30)];
        for &offset_ms in offsets {
            for (latency_ms, jitter_ms) in latencies {
                for phase_ms in (0..1000).step_by(100) {
                    let windows = against_a_dropping_provider(
                        90,
                        (Span::from_millis(phase_ms), Span::from_millis(offset_ms)),
                        Span::from_millis(latency_ms),
                        Span::from_millis(jitter_ms),
                    );
                    let shown = format!(
                        "phase {phase_ms} ms, offset {offset_ms} ms, latency {latency_ms} ms + up to {jitter_ms}: {windows:?}"
                    );
                    check(&windows, &shown);
                }
            }
        }
    }

    /// (served, refused) from the drop on, what was served from 10 s
    /// after it in 78 s, and how many of those seconds saw a refusal.
    fn after_the_drop(windows: &[(u64, u64)]) -> (u64, u64, u64, usize) {
        let after = &windows[2..90];
        let served = after.iter().map(|w| w.0).sum();
        let refused = after.iter().map(|w| w.1).sum();
        let settled = windows[12..90].iter().map(|w| w.0).sum();
        let probes = windows[12..90].iter().filter(|w| w.1 > 0).count();
        (served, refused, settled, probes)
    }

    #[test]
    fn after_a_drop_refusals_near_one_rate_make_it_known_and_it_is_used() {
        // Windows the clock aligns, and windows offset from it (a
        // provider counting from when its key's window began): at most
        // 1 % refused, at least 90 % of the new limit used, probes above
        // it grow rarer (at most two after the first 10 s).
        after_a_drop(&[0, 100, 300, 500, 700, 900], |windows, shown| {
            let (served, refused, settled, probes) = after_the_drop(windows);
            assert!(
                refused * 100 <= served + refused,
                "{refused} of {} refused: {shown}",
                served + refused
            );
            assert!(
                settled * 10 >= 78 * 12 * 9,
                "settled {settled} in 78 s: {shown}"
            );
            assert!(probes <= 2, "{shown}");
        });
    }

    proptest! {
        /// Calls of any size at any times against a provider whose window
        /// slides or is fixed (its quota partly taken by someone else at
        /// the start), each answer read at once: once Sluice has read an
        /// answer, the provider refuses none of the calls it lets through.
        #[test]
        fn following_a_window_never_sends_past_it(
            quota in 20u64..500,
            before in 0u64..400,
            window_s in prop::sample::select(vec![10u64, 20, 60]),
            slides in any::<bool>(),
            oldest_free in any::<bool>(),
            steps in proptest::collection::vec((0u64..6_000, 1u64..20), 1..300),
        ) {
            let mut provider = WindowProvider {
                quota,
                window: Span::from_secs(window_s),
                sliding: slides,
                oldest_free,
                log: vec![(NOW, before.min(quota))],
            };
            let mut table = ProviderTable::default();
            let mut now = NOW;
            let mut known = false;
            for (advance_ms, cost) in steps {
                now += Span::from_millis(advance_ms);
                if let Allowed::Yes { admitted } = table.admit(0, now, cost, None) {
                    let (served, count) = provider.call(now, cost);
                    prop_assert!(served || !known, "refused at {:?} (quota {}, {:?})", now.since(NOW), quota, table.row(0));
                    table.follow(0, admitted, count, now);
                    known = true;
                }
            }
        }

        #[test]
        fn any_bytes_decode_to_a_bounded_table_or_none(
            bytes in proptest::collection::vec(any::<u8>(), 0..600),
            now_ms in 0u64..4_000_000_000_000,
            owner in any::<u64>(),
        ) {
            let now = Instant::from_millis(now_ms);
            if let Some(mut table) = ProviderTable::decode(&bytes) {
                prop_assert!(table.rows().len() <= ProviderTable::MAX_ROWS);
                if let Some(until) = table.paused_until(owner, now, CAP) {
                    prop_assert!(until > now);
                    prop_assert!(until <= now + CLOCK_SKEW + CAP);
                }
                let _ = table.admit(owner, now, 1, None);
                prop_assert!(table.rows().len() <= ProviderTable::MAX_ROWS);
            }
        }

        #[test]
        fn pauses_stay_bounded_and_each_lasts_what_it_asked(
            steps in proptest::collection::vec((0u64..12, 0u64..5_000, 1u64..10_000), 1..60),
        ) {
            let mut table = ProviderTable::default();
            let mut now = NOW;
            for (owner, advance, wait_ms) in steps {
                now += Span::from_millis(advance);
                let before = table.paused_until(owner, now, CAP);
                table.pause(owner, now, Span::from_millis(wait_ms));
                let after = table.paused_until(owner, now, CAP);
                prop_assert!(after >= Some(now + Span::from_millis(wait_ms)));
                prop_assert!(after >= before);
                prop_assert!(table.rows().len() <= ProviderTable::MAX_ROWS);
                prop_assert_eq!(ProviderTable::decode(&table.encode()), Some(table.clone()));
            }
        }

        /// Calls go and answers come back in any order, each saying what
        /// the provider had left when the call arrived; the provider's
        /// window holds `quota`, of which someone else used `used_before`.
        /// Once Sluice has read one answer, its calls never take the
        /// provider past the quota (or past where it already was): no
        /// answer, however late or however often read, lets through calls
        /// the provider already counted.
        #[test]
        fn following_answers_in_any_order_never_sends_past_the_quota(
            quota in 1u64..50,
            used_before in 0u64..60,
            ops in proptest::collection::vec((0u8..3, any::<prop::sample::Index>(), 1u64..3), 1..200),
        ) {
            let mut table = ProviderTable::default();
            let mut provider_used = used_before;
            // Calls in flight: the row's count when each went, and what
            // the provider had left when it arrived.
            let mut in_flight: Vec<(u64, u64)> = Vec::new();
            let mut answered: Vec<(u64, u64)> = Vec::new();
            let mut known_at: Option<u64> = None;
            for (op, pick, cost) in ops {
                match op {
                    0 => {
                        if let Allowed::Yes { admitted } = table.admit(0, NOW, cost, None) {
                            provider_used += cost;
                            in_flight.push((admitted, quota.saturating_sub(provider_used)));
                        }
                    }
                    1 if !in_flight.is_empty() => {
                        let (admitted, remaining) = in_flight.remove(pick.index(in_flight.len()));
                        table.follow(0, admitted, count(remaining, 60_000), NOW);
                        answered.push((admitted, remaining));
                        known_at.get_or_insert(provider_used);
                    }
                    // Another worker reads an answer already read.
                    2 if !answered.is_empty() => {
                        let (admitted, remaining) = answered[pick.index(answered.len())];
                        table.follow(0, admitted, count(remaining, 60_000), NOW);
                    }
                    _ => {}
                }
            }
            if let Some(known_at) = known_at {
                prop_assert!(
                    provider_used <= quota.max(known_at),
                    "the provider counted {} of {}, {} when Sluice first knew",
                    provider_used, quota, known_at
                );
            }
        }
    }
}
