//! Parsing and validation of policies, reporting every problem with the path
//! of the field it concerns (`policies[2].rate.burst: must be >= 1`).
//!
//! Serde stops at the first structural error, so each policy of a set is
//! parsed on its own: a typo in one policy does not hide the problems of the
//! others. Policies that parse are then checked for meaning.

use std::collections::HashMap;
use std::fmt;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::duration::DurationMs;
use crate::policy::*;
use crate::price::{ModelPrice, Money, PriceTable};
use crate::usage::UsagePath;

/// Bounds that keep every value meaningful and every computation in range.
pub mod bounds {
    pub const MAX_POLICIES: usize = 1000;
    pub const MAX_NAME_LEN: usize = 64;
    pub const MAX_REQUESTS: u64 = 1_000_000_000;
    /// A money limit's `rate.requests`, in millionths: a billion units.
    pub const MAX_MONEY_BUDGET: u64 = 1_000_000_000_000_000;
    pub const MAX_BURST: u64 = 1_000_000_000;
    pub const MIN_PERIOD_MS: u64 = 1;
    /// 31 days: a monthly quota.
    pub const MAX_PERIOD_MS: u64 = 31 * 86_400_000;
    /// A full bucket must drain back within this (burst / requests * period).
    pub const MAX_BUCKET_SPAN_MS: u64 = 31 * 86_400_000;
    pub const MAX_LIMITS: usize = 8;
    pub const MIN_COLD_FACTOR: u32 = 2;
    pub const MAX_COLD_FACTOR: u32 = 10;
    pub const MAX_WARMUP_MS: u64 = 3_600_000;
    pub const MAX_IN_FLIGHT: u32 = 1_000_000;
    pub const MIN_SHARE_LEASE_MS: u64 = 500;
    pub const MAX_SHARE_LEASE_MS: u64 = 300_000;
    pub const MIN_LEASE_TTL_MS: u64 = 1_000;
    pub const MAX_LEASE_TTL_MS: u64 = 86_400_000;
    pub const MAX_WAIT_MS: u64 = 300_000;
    pub const MAX_QUEUE: u32 = 100_000;
    pub const MAX_KEYS: u32 = 1_000_000;
    /// A key value named in `fair.weights` or `fair.min`.
    pub const MAX_KEY_VALUE_LEN: usize = 256;
    pub const MAX_BODY_LEN: usize = 4096;
    pub const MAX_HOST_LEN: usize = 261;
    pub const MAX_PATH_PREFIX_LEN: usize = 1024;
    pub const MAX_HEADER_VALUE_LEN: usize = 1024;
    pub const MAX_HEADER_MATCHES: usize = 16;
    /// Paths summed for one limit's usage.
    pub const MAX_USAGE_PATHS: usize = 8;
    /// A usage path's weight, either way (output tokens counted 4 times,
    /// cached ones -1).
    pub const MAX_USAGE_WEIGHT: u64 = 1_000;
    pub const MAX_JSON_PATH_LEN: usize = 256;
    /// Names or indexes in one JSON path (`a.b.c` is 3).
    pub const MAX_JSON_PATH_STEPS: usize = 16;
    pub const MAX_JSON_MATCHES: usize = 8;
    pub const MAX_JSON_ONE_OF: usize = 64;
    pub const MAX_PROMPT_PATHS: usize = 8;
    pub const MAX_PRICED_MODELS: usize = 1024;
    pub const MAX_WARN_LINES: usize = 4;
    pub const MAX_MODEL_NAME: usize = 128;
    /// Per million tokens, in units of the currency.
    pub const MAX_PRICE_PER_MILLION: u64 = 100_000;
    pub const MIN_CHARS_PER_TOKEN: f64 = 0.25;
    pub const MAX_CHARS_PER_TOKEN: f64 = 64.0;
    pub const MAX_USAGE_BODY_BYTES: u32 = 16 * 1024 * 1024;
    pub const MIN_MAX_PAUSE_MS: u64 = 1;
    pub const MAX_PAUSE_ON: usize = 8;
}

const KNOWN_METHODS: &[&str] = &[
    "GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "CONNECT", "TRACE",
];

/// One problem with one field.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FieldError {
    /// `policies[2].rate.burst`; empty for the document as a whole.
    pub path: String,
    pub message: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

/// Every problem found, in document order.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ValidationErrors {
    pub errors: Vec<FieldError>,
}

impl fmt::Display for ValidationErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.errors.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl ValidationErrors {
    fn single(path: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            errors: vec![FieldError {
                path: path.into(),
                message: message.into(),
            }],
        }
    }

    fn from_vec(errors: Vec<FieldError>) -> Result<(), Self> {
        if errors.is_empty() {
            Ok(())
        } else {
            Err(Self { errors })
        }
    }
}

/// Collects errors under a path prefix.
struct Report<'a> {
    errors: &'a mut Vec<FieldError>,
    prefix: String,
}

impl<'a> Report<'a> {
    fn new(errors: &'a mut Vec<FieldError>, prefix: &str) -> Self {
        Self {
            errors,
            prefix: prefix.to_string(),
        }
    }

    fn at(&mut self, field: &str, message: impl Into<String>) {
        self.errors.push(FieldError {
            path: join_path(&self.prefix, field),
            message: message.into(),
        });
    }

    fn range_ms(&mut self, field: &str, value: DurationMs, min_ms: u64, max_ms: u64) {
        if value.as_millis() < min_ms {
            self.at(
                field,
                format!("must be at least {}", DurationMs::from_millis(min_ms)),
            );
        } else if value.as_millis() > max_ms {
            self.at(
                field,
                format!("must be at most {}", DurationMs::from_millis(max_ms)),
            );
        }
    }

    fn range_u64(&mut self, field: &str, value: u64, min: u64, max: u64) {
        if value < min {
            self.at(field, format!("must be >= {min}"));
        } else if value > max {
            self.at(field, format!("must be <= {max}"));
        }
    }
}

fn join_path(prefix: &str, field: &str) -> String {
    match (prefix.is_empty(), field.is_empty()) {
        (true, _) => field.to_string(),
        (false, true) => prefix.to_string(),
        (false, false) if field.starts_with('[') => format!("{prefix}{field}"),
        (false, false) => format!("{prefix}.{field}"),
    }
}

/// Parses and validates a whole policy set.
pub fn parse_policy_set(json: &str) -> Result<PolicySet, ValidationErrors> {
    let value: Value = serde_json::from_str(json)
        .map_err(|e| ValidationErrors::single("", format!("not valid JSON: {e}")))?;
    policy_set_from_value(value)
}

