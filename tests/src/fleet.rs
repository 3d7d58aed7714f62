//! Fleet mode measured: one global limit shared by three real Envoys
//! (`--concurrency 2` each) through the shares an in-process admin leases,
//! in front of one mock provider that enforces the limit itself (300 calls
//! a second) and counts every call over it. The global policy allows
//! 290/s. `tests/tests/fleet.rs` asserts on these runs and `make bench`
//! (scenario 7) prints them against their targets.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::{json, Value};
use sluice_demo::mock::{MockApi, MockLimits};

use crate::admin::{AdminServer, Operator, SYNC_TOKEN};
use crate::envoy::Envoy;
use crate::load::{self, busiest_window, Outcome};

pub const GLOBAL_RPS: f64 = 290.0;
pub const PROVIDER_RPS: u64 = 300;
pub const LEASE: Duration = Duration::from_secs(2);
pub const WORKERS: u32 = 2;
/// Offered load per instance: 80 % through the first.
pub const OFFERED: [(&str, u64); 3] = [("a", 400), ("b", 50), ("c", 50)];
/// How often the heavy load moves in [`moving`] (`make bench`; the
/// end-to-end test moves it every [`MOVE_EVERY_E2E`]).
pub const MOVE_EVERY: Duration = Duration::from_secs(5);
pub const MOVE_EVERY_E2E: Duration = Duration::from_secs(3);

/// How long [`uneven_then_kill`] runs: the window the steady use is
/// measured over, then how long after the kill.
#[derive(Debug, Clone, Copy)]
pub struct UnevenSpans {
    pub steady: (Duration, Duration),
    pub after_kill: Duration,
}

/// `make bench`'s figures: 8 s of steady state, 4 s after the kill.
pub const UNEVEN_BENCH: UnevenSpans = UnevenSpans {
    steady: (Duration::from_secs(4), Duration::from_secs(12)),
    after_kill: Duration::from_secs(4),
};

/// The end-to-end test's: behaviour, not figures (those are the
/// simulator's, `tests/sim/tests/fleet_shares.rs`, and the bench's).
/// After the kill as long as the bench: the use after it is measured
/// from a quarter of that past the admin's moving the share, over a
/// window that holds the dead Envoy's lease running out. (With 2 s, the
/// window was the 1.5 s from half a second after the move: a clean run
/// of 21304d7, run alone, saw 81 % there, what the survivors used
/// before the kill: their larger shares had not yet taken effect.)
pub const UNEVEN_E2E: UnevenSpans = UnevenSpans {
    steady: (Duration::from_secs(3), Duration::from_secs(6)),
    after_kill: Duration::from_secs(4),
};

/// Targets (issue 19): of the global limit, what reaches the provider.
pub const UNEVEN_TARGET: f64 = 0.98;
pub const MOVING_TARGET: f64 = 0.95;

pub fn global_policy() -> Value {
    json!({"name": "llm", "match": {"host": "api.llm.example"}, "scope": "global",
           "share_lease": "2s", "rate": {"requests": 290, "period": "1s", "burst": 6},
           "concurrency": {"max_in_flight": 30}})
}

pub fn plugin_config(instance: &str) -> String {
    json!({"instance": format!("fleet-{instance}"), "admin_cluster": "sluice_admin",
           "sync_interval": "200ms", "sync_token": SYNC_TOKEN,
           "fallback": {"version": 1, "policies": []}})
    .to_string()
}

pub fn provider() -> MockLimits {
    MockLimits {
        max_per_second: PROVIDER_RPS,
        max_in_flight: 30,
    }
}

/// Calls the mock answered, per second, over `[from, to)` of its clock,
/// from `instances` (all when empty).
pub fn rate_at_mock(mock: &MockApi, instances: &[&str], from: Duration, to: Duration) -> f64 {
    let n = mock
        .arrivals()
        .iter()
        .filter(|a| a.at >= from && a.at < to)
        .filter(|a| {
            instances.is_empty() || a.key.as_deref().is_some_and(|k| instances.contains(&k))
        })
        .count();
    n as f64 / (to - from).as_secs_f64()
}

pub fn most_in_any_second(mock: &MockApi) -> usize {
    busiest_second(mock).0
}

/// The most calls the provider saw in any second, when that second began
/// (from the mock's reset), and how many of them each instance sent.
pub fn busiest_second(mock: &MockApi) -> (usize, Duration, BTreeMap<String, usize>) {
    let arrivals = mock.arrivals();
    let mut at: Vec<Duration> = arrivals.iter().map(|a| a.at).collect();
    at.sort();
    let (most, from) = busiest_window(&at, Duration::from_secs(1));
    let mut by_instance = BTreeMap::new();
    for a in arrivals
        .iter()
        .filter(|a| a.at >= from && a.at < from + Duration::from_secs(1))
    {
        *by_instance
            .entry(a.key.clone().unwrap_or_default())
            .or_insert(0) += 1;
    }
    (most, from, by_instance)
}

