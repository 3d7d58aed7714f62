//! Requests this worker may admit by itself: tokens (and concurrency slots)
//! it took ahead of its requests while a bucket had plenty (see
//! `BucketState::grant`). Admitting from a grant costs no host call: far
//! from its limits a busy policy touches shared data once per grant instead
//! of twice per request. Near a limit buckets stop granting and every
//! request is decided in shared data again.

use std::collections::HashMap;

use sluice_shared::bucket::{Granted, GRANT_TTL_NS};
use sluice_shared::limiter::Nanos;
use sluice_shared::matcher::BucketKey;

/// The most requests asked for at once.
pub const MAX_GRANT: u64 = 64;
/// Buckets with a live grant, at most (per-key policies have many).
const MAX_ENTRIES: usize = 1024;

/// Which grant: the policy's index in the installed set, and its bucket.
pub type GrantKey = (usize, BucketKey);

#[derive(Debug, Clone, PartialEq, Eq)]
struct Grant {
    /// The bucket's key in shared data.
    bucket: String,
    tokens: u64,
    /// Spare slots: granted and not in use (a finished request's slot
    /// comes back here while the grant lives).
    slots: u32,
    until: Nanos,
    granted: u64,
    spent: u64,
}

#[derive(Debug, Default)]
pub struct LocalGrants {
    grants: HashMap<GrantKey, Grant>,
}

/// Spare slots to give back to a bucket in shared data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpareSlots {
    pub bucket: String,
    pub slots: u32,
}

impl LocalGrants {
    /// Admits a request from this bucket's grant if it has what the request
    /// needs (`cost` tokens when the policy has a rate, a slot when it has a
    /// concurrency limit); returns the bucket's key in shared data.
    pub fn spend(
        &mut self,
        key: GrantKey,
        cost: Option<u64>,
        slot: bool,
        now: Nanos,
    ) -> Option<&str> {
        let g = self.grants.get_mut(&key)?;
        if now >= g.until || cost.is_some_and(|c| g.tokens < c) || (slot && g.slots == 0) {
            return None;
        }
        g.tokens -= cost.unwrap_or(0);
        if slot {
            g.slots -= 1;
        }
        g.spent += 1;
        Some(&g.bucket)
    }

    /// A request of `key`'s bucket finished: its slot stays with this
    /// worker while a grant (one that granted something: the bucket was far
    /// from its limits) lives. False when it must go back to shared data at
    /// once, as near a limit, where another worker or a queued request may
    /// be waiting for it. `now` is asked only when such a grant exists: a
    /// clock read is a host call, and most streams end with none.
    pub fn return_slot(&mut self, key: GrantKey, now: impl FnOnce() -> Nanos) -> bool {
        match self.grants.get_mut(&key) {
            Some(g) if g.granted > 0 && now() < g.until => {
                g.slots += 1;
                true
            }
            _ => false,
        }
    }

    /// How many requests to ask for on the way to shared data: none for a
    /// bucket this worker has not used within a grant's lifetime (a rarely
    /// used key would only let its grants lapse), twice the last grant when
    /// it was spent in time, what it spent when it lapsed.
    pub fn wanted(&self, key: GrantKey, now: Nanos) -> u64 {
        match self.grants.get(&key) {
            None => 0,
            Some(g) if now < g.until => (g.granted.max(1) * 2).min(MAX_GRANT),
            Some(g) => g.spent,
        }
    }

    /// Records what the bucket just granted (possibly nothing: then the
    /// entry only remembers that this worker used the bucket now), replacing
    /// the previous grant; returns that grant's spare slots, to give back.
    pub fn record(
        &mut self,
        key: GrantKey,
        bucket: &str,
        granted: Granted,
        now: Nanos,
    ) -> Option<SpareSlots> {
        let got = granted.requests > 0;
        if !got && !self.grants.contains_key(&key) && self.grants.len() >= MAX_ENTRIES {
            return None;
        }
        let previous = self.grants.insert(
            key,
            Grant {
                // Even with nothing granted: a finished request's slot may
                // come back to this entry and must then reach this bucket.
                bucket: bucket.to_string(),
                tokens: granted.tokens,
                slots: granted.slots,
                until: now.saturating_add(GRANT_TTL_NS),
                granted: granted.requests,
                spent: 0,
            },
        );
        previous.and_then(spare)
    }

    /// Forgets lapsed grants and returns their spare slots, to give back
    /// (their tokens stay spent: a lapsed token is a request that did not
    /// happen, never one too many).
    pub fn prune(&mut self, now: Nanos) -> Vec<SpareSlots> {
        let mut back = Vec::new();
        self.grants.retain(|_, g| {
            if now < g.until {
                return true;
            }
            back.extend(spare(g.clone()));
            false
        });
        back
    }

