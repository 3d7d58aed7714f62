//! Helpers for the end-to-end tests (step 2): the mock third-party API and
//! process management for Envoy.
