//! Where a key's state lives in a keyed policy or limit of `max_keys`
//! places, the one rule both use: a key hashes to a first place and probes
//! a few after it; a place another key holds is taken over only when that
//! key's state is idle; with every probed place busy the key overflows.
//! [`on_place`] applies it in shared data to either kind of limit
//! ([`KeyPlace`]).

use sluice_filter_core::bucket::BucketState;
use sluice_filter_core::matcher::CompiledLimit;
use sluice_shared::limiter::RateState;
use sluice_shared::policy::KeyOverflow;
use sluice_shared::time::Instant;

use super::ctx::Ctx;
use crate::entries::{state_key, Codec, LimitOf, OwnedBucket, OwnedLimitState, Place};
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

/// The state a key holds in one place of a keyed limit, whichever kind
/// of limit: who holds it, whether it is idle, and a fresh one for a new
/// holder. The probe below is the one rule both kinds follow.
pub(super) trait KeyPlace: Codec {
    fn held_by(value: &Self::Value) -> u64;
    fn hold_for(value: &mut Self::Value, owner: u64);
    fn is_idle(&self, value: &Self::Value, now: Instant) -> bool;
    fn fresh_for(&self, owner: u64) -> Self::Value {
        let mut value = self.fresh();
        Self::hold_for(&mut value, owner);
        value
    }
}

/// A policy's own bucket in one of its places.
impl KeyPlace for OwnedBucket<'_> {
    fn held_by(state: &BucketState) -> u64 {
        state.owner
    }
    fn hold_for(state: &mut BucketState, owner: u64) {
        state.owner = owner;
    }
    fn is_idle(&self, state: &BucketState, now: Instant) -> bool {
        state.is_idle(self.0, now)
    }
}

/// A further limit's state in one of its places.
impl KeyPlace for OwnedLimitState<'_> {
    fn held_by(entry: &(u64, RateState)) -> u64 {
        entry.0
    }
    fn hold_for(entry: &mut (u64, RateState), owner: u64) {
        entry.0 = owner;
    }
    fn is_idle(&self, entry: &(u64, RateState), now: Instant) -> bool {
        self.0.is_idle(&entry.1, now)
    }
}

/// Where a key's call ran in a keyed limit: the place's entry, what `f`
/// said there, and whether the key took the place from an idle one (and
/// wrote it).
pub(super) struct InPlace<R> {
    pub key: String,
    pub out: R,
    pub evicted: bool,
}

/// Runs `f` on the state of `owner`'s place among `of`'s `max_keys`: its
/// own, or a free or idle one it claims afresh. A claim is written only if
/// `f` changes the state: a claim that holds nothing is no claim. None
/// (with `f` not run): every place it may use holds another key in use.
pub(super) fn on_place<H: Host + ?Sized, C: KeyPlace, R>(
    ctx: &mut Ctx<'_, H>,
    of: LimitOf<'_>,
    max_keys: u32,
    owner: u64,
    codec: &C,
    mut f: impl FnMut(&str, &mut C::Value) -> (R, bool),
) -> Result<Option<InPlace<R>>, StoreError> {
    let (host, store, now) = (ctx.host, &mut *ctx.store, ctx.now);
    for slot in probes(owner, max_keys) {
        let key = state_key(of, Place::Slot(slot));
        let mut evicted = false;
        let done = store.update_with(host, &key, codec, |value| {
            let claimed = claim(C::held_by(value), owner, || codec.is_idle(value, now));
            match claimed {
                Claim::Busy => return (None, false),
                Claim::Mine => {}
                Claim::Free | Claim::Evict => *value = codec.fresh_for(owner),
            }
            let (out, changed) = f(&key, value);
            evicted = changed && claimed == Claim::Evict;
            (Some(out), changed)
        })?;
        if let Some(out) = done {
            return Ok(Some(InPlace { key, out, evicted }));
        }
    }
    Ok(None)
}

/// Where a keyed call ran ([`on_key`]).
pub(super) enum Keyed<R> {
    /// In a place of its key's own.
    Placed(InPlace<R>),
    /// Every place it may use held another key in use: in the entry the
    /// overflowing keys share (nobody's, so owned by 0).
    Overflowed(InPlace<R>),
    /// No place, and the limit refuses overflowing keys (`f` not run).
    Refused,
}

/// Runs `f` on `owner`'s state in keyed `of` of `keys` (`max_keys` and
/// what an overflowing key does) ([`on_place`]), or with every place busy,
/// as the overflow says: in the shared overflow entry, or nowhere.
pub(super) fn on_key<H: Host + ?Sized, C: KeyPlace, R>(
    ctx: &mut Ctx<'_, H>,
    of: LimitOf<'_>,
    keys: (u32, KeyOverflow),
    owner: u64,
    codec: &C,
    mut f: impl FnMut(&str, &mut C::Value) -> (R, bool),
) -> Result<Keyed<R>, StoreError> {
    let (max_keys, overflow) = keys;
    if let Some(placed) = on_place(ctx, of, max_keys, owner, codec, &mut f)? {
        return Ok(Keyed::Placed(placed));
    }
    if overflow == KeyOverflow::Reject {
        return Ok(Keyed::Refused);
    }
    let key = state_key(of, Place::Overflow);
    let out = ctx.store.update_with(ctx.host, &key, codec, |value| {
        C::hold_for(value, 0);
        f(&key, value)
    })?;
    Ok(Keyed::Overflowed(InPlace {
        key,
        out,
        evicted: false,
    }))
}

