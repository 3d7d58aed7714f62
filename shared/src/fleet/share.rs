//! A share of a global limit, and what an instance holding one enforces
//! (the share while it runs, then its fallback).

use serde::{Deserialize, Serialize};

use super::Amount;
use crate::time::{millis, Instant, Span};

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

/// A gap between two runs of an instance's worker longer than this is a
/// stall (a stopped process, a machine too loaded to run it): a running
/// worker applies its shares at every tick, 100 ms apart.
pub const STALL: Span = Span::from_secs(1);

/// Whether an instance's worker, which last applied its shares at
/// `last_ran` and does again at `now`, slept through the end of `share`'s
/// lease: it lapsed during a [`STALL`]. Such a share gives nothing, not
/// its fallback, until a later sync brings another: the admin, which
/// heard nothing from the instance meanwhile, may have taken it for dead
/// and given the room to the others (the reservation of a silent
/// instance's fallback ends a lease and a half after its last sync). A
/// worker that ran as its share lapsed (the admin out of reach) keeps the
/// fallback: it was trying to sync all along.
pub fn lapsed_asleep(share: &Share, last_ran: Instant, now: Instant) -> bool {
    now - last_ran > STALL && share.expires_at > last_ran && share.expires_at <= now
}

/// The longest an instance holding shares leased for `leases` may wait
/// between two sync attempts while they fail: half the shortest lease,
/// and never more than `most`. The admin keeps a silent instance's
/// reservation a lease and a half after it last heard it, while the
/// instance enforces its fallback for as long as its syncs fail: one
/// that waited longer (5 s at a 3 s lease, its one answer after an
/// admin outage lost) was taken for dead while it enforced its fallback,
/// and the fleet enforced 341 of a limit of 290 (the simulator's
/// `an_admin_outage_never_costs_the_limit_and_shares_come_back`, seed
/// 284).
pub fn sync_backoff_bound(leases: impl IntoIterator<Item = Span>, most: Span) -> Span {
    leases
        .into_iter()
        .map(|lease| lease.div(2))
        .fold(most, Span::min)
}

fn even_split(limit: Amount, instances: u32) -> Amount {
    let n = instances.max(1);
    Amount {
        rate: limit.rate / f64::from(n),
        in_flight: limit.in_flight / n,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> Instant {
        Instant::from_millis(ms)
    }

    fn ending(ms: u64) -> Share {
        Share {
            amount: Amount {
                rate: 10.0,
                in_flight: 2,
            },
            expires_at: at(ms),
            instances: 2,
        }
    }

    #[test]
    fn syncs_back_off_at_most_half_the_shortest_lease() {
        let most = Span::from_secs(5);
        assert_eq!(sync_backoff_bound([], most), most);
        assert_eq!(
            sync_backoff_bound([Span::from_secs(20), Span::from_secs(3)], most),
            Span::from_millis(1_500)
        );
        assert_eq!(sync_backoff_bound([Span::from_secs(60)], most), most);
    }

    #[test]
    fn only_a_lease_that_ends_during_a_stall_lapsed_asleep() {
        // Ticking through its end (100 ms apart): seen, the fallback holds.
        assert!(!lapsed_asleep(&ending(5_000), at(4_950), at(5_050)));
        // Stalled from 4 s to 9 s across it: asleep.
        assert!(lapsed_asleep(&ending(5_000), at(4_000), at(9_000)));
        // Ending at the very instant the worker woke: asleep too.
        assert!(lapsed_asleep(&ending(9_000), at(4_000), at(9_000)));
        // Ended before the stall (the admin out of reach, the worker
        // running): its fallback was seen and stays.
        assert!(!lapsed_asleep(&ending(3_000), at(4_000), at(9_000)));
        // Still running after the stall: the admin still reserves it.
        assert!(!lapsed_asleep(&ending(9_001), at(4_000), at(9_000)));
        // A gap of exactly STALL is not one.
        assert!(!lapsed_asleep(&ending(5_000), at(4_500), at(5_500)));
    }
}
