//! The counters workers add up in shared data for the report: a policy's
//! (`Counters`, changed by `DeltaCounters`) and a further limit's
//! (`LimitCounters`).

use serde::{Deserialize, Serialize};
use sluice_shared::sync::PolicyReport;

/// A further limit's counters, summed over the workers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LimitCounters {
    pub admitted: u64,
    pub refused: u64,
    pub tokens: u64,
    /// A limit that listens to its provider: the provider's refusals,
    /// pauses begun, rate cuts.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub provider_refused: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub pauses: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub rate_cuts: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl LimitCounters {
    pub fn add(&mut self, other: &LimitCounters) {
        self.admitted = self.admitted.wrapping_add(other.admitted);
        self.refused = self.refused.wrapping_add(other.refused);
        self.tokens = self.tokens.wrapping_add(other.tokens);
        self.provider_refused = self.provider_refused.wrapping_add(other.provider_refused);
        self.pauses = self.pauses.wrapping_add(other.pauses);
        self.rate_cuts = self.rate_cuts.wrapping_add(other.rate_cuts);
    }
}

/// Counters as workers add them up; `in_flight` moves both ways, so it is
/// summed with wrapping arithmetic and read as the net total.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    pub admitted: u64,
    pub rejected: u64,
    pub queued: u64,
    pub queue_timeouts: u64,
    pub shadow_limited: u64,
    pub in_flight: u64,
    #[serde(default)]
    pub port_hidden: u64,
}

impl Counters {
    pub fn add(&mut self, other: &DeltaCounters) {
        self.admitted = self.admitted.wrapping_add_signed(other.admitted);
        self.rejected = self.rejected.wrapping_add_signed(other.rejected);
        self.queued = self.queued.wrapping_add_signed(other.queued);
        self.queue_timeouts = self
            .queue_timeouts
            .wrapping_add_signed(other.queue_timeouts);
        self.shadow_limited = self
            .shadow_limited
            .wrapping_add_signed(other.shadow_limited);
        self.in_flight = self.in_flight.wrapping_add_signed(other.in_flight);
        self.port_hidden = self.port_hidden.wrapping_add_signed(other.port_hidden);
    }

    pub fn to_report(self) -> PolicyReport {
        PolicyReport {
            admitted: self.admitted,
            rejected: self.rejected,
            queued: self.queued,
            queue_timeouts: self.queue_timeouts,
            shadow_limited: self.shadow_limited,
            port_hidden: self.port_hidden,
            // A net total below zero can only be a worker that died mid-count.
            in_flight: if (self.in_flight as i64) < 0 {
                0
            } else {
                self.in_flight
            },
            ..PolicyReport::default()
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeltaCounters {
    pub admitted: i64,
    pub rejected: i64,
    pub queued: i64,
    pub queue_timeouts: i64,
    pub shadow_limited: i64,
    pub in_flight: i64,
    pub port_hidden: i64,
}

impl DeltaCounters {
    pub fn is_zero(&self) -> bool {
        *self == Self::default()
    }
}
