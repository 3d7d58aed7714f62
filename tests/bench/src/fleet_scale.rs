//! Scenario 12: one admin under a fleet of simulated Envoys, N of them
//! at once (`--fleet-sizes`), each speaking the filter's own sync protocol:
//! a watch held open and reopened as the filter holds it, a report every
//! second with counters that grow by its own demand, the fleet shares the
//! last answer gave echoed back. What the admin spends per sync, how long
//! a sync takes, what each Envoy costs it in memory, and how long an edit
//! takes to reach every watch.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::{json, Value};
use sluice_e2e::envoy::free_port;
use sluice_e2e::postgres::PostgresServer;
use sluice_e2e::redis::RedisServer;
use sluice_wire::counts::Counts;
use sluice_wire::stats::PolicyCounter;
use sluice_wire::sync::{HeldShareReport, PolicyReport, SyncReport, SYNC_NOW_HEADER};
use sluice_wire::sync_answer::ReceivedHeaders;
use tokio::sync::Notify;

use crate::procs::{self, cpu_time, rss_mib};
use crate::Args;

const PASSWORD: &str = "bench-password";
const TOKEN: &str = procs::SYNC_TOKEN;
const POLICY: &str = "fleet";
/// The filter's default `sync_interval`.
const SYNC_EVERY: Duration = Duration::from_secs(1);
/// Before counting: every Envoy has synced and holds its watch.
const WARM_UP: Duration = Duration::from_secs(5);
/// Edits made while the fleet syncs, spread over the run.
const EDITS: usize = 5;
/// The filter's least gap between two watches that brought news.
const NEWS_GAP: Duration = Duration::from_millis(50);
/// How long a simulated Envoy waits for one answer, as the filter's
/// `sync_timeout` bounds its own calls.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// The filter's longest wait between syncs after failures.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

fn global_policy(rate: u64) -> Value {
    json!({"name": POLICY, "match": {"host": "api.fleet.example"}, "scope": "global",
           "rate": {"requests": rate, "period": "1s"},
           "concurrency": {"max_in_flight": 200}})
}

/// What one fleet size measured.
struct Measured {
    stores: Stores,
    envoys: usize,
    failed: u64,
    syncs_per_second: f64,
    watch_answers_per_second: f64,
    cpu_share: f64,
    cpu_us_per_sync: f64,
    sync_p50_ms: f64,
    sync_p99_ms: f64,
    rss_before_mib: f64,
    rss_after_mib: f64,
    push_p50_ms: f64,
    push_p99_ms: f64,
    push_missed: usize,
    /// Edits that landed, of [`EDITS`].
    edits_landed: usize,
    generator_cpu_share: f64,
    /// Redis commands and bytes (in and out), PostgreSQL transactions,
    /// per sync: the replicas' stores only.
    store_traffic: Option<StoreTraffic>,
}

/// Redis commands, Redis bytes in and out, PostgreSQL transactions: as
/// the stores count them since they started, or per sync over a run.
#[derive(Debug, Clone, Copy)]
struct StoreTraffic {
    redis_commands: f64,
    redis_bytes: f64,
    postgres_transactions: f64,
}

impl StoreTraffic {
    /// What the stores did from `before` to `after`, per sync of `syncs`.
    fn per_sync(before: Self, after: Self, syncs: u64) -> Self {
        let per_sync = |from: f64, to: f64| (to - from) / syncs.max(1) as f64;
        Self {
            redis_commands: per_sync(before.redis_commands, after.redis_commands),
            redis_bytes: per_sync(before.redis_bytes, after.redis_bytes),
            postgres_transactions: per_sync(
                before.postgres_transactions,
                after.postgres_transactions,
            ),
        }
    }
}

/// Where the admins keep their state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stores {
    /// One admin, its SQLite file.
    Sqlite,
    /// Admins sharing PostgreSQL and Redis, the Envoys split between them
    /// as a load balancer would: one, to weigh what a second adds.
    PostgresRedis { admins: usize },
}

