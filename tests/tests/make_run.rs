//! `make run` as a newcomer runs it: it builds what it needs, brings the
//! demo up on the README's ports, answers through the egress listener and
//! in the browser, refuses a second start clearly, and stops everything on
//! Ctrl-C (SIGINT to its process group, as a terminal sends it).

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use sluice_e2e::browser::Browser;
use sluice_e2e::envoy::workspace_root;

const PORTS: [u16; 8] = [8080, 8443, 9901, 10000, 9090, 9091, 9092, 9093];

/// `make`, as a user's shell starts it: without what `cargo test` sets for
/// its test binaries (the package's `CARGO_PKG_*` and `CARGO_MANIFEST_*`,
/// `CARGO_BIN_EXE_*`, the library path, ...). Build scripts ask to be
/// rerun when some of those change (ring's: `CARGO_PKG_NAME`,
/// `CARGO_MANIFEST_DIR`), so with them `make run` rebuilt ring and the
/// admin (30 s of a clean run) before the demo came up.
fn user_shell_make() -> Command {
    const SET_BY_CARGO_TEST: &[&str] = &[
        "CARGO_PKG_",
        "CARGO_MANIFEST_",
        "CARGO_BIN_",
        "CARGO_CRATE_",
        "CARGO_TARGET_TMPDIR",
        "CARGO_PRIMARY_PACKAGE",
        "OUT_DIR",
        "LD_LIBRARY_PATH",
    ];
    let mut make = Command::new("make");
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if name == "CARGO" || SET_BY_CARGO_TEST.iter().any(|p| name.starts_with(p)) {
            make.env_remove(name.as_ref());
        }
    }
    make
}

fn make_run(var: &std::path::Path) -> anyhow::Result<(Child, mpsc::Receiver<String>)> {
    let mut child = user_shell_make()
        .arg("run")
        .arg(format!("DEMO_VAR={}", var.display()))
        .current_dir(workspace_root())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own process group, like a job in a terminal.
        .process_group(0)
        .spawn()
        .context("starting make run")?;
    let (tx, rx) = mpsc::channel();
    for stream in [
        child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
        child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
    ]
    .into_iter()
    .flatten()
    {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
    }
    Ok((child, rx))
}

/// Lines until one satisfies `pred` (returned with all seen before it).
fn wait_line(
    rx: &mpsc::Receiver<String>,
    limit: Duration,
    pred: impl Fn(&str) -> bool,
) -> anyhow::Result<Vec<String>> {
    let deadline = Instant::now() + limit;
    let mut seen = Vec::new();
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        match rx.recv_timeout(left) {
            Ok(line) => {
                let done = pred(&line);
                seen.push(line);
                if done {
                    return Ok(seen);
                }
            }
            Err(_) => break,
        }
    }
    bail!("waited {limit:?}; output so far:\n{}", seen.join("\n"))
}

fn interrupt(child: &Child) {
    if let Ok(pgid) = i32::try_from(child.id()) {
        let _ = kill(Pid::from_raw(-pgid), Signal::SIGINT);
    }
}

