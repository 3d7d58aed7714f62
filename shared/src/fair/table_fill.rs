//! How a fair table fills with time: every part to `now` at its share
//! (the reserve first, what overflows to the pool, the burst never
//! passed), and at each window's end the shares worked out again from
//! what each key asked. What a call takes is [`FairTable::take`], in
//! `table.rs`.

use crate::time::{Instant, Span};

use super::table::{FairTable, FairTerms, UNIT, WINDOW};
use super::{shares, Claim};

impl FairTable {
    /// What the reserve holds at most, with `held` already held by the
    /// quiet keys' parts: one token, leaving one of the burst for each of
    /// the `busy` keys (with a small burst, keeping it would starve them:
    /// a fleet share's burst of 2 between two greedy keys left the
    /// heavier one no room at all).
    fn reserve_cap(terms: &FairTerms, held: i64, busy: usize) -> i64 {
        let burst = i64::try_from(terms.burst).unwrap_or(i64::MAX);
        let unit = UNIT as i64;
        let room = unit.saturating_mul(i64::try_from(busy).unwrap_or(i64::MAX));
        burst
            .saturating_sub(held)
            .saturating_sub(room)
            .clamp(0, unit)
    }

    /// Fills every part to `now` (what overflows to the pool), and at each
    /// window's end works the shares out again.
    pub(super) fn advance(&mut self, terms: &FairTerms, now: Instant) {
        // However long since (a slow rate refills over days); a fresh
        // table starts full, as the limit's bucket does.
        let fresh = self.refilled_at == Instant::EPOCH;
        let since = if fresh {
            Span::MAX
        } else {
            now.since(self.refilled_at)
        };
        if fresh {
            self.window_start = now;
        }
        self.refilled_at = self.refilled_at.max(now);
        let over = |rate: u64| {
            let units = u128::from(rate) * u128::from(since.as_nanos()) / 1_000_000_000;
            i64::try_from(units).unwrap_or(i64::MAX)
        };
        // A debt is less than a token (see `take`): a part further under
        // is broken shared data, and would hold back every key's calls.
        for key in &mut self.keys {
            key.tokens = key.tokens.max(-(UNIT as i64));
        }
        // What no share claims fills the pool too: a key new to the table
        // (no share until the window ends) takes from it at once.
        let shared: u64 = self.keys.iter().map(|k| k.share).sum();
        let mut unclaimed = over(terms.capacity.saturating_sub(shared));
        let burst = i64::try_from(terms.burst).unwrap_or(i64::MAX);
        // Quiet keys first: the burst each asks at once is kept for it
        // before the busy keys' parts fill (see [`FairKey::hold`]).
        // Among quiet keys, the smallest share first: a busy key alone
        // asking under the limit counts as quiet too, and took the room a
        // key calling now and then kept for its next call.
        let mut order: Vec<usize> = (0..self.keys.len()).collect();
        order.sort_by_key(|&at| (!self.keys[at].is_quiet(), self.keys[at].share));
        let quiet = order
            .iter()
            .take_while(|&&at| self.keys[at].is_quiet())
            .count();
        let mut fills: Vec<i64> = self.keys.iter().map(|k| over(k.share)).collect();
        // The reserve fills first: from what no share claims, then from
        // the busy keys' fills, or the quiet keys' when no key is busy (a
        // key alone claims the whole rate, and counts as quiet while it
        // asks under it). It takes its room after the quiet keys' parts.
        let quiet_held = order[..quiet]
            .iter()
            .map(|&at| {
                let key = &self.keys[at];
                let filled = key.tokens.saturating_add(fills[at]);
                filled.min(key.hold(terms).max(key.tokens)).max(0)
            })
            .fold(0, i64::saturating_add);
        let busy = order.len() - quiet;
        let mut wanted = self.fill_reserve(terms, quiet_held, busy, &mut unclaimed);
        // With no busy key, the quiet key of the largest share gives
        // first: the smallest's next burst is what its part is for (a
        // tenant sending 2 at once, 20 a second, found 1.9 in its part).
        let givers: Vec<usize> = if busy > 0 {
            order[quiet..].to_vec()
        } else {
            order.iter().rev().copied().collect()
        };
        for at in givers {
            let given = fills[at].min(wanted).max(0);
            (fills[at], wanted) = (fills[at] - given, wanted - given);
            self.reserve = self.reserve.saturating_add(given);
        }
        let debts: i64 = order[quiet..]
            .iter()
            .map(|&at| self.keys[at].tokens.min(0).saturating_neg())
            .fold(0, i64::saturating_add);
        let mut held: i64 = 0;
        for (n, &at) in order.iter().enumerate() {
            if n == quiet {
                held = held.saturating_add(self.reserve);
            }
            let key = &mut self.keys[at];
            // Its own cap, within what the reserve and the parts before it
            // left of the burst (one token each may add up to more than
            // the burst). A part past it (its share worked out lower, the
            // reserve filled) gives what it holds past it to the pool: kept,
            // it made the parts hold more than the burst, and the limit's
            // bucket refused what the table admitted (`sluice-sim`).
            // A quiet key keeps what it held past its hold, within the
            // burst: its share follows its asks window by window, and its
            // next burst is what the part is for.
            let room = burst.saturating_sub(held).max(0);
            let cap = if n < quiet {
                key.hold(terms).max(key.tokens).min(room)
            } else {
                // A busy part holds too what the other busy parts owe: it
                // may be unable to take what it holds until their shares pay
                // their debts back, and what overflowed would go to the
                // pool, for the debtors to take.
                let owed = debts.saturating_add(key.tokens.min(0));
                key.hold(terms).saturating_add(owed).min(room)
            };
            let filled = key.tokens.saturating_add(fills[at]);
            if filled > cap {
                let kept = cap.max(key.tokens.min(0));
                self.pool = self.pool.saturating_add(filled - kept);
                key.tokens = kept;
            } else {
                key.tokens = filled;
            }
            // A part in debt leaves as much more room: the bucket holds
            // that much less.
            held = held.saturating_add(key.tokens);
        }
        if busy == 0 {
            held = held.saturating_add(self.reserve);
        }
        // A part keeps what it held past a cap that shrank (its share
        // worked out again, the reserve filled): the reserve, then the
        // busy keys' parts, then the quiet keys', give up what the burst
        // does not hold, so that the table never holds more than the
        // limit's bucket does.
        let mut past = held.saturating_sub(burst).max(0);
        let trimmed = past.min(self.reserve.max(0));
        (self.reserve, past) = (self.reserve - trimmed, past - trimmed);
        for at in order.into_iter().rev() {
            if past <= 0 {
                break;
            }
            let key = &mut self.keys[at];
            let trimmed = past.min(key.tokens.max(0));
            (key.tokens, past) = (key.tokens - trimmed, past - trimmed);
        }
        held = held.min(burst);
        self.pool = self.pool.saturating_add(unclaimed);
        // All parts and the reserve together hold the burst at most.
        self.pool = self.pool.min(burst.saturating_sub(held)).max(0);
        let ended = now.since(self.window_start);
        if ended < WINDOW {
            return;
        }
        let one_window = ended < WINDOW.saturating_mul(2);
        for key in &mut self.keys {
            (key.asked_earlier, key.asked_before, key.used_before) = if one_window {
                (key.asked_before, key.asked, key.used)
            } else {
                (0, 0, 0)
            };
            key.asked = 0;
            key.used = 0;
        }
        self.window_start = now;
        // Keys that asked nothing for two windows go; what their parts
        // held goes to the pool (the parts and the pool hold the burst at
        // most together, so the pool stays within it).
        let gone: i64 = self
            .keys
            .iter()
            .filter(|k| k.asked_before == 0 && k.asked_earlier == 0)
            .map(|k| k.tokens.max(0))
            .fold(0, i64::saturating_add);
        self.pool = self.pool.saturating_add(gone);
        self.keys
            .retain(|k| k.asked_before > 0 || k.asked_earlier > 0);
        self.share_out(terms);
    }

