//! One policy, compiled: whether a request matches it, its bucket, key,
//! cost and priority, and its further limits' keys and costs.

use sluice_shared::fair::FairClaimant;
use sluice_shared::key_hash::KeySecret;
use sluice_shared::key_view::{name_key, KeyName};
use sluice_shared::limiter::{ConcurrencyLimit, RateLimiter};
use sluice_shared::policy::{KeyOverflow, KeySpec, Mode, NamedLimit, Policy, Priority, RateSpec};
use sluice_shared::request_headers::RequestHeaders;

use super::fair::CompiledFair;
use super::host::{HostMatcher, HostPattern};
use super::limit::{compile_limits, CompiledLimit, CompiledSlotLimit};
use super::request::{cost_header_of, cost_of, trim_ascii, BodyMatch, KeySecrets, KeySource};
use crate::body::BodyJson;
use crate::mcp::{McpMatcher, RpcCall};
use crate::pool::{Member, MemberPolicy, Pool};
use crate::pricing::{CallPrice, Pricing};

mod money;

/// A pool whose members are each called as a compiled policy.
pub type CompiledPool = Pool<CompiledPolicy>;
/// One member of a [`CompiledPool`].
pub type CompiledMember = Member<CompiledPolicy>;

impl MemberPolicy for CompiledPolicy {
    fn limits(&self) -> &[CompiledLimit] {
        &self.limits
    }

    fn slot_limits(&self) -> &[CompiledSlotLimit] {
        &self.slot_limits
    }
}

/// Which bucket of a policy a request uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BucketKey {
    /// The policy has no `key`: one bucket.
    Policy,
    /// A hash of the key header's value (requests without the header hash
    /// the empty value and so share one bucket). Raw keys (API keys) never
    /// reach shared data or logs.
    Keyed(u64),
}

/// A validated policy, prepared for matching and limiting.
#[derive(Debug, Clone)]
pub struct CompiledPolicy {
    pub policy: Policy,
    /// The policy's name, for what keeps it per request without a copy.
    shared_name: std::sync::Arc<str>,
    pub(crate) host: HostMatcher,
    methods: Vec<String>,
    headers: Vec<(String, Vec<u8>)>,
    /// Conditions on the request's JSON body (`match.json`).
    body_matches: Vec<BodyMatch>,
    /// The JSON-RPC messages counted (`match.mcp`).
    mcp: Option<McpMatcher>,
    /// `match.json` or `match.mcp` is given: the match reads the body.
    match_reads_body: bool,
    key: Option<KeySource>,
    cost_header: Option<String>,
    priority_header: Option<String>,
    pub rate: Option<RateLimiter>,
    pub concurrency: Option<ConcurrencyLimit>,
    /// The policy's further rate limits, in order.
    pub limits: Vec<CompiledLimit>,
    /// The policy's further concurrency limits, in order: taken after the
    /// rate limits, all or nothing with them.
    pub slot_limits: Vec<CompiledSlotLimit>,
    /// A global policy whose share allows nothing now: every request is
    /// refused without touching a bucket.
    pub fleet_closed: bool,
    /// The set's prices and where its calls name their model, when a
    /// further limit's cost is money.
    pub(crate) pricing: Option<Pricing>,
    /// The policy's key or a further limit's is read from the body.
    keys_from_body: bool,
    /// `fair`: who shares the rate and the slots, with what weights.
    pub fair: Option<CompiledFair>,
    /// `pool`: the members a call may go to, each with its limits.
    pub pool: Option<Box<CompiledPool>>,
    /// For a pool member's policy: the pool's policy's index in the set,
    /// and the member's in its pool.
    pub member_of: Option<(usize, usize)>,
    /// See [`CompiledPolicy::reads_request_body`]: found once, as every
    /// call that matches asks.
    reads_body: bool,
}

