//! Concurrency limit as a lease table: one lease per holder (an Envoy worker
//! VM), counting the slots that holder has in flight and expiring at a
//! deadline the holder keeps renewing. A holder that dies (VM crash or
//! restart) stops renewing, and its slots come back after the lease TTL.
//!
//! One lease per holder rather than per request keeps the shared value small
//! (a few dozen workers, not thousands of requests), so every compare-and-
//! swap moves a few hundred bytes at most whatever `max_in_flight` is.
//!
//! A lease is known by when it began ([`Lease::since`]): a holder whose
//! lease expired and was reclaimed, and that took a new one since, releases
//! a slot of the old one as nothing, never a slot of the new one.

use super::{Decision, DecodeError};
use crate::policy::on_limit::Priority;
use crate::time::{Instant, Span};

/// The fixed parameters of a concurrency limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConcurrencyLimit {
    pub max_in_flight: u32,
    /// Slots only high-priority requests may take.
    pub reserved_for_high: u32,
    pub lease_ttl: Span,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    pub holder: u64,
    pub count: u32,
    pub expires_at: Instant,
    /// When the holder took it: which of its leases this is.
    pub since: Instant,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LeaseTable {
    leases: Vec<Lease>,
}

impl LeaseTable {
    /// The most holders tracked at once; a table full of live holders refuses
    /// a new holder rather than growing without bound.
    pub const MAX_HOLDERS: usize = 1024;
    /// Bytes of one encoded lease.
    pub const LEASE_LEN: usize = 28;

    pub fn leases(&self) -> &[Lease] {
        &self.leases
    }

    /// Slots held by unexpired leases.
    pub fn in_flight(&self) -> u32 {
        self.leases
            .iter()
            .fold(0u32, |sum, l| sum.saturating_add(l.count))
    }

    pub fn held_by(&self, holder: u64) -> u32 {
        self.leases
            .iter()
            .find(|l| l.holder == holder)
            .map_or(0, |l| l.count)
    }

    /// Which lease `holder` holds now (its start), if any.
    pub fn lease_of(&self, holder: u64) -> Option<Instant> {
        self.leases
            .iter()
            .find(|l| l.holder == holder)
            .map(|l| l.since)
    }

    /// Drops leases whose holder stopped renewing before `now`; returns the
    /// slots reclaimed.
    pub fn reclaim_expired(&mut self, now: Instant) -> u32 {
        let mut reclaimed = 0u32;
        self.leases.retain(|l| {
            let live = l.expires_at >= now;
            if !live {
                reclaimed = reclaimed.saturating_add(l.count);
            }
            live
        });
        reclaimed
    }

    /// Takes one slot for `holder` if the limit allows it for `priority`.
    pub fn acquire(
        &mut self,
        limit: &ConcurrencyLimit,
        holder: u64,
        now: Instant,
        priority: Priority,
    ) -> Decision {
        self.reclaim_expired(now);
        let ceiling = match priority {
            Priority::High => limit.max_in_flight,
            Priority::Normal => limit.max_in_flight.saturating_sub(limit.reserved_for_high),
        };
        let in_flight = self.in_flight();
        let position = self.leases.iter().position(|l| l.holder == holder);
        let has_room = in_flight < ceiling;
        let has_place = position.is_some() || self.leases.len() < Self::MAX_HOLDERS;
        if !has_room || !has_place {
            return Decision::Deny {
                // No schedule for a slot to free: suggest a short retry.
                retry_after: Span::from_secs(1),
                reset_after: Span::ZERO,
            };
        }
        let expires_at = now + limit.lease_ttl;
        match position {
            Some(i) => {
                let lease = &mut self.leases[i];
                lease.count = lease.count.saturating_add(1);
                lease.expires_at = lease.expires_at.max(expires_at);
            }
            None => self.leases.push(Lease {
                holder,
                count: 1,
                expires_at,
                since: now,
            }),
        }
        Decision::Admit {
            remaining: u64::from(ceiling - in_flight - 1),
            reset_after: Span::ZERO,
        }
    }