/// Parses and validates a policy set already decoded as JSON.
pub fn policy_set_from_value(value: Value) -> Result<PolicySet, ValidationErrors> {
    let Value::Object(mut fields) = value else {
        return Err(ValidationErrors::single(
            "",
            "must be an object with \"version\" and \"policies\"",
        ));
    };
    let mut errors = Vec::new();
    for unknown in fields
        .keys()
        .filter(|k| !["version", "prices", "policies"].contains(&k.as_str()))
    {
        errors.push(FieldError {
            path: unknown.clone(),
            message: "unknown field, expected `version`, `prices` or `policies`".into(),
        });
    }
    let version = match fields.remove("version") {
        None => {
            errors.push(field_missing("version"));
            None
        }
        Some(v) => typed::<u64>(v, "version", &mut errors),
    };
    let prices = fields
        .remove("prices")
        .and_then(|v| typed::<PriceTable>(v, "prices", &mut errors));
    if let Some(prices) = &prices {
        check_prices(&mut Report::new(&mut errors, "prices"), prices);
    }
    let items = match fields.remove("policies") {
        None => {
            errors.push(field_missing("policies"));
            Vec::new()
        }
        Some(Value::Array(items)) => items,
        Some(_) => {
            errors.push(FieldError {
                path: "policies".into(),
                message: "must be a list of policies".into(),
            });
            Vec::new()
        }
    };
    if items.len() > bounds::MAX_POLICIES {
        errors.push(FieldError {
            path: "policies".into(),
            message: format!("at most {} policies", bounds::MAX_POLICIES),
        });
    }
    let mut policies = Vec::with_capacity(items.len());
    for (index, item) in items.into_iter().enumerate() {
        let path = format!("policies[{index}]");
        if let Some(policy) = typed::<Policy>(item, &path, &mut errors) {
            validate_policy(&policy, &path, &mut errors);
            policies.push((index, policy));
        }
    }
    check_across_policies(&policies, prices.is_some(), &mut errors);
    ValidationErrors::from_vec(errors)?;
    Ok(PolicySet {
        // Reaching here means no error was recorded, so version parsed.
        version: version.unwrap_or_default(),
        prices,
        policies: policies.into_iter().map(|(_, p)| p).collect(),
    })
}

/// Parses and validates one policy; paths are relative to the policy.
pub fn parse_policy(json: &str) -> Result<Policy, ValidationErrors> {
    let value: Value = serde_json::from_str(json)
        .map_err(|e| ValidationErrors::single("", format!("not valid JSON: {e}")))?;
    policy_from_value(value)
}

/// Parses and validates one policy already decoded as JSON.
pub fn policy_from_value(value: Value) -> Result<Policy, ValidationErrors> {
    let mut errors = Vec::new();
    let policy = typed::<Policy>(value, "", &mut errors);
    if let Some(policy) = &policy {
        validate_policy(policy, "", &mut errors);
    }
    ValidationErrors::from_vec(errors)?;
    policy.ok_or_else(|| ValidationErrors::single("", "policy did not parse"))
}

/// Checks a typed policy set (e.g. one built in code) for meaning.
pub fn validate_policy_set(set: &PolicySet) -> Result<(), ValidationErrors> {
    let mut errors = Vec::new();
    if set.policies.len() > bounds::MAX_POLICIES {
        errors.push(FieldError {
            path: "policies".into(),
            message: format!("at most {} policies", bounds::MAX_POLICIES),
        });
    }
    if let Some(prices) = &set.prices {
        check_prices(&mut Report::new(&mut errors, "prices"), prices);
    }
    let indexed: Vec<(usize, Policy)> = set.policies.iter().cloned().enumerate().collect();
    for (index, policy) in &indexed {
        validate_policy(policy, &format!("policies[{index}]"), &mut errors);
    }
    check_across_policies(&indexed, set.prices.is_some(), &mut errors);
    ValidationErrors::from_vec(errors)
}

/// What no one policy can tell: names unique, shared limits agreed on, a
/// pool member's limits its own, money limits priced.
fn check_across_policies(policies: &[(usize, Policy)], priced: bool, errors: &mut Vec<FieldError>) {
    check_unique_names(policies, errors);
    check_shared_limits(policies, errors);
    check_member_limits_own(policies, errors);
    check_priced_limits(policies, priced, errors);
    check_pools_after_body_readers(policies, errors);
    check_money_models_agree(policies, errors);
}

/// A call is priced once, at the model its policy's money limits say
/// where to read: they (and its pool members') must say the same.
fn check_money_models_agree(policies: &[(usize, Policy)], errors: &mut Vec<FieldError>) {
    for (index, policy) in policies {
        let own = policy
            .limits
            .iter()
            .enumerate()
            .map(|(i, l)| (format!("policies[{index}].limits[{i}]"), l));
        let members = policy
            .pool
            .iter()
            .flat_map(|p| p.members.iter().enumerate())
            .flat_map(|(m, member)| {
                member.limits.iter().enumerate().map(move |(i, l)| {
                    (
                        format!("policies[{index}].pool.members[{m}].limits[{i}]"),
                        l,
                    )
                })
            });
        let mut first: Option<(String, crate::price::ModelSource)> = None;
        for (path, limit) in own.chain(members) {
            let CostSpec::Price(spec) = &limit.cost else {
                continue;
            };
            let source = spec.cost().model;
            match &first {
                None => first = Some((path, source)),
                Some((at, want)) if *want != source => errors.push(FieldError {
                    path: format!("{path}.cost.price.model"),
                    message: format!(
                        "the policy's money limits price a call at one model: {at} reads it elsewhere"
                    ),
                }),
                Some(_) => {}
            }
        }
    }
}

/// A pool routes a call while its headers pass. A policy before it that
/// reads the body and matches the same headers holds the call until its
/// body is in: a call that policy then passes on (its body did not match)
/// would reach the pool after its headers were routed. Refused on the
/// pool's `match`, naming the policy before it.
fn check_pools_after_body_readers(policies: &[(usize, Policy)], errors: &mut Vec<FieldError>) {
    for (at, (index, pool_policy)) in policies.iter().enumerate() {
        if pool_policy.pool.is_none() {
            continue;
        }
        let earlier = policies[..at].iter().find(|(_, p)| {
            p.reads_request_body()
                && crate::overlap::headers_overlap(&p.matcher, &pool_policy.matcher)
        });
        if let Some((before, reader)) = earlier {
            errors.push(FieldError {
                path: format!("policies[{index}].match"),
                message: format!(
                    "policy {:?} (policies[{before}]) comes before this pool, reads the request's body and can match the same requests: \
                     a pool routes calls as their headers pass, so put the pool first or make their matches exclusive",
                    reader.name
                ),
            });
        }
    }
}

/// `value` as a `T`, or its errors pushed with their paths under `path`.
pub fn typed_at<T: DeserializeOwned>(
    value: Value,
    path: &str,
    errors: &mut Vec<FieldError>,
) -> Option<T> {
    typed(value, path, errors)
}

/// A limit named in several policies is one limit: they must agree on it.
/// Every policy that disagrees is told, so an edit to either side is
/// refused with an error on its own field.
fn check_shared_limits(policies: &[(usize, Policy)], errors: &mut Vec<FieldError>) {
    let mut by_name: HashMap<&str, Vec<(usize, usize, &NamedLimit)>> = HashMap::new();
    for (index, policy) in policies {
        for (at, limit) in policy.limits.iter().enumerate() {
            by_name
                .entry(limit.name.as_str())
                .or_default()
                .push((*index, at, limit));
        }
    }
    let mut found = Vec::new();
    for (name, uses) in &by_name {
        for (index, at, limit) in uses {
            let differs = |field: &str, same: &dyn Fn(&NamedLimit) -> bool| {
                uses.iter()
                    .find(|(i, _, l)| i != index && !same(l))
                    .map(|(other, _, _)| FieldError {
                        path: format!("policies[{index}].limits[{at}].{field}"),
                        message: format!(
                            "limit {name:?} is also in policies[{other}] with another {field}; a limit named in several policies is one limit"
                        ),
                    })
            };
            found.extend(
                differs("rate", &|l| l.rate == limit.rate)
                    .or_else(|| differs("concurrency", &|l| l.concurrency == limit.concurrency))
                    .or_else(|| differs("key", &|l| l.key == limit.key))
                    .or_else(|| differs("scope", &|l| l.scope == limit.scope))
                    .or_else(|| differs("provider", &|l| l.provider == limit.provider))
                    .or_else(|| differs("fair", &|l| l.fair == limit.fair)),
            );
        }
    }
    found.sort_by(|a, b| a.path.cmp(&b.path));
    errors.extend(found);
}

