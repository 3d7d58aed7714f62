//! Which bucket in shared data a request uses, and its admission there.
//!
//! A policy without `key` has one bucket. A keyed policy has `max_keys`
//! places; a key hashes to a first place and probes a few after it. A place
//! held by another key is taken over only when that key's bucket is idle
//! (counted as an eviction); with every probed place busy the key overflows:
//! into one bucket shared by all overflowing keys, or refused.

use sluice_filter_core::bucket::{Admission, BucketLimits, BucketState, FairCall, Prefetched};
use sluice_filter_core::headers::LimitKind;
use sluice_filter_core::matcher::{BucketKey, Classification, CompiledPolicy};
use sluice_shared::policy::KeyOverflow;

use super::ctx::Ctx;
use super::key_places::{self, Claim};
use super::retry::DEFAULT_RETRY;
use crate::entries::{bucket_key, Place};
use crate::host::Host;
use crate::metrics::PolicyCounter;
use crate::prefetch::SpareSlots;
use crate::store::StoreError;

/// How many requests more the worker would like to prefetch; whether it
/// must queue whatever the bucket holds (a further limit of its policy has
/// no room yet); the spare slots of the prefetch it replaces, given back
/// in the same write when they are of the bucket it lands in.
pub(super) struct Request<'a> {
    pub prefetch: u64,
    pub must_wait: bool,
    pub spare: Option<&'a SpareSlots>,
}

/// The bucket's key (empty when the request was refused before reaching
/// one), what it decided, and what it handed out ahead.
pub(super) struct Placed {
    pub bucket: String,
    pub admission: Admission,
    pub prefetched: Prefetched,
    /// The key found no place of its own.
    pub overflowed: bool,
    /// The spare slots went back with the decision.
    pub spare_returned: bool,
}

/// Finds the request's bucket and admits it there, taking up to
/// `request.prefetch` requests more for this worker when the bucket allows.
pub(super) fn place_and_admit<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    policy: &CompiledPolicy,
    limits: &BucketLimits,
    class: &Classification,
    request: Request<'_>,
) -> Result<Placed, StoreError> {
    let (host, store, metrics) = (ctx.host, &mut *ctx.store, &mut *ctx.metrics);
    let (holder, now) = (ctx.holder, ctx.now);
    let Request {
        prefetch,
        must_wait,
        spare,
    } = request;
    let name = policy.name();
    // Set by the run of `admit` that was written: a retried
    // compare-and-swap runs it again on the state it reads anew.
    let spare_returned = std::cell::Cell::new(false);
    let admit = |bucket: &str, s: &mut BucketState| {
        let returned = match spare {
            Some(SpareSlots {
                bucket: of,
                slots,
                lease: Some(lease),
            }) if &**of == bucket => s.release_many(holder, *lease, *slots) > 0,
            _ => false,
        };
        spare_returned.set(returned);
        // A fair policy's call waits in the fair order.
        let fair = class.fair.map(|who| FairCall {
            who,
            reserving: policy.fair.as_ref().and_then(|f| f.reserving()),
            rate: policy
                .fair
                .as_ref()
                .and_then(|f| f.terms)
                .map_or(0, |t| t.capacity),
        });
        let a = s.admit_call(
            limits,
            holder,
            now,
            (class.cost, class.priority),
            fair,
            must_wait,
        );
        let prefetched = match a {
            Admission::Admitted { .. } => s.prefetch(limits, holder, now, prefetch),
            _ => Prefetched::default(),
        };
        let changed = returned || !matches!(a, Admission::Rejected { .. });
        ((a, prefetched), changed)
    };
    let placed = |bucket: String, (admission, prefetched): (Admission, Prefetched)| Placed {
        bucket,
        admission,
        prefetched,
        overflowed: false,
        spare_returned: spare_returned.get(),
    };
    let overflowed = |p: Placed| Placed {
        overflowed: true,
        ..p
    };
    let BucketKey::Keyed(hash) = class.key else {
        let key = bucket_key(name, Place::Single);
        let outcome = store.update_as::<BucketState, _, _>(host, &key, |s| admit(&key, s))?;
        return Ok(placed(key, outcome));
    };
    let owner = key_places::owner_of(hash);
    for slot in key_places::probes(owner, policy.max_keys().unwrap_or(1)) {
        let key = bucket_key(name, Place::Slot(slot));
        let mut evicted = false;
        let outcome = store.update_as::<BucketState, _, _>(host, &key, |s| {
            let claim = key_places::claim(s.owner, owner, || s.is_idle(limits, now));
            evicted = claim == Claim::Evict;
            match claim {
                Claim::Busy => return (None, false),
                Claim::Free | Claim::Evict => *s = BucketState::new(owner),
                Claim::Mine => {}
            }
            let (a, changed) = admit(&key, s);
            (Some(a), changed || claim != Claim::Mine)
        })?;
        if let Some(outcome) = outcome {
            if evicted {
                metrics.add(name, PolicyCounter::KeyEvictions, 1);
            }
            return Ok(placed(key, outcome));
        }
    }
    metrics.add(name, PolicyCounter::KeyOverflow, 1);
    if policy.key_overflow() == Some(KeyOverflow::Reject) {
        let refused = Admission::Rejected {
            kind: LimitKind::for_limits(policy.rate.is_some()),
            retry_after: DEFAULT_RETRY,
        };
        spare_returned.set(false);
        return Ok(overflowed(placed(
            String::new(),
            (refused, Prefetched::default()),
        )));
    }
    let key = bucket_key(name, Place::Overflow);
    let outcome = store.update_as::<BucketState, _, _>(host, &key, |s| admit(&key, s))?;
    Ok(overflowed(placed(key, outcome)))
}
