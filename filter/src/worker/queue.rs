//! Turns for queued streams: on each tick a worker polls the buckets its
//! streams wait in, resumes the ones whose turn came (the bucket keeps one
//! FIFO for every worker), and refuses the ones whose wait ran out. The
//! previous tick's instant goes with each poll: a waiter is never charged
//! to the rate as of earlier than that (see `BucketState::poll`).

use sluice_shared::bucket::{BucketLimits, BucketState};
use sluice_shared::headers::LimitKind;
use sluice_shared::matcher::{CompiledPolicy, CompiledPolicySet};
use sluice_shared::time::Instant;

use super::budgets::Budgets;
use super::limits::{self, LimitPlace, Taken};
use super::refusal::{self, LocalReply, Refusal};
use super::retry::DEFAULT_RETRY;
use super::streams::{Further, Streams};
use crate::host::Host;
use crate::metrics::{Metrics, PolicyStat};
use crate::prefetch::Prefetches;
use crate::store::Store;

/// What the tick asks the glue to do to a paused stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamAction {
    Resume(u32),
    Reply(u32, LocalReply),
}

/// What serving the queues touches of the worker.
pub(super) struct Parts<'a> {
    pub store: &'a mut Store,
    pub metrics: &'a mut Metrics,
    pub streams: &'a mut Streams,
    pub prefetches: &'a mut Prefetches,
    pub budgets: &'a mut Budgets,
}

/// A call that left the queue holding its policy's further limits: what
/// it took where, for the worker to settle its usage and read its answer.
#[derive(Debug)]
pub(super) struct LeftWithLimits {
    pub context_id: u32,
    pub policy_index: usize,
    pub costs: Vec<u64>,
    pub keys: Vec<Option<u64>>,
    pub places: Vec<LimitPlace>,
}

/// Calls that left the queue holding their policy's further limits.
#[derive(Debug, Default)]
pub(super) struct Served {
    pub with_limits: Vec<LeftWithLimits>,
}

pub(super) fn serve<H: Host + ?Sized>(
    host: &H,
    parts: &mut Parts<'_>,
    policies: &CompiledPolicySet,
    holder: u64,
    (previous_poll, now): (Instant, Instant),
    served: &mut Served,
) -> Vec<StreamAction> {
    let mut actions = Vec::new();
    for (bucket, contexts) in parts.streams.waiting_by_bucket() {
        let Some(policy_name) = contexts
            .first()
            .and_then(|c| parts.streams.get(*c))
            .map(|s| s.policy.clone())
        else {
            continue;
        };
        let Some((index, policy)) = policies.find(&policy_name) else {
            // The policy is gone: nothing limits these requests any more.
            for ctx in contexts {
                parts.streams.end(
                    host,
                    parts.store,
                    parts.metrics,
                    parts.prefetches,
                    (holder, Some(now)),
                    ctx,
                );
                actions.push(StreamAction::Resume(ctx));
            }
            continue;
        };
        let limits = BucketLimits::of(policy);
        let poll = Poll {
            bucket: &bucket,
            contexts: &contexts,
            limits: &limits,
            holder,
            times: (previous_poll, now),
        };
        if policy.limits.is_empty() && policy.slot_limits.is_empty() {
            poll.all_turns(host, parts, &mut actions);
        } else {
            poll.head_turns_with_limits(host, parts, (index, policy), &mut actions, served);
        }
        for ctx in contexts {
            if !parts.streams.is_overdue(ctx, now) {
                continue;
            }
            parts.streams.end(
                host,
                parts.store,
                parts.metrics,
                parts.prefetches,
                (holder, Some(now)),
                ctx,
            );
            // It did not leave: its wait ran out.
            parts
                .metrics
                .add(&policy_name, PolicyStat::QueueAbandoned, -1);
            parts
                .metrics
                .add(&policy_name, PolicyStat::QueueTimeouts, 1);
            parts.metrics.add(&policy_name, PolicyStat::Rejected, 1);
            let refusal = Refusal::Policy {
                kind: LimitKind::for_limits(policy.rate.is_some()),
            };
            actions.push(StreamAction::Reply(
                ctx,
                refusal::render(policy, &refusal, DEFAULT_RETRY),
            ));
        }
    }
    actions
}

