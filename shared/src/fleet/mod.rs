//! Fleet mode's arithmetic: one global limit shared by many Envoys through
//! shares the admin leases out at each sync, weighted by the demand each
//! Envoy reports. Pure: time is a parameter.
//!
//! An instance enforces the newest share it received while its lease runs;
//! once it lapses (the admin out of reach), the smaller of that share and an
//! even split of the limit among the instances the admin counted when it
//! made the share ([`share_in_force`]).
//!
//! The admin gives out only room the others may be using. Per instance it
//! keeps every share the instance may still apply (a sent answer may have
//! been lost, so until the instance says which it applies, any of them) and
//! reserves the largest: a running share in full, a lapsed one at its
//! fallback. The reservation of an instance it no longer hears from ends
//! half a lease after its last share ran out (one and a half lease periods
//! after its last sync, whichever is later): a dead instance's share goes
//! back to the rest within two lease periods of its death. A live instance
//! that misses syncs for that long is taken for dead.
//! An instance cut off from an admin that is still serving others (a
//! partition, not a crash) may then overshoot by its fallback; a stopped
//! admin reallocates nothing, so there the sum holds for good. An instance
//! that was itself stopped while its share lapsed enforces nothing of it
//! until a later sync ([`lapsed_asleep`]): it was not trying to sync, and
//! the admin may have taken it for dead.
//!
//! - [`allocation`]: splitting a limit among instances by demand.
//! - [`demand`]: what an instance wants and uses, read off its counters.
//! - [`fair_demand`]: demand weighed by key for a limit shared fairly.
//! - [`ledger`]: the admin's record of the shares it leased out.
//! - [`share_limits`]: the limits an instance applies for its share.

pub mod allocation;
pub mod demand;
pub mod fair_demand;
pub mod ledger;
mod ledger_parts;
mod member;
mod share;
pub mod share_limits;
pub mod share_tag;

use serde::{Deserialize, Serialize};

use crate::policy::Policy;

pub use allocation::{allocate, FLOOR_FRACTION, RATE_HEADROOM};
pub use demand::{demand_between, used_between, Demand, Usage};
pub use ledger::{share_in_force, FleetTerms, Held, Ledger, MemberState, Share, USED_WINDOW};
pub use share::{lapsed_asleep, sync_backoff_bound, STALL};
pub use share_limits::{limits_for_share, rate_for_share, ShareLimits, MIN_SHARE_BURST};
pub use share_tag::ShareTags;

/// A quantity of a limit: requests per second and calls in flight.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Amount {
    pub rate: f64,
    pub in_flight: u32,
}

impl Amount {
    /// A policy's limit as a rate per second and calls in flight (0 for
    /// what it does not limit).
    pub fn of_policy(policy: &Policy) -> Amount {
        Amount {
            rate: policy.rate.as_ref().map_or(0.0, Self::per_second),
            in_flight: policy.concurrency.as_ref().map_or(0, |c| c.max_in_flight),
        }
    }

    /// A global further limit's: its rate, no calls in flight.
    pub fn of_limit(limit: &crate::policy::limit::NamedLimit) -> Amount {
        Amount {
            rate: limit.rate.as_ref().map_or(0.0, Self::per_second),
            in_flight: 0,
        }
    }

    /// A rate as so many per second.
    pub fn per_second(rate: &crate::policy::rate::RateSpec) -> f64 {
        rate.requests as f64 / rate.period.as_span().as_secs_f64().max(1e-9)
    }

    pub fn max(self, other: Amount) -> Amount {
        Amount {
            rate: self.rate.max(other.rate),
            in_flight: self.in_flight.max(other.in_flight),
        }
    }

    pub fn min(self, other: Amount) -> Amount {
        Amount {
            rate: self.rate.min(other.rate),
            in_flight: self.in_flight.min(other.in_flight),
        }
    }

    pub fn plus(self, other: Amount) -> Amount {
        Amount {
            rate: self.rate + other.rate,
            in_flight: self.in_flight.saturating_add(other.in_flight),
        }
    }

    /// What is left of `self` after `other`, never below nothing.
    pub fn minus(self, other: Amount) -> Amount {
        Amount {
            rate: (self.rate - other.rate).max(0.0),
            in_flight: self.in_flight.saturating_sub(other.in_flight),
        }
    }
}
