//! Deciding which policy a request falls under, which bucket it uses, what
//! it costs and how urgent it is. Works on raw header bytes: a request may
//! carry anything, and none of it may cause a panic.

use sluice_shared::fair::{self, FairClaimant, FairSlotTerms, FairTerms};
use sluice_shared::key_hash::KeySecret;
use sluice_shared::key_view::{name_key, KeyName};
use sluice_shared::limiter::{ConcurrencyLimit, RateLimiter};
use sluice_shared::policy::{
    ConcurrencySpec, CostSpec, FairSpec, JsonMatch, KeyLabel, KeyOverflow, KeySpec, Mode,
    NamedLimit, Policy, PolicySet, Priority, RateSpec, Unreadable, UsageSpec,
};
use sluice_shared::price::CompiledPrices;
use sluice_shared::prompt::PromptTokens;

pub use crate::body::BodyJson;
use crate::pricing::{CallPrice, CompiledPriceCost, Pricing};
use sluice_shared::json_path::JsonPath;
use sluice_shared::request_headers::RequestHeaders;
use sluice_shared::usage::CompiledUsage;
use sluice_shared::validate::{parse_policy_set, ValidationErrors};
use sluice_shared::warn::WarnLines;
use std::borrow::Cow;
use std::collections::HashMap;

