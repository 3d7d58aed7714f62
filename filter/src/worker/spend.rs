//! What each limit of an hour or longer (a daily token budget, a monthly
//! money budget) has spent this period, for the live view
//! ([`sluice_shared::spend`]).
//!
//! An unkeyed limit's spend is its one state's. A keyed limit's is in up to
//! `max_keys` places: the VM whose turn it is to report reads a slice of
//! them ([`SCAN_PER_REPORT`]), remembers what each held, and reports the
//! top spenders of all it remembers, so a report costs the same however
//! many keys there are. Each VM remembers what it read itself: with `n`
//! VMs taking turns a place is at most `n * max_keys / SCAN_PER_REPORT`
//! reports old. So that a key one VM has read is not missing from the
//! next VM's report (the live view would show it come and go until every
//! VM had read it), the reporting VM leaves the places of its top
//! spenders in shared data ([`entries::spend_top_key`]) and each VM
//! reads those first. For a keyed budget it also reports the keys whose spend
//! differs from what it last read (`budget_keys`, held by the admin across
//! restarts, see `budgets.rs`); a key that gave its place up is reported
//! as having spent nothing.
//!
//! With a sync token, such a limit's keys are hashed with the live view's
//! label secret (see [`CompiledPolicy::limit_keys`]): the same key has the
//! same hash on every Envoy, so the admin adds a key's spend up, and its
//! label is the one the admin finds for a typed key. Keys shown as their
//! values (`label: value`) have their labels written once per worker to a
//! small shared-data map ([`MAX_LABELS`]); a key not in it shows its hash.

use std::collections::{BTreeMap, BTreeSet};

use rustc_hash::{FxHashMap, FxHashSet};
use sluice_filter_core::matcher::{CompiledLimit, CompiledPolicy, RequestAtHand};
use sluice_shared::key_hash::KeySecret;
use sluice_shared::key_view::{hash_label, label_secret, SHOWN_TOP_KEYS};
use sluice_shared::limiter::{RateLimiter, RateState, Standing};
use sluice_shared::policy::KeyLabel;
use sluice_shared::request_headers::RequestHeaders;
use sluice_shared::spend::{top_spenders, KeySpend, SpendReport};
use sluice_shared::time::Instant;
use sluice_wire::sync::{KeySpent, MAX_KEYS_REPORTED};

use super::ctx::Ctx;
use super::key_places::owner_of;
use crate::entries::{
    self, spend_labels_key, spend_parents_key, spend_top_key, state_key, Codec, Json, LimitOf,
    OwnedLimitState, Place,
};
use crate::host::Host;
use crate::store::StoreError;

/// Places of keyed limits the reporting VM reads per report, in all (each
/// keyed limit of an hour or longer its part, at least one): a report then
/// says at most twice as many keys of keyed budgets (a key that left a
/// place and the one now in it), which keeps it well within the admin's
/// body limit however many keyed budgets the set has.
pub(super) const SCAN_PER_REPORT: u32 = 1024;
/// Labels a keyed limit keeps in shared data; past it, the lowest hashes
/// give way.
pub(super) const MAX_LABELS: usize = 256;
/// Owners a worker remembers having labelled, before it starts over.
const MAX_WRITTEN: usize = 4096;
/// The label of the place shared by keys that found none of their own.
pub(super) const OVERFLOW_LABEL: &str = "(keys without a place)";

/// The worker's side of each call: the secret keys of such limits are
/// hashed with, and the labels it has written.
#[derive(Debug, Default)]
pub(super) struct SpendLabels {
    secret: Option<KeySecret>,
    /// Whether an admin is told (labels are written only then).
    reporting: bool,
    written: FxHashSet<u64>,
}

impl SpendLabels {
    /// With an admin and a sync token (`Some(Some(token))`), keys of long
    /// limits are hashed with the label secret; otherwise with the Envoy's
    /// own.
    pub fn configure(&mut self, reporting_with: Option<Option<&str>>) {
        self.secret = reporting_with.flatten().map(|t| label_secret(Some(t)));
        self.reporting = reporting_with.is_some();
        self.written.clear();
    }

    pub fn secret(&self) -> Option<&KeySecret> {
        self.secret.as_ref()
    }

