//! A policy's further limits (`limits`): each in its own shared-data entry
//! (one per limit name, shared by every policy that names it; a keyed
//! limit has one per key, in at most `max_keys` places),
//! taken all or nothing ([`StackedTake`]) before the policy's own bucket
//! decides, and given back when that bucket refuses the call.

use sluice_filter_core::matcher::{CompiledLimit, CompiledPolicy, UNPRICED};
use sluice_shared::fair::FairClaimant;
use sluice_shared::limiter::{
    RateLimiter, RateState, StackedOutcome, StackedTake, Standing, StepResult,
};
use sluice_shared::policy::KeyOverflow;
use sluice_shared::time::{Instant, Span};
use sluice_shared::warn::period_mark;

use super::budgets::Budgets;
use super::ctx::Ctx;
use super::fair::{self, FairTaken};
use super::held_slot::HeldSlot;
use super::key_places::{self, Keyed};
use super::provider::{self, CountSays, Counted};
use super::retry::{DEFAULT_RETRY, SLOT_RETRY};
use super::rungs::Rungs;
use super::slots::{self, SlotsTaken};
use crate::entries::{state_key, LimitOf, LimitState, OwnedLimitState, Place};
use crate::host::Host;
use crate::metrics::{LimitCounter, Metrics};

/// Where a call's tokens of one further limit are: its shared-data entry,
/// and for a keyed limit the key owning that entry then.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitPlace {
    pub key: String,
    /// None: the entry is the limit's plain state. Some: it starts with
    /// the owning key's hash (0 for the overflow entry).
    pub owner: Option<u64>,
    /// Where the call counts in the provider's count the limit follows.
    pub counted: Option<Counted>,
}

impl LimitPlace {
    pub(super) fn unkeyed(limit: &str) -> Self {
        Self {
            key: state_key(LimitOf::Named(limit), Place::Single),
            owner: None,
            counted: None,
        }
    }
}

/// What an admitted call holds of its policy's further limits, to settle
/// its cost (`places`) and give back its slots when it ends.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Held {
    pub places: Vec<LimitPlace>,
    pub slots: Vec<HeldSlot>,
    /// Limits the call left past a warning line: (name, thousandths used).
    pub warnings: Vec<PastWarning>,
    /// What it took of its limits' fair tables.
    pub fair: FairTaken,
    /// A pool call: the member (its place in the pool) whose limits these
    /// are.
    pub member: Option<usize>,
    /// The ladder's rungs its take reached.
    pub rungs: Rungs,
}

/// What the further limits said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Taken {
    /// The policy has none, or every one took its cost: where, per rate
    /// limit, and a slot in each concurrency limit.
    All {
        places: Vec<LimitPlace>,
        slots: Vec<HeldSlot>,
        /// Limits the call left past a warning line: (name, thousandths used).
        warnings: Vec<PastWarning>,
        fair: FairTaken,
        /// See [`Held::rungs`].
        rungs: Rungs,
    },
    /// `limit` refused first, for `why`; nothing was kept from the
    /// others.
    Refused {
        limit: String,
        retry_after: Span,
        why: Why,
        /// Where the limit stood, when its own count refused.
        standing: Option<Standing>,
    },
    /// `limit` is a budget this Envoy does not know the spending of yet
    /// (just started; the admin has not answered): nothing was taken.
    Unknown { limit: String },
}

/// Why a limit refused a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Why {
    /// Its own count (or a fault in reading it).
    Limit,
    /// The provider asked to wait (`Retry-After`).
    ProviderPause,
    /// The provider's count has nothing left until its reset.
    ProviderCount,
    /// A money limit's call whose model has no price (and the table no
    /// default): never free.
    Unpriced,
    /// A money limit's MCP call of a tool that has no price (and the
    /// table no `tool_default`): never free.
    ToolUnpriced,
    /// The limit's rate is shared fairly (`fair`) and the call's key is
    /// past its share while others want theirs.
    FairShare,
    /// The limit has room for the call, but it is past its queue rung's
    /// line and the call is ahead of the pace its rest is released at.
    Paced,
}