/// What [`fleet_scale`] measures, in order.
const STORES: [Stores; 3] = [
    Stores::Sqlite,
    Stores::PostgresRedis { admins: 1 },
    Stores::PostgresRedis { admins: 2 },
];

impl Stores {
    fn label(self) -> String {
        match self {
            Stores::Sqlite => "SQLite, 1 admin".into(),
            Stores::PostgresRedis { admins: 1 } => "PostgreSQL + Redis, 1 admin".into(),
            Stores::PostgresRedis { admins } => format!("PostgreSQL + Redis, {admins} admins"),
        }
    }

    fn admins(self) -> usize {
        match self {
            Stores::Sqlite => 1,
            Stores::PostgresRedis { admins } => admins,
        }
    }
}

/// The stores the replicas share.
struct Backing {
    redis: RedisServer,
    redis_url: String,
    postgres: PostgresServer,
    database_url: String,
}

const DATABASE: &str = "sluice";

impl Backing {
    fn start() -> anyhow::Result<Self> {
        let redis = RedisServer::start()?;
        let postgres = PostgresServer::start()?;
        let database_url = postgres.database(DATABASE)?;
        Ok(Self {
            redis_url: redis.url(),
            redis,
            postgres,
            database_url,
        })
    }

    /// What the stores have done since they started.
    fn counters(&self) -> anyhow::Result<StoreTraffic> {
        let transactions: f64 = self
            .postgres
            .query(
                DATABASE,
                &format!(
                    "select xact_commit + xact_rollback from pg_stat_database where datname = '{DATABASE}'"
                ),
            )?
            .parse()
            .context("pg_stat_database")?;
        let redis = self.redis.info_stats()?;
        let stat = |field: &str| {
            redis
                .get(field)
                .map(|n| *n as f64)
                .with_context(|| format!("no {field} in Redis's INFO stats"))
        };
        Ok(StoreTraffic {
            redis_commands: stat("total_commands_processed")?,
            redis_bytes: stat("total_net_input_bytes")? + stat("total_net_output_bytes")?,
            postgres_transactions: transactions,
        })
    }
}

pub async fn fleet_scale(args: &Args, report: &mut crate::scenarios::Report) -> anyhow::Result<()> {
    let mut rows = Vec::new();
    for stores in STORES {
        for &envoys in &args.fleet_sizes {
            let measured = measure(args, envoys, stores)
                .await
                .with_context(|| format!("a fleet of {envoys}, {}", stores.label()))?;
            println!(
                "fleet of {envoys}, {}: {:.0} syncs/s, {:.0} µs admin CPU per sync, sync p99 {:.0} ms, push p99 {:.0} ms",
                stores.label(),
                measured.syncs_per_second,
                measured.cpu_us_per_sync,
                measured.sync_p99_ms,
                measured.push_p99_ms
            );
            rows.push(measured);
        }
    }
    report.add(render(&rows, args.seconds));
    Ok(())
}