    /// The live-view tags of a call's keys (`keys`, from `limit_keys`,
    /// hashed with [`Self::secret`] or else `own`, the Envoy's) in
    /// `policy`'s long limits: the label of a key shown by value, the key
    /// its call carried in the limit's keyed parent budget; but for keys
    /// this worker tagged already. Found while the request is at hand, for
    /// a call that may hold its limits only when it leaves the queue.
    /// The labels of a call's keys in `policy`'s limits and, for a pool
    /// call, in each member's it may leave for (`members`: a member's
    /// policy and the call's keys in its limits).
    pub fn labels_of_all<'p, R: RequestHeaders + ?Sized>(
        &self,
        policy: &CompiledPolicy,
        request: RequestAtHand<'_, R>,
        keys: &[Option<u64>],
        members: impl Iterator<Item = (&'p CompiledPolicy, &'p [Option<u64>])>,
        own: &KeySecret,
    ) -> KeyLabels {
        let mut labels = self.labels_of(policy, request, keys, own);
        for (member, keys) in members {
            labels.extend(self.labels_of(member, request, keys, own));
        }
        labels
    }

    pub fn labels_of<R: RequestHeaders + ?Sized>(
        &self,
        policy: &CompiledPolicy,
        request: RequestAtHand<'_, R>,
        keys: &[Option<u64>],
        own: &KeySecret,
    ) -> KeyLabels {
        let RequestAtHand { headers: req, body } = request;
        let mut labels = KeyLabels::default();
        if !self.reporting {
            return labels;
        }
        let secret = self.secret.as_ref().unwrap_or(own);
        for (index, limit) in policy.limits.iter().enumerate() {
            let Some(Some(hash)) = keys.get(index).filter(|_| limit.spends_over_hours) else {
                continue;
            };
            let parent = limit
                .parent
                .and_then(|p| keys.get(p).copied().flatten())
                .map_or(0, owner_of);
            let shown_by_label = limit.key_label != KeyLabel::Hash;
            let owner = owner_of(*hash);
            if (!shown_by_label && parent == 0) || self.written.contains(&owner) {
                continue;
            }
            let label = shown_by_label
                .then(|| policy.limit_key_name(index, req, secret, body))
                .flatten()
                .map(|name| name.label);
            labels.0.push(KeyTag {
                limit: limit.name.clone(),
                owner,
                label,
                parent,
            });
        }
        labels
    }

    /// Writes the tags of a call that holds its limits, once per key.
    pub fn record<H: Host + ?Sized>(&mut self, ctx: &mut Ctx<'_, H>, labels: &KeyLabels) {
        for tag in &labels.0 {
            if self.written.contains(&tag.owner) {
                continue;
            }
            let mut written = Ok(());
            if let Some(label) = &tag.label {
                written = written.and(write_tag(
                    ctx,
                    &spend_labels_key(&tag.limit),
                    tag.owner,
                    label,
                ));
            }
            if tag.parent != 0 {
                written = written.and(write_tag(
                    ctx,
                    &spend_parents_key(&tag.limit),
                    tag.owner,
                    &tag.parent,
                ));
            }
            // A failure is counted by the store; the key shows its hash
            // (and stands on its own in the tree) until a later call
            // writes it.
            if written.is_ok() {
                if self.written.len() >= MAX_WRITTEN {
                    self.written.clear();
                }
                self.written.insert(tag.owner);
            }
        }
    }
}

/// Sets `owner`'s entry in the shared-data map at `key` to `value`,
/// keeping at most [`MAX_LABELS`] (the lowest owners give way).
fn write_tag<H: Host + ?Sized, V>(
    ctx: &mut Ctx<'_, H>,
    key: &str,
    owner: u64,
    value: &V,
) -> Result<(), StoreError>
where
    V: Clone + PartialEq + serde::Serialize + serde::de::DeserializeOwned,
{
    ctx.store
        .update_with(ctx.host, key, &Json::<BTreeMap<u64, V>>::default(), |map| {
            if map.get(&owner) == Some(value) {
                return ((), false);
            }
            map.insert(owner, value.clone());
            while map.len() > MAX_LABELS {
                map.pop_first();
            }
            ((), true)
        })
}

/// What the live view learns of one key of a call: its label (a key
/// shown by value) and the key its call carried in the limit's parent
/// budget (0: none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct KeyTag {
    limit: String,
    owner: u64,
    label: Option<String>,
    parent: u64,
}

