//! The admin's JSON API under `/api/v1`, as types: the admin's handlers
//! answer with them and the web UI reads them, so both sides agree on every
//! field by construction. Times are milliseconds since the epoch on the
//! wire (`*_ms`), as the API has always written them.

#![forbid(unsafe_code)]

pub mod people;
pub mod policy_diff;
pub mod prices;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use sluice_shared::fleet::{Amount, MemberState};
use sluice_shared::key_view::KeyEstimate;
use sluice_shared::spend::SpendReport;
use sluice_shared::time::{millis, Span};
use sluice_shared::validate::FieldError;
use sluice_shared::Policy;
use sluice_wire::counts::LiveCounts;
use sluice_wire::stats::{LimitCounter, PolicyCounter, ProviderCounter};
use sluice_wire::sync::{PauseReport, SyncReport};

pub use crate::people::LoginRequest;

/// `POST /login` and `GET /session`: who is logged in, and the token every
/// write must send as `x-csrf-token`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionInfo {
    pub user: String,
    pub csrf_token: String,
    /// The admin runs with `--insecure-dev`: nobody logs in.
    #[serde(default)]
    pub insecure_dev: bool,
    /// What the user may do (the UI hides what they may not).
    #[serde(default)]
    pub role: crate::people::Role,
    /// How they were let in: "password", "proxy" (a trusted reverse
    /// proxy's user header) or "dev".
    #[serde(default)]
    pub via: String,
}

/// One policy as stored, with its version (also its `ETag`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredPolicy {
    pub policy: Policy,
    pub version: u64,
    pub updated_at_ms: u64,
    pub updated_by: String,
    /// The file it was applied from (policies as code); None when made or
    /// last edited by hand.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
}

/// `GET /policies`: the set in evaluation order, with the set's version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicyList {
    pub version: u64,
    pub policies: Vec<StoredPolicy>,
    /// The directory the policies are managed from (`--managed-dir`):
    /// nobody edits them here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub managed: Option<ManagedState>,
}

/// A managed directory and how its last reading went.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ManagedState {
    pub dir: String,
    /// When the directory was last read and applied (ms since the epoch).
    #[serde(default)]
    pub applied_ms: u64,
    /// Why its last change was refused (every error, file: path: reason);
    /// the policies in force are the last good ones.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `POST /apply` (policies as code): the files, as text.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApplyRequest {
    pub files: Vec<ApplyFile>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApplyFile {
    pub path: String,
    pub text: String,
}

/// `PUT /prices`: the policy set's version once the table is saved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PricesSaved {
    pub version: u64,
}

/// What an apply changed (or, dry, would change).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Applied {
    pub diff: crate::policy_diff::SetDiff,
    /// The policy set's version afterwards.
    pub version: u64,
    /// False for a dry run, or when nothing changed.
    pub applied: bool,
    /// The set's price table changed (or, dry, would change).
    #[serde(default)]
    pub prices_changed: bool,
}

/// `PUT /order`: every policy's name, in the new evaluation order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyOrder {
    pub names: Vec<String>,
}

/// One saved version of a policy (`policy` is None where it was deleted).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HistoryEntry {
    pub version: u64,
    pub set_version: u64,
    pub at_ms: u64,
    pub actor: String,
    pub policy: Option<Policy>,
}

/// `GET /policies/{name}/history`, newest first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct History {
    pub history: Vec<HistoryEntry>,
}

/// `POST /validate`: the policy is valid (an invalid one is a 422).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Validated {
    pub ok: bool,
}

/// One change, by whom, old → new.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AuditEntry {
    pub id: i64,
    pub at_ms: u64,
    pub actor: String,
    pub action: String,
    pub target: String,
    pub old: Option<serde_json::Value>,
    pub new: Option<serde_json::Value>,
}

/// `GET /audit`, newest first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AuditLog {
    pub entries: Vec<AuditEntry>,
}

/// An Envoy that synced, and what it last reported.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Instance {
    pub id: String,
    pub first_seen_ms: u64,
    pub last_sync_ms: u64,
    pub policy_version: u64,
    pub syncs: u64,
    /// Heard from within the last few seconds.
    pub live: bool,
    pub report: SyncReport,
}

