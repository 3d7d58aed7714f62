//! Fair shares of one limit between the keys that want it (issue step 4):
//! weighted max-min fairness, work-conserving, with reservations.
//!
//! Each key asks for `demand` (what it would take this round) and has a
//! `weight` and a `reserved` floor. A key first gets its reservation, as far
//! as it wants it (a reservation is lent out while its key does not want
//! it); what is left of the capacity is then filled like water by weight:
//! every key that wants more rises at the pace of its weight until it has
//! all it wants or the capacity is gone (as HTB's guaranteed rate plus a
//! weighted share of what is spare). Work-conserving: capacity only goes
//! unused when nobody wants it.
//!
//! The sum of the shares never passes the capacity, whatever the
//! reservations say (a peer's minimum share per member once pushed its
//! total past the cap): reservations beyond the capacity are cut, in key
//! order, and a valid set never has them (`validate` refuses it).
//!
//! Integer units throughout: weights in thousandths, shares in the limit's
//! tokens, the remainder of a division handed out one token at a time by
//! largest remainder (ties to the earlier key), so the shares add up
//! exactly.

/// Implements [`KeyEntry`] for an entry with `key`, `weight` and
/// `reserved` fields.
macro_rules! key_entry {
    ($entry:ty) => {
        impl super::KeyEntry for $entry {
            fn key(&self) -> u64 {
                self.key
            }
            fn set_key(&mut self, key: u64) {
                self.key = key;
            }
            fn set_terms(&mut self, weight: u64, reserved: u64) {
                (self.weight, self.reserved) = (weight, reserved);
            }
        }
    };
}
use key_entry;

mod slots;
mod table;
mod table_bytes;
mod table_fill;
pub use slots::{
    FairSlotTake, FairSlotTerms, FairSlots, FairSlotsDecodeError, SlotKey, SlotLease,
    HUNGER_MEMORY, WANT_MEMORY,
};
pub use table::{
    FairClaimant, FairKey, FairKeyView, FairTable, FairTake, FairTerms, MAX_KEYS, OVERFLOW_KEY,
    UNIT, WINDOW,
};
pub use table_bytes::FairDecodeError;

/// A key's entry in a fair table (of a rate or of slots).
pub(crate) trait KeyEntry: Default {
    fn key(&self) -> u64;
    fn set_key(&mut self, key: u64);
    /// Takes the weight and reservation `who` asks with now.
    fn set_terms(&mut self, weight: u64, reserved: u64);
}

/// The entry of `who` among `keys`: its own (made if it has none, while
/// fewer than `max_keys` (at most [`MAX_KEYS`]) have one), else the one
/// overflow entry all the others share (weight 1, nothing reserved).
/// Returns where it is, and whether it was made now. The key hash
/// [`OVERFLOW_KEY`] stands for the overflow: a key hashed to it is taken
/// as 1.
pub(crate) fn entry_of<E: KeyEntry>(
    keys: &mut Vec<E>,
    max_keys: usize,
    who: FairClaimant,
) -> (usize, bool) {
    let key = if who.key == OVERFLOW_KEY { 1 } else { who.key };
    if let Some(at) = keys.iter().position(|k| k.key() == key) {
        keys[at].set_terms(who.weight, who.reserved);
        return (at, false);
    }
    let own_places = keys.iter().filter(|k| k.key() != OVERFLOW_KEY).count();
    let (key, weight, reserved) = if own_places < max_keys.min(MAX_KEYS) {
        (key, who.weight, who.reserved)
    } else if let Some(at) = keys.iter().position(|k| k.key() == OVERFLOW_KEY) {
        return (at, false);
    } else {
        (OVERFLOW_KEY, WEIGHT_SCALE, 0)
    };
    let mut entry = E::default();
    entry.set_key(key);
    entry.set_terms(weight, reserved);
    keys.push(entry);
    (keys.len() - 1, true)
}

/// Keys an Envoy reports per fair policy, the busiest first.
pub const REPORTED_KEYS: usize = 64;