    /// Fills the reserve from `unclaimed` (what no share claims) up to its
    /// cap, `held` being what the quiet keys' parts hold (and `busy` how
    /// many other keys follow); what it holds past the cap goes to the
    /// pool. Returns what it still wants, for the busy keys' fills to give.
    fn fill_reserve(
        &mut self,
        terms: &FairTerms,
        held: i64,
        busy: usize,
        unclaimed: &mut i64,
    ) -> i64 {
        let cap = Self::reserve_cap(terms, held, busy);
        self.reserve = self.reserve.max(0);
        if self.reserve > cap {
            self.pool = self.pool.saturating_add(self.reserve - cap);
            self.reserve = cap;
        }
        let given = (*unclaimed).min(cap - self.reserve).max(0);
        self.reserve += given;
        *unclaimed -= given;
        cap - self.reserve
    }

    /// Each key's share for the next window, from what it asked (a key
    /// without two whole windows counted, new or back from rest, as if it
    /// wanted all: it gets its weighted part until its asks are counted;
    /// its first window is a part of one).
    pub(super) fn share_out(&mut self, terms: &FairTerms) {
        let per_second = Span::from_secs(1).as_nanos() / WINDOW.as_nanos();
        let claims: Vec<Claim> = self
            .keys
            .iter()
            .map(|k| {
                let asked = if k.asked_earlier == 0 {
                    terms.capacity
                } else {
                    k.asked_before
                        .max(k.asked_earlier)
                        .saturating_mul(per_second)
                };
                Claim {
                    weight: k.weight,
                    demand: asked.saturating_add(asked / 4).saturating_add(UNIT),
                    reserved: k.reserved.min(terms.capacity),
                }
            })
            .collect();
        for (key, share) in self.keys.iter_mut().zip(shares(terms.capacity, &claims)) {
            key.share = share;
        }
    }
}