/// How long a caller refused for an unpriced model is told to wait: the
/// same call fails until the price table changes.
const UNPRICED_RETRY: Span = Span::from_secs(60);

/// Changes the state at `place` with `f` (which says whether it changed).
/// A keyed entry another key took over since holds nothing of the call's:
/// it is left alone.
pub(super) fn update_at<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    rate: &RateLimiter,
    place: &LimitPlace,
    mut f: impl FnMut(&mut RateState) -> bool,
) -> Result<(), crate::store::StoreError> {
    let (host, store) = (ctx.host, &mut *ctx.store);
    match place.owner {
        None => store.update_with(host, &place.key, &LimitState(rate), |state| ((), f(state))),
        Some(owner) => store.update_with(
            host,
            &place.key,
            &OwnedLimitState(rate),
            |(held_by, state)| {
                if *held_by != owner {
                    return ((), false);
                }
                ((), f(state))
            },
        ),
    }
}

/// What a call takes from a policy's further limits, found from its
/// request: per rate limit its cost and its key's hash (None: unkeyed),
/// and per limit shared fairly (the rate limits, then the concurrency
/// limits) who it is there (empty when none is).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct LimitInputs {
    pub costs: Vec<u64>,
    pub keys: Vec<Option<u64>>,
    pub claimants: Vec<Option<FairClaimant>>,
}

/// Takes `costs[i]` from each of `policy`'s further rate limits (for a
/// keyed one, from the place of the call's key `keys[i]`), then a slot of
/// `holder`'s in each concurrency limit: all or none.
pub(super) fn take<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    budgets: &mut Budgets,
    policy: &CompiledPolicy,
    inputs: &LimitInputs,
) -> Taken {
    let (costs, claimants) = (&inputs.costs[..], &inputs.claimants[..]);
    // Each limit shared fairly first: a key past its share takes nothing.
    let fair = match fair::take_limits(ctx, policy, costs, claimants) {
        Ok(fair) => fair,
        Err((limit, retry_after)) => {
            return Taken::Refused {
                limit,
                retry_after,
                why: Why::FairShare,
                standing: None,
            }
        }
    };
    let (places, warnings, rungs) = match take_rates(ctx, budgets, policy, inputs) {
        Ok(taken) => taken,
        Err(refused) => {
            // The limit that refused held fewer tokens than its table: its
            // key's stay spent (see `fair::refused_after`).
            let by = match &refused {
                Taken::Refused { limit, .. } => Some(limit.as_str()),
                _ => None,
            };
            fair::give_back_limits(ctx, policy, &fair, costs, by);
            return refused;
        }
    };
    let now = ctx.now;
    let slot_claimants = claimants.get(policy.limits.len()..).unwrap_or_default();
    let slots = match slots::take(ctx, policy, slot_claimants) {
        SlotsTaken::All(slots) => slots,
        SlotsTaken::Refused { limit, fair_retry } => {
            give_back(ctx, policy, costs, &places, now);
            fair::give_back_limits(ctx, policy, &fair, costs, None);
            let (retry_after, why) = match fair_retry {
                Some(retry_after) => (retry_after, Why::FairShare),
                None => (SLOT_RETRY, Why::Limit),
            };
            return Taken::Refused {
                limit,
                retry_after,
                why,
                standing: None,
            };
        }
    };
    let mut places = places;
    match count_in_provider(ctx, policy, inputs, &mut places) {
        Ok(()) => Taken::All {
            places,
            slots,
            warnings,
            fair,
            rungs,
        },
        Err(refused) => {
            give_back(ctx, policy, costs, &places, now);
            fair::give_back_limits(ctx, policy, &fair, costs, None);
            slots::release(ctx, &slots);
            refused
        }
    }
}

