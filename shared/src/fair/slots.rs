//! A concurrency limit shared fairly between keys: which key may take one
//! more slot, as one value every worker changes by compare-and-swap.
//!
//! Slots cannot be taken back from a call in flight, so fairness acts on
//! who takes the slots that free up: each key's share of the slots comes
//! from [`shares`](super::shares) over what each key holds and wants
//! (weighted max-min, reservations first). A key holding less than its
//! share takes a free slot; a key at or past its share takes one only if
//! the free slots are more than what the keys that want more still lack of
//! their shares. Work-conserving: a slot nobody else wants goes to whoever
//! asks.
//!
//! What a key wants is read from its refusals, as callers cannot be told
//! apart (a caller retrying often looks like many):
//! - for [`HUNGER_MEMORY`] after a refusal it is *hungry*: it wants all it
//!   can get, and its whole share is kept for it, however many slots free
//!   at once (slots end in bursts, and a key at its share would take the
//!   second of two before the hungry key came back for it);
//! - for [`WANT_MEMORY`] after one it wants one slot more than it holds:
//!   long enough for a caller that honours the one-second `Retry-After`
//!   to come back and find the slot kept for it.
//!
//! A slot is kept idle for a key that no longer wants it for at most
//! [`HUNGER_MEMORY`] (its share) and then [`WANT_MEMORY`] (one slot).
//!
//! Slots are held on leases, one per worker, as the limit's own lease
//! table holds them, and each lease counts its slots per key: a worker that
//! dies stops renewing, and its slots leave every key's count with its
//! lease. The table is a gate before the limit's own lease table, which
//! still bounds the total: a broken or lost table reads empty and admits
//! too much for a while, never past the limit.

use crate::time::{Instant, Span};

use super::{shares, Claim, FairClaimant, FairKeyView, MAX_KEYS};

/// How long a refused key is remembered as wanting one more slot.
pub const WANT_MEMORY: Span = Span::from_secs(2);

/// How long a refused key is remembered as wanting its whole share.
pub const HUNGER_MEMORY: Span = Span::from_millis(100);

/// The most workers holding slots at once.
pub const MAX_HOLDERS: usize = 256;

/// The most (worker, key) counts held at once: a call that would need one
/// more is refused, as a full lease table refuses a new holder.
pub const MAX_HELD: usize = 8192;

/// The concurrency limit being shared: the slots its keys share (for the
/// call's priority), how long a lease lives unrenewed, and how many keys
/// have entries of their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FairSlotTerms {
    pub capacity: u32,
    pub lease_ttl: Span,
    pub max_keys: usize,
}

/// One worker's lease: the slots it holds, per key.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlotLease {
    pub holder: u64,
    /// When it began: which of the worker's leases this is.
    pub since: Instant,
    pub expires_at: Instant,
    /// (key, slots held), each key once.
    pub held: Vec<(u64, u32)>,
}

/// One key's entry.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlotKey {
    pub key: u64,
    pub weight: u64,
    /// Slots kept for it while it wants them.
    pub reserved: u64,
    /// It wants one slot more than it holds until then.
    pub wants_until: Instant,
    /// It wants its whole share until then.
    pub hungry_until: Instant,
}

super::key_entry!(SlotKey);

/// The whole shared state of one fair concurrency limit.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FairSlots {
    pub leases: Vec<SlotLease>,
    pub keys: Vec<SlotKey>,
}

/// What the table made of a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FairSlotTake {
    /// A slot for the key, on this lease of the worker's.
    Taken { lease: Instant },
    /// Try again when a call may have ended: the key is at its share
    /// while others want theirs, or (`full`) no slot is free at all.
    Refused { retry_after: Span, full: bool },
}

impl SlotKey {
    /// What it wants at `now`, holding `holds` of `capacity` slots.
    fn demand(&self, holds: u64, capacity: u64, now: Instant) -> u64 {
        if self.hungry_until >= now {
            capacity.max(holds)
        } else if self.wants_until >= now {
            holds.saturating_add(1)
        } else {
            holds
        }
    }
}

/// Why bytes are no table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FairSlotsDecodeError {
    #[error("fair slots: version {0} unknown")]
    Version(u8),
    #[error("fair slots: {0} bytes, not a whole table")]
    Length(usize),
    #[error("fair slots: more than its bounds allow ({0})")]
    TooMany(&'static str),
}