/// Runs `f` on `owner`'s place in keyed further `limit` ([`on_place`]),
/// the one rule a call's take and a budget's restore both use.
pub(super) fn on_limit_place<H: Host + ?Sized, R>(
    ctx: &mut Ctx<'_, H>,
    limit: &CompiledLimit,
    owner: u64,
    mut f: impl FnMut(&mut RateState) -> (R, bool),
) -> Result<Option<(String, R)>, StoreError> {
    let max_keys = limit.keys.map_or(1, |(max, _)| max);
    let codec = OwnedLimitState(&limit.rate);
    let placed = on_place(
        ctx,
        LimitOf::Named(&limit.name),
        max_keys,
        owner,
        &codec,
        |_, (_, state)| f(state),
    )?;
    Ok(placed.map(|p| (p.key, p.out)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::Clock;
    use crate::metrics::Metrics;
    use crate::store::Store;
    use crate::testing::FakeHost;
    use sluice_shared::limiter::{Decision, RateLimiter};
    use sluice_shared::policy::RateSpec;

    const T0: Instant = Instant::from_nanos(1_000_000_000_000);

    /// Takes one token for `owner` in a keyed limit of one place (`take`
    /// false: runs on the state and changes nothing), as a further limit
    /// or a policy's bucket would: where it ran, or None when refused.
    fn take_one(
        host: &FakeHost,
        rate: &RateLimiter,
        overflow: KeyOverflow,
        owner: u64,
        take: bool,
    ) -> Option<(String, bool, bool)> {
        let (clock, mut store, mut metrics) =
            (Clock::default(), Store::default(), Metrics::default());
        let mut decisions = super::super::decision_log::DecisionLog::default();
        let mut ctx = Ctx {
            host,
            clock: &clock,
            store: &mut store,
            metrics: &mut metrics,
            decisions: &mut decisions,
            holder: 1,
            now: host.now(),
            fresh: true,
        };
        let keyed = on_key(
            &mut ctx,
            LimitOf::Named("per-key"),
            (1, overflow),
            owner,
            &OwnedLimitState(rate),
            |_, entry| {
                let taken = take
                    && matches!(
                        rate.try_acquire(&mut entry.1, host.now(), 1),
                        Decision::Admit { .. }
                    );
                (taken, taken)
            },
        )
        .unwrap_or_else(|e| panic!("{e:?}"));
        match keyed {
            Keyed::Placed(p) => Some((p.key, p.out, p.evicted)),
            Keyed::Overflowed(p) => Some((p.key, p.out, false)),
            Keyed::Refused => None,
        }
    }

    #[test]
    fn a_key_finds_its_place_overflows_past_a_busy_one_and_evicts_an_idle_one() {
        let host = FakeHost::at(T0);
        let spec: RateSpec = serde_json::from_str(r#"{"requests": 1, "period": "1s", "burst": 2}"#)
            .unwrap_or_else(|e| panic!("{e}"));
        let rate = RateLimiter::from_spec(&spec);
        let owner_of_place = |key: &str| {
            let bytes = host.shared_get(key).0?;
            OwnedLimitState(&rate)
                .decode(&bytes)
                .map(|(owner, _)| owner)
        };
        // A claim that holds nothing is no claim: nothing is written.
        assert_eq!(
            take_one(&host, &rate, KeyOverflow::Shared, 7, false),
            Some(("sluice/l/per-key/0".into(), false, false))
        );
        assert_eq!(owner_of_place("sluice/l/per-key/0"), None);
        // Key 7 takes the one place; key 9 finds it busy and overflows.
        let placed = take_one(&host, &rate, KeyOverflow::Shared, 7, true);
        assert_eq!(placed, Some(("sluice/l/per-key/0".into(), true, false)));
        assert_eq!(owner_of_place("sluice/l/per-key/0"), Some(7));
        let overflowed = take_one(&host, &rate, KeyOverflow::Shared, 9, true);
        assert_eq!(
            overflowed,
            Some(("sluice/l/per-key/overflow".into(), true, false))
        );
        assert_eq!(
            owner_of_place("sluice/l/per-key/overflow"),
            Some(0),
            "nobody's"
        );
        // With overflow refused, the call runs nowhere.
        assert_eq!(take_one(&host, &rate, KeyOverflow::Reject, 9, true), None);
        // Once key 7's bucket is full again, key 9 takes its place over.
        host.advance_ms(3_000);
        let evicted = take_one(&host, &rate, KeyOverflow::Reject, 9, true);
        assert_eq!(evicted, Some(("sluice/l/per-key/0".into(), true, true)));
        assert_eq!(owner_of_place("sluice/l/per-key/0"), Some(9));
    }

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
