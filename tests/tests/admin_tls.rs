//! The admin's transport: Envoys sync over TLS with the admin's
//! certificate pinned (a wrong certificate fails the sync, visibly), and
//! clients that trickle their headers cannot hold the admin's connections.

use std::io::Read;
use std::time::{Duration, Instant};

use serde_json::json;
use sluice_demo::mock::{MockApi, MockLimits};
use sluice_e2e::admin::{AdminProcess, SYNC_TOKEN};
use sluice_e2e::envoy::{filter_vms, test_admin_tls_dir, Envoy};
use sluice_e2e::load::{self, count, wait_for};

fn plugin(instance: &str) -> String {
    json!({"instance": instance, "admin_cluster": "sluice_admin", "sync_interval": "200ms",
        "sync_token": SYNC_TOKEN, "fallback": {"version": 0, "policies": []}})
    .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoys_sync_over_tls_and_a_wrong_certificate_fails_visibly() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (admin, tls_port, tls_dir) = AdminProcess::start_tls_in(dir.path()).await?;
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

/// What an attacker who cannot sync does with the admin's connections.
#[derive(Debug, Clone, Copy)]
enum Hold {
    /// Half a request's headers, then nothing.
    HalfHeaders,
    /// Connects and sends nothing at all.
    Nothing,
    /// The start of the HTTP/2 preface, then nothing.
    HalfPreface,
    /// A whole HTTP/2 connection: one request answered, then idle.
    IdleHttp2,
    /// A watch without the token, its body a byte every 0.5 s.
    TrickledWatch,
}

/// One attacker's connection and how to tell when the admin closed it.
enum Held {
    Raw(std::net::TcpStream),
    /// The connection's task, and the client's handle that keeps it open.
    Http2(
        tokio::task::JoinHandle<()>,
        h2::client::SendRequest<bytes::Bytes>,
    ),
}

async fn hold(kind: Hold, port: u16) -> anyhow::Result<Held> {
    use std::io::Write;
    if let Hold::IdleHttp2 = kind {
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        let (client, connection) = h2::client::handshake(tcp).await?;
        // The task ends when the admin closes the connection.
        let task = tokio::spawn(async move {
            let _ = connection.await;
        });
        let mut client = client.ready().await?;
        let request = http::Request::get(format!("http://127.0.0.1:{port}/healthz")).body(())?;
        let (answer, _) = client.send_request(request, true)?;
        anyhow::ensure!(answer.await?.status().is_success(), "h2 /healthz");
        // The connection stays open, idle, while `client` is held.
        return Ok(Held::Http2(task, client));
    }
    let stream = std::net::TcpStream::connect(("127.0.0.1", port))?;
    let mut writer = stream.try_clone()?;
    match kind {
        Hold::HalfHeaders => {
            writer.write_all(b"GET /healthz HTTP/1.1\r\nhost: localhost\r\nx-slow: ")?
        }
        Hold::Nothing | Hold::IdleHttp2 => {}
        Hold::HalfPreface => writer.write_all(b"PRI * HTTP/2.0\r\n")?,
        Hold::TrickledWatch => {
            writer.write_all(
                b"POST /api/v1/sync/watch HTTP/1.1\r\nhost: localhost\r\n\
                  content-type: application/json\r\ncontent-length: 64\r\n\r\n{",
            )?;
            std::thread::spawn(move || {
                for _ in 0..63 {
                    std::thread::sleep(Duration::from_millis(500));
                    if writer.write_all(b" ").is_err() {
                        return;
                    }
                }
            });
        }
    }
    Ok(Held::Raw(stream))
}

/// Watches `held` (at most `limit`): when the admin closed it, if it did.
fn closed_at(held: Held, limit: Duration) -> tokio::task::JoinHandle<Option<Instant>> {
    match held {
        Held::Http2(task, client) => tokio::spawn(async move {
            let closed = tokio::time::timeout(limit, task).await;
            drop(client);
            closed.ok()?.ok()?;
            Some(Instant::now())
        }),
        Held::Raw(mut stream) => tokio::task::spawn_blocking(move || {
            let deadline = Instant::now() + limit;
            let mut buf = [0u8; 512];
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() || stream.set_read_timeout(Some(left)).is_err() {
                    return None;
                }
                match stream.read(&mut buf) {
                    // EOF: closed. An answer first (the watch's 401): read on.
                    Ok(0) => return Some(Instant::now()),
                    Ok(_) => continue,
                    Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                        return Some(Instant::now())
                    }
                    Err(_) => return None,
                }
            }
        }),
    }
}

