//! What the Sluice filter and the admin say to each other: the filter's
//! sync report ([`sync`]), the admin's answer ([`sync_answer`]), and the
//! counters a report carries, declared once by family ([`stats`]) and
//! held, summed and shown generically ([`counts`]). Both sides depend on
//! this crate and never on each other; the policy set itself and the
//! algorithms are `sluice_shared`'s.

#![forbid(unsafe_code)]

pub mod counts;
pub mod stats;
pub mod sync;
pub mod sync_answer;
