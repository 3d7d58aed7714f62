//! A call that holds its policy's further limits as it goes upstream,
//! whether its request was decided at once or its turn in the queue came:
//! what the parts acting on its answer need, handed over in one place
//! (`Parts::hold` in `mod.rs`) for both ways.

use sluice_filter_core::pricing::CallPrice;

use super::limits::{LimitPlace, PastWarning};
use super::pool::PoolCall;
use super::spend::KeyLabels;

#[derive(Debug)]
pub(super) struct Holding {
    pub context_id: u32,
    /// The policy whose limits it holds (for a pool call, its member's).
    pub policy_index: usize,
    /// What it took from each of them, with its key in each, and where.
    pub costs: Vec<u64>,
    pub keys: Vec<Option<u64>>,
    pub places: Vec<LimitPlace>,
    /// Its model's prices, for its money limits.
    pub price: Option<CallPrice>,
    /// Limits it left past a warning line.
    pub warnings: Vec<PastWarning>,
    /// Its keys' labels for the live view, found while its request was
    /// at hand.
    pub labels: KeyLabels,
    /// A pool call: its pool's policy, the member chosen, and what it
    /// would cost at each member.
    pub pool: Option<PoolRoute>,
}

#[derive(Debug)]
pub(super) struct PoolRoute {
    pub pool_index: usize,
    pub chosen: usize,
    pub call: Box<PoolCall>,
}
