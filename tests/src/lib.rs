//! End-to-end test support: the real Envoy process, the admin process,
//! PostgreSQL and Redis, a headless browser, and load generation. The mock
//! third-party API is the demo's (`sluice_demo::mock`).

#![forbid(unsafe_code)]

pub mod admin;
pub mod browser;
pub mod counting;
pub mod envoy;
pub mod fair;
pub mod fleet;
pub mod llm_budgets;
pub mod load;
pub mod postgres;
pub mod procinfo;
pub mod redis;
pub mod rlqs;
