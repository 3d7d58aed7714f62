//! A fair policy's calls in the queue, within a priority: start-time
//! fair queueing tags ([`FairTag`]), each key's share of the rate as its
//! weight.

use super::*;

/// Where a waiting call of a `fair` policy stands in start-time fair
/// queueing (Goyal, Vin and Cheng 1996): it starts at the later of the
/// queue's virtual time and the end of its key's calls already waiting,
/// and spans its cost per weight. Calls leave by start (arrival order
/// among equal starts): a key with nothing waiting starts at the virtual
/// time, ahead of a noisy key's backlog, so its wait is bounded by its
/// share; within a key, first come first served.
///
/// With reservations (`min`), a call spans its cost per its key's share
/// instead of its weight: the share among the keys waiting then, each
/// taken as greedy, reservations first ([`sluice_shared::fair::shares`]),
/// so a reserved key leaves at its reservation at least while it waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FairTag {
    pub key: u64,
    pub start: u64,
    pub end: u64,
    /// Its key's weight (thousandths) and reservation ([`fair::UNIT`]s a
    /// second), for the shares of the calls that come after.
    pub weight: u64,
    pub reserved: u64,
}

/// A `fair` policy's call as its queue places it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FairCall {
    pub who: FairClaimant,
    /// For a policy with reservations: the rate its keys share
    /// ([`fair::UNIT`]s a second). None: weights alone place its calls.
    pub reserving: Option<u64>,
    /// The rate its keys share ([`fair::UNIT`]s a second; 0 unknown): how
    /// fast the virtual time moves, so how long a call placed ahead of it
    /// waits.
    pub rate: u64,
}

/// Virtual time one token spans at weight 1 (1 000 thousandths).
pub const VIRTUAL_PER_TOKEN: u64 = 1_000_000;

/// With reservations, a key's share of the rate stands in for its weight,
/// in thousandths of the rate (a key with all of it weighs as one of
/// weight 1 alone).
pub(super) const SHARE_AS_WEIGHT: u128 = fair::WEIGHT_SCALE as u128;

impl BucketState {
    /// Where `call` costing `cost` starts and ends in the fair order. Key
    /// 0 stands for none in the layout: a key hashed to 0 is taken as 1.
    pub(super) fn fair_tag(&self, call: FairCall, cost: u64) -> FairTag {
        let who = call.who;
        let key = who.key.max(1);
        let start = self
            .waiters
            .iter()
            .filter_map(|w| w.fair)
            .filter(|f| f.key == key)
            .map(|f| f.end)
            .max()
            .unwrap_or(0)
            .max(self.finish_of(key))
            .max(self.virtual_now);
        let weight = match call.reserving {
            None => who.weight,
            Some(capacity) => self.share_as_weight(who, key, capacity),
        };
        let span = cost
            .max(1)
            .saturating_mul(VIRTUAL_PER_TOKEN)
            .checked_div(weight.max(1))
            .unwrap_or(u64::MAX)
            .max(1);
        FairTag {
            key,
            start,
            end: start.saturating_add(span),
            weight: who.weight,
            reserved: who.reserved,
        }
    }

    /// How long a call tagged `tag` waits while every key waiting keeps
    /// its queue: the virtual time moves at the rate times
    /// [`VIRTUAL_PER_TOKEN`] over the weights waiting (by shares, which add
    /// up to one whole).
    pub(super) fn fair_wait(&self, call: FairCall, tag: FairTag) -> Span {
        let ahead = tag.start.saturating_sub(self.virtual_now);
        if ahead == 0 || call.rate == 0 {
            return Span::ZERO;
        }
        let weights: u128 = match call.reserving {
            Some(_) => SHARE_AS_WEIGHT,
            None => {
                let mut keys: Vec<(u64, u64)> = vec![(tag.key, call.who.weight)];
                for w in self.waiters.iter().filter_map(|w| w.fair) {
                    if keys.iter().all(|(k, _)| *k != w.key) {
                        keys.push((w.key, w.weight));
                    }
                }
                keys.iter().map(|(_, w)| u128::from((*w).max(1))).sum()
            }
        };
        // An estimate: f64 keeps the product of large factors in range.
        let seconds = ahead as f64 * weights as f64 * fair::UNIT as f64
            / (call.rate as f64 * VIRTUAL_PER_TOKEN as f64);
        Span::from_nanos((seconds * 1e9).min(u64::MAX as f64) as u64)
    }

    /// Where `key`'s last call that left ended (0: it ends nowhere ahead).
    pub(super) fn finish_of(&self, key: u64) -> u64 {
        self.finishes
            .iter()
            .find(|(k, _)| *k == key)
            .map_or(0, |(_, end)| *end)
    }

    /// `who`'s share of `capacity` among the keys waiting and itself, all
    /// greedy, reservations first: in thousandths of the capacity.
    pub(super) fn share_as_weight(&self, who: FairClaimant, key: u64, capacity: u64) -> u64 {
        let mut keys: Vec<(u64, Claim)> = vec![(
            key,
            Claim {
                weight: who.weight,
                demand: capacity,
                reserved: who.reserved,
            },
        )];
        for tag in self.waiters.iter().filter_map(|w| w.fair) {
            if keys.iter().all(|(k, _)| *k != tag.key) {
                keys.push((
                    tag.key,
                    Claim {
                        weight: tag.weight,
                        demand: capacity,
                        reserved: tag.reserved,
                    },
                ));
            }
        }
        let claims: Vec<Claim> = keys.iter().map(|(_, c)| *c).collect();
        let mine = fair::shares(capacity, &claims)
            .first()
            .copied()
            .unwrap_or(0);
        let part = u128::from(mine) * SHARE_AS_WEIGHT / u128::from(capacity.max(1));
        u64::try_from(part).unwrap_or(u64::MAX)
    }
}
