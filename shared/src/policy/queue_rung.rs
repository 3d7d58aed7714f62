//! A limit's queue rung (`queue` on one of a policy's own limits): past a
//! share of the limit, the rest of its window is released evenly until
//! the window renews, and a call ahead of that pace waits in the policy's
//! queue until the pace reaches it or its `max_wait` runs out (then it is
//! refused as at the wall). Spend steps down to a steady pace before it
//! stops. Its checks; the pace itself is
//! `crate::limiter::pace`.

use serde::{Deserialize, Serialize};

use super::check::{join_path, Report};
use super::on_limit::LimitAction;
use super::rate::Algorithm;
use super::Policy;

#[cfg(feature = "schema")]
use schemars::JsonSchema;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct QueueRungSpec {
    /// The share of the limit (`0.8`: 80 %) past which the rest of its
    /// window is paced: a call that would take the limit (its key's,
    /// where keyed) past it waits until the rest released by then covers
    /// it.
    pub at: f64,
}

/// Every `queue` rung of a policy: only on its own fixed-window rate
/// limits (so never a global one, leased as a token bucket), in a policy
/// that queues, its share in (0, 1). A pool member's limits have none (a member past its line would
/// be passed over, not held).
pub(crate) fn check_queue_rungs(r: &mut Report, policy: &Policy) {
    for (index, limit) in policy.limits.iter().enumerate() {
        let Some(rung) = &limit.queue else {
            continue;
        };
        let path = join_path(&format!("limits[{index}]"), "queue");
        match &limit.rate {
            None => r.at(
                &path,
                "a queue rung paces a limit's window: a concurrency limit has none",
            ),
            Some(rate) if rate.algorithm != Algorithm::FixedWindow => r.at(
                &path,
                "a queue rung paces the rest of a window: give the limit `algorithm: fixed_window`",
            ),
            Some(_) => {}
        }
        if policy.on_limit.action != LimitAction::Queue {
            r.at(
                &path,
                "a queue rung holds calls in the policy's queue: set `on_limit.action: queue` (and its `max_wait`, the longest a call is held)",
            );
        }
        let same_source = |a: &super::KeySpec, b: &super::KeySpec| {
            a.header.as_deref().map(str::to_ascii_lowercase)
                == b.header.as_deref().map(str::to_ascii_lowercase)
                && a.json == b.json
        };
        if let Some(key) = &limit.key {
            if !policy.key.as_ref().is_some_and(|own| same_source(own, key)) {
                r.at(
                    &join_path(&path, "key"),
                    format!(
                        "a paced key's calls wait in their policy key's queue: give the policy the same `key` ({}), or one key's paced call would hold every other key's behind it",
                        key.source()
                    ),
                );
            }
        }
        if !(rung.at > 0.0 && rung.at < 1.0) {
            r.at(
                &join_path(&path, "at"),
                "a share of the limit, above 0 and below 1 (0.8 paces the last 20 %)",
            );
        }
    }
    for (m, member) in policy
        .pool
        .iter()
        .flat_map(|p| p.members.iter().enumerate())
    {
        for (index, limit) in member.limits.iter().enumerate() {
            if limit.queue.is_some() {
                r.at(
                    &format!("pool.members[{m}].limits[{index}].queue"),
                    "a member's paced limit would pass the member over, not hold the call: put the queue rung on the pool policy's own `limits`",
                );
            }
        }
    }
}