impl CompiledPolicy {
    pub fn new(policy: Policy) -> Self {
        let lower = |s: &str| s.to_ascii_lowercase();
        let mut compiled = Self {
            host: HostMatcher::new(&policy.matcher.host),
            methods: policy
                .matcher
                .methods
                .iter()
                .map(|m| m.to_ascii_uppercase())
                .collect(),
            headers: policy
                .matcher
                .headers
                .iter()
                .map(|h| (lower(&h.name), h.equals.as_bytes().to_vec()))
                .collect(),
            body_matches: policy
                .matcher
                .json
                .iter()
                .filter_map(BodyMatch::new)
                .collect(),
            mcp: policy.matcher.mcp.as_ref().map(McpMatcher::new),
            match_reads_body: policy.matcher.reads_request_body(),
            key: policy.key.as_ref().and_then(KeySource::new),
            cost_header: cost_header_of(&policy.cost),
            limits: compile_limits(&policy.limits),
            slot_limits: policy
                .limits
                .iter()
                .filter_map(|l| l.concurrency.as_ref().map(|c| CompiledSlotLimit::new(l, c)))
                .collect(),
            priority_header: policy
                .priority
                .as_ref()
                .and_then(|p| p.header.as_deref())
                .map(lower),
            rate: policy.rate.as_ref().map(RateLimiter::from_spec),
            concurrency: policy.concurrency.as_ref().map(ConcurrencyLimit::from_spec),
            fleet_closed: false,
            pricing: None,
            keys_from_body: policy
                .key
                .iter()
                .chain(policy.limits.iter().filter_map(|l| l.key.as_ref()))
                .chain(policy.fair.as_ref().map(|f| &f.key))
                .chain(
                    policy
                        .limits
                        .iter()
                        .filter_map(|l| l.fair.as_ref().map(|f| &f.key)),
                )
                .any(KeySpec::reads_request_body),
            fair: policy.fair.as_ref().and_then(|f| {
                CompiledFair::new(f, policy.rate.as_ref(), policy.concurrency.as_ref())
            }),
            pool: policy
                .pool
                .as_ref()
                .map(|spec| Box::new(CompiledPool::new(&policy, spec, CompiledPolicy::new))),
            member_of: None,
            reads_body: false,
            shared_name: policy.name.as_str().into(),
            policy,
        };
        compiled.reads_body = compiled.finds_body_read();
        compiled
    }

    pub fn name(&self) -> &str {
        &self.policy.name
    }

    /// The name, shared (a reference count, not a copy).
    pub fn shared_name(&self) -> std::sync::Arc<str> {
        std::sync::Arc::clone(&self.shared_name)
    }

    pub fn is_global(&self) -> bool {
        self.policy.scope == sluice_shared::policy::Scope::Global
    }

    /// Applies this instance's share of a global policy's limits; a fair
    /// table then shares that share.
    pub fn apply_share(&mut self, share: sluice_shared::fleet::Amount) {
        let limits = sluice_shared::fleet::limits_for_share(&self.policy, share);
        self.rate = limits.rate;
        self.concurrency = limits.concurrency;
        self.fleet_closed = limits.closed;
        let burst = self.share_burst();
        if let (Some(fair), Some(burst)) = (&mut self.fair, burst) {
            fair.share(share.rate, burst);
        }
    }

    /// Applies this instance's share of further limit `index` (a global
    /// one) to its rate.
    pub fn apply_limit_share(&mut self, index: usize, share: sluice_shared::fleet::Amount) {
        let Some((spec, rate_spec)) = self.rate_limit_specs().nth(index) else {
            return;
        };
        let full = sluice_shared::fleet::Amount::of_limit(spec);
        let (rate, closed) = sluice_shared::fleet::rate_for_share(rate_spec, full.rate, share.rate);
        let Some(limit) = self.limits.get_mut(index) else {
            return;
        };
        limit.rate = rate;
        limit.closed = closed;
        // Shared fairly: its table divides this Envoy's share.
        if let (Some(fair), sluice_shared::limiter::RateLimiter::TokenBucket(tb)) =
            (&mut limit.fair, &limit.rate)
        {
            fair.share(share.rate, tb.burst());
        }
    }

    /// The further rate limits as written, with their rates: in the order
    /// of [`Self::limits`].
    pub fn rate_limit_specs(&self) -> impl Iterator<Item = (&NamedLimit, &RateSpec)> {
        self.policy
            .limits
            .iter()
            .filter_map(|l| l.rate.as_ref().map(|rate| (l, rate)))
    }

