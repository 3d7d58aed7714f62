//! `sluice-soak`, what `make soak` runs: the admin binary (SQLite file),
//! Envoy with the filter syncing with it, the mock API, and mixed load for
//! a long time: rate, concurrency, queued and per-key policies, 30 % of
//! calls abandoned by their client, a policy change every 10 s. At the end
//! nothing may be left in flight and the memory of Envoy and the admin must
//! be flat. Exit status 1 when a check fails.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Parser;
use serde_json::{json, Value};
use sluice_demo::mock::{MockApi, MockLimits};
use sluice_e2e::admin::{AdminProcess, SYNC_TOKEN};
use sluice_e2e::envoy::{filter_vms, free_port, Envoy};
use sluice_e2e::load;
use sluice_e2e::procinfo::rss_mib;

#[derive(Parser)]
#[command(about = "Soak Sluice: long mixed load with aborts and policy changes")]
struct Args {
    /// How long the load runs, e.g. 30m, 90s.
    #[arg(long, default_value = "30m", value_parser = parse_duration)]
    duration: Duration,
    /// Concurrent clients.
    #[arg(long, default_value_t = 32)]
    clients: usize,
    /// Envoy worker threads.
    #[arg(long, default_value_t = 2)]
    workers: u32,
    /// Memory may grow this much between the end of warm-up and the end
    /// (MiB, per process) before the soak fails.
    #[arg(long, default_value_t = 24.0)]
    rss_slack_mib: f64,
    /// Leave one call in flight at the end (the soak's own test: the checks
    /// must catch it and fail).
    #[arg(long, hide = true)]
    leave_a_call_open: bool,
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    sluice_shared::DurationMs::parse(text).map(|d| Duration::from_millis(d.as_millis()))
}

const WARMUP: Duration = Duration::from_secs(10);
const CHANGE_EVERY: Duration = Duration::from_secs(10);
/// Of the calls the clients mean to abandon, about a quarter get their
/// answer (a 429 comes back in well under a millisecond) before they can;
/// 45 % of calls set to hang up early leave about a third really abandoned.
const ABORT_PERCENT: u64 = 45;
/// The share of calls that must end abandoned by their client.
const ABANDONED_TARGET: f64 = 30.0;

/// The policies under soak; `step` varies bank's and fx's rates.
fn policies(step: u64) -> Vec<Value> {
    let bank = if step % 2 == 0 { 200 } else { 120 };
    let fx = if step % 3 == 0 { 50 } else { 80 };
    vec![
        json!({"name": "bank", "match": {"host": "api.bank.example"},
               "rate": {"requests": bank, "period": "1s", "burst": 20}}),
        json!({"name": "llm", "match": {"host": "api.llm.example"},
               "concurrency": {"max_in_flight": 8, "lease_ttl": "30s"}}),
        json!({"name": "fx", "match": {"host": "api.fx.example"},
               "rate": {"requests": fx, "period": "1s", "burst": 5},
               "on_limit": {"action": "queue", "max_wait": "300ms", "max_queue": 200}}),
        json!({"name": "ship", "match": {"host": "api.ship.example"},
               "key": {"header": "x-api-key", "max_keys": 50},
               "rate": {"requests": 20, "period": "1s", "burst": 5}}),
    ]
}

const HOSTS: [&str; 4] = [
    "api.bank.example",
    "api.llm.example",
    "api.fx.example",
    "api.ship.example",
];

#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    limited: AtomicU64,
    aborted: AtomicU64,
    other: AtomicU64,
}

/// A small xorshift: the mix of calls needs to vary, not to be secure.
fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

