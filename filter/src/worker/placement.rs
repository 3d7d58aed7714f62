//! Which bucket in shared data a request uses, and its admission there.
//!
//! A policy without `key` has one bucket. A keyed policy has `max_keys`
//! places; a key hashes to a first place and probes a few after it. A place
//! held by another key is taken over only when that key's bucket is idle
//! (counted as an eviction); with every probed place busy the key overflows:
//! into one bucket shared by all overflowing keys, or refused.

use std::cell::Cell;

use sluice_filter_core::bucket::{
    Admission, BucketCall, BucketLimits, BucketState, FairCall, Prefetched,
};
use sluice_filter_core::headers::LimitKind;
use sluice_filter_core::matcher::{BucketKey, Classification, CompiledPolicy};
use sluice_shared::policy::KeyOverflow;
use sluice_shared::time::Instant;

use super::ctx::Ctx;
use super::key_places::{self, Keyed};
use super::retry::DEFAULT_RETRY;
use crate::entries::{state_key, LimitOf, OwnedBucket, Place};
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
    let admitting = Admitting {
        policy,
        limits,
        class,
        request,
        holder: ctx.holder,
        now: ctx.now,
        spare_returned: Cell::new(false),
    };
    let name = policy.name();
    let BucketKey::Keyed(hash) = class.key else {
        let key = state_key(LimitOf::Policy(name), Place::Single);
        let outcome = ctx
            .store
            .update_as::<BucketState, _, _>(ctx.host, &key, |s| admitting.admit(&key, s))?;
        return Ok(admitting.placed(key, outcome, false));
    };
    let keys = (
        policy.max_keys().unwrap_or(1),
        policy.key_overflow().unwrap_or(KeyOverflow::Shared),
    );
    let keyed = key_places::on_key(
        ctx,
        LimitOf::Policy(name),
        keys,
        key_places::owner_of(hash),
        &OwnedBucket(limits),
        |key, state| admitting.admit(key, state),
    )?;
    let (placed, overflowed) = match keyed {
        Keyed::Placed(placed) => {
            if placed.evicted {
                ctx.metrics.add(name, PolicyCounter::KeyEvictions, 1);
            }
            return Ok(admitting.placed(placed.key, placed.out, false));
        }
        Keyed::Overflowed(placed) => (placed.key, placed.out),
        Keyed::Refused => {
            let refused = Admission::Rejected {
                kind: LimitKind::for_limits(policy.rate.is_some()),
                retry_after: DEFAULT_RETRY,
            };
            admitting.spare_returned.set(false);
            (String::new(), (refused, Prefetched::default()))
        }
    };
    ctx.metrics.add(name, PolicyCounter::KeyOverflow, 1);
    Ok(admitting.placed(placed, overflowed, true))
}

/// One request being admitted in a bucket of its policy.
struct Admitting<'a> {
    policy: &'a CompiledPolicy,
    limits: &'a BucketLimits,
    class: &'a Classification,
    request: Request<'a>,
    holder: u64,
    now: Instant,
    /// Set by the run of `admit` that was written: a retried
    /// compare-and-swap runs it again on the state it reads anew.
    spare_returned: Cell<bool>,
}

impl Admitting<'_> {
    /// Admits the call in `bucket`'s state `s` (its spare slots given
    /// back first when they are of this bucket), with a prefetch when
    /// admitted; and whether `s` changed.
    fn admit(&self, bucket: &str, s: &mut BucketState) -> ((Admission, Prefetched), bool) {
        let (holder, now, limits, class) = (self.holder, self.now, self.limits, self.class);
        let returned = match self.request.spare {
            Some(SpareSlots {
                bucket: of,
                slots,
                lease: Some(lease),
            }) if &**of == bucket => s.release_many(holder, *lease, *slots) > 0,
            _ => false,
        };
        self.spare_returned.set(returned);
        // A fair policy's call waits in the fair order.
        let fair = self.policy.fair.as_ref();
        let fair = class.fair.map(|who| FairCall {
            who,
            reserving: fair.and_then(|f| f.reserving()),
            rate: fair.and_then(|f| f.terms).map_or(0, |t| t.capacity),
        });
        let call = BucketCall {
            cost: class.cost,
            priority: class.priority,
            fair,
        };
        let a = s.admit_call(limits, holder, now, call, self.request.must_wait);
        let prefetched = match a {
            Admission::Admitted { .. } => s.prefetch(limits, holder, now, self.request.prefetch),
            _ => Prefetched::default(),
        };
        let changed = returned || !matches!(a, Admission::Rejected { .. });
        ((a, prefetched), changed)
    }

    fn placed(&self, bucket: String, outcome: (Admission, Prefetched), overflowed: bool) -> Placed {
        let (admission, prefetched) = outcome;
        Placed {
            bucket,
            admission,
            prefetched,
            overflowed,
            spare_returned: self.spare_returned.get(),
        }
    }
}
