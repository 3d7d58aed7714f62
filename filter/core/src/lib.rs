//! The filter's pure decisions, apart from proxy-wasm and tested natively
//! with time passed in: which policy a request falls under, its key, cost
//! and priority ([`matcher`]), the state of a policy's bucket and how it
//! admits and queues ([`bucket`]), the values of a refusal's headers
//! ([`headers`]) and the plugin configuration ([`plugin`]). Only the
//! filter (and its tests and benchmarks) uses them; what the admin uses as
//! well is `sluice_shared`'s.

#![forbid(unsafe_code)]

pub mod body;
pub mod bucket;
pub mod headers;
pub mod matcher;
pub mod mcp;
pub mod plugin;
pub mod pool;
pub mod pricing;

pub use matcher::{BucketKey, Classification, CompiledPolicy, CompiledPolicySet};
