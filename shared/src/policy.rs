//! The policy schema: what an operator writes (JSON), as serde types.
//!
//! Parsing into these types checks shapes and refuses unknown fields;
//! [`crate::validate`] checks meaning (ranges, combinations, duplicates).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::duration::DurationMs;

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
    pub prices: Option<crate::price::PriceTable>,
    pub policies: Vec<Policy>,
}

impl PolicySet {
    /// Every further limit of the set: each policy's, and its pool members'
    /// (a limit two policies name comes once per policy).
    pub fn limits(&self) -> impl Iterator<Item = &NamedLimit> + Clone {
        self.policies.iter().flat_map(Policy::every_limit)
    }
}

fn tells_by_default() -> bool {
    true
}

fn is_true(b: &bool) -> bool {
    *b
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

/// How a policy's rate is shared between keys (`fair`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct FairSpec {
    /// Who shares: a request header or a JSON body field. At most the
    /// smaller of `max_keys` and 256 keys have shares of their own; the
    /// others share one.
    pub key: KeySpec,
    /// Weights by key value (0.001 to 1000); others have `default_weight`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub weights: BTreeMap<String, f64>,
    #[serde(default = "FairSpec::default_weight")]
    pub default_weight: f64,
    /// Reserved per key value, in the rate's requests (or tokens) per its
    /// period, or in slots when only a concurrency limit is shared: kept
    /// for the key while it wants it, lent out while it does not. They add
    /// up to the limit at most.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub min: BTreeMap<String, u64>,
}

impl FairSpec {
    pub const MIN_WEIGHT: f64 = 0.001;
    pub const MAX_WEIGHT: f64 = 1000.0;
    /// Weights and reservations named at most.
    pub const MAX_NAMED: usize = 1000;

    fn default_weight() -> f64 {
        1.0
    }
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

/// One more limit of a policy (see [`Policy::limits`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct NamedLimit {
    /// Letters, digits, `-`, `_`, `.`; unique in the policy. Policies that
    /// name the same limit share it and must give it the same `rate`. A
    /// refusal names it in the `x-sluice-limit` header; its stats are
    /// `sluice.limit.<name>.*`.
    pub name: String,
    /// Split this limit into one per value of a request header (tokens per
    /// minute per API key), whatever the policy's own `key`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<KeySpec>,
    /// A rate limit: so many calls (or tokens) per period.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<RateSpec>,
    /// Or a concurrency limit: so many calls in flight at once, for every
    /// policy naming it (Stripe's account-wide concurrency over
    /// per-endpoint policies). One slot per call, held until it ends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<ConcurrencySpec>,
    /// Tokens one call takes from this limit (with `usage`: its estimate).
    #[serde(default, skip_serializing_if = "CostSpec::is_default")]
    pub cost: CostSpec,
    /// The call's real cost, read from its response.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<UsageSpec>,
    /// `global`: one limit for every Envoy syncing with the admin, which
    /// leases each a share (as for a `global` policy), beside the
    /// policy's own limits, which may be per key and per Envoy.
    #[serde(default, skip_serializing_if = "Scope::is_instance")]
    pub scope: Scope,
    /// Listen to the provider this limit mirrors: its `Retry-After` on a
    /// refusal pauses the limit for every worker (and key, where keyed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<ProviderSpec>,
    /// Warning lines, as shares of the limit (`[0.8, 0.95]`): a call that
    /// leaves it past one gets `x-sluice-warn: "<limit>";used=0.81`, and
    /// each crossing is counted (`warn_crossed`) and written to the
    /// admin's audit log once.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warn_at: Vec<f64>,
    /// Whether callers are told its figures: what is spent of it and its
    /// size (a refusal's `x-sluice-spent` and `x-sluice-budget`, its
    /// quota in `RateLimit-Policy`, its remaining in `RateLimit`, the
    /// share used in `x-sluice-warn`). `false` for a limit every caller
    /// shares whose spend is the company's business, not theirs (an
    /// unkeyed money budget): a refusal then says only that it is spent
    /// and when it renews. Default `true`.
    #[serde(default = "tells_by_default", skip_serializing_if = "is_true")]
    pub tell_spend: bool,
    /// Share this limit's `rate` or `concurrency` fairly between the
    /// values of a key, by weight (as a policy's `fair` shares its own):
    /// tokens per minute or calls in flight divided between tenants.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fair: Option<FairSpec>,
}

