//! A rate limit shared fairly between keys, as one value every worker
//! changes by compare-and-swap: each key's share of the limit (from
//! [`shares`](super::shares), by what each key asked lately), a small
//! token bucket per key filled at its share, and a spare pool.
//!
//! - Every [`WINDOW`] the shares are worked out again from what each key
//!   asked (admitted and refused) in the last two windows, with a quarter
//!   and one token a second of headroom: a key asking less than its weighted
//!   part gets what it asks, the others divide the rest by weight
//!   (reservations first).
//! - The table is the limit's token bucket cut in parts: a key's part
//!   fills at its share and holds at most its share of the burst; what
//!   overflows (a key using less than its share) goes to the spare pool,
//!   and so does the part of the rate no share claims; any key past its
//!   own tokens takes from the pool: work-conserving whatever the
//!   headroom, and a key new to the table is served at once. All parts
//!   together hold the burst at most.
//! - One token of the burst (when the quiet keys' parts leave it, and a
//!   token for each busy key besides) is kept for a key new to the table
//!   or back from rest: it fills first, before the busy keys' parts, and
//!   no other key takes it. Such a key may also take from the parts of
//!   keys asking past their shares. A tenant calling once a second beside
//!   a greedy one found no token anywhere (its entry gone after two empty
//!   windows, the greedy key draining its part and the pool as they
//!   filled) and was refused every call (`sluice-sim`'s `fair` property
//!   found it).
//! - A part whose share of the burst is less than a call's worth (three
//!   keys under a burst of 2) takes a call once it is within a token of
//!   it, and goes into debt for the rest, which its share pays back. A
//!   debt borrows from the busy keys' parts and the pool only, never from
//!   a quiet key's part or the reserve, and the busy parts hold what the
//!   others owe besides their own caps (else it overflowed to the pool,
//!   for the debtors). Nothing goes past what the parts (a part in debt
//!   less), the pool and the reserve hold together: the limit's bucket.
//!   (Each part holding a token at least, the parts of three keys held
//!   more than a burst of 2, the last in turn nothing, and 54 to 69 calls
//!   a second of 95 went: `sluice-sim`'s `fair` property found it.)
//! - A key with too few tokens of its own and too few spare is refused,
//!   with the time its share takes to bring the call's worth.
//!
//! The limit's own bucket is still taken after this table admits, and
//! does not refuse what it admitted: both fill at the rate and hold the
//! burst at most, and the table takes no more than it holds, so it never
//! holds more than the bucket does. Fairness divides the limit and never
//! adds to it; it only decides who gets the bucket's tokens.
//!
//! Amounts are in millionths of a token, so that shares of small rates
//! split exactly.

use crate::time::{Instant, Span};

/// One token, in the table's units.
pub const UNIT: u64 = 1_000_000;

/// How often shares follow demand.
pub const WINDOW: Span = Span::from_millis(100);

/// How long after its last window a table's view still shows what that
/// window counted (see [`FairTable::view`]); a table idle for longer
/// shows no key.
pub const VIEW_HORIZON: Span = Span::from_secs(1);

/// Keys tracked at most; the others share one overflow entry.
pub const MAX_KEYS: usize = 256;

/// The overflow entry's key.
pub const OVERFLOW_KEY: u64 = 0;

/// The limit being shared: its rate in [`UNIT`]s a second, its burst in
/// [`UNIT`]s, and how many keys have entries of their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FairTerms {
    pub capacity: u64,
    pub burst: u64,
    pub max_keys: usize,
}

impl FairTerms {
    /// What a part filling at `rate` a second holds at most: that share
    /// of the burst. Less than a token is enough for a call: a key may go
    /// less than a token into debt (see [`FairTable::take`]). (A token at
    /// least for every part made the parts of three keys hold more than a
    /// burst of 2: the last in turn held nothing, its share overflowed,
    /// and a quarter of the limit was lost.)
    pub(super) fn hold(&self, rate: u64) -> i64 {
        let held = u128::from(rate) * u128::from(self.burst) / u128::from(self.capacity.max(1));
        let held = held.min(u128::from(self.burst));
        i64::try_from(held).unwrap_or(i64::MAX)
    }
}

/// Who asks: the key's hash, its weight in thousandths and what is
/// reserved for it in [`UNIT`]s a second.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FairClaimant {
    pub key: u64,
    pub weight: u64,
    pub reserved: u64,
}

/// One key's entry.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FairKey {
    pub key: u64,
    pub weight: u64,
    pub reserved: u64,
    /// Its share in [`UNIT`]s a second, until the window ends.
    pub share: u64,
    /// Its part of the bucket.
    pub tokens: i64,
    /// Asked (admitted or not) this window, the one before, and the one
    /// before that: a share follows the larger of the last two whole
    /// windows (a quiet key at 20 a second asks 1 to 3 calls a window).
    pub asked: u64,
    pub asked_before: u64,
    pub asked_earlier: u64,
    /// Admitted this window and the one before.
    pub used: u64,
    pub used_before: u64,
}

