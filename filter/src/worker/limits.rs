//! A policy's further limits (`limits`): each in its own shared-data entry
//! (one per limit name, shared by every policy that names it),
//! taken all or nothing ([`StackedTake`]) before the policy's own bucket
//! decides, and given back when that bucket refuses the call.

use sluice_shared::limiter::{RateLimiter, RateState, StackedOutcome, StackedTake};
use sluice_shared::matcher::CompiledPolicy;
use sluice_shared::time::{Instant, Span};

use super::admission::DEFAULT_RETRY;
use super::budgets::Budgets;
use crate::host::Host;
use crate::metrics::{LimitStat, Metrics};
use crate::store::Store;

/// Where a further limit lives in shared data: by its name alone, so
/// every policy naming it counts against the one limit.
pub fn limit_key(limit: &str) -> String {
    format!("sluice/l/{limit}")
}

/// What the further limits said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Taken {
    /// The policy has none, or every one took its cost.
    All,
    /// `limit` refused first; nothing was kept from the others.
    Refused { limit: String, retry_after: Span },
    /// `limit` is a budget this Envoy does not know the spending of yet
    /// (just started; the admin has not answered): nothing was taken.
    Unknown { limit: String },
}

/// Reads a limit's state; bytes that are no state of this limiter (another
/// algorithm after an edit, or garbage) start it afresh.
pub(super) fn state_of(rate: &RateLimiter, bytes: Option<&[u8]>) -> RateState {
    bytes
        .and_then(|b| rate.decode_state(b).ok())
        .unwrap_or_else(|| rate.initial_state())
}

/// Takes `costs[i]` from each of `policy`'s further limits, all or none.
pub(super) fn take<H: Host + ?Sized>(
    host: &H,
    store: &mut Store,
    metrics: &mut Metrics,
    budgets: &mut Budgets,
    policy: &CompiledPolicy,
    costs: &[u64],
    now: Instant,
) -> Taken {
    if policy.limits.is_empty() {
        return Taken::All;
    }
    if let Some(limit) = policy.limits.iter().find(|l| !budgets.is_known(host, l)) {
        metrics.add_limit(&limit.name, LimitStat::BudgetUnknown, 1);
        return Taken::Unknown {
            limit: limit.name.clone(),
        };
    }
    let mut take = StackedTake::new(costs.to_vec(), now);
    while let Some(index) = take.next_limit() {
        let Some(limit) = policy.limits.get(index) else {
            take.give_up(DEFAULT_RETRY);
            continue;
        };
        let key = limit_key(&limit.name);
        let stepped = store.update(host, &key, |bytes| {
            let mut state = state_of(&limit.rate, bytes);
            let step = take.apply(&limit.rate, &mut state);
            (step, step.changed.then(|| state.encode()))
        });
        match stepped {
            Ok(step) => take.advance(step),
            // The store counted and logged it; a limit that cannot be
            // checked refuses rather than let the call through unchecked.
            Err(_) => take.give_up(DEFAULT_RETRY),
        }
    }
    match take.outcome() {
        Some(StackedOutcome::Refused { limit, retry_after }) => {
            // Counted by the caller: a refusal, or a wait in the queue.
            let name = policy
                .limits
                .get(limit)
                .map_or_else(String::new, |l| l.name.clone());
            Taken::Refused {
                limit: name,
                retry_after,
            }
        }
        _ => Taken::All,
    }
}

/// Counts a call every further limit let through and that went.
pub(super) fn count_admitted(metrics: &mut Metrics, policy: &CompiledPolicy, costs: &[u64]) {
    for (limit, cost) in policy.limits.iter().zip(costs) {
        metrics.add_limit(&limit.name, LimitStat::Admitted, 1);
        if limit.usage.is_some() {
            // Counted when the response settles what it really cost.
            continue;
        }
        let tokens = i64::try_from(limit.rate.taken(*cost)).unwrap_or(i64::MAX);
        metrics.add_limit(&limit.name, LimitStat::Tokens, tokens);
    }
}

/// Gives back what [`take`] took at `taken_at`: the policy's own bucket
/// refused the call.
pub(super) fn give_back<H: Host + ?Sized>(
    host: &H,
    store: &mut Store,
    policy: &CompiledPolicy,
    costs: &[u64],
    taken_at: Instant,
    now: Instant,
) {
    for (limit, cost) in policy.limits.iter().zip(costs) {
        let tokens = limit.rate.taken(*cost);
        let key = limit_key(&limit.name);
        // On failure (counted and logged by the store) the tokens stay
        // taken: the limit errs on the safe side.
        let _ = store.update(host, &key, |bytes| {
            let mut state = state_of(&limit.rate, bytes);
            let before = state;
            limit.rate.refund(&mut state, taken_at, now, tokens);
            ((), (state != before).then(|| state.encode()))
        });
    }
}

/// Settles a call's cost on `limit` once its response said what it used:
/// `(estimate, used)` tokens, `(taken_at, now)`. Less than the estimate is
/// refunded; more is charged whatever the limit holds, a debt the calls
/// that follow pay.
pub(super) fn adjust<H: Host + ?Sized>(
    host: &H,
    store: &mut Store,
    limit: &str,
    rate: &RateLimiter,
    (estimate, used): (u64, u64),
    (taken_at, now): (Instant, Instant),
) {
    if estimate == used {
        return;
    }
    // On failure (counted and logged by the store) the estimate stands.
    let _ = store.update(host, &limit_key(limit), |bytes| {
        let mut state = state_of(rate, bytes);
        let before = state;
        if used > estimate {
            rate.charge(&mut state, now, used - estimate);
        } else {
            rate.refund(&mut state, taken_at, now, estimate - used);
        }
        ((), (state != before).then(|| state.encode()))
    });
}
