//! Policy sync with the admin, through Envoy shared data so that one VM
//! talks to the admin per interval and every worker installs the result.
//!
//! - `sluice/sync`: whose turn it is: the next sync instant and the count of
//!   consecutive failures (for backoff). A VM claims a turn by CAS.
//! - `sluice/policyset`: the last good policy set from the admin, as its
//!   version (8 bytes) followed by its JSON. Written only with a newer
//!   version, and only after validation, so a bad answer never replaces it.
//! - `sluice/policyset/version`: the version alone, which every worker
//!   reads on its tick (8 bytes) to notice a new set cheaply.
//! - `sluice/report`: per-policy counters summed over the workers, which the
//!   syncing VM sends as the utilization snapshot.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sluice_shared::limiter::Nanos;
use sluice_shared::plugin::PluginConfig;
use sluice_shared::sync::{PolicyReport, SYNC_PATH};
use sluice_shared::validate::parse_policy_set;
use sluice_shared::PolicySet;

use crate::host::Host;
use crate::store::{update_bytes, StoreError, StoreStats};

pub const SYNC_KEY: &str = "sluice/sync";
pub const POLICY_SET_KEY: &str = "sluice/policyset";
pub const POLICY_VERSION_KEY: &str = "sluice/policyset/version";
pub const REPORT_KEY: &str = "sluice/report";

/// Longest wait between attempts while the admin keeps failing.
const MAX_BACKOFF_NS: Nanos = 30_000_000_000;
/// Larger answers are refused unread.
pub const MAX_RESPONSE_BYTES: usize = 1 << 20;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncSettings {
    pub instance: String,
    pub cluster: String,
    pub authority: String,
    pub interval_ns: Nanos,
    pub token: Option<String>,
}

impl SyncSettings {
    /// None when the configuration names no admin cluster: no sync.
    pub fn from_config(config: &PluginConfig) -> Option<Self> {
        Some(Self {
            instance: config.instance.clone(),
            cluster: config.admin_cluster.clone()?,
            authority: config.admin_authority.clone(),
            interval_ns: config.sync_interval.as_nanos(),
            token: config.sync_token.clone(),
        })
    }

    /// An answer slower than the interval is as good as none.
    pub fn timeout_ms(&self) -> u64 {
        (self.interval_ns / 1_000_000).clamp(100, 5_000)
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Turn {
    next_due: Nanos,
    failures: u32,
}

impl Turn {
    fn decode(bytes: Option<&[u8]>) -> Self {
        let Some(b) = bytes.filter(|b| b.len() == 12) else {
            return Self::default();
        };
        let mut due = [0u8; 8];
        due.copy_from_slice(&b[..8]);
        let mut failures = [0u8; 4];
        failures.copy_from_slice(&b[8..]);
        Self {
            next_due: u64::from_le_bytes(due),
            failures: u32::from_le_bytes(failures),
        }
    }

    fn encode(self) -> Vec<u8> {
        let mut out = self.next_due.to_le_bytes().to_vec();
        out.extend_from_slice(&self.failures.to_le_bytes());
        out
    }
}

/// Takes the sync turn if it is due: true means this VM syncs now.
pub fn claim_turn<H: Host + ?Sized>(
    host: &H,
    stats: &mut StoreStats,
    now: Nanos,
    interval: Nanos,
) -> bool {
    update_bytes(host, SYNC_KEY, stats, |cur| {
        let mut turn = Turn::decode(cur);
        if now < turn.next_due {
            return (false, None);
        }
        turn.next_due = now.saturating_add(interval);
        (true, Some(turn.encode()))
    })
    .unwrap_or(false)
}

/// After a sync: a failure pushes the next turn back, doubling up to 30 s;
/// a success clears the backoff.
pub fn finish_turn<H: Host + ?Sized>(
    host: &H,
    stats: &mut StoreStats,
    now: Nanos,
    interval: Nanos,
    ok: bool,
) {
    let _ = update_bytes(host, SYNC_KEY, stats, |cur| {
        let mut turn = Turn::decode(cur);
        if ok {
            if turn.failures == 0 {
                return ((), None);
            }
            turn.failures = 0;
        } else {
            turn.failures = turn.failures.saturating_add(1);
            let backoff = interval
                .saturating_mul(1 << turn.failures.min(16))
                .min(MAX_BACKOFF_NS);
            turn.next_due = now.saturating_add(backoff.max(interval));
        }
        ((), Some(turn.encode()))
    });
}

pub(crate) fn read_u64(bytes: Option<&[u8]>) -> Option<u64> {
    let b = bytes?.get(..8)?;
    let mut a = [0u8; 8];
    a.copy_from_slice(b);
    Some(u64::from_le_bytes(a))
}

/// The version hint every worker polls.
pub fn published_version<H: Host + ?Sized>(host: &H) -> Option<u64> {
    read_u64(host.shared_get(POLICY_VERSION_KEY).0.as_deref())
}

/// The last good policy set from the admin, if any. A value that fails to
/// decode or validate is ignored (and never written in the first place).
pub fn published_set<H: Host + ?Sized>(host: &H) -> Option<PolicySet> {
    let bytes = host.shared_get(POLICY_SET_KEY).0?;
    let json = std::str::from_utf8(bytes.get(8..)?).ok()?;
    parse_policy_set(json).ok()
}

/// Stores a validated set for every worker, unless a newer one is there.
/// True if it was stored.
pub fn publish<H: Host + ?Sized>(
    host: &H,
    stats: &mut StoreStats,
    set: &PolicySet,
) -> Result<bool, StoreError> {
    let json = serde_json::to_vec(set).unwrap_or_default();
    let stored = update_bytes(host, POLICY_SET_KEY, stats, |cur| {
        if read_u64(cur).is_some_and(|v| v >= set.version) {
            return (false, None);
        }
        let mut value = set.version.to_le_bytes().to_vec();
        value.extend_from_slice(&json);
        (true, Some(value))
    })?;
    if stored {
        update_bytes(host, POLICY_VERSION_KEY, stats, |cur| {
            if read_u64(cur).is_some_and(|v| v >= set.version) {
                return ((), None);
            }
            ((), Some(set.version.to_le_bytes().to_vec()))
        })?;
    }
    Ok(stored)
}

/// What came back from the admin.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    /// 200 with a valid policy set.
    PolicySet(PolicySet),
    /// 304: the set we have is current.
    Unchanged,
    /// Anything else; the last good set stays.
    Failed(String),
}

pub fn interpret(status: Option<u16>, body: Option<&[u8]>) -> Answer {
    match status {
        Some(304) => Answer::Unchanged,
        Some(200) => {
            let Some(body) = body else {
                return Answer::Failed("empty answer".into());
            };
            let Ok(json) = std::str::from_utf8(body) else {
                return Answer::Failed("answer is not UTF-8".into());
            };
            match parse_policy_set(json) {
                Ok(set) => Answer::PolicySet(set),
                Err(errors) => Answer::Failed(format!("refused an invalid policy set: {errors}")),
            }
        }
        Some(status) => Answer::Failed(format!("admin answered HTTP {status}")),
        None => Answer::Failed("no answer (admin unreachable or too slow)".into()),
    }
}

/// Counters as workers add them up; `in_flight` moves both ways, so it is
/// summed with wrapping arithmetic and read as the net total.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    pub admitted: u64,
    pub rejected: u64,
    pub queued: u64,
    pub queue_timeouts: u64,
    pub shadow_limited: u64,
    pub in_flight: u64,
}