/// Counts the call in the provider's count of every limit following one,
/// once every limit took it: all or none (on a refusal, the counts taken
/// are in `places` for [`give_back`]).
fn count_in_provider<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    policy: &CompiledPolicy,
    inputs: &LimitInputs,
    places: &mut [LimitPlace],
) -> Result<(), Taken> {
    let (costs, keys) = (&inputs.costs, &inputs.keys);
    for (index, (limit, place)) in policy.limits.iter().zip(places.iter_mut()).enumerate() {
        let key = keys.get(index).copied().flatten();
        let cost = limit.rate.taken(costs.get(index).copied().unwrap_or(0));
        match provider::count(ctx, limit, key, cost) {
            Ok(CountSays::NotFollowed) => {}
            Ok(CountSays::Counted(counted)) => place.counted = Some(counted),
            Ok(CountSays::Exhausted { wait }) => {
                return Err(Taken::Refused {
                    limit: limit.name.clone(),
                    retry_after: wait,
                    why: Why::ProviderCount,
                    standing: None,
                })
            }
            // The store counted and logged it: a count that cannot be
            // checked refuses rather than let the call through unchecked.
            Err(_) => {
                return Err(Taken::Refused {
                    limit: limit.name.clone(),
                    retry_after: DEFAULT_RETRY,
                    why: Why::Limit,
                    standing: None,
                })
            }
        }
    }
    Ok(())
}

/// What refuses a call before any rate limit is taken: a budget not
/// known yet, a model without a price, a limit its provider paused.
fn refused_before_taking<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    budgets: &mut Budgets,
    policy: &CompiledPolicy,
    inputs: &LimitInputs,
) -> Result<(), Taken> {
    if let Some(limit) = policy
        .limits
        .iter()
        .find(|l| !budgets.is_known(ctx.host, l))
    {
        ctx.metrics
            .add_limit(&limit.name, LimitCounter::BudgetUnknown, 1);
        return Err(Taken::Unknown {
            limit: limit.name.clone(),
        });
    }
    if let Some(limit) = policy
        .limits
        .iter()
        .zip(&inputs.costs)
        .find(|(l, cost)| l.is_priced() && **cost == UNPRICED)
        .map(|(l, _)| l)
    {
        return Err(Taken::Refused {
            limit: limit.name.clone(),
            retry_after: UNPRICED_RETRY,
            why: if policy.counts_mcp() {
                Why::ToolUnpriced
            } else {
                Why::Unpriced
            },
            standing: None,
        });
    }
    for (index, limit) in policy.limits.iter().enumerate() {
        let key = inputs.keys.get(index).copied().flatten();
        if let Some(wait) = provider::paused(ctx.host, limit, key, ctx.now) {
            // Counted by the caller, as any refusal by this limit.
            return Err(Taken::Refused {
                limit: limit.name.clone(),
                retry_after: wait,
                why: Why::ProviderPause,
                standing: None,
            });
        }
    }
    Ok(())
}

/// Where each rate limit holds the call's tokens, lines past, the rungs reached.
type RatesTaken = (Vec<LimitPlace>, Vec<PastWarning>, Rungs);

/// The rate limits' part of [`take`].
fn take_rates<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    budgets: &mut Budgets,
    policy: &CompiledPolicy,
    inputs: &LimitInputs,
) -> Result<RatesTaken, Taken> {
    if policy.limits.is_empty() {
        return Ok((Vec::new(), Vec::new(), Rungs::default()));
    }
    refused_before_taking(ctx, budgets, policy, inputs)?;
    let (costs, keys, now) = (&inputs.costs[..], &inputs.keys, ctx.now);
    let mut places: Vec<Option<LimitPlace>> = vec![None; policy.limits.len()];
    let mut take = StackedTake::new(costs.to_vec(), now);
    let watched = |l: &CompiledLimit| !l.warn.is_empty() || l.has_rungs();
    if policy.limits.iter().any(watched) {
        take = take.watching(policy.limits.iter().map(watched).collect());
    }
    while let Some(index) = take.next_limit() {
        let (Some(limit), Some(place)) = (policy.limits.get(index), places.get_mut(index)) else {
            take.give_up(DEFAULT_RETRY);
            continue;
        };
        if limit.closed {
            // This Envoy's share of a global limit allows nothing now.
            take.give_up(DEFAULT_RETRY);
            continue;
        }
        let key = keys.get(index).copied().flatten();
        match step(ctx, limit, key, place, &take) {
            Ok(Some(step)) => take.advance(step),
            // No place for the key (overflow: reject), or the store
            // counted and logged a failure: a limit that cannot be checked
            // refuses rather than let the call through unchecked.
            Ok(None) | Err(_) => take.give_up(DEFAULT_RETRY),
        }
    }
    match take.outcome() {
        Some(StackedOutcome::Refused { limit, retry_after }) => {
            // Counted by the caller: a refusal, or a wait in the queue.
            let (refused_by, standing) = (policy.limits.get(limit), take.standing());
            let cost = costs.get(limit).copied().unwrap_or(0);
            let paced = refused_by
                .zip(standing)
                .is_some_and(|(l, s)| l.held_by_pace(&s, cost));
            Err(Taken::Refused {
                limit: refused_by.map_or_else(String::new, |l| l.name.clone()),
                retry_after,
                why: if paced { Why::Paced } else { Why::Limit },
                standing,
            })
        }
        _ => {
            let places: Vec<LimitPlace> = places
                .into_iter()
                .zip(&policy.limits)
                .map(|(place, limit)| place.unwrap_or_else(|| LimitPlace::unkeyed(&limit.name)))
                .collect();
            let warnings = warnings(ctx, policy, costs, &places, &take);
            Ok((places, warnings, Rungs::reached(policy, &take)))
        }
    }
}

