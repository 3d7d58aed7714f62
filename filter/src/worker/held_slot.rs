//! A slot a call holds, in a further concurrency limit's lease table or
//! in a fair slots table: what `slots` and `fair` hand out and `streams`
//! gives back (its own module, so that neither of those imports the
//! other for it).

use sluice_shared::time::{Instant, Span};

/// One slot a call holds: where, which of this worker's leases there, and
/// how long that lease lives unrenewed; in a fair slots table, the key it
/// counts for (`fair_key`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldSlot {
    pub key: String,
    pub lease: Instant,
    pub ttl: Span,
    pub fair_key: Option<u64>,
}
