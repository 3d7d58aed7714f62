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

mod encoding;
mod pause;
#[cfg(test)]
mod tests;

pub use pause::{PauseSet, PauseWhy};

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
        admitted: u64,
        since: u64,
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

    /// A provider refused a call at `at` (by this Envoy's clock;
    /// `heard`: this Envoy's call or another's; `throttle`: the limit's
    /// own rate and period, and the wait the refusal asked for): the
    /// adapted rate is cut, once per overload, and for relayed news only
    /// while it is fresh. Returns whether it was.
    pub fn throttled(
        &mut self,
        owner: u64,
        heard: Heard,
        at: Instant,
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
        admitted: u64,
        sent: Instant,
        estimate: u64,
        used: u64,
        now: Instant,
    ) -> bool {
        let Some(row) = self.rows.iter_mut().find(|r| r.owner == owner) else {
            return false;
        };
        if estimate == used {
            return false;
        }
        let before = *row;
        row.sent.settle(sent, row.window, estimate, used);
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
            return row.follow_window(admitted, since, count.remaining, until, now) || watched;
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
}
