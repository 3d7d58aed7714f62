//! One simulated Envoy: its watch and its syncs, as the filter makes
//! them, and what the fleet of them shares with the measurement.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sluice_shared::fleet::{share_in_force, Amount, Share};
use sluice_shared::key_view::{label_secret, name_key, KeyOutcome, KeysReport, ENVOY_TOP_KEYS};
use sluice_shared::policy::key::KeyLabel;
use sluice_shared::time::{Instant as SimInstant, Span};
use sluice_wire::counts::Counts;
use sluice_wire::stats::LimitCounter;
use sluice_wire::stats::PolicyCounter;
use sluice_wire::sync::{
    BudgetReport, HeldShareReport, KeySpent, LimitReport, PolicyReport, ProviderReport, SyncReport,
    SYNC_NOW_HEADER,
};
use sluice_wire::sync_answer::ReceivedHeaders;
use tokio::sync::Notify;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::header::{HeaderMap, AUTHORIZATION, CONTENT_TYPE};
use hyper::{Request, Uri};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use super::{lock, POLICY, TOKEN};

/// The filter's default `sync_interval`.
pub(super) const SYNC_EVERY: Duration = Duration::from_secs(1);
/// The filter's least gap between two watches that brought news.
const NEWS_GAP: Duration = Duration::from_millis(50);
/// How long a simulated Envoy waits for one answer, as the filter's
/// `sync_timeout` bounds its own calls.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// The filter's longest wait between syncs after failures, holding a
/// share of the global policy (its default lease): half that lease, at
/// most 5 s (`sync_backoff_bound`).
fn longest_backoff() -> Duration {
    let lease = sluice_shared::Scope::DEFAULT_SHARE_LEASE.as_span();
    let most = sluice_shared::Span::from_millis(sluice_wire::sync::MAX_SYNC_BACKOFF_MS);
    Duration::from_millis(sluice_shared::fleet::sync_backoff_bound([lease], most).as_millis())
}
/// How long the admin may hold a watch, and how long one is waited for.
const WATCH_WAIT_MS: &str = "20000";
const WATCH_TIMEOUT: Duration = Duration::from_secs(30);
/// Calls are counted in thousandths between the Envoys and the
/// measurement: a share of 14.6 calls a second passes 14.6 in a second.
const MILLI: f64 = 1000.0;
/// How long each of its calls takes upstream.
const CALL_SECONDS: f64 = 0.2;

/// The local policy each report also speaks of, its further limits, and
/// what its calls are: a few a second, from a few callers' keys and teams.
pub(super) const BANK: &str = "bank";
pub(super) const BANK_PROVIDER: &str = "bank-provider";
pub(super) const TEAM_BUDGET: &str = "team-daily";
pub(super) const TEAM_BUDGET_SIZE: u64 = 1_000_000_000;
/// Its calls a second to the bank.
const BANK_CALLS: u64 = 5;
/// The callers' keys it sees, and how many of them call between syncs.
const BANK_KEYS: u64 = 200;
const KEYS_PER_SYNC: u64 = 20;
/// The teams whose budgets it charges, each call its team's, and what a
/// call costs (micro-units).
const TEAMS: u64 = 50;
const TEAMS_PER_SYNC: u64 = 4;
const CALL_COST: u64 = 1_500;

/// What the simulated Envoys share with the measurement.
pub(super) struct FleetState {
    /// While the run counts.
    pub(super) counting: AtomicBool,
    pub(super) syncs: AtomicU64,
    pub(super) failed: AtomicU64,
    pub(super) sync_ms: Mutex<Vec<f64>>,
    /// Watch answers of any kind while counting.
    pub(super) watch_answers_counted: AtomicU64,
    /// Per Envoy, when it got each newer set, and its version.
    pub(super) learned: Mutex<Vec<Vec<(Instant, u64)>>>,
    /// The set version each Envoy enforces (raised by its watch or sync).
    versions: Vec<AtomicU64>,
    /// Calls the Envoys were asked to make and calls their shares let
    /// pass, in thousandths, over the periods their syncs closed while
    /// counting (each Envoy closes one a second, so a run of n seconds
    /// counts n of each Envoy's periods).
    pub(super) asked_milli: AtomicU64,
    pub(super) passed_milli: AtomicU64,
    /// Each Envoy's newest share of the global policy, and when that
    /// Envoy's clock (which the share's lease is on) started.
    pub(super) shares: Vec<Mutex<Option<(Share, Instant)>>>,
}

