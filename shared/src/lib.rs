//! Sluice's pure core: the policy schema, its validation, request matching,
//! the limiter algorithms and the response header values. No I/O and no
//! clock: the Envoy filter and the admin service are thin shells around it,
//! and everything here is tested natively with time passed in.

pub mod api;
pub mod bucket;
pub mod counts;
pub mod duration;
pub mod fleet;
pub mod headers;
pub mod key_hash;
pub mod key_view;
pub mod limiter;
pub mod matcher;
pub mod people;
pub mod plugin;
pub mod policy;
pub mod policy_diff;
pub mod provider;
pub mod request_headers;
pub mod stats;
pub mod sync;
pub mod sync_answer;
pub mod time;
pub mod usage;
pub mod validate;

pub use duration::DurationMs;
pub use key_hash::KeySecret;
pub use matcher::{BucketKey, Classification, CompiledPolicy, CompiledPolicySet};
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
