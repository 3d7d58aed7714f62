//! The policy schema: what an operator writes (JSON), as serde types,
//! one module per concept, each with the checks of its meaning (ranges,
//! combinations) beside its types; [`crate::validate`] parses a set and
//! runs them, and checks what spans policies (duplicates, shared limits).
//! Parsing into these types checks shapes and refuses unknown fields.

pub mod bounds;
pub mod check;
pub mod cost;
pub mod downgrade;
pub mod fair;
pub mod key;
pub mod limit;
pub mod matching;
pub mod mcp;
pub mod on_limit;
pub mod period;
pub mod pool;
pub mod prompt;
pub mod provider;
pub mod queue_rung;
pub mod rate;
pub mod route;
pub mod usage;

pub use cost::{
    CostFromHeader, CostFromRequestJson, CostSpec, PriceCostSpec, PriceWord, PricedWith,
};
pub use fair::FairSpec;
pub use key::{KeyLabel, KeyOverflow, KeySpec};
pub use limit::{NamedLimit, Scope};
pub use matching::{HeaderEquals, JsonMatch, MatchSpec, Unreadable};
pub use mcp::McpMatch;
pub use on_limit::{LimitAction, OnLimit, Priority, PrioritySpec};
pub use pool::{PoolMember, PoolRule, PoolSpec, StickySpec};
pub use prompt::PromptEstimate;
pub use provider::{
    CustomHeaders, HeaderPreset, IetfItem, ProviderHeaders, ProviderSpec, ResetFormat,
};
pub use rate::{Algorithm, ConcurrencySpec, RateSpec, WarmupSpec};
pub use usage::{UnreadCharge, UnreadName, UsagePaths, UsageSpec};

use serde::{Deserialize, Serialize};

use crate::duration::DurationMs;
use crate::price::PriceTable;

#[cfg(feature = "schema")]
use schemars::JsonSchema;

/// A versioned, ordered list of policies. The first policy whose `match`
/// accepts a request decides for it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct PolicySet {
    /// Increases with every change; filters install a set only when it is newer.
    pub version: u64,
    /// What models cost, for limits whose cost is money (`"cost": "price"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prices: Option<PriceTable>,
    pub policies: Vec<Policy>,
}

impl PolicySet {
    /// Every further limit of the set: each policy's, and its pool members'
    /// (a limit two policies name comes once per policy).
    pub fn limits(&self) -> impl Iterator<Item = &NamedLimit> + Clone {
        self.policies.iter().flat_map(Policy::every_limit)
    }
}

impl Policy {
    /// Whether deciding a call of this policy takes its request's body:
    /// a match, a key or a fair key on it, a further limit costed, keyed
    /// or shared by it, money, or a stream made to ask for its usage.
    pub fn reads_request_body(&self) -> bool {
        let fair = |f: &Option<FairSpec>| f.as_ref().is_some_and(|f| f.key.reads_request_body());
        self.matcher.reads_request_body()
            || self.key.as_ref().is_some_and(KeySpec::reads_request_body)
            || fair(&self.fair)
            || self.every_limit().any(|l| {
                l.cost.reads_request_body()
                    || l.key.as_ref().is_some_and(KeySpec::reads_request_body)
                    || fair(&l.fair)
                    || l.usage.as_ref().is_some_and(|u| u.ask_stream_usage)
            })
    }

    /// Every further limit with its path after `prefix`: its own
    /// (`limits[i]`), then its pool members' (`pool.members[m].limits[i]`).
    pub fn every_limit_at<'p>(
        &'p self,
        prefix: &'p str,
    ) -> impl Iterator<Item = (String, &'p NamedLimit)> + 'p {
        let own = self
            .limits
            .iter()
            .enumerate()
            .map(move |(i, l)| (format!("{prefix}limits[{i}]"), l));
        let members = self
            .pool
            .iter()
            .flat_map(|p| p.members.iter().enumerate())
            .flat_map(move |(m, member)| {
                member
                    .limits
                    .iter()
                    .enumerate()
                    .map(move |(i, l)| (format!("{prefix}pool.members[{m}].limits[{i}]"), l))
            });
        own.chain(members)
    }

    /// The policy's further limits, then its pool members'.
    pub fn every_limit(&self) -> impl Iterator<Item = &NamedLimit> + Clone {
        self.limits.iter().chain(
            self.pool
                .iter()
                .flat_map(|pool| pool.members.iter().flat_map(|m| m.limits.iter())),
        )
    }
}

/// One named limit on one destination.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct Policy {
    /// Letters, digits, `-`, `_`, `.`; unique in the set. Appears in stats and
    /// in the `x-sluice-policy` response header.
    pub name: String,
    #[serde(rename = "match")]
    pub matcher: MatchSpec,
    /// Split the policy into one bucket per value of a request header.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<KeySpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<RateSpec>,
    /// Tokens one request takes from `rate`.
    #[serde(default, skip_serializing_if = "CostSpec::is_default")]
    pub cost: CostSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<ConcurrencySpec>,
    /// More rate limits on the same calls, each counted on its own and for
    /// every call of the policy (not per key): a company-wide limit beside
    /// a per-key `rate`, a per-minute limit beside a per-second one,
    /// tokens beside requests. A call goes only if every limit lets it; a
    /// call one limit refuses takes nothing from the others. A limit named
    /// in several policies is one limit that all of them count against
    /// (an account-wide limit over per-endpoint policies).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub limits: Vec<NamedLimit>,
    #[serde(default)]
    pub on_limit: OnLimit,
    /// How a request's priority is found; without it every request is `normal`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<PrioritySpec>,
    #[serde(default)]
    pub mode: Mode,
    /// Whether the limits are each Envoy's own or one limit for the fleet.
    #[serde(default, skip_serializing_if = "Scope::is_instance")]
    pub scope: Scope,
    /// `global` only: how long a share the admin grants stays valid without
    /// a renewal. Default 3 s; an Envoy that cannot reach the admin keeps its
    /// share this long, then falls back to an even split.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share_lease: Option<DurationMs>,
    /// When callers get the `RateLimit-Policy` and `RateLimit` fields:
    /// on refusals only (the default), or on every answer, so that they
    /// can pace themselves before they are refused.
    #[serde(default, skip_serializing_if = "RateLimitHeaders::is_refusals")]
    pub ratelimit_headers: RateLimitHeaders,
    /// Share the policy's `rate` and `concurrency` fairly between the
    /// values of a key (teams, customers): while several want more than
    /// the limit gives, each gets it in proportion to its weight; a key
    /// wanting less gets all it wants and the rest goes to the others. The
    /// limit's own bound holds as it is: fairness divides it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fair: Option<FairSpec>,
    /// Send each call to one of several upstreams (a pool's members), each
    /// with limits of its own: to a member that can take it now, by
    /// `rule`; a member its provider paused (429, 503) is passed over
    /// until its pause ends. The policy's own limits hold for the pool as
    /// a whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<PoolSpec>,
}

/// When the `RateLimit-Policy` / `RateLimit` fields go to callers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum RateLimitHeaders {
    /// On Sluice's refusals only.
    #[default]
    Refusals,
    /// Also on every answer a call of the policy gets from upstream.
    Always,
}

impl RateLimitHeaders {
    pub fn is_refusals(&self) -> bool {
        *self == RateLimitHeaders::Refusals
    }
}

impl Policy {
    /// The share lease in effect for a global policy.
    pub fn share_lease(&self) -> DurationMs {
        self.share_lease.unwrap_or(Scope::DEFAULT_SHARE_LEASE)
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    #[default]
    Enforce,
    /// Count and log what would have been limited; never limit.
    Shadow,
}