impl FleetState {
    pub(super) fn new(envoys: usize, version: u64) -> Self {
        Self {
            counting: AtomicBool::new(false),
            syncs: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            sync_ms: Mutex::new(Vec::new()),
            watch_answers_counted: AtomicU64::new(0),
            learned: Mutex::new(vec![Vec::new(); envoys]),
            versions: (0..envoys).map(|_| AtomicU64::new(version)).collect(),
            asked_milli: AtomicU64::new(0),
            passed_milli: AtomicU64::new(0),
            shares: (0..envoys).map(|_| Mutex::new(None)).collect(),
        }
    }

    /// Whether every Envoy has had a share of some rate (an admin that
    /// has just started answers with shares of none at first).
    pub(super) fn all_shared(&self) -> bool {
        self.shares
            .iter()
            .all(|s| lock(s).is_some_and(|(share, _)| share.amount.rate > 0.0))
    }

    /// The rates the Envoys enforce of the global policy at `now`, added
    /// up: each its share while the lease runs, then its fallback.
    pub(super) fn rates_in_force(&self, limit: Amount, now: Instant) -> f64 {
        self.shares
            .iter()
            .filter_map(|s| *lock(s))
            .map(|(share, started)| share_in_force(Some(share), limit, clock(started, now)).rate)
            .sum()
    }

    pub(super) fn counting(&self) -> bool {
        self.counting.load(Ordering::SeqCst)
    }

    /// Envoy `index` got the set of `version` at `at`, by a watch or a sync.
    fn got_set(&self, index: usize, version: u64, at: Instant) {
        if self.versions[index].fetch_max(version, Ordering::SeqCst) < version {
            lock(&self.learned)[index].push((at, version));
        }
    }
}

#[derive(Clone)]
pub(super) struct SimEnvoy {
    index: usize,
    name: String,
    http: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    sync_url: Uri,
    watch_url: Uri,
    /// Its calls a second: uneven, 1 to 10 times the least busy one's.
    demand: u64,
    /// The global policy's limit (what a lapsed share falls back to splits).
    limit: Amount,
    /// Where in the sync second it syncs (real Envoys start at any time).
    offset: Duration,
    /// Its watch heard that fleet room was freed: sync now.
    hurry: Arc<Notify>,
    fleet: Arc<FleetState>,
}

