//! A share of a global limit, and what an instance holding one enforces
//! (the share while it runs, then its fallback).

use serde::{Deserialize, Serialize};

use super::Amount;
use crate::time::{millis, Instant};

/// A share of the global limit leased to one instance until `expires_at`;
/// `instances` is how many the admin counted when it made it (what a
/// lapsed share falls back to splits the limit that many ways). Field names
/// on the wire and in Redis are the ones the first release wrote.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Share {
    #[serde(rename = "share")]
    pub amount: Amount,
    #[serde(rename = "expires_at_ms", with = "millis")]
    pub expires_at: Instant,
    pub instances: u32,
}

impl Share {
    /// The id an instance echoes to say it applies this share: its expiry,
    /// in milliseconds of the admin's clock (unique per instance, since
    /// each sync leases until later).
    pub fn id(&self) -> u64 {
        self.expires_at.as_millis()
    }
}

/// The share an instance enforces of a global limit, given the newest
/// share it received: that share while its lease runs, then the smaller of
/// it and an even split (never more than either). Nothing before its first
/// share: the admin has reserved nothing for it yet (the first sync is at
/// start).
pub fn share_in_force(newest: Option<Share>, limit: Amount, now: Instant) -> Amount {
    match newest {
        None => Amount::default(),
        Some(s) if s.expires_at > now => s.amount,
        Some(s) => s.amount.min(even_split(limit, s.instances)),
    }
}

fn even_split(limit: Amount, instances: u32) -> Amount {
    let n = instances.max(1);
    Amount {
        rate: limit.rate / f64::from(n),
        in_flight: limit.in_flight / n,
    }
}