fn field_missing(field: &str) -> FieldError {
    FieldError {
        path: field.into(),
        message: "missing field".into(),
    }
}

fn typed<T: DeserializeOwned>(value: Value, path: &str, errors: &mut Vec<FieldError>) -> Option<T> {
    match serde_path_to_error::deserialize::<_, T>(value) {
        Ok(v) => Some(v),
        Err(e) => {
            let inner = e.path().to_string();
            let inner = if inner == "." { String::new() } else { inner };
            let (inner, message) = split_missing_field(inner, e.into_inner().to_string());
            errors.push(FieldError {
                path: join_path(path, &inner),
                message,
            });
            None
        }
    }
}

/// serde reports a missing field at its parent ("missing field `requests`");
/// point the path at the field itself, as for every other error.
fn split_missing_field(path: String, message: String) -> (String, String) {
    if let Some(rest) = message.strip_prefix("missing field `") {
        if let Some(field) = rest.strip_suffix('`') {
            return (join_path(&path, field), "missing field".into());
        }
    }
    (path, message)
}

fn check_unique_names(policies: &[(usize, Policy)], errors: &mut Vec<FieldError>) {
    let mut first_seen: HashMap<&str, usize> = HashMap::new();
    for (index, policy) in policies {
        match first_seen.get(policy.name.as_str()) {
            Some(first) => errors.push(FieldError {
                path: format!("policies[{index}].name"),
                message: format!(
                    "duplicate name {:?}, already used by policies[{first}]",
                    policy.name
                ),
            }),
            None => {
                first_seen.insert(&policy.name, *index);
            }
        }
    }
}

/// Checks one policy for meaning, adding errors under `prefix`.
pub fn validate_policy(policy: &Policy, prefix: &str, errors: &mut Vec<FieldError>) {
    let mut r = Report::new(errors, prefix);
    check_name(&mut r, &policy.name);
    check_match(&mut r, &policy.matcher);
    if let Some(key) = &policy.key {
        check_key(&mut r, key);
    }
    if policy.rate.is_none() && policy.concurrency.is_none() {
        r.at("", "sets no limit: give it `rate`, `concurrency`, or both");
    }
    if let Some(rate) = &policy.rate {
        check_rate(&mut r, rate);
    }
    check_cost(&mut r, &policy.cost, policy.rate.as_ref());
    if policy.cost.is_price() {
        r.at(
            "cost",
            "a price is for `limits` only: give a further limit whose cost is `price`",
        );
    } else if policy.cost.reads_request_body() {
        r.at(
            "cost.json",
            "a cost read from the request body is for `limits` only; the policy's own `cost` is a number or a header",
        );
    }
    if let Some(conc) = &policy.concurrency {
        check_concurrency(&mut r, conc, policy.priority.is_some());
    }
    check_on_limit(&mut r, &policy.on_limit);
    check_scope(&mut r, policy);
    check_limits(&mut r, policy);
    if let Some(fair) = &policy.fair {
        check_fair(&mut r, policy, fair);
    }
    if let Some(pool) = &policy.pool {
        check_pool(&mut r, policy, pool);
    }
    if let Some(priority) = &policy.priority {
        if let Some(header) = &priority.header {
            check_header_name(&mut r, "priority.header", header);
        }
    }
}

/// A global limit is split into shares by rate and slots; what cannot be
/// split that way is refused rather than enforced wrongly.
fn check_scope(r: &mut Report, policy: &Policy) {
    match policy.scope {
        Scope::Instance => {
            if policy.share_lease.is_some() {
                r.at(
                    "share_lease",
                    "only a `scope: global` policy has a share lease",
                );
            }
        }
        Scope::Global => {
            if let Some(lease) = policy.share_lease {
                r.range_ms(
                    "share_lease",
                    lease,
                    bounds::MIN_SHARE_LEASE_MS,
                    bounds::MAX_SHARE_LEASE_MS,
                );
            }
            if policy.key.is_some() {
                r.at(
                    "key",
                    "a `scope: global` policy cannot have per-key buckets",
                );
            }
            if let Some(rate) = &policy.rate {
                if rate.algorithm != Algorithm::TokenBucket {
                    r.at(
                        "rate.algorithm",
                        "a `scope: global` policy needs `token_bucket`: windows cannot be split into shares",
                    );
                }
                if rate.warmup.is_some() {
                    r.at("rate.warmup", "not supported with `scope: global`");
                }
            }
        }
    }
}

