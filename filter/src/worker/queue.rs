//! Turns for queued streams: on each tick a worker polls the buckets its
//! streams wait in, resumes the ones whose turn came (the bucket keeps one
//! FIFO for every worker), and refuses the ones whose wait ran out. The
//! previous tick's instant goes with each poll: a waiter is never charged
//! to the rate as of earlier than that (see `BucketState::poll`).

use std::collections::BTreeMap;
use std::sync::Arc;

use sluice_filter_core::bucket::{BucketLimits, BucketState};
use sluice_filter_core::headers::LimitKind;
use sluice_filter_core::matcher::{CompiledPolicy, CompiledPolicySet};
use sluice_shared::limiter::Standing;
use sluice_shared::time::{Instant, Span};

use super::budgets::Budgets;
use super::call::{Holding, PoolRoute};
use super::ctx::Ctx;
use super::limits::{self, LimitInputs, Taken, Why};
use super::pool;
use super::refusal::{self, Refusal};
use super::retry::DEFAULT_RETRY;
use super::rpc_reply;
use super::streams::{Further, PolicyStats, Streams};
use super::to_shell::StreamAction;
use crate::host::Host;
use crate::metrics::PolicyCounter;
use crate::prefetch::Prefetches;

/// What serving the queues touches of the worker's own parts, besides the
/// tick's [`Ctx`].
pub(super) struct Parts<'a> {
    pub streams: &'a mut Streams,
    pub prefetches: &'a mut Prefetches,
    pub budgets: &'a mut Budgets,
    pub holds: &'a mut HeadHolds,
}

/// The longest a queue's head that its further limits refused waits
/// before it asks them again. A limit's refusal says when it has room
/// again, but room can come sooner (a call's unused tokens given back,
/// an adaptive rate raised, a larger share): asked again within 20 ms,
/// it loses at most that much of it.
const HEAD_HOLD_MOST: Span = Span::from_millis(20);

/// Per bucket, this worker's waiter at the head of its queue that its
/// further limits refused, and until when it is not asked of them again.
/// Without it every tick (each millisecond while a call waits) asked
/// every further limit of the head again, in each worker: a queue before
/// a limit of 12 a second asked about 80 times for each call it let go.
/// Once this worker's waiters in the bucket change (one arrived: it may
/// rank ahead, of a higher priority or a fair key ahead; or one left),
/// its head is asked for again at once.
#[derive(Debug, Default)]
pub(super) struct HeadHolds(BTreeMap<String, HeadHold>);

#[derive(Debug, Clone)]
struct HeadHold {
    head: u32,
    until: Instant,
    /// How many of this worker's calls waited in the bucket then.
    waiting: usize,
    refused_by: HeldBy,
}

/// The further limit that last refused a queue's head: while that head
/// still waits, a waiter of the bucket whose wait runs out is refused in
/// its name (the limit, where it stood, when it has room), not only the
/// policy's.
#[derive(Debug, Clone)]
struct HeldBy {
    limit: String,
    why: Why,
    standing: Option<Standing>,
    /// When the limit said it would have room.
    room_at: Instant,
}

impl HeldBy {
    /// The refusal of a call whose wait ran out at `now`, and its
    /// `Retry-After`: what is left of the limit's own wait.
    fn refusal(&self, now: Instant) -> (Refusal, Span) {
        let standing = self.standing.map(|s| Standing {
            until_reset: s.renews_at.since(now),
            ..s
        });
        let left = self.room_at.since(now);
        let refusal = Refusal::Limit {
            limit: self.limit.clone(),
            why: self.why,
            standing,
        };
        (refusal, if left.is_zero() { DEFAULT_RETRY } else { left })
    }
}

impl HeadHolds {
    /// Whether the head of `bucket` waits on its refusal: this worker's
    /// calls waiting there (`contexts`) are the ones it was refused among,
    /// and its hold has not run out.
    fn holds(&self, bucket: &str, contexts: &[u32], now: Instant) -> bool {
        self.0.get(bucket).is_some_and(|h| {
            now < h.until && contexts.len() == h.waiting && contexts.contains(&h.head)
        })
    }

    fn hold(&mut self, bucket: &str, head: HeadHold) {
        self.0.insert(bucket.to_string(), head);
    }

    /// What last refused the head of `bucket`, while it still waits among
    /// `contexts`.
    fn held_by(&self, bucket: &str, contexts: &[u32]) -> Option<&HeldBy> {
        self.0
            .get(bucket)
            .filter(|h| contexts.contains(&h.head))
            .map(|h| &h.refused_by)
    }

    /// Drops the holds of buckets nobody of this worker waits in
    /// (`waiting` in the buckets' order, as `Streams::waiting_by_bucket`).
    fn keep_only(&mut self, waiting: &[(Arc<str>, Vec<u32>)]) {
        self.0.retain(|bucket, _| {
            waiting
                .binary_search_by(|(b, _)| (**b).cmp(bucket.as_str()))
                .is_ok()
        });
    }
}