    /// Takes `n` more slots for `holder` at once (spares its worker hands
    /// to its own requests), if they fit under the normal-priority ceiling.
    pub fn acquire_many(
        &mut self,
        limit: &ConcurrencyLimit,
        holder: u64,
        now: Instant,
        n: u32,
    ) -> bool {
        self.reclaim_expired(now);
        let ceiling = limit.max_in_flight.saturating_sub(limit.reserved_for_high);
        let fits = self.in_flight().saturating_add(n) <= ceiling;
        let Some(lease) = self.leases.iter_mut().find(|l| l.holder == holder) else {
            return false;
        };
        if n == 0 || !fits {
            return false;
        }
        lease.count = lease.count.saturating_add(n);
        lease.expires_at = lease.expires_at.max(now + limit.lease_ttl);
        true
    }

    /// Slots free for a normal-priority request.
    pub fn free_for_normal(&self, limit: &ConcurrencyLimit) -> u32 {
        limit
            .max_in_flight
            .saturating_sub(limit.reserved_for_high)
            .saturating_sub(self.in_flight())
    }

    /// Returns `n` slots of `holder`'s lease `lease` (fewer if it holds
    /// fewer, none if that lease is over); returns how many it gave back.
    pub fn release_many(&mut self, holder: u64, lease: Instant, n: u32) -> u32 {
        let Some(i) = self
            .leases
            .iter()
            .position(|l| l.holder == holder && l.since == lease)
        else {
            return 0;
        };
        let lease = &mut self.leases[i];
        let given = n.min(lease.count);
        lease.count -= given;
        if lease.count == 0 {
            self.leases.swap_remove(i);
        }
        given
    }

    /// Returns one slot of `holder`'s lease `lease`. False if that lease is
    /// over (it expired and was reclaimed, maybe replaced by a newer one):
    /// nothing is taken from others, nor from the holder's newer lease.
    pub fn release(&mut self, holder: u64, lease: Instant) -> bool {
        let Some(i) = self
            .leases
            .iter()
            .position(|l| l.holder == holder && l.since == lease)
        else {
            return false;
        };
        let lease = &mut self.leases[i];
        if lease.count <= 1 {
            self.leases.swap_remove(i);
        } else {
            lease.count -= 1;
        }
        true
    }