/// `pool`: two or more members with names and clusters of their own,
/// weights in range, each with limits of its own; a pool routes every call,
/// so it cannot be in shadow mode.
fn check_pool(r: &mut Report, policy: &Policy, pool: &PoolSpec) {
    if policy.mode == Mode::Shadow {
        r.at(
            "mode",
            "a pool routes every call to a member: its policy limits in `reject` or `queue` mode, not in shadow mode",
        );
    }
    check_pool_reads_headers_only(r, policy, pool);
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
        if policy.limits.len() + member.limits.len() > bounds::MAX_LIMITS {
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

/// Envoy picks a call's route while its headers pass; a pool writes the
/// member into them then, so nothing that chooses or costs the member may
/// wait for the request's body.
fn check_pool_reads_headers_only(r: &mut Report, policy: &Policy, pool: &PoolSpec) {
    const HEADERS_ONLY: &str = "a pool routes the call while its headers pass: read this from a header, not the request's JSON body";
    if pool.sticky.as_ref().is_some_and(|s| s.json.is_some()) {
        r.at("pool.sticky.json", HEADERS_ONLY);
    }
    if policy.matcher.reads_request_body() {
        r.at("match.json", HEADERS_ONLY);
    }
    if policy.key.as_ref().is_some_and(KeySpec::reads_request_body) {
        r.at("key.json", HEADERS_ONLY);
    }
    if policy
        .fair
        .as_ref()
        .is_some_and(|f| f.key.reads_request_body())
    {
        r.at("fair.key.json", HEADERS_ONLY);
    }
    let body_limits = policy
        .limits
        .iter()
        .enumerate()
        .map(|(i, l)| (format!("limits[{i}]"), l))
        .chain(pool.members.iter().enumerate().flat_map(|(m, member)| {
            member
                .limits
                .iter()
                .enumerate()
                .map(move |(i, l)| (format!("pool.members[{m}].limits[{i}]"), l))
        }));
    for (at, limit) in body_limits {
        if limit.cost.reads_request_body() {
            r.at(&format!("{at}.cost"), HEADERS_ONLY);
        }
        if limit.key.as_ref().is_some_and(KeySpec::reads_request_body) {
            r.at(&format!("{at}.key.json"), HEADERS_ONLY);
        }
        if limit
            .fair
            .as_ref()
            .is_some_and(|f| f.key.reads_request_body())
        {
            r.at(&format!("{at}.fair.key.json"), HEADERS_ONLY);
        }
        if limit.usage.as_ref().is_some_and(|u| u.ask_stream_usage) {
            r.at(
                &format!("{at}.usage.ask_stream_usage"),
                "a pool routes the call while its headers pass: its body cannot be changed to ask for its usage",
            );
        }
    }
}

/// An Envoy cluster's name as a header value: printable ASCII, no spaces.
fn check_cluster(r: &mut Report, cluster: &str) {
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

/// A pool member's limits are its own: no other policy or member names
/// them (a limit named twice is one limit, and a member's room is its own).
fn check_member_limits_own(policies: &[(usize, Policy)], errors: &mut Vec<FieldError>) {
    let mut uses: HashMap<&str, Vec<String>> = HashMap::new();
    for (index, policy) in policies {
        for (at, limit) in policy.limits.iter().enumerate() {
            uses.entry(limit.name.as_str())
                .or_default()
                .push(format!("policies[{index}].limits[{at}]"));
        }
        for (m, member) in policy
            .pool
            .iter()
            .flat_map(|p| p.members.iter().enumerate())
        {
            for (at, limit) in member.limits.iter().enumerate() {
                uses.entry(limit.name.as_str())
                    .or_default()
                    .push(format!("policies[{index}].pool.members[{m}].limits[{at}]"));
            }
        }
    }
    let mut found = Vec::new();
    for (name, paths) in &uses {
        if paths.len() < 2 || !paths.iter().any(|p| p.contains(".pool.")) {
            continue;
        }
        for path in paths.iter().filter(|p| p.contains(".pool.")) {
            let other = paths
                .iter()
                .find(|p| *p != path)
                .cloned()
                .unwrap_or_default();
            found.push(FieldError {
                path: format!("{path}.name"),
                message: format!(
                    "limit {name:?} is also named at {other}: a pool member's limits are its own"
                ),
            });
        }
    }
    found.sort_by(|a, b| a.path.cmp(&b.path));
    errors.extend(found);
}

/// A policy's further limits: each a valid rate with a valid cost and a
/// name of its own. What the filter cannot yet enforce across several
/// limits is refused here, never enforced wrongly.
fn check_limits(r: &mut Report, policy: &Policy) {
    check_named_limits(r, "limits", &policy.limits);
}

/// Limits under `field` (a policy's `limits`, a pool member's).
fn check_named_limits(r: &mut Report, field: &str, limits: &[NamedLimit]) {
    if limits.is_empty() {
        return;
    }
    if limits.len() > bounds::MAX_LIMITS {
        r.at(field, format!("at most {} limits", bounds::MAX_LIMITS));
    }
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for (index, limit) in limits.iter().enumerate() {
        let mut lr = Report::new(
            r.errors,
            &join_path(&r.prefix, &format!("{field}[{index}]")),
        );
        check_name(&mut lr, &limit.name);
        if let Some(key) = &limit.key {
            check_key(&mut lr, key);
        }
        match (&limit.rate, &limit.concurrency) {
            (Some(rate), None) => check_rate_limit(&mut lr, limit, rate),
            (None, Some(conc)) => {
                check_slot_limit(&mut lr, limit, conc);
                if let Some(fair) = &limit.fair {
                    check_limit_fair(&mut lr, limit, fair);
                }
            }
            (Some(_), Some(_)) => lr.at(
                "concurrency",
                "a limit is a `rate` or a `concurrency`, not both: make them two limits",
            ),
            (None, None) => lr.at(
                "rate",
                "missing field: a limit needs `rate` or `concurrency`",
            ),
        }
        if let Some(first) = seen.insert(&limit.name, index) {
            lr.at(
                "name",
                format!(
                    "duplicate name {:?}, already used by limits[{first}]",
                    limit.name
                ),
            );
        }
    }
}

/// A further rate limit: its rate, its cost, and what `scope: global`
/// can split into shares.
fn check_rate_limit(lr: &mut Report, limit: &NamedLimit, rate: &RateSpec) {
    if limit.cost.is_price() {
        check_rate_up_to(lr, rate, bounds::MAX_MONEY_BUDGET);
        if rate.algorithm == Algorithm::TokenBucket {
            lr.at(
                "rate.algorithm",
                "a budget in money is counted per period: fixed_window or sliding_window",
            );
        }
    } else {
        check_rate(lr, rate);
    }
    if limit.scope == Scope::Global {
        if limit.key.is_some() {
            lr.at(
                "key",
                "a `scope: global` limit cannot be per key: its shares are per Envoy",
            );
        }
        if rate.algorithm != Algorithm::TokenBucket {
            lr.at(
                "rate.algorithm",
                "a `scope: global` limit needs `token_bucket`: windows cannot be split into shares",
            );
        }
        if rate.warmup.is_some() {
            lr.at("rate.warmup", "not supported with `scope: global`");
        }
    }
    check_cost(lr, &limit.cost, Some(rate));
    check_warn_at(lr, &limit.warn_at);
    match &limit.usage {
        Some(usage) if limit.cost.is_price() => check_price_usage(lr, usage),
        Some(usage) => check_usage(lr, usage),
        None => {}
    }
    if let Some(provider) = &limit.provider {
        check_provider(lr, provider);
    }
    if let Some(fair) = &limit.fair {
        check_limit_fair(lr, limit, fair);
    }
}

fn check_provider(lr: &mut Report, provider: &ProviderSpec) {
    if provider.pause_on.len() > bounds::MAX_PAUSE_ON {
        lr.at(
            "provider.pause_on",
            format!("at most {} statuses", bounds::MAX_PAUSE_ON),
        );
    }
    for (i, status) in provider.pause_on.iter().enumerate() {
        if !(400..=599).contains(status) {
            lr.at(
                &format!("provider.pause_on[{i}]"),
                "must be an error status (400 to 599): only a refusal pauses a limit",
            );
        }
        if provider.pause_on[..i].contains(status) {
            lr.at(&format!("provider.pause_on[{i}]"), "listed twice");
        }
    }
    match &provider.headers {
        Some(ProviderHeaders::Ietf(item)) => {
            if item.ietf.is_empty() || item.ietf.len() > bounds::MAX_NAME_LEN {
                lr.at(
                    "provider.headers.ietf",
                    format!(
                        "the name of an item of the provider's `RateLimit` field: 1 to {} characters",
                        bounds::MAX_NAME_LEN
                    ),
                );
            }
        }
        Some(ProviderHeaders::Custom(custom)) => {
            check_header_name(lr, "provider.headers.remaining", &custom.remaining);
            if let Some(limit) = &custom.limit {
                check_header_name(lr, "provider.headers.limit", limit);
            }
            if let Some(reset) = &custom.reset {
                check_header_name(lr, "provider.headers.reset", reset);
            }
        }
        Some(ProviderHeaders::Preset(_)) | None => {}
    }
    if let Some(max_pause) = provider.max_pause {
        lr.range_ms(
            "provider.max_pause",
            max_pause,
            bounds::MIN_MAX_PAUSE_MS,
            ProviderSpec::MAX_PAUSE_LIMIT.as_millis(),
        );
    }
}

/// A further concurrency limit: one slot per call, for every policy
/// naming it, on this Envoy. What it would mean per key, per fleet or with
/// a cost is refused here rather than enforced as something else.
fn check_slot_limit(lr: &mut Report, limit: &NamedLimit, conc: &ConcurrencySpec) {
    if conc.reserved_for_high > 0 {
        lr.at(
            "concurrency.reserved_for_high",
            "the priority lane is the policy's own `concurrency`'s; a concurrency limit in `limits` has none",
        );
    }
    let without_lane = ConcurrencySpec {
        reserved_for_high: 0,
        ..conc.clone()
    };
    check_concurrency(lr, &without_lane, false);
    if !limit.warn_at.is_empty() {
        lr.at(
            "warn_at",
            "warning lines are for a `rate` limit: a concurrency limit has no share used",
        );
    }
    if limit.key.is_some() {
        lr.at(
            "key",
            "a concurrency limit in `limits` is for every call of the policies naming it; for calls in flight per key use the policy's own `concurrency` with its `key`",
        );
    }
    if limit.scope == Scope::Global {
        lr.at(
            "scope",
            "a concurrency limit in `limits` is per Envoy; for calls in flight across the fleet use a `scope: global` policy's own `concurrency`",
        );
    }
    if !CostSpec::is_default(&limit.cost) {
        lr.at(
            "cost",
            "a concurrency limit takes one slot per call: no `cost`",
        );
    }
    if limit.usage.is_some() {
        lr.at(
            "usage",
            "a concurrency limit takes one slot per call: no `usage`",
        );
    }
    if limit.provider.is_some() {
        lr.at(
            "provider",
            "a provider's pauses and counts are for rate limits: put `provider` on the rate limit it mirrors",
        );
    }
}

/// `fair`: a key to share by, weights in range, and reservations that
/// add up to the limit at most (a peer's minimum per member once pushed
/// its total past the cap). What the filter does not share fairly yet is
/// refused here, never enforced unfairly.
fn check_fair(r: &mut Report, policy: &Policy, fair: &FairSpec) {
    let mut fr = Report::new(r.errors, &join_path(&r.prefix, "fair"));
    check_key(&mut fr, &fair.key);
    let reservable = match (&policy.rate, &policy.concurrency) {
        // "sets no limit" says it.
        (None, None) => return,
        (Some(rate), None) => Some(Reservable::rate(rate)),
        (None, Some(slots)) => Some(Reservable::slots(slots)),
        (Some(_), Some(_)) => {
            if !fair.min.is_empty() {
                fr.at(
                    "min",
                    "the policy shares both its `rate` and its `concurrency`: reservations would be in two units (put one of them in a further limit with its own `fair` to reserve)",
                );
            }
            None
        }
    };
    if policy.key.is_some() {
        fr.at(
            "",
            "a policy with `key` has a bucket per key already: share one rate fairly with `fair`, or split it with `key`, not both",
        );
    }
    check_fair_spec(&mut fr, fair, reservable);
    if policy.scope == Scope::Global && policy.on_limit.action == LimitAction::Queue {
        fr.at(
            "",
            "a fair queue orders one Envoy's waiting calls: with `scope: global`, share fairly in reject mode",
        );
    }
    if policy.scope == Scope::Global && policy.concurrency.is_some() {
        fr.at(
            "",
            "slots are shared fairly per Envoy: not with `scope: global` (a global policy's own `rate` can be)",
        );
    }
    if policy.scope == Scope::Global && !fair.min.is_empty() {
        fr.at(
            "min",
            "reservations are kept by each Envoy's table: not with `scope: global` (weights are weighed across the fleet)",
        );
    }
}

/// A further limit's `fair`: its own `rate` or `concurrency` shared by
/// weight (a global rate across the fleet, by weights only; not beside a
/// per-key split).
fn check_limit_fair(lr: &mut Report, limit: &NamedLimit, fair: &FairSpec) {
    let mut fr = Report::new(lr.errors, &join_path(&lr.prefix, "fair"));
    check_key(&mut fr, &fair.key);
    let rate = match (&limit.rate, &limit.concurrency) {
        (Some(rate), _) => rate,
        (None, Some(slots)) => {
            // Its `key`, `scope` and `cost` are refused as any concurrency
            // limit's are.
            check_fair_spec(&mut fr, fair, Some(Reservable::slots(slots)));
            return;
        }
        (None, None) => return,
    };
    if limit.key.is_some() {
        fr.at(
            "",
            "a limit with `key` has a bucket per key already: share its rate fairly with `fair`, or split it with `key`, not both",
        );
    }
    if limit.scope == Scope::Global && !fair.min.is_empty() {
        fr.at(
            "min",
            "reservations are kept by each Envoy's table: not with `scope: global` (weights are weighed across the fleet)",
        );
    }
    if limit.cost.is_price() {
        fr.at(
            "",
            "a budget in money is not shared fairly: give it a `key`",
        );
    }
    check_fair_spec(&mut fr, fair, Some(Reservable::rate(rate)));
}

/// What reservations are counted against: the limit's size in its units.
struct Reservable {
    size: u64,
    what: &'static str,
}

impl Reservable {
    fn rate(rate: &RateSpec) -> Self {
        Self {
            size: rate.requests,
            what: "the rate's",
        }
    }

    /// The slots a normal-priority call may take.
    fn slots(slots: &ConcurrencySpec) -> Self {
        Self {
            size: u64::from(slots.max_in_flight.saturating_sub(slots.reserved_for_high)),
            what: "the slots' (without those reserved for high priority)",
        }
    }
}

/// What any `fair` must say well: weights in range, named keys of sane
/// length, reservations within the rate.
fn check_fair_spec(fr: &mut Report, fair: &FairSpec, reservable: Option<Reservable>) {
    let weight_in_range = |w: f64| (FairSpec::MIN_WEIGHT..=FairSpec::MAX_WEIGHT).contains(&w);
    let range = format!(
        "a weight is from {} to {}",
        FairSpec::MIN_WEIGHT,
        FairSpec::MAX_WEIGHT
    );
    if !weight_in_range(fair.default_weight) {
        fr.at("default_weight", range.clone());
    }
    for (what, count) in [("weights", fair.weights.len()), ("min", fair.min.len())] {
        if count > FairSpec::MAX_NAMED {
            fr.at(what, format!("at most {} keys", FairSpec::MAX_NAMED));
        }
    }
    for (name, weight) in &fair.weights {
        if !weight_in_range(*weight) {
            fr.at(&format!("weights.{name}"), range.clone());
        }
    }
    for name in fair.weights.keys().chain(fair.min.keys()) {
        if name.is_empty() || name.len() > bounds::MAX_KEY_VALUE_LEN {
            fr.at(
                "weights",
                format!(
                    "a key value is 1 to {} characters",
                    bounds::MAX_KEY_VALUE_LEN
                ),
            );
            break;
        }
    }
    let reserved = fair
        .min
        .values()
        .fold(0u64, |sum, v| sum.saturating_add(*v));
    let Some(Reservable { size, what }) = reservable else {
        return;
    };
    if reserved > size {
        fr.at(
            "min",
            format!(
                "reservations add up to {reserved}, more than {what} {size}: they would push the total past the limit",
            ),
        );
    }
}

fn check_key(r: &mut Report, key: &KeySpec) {
    match (&key.header, &key.json) {
        (Some(header), None) => {
            check_header_name(r, "key.header", header);
            if key.label == KeyLabel::Value && crate::header_names::is_credential(header) {
                r.at(
                    "key.label",
                    format!(
                        "{header:?} carries a credential: its values are never shown, so its keys are labelled by hash (leave `label` out)"
                    ),
                );
            }
        }
        (None, Some(path)) => check_json_path(r, "key.json", path),
        (Some(_), Some(_)) => r.at("key", "give either `header` or `json`, not both"),
        (None, None) => r.at(
            "key",
            "give `header` (a request header) or `json` (a path in the request's JSON body)",
        ),
    }
    r.range_u64(
        "key.max_keys",
        key.max_keys.into(),
        1,
        bounds::MAX_KEYS.into(),
    );
}

fn check_name(r: &mut Report, name: &str) {
    if name.is_empty() {
        r.at("name", "must not be empty");
    } else if name.len() > bounds::MAX_NAME_LEN {
        r.at(
            "name",
            format!("at most {} characters", bounds::MAX_NAME_LEN),
        );
    } else if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        r.at("name", "only letters, digits, '-', '_' and '.' are allowed");
    }
}

fn check_match(r: &mut Report, m: &MatchSpec) {
    check_host(r, &m.host);
    check_json_matches(r, &m.json);
    if m.unreadable == Unreadable::Next && m.json.is_empty() {
        r.at(
            "match.unreadable",
            "applies only with `match.json`: without conditions on the body a policy matches by its headers alone",
        );
    }
    if let Some(prefix) = &m.path_prefix {
        if !prefix.starts_with('/') {
            r.at("match.path_prefix", "must start with '/'");
        } else if prefix.len() > bounds::MAX_PATH_PREFIX_LEN {
            r.at(
                "match.path_prefix",
                format!("at most {} characters", bounds::MAX_PATH_PREFIX_LEN),
            );
        } else if prefix.bytes().any(|b| b <= b' ' || b == 0x7f) {
            r.at(
                "match.path_prefix",
                "must not contain spaces or control characters",
            );
        }
    }
    for (i, method) in m.methods.iter().enumerate() {
        if !KNOWN_METHODS.iter().any(|k| k.eq_ignore_ascii_case(method)) {
            r.at(
                &format!("match.methods[{i}]"),
                format!(
                    "unknown method {method:?}, expected one of {}",
                    KNOWN_METHODS.join(", ")
                ),
            );
        }
    }
    if m.headers.len() > bounds::MAX_HEADER_MATCHES {
        r.at(
            "match.headers",
            format!("at most {} header conditions", bounds::MAX_HEADER_MATCHES),
        );
    }
    for (i, h) in m.headers.iter().enumerate() {
        check_header_name(r, &format!("match.headers[{i}].name"), &h.name);
        if h.equals.len() > bounds::MAX_HEADER_VALUE_LEN {
            r.at(
                &format!("match.headers[{i}].equals"),
                format!("at most {} characters", bounds::MAX_HEADER_VALUE_LEN),
            );
        } else if h.equals.chars().any(|c| c.is_control()) {
            r.at(
                &format!("match.headers[{i}].equals"),
                "must not contain control characters",
            );
        }
    }
}

fn check_host(r: &mut Report, host: &str) {
    if host.is_empty() {
        r.at(
            "match.host",
            "must not be empty; use \"*\" to match any host",
        );
        return;
    }
    if host == "*" {
        return;
    }
    if host.len() > bounds::MAX_HOST_LEN {
        r.at(
            "match.host",
            format!("at most {} characters", bounds::MAX_HOST_LEN),
        );
        return;
    }
    let exact = host.strip_prefix("*.").unwrap_or(host);
    if exact.is_empty() {
        r.at(
            "match.host",
            "\"*.\" needs a domain after it, e.g. \"*.example.com\"",
        );
    } else if exact.contains('*') {
        r.at(
            "match.host",
            "'*' is allowed only as \"*\" or as a leading \"*.\" (e.g. \"*.example.com\")",
        );
    } else if !exact
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b':' | b'[' | b']'))
    {
        r.at(
            "match.host",
            "only letters, digits, '-', '.', and an optional \":port\" are allowed",
        );
    } else if let Some(port) = port_of(exact) {
        if port.parse::<u16>().map_or(true, |p| p == 0) {
            r.at("match.host", format!("invalid port {port:?}"));
        }
    }
}

