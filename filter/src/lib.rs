//! The Sluice proxy-wasm filter: a thin adapter between Envoy and the pure
//! decisions of `sluice-shared`.
//!
//! - [`host`]: every call into Envoy, behind a trait.
//! - [`store`]: bucket states in shared data, updated by compare-and-swap.
//! - [`sync`]: policy sets from the admin, and utilization reports to it.
//! - [`fleet`]: shares of global limits granted by the admin (fleet mode).
//! - [`worker`]: the per-VM logic (match, admit, queue, release, tick).
//! - `envoy` (wasm only): the proxy-wasm contexts that drive the worker.

pub mod fleet;
pub mod grants;
pub mod host;
pub mod metrics;
pub mod store;
pub mod sync;
pub mod worker;

#[cfg(target_arch = "wasm32")]
mod envoy;

#[cfg(test)]
mod testing;
#[cfg(test)]
mod tests;
