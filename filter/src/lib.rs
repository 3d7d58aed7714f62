//! The Sluice proxy-wasm filter: a thin adapter between Envoy and the pure
//! decisions of `sluice-shared`.
//!
//! - [`host`]: every call into Envoy, behind a trait; [`clock`]: its wall
//!   clock made monotonic.
//! - [`kept_headers`]: a request's headers, each read from Envoy once
//!   (the native build); [`header_pairs`]: all of them in one host call
//!   (the wasm build).
//! - [`entries`]: every shared-data entry's key and layout.
//! - [`shared_memory`]: shared data in process memory (the native
//!   module's, and the rule the tests' host keeps).
//! - [`store`]: values in shared data, updated by compare-and-swap; every
//!   failure counted and logged there.
//! - [`sync`]: policy sets from the admin, the held watch
//!   ([`sync::watch`]) and shares of global limits ([`sync::fleet`]);
//!   [`report`]: utilization to it, from the [`counters`] the workers add
//!   up.
//! - [`prefetch`]: tokens and slots a worker takes ahead, far from a limit.
//! - [`metrics`]: stats, batched per worker.
//! - [`worker`]: the per-VM logic (match, admit, queue, release, tick).
//! - [`stream_shell`]: a stream's hooks turned into worker calls, for
//!   both builds' streams.
//! - `envoy` (wasm only): the proxy-wasm contexts that drive the worker.

pub mod clock;
pub mod counters;
pub mod entries;
pub mod header_pairs;
pub mod host;
pub mod kept_headers;
pub mod metrics;
pub mod prefetch;
pub mod report;
pub mod shared_memory;
pub mod store;
pub mod stream_shell;
pub mod sync;
pub mod worker;

#[cfg(target_arch = "wasm32")]
mod envoy;

#[cfg(test)]
mod testing;
#[cfg(test)]
mod tests;