/// A limit the call left past a warning line, and the thousandths of it
/// used (None: the limit does not tell, `tell_spend: false`).
pub(super) type PastWarning = (String, Option<u64>);

/// The warning lines the call's take crossed (counted) and those it left
/// its limits past (the answer says so).
fn warnings<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    policy: &CompiledPolicy,
    costs: &[u64],
    places: &[LimitPlace],
    take: &StackedTake,
) -> Vec<PastWarning> {
    let mut past = Vec::new();
    for (index, limit) in policy.limits.iter().enumerate() {
        if limit.warn.is_empty() {
            continue;
        }
        let Some(standing) = take.taken_standing(index) else {
            continue;
        };
        let taken = limit.rate.taken(costs.get(index).copied().unwrap_or(0));
        let warning = limit.warn.check(&standing, taken);
        if warning.crossed != 0 {
            let place = places.get(index);
            let period = policy
                .policy
                .limits
                .iter()
                .find(|l| l.name == limit.name)
                .and_then(|l| l.rate.as_ref())
                .map_or(1, |r| r.period.as_span().as_nanos());
            let owner = place.and_then(|p| p.owner).unwrap_or(0);
            // A calendar period's is its window: a local day or month.
            let mark = match limit.rate.calendar_window_start(ctx.now) {
                Some(start) => period_mark(start.as_nanos(), 1, owner),
                None => period_mark(ctx.now.as_nanos(), period, owner),
            };
            let first = (0..8u8)
                .filter(|line| warning.crossed & (1 << line) != 0)
                .filter(|line| {
                    let key = format!("{}/w{line}", place.map_or("", |p| p.key.as_str()));
                    // Once a period: a line crossed again after usage gave
                    // some of an estimate back is not a new crossing.
                    ctx.store
                        .update_as::<u64, _, _>(ctx.host, &key, |seen| {
                            let new = *seen != mark;
                            *seen = mark;
                            (new, new)
                        })
                        .unwrap_or(false)
                })
                .count();
            if first > 0 {
                ctx.metrics.add_limit(
                    &limit.name,
                    LimitCounter::WarnCrossed,
                    i64::try_from(first).unwrap_or(i64::MAX),
                );
            }
        }
        if let Some(used) = warning.past {
            ctx.metrics.add_limit(&limit.name, LimitCounter::Warned, 1);
            past.push((limit.name.clone(), limit.tells_spend.then_some(used)));
        }
    }
    past
}