/// A call's keys' tags for the live view.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct KeyLabels(Vec<KeyTag>);

impl KeyLabels {
    /// Both calls' tags (a queued pool call's, for each member it may
    /// leave for).
    pub fn extend(&mut self, other: KeyLabels) {
        for tag in other.0 {
            if !self.0.contains(&tag) {
                self.0.push(tag);
            }
        }
    }
}

/// The reporting VM's memory of keyed limits' places.
#[derive(Debug, Default)]
pub(super) struct SpendScan {
    keyed: BTreeMap<String, KeyedScan>,
    /// Places each keyed limit reads this report.
    per_limit: u32,
    /// Per keyed budget, the keys whose spend changed since the last
    /// report (the admin keeps them across restarts, see `budgets.rs`).
    changed: BTreeMap<String, Vec<KeySpent>>,
}

#[derive(Debug, Default)]
struct KeyedScan {
    /// The places a key held when read (by place): its owner, what it had
    /// spent, and when its period renews (the Envoy's clock, ms). Places
    /// nobody held are left out, so this grows with the keys in use, not
    /// with `max_keys` (up to a million).
    held: FxHashMap<u32, HeldPlace>,
    /// How many places the limit has.
    places: u32,
    next: u32,
}

#[derive(Debug, Clone, Copy)]
struct HeldPlace {
    owner: u64,
    spent: u64,
    renews_at: u64,
}

impl SpendScan {
    /// Starts a report of `limits` (the set's, a limit named twice
    /// counted once): forgets the limits no longer in it, and divides
    /// [`SCAN_PER_REPORT`] between its keyed limits of an hour or longer.
    pub fn begin<'a>(&mut self, limits: impl Iterator<Item = &'a CompiledLimit>) {
        let mut names = BTreeSet::new();
        let mut keyed = BTreeSet::new();
        for limit in limits {
            names.insert(limit.name.as_str());
            if limit.spends_over_hours && limit.keys.is_some() {
                keyed.insert(limit.name.as_str());
            }
        }
        self.keyed.retain(|name, _| names.contains(name.as_str()));
        self.changed.retain(|name, _| names.contains(name.as_str()));
        let count = u32::try_from(keyed.len()).unwrap_or(u32::MAX).max(1);
        self.per_limit = (SCAN_PER_REPORT / count).max(1);
    }

    /// The keys of keyed budgets whose spend changed since the last call,
    /// at most [`MAX_KEYS_REPORTED`] in all (reached only by a set of more
    /// than a thousand keyed budgets, each reading one place a report).
    pub fn take_changed(&mut self) -> BTreeMap<String, Vec<KeySpent>> {
        let mut changed = std::mem::take(&mut self.changed);
        let mut room = MAX_KEYS_REPORTED;
        for keys in changed.values_mut() {
            keys.truncate(room);
            room -= keys.len();
        }
        changed.retain(|_, keys| !keys.is_empty());
        changed
    }

    /// What `limit` has spent this period, if it is one of an hour or
    /// longer: an unkeyed one's from `state` (its one state, as the report
    /// read it), a keyed one's from its places. Garbage in shared data reads
    /// as a fresh state, as the limit itself reads it.
    pub fn report<H: Host + ?Sized>(
        &mut self,
        host: &H,
        limit: &CompiledLimit,
        state: Option<&RateState>,
        now: Instant,
    ) -> Option<SpendReport> {
        if !limit.spends_over_hours {
            return None;
        }
        let rate = &limit.rate;
        let Some((max_keys, _)) = limit.keys else {
            let standing = Standing::of(rate, state?, now);
            return Some(SpendReport {
                spent: standing.spent,
                size: standing.size,
                renews_in_ms: standing.until_reset.as_millis(),
                ..SpendReport::default()
            });
        };
        let size = rate.available(&rate.initial_state(), now);
        let scan = self.keyed.entry(limit.name.clone()).or_default();
        let places = max_keys.max(1);
        if scan.places != places {
            *scan = KeyedScan {
                places,
                ..KeyedScan::default()
            };
        }
        let changed =
            scan.read_hinted_and_next(host, limit, self.per_limit.max(1).min(places), now);
        if limit.keyed_budget && !changed.is_empty() {
            // Taken at every report: at most twice the places read.
            let list = self.changed.entry(limit.name.clone()).or_default();
            list.extend(changed);
            let over = list.len().saturating_sub(MAX_KEYS_REPORTED);
            list.drain(..over);
        }
        let (_, overflow_spent, _) = spent_at(
            host,
            rate,
            &state_key(LimitOf::Named(&limit.name), Place::Overflow),
            now,
        );
        // Labels for the top only: a limit may have thousands of keys.
        let mut top: Vec<(u64, u64)> = scan.spending().collect();
        if overflow_spent > 0 {
            top.push((0, overflow_spent));
        }
        top.sort_unstable_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        top.truncate(SHOWN_TOP_KEYS);
        Some(SpendReport {
            spent: scan
                .spending()
                .map(|(_, spent)| spent)
                .fold(overflow_spent, u64::saturating_add),
            size,
            renews_in_ms: scan.renews_in_ms(now),
            spending_keys: scan.spending().count() as u64,
            keys: top_spenders(labelled(host, limit, top, size)),
            refused: Vec::new(),
        })
    }
}