async fn measure(args: &Args, envoys: usize, stores: Stores) -> anyhow::Result<Measured> {
    let backing = match stores {
        Stores::Sqlite => None,
        Stores::PostgresRedis { .. } => Some(Backing::start()?),
    };
    let replicas = stores.admins();
    let mut admins = Vec::new();
    let mut bases = Vec::new();
    for _ in 0..replicas {
        let port = free_port()?;
        let extra: Vec<&str> = match &backing {
            Some(b) => vec![
                "--redis-url",
                b.redis_url.as_str(),
                "--database-url",
                b.database_url.as_str(),
            ],
            None => Vec::new(),
        };
        // One after the other: the first makes the database's tables.
        admins.push(procs::start_admin_with(
            &args.admin_bin,
            port,
            PASSWORD,
            &extra,
        )?);
        bases.push(format!("http://127.0.0.1:{port}"));
    }
    let op = sluice_e2e::admin::Operator::login(&bases[0], PASSWORD).await?;
    op.create(global_policy(10 * envoys as u64)).await?;
    let version = op.get("/api/v1/policies").await?["version"]
        .as_u64()
        .context("the policy set has no version")?;
    let pids: Vec<u32> = admins.iter().map(procs::Proc::pid).collect();
    let rss_before_mib = sum_of(&pids, rss_mib)?;

    let fleet = Arc::new(FleetState::new(envoys, version));
    let mut tasks = Vec::new();
    for i in 0..envoys {
        let envoy = SimEnvoy::new(&bases[i % replicas], i, envoys, Arc::clone(&fleet))?;
        tasks.push(tokio::spawn(envoy.clone().watch_forever()));
        tasks.push(tokio::spawn(envoy.sync_forever()));
    }
    tokio::time::sleep(WARM_UP).await;

    let run = Duration::from_secs(args.seconds.max(10));
    fleet.counting.store(true, Ordering::SeqCst);
    let stores_before = backing.as_ref().map(Backing::counters).transpose()?;
    let (cpu_before, gen_before, started) = (
        sum_of(&pids, cpu_time)?,
        cpu_time(std::process::id())?,
        Instant::now(),
    );
    let mut edits = Vec::new();
    for edit in 0..EDITS {
        // Each edit somewhere else in the Envoys' sync second.
        let pause = run.mul_f64(1.0 / (EDITS as f64 + 1.0))
            + Duration::from_millis(137 * edit as u64 % 1000);
        tokio::time::sleep(pause.min(run.saturating_sub(started.elapsed()))).await;
        // An admin too busy to take an edit in time (408) is a finding,
        // not the end of the run: the edits that landed are measured.
        match op
            .update(global_policy(10 * envoys as u64 + edit as u64 + 1))
            .await
        {
            Ok(_) => {
                let answered = Instant::now();
                // The set's version now: this edit's, or a later one's if
                // an edit reported refused landed after all (then the
                // push is counted to the later version, never too soon).
                let made = op.get("/api/v1/policies").await?["version"]
                    .as_u64()
                    .context("the policy set has no version")?;
                edits.push((answered, made));
            }
            Err(e) => println!(
                "fleet of {envoys}, {}: an edit was refused: {e:#}",
                stores.label()
            ),
        }
    }
    tokio::time::sleep(run.saturating_sub(started.elapsed())).await;
    fleet.counting.store(false, Ordering::SeqCst);
    let elapsed = started.elapsed().as_secs_f64();
    let admin_cpu = sum_of(&pids, cpu_time)?.saturating_sub(cpu_before);
    let stores_after = backing.as_ref().map(Backing::counters).transpose()?;
    let gen_cpu = cpu_time(std::process::id())?.saturating_sub(gen_before);
    // A last watch answer for the last edit gets a moment to come.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss_after_mib = sum_of(&pids, rss_mib)?;
    for task in tasks {
        task.abort();
    }

    let syncs = fleet.syncs.load(Ordering::SeqCst);
    let mut latencies = std::mem::take(&mut *lock(&fleet.sync_ms));
    latencies.sort_by(f64::total_cmp);
    let learned = std::mem::take(&mut *lock(&fleet.learned));
    let (mut push, push_missed) = push_latencies(&edits, &learned);
    push.sort_by(f64::total_cmp);
    let store_traffic = stores_before
        .zip(stores_after)
        .map(|(before, after)| StoreTraffic::per_sync(before, after, syncs));
    drop(admins);
    Ok(Measured {
        stores,
        envoys,
        failed: fleet.failed.load(Ordering::SeqCst),
        syncs_per_second: syncs as f64 / elapsed,
        watch_answers_per_second: fleet.watch_answers_counted.load(Ordering::SeqCst) as f64
            / elapsed,
        cpu_share: admin_cpu.as_secs_f64() / elapsed,
        cpu_us_per_sync: admin_cpu.as_secs_f64() * 1e6 / syncs.max(1) as f64,
        sync_p50_ms: crate::scenarios::percentile(&latencies, 0.5),
        sync_p99_ms: crate::scenarios::percentile(&latencies, 0.99),
        rss_before_mib,
        rss_after_mib,
        push_p50_ms: crate::scenarios::percentile(&push, 0.5),
        push_p99_ms: crate::scenarios::percentile(&push, 0.99),
        push_missed,
        edits_landed: edits.len(),
        generator_cpu_share: gen_cpu.as_secs_f64() / elapsed,
        store_traffic,
    })
}