impl SimEnvoy {
    /// Envoy `index` of `envoys`, syncing with the admin at `base`: over
    /// TLS with `tls` (the admin's certificate pinned), each Envoy with
    /// connections of its own, as real Envoys hold theirs.
    pub(super) fn new(
        base: &str,
        tls: Option<&rustls::ClientConfig>,
        index: usize,
        envoys: usize,
        limit: Amount,
        fleet: Arc<FleetState>,
    ) -> anyhow::Result<Self> {
        // Plain HTTP is given a configuration that trusts nothing: it
        // never makes a TLS connection with it.
        let config = match tls {
            Some(config) => config.clone(),
            None => rustls::ClientConfig::builder_with_provider(Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()?
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth(),
        };
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(config)
            .https_or_http()
            .enable_http1()
            .build();
        Ok(Self {
            index,
            name: format!("sim-{index}"),
            http: Client::builder(TokioExecutor::new()).build(connector),
            sync_url: format!("{base}/api/v1/sync").parse()?,
            watch_url: format!("{base}/api/v1/sync/watch").parse()?,
            demand: 2 + 2 * (index as u64 % 10),
            limit,
            offset: SYNC_EVERY.mul_f64(index as f64 / envoys as f64),
            hurry: Arc::new(Notify::new()),
            fleet,
        })
    }

    fn version(&self) -> u64 {
        self.fleet.versions[self.index].load(Ordering::SeqCst)
    }

    /// Holds a watch open, as a filter with push on does (`sync/watch.rs`,
    /// `SyncClient::on_watch_answer`): a new set, or a word to sync now
    /// (fleet room was freed), reopens it 50 ms after the last one was
    /// sent at the soonest, and the word makes it sync at once; an answer
    /// with nothing new 1 s after, a failure 1 to 3 s after.
    pub(super) async fn watch_forever(self) {
        loop {
            let body = json!({"instance": self.name, "policy_version": self.version()}).to_string();
            let sent = tokio::time::Instant::now();
            let answered = self
                .post(&self.watch_url, body, Some(WATCH_WAIT_MS), WATCH_TIMEOUT)
                .await;
            let Ok(answer) = answered else {
                tokio::time::sleep(SYNC_EVERY + SYNC_EVERY.mul_f64(2.0 * fastrand::f64())).await;
                continue;
            };
            let at = Instant::now();
            let sync_now = answer.headers.contains_key(SYNC_NOW_HEADER);
            let news = match answer.status {
                200 => {
                    if let Ok(set) = serde_json::from_slice::<Value>(&answer.body) {
                        if let Some(version) = set["version"].as_u64() {
                            self.fleet.got_set(self.index, version, at);
                        }
                    }
                    true
                }
                304 if sync_now => {
                    self.hurry.notify_one();
                    true
                }
                _ => false,
            };
            if self.fleet.counting() {
                self.fleet
                    .watch_answers_counted
                    .fetch_add(1, Ordering::SeqCst);
            }
            let gap = if news { NEWS_GAP } else { SYNC_EVERY };
            tokio::time::sleep_until(sent + gap).await;
        }
    }

    /// Syncs once a second with a report of what it did since it started.
    pub(super) async fn sync_forever(self) {
        tokio::time::sleep(self.offset).await;
        let mut next = tokio::time::Instant::now();
        let mut calls = Calls::new(Instant::now());
        let mut share_ids = BTreeMap::new();
        let mut held: BTreeMap<String, HeldShareReport> = BTreeMap::new();
        // The global policy's newest share, its lease on this Envoy's clock.
        let mut in_force: Option<Share> = None;
        let mut failures = 0u32;
        loop {
            next += SYNC_EVERY;
            // Its calls since the last sync, let through as far as the
            // fleet share it held allowed (none before its first share:
            // a global policy is closed until then).
            let (asked, passed) =
                calls.until(Instant::now(), self.demand as f64, in_force, self.limit);
            if self.fleet.counting() {
                self.fleet.asked_milli.fetch_add(asked, Ordering::SeqCst);
                self.fleet.passed_milli.fetch_add(passed, Ordering::SeqCst);
            }
            let body = self.report(&calls, &share_ids, &held);
            let sent = Instant::now();
            let answer = self.post(&self.sync_url, body, None, CALL_TIMEOUT).await;
            let took = sent.elapsed().as_secs_f64() * 1000.0;
            let answer = match answer {
                Ok(answer) if (200..300).contains(&answer.status) || answer.status == 304 => answer,
                _ => {
                    if self.fleet.counting() {
                        self.fleet.failed.fetch_add(1, Ordering::SeqCst);
                    }
                    // As the filter backs off (`finish_turn`): its interval,
                    // doubled after each failure in a row, at most half
                    // the share lease.
                    failures = failures.saturating_add(1);
                    let backoff = SYNC_EVERY
                        .saturating_mul(1 << (failures - 1).min(16))
                        .min(longest_backoff());
                    self.wait_for_turn(tokio::time::Instant::now() + backoff)
                        .await;
                    next = tokio::time::Instant::now();
                    continue;
                }
            };
            failures = 0;
            let heard = ReceivedHeaders::read(|name| {
                answer.headers.get(name).map(|v| v.as_bytes().to_vec())
            });
            // A new set came with the sync (its watch was slower): enforced.
            let etag = answer.headers.get("etag").and_then(|v| v.to_str().ok());
            if let Some(version) = etag.and_then(|v| v.trim_matches('"').parse::<u64>().ok()) {
                if answer.status == 200 {
                    self.fleet.got_set(self.index, version, Instant::now());
                }
            }
            if let Some(Ok(shares)) = heard.shares {
                for (policy, share) in shares {
                    if policy == POLICY {
                        let newest = Share {
                            amount: Amount {
                                rate: share.rate,
                                in_flight: share.in_flight,
                            },
                            expires_at: calls.clock(Instant::now())
                                + Span::from_millis(share.lease_ms),
                            instances: share.instances,
                        };
                        in_force = Some(newest);
                        *lock(&self.fleet.shares[self.index]) = Some((newest, calls.started));
                    }
                    share_ids.insert(policy.clone(), share.id);
                    held.insert(
                        policy,
                        HeldShareReport {
                            rate: share.rate,
                            in_flight: share.in_flight,
                            instances: share.instances,
                            tag: share.tag,
                        },
                    );
                }
            }
            if self.fleet.counting() {
                self.fleet.syncs.fetch_add(1, Ordering::SeqCst);
                lock(&self.fleet.sync_ms).push(took);
            }
            self.wait_for_turn(next).await;
            next = tokio::time::Instant::now();
        }
    }

    /// One call to the admin, its answer read whole within `timeout`.
    async fn post(
        &self,
        url: &Uri,
        body: String,
        wait_ms: Option<&'static str>,
        timeout: Duration,
    ) -> anyhow::Result<Answer> {
        let mut request = Request::post(url.clone())
            .header(AUTHORIZATION, format!("Bearer {TOKEN}"))
            .header(CONTENT_TYPE, "application/json");
        if let Some(ms) = wait_ms {
            request = request.header("sluice-wait-ms", ms);
        }
        let request = request.body(Full::new(Bytes::from(body)))?;
        tokio::time::timeout(timeout, async {
            let (parts, body) = self.http.request(request).await?.into_parts();
            let body = body.collect().await?.to_bytes();
            Ok(Answer {
                status: parts.status.as_u16(),
                headers: parts.headers,
                body,
            })
        })
        .await?
    }

    /// Until its next sync is due, or its watch said to sync now.
    async fn wait_for_turn(&self, next: tokio::time::Instant) {
        tokio::select! {
            () = tokio::time::sleep_until(next) => {}
            () = self.hurry.notified() => {}
        }
    }

    fn report(
        &self,
        calls: &Calls,
        share_ids: &BTreeMap<String, u64>,
        held: &BTreeMap<String, HeldShareReport>,
    ) -> String {
        let share = held.get(POLICY);
        let (rate, slots) = share.map_or((0.0, 0), |h| (h.rate, u64::from(h.in_flight)));
        let passing = (self.demand as f64).min(rate);
        let mut counts = Counts::default();
        counts.set(PolicyCounter::Admitted, calls.admitted());
        counts.set(PolicyCounter::Rejected, calls.rejected());
        // Calls of CALL_SECONDS each: in flight is what passes a second
        // times that (Little's law), within the slots of its share.
        counts.set(
            PolicyCounter::InFlight,
            ((passing * CALL_SECONDS).ceil() as u64).min(slots),
        );
        let mut policies = BTreeMap::new();
        policies.insert(
            POLICY.to_string(),
            PolicyReport {
                counts,
                max_in_flight: slots,
                // Tokens left in its bucket: none while it is asked more
                // than its share lets through.
                tokens: Some(if (self.demand as f64) > rate { 0 } else { 1 }),
                ..Default::default()
            },
        );
        let at_ms = calls.at_ms();
        let syncs = at_ms / 1000;
        let bank_calls = syncs * BANK_CALLS;
        let mut bank_counts = Counts::default();
        bank_counts.set(PolicyCounter::Admitted, bank_calls);
        policies.insert(
            BANK.to_string(),
            PolicyReport {
                counts: bank_counts,
                tokens: Some(1000 - BANK_CALLS),
                ..Default::default()
            },
        );
        let mut admitted = Counts::default();
        admitted.set(LimitCounter::Admitted, bank_calls);
        let mut limits = BTreeMap::new();
        limits.insert(
            BANK_PROVIDER.to_string(),
            LimitReport {
                counts: admitted,
                requests: 100,
                period_ms: 1000,
                available: Some(100 - BANK_CALLS),
                provider: Some(ProviderReport {
                    remaining: Some(100 - BANK_CALLS * (self.index as u64 % 10 + 1)),
                    limit: Some(100),
                    ..ProviderReport::default()
                }),
                ..LimitReport::default()
            },
        );
        let spent_by_all = bank_calls * CALL_COST;
        limits.insert(
            TEAM_BUDGET.to_string(),
            LimitReport {
                counts: admitted,
                requests: TEAM_BUDGET_SIZE,
                period_ms: 86_400_000,
                ..LimitReport::default()
            },
        );
        let mut budgets = BTreeMap::new();
        budgets.insert(
            TEAM_BUDGET.to_string(),
            BudgetReport {
                known: true,
                available: TEAM_BUDGET_SIZE.saturating_sub(spent_by_all / TEAMS),
                size: TEAM_BUDGET_SIZE,
                at_ms,
                resume_after: None,
            },
        );
        // The teams charged since the last sync, each what it spent so far.
        let team_keys: Vec<KeySpent> = (0..TEAMS_PER_SYNC)
            .map(|i| {
                let team = (syncs * TEAMS_PER_SYNC + i) % TEAMS;
                KeySpent {
                    owner: team.wrapping_mul(0x9e37_79b9_7f4a_7c15),
                    spent: spent_by_all / TEAMS + CALL_COST,
                }
            })
            .collect();
        let mut budget_keys = BTreeMap::new();
        budget_keys.insert(TEAM_BUDGET.to_string(), team_keys);
        // The callers' keys seen since the last sync.
        let mut seen = KeysReport {
            since_ms: at_ms.saturating_sub(1000),
            ..KeysReport::default()
        };
        let secret = label_secret(Some(TOKEN));
        for i in 0..KEYS_PER_SYNC {
            let key = (self.index as u64 * 7 + syncs * KEYS_PER_SYNC + i) % BANK_KEYS;
            let name = name_key(
                &secret,
                BANK,
                format!("key-{key}").as_bytes(),
                KeyLabel::Hash,
            );
            seen.record(&name, KeyOutcome::Admitted, false, ENVOY_TOP_KEYS);
        }
        let mut keys = BTreeMap::new();
        keys.insert(BANK.to_string(), seen);
        let report = SyncReport {
            instance: self.name.clone(),
            policy_version: self.version(),
            at_ms,
            limits,
            budgets,
            budget_keys,
            keys,
            policies,
            shares: share_ids.clone(),
            held: held.clone(),
            ..SyncReport::default()
        };
        serde_json::to_string(&report).unwrap_or_default()
    }
}

/// What one Envoy was asked and let through since it started, by its
/// own clock: the counters its reports carry, from which the admin reads
/// its demand.
#[derive(Debug, Clone, Copy)]
pub(super) struct Calls {
    started: Instant,
    until: Instant,
    asked: f64,
    passed: f64,
}

impl Calls {
    pub(super) fn new(started: Instant) -> Self {
        Self {
            started,
            until: started,
            asked: 0.0,
            passed: 0.0,
        }
    }