/// The port part of `host:port` or `[v6]:port`, if any.
fn port_of(host: &str) -> Option<&str> {
    if let Some(rest) = host.strip_prefix('[') {
        let close = rest.find(']')?;
        return rest[close + 1..].strip_prefix(':');
    }
    host.rsplit_once(':').map(|(_, port)| port)
}

/// An HTTP header name (RFC 9110 token), matched case-insensitively.
fn check_header_name(r: &mut Report, field: &str, name: &str) {
    if name.is_empty() {
        r.at(field, "must not be empty");
    } else if name.len() > 256 {
        r.at(field, "at most 256 characters");
    } else if !name.bytes().all(is_token_byte) {
        r.at(field, format!("{name:?} is not a valid header name"));
    }
}

fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

fn check_rate(r: &mut Report, rate: &RateSpec) {
    check_rate_up_to(r, rate, bounds::MAX_REQUESTS);
}

/// A rate of at most `max_requests` a period (money counts millionths).
fn check_rate_up_to(r: &mut Report, rate: &RateSpec, max_requests: u64) {
    r.range_u64("rate.requests", rate.requests, 1, max_requests);
    r.range_ms(
        "rate.period",
        rate.period,
        bounds::MIN_PERIOD_MS,
        bounds::MAX_PERIOD_MS,
    );
    let is_bucket = rate.algorithm == Algorithm::TokenBucket;
    if let Some(burst) = rate.burst {
        if !is_bucket {
            r.at("rate.burst", "applies only to algorithm token_bucket");
        } else {
            r.range_u64("rate.burst", burst, 1, bounds::MAX_BURST);
        }
    }
    // A period out of range is reported as such, not again as a refill.
    let period_ok =
        (bounds::MIN_PERIOD_MS..=bounds::MAX_PERIOD_MS).contains(&rate.period.as_millis());
    if is_bucket && rate.requests >= 1 && period_ok {
        let span_ms = u128::from(rate.effective_burst()) * u128::from(rate.period.as_millis())
            / u128::from(rate.requests);
        if span_ms > u128::from(bounds::MAX_BUCKET_SPAN_MS) {
            r.at(
                "rate.burst",
                "a full bucket would take more than 31 days to refill; lower burst or raise the rate",
            );
        }
    }
    if let Some(warmup) = &rate.warmup {
        if !is_bucket {
            r.at("rate.warmup", "applies only to algorithm token_bucket");
        }
        r.range_ms(
            "rate.warmup.period",
            warmup.period,
            1,
            bounds::MAX_WARMUP_MS,
        );
        r.range_u64(
            "rate.warmup.cold_factor",
            warmup.cold_factor.into(),
            bounds::MIN_COLD_FACTOR.into(),
            bounds::MAX_COLD_FACTOR.into(),
        );
    }
}