impl Counters {
    pub fn add(&mut self, other: &DeltaCounters) {
        self.admitted = self.admitted.wrapping_add_signed(other.admitted);
        self.rejected = self.rejected.wrapping_add_signed(other.rejected);
        self.queued = self.queued.wrapping_add_signed(other.queued);
        self.queue_timeouts = self
            .queue_timeouts
            .wrapping_add_signed(other.queue_timeouts);
        self.shadow_limited = self
            .shadow_limited
            .wrapping_add_signed(other.shadow_limited);
        self.in_flight = self.in_flight.wrapping_add_signed(other.in_flight);
    }

    pub fn to_report(self) -> PolicyReport {
        PolicyReport {
            admitted: self.admitted,
            rejected: self.rejected,
            queued: self.queued,
            queue_timeouts: self.queue_timeouts,
            shadow_limited: self.shadow_limited,
            // A net total below zero can only be a worker that died mid-count.
            in_flight: if (self.in_flight as i64) < 0 {
                0
            } else {
                self.in_flight
            },
            ..PolicyReport::default()
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeltaCounters {
    pub admitted: i64,
    pub rejected: i64,
    pub queued: i64,
    pub queue_timeouts: i64,
    pub shadow_limited: i64,
    pub in_flight: i64,
}

impl DeltaCounters {
    pub fn is_zero(&self) -> bool {
        *self == Self::default()
    }
}

pub fn read_report<H: Host + ?Sized>(host: &H) -> BTreeMap<String, Counters> {
    host.shared_get(REPORT_KEY)
        .0
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

/// Adds one worker's deltas into the shared report.
pub fn add_to_report<H: Host + ?Sized>(
    host: &H,
    stats: &mut StoreStats,
    deltas: &BTreeMap<String, DeltaCounters>,
) -> Result<(), StoreError> {
    update_bytes(host, REPORT_KEY, stats, |cur| {
        let mut report: BTreeMap<String, Counters> = cur
            .and_then(|b| serde_json::from_slice(b).ok())
            .unwrap_or_default();
        for (policy, d) in deltas {
            report.entry(policy.clone()).or_default().add(d);
        }
        ((), Some(serde_json::to_vec(&report).unwrap_or_default()))
    })
}

/// The request to the admin: headers and body.
pub fn request(settings: &SyncSettings, body: &[u8]) -> (Vec<(String, String)>, Vec<u8>) {
    let mut headers = vec![
        (":method".to_string(), "POST".to_string()),
        (":path".to_string(), SYNC_PATH.to_string()),
        (":authority".to_string(), settings.authority.clone()),
        ("content-type".to_string(), "application/json".to_string()),
    ];
    if let Some(token) = &settings.token {
        headers.push(("authorization".to_string(), format!("Bearer {token}")));
    }
    (headers, body.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::FakeHost;

    const SEC: u64 = 1_000_000_000;

    fn set(version: u64, requests: u64) -> PolicySet {
        parse_policy_set(&format!(
            r#"{{"version": {version}, "policies": [{{"name": "bank", "match": {{"host": "b"}}, "rate": {{"requests": {requests}, "period": "1s"}}}}]}}"#
        ))
        .unwrap()
    }

    #[test]
    fn one_vm_per_interval_gets_the_turn_and_failures_back_off() {
        let host = FakeHost::at(10 * SEC);
        let mut stats = StoreStats::default();
        assert!(claim_turn(&host, &mut stats, 10 * SEC, SEC));
        assert!(
            !claim_turn(&host, &mut stats, 10 * SEC + 1, SEC),
            "a second VM waits"
        );
        assert!(claim_turn(&host, &mut stats, 11 * SEC, SEC));
        // Three failures: 2 s, 4 s, 8 s.
        let mut now = 11 * SEC;
        for expected in [2, 4, 8] {
            finish_turn(&host, &mut stats, now, SEC, false);
            assert!(!claim_turn(
                &host,
                &mut stats,
                now + expected * SEC - 1,
                SEC
            ));
            now += expected * SEC;
            assert!(claim_turn(&host, &mut stats, now, SEC));
        }
        for _ in 0..20 {
            finish_turn(&host, &mut stats, now, SEC, false);
        }
        assert!(
            claim_turn(&host, &mut stats, now + 30 * SEC, SEC),
            "backoff stops at 30 s"
        );
        finish_turn(&host, &mut stats, now + 30 * SEC, SEC, true);
        assert!(
            claim_turn(&host, &mut stats, now + 31 * SEC, SEC),
            "success: back to the interval"
        );
    }

    #[test]
    fn only_newer_valid_sets_are_published() {
        let host = FakeHost::at(0);
        let mut stats = StoreStats::default();
        assert_eq!(published_version(&host), None);
        assert!(publish(&host, &mut stats, &set(3, 10)).unwrap());
        assert!(!publish(&host, &mut stats, &set(2, 99)).unwrap(), "older");
        assert!(
            !publish(&host, &mut stats, &set(3, 99)).unwrap(),
            "same version"
        );
        assert_eq!(published_version(&host), Some(3));
        assert_eq!(published_set(&host).unwrap(), set(3, 10));
        assert!(publish(&host, &mut stats, &set(4, 20)).unwrap());
        assert_eq!(published_set(&host).unwrap().version, 4);
    }

    #[test]
    fn bad_answers_are_failures_never_sets() {
        assert_eq!(interpret(Some(304), None), Answer::Unchanged);
        assert!(matches!(
            interpret(Some(200), Some(br#"{"version": 2, "policies": []}"#)),
            Answer::PolicySet(_)
        ));
        for (status, body) in [
            (Some(200), Some(&b"garbage"[..])),
            (Some(200), Some(&b"\xff\xfe"[..])),
            (Some(200), None),
            (Some(200), Some(&br#"{"version": 2, "policies": [{"name": "x", "match": {"host": "a"}, "rate": {"requests": 0, "period": "1s"}}]}"#[..])),
            (Some(500), Some(&b"oops"[..])),
            (None, None),
        ] {
            assert!(matches!(interpret(status, body), Answer::Failed(_)), "{status:?} {body:?}");
        }
        let Answer::Failed(why) = interpret(Some(200), Some(br#"{"version": 2, "policies": [{"name": "x", "match": {"host": "a"}, "rate": {"requests": 0, "period": "1s"}}]}"#)) else {
            panic!()
        };
        assert!(why.contains("policies[0].rate.requests"), "{why}");
    }

    #[test]
    fn report_sums_workers_including_in_flight_going_down() {
        let host = FakeHost::at(0);
        let mut stats = StoreStats::default();
        let mut a = BTreeMap::new();
        a.insert(
            "bank".to_string(),
            DeltaCounters {
                admitted: 5,
                in_flight: 3,
                ..Default::default()
            },
        );
        let mut b = BTreeMap::new();
        b.insert(
            "bank".to_string(),
            DeltaCounters {
                admitted: 2,
                in_flight: -1,
                ..Default::default()
            },
        );
        add_to_report(&host, &mut stats, &a).unwrap();
        add_to_report(&host, &mut stats, &b).unwrap();
        let report = read_report(&host)["bank"].to_report();
        assert_eq!((report.admitted, report.in_flight), (7, 2));
    }
}
