//! A call sent for a cheaper model (see [`super::downgrade`]) takes the
//! cheaper model's costs and prices, and gives back what the dear
//! estimate took beyond them.

use sluice_filter_core::matcher::{BodyJson, CompiledPolicy};
use sluice_shared::request_headers::RequestHeaders;

use super::{rewrite, AsItCame, Downgraded};
use crate::host::Host;
use crate::worker::ctx::Ctx;
use crate::worker::limits::{self, Held, LimitPlace};
use crate::worker::provider;
use crate::worker::request::CallInputs;
use crate::worker::Parts;

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
        let downgraded = rewrite(ctx, policy, held, came)?;
        let sent = BodyJson::parse(&downgraded.body);
        let cheaper = self.inputs_of(ctx, policy, context_id, came.req, &sent);
        let beyond: Vec<u64> = policy
            .limits
            .iter()
            .zip(inputs.limits.costs.iter().zip(&cheaper.limits.costs))
            .map(|(limit, (dear, cheap))| {
                limit
                    .rate
                    .taken(*dear)
                    .saturating_sub(limit.rate.taken(*cheap))
            })
            .collect();
        give_back_tokens(ctx, policy, &beyond, &held.places);
        inputs.limits.costs = cheaper.limits.costs;
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
