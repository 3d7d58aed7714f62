//! Every entry this filter keeps in Envoy shared data: its key, and how
//! its value is laid out ([`Codec`]). A new entry goes here, so that no two parts pick the
//! same key and every layout is found in one place. Keys start `sluice/`;
//! the names of policies and limits in them are validated names.

use serde::de::DeserializeOwned;
use serde::Serialize;
use std::marker::PhantomData;

use sluice_filter_core::bucket::{BucketLimits, BucketState};
use sluice_filter_core::matcher::CompiledLimit;
use sluice_shared::fair::{FairSlots, FairTable};
use sluice_shared::limiter::concurrency::LeaseTable;
use sluice_shared::limiter::{RateLimiter, RateState};
use sluice_shared::provider::ProviderTable;
use sluice_shared::time::Instant;

use crate::host::Host;

/// The sync state shared by the workers (`sync::SyncState`).
pub const SYNC_KEY: &str = "sluice/sync";
/// The policy set the admin last sent, as its JSON.
pub const POLICY_SET_KEY: &str = "sluice/policyset";
/// Which set that is (`sync::SetId`).
pub const POLICY_VERSION_KEY: &str = "sluice/policyset/version";
/// The held watch for pushed edits (`watch`).
pub const WATCH_KEY: &str = "sluice/sync/watch";
/// The fleet shares the admin leased (`fleet`).
pub const SHARES_KEY: &str = "sluice/fleet/shares";
/// The next holder id a worker takes (`store::Store::next_holder`).
pub const HOLDERS_KEY: &str = "sluice/holders";
/// The secret keys are hashed with, drawn once per Envoy.
pub const KEY_SECRET_KEY: &str = "sluice/key-secret";
/// Policy counters gathered for the next report (`report`).
pub const REPORT_KEY: &str = "sluice/report";
/// Further limits' counters gathered for the next report.
pub const LIMIT_REPORT_KEY: &str = "sluice/report/limits";
/// The last calls each limit refused (per key, the newest), kept across
/// reports: the budget tree says why each node last refused.
pub const REFUSED_KEY: &str = "sluice/report/refused";
/// Per-key counts gathered for the next report.
pub const KEYS_REPORT_KEY: &str = "sluice/report/keys";

/// The last part of a keyed limit's overflow entry.
pub const OVERFLOW_SUFFIX: &str = "/overflow";

/// Whose limit an entry holds: a policy's own `rate` and `concurrency`,
/// or a further limit (`limits`) by its name alone, so every policy naming
/// it counts against the one limit. Names have no `/` and the two kinds
/// have prefixes of their own, so a policy and a limit of one name never
/// meet. Each concept below builds its key from this once, for both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitOf<'a> {
    /// A policy's own rate and concurrency (its [`BucketState`]).
    Policy(&'a str),
    /// A further limit: its [`LimitState`] (a rate) or lease table (a
    /// concurrency limit).
    Named(&'a str),
}

impl<'a> LimitOf<'a> {
    fn name(self) -> &'a str {
        match self {
            Self::Policy(name) | Self::Named(name) => name,
        }
    }
}

/// Which of a limit's entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// An unkeyed limit's one entry.
    Single,
    /// One of a keyed limit's `max_keys` places.
    Slot(u32),
    /// The entry a keyed limit's overflowing keys share.
    Overflow,
}

/// Where a limit's state lives: a policy's bucket (`sluice/b/`), a further
/// limit's state (`sluice/l/`); a keyed one's places below it.
pub fn state_key(of: LimitOf<'_>, place: Place) -> String {
    let prefix = match of {
        LimitOf::Policy(_) => "sluice/b/",
        LimitOf::Named(_) => "sluice/l/",
    };
    let name = of.name();
    match place {
        // Not `format!`: this runs on every round to shared data, and the
        // formatting machinery costs several times the copy.
        Place::Single => [prefix, name].concat(),
        Place::Slot(i) => format!("{prefix}{name}/{i}"),
        Place::Overflow => [prefix, name, OVERFLOW_SUFFIX].concat(),
    }
}

