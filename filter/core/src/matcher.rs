//! Deciding which policy a request falls under, which bucket it uses, what
//! it costs and how urgent it is. Works on raw header bytes: a request may
//! carry anything, and none of it may cause a panic.

use sluice_shared::key_hash::KeySecret;
use sluice_shared::key_view::{name_key, KeyName};
use sluice_shared::limiter::{ConcurrencyLimit, RateLimiter};
use sluice_shared::policy::{
    CostSpec, KeyOverflow, Mode, NamedLimit, Policy, PolicySet, Priority, RateSpec,
};
use sluice_shared::request_headers::RequestHeaders;
use sluice_shared::usage::{CompiledUsage, UsagePath};
use sluice_shared::validate::{parse_policy_set, ValidationErrors};

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
    key_header: Option<String>,
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
}

/// One of a policy's further limits, ready to count.
#[derive(Debug, Clone)]
pub struct CompiledLimit {
    pub name: String,
    pub rate: RateLimiter,
    cost: CostSpec,
    cost_header: Option<String>,
    /// Where in the request's JSON body the estimate is read.
    cost_json: Option<UsagePath>,
    /// Where the real cost is read from the response.
    pub usage: Option<CompiledUsage>,
    /// Held by the admin across restarts ([`sluice_shared::NamedLimit::is_budget`]).
    pub budget: bool,
    /// One limit per value of this request header (lower case).
    key_header: Option<String>,
    /// With `key`: how many keys hold a place, and what the others do.
    pub keys: Option<(u32, KeyOverflow)>,
    /// `scope: global`: this Envoy applies its share (see
    /// [`CompiledPolicy::apply_limit_share`]); `closed` while the share
    /// allows nothing (before the first).
    pub global: bool,
    pub closed: bool,
    /// What it takes from the provider's answers (`provider`).
    pub provider: Option<sluice_shared::provider::CompiledProvider>,
}

