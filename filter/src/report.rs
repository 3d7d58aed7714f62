//! The utilization report: per-policy counters summed over the workers in
//! `sluice/report` in shared data (per further limit in
//! `sluice/report/limits`), which the syncing VM sends to the admin.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sluice_shared::key_view::{KeysReport, ENVOY_TOP_KEYS};
use sluice_shared::time::Instant;
use sluice_wire::sync::MAX_REPORT_KEYED;

use crate::counters::{Counters, DeltaCounters, LimitCounters};
use crate::entries::{self, Json, KEYS_REPORT_KEY, LIMIT_REPORT_KEY, REFUSED_KEY, REPORT_KEY};
use crate::host::Host;
use crate::store::{Store, StoreError};
use sluice_shared::spend::{keep_last_refusals, RefusedCall};

/// The Envoy's per-key counts since the syncing VM last took them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
struct SharedKeys {
    since_ms: u64,
    policies: BTreeMap<String, KeysReport>,
}

/// Adds one worker's per-key counts (since `since`) into the Envoy's.
pub fn add_to_keys_report<H: Host + ?Sized>(
    host: &H,
    store: &mut Store,
    since: Instant,
    pending: &BTreeMap<String, KeysReport>,
) -> Result<(), StoreError> {
    store.update_with(
        host,
        KEYS_REPORT_KEY,
        &Json::default(),
        |shared: &mut SharedKeys| {
            if shared.since_ms == 0 {
                shared.since_ms = since.as_millis();
            }
            for (policy, keys) in pending {
                shared
                    .policies
                    .entry(policy.clone())
                    .or_default()
                    .merge(keys, ENVOY_TOP_KEYS);
            }
            ((), true)
        },
    )
}

/// Takes the Envoy's per-key counts for a report, leaving none: each
/// report covers the span since the previous one. Only policies still in
/// `keep` are reported (a removed policy's counts go with it).
pub fn take_keys_report<H: Host + ?Sized>(
    host: &H,
    store: &mut Store,
    now: Instant,
    keep: impl Fn(&str) -> bool,
) -> BTreeMap<String, KeysReport> {
    let fresh = SharedKeys {
        since_ms: now.as_millis(),
        policies: BTreeMap::new(),
    };
    let taken = store.update_with(host, KEYS_REPORT_KEY, &Json::default(), |shared| {
        (std::mem::replace(shared, fresh.clone()), true)
    });
    // A failure is counted and logged by the store; the view misses a span.
    let Ok(taken) = taken else {
        return BTreeMap::new();
    };
    let since_ms = taken.since_ms.min(now.as_millis());
    taken
        .policies
        .into_iter()
        .filter(|(policy, keys)| keep(policy) && !keys.is_empty())
        .take(MAX_REPORT_KEYED)
        .map(|(policy, mut keys)| {
            keys.since_ms = since_ms;
            (policy, keys)
        })
        .collect()
}

pub fn read_report<H: Host + ?Sized>(host: &H) -> BTreeMap<String, Counters> {
    entries::read(host, REPORT_KEY, &Json::default())
}

/// Adds one worker's deltas into the shared report.
pub fn add_to_report<H: Host + ?Sized>(
    host: &H,
    store: &mut Store,
    deltas: &BTreeMap<String, DeltaCounters>,
) -> Result<(), StoreError> {
    add_into(host, store, REPORT_KEY, deltas, Counters::add_deltas)
}

pub fn read_limit_report<H: Host + ?Sized>(host: &H) -> BTreeMap<String, LimitCounters> {
    entries::read(host, LIMIT_REPORT_KEY, &Json::default())
}

/// Adds one worker's further-limit deltas into the shared report.
pub fn add_to_limit_report<H: Host + ?Sized>(
    host: &H,
    store: &mut Store,
    deltas: &BTreeMap<String, LimitCounters>,
) -> Result<(), StoreError> {
    add_into(host, store, LIMIT_REPORT_KEY, deltas, LimitCounters::add)
}

/// The last calls each limit refused, as the workers noted them.
pub fn read_refused<H: Host + ?Sized>(host: &H) -> BTreeMap<String, Vec<RefusedCall>> {
    entries::read(host, REFUSED_KEY, &Json::default())
}

/// Limits whose refusals are kept: a set names at most this many.
const MAX_REFUSING_LIMITS: usize = 1024;