fn check_cost(r: &mut Report, cost: &CostSpec, rate: Option<&RateSpec>) {
    let capacity = rate.map(RateSpec::capacity);
    let over_capacity = |n: u64| capacity.is_some_and(|c| c >= 1 && n > c);
    let capacity_message = |c: Option<u64>| {
        format!(
            "must be <= {} (the rate's {}), or such a request could never pass",
            c.unwrap_or(0),
            if rate.is_some_and(|r| r.algorithm == Algorithm::TokenBucket) {
                "burst"
            } else {
                "requests per period"
            }
        )
    };
    match cost {
        CostSpec::Fixed(1) => {}
        _ if rate.is_none() => r.at("cost", "applies only to `rate`, and this policy has none"),
        CostSpec::Fixed(0) => r.at("cost", "must be >= 1"),
        CostSpec::Fixed(n) if over_capacity(*n) => r.at("cost", capacity_message(capacity)),
        CostSpec::Fixed(_) => {}
        CostSpec::FromHeader(h) => {
            check_header_name(r, "cost.header", &h.header);
            check_default_and_max(
                r,
                h.default,
                h.max,
                capacity_message(capacity),
                over_capacity,
            );
        }
        CostSpec::Price(spec) => {
            let price = spec.cost();
            check_json_path(r, "cost.price.output", &price.output);
            r.range_u64(
                "cost.price.default_output",
                price.default_output,
                1,
                bounds::MAX_BURST,
            );
            r.range_u64(
                "cost.price.max_output",
                price.max_output,
                price.default_output.max(1),
                bounds::MAX_BURST,
            );
            check_prompt_estimate(r, "cost.price.prompt", &price.prompt);
            check_model_source(r, &price.model);
        }
        CostSpec::FromRequestJson(j) => {
            check_json_path(r, "cost.json", &j.json);
            if j.plus > bounds::MAX_BURST {
                r.at("cost.plus", format!("must be <= {}", bounds::MAX_BURST));
            }
            if let Some(prompt) = &j.plus_prompt {
                check_prompt_estimate(r, "cost.plus_prompt", prompt);
            }
            check_default_and_max(
                r,
                j.default,
                j.max,
                capacity_message(capacity),
                over_capacity,
            );
        }
    }
}

