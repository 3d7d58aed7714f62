//! Sluice as a native Envoy dynamic module: the same [`Worker`] and core
//! crates as the wasm filter, behind a second [`Host`].
//!
//! - `abi`: the parts of Envoy's C ABI Sluice calls, declared by hand.
//! - `hooks`: the event hooks Envoy calls.
//! - `module`: a filter configuration: its workers' slots, the ticker
//!   thread, mailboxes of waiting streams, callouts.
//! - `workers`: its workers made, started and ticked, each with its host.
//! - `host`: the [`Host`] seam (shared data in process memory).
//! - `stream`: one stream's hooks turned into calls on its worker.
//! - `stats`: stats through Envoy's labelled dynamic-module metrics.
//!
//! [`Worker`]: sluice_filter::worker::Worker
//! [`Host`]: sluice_filter::host::Host

mod abi;
mod hooks;
mod host;
mod module;
mod stats;
mod stream;
mod workers;