/// The admin's view of the global policy: instance -> (rate share, slots).
pub async fn shares(op: &Operator) -> anyhow::Result<Vec<(String, f64, u64)>> {
    let fleet = op.get("/api/v1/fleet").await?;
    let members = fleet["policies"][0]["members"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    Ok(members
        .iter()
        .map(|m| {
            (
                m["instance"].as_str().unwrap_or_default().to_string(),
                m["share"]["rate"].as_f64().unwrap_or(0.0),
                m["share"]["in_flight"].as_u64().unwrap_or(0),
            )
        })
        .collect())
}

pub fn start_envoys(mock: &MockApi, admin_ports: &[u16]) -> anyhow::Result<Vec<Envoy>> {
    OFFERED
        .iter()
        .map(|(name, _)| {
            Envoy::start_with_admins(&plugin_config(name), mock.addr.port(), admin_ports, WORKERS)
        })
        .collect()
}

pub async fn finish(
    stop: &Arc<AtomicBool>,
    load: Vec<tokio::task::JoinHandle<Vec<Outcome>>>,
) -> usize {
    stop.store(true, Ordering::SeqCst);
    let mut calls = 0;
    for l in load {
        calls += l.await.map(|o| o.len()).unwrap_or(0);
    }
    calls
}

/// Polls `check` every 20 ms until it holds; how long that took.
pub async fn until<F, Fut>(limit: Duration, mut check: F) -> Option<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let started = Instant::now();
    while started.elapsed() < limit {
        if check().await {
            return Some(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

/// How long after `killed_at` the admin's view shows the global policy
/// shared by `survivors` members holding 95 % of the limit between them:
/// the killed one's share moved (an error after four leases).
pub async fn share_moved(
    op: &Operator,
    survivors: usize,
    killed_at: Instant,
) -> anyhow::Result<Duration> {
    loop {
        let now = shares(op).await?;
        let sum: f64 = now.iter().map(|(_, r, _)| r).sum();
        if now.len() == survivors && sum >= 0.95 * GLOBAL_RPS {
            return Ok(killed_at.elapsed());
        }
        anyhow::ensure!(
            killed_at.elapsed() < LEASE * 4,
            "the killed Envoy's share did not move within {:?}: {now:?}",
            LEASE * 4
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One admin, the global policy, the mock provider and three Envoys.
pub struct Fleet {
    _dir: tempfile::TempDir,
    pub admin: AdminServer,
    pub op: Operator,
    pub mock: MockApi,
    pub envoys: Vec<Envoy>,
}

impl Fleet {
    pub async fn start() -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let admin = AdminServer::start(dir.path().join("sluice.db"), 0).await?;
        let op = admin.login().await?;
        op.create(global_policy()).await?;
        let mock = MockApi::start("127.0.0.1:0".parse()?, provider()).await?;
        let envoys = start_envoys(&mock, &[admin.port])?;
        Ok(Self {
            _dir: dir,
            admin,
            op,
            mock,
            envoys,
        })
    }
}

/// [`uneven_then_kill`]'s figures.
#[derive(Debug)]
pub struct Uneven {
    /// Calls a second at the provider, steady (4 to 12 s), and per Envoy.
    pub used: f64,
    pub per: Vec<f64>,
    pub steady_shares: Vec<(String, f64, u64)>,
    /// From c's SIGKILL until the admin shows its share with a and b.
    pub moved: Duration,
    /// Calls a second at the provider from a second after that.
    pub used_after: f64,
    pub calls: usize,
    pub most_in_a_second: usize,
    pub refused_by_provider: u64,
    pub syncs_ok: Vec<f64>,
}

/// Uneven load (a 400/s, b 50/s, c 50/s) over `spans.steady`, then Envoy
/// c SIGKILLed and `spans.after_kill` more.
pub async fn uneven_then_kill(fleet: &mut Fleet, spans: UnevenSpans) -> anyhow::Result<Uneven> {
    let stop = Arc::new(AtomicBool::new(false));
    fleet.mock.reset();
    let origin = Instant::now();
    let load = load::paced_through(&fleet.envoys, &OFFERED, &stop);
    // Shares settle within a few syncs; then the steady state.
    let (from, to) = spans.steady;
    tokio::time::sleep(to).await;
    let used = rate_at_mock(&fleet.mock, &[], from, to);
    let per: Vec<f64> = ["a", "b", "c"]
        .iter()
        .map(|i| rate_at_mock(&fleet.mock, &[i], from, to))
        .collect();
    let steady_shares = shares(&fleet.op).await?;

    let killed_at = Instant::now();
    let killed_on_mock = origin.elapsed();
    drop(fleet.envoys.pop());
    let moved = share_moved(&fleet.op, 2, killed_at).await?;
    tokio::time::sleep(spans.after_kill).await;
    let after_from = killed_on_mock + moved + spans.after_kill / 4;
    let used_after = rate_at_mock(&fleet.mock, &[], after_from, origin.elapsed());
    let calls = finish(&stop, load).await;
    Ok(Uneven {
        used,
        per,
        steady_shares,
        moved,
        used_after,
        calls,
        most_in_a_second: most_in_any_second(&fleet.mock),
        refused_by_provider: fleet.mock.rejected_by_mock(),
        syncs_ok: syncs_ok(&fleet.envoys),
    })
}

/// [`moving`]'s figures.
#[derive(Debug)]
pub struct Moving {
    /// Calls a second at the provider from just before the first move to
    /// the end (three moves), and in each period after a move.
    pub used: f64,
    pub per_period: Vec<f64>,
    pub calls: usize,
    pub most_in_a_second: usize,
    pub refused_by_provider: u64,
    pub syncs_ok: Vec<f64>,
}

/// The heavy load (400/s) moves a -> b -> c every `every`, the other two
/// at 50/s, for four periods. With `trace`, prints the admin's view every
/// 50 ms.
pub async fn moving(fleet: &Fleet, trace: bool, every: Duration) -> anyhow::Result<Moving> {
    // Every Envoy has synced and holds a share before the load starts,
    // and the just-started admin's ledger no longer recovers (for a lease
    // and a half from its first sync nobody's share grows: begun before,
    // on a loaded machine the load's first move fell in it, and its
    // period passed 159 calls a second of 290 in a clean run of 61697c6).
    until(Duration::from_secs(10), || async {
        let recovering = fleet.op.get("/api/v1/fleet").await.map_or(true, |f| {
            f["policies"][0]["recovering"].as_bool().unwrap_or(true)
        });
        !recovering && shares(&fleet.op).await.is_ok_and(|s| s.len() == 3)
    })
    .await
    .context("three Envoys in the fleet, its ledger not recovering, within 10 s")?;
    let stop = Arc::new(AtomicBool::new(false));
    fleet.mock.reset();
    let load = load::moving_through(&fleet.envoys, &["a", "b", "c"], (400, 50), every, &stop);
    let started = Instant::now();
    while started.elapsed() < every * 4 {
        if trace {
            print_view(&fleet.op, started.elapsed()).await?;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let calls = finish(&stop, load).await;
    let (from, to) = (every - Duration::from_millis(500), every * 4);
    if trace {
        // What the provider saw per 100 ms, by instance.
        let tenths = u32::try_from((every * 4).as_millis() / 100).unwrap_or(200);
        for tenth in 0..tenths {
            let at = Duration::from_millis(100) * tenth;
            let per: Vec<String> = ["a", "b", "c"]
                .iter()
                .map(|i| {
                    let n = rate_at_mock(&fleet.mock, &[i], at, at + Duration::from_millis(100));
                    format!("{i} {:.0}", n)
                })
                .collect();
            println!("arrivals {:>5} ms: {}", at.as_millis(), per.join(" "));
        }
    }
    Ok(Moving {
        used: rate_at_mock(&fleet.mock, &[], from, to),
        per_period: (1..4)
            .map(|k| rate_at_mock(&fleet.mock, &[], every * k, every * (k + 1)))
            .collect(),
        calls,
        most_in_a_second: most_in_any_second(&fleet.mock),
        refused_by_provider: fleet.mock.rejected_by_mock(),
        syncs_ok: syncs_ok(&fleet.envoys),
    })
}

/// Syncs each Envoy's filter counted as answered.
fn syncs_ok(envoys: &[Envoy]) -> Vec<f64> {
    envoys
        .iter()
        .map(|e| e.filter_stat("sync_ok").unwrap_or(0.0))
        .collect()
}

/// Each member's share, reservation, demand and use, on one line.
async fn print_view(op: &Operator, at: Duration) -> anyhow::Result<()> {
    let fleet = op.get("/api/v1/fleet").await?;
    let line: Vec<String> = fleet["policies"][0]["members"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|m| {
            format!(
                "{} share {:.0} res {:.0} dem {:.0} used {:.0}",
                m["instance"].as_str().unwrap_or_default(),
                m["share"]["rate"].as_f64().unwrap_or(0.0),
                m["reserved"]["rate"].as_f64().unwrap_or(0.0),
                m["demand"]["rate"].as_f64().unwrap_or(0.0),
                m["used"]["rate"].as_f64().unwrap_or(0.0)
            )
        })
        .collect();
    println!("trace {:>5} ms: {}", at.as_millis(), line.join(" | "));
    Ok(())
}
