//! The worker's side of `fair`: in reject mode each call of a policy whose
//! rate is shared fairly takes its key's part in the policy's fair table
//! (one shared-data value, `entries::fair_key`) before the policy's own
//! bucket; in queue mode the policy's queue orders waiting calls fairly
//! instead (`sluice_filter_core::bucket::FairTag`). A further limit shared
//! fairly has a table of its own (the same `entries::fair_key`, of the
//! limit's name), taken before
//! the limits' buckets in either mode ([`take_limits`]). The table decides
//! (`sluice_shared::fair::FairTable`); this only reads and writes it.
//!
//! Slots shared fairly (a policy's own `concurrency` in reject mode, a
//! further concurrency limit in either mode) pass a gate first: one slot
//! in the limit's fair slots table (`entries::fair_slots_key`;
//! `sluice_shared::fair::FairSlots` decides), one gate for both kinds
//! ([`take_slot`]), held as a [`HeldSlot`] beside the limit's own, released and
//! renewed with it.

use sluice_filter_core::headers::LimitKind;
use sluice_filter_core::matcher::{Classification, CompiledFair, CompiledPolicy};
use sluice_shared::fair::{
    FairClaimant, FairSlotTake, FairSlotTerms, FairSlots, FairTable, FairTake, FairTerms,
};
use sluice_shared::policy::Priority;
use sluice_shared::time::Span;

use super::ctx::Ctx;
use super::held_slot::HeldSlot;
use crate::entries::{self, LimitOf};
use crate::host::Host;

/// What the fair table said of a call.
pub(super) enum Fair {
    /// No `fair`, or the table could not be changed (its fault counted by
    /// the store): the policy's bucket alone decides, as it bounds the
    /// total either way.
    NotShared,
    /// Taken from the key's share or the spare pool: give it back if the
    /// bucket refuses.
    Taken(FairClaimant),
    /// Past its share while others want theirs.
    Refused { retry_after: Span },
}

pub(super) fn take<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    policy: &CompiledPolicy,
    class: &Classification,
) -> Fair {
    let (Some(compiled), Some(who)) = (&policy.fair, class.fair) else {
        return Fair::NotShared;
    };
    if policy.queues() {
        // Queued calls leave the queue in the fair order instead
        // (`BucketState`'s fair tags): the queue is the share.
        return Fair::NotShared;
    }
    match take_from(
        ctx,
        compiled,
        LimitOf::Policy(policy.name()),
        who,
        class.cost,
    ) {
        Some(FairTake::Refused { retry_after }) => Fair::Refused { retry_after },
        Some(FairTake::Own | FairTake::Spare) => Fair::Taken(who),
        None => Fair::NotShared,
    }
}

/// The bucket refused a call the table admitted. For want of a slot
/// (`kind` concurrency), the rate's tokens come back to the call's key.
/// For want of the rate's tokens, the table held more than the bucket (it
/// was lost or broken and started afresh, full): the tokens stay spent, so
/// the table grows poorer until it holds no more than the bucket again,
/// and the bucket stops refusing whoever comes first.
pub(super) fn refused_after<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    policy: &CompiledPolicy,
    who: FairClaimant,
    cost: u64,
    kind: LimitKind,
) {
    let Some(terms) = policy.fair.as_ref().and_then(|f| f.terms) else {
        return;
    };
    let refund = kind == LimitKind::Concurrency;
    give_back(
        ctx,
        LimitOf::Policy(policy.name()),
        &terms,
        who,
        cost,
        refund,
    );
}

/// What a call took of its further limits' fair tables: (the limit's
/// index among the policy's rate limits, who took).
pub(super) type FairTaken = Vec<(usize, FairClaimant)>;

/// Takes `costs[i]` from the fair table of each further rate limit shared
/// fairly (`claimants[i]`): all or none. Refused: the limit and when its
/// share brings the call's worth. A table that cannot be changed (its
/// fault counted by the store) leaves the limit's bucket alone to decide.
pub(super) fn take_limits<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    policy: &CompiledPolicy,
    costs: &[u64],
    claimants: &[Option<FairClaimant>],
) -> Result<FairTaken, (String, Span)> {
    let mut taken = FairTaken::new();
    for (index, (limit, who)) in policy.limits.iter().zip(claimants).enumerate() {
        let (Some(compiled), Some(who)) = (&limit.fair, *who) else {
            continue;
        };
        let cost = costs.get(index).copied().unwrap_or(1);
        match take_from(ctx, compiled, LimitOf::Named(&limit.name), who, cost) {
            Some(FairTake::Refused { retry_after }) => {
                give_back_limits(ctx, policy, &taken, costs, None);
                return Err((limit.name.clone(), retry_after));
            }
            Some(FairTake::Own | FairTake::Spare) => taken.push((index, who)),
            None => {}
        }
    }
    Ok(taken)
}

