//! The sync protocol between the filter and the admin: what an Envoy reports
//! every `sync_interval`, and how the admin answers.
//!
//! `POST /api/v1/sync` with `Authorization: Bearer <sync_token>` and a
//! [`SyncReport`] body. The admin answers `200` with the current
//! [`sluice_shared::PolicySet`] when its version differs from `policy_version`, and
//! `304 Not Modified` (no body) otherwise.
//!
//! Fleet mode: for each `scope: global` policy both answers carry the
//! instance's share in the [`SHARES_HEADER`] header (JSON, a
//! [`ShareMessage`] per policy), and the next report names the share the
//! instance applies (`shares`). Durations are relative, so the Envoys'
//! clocks need not agree with the admin's. The answers are written and
//! read in [`crate::sync_answer`] only.
//!
//! The header is `sluice-grants` and the report's field `grants` on the
//! wire, as the first fleet release named them: filters and admins of
//! either release keep understanding each other.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::counts::Counts;
use crate::stats::{LimitCounter, PolicyCounter, ProviderCounter};
use sluice_shared::fair::{FairKeyView, REPORTED_KEYS};
use sluice_shared::key_view::{KeysReport, ENVOY_TOP_KEYS, MAX_VALUE_LABEL};
use sluice_shared::spend::SpendReport;

pub const SYNC_PATH: &str = "/api/v1/sync";
/// The longest an Envoy waits between sync attempts while the admin keeps
/// failing them (its interval, doubled after each failure, up to this): an
/// Envoy turned away is heard again within it of the admin answering.
pub const MAX_SYNC_BACKOFF_MS: u64 = 5_000;
/// Push: a watch call (sync token, a [`WatchRequest`] body) the admin holds
/// until the policy set differs from the one named, then answers `200`
/// with it, or `304` after the hold asked for in [`WAIT_HEADER`] (ms, at
/// most 25 s). Both answers carry [`EPOCH_HEADER`].
pub const WATCH_PATH: &str = "/api/v1/sync/watch";
pub const WAIT_HEADER: &str = "sluice-wait-ms";
/// On a watch's `304`: a fleet share freed room others may want (an Envoy
/// whose load fell took a smaller share); sync now instead of at the
/// interval.
pub const SYNC_NOW_HEADER: &str = "sluice-sync-now";
pub const SHARES_HEADER: &str = "sluice-grants";
/// The admin's store epoch, on every answer: drawn at random when the store
/// was created, and again when a restored store finds Envoys ahead of it.
/// A filter takes a lower version from another epoch, never from its own.
pub const EPOCH_HEADER: &str = "sluice-store-epoch";
/// Budgets the admin holds for the Envoy that synced (JSON, a
/// [`BudgetsMessage`]): on every answer that has any to give back.
pub const BUDGETS_HEADER: &str = "sluice-budgets";
/// The most budgets one answer gives back, so that the header stays far
/// below Envoy's header size limit (60 KiB).
pub const MAX_BUDGETS_ANSWERED: usize = 256;
/// How long the admin keeps a budget nobody reported: longer than the
/// longest period a limit may have (31 days).
pub const BUDGET_RETENTION_MS: u64 = 32 * 24 * 60 * 60 * 1000;

/// What other Envoys' providers said (JSON, a [`ProviderNews`]), on
/// answers to Envoys that share a limit that listens to its provider:
/// pauses still running and rate cuts of the last
/// [`RELAYED_CUT_FOR_MS`], each as relative times.
pub const PROVIDER_HEADER: &str = "sluice-provider";
/// The most limits one answer relays news of.
pub const MAX_PROVIDER_NEWS: usize = 256;
/// How long the admin keeps relaying a rate cut: past it, an Envoy that
/// did not hear of it has had several syncs to.
pub const RELAYED_CUT_FOR_MS: u64 = 5_000;

/// An instance's name is checked where the filter's configuration is
/// (`sluice_shared::instance`): the report carries the same name.
pub use sluice_shared::instance::{check_instance, MAX_INSTANCE_LEN};

