//! Scenario 12: admins (SQLite, over TLS or not; one and two over
//! PostgreSQL and Redis) under a fleet of simulated Envoys, N of them at
//! once (`--fleet-sizes`), each speaking the filter's own sync protocol
//! (`sim_envoy`): a watch held open and reopened as the filter holds it,
//! a report every second as a real Envoy's, the fleet shares the last
//! answer gave echoed back and enforced. What the admin spends per sync,
//! how long a sync takes, what each Envoy costs it in memory, how long an
//! edit takes to reach every Envoy, and how much of the global limit the
//! shares let the fleet use.

mod render;
mod sim_envoy;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::{json, Value};
use sluice_e2e::envoy::free_port;
use sluice_e2e::postgres::PostgresServer;
use sluice_e2e::redis::RedisServer;
use sluice_shared::fleet::Amount;

use crate::procs::{self, cpu_time, rss_mib};
use crate::Args;
use render::render;
use sim_envoy::{FleetState, SimEnvoy};

const PASSWORD: &str = "bench-password";
const TOKEN: &str = procs::SYNC_TOKEN;
const POLICY: &str = "fleet";
/// Before counting: every Envoy has synced and holds its watch.
const WARM_UP: Duration = Duration::from_secs(5);
/// How long every Envoy is waited for to hold a share of the global
/// policy (closed until then) before the run counts anyway.
const FIRST_SHARES_WAIT: Duration = Duration::from_secs(30);
/// Edits made while the fleet syncs, spread over the run.
const EDITS: usize = 5;
/// The global limit per Envoy, calls a second. The Envoys are asked
/// 2 to 20 a second (11 on average): together a tenth more than the
/// limit, unevenly, so the limit is used whole only if the shares follow
/// each Envoy's demand.
const LIMIT_PER_ENVOY: u64 = 10;

/// A policy of this Envoy's own (`scope: local`) whose reports carry what
/// a real Envoy's do beside the global policy's counters: calls per
/// caller's key (the live view's top keys), a further limit that listens
/// to its provider's `RateLimit` headers, and a keyed money budget per
/// team (its changed keys each sync).
fn bank_policy() -> Value {
    json!({"name": sim_envoy::BANK, "match": {"host": "api.bank.example"},
    "rate": {"requests": 1000, "period": "1s"},
    "key": {"header": "x-api-key"},
    "limits": [
        {"name": sim_envoy::BANK_PROVIDER, "rate": {"requests": 100, "period": "1s"},
         "provider": {"headers": "ietf"}},
        {"name": sim_envoy::TEAM_BUDGET,
         "rate": {"requests": sim_envoy::TEAM_BUDGET_SIZE, "period": "1d", "algorithm": "fixed_window"},
         "key": {"header": "x-team", "max_keys": 4096}}
    ]})
}

/// The global policy's calls in flight.
const GLOBAL_IN_FLIGHT: u32 = 200;

fn global_policy(rate: u64) -> Value {
    json!({"name": POLICY, "match": {"host": "api.fleet.example"}, "scope": "global",
           "rate": {"requests": rate, "period": "1s"},
           "concurrency": {"max_in_flight": GLOBAL_IN_FLIGHT}})
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
    /// Calls the Envoys were asked and their shares let through, each a
    /// part of the global limit, over the run.
    asked_of_limit: f64,
    used_of_limit: f64,
    /// The rates of the limit the Envoys enforced at the run's end (each
    /// its share, or its fallback once the lease ended), added up, as a
    /// part of it.
    shares_of_limit: f64,
    /// From the fleet's start until every Envoy held a share of the
    /// global policy (none within [`FIRST_SHARES_WAIT`]: `None`).
    first_shares: Option<Duration>,
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
    /// One admin, its SQLite file; its Envoys syncing over TLS or not.
    Sqlite { tls: bool },
    /// Admins sharing PostgreSQL and Redis, the Envoys split between them
    /// as a load balancer would: one, to weigh what a second adds.
    PostgresRedis { admins: usize },
}

/// What [`fleet_scale`] measures, in order.
const STORES: [Stores; 4] = [
    Stores::Sqlite { tls: false },
    Stores::Sqlite { tls: true },
    Stores::PostgresRedis { admins: 1 },
    Stores::PostgresRedis { admins: 2 },
];