/// Weights are kept in thousandths: `0.5` is 500.
pub const WEIGHT_SCALE: u64 = 1000;

/// What one key brings to a round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claim {
    /// Its weight in thousandths (0 counts as the smallest weight, 1, and
    /// past 1 000 000 as 1 000 000).
    pub weight: u64,
    /// What it would take.
    pub demand: u64,
    /// Kept for it while it wants it.
    pub reserved: u64,
}

/// Each key's share of `capacity`, in the order of `claims`.
pub fn shares(capacity: u64, claims: &[Claim]) -> Vec<u64> {
    let mut grant: Vec<u64> = Vec::with_capacity(claims.len());
    // Reservations first, as far as each key wants its own; never past
    // the capacity.
    let mut left = capacity;
    for claim in claims {
        let take = claim.reserved.min(claim.demand).min(left);
        left -= take;
        grant.push(take);
    }
    // Then the rest by weight, as water fills: the keys in the order of
    // what they still want per weight; each that wants no more than its
    // weighted part of what is left gets all it wants, and once one wants
    // more, it and every key after it (wanting more still) divide what is
    // left by weight.
    let mut wanting: Vec<(usize, u64)> = (0..claims.len())
        .filter_map(|i| {
            let want = claims[i].demand - grant[i];
            (want > 0).then_some((i, want))
        })
        .collect();
    // a/wa < b/wb, exactly: a*wb < b*wa.
    wanting.sort_by(|&(i, a), &(j, b)| {
        (u128::from(a) * weight_of(&claims[j]))
            .cmp(&(u128::from(b) * weight_of(&claims[i])))
            .then(i.cmp(&j))
    });
    let mut weight_left: u128 = wanting.iter().map(|&(i, _)| weight_of(&claims[i])).sum();
    for (at, &(i, want)) in wanting.iter().enumerate() {
        let weight = weight_of(&claims[i]);
        if u128::from(want) * weight_left <= u128::from(left) * weight {
            grant[i] += want;
            left -= want;
            weight_left -= weight;
            continue;
        }
        divide(left, weight_left, &wanting[at..], claims, &mut grant);
        break;
    }
    grant
}

/// Divides `left` between `keys` (each wanting more than its part) by
/// weight, the remainder one token at a time by largest remainder (ties to
/// the earlier key).
fn divide(
    left: u64,
    weight_left: u128,
    keys: &[(usize, u64)],
    claims: &[Claim],
    grant: &mut [u64],
) {
    let mut parts: Vec<(usize, u64, u128)> = keys
        .iter()
        .map(|&(i, _)| {
            let exact = u128::from(left) * weight_of(&claims[i]);
            // At most `left`: fits.
            (i, (exact / weight_left) as u64, exact % weight_left)
        })
        .collect();
    let mut spare = left - parts.iter().map(|(_, part, _)| part).sum::<u64>();
    parts.sort_by(|a, b| b.2.cmp(&a.2).then(a.0.cmp(&b.0)));
    for (i, part, _) in parts {
        let extra = u64::from(spare > 0);
        spare -= extra;
        grant[i] += part + extra;
    }
}

/// The largest weight counted, in thousandths (a policy's weights go up to
/// 1 000): a weight read off a report cannot overflow the arithmetic.
const MAX_WEIGHT: u64 = 1_000 * WEIGHT_SCALE;