async fn client_loop(url: String, seed: u64, stop: Arc<AtomicBool>, tally: Arc<Tally>) {
    let http = load::client();
    let mut rng = seed | 1;
    while !stop.load(Ordering::Relaxed) {
        let r = next(&mut rng);
        let host = HOSTS[(r % 4) as usize];
        let abort = (r >> 8) % 100 < ABORT_PERCENT;
        let delay = 5 + (r >> 16) % 40;
        let mut request = http
            .get(format!("{url}/soak?delay_ms={delay}"))
            .header("host", host)
            .header("x-api-key", format!("key-{}", (r >> 24) % 80));
        // An abandoned call: the client hangs up before the API answers
        // (or before its queue turn comes).
        request = request.timeout(if abort {
            Duration::from_millis(1 + (r >> 32) % delay)
        } else {
            Duration::from_secs(10)
        });
        match request.send().await {
            Ok(resp) => {
                let status = resp.status().as_u16();
                let _ = resp.bytes().await;
                match status {
                    200 => tally.ok.fetch_add(1, Ordering::Relaxed),
                    429 => tally.limited.fetch_add(1, Ordering::Relaxed),
                    _ => tally.other.fetch_add(1, Ordering::Relaxed),
                };
            }
            Err(e) if e.is_timeout() => {
                tally.aborted.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {
                tally.other.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

struct Rss {
    envoy: f64,
    admin: f64,
}

fn rss(envoy: &Envoy, admin: &AdminProcess) -> anyhow::Result<Rss> {
    Ok(Rss {
        envoy: rss_mib(envoy.pid())?,
        admin: rss_mib(admin.pid())?,
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("sluice.db");
    let admin_port = free_port()?;
    let admin = AdminProcess::start(&db, admin_port, None, &dir.path().join("admin.log"))
        .await
        .context("starting the admin")?;
    let op = admin.login().await?;
    for p in policies(0) {
        op.create(p).await?;
    }
    let mock = MockApi::start("127.0.0.1:0".parse()?, MockLimits::default()).await?;
    let config =
        json!({"instance": "soak", "admin_cluster": "sluice_admin", "sync_interval": "500ms",
        "sync_token": SYNC_TOKEN, "fallback": {"version": 0, "policies": []}})
        .to_string();
    let envoy = Envoy::start_with_admin(&config, mock.addr.port(), admin_port, args.workers)?;
    let installs = |e: &Envoy| e.filter_stat("policy_sets_installed").unwrap_or(0.0);
    let deadline = Instant::now() + Duration::from_secs(10);
    while installs(&envoy) < filter_vms(args.workers) {
        if Instant::now() > deadline {
            bail!("the admin's policies never reached Envoy");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "soak: {} of load, {} clients, {ABORT_PERCENT} % set to hang up early, a policy change every {CHANGE_EVERY:?}; \
         Envoy pid {} ({} workers), admin pid {}",
        humanize(args.duration),
        args.clients,
        envoy.pid(),
        args.workers,
        admin.pid()
    );

    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let clients: Vec<_> = (0..args.clients)
        .map(|i| {
            tokio::spawn(client_loop(
                envoy.url(""),
                0x9E37_79B9_7F4A_7C15_u64.wrapping_mul(i as u64 + 1),
                stop.clone(),
                tally.clone(),
            ))
        })
        .collect();
    let started = Instant::now();
    let mut at_warm = None;
    let mut changes = 0u64;
    let mut next_change = started + CHANGE_EVERY;
    let mut next_report = started + Duration::from_secs(60);
    while started.elapsed() < args.duration {
        tokio::time::sleep(Duration::from_millis(200)).await;
        if at_warm.is_none() && started.elapsed() >= WARMUP.min(args.duration / 2) {
            at_warm = Some(rss(&envoy, &admin)?);
        }
        if Instant::now() >= next_change {
            changes += 1;
            for p in policies(changes)
                .into_iter()
                .filter(|p| p["name"] == "bank" || p["name"] == "fx")
            {
                op.update(p).await.context("a policy change")?;
            }
            next_change += CHANGE_EVERY;
        }
        if Instant::now() >= next_report {
            let now = rss(&envoy, &admin)?;
            println!(
                "soak: {:?} in: {} ok, {} limited, {} abandoned; RSS Envoy {:.1} MiB, admin {:.1} MiB",
                started.elapsed().as_secs(),
                tally.ok.load(Ordering::Relaxed),
                tally.limited.load(Ordering::Relaxed),
                tally.aborted.load(Ordering::Relaxed),
                now.envoy,
                now.admin
            );
            next_report += Duration::from_secs(60);
        }
    }
    stop.store(true, Ordering::SeqCst);
    for c in clients {
        let _ = c.await;
    }
    if args.leave_a_call_open {
        // A call the API holds for a minute, sent once the load is over (so
        // a free slot admits it): still in flight when the checks run.
        let url = envoy.url("/soak?delay_ms=60000");
        tokio::spawn(async move {
            let _ = load::client()
                .get(url)
                .header("host", "api.llm.example")
                .timeout(Duration::from_secs(120))
                .send()
                .await;
        });
    }
    // Abandoned streams end as their upstream calls finish; stats reach
    // Envoy on the filter's tick.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let at_end = rss(&envoy, &admin)?;
    let at_warm = at_warm.context("the soak ended before warm-up")?;
    let in_flight = envoy.gauge("llm", "in_flight")?;
    // The queue's length as the filter last reported it to the admin.
    let instances = op.get("/api/v1/instances").await?;
    let waiting = instances["instances"]
        .as_array()
        .and_then(|a| a.iter().find(|i| i["id"] == "soak"))
        .map(|i| i["report"]["policies"]["fx"]["waiting"].as_u64())
        .context("the soak's Envoy in the admin's instance list")?
        .context("fx's queue length in the instance's report")?;
    let version = op.get("/api/v1/policies").await?["version"]
        .as_u64()
        .unwrap_or(0);
    let versions = envoy.filter_stat("policy_sets_installed").unwrap_or(0.0);
    let (ok, limited, aborted, other) = (
        tally.ok.load(Ordering::Relaxed),
        tally.limited.load(Ordering::Relaxed),
        tally.aborted.load(Ordering::Relaxed),
        tally.other.load(Ordering::Relaxed),
    );
    let total = ok + limited + aborted + other;
    let aborted_share = aborted as f64 * 100.0 / total.max(1) as f64;
    println!(
        "soak: {total} calls: {ok} ok, {limited} limited, {aborted} abandoned ({aborted_share:.1} %, target {ABANDONED_TARGET} %), \
         {other} other; {changes} policy changes (admin at version {version}, {versions} installs \
         across Envoy's VMs); afterwards in flight {in_flight} (Envoy, llm), {} (mock), fx queue {waiting}; \
         RSS after warm-up -> end: Envoy {:.1} -> {:.1} MiB, admin {:.1} -> {:.1} MiB",
        mock.in_flight(),
        at_warm.envoy,
        at_end.envoy,
        at_warm.admin,
        at_end.admin
    );
    let mut failed = Vec::new();
    if in_flight != 0.0 || mock.in_flight() != 0 {
        failed.push("calls left in flight".to_string());
    }
    if waiting != 0 {
        failed.push("calls left waiting in the queue".to_string());
    }
    if other > total / 1000 {
        failed.push(format!(
            "{other} calls failed for reasons other than limits or aborts"
        ));
    }
    if aborted_share < ABANDONED_TARGET {
        failed.push(format!("only {aborted_share:.1} % of calls were abandoned"));
    }
    if (changes as f64) * filter_vms(args.workers) > versions {
        failed.push("not every policy change reached every worker".into());
    }
    for (name, warm, end) in [
        ("Envoy", at_warm.envoy, at_end.envoy),
        ("admin", at_warm.admin, at_end.admin),
    ] {
        if end > warm + args.rss_slack_mib {
            failed.push(format!(
                "{name} grew from {warm:.1} to {end:.1} MiB (slack {} MiB)",
                args.rss_slack_mib
            ));
        }
    }
    if failed.is_empty() {
        println!("soak: passed");
        Ok(())
    } else {
        // An error, not `process::exit`: the admin, Envoy and the mock are
        // stopped on the way out (exit skipped their drops and left them running).
        bail!("soak: FAILED: {}", failed.join("; "))
    }
}

fn humanize(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 60 && s % 60 == 0 {
        format!("{} min", s / 60)
    } else {
        format!("{s} s")
    }
}
