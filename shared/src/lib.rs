//! Sluice's pure core, what the filter and the admin both use: the policy
//! schema, its validation, the limiter algorithms, provider signals, usage
//! parsing, key hashing and the per-key view, and fleet allocation. No
//! I/O and no clock: the Envoy filter and the admin service are thin
//! shells around it, and everything here is tested natively with time
//! passed in. What the filter
//! and the admin say to each other is `sluice_wire`'s; the filter's own
//! decisions (matching, buckets, refusal headers, its configuration) are
//! `sluice_filter_core`'s; the admin's JSON API is `sluice_api`'s.

#![forbid(unsafe_code)]

pub mod budget_tree;
pub mod calendar;
pub mod duration;
pub mod fair;
pub mod fleet;
pub mod header_names;
pub mod instance;
pub mod json_path;
pub mod key_hash;
pub mod key_view;
pub mod limiter;
pub mod policy;
pub mod pool;
pub mod price;
pub mod prompt;
pub mod provider;
pub mod request_headers;
pub mod request_json;
pub mod spend;
pub mod stream_usage;
pub mod time;
pub mod usage;
pub mod validate;
pub mod warn;

pub use duration::DurationMs;
pub use key_hash::KeySecret;
pub use policy::*;
pub use request_headers::RequestHeaders;
pub use time::{Instant, Span};
pub use validate::{
    parse_policy, parse_policy_set, validate_policy_set, FieldError, ValidationErrors,
};

/// The JSON Schema of a policy set, as published in `docs/policy.schema.json`.
#[cfg(feature = "schema")]
pub fn policy_set_schema() -> serde_json::Value {
    let schema = schemars::schema_for!(PolicySet);
    serde_json::to_value(schema).unwrap_or_default()
}