/// One key of a fair table as an Envoy reports it: its weight in
/// thousandths, and per second its share, what it used and what it asked
/// (its demand) over the last whole windows (for slots shared fairly, the
/// slots it may hold, holds and wants). The key is a hash: under the
/// fleet's label secret when an admin is there (alike on every Envoy, and
/// shown as its label), [`OVERFLOW_KEY`] for the keys past `max_keys`.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FairKeyView {
    pub key: u64,
    pub weight: u64,
    pub share: f64,
    pub used: f64,
    pub demand: f64,
    /// Slots shared fairly: share, use and demand are slots held at
    /// once, not a rate.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub slots: bool,
}

super::key_entry!(FairKey);

/// Windows in a second.
const WINDOWS_PER_SECOND: u64 = Span::from_secs(1).as_nanos() / WINDOW.as_nanos();

impl FairKey {
    /// The most it asked in one of the last two whole windows.
    fn peak(&self) -> u64 {
        self.asked_before.max(self.asked_earlier)
    }

    /// Its share covers all it asks: it is under its fair part.
    pub(super) fn is_quiet(&self) -> bool {
        // A key whose window before last was empty counts as wanting
        // all (`share_out`), but its peak is still what it asks at once.
        let peak = self.peak();
        peak > 0 && self.share >= peak.saturating_mul(WINDOWS_PER_SECOND)
    }

    /// What its part holds at most: its share of the burst (one token at
    /// least); a quiet key's part holds what it asked in one window too,
    /// within the burst. A caller under its part that sends a few calls at
    /// once (a keep-alive pool paced in step) must find them all in its
    /// part: with only its share of the burst (a 20/s key of a 95/s,
    /// burst 5 limit holds about 1), a greedy key drains whatever
    /// overflows to the pool, and the quiet key got half of what it
    /// asked (`sluice-sim`'s `fair` property found it).
    pub(super) fn hold(&self, terms: &FairTerms) -> i64 {
        let own = terms.hold(self.share);
        if !self.is_quiet() {
            return own;
        }
        // Within the burst less one token (the reserve's, or the busy
        // keys' room), when the burst holds two.
        let most = terms.burst.saturating_sub(UNIT).max(UNIT.min(terms.burst));
        let peak = i64::try_from(self.peak().min(most)).unwrap_or(i64::MAX);
        own.max(peak)
    }
}

/// The whole shared state of one fair limit.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FairTable {
    pub window_start: Instant,
    pub refilled_at: Instant,
    /// Spare tokens any key may take.
    pub pool: i64,
    /// Spare tokens only a key new to the table (or back from rest) may
    /// take (see [`FairTable::reserve_cap`]).
    pub reserve: i64,
    pub keys: Vec<FairKey>,
}

/// What the table made of a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FairTake {
    /// From the key's own share.
    Own,
    /// Beyond its share, from what others left spare.
    Spare,
    /// Over its share while the others want theirs: refused until its
    /// share brings the call's worth.
    Refused { retry_after: Span },
}

impl FairTake {
    pub fn admitted(self) -> bool {
        !matches!(self, FairTake::Refused { .. })
    }
}

impl FairTable {
    /// A call of `who` costing `cost` tokens at `now`.
    pub fn take(
        &mut self,
        terms: &FairTerms,
        now: Instant,
        who: FairClaimant,
        cost: u64,
    ) -> FairTake {
        self.advance(terms, now);
        let cost = cost.saturating_mul(UNIT);
        let (at, made) = self.entry(terms, who);
        let key = &mut self.keys[at];
        key.asked = key.asked.saturating_add(cost);
        let signed = i64::try_from(cost).unwrap_or(i64::MAX);
        // What the limit's bucket holds: the parts (a part in debt less),
        // the pool and the reserve. A call past it would be refused there.
        let total = self.total();
        if total < signed {
            return FairTake::Refused {
                retry_after: self.wait(terms, at, signed, total),
            };
        }
        // What the busy keys' parts (a part in debt less) and the pool
        // hold: what a busy key's call, and what a quiet key takes past its
        // part, comes out of. The quiet keys' parts and the reserve are
        // theirs, and a debt never borrows them.
        let quiet = self.keys[at].is_quiet();
        let slack = self.slack();
        let key = &mut self.keys[at];
        if key.tokens >= signed && (quiet || slack >= signed) {
            key.tokens -= signed;
            key.used = key.used.saturating_add(cost);
            return FairTake::Own;
        }
        let own = key.tokens.max(0);
        let need = signed - own;
        let from_slack = if quiet { need } else { signed };
        if (self.pool >= need && slack >= from_slack)
            || (made && self.make_room_for_newcomer(at, need))
        {
            let key = &mut self.keys[at];
            key.tokens -= own;
            key.used = key.used.saturating_add(cost);
            self.pool -= need;
            return FairTake::Spare;
        }
        // A part that cannot hold the call's worth (its share of the burst
        // less than a token: three keys under a burst of 2), within a token
        // of it: the part goes into debt for the rest (what the pool holds
        // first), which its share pays back before it holds anything again.
        let key = &mut self.keys[at];
        if key.hold(terms) <= signed && key.tokens > signed - UNIT as i64 && slack >= from_slack {
            let from_pool = self.pool.clamp(0, need);
            self.pool -= from_pool;
            key.tokens -= signed - from_pool;
            key.used = key.used.saturating_add(cost);
            return FairTake::Own;
        }
        FairTake::Refused {
            retry_after: self.wait(terms, at, signed, total),
        }
    }