#[derive(Debug, Clone, PartialEq, Eq)]
enum HostPattern {
    Any,
    Exact(String),
    /// `*.example.com` stored as `.example.com`.
    Suffix(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct HostMatcher {
    pattern: HostPattern,
    /// When the pattern names a port, the request's port must equal it.
    port: Option<String>,
}

impl HostMatcher {
    fn new(host: &str) -> Self {
        if host == "*" {
            return Self {
                pattern: HostPattern::Any,
                port: None,
            };
        }
        let (name, port) = split_port(host.as_bytes());
        let name = String::from_utf8_lossy(name).to_ascii_lowercase();
        let port = port.map(|p| String::from_utf8_lossy(p).into_owned());
        let pattern = match name.strip_prefix('*') {
            Some(suffix) => HostPattern::Suffix(suffix.to_string()),
            None => HostPattern::Exact(name),
        };
        Self { pattern, port }
    }

    /// Whether `authority` is this host. A pattern naming a port matches
    /// that port, or no port at all: an Envoy that strips ports before
    /// filters run (`strip_any_host_port`) hides it, and a limit that
    /// stopped applying then would fail open. It matches by the name
    /// alone then (see [`Self::port_hidden`]).
    fn matches(&self, authority: &[u8]) -> bool {
        // Most authorities come exactly as configured.
        if let (HostPattern::Exact(host), None) = (&self.pattern, &self.port) {
            if authority == host.as_bytes() {
                return true;
            }
        }
        let (name, port) = split_port(authority);
        let name = name.strip_suffix(b".").unwrap_or(name);
        if let (Some(want), Some(port)) = (&self.port, port) {
            if port != want.as_bytes() {
                return false;
            }
        }
        match &self.pattern {
            HostPattern::Any => true,
            HostPattern::Exact(host) => name.eq_ignore_ascii_case(host.as_bytes()),
            HostPattern::Suffix(suffix) => {
                name.len() > suffix.len()
                    && name[name.len() - suffix.len()..].eq_ignore_ascii_case(suffix.as_bytes())
            }
        }
    }
}

impl HostMatcher {
    /// The pattern names a port the request's authority does not carry:
    /// matched by the name alone.
    fn port_hidden(&self, authority: Option<&[u8]>) -> bool {
        self.port.is_some() && authority.is_some_and(|a| split_port(a).1.is_none())
    }
}

/// Splits `host:port` / `[v6]:port`; a trailing part that is not all digits
/// is not a port.
fn split_port(authority: &[u8]) -> (&[u8], Option<&[u8]>) {
    if authority.first() == Some(&b'[') {
        if let Some(close) = authority.iter().position(|&b| b == b']') {
            let rest = &authority[close + 1..];
            return match rest.strip_prefix(b":") {
                Some(port) if !port.is_empty() => (&authority[..=close], Some(port)),
                _ => (&authority[..=close], None),
            };
        }
        return (authority, None);
    }
    match authority.iter().rposition(|&b| b == b':') {
        Some(i) if i + 1 < authority.len() && authority[i + 1..].iter().all(u8::is_ascii_digit) => {
            (&authority[..i], Some(&authority[i + 1..]))
        }
        _ => (authority, None),
    }
}

/// A validated policy, prepared for matching and limiting.
#[derive(Debug, Clone)]
pub struct CompiledPolicy {
    pub policy: Policy,
    /// The policy's name, for what keeps it per request without a copy.
    shared_name: std::sync::Arc<str>,
    host: HostMatcher,
    methods: Vec<String>,
    headers: Vec<(String, Vec<u8>)>,
    /// Conditions on the request's JSON body (`match.json`).
    body_matches: Vec<BodyMatch>,
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
    pricing: Option<Pricing>,
    /// The policy's key or a further limit's is read from the body.
    keys_from_body: bool,
    /// `fair`: who shares the rate and the slots, with what weights.
    pub fair: Option<CompiledFair>,
    /// `pool`: the members a call may go to, each with its limits.
    pub pool: Option<Box<crate::pool::CompiledPool>>,
    /// For a pool member's policy: the pool's policy's index in the set,
    /// and the member's in its pool.
    pub member_of: Option<(usize, usize)>,
}

/// A `fair`, ready to tell who asks: the key's hash, weight and
/// reservation, and the terms its tables share the rate and the slots on.
#[derive(Debug, Clone)]
pub struct CompiledFair {
    key: KeySource,
    weights: HashMap<Vec<u8>, u64>,
    default_weight: u64,
    /// Reservations in the rate table's units a second, or in slots when
    /// only slots are shared (validation allows them in one unit only).
    reserved: HashMap<Vec<u8>, u64>,
    /// The rate's table (None: no rate is shared).
    pub terms: Option<FairTerms>,
    /// The slots' table (None: no concurrency is shared).
    pub slots: Option<FairSlotTerms>,
}

impl CompiledFair {
    fn new(
        spec: &FairSpec,
        rate: Option<&RateSpec>,
        slots: Option<&ConcurrencySpec>,
    ) -> Option<Self> {
        let thousandths = |w: f64| (w * fair::WEIGHT_SCALE as f64).round().max(1.0) as u64;
        let period_ms = u128::from(rate.map_or(1000, |r| r.period.as_millis()).max(1));
        let per_second = |n: u64| {
            let units = u128::from(n) * u128::from(fair::UNIT) * 1000 / period_ms;
            u64::try_from(units).unwrap_or(u64::MAX)
        };
        let max_keys = usize::try_from(spec.key.max_keys).unwrap_or(usize::MAX);
        Some(Self {
            key: KeySource::new(&spec.key)?,
            weights: spec
                .weights
                .iter()
                .map(|(k, w)| (k.as_bytes().to_vec(), thousandths(*w)))
                .collect(),
            default_weight: thousandths(spec.default_weight),
            reserved: spec
                .min
                .iter()
                .map(|(k, n)| {
                    let units = if rate.is_some() { per_second(*n) } else { *n };
                    (k.as_bytes().to_vec(), units)
                })
                .collect(),
            terms: rate.map(|rate| FairTerms {
                capacity: per_second(rate.requests),
                burst: rate.effective_burst().saturating_mul(fair::UNIT),
                max_keys,
            }),
            slots: slots.map(|slots| FairSlotTerms {
                capacity: slots.max_in_flight.saturating_sub(slots.reserved_for_high),
                lease_ttl: slots.lease_ttl.as_span(),
                max_keys,
            }),
        })
    }

    /// With reservations, the rate its keys share: a fair queue then places
    /// calls by their keys' shares (`bucket::FairCall`).
    pub fn reserving(&self) -> Option<u64> {
        let terms = self.terms.as_ref()?;
        (!self.reserved.is_empty()).then_some(terms.capacity)
    }

    /// Shares this Envoy's share of a global limit instead: `rate` a second
    /// and `burst` tokens.
    fn share(&mut self, rate: f64, burst: u64) {
        let Some(terms) = &mut self.terms else {
            return;
        };
        let units = (rate.max(0.0) * fair::UNIT as f64).floor();
        // An f64 past u64 saturates in `as`.
        terms.capacity = units as u64;
        terms.burst = burst.saturating_mul(fair::UNIT);
    }

    /// Who a request is: its key's hash (as a policy key is hashed), weight
    /// and reservation (absent key: the empty value).
    fn claimant<R: RequestHeaders + ?Sized>(
        &self,
        policy: &str,
        req: &R,
        secret: &KeySecret,
        body: &BodyJson,
    ) -> FairClaimant {
        let value = self.key.value(req, body);
        let value = value.as_deref().unwrap_or_default();
        FairClaimant {
            key: secret.hash(policy, value),
            weight: self
                .weights
                .get(value)
                .copied()
                .unwrap_or(self.default_weight),
            reserved: self.reserved.get(value).copied().unwrap_or(0),
        }
    }
}

/// One of a policy's further limits, ready to count.
#[derive(Debug, Clone)]
pub struct CompiledLimit {
    pub name: String,
    pub rate: RateLimiter,
    cost: CostSpec,
    cost_header: Option<String>,
    /// Where in the request's JSON body the estimate is read.
    cost_json: Option<JsonPath>,
    /// What the request's prompt adds to that estimate.
    cost_prompt: Option<PromptTokens>,
    /// A cost in money at the set's prices.
    price: Option<CompiledPriceCost>,
    /// Its warning lines (`warn_at`).
    pub warn: WarnLines,
    /// Callers are told its figures (`tell_spend`).
    pub tells_spend: bool,
    /// The limit's own `usage` (a money limit's is priced per call).
    usage_spec: Option<UsageSpec>,
    /// Where the real cost is read from the response.
    pub usage: Option<CompiledUsage>,
    /// Held by the admin across restarts ([`sluice_shared::NamedLimit::is_budget`]).
    pub budget: bool,
    /// Held by the admin per key ([`sluice_shared::NamedLimit::is_keyed_budget`]).
    pub keyed_budget: bool,
    /// Its spend is shown in the live view
    /// ([`sluice_shared::NamedLimit::spends_over_hours`]).
    pub spends_over_hours: bool,
    /// One limit per value of a request header or body field.
    key: Option<KeySource>,
    /// How the live view names its keys.
    pub key_label: KeyLabel,
    /// With `key`: how many keys hold a place, and what the others do.
    pub keys: Option<(u32, KeyOverflow)>,
    /// `scope: global`: this Envoy applies its share (see
    /// [`CompiledPolicy::apply_limit_share`]); `closed` while the share
    /// allows nothing (before the first).
    pub global: bool,
    pub closed: bool,
    /// What it takes from the provider's answers (`provider`).
    pub provider: Option<sluice_shared::provider::CompiledProvider>,
    /// `fair`: who shares its rate, with what weights.
    pub fair: Option<CompiledFair>,
}

impl CompiledLimit {
    /// Whether its cost is money at the set's prices.
    pub fn is_priced(&self) -> bool {
        self.price.is_some()
    }
}

/// One of a policy's further concurrency limits, ready to count.
#[derive(Debug, Clone)]
pub struct CompiledSlotLimit {
    pub name: String,
    pub limit: ConcurrencyLimit,
    /// `fair`: who shares its slots, with what weights.
    pub fair: Option<CompiledFair>,
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

/// Everything the filter needs to know about a matched request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Classification {
    pub policy_index: usize,
    pub key: BucketKey,
    pub cost: u64,
    pub priority: Priority,
    /// The policy names a port the request did not carry (Envoy may have
    /// stripped it): matched by the host alone.
    pub port_hidden: bool,
    /// Who asks, when the policy's rate is shared fairly.
    pub fair: Option<FairClaimant>,
}

impl CompiledPolicy {
    pub fn new(policy: Policy) -> Self {
        let lower = |s: &str| s.to_ascii_lowercase();
        Self {
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
            key: policy.key.as_ref().and_then(KeySource::new),
            cost_header: cost_header_of(&policy.cost),
            limits: policy
                .limits
                .iter()
                .filter_map(|l| l.rate.as_ref().map(|rate| (l, rate)))
                .map(|(l, rate)| CompiledLimit {
                    name: l.name.clone(),
                    rate: RateLimiter::from_spec(rate),
                    cost: l.cost.clone(),
                    cost_header: cost_header_of(&l.cost),
                    cost_json: match &l.cost {
                        CostSpec::FromRequestJson(j) => JsonPath::parse(&j.json),
                        _ => None,
                    },
                    cost_prompt: match &l.cost {
                        CostSpec::FromRequestJson(j) => {
                            j.plus_prompt.as_ref().map(PromptTokens::new)
                        }
                        _ => None,
                    },
                    price: match &l.cost {
                        CostSpec::Price(spec) => Some(CompiledPriceCost::new(spec.cost())),
                        _ => None,
                    },
                    usage_spec: l.usage.clone(),
                    warn: WarnLines::new(&l.warn_at),
                    tells_spend: l.tell_spend,
                    // A money limit reads its usage at each call's prices
                    // ([`CompiledPolicy::priced_usage`]); this one says it
                    // reads one.
                    usage: match &l.cost {
                        CostSpec::Price(_) => Some(CompiledUsage::new(
                            l.usage.as_ref().unwrap_or(&UsageSpec::default()),
                            &l.cost,
                        )),
                        _ => l.usage.as_ref().map(|u| CompiledUsage::new(u, &l.cost)),
                    },
                    budget: l.is_budget(),
                    keyed_budget: l.is_keyed_budget(),
                    spends_over_hours: l.spends_over_hours(),
                    key: l.key.as_ref().and_then(KeySource::new),
                    key_label: l.key.as_ref().map(|k| k.label).unwrap_or_default(),
                    keys: l.key.as_ref().map(|k| (k.max_keys.max(1), k.overflow)),
                    global: l.scope == sluice_shared::policy::Scope::Global,
                    closed: false,
                    provider: l
                        .provider
                        .as_ref()
                        .map(|p| sluice_shared::provider::CompiledProvider::new(p, &l.name, rate)),
                    fair: l
                        .fair
                        .as_ref()
                        .and_then(|f| CompiledFair::new(f, Some(rate), None)),
                })
                .collect(),
            slot_limits: policy
                .limits
                .iter()
                .filter_map(|l| {
                    l.concurrency.as_ref().map(|c| CompiledSlotLimit {
                        name: l.name.clone(),
                        limit: ConcurrencyLimit::from_spec(c),
                        fair: l
                            .fair
                            .as_ref()
                            .and_then(|f| CompiledFair::new(f, None, Some(c))),
                    })
                })
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
                .map(|spec| Box::new(crate::pool::CompiledPool::new(&policy, spec))),
            member_of: None,
            shared_name: policy.name.as_str().into(),
            policy,
        }
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
    pub fn matches_body(&self, body: &BodyJson) -> Option<bool> {
        if self.body_matches.is_empty() {
            return Some(true);
        }
        let json = body.json()?;
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
        self.limits
            .iter()
            .filter(move |l| l.key.as_ref().is_some_and(|k| k.unread(body)))
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
        (secret, spending): (&KeySecret, Option<&KeySecret>),
        body: &BodyJson,
    ) -> Vec<Option<u64>> {
        if self.limits.is_empty() {
            return Vec::new();
        }
        self.limits
            .iter()
            .map(|l| {
                let value = l.key.as_ref()?.value(req, body);
                let secret = match spending {
                    Some(spending) if l.spends_over_hours => spending,
                    _ => secret,
                };
                Some(secret.hash(&l.name, value.as_deref().unwrap_or_default()))
            })
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
        let limit = self.limits.get(index)?;
        let value = limit.key.as_ref()?.value(req, body);
        Some(name_key(
            secret,
            &limit.name,
            value.as_deref().unwrap_or_default(),
            limit.key_label,
        ))
    }

    /// Tokens this request takes: a header value that is not a whole number
    /// gives the default, one above `max` counts as `max`, 0 counts as 1.
    pub fn cost<R: RequestHeaders + ?Sized>(&self, req: &R) -> u64 {
        cost_of(&self.policy.cost, self.cost_header.as_deref(), req)
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
        .chain(self.limits.iter().flat_map(move |l| {
            [
                key_header(&l.key),
                l.cost_header.as_deref(),
                l.fair.as_ref().and_then(|f| f.key.header()),
            ]
        }))
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
    pub fn reads_request_body(&self) -> bool {
        !self.body_matches.is_empty()
            || self.keys_from_body
            || self
                .limits
                .iter()
                .any(|l| l.cost_json.is_some() || l.price.is_some())
            || self.asks_stream_usage()
    }

    /// Whether a streamed request that does not ask for its usage is
    /// made to ask (`usage.ask_stream_usage` on a further limit).
    pub fn asks_stream_usage(&self) -> bool {
        self.limits
            .iter()
            .any(|l| l.usage.as_ref().is_some_and(|u| u.ask_stream_usage))
    }

    /// The currency of its money limits, when it has any.
    pub fn currency(&self) -> Option<&str> {
        self.pricing.as_ref().map(|p| p.prices.currency.as_str())
    }

    /// Its money limits, its pool members' with them (a pool call is
    /// priced before its member is chosen).
    fn money_limits(&self) -> impl Iterator<Item = &CompiledPriceCost> {
        let members = self
            .pool
            .iter()
            .flat_map(|pool| pool.members.iter())
            .flat_map(|m| m.policy.limits.iter());
        self.limits
            .iter()
            .chain(members)
            .filter_map(|l| l.price.as_ref())
    }

    /// The call's prices (its model's, by where the policy's money limits
    /// say it is named, and its unread ceiling), for its money limits;
    /// None when the policy has none, or the model has no price and the
    /// table no default.
    pub fn call_price<R: RequestHeaders + ?Sized>(
        &self,
        req: &R,
        body: &BodyJson,
    ) -> Option<CallPrice> {
        self.pricing
            .as_ref()?
            .call_price(req, body, self.money_limits())
    }

    /// What a call of `price` is charged by the limit at `index` once its
    /// answer is in: a money limit's usage at the call's model's prices
    /// (or its answer's, when dearer; None for an unpriced call, which was
    /// refused), any other limit's own.
    pub fn priced_usage(&self, index: usize, price: Option<&CallPrice>) -> Option<CompiledUsage> {
        let limit = self.limits.get(index)?;
        match (&limit.price, price, &self.pricing) {
            (Some(cost), Some(price), Some(pricing)) => {
                Some(pricing.usage(limit.usage_spec.as_ref(), &limit.cost, cost, price))
            }
            (Some(_), _, _) => None,
            (None, _, _) => limit.usage.clone(),
        }
    }

    /// Whether a further limit's real cost is read from the response.
    pub fn reads_usage(&self) -> bool {
        self.limits.iter().any(|l| l.usage.is_some())
    }

    /// What this request takes from each of the policy's further limits;
    /// `body` is the request's body as far as it was read.
    /// `price`: the call's, as [`Self::call_price`] found it.
    pub fn limit_costs<R: RequestHeaders + ?Sized>(
        &self,
        req: &R,
        body: &BodyJson,
        price: Option<&CallPrice>,
    ) -> Vec<u64> {
        if self.limits.is_empty() {
            return Vec::new();
        }
        self.limits
            .iter()
            .map(|l| match (&l.cost, &l.cost_json) {
                // A body that cannot be read could ask for anything: it is
                // estimated at the most the cost may be, never its default.
                (CostSpec::FromRequestJson(spec), Some(_)) if body.unreadable() => spec.max.max(1),
                (CostSpec::Price(_), _) => l
                    .price
                    .as_ref()
                    .map_or(UNPRICED, |p| p.estimate(body, price.map(|c| &c.model))),
                (CostSpec::FromRequestJson(spec), Some(path)) => {
                    let json = body.json();
                    let asked = json.and_then(|v| path.find(v));
                    let prompt = match (json, &l.cost_prompt) {
                        (Some(v), Some(prompt)) => prompt.tokens(v),
                        _ => 0,
                    };
                    asked
                        .map_or(spec.default, |n| n.saturating_add(spec.plus))
                        .saturating_add(prompt)
                        .clamp(1, spec.max.max(1))
                }
                _ => cost_of(&l.cost, l.cost_header.as_deref(), req),
            })
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

/// Tokens a request takes under `spec`: a header value that is not a
/// whole number gives the default, one above `max` counts as `max`, 0
/// counts as 1.
fn cost_of<R: RequestHeaders + ?Sized>(spec: &CostSpec, header: Option<&str>, req: &R) -> u64 {
    match spec {
        CostSpec::Fixed(n) => (*n).max(1),
        // Without the body (the policy's own cost, refused by validation).
        CostSpec::FromRequestJson(j) => j.default.clamp(1, j.max.max(1)),
        CostSpec::Price(_) => UNPRICED,
        CostSpec::FromHeader(spec) => {
            let parsed = header
                .and_then(|h| req.header(h))
                .and_then(|v| parse_whole_number(&v));
            parsed.unwrap_or(spec.default).clamp(1, spec.max.max(1))
        }
    }
}

fn cost_header_of(cost: &CostSpec) -> Option<String> {
    match cost {
        CostSpec::FromHeader(h) => Some(h.header.to_ascii_lowercase()),
        CostSpec::Fixed(_) | CostSpec::FromRequestJson(_) | CostSpec::Price(_) => None,
    }
}

pub use crate::pricing::UNPRICED;

fn trim_ascii(v: &[u8]) -> &[u8] {
    v.trim_ascii()
}

/// Digits only (surrounding spaces allowed); anything else, or a number past
/// u64, is None.
fn parse_whole_number(v: &[u8]) -> Option<u64> {
    let v = v.trim_ascii();
    if v.is_empty() || v.len() > 20 || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    v.iter().try_fold(0u64, |acc, d| {
        acc.checked_mul(10)?.checked_add(u64::from(d - b'0'))
    })
}

/// Where a key's value comes from: a request header or a field of the
/// request's JSON body.
#[derive(Debug, Clone)]
pub(crate) enum KeySource {
    /// Lower case, as Envoy gives header names.
    Header(String),
    Json(JsonPath),
}

impl KeySource {
    /// From a validated spec (None for one that names no source).
    pub(crate) fn new(spec: &KeySpec) -> Option<Self> {
        match (&spec.header, &spec.json) {
            (Some(header), _) => Some(Self::Header(header.to_ascii_lowercase())),
            (None, Some(path)) => JsonPath::parse(path).map(Self::Json),
            (None, None) => None,
        }
    }

    pub(crate) fn header(&self) -> Option<&str> {
        match self {
            Self::Header(h) => Some(h),
            Self::Json(_) => None,
        }
    }

    /// The key's value (None: absent; such calls share one bucket).
    pub(crate) fn value<'r, R: RequestHeaders + ?Sized>(
        &self,
        req: &'r R,
        body: &'r BodyJson,
    ) -> Option<Cow<'r, [u8]>> {
        match self {
            Self::Header(h) => req.header(h),
            Self::Json(path) => match path.text_in(body.json()?)? {
                Cow::Borrowed(s) => Some(Cow::Borrowed(s.as_bytes())),
                Cow::Owned(s) => Some(Cow::Owned(s.into_bytes())),
            },
        }
    }

    /// A body field the body lacks (a missing header is an ordinary key:
    /// the empty one).
    fn unread(&self, body: &BodyJson) -> bool {
        match self {
            Self::Header(_) => false,
            Self::Json(path) => body.json().and_then(|v| path.text_in(v)).is_none(),
        }
    }
}

/// One condition of `match.json`, ready to test.
#[derive(Debug, Clone)]
struct BodyMatch {
    path: JsonPath,
    test: BodyTest,
}

#[derive(Debug, Clone)]
enum BodyTest {
    Equals(String),
    Prefix(String),
    OneOf(Vec<String>),
}

impl BodyMatch {
    /// From a validated condition (exactly one test).
    fn new(spec: &JsonMatch) -> Option<Self> {
        let test = match (&spec.equals, &spec.prefix) {
            (Some(v), _) => BodyTest::Equals(v.clone()),
            (None, Some(p)) => BodyTest::Prefix(p.clone()),
            (None, None) => BodyTest::OneOf(spec.one_of.clone()),
        };
        Some(Self {
            path: JsonPath::parse(&spec.path)?,
            test,
        })
    }

    /// None: the body lacks the field (or holds no text there).
    fn holds(&self, json: &serde_json::Value) -> Option<bool> {
        let text = self.path.text_in(json)?;
        Some(match &self.test {
            BodyTest::Equals(want) => *text == **want,
            BodyTest::Prefix(prefix) => text.starts_with(prefix.as_str()),
            BodyTest::OneOf(values) => values.iter().any(|v| *v == *text),
        })
    }
}

/// What [`CompiledPolicySet::classify`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Classified {
    /// The first policy matching the headers, from index `from`, decides
    /// on the body, which is still coming: keep the headers policies from
    /// `from` on read ([`CompiledPolicySet::keep_headers_for_body`]), read
    /// the body, and classify again.
    NeedsBody { from: usize },
    /// The first policy matching the headers reads the body, which names
    /// `key` twice in one object: the call is refused (the provider could
    /// read it another way than Sluice did).
    DuplicateKey { policy_index: usize, key: String },
    Decided {
        /// The policy the request falls under (None: no policy).
        class: Option<Classification>,
        /// Policies passed over because their `match.json` could not be
        /// told from the body (not JSON, too large, a field missing).
        passed_over: Vec<usize>,
    },
}

impl Classified {
    /// The policy the request falls under, once decided.
    pub fn class(self) -> Option<Classification> {
        match self {
            Self::Decided { class, .. } => class,
            Self::NeedsBody { .. } | Self::DuplicateKey { .. } => None,
        }
    }
}

/// A validated policy set, ready to classify requests.
#[derive(Debug, Clone)]
pub struct CompiledPolicySet {
    pub version: u64,
    pub policies: Vec<CompiledPolicy>,
    /// Each pool member's policy, after `policies` in [`Self::policy`]'s
    /// numbering: (its pool's policy, the member).
    members: Vec<(usize, usize)>,
}

impl CompiledPolicySet {
    /// Parses, validates and compiles; nothing is built from an invalid set.
    pub fn from_json(json: &str) -> Result<Self, ValidationErrors> {
        parse_policy_set(json).map(Self::from_validated)
    }

    /// Compiles a set that passed validation.
    pub fn from_validated(set: PolicySet) -> Self {
        let prices = set
            .prices
            .as_ref()
            .map(|t| std::sync::Arc::new(CompiledPrices::new(t)));
        // A policy (or pool member) with a money limit prices its calls,
        // its model named where its money limits say (they agree).
        let priced = |compiled: &mut CompiledPolicy| {
            let source = compiled
                .money_limits()
                .next()
                .map(|l| l.spec().model.clone());
            if let (Some(prices), Some(source)) = (&prices, source) {
                compiled.pricing = Some(Pricing::new(std::sync::Arc::clone(prices), &source));
            }
        };
        let mut policies: Vec<CompiledPolicy> = set
            .policies
            .into_iter()
            .map(|p| {
                let mut compiled = CompiledPolicy::new(p);
                priced(&mut compiled);
                compiled
            })
            .collect();
        let mut members = Vec::new();
        let count = policies.len();
        for (index, policy) in policies.iter_mut().enumerate() {
            let Some(pool) = policy.pool.as_mut() else {
                continue;
            };
            for (at, member) in pool.members.iter_mut().enumerate() {
                priced(&mut member.policy);
                member.policy.member_of = Some((index, at));
                member.index = count + members.len();
                members.push((index, at));
            }
        }
        Self {
            version: set.version,
            policies,
            members,
        }
    }

    pub fn empty() -> Self {
        Self {
            version: 0,
            policies: Vec::new(),
            members: Vec::new(),
        }
    }

    /// The policy numbered `index`: one of `policies`, or after them a pool
    /// member's (the pool's policy with the member's limits).
    pub fn policy(&self, index: usize) -> Option<&CompiledPolicy> {
        if let Some(policy) = self.policies.get(index) {
            return Some(policy);
        }
        let (pool_index, at) = *self.members.get(index.checked_sub(self.policies.len())?)?;
        let pool = self.policies.get(pool_index)?.pool.as_ref()?;
        pool.members.get(at).map(|m| &m.policy)
    }

    /// [`Self::policy`], to change (a fleet share applied).
    pub fn policy_mut(&mut self, index: usize) -> Option<&mut CompiledPolicy> {
        if index < self.policies.len() {
            return self.policies.get_mut(index);
        }
        let (pool_index, at) = *self.members.get(index - self.policies.len())?;
        let pool = self.policies.get_mut(pool_index)?.pool.as_mut()?;
        pool.members.get_mut(at).map(|m| &mut m.policy)
    }

    /// Every policy a call may be decided as: `policies`, then each pool
    /// member's, numbered as [`Self::policy`] numbers them.
    pub fn all(&self) -> impl Iterator<Item = &CompiledPolicy> {
        self.policies.iter().chain(
            self.policies
                .iter()
                .filter_map(|p| p.pool.as_ref())
                .flat_map(|pool| pool.members.iter().map(|m| &m.policy)),
        )
    }

    /// The first policy that matches, in list order, and how the request
    /// falls under it: its key hashed with `secret`, and its `fair` key with
    /// `fair_secret` (the fleet's label secret when an admin is there, so
    /// that a key hashes alike on every Envoy and the live view can name
    /// it; else `secret`). A policy that decides on the body asks for it
    /// while it is [`BodyJson::Coming`].
    pub fn classify<R: RequestHeaders + ?Sized>(
        &self,
        req: &R,
        (secret, fair_secret): (&KeySecret, Option<&KeySecret>),
        body: &BodyJson,
    ) -> Classified {
        let mut passed_over = Vec::new();
        for (policy_index, policy) in self.policies.iter().enumerate() {
            if !policy.matches(req) {
                continue;
            }
            if policy.reads_request_body() {
                match body {
                    BodyJson::Coming => return Classified::NeedsBody { from: policy_index },
                    BodyJson::Duplicate(key) => {
                        return Classified::DuplicateKey {
                            policy_index,
                            key: key.clone(),
                        }
                    }
                    _ => {}
                }
            }
            match policy.matches_body(body) {
                Some(true) => {}
                Some(false) => continue,
                // A body it cannot read falls under it (fail closed): the
                // provider may read what Sluice could not.
                None if body.unreadable()
                    && policy.policy.matcher.unreadable == Unreadable::Match => {}
                None => {
                    passed_over.push(policy_index);
                    continue;
                }
            }
            let class = Classification {
                policy_index,
                key: policy.bucket_key(req, secret, body),
                cost: policy.cost(req),
                priority: policy.priority(req),
                port_hidden: policy.host.port.is_some()
                    && policy.host.port_hidden(req.header(":authority").as_deref()),
                fair: policy
                    .fair
                    .as_ref()
                    .map(|f| f.claimant(policy.name(), req, fair_secret.unwrap_or(secret), body)),
            };
            return Classified::Decided {
                class: Some(class),
                passed_over,
            };
        }
        Classified::Decided {
            class: None,
            passed_over,
        }
    }

    /// Reads, while the headers pass, every header classifying the request
    /// again once its body is in may read (policies from `from` on: their
    /// match, and for those whose headers match, what deciding reads).
    /// Proxy-wasm hosts answer header reads only while the headers pass;
    /// `req` keeps what was read.
    pub fn keep_headers_for_body<R: RequestHeaders + ?Sized>(&self, req: &R, from: usize) {
        for policy in self.policies.iter().skip(from) {
            if policy.matches(req) {
                let _ = req.header(":authority");
                for header in policy.decision_headers() {
                    let _ = req.header(header);
                }
                let Some(pool) = &policy.pool else {
                    continue;
                };
                if let Some(header) = pool.sticky_header() {
                    let _ = req.header(header);
                }
                for member in &pool.members {
                    for header in member.policy.decision_headers() {
                        let _ = req.header(header);
                    }
                }
            }
        }
    }

    /// Whether a request whose body is awaited for policies from `from` on
    /// may be made to ask for its stream's usage: its body may grow, so it
    /// must go upstream without the length it came with.
    pub fn may_ask_stream_usage<R: RequestHeaders + ?Sized>(&self, req: &R, from: usize) -> bool {
        self.policies
            .iter()
            .skip(from)
            .any(|p| p.asks_stream_usage() && p.matches(req))
    }

    /// The request headers this set's pools route by (lower case): a
    /// caller's own value of any of them must never reach Envoy's routes.
    pub fn route_headers(&self) -> impl Iterator<Item = &str> {
        self.policies
            .iter()
            .filter_map(|p| p.pool.as_ref())
            .map(|pool| pool.route_header.as_str())
    }

    pub fn find(&self, name: &str) -> Option<(usize, &CompiledPolicy)> {
        self.policies
            .iter()
            .enumerate()
            .find(|(_, p)| p.name() == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(json: &str) -> CompiledPolicySet {
        CompiledPolicySet::from_json(json).unwrap_or_else(|e| panic!("{e}"))
    }

    fn req<'a>(headers: &'a [(&'a str, &'a [u8])]) -> &'a [(&'a str, &'a [u8])] {
        headers
    }

    const SECRET: KeySecret = KeySecret::from_bytes([7; KeySecret::LEN]);

    const POLICIES: &str = r#"{"version": 1, "policies": [
        {"name": "bank-payments", "match": {"host": "api.bank.example", "path_prefix": "/v1/payments", "methods": ["post"]},
         "rate": {"requests": 10, "period": "1s"}},
        {"name": "bank", "match": {"host": "api.bank.example"}, "rate": {"requests": 100, "period": "1s"}},
        {"name": "llm", "match": {"host": "*.llm.example:443", "headers": [{"name": "X-Tier", "equals": "prod"}]},
         "key": {"header": "X-Api-Key"},
         "cost": {"header": "x-tokens", "default": 2, "max": 50},
         "rate": {"requests": 100, "period": "1s"},
         "concurrency": {"max_in_flight": 5, "reserved_for_high": 1},
         "priority": {"header": "x-priority"}},
        {"name": "rest", "match": {"host": "*"}, "concurrency": {"max_in_flight": 1000}}
    ]}"#;

    #[test]
    fn first_match_wins_in_list_order() {
        let s = set(POLICIES);
        let pick = |h: &[(&str, &[u8])]| {
            s.classify(h, (&SECRET, None), &BodyJson::Absent)
                .class()
                .map(|c| s.policies[c.policy_index].name().to_string())
        };
        assert_eq!(
            pick(req(&[
                (":authority", b"API.bank.example"),
                (":path", b"/v1/payments/9"),
                (":method", b"POST")
            ])),
            Some("bank-payments".into())
        );
        assert_eq!(
            pick(req(&[
                (":authority", b"api.bank.example:443"),
                (":path", b"/v1/payments"),
                (":method", b"GET")
            ])),
            Some("bank".into())
        );
        assert_eq!(
            pick(req(&[
                (":authority", b"eu.llm.example:443"),
                ("x-tier", b"prod")
            ])),
            Some("llm".into())
        );
        // Wrong port, bare suffix, or missing header: falls through to the catch-all.
        assert_eq!(
            pick(req(&[
                (":authority", b"eu.llm.example:80"),
                ("x-tier", b"prod")
            ])),
            Some("rest".into())
        );
        assert_eq!(
            pick(req(&[
                (":authority", b"llm.example:443"),
                ("x-tier", b"prod")
            ])),
            Some("rest".into())
        );
        assert_eq!(
            pick(req(&[(":authority", b"eu.llm.example:443")])),
            Some("rest".into())
        );
        assert_eq!(pick(req(&[])), Some("rest".into()));
    }

    /// A policy naming a port still holds when Envoy strips ports before
    /// filters run: a request without a port matches it by its host (fail
    /// closed), and says so; one with another port does not.
    #[test]
    fn a_policy_naming_a_port_matches_a_request_without_one() {
        let s = set(POLICIES);
        let classify = |authority: &'static [u8]| {
            s.classify(
                req(&[(":authority", authority), ("x-tier", b"prod")]),
                (&SECRET, None),
                &BodyJson::Absent,
            )
            .class()
            .map(|c| (s.policies[c.policy_index].name().to_string(), c.port_hidden))
        };
        assert_eq!(classify(b"eu.llm.example"), Some(("llm".into(), true)));
        assert_eq!(classify(b"eu.llm.example:443"), Some(("llm".into(), false)));
        assert_eq!(
            classify(b"eu.llm.example:8443"),
            Some(("rest".into(), false))
        );
        // A policy naming no port never says a port was hidden.
        let bank = s
            .classify(
                req(&[(":authority", b"api.bank.example")]),
                (&SECRET, None),
                &BodyJson::Absent,
            )
            .class();
        assert_eq!(bank.map(|c| c.port_hidden), Some(false));
        let m = HostMatcher::new("[::1]:8080");
        assert!(m.matches(b"[::1]"));
        assert!(m.port_hidden(Some(b"[::1]")));
    }

