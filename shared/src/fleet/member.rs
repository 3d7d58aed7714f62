//! One instance as a fleet ledger keeps it: its demand, the shares it may
//! still apply, when it was last heard and whether its connections closed;
//! what of the limit it may be enforcing now, and until when.

use serde::{Deserialize, Serialize};

use super::demand::{Demand, Usage};
use super::fair_demand::KeyDemand;
use super::share::{share_in_force, Share};
use super::Amount;
use crate::time::{millis, Instant, Span};

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(super) struct Member {
    pub(super) demand: Demand,
    #[serde(rename = "last_heard_ms", with = "millis")]
    pub(super) last_heard: Instant,
    /// The shares it may still apply, oldest first.
    #[serde(rename = "grants")]
    pub(super) shares: Vec<Share>,
    /// Its counters at its last sync, to turn the next ones into rates.
    #[serde(default)]
    pub(super) usage: Option<Usage>,
    /// What it admitted per second over the last whole window of at least
    /// [`USED_WINDOW`], and held in flight at its last sync.
    #[serde(default)]
    pub(super) used: Amount,
    /// Its counters where the current window began.
    #[serde(default)]
    pub(super) used_since: Option<Usage>,
    /// Time between its last two syncs.
    #[serde(default, rename = "sync_gap_ms", with = "millis")]
    pub(super) sync_gap: Span,
    /// When a connection of its to the admin closed (see
    /// [`Ledger::departed`]), if it has not synced since.
    #[serde(default, rename = "departed_ms", with = "millis")]
    pub(super) departed: Instant,
    /// At its last sync, what its target gave it beyond the share it got:
    /// room the others still held (see [`Ledger::held_back`]).
    #[serde(default)]
    pub(super) held_back: Amount,
    /// Its demand jumped at its last sync: the next whole count is taken
    /// as it is (`demand::settle`).
    #[serde(default)]
    pub(super) settling: bool,
    /// For a limit shared fairly, its keys as its last sync reported them
    /// (see `fair_demand`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(super) fair: Vec<KeyDemand>,
    /// The share it named that this ledger had no record of (see
    /// [`Ledger::sync`]), while the ledger recovers: that room was its
    /// own, so it may be given it again even after it applied a smaller
    /// share meanwhile (the first one after it came back, made before its
    /// demand was known).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) claimed: Option<Share>,
    /// When it last claimed a share this ledger had no record of: one
    /// claim a lease, at most.
    #[serde(default, rename = "claimed_at_ms", with = "millis")]
    pub(super) claimed_at: Instant,
}

/// How long a ledger keeps what a member may enforce reserved: a lease
/// and a half past its last share or sync (sooner once it is taken for
/// dead), and in any case until `silent_until` (see
/// `Ledger::keep_the_silent_until`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Keeping {
    pub(super) lease: Span,
    pub(super) silent_until: Instant,
}

/// An instance whose connection closed is taken for dead once it has
/// not synced for this many of its sync intervals since...
const DEPARTURE_SYNCS: u64 = 3;
/// ...and at least this long. A live Envoy under load syncs late, and one
/// taken for dead keeps enforcing its share while the others are given
/// its room; three intervals and 600 ms still move a killed one's share
/// well within a lease.
const DEPARTURE_GRACE: Span = Span::from_millis(600);
/// A sync heard this soon after the instance's connection closed may have
/// been sent before it died (its VMs call over connections of their own,
/// and a report in flight on one arrives after another's close): it does
/// not prove the instance alive. Its next sync does. Taken as proof, a
/// SIGKILLed Envoy's share stayed reserved for a lease and a half (the
/// simulator's fleet, seed 33).
const DEPARTURE_IN_FLIGHT: Span = Span::from_millis(200);

impl Member {
    /// It synced at `now`: the gap since its last sync is measured, and
    /// a departure noted before is void, unless this sync may have been
    /// sent before it died ([`DEPARTURE_IN_FLIGHT`]).
    pub(super) fn heard(&mut self, now: Instant) {
        if self.last_heard > Instant::EPOCH && now > self.last_heard {
            self.sync_gap = now - self.last_heard;
        }
        self.last_heard = now;
        if now > self.departed + DEPARTURE_IN_FLIGHT {
            self.departed = Instant::EPOCH;
        }
    }

    /// The most it may be enforcing now (0 once its reservation ended).
    pub(super) fn reserved(&self, limit: Amount, keeping: Keeping, now: Instant) -> Amount {
        if now >= self.reserved_until(keeping) {
            return Amount::default();
        }
        self.shares
            .iter()
            .map(|&s| share_in_force(Some(s), limit, now))
            .fold(Amount::default(), Amount::max)
    }

    pub(super) fn reserved_until(&self, keeping: Keeping) -> Instant {
        let lease = keeping.lease;
        // The fallback after a lapsed share stays reserved this long: an
        // instance that merely missed a few syncs is not given away.
        let grace = lease.div(2);
        let last_share_ends = self
            .shares
            .iter()
            .map(|s| s.expires_at + grace)
            .max()
            .unwrap_or(Instant::EPOCH);
        let until = last_share_ends.max(self.last_heard + lease + grace);
        let until = match self.dead_from() {
            Some(dead) => until.min(dead),
            None => until,
        };
        // While the admin turns syncs away, silence and closed connections
        // (an Envoy giving up on a sync the admin was slow to answer closes
        // it) prove nothing.
        until.max(keeping.silent_until)
    }

    /// When a departed instance counts as dead: its connection closed and
    /// it missed its next syncs (a live one whose connection merely closed syncs
    /// on).
    fn dead_from(&self) -> Option<Instant> {
        if self.departed == Instant::EPOCH || self.departed + DEPARTURE_IN_FLIGHT < self.last_heard
        {
            return None;
        }
        let wait = self
            .sync_gap
            .saturating_mul(DEPARTURE_SYNCS)
            .max(DEPARTURE_GRACE);
        Some(self.departed + wait)
    }
}
