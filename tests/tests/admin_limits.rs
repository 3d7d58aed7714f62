//! The admin under hostile load, as its own process: a storm of wrong
//! logins while Envoys sync, and pod churn (thousands of instance ids).
//! Memory stays bounded, syncs keep being answered.

use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use futures_util::StreamExt;
use serde_json::json;
use sluice_demo::mock::{MockApi, MockLimits};
use sluice_e2e::admin::{AdminProcess, SYNC_TOKEN};
use sluice_e2e::envoy::Envoy;
use sluice_e2e::procinfo::rss_mib;

/// A counter from the admin's `/metrics`.
async fn admin_metric(admin: &AdminProcess, name: &str) -> anyhow::Result<f64> {
    let text = reqwest::get(format!("{}/metrics", admin.base()))
        .await?
        .text()
        .await?;
    Ok(text
        .lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
        .unwrap_or(0.0))
}

/// 500 wrong logins at once from 250 client addresses while four Envoys
/// sync every 500 ms (each must be answered within it): the guesses are
/// taken from the throttles before any password is checked, and checks
/// run one at a time, so the admin checks a handful of passwords, its
/// memory stays small and no sync fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_login_storm_checks_a_handful_of_passwords_and_starves_no_sync() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let admin = AdminProcess::start_in(dir.path(), &[]).await?;
    let port = admin.port;
    admin
        .login()
        .await?
        .create(
            json!({"name": "bank", "match": {"host": "api.bank.example"},
            "rate": {"requests": 100, "period": "1s"}}),
        )
        .await?;
    let mock = MockApi::start("127.0.0.1:0".parse()?, MockLimits::default()).await?;
    let mut envoys = Vec::new();
    for i in 0..4 {
        let config = json!({"instance": format!("storm-{i}"), "admin_cluster": "sluice_admin",
            // A sync times out after its interval: 500 ms is the answer
            // the admin must give under the storm (at 200 ms one sync in
            // 135 timed out once on a loaded 2-core CI machine).
            "sync_interval": "500ms", "sync_token": SYNC_TOKEN,
            "fallback": {"version": 0, "policies": []}})
        .to_string();
        envoys.push(Envoy::start_with_admin(&config, mock.addr.port(), port, 1)?);
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let stat = |e: &Envoy, s: &str| e.filter_stat(s).unwrap_or(0.0);
    let ok_before: Vec<f64> = envoys.iter().map(|e| stat(e, "sync_ok")).collect();
    let failed_before: Vec<f64> = envoys.iter().map(|e| stat(e, "sync_failures")).collect();
    let checks_before = admin_metric(&admin, "sluice_admin_password_checks_total").await?;
    let rss_before = rss_mib(admin.pid())?;

    let url = format!("{}/api/v1/login", admin.base());
    let clients: Vec<reqwest::Client> = (0..250u8)
        .map(|i| {
            reqwest::Client::builder()
                .local_address(IpAddr::V4(Ipv4Addr::new(127, 0, 1, i.saturating_add(1))))
                .timeout(Duration::from_secs(30))
                .build()
        })
        .collect::<Result<_, _>>()?;
    let pid = admin.pid();
    let sampler = tokio::spawn(async move {
        let mut most = 0.0f64;
        let until = Instant::now() + Duration::from_secs(8);
        while Instant::now() < until {
            most = most.max(rss_mib(pid).unwrap_or(0.0));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        most
    });
    let started = Instant::now();
    let logins = (0..500).map(|i| {
        let client = clients[i % clients.len()].clone();
        let url = url.clone();
        async move {
            client
                .post(url)
                .header("content-type", "application/json")
                .body(json!({"password": format!("guess-{i}")}).to_string())
                .send()
                .await
                .map(|r| r.status().as_u16())
                .unwrap_or(0)
        }
    });
    let statuses = join_all(logins).await;
    let storm = started.elapsed();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rss_most = sampler.await?;
    let checks = admin_metric(&admin, "sluice_admin_password_checks_total").await? - checks_before;
    let count = |code: u16| statuses.iter().filter(|s| **s == code).count();
    let ok_after: Vec<f64> = envoys.iter().map(|e| stat(e, "sync_ok")).collect();
    let failed_after: Vec<f64> = envoys.iter().map(|e| stat(e, "sync_failures")).collect();
    let syncs: Vec<f64> = ok_after
        .iter()
        .zip(&ok_before)
        .map(|(a, b)| a - b)
        .collect();
    let failures: f64 = failed_after
        .iter()
        .zip(&failed_before)
        .map(|(a, b)| a - b)
        .sum();
    // The account's throttle: a burst of 20, then one every 2 s.
    let allowed = 20.0 + (storm.as_secs_f64() / 2.0).ceil() + 1.0;
    println!(
        "login storm: 500 wrong logins from 250 addresses in {storm:?}: {} x 401, {} x 429, {} x 503, {} unanswered; \
         passwords checked {checks} (allowed {allowed}); admin RSS {rss_before:.1} MiB before, at most {rss_most:.1} MiB during; \
         the 4 Envoys' good syncs meanwhile {syncs:?}, failed syncs {failures}",
        count(401),
        count(429),
        count(503),
        count(0)
    );
    assert_eq!(count(0), 0, "every login answered");
    assert!(checks <= allowed, "{checks} passwords checked");
    assert!(rss_most < 200.0, "admin RSS {rss_most} MiB");
    assert_eq!(failures, 0.0, "a sync failed during the storm");
    assert!(syncs.iter().all(|s| *s >= 5.0), "syncs went on: {syncs:?}");
    Ok(())
}

/// Pod churn: 10 000 instance ids sync over time, in rounds of 2 000 that
/// then fall silent. With an instance TTL of 3 s the admin forgets them
/// (live view and store), and its memory stays flat from round to round
/// once the first round has warmed its allocator up.
///
/// glibc gives each thread that allocates under contention an arena of its
/// own, up to 8 per core, and the store's blocking threads come and go with
/// the load: on a busy CI machine new arenas kept appearing until round 4
/// (84 -> 86 -> 90 -> 97 -> 97 MiB) while an idle one was flat from round
/// 1. Two arenas keep most of that warm-up out of what is measured (a
/// busy CI still saw one step of 7.7 MiB, then flat), a leak in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_instance_ids_keep_the_admins_memory_flat() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let admin = AdminProcess::start_in_env(
        dir.path(),
        &["--instance-ttl", "3s"],
        &[("MALLOC_ARENA_MAX", "2")],
    )
    .await?;
    let op = admin.login().await?;
    for name in ["bank", "llm", "fx", "maps"] {
        op.create(
            json!({"name": name, "match": {"host": format!("api.{name}.example")},
            "rate": {"requests": 100, "period": "1s"}}),
        )
        .await?;
    }
    let http = reqwest::Client::new();
    let url = format!("{}/api/v1/sync", admin.base());
    let auth = format!("Bearer {SYNC_TOKEN}");
    let policies = json!({"bank": {"admitted": 10, "rejected": 1, "queued": 0, "queue_timeouts": 0,
        "shadow_limited": 0, "in_flight": 1, "max_in_flight": 0},
        "llm": {"admitted": 10, "rejected": 1, "queued": 0, "queue_timeouts": 0,
        "shadow_limited": 0, "in_flight": 1, "max_in_flight": 0}});
    let mut rss = Vec::new();
    for round in 0..5u64 {
        for at_ms in [1_000u64, 1_200, 2_400] {
            let syncs = (0..2000u64).map(|i| {
                let report = json!({"instance": format!("pod-{round}-{i}"), "policy_version": 4,
                    "at_ms": at_ms, "policies": policies});
                let request = http
                    .post(&url)
                    .header("authorization", &auth)
                    .header("content-type", "application/json")
                    .body(report.to_string());
                async move {
                    request
                        .send()
                        .await
                        .map(|r| r.status().as_u16())
                        .unwrap_or(0)
                }
            });
            let statuses: Vec<u16> = futures_util::stream::iter(syncs)
                .buffer_unordered(32)
                .collect()
                .await;
            anyhow::ensure!(
                statuses.iter().all(|s| *s == 200 || *s == 304),
                "round {round}: a sync failed"
            );
        }
        // Silent past the TTL, then pruned (the store every TTL / 2).
        tokio::time::sleep(Duration::from_secs(5)).await;
        rss.push(rss_mib(admin.pid())?);
    }
    let listed = op.get("/api/v1/instances?limit=1000").await?;
    let listed = listed["instances"].as_array().map_or(0, Vec::len);
    println!(
        "churn: 10 000 instance ids in 5 rounds of 2 000 (3 syncs each, TTL 3 s): admin RSS after each round {rss:.1?} MiB; \
         instances listed at the end {listed}"
    );
    assert_eq!(listed, 0, "silent instances are forgotten");
    // The first rounds only warm the allocator up, and how many they take
    // depends on the machine's load: clean runs saw 83 -> 96 MiB from round
    // 1 to 2 and then flat, and a busy CI 87.9, 87.9, 89.1, 96.8, 96.8 (one
    // step of 7.7 MiB in round 4, then flat again). A leak grows with every
    // round of 2 000 new ids, so it shows as no round after the first being
    // flat; a warm-up step shows as one round's jump between flat ones.
    let steps: Vec<f64> = rss.windows(2).skip(1).map(|w| w[1] - w[0]).collect();
    let flattest = steps.iter().copied().fold(f64::INFINITY, f64::min);
    assert!(
        flattest < 1.5,
        "the admin grew in every round after the first ({steps:.1?} MiB): a leak"
    );
    let grown = rss[4] - rss[1];
    assert!(
        grown < 16.0,
        "the admin grew {grown:.1} MiB over 6 000 more ids after a warm-up round"
    );
    Ok(())
}