/// `GET /instances`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InstanceList {
    pub instances: Vec<Instance>,
    pub now_ms: u64,
    /// More instances follow: ask again with `?after=` this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<String>,
}

/// One global policy's limit and how it is shared out now.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FleetPolicy {
    pub policy: String,
    pub limit: Amount,
    #[serde(rename = "lease_ms", with = "millis")]
    pub lease: Span,
    /// What the members may be enforcing, together.
    pub reserved: Amount,
    /// The ledger was lost and is being learned back from the Envoys'
    /// syncs: no share grows until then.
    #[serde(default)]
    pub recovering: bool,
    pub members: Vec<MemberState>,
}

/// `GET /budgets`: the budgets (limits of an hour or longer) as the tree
/// their stacking forms, company over team over key
/// ([`sluice_shared::budget_tree`]), with what the live Envoys spent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BudgetTree {
    /// The admin's clock when the tree was read (ms since the epoch).
    pub at_ms: u64,
    /// The price table's currency: money budgets' amounts are micro-units
    /// of it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub currency: Option<String>,
    pub roots: Vec<sluice_shared::budget_tree::BudgetNode>,
}

/// `GET /fleet`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FleetView {
    pub now_ms: u64,
    pub policies: Vec<FleetPolicy>,
    /// Stock Envoys whose `rate_limit_quota` filter holds an RLQS stream
    /// to this admin. They are members of the policies' ledgers too, as
    /// `rlqs:<name>`.
    #[serde(default)]
    pub rlqs: Vec<RlqsClient>,
}

/// One RLQS stream (a stock Envoy's `rate_limit_quota` filter).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RlqsClient {
    /// Its member name in the ledgers: `rlqs:` and the stream's
    /// `x-sluice-instance` metadata, or its address.
    pub instance: String,
    /// The address its stream comes from.
    pub peer: String,
    /// The filter's `domain`.
    pub domain: String,
    /// When its stream opened and when it last reported (ms since the
    /// epoch; 0: no report yet).
    pub connected_ms: u64,
    pub last_report_ms: u64,
    /// Buckets it reported that are assigned: per limit, how many and the
    /// rate a second they share.
    pub assigned: Vec<RlqsAssigned>,
    /// The first few buckets given no assignment, with why, and how many
    /// in all.
    pub unassigned: Vec<RlqsUnassigned>,
    pub unassigned_count: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RlqsAssigned {
    pub limit: String,
    pub buckets: u64,
    pub rate: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RlqsUnassigned {
    pub bucket: std::collections::BTreeMap<String, String>,
    pub reason: String,
}

/// Per policy (and per instance), what happens each second.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Utilization {
    /// Its reported counters (`PolicyCounter`) as shown: a rate per second
    /// (`admitted_per_s`, ...) or the value now (`in_flight`, totals
    /// since the Envoys started).
    #[serde(flatten)]
    pub counts: LiveCounts<PolicyCounter>,
    pub max_in_flight: u64,
    #[serde(default)]
    pub waiting: u64,
    /// Rate tokens left (summed over instances; absent without a rate).
    pub tokens: Option<u64>,
}

impl Utilization {
    /// Adds another instance's figures.
    pub fn add(&mut self, other: &Utilization) {
        self.counts.add(&other.counts);
        self.max_in_flight = self.max_in_flight.saturating_add(other.max_in_flight);
        self.waiting = self.waiting.saturating_add(other.waiting);
        self.tokens = match (self.tokens, other.tokens) {
            (None, t) | (t, None) => t,
            (Some(a), Some(b)) => Some(a.saturating_add(b)),
        };
    }
}

/// Per further limit, what happens each second, summed over instances.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LimitUse {
    /// Its reported counters (`LimitCounter`) as shown: `admitted_per_s`,
    /// `refused_per_s`, `tokens_per_s` (tokens charged per second).
    #[serde(flatten)]
    pub counts: LiveCounts<LimitCounter>,
    /// The limit's size: `requests` per `period_ms` (each Envoy's).
    pub requests: u64,
    pub period_ms: u64,
    /// Tokens it holds now (summed over instances).
    pub available: Option<u64>,
    /// A concurrency limit (`period_ms` 0): calls in flight now (summed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_flight: Option<u64>,
    /// A limit that listens to its provider: what the provider said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<ProviderUse>,
    /// A limit of an hour or longer: what it spent this period (summed
    /// over instances; a keyed one's top spenders).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spend: Option<SpendReport>,
}