/// What a rate limit takes from the provider's answers (opt-in).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ProviderSpec {
    /// Answers whose `Retry-After` (or OpenAI's `retry-after-ms`) pauses
    /// the limit: every call it governs waits (queue) or is refused with
    /// the time left (reject) until the provider said to come back.
    #[serde(default = "ProviderSpec::default_pause_on")]
    pub pause_on: Vec<u16>,
    /// The longest a provider may pause the limit; a longer `Retry-After`
    /// pauses this long (and is counted). Default 5 minutes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_pause: Option<DurationMs>,
    /// Follow the provider's own count of what is left, read from its
    /// answers: a preset (`ietf`, `openai-requests`, `openai-tokens`,
    /// `anthropic-requests`, `anthropic-tokens`, `anthropic-input-tokens`,
    /// `anthropic-output-tokens`, `github`), `{"ietf": "<item name>"}`, or
    /// your own headers. When the provider has fewer left than Sluice
    /// believes, no more than that goes until its reset; Sluice never goes
    /// above its own limit for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub headers: Option<ProviderHeaders>,
    /// For a provider that says only "429": every refusal (a status in
    /// `pause_on`) cuts this limit's rate to 0.7 of what went, once per
    /// overload, and the rate climbs back to the limit's own along a
    /// cubic curve (as AWS SDKs' adaptive mode), learned by every worker
    /// at once.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub adaptive: bool,
}

/// Where a provider says how much of its limit is left.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(
    untagged,
    expecting = "a preset (\"ietf\", \"openai-requests\", \"openai-tokens\", \"anthropic-requests\", \"anthropic-tokens\", \"anthropic-input-tokens\", \"anthropic-output-tokens\", \"github\"), {\"ietf\": \"<item name>\"} or {\"remaining\": ..., \"reset\": ..., \"reset_format\": ...}"
)]
pub enum ProviderHeaders {
    Preset(HeaderPreset),
    Ietf(IetfItem),
    Custom(CustomHeaders),
}

/// The headers of a provider Sluice knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "kebab-case")]
pub enum HeaderPreset {
    /// `RateLimit: "<this limit's name>";r=..;t=..` (or its only item), or
    /// the older `RateLimit-Remaining` / `RateLimit-Reset`.
    Ietf,
    /// `x-ratelimit-remaining-requests`, reset as `1m30.5s`.
    OpenaiRequests,
    /// `x-ratelimit-remaining-tokens`, reset as `12ms`.
    OpenaiTokens,
    /// `anthropic-ratelimit-requests-remaining`, reset as an RFC 3339 time.
    AnthropicRequests,
    AnthropicTokens,
    AnthropicInputTokens,
    AnthropicOutputTokens,
    /// `x-ratelimit-remaining`, reset in epoch seconds.
    Github,
}

/// The IETF `RateLimit` item to follow, by name.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct IetfItem {
    pub ietf: String,
}

/// A provider's own headers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct CustomHeaders {
    /// The header with the provider's limit (its quota per window), if it
    /// sends one: after its reset, Sluice expects that much again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<String>,
    /// The header with what is left (a whole number).
    pub remaining: String,
    /// The header saying when the count is full again; without it, the
    /// limit's own period.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reset: Option<String>,
    #[serde(default)]
    pub reset_format: ResetFormat,
}

/// How a reset header is written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum ResetFormat {
    /// Seconds from now.
    #[default]
    Seconds,
    /// Seconds since 1970 (GitHub).
    EpochSeconds,
    /// `12ms`, `6m0s`, `1m30.5s` (OpenAI).
    Duration,
    /// `2026-11-24T12:00:05Z` (Anthropic).
    Rfc3339,
}

impl ProviderSpec {
    pub const DEFAULT_PAUSE_ON: [u16; 2] = [429, 503];
    pub const DEFAULT_MAX_PAUSE: DurationMs = DurationMs::from_secs(300);
    /// The most `max_pause` may be: a provider's hourly window.
    pub const MAX_PAUSE_LIMIT: DurationMs = DurationMs::from_secs(24 * 3600);

    fn default_pause_on() -> Vec<u16> {
        Self::DEFAULT_PAUSE_ON.to_vec()
    }

    pub fn max_pause(&self) -> DurationMs {
        self.max_pause.unwrap_or(Self::DEFAULT_MAX_PAUSE)
    }
}