/// Calls that left the queue holding their policy's further limits: the
/// tick hands each over (`Parts::hold`), routes it, and resumes it.
#[derive(Debug, Default)]
pub(super) struct Served {
    pub with_limits: Vec<Holding>,
}

/// Hands turns to the waiters whose turn came since `previous_poll` and
/// refuses those whose wait ran out.
pub(super) fn serve<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    parts: &mut Parts<'_>,
    policies: &CompiledPolicySet,
    previous_poll: Instant,
    served: &mut Served,
) -> Vec<StreamAction> {
    let mut actions = Vec::new();
    let waiting = parts.streams.waiting_by_bucket();
    parts.holds.keep_only(&waiting);
    for (bucket, contexts) in waiting {
        let Some(policy_name) = contexts
            .first()
            .and_then(|c| parts.streams.get(*c))
            .map(|s| s.policy.clone())
        else {
            continue;
        };
        let Some((index, policy)) = policies.find(&policy_name) else {
            // The policy is gone: nothing limits these requests any more.
            for context_id in contexts {
                parts.streams.end(ctx, parts.prefetches, context_id);
                actions.push(StreamAction::Resume(context_id));
            }
            continue;
        };
        let limits = BucketLimits::of(policy);
        let poll = Poll {
            bucket: &bucket,
            contexts: &contexts,
            limits: &limits,
            previous_poll,
        };
        if policy.limits.is_empty() && policy.slot_limits.is_empty() && policy.pool.is_none() {
            poll.all_turns(ctx, parts, &mut actions);
        } else {
            poll.head_turns_with_limits(ctx, parts, index, policy, served);
        }
        refuse_overdue(ctx, parts, policy, &bucket, &contexts, &mut actions);
    }
    actions
}

/// Refuses the waiters of `bucket` whose wait ran out: in the name of the
/// further limit that holds the queue's head, if one does, else of the
/// policy's own limit.
fn refuse_overdue<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    parts: &mut Parts<'_>,
    policy: &CompiledPolicy,
    bucket: &str,
    contexts: &[u32],
    actions: &mut Vec<StreamAction>,
) {
    let now = ctx.now;
    let held_by = parts.holds.held_by(bucket, contexts).cloned();
    for &context_id in contexts {
        if !parts.streams.is_overdue(context_id, now) {
            continue;
        }
        let rpc = parts.streams.further_of(context_id).rpc;
        if let Some(stream) = parts.streams.get(context_id) {
            ctx.decisions.waited(context_id, now - stream.since);
        }
        parts.streams.end(ctx, parts.prefetches, context_id);
        // It did not leave: its wait ran out.
        let name = policy.name();
        ctx.metrics.add(name, PolicyCounter::QueueAbandoned, -1);
        ctx.metrics.add(name, PolicyCounter::QueueTimeouts, 1);
        ctx.metrics.add(name, PolicyCounter::Rejected, 1);
        let (refusal, retry_after) = match &held_by {
            Some(held_by) => held_by.refusal(now),
            None => {
                let kind = LimitKind::for_limits(policy.rate.is_some());
                (Refusal::Policy { kind }, DEFAULT_RETRY)
            }
        };
        let reply = refusal::render(policy, &refusal, retry_after);
        let reply = match &rpc {
            Some(call) => rpc_reply::for_rpc(reply, call),
            None => reply,
        };
        actions.push(StreamAction::Reply(context_id, reply));
    }
}

/// One bucket's queue, polled by this worker.
struct Poll<'a> {
    bucket: &'a str,
    contexts: &'a [u32],
    limits: &'a BucketLimits,
    previous_poll: Instant,
}

