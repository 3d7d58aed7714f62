//! Where a key's state lives in a keyed policy or limit of `max_keys`
//! places, the one rule both use: a key hashes to a first place and probes
//! a few after it; a place another key holds is taken over only when that
//! key's state is idle; with every probed place busy the key overflows.
//! [`on_limit_place`] applies it to a keyed further limit in shared data.

use sluice_filter_core::matcher::CompiledLimit;
use sluice_shared::limiter::RateState;

use super::ctx::Ctx;
use crate::entries::{keyed_limit_key, OwnedLimitState};
use crate::host::Host;
use crate::store::StoreError;

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

/// Runs `f` on the state of `owner`'s place in keyed `limit`, the one
/// rule a call's take and a budget's restore both use: its own place, or a
/// free or idle one it claims afresh. None (with `f` not run): every place
/// it may use holds another key in use.
pub(super) fn on_limit_place<H: Host + ?Sized, R>(
    ctx: &mut Ctx<'_, H>,
    limit: &CompiledLimit,
    owner: u64,
    mut f: impl FnMut(&mut RateState) -> (R, bool),
) -> Result<Option<(String, R)>, StoreError> {
    let (host, store, now) = (ctx.host, &mut *ctx.store, ctx.now);
    let rate = &limit.rate;
    let max_keys = limit.keys.map_or(1, |(max, _)| max);
    for slot in probes(owner, max_keys) {
        let key = keyed_limit_key(&limit.name, Some(slot));
        let done = store.update_with(host, &key, &OwnedLimitState(rate), |entry| {
            match claim(entry.0, owner, || rate.is_idle(&entry.1, now)) {
                Claim::Busy => return (None, false),
                Claim::Mine => {}
                // Written only if `f` changes the state: a claim that
                // holds nothing is no claim.
                Claim::Free | Claim::Evict => *entry = (owner, rate.initial_state()),
            }
            let (out, changed) = f(&mut entry.1);
            (Some(out), changed)
        })?;
        if let Some(out) = done {
            return Ok(Some((key, out)));
        }
    }
    Ok(None)
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
