//! The Sluice proxy-wasm filter (built in step 2): a thin adapter that moves
//! request headers and shared-data bytes between Envoy and `sluice-shared`.

pub use sluice_shared as core;