impl Default for ProviderSpec {
    fn default() -> Self {
        Self {
            pause_on: Self::default_pause_on(),
            max_pause: None,
            headers: None,
            adaptive: false,
        }
    }
}

impl NamedLimit {
    /// Where a global limit's share is in the fleet's messages: beside the
    /// global policies' (whose names have no `/`).
    pub fn fleet_name(&self) -> String {
        format!("limits/{}", self.name)
    }

    /// A limit this long is a budget: an Envoy syncing with an admin gets
    /// back what it spent of it after a restart, so a restart does not
    /// refill a daily or monthly limit.
    pub const BUDGET_MIN_PERIOD: DurationMs = DurationMs::from_secs(3600);

    /// A keyed limit is not: the admin holds one record per limit.
    pub fn is_budget(&self) -> bool {
        self.spends_over_hours() && self.key.is_none() && self.scope == Scope::Instance
    }

    /// A keyed budget: the admin holds what each key spent, so that a
    /// restart refills no key's day or month either (with a sync token,
    /// which keeps a key's hash the same across restarts).
    pub fn is_keyed_budget(&self) -> bool {
        self.spends_over_hours() && self.key.is_some() && self.scope == Scope::Instance
    }

    /// A rate limit of an hour or longer, keyed or not: the live view shows
    /// what it has spent (per key: the top spenders) against its size.
    pub fn spends_over_hours(&self) -> bool {
        self.rate
            .as_ref()
            .is_some_and(|r| r.period >= Self::BUDGET_MIN_PERIOD)
    }
}

/// Who a policy's limits are for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    /// Every Envoy enforces the whole limit on its own calls.
    #[default]
    Instance,
    /// The limit is for every Envoy syncing with the admin, together: the
    /// admin leases each a share, weighted by the demand it reports
    /// (fleet mode, docs/FLEET.md).
    Global,
}

impl Scope {
    pub const DEFAULT_SHARE_LEASE: DurationMs = DurationMs::from_secs(3);

    pub fn is_instance(&self) -> bool {
        *self == Scope::Instance
    }
}

/// Which requests a policy applies to. Every given condition must hold.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct MatchSpec {
    /// Destination host (the request's `:authority`): `api.bank.example`,
    /// `api.bank.example:8443`, `*.bank.example` (any subdomain) or `*` (any).
    pub host: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path_prefix: Option<String>,
    /// Empty means any method.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub methods: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<HeaderEquals>,
    /// Fields of the request's JSON body (`model` is `gpt-4o`). Only a
    /// policy with such conditions reads the body (up to 1 MiB). A body
    /// that lacks the field, or holds another value, does not match, and
    /// the request goes on to the next policy; one that cannot be read
    /// (not JSON, over 1 MiB) falls under this policy, unless
    /// `unreadable` says `next`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub json: Vec<JsonMatch>,
    /// Where a call whose headers match goes when its body cannot be read
    /// (not JSON, over 1 MiB, cut by trailers Sluice could not read):
    /// `match` (the default) decides it under this policy, its costs at
    /// their most; `next` passes it on to the next policy, which must then
    /// be as strict, since the provider may read the body all the same.
    #[serde(default, skip_serializing_if = "Unreadable::is_match")]
    pub unreadable: Unreadable,
}

/// See [`MatchSpec::unreadable`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Unreadable {
    /// The call falls under this policy (fail closed).
    #[default]
    Match,
    /// The call goes on to the next policy.
    Next,
}

impl Unreadable {
    fn is_match(&self) -> bool {
        *self == Self::Match
    }
}

impl MatchSpec {
    /// Whether matching a request takes its body.
    pub fn reads_request_body(&self) -> bool {
        !self.json.is_empty()
    }
}

/// A condition on one field of the request's JSON body: exactly one of
/// `equals`, `prefix` and `one_of`. A string field is compared as it is; a
/// number or `true`/`false` as its JSON text (`3`, `true`); anything else
/// (an object, a list, `null`) matches nothing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct JsonMatch {
    /// A dotted path into the body: `model`, `metadata.team`, `input.0.role`.
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub equals: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub one_of: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct HeaderEquals {
    pub name: String,
    pub equals: String,
}

