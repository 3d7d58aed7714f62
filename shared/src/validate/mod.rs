//! A policy set parsed and checked: shapes by serde (the field and the
//! reason for each error), then each policy's meaning by its concepts'
//! checks (`crate::policy`'s modules), then what spans policies: unique
//! names, limits shared between policies, prices, pools.

use serde::de::DeserializeOwned;
use serde_json::Value;

pub use crate::policy::bounds;
use crate::policy::check::{check_header_name, check_name, join_path, Report};
pub use crate::policy::check::{FieldError, ValidationErrors};
use crate::policy::cost::check_cost;
use crate::policy::fair::{check_fair_spec, Reservable};
use crate::policy::key::check_key;
use crate::policy::limit::check_named_limits;
use crate::policy::matching::check_match;
use crate::policy::on_limit::check_on_limit;
use crate::policy::pool::check_pool;
use crate::policy::rate::{check_concurrency, check_rate, check_rate_splits_into_shares};
use crate::policy::*;
use crate::price::{check_prices, PriceTable};

mod across;

use across::check_across_policies;

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
    check_across_policies(&policies, prices.as_ref(), &mut errors);
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
    check_across_policies(&indexed, set.prices.as_ref(), &mut errors);
    ValidationErrors::from_vec(errors)
}

/// `value` as a `T`, or its errors pushed with their paths under `path`.
pub fn typed_at<T: DeserializeOwned>(
    value: Value,
    path: &str,
    errors: &mut Vec<FieldError>,
) -> Option<T> {
    typed(value, path, errors)
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
    crate::policy::route::check_routes(&mut r, policy);
    crate::policy::queue_rung::check_queue_rungs(&mut r, policy);
    if let Some(fair) = &policy.fair {
        check_fair(&mut r, policy, fair);
    }
    if let Some(pool) = &policy.pool {
        // A pool routes every call, so it cannot be in shadow mode.
        if policy.mode == Mode::Shadow {
            r.at(
                "mode",
                "a pool routes every call to a member: its policy limits in `reject` or `queue` mode, not in shadow mode",
            );
        }
        check_members_not_downgraded(&mut r, policy);
        check_pool(&mut r, pool, policy.limits.len());
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
                check_rate_splits_into_shares(r, rate, "policy");
            }
        }
    }
}

/// A pool's call is sent for a cheaper model by a `downgrade` on the
/// pool policy's own limits (every member's); a member's own limits have
/// none: a member whose budget cannot take a call is passed over already.
fn check_members_not_downgraded(r: &mut Report, policy: &Policy) {
    for (at, limit) in policy.every_limit_at("") {
        if limit.downgrade.is_some() && at.starts_with("pool.") {
            r.at(
                &format!("{at}.downgrade"),
                "a member whose budget cannot take a call is passed over already: put the downgrade on the pool policy's own `limits`",
            );
        }
    }
}

/// A policy's further limits: each a valid rate with a valid cost and a
/// name of its own. What the filter cannot yet enforce across several
/// limits is refused here, never enforced wrongly.
fn check_limits(r: &mut Report, policy: &Policy) {
    check_named_limits(r, "limits", &policy.limits);
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