/// Gives back what `taken` took of further limits' fair tables, because
/// a limit or the policy refused the call after them: the tokens come
/// back to each key, but for `refused_by`'s, whose bucket held fewer than
/// its table (they stay spent, as [`refused_after`] says why).
pub(super) fn give_back_limits<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    policy: &CompiledPolicy,
    taken: &[(usize, FairClaimant)],
    costs: &[u64],
    refused_by: Option<&str>,
) {
    for &(index, who) in taken {
        let Some(limit) = policy.limits.get(index) else {
            continue;
        };
        let Some(terms) = limit.fair.as_ref().and_then(|f| f.terms) else {
            continue;
        };
        let cost = costs.get(index).copied().unwrap_or(1);
        let refund = refused_by != Some(limit.name.as_str());
        give_back(ctx, LimitOf::Named(&limit.name), &terms, who, cost, refund);
    }
}

/// Takes `cost` for `who` from `of`'s fair table (None: no rate shared,
/// or the table could not be changed).
fn take_from<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    compiled: &CompiledFair,
    of: LimitOf<'_>,
    who: FairClaimant,
    cost: u64,
) -> Option<FairTake> {
    let (terms, now) = (compiled.terms?, ctx.now);
    ctx.store
        .update_as::<FairTable, _, _>(ctx.host, &entries::fair_key(of), |table| {
            (table.take(&terms, now, who, cost), true)
        })
        .ok()
}

/// Gives `cost` back to `who` in `of`'s fair table (`refund`: as tokens
/// it may spend again).
fn give_back<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    of: LimitOf<'_>,
    terms: &FairTerms,
    who: FairClaimant,
    cost: u64,
    refund: bool,
) {
    // A failure is counted by the store; the key then lost one call of
    // its share, never the limit's bound.
    let _ = ctx
        .store
        .update_as::<FairTable, _, _>(ctx.host, &entries::fair_key(of), |table| {
            table.give_back(terms, who, cost, refund);
            ((), true)
        });
}

/// What the gate of slots shared fairly said of a call.
pub(super) enum FairSlot {
    /// No slots shared fairly, or the table could not be changed (its
    /// fault counted by the store): the limit's lease table alone decides.
    NotShared,
    /// A slot for the call's key: held and released with the call.
    Taken(HeldSlot),
    /// The key is at its share while others want theirs, or (`full`) no
    /// slot is free at all: then refused as the limit refuses.
    Refused { retry_after: Span, full: bool },
}

/// The terms of a policy's own slots shared fairly for `class`'s call
/// (None: not shared, or the policy queues, and its queue's fair order
/// shares its slots too).
pub(super) fn own_slot_terms(
    policy: &CompiledPolicy,
    class: &Classification,
) -> Option<FairSlotTerms> {
    let terms = policy.fair.as_ref().and_then(|f| f.slots)?;
    if policy.queues() {
        return None;
    }
    Some(match (class.priority, policy.concurrency) {
        // A high-priority call may take the lane's slots too.
        (Priority::High, Some(limit)) => FairSlotTerms {
            capacity: limit.max_in_flight,
            ..terms
        },
        _ => terms,
    })
}

/// The gate of `of`'s slots shared fairly: one slot of its fair slots
/// table for `who` under `terms` (either None: not shared).
pub(super) fn take_slot<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    of: LimitOf<'_>,
    terms: Option<FairSlotTerms>,
    who: Option<FairClaimant>,
) -> FairSlot {
    let (Some(terms), Some(who)) = (terms, who) else {
        return FairSlot::NotShared;
    };
    let key = entries::fair_slots_key(of);
    let (holder, now) = (ctx.holder, ctx.now);
    let taken = ctx
        .store
        .update_as::<FairSlots, _, _>(ctx.host, &key, |table| {
            let take = table.take(&terms, holder, now, who);
            // A refusal is written too: the key now wants a slot.
            (take, true)
        });
    match taken {
        Ok(FairSlotTake::Taken { lease }) => FairSlot::Taken(HeldSlot {
            key,
            lease,
            ttl: terms.lease_ttl,
            fair_key: Some(who.key),
        }),
        Ok(FairSlotTake::Refused { retry_after, full }) => FairSlot::Refused { retry_after, full },
        Err(_) => FairSlot::NotShared,
    }
}
