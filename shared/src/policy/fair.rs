//! Fair shares (`fair`): a limit divided between the values of a key by
//! weight, with reservations, and its checks.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::bounds;
use super::check::Report;
use super::key::KeySpec;
use super::rate::{ConcurrencySpec, RateSpec};

#[cfg(feature = "schema")]
use schemars::JsonSchema;
/// How a policy's rate is shared between keys (`fair`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct FairSpec {
    /// Who shares: a request header or a JSON body field. At most the
    /// smaller of `max_keys` and 256 keys have shares of their own; the
    /// others share one.
    pub key: KeySpec,
    /// Weights by key value (0.001 to 1000); others have `default_weight`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub weights: BTreeMap<String, f64>,
    #[serde(default = "FairSpec::default_weight")]
    pub default_weight: f64,
    /// Reserved per key value, in the rate's requests (or tokens) per its
    /// period, or in slots when only a concurrency limit is shared: kept
    /// for the key while it wants it, lent out while it does not. They add
    /// up to the limit at most.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub min: BTreeMap<String, u64>,
}

impl FairSpec {
    pub const MIN_WEIGHT: f64 = 0.001;
    pub const MAX_WEIGHT: f64 = 1000.0;
    /// Weights and reservations named at most.
    pub const MAX_NAMED: usize = 1000;

    fn default_weight() -> f64 {
        1.0
    }
}

/// What reservations are counted against: the limit's size in its units.
pub(crate) struct Reservable {
    size: u64,
    what: &'static str,
}

impl Reservable {
    pub(crate) fn rate(rate: &RateSpec) -> Self {
        Self {
            size: rate.requests,
            what: "the rate's",
        }
    }

    /// The slots a normal-priority call may take.
    pub(crate) fn slots(slots: &ConcurrencySpec) -> Self {
        Self {
            size: u64::from(slots.max_in_flight.saturating_sub(slots.reserved_for_high)),
            what: "the slots' (without those reserved for high priority)",
        }
    }
}

/// What any `fair` must say well: weights in range, named keys of sane
/// length, reservations within the rate.
pub(crate) fn check_fair_spec(fr: &mut Report, fair: &FairSpec, reservable: Option<Reservable>) {
    let weight_in_range = |w: f64| (FairSpec::MIN_WEIGHT..=FairSpec::MAX_WEIGHT).contains(&w);
    let range = format!(
        "a weight is from {} to {}",
        FairSpec::MIN_WEIGHT,
        FairSpec::MAX_WEIGHT
    );
    if !weight_in_range(fair.default_weight) {
        fr.at("default_weight", range.clone());
    }
    for (what, count) in [("weights", fair.weights.len()), ("min", fair.min.len())] {
        if count > FairSpec::MAX_NAMED {
            fr.at(what, format!("at most {} keys", FairSpec::MAX_NAMED));
        }
    }
    for (name, weight) in &fair.weights {
        if !weight_in_range(*weight) {
            fr.at(&format!("weights.{name}"), range.clone());
        }
    }
    for name in fair.weights.keys().chain(fair.min.keys()) {
        if name.is_empty() || name.len() > bounds::MAX_KEY_VALUE_LEN {
            fr.at(
                "weights",
                format!(
                    "a key value is 1 to {} characters",
                    bounds::MAX_KEY_VALUE_LEN
                ),
            );
            break;
        }
    }
    let reserved = fair
        .min
        .values()
        .fold(0u64, |sum, v| sum.saturating_add(*v));
    let Some(Reservable { size, what }) = reservable else {
        return;
    };
    if reserved > size {
        fr.at(
            "min",
            format!(
                "reservations add up to {reserved}, more than {what} {size}: they would push the total past the limit",
            ),
        );
    }
}