/// Bounds on a report, so a broken or hostile client cannot make the admin
/// store megabytes per sync.
pub const MAX_REPORT_POLICIES: usize = 1000;
/// Envoys one admin keeps track of (live view, instance list, watches):
/// past it a new instance is refused until a silent one is forgotten.
pub const MAX_INSTANCES: usize = 10_000;
/// Keyed policies one report may describe key by key (each up to a few
/// kilobytes).
pub const MAX_REPORT_KEYED: usize = 100;
/// Filter-wide counters one report may carry (the filter has a few dozen).
pub const MAX_REPORT_FILTER_STATS: usize = 128;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SyncReport {
    /// The Envoy's name (`instance` in the plugin configuration).
    pub instance: String,
    /// Version of the policy set the filter enforces (0: none from the admin yet).
    pub policy_version: u64,
    /// The store epoch that version belongs to (0: none named).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub policy_epoch: u64,
    /// Milliseconds since the Unix epoch, by the Envoy's clock.
    pub at_ms: u64,
    /// Per policy, counters since the Envoy started plus current gauges.
    #[serde(default)]
    pub policies: BTreeMap<String, PolicyReport>,
    /// Filter-wide counters (CAS retries, sync failures, ...).
    #[serde(default)]
    pub filter: BTreeMap<String, u64>,
    /// Per global policy, the id of the newest share this Envoy received
    /// (and so applies).
    #[serde(default, rename = "grants", skip_serializing_if = "BTreeMap::is_empty")]
    pub shares: BTreeMap<String, u64>,
    /// Per global policy, that share as this Envoy received it: an admin
    /// that lost its record of the share learns it back from here.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub held: BTreeMap<String, HeldShareReport>,
    /// Per further limit (`limits`, by name), counters since the Envoy
    /// started, its size and what it holds now.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub limits: BTreeMap<String, LimitReport>,
    /// Per budget (a further limit of an hour or longer, by name): what
    /// this Envoy holds of it, and whether that includes what the admin
    /// held for it when this Envoy started.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub budgets: BTreeMap<String, BudgetReport>,
    /// Per keyed budget: the keys whose spend changed since the last
    /// report (only once the budget is known).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub budget_keys: BTreeMap<String, Vec<KeySpent>>,
    /// Per keyed policy: its busiest keys and distinct keys since the
    /// previous report (not since start: the filter starts over at every
    /// report, so that keys gone quiet make room).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub keys: BTreeMap<String, KeysReport>,
    /// Per policy shared fairly (`fair`): its busiest keys' weights,
    /// shares, use and demand, as this Envoy's table has them.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub fair: BTreeMap<String, Vec<FairKeyView>>,
}

/// The body of a watch call: the set its Envoy enforces.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchRequest {
    pub instance: String,
    pub policy_version: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub policy_epoch: u64,
}

/// A budget as one Envoy reports it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BudgetReport {
    /// False until the admin's answer was applied: the Envoy just started
    /// and asks what it spent before; the admin keeps its own record.
    pub known: bool,
    /// Tokens left of `size`, at `at_ms` (the Envoy's clock).
    pub available: u64,
    pub size: u64,
    pub at_ms: u64,
    /// A keyed budget being given back in parts: the last key it took
    /// (its hash as the admin orders them); the admin sends those after.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume_after: Option<i64>,
}

/// What one key of a keyed budget has spent, at the report's `at_ms` (0:
/// nothing, or the key gave its place up: forget it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeySpent {
    pub owner: u64,
    pub spent: u64,
}

/// What a keyed budget's key spent by `at_ms`, as the admin gives it back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldKey {
    pub owner: u64,
    pub spent: u64,
    pub at_ms: u64,
}

impl HeldKey {
    /// How the admin orders keys (SQL integers are signed): the cursor of
    /// [`BudgetReport::resume_after`].
    pub fn cursor(&self) -> i64 {
        self.owner as i64
    }
}

/// The most keys of keyed budgets one answer gives back (in all).
pub const MAX_KEYS_ANSWERED: usize = 256;
/// The most changed keys of keyed budgets one report says, in all (at
/// most 120 KiB of JSON, 2 048 times the longest entry's 60 bytes, comma
/// included: well within the admin's 256 KiB body limit).
pub const MAX_KEYS_REPORTED: usize = 2048;

