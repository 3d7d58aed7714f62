//! A policy's or a limit's `fair`, compiled: who a call is (its key's
//! hash, weight and reservation) and the terms its tables share on.

use std::collections::HashMap;

use sluice_shared::fair::{self, FairClaimant, FairSlotTerms, FairTerms};
use sluice_shared::key_hash::KeySecret;
use sluice_shared::policy::{ConcurrencySpec, FairSpec, RateSpec};
use sluice_shared::request_headers::RequestHeaders;

use super::request::KeySource;
use crate::body::BodyJson;

/// A `fair`, ready to tell who asks: the key's hash, weight and
/// reservation, and the terms its tables share the rate and the slots on.
#[derive(Debug, Clone)]
pub struct CompiledFair {
    pub(crate) key: KeySource,
    weights: HashMap<Vec<u8>, u64>,
    default_weight: u64,
    /// Reservations in the rate table's units a second, or in slots when
    /// only slots are shared (validation allows them in one unit only).
    reserved: HashMap<Vec<u8>, u64>,
    /// The rate's table (None: no rate is shared).
    pub terms: Option<FairTerms>,
    /// The slots' table (None: no concurrency is shared).
    pub slots: Option<FairSlotTerms>,
}

impl CompiledFair {
    /// The request header its key is read from, if it is one.
    pub(crate) fn key_header(&self) -> Option<&str> {
        self.key.header()
    }

    pub(crate) fn new(
        spec: &FairSpec,
        rate: Option<&RateSpec>,
        slots: Option<&ConcurrencySpec>,
    ) -> Option<Self> {
        let thousandths = |w: f64| (w * fair::WEIGHT_SCALE as f64).round().max(1.0) as u64;
        let period_ms = u128::from(rate.map_or(1000, |r| r.period.as_millis()).max(1));
        let per_second = |n: u64| {
            let units = u128::from(n) * u128::from(fair::UNIT) * 1000 / period_ms;
            u64::try_from(units).unwrap_or(u64::MAX)
        };
        let max_keys = usize::try_from(spec.key.max_keys).unwrap_or(usize::MAX);
        Some(Self {
            key: KeySource::new(&spec.key)?,
            weights: spec
                .weights
                .iter()
                .map(|(k, w)| (k.as_bytes().to_vec(), thousandths(*w)))
                .collect(),
            default_weight: thousandths(spec.default_weight),
            reserved: spec
                .min
                .iter()
                .map(|(k, n)| {
                    let units = if rate.is_some() { per_second(*n) } else { *n };
                    (k.as_bytes().to_vec(), units)
                })
                .collect(),
            terms: rate.map(|rate| FairTerms {
                capacity: per_second(rate.requests),
                burst: rate.effective_burst().saturating_mul(fair::UNIT),
                max_keys,
            }),
            slots: slots.map(|slots| FairSlotTerms {
                capacity: slots.max_in_flight.saturating_sub(slots.reserved_for_high),
                lease_ttl: slots.lease_ttl.as_span(),
                max_keys,
            }),
        })
    }

    /// With reservations, the rate its keys share: a fair queue then places
    /// calls by their keys' shares (`bucket::FairCall`).
    pub fn reserving(&self) -> Option<u64> {
        let terms = self.terms.as_ref()?;
        (!self.reserved.is_empty()).then_some(terms.capacity)
    }

    /// Shares this Envoy's share of a global limit instead: `rate` a second
    /// and `burst` tokens.
    pub(crate) fn share(&mut self, rate: f64, burst: u64) {
        let Some(terms) = &mut self.terms else {
            return;
        };
        let units = (rate.max(0.0) * fair::UNIT as f64).floor();
        // An f64 past u64 saturates in `as`.
        terms.capacity = units as u64;
        terms.burst = burst.saturating_mul(fair::UNIT);
    }

    /// Who a request is: its key's hash (as a policy key is hashed), weight
    /// and reservation (absent key: the empty value).
    pub(crate) fn claimant<R: RequestHeaders + ?Sized>(
        &self,
        policy: &str,
        req: &R,
        secret: &KeySecret,
        body: &BodyJson,
    ) -> FairClaimant {
        let value = self.key.value(req, body);
        let value = value.as_deref().unwrap_or_default();
        FairClaimant {
            key: secret.hash(policy, value),
            weight: self
                .weights
                .get(value)
                .copied()
                .unwrap_or(self.default_weight),
            reserved: self.reserved.get(value).copied().unwrap_or(0),
        }
    }
}