struct StopOnDrop(Option<Child>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        if let Some(child) = &mut self.0 {
            interrupt(child);
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            if let Ok(pgid) = i32::try_from(child.id()) {
                let _ = kill(Pid::from_raw(-pgid), Signal::SIGKILL);
            }
            let _ = child.wait();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn make_run_brings_up_the_demo_and_ctrl_c_stops_it() -> anyhow::Result<()> {
    for port in PORTS {
        anyhow::ensure!(
            std::net::TcpListener::bind(("127.0.0.1", port)).is_ok(),
            "port {port} is in use: stop whatever holds it (a `make run`?) before this test"
        );
    }
    let started = Instant::now();
    // A fresh database, as on a first run (not the developer's var/).
    let var = tempfile::tempdir()?;
    let (child, rx) = make_run(var.path())?;
    let mut guard = StopOnDrop(Some(child));
    let output = wait_line(&rx, Duration::from_secs(1200), |l| {
        l.contains("Press Ctrl-C to stop everything")
    })?;
    let text = output.join("\n");
    println!("make run: up after {:?}", started.elapsed());
    for url in [
        "http://127.0.0.1:8080/",
        "http://127.0.0.1:10000/",
        "http://127.0.0.1:9901/",
    ] {
        assert!(text.contains(url), "make run printed {url}:\n{text}");
    }
    assert!(
        text.contains("--insecure-dev"),
        "make run says the admin runs without a login"
    );

    // One request through the egress listener, as the README shows it.
    let http = reqwest::Client::new();
    let resp = http
        .get("http://127.0.0.1:10000/v1/pay")
        .header("host", "api.bank.example")
        .send()
        .await?;
    let status = resp.status().as_u16();
    let policy = resp
        .headers()
        .get("x-sluice-policy")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    println!("make run: GET api.bank.example/v1/pay through Envoy -> {status} (x-sluice-policy {policy:?})");
    assert!(
        status == 200 || (status == 429 && policy.as_deref() == Some("bank")),
        "through the egress listener: {status}"
    );

    // The Envoy synced with the admin, and the live view moves.
    let browser = Browser::start().await?;
    browser.client.goto("http://127.0.0.1:8080/live").await?;
    let admitted = browser
        .wait_text(
            ".live-policy[data-policy='bank'] .admitted-now",
            Duration::from_secs(20),
            |t| t.parse::<f64>().is_ok_and(|v| v > 50.0),
        )
        .await?;
    let instances = http
        .get("http://127.0.0.1:8080/api/v1/instances")
        .send()
        .await?
        .text()
        .await?;
    println!("make run: live view shows bank at {admitted} admitted/s; instances: {instances}");
    assert!(instances.contains("demo-envoy"), "{instances}");

    // The demo pool (in the admin's set, synced by now): calls reach a
    // deployment.
    let mut members = std::collections::BTreeMap::<String, u32>::new();
    for _ in 0..20 {
        let resp = http
            .get("http://127.0.0.1:10000/v1/complete")
            .header("host", "api.pool.example")
            .send()
            .await?;
        let answered = resp
            .headers()
            .get("x-sluice-member-answered")
            .and_then(|v| v.to_str().ok())
            .map_or_else(|| format!("status {}", resp.status()), str::to_string);
        *members.entry(answered).or_default() += 1;
    }
    println!("make run: 20 calls to api.pool.example answered by {members:?}");
    assert!(
        members
            .keys()
            .all(|m| m == "east" || m == "west" || m == "status 429 Too Many Requests"),
        "pool members answered: {members:?}"
    );
    assert!(members.contains_key("east") || members.contains_key("west"));
    // The live view shows each member's calls and share.
    let mut shares = Vec::new();
    for member in ["east", "west"] {
        let calls = browser
            .wait_text(
                &format!(".live-pool[data-policy='pool'] .pool-member[data-member='{member}'] .member-calls"),
                Duration::from_secs(20),
                |t| t.parse::<f64>().is_ok_and(|v| v > 5.0),
            )
            .await?;
        let share = browser
            .wait_text(
                &format!(".live-pool[data-policy='pool'] .pool-member[data-member='{member}'] .member-share"),
                Duration::from_secs(5),
                |t| t.ends_with('%'),
            )
            .await?;
        shares.push(format!("{member} {calls}/s ({share})"));
    }
    println!("make run: the live view's pool: {}", shares.join(", "));

    // The demo LLM: answers settle their tokens, and the provider refuses
    // nothing.
    let llm: serde_json::Value = serde_json::from_str(
        &http
            .get("http://127.0.0.1:9090/__llm/stats")
            .send()
            .await?
            .text()
            .await?,
    )?;
    let stats = http
        .get("http://127.0.0.1:9901/stats?filter=sluice.limit.llm-tokens")
        .send()
        .await?
        .text()
        .await?;
    println!(
        "make run: demo LLM completed {} calls, refused {}; {}",
        llm["completed"],
        llm["refused"],
        stats.lines().collect::<Vec<_>>().join(", ")
    );
    assert_eq!(llm["refused"], 0, "the demo LLM refused calls");
    assert!(llm["completed"].as_u64().is_some_and(|n| n > 0));
    assert!(stats.contains("llm-tokens.usage_read"), "{stats}");
    // The demo's agents: their tool calls reach the MCP server through
    // Envoy, a tool list too.
    let tools: serde_json::Value = http
        .post("http://127.0.0.1:10000/mcp")
        .header("host", "mcp.tools.example")
        .header("content-type", "application/json")
        .body(r#"{"jsonrpc": "2.0", "id": 1, "method": "tools/list"}"#)
        .send()
        .await?
        .json()
        .await?;
    assert_eq!(tools["result"]["tools"][0]["name"], "search", "{tools}");
    let mcp: serde_json::Value = http
        .get("http://127.0.0.1:9093/__mcp/stats")
        .send()
        .await?
        .json()
        .await?;
    println!("make run: the demo MCP server answered {mcp}");
    assert!(
        mcp["calls"]["search"]
            .as_object()
            .is_some_and(|a| !a.is_empty()),
        "{mcp}"
    );
    let shot = browser.client.screenshot().await?;
    let shots = workspace_root().join("target/screenshots");
    std::fs::create_dir_all(&shots)?;
    std::fs::write(shots.join("demo-live-view.png"), shot)?;
    browser.close().await;

    // A second `make run` while the first is up says the ports are taken.
    let second = user_shell_make()
        .arg("run")
        .current_dir(workspace_root())
        .output()?;
    let second_err = String::from_utf8_lossy(&second.stderr);
    println!(
        "make run, a second time: exit {:?}: {}",
        second.status.code(),
        second_err
            .lines()
            .filter(|l| l.contains("taken") || l.contains("127.0.0.1"))
            .collect::<Vec<_>>()
            .join(" / ")
    );
    assert!(!second.status.success());
    assert!(
        second_err.contains("ports are taken") && second_err.contains("127.0.0.1:8080"),
        "{second_err}"
    );

    // Ctrl-C: everything it started stops, and the ports are free again.
    let mut child = guard.0.take().context("make run is gone")?;
    let stopping = Instant::now();
    interrupt(&child);
    let deadline = Instant::now() + Duration::from_secs(20);
    while child.try_wait()?.is_none() {
        if Instant::now() > deadline {
            guard.0 = Some(child);
            bail!("make run still running 20 s after Ctrl-C");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let tail: Vec<String> = rx.try_iter().collect();
    println!(
        "make run: stopped {:?} after Ctrl-C:\n{}",
        stopping.elapsed(),
        tail.join("\n")
    );
    assert!(tail
        .iter()
        .any(|l| l.contains("Envoy") && l.contains("pid")));
    for port in PORTS {
        assert!(
            std::net::TcpListener::bind(("127.0.0.1", port)).is_ok(),
            "port {port} still held after Ctrl-C"
        );
    }
    Ok(())
}
