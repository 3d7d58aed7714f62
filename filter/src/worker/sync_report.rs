//! What a sync reports of this worker's limits: each further limit's
//! count, size and standing (with what the long ones spent), and each fair
//! table's busiest keys.

use std::collections::BTreeMap;

use sluice_filter_core::matcher::{CompiledFair, CompiledPolicySet};
use sluice_shared::fair::{
    FairKeyView, FairSlotTerms, FairSlots, FairTable, FairTerms, REPORTED_KEYS,
};
use sluice_shared::time::Instant;
use sluice_wire::sync::LimitReport;

use super::provider;
use super::slots;
use super::spend::SpendScan;
use crate::entries::{self, state_key, LimitOf, LimitState, Place};
use crate::host::Host;
use crate::metrics::LimitCounter;
use crate::report;
use crate::store::Store;

/// Each fair table's busiest keys (reject mode: a fair queue keeps no
/// table), for the live view and the admin's weighing of a global limit:
/// a policy's under its name (its rate's table, or its slots' when it
/// shares only slots), a further limit's as `limits/<name>`.
pub(super) fn fair_views<H: Host + ?Sized>(
    host: &H,
    store: &mut Store,
    policies: &CompiledPolicySet,
    now: Instant,
) -> BTreeMap<String, Vec<FairKeyView>> {
    enum Shared {
        Rate(FairTerms),
        Slots(FairSlotTerms),
    }
    let shared = |fair: &CompiledFair| match (fair.terms, fair.slots) {
        (Some(terms), _) => Some(Shared::Rate(terms)),
        (None, Some(slots)) => Some(Shared::Slots(slots)),
        (None, None) => None,
    };
    let own = policies.policies.iter().filter_map(|p| {
        let shared = shared(p.fair.as_ref()?)?;
        let key = match shared {
            Shared::Rate(_) => entries::fair_key(entries::LimitOf::Policy(p.name())),
            Shared::Slots(_) => entries::fair_slots_key(entries::LimitOf::Policy(p.name())),
        };
        Some((p.name().to_string(), key, shared))
    });
    let rate_limits = policies
        .all()
        .flat_map(|p| p.limits.iter())
        .filter_map(|l| {
            let terms = l.fair.as_ref()?.terms?;
            Some((
                format!("limits/{}", l.name),
                entries::fair_key(entries::LimitOf::Named(&l.name)),
                Shared::Rate(terms),
            ))
        });
    let slot_limits = policies
        .all()
        .flat_map(|p| p.slot_limits.iter())
        .filter_map(|l| {
            let slots = l.fair.as_ref()?.slots?;
            Some((
                format!("limits/{}", l.name),
                entries::fair_slots_key(entries::LimitOf::Named(&l.name)),
                Shared::Slots(slots),
            ))
        });
    let mut views = BTreeMap::new();
    for (name, key, shared) in own.chain(rate_limits).chain(slot_limits) {
        if views.contains_key(&name) {
            // A limit named in several policies has one table.
            continue;
        }
        let view = match shared {
            Shared::Rate(terms) => store
                .read_as::<FairTable, _>(host, &key)
                .map(|table| table.view(&terms, now, REPORTED_KEYS)),
            Shared::Slots(terms) => store
                .read_as::<FairSlots, _>(host, &key)
                .map(|table| table.view(&terms, now, REPORTED_KEYS)),
        };
        if let Some(view) = view {
            views.insert(name, view);
        }
    }
    views
}

/// Every further limit of the set (once, by name): what it counted, its
/// size, and what it holds now.
pub(super) fn limit_reports<H: Host + ?Sized>(
    host: &H,
    policies: &CompiledPolicySet,
    now: Instant,
    spend: &mut SpendScan,
) -> BTreeMap<String, LimitReport> {
    let counters = report::read_limit_report(host);
    let refused = report::read_refused(host);
    let mut out = BTreeMap::new();
    // Every limit a call may take: the policies', and their pool members'.
    spend.begin(policies.all().flat_map(|p| p.limits.iter()));
    for p in policies.all() {
        for ((_, rate), limit) in p.rate_limit_specs().zip(&p.limits) {
            if out.contains_key(&limit.name) {
                continue;
            }
            let counted = counters.get(&limit.name).copied().unwrap_or_default();
            // Garbage reads as a limit afresh, as the limit itself does. A
            // keyed limit holds a count per key: none is the limit's.
            let state = limit.keys.is_none().then(|| {
                entries::read(
                    host,
                    &state_key(LimitOf::Named(&limit.name), Place::Single),
                    &LimitState(&limit.rate),
                )
            });
            let available = state.as_ref().map(|s| limit.rate.available(s, now));
            out.insert(
                limit.name.clone(),
                LimitReport {
                    counts: counted.counts,
                    requests: rate.requests,
                    period_ms: rate.period.as_millis(),
                    available,
                    in_flight: None,
                    provider: provider::report(host, limit, &counted, now),
                    spend: spend.report(host, limit, state.as_ref(), now).map(|mut s| {
                        s.refused = refused.get(&limit.name).cloned().unwrap_or_default();
                        s
                    }),
                },
            );
        }
        for limit in &p.slot_limits {
            if out.contains_key(&limit.name) {
                continue;
            }
            let counted = counters.get(&limit.name).copied().unwrap_or_default();
            let in_flight = u64::from(slots::in_flight(host, &limit.name, now));
            let size = u64::from(limit.limit.max_in_flight);
            let mut counts = counted.counts;
            // A slot is a concurrency limit's token.
            counts.set(LimitCounter::Tokens, counts[LimitCounter::Admitted]);
            out.insert(
                limit.name.clone(),
                LimitReport {
                    counts,
                    requests: size,
                    period_ms: 0,
                    available: Some(size.saturating_sub(in_flight)),
                    in_flight: Some(in_flight),
                    provider: None,
                    spend: None,
                },
            );
        }
    }
    out
}