/// What a limit's provider said, over the live instances.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ProviderUse {
    /// The provider's count of what is left before its reset: the lowest
    /// any Envoy holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remaining: Option<u64>,
    /// The provider's limit per window, as it said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u64>,
    /// The pause in force with the most left.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pause: Option<PauseReport>,
    /// The Envoy whose provider began a pause in force (the others took
    /// it from the admin's relay).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused_by: Option<String>,
    /// The adapted rates per second, summed over the Envoys that adapt
    /// (absent: none does; the limit's own rate holds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<f64>,
    /// Its counters (`ProviderCounter`) as shown: the provider's refusals
    /// per second (`refused_per_s`); pauses begun and rate cuts since the
    /// Envoys started.
    #[serde(flatten)]
    pub counts: LiveCounts<ProviderCounter>,
}

impl ProviderUse {
    pub fn add(&mut self, other: &ProviderUse) {
        self.remaining = match (self.remaining, other.remaining) {
            (None, r) | (r, None) => r,
            (Some(a), Some(b)) => Some(a.min(b)),
        };
        self.limit = self.limit.max(other.limit);
        self.pause = match (self.pause, other.pause) {
            (None, p) | (p, None) => p,
            (Some(a), Some(b)) => Some(if b.left_ms > a.left_ms { b } else { a }),
        };
        if self.paused_by.is_none() {
            self.paused_by.clone_from(&other.paused_by);
        }
        self.rate = match (self.rate, other.rate) {
            (None, r) | (r, None) => r,
            (Some(a), Some(b)) => Some(a + b),
        };
        self.counts.add(&other.counts);
    }
}

impl LimitUse {
    /// Adds another instance's figures.
    pub fn add(&mut self, other: &LimitUse) {
        self.counts.add(&other.counts);
        self.requests = self.requests.max(other.requests);
        self.period_ms = self.period_ms.max(other.period_ms);
        self.available = match (self.available, other.available) {
            (None, t) | (t, None) => t,
            (Some(a), Some(b)) => Some(a.saturating_add(b)),
        };
        self.in_flight = match (self.in_flight, other.in_flight) {
            (None, n) | (n, None) => n,
            (Some(a), Some(b)) => Some(a.saturating_add(b)),
        };
        match (&mut self.provider, &other.provider) {
            (Some(a), Some(b)) => a.add(b),
            (None, b) => self.provider.clone_from(b),
            (_, None) => {}
        }
        match (&mut self.spend, &other.spend) {
            (Some(a), Some(b)) => a.merge(b),
            (None, b) => self.spend.clone_from(b),
            (_, None) => {}
        }
    }

    /// A concurrency limit: it has no period.
    pub fn is_concurrency(&self) -> bool {
        self.period_ms == 0
    }

    /// Tokens used over one of the limit's periods at the current pace.
    pub fn used_per_period(&self) -> f64 {
        self.counts.per_s(LimitCounter::Tokens) * self.period_ms as f64 / 1000.0
    }
}

/// `GET /live` (server-sent events): a `history` event with the recent
/// frames, then a `frame` event every second.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LiveFrame {
    pub at_ms: u64,
    /// Per policy, summed over the live instances.
    pub policies: BTreeMap<String, Utilization>,
    /// Per further limit, summed over the live instances.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub limits: BTreeMap<String, LimitUse>,
    /// Per instance, per policy.
    pub instances: BTreeMap<String, BTreeMap<String, Utilization>>,
    /// Per keyed policy, its busiest keys over the live instances (in the
    /// newest frame only, not in history).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub keys: BTreeMap<String, KeysUse>,
    /// Per policy shared fairly, its keys' shares, use and demand summed
    /// over the live instances, the most demanding first (at most
    /// [`sluice_shared::key_view::SHOWN_TOP_KEYS`]; newest frame only).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub fair: BTreeMap<String, Vec<FairKeyUse>>,
}

