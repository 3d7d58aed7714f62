//! A pool's route rung (`route` on one of the pool policy's own limits):
//! past a share of the limit, the call goes to one named member (a
//! cheaper deployment, a self-hosted model) instead of the pool's choice,
//! so spend steps down before it stops. Its checks; the filter's side is
//! in `filter/src/worker/pool.rs`.

use serde::{Deserialize, Serialize};

use super::check::{join_path, Report};
use super::Policy;

#[cfg(feature = "schema")]
use schemars::JsonSchema;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RouteSpec {
    /// The share of the limit (`0.9`: 90 %) past which calls are routed:
    /// a call that leaves the limit (its key's, where keyed) at or past
    /// it goes to `member`.
    pub at: f64,
    /// The pool member (its `name`) such calls go to; when it cannot take
    /// one, the call is refused (queued, in queue mode) as that member's
    /// limits say, never sent to a dearer member.
    pub member: String,
}

/// Every `route` of a policy: only on a pool policy's own rate limits,
/// naming one of its members, its share in (0, 1]. A member's limits
/// route nowhere (a member whose limit is full is passed over already).
pub(crate) fn check_routes(r: &mut Report, policy: &Policy) {
    for (index, limit) in policy.limits.iter().enumerate() {
        let Some(route) = &limit.route else {
            continue;
        };
        let path = join_path(&format!("limits[{index}]"), "route");
        let Some(pool) = &policy.pool else {
            r.at(
                &path,
                "a route rung sends calls to a member of the policy's pool: this policy has no `pool`",
            );
            continue;
        };
        if limit.rate.is_none() {
            r.at(
                &path,
                "a route rung is a line on a limit's rate: a concurrency limit has none",
            );
        }
        if !(route.at > 0.0 && route.at <= 1.0) {
            r.at(
                &join_path(&path, "at"),
                "a share of the limit, above 0 and at most 1 (0.9 routes past 90 %)",
            );
        }
        if !pool.members.iter().any(|m| m.name == route.member) {
            let names: Vec<&str> = pool.members.iter().map(|m| m.name.as_str()).collect();
            r.at(
                &join_path(&path, "member"),
                format!(
                    "{:?} is no member of this pool (its members: {})",
                    route.member,
                    names.join(", ")
                ),
            );
        }
    }
    for (m, member) in policy
        .pool
        .iter()
        .flat_map(|p| p.members.iter().enumerate())
    {
        for (index, limit) in member.limits.iter().enumerate() {
            if limit.route.is_some() {
                r.at(
                    &format!("pool.members[{m}].limits[{index}].route"),
                    "a member's full limit passes the member over already: put the route rung on the pool policy's own `limits`",
                );
            }
        }
    }
}