    /// Forgets every grant (a new policy set: indexes may mean other
    /// policies now); returns their spare slots, to give back.
    pub fn clear(&mut self) -> Vec<SpareSlots> {
        self.grants.drain().filter_map(|(_, g)| spare(g)).collect()
    }

    /// True while some grant holds spare slots (they go back on a tick).
    pub fn holds_slots(&self) -> bool {
        self.grants.values().any(|g| g.slots > 0)
    }

    pub fn is_empty(&self) -> bool {
        self.grants.is_empty()
    }
}

fn spare(g: Grant) -> Option<SpareSlots> {
    (g.slots > 0).then_some(SpareSlots {
        bucket: g.bucket,
        slots: g.slots,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: Nanos = 1_000_000_000;
    const K: GrantKey = (0, BucketKey::Policy);

    fn granted(tokens: u64, slots: u32) -> Granted {
        Granted {
            tokens,
            slots,
            requests: tokens.max(u64::from(slots)),
        }
    }

    #[test]
    fn spends_only_what_it_was_granted_and_only_in_time() {
        let mut g = LocalGrants::default();
        assert_eq!(g.wanted(K, T0), 0, "a bucket this worker has not used");
        assert_eq!(g.record(K, "b", Granted::default(), T0), None);
        assert_eq!(g.wanted(K, T0 + 1), 2, "used just now");
        assert_eq!(g.record(K, "b", granted(3, 0), T0), None);
        assert_eq!(g.spend(K, Some(2), false, T0), Some("b"));
        assert_eq!(
            g.spend(K, Some(2), false, T0),
            None,
            "one token left, cost 2"
        );
        assert_eq!(g.spend(K, Some(1), true, T0), None, "no slot granted");
        assert_eq!(
            g.spend(K, Some(1), false, T0 + GRANT_TTL_NS),
            None,
            "lapsed"
        );
        assert_eq!(
            g.spend((1, BucketKey::Policy), Some(1), false, T0),
            None,
            "another policy"
        );
    }

    #[test]
    fn slots_come_back_to_a_live_grant_and_lapsed_ones_go_back_to_shared_data() {
        let mut g = LocalGrants::default();
        g.record(K, "b", granted(0, 2), T0);
        assert!(g.spend(K, None, true, T0).is_some());
        assert!(g.spend(K, None, true, T0).is_some());
        assert!(g.spend(K, None, true, T0).is_none(), "both slots in use");
        assert!(g.return_slot(K, || T0 + 1));
        assert!(g.holds_slots());
        assert!(
            !g.return_slot(K, || T0 + GRANT_TTL_NS),
            "lapsed: back to shared data"
        );
        assert_eq!(
            g.prune(T0 + GRANT_TTL_NS),
            vec![SpareSlots {
                bucket: "b".into(),
                slots: 1
            }]
        );
        assert!(g.is_empty());
    }

    #[test]
    fn a_bucket_that_granted_nothing_keeps_no_slot() {
        let mut g = LocalGrants::default();
        g.record(K, "b", Granted::default(), T0);
        assert!(
            !g.return_slot(K, || T0 + 1),
            "near the limit: straight back"
        );
        assert!(!g.holds_slots());
    }

    #[test]
    fn asks_for_more_while_grants_are_spent_in_time_and_less_when_they_lapse() {
        let mut g = LocalGrants::default();
        let k = (0, BucketKey::Keyed(7));
        g.record(k, "b", granted(8, 0), T0);
        assert_eq!(g.wanted(k, T0 + 10), 16);
        g.record(k, "b", granted(64, 0), T0);
        assert_eq!(g.wanted(k, T0 + 10), MAX_GRANT);
        for _ in 0..4 {
            assert!(g.spend(k, Some(1), false, T0 + 1).is_some());
        }
        assert_eq!(g.wanted(k, T0 + GRANT_TTL_NS), 4, "4 were spent in time");
        assert_eq!(
            g.record(k, "b", Granted::default(), T0 + GRANT_TTL_NS),
            None
        );
        assert!(g.prune(T0 + 2 * GRANT_TTL_NS).is_empty());
        assert!(g.is_empty(), "lapsed entries are forgotten on the tick");
    }

    #[test]
    fn a_new_grant_hands_back_the_spare_slots_of_the_one_it_replaces() {
        let mut g = LocalGrants::default();
        g.record(K, "b", granted(0, 3), T0);
        assert!(g.spend(K, None, true, T0).is_some());
        assert_eq!(
            g.record(K, "b", granted(0, 4), T0 + 5),
            Some(SpareSlots {
                bucket: "b".into(),
                slots: 2
            })
        );
        assert_eq!(
            g.clear(),
            vec![SpareSlots {
                bucket: "b".into(),
                slots: 4
            }]
        );
    }
}