impl KeyedScan {
    /// Reads the next `count` places of keyed `limit`, round the places:
    /// which key holds each and what it spent. Returns the keys whose
    /// spending changed (a key that gave its place up: to 0).
    fn read_next<H: Host + ?Sized>(
        &mut self,
        host: &H,
        limit: &CompiledLimit,
        count: u32,
        now: Instant,
    ) -> Vec<KeySpent> {
        let mut changed = Vec::new();
        for _ in 0..count {
            let place = self.next;
            self.read_place(host, limit, place, now, &mut changed);
            self.next = (place + 1) % self.places;
        }
        changed
    }

    /// Reads the places of the top keys the last VM to report left, then
    /// the next `count`, and leaves this VM's top for the next. Returns the
    /// keys whose spending changed.
    fn read_hinted_and_next<H: Host + ?Sized>(
        &mut self,
        host: &H,
        limit: &CompiledLimit,
        count: u32,
        now: Instant,
    ) -> Vec<KeySpent> {
        let top_key = spend_top_key(&limit.name);
        let hinted = entries::read(host, &top_key, &Json::<Vec<u32>>::default());
        let mut changed = Vec::new();
        // A hostile or stale hint reads no more places than a report shows.
        for place in hinted.iter().take(SHOWN_TOP_KEYS) {
            if *place < self.places {
                self.read_place(host, limit, *place, now, &mut changed);
            }
        }
        changed.extend(self.read_next(host, limit, count, now));
        let top_places = self.top_places();
        if top_places != hinted {
            // Only a hint: a failed write leaves the next VM to find
            // these places in its own turn.
            let _ = host.shared_set(
                &top_key,
                &Json::<Vec<u32>>::default().encode(&top_places),
                None,
            );
        }
        changed
    }

    /// Reads which key holds `place` and what it spent, adding to
    /// `changed` what differs from the last reading.
    fn read_place<H: Host + ?Sized>(
        &mut self,
        host: &H,
        limit: &CompiledLimit,
        place: u32,
        now: Instant,
        changed: &mut Vec<KeySpent>,
    ) {
        let key = state_key(LimitOf::Named(&limit.name), Place::Slot(place));
        let (owner, spent, renews_at) = spent_at(host, &limit.rate, &key, now);
        let (was_owner, was_spent) = self.held.get(&place).map_or((0, 0), |h| (h.owner, h.spent));
        if was_owner != 0 && was_owner != owner && was_spent > 0 {
            // Its key gave the place up (idle: nothing spent now).
            changed.push(KeySpent {
                owner: was_owner,
                spent: 0,
            });
        }
        if owner != 0 && (owner, spent) != (was_owner, was_spent) {
            changed.push(KeySpent { owner, spent });
        }
        if owner == 0 {
            self.held.remove(&place);
        } else {
            let held = HeldPlace {
                owner,
                spent,
                renews_at,
            };
            self.held.insert(place, held);
        }
    }

