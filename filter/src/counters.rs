//! The counters workers add up in shared data for the report: a policy's
//! (`Counters`, changed by `DeltaCounters`) and a further limit's
//! (`LimitCounters`), each a [`Counts`] of the families in
//! `sluice_wire::stats`.

use serde::{Deserialize, Serialize};
use sluice_wire::counts::Counts;
use sluice_wire::stats::{LimitCounter, PolicyCounter, ProviderCounter};
use sluice_wire::sync::PolicyReport;

/// A policy's counters summed over the workers; `in_flight` moves both
/// ways, so it is summed with wrapping arithmetic and read as the net
/// total.
pub type Counters = Counts<PolicyCounter>;

/// One worker's changes to a policy's counters since it last reported.
pub type DeltaCounters = Counts<PolicyCounter, i64>;

/// A further limit's counters, summed over the workers: its own, and what
/// its provider said.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LimitCounters {
    #[serde(flatten)]
    pub counts: Counts<LimitCounter>,
    #[serde(default)]
    pub provider: Counts<ProviderCounter>,
}

impl LimitCounters {
    pub fn add(&mut self, other: &LimitCounters) {
        self.counts.add_all(&other.counts);
        self.provider.add_all(&other.provider);
    }
}

/// A policy's counters as the report carries them.
pub fn policy_report(counters: Counters) -> PolicyReport {
    PolicyReport {
        counts: counters.settled(),
        ..PolicyReport::default()
    }
}