impl BudgetReport {
    pub fn held(&self) -> HeldBudget {
        HeldBudget {
            available: self.available,
            size: self.size,
            at_ms: self.at_ms,
            ..HeldBudget::default()
        }
    }
}

/// A budget as the admin holds it for one Envoy: the last it reported
/// once known. Times are that Envoy's own clock, given back to it. A keyed
/// budget's is its keys' (`keys`, in parts: `more` when others follow).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldBudget {
    pub available: u64,
    pub size: u64,
    pub at_ms: u64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub keys: Vec<HeldKey>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub more: bool,
}

impl HeldBudget {
    /// What was spent of the budget by `at_ms`.
    pub fn spent(&self) -> u64 {
        self.size.saturating_sub(self.available)
    }
}

pub type BudgetsMessage = BTreeMap<String, HeldBudget>;

/// One further limit, as one Envoy counts it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LimitReport {
    /// Its reported counters (`LimitCounter`), by name.
    #[serde(flatten)]
    pub counts: Counts<LimitCounter>,
    /// The limit's size: `requests` per `period_ms`.
    pub requests: u64,
    pub period_ms: u64,
    /// Tokens it holds now (a concurrency limit: slots free now).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub available: Option<u64>,
    /// A concurrency limit (`period_ms` 0, `requests` its `max_in_flight`):
    /// the calls holding one of its slots now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_flight: Option<u64>,
    /// A limit that listens to its provider: what the provider said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<ProviderReport>,
    /// A limit of an hour or longer: what it spent this period.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spend: Option<SpendReport>,
}

/// What a further limit's provider said, as one Envoy holds it at
/// `at_ms`. The state (count, pause, rate) is an unkeyed limit's; a keyed
/// limit keeps it per key and reports the counters only.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct ProviderReport {
    /// Tokens the provider's count still allows before its reset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remaining: Option<u64>,
    /// The provider's limit per window, as it said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pause: Option<PauseReport>,
    /// The adapted rate per second (absent: the limit's own rate holds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<f64>,
    /// How long before `at_ms` the rate was last cut.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cut_ago_ms: Option<u64>,
    /// Since the Envoy started: the provider's refusals, pauses begun,
    /// rate cuts (`ProviderCounter`), by name.
    #[serde(flatten)]
    pub counts: Counts<ProviderCounter>,
}

/// A pause in force.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PauseReport {
    /// How long it has run and still runs, at `at_ms`.
    pub ran_ms: u64,
    pub left_ms: u64,
    /// The provider's status on the answer that began it (0: not known).
    pub status: u16,
    /// It began on another Envoy's word, relayed by the admin.
    #[serde(default)]
    pub relayed: bool,
}

/// Per limit (by name), what other Envoys' providers said.
pub type ProviderNews = BTreeMap<String, LimitNews>;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LimitNews {
    /// A pause still running: for this long after the answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pause_ms: Option<u64>,
    /// The provider's status on the answer that began it.
    #[serde(default)]
    pub status: u16,
    /// The newest rate cut, this long before the answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cut_ago_ms: Option<u64>,
}

/// A share an Envoy holds, as it describes it (ids are in `grants`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct HeldShareReport {
    pub rate: f64,
    pub in_flight: u32,
    pub instances: u32,
    /// The tag the admin gave the share (0: none came with it).
    #[serde(default)]
    pub tag: u64,
}

/// One global policy's share for the instance that synced.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ShareMessage {
    /// Requests per second.
    pub rate: f64,
    pub in_flight: u32,
    /// Valid for this long after the instance sent its report.
    pub lease_ms: u64,
    /// How many instances the admin counted; a lapsed share falls back to
    /// the limit split this many ways.
    pub instances: u32,
    /// Echoed in the next report's `shares`.
    pub id: u64,
    /// The admin's tag of this share, echoed in the next report's `held`:
    /// a share it lost track of is believed back only with it.
    #[serde(default)]
    pub tag: u64,
}