/// Where a call names its model: exactly one of a body field, a header
/// and a path prefix (a segment after it).
fn check_model_source(r: &mut Report, source: &crate::price::ModelSource) {
    const FIELD: &str = "cost.price.model";
    match (&source.json, &source.header, &source.path_after) {
        (Some(path), None, None) => check_json_path(r, &format!("{FIELD}.json"), path),
        (None, Some(header), None) => check_header_name(r, &format!("{FIELD}.header"), header),
        (None, None, Some(prefix)) => {
            if !prefix.starts_with('/') || !prefix.ends_with('/') {
                r.at(
                    &format!("{FIELD}.path_after"),
                    "must start and end with '/': the model is the path's segment right after it",
                );
            } else if prefix.len() > bounds::MAX_PATH_PREFIX_LEN
                || prefix.bytes().any(|b| b <= b' ' || b == 0x7f)
            {
                r.at(
                    &format!("{FIELD}.path_after"),
                    format!(
                        "at most {} characters, no spaces or control characters",
                        bounds::MAX_PATH_PREFIX_LEN
                    ),
                );
            }
        }
        _ => r.at(
            FIELD,
            "give exactly one of `json` (a body field), `header` or `path_after` (the path's segment after it)",
        ),
    }
}

fn check_default_and_max(
    r: &mut Report,
    default: u64,
    max: u64,
    capacity_message: String,
    over_capacity: impl Fn(u64) -> bool,
) {
    if default == 0 {
        r.at("cost.default", "must be >= 1");
    } else if over_capacity(default) {
        r.at("cost.default", capacity_message.clone());
    }
    if max < default.max(1) {
        r.at("cost.max", "must be >= cost.default");
    } else if over_capacity(max) {
        r.at("cost.max", capacity_message);
    }
}

fn check_json_path(r: &mut Report, field: &str, path: &str) {
    if path.len() > bounds::MAX_JSON_PATH_LEN {
        r.at(
            field,
            format!("at most {} characters", bounds::MAX_JSON_PATH_LEN),
        );
    } else if UsagePath::parse(path).is_none() {
        r.at(
            field,
            format!("{path:?} is not a path: names or indexes joined by '.', none empty (usage.total_tokens)"),
        );
    } else if path.split('.').count() > bounds::MAX_JSON_PATH_STEPS {
        r.at(
            field,
            format!(
                "at most {} names or indexes deep",
                bounds::MAX_JSON_PATH_STEPS
            ),
        );
    }
}

/// Where a prompt's text is and how many characters make a token: a few
/// paths, and a ratio a tokenizer could have (a quarter of a character,
/// as some scripts' characters take several tokens, to 64).
fn check_prompt_estimate(r: &mut Report, field: &str, prompt: &PromptEstimate) {
    if prompt.paths.is_empty() {
        r.at(
            &format!("{field}.paths"),
            "name at least one path (messages)",
        );
    }
    if prompt.paths.len() > bounds::MAX_PROMPT_PATHS {
        r.at(
            &format!("{field}.paths"),
            format!("at most {} paths", bounds::MAX_PROMPT_PATHS),
        );
    }
    for (i, path) in prompt.paths.iter().enumerate() {
        if path != PromptEstimate::EVERY_STRING {
            check_json_path(r, &format!("{field}.paths[{i}]"), path);
        }
    }
    let ratio = prompt.chars_per_token;
    if !(bounds::MIN_CHARS_PER_TOKEN..=bounds::MAX_CHARS_PER_TOKEN).contains(&ratio) {
        r.at(
            &format!("{field}.chars_per_token"),
            format!(
                "must be between {} and {} characters",
                bounds::MIN_CHARS_PER_TOKEN,
                bounds::MAX_CHARS_PER_TOKEN
            ),
        );
    }
}

/// Conditions on the request's JSON body: a path each, and exactly one of
/// `equals`, `prefix` and `one_of`, with values as bounded as a header's.
fn check_json_matches(r: &mut Report, matches: &[JsonMatch]) {
    if matches.len() > bounds::MAX_JSON_MATCHES {
        r.at(
            "match.json",
            format!("at most {} body conditions", bounds::MAX_JSON_MATCHES),
        );
    }
    for (i, m) in matches.iter().enumerate() {
        let at = |field: &str| format!("match.json[{i}]{field}");
        check_json_path(r, &at(".path"), &m.path);
        let given = usize::from(m.equals.is_some())
            + usize::from(m.prefix.is_some())
            + usize::from(!m.one_of.is_empty());
        if given != 1 {
            r.at(
                &at(""),
                "give exactly one of `equals`, `prefix` and `one_of`",
            );
        }
        if m.one_of.len() > bounds::MAX_JSON_ONE_OF {
            r.at(
                &at(".one_of"),
                format!("at most {} values", bounds::MAX_JSON_ONE_OF),
            );
        }
        let values = m
            .equals
            .iter()
            .map(|v| (at(".equals"), v))
            .chain(m.prefix.iter().map(|v| (at(".prefix"), v)))
            .chain(
                m.one_of
                    .iter()
                    .enumerate()
                    .map(|(j, v)| (at(&format!(".one_of[{j}]")), v)),
            );
        for (field, value) in values {
            if value.len() > bounds::MAX_HEADER_VALUE_LEN {
                r.at(
                    &field,
                    format!("at most {} characters", bounds::MAX_HEADER_VALUE_LEN),
                );
            }
        }
    }
}

/// Where a limit's real cost is read from the response: one source, paths
/// that parse, a bounded read.
fn check_usage(r: &mut Report, usage: &UsageSpec) {
    match (&usage.header, usage.json.is_empty()) {
        (Some(_), false) => r.at("usage", "give either `header` or `json`, not both"),
        (None, true) => r.at(
            "usage",
            "give `header` (a response header) or `json` (paths in the response body)",
        ),
        _ => {}
    }
    if let Some(h) = &usage.header {
        check_header_name(r, "usage.header", h);
        if !usage.events.is_empty() {
            r.at("usage.events", "applies only with `json`");
        }
        if usage.ask_stream_usage {
            r.at(
                "usage.ask_stream_usage",
                "applies only with `json`: the usage asked for comes in the stream's events",
            );
        }
    }
    for (field, paths) in [("usage.json", &usage.json), ("usage.events", &usage.events)] {
        if paths.len() > bounds::MAX_USAGE_PATHS {
            r.at(field, format!("at most {} paths", bounds::MAX_USAGE_PATHS));
        }
        for (i, (path, weight)) in paths.iter().enumerate() {
            check_json_path(r, &format!("{field}[{i}]"), path);
            if weight == 0 {
                r.at(
                    &format!("{field}[{i}]"),
                    format!("{path:?} has weight 0: it counts nothing, leave it out"),
                );
            } else if weight.unsigned_abs() > bounds::MAX_USAGE_WEIGHT {
                r.at(
                    &format!("{field}[{i}]"),
                    format!(
                        "{path:?}: a weight between -{max} and {max}",
                        max = bounds::MAX_USAGE_WEIGHT
                    ),
                );
            }
        }
        if !paths.is_empty() && paths.iter().all(|(_, weight)| weight < 0) {
            r.at(
                field,
                "no path counts up: give at least one a positive weight",
            );
        }
    }
    check_usage_bounds(r, usage);
}