impl Poll<'_> {
    /// Every waiter of this worker whose turn came leaves.
    fn all_turns<H: Host + ?Sized>(
        &self,
        ctx: &mut Ctx<'_, H>,
        parts: &mut Parts<'_>,
        actions: &mut Vec<StreamAction>,
    ) {
        let (previous_poll, now, holder) = (self.previous_poll, ctx.now, ctx.holder);
        // On failure (counted by the store) the next tick polls again.
        let (turns, lease) = ctx
            .store
            .update_as::<BucketState, _, _>(ctx.host, self.bucket, |s| {
                let tickets = s.poll(self.limits, holder, previous_poll, now);
                let changed = !tickets.is_empty();
                ((tickets, s.lease_of(holder)), changed)
            })
            .unwrap_or_default();
        for ticket in turns {
            if let Some(context_id) = parts.streams.with_ticket(self.contexts, ticket) {
                parts
                    .streams
                    .turn_came(ctx.metrics, ctx.decisions, context_id, lease, now);
                actions.push(StreamAction::Resume(context_id));
            }
        }
    }

    /// Whose turn it is (its ticket and stream), if one of this worker's
    /// waiters is at the head and fits the bucket now; read on a copy:
    /// nothing is taken yet.
    fn head<H: Host + ?Sized>(
        &self,
        ctx: &mut Ctx<'_, H>,
        parts: &Parts<'_>,
    ) -> Option<(u64, u32)> {
        let state = ctx.store.read_as::<BucketState, _>(ctx.host, self.bucket)?;
        let mut peek = state.clone();
        let ticket = peek.poll_head(self.limits, ctx.holder, self.previous_poll, ctx.now)?;
        let context_id = parts.streams.with_ticket(self.contexts, ticket)?;
        Some((ticket, context_id))
    }

    /// The head leaves the bucket's queue: its ticket, if it still was
    /// this worker's and fit the bucket, and this worker's lease there.
    /// On failure (counted by the store) the next tick polls again.
    fn leave_head<H: Host + ?Sized>(&self, ctx: &mut Ctx<'_, H>) -> (Option<u64>, Option<Instant>) {
        let (previous_poll, now, holder) = (self.previous_poll, ctx.now, ctx.holder);
        ctx.store
            .update_as::<BucketState, _, _>(ctx.host, self.bucket, |s| {
                let left = s.poll_head(self.limits, holder, previous_poll, now);
                ((left, s.lease_of(holder)), left.is_some())
            })
            .unwrap_or_default()
    }

    /// The head its further limits refused waits for them (or its
    /// deadline), asked again when they said (at most
    /// [`HEAD_HOLD_MOST`] on).
    fn hold_refused_head(&self, holds: &mut HeadHolds, head: u32, taken: Taken, now: Instant) {
        if let Taken::Refused {
            limit,
            retry_after,
            why,
            standing,
        } = taken
        {
            let hold = HeadHold {
                head,
                until: now + retry_after.min(HEAD_HOLD_MOST),
                waiting: self.contexts.len(),
                refused_by: HeldBy {
                    limit,
                    why,
                    standing,
                    room_at: now + retry_after,
                },
            };
            holds.hold(self.bucket, hold);
        }
    }

    /// The head of the queue leaves only once its policy's further limits
    /// took it too, all of them at the moment it leaves; until they do it
    /// stays at the head and nobody passes it (FIFO across every limit).
    fn head_turns_with_limits<H: Host + ?Sized>(
        &self,
        ctx: &mut Ctx<'_, H>,
        parts: &mut Parts<'_>,
        index: usize,
        policy: &CompiledPolicy,
        served: &mut Served,
    ) {
        let now = ctx.now;
        if parts.holds.holds(self.bucket, self.contexts, now) {
            return;
        }
        for _ in 0..self.contexts.len() {
            let Some((ticket, context_id)) = self.head(ctx, parts) else {
                return;
            };
            let Further {
                limits: inputs,
                price,
                pool: pool_call,
                labels,
                ..
            } = parts.streams.further_of(context_id);
            // A pool call goes to a member that can take it now.
            let (taken, member) =
                pool::take_limits(ctx, parts.budgets, policy, &inputs, pool_call.as_deref());
            let limits_policy = pool::limits_of(policy, member);
            let (LimitInputs { costs, keys, .. }, member_index) =
                pool::inputs_at_member(policy, index, member, pool_call.as_deref(), inputs);
            let Taken::All {
                places,
                slots,
                warnings,
                fair,
                rungs,
            } = taken
            else {
                self.hold_refused_head(parts.holds, context_id, taken, now);
                return;
            };
            match self.leave_head(ctx) {
                (Some(left), lease) if left == ticket => {
                    limits::count_admitted(ctx.metrics, limits_policy, &costs);
                    parts
                        .streams
                        .turn_came(ctx.metrics, ctx.decisions, context_id, lease, now);
                    let series = ctx.metrics.series_of(policy.name());
                    let counted = PolicyStats { policy, series };
                    parts.streams.hold_slots(context_id, counted, slots, now);
                    served.with_limits.push(Holding {
                        context_id,
                        policy_index: member_index,
                        costs,
                        keys,
                        places,
                        price,
                        warnings,
                        downgraded: None,
                        rerouted: pool::rerouted(policy, member, &rungs),
                        labels,
                        pool: member.zip(pool_call).map(|(chosen, call)| PoolRoute {
                            pool_index: index,
                            chosen,
                            call,
                        }),
                    });
                }
                _ => {
                    // Another worker changed the queue in between: the
                    // limits get their tokens back; the next tick polls again.
                    limits::give_back(ctx, limits_policy, &costs, &places, now);
                    super::fair::give_back_limits(ctx, limits_policy, &fair, &costs, None);
                    super::slots::release(ctx, &slots);
                    return;
                }
            }
        }
    }
}

/// Where a pool call leaving the queue goes: Envoy routes it by the
/// pool's route header, set to its member's cluster.
pub(super) fn route_to(
    policies: &CompiledPolicySet,
    route: &PoolRoute,
    context_id: u32,
) -> Option<StreamAction> {
    let pool = policies.policy(route.pool_index)?.pool.as_ref()?;
    let member = pool.members.get(route.chosen)?;
    Some(StreamAction::SetHeader(
        context_id,
        pool.route_header.clone(),
        member.cluster.clone(),
    ))
}
