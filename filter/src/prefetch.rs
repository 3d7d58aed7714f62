//! Requests this worker may admit by itself: tokens (and concurrency slots)
//! it prefetched ahead of its requests while a bucket had plenty (see
//! `BucketState::prefetch`). Admitting from a prefetch costs no host call:
//! far from its limits a busy policy touches shared data once per prefetch
//! instead of twice per request. Near a limit buckets stop handing out
//! prefetches and every request is decided in shared data again.

use std::collections::hash_map::Entry;
use std::sync::Arc;

use rustc_hash::FxHashMap;

use sluice_filter_core::bucket::{Prefetched, PREFETCH_TTL};
use sluice_filter_core::matcher::BucketKey;
use sluice_shared::time::Instant;

/// What a request admitted from a prefetch took: its bucket, and the
/// worker's lease its slot belongs to (when the policy limits concurrency).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spent<'a> {
    /// Shared with the prefetch: a request takes its bucket's name without
    /// a copy.
    pub bucket: &'a Arc<str>,
    pub lease: Option<Instant>,
}

/// The most requests asked for at once.
pub const MAX_PREFETCH: u64 = 64;
/// Buckets with a live prefetch, at most (per-key policies have many).
const MAX_ENTRIES: usize = 1024;

/// Which prefetch: the policy's index in the installed set, and its bucket.
pub type PrefetchKey = (usize, BucketKey);

#[derive(Debug, Clone, PartialEq, Eq)]
struct Prefetch {
    /// The bucket's key in shared data.
    bucket: Arc<str>,
    tokens: u64,
    /// Spare slots: prefetched and not in use (a finished request's slot
    /// comes back here while the prefetch lives).
    slots: u32,
    /// The worker's lease in the bucket the slots belong to.
    lease: Option<Instant>,
    until: Instant,
    /// Requests the bucket handed out (0: none, this entry only remembers
    /// that the worker used the bucket).
    handed_out: u64,
    spent: u64,
    /// A finished call's slot may stay here (`Prefetched::keeps_slots`).
    keeps_slots: bool,
}

#[derive(Debug, Default)]
pub struct Prefetches {
    entries: FxHashMap<PrefetchKey, Prefetch>,
}

/// Spare slots to give back to a bucket in shared data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpareSlots {
    pub bucket: Arc<str>,
    pub slots: u32,
    pub lease: Option<Instant>,
}

