//! `ratelimit_headers: always`: the answer to every call of the policy
//! that went upstream tells its caller where the policy's limits stand,
//! in the fields Sluice's refusals carry (`RateLimit-Policy`,
//! `RateLimit`), so that callers can pace themselves before they are
//! refused. A limit that follows its provider's count tells the lower of
//! the two; one the provider paused tells 0 until the pause ends.
//!
//! Limits with a count per key (a keyed policy's rate, a keyed further
//! limit) are listed in `RateLimit-Policy` only: which key a call used is
//! the filter's business, not a value to compute per answer.

use std::sync::Arc;

use sluice_filter_core::bucket::BucketState;
use sluice_filter_core::headers::{admitted_headers, quota_id, ratelimit_item, LimitKind};
use sluice_filter_core::matcher::{CompiledPolicy, CompiledPolicySet};
use sluice_shared::policy::RateLimitHeaders;
use sluice_shared::time::{Instant, Span};

use super::ctx::Ctx;
use super::provider;
use super::slots;
use crate::entries::{self, state_key, LimitOf, LimitState, Place};
use crate::host::Host;
use crate::store::Store;

/// A call whose answer gets the fields: under which set and policy it
/// went.
#[derive(Debug)]
pub(super) struct Told {
    set: Arc<CompiledPolicySet>,
    policy_index: usize,
}

impl Told {
    /// A call of policy `policy_index` of `set` goes (or waits to); None:
    /// its policy tells nothing.
    pub fn of(set: &Arc<CompiledPolicySet>, policy_index: usize) -> Option<Self> {
        let tells = set
            .policies
            .get(policy_index)
            .is_some_and(|p| p.policy.ratelimit_headers == RateLimitHeaders::Always);
        tells.then(|| Self {
            set: Arc::clone(set),
            policy_index,
        })
    }

    /// The fields for the call's answer.
    pub fn headers<H: Host + ?Sized>(&self, ctx: &mut Ctx<'_, H>) -> Vec<(&'static str, String)> {
        let (host, store, now) = (ctx.host, &mut *ctx.store, ctx.now);
        let Some(policy) = self.set.policies.get(self.policy_index) else {
            return Vec::new();
        };
        admitted_headers(&policy.policy, &items(host, store, policy, now))
    }
}

/// The state of each limit of `policy` that has one to tell.
fn items<H: Host + ?Sized>(
    host: &H,
    store: &mut Store,
    policy: &CompiledPolicy,
    now: Instant,
) -> Vec<String> {
    let mut items = Vec::new();
    if let (Some(limiter), None) = (&policy.rate, policy.max_keys()) {
        let state = store
            .read_as::<BucketState, _>(
                host,
                &state_key(LimitOf::Policy(policy.name()), Place::Single),
            )
            .unwrap_or_default();
        let rate = state.rate.unwrap_or_else(|| limiter.initial_state());
        items.push(ratelimit_item(
            &quota_id(&policy.policy, LimitKind::Rate),
            limiter.available(&rate, now),
            Some(limiter.until_reset(&rate, now)),
        ));
    }
    for limit in policy
        .limits
        .iter()
        .filter(|l| l.keys.is_none() && l.tells_spend)
    {
        // Garbage reads as a limit afresh, as the limit itself does.
        let state = entries::read(
            host,
            &state_key(LimitOf::Named(&limit.name), Place::Single),
            &LimitState(&limit.rate),
        );
        let (mut remaining, mut reset) = if limit.closed {
            (0, Span::ZERO)
        } else {
            (
                limit.rate.available(&state, now),
                limit.rate.until_reset(&state, now),
            )
        };
        if let Some((says, until)) = provider::says(host, limit, now) {
            if says < remaining {
                remaining = says;
                reset = until;
            }
        }
        items.push(ratelimit_item(&limit.name, remaining, Some(reset)));
    }
    for limit in &policy.slot_limits {
        let size = limit.limit.max_in_flight;
        let free = size.saturating_sub(slots::in_flight(host, &limit.name, now));
        items.push(ratelimit_item(&limit.name, u64::from(free), None));
    }
    items
}
