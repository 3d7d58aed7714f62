//! A policy's further concurrency limits (`limits` with `concurrency`):
//! one shared-data entry per limit name, as for a further rate limit, so
//! every policy naming it (Stripe's account-wide calls in flight over
//! per-endpoint policies) counts against the one limit. The entry is a
//! lease table, as a policy's own concurrency keeps in its bucket: one
//! lease per worker, renewed while it holds slots, reclaimed when it dies.
//!
//! A call takes a slot in each once every rate limit took it, all or
//! nothing, and gives them back exactly once when its stream ends. A limit
//! whose slots are shared fairly passes its gate first
//! (`fair::take_slot`): one more slot held in its fair slots table.

use sluice_filter_core::matcher::CompiledPolicy;
use sluice_shared::fair::{FairClaimant, FairSlots};
use sluice_shared::limiter::{ConcurrencyLimit, Decision, LeaseTable};
use sluice_shared::policy::Priority;
use sluice_shared::time::{Instant, Span};

use super::ctx::Ctx;
use super::fair::{self, FairSlot};
use super::held_slot::HeldSlot;
use crate::entries::{self, state_key, LimitOf, Place};
use crate::host::Host;
use crate::store::StoreError;

/// What the concurrency limits said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum SlotsTaken {
    /// A slot in each (none if the policy has none).
    All(Vec<HeldSlot>),
    /// `limit` had no room (or could not be read): nothing was kept.
    /// `fair_retry`: refused by its fair share, to try again after that.
    Refused {
        limit: String,
        fair_retry: Option<Span>,
    },
}

/// Takes one slot in each of `policy`'s concurrency limits for `holder`,
/// all or none; `claimants[i]` is who the call is in limit `i`'s fair
/// share (if its slots are shared fairly).
pub(super) fn take<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    policy: &CompiledPolicy,
    claimants: &[Option<FairClaimant>],
) -> SlotsTaken {
    let mut held = Vec::with_capacity(policy.slot_limits.len());
    for (index, slot_limit) in policy.slot_limits.iter().enumerate() {
        let who = claimants.get(index).copied().flatten();
        let refused = |fair_retry| SlotsTaken::Refused {
            limit: slot_limit.name.clone(),
            fair_retry,
        };
        let terms = slot_limit.fair.as_ref().and_then(|f| f.slots);
        match fair::take_slot(ctx, LimitOf::Named(&slot_limit.name), terms, who) {
            FairSlot::NotShared => {}
            FairSlot::Taken(gate) => held.push(gate),
            FairSlot::Refused { retry_after, full } => {
                release(ctx, &held);
                return refused((!full).then_some(retry_after));
            }
        }
        match take_one(ctx, &slot_limit.name, &slot_limit.limit) {
            Ok(Some(slot)) => held.push(slot),
            // No room, or the store counted and logged a failure: a limit
            // that cannot be checked refuses rather than let the call go.
            Ok(None) | Err(_) => {
                release(ctx, &held);
                return refused(None);
            }
        }
    }
    SlotsTaken::All(held)
}

fn take_one<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    name: &str,
    limit: &ConcurrencyLimit,
) -> Result<Option<HeldSlot>, StoreError> {
    let key = state_key(LimitOf::Named(name), Place::Single);
    let (holder, now) = (ctx.holder, ctx.now);
    let lease = ctx
        .store
        .update_as::<LeaseTable, _, _>(ctx.host, &key, |table| {
            match table.acquire(limit, holder, now, Priority::Normal) {
                Decision::Admit { .. } => (table.lease_of(holder), true),
                Decision::Deny { .. } => (None, false),
            }
        })?;
    Ok(lease.map(|lease| HeldSlot {
        key,
        lease,
        ttl: limit.lease_ttl,
        fair_key: None,
    }))
}

/// Gives `slots` back. A failure is counted and logged by the store; the
/// worker's lease then expires and gives the slot back.
pub(super) fn release<H: Host + ?Sized>(ctx: &mut Ctx<'_, H>, slots: &[HeldSlot]) {
    let holder = ctx.holder;
    for slot in slots {
        let _ = match slot.fair_key {
            Some(fair_key) => {
                ctx.store
                    .update_as::<FairSlots, _, _>(ctx.host, &slot.key, |table| {
                        ((), table.release(holder, slot.lease, fair_key))
                    })
            }
            None => ctx
                .store
                .update_as::<LeaseTable, _, _>(ctx.host, &slot.key, |table| {
                    ((), table.release(holder, slot.lease))
                }),
        };
    }
}

/// Keeps `holder`'s lease at `key` alive for `ttl` more (`fair`: `key` is
/// a fair slots table).
pub(super) fn renew<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    key: &str,
    fair: bool,
    ttl: Span,
) -> Result<(), StoreError> {
    let (holder, now) = (ctx.holder, ctx.now);
    if fair {
        return ctx
            .store
            .update_as::<FairSlots, _, _>(ctx.host, key, |table| {
                ((), table.renew(holder, now, ttl))
            });
    }
    ctx.store
        .update_as::<LeaseTable, _, _>(ctx.host, key, |table| ((), table.renew(holder, now, ttl)))
}

/// Calls holding a slot of limit `name` now, on every worker.
pub fn in_flight<H: Host + ?Sized>(host: &H, name: &str, now: Instant) -> u32 {
    let mut table: LeaseTable =
        entries::read_as(host, &state_key(LimitOf::Named(name), Place::Single));
    table.reclaim_expired(now);
    table.in_flight()
}