/// Labels of a keyed limit of an hour or longer whose keys are shown as
/// their values (`label: value`): owner hash to label, for the live view
/// (see `worker/spend.rs`).
pub fn spend_labels_key(limit: &str) -> String {
    format!("sluice/sl/{limit}")
}

/// Parents of a keyed limit's keys in the budget tree: owner hash to the
/// owner of the key the same calls carried in its parent budget (see
/// `worker/spend.rs`).
pub fn spend_parents_key(limit: &str) -> String {
    format!("sluice/sp/{limit}")
}

/// The places of a keyed limit's top spenders as the last VM to report
/// read them (`Json<Vec<u32>>`): the next VM to report reads them first,
/// so every VM reports the same top keys (see `worker/spend.rs`).
pub fn spend_top_key(limit: &str) -> String {
    format!("sluice/st/{limit}")
}

/// Marks a budget's state as one the admin's budgets header set.
pub fn budget_known_key(limit: &str) -> String {
    format!("sluice/bk/{limit}")
}

/// A keyed budget the admin gives back in parts: the last key taken
/// (`Json<Option<i64>>`, see `sluice_wire::sync::HeldKey::cursor`).
pub fn budget_cursor_key(limit: &str) -> String {
    format!("sluice/bkc/{limit}")
}

/// A limit's fair table (`fair`): each key's share and bucket, the spare
/// pool; a further limit's is shared by every policy naming it.
pub fn fair_key(of: LimitOf<'_>) -> String {
    match of {
        LimitOf::Policy(policy) => format!("sluice/f/{policy}"),
        LimitOf::Named(limit) => format!("sluice/fl/{limit}"),
    }
}

/// A limit's slots shared fairly: who may take one more.
pub fn fair_slots_key(of: LimitOf<'_>) -> String {
    match of {
        LimitOf::Policy(policy) => format!("sluice/fs/{policy}"),
        LimitOf::Named(limit) => format!("sluice/fsl/{limit}"),
    }
}

/// Marks that a policy's port-hidden warning was logged in this Envoy.
pub fn port_hidden_key(policy: &str) -> String {
    format!("sluice/port-hidden/{policy}")
}

/// Where a limit's provider table lives, and whose row it is there: an
/// unkeyed limit has one entry (row 0); a keyed one spreads its keys over
/// `max_keys` entries, each holding the rows of the keys hashed to it.
pub fn provider_key(limit: &CompiledLimit, key: Option<u64>) -> (String, u64) {
    match (key, limit.keys) {
        (Some(hash), Some((max_keys, _))) => (
            format!(
                "sluice/p/{}/{}",
                limit.name,
                hash % u64::from(max_keys.max(1))
            ),
            hash,
        ),
        _ => (format!("sluice/p/{}", limit.name), 0),
    }
}

/// How a value is laid out under its key. Callers of
/// [`Store`](crate::store::Store) get the value, never its bytes: most
/// values lay themselves out ([`Entry`]), a limit's state by its limiter
/// ([`LimitState`], [`OwnedLimitState`]).
pub trait Codec {
    type Value;
    /// What a missing or unreadable value reads as.
    fn fresh(&self) -> Self::Value;
    /// None: the bytes are not such a value (broken, or another layout).
    fn decode(&self, bytes: &[u8]) -> Option<Self::Value>;
    fn encode(&self, value: &Self::Value) -> Vec<u8>;
}

/// A value that lays itself out; a missing or unreadable one is its
/// `Default`.
pub trait Entry: Default {
    fn decode(bytes: &[u8]) -> Option<Self>;
    fn encode(&self) -> Vec<u8>;
}

/// The [`Codec`] of an [`Entry`].
pub struct Plain<T>(PhantomData<T>);

