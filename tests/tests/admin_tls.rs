//! The admin's transport: Envoys sync over TLS with the admin's
//! certificate pinned (a wrong certificate fails the sync, visibly), and
//! clients that trickle their headers cannot hold the admin's connections.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use serde_json::json;
use sluice_demo::mock::{MockApi, MockLimits};
use sluice_e2e::admin::{AdminProcess, SYNC_TOKEN};
use sluice_e2e::envoy::{filter_vms, free_port, test_admin_tls_dir, Envoy};
use sluice_e2e::load::{self, count, wait_for};

fn plugin(instance: &str) -> String {
    json!({"instance": instance, "admin_cluster": "sluice_admin", "sync_interval": "200ms",
        "sync_token": SYNC_TOKEN, "fallback": {"version": 0, "policies": []}})
    .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoys_sync_over_tls_and_a_wrong_certificate_fails_visibly() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let tls_dir = dir.path().join("tls");
    let tls_port = free_port()?;
    let admin = AdminProcess::start_in(
        dir.path(),
        &[
            "--tls-listen",
            &format!("127.0.0.1:{tls_port}"),
            "--tls-self-signed",
            &tls_dir.display().to_string(),
        ],
    )
    .await?;
    admin
        .login()
        .await?
        .create(
            json!({"name": "bank", "match": {"host": "api.bank.example"},
            "rate": {"requests": 5, "period": "1s", "burst": 5}}),
        )
        .await?;
    let mock = MockApi::start("127.0.0.1:0".parse()?, MockLimits::default()).await?;

    // The admin's own certificate pinned: the set arrives.
    let pinned = Envoy::start_with_admin_tls(
        &plugin("tls-ok"),
        mock.addr.port(),
        tls_port,
        2,
        &tls_dir.join("ca.pem"),
    )?;
    let took = wait_for("the set over TLS", Duration::from_secs(5), || {
        pinned.filter_stat("policy_sets_installed").unwrap_or(0.0) >= filter_vms(2)
    })
    .await?;
    let burst = load::burst(&pinned.url("/"), "api.bank.example", 20).await;

    // Another certificate pinned (what a man in the middle would show).
    let other_ca = test_admin_tls_dir()?.join("ca.pem");
    let wrong = Envoy::start_with_admin_tls(
        &plugin("tls-wrong-ca"),
        mock.addr.port(),
        tls_port,
        2,
        &other_ca,
    )?;
    let started = Instant::now();
    wait_for("failed syncs", Duration::from_secs(5), || {
        wrong.filter_stat("sync_failures").unwrap_or(0.0) >= 3.0
    })
    .await?;
    let installed = wrong.filter_stat("policy_sets_installed").unwrap_or(0.0);
    let log = wrong.log();
    let reason = log
        .lines()
        .find_map(|l| {
            l.find("sync with the admin failed")
                .map(|at| l[at..].to_string())
        })
        .unwrap_or_default();
    println!(
        "tls: pinned certificate: the set reached every worker after {took:?}, bank 5/s: {} of 20 passed; \
         wrong certificate: {} failed syncs in {:?}, {installed} sets installed, Envoy logged: {reason}",
        count(&burst, 200),
        wrong.filter_stat("sync_failures").unwrap_or(0.0),
        started.elapsed()
    );
    assert!((5..=6).contains(&count(&burst, 200)));
    assert_eq!(
        installed, 0.0,
        "nothing taken from an admin it cannot verify"
    );
    assert!(!reason.is_empty(), "the failure is logged");
    Ok(())
}

/// 200 connections that send half a request and stop: the admin closes
/// them after its header read timeout, and answers everyone else
/// meanwhile, however many such connections there are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_cannot_hold_the_admins_connections() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let admin = AdminProcess::start_in(
        dir.path(),
        &["--max-connections", "100", "--header-read-timeout", "1s"],
    )
    .await?;
    let port = admin.port;
    let mut slow = Vec::new();
    for _ in 0..200 {
        let stream = std::net::TcpStream::connect(("127.0.0.1", port))?;
        slow.push(stream);
    }
    for s in &mut slow {
        let _ = s.write_all(b"GET /healthz HTTP/1.1\r\nhost: localhost\r\nx-slow: ");
    }
    let started = Instant::now();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()?;
    let health = http.get(format!("{}/healthz", admin.base())).send().await?;
    let answered_in = started.elapsed();
    // Every slow connection is closed by the admin (a read gives EOF).
    let mut closed = 0;
    for s in &mut slow {
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut buf = [0u8; 512];
        match s.read(&mut buf) {
            Ok(_) => closed += 1,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => closed += 1,
            Err(_) => {}
        }
    }
    let all_closed_in = started.elapsed();
    println!(
        "slow clients: 200 connections with half their headers (cap 100, header timeout 1 s): \
         /healthz answered {} in {answered_in:?}; {closed} of 200 closed by the admin within {all_closed_in:?}",
        health.status()
    );
    assert!(health.status().is_success());
    assert!(answered_in < Duration::from_secs(5), "{answered_in:?}");
    assert_eq!(closed, 200, "every slow connection was closed");
    Ok(())
}