/// One step of a stacked take on `limit`: on its one entry, or for a keyed
/// limit on the entry of the call's key, found on the first step (a place
/// of its own, one it takes over from an idle key, or the overflow) and
/// kept in `place` for the steps after. None: the key has no place.
fn step<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    limit: &CompiledLimit,
    key: Option<u64>,
    place: &mut Option<LimitPlace>,
    take: &StackedTake,
) -> Result<Option<StepResult>, crate::store::StoreError> {
    let (host, store) = (ctx.host, &mut *ctx.store);
    let rate = &limit.rate;
    let Some(hash) = key else {
        return store
            .update_with(
                host,
                &state_key(LimitOf::Named(&limit.name), Place::Single),
                &LimitState(rate),
                |state| {
                    let step = take.apply(rate, state);
                    (step, step.changed)
                },
            )
            .map(Some);
    };
    if let Some(place) = place {
        let owner = place.owner.unwrap_or(0);
        return store
            .update_with(
                host,
                &place.key,
                &OwnedLimitState(rate),
                |(held_by, state)| {
                    if *held_by != owner {
                        // Taken over since: nothing of this call's is there.
                        let mut fresh = rate.initial_state();
                        return (take.apply(rate, &mut fresh), false);
                    }
                    let step = take.apply(rate, state);
                    (step, step.changed)
                },
            )
            .map(Some);
    }
    let owner = key_places::owner_of(hash);
    let keys = limit.keys.unwrap_or((1, KeyOverflow::Shared));
    let keyed = key_places::on_key(
        ctx,
        LimitOf::Named(&limit.name),
        keys,
        owner,
        &OwnedLimitState(rate),
        |_, entry| {
            let step = take.apply(rate, &mut entry.1);
            (step, step.changed)
        },
    )?;
    let (placed, owner) = match keyed {
        Keyed::Placed(placed) => (placed, owner),
        // The overflow place is nobody's: every overflowing key shares it.
        Keyed::Overflowed(placed) => (placed, 0),
        Keyed::Refused => return Ok(None),
    };
    *place = Some(LimitPlace {
        key: placed.key,
        owner: Some(owner),
        counted: None,
    });
    Ok(Some(placed.out))
}

/// Counts a call every further limit let through and that went.
pub(super) fn count_admitted(metrics: &mut Metrics, policy: &CompiledPolicy, costs: &[u64]) {
    for slot_limit in &policy.slot_limits {
        metrics.add_limit(&slot_limit.name, LimitCounter::Admitted, 1);
    }
    for (limit, cost) in policy.limits.iter().zip(costs) {
        metrics.add_limit(&limit.name, LimitCounter::Admitted, 1);
        if limit.usage.is_some() {
            // Counted when the response settles what it really cost.
            continue;
        }
        let tokens = i64::try_from(limit.rate.taken(*cost)).unwrap_or(i64::MAX);
        metrics.add_limit(&limit.name, LimitCounter::Tokens, tokens);
    }
}

/// Gives back what [`take`] took at `taken_at` (at `places`): the policy's
/// own bucket refused the call, or it queued.
pub(super) fn give_back<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    policy: &CompiledPolicy,
    costs: &[u64],
    places: &[LimitPlace],
    taken_at: Instant,
) {
    let now = ctx.now;
    for ((limit, cost), place) in policy.limits.iter().zip(costs).zip(places) {
        let tokens = limit.rate.taken(*cost);
        if let Some(counted) = place.counted {
            provider::uncount(ctx, limit, counted, tokens);
        }
        // On failure (counted and logged by the store) the tokens stay
        // taken: the limit errs on the safe side.
        let _ = update_at(ctx, &limit.rate, place, |state| {
            let before = *state;
            limit.rate.refund(state, taken_at, now, tokens);
            *state != before
        });
    }
}

/// Settles a call's cost on the limit at `place` once its response said
/// what it used: `(estimate, used)` tokens, `(taken_at, now)`. Less than
/// the estimate is refunded; more is charged whatever the limit holds, a
/// debt the calls that follow pay.
pub(super) fn adjust<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    place: &LimitPlace,
    rate: &RateLimiter,
    estimate: u64,
    used: u64,
    taken_at: Instant,
) {
    if estimate == used {
        return;
    }
    let now = ctx.now;
    // On failure (counted and logged by the store) the estimate stands.
    let _ = update_at(ctx, rate, place, |state| {
        let before = *state;
        if used > estimate {
            rate.charge(state, now, used - estimate);
        } else {
            rate.refund(state, taken_at, now, estimate - used);
        }
        *state != before
    });
}