/// One key of a policy shared fairly (`fair`), over the live instances:
/// its weight, and per second its share, what it used and what it asked
/// (with `slots`, slots shared fairly: the slots it may hold, holds and
/// wants, at once).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FairKeyUse {
    /// As the busiest keys name it (its hash under the fleet's label
    /// secret), or [`FAIR_OVERFLOW_LABEL`].
    pub label: String,
    pub weight: f64,
    pub share_per_s: f64,
    pub used_per_s: f64,
    pub demand_per_s: f64,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub slots: bool,
}

/// The label of the keys past `max_keys`, which share one entry.
pub const FAIR_OVERFLOW_LABEL: &str = "(other keys)";

/// A keyed policy's keys, over the live instances.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct KeysUse {
    /// The busiest keys by admitted calls a second, busiest first (at most
    /// [`sluice_shared::key_view::SHOWN_TOP_KEYS`]).
    pub top: Vec<KeyUse>,
    /// Calls a second over every key, listed or not.
    pub calls_per_s: f64,
    /// Distinct keys seen over the last [`KEYS_ACTIVE_FOR_MS`].
    pub active: Option<KeyEstimate>,
    /// Of those, keys that found no place of their own (`max_keys`).
    pub overflowed: Option<KeyEstimate>,
}

/// How long a key counts as active after its last call.
pub const KEYS_ACTIVE_FOR_MS: u64 = 10_000;

/// One key's use. `uncertain_per_s` is how much of its calls may be other
/// keys' (Space-Saving's error; 0 when counted exactly).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct KeyUse {
    pub label: String,
    pub admitted_per_s: f64,
    pub queued_per_s: f64,
    pub refused_per_s: f64,
    #[serde(default)]
    pub uncertain_per_s: f64,
}

/// `POST /api/v1/policies/{name}/key-label`: which label the live view
/// shows for a key typed in (the key is never stored or logged).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyLabelRequest {
    pub key: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyLabelAnswer {
    pub policy: String,
    pub label: String,
}

/// `GET /healthz`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Health {
    pub status: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_set_version: Option<u64>,
}

/// Every error: what went wrong, with every field error of a refused
/// policy (422) or the version that won a conflicting edit (409).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<FieldError>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_version: Option<u64>,
}

impl ErrorBody {
    /// An error with a message only.
    pub fn new(error: impl Into<String>) -> Self {
        Self {
            error: error.into(),
            errors: Vec::new(),
            current_version: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_bodies_keep_their_wire_shape() {
        let plain = ErrorBody {
            error: "log in first".into(),
            errors: Vec::new(),
            current_version: None,
        };
        assert_eq!(
            serde_json::to_string(&plain).unwrap(),
            r#"{"error":"log in first"}"#
        );
        let invalid: ErrorBody = serde_json::from_str(
            r#"{"error": "invalid policy", "errors": [{"path": "rate.burst", "message": "must be >= 1"}]}"#,
        )
        .unwrap();
        assert_eq!(invalid.errors[0].path, "rate.burst");
        let stale: ErrorBody =
            serde_json::from_str(r#"{"error": "stale", "current_version": 4}"#).unwrap();
        assert_eq!(stale.current_version, Some(4));
    }

    #[test]
    fn a_fleet_view_reads_back_what_the_admin_writes() {
        let json = r#"{"now_ms": 5000, "policies": [{"policy": "llm",
            "limit": {"rate": 300.0, "in_flight": 30}, "lease_ms": 3000,
            "reserved": {"rate": 100.0, "in_flight": 10},
            "members": [{"instance": "e1", "share": {"rate": 100.0, "in_flight": 10},
                "reserved": {"rate": 100.0, "in_flight": 10}, "used": {"rate": 90.0, "in_flight": 8},
                "demand": {"rate": 95.0, "in_flight": 9, "queued": 0}, "last_sync_ms": 4900}]}]}"#;
        let view: FleetView = serde_json::from_str(json).unwrap();
        assert_eq!(view.policies[0].lease, Span::from_secs(3));
        assert_eq!(view.policies[0].members[0].last_sync.as_millis(), 4900);
        let again: FleetView =
            serde_json::from_str(&serde_json::to_string(&view).unwrap()).unwrap();
        assert_eq!(again, view);
    }
}
