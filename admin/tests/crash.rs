//! The admin binary killed with SIGKILL in the middle of a burst of policy
//! writes: after a restart on the same SQLite file every write that was
//! answered 2xx is there, and the store passes its integrity check.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sluice_admin::store::Store;

const PASSWORD: &str = "crash-password";

fn start(db: &std::path::Path, port: u16) -> Child {
    Command::new(env!("CARGO_BIN_EXE_sluice-admin"))
        .args(["--listen", &format!("127.0.0.1:{port}"), "--db"])
        .arg(db)
        .env("SLUICE_ADMIN_PASSWORD", PASSWORD)
        .env(
            "SLUICE_SYNC_TOKEN",
            "crash-token-0123456789abcdef-0123456789",
        )
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("the admin binary starts")
}

async fn wait_up(http: &reqwest::Client, base: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if http.get(format!("{base}/healthz")).send().await.is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the admin did not come up");
}

async fn login(http: &reqwest::Client, base: &str) -> (String, String) {
    let resp = http
        .post(format!("{base}/api/v1/login"))
        .header("content-type", "application/json")
        .body(format!(r#"{{"password": "{PASSWORD}"}}"#))
        .send()
        .await
        .expect("login answers");
    let cookie = resp
        .headers()
        .get("set-cookie")
        .and_then(|v| v.to_str().ok())
        .and_then(|c| c.split(';').next())
        .expect("a session cookie")
        .to_string();
    let body: serde_json::Value =
        serde_json::from_str(&resp.text().await.expect("a body")).expect("JSON");
    let csrf = body["csrf_token"]
        .as_str()
        .expect("a CSRF token")
        .to_string();
    (cookie, csrf)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_during_writes_loses_no_acknowledged_write() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let db = dir.path().join("crash.db");
    let port = sluice_test_ports::free_port().expect("a free port");
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    let mut admin = start(&db, port);
    wait_up(&http, &base).await;
    let (cookie, csrf) = login(&http, &base).await;

    // Eight writers creating policies as fast as the admin answers.
    let mut writers = Vec::new();
    for w in 0..8 {
        let http = http.clone();
        let (base, cookie, csrf) = (base.clone(), cookie.clone(), csrf.clone());
        writers.push(tokio::spawn(async move {
            let mut acknowledged = Vec::new();
            for i in 0.. {
                let name = format!("w{w}-p{i}");
                let body = format!(
                    r#"{{"name": "{name}", "match": {{"host": "{name}.example"}}, "rate": {{"requests": 10, "period": "1s"}}}}"#
                );
                let sent = http
                    .post(format!("{base}/api/v1/policies"))
                    .header("cookie", &cookie)
                    .header("x-csrf-token", &csrf)
                    .header("content-type", "application/json")
                    .body(body)
                    .send()
                    .await;
                match sent {
                    Ok(r) if r.status().is_success() => acknowledged.push(name),
                    Ok(_) => {}
                    Err(_) => break, // the admin is gone
                }
            }
            acknowledged
        }));
    }
    tokio::time::sleep(Duration::from_millis(700)).await;
    admin.kill().expect("SIGKILL");
    let _ = admin.wait();
    let mut acknowledged = Vec::new();
    for w in writers {
        acknowledged.extend(w.await.expect("a writer"));
    }

    // Restart on the same file: every acknowledged write is there.
    let mut admin = start(&db, port);
    wait_up(&http, &base).await;
    let store = Store::open(&db).expect("the store opens");
    let (_, stored) = store.blocking().list().expect("the policies list");
    let names: std::collections::HashSet<&str> =
        stored.iter().map(|p| p.policy.name.as_str()).collect();
    let lost: Vec<&String> = acknowledged
        .iter()
        .filter(|n| !names.contains(n.as_str()))
        .collect();
    let integrity = store
        .blocking()
        .integrity_check()
        .expect("integrity check runs")
        .unwrap_or_default();
    println!(
        "admin SIGKILL mid-writes: {} writes acknowledged before the kill, {} policies stored after restart, \
         {} acknowledged writes lost, integrity {integrity}",
        acknowledged.len(),
        stored.len(),
        lost.len()
    );
    let _ = admin.kill();
    let _ = admin.wait();
    assert!(acknowledged.len() >= 10, "the burst was under way");
    assert!(lost.is_empty(), "lost: {lost:?}");
    assert_eq!(integrity, "ok");
}