    #[test]
    fn unmatched_requests_get_no_policy() {
        let s = set(
            r#"{"version": 1, "policies": [{"name": "a", "match": {"host": "a.example"}, "rate": {"requests": 1, "period": "1s"}}]}"#,
        );
        assert_eq!(
            s.classify(
                req(&[(":authority", b"b.example")]),
                (&SECRET, None),
                &BodyJson::Absent
            )
            .class(),
            None
        );
        assert_eq!(
            s.classify(req(&[]), (&SECRET, None), &BodyJson::Absent)
                .class(),
            None
        );
        assert_eq!(
            s.classify(
                req(&[(":authority", &[0xff, 0xfe, b':'])]),
                (&SECRET, None),
                &BodyJson::Absent
            )
            .class(),
            None
        );
    }

    #[test]
    fn key_cost_and_priority_come_from_headers() {
        let s = set(POLICIES);
        let base: [(&str, &[u8]); 2] = [(":authority", b"eu.llm.example:443"), ("x-tier", b"prod")];
        let with = |extra: &[(&'static str, &'static [u8])]| {
            let mut h = base.to_vec();
            h.extend_from_slice(extra);
            s.classify(h.as_slice(), (&SECRET, None), &BodyJson::Absent)
                .class()
                .unwrap()
        };
        let a = with(&[("x-api-key", b"key-a")]);
        let b = with(&[("x-api-key", b"key-b")]);
        let none = with(&[]);
        assert_ne!(a.key, b.key);
        assert_ne!(a.key, none.key);
        assert_eq!(with(&[("x-api-key", b"key-a")]).key, a.key);
        assert_eq!(none.cost, 2);
        assert_eq!(with(&[("x-tokens", b" 7 ")]).cost, 7);
        assert_eq!(with(&[("x-tokens", b"9999")]).cost, 50);
        assert_eq!(with(&[("x-tokens", b"0")]).cost, 1);
        assert_eq!(with(&[("x-tokens", b"-3")]).cost, 2);
        assert_eq!(with(&[("x-tokens", b"99999999999999999999999")]).cost, 2);
        assert_eq!(with(&[("x-priority", b"HIGH")]).priority, Priority::High);
        assert_eq!(
            with(&[("x-priority", b"whatever")]).priority,
            Priority::Normal
        );
        assert_eq!(none.priority, Priority::Normal);
    }

