//! The worker's side of `fair`: in reject mode each call of a policy whose
//! rate is shared fairly takes its key's part in the policy's fair table
//! (one shared-data value, `entries::fair_key`) before the policy's own
//! bucket; in queue mode the policy's queue orders waiting calls fairly
//! instead (`sluice_filter_core::bucket::FairTag`). A further limit shared
//! fairly has a table of its own (`entries::fair_limit_key`), taken before
//! the limits' buckets in either mode ([`take_limits`]). The table decides
//! (`sluice_shared::fair::FairTable`); this only reads and writes it.

use sluice_filter_core::headers::LimitKind;
use sluice_filter_core::matcher::{Classification, CompiledFair, CompiledPolicy};
use sluice_shared::fair::{FairClaimant, FairTable, FairTake};
use sluice_shared::policy::LimitAction;
use sluice_shared::time::Span;

use super::ctx::Ctx;
use crate::entries;
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
    if policy.policy.on_limit.action == LimitAction::Queue && !policy.is_shadow() {
        // Queued calls leave the policy's queue in the fair order instead
        // (`BucketState`'s fair tags): the queue is the share.
        return Fair::NotShared;
    }
    let key = entries::fair_key(policy.name());
    match take_from(ctx, compiled, &key, who, class.cost) {
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
    (who, cost): (FairClaimant, u64),
    kind: LimitKind,
) {
    let Some(compiled) = &policy.fair else {
        return;
    };
    let terms = compiled.terms;
    let refund = kind == LimitKind::Concurrency;
    let key = entries::fair_key(policy.name());
    // A failure is counted by the store; the key then lost one call of
    // its share, never the limit's bound.
    let _ = ctx
        .store
        .update_as::<FairTable, _, _>(ctx.host, &key, |table| {
            table.give_back(&terms, who, cost, refund);
            ((), true)
        });
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
        match take_from(
            ctx,
            compiled,
            &entries::fair_limit_key(&limit.name),
            who,
            cost,
        ) {
            Some(FairTake::Refused { retry_after }) => {
                give_back_limits(ctx, policy, (&taken, costs), None);
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
    (taken, costs): (&[(usize, FairClaimant)], &[u64]),
    refused_by: Option<&str>,
) {
    for &(index, who) in taken {
        let Some(limit) = policy.limits.get(index) else {
            continue;
        };
        let Some(compiled) = &limit.fair else {
            continue;
        };
        let terms = compiled.terms;
        let cost = costs.get(index).copied().unwrap_or(1);
        let refund = refused_by != Some(limit.name.as_str());
        // A failure is counted by the store; the key then lost one call
        // of its share, never the limit's bound.
        let _ = ctx.store.update_as::<FairTable, _, _>(
            ctx.host,
            &entries::fair_limit_key(&limit.name),
            |table| {
                table.give_back(&terms, who, cost, refund);
                ((), true)
            },
        );
    }
}

fn take_from<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    compiled: &CompiledFair,
    key: &str,
    who: FairClaimant,
    cost: u64,
) -> Option<FairTake> {
    let (terms, now) = (compiled.terms, ctx.now);
    ctx.store
        .update_as::<FairTable, _, _>(ctx.host, key, |table| {
            (table.take(&terms, now, who, cost), true)
        })
        .ok()
}
