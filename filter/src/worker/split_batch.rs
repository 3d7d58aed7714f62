//! An MCP batch split into parts (`BatchPart`, the matcher's): each part
//! decided as a call of its own policy, at once and without a prefetch;
//! the batch goes only if every part is admitted, each then holding its
//! limits as a call of its own would (under the batch's stream). If any
//! part is refused, every part admitted gives back what it took, and the
//! refusal answers each request with its own part's error.

use std::sync::Arc;

use sluice_filter_core::bucket::BucketState;
use sluice_filter_core::matcher::{
    BatchPart, BodyJson, BucketKey, CompiledPolicy, CompiledPolicySet, RequestAtHand,
};
use sluice_filter_core::mcp::batch_ids;
use sluice_shared::key_view::KeyOutcome;
use sluice_shared::request_headers::RequestHeaders;
use sluice_shared::time::Instant;

use super::admission::{self, Decision};
use super::ctx::Ctx;
use super::limits::{self, Held};
use super::request::{Admitted, CallInputs};
use super::streams::{self, PolicyStats};
use super::telling::Told;
use super::to_shell::LocalReply;
use super::{fair, rpc_reply, slots, Parts, Verdict};
use crate::host::Host;
use crate::metrics::PolicyCounter;

/// A part as decided: its policy's index, what it takes, the decision,
/// and what it holds of its further limits when admitted.
struct DecidedPart {
    part: BatchPart,
    body: BodyJson,
    inputs: CallInputs,
    decision: Decision,
    held: Option<Held>,
    overflowed: bool,
    taken_at: Instant,
}

impl Parts {
    /// Decides a batch split into `parts`: see the module's header.
    pub(super) fn split_batch<H, R>(
        &mut self,
        ctx: &mut Ctx<'_, H>,
        policies: &Arc<CompiledPolicySet>,
        context_id: u32,
        req: &R,
        body: &BodyJson,
        parts: Vec<BatchPart>,
    ) -> Verdict
    where
        H: Host + ?Sized,
        R: RequestHeaders + ?Sized,
    {
        // Rare, and decided in shared data part by part: a fresh reading.
        ctx.read_clock();
        let mut decided = Vec::with_capacity(parts.len());
        for part in parts {
            let Some(policy) = policies.policies.get(part.class.policy_index) else {
                continue;
            };
            let part_body = part.body(body);
            self.notice_how_it_read(ctx, policy, &part.class, &part_body);
            let inputs = self.inputs_of(ctx, policy, context_id, req, &part_body);
            let mut deciding = admission::Deciding {
                batch_part: true,
                ..admission::Deciding::new(&mut self.prefetches, &mut self.budgets)
            };
            let (decision, held) = deciding.decide(ctx, policy, &part.class, &inputs.limits, None);
            decided.push(DecidedPart {
                part,
                body: part_body,
                inputs,
                decision,
                held,
                overflowed: deciding.overflowed,
                taken_at: ctx.now,
            });
        }
        let refused = decided
            .iter()
            .any(|d| matches!(d.decision, Decision::Refuse(_) | Decision::Queue { .. }));
        let outcome = if refused {
            KeyOutcome::Refused
        } else {
            KeyOutcome::Admitted
        };
        for part in &decided {
            let Some(policy) = policies.policies.get(part.part.class.policy_index) else {
                continue;
            };
            if part.part.class.key != BucketKey::Policy {
                let request = RequestAtHand::new(req, &part.body);
                self.sync
                    .count_key(policy, request, outcome, part.overflowed, ctx.now);
            }
        }
        if refused {
            return self.refuse_split(ctx, policies, body, decided);
        }
        // The one part holding a slot of its own policy (the matcher
        // splits no batch with two) starts the stream the others' further
        // slots join.
        decided.sort_by_key(|d| {
            let policy = policies.policies.get(d.part.class.policy_index);
            policy.is_none_or(|p| p.concurrency.is_none())
        });
        for part in decided {
            self.hold_part(ctx, policies, context_id, req, part);
        }
        Verdict::Continue
    }