/// One bucket per distinct value of `header` (per API key, per tenant), or
/// of a field of the request's JSON body (`json`: per model, per `user`).
///
/// Requests without the header (or whose body is not JSON, or lacks the
/// field) share one bucket. At most `max_keys` keys are
/// tracked at once; a key whose bucket is idle (full again, nothing in flight)
/// gives its place to a new key. When every place holds a busy key, a new key
/// is handled by `overflow`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct KeySpec {
    /// A request header: exactly one of `header` and `json`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// A dotted path into the request's JSON body (`model`, `user`,
    /// `metadata.team`): a string is the key as it is, a number or
    /// `true`/`false` its JSON text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub json: Option<String>,
    #[serde(default = "KeySpec::default_max_keys")]
    pub max_keys: u32,
    #[serde(default)]
    pub overflow: KeyOverflow,
    /// How the live view names keys: a keyed hash (default: raw keys never
    /// leave Envoy) or, for values that are no secret (a tenant id, a
    /// region), the value itself.
    #[serde(default, skip_serializing_if = "KeyLabel::is_hash")]
    pub label: KeyLabel,
}

/// How the live view names a policy's keys.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum KeyLabel {
    /// A keyed hash such as `#3fa2c41b09de`; the admin finds a key you type.
    #[default]
    Hash,
    /// The header's value, when printable and no secret (cut at 64
    /// characters).
    Value,
}

impl KeyLabel {
    fn is_hash(&self) -> bool {
        *self == KeyLabel::Hash
    }
}

impl KeySpec {
    pub const DEFAULT_MAX_KEYS: u32 = 10_000;

    /// Whether the key is read from the request's body.
    pub fn reads_request_body(&self) -> bool {
        self.json.is_some()
    }

    /// Where the key comes from, for people: `x-api-key`, `json model`.
    pub fn source(&self) -> String {
        match (&self.header, &self.json) {
            (Some(header), _) => header.clone(),
            (None, Some(path)) => format!("json {path}"),
            (None, None) => String::new(),
        }
    }

    fn default_max_keys() -> u32 {
        Self::DEFAULT_MAX_KEYS
    }
}

/// What happens to a request whose key finds no place among `max_keys`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum KeyOverflow {
    /// All overflowing keys share one extra bucket with the policy's limits:
    /// they are limited together, never let through unlimited.
    #[default]
    Shared,
    /// Overflowing keys are refused with the policy's `on_limit` reply.
    Reject,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RateSpec {
    #[serde(default)]
    pub algorithm: Algorithm,
    /// Requests (tokens) allowed per `period`.
    pub requests: u64,
    /// `"1s"`, `"1m"`, `"1h"`, `"250ms"` or milliseconds.
    pub period: DurationMs,
    /// Token bucket only: how many requests may go at once after an idle
    /// spell. Defaults to `requests`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u64>,
    /// Token bucket only: after an idle spell the rate starts lower and ramps
    /// up to full, for a backend that needs warming (Guava's SmoothWarmingUp).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warmup: Option<WarmupSpec>,
}

impl RateSpec {
    /// The bucket capacity in effect.
    pub fn effective_burst(&self) -> u64 {
        self.burst.unwrap_or(self.requests)
    }

