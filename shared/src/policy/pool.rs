//! A pool (`pool`): the upstreams a policy's calls may go to, each with
//! limits of its own, and its checks.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::bounds;
use super::check::{check_header_name, check_json_path, check_name, join_path, Report};
use super::fair::FairSpec;
use super::limit::{check_named_limits, NamedLimit};

#[cfg(feature = "schema")]
use schemars::JsonSchema;
/// A pool of upstreams for the same calls (`pool`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct PoolSpec {
    #[serde(default)]
    pub rule: PoolRule,
    /// Keep the calls of one key (a conversation's id: a header or a JSON
    /// body field) on one member while it has room, so that a provider's
    /// prompt cache keeps working.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sticky: Option<StickySpec>,
    /// The request header Sluice writes the chosen member's `cluster`
    /// into; Envoy's routes match it, one route per member. A caller's own
    /// value is removed from every request, pool or not (and the default
    /// header's even before the first policy set with a pool).
    #[serde(default = "PoolSpec::default_route_header")]
    pub route_header: String,
    /// Two to 16 members, names unique in the set.
    pub members: Vec<PoolMember>,
}

impl PoolSpec {
    pub const MAX_MEMBERS: usize = 16;
    /// The answer's header naming the member that answered (set by the
    /// route from its endpoint's metadata), when Envoy retried the call on
    /// another member.
    pub const ANSWERED_BY_HEADER: &'static str = "x-sluice-member-answered";
    /// Each attempt's answer's header naming the member that gave it (set
    /// per attempt by an upstream filter of the member's cluster, from its
    /// endpoint's metadata), for the filter that hears attempts (plugin
    /// `role: attempts`).
    pub const ATTEMPT_MEMBER_HEADER: &'static str = "x-sluice-attempt-member";
    /// `route_header` when a pool names none.
    pub const DEFAULT_ROUTE_HEADER: &'static str = "x-sluice-member";

    fn default_route_header() -> String {
        Self::DEFAULT_ROUTE_HEADER.to_string()
    }
}

/// How a pool chooses a member for a call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum PoolRule {
    /// The member with the most of its tightest limit left, as a part of
    /// that limit: members fill alike.
    #[default]
    MostRoom,
    /// At random by `weight`, among the members that can take the call.
    Weighted,
    /// In the order written: the first until it is full or paused, then
    /// the next.
    Priority,
}

/// Where a pool's sticky key is read: exactly one of `header` and `json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct StickySpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// A dotted path into the request's JSON body.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub json: Option<String>,
}

/// One upstream of a pool.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct PoolMember {
    /// Letters, digits, `-`, `_`, `.`; unique in the pool. Stats are
    /// `sluice.member.<policy>.<name>.*`.
    pub name: String,
    /// The Envoy cluster the call is routed to (written into
    /// `route_header`). Its credential is Envoy's configuration's, never
    /// the admin's.
    pub cluster: String,
    /// For `rule: weighted` (0.001 to 1000).
    #[serde(default = "PoolMember::default_weight")]
    pub weight: f64,
    /// The member's own limits, as a policy's `limits` (rate, tokens,
    /// concurrency, its provider's signals): at least one. Their names are
    /// the member's own: no other policy or member names them.
    pub limits: Vec<NamedLimit>,
}

impl PoolMember {
    fn default_weight() -> f64 {
        1.0
    }
}

/// `pool`: two or more members with names and clusters of their own,
/// weights in range, each with limits of its own, at most
/// `bounds::MAX_LIMITS` with its policy's `policy_limits`.
pub(crate) fn check_pool(r: &mut Report, pool: &PoolSpec, policy_limits: usize) {
    let mut pr = Report::new(r.errors, &join_path(&r.prefix, "pool"));
    check_header_name(&mut pr, "route_header", &pool.route_header);
    if let Some(why) = crate::header_names::not_writable(&pool.route_header) {
        pr.at(
            "route_header",
            format!(
                "Sluice writes the chosen member here, and {:?} cannot be written: {why}",
                pool.route_header
            ),
        );
    }
    if let Some(sticky) = &pool.sticky {
        match (&sticky.header, &sticky.json) {
            (Some(header), None) => check_header_name(&mut pr, "sticky.header", header),
            (None, Some(path)) => check_json_path(&mut pr, "sticky.json", path),
            (Some(_), Some(_)) => pr.at("sticky", "give either `header` or `json`, not both"),
            (None, None) => pr.at(
                "sticky",
                "give `header` (a request header) or `json` (a path in the request's JSON body)",
            ),
        }
    }
    if pool.members.len() < 2 {
        pr.at("members", "a pool needs at least two members");
    } else if pool.members.len() > PoolSpec::MAX_MEMBERS {
        pr.at(
            "members",
            format!("at most {} members", PoolSpec::MAX_MEMBERS),
        );
    }
    let mut names: HashMap<&str, usize> = HashMap::new();
    let mut clusters: HashMap<&str, usize> = HashMap::new();
    for (index, member) in pool.members.iter().enumerate() {
        let mut mr = Report::new(
            pr.errors,
            &join_path(&pr.prefix, &format!("members[{index}]")),
        );
        check_name(&mut mr, &member.name);
        if let Some(first) = names.insert(&member.name, index) {
            mr.at(
                "name",
                format!(
                    "duplicate name {:?}, already used by members[{first}]",
                    member.name
                ),
            );
        }
        check_cluster(&mut mr, &member.cluster);
        if let Some(first) = clusters.insert(&member.cluster, index) {
            mr.at(
                "cluster",
                format!(
                    "members[{first}] is routed to {:?} already: each member is an upstream of its own",
                    member.cluster
                ),
            );
        }
        if !(member.weight.is_finite()
            && (FairSpec::MIN_WEIGHT..=FairSpec::MAX_WEIGHT).contains(&member.weight))
        {
            mr.at(
                "weight",
                format!(
                    "must be a number from {} to {}",
                    FairSpec::MIN_WEIGHT,
                    FairSpec::MAX_WEIGHT
                ),
            );
        }
        if member.limits.is_empty() {
            mr.at(
                "limits",
                "a member needs at least one limit of its own (its rate, tokens or calls in flight), so that the pool knows its room",
            );
        } else if !member
            .limits
            .iter()
            .any(|l| l.rate.is_some() && l.provider.is_some())
        {
            mr.at(
                "limits",
                "give one of a member's rate limits `provider` (e.g. {\"pause_on\": [429, 503]}), so that its refusals pause it and calls go to the other members",
            );
        }
        if policy_limits + member.limits.len() > bounds::MAX_LIMITS {
            mr.at(
                "limits",
                format!(
                    "the policy's limits and a member's take at most {} together",
                    bounds::MAX_LIMITS
                ),
            );
        }
        // A member's limit may be `scope: global`, as any further limit:
        // its quota is then leased in shares over the fleet, and its
        // provider's pauses and cuts reach every Envoy.
        check_named_limits(&mut mr, "limits", &member.limits);
    }
}

/// An Envoy cluster's name as a header value: printable ASCII, no spaces.
pub(crate) fn check_cluster(r: &mut Report, cluster: &str) {
    if cluster.is_empty() {
        r.at("cluster", "must not be empty");
    } else if cluster.len() > bounds::MAX_NAME_LEN * 2 {
        r.at(
            "cluster",
            format!("at most {} characters", bounds::MAX_NAME_LEN * 2),
        );
    } else if !cluster.bytes().all(|b| b.is_ascii_graphic()) {
        r.at(
            "cluster",
            "an Envoy cluster's name: printable ASCII without spaces",
        );
    }
}