fn weight_of(claim: &Claim) -> u128 {
    u128::from(claim.weight.clamp(1, MAX_WEIGHT))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn greedy(weight: u64) -> Claim {
        Claim {
            weight: weight * WEIGHT_SCALE,
            demand: u64::MAX / 4,
            reserved: 0,
        }
    }

    #[test]
    fn greedy_keys_share_by_weight() {
        assert_eq!(
            shares(100, &[greedy(1), greedy(1), greedy(2)]),
            [25, 25, 50]
        );
        // A remainder goes one token at a time, the largest first.
        assert_eq!(shares(10, &[greedy(1), greedy(1), greedy(1)]), [4, 3, 3]);
    }

    #[test]
    fn a_key_wanting_less_gets_it_all_and_the_rest_goes_to_the_others() {
        let quiet = Claim {
            weight: WEIGHT_SCALE,
            demand: 20,
            reserved: 0,
        };
        assert_eq!(shares(100, &[quiet, greedy(1)]), [20, 80]);
        assert_eq!(shares(100, &[quiet]), [20], "nobody else wants the rest");
    }

    #[test]
    fn reservations_are_kept_while_wanted_and_lent_out_otherwise() {
        let gold = |demand| Claim {
            weight: WEIGHT_SCALE,
            demand,
            reserved: 60,
        };
        // Gold wants all: its 60, then half of the 40 left.
        assert_eq!(shares(100, &[gold(1_000), greedy(1)]), [80, 20]);
        // Gold wants 10: the other 50 of its reservation are lent out.
        assert_eq!(shares(100, &[gold(10), greedy(1)]), [10, 90]);
    }

    #[test]
    fn reservations_beyond_the_capacity_never_push_the_total_past_it() {
        let reserved = |r| Claim {
            weight: WEIGHT_SCALE,
            demand: 1_000,
            reserved: r,
        };
        let got = shares(100, &[reserved(70), reserved(70), reserved(70)]);
        assert_eq!(got.iter().sum::<u64>(), 100);
        assert_eq!(got, [70, 30, 0]);
    }

    proptest! {
        /// Whatever the claims: the shares add up to what the capacity
        /// allows of what is wanted (never more, nothing left idle that is
        /// wanted), no key gets more than it wants, a reservation within
        /// the capacity is kept while wanted, and keys that want more than
        /// they got got the same per weight beyond their reservations (to a
        /// token), no less than any satisfied key.
        #[test]
        fn shares_are_work_conserving_weighted_max_min(
            capacity in 0u64..10_000,
            claims in prop::collection::vec(
                (0u64..5_000, 0u64..3_000, 0u64..200)
                    .prop_map(|(weight, demand, reserved)| Claim { weight, demand, reserved }),
                0..12),
        ) {
            let got = shares(capacity, &claims);
            prop_assert_eq!(got.len(), claims.len());
            let wanted: u64 = claims.iter().map(|c| c.demand).sum();
            prop_assert_eq!(got.iter().sum::<u64>(), capacity.min(wanted));
            for (g, c) in got.iter().zip(&claims) {
                prop_assert!(*g <= c.demand);
            }
            let reserved: u64 = claims.iter().map(|c| c.reserved.min(c.demand)).sum();
            if reserved <= capacity {
                for (g, c) in got.iter().zip(&claims) {
                    prop_assert!(*g >= c.reserved.min(c.demand));
                }
                // Beyond reservations, per unit of weight (scaled exactly).
                let level = |g: u64, c: &Claim| {
                    (g - c.reserved.min(c.demand)) as f64 / weight_of(c) as f64
                };
                let unsatisfied: Vec<f64> = got.iter().zip(&claims)
                    .filter(|(g, c)| **g < c.demand)
                    .map(|(g, c)| level(*g, c))
                    .collect();
                if let (Some(lo), Some(hi)) = (
                    unsatisfied.iter().copied().reduce(f64::min),
                    unsatisfied.iter().copied().reduce(f64::max),
                ) {
                    // One token of rounding each way, per weight.
                    let slack = |c: &Claim| 1.0 / weight_of(c) as f64;
                    let most_slack = claims.iter().map(slack).fold(0.0, f64::max);
                    prop_assert!(hi - lo <= 2.0 * most_slack + 1e-9, "levels {lo} .. {hi}");
                    for (g, c) in got.iter().zip(&claims) {
                        if *g == c.demand {
                            prop_assert!(level(*g, c) <= hi + 2.0 * most_slack + 1e-9);
                        }
                    }
                }
            }
        }
    }
}