impl<T> Default for Plain<T> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T: Entry> Codec for Plain<T> {
    type Value = T;
    fn fresh(&self) -> T {
        T::default()
    }
    fn decode(&self, bytes: &[u8]) -> Option<T> {
        T::decode(bytes)
    }
    fn encode(&self, value: &T) -> Vec<u8> {
        value.encode()
    }
}

/// Reads the value at `key` without changing it: fresh when missing or
/// unreadable (for what is only shown or reported; a decision that must
/// count a broken value reads through the store).
pub fn read<H: Host + ?Sized, C: Codec>(host: &H, key: &str, codec: &C) -> C::Value {
    host.shared_get(key)
        .0
        .and_then(|bytes| codec.decode(&bytes))
        .unwrap_or_else(|| codec.fresh())
}

/// [`read`] of an [`Entry`].
pub fn read_as<T: Entry, H: Host + ?Sized>(host: &H, key: &str) -> T {
    read(host, key, &Plain::<T>::default())
}

impl Entry for BucketState {
    fn decode(bytes: &[u8]) -> Option<Self> {
        BucketState::decode(bytes).ok()
    }
    fn encode(&self) -> Vec<u8> {
        BucketState::encode(self)
    }
}

impl Entry for FairTable {
    fn decode(bytes: &[u8]) -> Option<Self> {
        FairTable::decode(bytes).ok()
    }
    fn encode(&self) -> Vec<u8> {
        FairTable::encode(self)
    }
}

impl Entry for FairSlots {
    fn decode(bytes: &[u8]) -> Option<Self> {
        FairSlots::decode(bytes).ok()
    }
    fn encode(&self) -> Vec<u8> {
        FairSlots::encode(self)
    }
}

impl Entry for ProviderTable {
    fn decode(bytes: &[u8]) -> Option<Self> {
        ProviderTable::decode(bytes)
    }
    fn encode(&self) -> Vec<u8> {
        ProviderTable::encode(self)
    }
}

/// A concurrency limit's lease table ([`limit_key`]); bytes that are none
/// (a rate limit's state before an edit, or garbage) start it empty: the
/// limit errs toward its callers only for as long as the slots so lost
/// would have been held.
impl Entry for LeaseTable {
    fn decode(bytes: &[u8]) -> Option<Self> {
        LeaseTable::decode(bytes).ok()
    }
    fn encode(&self) -> Vec<u8> {
        LeaseTable::encode(self)
    }
}

/// A marker ([`budget_known_key`], [`port_hidden_key`]): set or not.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Marker(pub bool);

impl Entry for Marker {
    fn decode(bytes: &[u8]) -> Option<Self> {
        match bytes {
            [1] => Some(Self(true)),
            [0] => Some(Self(false)),
            _ => None,
        }
    }
    fn encode(&self) -> Vec<u8> {
        vec![u8::from(self.0)]
    }
}

/// A counter, little-endian ([`HOLDERS_KEY`]).
impl Entry for u64 {
    fn decode(bytes: &[u8]) -> Option<Self> {
        <[u8; 8]>::try_from(bytes).ok().map(u64::from_le_bytes)
    }
    fn encode(&self) -> Vec<u8> {
        self.to_le_bytes().to_vec()
    }
}

/// A point in time, nanoseconds little-endian ([`WATCH_KEY`]).
impl Entry for Instant {
    fn decode(bytes: &[u8]) -> Option<Self> {
        u64::decode(bytes).map(Instant::from_nanos)
    }
    fn encode(&self) -> Vec<u8> {
        self.as_nanos().encode()
    }
}

/// A value kept as JSON: the reports' counters ([`REPORT_KEY`],
/// [`LIMIT_REPORT_KEY`], [`KEYS_REPORT_KEY`]). Broken, or from another
/// release: it starts over rather than fail to count.
pub struct Json<T>(PhantomData<T>);