/// When a refused call may find a slot: a call in flight has to end
/// first, and nothing says when (as a concurrency limit answers).
const RETRY_AFTER: Span = Span::from_secs(1);

const VERSION: u8 = 1;

impl FairSlots {
    /// One more slot for `who`, held by `holder`.
    pub fn take(
        &mut self,
        terms: &FairSlotTerms,
        holder: u64,
        now: Instant,
        who: FairClaimant,
    ) -> FairSlotTake {
        self.forget_past(now);
        let at = self.entry(terms, who);
        let key = self.keys[at].key;
        let held = self.held_per_key();
        let total = self.in_flight();
        let capacity = u64::from(terms.capacity);
        let full = total >= capacity;
        let admitted = !full && self.fits(capacity, (&held, total), at, now);
        let lease_place = self.lease_place(holder, key);
        let Some(lease_at) = lease_place.filter(|_| admitted) else {
            self.keys[at].wants_until = now + WANT_MEMORY;
            self.keys[at].hungry_until = now + HUNGER_MEMORY;
            return FairSlotTake::Refused {
                retry_after: RETRY_AFTER,
                full: full || lease_place.is_none(),
            };
        };
        let expires_at = now + terms.lease_ttl;
        let lease = match lease_at {
            Some(i) => &mut self.leases[i],
            None => {
                self.leases.push(SlotLease {
                    holder,
                    since: now,
                    expires_at,
                    held: Vec::new(),
                });
                let last = self.leases.len() - 1;
                &mut self.leases[last]
            }
        };
        lease.expires_at = lease.expires_at.max(expires_at);
        match lease.held.iter_mut().find(|(k, _)| *k == key) {
            Some((_, count)) => *count = count.saturating_add(1),
            None => lease.held.push((key, 1)),
        }
        FairSlotTake::Taken { lease: lease.since }
    }

    /// Whether the key at `at` may take one more slot: below its share, or
    /// with free slots beyond what the keys wanting more lack of theirs.
    fn fits(&self, capacity: u64, (held, total): (&[u64], u64), at: usize, now: Instant) -> bool {
        let claims: Vec<Claim> = self
            .keys
            .iter()
            .zip(held)
            .enumerate()
            .map(|(i, (k, &holds))| {
                let demand = if i == at {
                    holds.saturating_add(1)
                } else {
                    k.demand(holds, capacity, now)
                };
                Claim {
                    weight: k.weight,
                    demand,
                    reserved: k.reserved,
                }
            })
            .collect();
        let share = shares(capacity, &claims);
        if held[at] < share[at] {
            return true;
        }
        let lacking: u64 = share
            .iter()
            .zip(held)
            .enumerate()
            .filter(|&(i, _)| i != at)
            .map(|(_, (s, h))| s.saturating_sub(*h))
            .sum();
        capacity.saturating_sub(total) > lacking
    }

    /// Where `holder`'s lease is (`Some(None)`: it has none yet and may
    /// open one), or None when the table's bounds leave no room for one
    /// more count.
    fn lease_place(&self, holder: u64, key: u64) -> Option<Option<usize>> {
        let counts: usize = self.leases.iter().map(|l| l.held.len()).sum();
        match self.leases.iter().position(|l| l.holder == holder) {
            Some(i) => {
                let new_count = !self.leases[i].held.iter().any(|(k, _)| *k == key);
                (!new_count || counts < MAX_HELD).then_some(Some(i))
            }
            None => (self.leases.len() < MAX_HOLDERS && counts < MAX_HELD).then_some(None),
        }
    }

    /// Gives back one slot of `key` on `holder`'s lease `lease`. False when
    /// that lease is over (expired and reclaimed): nothing else is touched.
    pub fn release(&mut self, holder: u64, lease: Instant, key: u64) -> bool {
        let Some(i) = self
            .leases
            .iter()
            .position(|l| l.holder == holder && l.since == lease)
        else {
            return false;
        };
        let Some(j) = self.leases[i].held.iter().position(|(k, _)| *k == key) else {
            return false;
        };
        let count = &mut self.leases[i].held[j].1;
        *count = count.saturating_sub(1);
        if *count == 0 {
            self.leases[i].held.swap_remove(j);
        }
        if self.leases[i].held.is_empty() {
            self.leases.swap_remove(i);
        }
        true
    }

