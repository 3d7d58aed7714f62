//! Turns for queued streams: on each tick a worker polls the buckets its
//! streams wait in, resumes the ones whose turn came (the bucket keeps one
//! FIFO for every worker), and refuses the ones whose wait ran out. The
//! previous tick's instant goes with each poll: a waiter is never charged
//! to the rate as of earlier than that (see `BucketState::poll`).

use sluice_shared::bucket::BucketLimits;
use sluice_shared::headers::LimitKind;
use sluice_shared::matcher::CompiledPolicySet;
use sluice_shared::time::Instant;

use super::admission::{rejection, LocalReply, DEFAULT_RETRY};
use super::streams::Streams;
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

#[allow(clippy::too_many_arguments)]
pub(super) fn serve<H: Host + ?Sized>(
    host: &H,
    store: &mut Store,
    metrics: &mut Metrics,
    streams: &mut Streams,
    prefetches: &mut Prefetches,
    policies: &CompiledPolicySet,
    holder: u64,
    (previous_poll, now): (Instant, Instant),
) -> Vec<StreamAction> {
    let mut actions = Vec::new();
    for (bucket, contexts) in streams.waiting_by_bucket() {
        let Some(policy_name) = contexts
            .first()
            .and_then(|c| streams.get(*c))
            .map(|s| s.policy.clone())
        else {
            continue;
        };
        let Some((_, policy)) = policies.find(&policy_name) else {
            // The policy is gone: nothing limits these requests any more.
            for ctx in contexts {
                streams.end(host, store, metrics, prefetches, holder, ctx);
                actions.push(StreamAction::Resume(ctx));
            }
            continue;
        };
        let limits = BucketLimits::of(policy);
        // On failure (counted by the store) the next tick polls again.
        let (turns, lease) = store
            .update_bucket(host, &bucket, |s| {
                let tickets = s.poll(&limits, holder, previous_poll, now);
                let changed = !tickets.is_empty();
                ((tickets, s.lease_of(holder)), changed)
            })
            .unwrap_or_default();
        for ticket in turns {
            if let Some(ctx) = streams.with_ticket(&contexts, ticket) {
                streams.turn_came(metrics, ctx, lease, now);
                actions.push(StreamAction::Resume(ctx));
            }
        }
        for ctx in contexts {
            if !streams.is_overdue(ctx, now) {
                continue;
            }
            streams.end(host, store, metrics, prefetches, holder, ctx);
            // It did not leave: its wait ran out.
            metrics.add(&policy_name, PolicyStat::QueueAbandoned, -1);
            metrics.add(&policy_name, PolicyStat::QueueTimeouts, 1);
            metrics.add(&policy_name, PolicyStat::Rejected, 1);
            let kind = LimitKind::for_limits(policy.rate.is_some());
            actions.push(StreamAction::Reply(
                ctx,
                rejection(policy, kind, DEFAULT_RETRY),
            ));
        }
    }
    actions
}