    /// The most tokens one request can ever take: beyond it a request could
    /// never be admitted.
    pub fn capacity(&self) -> u64 {
        match self.algorithm {
            Algorithm::TokenBucket => self.effective_burst(),
            Algorithm::FixedWindow | Algorithm::SlidingWindow => self.requests,
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// GCRA: smooth refill, bursts up to `burst`, no double burst at edges.
    #[default]
    TokenBucket,
    /// At most `requests` per aligned window; allows up to twice that across
    /// a window edge.
    FixedWindow,
    /// Weighted blend of the previous and current window; no edge burst.
    SlidingWindow,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct WarmupSpec {
    /// How long the ramp from cold to full rate takes. A bucket idle for at
    /// least this long is cold again.
    pub period: DurationMs,
    /// The cold rate is `requests / cold_factor`.
    #[serde(default = "WarmupSpec::default_cold_factor")]
    pub cold_factor: u32,
}

impl WarmupSpec {
    pub const DEFAULT_COLD_FACTOR: u32 = 3;

    fn default_cold_factor() -> u32 {
        Self::DEFAULT_COLD_FACTOR
    }
}

/// Tokens one request takes: a fixed number, read from a request header,
/// or (in `limits` only) read from a field of the request's JSON body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(
    untagged,
    expecting = "a number of tokens, {\"header\": ..., \"default\": ..., \"max\": ...}, {\"json\": ..., \"plus\": ..., \"plus_prompt\": {\"paths\": [...], \"chars_per_token\": ...}, \"default\": ..., \"max\": ...}, \"price\" or {\"price\": {\"output\": ..., \"default_output\": ..., \"prompt\": ..., \"usage\": \"openai\" or \"anthropic\"}}"
)]
pub enum CostSpec {
    Fixed(u64),
    FromHeader(CostFromHeader),
    FromRequestJson(CostFromRequestJson),
    /// Money at the set's `prices` (in `limits` only): the limit's
    /// `rate.requests` is then its budget in millionths of the currency.
    Price(PriceCostSpec),
}

/// `"price"`, or `{"price": {...}}` to set how it is estimated and read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(untagged)]
pub enum PriceCostSpec {
    Word(PriceWord),
    Set(PricedWith),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum PriceWord {
    Price,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct PricedWith {
    pub price: crate::price::PriceCost,
}

impl PriceCostSpec {
    pub fn cost(&self) -> crate::price::PriceCost {
        match self {
            PriceCostSpec::Word(_) => crate::price::PriceCost::default(),
            PriceCostSpec::Set(with) => with.price.clone(),
        }
    }
}

impl Default for CostSpec {
    fn default() -> Self {
        CostSpec::Fixed(1)
    }
}

impl CostSpec {
    pub fn is_default(&self) -> bool {
        *self == CostSpec::Fixed(1)
    }

    /// The largest cost this spec can produce.
    pub fn max_cost(&self) -> u64 {
        match self {
            CostSpec::Fixed(n) => *n,
            CostSpec::FromHeader(h) => h.max.max(h.default),
            CostSpec::FromRequestJson(j) => j.max.max(j.default),
            // Money has no most: the estimate is the most a call can be.
            CostSpec::Price(_) => 0,
        }
    }

    /// Whether the cost is known only once the request's body is read.
    pub fn reads_request_body(&self) -> bool {
        matches!(self, CostSpec::FromRequestJson(_) | CostSpec::Price(_))
    }

    /// Whether the cost is money at the set's prices.
    pub fn is_price(&self) -> bool {
        matches!(self, CostSpec::Price(_))
    }
}

/// A header value that is not a whole number uses `default`; a value above
/// `max` counts as `max`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct CostFromHeader {
    pub header: String,
    #[serde(default = "CostFromHeader::default_cost")]
    pub default: u64,
    pub max: u64,
}

impl CostFromHeader {
    fn default_cost() -> u64 {
        1
    }
}

/// An estimate read from the request's JSON body: the whole number at
/// `json` (a dotted path, `max_tokens`) plus `plus` (a floor for what the
/// call costs beyond it, such as a prompt's framing), plus the prompt's
/// estimated tokens (`plus_prompt`), at most `max`. A JSON body without a
/// whole number at `json` costs `default` (and its prompt); one that is
/// not JSON costs `default`, one too large to read `max`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct CostFromRequestJson {
    pub json: String,
    #[serde(default)]
    pub plus: u64,
    /// Adds the prompt's size, so that a long prompt is admitted against
    /// about what it will cost before it is sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plus_prompt: Option<PromptEstimate>,
    #[serde(default = "CostFromHeader::default_cost")]
    pub default: u64,
    pub max: u64,
}

/// A prompt's tokens estimated from its text: the characters of every
/// string under `paths` (`messages`, `input`, `prompt`; a path the body
/// lacks adds nothing; `"*"` is the whole body), divided by
/// `chars_per_token` and rounded up.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct PromptEstimate {
    pub paths: Vec<String>,
    /// Characters a token holds on average: about 4 for English text
    /// and OpenAI's or Anthropic's tokenizers, less for JSON or code
    /// (3.3), less still for other scripts. Default 4.
    #[serde(default = "PromptEstimate::default_chars_per_token")]
    pub chars_per_token: f64,
}

impl PromptEstimate {
    pub const DEFAULT_CHARS_PER_TOKEN: f64 = 4.0;
    /// A path that counts every string of the body.
    pub const EVERY_STRING: &'static str = "*";

    fn default_chars_per_token() -> f64 {
        Self::DEFAULT_CHARS_PER_TOKEN
    }
}

