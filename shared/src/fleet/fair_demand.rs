//! A global limit shared fairly by key (`fair`): every instance reports its
//! keys' weights and demands, and the admin weighs them fleet-wide before
//! it splits the limit between instances. The limit is divided between
//! the keys by weight, as one Envoy's table divides its share
//! ([`crate::fair::shares`]); each key's part is spread over the instances
//! it asks through, in proportion to what it asks there; and an instance's
//! demand counts for no more than its keys' parts. Each Envoy's table then
//! divides its share between its keys by weight again, so a key's calls
//! come out near its fleet-wide part wherever they arrive.
//!
//! Keys are hashes under the fleet's label secret, alike on every Envoy.

use std::collections::BTreeMap;

use super::Demand;
use serde::{Deserialize, Serialize};

use crate::fair::{shares, Claim, FairKeyView};

/// One key of an instance as the ledger keeps it for weighing: its hash,
/// weight (thousandths) and demand (calls a second). A tuple on the wire:
/// the ledger holds up to 64 of these per instance and is read and written
/// whole at every sync.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct KeyDemand(pub u64, pub u64, pub f64);

impl From<&FairKeyView> for KeyDemand {
    fn from(view: &FairKeyView) -> Self {
        KeyDemand(view.key, view.weight, view.demand)
    }
}

/// Rates are weighed in thousandths of a call a second.
const MILLI: f64 = 1000.0;

/// `demands` with each instance's rate cut to its keys' fair part of
/// `limit_rate`, while the keys together ask for more than the limit
/// (unchanged where an instance reports no keys, and all of them when none
/// does or there is room for every key). A cut, not a scaling: an Envoy
/// whose own count lags its keys' (it fell behind for a moment) keeps the
/// smaller of the two, never a fraction of it.
pub fn weigh(limit_rate: f64, demands: &[Demand], keys: &[&[KeyDemand]]) -> Vec<Demand> {
    if keys.iter().all(|k| k.is_empty()) {
        return demands.to_vec();
    }
    let milli = |rate: f64| (rate.max(0.0) * MILLI).round() as u64;
    // Per key: its weight and what it asks fleet-wide.
    let mut fleet: BTreeMap<u64, Claim> = BTreeMap::new();
    for &KeyDemand(key, weight, demand) in keys.iter().flat_map(|k| k.iter()) {
        let claim = fleet.entry(key).or_insert(Claim {
            weight,
            demand: 0,
            reserved: 0,
        });
        claim.weight = claim.weight.max(weight);
        claim.demand = claim.demand.saturating_add(milli(demand));
    }
    let claims: Vec<Claim> = fleet.values().copied().collect();
    let asked_in_all = claims
        .iter()
        .fold(0u64, |sum, c| sum.saturating_add(c.demand));
    if asked_in_all <= milli(limit_rate) {
        return demands.to_vec();
    }
    let parts: BTreeMap<u64, (u64, u64)> = fleet
        .keys()
        .zip(shares(milli(limit_rate), &claims).into_iter().zip(&claims))
        .map(|(&key, (part, claim))| (key, (part, claim.demand)))
        .collect();
    demands
        .iter()
        .zip(keys)
        .map(|(demand, keys)| {
            if keys.is_empty() {
                return *demand;
            }
            let fair: f64 = keys
                .iter()
                .filter_map(|&KeyDemand(key, _, demand)| {
                    let &(part, total) = parts.get(&key)?;
                    (total > 0).then(|| part as f64 * milli(demand) as f64 / total as f64)
                })
                .sum();
            Demand {
                rate: demand.rate.min(fair / MILLI),
                ..*demand
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fair::WEIGHT_SCALE;

    fn key(key: u64, weight: u64, demand: f64) -> KeyDemand {
        KeyDemand(key, weight * WEIGHT_SCALE, demand)
    }

    fn asking(rate: f64) -> Demand {
        Demand {
            rate,
            ..Demand::default()
        }
    }

    #[test]
    fn greedy_keys_on_different_instances_count_by_weight() {
        // t1 (weight 1) through a; t2 (1) and t3 (2) through b.
        let a = [key(1, 1, 200.0)];
        let b = [key(2, 1, 200.0), key(3, 2, 200.0)];
        let weighed = weigh(100.0, &[asking(200.0), asking(400.0)], &[&a, &b]);
        assert!((weighed[0].rate - 25.0).abs() < 0.01, "{weighed:?}");
        assert!((weighed[1].rate - 75.0).abs() < 0.01, "{weighed:?}");
    }

    #[test]
    fn a_key_on_two_instances_splits_its_part_by_where_it_asks() {
        let a = [key(1, 1, 150.0)];
        let b = [key(1, 1, 50.0), key(2, 1, 200.0)];
        let weighed = weigh(100.0, &[asking(150.0), asking(250.0)], &[&a, &b]);
        // Key 1 gets 50, three quarters of it through a.
        assert!((weighed[0].rate - 37.5).abs() < 0.01, "{weighed:?}");
        assert!((weighed[1].rate - 62.5).abs() < 0.01, "{weighed:?}");
    }

    #[test]
    fn an_envoy_whose_own_count_lags_its_keys_keeps_its_part_not_a_fraction() {
        // a's keys ask 200 a second, but its own count (smoothed) fell to
        // 60 for a moment: it keeps 25, its key's part, not 60 × 25/200.
        let a = [key(1, 1, 200.0)];
        let b = [key(2, 1, 200.0), key(3, 2, 200.0)];
        let weighed = weigh(100.0, &[asking(60.0), asking(400.0)], &[&a, &b]);
        assert!((weighed[0].rate - 25.0).abs() < 0.01, "{weighed:?}");
        // One asking less than its part keeps what it asks.
        let weighed = weigh(100.0, &[asking(10.0), asking(400.0)], &[&a, &b]);
        assert!((weighed[0].rate - 10.0).abs() < 0.01, "{weighed:?}");
    }

    #[test]
    fn room_enough_for_all_changes_nothing() {
        let a = [key(1, 1, 20.0)];
        let b = [key(2, 3, 30.0)];
        let demands = [asking(20.0), asking(30.0)];
        assert_eq!(weigh(100.0, &demands, &[&a, &b]), demands);
        // Nobody reports keys (a policy without `fair`): as they came.
        assert_eq!(weigh(10.0, &demands, &[&[], &[]]), demands);
    }

    #[test]
    fn hostile_numbers_never_raise_a_demand() {
        let wild = [
            key(1, 0, f64::MAX),
            KeyDemand(2, u64::MAX, 1e300),
            key(3, 1, -5.0),
            key(1, 7, f64::NAN),
        ];
        let demands = [asking(80.0), asking(40.0)];
        let weighed = weigh(100.0, &demands, &[&wild, &[key(9, 1, 40.0)]]);
        for (w, d) in weighed.iter().zip(&demands) {
            assert!(
                w.rate.is_finite() && w.rate >= 0.0 && w.rate <= d.rate,
                "{weighed:?}"
            );
        }
    }
}