    /// Calls from the last count to `now` at `demand` a second, of which
    /// passed what the share in force let through (the filter's
    /// `share_in_force`: `newest` while its lease runs, then its fallback
    /// of `limit`; nothing before a first share): what this period added,
    /// in thousandths.
    pub(super) fn until(
        &mut self,
        now: Instant,
        demand: f64,
        newest: Option<Share>,
        limit: Amount,
    ) -> (u64, u64) {
        let (from, to) = (self.until, self.until.max(now));
        self.until = to;
        let passing = |at: Instant, seconds: f64| {
            demand.min(share_in_force(newest, limit, self.clock(at)).rate.max(0.0)) * seconds
        };
        let seconds = |a: Instant, b: Instant| b.saturating_duration_since(a).as_secs_f64();
        // A lease that ends within the period: the share before, its
        // fallback after.
        let lapse = newest
            .map(|s| self.started + Duration::from_millis(s.expires_at.as_millis()))
            .filter(|&end| from < end && end < to);
        let passed = match lapse {
            Some(end) => passing(from, seconds(from, end)) + passing(to, seconds(end, to)),
            None => passing(to, seconds(from, to)),
        };
        let asked = demand * seconds(from, to);
        self.asked += asked;
        self.passed += passed;
        ((asked * MILLI) as u64, (passed * MILLI) as u64)
    }