    /// A part of a batch that goes holds its limits under the batch's
    /// stream, as a call of its policy admitted now would.
    fn hold_part<H, R>(
        &mut self,
        ctx: &mut Ctx<'_, H>,
        policies: &Arc<CompiledPolicySet>,
        context_id: u32,
        req: &R,
        part: DecidedPart,
    ) where
        H: Host + ?Sized,
        R: RequestHeaders + ?Sized,
    {
        let DecidedPart {
            part,
            body,
            mut inputs,
            decision,
            held,
            ..
        } = part;
        let policy_index = part.class.policy_index;
        let Some(policy) = policies.policies.get(policy_index) else {
            return;
        };
        let request = RequestAtHand::new(req, &body);
        let slots = match held {
            Some(held) => {
                limits::count_admitted(ctx.metrics, policy, &inputs.limits.costs);
                let admitted = Admitted {
                    context_id,
                    pool_index: policy_index,
                    held,
                    downgraded: None,
                };
                self.hold_admitted(ctx, policies, admitted, &mut inputs, request)
            }
            None => Vec::new(),
        };
        self.calls
            .goes(context_id, Told::of(policies, policy_index), None);
        let series = self.series.get(policy_index).copied();
        let series = series.unwrap_or_else(|| ctx.metrics.series_of(policy.name()));
        let stats = PolicyStats { policy, series };
        let now = ctx.now;
        if let Decision::Admit {
            bucket, key, lease, ..
        } = decision
        {
            let slot = streams::Slot { bucket, lease };
            self.streams
                .admitted(ctx.metrics, context_id, stats, slot, key, now);
        }
        self.streams.hold_slots(context_id, stats, slots, now);
    }

    /// A batch a part of which was refused: every part admitted gives
    /// back what it took; each request is answered with its part's error.
    fn refuse_split<H: Host + ?Sized>(
        &mut self,
        ctx: &mut Ctx<'_, H>,
        policies: &Arc<CompiledPolicySet>,
        body: &BodyJson,
        decided: Vec<DecidedPart>,
    ) -> Verdict {
        let mut refused = Vec::new();
        for part in decided {
            let Some(policy) = policies.policies.get(part.part.class.policy_index) else {
                continue;
            };
            if policy.is_global() {
                self.sync.fleet_refused(ctx);
            }
            match part.decision {
                Decision::Refuse(reply) => refused.push((reply, part.part.messages)),
                Decision::Admit { bucket, lease, .. } => {
                    let cost = part.part.class.cost;
                    give_back_own(ctx, policy, &bucket, cost, lease, part.taken_at);
                    give_back_held(ctx, policy, &part.inputs, part.held, part.taken_at);
                    ctx.metrics.add(policy.name(), PolicyCounter::Rejected, 1);
                }
                Decision::Pass => {
                    give_back_held(ctx, policy, &part.inputs, part.held, part.taken_at);
                }
                // Never: a part's bucket decides without a queue, and its
                // further limits do not wait (`Deciding::batch_part`).
                Decision::Queue { .. } => {}
            }
        }
        let ids = body.json().and_then(batch_ids).unwrap_or_default();
        match rpc_reply::for_split_batch(refused, &ids) {
            Some(reply) => Verdict::Reply(reply),
            // Refused, with no reply: none of its parts says why.
            None => Verdict::Reply(LocalReply {
                status: 429,
                headers: Vec::new(),
                body: Vec::new(),
            }),
        }
    }
}

/// Gives back what an admitted part took of its policy's own bucket:
/// its tokens, and its slot.
fn give_back_own<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    policy: &CompiledPolicy,
    bucket: &str,
    cost: u64,
    lease: Option<Instant>,
    taken_at: Instant,
) {
    if bucket.is_empty() {
        return;
    }
    let (holder, now) = (ctx.holder, ctx.now);
    // On failure (counted and logged by the store) the tokens stay taken
    // and the lease gives the slot back: the limit errs on the safe side.
    let _ = ctx
        .store
        .update_as::<BucketState, _, _>(ctx.host, bucket, |state| {
            let before = state.clone();
            if let (Some(rate), Some(taken)) = (&policy.rate, state.rate.as_mut()) {
                rate.refund(taken, taken_at, now, rate.taken(cost));
            }
            if let Some(lease) = lease {
                state.release(holder, lease);
            }
            let changed = *state != before;
            ((), changed)
        });
}

/// Gives back what an admitted part took of its policy's further limits:
/// their tokens (uncounted), fair shares and slots.
fn give_back_held<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    policy: &CompiledPolicy,
    inputs: &CallInputs,
    held: Option<Held>,
    taken_at: Instant,
) {
    let Some(held) = held else {
        return;
    };
    let costs = &inputs.limits.costs;
    limits::give_back(ctx, policy, costs, &held.places, taken_at);
    fair::give_back_limits(ctx, policy, &held.fair, costs, None);
    slots::release(ctx, &held.slots);
}