    /// Pushes the holder's deadline to `now + ttl`, as a live worker does on
    /// its periodic tick.
    pub fn renew(&mut self, holder: u64, now: Instant, ttl: Span) -> bool {
        match self.leases.iter_mut().find(|l| l.holder == holder) {
            Some(lease) => {
                lease.expires_at = lease.expires_at.max(now + ttl);
                true
            }
            None => false,
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(4 + self.leases.len() * Self::LEASE_LEN);
        let n = u32::try_from(self.leases.len()).unwrap_or(u32::MAX);
        out.extend_from_slice(&n.to_le_bytes());
        for l in &self.leases {
            out.extend_from_slice(&l.holder.to_le_bytes());
            out.extend_from_slice(&l.count.to_le_bytes());
            out.extend_from_slice(&l.expires_at.as_nanos().to_le_bytes());
            out.extend_from_slice(&l.since.as_nanos().to_le_bytes());
        }
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        let (count, body) = bytes.split_first_chunk::<4>().ok_or(DecodeError::Length {
            expected: 4,
            found: bytes.len(),
        })?;
        let n = u32::from_le_bytes(*count) as usize;
        if n > Self::MAX_HOLDERS || body.len() != n * Self::LEASE_LEN {
            return Err(DecodeError::Length {
                expected: 4 + n.min(Self::MAX_HOLDERS) * Self::LEASE_LEN,
                found: bytes.len(),
            });
        }
        let leases = body
            .chunks_exact(Self::LEASE_LEN)
            .map(|c| {
                let (holder, rest) = c.split_at(8);
                let (count, rest) = rest.split_at(4);
                let (expires, since) = rest.split_at(8);
                let instant = |b: &[u8]| {
                    Instant::from_nanos(u64::from_le_bytes(b.try_into().unwrap_or_default()))
                };
                Lease {
                    holder: u64::from_le_bytes(holder.try_into().unwrap_or_default()),
                    count: u32::from_le_bytes(count.try_into().unwrap_or_default()),
                    expires_at: instant(expires),
                    since: instant(since),
                }
            })
            .collect();
        Ok(Self { leases })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMIT: ConcurrencyLimit = ConcurrencyLimit {
        max_in_flight: 3,
        reserved_for_high: 1,
        lease_ttl: Span::from_secs(10),
    };

    fn at(secs: u64, ns: u64) -> Instant {
        Instant::from_nanos(secs * 1_000_000_000 + ns)
    }

    fn admitted(d: Decision) -> bool {
        matches!(d, Decision::Admit { .. })
    }

    #[test]
    fn normal_requests_leave_the_reserved_slot_to_high_priority() {
        let mut t = LeaseTable::default();
        assert!(admitted(t.acquire(&LIMIT, 1, at(0, 0), Priority::Normal)));
        assert!(admitted(t.acquire(&LIMIT, 2, at(0, 0), Priority::Normal)));
        assert!(!admitted(t.acquire(&LIMIT, 1, at(0, 0), Priority::Normal)));
        assert!(admitted(t.acquire(&LIMIT, 1, at(0, 0), Priority::High)));
        assert!(!admitted(t.acquire(&LIMIT, 3, at(0, 0), Priority::High)));
        assert_eq!(t.in_flight(), 3);
        let lease = t.lease_of(1).unwrap();
        assert!(t.release(1, lease));
        assert!(admitted(t.acquire(&LIMIT, 3, at(0, 0), Priority::High)));
    }

    #[test]
    fn a_dead_holder_slots_return_after_the_ttl() {
        let mut t = LeaseTable::default();
        for _ in 0..3 {
            assert!(admitted(t.acquire(&LIMIT, 7, at(0, 0), Priority::High)));
        }
        assert!(!admitted(t.acquire(&LIMIT, 8, at(5, 0), Priority::High)));
        // Holder 7 never renews or releases.
        assert!(admitted(t.acquire(&LIMIT, 8, at(10, 1), Priority::High)));
        assert_eq!(t.held_by(7), 0);
        // Its late release takes nothing from holder 8.
        assert!(!t.release(7, at(0, 0)));
        assert_eq!(t.in_flight(), 1);
    }

    #[test]
    fn renewing_keeps_a_long_request_slot() {
        let mut t = LeaseTable::default();
        assert!(admitted(t.acquire(&LIMIT, 1, at(0, 0), Priority::Normal)));
        assert!(t.renew(1, at(8, 0), LIMIT.lease_ttl));
        assert_eq!(t.reclaim_expired(at(15, 0)), 0);
        assert_eq!(t.reclaim_expired(at(18, 1)), 1);
    }

    #[test]
    fn release_never_goes_below_zero() {
        let mut t = LeaseTable::default();
        assert!(!t.release(1, at(0, 0)));
        assert!(admitted(t.acquire(&LIMIT, 1, at(0, 0), Priority::Normal)));
        assert!(t.release(1, at(0, 0)));
        assert!(!t.release(1, at(0, 0)));
        assert_eq!(t.in_flight(), 0);
        assert!(t.leases().is_empty());
    }

    #[test]
    fn a_release_of_an_expired_lease_never_frees_the_holders_newer_one() {
        let mut t = LeaseTable::default();
        assert!(admitted(t.acquire(&LIMIT, 1, at(0, 0), Priority::Normal)));
        let old = t.lease_of(1).unwrap();
        // The lease lapses (the holder missed its renewals); the holder
        // takes a new one, for another request.
        assert!(admitted(t.acquire(&LIMIT, 1, at(11, 0), Priority::Normal)));
        let new = t.lease_of(1).unwrap();
        assert_ne!(old, new);
        assert_eq!(t.held_by(1), 1);
        // The first request ends now: its slot was reclaimed already.
        assert!(!t.release(1, old));
        assert_eq!(t.release_many(1, old, 5), 0);
        assert_eq!(t.held_by(1), 1, "the new request still holds its slot");
        assert!(t.release(1, new));
        assert_eq!(t.in_flight(), 0);
    }

    #[test]
    fn encoding_round_trips_and_refuses_garbage() {
        let mut t = LeaseTable::default();
        t.acquire(&LIMIT, u64::MAX, at(0, 5), Priority::High);
        t.acquire(&LIMIT, 2, at(0, 6), Priority::High);
        assert_eq!(LeaseTable::decode(&t.encode()).unwrap(), t);
        assert_eq!(
            LeaseTable::decode(&LeaseTable::default().encode())
                .unwrap()
                .in_flight(),
            0
        );
        assert!(LeaseTable::decode(&[]).is_err());
        assert!(LeaseTable::decode(&[255, 255, 255, 255]).is_err());
        assert!(LeaseTable::decode(&[1, 0, 0, 0, 9]).is_err());
    }
}
