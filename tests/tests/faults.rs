//! Faults around the filter, in a real Envoy (`--concurrency 4`): an admin
//! that answers badly, an admin killed mid-load, Envoy killed mid-load, a
//! stream that outlives its lease. Each prints its figures.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sluice_demo::mock::{Arrival, MockApi, MockLimits};
use sluice_e2e::admin::{AdminProcess, PASSWORD, SYNC_TOKEN};
use sluice_e2e::browser::Browser;
use sluice_e2e::envoy::{filter_vms, free_port, workspace_root, Envoy};
use sluice_e2e::load::{self, count, wait_for, Outcome};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const WORKERS: u32 = 4;

fn bank_set(version: u64, requests: u64) -> Value {
    json!({"version": version, "policies": [
        {"name": "bank", "match": {"host": "api.bank.example"},
         "rate": {"requests": requests, "period": "1s", "burst": requests}}]})
}

/// What the stand-in admin answers to the filter's sync.
#[derive(Clone, Debug)]
enum Answer {
    /// A valid set: 304 when the filter already has its version.
    Set(Value),
    /// 200 with bytes that are neither UTF-8 nor JSON.
    Garbage,
    /// 200 with a valid, looser set padded past the filter's 1 MiB cap.
    Huge,
    /// A valid, looser set, but 3 s late (the sync timeout is 200 ms).
    Slow,
    /// 200 with a newer set that fails validation (a looser bank beside an
    /// invalid policy): the whole set must be refused.
    Invalid,
    /// 304 whose shares header is not UTF-8 (the SDK's string getter
    /// panics on it).
    NonUtf8Header,
    /// 200 with the headers of a looser set, then the connection closes
    /// mid-body: Envoy reports a reset after headers, with no response
    /// headers left to read (the SDK's getter panics on the missing map).
    ResetAfterHeaders,
    /// 503 with Retry-After, as a busy admin sheds a sync past
    /// `--max-syncs-in-flight`.
    Shed,
}

impl Answer {
    fn name(&self) -> &'static str {
        match self {
            Answer::Set(_) => "a valid set",
            Answer::Garbage => "garbage bytes",
            Answer::Huge => "a 3 MiB body",
            Answer::Slow => "an answer 3 s late",
            Answer::Invalid => "a set that fails validation",
            Answer::NonUtf8Header => "a shares header that is not UTF-8",
            Answer::ResetAfterHeaders => "a reset after the headers (truncated body)",
            Answer::Shed => "a busy admin's 503 with Retry-After",
        }
    }
}

/// An admin that answers whatever the test says: the faults a real admin
/// (or whatever sits between it and Envoy) could produce. It speaks
/// HTTP/1.1 by hand, so it can send what no well-behaved server would.
#[derive(Clone)]
struct StandInAdmin {
    answer: Arc<Mutex<Answer>>,
    calls: Arc<AtomicU64>,
    /// The store epoch it names in every answer (0: none).
    epoch: Arc<AtomicU64>,
}

impl StandInAdmin {
    fn new(answer: Answer) -> Self {
        Self {
            answer: Arc::new(Mutex::new(answer)),
            calls: Arc::new(AtomicU64::new(0)),
            epoch: Arc::new(AtomicU64::new(0)),
        }
    }

    fn answer(&self, answer: Answer) -> anyhow::Result<()> {
        *self.answer.lock().map_err(|_| anyhow::anyhow!("lock"))? = answer;
        Ok(())
    }
}