/// One bucket's queue, polled by this worker.
struct Poll<'a> {
    bucket: &'a str,
    contexts: &'a [u32],
    limits: &'a BucketLimits,
    holder: u64,
    times: (Instant, Instant),
}

impl Poll<'_> {
    /// Every waiter of this worker whose turn came leaves.
    fn all_turns<H: Host + ?Sized>(
        &self,
        host: &H,
        parts: &mut Parts<'_>,
        actions: &mut Vec<StreamAction>,
    ) {
        let (previous_poll, now) = self.times;
        // On failure (counted by the store) the next tick polls again.
        let (turns, lease) = parts
            .store
            .update_as::<BucketState, _, _>(host, self.bucket, |s| {
                let tickets = s.poll(self.limits, self.holder, previous_poll, now);
                let changed = !tickets.is_empty();
                ((tickets, s.lease_of(self.holder)), changed)
            })
            .unwrap_or_default();
        for ticket in turns {
            if let Some(ctx) = parts.streams.with_ticket(self.contexts, ticket) {
                parts.streams.turn_came(parts.metrics, ctx, lease, now);
                actions.push(StreamAction::Resume(ctx));
            }
        }
    }

    /// The head of the queue leaves only once its policy's further limits
    /// took it too, all of them at the moment it leaves; until they do it
    /// stays at the head and nobody passes it (FIFO across every limit).
    fn head_turns_with_limits<H: Host + ?Sized>(
        &self,
        host: &H,
        parts: &mut Parts<'_>,
        (index, policy): (usize, &CompiledPolicy),
        actions: &mut Vec<StreamAction>,
        served: &mut Served,
    ) {
        let (previous_poll, now) = self.times;
        for _ in 0..self.contexts.len() {
            // Whose turn it is, on a copy: nothing is taken yet.
            let Some(state) = parts.store.read_as::<BucketState, _>(host, self.bucket) else {
                return;
            };
            let mut peek = state.clone();
            let Some(ticket) = peek.poll_head(self.limits, self.holder, previous_poll, now) else {
                return;
            };
            let Some(ctx) = parts.streams.with_ticket(self.contexts, ticket) else {
                return;
            };
            let (costs, keys) = parts
                .streams
                .get(ctx)
                .and_then(|s| s.further.as_deref())
                .map(|f: &Further| (f.costs.clone(), f.keys.clone()))
                .unwrap_or_default();
            let taken = limits::take(
                host,
                parts.store,
                parts.metrics,
                parts.budgets,
                policy,
                (&costs, &keys),
                self.holder,
                now,
            );
            let Taken::All { places, slots } = taken else {
                // The head waits for its further limits (or its deadline).
                return;
            };
            let left = parts
                .store
                .update_as::<BucketState, _, _>(host, self.bucket, |s| {
                    let left = s.poll_head(self.limits, self.holder, previous_poll, now);
                    ((left, s.lease_of(self.holder)), left.is_some())
                })
                .unwrap_or_default();
            match left {
                (Some(left), lease) if left == ticket => {
                    limits::count_admitted(parts.metrics, policy, &costs);
                    parts.streams.turn_came(parts.metrics, ctx, lease, now);
                    let series = parts.metrics.series_of(policy.name());
                    parts.streams.hold_slots(ctx, (policy, series), slots, now);
                    served.with_limits.push(LeftWithLimits {
                        context_id: ctx,
                        policy_index: index,
                        costs,
                        keys,
                        places,
                    });
                    actions.push(StreamAction::Resume(ctx));
                }
                _ => {
                    // Another worker changed the queue in between: the
                    // limits get their tokens back; the next tick polls again.
                    limits::give_back(host, parts.store, policy, (&costs, &places), now, now);
                    super::slots::release(host, parts.store, self.holder, &slots);
                    return;
                }
            }
        }
    }
}
