//! `sluice-sim`: a deterministic simulator of Sluice. The real worker
//! (the [`sluice_filter::worker::Worker`] both builds run), driven through
//! the real stream hooks ([`sluice_filter::stream_shell::StreamShell`]),
//! in virtual time, against simulated providers and callers; every choice
//! drawn from one seed, so that a seed gives the same run, byte for byte,
//! and a failing property names the seed that replays it.
//!
//! - [`admin`]: the admin's real fleet ledgers and provider relay,
//!   answering syncs in virtual time.
//! - [`host`]: the filter's `Host` over an Envoy's shared data and the
//!   virtual clock; faults (a shared-data write failing) by seed.
//! - [`envoy`]: one Envoy's workers and streams.
//! - [`fleet`]: the network between the Envoys and the admin (latency,
//!   loss, the admin down), and what the Envoys held of global limits.
//! - [`provider`]: upstreams shaped as real providers limit;
//!   [`pool`]: a pool's members as Envoy routes to them and retries.
//! - [`callers`]: greedy and paced callers.
//! - [`world`]: the event loop (its callers' side in `world/calls.rs`);
//!   [`trace`]: what a run did, per second.
//! - [`property`]: many seeds, the failing one replayed.

#![forbid(unsafe_code)]

pub mod admin;
pub mod callers;
pub mod envoy;
pub mod fleet;
pub mod headers;
pub mod host;
pub mod pool;
pub mod property;
pub mod provider;
pub mod rng;
pub mod trace;
pub mod world;

/// Every executable linking the simulator (its properties) allocates
/// through mimalloc: see Cargo.toml.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;