impl<T> Default for Json<T> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T: Serialize + DeserializeOwned + Default> Codec for Json<T> {
    type Value = T;
    fn fresh(&self) -> T {
        T::default()
    }
    fn decode(&self, bytes: &[u8]) -> Option<T> {
        serde_json::from_slice(bytes).ok()
    }
    fn encode(&self, value: &T) -> Vec<u8> {
        serde_json::to_vec(value).unwrap_or_default()
    }
}

/// A further limit's state ([`limit_key`]); bytes that are no state of
/// this limiter (another algorithm after an edit, or garbage) start it
/// afresh.
pub struct LimitState<'a>(pub &'a RateLimiter);

impl Codec for LimitState<'_> {
    type Value = RateState;
    fn fresh(&self) -> RateState {
        self.0.initial_state()
    }
    fn decode(&self, bytes: &[u8]) -> Option<RateState> {
        self.0.decode_state(bytes).ok()
    }
    fn encode(&self, state: &RateState) -> Vec<u8> {
        state.encode()
    }
}

/// A keyed policy's bucket in one of its places (its [`BucketState`]
/// records the owning key), read with the limits that say when it is
/// idle.
pub struct OwnedBucket<'a>(pub &'a BucketLimits);

impl Codec for OwnedBucket<'_> {
    type Value = BucketState;
    fn fresh(&self) -> BucketState {
        BucketState::default()
    }
    fn decode(&self, bytes: &[u8]) -> Option<BucketState> {
        <BucketState as Entry>::decode(bytes)
    }
    fn encode(&self, state: &BucketState) -> Vec<u8> {
        Entry::encode(state)
    }
}

/// A keyed further limit's place ([`state_key`]): its owner's hash, then its
/// state; a missing or unreadable one is nobody's (0) and fresh.
pub struct OwnedLimitState<'a>(pub &'a RateLimiter);