impl Stores {
    fn label(self) -> String {
        match self {
            Stores::Sqlite { tls: false } => "SQLite, 1 admin".into(),
            Stores::Sqlite { tls: true } => "SQLite, 1 admin, TLS".into(),
            Stores::PostgresRedis { admins: 1 } => "PostgreSQL + Redis, 1 admin".into(),
            Stores::PostgresRedis { admins } => format!("PostgreSQL + Redis, {admins} admins"),
        }
    }

    fn admins(self) -> usize {
        match self {
            Stores::Sqlite { .. } => 1,
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
        Stores::Sqlite { .. } => None,
        Stores::PostgresRedis { .. } => Some(Backing::start()?),
    };
    let replicas = stores.admins();
    let tls = matches!(stores, Stores::Sqlite { tls: true });
    let cert_dir = tempfile::tempdir()?;
    let cert_dir_arg = cert_dir.path().display().to_string();
    let mut admins = Vec::new();
    let mut bases = Vec::new();
    let mut sync_bases = Vec::new();
    for _ in 0..replicas {
        let port = free_port()?;
        let mut extra: Vec<String> = match &backing {
            Some(b) => vec![
                "--redis-url".into(),
                b.redis_url.clone(),
                "--database-url".into(),
                b.database_url.clone(),
            ],
            None => Vec::new(),
        };
        if tls {
            // Envoys sync over TLS, the admin's certificate pinned; the
            // operator's edits go to the plain port.
            let tls_port = free_port()?;
            extra.extend([
                "--tls-listen".into(),
                format!("127.0.0.1:{tls_port}"),
                "--tls-self-signed".into(),
                cert_dir_arg.clone(),
            ]);
            sync_bases.push(format!("https://127.0.0.1:{tls_port}"));
        } else {
            sync_bases.push(format!("http://127.0.0.1:{port}"));
        }
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
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
    let limit = LIMIT_PER_ENVOY * envoys as u64;
    let global_limit = Amount {
        rate: limit as f64,
        in_flight: GLOBAL_IN_FLIGHT,
    };
    op.create(global_policy(limit)).await?;
    op.create(bank_policy()).await?;
    let tls_config = if tls {
        Some(pinned_client_config(&cert_dir.path().join("ca.pem"))?)
    } else {
        None
    };
    let version = op.get("/api/v1/policies").await?["version"]
        .as_u64()
        .context("the policy set has no version")?;
    let pids: Vec<u32> = admins.iter().map(procs::Proc::pid).collect();
    let rss_before_mib = sum_of(&pids, rss_mib)?;

    let fleet = Arc::new(FleetState::new(envoys, version));
    let mut tasks = Vec::new();
    for i in 0..envoys {
        let envoy = SimEnvoy::new(
            &sync_bases[i % replicas],
            tls_config.as_ref(),
            i,
            envoys,
            global_limit,
            Arc::clone(&fleet),
        )?;
        tasks.push(tokio::spawn(envoy.clone().watch_forever()));
        tasks.push(tokio::spawn(envoy.sync_forever()));
    }
    // Counted once every Envoy holds a share and has synced with it
    // once more, so that no counted second is one before its first share.
    let spawned = Instant::now();
    let first_shares = loop {
        if fleet.all_shared() {
            break Some(spawned.elapsed());
        }
        if spawned.elapsed() > FIRST_SHARES_WAIT {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    tokio::time::sleep(
        WARM_UP
            .saturating_sub(spawned.elapsed())
            .max(sim_envoy::SYNC_EVERY),
    )
    .await;

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
        match op.update(global_policy(limit + edit as u64 + 1)).await {
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
    let rates_in_force = fleet.rates_in_force(global_limit, Instant::now());
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
        asked_of_limit: part_of_limit(&fleet.asked_milli, limit, elapsed),
        used_of_limit: part_of_limit(&fleet.passed_milli, limit, elapsed),
        first_shares,
        shares_of_limit: rates_in_force / limit.max(1) as f64,
        store_traffic,
    })
}

/// Calls counted in thousandths over `seconds`, as a part of `limit` a
/// second.
fn part_of_limit(milli: &std::sync::atomic::AtomicU64, limit: u64, seconds: f64) -> f64 {
    milli.load(Ordering::SeqCst) as f64 / 1000.0 / seconds / limit.max(1) as f64
}

/// A client configuration that trusts the admin's self-signed
/// certificate (`ca.pem`) alone, as an Envoy pins it.
fn pinned_client_config(ca: &std::path::Path) -> anyhow::Result<rustls::ClientConfig> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca).with_context(|| ca.display().to_string())? {
        roots.add(cert.context("the admin's ca.pem")?)?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth())
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

#[cfg(test)]
mod tests {
    use super::*;

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
