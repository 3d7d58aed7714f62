//! Deciding which policy a request falls under, which bucket it uses, what
//! it costs and how urgent it is: the policy set compiled, one module per
//! concept (hosts, what is read from a request, fair shares, further
//! limits, a policy). Works on raw header bytes: a request may carry
//! anything, and none of it may cause a panic.

mod batch;
mod fair;
mod host;
mod limit;
mod policy;
mod request;

pub use crate::body::{BodyJson, RequestAtHand};
pub use crate::mcp::BatchProblem;
pub use crate::pricing::UNPRICED;
pub use batch::BatchPart;
pub use fair::CompiledFair;
pub use limit::{CompiledLimit, CompiledSlotLimit};
pub use policy::{BucketKey, CompiledMember, CompiledPolicy, CompiledPool};
pub use request::KeySecrets;
pub(crate) use request::KeySource;

use sluice_shared::fair::FairClaimant;
use sluice_shared::policy::{PolicySet, Priority, Unreadable};
use sluice_shared::price::CompiledPrices;
use sluice_shared::request_headers::RequestHeaders;
use sluice_shared::validate::{parse_policy_set, ValidationErrors};

use crate::pricing::Pricing;

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
    /// The first policy taking the body counts MCP messages, and the body
    /// is a batch it cannot decide as one call, nor split into parts each
    /// decided as if sent alone: refused whole, nothing counted (see
    /// [`BatchProblem`]).
    BatchRefused {
        policy_index: usize,
        problem: BatchProblem,
    },
    /// The body is a batch of MCP messages no one policy decides whole:
    /// each part is decided as a call of its own policy, and the batch
    /// goes only if every part is admitted (see [`BatchPart`]).
    Split { parts: Vec<BatchPart> },
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
            Self::NeedsBody { .. }
            | Self::DuplicateKey { .. }
            | Self::BatchRefused { .. }
            | Self::Split { .. } => None,
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
        secrets: KeySecrets<'_>,
        body: &BodyJson,
    ) -> Classified {
        let KeySecrets {
            own: secret,
            label: fair_secret,
        } = secrets;
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
            if policy.counts_mcp() {
                if let Some(problem) = self.batch_problem(req, secrets, body, policy_index) {
                    return match self.split_batch(req, secrets, body, problem) {
                        Ok(parts) => Classified::Split { parts },
                        Err(problem) => Classified::BatchRefused {
                            policy_index,
                            problem,
                        },
                    };
                }
            }
            let class = Classification {
                policy_index,
                key: policy.bucket_key(req, secret, body),
                cost: policy.cost(req, body),
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
    /// may go upstream changed (made to ask for its stream's usage, or
    /// sent for a cheaper model): it must go without the length it came
    /// with.
    pub fn may_rewrite_body<R: RequestHeaders + ?Sized>(&self, req: &R, from: usize) -> bool {
        self.policies
            .iter()
            .skip(from)
            .any(|p| p.may_rewrite_body() && p.matches(req))
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
    use super::host::HostMatcher;
    use super::*;
    use sluice_shared::fair::{self, FairSlotTerms};
    use sluice_shared::key_hash::KeySecret;
    use sluice_shared::policy::KeySpec;

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
            s.classify(h, KeySecrets::new(&SECRET, None), &BodyJson::Absent)
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
                KeySecrets::new(&SECRET, None),
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
                KeySecrets::new(&SECRET, None),
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
                KeySecrets::new(&SECRET, None),
                &BodyJson::Absent
            )
            .class(),
            None
        );
        assert_eq!(
            s.classify(req(&[]), KeySecrets::new(&SECRET, None), &BodyJson::Absent)
                .class(),
            None
        );
        assert_eq!(
            s.classify(
                req(&[(":authority", &[0xff, 0xfe, b':'])]),
                KeySecrets::new(&SECRET, None),
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
            s.classify(
                h.as_slice(),
                KeySecrets::new(&SECRET, None),
                &BodyJson::Absent,
            )
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
            KeySecrets::new(&SECRET, None),
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
            Classified::NeedsBody { .. }
            | Classified::DuplicateKey { .. }
            | Classified::BatchRefused { .. }
            | Classified::Split { .. } => {
                panic!("the body was read, without a key twice, and is no batch")
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
            classify_body(&s, b).class().map(|c| {
                (
                    c.key,
                    claude.limit_keys(req(&[]), KeySecrets::new(&SECRET, None), b),
                )
            })
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
            KeySecrets::new(&SECRET, None),
            &BodyJson::Coming,
        );
        assert!(matches!(other, Classified::Decided { class: Some(_), .. }));
    }
    /// A key from a header and a body field: one per pair of values, no
    /// two pairs alike however their texts split, a call without the
    /// header keyed per field value, one lacking the field in the shared
    /// bucket; the header is read with the decision's headers.
    #[test]
    fn a_key_from_a_header_and_a_body_field_is_one_per_pair() {
        let s = set(r#"{"version": 1, "policies": [
            {"name": "llm", "match": {"host": "*"}, "rate": {"requests": 100, "period": "1s"},
             "limits": [{"name": "tpm-per-key", "rate": {"requests": 1000, "period": "1m"},
                         "key": {"header": "Authorization", "json": "model"}}]}]}"#);
        let llm = &s.policies[0];
        let key = |auth: Option<&[u8]>, body: &str| {
            let headers: Vec<(&str, &[u8])> =
                auth.map(|a| ("authorization", a)).into_iter().collect();
            llm.limit_keys(
                headers.as_slice(),
                KeySecrets::new(&SECRET, None),
                &json(body),
            )[0]
        };
        let a_4o = key(Some(b"sk-a"), r#"{"model": "gpt-4o"}"#);
        let a_mini = key(Some(b"sk-a"), r#"{"model": "gpt-4o-mini"}"#);
        let b_4o = key(Some(b"sk-b"), r#"{"model": "gpt-4o"}"#);
        assert!(a_4o.is_some());
        assert_ne!(a_4o, a_mini, "per model");
        assert_ne!(a_4o, b_4o, "per API key");
        assert_eq!(a_4o, key(Some(b"sk-a"), r#"{"model": "gpt-4o", "n": 2}"#));
        // Texts that join alike split apart: ("sk-ab", "c") and ("sk-a", "bc").
        assert_ne!(
            key(Some(b"sk-ab"), r#"{"model": "c"}"#),
            key(Some(b"sk-a"), r#"{"model": "bc"}"#)
        );
        assert_ne!(
            key(Some(b"sk-a"), r#"{"model": "x\ny"}"#),
            key(Some(b"sk-a\nx"), r#"{"model": "y"}"#),
            "a header holding the join (never from Envoy) has no key of its own"
        );
        assert_eq!(key(Some(b"sk-a\nx"), r#"{"model": "y"}"#), key(None, "{}"));
        // Without the header: a key per model still.
        assert_ne!(
            key(None, r#"{"model": "gpt-4o"}"#),
            key(None, r#"{"model": "gpt-4o-mini"}"#)
        );
        assert!(llm.limits_key_unread(&json("{}")).count() == 1);
        assert!(llm.reads_request_body());
        assert!(llm.decision_headers().any(|h| h == "authorization"));
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
