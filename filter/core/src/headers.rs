//! Response header values for a limit decision: `Retry-After` (RFC 9110) and
//! `RateLimit-Policy` / `RateLimit` as structured fields per
//! draft-ietf-httpapi-ratelimit-headers (`"name";q=100;w=1`, `"name";r=0;t=1`).
//!
//! Policy names are restricted to `[A-Za-z0-9._-]` by validation, so they are
//! valid inside a structured-field string without escaping.

use sluice_shared::policy::Policy;
use sluice_shared::time::{Span, NANOS_PER_SEC};

pub const RETRY_AFTER: &str = "retry-after";
pub const RATELIMIT_POLICY: &str = "ratelimit-policy";
pub const RATELIMIT: &str = "ratelimit";
pub const SLUICE_POLICY: &str = "x-sluice-policy";

/// Which of a policy's limits a decision is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitKind {
    Rate,
    Concurrency,
}

impl LimitKind {
    /// The limit a refusal is reported against when no single limit caused
    /// it (contention, a full queue, a closed fleet share, key overflow):
    /// the rate when the policy has one, its concurrency limit otherwise.
    pub fn for_limits(has_rate: bool) -> LimitKind {
        if has_rate {
            LimitKind::Rate
        } else {
            LimitKind::Concurrency
        }
    }
}

/// Whole seconds, rounded up: a client that waits this long will not be
/// early. At least 1, as a 0 would invite an immediate retry.
pub fn retry_after_value(retry_after: Span) -> String {
    retry_after.as_secs_ceil().max(1).to_string()
}

/// The identifier of one limit of a policy in the RateLimit fields.
pub fn quota_id(policy: &Policy, kind: LimitKind) -> String {
    match kind {
        LimitKind::Rate => policy.name.clone(),
        LimitKind::Concurrency => format!("{}/in-flight", policy.name),
    }
}

/// A rate limit as a quota policy item: `"id";q=<quota>;w=<seconds>`.
fn rate_item(id: &str, rate: &sluice_shared::policy::RateSpec) -> String {
    let period = rate.period.as_span();
    let (quota, window_s) = match period.as_whole_secs() {
        Some(secs) if secs > 0 => (rate.requests, secs),
        _ => {
            // The field's window is whole seconds: state the same rate per second.
            let per_second = u128::from(rate.requests) * u128::from(NANOS_PER_SEC)
                / u128::from(period.as_nanos().max(1));
            (u64::try_from(per_second).unwrap_or(u64::MAX).max(1), 1)
        }
    };
    format!("\"{id}\";q={quota};w={window_s}")
}

/// Every limit of the policy as quota policy items: its rate, its
/// concurrency, then its further limits by name.
pub fn ratelimit_policy_value(policy: &Policy) -> String {
    let mut items = Vec::with_capacity(2 + policy.limits.len());
    if let Some(rate) = &policy.rate {
        items.push(rate_item(&quota_id(policy, LimitKind::Rate), rate));
    }
    if let Some(conc) = &policy.concurrency {
        items.push(format!(
            "\"{}\";q={};qu=\"concurrent-requests\"",
            quota_id(policy, LimitKind::Concurrency),
            conc.max_in_flight
        ));
    }
    // A limit that keeps its figures to itself (`tell_spend: false`) is
    // not listed: its quota is its size.
    for limit in policy.limits.iter().filter(|l| l.tell_spend) {
        if let Some(rate) = &limit.rate {
            items.push(rate_item(&limit.name, rate));
        }
        if let Some(conc) = &limit.concurrency {
            items.push(format!(
                "\"{}\";q={};qu=\"concurrent-requests\"",
                limit.name, conc.max_in_flight
            ));
        }
    }
    items.join(", ")
}

/// The live state of one limit: `remaining` units, full again in `reset`.
pub fn ratelimit_value(policy: &Policy, kind: LimitKind, remaining: u64, reset: Span) -> String {
    let id = quota_id(policy, kind);
    match kind {
        LimitKind::Rate => format!("\"{id}\";r={remaining};t={}", reset.as_secs_ceil()),
        LimitKind::Concurrency => format!("\"{id}\";r={remaining}"),
    }
}

/// One limit's state as a `RateLimit` item: `"id";r=<remaining>;t=<reset>`
/// (a concurrency limit, which does not reset: no `t`).
pub fn ratelimit_item(id: &str, remaining: u64, reset: Option<Span>) -> String {
    match reset {
        Some(reset) => format!("\"{id}\";r={remaining};t={}", reset.as_secs_ceil()),
        None => format!("\"{id}\";r={remaining}"),
    }
}

/// The fields an admitted call's answer gets (`ratelimit_headers:
/// always`): every limit of the policy, and the state of those that have
/// one to tell (`items`, from [`ratelimit_item`]).
pub fn admitted_headers(policy: &Policy, items: &[String]) -> Vec<(&'static str, String)> {
    let mut out = vec![(RATELIMIT_POLICY, ratelimit_policy_value(policy))];
    if !items.is_empty() {
        out.push((RATELIMIT, items.join(", ")));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_shared::validate::parse_policy;

    fn policy(json: &str) -> Policy {
        parse_policy(json).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        let ns = Span::from_nanos;
        assert_eq!(retry_after_value(ns(1)), "1");
        assert_eq!(retry_after_value(ns(0)), "1");
        assert_eq!(retry_after_value(ns(1_000_000_000)), "1");
        assert_eq!(retry_after_value(ns(1_000_000_001)), "2");
        assert_eq!(retry_after_value(Span::MAX), "18446744074");
    }

    #[test]
    fn policy_field_lists_rate_and_concurrency() {
        let p = policy(
            r#"{"name": "llm", "match": {"host": "api.llm.example"},
                "rate": {"requests": 600, "period": "1m"},
                "concurrency": {"max_in_flight": 50}}"#,
        );
        assert_eq!(
            ratelimit_policy_value(&p),
            r#""llm";q=600;w=60, "llm/in-flight";q=50;qu="concurrent-requests""#
        );
        let p = policy(
            r#"{"name": "fast", "match": {"host": "*"}, "rate": {"requests": 5, "period": "250ms"}}"#,
        );
        assert_eq!(ratelimit_policy_value(&p), r#""fast";q=20;w=1"#);
    }

    #[test]
    fn further_limits_are_listed() {
        let p = policy(
            r#"{"name": "openai", "match": {"host": "*"}, "rate": {"requests": 500, "period": "1m"},
                "limits": [{"name": "tpm", "rate": {"requests": 30000, "period": "1m"}},
                           {"name": "daily", "rate": {"requests": 2000000, "period": "1d", "algorithm": "fixed_window"}}]}"#,
        );
        assert_eq!(
            ratelimit_policy_value(&p),
            r#""openai";q=500;w=60, "tpm";q=30000;w=60, "daily";q=2000000;w=86400"#
        );
    }
}
