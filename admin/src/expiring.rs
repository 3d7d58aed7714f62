//! Values by key in this process's memory, each kept until the time its
//! writer asked (as Redis's `PX` keeps it), and never more than a bound
//! however many keys callers make up: past it, what has expired goes
//! first, then what expires first. The one place both the key-value
//! store's memory backend (`kv.rs`, strings) and the fleet's decoded
//! ledgers (`fleet.rs`) keep what they hold.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::time::Instant;

pub struct ExpiringMap<V> {
    values: HashMap<String, Kept<V>>,
    max_entries: usize,
}

struct Kept<V> {
    value: V,
    expires: Instant,
}

impl<V> ExpiringMap<V> {
    /// Empty, holding at most `max_entries` (at least one) at once.
    pub fn new(max_entries: usize) -> Self {
        Self {
            values: HashMap::new(),
            max_entries: max_entries.max(1),
        }
    }

    /// The value of `key`, if it has one that has not expired at `now`.
    pub fn get(&self, key: &str, now: Instant) -> Option<&V> {
        self.values
            .get(key)
            .filter(|kept| kept.expires > now)
            .map(|kept| &kept.value)
    }

    /// Sets `key` to `value` until `expires`.
    pub fn set(&mut self, key: String, value: V, expires: Instant, now: Instant) {
        if !self.values.contains_key(&key) {
            self.make_room(now);
        }
        self.values.insert(key, Kept { value, expires });
    }

    /// The value of `key` to change in place, kept from now until
    /// `expires`; `fresh()` when it has none that has not expired.
    pub fn keep(
        &mut self,
        key: &str,
        expires: Instant,
        now: Instant,
        fresh: impl FnOnce() -> V,
    ) -> &mut V {
        if !self.values.contains_key(key) {
            self.make_room(now);
        }
        let kept = match self.values.entry(key.to_string()) {
            Entry::Occupied(occupied) => {
                let kept = occupied.into_mut();
                if kept.expires <= now {
                    kept.value = fresh();
                }
                kept
            }
            Entry::Vacant(vacant) => vacant.insert(Kept {
                value: fresh(),
                expires,
            }),
        };
        kept.expires = expires;
        &mut kept.value
    }

    /// Room for one more key: what expired goes, then what expires first.
    fn make_room(&mut self, now: Instant) {
        if self.values.len() < self.max_entries {
            return;
        }
        self.values.retain(|_, kept| kept.expires > now);
        if self.values.len() >= self.max_entries {
            let first = self
                .values
                .iter()
                .min_by_key(|(_, kept)| kept.expires)
                .map(|(k, _)| k.clone());
            if let Some(first) = first {
                self.values.remove(&first);
            }
        }
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        self.values.clear();
    }

    /// Values held now, expired ones included until they make room.
    pub fn len(&self) -> usize {
        self.values.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn keep_changes_in_place_and_starts_afresh_once_expired() {
        let start = Instant::now();
        let later = |ms| start + Duration::from_millis(ms);
        let mut map = ExpiringMap::new(4);
        *map.keep("a", later(100), start, || 0) += 1;
        *map.keep("a", later(100), later(10), || 0) += 1;
        assert_eq!(map.get("a", later(50)), Some(&2));
        // Kept longer by the last keep.
        *map.keep("a", later(300), later(60), || 0) += 1;
        assert_eq!(map.get("a", later(200)), Some(&3));
        assert_eq!(map.get("a", later(300)), None);
        *map.keep("a", later(500), later(301), || 10) += 1;
        assert_eq!(map.get("a", later(400)), Some(&11));
    }

    #[test]
    fn keep_is_bounded_as_set_is() {
        let now = Instant::now();
        let mut map = ExpiringMap::new(3);
        for i in 0..1_000u64 {
            *map.keep(
                &format!("k{i}"),
                now + Duration::from_millis(1 + i),
                now,
                || i,
            ) += 1;
        }
        assert_eq!(map.len(), 3);
        // The ones expiring first went.
        assert_eq!(map.get("k999", now), Some(&1000));
        assert_eq!(map.get("k0", now), None);
    }
}