/// A figure of each admin process, added up.
fn sum_of<T: std::iter::Sum<T>>(
    pids: &[u32],
    figure: impl Fn(u32) -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    pids.iter().map(|&pid| figure(pid)).sum()
}

/// From each edit (when it was answered, and the set version it made) to
/// when each Envoy first held that version or a later one (by its watch's
/// answer or its sync's, whichever came first), in milliseconds; and how
/// many (edit, Envoy) pairs never got there. An Envoy that had the
/// version before the edit's answer reached the editor counts 0.
fn push_latencies(edits: &[(Instant, u64)], learned: &[Vec<(Instant, u64)>]) -> (Vec<f64>, usize) {
    let mut latencies = Vec::new();
    let mut missed = 0;
    for (edited, version) in edits {
        for envoy in learned {
            match envoy.iter().find(|(_, held)| held >= version) {
                Some((at, _)) => {
                    latencies.push(at.saturating_duration_since(*edited).as_secs_f64() * 1000.0);
                }
                None => missed += 1,
            }
        }
    }
    (latencies, missed)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What the simulated Envoys share with the measurement.
struct FleetState {
    /// While the run counts.
    counting: AtomicBool,
    syncs: AtomicU64,
    failed: AtomicU64,
    sync_ms: Mutex<Vec<f64>>,
    /// Watch answers of any kind while counting.
    watch_answers_counted: AtomicU64,
    /// Per Envoy, when it got each newer set, and its version.
    learned: Mutex<Vec<Vec<(Instant, u64)>>>,
    /// The set version each Envoy enforces (raised by its watch or sync).
    versions: Vec<AtomicU64>,
}

impl FleetState {
    fn new(envoys: usize, version: u64) -> Self {
        Self {
            counting: AtomicBool::new(false),
            syncs: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            sync_ms: Mutex::new(Vec::new()),
            watch_answers_counted: AtomicU64::new(0),
            learned: Mutex::new(vec![Vec::new(); envoys]),
            versions: (0..envoys).map(|_| AtomicU64::new(version)).collect(),
        }
    }

    fn counting(&self) -> bool {
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
struct SimEnvoy {
    index: usize,
    name: String,
    http: reqwest::Client,
    sync_url: String,
    watch_url: String,
    /// Its calls a second: uneven, 1 to 10 times the least busy one's.
    demand: u64,
    /// Where in the sync second it syncs (real Envoys start at any time).
    offset: Duration,
    /// Its watch heard that fleet room was freed: sync now.
    hurry: Arc<Notify>,
    fleet: Arc<FleetState>,
}

impl SimEnvoy {
    fn new(
        base: &str,
        index: usize,
        envoys: usize,
        fleet: Arc<FleetState>,
    ) -> anyhow::Result<Self> {
        Ok(Self {
            index,
            name: format!("sim-{index}"),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .build()?,
            sync_url: format!("{base}/api/v1/sync"),
            watch_url: format!("{base}/api/v1/sync/watch"),
            demand: 2 + 2 * (index as u64 % 10),
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
    async fn watch_forever(self) {
        loop {
            let body = json!({"instance": self.name, "policy_version": self.version()}).to_string();
            let sent = tokio::time::Instant::now();
            let answered = self
                .http
                .post(&self.watch_url)
                .bearer_auth(TOKEN)
                .header("content-type", "application/json")
                .header("sluice-wait-ms", "20000")
                .body(body)
                .send()
                .await;
            let Ok(answer) = answered else {
                tokio::time::sleep(SYNC_EVERY + SYNC_EVERY.mul_f64(2.0 * fastrand::f64())).await;
                continue;
            };
            let at = Instant::now();
            let status = answer.status().as_u16();
            let sync_now = answer.headers().contains_key(SYNC_NOW_HEADER);
            let news = match status {
                200 => {
                    if let Ok(set) = answer.json::<Value>().await {
                        if let Some(version) = set["version"].as_u64() {
                            self.fleet.got_set(self.index, version, at);
                        }
                    }
                    true
                }
                304 if sync_now => {
                    let _ = answer.bytes().await;
                    self.hurry.notify_one();
                    true
                }
                _ => {
                    let _ = answer.bytes().await;
                    false
                }
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
    async fn sync_forever(self) {
        tokio::time::sleep(self.offset).await;
        let mut next = tokio::time::Instant::now();
        let mut admitted = 0u64;
        let mut share_ids = BTreeMap::new();
        let mut held = BTreeMap::new();
        let mut failures = 0u32;
        loop {
            next += SYNC_EVERY;
            admitted += self.demand;
            let body = self.report(admitted, &share_ids, &held);
            let sent = Instant::now();
            let answer = tokio::time::timeout(
                CALL_TIMEOUT,
                self.http
                    .post(&self.sync_url)
                    .bearer_auth(TOKEN)
                    .header("content-type", "application/json")
                    .body(body)
                    .send(),
            )
            .await;
            let took = sent.elapsed().as_secs_f64() * 1000.0;
            let answer = match answer {
                Ok(Ok(answer)) if answer.status().is_success() || answer.status() == 304 => answer,
                _ => {
                    if self.fleet.counting() {
                        self.fleet.failed.fetch_add(1, Ordering::SeqCst);
                    }
                    // As the filter backs off (`finish_turn`): its interval,
                    // doubled after each failure in a row, at most 5 s.
                    failures = failures.saturating_add(1);
                    let backoff = SYNC_EVERY
                        .saturating_mul(1 << (failures - 1).min(16))
                        .min(MAX_BACKOFF);
                    self.wait_for_turn(tokio::time::Instant::now() + backoff)
                        .await;
                    next = tokio::time::Instant::now();
                    continue;
                }
            };
            failures = 0;
            let heard = ReceivedHeaders::read(|name| {
                answer.headers().get(name).map(|v| v.as_bytes().to_vec())
            });
            // A new set came with the sync (its watch was slower): enforced.
            let etag = answer.headers().get("etag").and_then(|v| v.to_str().ok());
            if let Some(version) = etag.and_then(|v| v.trim_matches('"').parse::<u64>().ok()) {
                if answer.status() == 200 {
                    self.fleet.got_set(self.index, version, Instant::now());
                }
            }
            if let Some(Ok(shares)) = heard.shares {
                for (policy, share) in shares {
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
            let _ = answer.bytes().await;
            if self.fleet.counting() {
                self.fleet.syncs.fetch_add(1, Ordering::SeqCst);
                lock(&self.fleet.sync_ms).push(took);
            }
            self.wait_for_turn(next).await;
            next = tokio::time::Instant::now();
        }
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
        admitted: u64,
        share_ids: &BTreeMap<String, u64>,
        held: &BTreeMap<String, HeldShareReport>,
    ) -> String {
        let mut counts = Counts::default();
        counts.set(PolicyCounter::Admitted, admitted);
        counts.set(PolicyCounter::Rejected, admitted / 50);
        let mut policies = BTreeMap::new();
        policies.insert(
            POLICY.to_string(),
            PolicyReport {
                counts,
                max_in_flight: self.demand,
                tokens: Some(self.demand),
                ..Default::default()
            },
        );
        let report = SyncReport {
            instance: self.name.clone(),
            policy_version: self.version(),
            at_ms: 0,
            policies,
            shares: share_ids.clone(),
            held: held.clone(),
            ..SyncReport::default()
        };
        serde_json::to_string(&report).unwrap_or_default()
    }
}

fn render(rows: &[Measured], seconds: u64) -> String {
    let mut s = String::from(
        "## 12. A fleet of simulated Envoys\n\n\
         Command: `make bench BENCH_ARGS=\"--only 12\"`. One admin on SQLite, then one and then two admins sharing \
         PostgreSQL and Redis (each simulated Envoy syncing with one of them, as behind a load balancer), over \
         plain HTTP, and N simulated Envoys in one load process on the same machine, each speaking the filter's sync protocol as a filter with \
         `sync_interval: 1s` (the default) and push on does: a watch held open (`POST /api/v1/sync/watch`, \
         reopened as the filter reopens it: 50 ms after the last was sent when it brought a new set or a word to \
         sync now, which also makes it sync at once), a report every second at its own point of the second (counters of \
         one `scope: global` policy growing by its own demand, uneven from one Envoy to the next by 1 to 10 times, \
         its in-flight, the fleet share it was last given echoed back), its share read from each answer's \
         headers, and after a failed or shed sync (`503`) its interval doubled each time, at most 5 s, as the filter backs off. Counted for ",
    );
    let _ = write!(
        s,
        "{} s after a 5 s warm-up; {EDITS} edits of the policy are made during it (\"edits\": how many the admin took). Admin CPU is read from \
         `/proc/<admin>/stat` (both admins' added up) and divided by the syncs answered (watches and edits included); memory per Envoy is the \
         admins' RSS after the run less before the fleet came, divided by N. Push: from an edit's 2xx to each \
         Envoy holding the set version it made, by its watch's answer or by its sync's when that came first \
         (edits through the first admin). Not simulated yet: TLS, \
         provider news, keyed policies and budgets in the reports.\n\n",
        seconds.max(10)
    );
    s.push_str(
        "| stores | Envoys | syncs/s | watch answers/s | failed | admin CPU | CPU per sync | sync p50 / p99 | admin RSS before → after | per Envoy | push p50 / p99 | push missed | edits | load generator CPU |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let per_envoy_kib = (r.rss_after_mib - r.rss_before_mib) * 1024.0 / r.envoys as f64;
        let _ = writeln!(
            s,
            "| {} | {} | {:.0} | {:.0} | {} | {:.1} % of a core | {:.0} µs | {:.1} / {:.1} ms | {:.1} → {:.1} MiB | {:.1} KiB | {:.0} / {:.0} ms | {} of {} | {} of {EDITS} | {:.1} % of a core |",
            r.stores.label(),
            r.envoys,
            r.syncs_per_second,
            r.watch_answers_per_second,
            r.failed,
            r.cpu_share * 100.0,
            r.cpu_us_per_sync,
            r.sync_p50_ms,
            r.sync_p99_ms,
            r.rss_before_mib,
            r.rss_after_mib,
            per_envoy_kib,
            r.push_p50_ms,
            r.push_p99_ms,
            r.push_missed,
            r.envoys * r.edits_landed,
            r.edits_landed,
            r.generator_cpu_share * 100.0,
        );
    }
    s.push_str(
        "\nWhat the replicas asked of their stores, per sync answered (`INFO stats` of Redis: \
         `total_commands_processed`, `total_net_input_bytes` + `total_net_output_bytes`; PostgreSQL's \
         `pg_stat_database`: `xact_commit` + `xact_rollback`):\n\n\
         | stores | Envoys | Redis commands | Redis bytes | PostgreSQL transactions |\n|---|---|---|---|---|\n",
    );
    for r in rows {
        if let Some(t) = &r.store_traffic {
            let _ = writeln!(
                s,
                "| {} | {} | {:.1} | {:.0} | {:.2} |",
                r.stores.label(),
                r.envoys,
                t.redis_commands,
                t.redis_bytes,
                t.postgres_transactions
            );
        }
    }
    s.push_str(&render_scaling(rows));
    s.push_str(
        "\nThe load generator shares the machine's 2 cores with the admin: where the two together need more than \
         both cores, the syncs fall behind their once a second and the latencies include the wait for a core.\n",
    );
    s
}

/// What a second admin on the same PostgreSQL and Redis adds, as a part
/// of one admin's capacity, from the CPU each spends per sync alone
/// (`one_us`) and beside a second (`two_us`): each admin bound by its own
/// core, one serves `1 / one_us` syncs a second, two `2 / two_us`.
fn second_admin_adds(one_us: f64, two_us: f64) -> f64 {
    2.0 * one_us / two_us - 1.0
}

fn render_scaling(rows: &[Measured]) -> String {
    let cpu_of = |admins: usize, envoys: usize| {
        rows.iter()
            .find(|r| r.stores == Stores::PostgresRedis { admins } && r.envoys == envoys)
            .map(|r| r.cpu_us_per_sync)
    };
    let mut s = String::from(
        "\nWhat a second admin adds (the issue's target: at least 80 % of what one serves). Each admin \
         given a core of its own serves as many syncs a second as a core holds of its CPU per sync, so \
         two serve `2 / (CPU per sync beside another)` where one serves `1 / (CPU per sync alone)`: the \
         second adds `2 × alone / beside − 1` of one's capacity. What the two spend beyond one (reading \
         each other's changes of the ledgers in Redis, compare-and-set rounds lost to each other) is what \
         lowers it. On this machine's two cores, shared with PostgreSQL, Redis and the load, this is a \
         projection from CPU per sync, not a measured saturation; above 100 %, the one admin alone \
         answered fewer syncs than were asked (it fell behind, and what it spent waiting on its stores \
         and on the cores went to fewer syncs), and where the two fell behind further (5 000) it is \
         lower than a machine with cores to spare would give.\n\n\
         | Envoys | 1 admin: CPU per sync | 2 admins: CPU per sync | a second admin adds |\n|---|---|---|---|\n",
    );
    let mut sizes: Vec<usize> = rows.iter().map(|r| r.envoys).collect();
    sizes.sort_unstable();
    sizes.dedup();
    for envoys in sizes {
        if let (Some(one), Some(two)) = (cpu_of(1, envoys), cpu_of(2, envoys)) {
            let _ = writeln!(
                s,
                "| {envoys} | {one:.0} µs | {two:.0} µs | {:.0} % |",
                second_admin_adds(one, two) * 100.0
            );
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_admin_adds_what_its_cpu_per_sync_leaves() {
        // The same CPU per sync beside another as alone: a whole admin more.
        assert!((second_admin_adds(500.0, 500.0) - 1.0).abs() < 1e-9);
        // Twice the CPU per sync: two serve what one did, nothing added.
        assert!(second_admin_adds(500.0, 1000.0).abs() < 1e-9);
        // 80 % added needs CPU per sync within 11 % of one's alone.
        assert!(second_admin_adds(500.0, 555.0) > 0.8);
        assert!(second_admin_adds(500.0, 560.0) < 0.8);
    }

    #[test]
    fn push_latency_is_to_each_envoy_holding_the_edits_version() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        // Edits answered at 100 ms (version 2) and 500 ms (version 3).
        let edits = [(at(100), 2), (at(500), 3)];
        let learned = vec![
            // Version 2 at 130 ms, version 3 at 490 ms (before the edit's
            // answer reached the editor).
            vec![(at(50), 1), (at(130), 2), (at(490), 3)],
            // Version 2 only at 800 ms (after the second edit): the first
            // edit's push took 700 ms, not the second's 300.
            vec![(at(800), 2)],
        ];
        let (mut latencies, missed) = push_latencies(&edits, &learned);
        latencies.sort_by(f64::total_cmp);
        let rounded: Vec<u64> = latencies.iter().map(|ms| ms.round() as u64).collect();
        assert_eq!(rounded, vec![0, 30, 700]);
        assert_eq!(missed, 1, "the second Envoy never held version 3");
    }
}