fn response(status: &str, headers: &[(&str, &[u8])], body: &[u8]) -> Vec<u8> {
    let mut out = format!("HTTP/1.1 {status}\r\nconnection: close\r\n").into_bytes();
    for (name, value) in headers {
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(format!("content-length: {}\r\n\r\n", body.len()).as_bytes());
    out.extend_from_slice(body);
    out
}

/// One request (head and `content-length` body), one answer, then close.
async fn stand_in_connection(mut sock: TcpStream, admin: StandInAdmin) -> std::io::Result<()> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        let n = sock.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        if buf.len() > 1 << 20 {
            return Ok(());
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    while buf.len() < head_end + length {
        let n = sock.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    admin.calls.fetch_add(1, Ordering::SeqCst);
    let is_watch = head
        .lines()
        .next()
        .is_some_and(|l| l.contains(sluice_wire::sync::WATCH_PATH));
    let report = serde_json::from_slice::<Value>(buf.get(head_end..).unwrap_or(&[])).ok();
    let has = report.as_ref().and_then(|r| r["policy_version"].as_u64());
    let has_epoch = report
        .as_ref()
        .and_then(|r| r["policy_epoch"].as_u64())
        .unwrap_or(0);
    let epoch = admin.epoch.load(Ordering::SeqCst);
    let epoch_text = epoch.to_string();
    let epoch_header: (&str, &[u8]) = (sluice_wire::sync::EPOCH_HEADER, epoch_text.as_bytes());
    let answer = admin
        .answer
        .lock()
        .map(|a| a.clone())
        .unwrap_or(Answer::Garbage);
    let json: &[(&str, &[u8])] = &[("content-type", b"application/json")];
    let bytes = match answer {
        Answer::Set(set) if set["version"].as_u64() == has && has_epoch == epoch => {
            response("304 Not Modified", &[epoch_header], b"")
        }
        Answer::Set(set) => response(
            "200 OK",
            &[json[0], epoch_header],
            set.to_string().as_bytes(),
        ),
        Answer::Garbage => response("200 OK", &[], &[0xff, 0xfe, b'{', b'"', 0x00, 0xc3]),
        Answer::Huge => {
            let mut body = bank_set(50, 1000).to_string().into_bytes();
            body.extend(std::iter::repeat_n(b' ', 3 << 20));
            response("200 OK", json, &body)
        }
        // Late is a fault for a sync (it times out after its interval);
        // a watch is held on purpose, so its slow answer brings nothing.
        Answer::Slow if is_watch => {
            tokio::time::sleep(Duration::from_secs(3)).await;
            response("304 Not Modified", &[epoch_header], b"")
        }
        Answer::Slow => {
            tokio::time::sleep(Duration::from_secs(3)).await;
            response("200 OK", json, bank_set(60, 1000).to_string().as_bytes())
        }
        Answer::Invalid => {
            let mut set = bank_set(70, 1000);
            if let Some(policies) = set["policies"].as_array_mut() {
                policies.push(
                    json!({"name": "maps", "match": {"host": "api.maps.example"},
                    "rate": {"requests": 0, "period": "1s"}}),
                );
            }
            response("200 OK", json, set.to_string().as_bytes())
        }
        Answer::NonUtf8Header => response(
            "304 Not Modified",
            &[(sluice_wire::sync::SHARES_HEADER, &[0xff, 0xfe, 0x80, b'{'])],
            b"",
        ),
        Answer::Shed => response(
            "503 Service Unavailable",
            &[json[0], ("retry-after", b"1")],
            br#"{"error":"busy: the admin answers as many syncs as it can (--max-syncs-in-flight); keep the set and shares you hold and sync again later"}"#,
        ),
        Answer::ResetAfterHeaders => {
            let body = bank_set(80, 1000).to_string().into_bytes();
            let mut out = response("200 OK", json, &body);
            // Claim the whole body, send a third of it, hang up.
            out.truncate(out.len() - body.len() * 2 / 3);
            out
        }
    };
    sock.write_all(&bytes).await?;
    sock.shutdown().await
}

async fn serve_stand_in(listener: TcpListener, admin: StandInAdmin) {
    while let Ok((sock, _)) = listener.accept().await {
        tokio::spawn(stand_in_connection(sock, admin.clone()));
    }
}

/// Envoy in front of `mock`, syncing every 200 ms with the admin on
/// `admin_port`, once the admin's set is in every worker. The fallback is
/// empty: whatever holds later while the admin misbehaves or is gone is the
/// last set it sent, not something in Envoy's configuration.
async fn synced_envoy(instance: &str, mock: &MockApi, admin_port: u16) -> anyhow::Result<Envoy> {
    let config = json!({"instance": instance, "admin_cluster": "sluice_admin",
        "sync_interval": "200ms", "sync_token": SYNC_TOKEN,
        "fallback": {"version": 0, "policies": []}})
    .to_string();
    let envoy = Envoy::start_with_admin(&config, mock.addr.port(), admin_port, WORKERS)?;
    wait_for(
        "the admin's set in every worker",
        Duration::from_secs(5),
        || envoy.filter_stat("policy_sets_installed").unwrap_or(0.0) >= filter_vms(WORKERS),
    )
    .await?;
    Ok(envoy)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_misbehaving_admin_never_replaces_the_last_good_set() -> anyhow::Result<()> {
    let stand_in = StandInAdmin::new(Answer::Set(bank_set(1, 5)));
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let admin_port = listener.local_addr()?.port();
    tokio::spawn(serve_stand_in(listener, stand_in.clone()));
    let mock = MockApi::start("127.0.0.1:0".parse()?, MockLimits::default()).await?;
    let envoy = synced_envoy("e2e-faulty-admin", &mock, admin_port).await?;
    let stat = |name: &str| envoy.filter_stat(name).unwrap_or(0.0);
    let url = envoy.url("/");
    let first = load::burst(&url, "api.bank.example", 40).await;
    assert!((5..=6).contains(&count(&first, 200)), "bank 5/s holds");
    // Every VM installs it, the main thread's too; the count settles
    // within a few ticks.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let installed = stat("policy_sets_installed");

    for bad in [
        Answer::Garbage,
        Answer::Huge,
        Answer::Slow,
        Answer::Invalid,
        Answer::NonUtf8Header,
        Answer::ResetAfterHeaders,
        Answer::Shed,
    ] {
        let name = bad.name();
        *stand_in
            .answer
            .lock()
            .map_err(|_| anyhow::anyhow!("lock"))? = bad;
        let failures_before = stat("sync_failures");
        let took = wait_for(
            &format!("two failed syncs on {name}"),
            Duration::from_secs(15),
            || stat("sync_failures") >= failures_before + 2.0,
        )
        .await?;
        // The bucket refills, then a burst shows which limit is enforced:
        // the bad answers would all have loosened bank to 1000/s.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let during = load::burst(&url, "api.bank.example", 40).await;
        let failures = stat("sync_failures") - failures_before;
        println!(
            "faulty admin: {name}: {failures} failed syncs counted (the first two within {took:?}); \
             policy sets installed {} (before {installed}); a burst of 40: {} passed, {} got 429",
            stat("policy_sets_installed"),
            count(&during, 200),
            count(&during, 429)
        );
        assert!(
            (5..=6).contains(&count(&during, 200)),
            "{name}: bank 5/s kept"
        );
        assert_eq!(
            stat("policy_sets_installed"),
            installed,
            "{name}: nothing installed"
        );
        // A good answer again, so the next fault starts without backoff.
        *stand_in
            .answer
            .lock()
            .map_err(|_| anyhow::anyhow!("lock"))? = Answer::Set(bank_set(1, 5));
        let ok_before = stat("sync_ok");
        wait_for("a good sync", Duration::from_secs(35), || {
            stat("sync_ok") > ok_before
        })
        .await?;
    }
    let log = envoy.log();
    let reasons: Vec<&str> = log
        .lines()
        .filter_map(|l| {
            l.find("sluice: sync with the admin failed")
                .map(|at| &l[at + "sluice: ".len()..])
        })
        .collect();
    let mut distinct: Vec<&str> = reasons
        .iter()
        .map(|r| r.split(';').next().unwrap_or(r))
        .collect();
    distinct.sort();
    distinct.dedup();
    println!("faulty admin: the reasons Envoy logged: {distinct:#?}");
    for want in [
        "not UTF-8",
        "refused a 3145",
        "HTTP 504",
        "HTTP 503",
        "refused an invalid policy set",
    ] {
        assert!(
            distinct.iter().any(|r| r.contains(want)),
            "no log line says {want:?}"
        );
    }
    assert!(
        distinct
            .iter()
            .any(|r| r.contains("policies[1].rate.requests")),
        "the refusal names the field"
    );

    // A newer valid set is taken as soon as the admin sends one.
    *stand_in
        .answer
        .lock()
        .map_err(|_| anyhow::anyhow!("lock"))? = Answer::Set(bank_set(2, 1000));
    wait_for("the newer good set", Duration::from_secs(35), || {
        stat("policy_sets_installed") >= installed + filter_vms(WORKERS)
    })
    .await?;
    let after = load::burst(&url, "api.bank.example", 40).await;
    println!(
        "faulty admin: a good set again (1000/s): {} of 40 passed; {} calls to the admin in all (syncs and push watches); \
         Envoy's workers never panicked: {}",
        count(&after, 200),
        stand_in.calls.load(Ordering::SeqCst),
        !log.contains("panicked")
    );
    assert_eq!(count(&after, 200), 40);
    assert!(!log.contains("panicked"), "a VM panicked");
    assert!(
        log.contains("shares header does not parse"),
        "the non-UTF-8 shares header was read, refused and logged"
    );
    Ok(())
}

/// One forged answer naming a huge version of the admin's store pins an
/// Envoy to it: the admin's honest, lower versions of the same store are
/// then reported as stale (not as a good sync), and a set from a new store
/// epoch (what the admin draws when it sees an Envoy ahead of it) is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_version_is_reported_stale_until_a_new_store_epoch() -> anyhow::Result<()> {
    let stand_in = StandInAdmin::new(Answer::Set(bank_set(3, 5)));
    stand_in.epoch.store(111, Ordering::SeqCst);
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let admin_port = listener.local_addr()?.port();
    tokio::spawn(serve_stand_in(listener, stand_in.clone()));
    let mock = MockApi::start("127.0.0.1:0".parse()?, MockLimits::default()).await?;
    let envoy = synced_envoy("e2e-forged", &mock, admin_port).await?;
    let stat = |name: &str| envoy.filter_stat(name).unwrap_or(0.0);
    let url = envoy.url("/");

    // The forged answer: the same store, version u64::MAX, bank at 5/s.
    let installed = stat("policy_sets_installed");
    stand_in.answer(Answer::Set(bank_set(u64::MAX, 5)))?;
    wait_for("the forged set", Duration::from_secs(5), || {
        stat("policy_sets_installed") >= installed + filter_vms(WORKERS)
    })
    .await?;
    // The honest admin again: version 4 of the same store, bank at 1000/s.
    stand_in.answer(Answer::Set(bank_set(4, 1000)))?;
    let stale_before = stat("sync_stale");
    let ok_before = stat("sync_ok");
    wait_for("stale syncs counted", Duration::from_secs(5), || {
        stat("sync_stale") >= stale_before + 3.0
    })
    .await?;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let pinned = load::burst(&url, "api.bank.example", 40).await;
    let stale = stat("sync_stale") - stale_before;
    let ok = stat("sync_ok") - ok_before;
    println!(
        "forged: after a forged version u64::MAX, the honest version 4 was reported stale {stale} times \
         (good syncs counted meanwhile {ok}); bank: {} of 40 passed (the forged 5/s is kept)",
        count(&pinned, 200)
    );
    assert_eq!(ok, 0.0, "a stale answer is not a good sync");
    assert!((5..=6).contains(&count(&pinned, 200)));
    assert!(envoy
        .log()
        .contains("enforces version 18446744073709551615 of the same store"));

    // A new store epoch: its version 1 is taken.
    let installed = stat("policy_sets_installed");
    stand_in.epoch.store(222, Ordering::SeqCst);
    stand_in.answer(Answer::Set(bank_set(1, 1000)))?;
    let took = wait_for("the new epoch's set", Duration::from_secs(5), || {
        stat("policy_sets_installed") >= installed + filter_vms(WORKERS)
    })
    .await?;
    // The bucket keeps its state across a new set: the forged 5/s left it
    // empty, and at 1000/s it holds the 40 calls' tokens 40 ms later.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let after = load::burst(&url, "api.bank.example", 40).await;
    println!(
        "forged: a new store epoch's version 1 was taken after {took:?}; bank 1000/s: {} of 40 passed",
        count(&after, 200)
    );
    assert_eq!(count(&after, 200), 40);
    assert!(!envoy.log().contains("panicked"));
    Ok(())
}

/// bank at 40/s (burst 5) and 4 in flight, under 16 clients calling an API
/// that takes 20 ms: the load the restart tests restart Envoy under.
struct BankUnderLoad {
    mock: MockApi,
    envoy: Envoy,
    origin: Instant,
    stop: Arc<AtomicBool>,
    load: tokio::task::JoinHandle<Vec<Outcome>>,
}

impl BankUnderLoad {
    async fn start(instance: &str, provider: MockLimits) -> anyhow::Result<Self> {
        let mock = MockApi::start("127.0.0.1:0".parse()?, provider).await?;
        let policies = json!({"version": 1, "policies": [
            {"name": "bank", "match": {"host": "api.bank.example"},
             "rate": {"requests": 40, "period": "1s", "burst": 5},
             "concurrency": {"max_in_flight": 4}}]});
        let config = json!({"instance": instance, "fallback": policies}).to_string();
        let envoy = Envoy::start(&config, mock.addr.port(), WORKERS)?;
        mock.reset();
        let origin = Instant::now();
        let stop = Arc::new(AtomicBool::new(false));
        let load = tokio::spawn(load::until_stopped(
            envoy.url("/pay?delay_ms=20"),
            "api.bank.example",
            16,
            origin,
            stop.clone(),
        ));
        Ok(Self {
            mock,
            envoy,
            origin,
            stop,
            load,
        })
    }

    /// When the mock saw its latest arrival.
    fn mock_clock(&self) -> Duration {
        self.mock
            .arrivals()
            .last()
            .map(|a| a.at)
            .unwrap_or_default()
    }

    /// Stops the load; every call's outcome.
    async fn finish(&mut self) -> anyhow::Result<Vec<Outcome>> {
        self.stop.store(true, Ordering::SeqCst);
        Ok((&mut self.load).await?)
    }

    /// How many of 8 calls of 500 ms sent at once get a slot (all 4 when
    /// none leaked).
    async fn free_slots(&self) -> usize {
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let slow = load::burst(&self.envoy.url("/pay?delay_ms=500"), "api.bank.example", 8).await;
        count(&slow, 200)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_killed_mid_load_enforces_from_the_first_request_after_restart() -> anyhow::Result<()>
{
    // The provider allows 50/s and 4 in flight; Sluice is set below it.
    let mut run = BankUnderLoad::start(
        "e2e-restart",
        MockLimits {
            max_per_second: 50,
            max_in_flight: 4,
        },
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let killed_at = run.origin.elapsed();
    // On this runtime thread, which lives as long as the test: an Envoy
    // started from a spawn_blocking thread was seen to get SIGTERM when that
    // thread exited, 10 s idle later (a parent-death signal follows the
    // thread that spawned the process, not the process).
    tokio::task::block_in_place(|| run.envoy.kill());
    // The mock's clock once the old Envoy is gone and what it had already
    // written has arrived: read before the kill, a call the old Envoy sent
    // in between was once taken for the new one's first and put the
    // windows below a second early (CI: "1 in the first second", 35/s).
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mock_clock_at_kill = run.mock_clock();
    tokio::task::block_in_place(|| run.envoy.restart())?;
    let live_at = run.origin.elapsed();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let outcomes = run.finish().await?;
    let (mock, envoy) = (&run.mock, &run.envoy);
    let after: Vec<Arrival> = mock
        .arrivals()
        .into_iter()
        .filter(|a| a.at > mock_clock_at_kill)
        .collect();
    // Calls the new Envoy let through in its first second: sent and
    // arrived within a second of the earliest sent.
    let first_second_after = after.iter().map(load::sent).min().map_or(0, |t0| {
        load::surely_within(&after, t0, Duration::from_secs(1))
    });
    let most_1s_after = load::most_surely_within(&after, Duration::from_secs(1)).0;
    let after: Vec<Duration> = after.iter().map(|a| a.at).collect();
    // From 1 s to 3 s after the new Envoy's first call, however long the
    // restart took (the load runs 4 s past it).
    let first_after = after.first().copied().unwrap_or(mock_clock_at_kill);
    let steady_after = after
        .iter()
        .filter(|&&a| {
            a >= first_after + Duration::from_secs(1) && a < first_after + Duration::from_secs(3)
        })
        .count() as f64
        / 2.0;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let in_flight = envoy.gauge("bank", "in_flight")?;
    println!(
        "envoy restart: SIGKILL at {killed_at:?}, the new Envoy live at {live_at:?}; {} requests: \
         {} passed, {} got 429, {} failed to connect; after the restart: {} requests reached the \
         mock in its first second (burst 5 + 40/s), most sent and arrived in any 1 s {most_1s_after} (bound 45), \
         steady {steady_after:.1}/s; \
         mock refused {} as over its own limit (50/s, 4 in flight), most in flight at the mock {}; \
         in flight now {in_flight}",
        outcomes.len(),
        count(&outcomes, 200),
        count(&outcomes, 429),
        count(&outcomes, 0),
        first_second_after,
        mock.rejected_by_mock(),
        mock.max_in_flight(),
    );
    assert_eq!(mock.rejected_by_mock(), 0, "over the provider's limit");
    assert!(mock.max_in_flight() <= 4);
    assert!(
        first_second_after <= 46,
        "{first_second_after} in the first second"
    );
    assert!(most_1s_after <= 46, "{most_1s_after} in one second");
    assert!(
        (36.0..=44.0).contains(&steady_after),
        "enforcing 40/s after the restart, not {steady_after}"
    );
    assert_eq!(in_flight, 0.0);
    let free = run.free_slots().await;
    println!("envoy restart: 8 slow requests at once: {free} passed (4 slots)");
    assert_eq!(free, 4, "no slot leaked");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_outlives_its_lease_gives_its_slot_back() -> anyhow::Result<()> {
    let mock = MockApi::start("127.0.0.1:0".parse()?, MockLimits::default()).await?;
    let config = json!({"instance": "e2e-lease", "fallback": {"version": 1, "policies": [
        {"name": "llm", "match": {"host": "api.llm.example"},
         "concurrency": {"max_in_flight": 2, "lease_ttl": "2s"}}]}})
    .to_string();
    let envoy = Envoy::start(&config, mock.addr.port(), WORKERS)?;
    let origin = Instant::now();
    // Two streams that hang far past the lease.
    let stuck: Vec<_> = (0..2)
        .map(|_| {
            let request = load::client()
                .get(envoy.url("/generate?delay_ms=8000"))
                .header("host", "api.llm.example");
            tokio::spawn(load::send(request, origin))
        })
        .collect();
    wait_for("both stuck at the mock", Duration::from_secs(2), || {
        mock.in_flight() == 2
    })
    .await?;
    let while_held = load::burst(&envoy.url("/generate"), "api.llm.example", 1).await;
    let mut freed_after = None;
    while origin.elapsed() < Duration::from_secs(6) {
        let probe = load::burst(&envoy.url("/generate"), "api.llm.example", 1).await;
        if count(&probe, 200) == 1 {
            freed_after = Some(origin.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    let expired = envoy.policy_stat("leases_expired", "llm")?;
    let mut stuck_status = Vec::new();
    for s in stuck {
        stuck_status.push(s.await?.status);
    }
    // The stuck streams ended after their slots were already given back:
    // their end must not give them back a second time.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let in_flight = envoy.gauge("llm", "in_flight")?;
    let slow = load::burst(&envoy.url("/generate?delay_ms=500"), "api.llm.example", 5).await;
    println!(
        "lease: 2 streams stuck at the mock for 8 s, limit 2, lease_ttl 2 s; while held: {:?}; \
         a slot came back after {freed_after:?}; leases_expired {expired}; the stuck streams \
         ended {stuck_status:?}; in flight then {in_flight}; 5 slow requests at once: {} passed",
        while_held.iter().map(|o| o.status).collect::<Vec<_>>(),
        count(&slow, 200)
    );
    assert_eq!(count(&while_held, 429), 1);
    let freed = freed_after.ok_or_else(|| anyhow::anyhow!("no slot came back within 6 s"))?;
    assert!(
        freed >= Duration::from_secs(2) && freed < Duration::from_millis(3500),
        "slot back after {freed:?}"
    );
    assert_eq!(expired, 2.0);
    assert_eq!(
        stuck_status,
        vec![200, 200],
        "the stuck streams were not cut"
    );
    assert_eq!(in_flight, 0.0);
    assert_eq!(count(&slow, 200), 2, "exactly 2 slots, none counted twice");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_killed_mid_load_changes_nothing_and_comes_back() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("sluice.db");
    let log_path = dir.path().join("admin.log");
    let ui_dir = std::env::var_os("SLUICE_UI_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target/ui"));
    let port = free_port()?;
    let admin = AdminProcess::start(&db, port, Some(&ui_dir), &log_path).await?;
    let op = admin.login().await?;
    op.create(
        json!({"name": "bank", "match": {"host": "api.bank.example"},
        "rate": {"requests": 40, "period": "1s", "burst": 5}}),
    )
    .await?;
    let mock = MockApi::start(
        "127.0.0.1:0".parse()?,
        MockLimits {
            max_per_second: 50,
            max_in_flight: 0,
        },
    )
    .await?;
    let envoy = synced_envoy("e2e-admin-kill", &mock, port).await?;
    let stat = |name: &str| envoy.filter_stat(name).unwrap_or(0.0);
    mock.reset();
    let origin = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let load = tokio::spawn(load::until_stopped(
        envoy.url("/pay"),
        "api.bank.example",
        16,
        origin,
        stop.clone(),
    ));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let admin_pid = admin.pid();
    admin.kill();
    let killed = mock.arrivals().last().map(|a| a.at).unwrap_or_default();
    let failures_before = stat("sync_failures");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let failures = stat("sync_failures") - failures_before;
    let restarted = mock.arrivals().last().map(|a| a.at).unwrap_or_default();
    let admin = AdminProcess::start(&db, port, Some(&ui_dir), &log_path).await?;
    let ok_before = stat("sync_ok");
    let resumed = wait_for("sync after the restart", Duration::from_secs(35), || {
        stat("sync_ok") > ok_before
    })
    .await?;
    stop.store(true, Ordering::SeqCst);
    let outcomes = load.await?;
    let arrivals: Vec<Duration> = mock.arrivals().iter().map(|a| a.at).collect();
    let while_down = arrivals
        .iter()
        .filter(|&&a| a >= killed + Duration::from_millis(500) && a < restarted)
        .count() as f64
        / (restarted.saturating_sub(killed + Duration::from_millis(500))).as_secs_f64();
    let most_1s = load::most_surely_within(&mock.arrivals(), Duration::from_secs(1)).0;

    // The operator's view after the restart: the instance is back.
    let op = admin.login().await?;
    let listed_live = || {
        let op = &op;
        async move {
            op.get("/api/v1/instances").await.ok().and_then(|listed| {
                listed["instances"]
                    .as_array()
                    .and_then(|a| a.iter().find(|i| i["id"] == "e2e-admin-kill"))
                    .cloned()
            })
        }
    };
    let mut me = Value::Null;
    for _ in 0..50 {
        me = listed_live().await.unwrap_or_default();
        if me["live"] == true {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let browser = Browser::start().await?;
    let page = async {
        let c = &browser.client;
        c.goto(&format!("{}/", admin.base())).await?;
        browser.fill("#password", PASSWORD).await?;
        browser.click("#login-button").await?;
        browser
            .wait_text("#policies", Duration::from_secs(10), |t| t.contains("bank"))
            .await?;
        c.goto(&format!("{}/instances", admin.base())).await?;
        browser
            .wait_text("#instances", Duration::from_secs(10), |t| {
                t.contains("e2e-admin-kill") && t.contains("live")
            })
            .await
    }
    .await;
    browser.close().await;
    let page = page?;
    println!(
        "admin kill: SIGKILL of pid {admin_pid} under 16 clients; while it was down {failures} failed \
         syncs, the mock saw {while_down:.1}/s (limit 40/s); most sent and arrived in any 1 s {most_1s} (bound 45); \
         mock refused {} as over 50/s; {} requests, {} passed, {} got 429, {} failed; restarted: \
         sync resumed after {resumed:?}; instance live={} at version {}; the instances page: {:?}",
        mock.rejected_by_mock(),
        outcomes.len(),
        count(&outcomes, 200),
        count(&outcomes, 429),
        count(&outcomes, 0),
        me["live"],
        me["policy_version"],
        page.lines().find(|l| l.contains("e2e-admin-kill")).unwrap_or(&page),
    );
    assert!(failures >= 1.0);
    assert_eq!(mock.rejected_by_mock(), 0, "over the provider's limit");
    assert!(most_1s <= 46, "{most_1s} in one second");
    assert!(
        (36.0..=44.0).contains(&while_down),
        "40/s enforced while the admin was down, not {while_down:.1}/s"
    );
    assert_eq!(count(&outcomes, 0), 0, "Envoy answered every request");
    assert_eq!(me["live"], true);

    // Secrets stay out of both logs (the admin's at debug level).
    let cookie_and_csrf = op.secrets();
    let admin_log = admin.log();
    let envoy_log = envoy.log();
    let mut leaks = Vec::new();
    for (what, secret) in [
        ("the password", PASSWORD.to_string()),
        ("the sync token", SYNC_TOKEN.to_string()),
        ("the session cookie", cookie_and_csrf.0),
        ("the CSRF token", cookie_and_csrf.1),
    ] {
        if admin_log.contains(&secret) {
            leaks.push(format!("{what} in the admin's log"));
        }
        if envoy_log.contains(&secret) {
            leaks.push(format!("{what} in Envoy's log"));
        }
    }
    println!(
        "secrets: none of password, sync token, session cookie, CSRF token in {} lines of admin \
         log (debug) or {} lines of Envoy log: {}",
        admin_log.lines().count(),
        envoy_log.lines().count(),
        leaks.is_empty()
    );
    assert!(leaks.is_empty(), "{leaks:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_hot_restart_mid_load() -> anyhow::Result<()> {
    let mut run = BankUnderLoad::start("e2e-hot-restart", MockLimits::default()).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mock_clock_at_restart = run.mock_clock();
    // On this runtime thread, not a spawn_blocking one (see above).
    let parent = tokio::task::block_in_place(|| run.envoy.hot_restart())?;
    // Exited: gone from /proc, or a zombie waiting to be reaped.
    let parent_alive = move || {
        std::fs::read_to_string(format!("/proc/{parent}/stat")).is_ok_and(|stat| {
            stat.rsplit_once(") ")
                .is_some_and(|(_, rest)| !rest.starts_with('Z'))
        })
    };
    let parent_gone = wait_for("the old Envoy to exit", Duration::from_secs(15), || {
        !parent_alive()
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let outcomes = run.finish().await?;
    let (mock, envoy) = (&run.mock, &run.envoy);
    let arrived = mock.arrivals();
    let overlap_end = mock_clock_at_restart + parent_gone;
    let in_overlap: Vec<Arrival> = arrived
        .iter()
        .filter(|a| a.at > mock_clock_at_restart && a.at <= overlap_end)
        .cloned()
        .collect();
    let after: Vec<Arrival> = arrived
        .iter()
        .filter(|a| a.at > overlap_end)
        .cloned()
        .collect();
    let most_1s_overlap = load::most_surely_within(&in_overlap, Duration::from_secs(1)).0;
    let most_1s_after = load::most_surely_within(&after, Duration::from_secs(1)).0;
    let after: Vec<Duration> = after.iter().map(|a| a.at).collect();
    let steady_after = after.len() as f64
        / after
            .last()
            .zip(after.first())
            .map_or(1.0, |(l, f)| (*l - *f).as_secs_f64().max(0.001));
    tokio::time::sleep(Duration::from_millis(400)).await;
    let in_flight = envoy.gauge("bank", "in_flight")?;
    let free = run.free_slots().await;
    println!(
        "hot restart: the old Envoy drained and exited {parent_gone:?} after the new one was live; \
         {} requests, {} passed, {} got 429, {} failed; while both ran: {} reached the mock, most sent and \
         arrived in any 1 s {} (one Envoy's bound 45), most in flight at the mock over the run {} (limit 4); \
         after: most sent and arrived in any 1 s {} (bound 45), {steady_after:.1}/s; in flight {in_flight}; 8 slow \
         requests at once: {} passed",
        outcomes.len(),
        count(&outcomes, 200),
        count(&outcomes, 429),
        count(&outcomes, 0),
        in_overlap.len(),
        most_1s_overlap,
        mock.max_in_flight(),
        most_1s_after,
        free,
    );
    // Each process keeps its own counters (Envoy's shared data is per
    // process): while both serve, the two together stay within twice the
    // limit, and the new one alone within one.
    assert_eq!(count(&outcomes, 0), 0, "no request lost to the restart");
    assert!(most_1s_overlap <= 2 * 46, "{most_1s_overlap} in one second");
    assert!(mock.max_in_flight() <= 8);
    assert!(most_1s_after <= 46, "{most_1s_after} in one second");
    assert_eq!(in_flight, 0.0);
    assert_eq!(free, 4, "no slot leaked");
    Ok(())
}

/// What a budget's calls got: admitted, refused because the budget was
/// not known yet, refused because it was spent.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct BudgetCalls {
    admitted: u32,
    unknown: u32,
    spent: u32,
}

/// `n` calls one after another, each sorted by its answer.
async fn budget_calls(envoy: &Envoy, n: u32, pause: Duration) -> anyhow::Result<BudgetCalls> {
    budget_calls_as(envoy, ("daily", None), n, pause).await
}

/// As [`budget_calls`], of budget `limit`, as `team` (`x-team`) if any.
async fn budget_calls_as(
    envoy: &Envoy,
    (limit, team): (&str, Option<&str>),
    n: u32,
    pause: Duration,
) -> anyhow::Result<BudgetCalls> {
    let http = reqwest::Client::new();
    let mut got = BudgetCalls::default();
    for _ in 0..n {
        let mut call = http
            .get(envoy.url("/v1/route"))
            .header("host", "api.maps.example");
        if let Some(team) = team {
            call = call.header("x-team", team);
        }
        let r = call.send().await?;
        let header = |name: &str| {
            r.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        match (r.status().as_u16(), header("x-sluice-reason").as_deref()) {
            (200, _) => got.admitted += 1,
            (429, Some("budget-unknown")) => got.unknown += 1,
            (429, None) if header("x-sluice-limit").as_deref() == Some(limit) => got.spent += 1,
            (status, reason) => anyhow::bail!(
                "unexpected answer {status} (reason {reason:?}, limit {:?})",
                header("x-sluice-limit")
            ),
        }
        tokio::time::sleep(pause).await;
    }
    Ok(got)
}

/// 50 calls a day for the maps API (a token bucket refilling one call
/// every 29 minutes: nothing during the test). Envoy's own configuration
/// carries the policy too, so it is enforced from the first request.
const DAILY_BUDGET: &str = r#"{"name": "maps", "match": {"host": "api.maps.example"},
    "rate": {"requests": 100, "period": "1s"},
    "limits": [{"name": "daily", "rate": {"requests": 50, "period": "1d"}}]}"#;

/// 5 calls a day per team, in 2 048 places (the policy's own rate far
/// above the test's pace: 16 callers can pass 1 000 calls a second here): the 300 teams' hashes (under
/// the test's sync token: the same every run) each find a place of their
/// own, which at 1 000 places one did not (four probes all taken).
const TEAM_BUDGET: &str = r#"{"name": "maps", "match": {"host": "api.maps.example"},
    "rate": {"requests": 100000, "period": "1s"},
    "limits": [{"name": "team-daily", "rate": {"requests": 5, "period": "1d", "algorithm": "fixed_window"},
                "key": {"header": "x-team", "max_keys": 2048}}]}"#;

/// A team's calls until `tries` were admitted or refused as spent (those
/// refused as `budget-unknown` are tried again).
async fn team_calls(envoy: &Envoy, team: &str, tries: u32) -> anyhow::Result<BudgetCalls> {
    let mut got = BudgetCalls::default();
    let started = Instant::now();
    while got.admitted + got.spent < tries {
        let one = budget_calls_as(envoy, ("team-daily", Some(team)), 1, Duration::ZERO).await?;
        got.admitted += one.admitted;
        got.spent += one.spent;
        got.unknown += one.unknown;
        if one.unknown > 0 {
            anyhow::ensure!(
                started.elapsed() < Duration::from_secs(20),
                "{team}: the budget never opened"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    Ok(got)
}

/// [`team_calls`] for every team, 16 teams at a time, in the teams' order.
async fn each_team(
    envoy: &Envoy,
    teams: &[String],
    tries: u32,
) -> anyhow::Result<Vec<BudgetCalls>> {
    use futures_util::StreamExt;
    futures_util::stream::iter(teams)
        .map(|team| team_calls(envoy, team, tries))
        .buffered(16)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect()
}

/// A daily budget per team is not refilled by an Envoy crash either: 300
/// teams spend 3 of their 5 calls each, Envoy is SIGKILLed and started
/// again, and each team gets exactly the 2 it has left. The admin gives
/// the 300 keys back in two parts (256, then 44; `filter/src/tests/
/// budgets.rs` follows parts); the budget refuses as `budget-unknown`
/// until the last, never lets a call through unknown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daily_budget_per_team_is_not_refilled_by_an_envoy_restart() -> anyhow::Result<()> {
    let mock = MockApi::start("127.0.0.1:0".parse()?, MockLimits::default()).await?;
    let policy: Value = serde_json::from_str(TEAM_BUDGET)?;
    let dir = tempfile::tempdir()?;
    let admin = AdminProcess::start_in(dir.path(), &[]).await?;
    admin.login().await?.create(policy.clone()).await?;
    let config = json!({"instance": "e2e-team-budget", "admin_cluster": "sluice_admin",
        "sync_interval": "200ms", "sync_token": SYNC_TOKEN,
        "fallback": {"version": 0, "policies": [policy]}})
    .to_string();
    let mut envoy = Envoy::start_with_admin(&config, mock.addr.port(), admin.port, WORKERS)?;
    let teams: Vec<String> = (0..300).map(|i| format!("team-{i:03}")).collect();
    let first = each_team(&envoy, &teams, 3).await?;
    let short: Vec<_> = teams
        .iter()
        .zip(&first)
        .filter(|(_, c)| c.admitted != 3)
        .collect();
    anyhow::ensure!(short.is_empty(), "first life: {short:?}");
    // Each report reads 1 024 places, on the worker whose turn it is: two
    // turns of each of the 5 for every key's last spend to reach the
    // admin (10 syncs of 200 ms), and a few more.
    tokio::time::sleep(Duration::from_millis(3_000)).await;
    mock.reset();
    tokio::task::block_in_place(|| envoy.kill_and_restart())?;
    let restarted = Instant::now();
    let after = each_team(&envoy, &teams, 5).await?;
    let admitted: u32 = after.iter().map(|c| c.admitted).sum();
    let unknown: u32 = after.iter().map(|c| c.unknown).sum();
    println!(
        "team budget held by the admin: 300 teams spent 3 of 5 each; after a SIGKILL and restart \
         {admitted} calls went ({unknown} refused as budget-unknown first) over {:?}; the API saw {} calls",
        restarted.elapsed(),
        mock.arrivals().len()
    );
    let wrong: Vec<(&String, &BudgetCalls)> = teams
        .iter()
        .zip(&after)
        .filter(|(_, c)| c.admitted != 2)
        .collect();
    assert!(wrong.is_empty(), "each team only its 2 left: {wrong:?}");
    assert_eq!(mock.arrivals().len(), 600);
    assert!(unknown > 0, "closed until the admin's answers");
    drop(admin);
    Ok(())
}

/// A daily budget is not refilled by an Envoy crash: 30 calls spent, Envoy
/// SIGKILLed and started again, and only the 20 left go through; the calls
/// before the admin's first answer are refused as `budget-unknown`, never
/// let through. Then the admin is down when Envoy restarts: the budget
/// stays closed until the admin is back. Without an admin (the control),
/// the same restart gives the whole budget back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daily_budget_is_not_refilled_by_an_envoy_restart() -> anyhow::Result<()> {
    let mock = MockApi::start("127.0.0.1:0".parse()?, MockLimits::default()).await?;
    let policy: Value = serde_json::from_str(DAILY_BUDGET)?;

    // The control: no admin, so a restart starts the budget afresh.
    let config = json!({"instance": "e2e-budget-alone",
        "fallback": {"version": 1, "policies": [policy.clone()]}})
    .to_string();
    let mut alone = Envoy::start(&config, mock.addr.port(), WORKERS)?;
    let before = budget_calls(&alone, 30, Duration::ZERO).await?;
    tokio::task::block_in_place(|| alone.kill_and_restart())?;
    let after = budget_calls(&alone, 60, Duration::ZERO).await?;
    println!("budget without an admin: {before:?} before the restart, {after:?} after");
    assert_eq!((before.admitted, after.admitted), (30, 50), "refilled");
    drop(alone);

    let dir = tempfile::tempdir()?;
    let (db, log_path) = (dir.path().join("sluice.db"), dir.path().join("admin.log"));
    let port = free_port()?;
    let admin = AdminProcess::start(&db, port, None, &log_path).await?;
    admin.login().await?.create(policy.clone()).await?;
    let config = json!({"instance": "e2e-budget", "admin_cluster": "sluice_admin",
        "sync_interval": "200ms", "sync_token": SYNC_TOKEN,
        "fallback": {"version": 0, "policies": [policy]}})
    .to_string();
    let mut envoy = Envoy::start_with_admin(&config, mock.addr.port(), port, WORKERS)?;
    // Until the first answer the budget is closed; then 30 go.
    let mut first = BudgetCalls::default();
    while first.admitted < 30 {
        let got = budget_calls(&envoy, 1, Duration::from_millis(10)).await?;
        anyhow::ensure!(got.spent == 0, "spent before 30 calls: {first:?}");
        first.admitted += got.admitted;
        first.unknown += got.unknown;
        anyhow::ensure!(first.unknown < 500, "the budget never opened");
    }
    // Two syncs, so the admin holds what the last call left.
    tokio::time::sleep(Duration::from_millis(600)).await;
    mock.reset();
    tokio::task::block_in_place(|| envoy.kill_and_restart())?;
    let restarted = Instant::now();
    let after = budget_calls(&envoy, 300, Duration::from_millis(5)).await?;
    let through = mock.arrivals().len();
    println!(
        "budget held by the admin: first life {first:?}; after a SIGKILL and restart {after:?} \
         over {:?}; the API saw {through} calls after the restart",
        restarted.elapsed()
    );
    assert_eq!(
        after.admitted, 20,
        "only what was left of the day: {after:?}"
    );
    assert_eq!(through, 20);
    assert!(after.spent > 0, "and then the budget refuses: {after:?}");
    let unknown_stat = envoy.limit_stat("daily", "budget_unknown")?;
    assert_eq!(unknown_stat, f64::from(after.unknown));

    // The admin is down when Envoy restarts: nothing goes until it is back.
    admin.kill();
    tokio::task::block_in_place(|| envoy.kill_and_restart())?;
    mock.reset();
    let down = budget_calls(&envoy, 40, Duration::from_millis(25)).await?;
    assert_eq!(
        (down.admitted, down.spent),
        (0, 0),
        "closed while unknown: {down:?}"
    );
    let admin = AdminProcess::start(&db, port, None, &log_path).await?;
    let came_back = Instant::now();
    let mut back = BudgetCalls::default();
    while back.spent == 0 {
        let got = budget_calls(&envoy, 1, Duration::from_millis(20)).await?;
        back.admitted += got.admitted;
        back.unknown += got.unknown;
        back.spent += got.spent;
        anyhow::ensure!(
            came_back.elapsed() < Duration::from_secs(20),
            "the budget did not resume: {back:?}"
        );
    }
    println!(
        "admin down while Envoy restarted: {down:?}; admin back, the budget resumed spent after {:?}: {back:?}",
        came_back.elapsed()
    );
    assert_eq!(back.admitted, 0, "still spent: {back:?}");
    assert_eq!(mock.arrivals().len(), 0);
    drop(admin);
    Ok(())
}
