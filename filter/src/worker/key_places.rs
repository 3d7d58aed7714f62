//! Where a key's state lives in a keyed policy or limit of `max_keys`
//! places, the one rule both use: a key hashes to a first place and probes
//! a few after it; a place another key holds is taken over only when that
//! key's state is idle; with every probed place busy the key overflows.

/// Places tried for a new key before it overflows.
const KEY_PROBES: u32 = 4;

/// The owner a place records for a key (0 marks a place no key owns, so a
/// hash of 0 is recorded as 1).
pub(super) fn owner_of(hash: u64) -> u64 {
    hash.max(1)
}

/// The places `owner` tries, in order.
pub(super) fn probes(owner: u64, max_keys: u32) -> impl Iterator<Item = u32> {
    let max_keys = u64::from(max_keys.max(1));
    let first = owner % max_keys;
    (0..u64::from(KEY_PROBES).min(max_keys)).map(move |probe| ((first + probe) % max_keys) as u32)
}

/// What `owner` may do with a place `held_by` records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Claim {
    /// Its own: use the state there.
    Mine,
    /// No key's: start a fresh state there.
    Free,
    /// Another key's, idle: start a fresh state there (an eviction).
    Evict,
    /// Another key's, in use: try the next place.
    Busy,
}

/// `is_idle` is asked only when another key holds the place.
pub(super) fn claim(held_by: u64, owner: u64, is_idle: impl FnOnce() -> bool) -> Claim {
    if held_by == owner {
        Claim::Mine
    } else if held_by == 0 {
        Claim::Free
    } else if is_idle() {
        Claim::Evict
    } else {
        Claim::Busy
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_probes_a_few_places_from_its_own_wrapping_round() {
        assert_eq!(probes(9, 10).collect::<Vec<_>>(), [9, 0, 1, 2]);
        assert_eq!(probes(5, 2).collect::<Vec<_>>(), [1, 0]);
        assert_eq!(probes(u64::MAX, 0).collect::<Vec<_>>(), [0]);
        assert_eq!(owner_of(0), 1);
    }

    #[test]
    fn a_busy_place_of_another_key_is_never_claimed() {
        assert_eq!(claim(7, 7, || unreachable!()), Claim::Mine);
        assert_eq!(claim(0, 7, || unreachable!()), Claim::Free);
        assert_eq!(claim(3, 7, || true), Claim::Evict);
        assert_eq!(claim(3, 7, || false), Claim::Busy);
    }
}