/// Clients that hold connections without a token, each kind up to the
/// connection cap: idle, half a request, half an HTTP/2 preface, an idle
/// HTTP/2 connection, a tokenless watch whose body trickles. The admin
/// closes every one within its header timeout (1 s here), answers
/// `/healthz` meanwhile, and an Envoy started while they hold every
/// slot syncs within 10 s, while the clients would still hold them (30 s:
/// the trickled watch alone writes for 31 s). A bound of 2 s after the
/// Envoy was up failed beside two busy loops at 3.96 s: it measured when
/// a starved Envoy got to its first sync, not whether the admin let it in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_cannot_hold_the_admins_connections() -> anyhow::Result<()> {
    const CAP: usize = 100;
    let dir = tempfile::tempdir()?;
    let admin = AdminProcess::start_in(
        dir.path(),
        &["--max-connections", "100", "--header-read-timeout", "1s"],
    )
    .await?;
    let mock = MockApi::start("127.0.0.1:0".parse()?, MockLimits::default()).await?;
    let mut failures = Vec::new();
    for kind in [
        Hold::Nothing,
        Hold::HalfHeaders,
        Hold::HalfPreface,
        Hold::IdleHttp2,
        Hold::TrickledWatch,
    ] {
        let started = Instant::now();
        let mut watching = Vec::new();
        for _ in 0..CAP {
            let opened = Instant::now();
            let held = hold(kind, admin.port).await?;
            watching.push((opened, closed_at(held, Duration::from_secs(30))));
        }
        let opened_in = started.elapsed();
        // A connection of its own, not one kept from the round before.
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .pool_max_idle_per_host(0)
            .build()?;
        let health = http.get(format!("{}/healthz", admin.base())).send().await?;
        let health_in = started.elapsed();
        // A new Envoy needs a connection of its own: it syncs once the
        // held ones are gone.
        let instance = format!("held-{kind:?}").to_lowercase();
        let envoy = Envoy::start_with_admin(&plugin(&instance), mock.addr.port(), admin.port, 1)?;
        let envoy_ready = Instant::now();
        let synced = wait_for("a sync", Duration::from_secs(10), || {
            envoy.filter_stat("sync_ok").unwrap_or(0.0) >= 1.0
        })
        .await;
        let sync_in = envoy_ready.elapsed();
        let mut closed = 0;
        let mut longest = Duration::ZERO;
        for (opened, watch) in watching {
            if let Some(at) = watch.await? {
                closed += 1;
                longest = longest.max(at.duration_since(opened));
            }
        }
        println!(
            "slow clients, {kind:?}: {CAP} connections (cap {CAP}, header timeout 1 s) opened in {opened_in:.2?}; \
             /healthz answered {} {health_in:.2?} after the first; a new Envoy synced {sync_in:.2?} after it was up; \
             {closed} of {CAP} closed by the admin, each at most {longest:.2?} after it opened",
            health.status()
        );
        if !health.status().is_success() || health_in > Duration::from_secs(2) {
            failures.push(format!(
                "{kind:?}: /healthz {} after {health_in:?}",
                health.status()
            ));
        }
        if synced.is_err() {
            failures.push(format!(
                "{kind:?}: the Envoy had not synced {sync_in:?} after it was up"
            ));
        }
        // Closed within the header timeout, plus scheduling slack.
        if closed != CAP || longest > Duration::from_millis(1_500) {
            failures.push(format!(
                "{kind:?}: {closed} of {CAP} closed, the longest open {longest:?}"
            ));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
    Ok(())
}