    /// `at` on this Envoy's clock.
    pub(super) fn clock(&self, at: Instant) -> SimInstant {
        clock(self.started, at)
    }

    pub(super) fn admitted(&self) -> u64 {
        self.passed as u64
    }

    pub(super) fn rejected(&self) -> u64 {
        (self.asked as u64).saturating_sub(self.admitted())
    }

    /// Its clock: milliseconds since it started (never 0, which a
    /// filter's clock is not either).
    pub(super) fn at_ms(&self) -> u64 {
        self.until
            .saturating_duration_since(self.started)
            .as_millis() as u64
            + 1
    }
}

/// `at` on the clock of an Envoy that started at `started`.
fn clock(started: Instant, at: Instant) -> SimInstant {
    SimInstant::from_millis(at.saturating_duration_since(started).as_millis() as u64)
}

/// An answer of the admin, read whole.
struct Answer {
    status: u16,
    headers: HeaderMap,
    body: Bytes,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_pass_as_far_as_the_share_held_over_the_period_lets_them() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let limit = Amount {
            rate: 40.0,
            in_flight: 0,
        };
        // Leased until `ms` of its clock, made when there were 4 Envoys.
        let share = |rate: f64, ms: u64| {
            Some(Share {
                amount: Amount { rate, in_flight: 0 },
                expires_at: SimInstant::from_millis(ms),
                instances: 4,
            })
        };
        let mut calls = Calls::new(t0);
        // No share yet: asked 10 a second for a second, none passed.
        assert_eq!(calls.until(at(1000), 10.0, None, limit), (10_000, 0));
        // A share of 6.5 a second for half a second: 3.25 of 5 passed.
        assert_eq!(
            calls.until(at(1500), 10.0, share(6.5, 9_000), limit),
            (5_000, 3_250)
        );
        // A share above the demand passes the demand, no more.
        assert_eq!(
            calls.until(at(2500), 10.0, share(40.0, 9_000), limit),
            (10_000, 10_000)
        );
        assert_eq!((calls.admitted(), calls.rejected()), (13, 12));
        assert_eq!(calls.at_ms(), 2501);
        // A lease that ends half way: the share of 30 before, its fallback
        // after (an even split of 40 four ways: 10, of 20 asked).
        assert_eq!(
            calls.until(at(3500), 20.0, share(30.0, 3_000), limit),
            (20_000, 15_000)
        );
        // A clock that went back counts nothing.
        assert_eq!(
            calls.until(at(2000), 10.0, share(40.0, 9_000), limit),
            (0, 0)
        );
        assert_eq!(calls.at_ms(), 3501);
    }
}