    /// The burst of this Envoy's share, for a global policy with a rate
    /// (None otherwise).
    pub fn share_burst(&self) -> Option<u64> {
        match (&self.rate, self.is_global()) {
            (Some(sluice_shared::limiter::RateLimiter::TokenBucket(tb)), true) => Some(tb.burst()),
            _ => None,
        }
    }

    pub fn is_shadow(&self) -> bool {
        self.policy.mode == Mode::Shadow
    }

    /// Whether its refused calls wait in its queue: queue mode, and not in
    /// shadow mode (which judges as `reject` would).
    pub fn queues(&self) -> bool {
        self.policy.on_limit.action == sluice_shared::policy::LimitAction::Queue
            && !self.is_shadow()
    }

    pub fn key_overflow(&self) -> Option<KeyOverflow> {
        self.policy.key.as_ref().map(|k| k.overflow)
    }

    pub fn max_keys(&self) -> Option<u32> {
        self.policy.key.as_ref().map(|k| k.max_keys)
    }

    /// The request's key as the live view names it (None for a policy
    /// without `key`), labels hashed with `secret` (see
    /// [`sluice_shared::key_view`]).
    pub fn key_name<R: RequestHeaders + ?Sized>(
        &self,
        req: &R,
        secret: &KeySecret,
        body: &BodyJson,
    ) -> Option<KeyName> {
        let key = self.key.as_ref()?;
        let mode = self
            .policy
            .key
            .as_ref()
            .map(|k| k.label)
            .unwrap_or_default();
        let value = key.value(req, body);
        Some(name_key(
            secret,
            self.name(),
            value.as_deref().unwrap_or_default(),
            mode,
        ))
    }

    /// Whether the request's headers match (its body is for
    /// [`Self::matches_body`]).
    pub fn matches<R: RequestHeaders + ?Sized>(&self, req: &R) -> bool {
        let authority = req.header(":authority").or_else(|| req.header("host"));
        match authority {
            Some(a) if self.host.matches(&a) => {}
            None if self.host.pattern == HostPattern::Any && self.host.port.is_none() => {}
            _ => return false,
        }
        if let Some(prefix) = &self.policy.matcher.path_prefix {
            match req.header(":path") {
                Some(path) if path.starts_with(prefix.as_bytes()) => {}
                _ => return false,
            }
        }
        if !self.methods.is_empty() {
            match req.header(":method") {
                Some(m)
                    if self
                        .methods
                        .iter()
                        .any(|want| m.eq_ignore_ascii_case(want.as_bytes())) => {}
                _ => return false,
            }
        }
        self.headers.iter().all(|(name, want)| {
            req.header(name)
                .is_some_and(|v| v.as_ref() == want.as_slice())
        })
    }

    /// Whether the match's conditions on the body hold (true for a policy
    /// without any); None when they cannot be told: the body is not JSON,
    /// too large, absent, or lacks a field they name.
    #[inline]
    pub fn matches_body(&self, body: &BodyJson) -> Option<bool> {
        if !self.match_reads_body {
            return Some(true);
        }
        self.matches_read_body(body)
    }

    fn matches_read_body(&self, body: &BodyJson) -> Option<bool> {
        let json = body.json()?;
        if self.mcp.as_ref().is_some_and(|m| m.counted(json) == 0) {
            return Some(false);
        }
        for condition in &self.body_matches {
            if !condition.holds(json)? {
                return Some(false);
            }
        }
        Some(true)
    }

    /// The request's bucket; a key is hashed with `secret` (see
    /// [`sluice_shared::key_hash`]). A key the body lacks is the empty
    /// value's: those calls share one bucket.
    pub fn bucket_key<R: RequestHeaders + ?Sized>(
        &self,
        req: &R,
        secret: &KeySecret,
        body: &BodyJson,
    ) -> BucketKey {
        match &self.key {
            None => BucketKey::Policy,
            Some(key) => {
                let value = key.value(req, body);
                BucketKey::Keyed(secret.hash(self.name(), value.as_deref().unwrap_or_default()))
            }
        }
    }

    /// Whether the policy's key or a further limit's is a field of the
    /// request's body.
    pub fn keys_from_body(&self) -> bool {
        self.keys_from_body
    }

    /// Whether the policy's key is a body field this body lacks.
    pub fn key_unread(&self, body: &BodyJson) -> bool {
        self.key.as_ref().is_some_and(|k| k.unread(body))
    }