/// Where a call's real cost comes from once its response is known: a
/// response header, or whole numbers in its JSON body (summed). The call
/// is admitted against its `cost` (the estimate); when the response ends
/// the difference is refunded or charged to the calls that follow. A
/// response that ends early, carries no usage, or whose usage cannot be
/// read is charged `unread`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct UsageSpec {
    /// A response header holding the cost (`x-usage-tokens`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// Dotted paths into a JSON response whose whole numbers are summed:
    /// `["usage.total_tokens"]`, or `["usage.input_tokens",
    /// "usage.output_tokens"]`; or weighed, a path to its weight:
    /// `{"usage.prompt_tokens": 1, "usage.completion_tokens": 4,
    /// "usage.prompt_tokens_details.cached_tokens": -1}`.
    #[serde(default, skip_serializing_if = "UsagePaths::is_empty")]
    pub json: UsagePaths,
    /// The paths for a streamed (`text/event-stream`) answer, where the
    /// last value of each across its events counts; default: `json`.
    #[serde(default, skip_serializing_if = "UsagePaths::is_empty")]
    pub events: UsagePaths,
    /// The most of a JSON body (or of one event) read for its usage;
    /// default 256 KiB. A larger one is charged `unread` and counted
    /// (`usage_too_large`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_body_bytes: Option<u32>,
    /// What a call is charged when its usage could not be read (an answer
    /// cut short, without usage, too large to read): `"max"` (the default:
    /// the most its `cost` can be, not the caller's own estimate), a
    /// number of tokens, or `"estimate"` (what it was admitted against).
    /// Never less than the estimate.
    #[serde(default, skip_serializing_if = "UnreadCharge::is_default")]
    pub unread: UnreadCharge,
    /// For OpenAI-style streams: a streamed request that does not ask for
    /// its usage is sent asking (`"stream_options": {"include_usage":
    /// true}`), and what the provider adds for it is taken out of the
    /// answer, which the caller gets as it would have without. So a
    /// stream's usage is read, not charged `unread`. Such calls go
    /// upstream without `content-length` (their body may grow).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ask_stream_usage: bool,
}

/// See [`UsageSpec::unread`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(
    untagged,
    expecting = "\"max\", \"estimate\" or a whole number of tokens"
)]
pub enum UnreadCharge {
    Named(UnreadName),
    Tokens(u64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum UnreadName {
    /// The most the limit's `cost` can be.
    Max,
    /// What the call was admitted against.
    Estimate,
}

impl Default for UnreadCharge {
    fn default() -> Self {
        UnreadCharge::Named(UnreadName::Max)
    }
}

impl UnreadCharge {
    pub fn is_default(&self) -> bool {
        *self == Self::default()
    }

    /// The tokens charged for unread usage of a limit whose cost is
    /// `cost` (None: the estimate).
    pub fn tokens(&self, cost: &CostSpec) -> Option<u64> {
        // Money's estimate already counts the most output the call asked
        // for at its model's price: "max" is that estimate.
        if cost.is_price() {
            return match self {
                UnreadCharge::Tokens(n) => Some(*n),
                UnreadCharge::Named(_) => None,
            };
        }
        match self {
            UnreadCharge::Named(UnreadName::Max) => Some(cost.max_cost()),
            UnreadCharge::Named(UnreadName::Estimate) => None,
            UnreadCharge::Tokens(n) => Some(*n),
        }
    }
}

impl UsageSpec {
    pub const DEFAULT_MAX_BODY_BYTES: u32 = 256 * 1024;

    pub fn max_body_bytes(&self) -> u32 {
        self.max_body_bytes.unwrap_or(Self::DEFAULT_MAX_BODY_BYTES)
    }

    /// The paths read from a streamed answer.
    pub fn event_paths(&self) -> &UsagePaths {
        if self.events.is_empty() {
            &self.json
        } else {
            &self.events
        }
    }
}

/// Paths into a JSON answer whose whole numbers are summed, each times its
/// weight: a list (every weight 1) or a map of path to weight. A path of a
/// positive weight must be in the answer (or its usage is missing); one of
/// a negative weight (a discount, such as cached prompt tokens) counts 0
/// when absent. The sum is never below 0.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct UsagePaths(pub Vec<(String, i64)>);

impl UsagePaths {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Each path with its weight.
    pub fn iter(&self) -> impl Iterator<Item = (&str, i64)> {
        self.0.iter().map(|(path, weight)| (path.as_str(), *weight))
    }
}

impl<S: Into<String>> FromIterator<S> for UsagePaths {
    /// Paths of weight 1.
    fn from_iter<I: IntoIterator<Item = S>>(paths: I) -> Self {
        Self(paths.into_iter().map(|p| (p.into(), 1)).collect())
    }
}

impl Serialize for UsagePaths {
    /// A list while every weight is 1, as most policies write it.
    fn serialize<Ser: serde::Serializer>(&self, serializer: Ser) -> Result<Ser::Ok, Ser::Error> {
        use serde::ser::{SerializeMap, SerializeSeq};
        if self.0.iter().all(|(_, weight)| *weight == 1) {
            let mut seq = serializer.serialize_seq(Some(self.0.len()))?;
            for (path, _) in &self.0 {
                seq.serialize_element(path)?;
            }
            seq.end()
        } else {
            let mut map = serializer.serialize_map(Some(self.0.len()))?;
            for (path, weight) in &self.0 {
                map.serialize_entry(path, weight)?;
            }
            map.end()
        }
    }
}

impl<'de> Deserialize<'de> for UsagePaths {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(
            untagged,
            expecting = "a list of paths, or a map of path to a whole-number weight"
        )]
        enum Written {
            List(Vec<String>),
            Weighted(std::collections::BTreeMap<String, i64>),
        }
        Ok(match Written::deserialize(deserializer)? {
            Written::List(paths) => paths.into_iter().collect(),
            Written::Weighted(weights) => Self(weights.into_iter().collect()),
        })
    }
}

