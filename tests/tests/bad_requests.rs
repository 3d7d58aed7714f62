//! Requests no client should send, on raw sockets through the real Envoy:
//! missing, huge and non-UTF-8 authorities, key and cost headers. Each gets a
//! defined answer, the filter never panics, and the limits still hold after.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use sluice_demo::mock::{MockApi, MockLimits};
use sluice_e2e::envoy::Envoy;

/// Sends `request` as raw bytes on a fresh connection; returns the status
/// code of the answer (0 when the connection closed without one).
fn raw(port: u16, request: &[u8]) -> anyhow::Result<u16> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(request)?;
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    while !answer.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => answer.extend_from_slice(&buf[..n]),
        }
    }
    let line = String::from_utf8_lossy(&answer);
    Ok(line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0))
}

fn get(host: &[u8], extra: &[&[u8]]) -> Vec<u8> {
    let mut r = b"GET /v1/x HTTP/1.1\r\n".to_vec();
    if !host.is_empty() {
        r.extend_from_slice(b"host: ");
        r.extend_from_slice(host);
        r.extend_from_slice(b"\r\n");
    }
    for h in extra {
        r.extend_from_slice(h);
        r.extend_from_slice(b"\r\n");
    }
    r.extend_from_slice(b"connection: close\r\n\r\n");
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_get_a_defined_answer_and_never_a_panic() -> anyhow::Result<()> {
    let mock = MockApi::start("127.0.0.1:0".parse()?, MockLimits::default()).await?;
    let config = r#"{"instance": "bad-input", "fallback": {"version": 1, "policies": [
        {"name": "keyed", "match": {"host": "*"}, "key": {"header": "x-api-key", "max_keys": 100},
         "rate": {"requests": 5, "period": "1m", "burst": 5}, "cost": {"header": "x-cost", "default": 1, "max": 2}}]}}"#;
    let envoy = Envoy::start(config, mock.addr.port(), 2)?;
    let port = envoy.listener_port;
    let huge = vec![b'a'; 50_000];
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("no host header", get(b"", &[])),
        ("60 KB authority", get(&huge, &[])),
        ("non-UTF-8 authority", get(b"api.\xff\xfe.example", &[])),
        (
            "non-UTF-8 key",
            get(b"api.example", &[b"x-api-key: \xc3\x28\xff"]),
        ),
        (
            "huge key",
            get(
                b"api.example",
                &[&[b"x-api-key: ".as_slice(), &vec![b'k'; 30_000]].concat()],
            ),
        ),
        (
            "cost not a number",
            get(b"api.example", &[b"x-api-key: c1", b"x-cost: lots"]),
        ),
        (
            "cost past u64",
            get(
                b"api.example",
                &[b"x-api-key: c2", b"x-cost: 99999999999999999999999"],
            ),
        ),
        (
            "negative cost",
            get(b"api.example", &[b"x-api-key: c3", b"x-cost: -4"]),
        ),
        (
            "non-UTF-8 cost",
            get(b"api.example", &[b"x-api-key: c4", b"x-cost: \xff\x00"]),
        ),
        ("empty key", get(b"api.example", &[b"x-api-key: "])),
    ];
    let mut answers = Vec::new();
    for (name, request) in &cases {
        let status = raw(port, request)?;
        answers.push(format!("{name} -> {status}"));
        assert!(
            matches!(status, 200 | 400 | 413 | 429 | 431 | 0),
            "{name}: answered {status}"
        );
    }
    // The limits still hold: key "fresh" has 5 per minute.
    let mut fresh = Vec::new();
    for _ in 0..7 {
        fresh.push(raw(port, &get(b"api.example", &[b"x-api-key: fresh"]))?);
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    let log = envoy.log();
    let panicked =
        log.contains("panicked") || log.contains("wasm trap") || log.contains("Function: proxy_on");
    println!(
        "bad input: {}; then key \"fresh\" x7 -> {fresh:?}; filter host errors {}, panics in the log: {panicked}",
        answers.join(", "),
        envoy.filter_stat("host_errors").unwrap_or(0.0),
    );
    assert!(!panicked, "the filter failed:\n{log}");
    assert_eq!(fresh.iter().filter(|&&s| s == 200).count(), 5);
    assert_eq!(fresh.iter().filter(|&&s| s == 429).count(), 2);
    Ok(())
}

/// Where a key landed before keys were hashed with a secret: xxh3 of the
/// value, which anyone can compute.
fn public_place(key: &str, places: u64) -> u64 {
    xxhash_rust::xxh3::xxh3_64(key.as_bytes()).max(1) % places
}