    /// What the busy keys' parts (a part in debt less) and the pool hold
    /// together.
    fn slack(&self) -> i64 {
        self.keys
            .iter()
            .filter(|k| !k.is_quiet())
            .map(|k| k.tokens)
            .fold(self.pool, i64::saturating_add)
    }

    /// What the parts (a part in debt less), the pool and the reserve hold
    /// together.
    fn total(&self) -> i64 {
        self.keys
            .iter()
            .map(|k| k.tokens)
            .fold(self.pool.saturating_add(self.reserve), i64::saturating_add)
    }

    /// How long until the key at `at` may take `signed`: until its part
    /// is within a token of it, if it can hold that (else until the shares
    /// are worked out again), and the table holds it.
    fn wait(&self, terms: &FairTerms, at: usize, signed: i64, total: i64) -> Span {
        let key = &self.keys[at];
        let within = signed.saturating_sub(UNIT as i64);
        let short = within
            .saturating_sub(key.tokens)
            .saturating_add(1)
            .max(1)
            .unsigned_abs();
        let own = if key.tokens > within {
            Span::ZERO
        } else if key.share == 0 || within >= terms.hold(key.share) {
            WINDOW
        } else {
            let nanos = u128::from(short) * 1_000_000_000 / u128::from(key.share);
            Span::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
        };
        let table_short = signed.saturating_sub(total).max(0).unsigned_abs();
        let nanos = u128::from(table_short) * 1_000_000_000 / u128::from(terms.capacity.max(1));
        let table = Span::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX));
        own.max(table).max(Span::from_millis(1))
    }

    /// A call admitted here was refused by the limit itself: it no longer
    /// counts as used, and with `refund` its tokens come back to its key
    /// (as far as its part holds them).
    pub fn give_back(&mut self, terms: &FairTerms, who: FairClaimant, cost: u64, refund: bool) {
        let cost = cost.saturating_mul(UNIT);
        let (at, _) = self.entry(terms, who);
        let key = &mut self.keys[at];
        key.used = key.used.saturating_sub(cost);
        if refund {
            let cap = key.hold(terms).max(key.tokens);
            let back = i64::try_from(cost).unwrap_or(i64::MAX);
            key.tokens = key.tokens.saturating_add(back).min(cap);
        }
    }

    /// The entry of `who` ([`entry_of`](super::entry_of)), and whether it
    /// was made now.
    fn entry(&mut self, terms: &FairTerms, who: FairClaimant) -> (usize, bool) {
        let (at, made) = super::entry_of(&mut self.keys, terms.max_keys, who);
        if made {
            // A newcomer gets its share now, not at the window's end: its
            // part starts filling at once (a quiet caller's second call 50
            // ms after its first was refused while a noisy one drained the
            // pool).
            self.share_out(terms);
        }
        (at, made)
    }

    /// A key new to the table (or back from rest) needs `need` more than
    /// its part and the pool hold: the reserve kept for it, then the parts
    /// of the keys asking more than their shares (worked out again as it
    /// came), the fullest first, make it up in the pool, if they can. (A
    /// busy key alone counts as quiet while it asks under the limit, and
    /// its part holds the whole burst; a greedy one drains its part and
    /// the pool as they fill: either way a newcomer found nothing.) Not
    /// for a quiet key: a busy key whose asks dip under its share for a
    /// window would drain the reserve, and a quiet key's part holds its
    /// bursts.
    fn make_room_for_newcomer(&mut self, at: usize, need: i64) -> bool {
        // The other busy keys, the fullest first.
        let mut fullest: Vec<usize> = (0..self.keys.len())
            .filter(|&i| i != at && !self.keys[i].is_quiet())
            .collect();
        fullest.sort_by_key(|&i| std::cmp::Reverse(self.keys[i].tokens));
        let spare: i64 = fullest.iter().map(|&i| self.keys[i].tokens.max(0)).fold(
            self.pool.max(0).saturating_add(self.reserve.max(0)),
            i64::saturating_add,
        );
        if spare < need {
            return false;
        }
        let mut short = need - self.pool.max(0);
        let from_reserve = short.min(self.reserve.max(0)).max(0);
        (self.reserve, short) = (self.reserve - from_reserve, short - from_reserve);
        for i in fullest {
            if short <= 0 {
                break;
            }
            let given = short.min(self.keys[i].tokens.max(0));
            self.keys[i].tokens -= given;
            short -= given;
        }
        // The pool now holds the call's worth.
        self.pool = need;
        true
    }

    /// Each key as of `now`: its share, what it used and what it asked
    /// per second (the overflow entry among them), busiest first, at most
    /// `most`.
    ///
    /// Within [`VIEW_HORIZON`] of the table's last window, as of the end of
    /// the two windows after it: what they counted, rather than nothing
    /// because no call came since. A view is read on the Envoy's sync, and
    /// one read after its worker stood still for 200 ms (a loaded machine,
    /// a pause between a client's bursts) showed no key at all: the live
    /// view lost its tenants for that sync, and the admin weighed that
    /// Envoy's demand as if no key wanted its share.
    pub fn view(&self, terms: &FairTerms, now: Instant, most: usize) -> Vec<FairKeyView> {
        let mut table = self.clone();
        let counted_until = self.window_start + Span::from_nanos(WINDOW.as_nanos() * 2 - 1);
        let as_of = if now.since(self.window_start) < VIEW_HORIZON {
            now.min(counted_until)
        } else {
            now
        };
        table.advance(terms, as_of);
        let per_second = (Span::from_secs(1).as_nanos() / WINDOW.as_nanos()) as f64;
        let rate = |units: u64| units as f64 * per_second / UNIT as f64;
        let mut keys: Vec<FairKeyView> = table
            .keys
            .iter()
            .map(|k| FairKeyView {
                key: k.key,
                weight: k.weight,
                share: k.share as f64 / UNIT as f64,
                used: rate(k.used_before),
                demand: rate(k.asked_before.max(k.asked_earlier)),
                slots: false,
            })
            .collect();
        keys.sort_by(|a, b| b.demand.total_cmp(&a.demand).then(a.key.cmp(&b.key)));
        keys.truncate(most);
        keys
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fair::FairDecodeError;
    use proptest::prelude::*;

    const TERMS: FairTerms = FairTerms {
        capacity: 100 * UNIT,
        burst: 10 * UNIT,
        max_keys: 100,
    };

    fn key(key: u64, weight: u64) -> FairClaimant {
        FairClaimant {
            key,
            weight: weight * super::super::WEIGHT_SCALE,
            reserved: 0,
        }
    }

    /// Offers each key its calls a second, evenly spread, for `seconds`;
    /// what each had admitted over the last `measure` seconds.
    fn run(
        table: &mut FairTable,
        offered: &[(FairClaimant, u64)],
        (from, seconds, measure): (u64, u64, u64),
    ) -> Vec<u64> {
        let mut admitted = vec![0; offered.len()];
        // A step of 100 µs; each key's calls land on their own instants.
        let steps = seconds * 10_000;
        let mut next: Vec<u64> = vec![0; offered.len()];
        for step in 0..steps {
            let now = Instant::from_nanos((from * 10_000 + step) * 100_000);
            for (i, (who, per_second)) in offered.iter().enumerate() {
                if *per_second == 0 {
                    continue;
                }
                let every = 10_000 / per_second;
                if step >= next[i] {
                    next[i] = step + every.max(1);
                    if table.take(&TERMS, now, *who, 1).admitted()
                        && step >= (seconds - measure) * 10_000
                    {
                        admitted[i] += 1;
                    }
                }
            }
        }
        admitted
    }

    /// A view read while no call came for longer than two windows (but
    /// less than a second) still shows the keys and what they asked; one
    /// read after a second of quiet shows none.
    #[test]
    fn a_view_after_a_short_quiet_shows_what_the_last_windows_counted() {
        let mut table = FairTable::default();
        run(
            &mut table,
            &[(key(1, 1), 1_000), (key(2, 3), 1_000)],
            (0, 2, 1),
        );
        let end = Instant::from_nanos(2_000_000_000);
        let at = |ms: u64| table.view(&TERMS, end + Span::from_millis(ms), 10);
        let busy = at(0);
        for quiet in [150, 250, 900] {
            let view = at(quiet);
            assert_eq!(view.len(), 2, "after {quiet} ms: {view:?}");
            for (now, then) in view.iter().zip(&busy) {
                assert_eq!(now.key, then.key);
                assert!(
                    now.demand >= 0.5 * then.demand,
                    "after {quiet} ms: {view:?} against {busy:?}"
                );
                assert!(now.share > 0.0, "after {quiet} ms: {view:?}");
            }
        }
        assert!(at(1_100).is_empty(), "{:?}", at(1_100));
    }

    #[test]
    fn greedy_keys_get_the_limit_by_weight() {
        let mut table = FairTable::default();
        let got = run(
            &mut table,
            &[(key(1, 1), 1_000), (key(2, 1), 1_000), (key(3, 2), 1_000)],
            (0, 12, 10),
        );
        for (got, want) in got.iter().zip([250, 250, 500]) {
            assert!(
                got.abs_diff(want) * 100 <= want * 3,
                "{got} of {want} in 10 s"
            );
        }
    }

    #[test]
    fn a_quiet_key_gets_all_it_asks_and_the_noisy_one_the_rest() {
        let mut table = FairTable::default();
        let got = run(
            &mut table,
            &[(key(1, 1), 1_000), (key(2, 1), 20)],
            (0, 12, 10),
        );
        assert!(got[1] >= 198, "quiet {got:?}");
        assert!(got[0] >= 780 && got[0] + got[1] <= 1_005, "{got:?}");
    }

    /// A quiet key at 20 a second whose calls fall unevenly (1 in one
    /// window, 3 in the next), coming late in a window, beside a noisy
    /// one: its share is its weighted part until two whole windows are
    /// counted, then the larger of the last two, and every call goes.
    #[test]
    fn a_quiet_key_with_uneven_windows_loses_no_call() {
        let mut table = FairTable::default();
        let (noisy, quiet) = (key(1, 1), key(2, 1));
        let mut refused = 0;
        for ms in 0..10_000u64 {
            let now = Instant::from_millis(ms);
            table.take(&TERMS, now, noisy, 1);
            // Its first call 5 ms before a window ends: that window
            // counts a part of its asks.
            let first = 95;
            if ms >= first
                && [0, 100, 130, 160].contains(&((ms - first) % 200))
                && !table.take(&TERMS, now, quiet, 1).admitted()
                && ms > first
            {
                refused += 1;
            }
        }
        // Its very first call may find the pool just drained (its share
        // has brought it nothing yet); none after it is refused.
        assert_eq!(refused, 0);
    }

    /// The book's first fair policy (95/s, burst 5): a quiet key sending
    /// 2, 3 or 4 calls at once, 20 a second, beside a noisy one taking
    /// whatever it finds every millisecond. Each burst finds room in the
    /// quiet key's part (before: its part held its share of the burst,
    /// about 1, and it got 10 of its 20 a second), and the noisy key
    /// gets the rest.
    #[test]
    fn a_quiet_key_sending_a_few_calls_at_once_gets_them_all() {
        let terms = FairTerms {
            capacity: 95 * UNIT,
            burst: 5 * UNIT,
            max_keys: 100,
        };
        for at_once in [2u64, 3, 4] {
            let mut table = FairTable::default();
            let (noisy, quiet) = (key(1, 1), key(2, 1));
            let every = 1000 * at_once / 20;
            let (mut refused, mut noisy_got) = (0, 0);
            for ms in 0..10_000u64 {
                // Past the epoch: a table refilled at the epoch is fresh.
                let now = Instant::from_millis(1_000 + ms);
                if ms % every == 7 {
                    for _ in 0..at_once {
                        if !table.take(&terms, now, quiet, 1).admitted() && ms >= 2_000 {
                            refused += 1;
                        }
                    }
                }
                while table.take(&terms, now, noisy, 1).admitted() {
                    if ms >= 2_000 {
                        noisy_got += 1;
                    }
                }
            }
            assert_eq!(refused, 0, "{at_once} at once");
            // 8 s at 95/s, the quiet key's 160 taken out; a burst's worth
            // lost at most each second.
            assert!(
                noisy_got >= 8 * (95 - 20 - 5),
                "{at_once} at once: {noisy_got}"
            );
        }
    }

    /// The book's first fair policy (95/s, burst 5): a key calling now and
    /// then (its entry gone after two empty windows each time) beside a
    /// greedy key taking whatever it finds every millisecond gets every
    /// call, and the greedy key the rest (before the reserve, every call
    /// of a key calling once a second was refused: `sluice-sim`'s `fair`
    /// property).
    #[test]
    fn a_key_calling_now_and_then_beside_a_greedy_one_gets_every_call() {
        let terms = FairTerms {
            capacity: 95 * UNIT,
            burst: 5 * UNIT,
            max_keys: 100,
        };
        for every in [250u64, 400, 777, 1_000, 3_000] {
            let mut table = FairTable::default();
            let (greedy, sparse) = (key(1, 1), key(2, 1));
            let (mut refused, mut calls, mut greedy_got) = (0, 0, 0);
            for ms in 0..20_000u64 {
                let now = Instant::from_millis(1_000 + ms);
                if ms % every == 3 {
                    calls += 1;
                    if !table.take(&terms, now, sparse, 1).admitted() {
                        refused += 1;
                    }
                }
                while table.take(&terms, now, greedy, 1).admitted() {
                    greedy_got += 1;
                }
            }
            assert_eq!(refused, 0, "every {every} ms: {refused} of {calls}");
            // 20 s at 95/s and the first burst, less the sparse calls.
            assert!(
                greedy_got + calls >= 20 * 95,
                "every {every} ms: greedy {greedy_got}"
            );
        }
    }

    /// A key asking under the limit alone counts as quiet, and its part
    /// holds the whole burst; a newcomer's first call is served from it
    /// (the shares are worked out again as the newcomer comes).
    #[test]
    fn a_newcomer_beside_a_busy_key_under_the_limit_is_served() {
        let terms = FairTerms {
            capacity: 95 * UNIT,
            burst: 5 * UNIT,
            max_keys: 100,
        };
        let mut table = FairTable::default();
        let (busy, newcomer) = (key(1, 1), key(2, 1));
        // 90 a second, 9 a window, for 2 s: its part fills to the burst
        // between windows, and nothing is spare.
        for ms in 0..2_000u64 {
            if ms % 100 < 9 {
                table.take(&terms, Instant::from_millis(1_000 + ms), busy, 1);
            }
        }
        let now = Instant::from_millis(3_000);
        assert!(table.keys[0].is_quiet(), "{table:?}");
        assert!(table.take(&terms, now, newcomer, 1).admitted(), "{table:?}");
    }

    /// The reserve is one token, kept only when the burst holds two: with
    /// a burst of one it would starve the busy keys.
    #[test]
    fn the_reserve_leaves_a_burst_of_one_to_the_busy_keys() {
        for (burst, kept) in [(1, 0), (2, 1), (5, 1)] {
            let terms = FairTerms {
                capacity: 10 * UNIT,
                burst: burst * UNIT,
                max_keys: 10,
            };
            let mut table = FairTable::default();
            let now = Instant::from_millis(1_000);
            while table.take(&terms, now, key(1, 1), 1).admitted() {}
            let later = Instant::from_millis(5_000);
            table.take(&terms, later, key(1, 1), 1);
            assert_eq!(table.reserve, kept * UNIT as i64, "burst {burst}");
            assert!(
                table.pool + table.reserve + table.keys[0].tokens <= burst as i64 * UNIT as i64,
                "burst {burst}: {table:?}"
            );
        }
    }

    /// A fleet share's small burst (2) between two greedy keys of weights
    /// 1 and 2: each keeps room for a call and they get the rate by
    /// weight (a reserve kept there left the heavier key no room, and it
    /// got nothing through two real Envoys).
    #[test]
    fn a_small_burst_between_greedy_keys_keeps_no_reserve() {
        let terms = FairTerms {
            capacity: 67 * UNIT,
            burst: 2 * UNIT,
            max_keys: 10,
        };
        let mut table = FairTable::default();
        let (light, heavy) = (key(1, 1), key(2, 2));
        let mut got = [0u64; 2];
        for ms in 0..10_000u64 {
            let now = Instant::from_millis(1_000 + ms);
            for (n, who) in [light, heavy].into_iter().enumerate() {
                if table.take(&terms, now, who, 1).admitted() && ms >= 2_000 {
                    got[n] += 1;
                }
            }
        }
        // 8 s at 67 a second: a third and two thirds.
        assert!(
            got[0].abs_diff(179) <= 9 && got[1].abs_diff(357) <= 18,
            "{got:?}"
        );
    }

    /// Three greedy keys under a burst of 2: each part holds its share of
    /// the burst, less than a token for two of them, and goes into debt
    /// for the rest of a call. The whole rate goes, by weight (each part
    /// holding a token at least, the last in turn held nothing: 54 to 69
    /// a second of 95 went, the heaviest key no more than the others).
    #[test]
    fn three_greedy_keys_under_a_burst_of_two_get_the_rate_by_weight() {
        let terms = FairTerms {
            capacity: 95 * UNIT,
            burst: 2 * UNIT,
            max_keys: 10,
        };
        let mut table = FairTable::default();
        let keys = [key(1, 1), key(2, 1), key(3, 2)];
        let mut got = [0u64; 3];
        for tick in 0..40_000u64 {
            // Every 250 µs, in turn: each key asks every millisecond.
            let now = Instant::from_nanos((1_000_000 + tick * 250) * 1_000);
            let n = (tick % 4) as usize;
            let Some(&who) = keys.get(n) else { continue };
            if table.take(&terms, now, who, 1).admitted() && tick >= 8_000 {
                got[n] += 1;
            }
            let held =
                table.keys.iter().map(|k| k.tokens).sum::<i64>() + table.pool + table.reserve;
            assert!(held <= terms.burst as i64, "{table:?}");
        }
        // 8 s at 95 a second: a quarter, a quarter and a half.
        let want = [190, 190, 380];
        for (got, want) in got.iter().zip(want) {
            assert!(got.abs_diff(want) <= want / 50, "{got:?} of {want}");
        }
    }

    /// Shared data with a part far in debt (or the pool): the other keys
    /// are served, and the part's debt is a token at most.
    #[test]
    fn a_part_broken_far_into_debt_holds_back_no_other_key() {
        let mut table = FairTable::default();
        let (a, b) = (key(1, 1), key(2, 1));
        assert!(table
            .take(&TERMS, Instant::from_millis(1_000), a, 1)
            .admitted());
        assert!(table
            .take(&TERMS, Instant::from_millis(1_000), b, 1)
            .admitted());
        table.keys[0].tokens = i64::MIN;
        table.pool = i64::MIN;
        let mut read = FairTable::decode(&table.encode()).expect("decodes");
        let served = (1..=50u64)
            .filter(|ms| {
                read.take(
                    &TERMS,
                    Instant::from_millis(1_000) + Span::from_millis(*ms * 20),
                    b,
                    1,
                )
                .admitted()
            })
            .count();
        assert!(served >= 40, "b served {served} of 50 at 50 a second");
        assert!(
            read.keys.iter().all(|k| k.tokens > -(UNIT as i64)),
            "{read:?}"
        );
    }

    #[test]
    fn an_idle_key_lends_its_share_and_takes_it_back_when_it_returns() {
        let mut table = FairTable::default();
        let (a, b, gold) = (key(1, 1), key(2, 1), key(3, 2));
        run(
            &mut table,
            &[(a, 1_000), (b, 1_000), (gold, 1_000)],
            (0, 2, 1),
        );
        let idle = run(&mut table, &[(a, 1_000), (b, 1_000), (gold, 0)], (2, 3, 2));
        assert!(
            idle[0] >= 95 && idle[1] >= 95,
            "50/50 while gold rests: {idle:?}"
        );
        let back = run(
            &mut table,
            &[(a, 1_000), (b, 1_000), (gold, 1_000)],
            (5, 3, 2),
        );
        assert!(back[2] >= 95 && back[0] <= 55, "gold back: {back:?}");
    }

    #[test]
    fn reservations_are_kept_for_a_key_that_wants_them() {
        let mut table = FairTable::default();
        let gold = FairClaimant {
            reserved: 60 * UNIT,
            ..key(3, 1)
        };
        let got = run(
            &mut table,
            &[(key(1, 1), 1_000), (gold, 1_000)],
            (0, 12, 10),
        );
        // Gold: its 60 and half of the 40 left.
        assert!(
            got[1].abs_diff(800) <= 24 && got[0].abs_diff(200) <= 10,
            "{got:?}"
        );
    }

    #[test]
    fn keys_past_max_keys_share_the_overflow_entry() {
        let mut table = FairTable::default();
        let terms = FairTerms {
            max_keys: 2,
            ..TERMS
        };
        for k in 1..=5 {
            table.take(&terms, Instant::from_millis(1), key(k, 1), 1);
        }
        assert_eq!(table.keys.len(), 3);
        assert_eq!(table.keys[2].key, OVERFLOW_KEY);
        assert_eq!(table.keys[2].asked, 3 * UNIT, "keys 3, 4 and 5");
        // A key whose hash is the overflow's own is not taken for it.
        table.take(&terms, Instant::from_millis(2), key(OVERFLOW_KEY, 1), 1);
        assert_eq!(table.keys[2].asked, 3 * UNIT);
    }

    #[test]
    fn a_refused_call_is_told_when_its_share_brings_one() {
        let mut table = FairTable::default();
        let (a, b) = (key(1, 1), key(2, 1));
        run(&mut table, &[(a, 1_000), (b, 1_000)], (0, 1, 1));
        let now = Instant::from_millis(1_000);
        let mut refused = None;
        for _ in 0..100 {
            if let FairTake::Refused { retry_after } = table.take(&TERMS, now, a, 1) {
                refused = Some(retry_after);
                break;
            }
        }
        let retry = refused.expect("a greedy key is refused");
        // At 50 a second a token takes 20 ms.
        assert!(retry <= Span::from_millis(21), "{retry:?}");
    }

    #[test]
    fn a_call_the_limit_refused_is_refunded_only_for_want_of_a_slot() {
        let mut table = FairTable::default();
        let a = key(1, 1);
        run(&mut table, &[(a, 1_000)], (0, 1, 1));
        let now = Instant::from_millis(1_000);
        while table.take(&TERMS, now, a, 1).admitted() {}
        let before = table.keys[0].tokens;
        table.give_back(&TERMS, a, 1, false);
        assert_eq!(
            table.keys[0].tokens, before,
            "the table held more than the bucket"
        );
        table.give_back(&TERMS, a, 1, true);
        assert_eq!(
            table.keys[0].tokens,
            before + UNIT as i64,
            "a slot was missing"
        );
        assert!(table.take(&TERMS, now, a, 1).admitted());
    }

    /// One call a day, burst 1: the first call goes, the next is refused
    /// for a day, then goes (the table keeps time however slow; a rate
    /// in whole millionths of a token a second, 11 for 11.57, fills up to
    /// a tenth later than the bucket, never sooner).
    #[test]
    fn a_slow_rate_is_shared_as_slowly_as_the_bucket_fills() {
        let day = FairTerms {
            capacity: UNIT / 86_400,
            burst: UNIT,
            max_keys: 10,
        };
        let mut table = FairTable::default();
        let t = |s: u64| Instant::from_millis(s * 1000);
        assert!(table.take(&day, t(1), key(1, 1), 1).admitted());
        assert!(!table.take(&day, t(2), key(1, 1), 1).admitted());
        assert!(!table.take(&day, t(43_200), key(1, 1), 1).admitted());
        assert!(!table.take(&day, t(86_300), key(1, 1), 1).admitted());
        assert!(table.take(&day, t(95_100), key(1, 1), 1).admitted());
    }

    #[test]
    fn bad_bytes_are_refused_not_read() {
        let mut table = FairTable::default();
        table.take(&TERMS, Instant::from_millis(5), key(9, 1), 1);
        let bytes = table.encode();
        assert_eq!(FairTable::decode(&bytes), Ok(table.clone()));
        assert!(FairTable::decode(&bytes[..bytes.len() - 1]).is_err());
        assert!(FairTable::decode(&[]).is_err());
        assert!(FairTable::decode(&[9; 40]).is_err());
        let mut many = bytes.clone();
        many[33..37].copy_from_slice(&u32::MAX.to_le_bytes());
        // Version 2, written before the reserve: read with none.
        let mut two = bytes.clone();
        two.drain(25..33);
        two[0] = 2;
        let read = FairTable::decode(&two).expect("version 2 is read");
        assert_eq!(read.reserve, 0);
        assert_eq!(read.keys, table.keys);
        assert_eq!(
            FairTable::decode(&many),
            Err(FairDecodeError::TooManyKeys(u32::MAX as usize))
        );
    }

    proptest! {
        /// Whatever the calls, costs, weights and clock (even going back):
        /// no panic, the table never holds more than the burst, and over
        /// any run no more is admitted than a token bucket of the limit's
        /// rate and burst admits: the rate over the run and the burst.
        #[test]
        fn never_more_than_the_limit_and_what_it_holds(
            calls in prop::collection::vec((0u64..6, 1u64..4, 0u64..3_000_000, 1u64..3_000), 1..400),
        ) {
            let mut table = FairTable::default();
            let mut now = 0u64;
            let mut admitted = 0u64;
            let (mut first, mut last) = (u64::MAX, 0u64);
            for (k, cost, step, weight) in calls {
                now = now.saturating_add(step);
                first = first.min(now);
                last = last.max(now);
                let who = FairClaimant { key: k, weight, reserved: (k % 2) * 30 * UNIT };
                if table.take(&TERMS, Instant::from_nanos(now), who, cost).admitted() {
                    admitted += cost;
                }
                // What the table holds never passes the burst: the policy's
                // bucket holds no more, and would refuse what it admitted.
                // A part in debt holds that much less, never a token less.
                let held = table.keys.iter().map(|k| k.tokens).sum::<i64>()
                    + table.pool.max(0)
                    + table.reserve.max(0);
                prop_assert!(held <= TERMS.burst as i64, "holds {} of {}: {:?}", held, TERMS.burst, table);
                prop_assert!(table.keys.iter().all(|k| k.tokens > -(UNIT as i64)), "{:?}", table);
                let bytes = table.encode();
                prop_assert_eq!(FairTable::decode(&bytes), Ok(table.clone()));
            }
            let seconds = (last - first) as f64 / 1e9;
            let bound = 100.0 * seconds + 10.0;
            prop_assert!((admitted as f64) <= bound, "{} > {}", admitted, bound);
        }
    }
}
