//! Fleet mode: one global limit shared by three real Envoys (`--concurrency
//! 2` each) through shares the admin leases at every sync, in front of one
//! mock provider that enforces the limit itself (300 calls a second) and
//! counts every call over it.
//!
//! The global policy allows 290/s, so the provider's own limit is never hit
//! while the shares hold; one Envoy carries 80 % of the traffic.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use sluice_demo::mock::{MockApi, MockLimits};
use sluice_e2e::admin::AdminProcess;
use sluice_e2e::envoy::{free_port, Envoy};
use sluice_e2e::fair;
use sluice_e2e::fleet::{
    self, busiest_second, finish, global_policy, most_in_any_second, plugin_config, provider,
    rate_at_mock, shares, start_envoys, until, Fleet, GLOBAL_RPS, LEASE, OFFERED, PROVIDER_RPS,
    WORKERS,
};
use sluice_e2e::load::{self, wait_for, Outcome};
use sluice_e2e::postgres::PostgresServer;
use sluice_e2e::redis::RedisServer;

/// Syncs a replica answered, from its `/metrics`.
async fn syncs_answered(base: &str) -> u64 {
    let Ok(response) = reqwest::get(format!("{base}/metrics")).await else {
        return 0;
    };
    let text = response.text().await.unwrap_or_default();
    text.lines()
        .filter(|l| l.starts_with("sluice_admin_sync_requests_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// The provider, counting its calendar seconds as real ones do, refused
/// nothing. The most it saw in any 1 s from any instant is printed, not
/// asserted: the shares allow their bursts (up to 290 + 3 x 6 in a
/// sliding second by design), and on a loaded machine calls admitted
/// over more than a second reach the provider within one (a clean run
/// of 2762abe saw 308 of 300 with nothing refused). That the shares
/// never add up past the limit is the simulator's property
/// (`tests/sim/tests/fleet_shares.rs`, 1 000 seeds each, the provider
/// refusing nothing).
fn never_over_the_provider(refused: u64) {
    assert_eq!(refused, 0, "the provider's limit was exceeded");
}

/// Through three real Envoys: uneven load uses the global limit, the busy
/// Envoy's share follows its demand, and when Envoy c dies (SIGKILL: its
/// kernel closes its connections, and it misses its syncs) its share goes
/// to a and b; the provider's limit is never passed. Behaviour with
/// margins a loaded machine keeps: the figures (98 % used, the share moved
/// within four syncs) are the simulator's (`tests/sim/tests/fleet_shares.rs`,
/// 1 000 seeds) and `make bench`'s (scenario 7, the same run for 12 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uneven_load_uses_the_global_limit_and_a_dead_envoys_share_moves() -> anyhow::Result<()> {
    let mut fleet = Fleet::start().await?;
    let run = fleet::uneven_then_kill(&mut fleet, fleet::UNEVEN_E2E).await?;
    println!(
        "fleet uneven: offered a 400/s, b 50/s, c 50/s; global limit {GLOBAL_RPS}/s, provider {PROVIDER_RPS}/s; \
         steady ({:?}): the provider saw {:.1}/s ({:.1} % of the global limit): a {:.1}/s, b {:.1}/s, c {:.1}/s; \
         shares then {:?}",
        fleet::UNEVEN_E2E.steady,
        run.used,
        100.0 * run.used / GLOBAL_RPS,
        run.per[0],
        run.per[1],
        run.per[2],
        run.steady_shares,
    );
    println!(
        "fleet kill: c SIGKILLed; its share moved to a and b after {:?} (lease {LEASE:?}); then the provider saw \
         {:.1}/s ({:.1} % of the global limit); {} calls in all; most in any 1 s at the provider {} (limit {PROVIDER_RPS}); \
         refused by the provider {}; syncs ok a, b: {:?}",
        run.moved,
        run.used_after,
        100.0 * run.used_after / GLOBAL_RPS,
        run.calls,
        run.most_in_a_second,
        run.refused_by_provider,
        run.syncs_ok,
    );
    assert!(
        run.used >= 0.9 * GLOBAL_RPS,
        "steady use {:.1}/s of {GLOBAL_RPS}/s",
        run.used
    );
    assert!(
        run.per[0] > run.per[1] * 3.0,
        "a's share follows its demand: {:?}",
        run.per
    );
    assert!(
        run.moved <= LEASE * 2,
        "moved after {:?}, more than two leases",
        run.moved
    );
    assert!(
        run.used_after >= 0.9 * GLOBAL_RPS,
        "after the kill {:.1}/s",
        run.used_after
    );
    never_over_the_provider(run.refused_by_provider);
    Ok(())
}

/// The heavy load moves to the next Envoy every 3 s: a 400/s, then b,
/// then c, the other two at 50/s each. Shares follow each move through
/// real Envoys and the provider's limit is never passed; the figure (at
/// least 94.5 % used, moves every 5 s) is the simulator's and `make
/// bench`'s. `FLEET_TRACE=1` prints the admin's view every 50 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_that_moves_between_envoys_still_uses_the_global_limit() -> anyhow::Result<()> {
    let fleet = Fleet::start().await?;
    let every = fleet::MOVE_EVERY_E2E;
    let run = fleet::moving(&fleet, std::env::var("FLEET_TRACE").is_ok(), every).await?;
    println!(
        "fleet moving: 400/s moves a -> b -> c every {every:?}, the others 50/s; global limit {GLOBAL_RPS}/s; \
         from the first move on the provider saw {:.1}/s ({:.1} % of the global limit); per period after a move \
         {:.1?}; {} calls; most in any 1 s {} (provider {PROVIDER_RPS}); refused by the provider {}; syncs ok {:?}",
        run.used,
        100.0 * run.used / GLOBAL_RPS,
        run.per_period,
        run.calls,
        run.most_in_a_second,
        run.refused_by_provider,
        run.syncs_ok,
    );
    assert!(
        run.used >= 0.85 * GLOBAL_RPS,
        "moving load used {:.1}/s of {GLOBAL_RPS}/s",
        run.used
    );
    // Each period after a move, the load's new Envoy has most of it.
    assert!(
        run.per_period.iter().all(|p| *p >= 0.8 * GLOBAL_RPS),
        "after each move: {:?}",
        run.per_period
    );
    never_over_the_provider(run.refused_by_provider);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_replicas_share_leases_in_redis_and_no_admin_means_no_overshoot() -> anyhow::Result<()>
{
    let redis = RedisServer::start()?;
    let postgres = PostgresServer::start()?;
    let database = postgres.database("sluice")?;
    let dir = tempfile::tempdir()?;
    // Unused: the replicas keep policies in PostgreSQL.
    let db = dir.path().join("unused.db");
    let url = redis.url();
    let replica_args = [
        "--redis-url",
        url.as_str(),
        "--database-url",
        database.as_str(),
    ];
    let ports = [free_port()?, free_port()?];
    let first = AdminProcess::start_with_args(
        &db,
        ports[0],
        None,
        &dir.path().join("admin-1.log"),
        &replica_args,
    )
    .await?;
    let second = AdminProcess::start_with_args(
        &db,
        ports[1],
        None,
        &dir.path().join("admin-2.log"),
        &replica_args,
    )
    .await?;
    let op = first.login().await?;
    op.create(global_policy()).await?;
    let op2 = second.login().await?;
    let mock = MockApi::start("127.0.0.1:0".parse()?, provider()).await?;
    let envoys = start_envoys(&mock, &ports)?;
    let stop = Arc::new(AtomicBool::new(false));
    mock.reset();
    let origin = Instant::now();
    let load = load::paced_through(&envoys, &OFFERED, &stop);
    tokio::time::sleep(Duration::from_secs(8)).await;
    let used_two = rate_at_mock(&mock, &[], Duration::from_secs(4), Duration::from_secs(8));
    // Both replicas answered syncs, from one ledger.
    let answered = (
        syncs_answered(&first.base()).await,
        syncs_answered(&second.base()).await,
    );
    // Every Envoy's share is in the ledger, seen from either replica (on
    // a machine with no idle core, one Envoy's first share was not yet
    // there at 8 s).
    until(Duration::from_secs(10), || async {
        let seen = (shares(&op).await, shares(&op2).await);
        matches!(seen, (Ok(one), Ok(two)) if one.len() == 3 && two.len() == 3)
    })
    .await;
    let shares_via_first = shares(&op).await?;
    let shares_via_second = shares(&op2).await?;

    // Replica 1 dies: Envoy's health check drops it, syncs go on through 2.
    let syncs_before: Vec<f64> = envoys
        .iter()
        .map(|e| e.filter_stat("sync_ok").unwrap_or(0.0))
        .collect();
    let killed_first = origin.elapsed();
    first.kill();
    tokio::time::sleep(Duration::from_secs(6)).await;
    let syncs_after: Vec<f64> = envoys
        .iter()
        .map(|e| e.filter_stat("sync_ok").unwrap_or(0.0))
        .collect();
    let used_one = rate_at_mock(
        &mock,
        &[],
        killed_first + Duration::from_secs(2),
        origin.elapsed(),
    );
    let live_after = shares(&op2).await?;
    // Policies live in PostgreSQL: an edit through the surviving replica
    // reaches every Envoy.
    let edited_version = op2
        .create(
            json!({"name": "after-failover", "match": {"host": "api.other.example"},
            "rate": {"requests": 5, "period": "1s"}}),
        )
        .await?;
    let set_version = op2.get("/api/v1/policies").await?["version"]
        .as_u64()
        .unwrap_or(0);
    let edited_at = Instant::now();
    let mut edit_reached = None;
    while edited_at.elapsed() < Duration::from_secs(5) {
        let instances = op2.get("/api/v1/instances").await?;
        let on_it = instances["instances"].as_array().map_or(0, |all| {
            all.iter()
                .filter(|i| i["policy_version"].as_u64() >= Some(set_version))
                .count()
        });
        if on_it == envoys.len() {
            edit_reached = Some(edited_at.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Replica 2 dies too: no admin at all. Shares run to the end of their
    // lease, then fall back to an even split of the limit, never more.
    let killed_second = origin.elapsed();
    second.kill();
    let lapsed = wait_for(
        "every Envoy counting failed syncs",
        Duration::from_secs(5),
        || {
            envoys
                .iter()
                .all(|e| e.filter_stat("sync_failures").unwrap_or(0.0) > 0.0)
        },
    )
    .await;
    tokio::time::sleep(LEASE * 3).await;
    let used_none = rate_at_mock(
        &mock,
        &[],
        killed_second + LEASE + Duration::from_secs(1),
        origin.elapsed(),
    );
    let calls = finish(&stop, load).await;
    let (most, busiest_from, busiest_by) = busiest_second(&mock);
    let refused_by_provider = mock.rejected_by_mock();

    println!(
        "fleet replicas: two admins, policies in PostgreSQL, leases in Redis, syncs answered {answered:?}; the provider saw {used_two:.1}/s \
         ({:.1} % of {PROVIDER_RPS}/s); shares via replica 1 {shares_via_first:?}, via replica 2 {shares_via_second:?}",
        100.0 * used_two / PROVIDER_RPS as f64,
    );
    println!(
        "fleet replica kill: replica 1 SIGKILLed; syncs ok per Envoy {syncs_before:?} -> {syncs_after:?} in 6 s; \
         the provider saw {used_one:.1}/s; replica 2 sees {live_after:?}; a policy created through replica 2 \
         (policy version {edited_version}, set version {set_version}) reached every Envoy in {edit_reached:?}",
    );
    println!(
        "fleet no admin: both replicas gone ({lapsed:?} to the first failures); after the leases lapsed the provider saw \
         {used_none:.1}/s (fallback: each Envoy at most {:.1}/s); {calls} calls in all; most in any 1 s {most} \
         (limit {PROVIDER_RPS}), from {busiest_from:?} (replica 1 killed at {killed_first:?}, replica 2 at \
         {killed_second:?}), by instance {busiest_by:?}; refused by the provider {refused_by_provider}",
        GLOBAL_RPS / 3.0,
    );
    assert!(
        answered.0 > 0 && answered.1 > 0,
        "both replicas answered syncs: {answered:?}"
    );
    assert_eq!(shares_via_first.len(), 3, "{shares_via_first:?}");
    assert_eq!(
        shares_via_first.iter().map(|s| &s.0).collect::<Vec<_>>(),
        shares_via_second.iter().map(|s| &s.0).collect::<Vec<_>>(),
        "one ledger, seen from both replicas"
    );
    assert!(
        used_two >= 0.9 * PROVIDER_RPS as f64,
        "use with two replicas {used_two:.1}/s"
    );
    for (before, after) in syncs_before.iter().zip(&syncs_after) {
        assert!(
            after - before >= 10.0,
            "syncs continued: {syncs_before:?} -> {syncs_after:?}"
        );
    }
    assert_eq!(
        live_after.len(),
        3,
        "every Envoy still holds a share: {live_after:?}"
    );
    assert!(
        edit_reached.is_some(),
        "the edit through replica 2 never reached the Envoys"
    );
    assert!(used_none <= GLOBAL_RPS + 10.0, "fallback {used_none:.1}/s");
    never_over_the_provider(refused_by_provider);
    Ok(())
}

/// One of an admin's `/metrics` counters, summed over the lines that start
/// with `series` (0 when it cannot be read).
async fn admin_counter(base: &str, series: &str) -> f64 {
    let Ok(response) = reqwest::get(format!("{base}/metrics")).await else {
        return 0.0;
    };
    let text = response.text().await.unwrap_or_default();
    text.lines()
        .filter(|l| l.starts_with(series))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The provider of the backend restarts: past 350 calls a calendar
/// second, the global limit's 290 and 60 more. Restarting PostgreSQL (its
/// disk, its start) starves the Envoys on a loaded machine, and what they
/// admitted at 290 a second reached the provider in clumps: 15 of the
/// provider's 300 refused in one clean run (most in a sliding second
/// 323), 35 beside two busy loops, whatever the shares. A recovery that
/// handed out the lost leases' room again (the busy Envoy given 290
/// beside the others' 50 each: 390) still passes 350. That the shares
/// never add up past the limit when the ledgers are lost is the
/// simulator's (`fleet_shares::a_lost_ledger_never_costs_the_limit_and_shares_come_back`).
const RESTARTS_PROVIDER_RPS: u64 = 350;

/// Redis, then PostgreSQL, restart under load behind one admin. Redis
/// comes back empty (no persistence): every lease in it is gone, while the
/// Envoys still enforce theirs. Shares go out again, edits are saved again
/// and syncs succeed again within 5 s of each server being back, and the
/// provider never sees more than [`RESTARTS_PROVIDER_RPS`] meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_and_postgres_restarts_under_load_cost_seconds_and_never_the_limit(
) -> anyhow::Result<()> {
    let mut redis = RedisServer::start()?;
    let mut postgres = PostgresServer::start()?;
    let database = postgres.database("sluice")?;
    let dir = tempfile::tempdir()?;
    let port = free_port()?;
    let redis_url = redis.url();
    let admin = AdminProcess::start_with_args(
        &dir.path().join("unused.db"),
        port,
        None,
        &dir.path().join("admin.log"),
        &["--redis-url", &redis_url, "--database-url", &database],
    )
    .await?;
    let base = admin.base();
    let op = admin.login().await?;
    op.create(global_policy()).await?;
    let limits = MockLimits {
        max_per_second: RESTARTS_PROVIDER_RPS,
        ..provider()
    };
    let mock = MockApi::start("127.0.0.1:0".parse()?, limits).await?;
    let envoys = start_envoys(&mock, &[port])?;
    let stop = Arc::new(AtomicBool::new(false));
    mock.reset();
    let load = load::paced_through(&envoys, &OFFERED, &stop);
    tokio::time::sleep(Duration::from_secs(4)).await;
    let shared_before = shares(&op).await?;

    // Redis restarts empty.
    let fleet_errors = "sluice_admin_sync_requests_total{result=\"fleet_error\"}";
    let errors_before = admin_counter(&base, fleet_errors).await;
    tokio::task::block_in_place(|| redis.restart())?;
    let shares_back = until(Duration::from_secs(5), || async {
        shares(&op)
            .await
            .is_ok_and(|s| s.len() == OFFERED.len() && s.iter().all(|(_, rate, _)| *rate > 0.0))
    })
    .await;
    let redis_errors = admin_counter(&base, fleet_errors).await - errors_before;
    tokio::time::sleep(Duration::from_secs(3)).await;

    // PostgreSQL restarts (every connection dropped).
    let syncs_before: Vec<f64> = envoys
        .iter()
        .map(|e| e.filter_stat("sync_ok").unwrap_or(0.0))
        .collect();
    tokio::task::block_in_place(|| postgres.stop_for_now());
    // Meanwhile: /healthz says the store is gone; /metrics, which reads
    // nothing from it, still answers at once.
    let asked = Instant::now();
    let metrics_down = reqwest::get(format!("{base}/metrics"))
        .await?
        .status()
        .as_u16();
    let metrics_took = asked.elapsed();
    // /healthz checks the store at most once a second.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let health_down = reqwest::get(format!("{base}/healthz"))
        .await?
        .status()
        .as_u16();
    tokio::task::block_in_place(|| postgres.start_again())?;
    let mut attempt = 0;
    let writes_back = until(Duration::from_secs(5), || {
        attempt += 1;
        let op = &op;
        let name = format!("after-restart-{attempt}");
        async move {
            op.create(json!({"name": name, "match": {"host": "api.other.example"},
                "rate": {"requests": 5, "period": "1s"}}))
                .await
                .is_ok()
        }
    })
    .await;
    let syncs_back = until(Duration::from_secs(5), || {
        let envoys = &envoys;
        let syncs_before = &syncs_before;
        async move {
            envoys
                .iter()
                .zip(syncs_before)
                .all(|(e, before)| e.filter_stat("sync_ok").unwrap_or(0.0) >= before + 2.0)
        }
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let shared_after = shares(&op).await?;
    let calls = finish(&stop, load).await;
    let most = most_in_any_second(&mock);
    // The provider's whole calendar seconds (what it limits: a sliding
    // second may hold the end of one and the start of the next).
    let most_counted =
        fair::most_in_a_second(&fair::per_second(&mock, Duration::ZERO, Duration::MAX));
    let most_in_flight = mock.max_in_flight();
    let refused_by_provider = mock.rejected_by_mock();
    println!(
        "backend restarts: with PostgreSQL down /metrics answered {metrics_down} in {metrics_took:?}, /healthz {health_down}"
    );
    println!(
        "backend restarts: shares before {shared_before:?}; Redis restarted empty: shares to all {} Envoys again after \
         {shares_back:?} ({redis_errors} syncs without shares meanwhile); PostgreSQL restarted: an edit saved after \
         {writes_back:?}, every Envoy syncing again after {syncs_back:?}; shares after {shared_after:?}; {calls} calls, \
         most in any 1 s {most}, in one of the provider's whole calendar seconds {most_counted} (global {GLOBAL_RPS}), \
         in flight at once {most_in_flight} (limit 30), refused by the provider {refused_by_provider} \
         (limit {RESTARTS_PROVIDER_RPS})",
        OFFERED.len()
    );
    assert_eq!((metrics_down, health_down), (200, 503));
    assert!(
        metrics_took < Duration::from_millis(500),
        "{metrics_took:?}"
    );
    assert!(
        shares_back.is_some(),
        "no shares within 5 s of Redis being back"
    );
    assert!(
        writes_back.is_some(),
        "no edit saved within 5 s of PostgreSQL being back"
    );
    assert!(
        syncs_back.is_some(),
        "syncs not back within 5 s of PostgreSQL being back"
    );
    never_over_the_provider(refused_by_provider);
    Ok(())
}

/// Replicas keep policies in PostgreSQL and leases in Redis over TLS, each
/// server's certificate checked against the CA given: shares go out as
/// without TLS. With another CA the admin refuses to start and says which
/// server it could not trust.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_reach_postgres_and_redis_over_tls_with_the_ca_checked() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (cert, key) = sluice_admin::server::self_signed(&dir.path().join("servers"))?;
    let ca = dir.path().join("servers/ca.pem");
    sluice_admin::server::self_signed(&dir.path().join("other"))?;
    let other_ca = dir.path().join("other/ca.pem");
    let redis = RedisServer::start_tls(&cert, &key, &ca)?;
    let postgres = PostgresServer::start_tls(&cert, &key)?;
    let database = format!("{}?sslmode=require", postgres.database("sluice")?);
    let redis_url = redis.url();
    let start =
        |port: u16, log: &str, redis_ca: &std::path::Path, database_ca: &std::path::Path| {
            let args: Vec<String> = vec![
                "--redis-url".into(),
                redis_url.clone(),
                "--redis-ca".into(),
                redis_ca.display().to_string(),
                "--database-url".into(),
                database.clone(),
                "--database-ca".into(),
                database_ca.display().to_string(),
            ];
            let (db, log) = (dir.path().join("unused.db"), dir.path().join(log));
            async move {
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                AdminProcess::start_with_args(&db, port, None, &log, &args).await
            }
        };
    let port = free_port()?;
    let admin = start(port, "admin.log", &ca, &ca).await?;
    let op = admin.login().await?;
    op.create(global_policy()).await?;
    let mock = MockApi::start("127.0.0.1:0".parse()?, provider()).await?;
    let envoy =
        Envoy::start_with_admins(&plugin_config("tls"), mock.addr.port(), &[port], WORKERS)?;
    let shared = until(Duration::from_secs(5), || async {
        shares(&op)
            .await
            .is_ok_and(|s| s.len() == 1 && s[0].1 > 0.0)
    })
    .await;
    let view = shares(&op).await?;

    let untrusted_redis = start(free_port()?, "wrong-redis-ca.log", &other_ca, &ca)
        .await
        .err()
        .map(|e| format!("{e:#}"))
        .unwrap_or_default();
    let untrusted_postgres = start(free_port()?, "wrong-postgres-ca.log", &ca, &other_ca)
        .await
        .err()
        .map(|e| format!("{e:#}"))
        .unwrap_or_default();
    // The error and its cause, without the backtrace RUST_BACKTRACE adds.
    let last_line = |log: &str| {
        log.lines()
            .filter(|l| l.starts_with("Error:") || l.contains("certificate"))
            .map(str::trim)
            .collect::<Vec<_>>()
            .join(" / ")
    };
    println!(
        "backends over TLS: shares after {shared:?}: {view:?}; Redis with another CA: {}; PostgreSQL with another CA: {}",
        last_line(&untrusted_redis),
        last_line(&untrusted_postgres)
    );
    assert!(
        shared.is_some(),
        "no share went out through TLS Redis and PostgreSQL"
    );
    assert!(
        untrusted_redis.contains("connecting to Redis")
            && untrusted_redis.to_lowercase().contains("certificate"),
        "{untrusted_redis}"
    );
    assert!(
        untrusted_postgres.contains("connecting to PostgreSQL")
            && untrusted_postgres.to_lowercase().contains("certificate"),
        "{untrusted_postgres}"
    );
    drop(envoy);
    Ok(())
}

/// A call's cost (tokens from a header) can be more than an Envoy's share
/// of a global limit holds: an idle Envoy's floor of a 300/s policy with a
/// burst of 30 holds 2. Such a call is refused with the reason, however
/// full that share's bucket, while a busier Envoy with more room admits it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_costing_more_than_an_envoys_share_holds_is_refused_with_the_reason(
) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let admin = AdminProcess::start_in(dir.path(), &[]).await?;
    let op = admin.login().await?;
    op.create(
        json!({"name": "llm", "match": {"host": "api.llm.example"}, "scope": "global",
        "share_lease": "2s", "rate": {"requests": 300, "period": "1s", "burst": 30},
        "cost": {"header": "x-tokens", "default": 1, "max": 20}}),
    )
    .await?;
    let mock = MockApi::start("127.0.0.1:0".parse()?, MockLimits::default()).await?;
    let envoys = start_envoys(&mock, &[admin.port])?;
    // Only the first Envoy is busy; the others keep their floors.
    let stop = Arc::new(AtomicBool::new(false));
    let load = load::paced_through(&envoys[..1], &[("a", 250)], &stop);
    // Settled: past the new admin's recovery (every Envoy holds a share),
    // the busy one holding most. The load goes on while the calls are
    // made: shares follow demand within a sync, and without it the idle
    // Envoys would soon hold a third each.
    let settled = until(Duration::from_secs(8), || async {
        shares(&op).await.is_ok_and(|s| {
            s.len() == 3
                && s.iter().all(|(_, rate, _)| *rate > 0.0)
                && s.iter().any(|(n, rate, _)| n == "fleet-a" && *rate > 200.0)
        })
    })
    .await;
    let view = shares(&op).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let http = load::client();
    let call = |envoy: &Envoy, tokens: &'static str| {
        http.get(envoy.url("/v1/complete"))
            .header("host", "api.llm.example")
            .header("x-tokens", tokens)
            .send()
    };
    let idle = &envoys[2];
    let costly = call(idle, "5").await?;
    let costly_status = costly.status().as_u16();
    let reason = costly
        .headers()
        .get("x-sluice-reason")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let body = costly.text().await?;
    let cheap = call(idle, "1").await?.status().as_u16();
    let on_the_busy_one = call(&envoys[0], "5").await?.status().as_u16();
    finish(&stop, load).await;
    println!(
        "cost above a share: shares settled after {settled:?}: {view:?}; on an idle Envoy a call costing 5 -> {costly_status} \
         ({reason}: {}), costing 1 -> {cheap}; on the busy Envoy costing 5 -> {on_the_busy_one}",
        body.trim()
    );
    assert!(
        settled.is_some(),
        "the busy Envoy never got most of the limit"
    );
    assert_eq!(costly_status, 429);
    assert_eq!(reason, "cost-above-share-burst");
    assert!(body.contains("costs 5"), "{body}");
    assert_eq!(cheap, 200);
    assert_eq!(on_the_busy_one, 200);
    Ok(())
}

/// A per-key limit in each Envoy and a fleet-wide limit on the same calls:
/// the policy allows each API key 100/s (per Envoy), and a further limit
/// with `scope: global` allows 120/s for the whole fleet. Two Envoys are
/// offered 150/s each on their own key: each key stays under its 100/s,
/// and both together take the fleet's 120/s, no more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_per_key_limit_and_a_fleet_wide_limit_hold_on_the_same_calls() -> anyhow::Result<()> {
    const FLEET_RPS: f64 = 120.0;
    let dir = tempfile::tempdir()?;
    let admin = AdminProcess::start_in(dir.path(), &[]).await?;
    let op = admin.login().await?;
    op.create(json!({"name": "llm", "match": {"host": "api.llm.example"},
        "key": {"header": "x-api-key"}, "rate": {"requests": 100, "period": "1s", "burst": 5},
        "limits": [{"name": "fleet-wide", "scope": "global",
                    "rate": {"requests": 120, "period": "1s", "burst": 6}}]}))
        .await?;
    let mock = MockApi::start(
        "127.0.0.1:0".parse()?,
        MockLimits {
            max_per_second: 130,
            max_in_flight: 0,
        },
    )
    .await?;
    let envoys: Vec<Envoy> = ["a", "b"]
        .iter()
        .map(|name| {
            Envoy::start_with_admins(
                &plugin_config(name),
                mock.addr.port(),
                &[admin.port],
                WORKERS,
            )
        })
        .collect::<anyhow::Result<_>>()?;
    op.wait_for_shares(&["fleet-a", "fleet-b"]).await?;
    let stop = Arc::new(AtomicBool::new(false));
    mock.reset();
    let load = load::paced_through(&envoys, &[("a", 150), ("b", 150)], &stop);
    tokio::time::sleep(Duration::from_secs(10)).await;
    let (from, to) = (Duration::from_secs(3), Duration::from_secs(10));
    let used = rate_at_mock(&mock, &[], from, to);
    let per: Vec<f64> = ["a", "b"]
        .iter()
        .map(|i| rate_at_mock(&mock, &[i], from, to))
        .collect();
    let outcomes: Vec<Outcome> = {
        stop.store(true, Ordering::SeqCst);
        let mut all = Vec::new();
        for l in load {
            all.extend(l.await.unwrap_or_default());
        }
        all
    };
    let by_fleet_limit = outcomes
        .iter()
        .filter(|o| {
            o.headers
                .get("x-sluice-limit")
                .is_some_and(|v| v == "fleet-wide")
        })
        .count();
    let most = most_in_any_second(&mock);
    let admitted: Vec<f64> = envoys
        .iter()
        .map(|e| e.limit_stat("fleet-wide", "admitted").unwrap_or(-1.0))
        .collect();
    println!(
        "per key + fleet-wide: offered a 150/s, b 150/s (per key 100/s per Envoy, fleet-wide {FLEET_RPS}/s); \
         steady (3..10 s) the provider saw {used:.1}/s: a {:.1}/s, b {:.1}/s; most in any 1 s {most}; \
         {} calls, {by_fleet_limit} refused naming fleet-wide; fleet-wide admitted per Envoy {admitted:?}; \
         provider refused {}",
        per[0],
        per[1],
        outcomes.len(),
        mock.rejected_by_mock(),
    );
    assert!(
        used <= FLEET_RPS * 1.05,
        "over the fleet-wide limit: {used:.1}/s"
    );
    // Measured from when both Envoys hold their shares: 120.0/s of 120 in
    // both builds (from a fixed wait after their start, part of the new
    // admin's first lease, which leases nothing, was measured too: 84 %).
    assert!(
        used >= FLEET_RPS * 0.95,
        "the fleet-wide limit mostly used: {used:.1}/s"
    );
    assert!(
        per.iter().all(|r| *r <= 100.0 * 1.05),
        "a key over its 100/s: {per:?}"
    );
    assert!(by_fleet_limit > 0, "the fleet-wide limit refused, by name");
    assert_eq!(mock.rejected_by_mock(), 0);
    Ok(())
}

/// Provider news kept in Redis, as admin replicas keep it: a pause and a
/// rate cut an Envoy told one replica reach an Envoy syncing with another;
/// the longer pause wins, a cut echoed back by the Envoy that followed it
/// is the same cut, and nothing goes back to the Envoy that saw it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_replicas_relay_provider_news_through_redis() -> anyhow::Result<()> {
    use anyhow::Context;
    use sluice_admin::kv::RedisConnection;
    use sluice_admin::relay::ProviderRelay;
    use sluice_wire::sync::{LimitReport, PauseReport, ProviderReport, SyncReport};

    let redis = RedisServer::start()?;
    let url = redis.url();
    let mut replicas = Vec::new();
    for _ in 0..2 {
        let connection = RedisConnection::open(&url, None)
            .await
            .context("connecting to the test's Redis")?;
        replicas.push(ProviderRelay::redis(&connection));
    }
    let (one, two) = (&replicas[0], &replicas[1]);
    let report = |instance: &str, provider: ProviderReport| {
        let mut r = SyncReport {
            instance: instance.into(),
            ..SyncReport::default()
        };
        r.limits.insert(
            "provider-rate".into(),
            LimitReport {
                provider: Some(provider),
                ..LimitReport::default()
            },
        );
        r
    };
    let pause = |left_ms: u64| ProviderReport {
        pause: Some(PauseReport {
            ran_ms: 0,
            left_ms,
            status: 429,
            relayed: false,
        }),
        ..ProviderReport::default()
    };
    let cut = |ago: u64| ProviderReport {
        cut_ago_ms: Some(ago),
        ..ProviderReport::default()
    };
    let quiet = ProviderReport::default();
    let t = 1_800_000_000_000u64;
    let set: sluice_shared::PolicySet = serde_json::from_value(json!({"version": 1, "policies": [
        {"name": "p", "match": {"host": "a"}, "rate": {"requests": 100, "period": "1s"},
         "limits": [{"name": "provider-rate", "scope": "global",
                     "rate": {"requests": 100, "period": "1s"}, "provider": {"max_pause": "5s"}}]}]}))?;
    let set = &set;

    one.hear(&report("envoy-a", pause(3_000)), set, t).await?;
    two.hear(&report("envoy-c", pause(1_000)), set, t + 50)
        .await?;
    let to_b = two
        .news_for(&report("envoy-b", quiet), set, t + 100)
        .await?;
    let to_a = one
        .news_for(&report("envoy-a", quiet), set, t + 100)
        .await?;
    one.hear(&report("envoy-a", cut(100)), set, t + 200).await?;
    let cut_to_b = two
        .news_for(&report("envoy-b", quiet), set, t + 600)
        .await?;
    // b followed the cut and reports it back (a few ms off): still a's.
    two.hear(&report("envoy-b", cut(496)), set, t + 600).await?;
    let cut_to_a = one
        .news_for(&report("envoy-a", quiet), set, t + 700)
        .await?;
    let later = two
        .news_for(&report("envoy-b", quiet), set, t + 10_000)
        .await?;
    // A rogue re-reporting a day's pause every 200 ms through both
    // replicas: relayed for max_pause (5 s) from its first report only.
    let rogue_from = t + 100_000;
    let mut relayed_until = 0;
    for i in 0..100u64 {
        let now = rogue_from + 200 * i;
        let replica = if i % 2 == 0 { one } else { two };
        replica
            .hear(&report("rogue", pause(86_400_000)), set, now)
            .await?;
        let told = replica
            .news_for(&report("envoy-b", quiet), set, now)
            .await?;
        if let Some(ms) = told.get("provider-rate").and_then(|n| n.pause_ms) {
            relayed_until = relayed_until.max(now + ms);
        }
    }
    assert_eq!(relayed_until, rogue_from + 5_000, "max_pause in total");
    println!(
        "relay through redis: to b via the other replica {to_b:?}; to a itself {to_a:?}; \
         the cut to b {cut_to_b:?}, back to a {cut_to_a:?}; 10 s later {later:?}"
    );
    let b = &to_b["provider-rate"];
    assert_eq!(
        (b.pause_ms, b.status),
        (Some(2_900), 429),
        "the longer pause"
    );
    assert!(to_a.is_empty(), "nothing back to its source: {to_a:?}");
    assert_eq!(cut_to_b["provider-rate"].cut_ago_ms, Some(500));
    assert!(
        cut_to_a
            .get("provider-rate")
            .is_none_or(|n| n.cut_ago_ms.is_none()),
        "{cut_to_a:?}"
    );
    assert!(later.is_empty(), "{later:?}");
    Ok(())
}

/// Third security review, item 5: a holder of the sync token, syncing as
/// an instance of its own every 200 ms, names a fresh share of the whole
/// global limit each time (an id the admin never issued, a made-up tag).
/// The admin takes none of them as a share it holds: the three Envoys,
/// offered 400/50/50 calls a second, still bring the provider at least
/// 90 % of the limit over the 5 s the rogue keeps at it (before, each
/// made-up share was a claim on the whole limit and kept the ledger
/// recovering, so nobody's share grew).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rogue_holding_the_sync_token_cannot_claim_shares_it_was_never_given(
) -> anyhow::Result<()> {
    use sluice_e2e::admin::SYNC_TOKEN;
    let fleet = Fleet::start().await?;
    fleet
        .op
        .wait_for_shares(&["fleet-a", "fleet-b", "fleet-c"])
        .await?;
    // The mock's clock starts again with the load.
    fleet.mock.reset();
    let stop = Arc::new(AtomicBool::new(false));
    let load: Vec<_> = OFFERED
        .iter()
        .zip(&fleet.envoys)
        .map(|((name, rate), envoy)| {
            load::paced(
                envoy.url("/v1/complete"),
                "api.llm.example",
                name,
                *rate,
                stop.clone(),
            )
        })
        .collect();
    let rogue_stop = Arc::new(AtomicBool::new(false));
    let (base, halt) = (fleet.admin.base(), rogue_stop.clone());
    let rogue = tokio::spawn(async move {
        let http = reqwest::Client::new();
        let mut sent = 0u64;
        let started = Instant::now();
        while !halt.load(Ordering::SeqCst) {
            let at = started.elapsed().as_millis() as u64;
            let report = json!({"instance": "rogue", "policy_version": 1, "at_ms": 1_000 + at,
                "shares": {"llm": 4_000_000_000_000u64 + at},
                "held": {"llm": {"rate": 290.0, "in_flight": 30, "instances": 1, "tag": 0x5eed_0000 + at}}});
            let _ = http
                .post(format!("{base}/api/v1/sync"))
                .bearer_auth(SYNC_TOKEN)
                .json(&report)
                .send()
                .await;
            sent += 1;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        sent
    });
    tokio::time::sleep(Duration::from_secs(6)).await;
    let used = rate_at_mock(
        &fleet.mock,
        &[],
        Duration::from_secs(1),
        Duration::from_secs(6),
    );
    let view = shares(&fleet.op).await?;
    rogue_stop.store(true, Ordering::SeqCst);
    let sent = rogue.await?;
    let calls = finish(&stop, load).await;
    println!(
        "fleet, a rogue with the sync token: {sent} made-up shares of the whole limit in 6 s; the provider saw {used:.1}/s \
         ({:.1} % of {GLOBAL_RPS}/s) over 1..6 s of {calls} calls; the admin's shares then {view:?}; refused by the provider {}",
        100.0 * used / GLOBAL_RPS,
        fleet.mock.rejected_by_mock()
    );
    anyhow::ensure!(used >= 0.9 * GLOBAL_RPS, "the fleet used {used:.1}/s");
    anyhow::ensure!(fleet.mock.rejected_by_mock() == 0);
    Ok(())
}