/// One of a policy's further concurrency limits, ready to count.
#[derive(Debug, Clone)]
pub struct CompiledSlotLimit {
    pub name: String,
    pub limit: ConcurrencyLimit,
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
            key_header: policy.key.as_ref().map(|k| lower(&k.header)),
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
                        CostSpec::FromRequestJson(j) => UsagePath::parse(&j.json),
                        _ => None,
                    },
                    usage: l.usage.as_ref().map(|u| CompiledUsage::new(u, &l.cost)),
                    budget: l.is_budget(),
                    key_header: l.key.as_ref().map(|k| lower(&k.header)),
                    keys: l.key.as_ref().map(|k| (k.max_keys.max(1), k.overflow)),
                    global: l.scope == sluice_shared::policy::Scope::Global,
                    closed: false,
                    provider: l
                        .provider
                        .as_ref()
                        .map(|p| sluice_shared::provider::CompiledProvider::new(p, &l.name, rate)),
                })
                .collect(),
            slot_limits: policy
                .limits
                .iter()
                .filter_map(|l| {
                    l.concurrency.as_ref().map(|c| CompiledSlotLimit {
                        name: l.name.clone(),
                        limit: ConcurrencyLimit::from_spec(c),
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

    /// Applies this instance's share of a global policy's limits.
    pub fn apply_share(&mut self, share: sluice_shared::fleet::Amount) {
        let limits = sluice_shared::fleet::limits_for_share(&self.policy, share);
        self.rate = limits.rate;
        self.concurrency = limits.concurrency;
        self.fleet_closed = limits.closed;
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
    ) -> Option<KeyName> {
        let header = self.key_header.as_deref()?;
        let mode = self
            .policy
            .key
            .as_ref()
            .map(|k| k.label)
            .unwrap_or_default();
        let value = req.header(header);
        Some(name_key(
            secret,
            self.name(),
            value.as_deref().unwrap_or_default(),
            mode,
        ))
    }

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

    /// The request's bucket; a key is hashed with `secret` (see
    /// [`sluice_shared::key_hash`]).
    pub fn bucket_key<R: RequestHeaders + ?Sized>(&self, req: &R, secret: &KeySecret) -> BucketKey {
        match &self.key_header {
            None => BucketKey::Policy,
            Some(h) => {
                let value = req.header(h);
                BucketKey::Keyed(secret.hash(self.name(), value.as_deref().unwrap_or_default()))
            }
        }
    }

    /// Per further limit, the hash of the request's key for it (None for a
    /// limit without `key`). Keys are hashed as the policy's own are, under
    /// the limit's name.
    pub fn limit_keys<R: RequestHeaders + ?Sized>(
        &self,
        req: &R,
        secret: &KeySecret,
    ) -> Vec<Option<u64>> {
        if self.limits.is_empty() {
            return Vec::new();
        }
        self.limits
            .iter()
            .map(|l| {
                let header = l.key_header.as_deref()?;
                let value = req.header(header);
                Some(secret.hash(&l.name, value.as_deref().unwrap_or_default()))
            })
            .collect()
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
        [&self.key_header, &self.cost_header, &self.priority_header]
            .into_iter()
            .chain(
                self.limits
                    .iter()
                    .flat_map(|l| [&l.key_header, &l.cost_header]),
            )
            .filter_map(|h| h.as_deref())
    }

    /// Whether a further limit's cost is read from the request's body, so
    /// the call is decided only once its body is in.
    pub fn reads_request_body(&self) -> bool {
        self.limits.iter().any(|l| l.cost_json.is_some())
    }

    /// Whether a further limit's real cost is read from the response.
    pub fn reads_usage(&self) -> bool {
        self.limits.iter().any(|l| l.usage.is_some())
    }

    /// What this request takes from each of the policy's further limits;
    /// `body` is the request's body as far as it was read (see
    /// [`RequestJson`]).
    pub fn limit_costs<R: RequestHeaders + ?Sized>(
        &self,
        req: &R,
        body: RequestJson<'_>,
    ) -> Vec<u64> {
        if self.limits.is_empty() {
            return Vec::new();
        }
        let json = match body {
            RequestJson::Read(b) if self.reads_request_body() => {
                serde_json::from_slice::<serde_json::Value>(b).ok()
            }
            _ => None,
        };
        self.limits
            .iter()
            .map(|l| match (&l.cost, &l.cost_json) {
                // A body too large to read could ask for anything: it is
                // estimated at the most the cost may be, never its default.
                (CostSpec::FromRequestJson(spec), Some(_)) if body == RequestJson::TooLarge => {
                    spec.max.max(1)
                }
                (CostSpec::FromRequestJson(spec), Some(path)) => {
                    let asked = json.as_ref().and_then(|v| path.find(v));
                    asked
                        .map_or(spec.default, |n| n.saturating_add(spec.plus))
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
        CostSpec::Fixed(_) | CostSpec::FromRequestJson(_) => None,
    }
}

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

/// A request's body as far as an estimate is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestJson<'a> {
    /// Not read (none came, or no limit reads it): costs are their default.
    None,
    /// Too large to read: costs from it are their `max`.
    TooLarge,
    /// The body: costs from it read its JSON, or their default.
    Read(&'a [u8]),
}

/// A validated policy set, ready to classify requests.
#[derive(Debug, Clone)]
pub struct CompiledPolicySet {
    pub version: u64,
    pub policies: Vec<CompiledPolicy>,
}

impl CompiledPolicySet {
    /// Parses, validates and compiles; nothing is built from an invalid set.
    pub fn from_json(json: &str) -> Result<Self, ValidationErrors> {
        parse_policy_set(json).map(Self::from_validated)
    }

    /// Compiles a set that passed validation.
    pub fn from_validated(set: PolicySet) -> Self {
        Self {
            version: set.version,
            policies: set.policies.into_iter().map(CompiledPolicy::new).collect(),
        }
    }

    pub fn empty() -> Self {
        Self {
            version: 0,
            policies: Vec::new(),
        }
    }

    /// The first policy that matches, in list order, and how the request
    /// falls under it (its key hashed with `secret`).
    pub fn classify<R: RequestHeaders + ?Sized>(
        &self,
        req: &R,
        secret: &KeySecret,
    ) -> Option<Classification> {
        let (policy_index, policy) = self
            .policies
            .iter()
            .enumerate()
            .find(|(_, p)| p.matches(req))?;
        Some(Classification {
            policy_index,
            key: policy.bucket_key(req, secret),
            cost: policy.cost(req),
            priority: policy.priority(req),
            port_hidden: policy.host.port.is_some()
                && policy.host.port_hidden(req.header(":authority").as_deref()),
        })
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
            s.classify(h, &SECRET)
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
                &SECRET,
            )
            .map(|c| (s.policies[c.policy_index].name().to_string(), c.port_hidden))
        };
        assert_eq!(classify(b"eu.llm.example"), Some(("llm".into(), true)));
        assert_eq!(classify(b"eu.llm.example:443"), Some(("llm".into(), false)));
        assert_eq!(
            classify(b"eu.llm.example:8443"),
            Some(("rest".into(), false))
        );
        // A policy naming no port never says a port was hidden.
        let bank = s.classify(req(&[(":authority", b"api.bank.example")]), &SECRET);
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
            s.classify(req(&[(":authority", b"b.example")]), &SECRET),
            None
        );
        assert_eq!(s.classify(req(&[]), &SECRET), None);
        assert_eq!(
            s.classify(req(&[(":authority", &[0xff, 0xfe, b':'])]), &SECRET),
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
            s.classify(h.as_slice(), &SECRET).unwrap()
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
}