/// How much of an answer is read for its usage, and what an unread one is
/// charged: the same for every limit that reads usage.
fn check_usage_bounds(r: &mut Report, usage: &UsageSpec) {
    if let Some(max) = usage.max_body_bytes {
        r.range_u64(
            "usage.max_body_bytes",
            u64::from(max),
            1024,
            u64::from(bounds::MAX_USAGE_BODY_BYTES),
        );
    }
    if let crate::policy::UnreadCharge::Tokens(n) = usage.unread {
        r.range_u64("usage.unread", n, 1, bounds::MAX_REQUESTS);
    }
}

/// Warning lines: a few shares of the limit, each between 0 and 1,
/// ascending.
fn check_warn_at(r: &mut Report, lines: &[f64]) {
    if lines.len() > bounds::MAX_WARN_LINES {
        r.at(
            "warn_at",
            format!("at most {} lines", bounds::MAX_WARN_LINES),
        );
    }
    for (i, line) in lines.iter().enumerate() {
        if !(*line > 0.0 && *line < 1.0) {
            r.at(
                &format!("warn_at[{i}]"),
                "a share of the limit, between 0 and 1 (0.8 warns at 80 %)",
            );
        } else if i > 0 && lines[i - 1] >= *line {
            r.at(
                &format!("warn_at[{i}]"),
                "lines go up: each above the one before",
            );
        }
    }
}

/// A price limit reads its usage as its `price.usage` says: its `usage`
/// may only ask streams for it and bound the read.
fn check_price_usage(r: &mut Report, usage: &UsageSpec) {
    if usage.header.is_some() || !usage.json.is_empty() || !usage.events.is_empty() {
        r.at(
            "usage",
            "a price reads the answer's usage as `cost.price.usage` says (openai or anthropic): give only `ask_stream_usage`, `unread` or `max_body_bytes`",
        );
    }
    check_usage_bounds(r, usage);
}

/// A price table: a known currency, named models, prices a provider
/// could charge.
fn check_prices(r: &mut Report, prices: &PriceTable) {
    if iso_currency::Currency::from_code(&prices.currency).is_none() {
        r.at(
            "currency",
            format!(
                "{:?} is not an ISO 4217 currency code (USD, EUR, GBP, JPY, ...)",
                prices.currency
            ),
        );
    }
    if prices.models.len() > bounds::MAX_PRICED_MODELS {
        r.at(
            "models",
            format!("at most {} models", bounds::MAX_PRICED_MODELS),
        );
    }
    for (name, price) in &prices.models {
        let at = format!("models.{name}");
        let bare = name.strip_suffix('*').unwrap_or(name);
        if bare.is_empty() || name.len() > bounds::MAX_MODEL_NAME || bare.contains('*') {
            r.at(
                &at,
                format!(
                    "a model's name, at most {} characters, `*` only at its end",
                    bounds::MAX_MODEL_NAME
                ),
            );
        }
        check_model_price(r, &at, price);
    }
    if let Some(default) = &prices.default {
        check_model_price(r, "default", default);
    }
}

fn check_model_price(r: &mut Report, at: &str, price: &ModelPrice) {
    let most = Money(bounds::MAX_PRICE_PER_MILLION * Money::ONE);
    for (kind, amount) in [
        ("input", Some(price.input)),
        ("output", Some(price.output)),
        ("cached_input", price.cached_input),
    ] {
        if amount.is_some_and(|a| a > most) {
            r.at(
                &format!("{at}.{kind}"),
                format!(
                    "at most {} a million tokens: a price is per million tokens",
                    bounds::MAX_PRICE_PER_MILLION
                ),
            );
        }
    }
    if price.input.micros() == 0 && price.output.micros() == 0 {
        r.at(
            at,
            "input and output both free: give the model's price, or leave it out (then `default`, or refused)",
        );
    }
}

/// A limit whose cost is `price` needs the set's `prices`.
fn check_priced_limits(
    policies: &[(usize, Policy)],
    has_prices: bool,
    errors: &mut Vec<FieldError>,
) {
    if has_prices {
        return;
    }
    for (index, policy) in policies {
        let own = policy
            .limits
            .iter()
            .enumerate()
            .map(|(i, l)| (format!("policies[{index}].limits[{i}]"), l));
        let members = policy
            .pool
            .iter()
            .flat_map(|p| p.members.iter().enumerate())
            .flat_map(|(m, member)| {
                member.limits.iter().enumerate().map(move |(i, l)| {
                    (
                        format!("policies[{index}].pool.members[{m}].limits[{i}]"),
                        l,
                    )
                })
            });
        for (path, limit) in own.chain(members) {
            if limit.cost.is_price() {
                errors.push(FieldError {
                    path: format!("{path}.cost"),
                    message: "a price needs the set's `prices`: what each model costs, and in which currency".into(),
                });
            }
        }
    }
}

fn check_concurrency(r: &mut Report, conc: &ConcurrencySpec, has_priority: bool) {
    r.range_u64(
        "concurrency.max_in_flight",
        conc.max_in_flight.into(),
        1,
        bounds::MAX_IN_FLIGHT.into(),
    );
    r.range_ms(
        "concurrency.lease_ttl",
        conc.lease_ttl,
        bounds::MIN_LEASE_TTL_MS,
        bounds::MAX_LEASE_TTL_MS,
    );
    if conc.reserved_for_high > 0 {
        if conc.reserved_for_high >= conc.max_in_flight {
            r.at(
                "concurrency.reserved_for_high",
                "must be less than max_in_flight, or normal requests could never pass",
            );
        }
        if !has_priority {
            r.at(
                "concurrency.reserved_for_high",
                "needs `priority` on the policy, or no request is ever high priority",
            );
        }
    }
}

fn check_on_limit(r: &mut Report, on_limit: &OnLimit) {
    if !(400..=599).contains(&on_limit.status) {
        r.at(
            "on_limit.status",
            "must be an HTTP error status, 400 to 599",
        );
    }
    if let Some(body) = &on_limit.body {
        if body.len() > bounds::MAX_BODY_LEN {
            r.at(
                "on_limit.body",
                format!("at most {} bytes", bounds::MAX_BODY_LEN),
            );
        }
    }
    match on_limit.action {
        LimitAction::Queue => {
            match on_limit.max_wait {
                None => r.at("on_limit.max_wait", "required when action is queue"),
                Some(wait) => r.range_ms("on_limit.max_wait", wait, 1, bounds::MAX_WAIT_MS),
            }
            if let Some(max_queue) = on_limit.max_queue {
                r.range_u64(
                    "on_limit.max_queue",
                    max_queue.into(),
                    1,
                    bounds::MAX_QUEUE.into(),
                );
            }
        }
        LimitAction::Reject => {
            if on_limit.max_wait.is_some() {
                r.at("on_limit.max_wait", "applies only when action is queue");
            }
            if on_limit.max_queue.is_some() {
                r.at("on_limit.max_queue", "applies only when action is queue");
            }
        }
    }
}