    /// The places of the [`SHOWN_TOP_KEYS`] keys that spent most, in
    /// order of place (the same set reads the same).
    fn top_places(&self) -> Vec<u32> {
        let mut top: Vec<(u32, u64)> = self
            .held
            .iter()
            .filter(|(_, h)| h.spent > 0)
            .map(|(place, h)| (*place, h.spent))
            .collect();
        top.sort_unstable_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        top.truncate(SHOWN_TOP_KEYS);
        let mut places: Vec<u32> = top.into_iter().map(|(place, _)| place).collect();
        places.sort_unstable();
        places
    }

    /// The keys spending now: (owner, spent).
    fn spending(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.held
            .values()
            .filter(|h| h.spent > 0)
            .map(|h| (h.owner, h.spent))
    }

    /// When the soonest of its spending keys renews (a fixed window
    /// renews them all at once).
    fn renews_in_ms(&self, now: Instant) -> u64 {
        self.held
            .values()
            .filter(|h| h.spent > 0)
            .map(|h| h.renews_at.saturating_sub(now.as_millis()))
            .filter(|left| *left > 0)
            .min()
            .unwrap_or(0)
    }
}

/// What the key at `key` (an entry of a limit of `rate`) spent: its
/// owner, what it spent, and when its period renews (ms).
fn spent_at<H: Host + ?Sized>(
    host: &H,
    rate: &RateLimiter,
    key: &str,
    now: Instant,
) -> (u64, u64, u64) {
    let (owner, state) = entries::read(host, key, &OwnedLimitState(rate));
    let standing = Standing::of(rate, &state, now);
    let renews_at = now.as_millis() + standing.until_reset.as_millis();
    (owner, standing.spent, renews_at)
}

/// The top spenders (owner, spent) with their labels (the overflow's, or
/// a hash's where the live view has no label).
fn labelled<H: Host + ?Sized>(
    host: &H,
    limit: &CompiledLimit,
    top: Vec<(u64, u64)>,
    size: u64,
) -> Vec<KeySpend> {
    let labels = entries::read(
        host,
        &spend_labels_key(&limit.name),
        &Json::<BTreeMap<u64, String>>::default(),
    );
    let parents = entries::read(
        host,
        &spend_parents_key(&limit.name),
        &Json::<BTreeMap<u64, u64>>::default(),
    );
    top.into_iter()
        .map(|(owner, spent)| KeySpend {
            label: match owner {
                0 => OVERFLOW_LABEL.to_string(),
                _ => labels
                    .get(&owner)
                    .cloned()
                    .unwrap_or_else(|| hash_label(owner)),
            },
            hash: owner,
            spent,
            size,
            parent: parents.get(&owner).copied().unwrap_or(0),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_filter_core::matcher::CompiledPolicySet;

    #[test]
    fn keyed_limits_share_the_places_read_and_a_report_says_at_most_its_keys() {
        let set = CompiledPolicySet::from_json(
            r#"{"version": 1, "policies": [{"name": "p", "match": {"host": "a.example"},
                "rate": {"requests": 10, "period": "1s"},
                "limits": [
                  {"name": "a", "rate": {"requests": 5, "period": "1d"}, "key": {"header": "x-a"}},
                  {"name": "b", "rate": {"requests": 5, "period": "1d"}, "key": {"header": "x-b"}},
                  {"name": "c", "rate": {"requests": 5, "period": "1d"}, "key": {"header": "x-c"}},
                  {"name": "d", "rate": {"requests": 5, "period": "1d"}, "key": {"header": "x-d"}},
                  {"name": "unkeyed", "rate": {"requests": 5, "period": "1d"}},
                  {"name": "short", "rate": {"requests": 5, "period": "1m"}, "key": {"header": "x-e"}}]}]}"#,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let mut scan = SpendScan::default();
        scan.begin(set.policies.iter().flat_map(|p| p.limits.iter()));
        assert_eq!(scan.per_limit, SCAN_PER_REPORT / 4);
        let many = |n: u64| {
            (0..n)
                .map(|owner| KeySpent { owner, spent: 1 })
                .collect::<Vec<_>>()
        };
        scan.changed.insert("a".into(), many(1_500));
        scan.changed.insert("b".into(), many(1_500));
        let taken = scan.take_changed();
        let said: usize = taken.values().map(Vec::len).sum();
        assert_eq!(said, MAX_KEYS_REPORTED);
        assert!(scan.take_changed().is_empty());
    }
}