#[cfg(feature = "schema")]
impl JsonSchema for UsagePaths {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "UsagePaths".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "description": "Dotted paths into a JSON answer whose whole numbers are summed: a list (each counted once), or a map of path to weight (`{\"usage.prompt_tokens\": 1, \"usage.completion_tokens\": 4, \"usage.prompt_tokens_details.cached_tokens\": -1}`). A negative weight's path counts 0 when absent; the sum is never below 0.",
            "oneOf": [
                { "type": "array", "items": { "type": "string" } },
                { "type": "object", "additionalProperties": { "type": "integer" } }
            ]
        })
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ConcurrencySpec {
    /// Requests allowed in flight at once, across all Envoy workers.
    pub max_in_flight: u32,
    /// A slot not released within this time is reclaimed (a crashed worker,
    /// a stream that never ends).
    #[serde(default = "ConcurrencySpec::default_lease_ttl")]
    pub lease_ttl: DurationMs,
    /// Slots only `high` priority requests may take (a priority lane).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub reserved_for_high: u32,
}

impl ConcurrencySpec {
    pub const DEFAULT_LEASE_TTL: DurationMs = DurationMs::from_secs(300);

    fn default_lease_ttl() -> DurationMs {
        Self::DEFAULT_LEASE_TTL
    }
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// What a request over the limit gets.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct OnLimit {
    #[serde(default)]
    pub action: LimitAction,
    /// Status of the local reply (also after a queue wait runs out).
    #[serde(default = "OnLimit::default_status")]
    pub status: u16,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<String>,
    /// `queue` only: the longest a request waits for its turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_wait: Option<DurationMs>,
    /// `queue` only: the most requests waiting at once, per Envoy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_queue: Option<u32>,
}

impl OnLimit {
    pub const DEFAULT_STATUS: u16 = 429;
    pub const DEFAULT_MAX_QUEUE: u32 = 1000;

    fn default_status() -> u16 {
        Self::DEFAULT_STATUS
    }

    pub fn queue_max(&self) -> u32 {
        self.max_queue.unwrap_or(Self::DEFAULT_MAX_QUEUE)
    }
}

impl Default for OnLimit {
    fn default() -> Self {
        Self {
            action: LimitAction::Reject,
            status: Self::DEFAULT_STATUS,
            body: None,
            max_wait: None,
            max_queue: None,
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum LimitAction {
    /// Answer at once with `status`, `Retry-After` and RateLimit headers.
    #[default]
    Reject,
    /// Hold the request until its turn, up to `max_wait`, then reject.
    Queue,
}

/// A request's priority: from a header whose value is `high` or `normal`
/// (case-insensitive); anything else, or no header, gives `default`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct PrioritySpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    #[serde(default)]
    pub default: Priority,
}

#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Priority {
    #[default]
    Normal,
    High,
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