    #[test]
    fn ipv6_and_odd_authorities() {
        let m = HostMatcher::new("[::1]:8080");
        assert!(m.matches(b"[::1]:8080"));
        assert!(!m.matches(b"[::1]:8081"));
        let m = HostMatcher::new("api.example");
        assert!(m.matches(b"api.example."));
        assert!(m.matches(b"api.example:99"));
        assert!(!m.matches(b"api.example:x"));
        assert!(!m.matches(b""));
        assert!(!m.matches(b"["));
    }

    const PER_MODEL: &str = r#"{"version": 1, "policies": [
        {"name": "gpt-4o", "match": {"host": "api.llm.example", "json": [{"path": "model", "equals": "gpt-4o"}]},
         "rate": {"requests": 10, "period": "1s"}},
        {"name": "small", "match": {"host": "api.llm.example", "json": [{"path": "model", "one_of": ["gpt-4o-mini", "haiku"]}]},
         "rate": {"requests": 10, "period": "1s"}},
        {"name": "claude", "match": {"host": "api.llm.example", "json": [{"path": "model", "prefix": "claude-"}]},
         "key": {"json": "metadata.user_id"},
         "limits": [{"name": "per-model", "key": {"json": "model"}, "rate": {"requests": 100, "period": "1m"}}],
         "rate": {"requests": 10, "period": "1s"}},
        {"name": "rest", "match": {"host": "*"}, "rate": {"requests": 10, "period": "1s"}}
    ]}"#;

    fn classify_body(s: &CompiledPolicySet, body: &BodyJson) -> Classified {
        s.classify(
            req(&[(":authority", b"api.llm.example")]),
            (&SECRET, None),
            body,
        )
    }

    fn json(text: &str) -> BodyJson {
        BodyJson::parse(text.as_bytes())
    }

    /// A policy matching on the body asks for it while it is coming; once
    /// read, the first policy whose body conditions hold takes the call;
    /// one whose conditions a readable body cannot tell (a field missing,
    /// not text) passes it on, named; a body that cannot be read at all
    /// falls under the first whose headers match.
    #[test]
    fn a_match_on_the_body_waits_for_it_and_decides_what_it_cannot_read() {
        let s = set(PER_MODEL);
        assert_eq!(
            classify_body(&s, &BodyJson::Coming),
            Classified::NeedsBody { from: 0 }
        );
        let pick = |body: &BodyJson| match classify_body(&s, body) {
            Classified::Decided { class, passed_over } => (
                class.map(|c| s.policies[c.policy_index].name().to_string()),
                passed_over,
            ),
            Classified::NeedsBody { .. } | Classified::DuplicateKey { .. } => {
                panic!("the body was read, without a key twice")
            }
        };
        let named = |n: &str| Some(n.to_string());
        assert_eq!(
            pick(&json(r#"{"model": "gpt-4o"}"#)),
            (named("gpt-4o"), vec![])
        );
        assert_eq!(
            pick(&json(r#"{"model": "haiku"}"#)),
            (named("small"), vec![])
        );
        assert_eq!(
            pick(&json(r#"{"model": "claude-sonnet-4"}"#)),
            (named("claude"), vec![])
        );
        assert_eq!(
            pick(&json(r#"{"model": "gpt-4o-2024"}"#)),
            (named("rest"), vec![])
        );
        // Not a string where the model should be: not told, passed on.
        assert_eq!(
            pick(&json(r#"{"model": {"name": "gpt-4o"}}"#)),
            (named("rest"), vec![0, 1, 2])
        );
        assert_eq!(
            pick(&json(r#"{"prompt": "hi"}"#)),
            (named("rest"), vec![0, 1, 2])
        );
        // A body that cannot be read falls under the first policy whose
        // headers match (fail closed: the provider may read it).
        assert_eq!(
            pick(&BodyJson::parse(b"model=gpt-4o")),
            (named("gpt-4o"), vec![])
        );
        assert_eq!(pick(&BodyJson::TooLarge), (named("gpt-4o"), vec![]));
        assert_eq!(pick(&BodyJson::Absent), (named("rest"), vec![0, 1, 2]));
        assert_eq!(
            classify_body(
                &s,
                &BodyJson::parse(br#"{"model": "a", "model": "gpt-4o"}"#)
            ),
            Classified::DuplicateKey {
                policy_index: 0,
                key: "model".into()
            }
        );
        // Numbers and booleans compare as their JSON text.
        let s = set(
            r#"{"version": 1, "policies": [{"name": "n", "match": {"host": "*", "json": [{"path": "n", "equals": "3"}, {"path": "b", "equals": "true"}]}, "rate": {"requests": 1, "period": "1s"}}]}"#,
        );
        let class = |b: &str| classify_body(&s, &json(b)).class().is_some();
        assert!(class(r#"{"n": 3, "b": true}"#));
        assert!(!class(r#"{"n": 3.5, "b": true}"#));
        // A string holding the same text is the same value.
        assert!(class(r#"{"n": "3", "b": true}"#));
        assert!(!class(r#"{"n": 3, "b": "false"}"#));
    }

    /// Keys from the body: one bucket per value, the calls lacking it in
    /// one shared bucket (told apart by `key_unread`), and a policy whose
    /// headers match never reads the body unless it decides on it.
    #[test]
    fn keys_from_the_body_split_calls_and_missing_ones_share_a_bucket() {
        let s = set(PER_MODEL);
        let claude = &s.policies[2];
        let key = |b: &BodyJson| {
            classify_body(&s, b)
                .class()
                .map(|c| (c.key, claude.limit_keys(req(&[]), (&SECRET, None), b)))
        };
        let alice = json(r#"{"model": "claude-opus-4", "metadata": {"user_id": "alice"}}"#);
        let bob = json(r#"{"model": "claude-haiku-4", "metadata": {"user_id": "bob"}}"#);
        let nobody = json(r#"{"model": "claude-haiku-4"}"#);
        let (alice_key, alice_limits) = key(&alice).unwrap_or_else(|| panic!("claude"));
        let (bob_key, bob_limits) = key(&bob).unwrap_or_else(|| panic!("claude"));
        let (nobody_key, nobody_limits) = key(&nobody).unwrap_or_else(|| panic!("claude"));
        assert_ne!(alice_key, bob_key);
        assert_ne!(alice_key, nobody_key);
        assert_ne!(alice_limits, bob_limits, "per model");
        assert_eq!(bob_limits, nobody_limits, "the same model");
        assert!(claude.keys_from_body());
        assert!(!claude.key_unread(&alice));
        assert!(claude.key_unread(&nobody));
        assert_eq!(claude.limits_key_unread(&nobody).count(), 0);
        assert_eq!(claude.limits_key_unread(&json("{}")).count(), 1);
        assert!(claude.reads_request_body());
        assert!(!s.policies[3].reads_request_body());
        assert!(!s.policies[3].keys_from_body());
        // A request the catch-all takes on its headers alone is decided at
        // once, its body never asked for.
        let other = s.classify(
            req(&[(":authority", b"api.bank.example")]),
            (&SECRET, None),
            &BodyJson::Coming,
        );
        assert!(matches!(other, Classified::Decided { class: Some(_), .. }));
    }
    #[test]
    fn a_limits_estimate_adds_the_prompt_to_what_the_call_asks_for() {
        let s = set(r#"{"version": 1, "policies": [
            {"name": "llm", "match": {"host": "api.llm.example"}, "rate": {"requests": 100, "period": "1s"},
             "limits": [{"name": "tpm", "rate": {"requests": 1000000, "period": "1m"},
                         "cost": {"json": "max_tokens", "plus": 7, "default": 100, "max": 200000,
                                  "plus_prompt": {"paths": ["messages", "prompt"], "chars_per_token": 4}}}]}
        ]}"#);
        let llm = &s.policies[0];
        let cost = |b: &BodyJson| llm.limit_costs(req(&[]), b, None)[0];
        let prompt = "x".repeat(40_000);
        let asked = json(&format!(
            r#"{{"max_tokens": 50, "messages": [{{"role": "user", "content": "{prompt}"}}]}}"#
        ));
        // 50 asked + 7 + (4 for "user" + 40 000) / 4.
        assert_eq!(cost(&asked), 50 + 7 + 10_001);
        // No max_tokens: the default, and still the prompt.
        assert_eq!(cost(&json(r#"{"prompt": "abcdefgh"}"#)), 100 + 2);
        // At most max; a body that cannot be read (not JSON, too large)
        // costs the max.
        let huge = json(&format!(
            r#"{{"max_tokens": 1, "prompt": "{}"}}"#,
            "y".repeat(900_000)
        ));
        assert_eq!(cost(&huge), 200_000);
        assert_eq!(cost(&BodyJson::Invalid), 200_000);
        assert_eq!(cost(&BodyJson::TooLarge), 200_000);
        assert_eq!(cost(&BodyJson::Absent), 100);
    }

    /// A money limit needs the call's model and estimate from the body,
    /// whatever else the policy reads: a call decided on its headers alone
    /// would have no model and be refused as unpriced.
    #[test]
    fn a_money_limit_alone_reads_the_body() {
        let set = CompiledPolicySet::from_json(
            r#"{"version": 1, "prices": {"currency": "USD", "models": {"gpt-4o": {"input": "2.50", "output": "10"}}},
                "policies": [{"name": "llm", "match": {"host": "api.llm.example"},
                  "rate": {"requests": 100, "period": "1s"},
                  "limits": [{"name": "team-daily", "rate": {"requests": 1000000, "period": "1d", "algorithm": "fixed_window"},
                              "cost": "price", "key": {"header": "x-team"}}]}]}"#,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let llm = &set.policies[0];
        assert!(llm.reads_request_body());
        let body = BodyJson::parse(br#"{"model": "gpt-4o", "max_tokens": 10}"#);
        assert!(llm.call_price(req(&[]), &body).is_some());
    }

    #[test]
    fn a_global_limit_shared_fairly_divides_this_envoys_share() {
        let mut set = set(
            r#"{"version": 1, "policies": [{"name": "llm", "match": {"host": "x"},
              "rate": {"requests": 1000, "period": "1s"},
              "limits": [{"name": "tps", "scope": "global", "rate": {"requests": 90, "period": "1s", "burst": 4},
                          "fair": {"key": {"header": "x-tenant"}}},
                         {"name": "slots", "concurrency": {"max_in_flight": 6, "lease_ttl": "5s"},
                          "fair": {"key": {"header": "x-tenant"}, "min": {"a": 2}}}]}]}"#,
        );
        let llm = &mut set.policies[0];
        let capacity = |p: &CompiledPolicy| {
            p.limits[0]
                .fair
                .as_ref()
                .and_then(|f| f.terms)
                .map(|t| t.capacity)
        };
        assert_eq!(capacity(llm), Some(90 * fair::UNIT));
        llm.apply_limit_share(
            0,
            sluice_shared::fleet::Amount {
                rate: 22.5,
                in_flight: 0,
            },
        );
        assert_eq!(capacity(llm), Some(22 * fair::UNIT + fair::UNIT / 2));
        // The slots' `fair`: its terms, reservations in slots, and who
        // asks (after the rate limits' claimants).
        let slots = llm.slot_limits[0].fair.as_ref().and_then(|f| f.slots);
        assert_eq!(
            slots,
            Some(FairSlotTerms {
                capacity: 6,
                lease_ttl: sluice_shared::time::Span::from_secs(5),
                max_keys: usize::try_from(KeySpec::DEFAULT_MAX_KEYS).unwrap_or(0),
            })
        );
        let claimants = llm.limit_claimants(
            &[("x-tenant", b"a".as_slice())][..],
            &SECRET,
            &BodyJson::Absent,
        );
        assert_eq!(claimants.len(), 2);
        assert_eq!(claimants[1].map(|c| c.reserved), Some(2));
    }
}