    /// Keeps `holder`'s lease alive until `now + ttl`.
    pub fn renew(&mut self, holder: u64, now: Instant, ttl: Span) -> bool {
        match self.leases.iter_mut().find(|l| l.holder == holder) {
            Some(lease) => {
                lease.expires_at = lease.expires_at.max(now + ttl);
                true
            }
            None => false,
        }
    }

    /// Slots held now, on every worker (counts of keys without an entry,
    /// which only broken bytes have, among them).
    pub fn in_flight(&self) -> u64 {
        self.leases
            .iter()
            .flat_map(|l| l.held.iter())
            .map(|&(_, count)| u64::from(count))
            .sum()
    }

    /// Each key as of `now`: its share of the slots, what it holds and
    /// what it wants (all it can get just after a refusal, then one more),
    /// the most wanting first, at most `most`.
    pub fn view(&self, terms: &FairSlotTerms, now: Instant, most: usize) -> Vec<FairKeyView> {
        let mut table = self.clone();
        table.forget_past(now);
        let held = table.held_per_key();
        let claims: Vec<Claim> = table
            .keys
            .iter()
            .zip(&held)
            .map(|(k, &holds)| Claim {
                weight: k.weight,
                demand: k.demand(holds, u64::from(terms.capacity), now),
                reserved: k.reserved,
            })
            .collect();
        let share = shares(u64::from(terms.capacity), &claims);
        let mut keys: Vec<FairKeyView> = table
            .keys
            .iter()
            .zip(held.iter().zip(&claims))
            .zip(share)
            .map(|((k, (&holds, claim)), share)| FairKeyView {
                key: k.key,
                weight: k.weight,
                share: share as f64,
                used: holds as f64,
                demand: claim.demand as f64,
                slots: true,
            })
            .collect();
        keys.sort_by(|a, b| b.demand.total_cmp(&a.demand).then(a.key.cmp(&b.key)));
        keys.truncate(most);
        keys
    }

    /// Slots held per key, in the order of `keys`.
    fn held_per_key(&self) -> Vec<u64> {
        let mut held = vec![0u64; self.keys.len()];
        for lease in &self.leases {
            for &(key, count) in &lease.held {
                if let Some(i) = self.keys.iter().position(|k| k.key == key) {
                    held[i] += u64::from(count);
                }
            }
        }
        held
    }

    /// Drops leases their worker stopped renewing, wants past their
    /// memory, and keys that neither hold nor want.
    fn forget_past(&mut self, now: Instant) {
        self.leases.retain(|l| l.expires_at >= now);
        let leases = &self.leases;
        self.keys.retain(|k| {
            k.wants_until >= now
                || leases
                    .iter()
                    .any(|l| l.held.iter().any(|(held, _)| *held == k.key))
        });
    }