    /// The further limits whose key is a body field this body lacks.
    pub fn limits_key_unread<'a>(
        &'a self,
        body: &'a BodyJson,
    ) -> impl Iterator<Item = &'a CompiledLimit> + 'a {
        self.limits.iter().filter(move |l| l.key_unread(body))
    }

    /// Per further limit, the hash of the request's key for it (None for a
    /// limit without `key`). Keys are hashed as the policy's own are, under
    /// the limit's name; those of a limit of an hour or longer with
    /// `spending` when given (the live view's label secret, the same on
    /// every Envoy and after a restart), so that its keys' spend adds up
    /// over the fleet.
    pub fn limit_keys<R: RequestHeaders + ?Sized>(
        &self,
        req: &R,
        secrets: KeySecrets<'_>,
        body: &BodyJson,
    ) -> Vec<Option<u64>> {
        if self.limits.is_empty() {
            return Vec::new();
        }
        self.limits
            .iter()
            .map(|l| l.key_hash(req, secrets, body))
            .collect()
    }

    /// Who the request is in each further limit shared fairly, the rate
    /// limits then the concurrency limits (`slot_limits`), in order (None
    /// for a limit without `fair`; empty when none is): its key hashed
    /// under the limit's name with `secret`, as [`Self::classify`] hashes
    /// a policy's.
    pub fn limit_claimants<R: RequestHeaders + ?Sized>(
        &self,
        req: &R,
        secret: &KeySecret,
        body: &BodyJson,
    ) -> Vec<Option<FairClaimant>> {
        let rates = self.limits.iter().map(|l| (&l.name, &l.fair));
        let slots = self.slot_limits.iter().map(|l| (&l.name, &l.fair));
        if rates.clone().chain(slots.clone()).all(|(_, f)| f.is_none()) {
            return Vec::new();
        }
        rates
            .chain(slots)
            .map(|(name, fair)| fair.as_ref().map(|f| f.claimant(name, req, secret, body)))
            .collect()
    }

    /// The request's key for its further limit `index` as the live view
    /// names it (None: no such limit, or it has no `key`); with the secret
    /// [`Self::limit_keys`] hashed it with, its hash is that one.
    pub fn limit_key_name<R: RequestHeaders + ?Sized>(
        &self,
        index: usize,
        req: &R,
        secret: &KeySecret,
        body: &BodyJson,
    ) -> Option<KeyName> {
        self.limits.get(index)?.key_name(req, secret, body)
    }

    /// Tokens this request takes: a header value that is not a whole number
    /// gives the default, one above `max` counts as `max`, 0 counts as 1;
    /// each MCP message counted takes as much (a batch: all of them).
    pub fn cost<R: RequestHeaders + ?Sized>(&self, req: &R, body: &BodyJson) -> u64 {
        cost_of(&self.policy.cost, self.cost_header.as_deref(), req)
            .saturating_mul(self.messages(body))
    }

    /// The calls one request makes: the MCP messages counted in its body,
    /// at least one.
    #[inline]
    pub fn messages(&self, body: &BodyJson) -> u64 {
        match &self.mcp {
            None => 1,
            Some(mcp) => body.json().map_or(1, |json| mcp.counted(json).max(1)),
        }
    }

    /// Whether the policy counts MCP messages (`match.mcp`).
    pub fn counts_mcp(&self) -> bool {
        self.mcp.is_some()
    }

    /// Whom a refusal of this call answers, when the policy counts MCP
    /// messages and the body is JSON-RPC.
    pub fn rpc_call(&self, body: &BodyJson) -> Option<RpcCall> {
        self.mcp.as_ref()?.call(body.json()?)
    }

    /// Every request header deciding a call of this policy may read
    /// besides its match (its key, costs and priority, and its further
    /// limits' keys and costs). Proxy-wasm hosts answer header reads only
    /// while the headers pass: a policy that decides on the body reads
    /// these first, so that what the decision needs is at hand then.
    pub fn decision_headers(&self) -> impl Iterator<Item = &str> {
        fn key_header(key: &Option<KeySource>) -> Option<&str> {
            key.as_ref().and_then(KeySource::header)
        }
        [
            key_header(&self.key),
            self.cost_header.as_deref(),
            self.priority_header.as_deref(),
            self.fair.as_ref().and_then(|f| f.key.header()),
        ]
        .into_iter()
        .chain(self.limits.iter().flat_map(CompiledLimit::decision_headers))
        .chain(
            self.slot_limits
                .iter()
                .map(|l| l.fair.as_ref().and_then(|f| f.key.header())),
        )
        .flatten()
    }

    /// Whether the call is decided only once its body is in: the match,
    /// a key or a further limit's cost reads it (a money limit: the model
    /// and the estimate), or a streamed request is to be asked for its
    /// usage.
    /// A pool decides once the body is in when its sticky key or any
    /// member's limits read it: its route header is written before the
    /// held headers go on, so Envoy routes by the member chosen then.
    pub fn reads_request_body(&self) -> bool {
        self.reads_body
    }

    fn finds_body_read(&self) -> bool {
        !self.body_matches.is_empty()
            || self.mcp.is_some()
            || self.keys_from_body
            || self.limits.iter().any(CompiledLimit::cost_reads_body)
            || self.asks_stream_usage()
            || self.pool.as_ref().is_some_and(|pool| {
                pool.sticky_reads_body()
                    || pool.members.iter().any(|m| m.policy.reads_request_body())
            })
    }

    /// Whether a streamed request that does not ask for its usage is
    /// made to ask (`usage.ask_stream_usage` on a further limit, its pool
    /// members' too).
    pub fn asks_stream_usage(&self) -> bool {
        self.limits_and_members()
            .any(|l| l.usage.as_ref().is_some_and(|u| u.ask_stream_usage))
    }

    /// Whether the body it reads may go upstream changed (asked for its usage, or `downgrade`).
    pub fn may_rewrite_body(&self) -> bool {
        self.asks_stream_usage() || self.limits_and_members().any(|l| l.downgrade.is_some())
    }

    /// The policy whose further limit is named `name`: this one, or for
    /// a pool the member's (the pool's policy with the member's limits),
    /// which refuses and prices its calls.
    pub fn holder_of(&self, name: &str) -> Option<&CompiledPolicy> {
        if self.limits.iter().any(|l| l.name == name) {
            return Some(self);
        }
        self.pool
            .as_ref()?
            .members
            .iter()
            .map(|m| &m.policy)
            .find(|p| p.limits.iter().any(|l| l.name == name))
    }

    /// Its further limits, then its pool members' (which repeat its own).
    fn limits_and_members(&self) -> impl Iterator<Item = &CompiledLimit> {
        let members = self
            .pool
            .iter()
            .flat_map(|pool| pool.members.iter())
            .flat_map(|m| m.policy.limits.iter());
        self.limits.iter().chain(members)
    }

    /// Whether a further limit's real cost is read from the response.
    pub fn reads_usage(&self) -> bool {
        self.limits.iter().any(|l| l.usage.is_some())
    }

    /// What this request takes from each of the policy's further limits;
    /// `body` is the request's body as far as it was read.
    /// `price`: the call's, as [`Self::call_price`] found it.
    #[inline]
    pub fn limit_costs<R: RequestHeaders + ?Sized>(
        &self,
        req: &R,
        body: &BodyJson,
        price: Option<&CallPrice>,
    ) -> Vec<u64> {
        if self.limits.is_empty() {
            return Vec::new();
        }
        self.further_costs(req, body, price)
    }

    fn further_costs<R: RequestHeaders + ?Sized>(
        &self,
        req: &R,
        body: &BodyJson,
        price: Option<&CallPrice>,
    ) -> Vec<u64> {
        let messages = self.messages(body);
        self.limits
            .iter()
            .map(|l| l.call_cost(req, body, price, messages))
            .collect()
    }

    pub fn priority<R: RequestHeaders + ?Sized>(&self, req: &R) -> Priority {
        let Some(spec) = &self.policy.priority else {
            return Priority::Normal;
        };
        let value = self.priority_header.as_deref().and_then(|h| req.header(h));
        match value.as_deref().map(trim_ascii) {
            Some(v) if v.eq_ignore_ascii_case(b"high") => Priority::High,
            Some(v) if v.eq_ignore_ascii_case(b"normal") || v.eq_ignore_ascii_case(b"low") => {
                Priority::Normal
            }
            _ => spec.default,
        }
    }
}