pub type SharesMessage = BTreeMap<String, ShareMessage>;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyReport {
    /// Its reported counters (`PolicyCounter`), by name: since the Envoy
    /// started, and `in_flight` now.
    #[serde(flatten)]
    pub counts: Counts<PolicyCounter>,
    /// The concurrency limit (0: none).
    pub max_in_flight: u64,
    /// Rate tokens available now (absent without a rate limit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
    /// Requests waiting in the queue now.
    #[serde(default)]
    pub waiting: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl SyncReport {
    /// Checks the bounds a well-behaved filter never crosses.
    pub fn check(&self) -> Result<(), String> {
        check_instance(&self.instance).map_err(|e| format!("instance: {e}"))?;
        if self.policies.len() > MAX_REPORT_POLICIES {
            return Err(format!("policies: at most {MAX_REPORT_POLICIES} entries"));
        }
        if self.limits.len() > MAX_REPORT_POLICIES {
            return Err(format!("limits: at most {MAX_REPORT_POLICIES} entries"));
        }
        if self.budgets.len() > MAX_REPORT_POLICIES {
            return Err(format!("budgets: at most {MAX_REPORT_POLICIES} entries"));
        }
        if self.filter.len() > MAX_REPORT_FILTER_STATS {
            return Err(format!(
                "filter: at most {MAX_REPORT_FILTER_STATS} counters"
            ));
        }
        if self.keys.len() > MAX_REPORT_KEYED {
            return Err(format!("keys: at most {MAX_REPORT_KEYED} policies"));
        }
        for (policy, keys) in &self.keys {
            if keys.top.keys.len() > ENVOY_TOP_KEYS {
                return Err(format!("keys.{policy}: at most {ENVOY_TOP_KEYS} keys"));
            }
            // A value label is cut at MAX_VALUE_LABEL characters, plus "…".
            if keys
                .top
                .keys
                .iter()
                .any(|k| k.label.len() > MAX_VALUE_LABEL + 3)
            {
                return Err(format!("keys.{policy}: a label is too long"));
            }
        }
        if self.fair.len() > MAX_REPORT_POLICIES {
            return Err(format!("fair: at most {MAX_REPORT_POLICIES} policies"));
        }
        for (policy, keys) in &self.fair {
            if keys.len() > REPORTED_KEYS {
                return Err(format!("fair.{policy}: at most {REPORTED_KEYS} keys"));
            }
            let rate_ok = |r: f64| r.is_finite() && r >= 0.0;
            if keys
                .iter()
                .any(|k| !rate_ok(k.share) || !rate_ok(k.used) || !rate_ok(k.demand))
            {
                return Err(format!(
                    "fair.{policy}: a share, use or demand is not a finite rate of 0 or more"
                ));
            }
        }
        for (limit, report) in &self.limits {
            if let Some(spend) = &report.spend {
                spend
                    .check()
                    .map_err(|e| format!("limits.{limit}.spend: {e}"))?;
            }
        }
        if self.budget_keys.len() > MAX_REPORT_POLICIES {
            return Err(format!(
                "budget_keys: at most {MAX_REPORT_POLICIES} budgets"
            ));
        }
        if self.budget_keys.values().map(Vec::len).sum::<usize>() > MAX_KEYS_REPORTED {
            return Err(format!(
                "budget_keys: at most {MAX_KEYS_REPORTED} keys in all"
            ));
        }
        if let Some(name) = self
            .budgets
            .keys()
            .find(|n| n.is_empty() || n.len() > sluice_shared::validate::bounds::MAX_NAME_LEN)
        {
            return Err(format!("budgets: {name:?} is no limit name"));
        }
        Ok(())
    }
}

impl SyncReport {
    /// Forgets what the report says of names `set` does not have: only
    /// the set's policies and limits become live-view entries, metric
    /// labels, stored records and relay keys, whatever an Envoy (or a
    /// holder of the sync token) makes up. An Envoy a version behind loses
    /// the figures of a policy just removed, for a sync or two.
    pub fn keep_known(&mut self, set: &sluice_shared::PolicySet) {
        use std::collections::BTreeSet;
        let policies: BTreeSet<&str> = set.policies.iter().map(|p| p.name.as_str()).collect();
        let limits = || set.limits();
        let limit_names: BTreeSet<&str> = limits().map(|l| l.name.as_str()).collect();
        let budgets: BTreeSet<&str> = limits()
            .filter(|l| l.is_budget() || l.is_keyed_budget())
            .map(|l| l.name.as_str())
            .collect();
        let keyed_budgets: BTreeSet<&str> = limits()
            .filter(|l| l.is_keyed_budget())
            .map(|l| l.name.as_str())
            .collect();
        let keyed: BTreeSet<&str> = set
            .policies
            .iter()
            .filter(|p| p.key.is_some())
            .map(|p| p.name.as_str())
            .collect();
        let shared: BTreeSet<String> = set
            .policies
            .iter()
            .filter(|p| p.scope == sluice_shared::Scope::Global)
            .map(|p| p.name.clone())
            .chain(
                limits()
                    .filter(|l| l.scope == sluice_shared::Scope::Global)
                    .map(sluice_shared::NamedLimit::fleet_name),
            )
            .collect();
        self.policies
            .retain(|name, _| policies.contains(name.as_str()));
        self.limits
            .retain(|name, _| limit_names.contains(name.as_str()));
        self.budgets
            .retain(|name, _| budgets.contains(name.as_str()));
        self.budget_keys
            .retain(|name, _| keyed_budgets.contains(name.as_str()));
        self.keys.retain(|name, _| keyed.contains(name.as_str()));
        self.shares.retain(|name, _| shared.contains(name));
        self.held.retain(|name, _| shared.contains(name));
        // Fair tables: a policy's under its name, a further limit's as
        // `limits/<name>`, of those that have `fair`.
        let fair: BTreeSet<String> = set
            .policies
            .iter()
            .filter(|p| p.fair.is_some())
            .map(|p| p.name.clone())
            .chain(
                limits()
                    .filter(|l| l.fair.is_some())
                    .map(sluice_shared::NamedLimit::fleet_name),
            )
            .collect();
        self.fair.retain(|name, _| fair.contains(name));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_shared::key_view::{KeyCount, KeysReport};

    #[test]
    fn a_report_keeps_only_the_names_of_the_set() {
        let set: sluice_shared::PolicySet = serde_json::from_value(serde_json::json!({
            "version": 1,
            "policies": [
                {"name": "bank", "match": {"host": "a"}, "rate": {"requests": 5, "period": "1s"},
                 "key": {"header": "x-key"},
                 "limits": [{"name": "daily", "rate": {"requests": 5, "period": "1d"}},
                            {"name": "fleet", "scope": "global", "rate": {"requests": 5, "period": "1s"}}]},
                {"name": "shop", "match": {"host": "b"}, "scope": "global",
                 "rate": {"requests": 5, "period": "1s"}},
                {"name": "llm", "match": {"host": "c"}, "rate": {"requests": 5, "period": "1s"},
                 "fair": {"key": {"header": "x-tenant"}},
                 "limits": [{"name": "tps", "rate": {"requests": 50, "period": "1s"},
                             "fair": {"key": {"header": "x-tenant"}}}]}
            ]
        }))
        .unwrap();
        let mut r = report();
        for name in ["bank", "shop", "made-up"] {
            r.policies.insert(name.into(), PolicyReport::default());
            r.keys.insert(name.into(), KeysReport::default());
            r.shares.insert(name.into(), 1);
        }
        for name in ["daily", "fleet", "made-up"] {
            r.limits.insert(name.into(), LimitReport::default());
            r.budgets.insert(name.into(), BudgetReport::default());
        }
        r.shares.insert("limits/fleet".into(), 2);
        for name in ["llm", "bank", "limits/tps", "limits/daily", "made-up"] {
            r.fair.insert(name.into(), Vec::new());
        }
        r.keep_known(&set);
        let names = |m: Vec<&String>| m.into_iter().cloned().collect::<Vec<_>>();
        assert_eq!(names(r.policies.keys().collect()), ["bank", "shop"]);
        assert_eq!(names(r.keys.keys().collect()), ["bank"]);
        assert_eq!(names(r.shares.keys().collect()), ["limits/fleet", "shop"]);
        assert_eq!(names(r.limits.keys().collect()), ["daily", "fleet"]);
        assert_eq!(names(r.budgets.keys().collect()), ["daily"]);
        assert_eq!(names(r.fair.keys().collect()), ["limits/tps", "llm"]);
    }

    fn report() -> SyncReport {
        SyncReport {
            instance: "e1".into(),
            ..SyncReport::default()
        }
    }

    #[test]
    fn instance_names_are_short_and_plain() {
        for good in ["egress-1", "envoy_2.prod", "10.0.0.5:9901", "a"] {
            assert_eq!(check_instance(good), Ok(()), "{good}");
        }
        let long = "x".repeat(MAX_INSTANCE_LEN + 1);
        for bad in ["", "a\"} 1\n", "a b", "caf\u{e9}", "a/b", long.as_str()] {
            assert!(check_instance(bad).is_err(), "{bad:?}");
        }
        let mut hostile = report();
        hostile.instance = "a\"} 1\n".into();
        assert!(hostile.check().unwrap_err().starts_with("instance: "));
    }

    #[test]
    fn per_key_reports_past_their_bounds_are_refused_with_the_reason() {
        assert_eq!(report().check(), Ok(()));
        let mut many = report();
        for i in 0..=MAX_REPORT_KEYED {
            many.keys.insert(format!("p{i}"), KeysReport::default());
        }
        assert!(many.check().unwrap_err().starts_with("keys:"));
        let mut crowded = report();
        let keys = crowded.keys.entry("llm".into()).or_default();
        keys.top.keys = vec![KeyCount::default(); ENVOY_TOP_KEYS + 1];
        assert!(crowded.check().unwrap_err().starts_with("keys.llm:"));
        let mut long = report();
        long.keys.entry("llm".into()).or_default().top.keys = vec![KeyCount {
            label: "x".repeat(500),
            ..KeyCount::default()
        }];
        assert!(long.check().unwrap_err().contains("too long"));
    }

    /// Filters and admins of other releases read each other's reports:
    /// the counters keep their names and places.
    #[test]
    fn reports_keep_the_names_older_filters_and_admins_speak() {
        use crate::stats::{LimitCounter, PolicyCounter, ProviderCounter};
        let older = r#"{"admitted":5,"rejected":1,"queued":2,"queue_timeouts":0,
            "shadow_limited":4,"in_flight":3,"max_in_flight":10,"waiting":1}"#;
        let report: PolicyReport = serde_json::from_str(older).unwrap();
        assert_eq!(report.counts[PolicyCounter::InFlight], 3);
        assert_eq!(report.counts[PolicyCounter::ShadowLimited], 4);
        assert_eq!((report.max_in_flight, report.waiting), (10, 1));
        let written = serde_json::to_value(report).unwrap();
        for name in [
            "admitted",
            "rejected",
            "queued",
            "queue_timeouts",
            "shadow_limited",
            "in_flight",
            "max_in_flight",
            "waiting",
        ] {
            assert!(written.get(name).is_some(), "{name} in {written}");
        }
        let limit: LimitReport = serde_json::from_str(
            r#"{"admitted":1,"refused":2,"tokens":3,"requests":10,"period_ms":1000,
                "provider":{"refused":4,"pauses":1,"cuts":2,"remaining":7}}"#,
        )
        .unwrap();
        assert_eq!(limit.counts[LimitCounter::Tokens], 3);
        let provider = limit.provider.unwrap();
        assert_eq!(provider.counts[ProviderCounter::Cuts], 2);
        assert_eq!(provider.remaining, Some(7));
        let written = serde_json::to_value(limit).unwrap();
        assert_eq!(written["refused"], 2);
        assert_eq!(written["provider"]["refused"], 4);
        assert!(written.get("provider_refused").is_none(), "reported once");
    }
}