/// Adds one worker's last refusals into the shared ones (per key the
/// newest); a limit gone from the set is forgotten past
/// [`MAX_REFUSING_LIMITS`].
pub fn add_refused<H: Host + ?Sized>(
    host: &H,
    store: &mut Store,
    refused: &BTreeMap<String, Vec<RefusedCall>>,
) -> Result<(), StoreError> {
    store.update_with(
        host,
        REFUSED_KEY,
        &Json::default(),
        |kept: &mut BTreeMap<String, Vec<RefusedCall>>| {
            for (limit, calls) in refused {
                keep_last_refusals(kept.entry(limit.clone()).or_default(), calls);
            }
            while kept.len() > MAX_REFUSING_LIMITS {
                kept.pop_last();
            }
            ((), true)
        },
    )
}

/// Adds one worker's deltas, by name, into the shared report at `key`.
fn add_into<H, C, D>(
    host: &H,
    store: &mut Store,
    key: &str,
    deltas: &BTreeMap<String, D>,
    add: impl Fn(&mut C, &D),
) -> Result<(), StoreError>
where
    H: Host + ?Sized,
    C: Serialize + serde::de::DeserializeOwned + Default,
{
    store.update_with(
        host,
        key,
        &Json::default(),
        |report: &mut BTreeMap<String, C>| {
            for (name, d) in deltas {
                add(report.entry(name.clone()).or_default(), d);
            }
            ((), true)
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::Host;
    use crate::testing::FakeHost;
    use sluice_shared::key_view::{label_secret, name_key, KeyOutcome};
    use sluice_shared::KeyLabel;
    use sluice_wire::stats::PolicyCounter;

    #[test]
    fn report_sums_workers_including_in_flight_going_down() {
        let host = FakeHost::at(Instant::EPOCH);
        let mut stats = Store::default();
        let delta = |admitted: i64, in_flight: i64| {
            let mut d = DeltaCounters::default();
            d.add(PolicyCounter::Admitted, admitted);
            d.add(PolicyCounter::InFlight, in_flight);
            BTreeMap::from([("bank".to_string(), d)])
        };
        let (a, b) = (delta(5, 3), delta(2, -1));
        add_to_report(&host, &mut stats, &a).unwrap();
        add_to_report(&host, &mut stats, &b).unwrap();
        let report = crate::counters::policy_report(read_report(&host)["bank"]);
        let counts = report.counts;
        assert_eq!(
            (
                counts[PolicyCounter::Admitted],
                counts[PolicyCounter::InFlight]
            ),
            (7, 2)
        );
    }

    #[test]
    fn per_key_counts_add_up_over_workers_and_start_over_when_taken() {
        let host = FakeHost::at(Instant::EPOCH + sluice_shared::Span::from_secs(100));
        let mut store = Store::default();
        let secret = label_secret(Some("t"));
        let key = |v: &[u8]| name_key(&secret, "llm", v, KeyLabel::Hash);
        let mut worker = |n: u64, value: &[u8]| {
            let mut pending = BTreeMap::new();
            let keys: &mut KeysReport = pending.entry("llm".to_string()).or_default();
            for _ in 0..n {
                keys.record(&key(value), KeyOutcome::Admitted, false, 32);
            }
            add_to_keys_report(&host, &mut store, host.now(), &pending).unwrap();
        };
        worker(5, b"a");
        worker(3, b"a");
        worker(2, b"b");
        let now = host.now() + sluice_shared::Span::from_secs(1);
        let taken = take_keys_report(&host, &mut store, now, |p| p == "llm");
        let llm = &taken["llm"];
        assert_eq!(llm.since_ms, host.now().as_millis());
        assert_eq!(llm.top.total, 10);
        let a = llm
            .top
            .keys
            .iter()
            .find(|k| k.hash == key(b"a").hash)
            .unwrap();
        assert_eq!(a.admitted, 8);
        assert!(take_keys_report(&host, &mut store, now, |_| true).is_empty());
    }

    #[test]
    fn broken_per_key_counts_in_shared_data_are_started_over() {
        let host = FakeHost::at(Instant::EPOCH + sluice_shared::Span::from_secs(100));
        let mut store = Store::default();
        for junk in [
            &b"{"[..],
            b"[]",
            b"{\"since_ms\":1,\"policies\":{\"x\":{\"seen\":[1]}}}",
        ] {
            host.shared_set(KEYS_REPORT_KEY, junk, None).unwrap();
            assert!(take_keys_report(&host, &mut store, host.now(), |_| true).is_empty());
            let mut pending = BTreeMap::new();
            pending.insert("x".to_string(), KeysReport::default());
            add_to_keys_report(&host, &mut store, host.now(), &pending).unwrap();
        }
    }
}