impl Codec for OwnedLimitState<'_> {
    type Value = (u64, RateState);
    fn fresh(&self) -> (u64, RateState) {
        (0, self.0.initial_state())
    }
    fn decode(&self, bytes: &[u8]) -> Option<(u64, RateState)> {
        let owner = u64::decode(bytes.get(..8)?)?;
        let state = self.0.decode_state(bytes.get(8..)?).ok()?;
        Some((owner, state))
    }
    fn encode(&self, (owner, state): &(u64, RateState)) -> Vec<u8> {
        let mut out = owner.encode();
        out.extend_from_slice(&state.encode());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{FilterCounter, Metrics};
    use crate::store::Store;
    use crate::testing::FakeHost;
    use proptest::prelude::*;
    use sluice_shared::policy::RateSpec;
    use std::collections::BTreeMap;

    fn limiter() -> RateLimiter {
        let spec: RateSpec = serde_json::from_str(r#"{"requests": 10, "period": "1s"}"#)
            .unwrap_or_else(|e| panic!("{e}"));
        RateLimiter::from_spec(&spec)
    }

    fn round_trip<C: Codec>(codec: &C, value: &C::Value) -> Option<C::Value> {
        codec.decode(&codec.encode(value))
    }

    /// The keys outlive a filter version (shared data survives a hot
    /// restart and a new .wasm), so a policy's own limit and a further
    /// limit of the same name keep apart, each where it always was.
    #[test]
    fn each_concept_keeps_a_policys_own_limit_and_a_further_one_apart() {
        let (own, named) = (LimitOf::Policy("llm"), LimitOf::Named("llm"));
        let keys = [
            state_key(own, Place::Single),
            state_key(own, Place::Slot(3)),
            state_key(own, Place::Overflow),
            state_key(named, Place::Single),
            state_key(named, Place::Slot(3)),
            state_key(named, Place::Overflow),
            fair_key(own),
            fair_key(named),
            fair_slots_key(own),
            fair_slots_key(named),
        ];
        assert_eq!(
            keys,
            [
                "sluice/b/llm",
                "sluice/b/llm/3",
                "sluice/b/llm/overflow",
                "sluice/l/llm",
                "sluice/l/llm/3",
                "sluice/l/llm/overflow",
                "sluice/f/llm",
                "sluice/fl/llm",
                "sluice/fs/llm",
                "sluice/fsl/llm",
            ]
        );
    }

    /// A value of every layout that is not what its reader expects is
    /// replaced by a fresh one, and counted, never trusted.
    #[test]
    fn a_broken_value_of_any_entry_starts_fresh_and_is_counted() {
        let host = FakeHost::at(Instant::from_nanos(1));
        let mut store = Store::default();
        let rate = limiter();
        for key in [
            "marker", "counter", "time", "state", "owned", "set", "set-id", "shares",
        ] {
            host.shared
                .borrow_mut()
                .insert(key.into(), (vec![7, 7, 7], 5));
        }
        let seen = store.update_as::<Marker, _, _>(&host, "marker", |m| (m.0, false));
        let count = store.update_as::<u64, _, _>(&host, "counter", |n| (*n, false));
        let at = store.update_as::<Instant, _, _>(&host, "time", |t| (*t, false));
        let state = store.update_with(&host, "state", &LimitState(&rate), |s| (*s, false));
        let owned = store.update_with(&host, "owned", &OwnedLimitState(&rate), |e| (e.0, false));
        let set = store.update_as::<Option<crate::sync::PublishedSet>, _, _>(&host, "set", |s| {
            (s.is_none(), false)
        });
        let set_id =
            store.update_as::<Option<crate::sync::SetId>, _, _>(&host, "set-id", |id| (*id, false));
        let shares =
            store.update_as::<crate::sync::fleet::PublishedShares, _, _>(&host, "shares", |s| {
                (s.seq, false)
            });
        assert_eq!(seen, Ok(false));
        assert_eq!(count, Ok(0));
        assert_eq!(at, Ok(Instant::EPOCH));
        assert_eq!(state, Ok(rate.initial_state()));
        assert_eq!(owned, Ok(0));
        assert_eq!((set, set_id, shares), (Ok(true), Ok(None), Ok(0)));
        let mut metrics = Metrics::default();
        store.flush_into(&mut metrics);
        assert_eq!(metrics.pending_filter(FilterCounter::StateDecodeErrors), 8);
        // A missing value is no fault.
        let fresh = store.update_as::<u64, _, _>(&host, "missing", |n| (*n, false));
        assert_eq!(fresh, Ok(0));
        store.flush_into(&mut metrics);
        assert_eq!(metrics.pending_filter(FilterCounter::StateDecodeErrors), 8);
    }

    proptest! {
        #[test]
        fn every_layout_reads_what_it_wrote(n in any::<u64>(), owner in any::<u64>(), seen in any::<bool>()) {
            prop_assert_eq!(round_trip(&Plain::<u64>::default(), &n), Some(n));
            let at = Instant::from_nanos(n);
            prop_assert_eq!(round_trip(&Plain::<Instant>::default(), &at), Some(at));
            prop_assert_eq!(round_trip(&Plain::<Marker>::default(), &Marker(seen)), Some(Marker(seen)));
            let rate = limiter();
            let state = rate.initial_state();
            prop_assert_eq!(round_trip(&LimitState(&rate), &state), Some(state));
            let entry = (owner, state);
            prop_assert_eq!(round_trip(&OwnedLimitState(&rate), &entry), Some(entry));
        }

        #[test]
        fn any_bytes_read_as_a_value_or_nothing(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let rate = limiter();
            let _ = OwnedLimitState(&rate).decode(&bytes);
            let _ = LimitState(&rate).decode(&bytes);
            let _ = Plain::<Marker>::default().decode(&bytes);
            let _ = Plain::<Instant>::default().decode(&bytes);
            let _ = Json::<BTreeMap<String, u64>>::default().decode(&bytes);
        }
    }
}
