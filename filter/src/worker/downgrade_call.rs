//! A call sent for a cheaper model (see [`super::downgrade`]) takes the
//! cheaper model's costs and prices, and gives back what the dear
//! estimate took beyond them.

use sluice_filter_core::matcher::{BodyJson, CompiledPolicy};
use sluice_shared::request_headers::RequestHeaders;

use super::{rewrite, AsItCame, Downgraded};
use crate::host::Host;
use crate::worker::ctx::Ctx;
use crate::worker::limits::{self, Held, LimitPlace};
use crate::worker::request::CallInputs;
use crate::worker::Parts;
use crate::worker::{pool, provider};

impl Parts {
    /// Sends a call its take left past a downgrade line for the cheaper
    /// model (see [`downgrade`]): its costs and prices become the cheaper
    /// model's, and what the dear estimate took beyond them is given back.
    pub(in crate::worker) fn downgrade<H, R>(
        &self,
        ctx: &mut Ctx<'_, H>,
        policy: &CompiledPolicy,
        context_id: u32,
        held: &Held,
        came: &AsItCame<'_, R>,
        inputs: &mut CallInputs,
    ) -> Option<Box<Downgraded>>
    where
        H: Host + ?Sized,
        R: RequestHeaders + ?Sized,
    {
        // A pool call holds its member's limits (the pool's own among them).
        let holds = pool::limits_of(policy, held.member);
        let costs_held = |inputs: &CallInputs| match (held.member, &inputs.pool) {
            (Some(at), Some(call)) => call.members.get(at).map(|m| m.costs.clone()),
            _ => Some(inputs.limits.costs.clone()),
        };
        // Read before the body is rewritten: past it, the call is sent
        // for the cheaper model whatever follows.
        let dear = costs_held(inputs)?;
        let downgraded = rewrite(ctx, holds, held, came)?;
        let sent = BodyJson::parse(&downgraded.body);
        let mut cheaper = self.inputs_of(ctx, policy, context_id, came.req, &sent);
        let cheap = costs_held(&cheaper).unwrap_or_else(|| dear.clone());
        let beyond: Vec<u64> = holds
            .limits
            .iter()
            .zip(dear.iter().zip(&cheap))
            .map(|(limit, (dear, cheap))| {
                limit
                    .rate
                    .taken(*dear)
                    .saturating_sub(limit.rate.taken(*cheap))
            })
            .collect();
        give_back_tokens(ctx, holds, &beyond, &held.places);
        inputs.limits.costs = cheaper.limits.costs;
        if let (Some(call), Some(cheap)) = (inputs.pool.as_mut(), cheaper.pool.take()) {
            call.members = cheap.members;
        }
        inputs.price = cheaper.price;
        // Boxed: a rare rung's body and names ride in every call held.
        Some(Box::new(downgraded))
    }
}

/// Gives back `tokens[i]` of what the call at `places` took from limit
/// `i` (a cheaper estimate than it took); a 0 touches nothing.
fn give_back_tokens<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    policy: &CompiledPolicy,
    tokens: &[u64],
    places: &[LimitPlace],
) {
    let now = ctx.now;
    for ((limit, tokens), place) in policy.limits.iter().zip(tokens).zip(places) {
        if *tokens == 0 {
            continue;
        }
        if let Some(counted) = place.counted {
            provider::uncount(ctx, limit, counted, *tokens);
        }
        let _ = limits::update_at(ctx, &limit.rate, place, |state| {
            let before = *state;
            limit.rate.refund(state, now, now, *tokens);
            *state != before
        });
    }
}
