//! End-to-end test support: the mock third-party API, the real Envoy
//! process, and load generation.

pub mod admin;
pub mod browser;
pub mod demo_load;
pub mod envoy;
pub mod load;
pub mod mock;
pub mod postgres;
pub mod procinfo;
pub mod redis;