impl Prefetches {
    /// Admits a request from this bucket's prefetch if it has what the request
    /// needs (`cost` tokens when the policy has a rate, a slot when it has a
    /// concurrency limit); returns the bucket's key in shared data, and the
    /// lease of the slot.
    pub fn spend(
        &mut self,
        key: PrefetchKey,
        cost: Option<u64>,
        slot: bool,
        now: Instant,
    ) -> Option<Spent<'_>> {
        let g = self.entries.get_mut(&key)?;
        if now >= g.until || cost.is_some_and(|c| g.tokens < c) || (slot && g.slots == 0) {
            return None;
        }
        g.tokens -= cost.unwrap_or(0);
        if slot {
            g.slots -= 1;
        }
        g.spent += 1;
        Some(Spent {
            bucket: &g.bucket,
            lease: g.lease,
        })
    }

    /// A request of `key`'s bucket finished: its slot stays with this
    /// worker while a prefetch lives whose bucket had slots to spare (far
    /// from its concurrency limit, nobody waiting; its rate may be near),
    /// to go back with the worker's next write to the bucket. False when
    /// it must go back to shared data at once, as near a concurrency
    /// limit, where another worker or a queued request may be waiting for
    /// it. `now` is asked only when such a prefetch exists: a clock read
    /// is a host call, and most streams end with none. A slot of another
    /// lease than the prefetch's goes back to shared data.
    pub fn return_slot(
        &mut self,
        key: PrefetchKey,
        lease: Option<Instant>,
        now: impl FnOnce() -> Instant,
    ) -> bool {
        match self.entries.get_mut(&key) {
            Some(g) if g.keeps_slots && g.lease == lease && now() < g.until => {
                g.slots += 1;
                true
            }
            _ => false,
        }
    }

    /// How many requests to ask for on the way to shared data: none for a
    /// bucket this worker has not used within a prefetch's lifetime (a rarely
    /// used key would only let its prefetches lapse), twice the last prefetch when
    /// it was spent in time, what it spent when it lapsed.
    pub fn wanted(&self, key: PrefetchKey, now: Instant) -> u64 {
        match self.entries.get(&key) {
            None => 0,
            Some(g) if now < g.until => (g.handed_out.max(1) * 2).min(MAX_PREFETCH),
            Some(g) => g.spent,
        }
    }

    /// Records what the bucket just prefetched (possibly nothing: then the
    /// entry only remembers that this worker used the bucket now), replacing
    /// the previous prefetch. Returns the bucket's name as the entry keeps
    /// it (for the admitted stream to share rather than copy or look up
    /// again) and the replaced prefetch's spare slots, to give back.
    pub fn record(
        &mut self,
        key: PrefetchKey,
        bucket: &str,
        prefetched: Prefetched,
        now: Instant,
    ) -> (Arc<str>, Option<SpareSlots>) {
        let got = prefetched.requests > 0;
        let full = self.entries.len() >= MAX_ENTRIES;
        let fresh = |bucket: Arc<str>| Prefetch {
            // Even with nothing prefetched: a finished request's slot may
            // come back to this entry and must then reach this bucket.
            bucket,
            tokens: prefetched.tokens,
            slots: prefetched.slots,
            lease: prefetched.lease,
            until: now + PREFETCH_TTL,
            handed_out: prefetched.requests,
            spent: 0,
            keeps_slots: prefetched.keeps_slots,
        };
        match self.entries.entry(key) {
            Entry::Occupied(mut entry) => {
                // The name is shared with the prefetch replaced when it is
                // the same (it differs when the key moved to another place):
                // one allocation and copy a round fewer.
                let name = shared_name(&entry.get().bucket, bucket);
                let replaced = std::mem::replace(entry.get_mut(), fresh(Arc::clone(&name)));
                (name, spare(replaced))
            }
            Entry::Vacant(_) if !got && full => (Arc::from(bucket), None),
            Entry::Vacant(entry) => {
                let name: Arc<str> = Arc::from(bucket);
                entry.insert(fresh(Arc::clone(&name)));
                (name, None)
            }
        }
    }

    /// Takes the spare slots out of `key`'s prefetch, which the caller is
    /// about to replace: they go back to the bucket in the same
    /// compare-and-swap that decides its request there.
    pub fn take_spare(&mut self, key: PrefetchKey) -> Option<SpareSlots> {
        let g = self.entries.get_mut(&key)?;
        if g.slots == 0 {
            return None;
        }
        Some(SpareSlots {
            bucket: Arc::clone(&g.bucket),
            slots: std::mem::take(&mut g.slots),
            lease: g.lease,
        })
    }

    /// Forgets lapsed prefetches and returns their spare slots, to give back
    /// (their tokens stay spent: a lapsed token is a request that did not
    /// happen, never one too many).
    pub fn prune(&mut self, now: Instant) -> Vec<SpareSlots> {
        let mut back = Vec::new();
        self.entries.retain(|_, g| {
            if now < g.until {
                return true;
            }
            back.extend(spare(g.clone()));
            false
        });
        back
    }

    /// Forgets every prefetch (a new policy set: indexes may mean other
    /// policies now); returns their spare slots, to give back.
    pub fn clear(&mut self) -> Vec<SpareSlots> {
        self.entries.drain().filter_map(|(_, g)| spare(g)).collect()
    }

    /// True while some prefetch holds spare slots (they go back on a tick).
    pub fn holds_slots(&self) -> bool {
        self.entries.values().any(|g| g.slots > 0)
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// `name` as an `Arc<str>`: `kept` shared when it is the same name,
/// a new one otherwise.
fn shared_name(kept: &Arc<str>, name: &str) -> Arc<str> {
    if **kept == *name {
        Arc::clone(kept)
    } else {
        Arc::from(name)
    }
}

fn spare(g: Prefetch) -> Option<SpareSlots> {
    (g.slots > 0).then_some(SpareSlots {
        bucket: g.bucket,
        slots: g.slots,
        lease: g.lease,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    use sluice_shared::time::Span;

    const T0: Instant = Instant::from_nanos(1_000_000_000);
    const K: PrefetchKey = (0, BucketKey::Policy);
    const LEASE: Instant = Instant::from_nanos(5);

    fn prefetched(tokens: u64, slots: u32) -> Prefetched {
        Prefetched {
            tokens,
            slots,
            requests: tokens.max(u64::from(slots)),
            lease: (slots > 0).then_some(LEASE),
            keeps_slots: slots > 0,
        }
    }

    #[test]
    fn spends_only_what_it_was_prefetched_and_only_in_time() {
        let mut g = Prefetches::default();
        assert_eq!(g.wanted(K, T0), 0, "a bucket this worker has not used");
        assert_eq!(g.record(K, "b", Prefetched::default(), T0).1, None);
        assert_eq!(g.wanted(K, T0 + Span::from_nanos(1)), 2, "used just now");
        assert_eq!(g.record(K, "b", prefetched(3, 0), T0).1, None);
        assert_eq!(
            g.spend(K, Some(2), false, T0).map(|s| s.bucket.as_ref()),
            Some("b")
        );
        assert_eq!(
            g.spend(K, Some(2), false, T0),
            None,
            "one token left, cost 2"
        );
        assert_eq!(g.spend(K, Some(1), true, T0), None, "no slot prefetched");
        assert_eq!(
            g.spend(K, Some(1), false, T0 + PREFETCH_TTL),
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
    fn slots_come_back_to_a_live_prefetch_and_lapsed_ones_go_back_to_shared_data() {
        let mut g = Prefetches::default();
        g.record(K, "b", prefetched(0, 2), T0);
        assert!(g.spend(K, None, true, T0).is_some());
        assert!(g.spend(K, None, true, T0).is_some());
        assert!(g.spend(K, None, true, T0).is_none(), "both slots in use");
        assert!(g.return_slot(K, Some(LEASE), || T0 + Span::from_nanos(1)));
        assert!(g.holds_slots());
        assert!(
            !g.return_slot(K, Some(LEASE), || T0 + PREFETCH_TTL),
            "lapsed: back to shared data"
        );
        assert_eq!(
            g.prune(T0 + PREFETCH_TTL),
            vec![SpareSlots {
                bucket: "b".into(),
                slots: 1,
                lease: Some(LEASE)
            }]
        );
        assert!(g.is_empty());
    }

    #[test]
    fn a_bucket_near_its_concurrency_limit_keeps_no_slot() {
        let mut g = Prefetches::default();
        g.record(K, "b", Prefetched::default(), T0);
        assert!(
            !g.return_slot(K, Some(LEASE), || T0 + Span::from_nanos(1)),
            "near the limit: straight back"
        );
        assert!(!g.holds_slots());
    }

    #[test]
    fn near_its_rate_limit_a_bucket_with_slots_to_spare_keeps_a_finished_calls_slot_for_the_next_write(
    ) {
        let mut g = Prefetches::default();
        let rate_near = Prefetched {
            lease: Some(LEASE),
            keeps_slots: true,
            ..Prefetched::default()
        };
        g.record(K, "b", rate_near, T0);
        assert!(
            g.spend(K, Some(1), true, T0).is_none(),
            "nothing to admit by"
        );
        assert!(g.return_slot(K, Some(LEASE), || T0 + Span::from_nanos(1)));
        assert!(
            !g.return_slot(K, Some(Instant::from_nanos(6)), || T0),
            "a slot of another lease goes back at once"
        );
        assert_eq!(
            g.take_spare(K),
            Some(SpareSlots {
                bucket: "b".into(),
                slots: 1,
                lease: Some(LEASE)
            }),
            "the next call's write gives it back"
        );
        assert!(!g.holds_slots());
    }

    #[test]
    fn asks_for_more_while_prefetches_are_spent_in_time_and_less_when_they_lapse() {
        let mut g = Prefetches::default();
        let k = (0, BucketKey::Keyed(7));
        g.record(k, "b", prefetched(8, 0), T0);
        assert_eq!(g.wanted(k, T0 + Span::from_nanos(10)), 16);
        g.record(k, "b", prefetched(64, 0), T0);
        assert_eq!(g.wanted(k, T0 + Span::from_nanos(10)), MAX_PREFETCH);
        for _ in 0..4 {
            assert!(g
                .spend(k, Some(1), false, T0 + Span::from_nanos(1))
                .is_some());
        }
        assert_eq!(g.wanted(k, T0 + PREFETCH_TTL), 4, "4 were spent in time");
        assert_eq!(
            g.record(k, "b", Prefetched::default(), T0 + PREFETCH_TTL).1,
            None
        );
        assert!(g.prune(T0 + PREFETCH_TTL.saturating_mul(2)).is_empty());
        assert!(g.is_empty(), "lapsed entries are forgotten on the tick");
    }

    #[test]
    fn a_new_prefetch_hands_back_the_spare_slots_of_the_one_it_replaces() {
        let mut g = Prefetches::default();
        g.record(K, "b", prefetched(0, 3), T0);
        assert!(g.spend(K, None, true, T0).is_some());
        assert_eq!(
            g.record(K, "b", prefetched(0, 4), T0 + Span::from_nanos(5))
                .1,
            Some(SpareSlots {
                bucket: "b".into(),
                slots: 2,
                lease: Some(LEASE)
            })
        );
        assert_eq!(
            g.clear(),
            vec![SpareSlots {
                bucket: "b".into(),
                slots: 4,
                lease: Some(LEASE)
            }]
        );
    }

    #[test]
    fn the_name_a_round_returns_is_the_one_its_prefetch_keeps() {
        let mut g = Prefetches::default();
        let (first, _) = g.record(K, "b", prefetched(3, 0), T0);
        let (again, _) = g.record(K, "b", prefetched(3, 0), T0);
        assert!(Arc::ptr_eq(&first, &again), "the same name is shared");
        let (moved, _) = g.record(K, "c", prefetched(3, 0), T0);
        assert_eq!(&*moved, "c", "a key moved to another bucket");
        let held = g.spend(K, Some(1), false, T0).map(|s| Arc::clone(s.bucket));
        assert!(held.is_some_and(|h| Arc::ptr_eq(&h, &moved)));
    }
}