    /// The entry of `who` ([`entry_of`](super::entry_of)).
    fn entry(&mut self, terms: &FairSlotTerms, who: FairClaimant) -> usize {
        super::entry_of(&mut self.keys, terms.max_keys, who).0
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![VERSION];
        let len = |n: usize| u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes();
        out.extend_from_slice(&len(self.leases.len()));
        for lease in &self.leases {
            out.extend_from_slice(&lease.holder.to_le_bytes());
            out.extend_from_slice(&lease.since.as_nanos().to_le_bytes());
            out.extend_from_slice(&lease.expires_at.as_nanos().to_le_bytes());
            out.extend_from_slice(&len(lease.held.len()));
            for (key, count) in &lease.held {
                out.extend_from_slice(&key.to_le_bytes());
                out.extend_from_slice(&count.to_le_bytes());
            }
        }
        out.extend_from_slice(&len(self.keys.len()));
        for k in &self.keys {
            for v in [k.key, k.weight, k.reserved] {
                out.extend_from_slice(&v.to_le_bytes());
            }
            out.extend_from_slice(&k.wants_until.as_nanos().to_le_bytes());
            out.extend_from_slice(&k.hungry_until.as_nanos().to_le_bytes());
        }
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, FairSlotsDecodeError> {
        let mut r = Reader { bytes, at: 0 };
        match r.take::<1>()? {
            [VERSION] => {}
            [other] => return Err(FairSlotsDecodeError::Version(other)),
        }
        let leases_len = r.len(MAX_HOLDERS, "workers")?;
        let mut leases = Vec::with_capacity(leases_len);
        let mut counts = 0usize;
        for _ in 0..leases_len {
            let holder = r.u64()?;
            let since = Instant::from_nanos(r.u64()?);
            let expires_at = Instant::from_nanos(r.u64()?);
            let held_len = r.len(MAX_HELD - counts, "counts held")?;
            counts += held_len;
            let mut held = Vec::with_capacity(held_len);
            for _ in 0..held_len {
                held.push((r.u64()?, r.u32()?));
            }
            leases.push(SlotLease {
                holder,
                since,
                expires_at,
                held,
            });
        }
        let keys_len = r.len(MAX_KEYS + 1, "keys")?;
        let mut keys = Vec::with_capacity(keys_len);
        for _ in 0..keys_len {
            keys.push(SlotKey {
                key: r.u64()?,
                weight: r.u64()?,
                reserved: r.u64()?,
                wants_until: Instant::from_nanos(r.u64()?),
                hungry_until: Instant::from_nanos(r.u64()?),
            });
        }
        if r.at != bytes.len() {
            return Err(FairSlotsDecodeError::Length(bytes.len()));
        }
        Ok(Self { leases, keys })
    }
}

/// Reads a table's bytes in order, every read checked.
struct Reader<'b> {
    bytes: &'b [u8],
    at: usize,
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], FairSlotsDecodeError> {
        let end = self.at.saturating_add(N);
        let got = self
            .bytes
            .get(self.at..end)
            .and_then(|b| <[u8; N]>::try_from(b).ok())
            .ok_or(FairSlotsDecodeError::Length(self.bytes.len()))?;
        self.at = end;
        Ok(got)
    }

    fn u64(&mut self) -> Result<u64, FairSlotsDecodeError> {
        self.take::<8>().map(u64::from_le_bytes)
    }

    fn u32(&mut self) -> Result<u32, FairSlotsDecodeError> {
        self.take::<4>().map(u32::from_le_bytes)
    }

    fn len(&mut self, most: usize, what: &'static str) -> Result<usize, FairSlotsDecodeError> {
        let n = self.u32()? as usize;
        if n > most {
            return Err(FairSlotsDecodeError::TooMany(what));
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::super::{OVERFLOW_KEY, WEIGHT_SCALE};
    use super::*;
    use proptest::prelude::*;

    const TERMS: FairSlotTerms = FairSlotTerms {
        capacity: 10,
        lease_ttl: Span::from_secs(30),
        max_keys: 100,
    };

    fn key(key: u64, weight: u64) -> FairClaimant {
        FairClaimant {
            key,
            weight: weight * WEIGHT_SCALE,
            reserved: 0,
        }
    }

    fn at(ms: u64) -> Instant {
        Instant::from_nanos(1_000_000_000 + ms * 1_000_000)
    }

    fn taken(t: FairSlotTake) -> Option<Instant> {
        match t {
            FairSlotTake::Taken { lease } => Some(lease),
            FairSlotTake::Refused { .. } => None,
        }
    }

    fn held_by(table: &FairSlots, key: u64) -> u32 {
        table
            .leases
            .iter()
            .flat_map(|l| l.held.iter())
            .filter(|(k, _)| *k == key)
            .map(|(_, c)| c)
            .sum()
    }

    #[test]
    fn a_lone_key_takes_every_slot_and_no_more() {
        let mut table = FairSlots::default();
        for n in 0..10 {
            assert!(taken(table.take(&TERMS, 7, at(n), key(1, 1))).is_some());
        }
        assert!(taken(table.take(&TERMS, 7, at(11), key(1, 1))).is_none());
        assert_eq!(table.in_flight(), 10);
    }

    #[test]
    fn slots_that_free_go_to_the_key_below_its_share() {
        let mut table = FairSlots::default();
        let mut leases = Vec::new();
        for n in 0..10 {
            leases.push(taken(table.take(&TERMS, 7, at(n), key(1, 1))).unwrap());
        }
        // The quiet key comes: refused (no slot free), and now wants.
        assert!(taken(table.take(&TERMS, 8, at(20), key(2, 1))).is_none());
        // Five of the noisy key's calls end; it asks again at once and is
        // refused each time while the quiet key lacks its five.
        let mut quiet = 0;
        for (n, lease) in (0u64..).zip(&leases[..5]) {
            assert!(table.release(7, *lease, 1));
            assert!(
                taken(table.take(&TERMS, 7, at(30 + n), key(1, 1))).is_none(),
                "the noisy key is at its share"
            );
            if taken(table.take(&TERMS, 8, at(31 + n), key(2, 1))).is_some() {
                quiet += 1;
            }
        }
        assert_eq!(quiet, 5);
        assert_eq!(held_by(&table, 1), 5);
        assert_eq!(held_by(&table, 2), 5);
    }

    #[test]
    fn a_key_refused_again_and_again_keeps_one_slot_free_not_more() {
        let mut table = FairSlots::default();
        let mut leases = Vec::new();
        for n in 0..10 {
            leases.push(taken(table.take(&TERMS, 7, at(n), key(1, 1))).unwrap());
        }
        for n in 0..50 {
            assert!(taken(table.take(&TERMS, 8, at(20 + n), key(2, 1))).is_none());
        }
        for lease in &leases[..3] {
            assert!(table.release(7, *lease, 1));
        }
        // Just after its refusals the quiet key is hungry: all three are
        // kept for it (its share is five).
        assert!(taken(table.take(&TERMS, 7, at(100), key(1, 1))).is_none());
        // Later it wants one more: the noisy key takes two, the third is
        // kept.
        let later = at(100) + HUNGER_MEMORY;
        let noisy: Vec<_> = (0..3)
            .filter_map(|n| taken(table.take(&TERMS, 7, later + Span::from_millis(n), key(1, 1))))
            .collect();
        assert_eq!(noisy.len(), 2);
        assert!(taken(table.take(&TERMS, 8, later + Span::from_millis(9), key(2, 1))).is_some());
    }

    #[test]
    fn weights_divide_the_slots() {
        let mut table = FairSlots::default();
        // Both want more than the limit; slots free one at a time.
        let mut holding: Vec<(u64, Instant)> = Vec::new();
        let mut t = 0;
        for _ in 0..400 {
            t += 1;
            for who in [key(1, 1), key(2, 3)] {
                if let Some(lease) = taken(table.take(&TERMS, 7, at(t), who)) {
                    holding.push((who.key, lease));
                }
            }
            // The oldest call ends.
            if holding.len() == 10 {
                let (k, lease) = holding.remove(0);
                assert!(table.release(7, lease, k));
            }
        }
        let ones = holding.iter().filter(|(k, _)| *k == 1).count();
        assert!((2..=3).contains(&ones), "weight 1 of 4 holds {ones} of 9");
    }

    #[test]
    fn a_reservation_is_kept_while_wanted_and_lent_while_not() {
        let terms = TERMS;
        let gold = FairClaimant {
            key: 2,
            weight: WEIGHT_SCALE,
            reserved: 6,
        };
        let mut table = FairSlots::default();
        // Gold wants nothing: the other key takes all ten.
        for n in 0..10 {
            assert!(taken(table.take(&terms, 7, at(n), key(1, 1))).is_some());
        }
        // Gold comes and is refused; every slot that frees goes to gold
        // until it has its six.
        assert!(taken(table.take(&terms, 7, at(20), gold)).is_none());
        let lease = table.leases[0].since;
        for n in 0..6 {
            assert!(table.release(7, lease, 1));
            assert!(taken(table.take(&terms, 7, at(30 + n), key(1, 1))).is_none());
            // Gold wants more than one: it asks twice a turn.
            assert!(taken(table.take(&terms, 7, at(31 + n), gold)).is_some());
            let _ = table.take(&terms, 7, at(31 + n), gold);
        }
        assert_eq!(held_by(&table, 2), 6);
    }

    #[test]
    fn a_dead_workers_slots_leave_with_its_lease() {
        let mut table = FairSlots::default();
        for n in 0..10 {
            assert!(taken(table.take(&TERMS, 7, at(n), key(1, 1))).is_some());
        }
        let later = at(10) + TERMS.lease_ttl + Span::from_millis(1);
        assert!(taken(table.take(&TERMS, 8, later, key(2, 1))).is_some());
        assert_eq!(table.in_flight(), 1);
        assert_eq!(table.keys.len(), 1, "the dead worker's key is gone");
        // Its late release names a lease that is over: nothing changes.
        assert!(!table.release(7, at(0), 1));
        assert_eq!(table.in_flight(), 1);
    }

    #[test]
    fn a_want_is_forgotten_after_its_memory() {
        let mut table = FairSlots::default();
        let mut leases = Vec::new();
        for n in 0..10 {
            leases.push(taken(table.take(&TERMS, 7, at(n), key(1, 1))).unwrap());
        }
        assert!(taken(table.take(&TERMS, 8, at(20), key(2, 1))).is_none());
        assert!(table.release(7, leases[0], 1));
        let after = at(20) + WANT_MEMORY + Span::from_millis(1);
        assert!(
            taken(table.take(&TERMS, 7, after, key(1, 1))).is_some(),
            "nobody else wants the slot"
        );
    }

    #[test]
    fn keys_past_max_keys_share_the_overflow_entry() {
        let terms = FairSlotTerms {
            max_keys: 2,
            ..TERMS
        };
        let mut table = FairSlots::default();
        for k in 1..=6 {
            assert!(taken(table.take(&terms, 7, at(k), key(k * 10, 1))).is_some());
        }
        assert_eq!(table.keys.len(), 3);
        assert_eq!(held_by(&table, OVERFLOW_KEY), 4);
    }

    #[test]
    fn bad_bytes_are_refused() {
        let mut table = FairSlots::default();
        let _ = table.take(&TERMS, 7, at(0), key(1, 1));
        let bytes = table.encode();
        assert_eq!(FairSlots::decode(&bytes), Ok(table));
        for cut in 0..bytes.len() {
            assert!(FairSlots::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(FairSlots::decode(&longer).is_err());
        let mut version = bytes.clone();
        version[0] = 9;
        assert_eq!(
            FairSlots::decode(&version),
            Err(FairSlotsDecodeError::Version(9))
        );
        let mut huge = vec![VERSION];
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            FairSlots::decode(&huge),
            Err(FairSlotsDecodeError::TooMany(_))
        ));
    }

    proptest! {
        /// Whatever the keys, workers and order of takes, releases and
        /// deaths: never more slots held than the limit, every count held
        /// on a live lease, and a release gives back exactly one slot.
        #[test]
        fn never_more_slots_than_the_limit(
            ops in prop::collection::vec((0u8..4, 0u64..6, 0u64..3, 1u64..400), 1..300),
            capacity in 1u32..12,
        ) {
            let terms = FairSlotTerms { capacity, lease_ttl: Span::from_millis(500), max_keys: 3 };
            let mut table = FairSlots::default();
            let mut holding: Vec<(u64, u64, Instant)> = Vec::new();
            let mut now = at(0);
            for (op, k, holder, ms) in ops {
                now += Span::from_millis(ms);
                match op {
                    0 | 1 => {
                        let who = FairClaimant { key: k, weight: (k + 1) * 500, reserved: k % 2 };
                        if let FairSlotTake::Taken { lease } = table.take(&terms, holder, now, who) {
                            let stored = if k == OVERFLOW_KEY { 1 } else { k };
                            let stored = if table.keys.iter().any(|e| e.key == stored) { stored } else { OVERFLOW_KEY };
                            holding.push((holder, stored, lease));
                        }
                    }
                    2 => {
                        if let Some((holder, key, lease)) = holding.pop() {
                            let before = table.in_flight();
                            if table.release(holder, lease, key) {
                                prop_assert_eq!(table.in_flight(), before - 1);
                            }
                        }
                    }
                    _ => { table.renew(holder, now, terms.lease_ttl); }
                }
                prop_assert!(table.in_flight() <= u64::from(capacity));
                let bytes = table.encode();
                prop_assert_eq!(FairSlots::decode(&bytes), Ok(table.clone()));
            }
        }
    }
}