/// A tenant who chooses its keys aims four of them at another tenant's
/// places (each key's place and the three probed after it), holds a call
/// open on each, and so would push the victim out of every place it may
/// use: refused, with overflow "reject". With keys hashed under a secret
/// drawn by Envoy, the aimed keys land anywhere and the victim is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_aimed_at_another_tenants_places_do_not_crowd_it_out() -> anyhow::Result<()> {
    const PLACES: u64 = 64;
    let mock = MockApi::start("127.0.0.1:0".parse()?, MockLimits::default()).await?;
    let config = format!(
        r#"{{"instance": "aimed-keys", "fallback": {{"version": 1, "policies": [
        {{"name": "tenants", "match": {{"host": "*"}},
          "key": {{"header": "x-tenant", "max_keys": {PLACES}, "overflow": "reject"}},
          "concurrency": {{"max_in_flight": 1}}}}]}}}}"#
    );
    let envoy = Envoy::start(&config, mock.addr.port(), 2)?;
    let victim = "victim-tenant";
    let first = public_place(victim, PLACES);
    let aimed: Vec<String> = (0..4)
        .map(|probe| {
            let target = (first + probe) % PLACES;
            (0..)
                .map(|i| format!("attacker-{probe}-{i}"))
                .find(|k| public_place(k, PLACES) == target)
                .unwrap_or_default()
        })
        .collect();
    let http = sluice_e2e::load::client();
    let held: Vec<_> = aimed
        .iter()
        .map(|key| {
            let request = http
                .get(envoy.url("/v1/slow"))
                .header("host", "api.example")
                .header("x-tenant", key)
                .header("x-mock-delay-ms", "3000");
            tokio::spawn(async move { request.send().await.map(|r| r.status().as_u16()) })
        })
        .collect();
    // Until all four calls are in flight at the mock.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while mock.in_flight() < 4 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(mock.in_flight(), 4, "the attacker's calls are held open");
    let answer = http
        .get(envoy.url("/v1/x"))
        .header("host", "api.example")
        .header("x-tenant", victim)
        .send()
        .await?;
    let served = answer.status().as_u16();
    println!(
        "aimed keys: 4 keys aimed at {victim}'s places {first}..{} (of {PLACES}), held open; the victim got {served}",
        first + 3
    );
    assert_eq!(served, 200, "the victim was crowded out of its places");
    for call in held {
        assert_eq!(call.await??, 200, "the attacker's own calls are served");
    }
    Ok(())
}

/// The status each of 3 calls got, the middle one asking for a panic
/// (`x-sluice-test-panic`), through `envoy`.
async fn around_a_panic(envoy: &Envoy) -> anyhow::Result<Vec<u16>> {
    let http = sluice_e2e::load::client();
    let call = |panic: bool| {
        let mut request = http.get(envoy.url("/")).header("host", "api.bank.example");
        if panic {
            request = request.header("x-sluice-test-panic", "1");
        }
        async move { request.send().await.map_or(0, |r| r.status().as_u16()) }
    };
    let mut statuses = vec![call(false).await, call(true).await];
    // A trapped wasm VM is reloaded (FAIL_RELOAD) on a later call, after
    // a backoff: the calls until then are refused too.
    let started = std::time::Instant::now();
    let mut after = call(false).await;
    while after != 200 && started.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(250)).await;
        after = call(false).await;
    }
    statuses.push(after);
    Ok(statuses)
}

/// Also in the third security review: one failure mode for both builds.
/// A call the filter fails on (a panic, forced by `panic_on_header`) is
/// refused in both by default: the native module answers 503
/// (`x-sluice-reason: filter-failure`), the wasm filter's VM traps and
/// Envoy (FAIL_RELOAD) answers for it; with `failure_mode: open` the
/// native module lets it through. Calls before and after pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_on_a_call_refuses_it_in_both_builds_unless_open() -> anyhow::Result<()> {
    use sluice_e2e::envoy::{filter_native, with_native_filter, workspace_root};
    let mock = MockApi::start(
        "127.0.0.1:0".parse()?,
        MockLimits {
            max_per_second: 0,
            max_in_flight: 0,
        },
    )
    .await?;
    let config = |mode: &str| {
        format!(
            r#"{{"instance": "e2e-panic", "panic_on_header": "x-sluice-test-panic", "failure_mode": "{mode}",
                "fallback": {{"version": 1, "policies": [{{"name": "bank", "match": {{"host": "api.bank.example"}},
                  "rate": {{"requests": 1000, "period": "1s"}}}}]}}}}"#
        )
    };
    let template = std::fs::read_to_string(workspace_root().join("envoy/egress-test.yaml"))?;
    let native = with_native_filter(&template, &filter_native()?)?;
    let mut outcomes = Vec::new();
    for (build, template, mode) in [
        ("wasm", &template, "closed"),
        ("native", &native, "closed"),
        ("native", &native, "open"),
    ] {
        let envoy = Envoy::start_with(template, &config(mode), mock.addr.port(), 2)?;
        mock.reset();
        let statuses = around_a_panic(&envoy).await?;
        let reached = mock.arrivals().len();
        // Refused while a trapped VM waits for its reload: not the provider's.
        println!("failure mode, {build} {mode}: 3 calls, the middle one failing -> {statuses:?}; the provider saw {reached}");
        outcomes.push((build, mode, statuses, reached));
    }
    for (build, mode, statuses, reached) in outcomes {
        anyhow::ensure!(
            statuses[0] == 200 && statuses[2] == 200,
            "{build} {mode}: {statuses:?}"
        );
        if mode == "open" {
            anyhow::ensure!(
                statuses[1] == 200 && reached == 3,
                "{build} {mode}: {statuses:?} {reached}"
            );
        } else {
            anyhow::ensure!(
                statuses[1] >= 500,
                "{build} {mode}: the failed call passed: {statuses:?}"
            );
            anyhow::ensure!(
                reached == 2,
                "{build} {mode}: {reached} reached the provider"
            );
        }
    }
    Ok(())
}
