//! Listening to the provider, through a real Envoy (`--concurrency 4`): a
//! refusal with `Retry-After` one worker sees pauses the limit for every
//! worker; waits that do not parse, or are too long, never stop calls
//! longer than `max_pause`.

use std::time::Duration;

use sluice_demo::mock::{MockApi, MockLimits};
use sluice_e2e::envoy::Envoy;
use sluice_e2e::load::{self, closed_loop, count};

const WORKERS: u32 = 4;
const HOST: &str = "api.provider.example";
/// The mock's arrivals mark the call that was refused with this `x-seq`.
const REFUSED_SEQ: u64 = 424_242;

async fn setup(max_pause: &str) -> anyhow::Result<(MockApi, Envoy)> {
    let mock = MockApi::start("127.0.0.1:0".parse()?, MockLimits::default()).await?;
    let config = format!(
        r#"{{"instance": "e2e-provider", "fallback": {{"version": 1, "policies": [
            {{"name": "api", "match": {{"host": "{HOST}"}},
              "rate": {{"requests": 100000, "period": "1s"}},
              "limits": [{{"name": "provider-rate", "rate": {{"requests": 100000, "period": "1s"}},
                          "provider": {{"max_pause": "{max_pause}"}}}}]}}]}}}}"#
    );
    let envoy = Envoy::start(&config, mock.addr.port(), WORKERS)?;
    mock.reset();
    Ok((mock, envoy))
}

/// One call the provider refuses with `status` and `Retry-After: wait`.
async fn provoke(
    http: &reqwest::Client,
    url: &str,
    status: u16,
    wait: &str,
) -> anyhow::Result<u16> {
    let r = http
        .get(url)
        .header("host", HOST)
        .header("x-seq", REFUSED_SEQ.to_string())
        .header("x-mock-status", status.to_string())
        .header("x-mock-retry-after", wait)
        .send()
        .await?;
    Ok(r.status().as_u16())
}

async fn plain(http: &reqwest::Client, url: &str) -> anyhow::Result<reqwest::Response> {
    Ok(http.get(url).header("host", HOST).send().await?)
}

/// Stats reach Envoy on the filter's tick (100 ms when idle).
async fn settle() {
    tokio::time::sleep(Duration::from_millis(400)).await;
}

/// 16 clients call as fast as they can for 6 s; at 1.5 s one call gets
/// the provider's 429 with `Retry-After: 3`. The mock sees nothing from
/// any of the 4 workers for 3 s (± 100 ms) after it, then calls resume;
/// the callers meanwhile get 429 naming the limit and the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_429_with_retry_after_stops_every_worker_for_that_long() -> anyhow::Result<()> {
    let (mock, envoy) = setup("10s").await?;
    let url = envoy.url("/v1/orders");
    let load_url = url.clone();
    let load = tokio::spawn(closed_loop(16, Duration::from_secs(6), move |c, _| {
        c.get(&load_url).header("host", HOST)
    }));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let http = load::client();
    let provoked = provoke(&http, &url, 429, "3").await?;
    let outcomes = load.await?;
    settle().await;

    let arrivals = mock.arrivals();
    let refused_at = arrivals
        .iter()
        .find(|a| a.seq == Some(REFUSED_SEQ))
        .map(|a| a.at)
        .ok_or_else(|| anyhow::anyhow!("the refused call never reached the provider"))?;
    // Calls already past the filter when the pause began may still arrive
    // in the first few milliseconds.
    let in_flight_grace = Duration::from_millis(50);
    let during: Vec<Duration> = arrivals
        .iter()
        .map(|a| a.at)
        .filter(|&at| {
            at > refused_at + in_flight_grace && at < refused_at + Duration::from_millis(2900)
        })
        .collect();
    let resumed = arrivals
        .iter()
        .map(|a| a.at)
        .filter(|&at| at > refused_at + in_flight_grace)
        .min()
        .map(|at| at - refused_at);
    let by_pause = outcomes
        .iter()
        .filter(|o| {
            o.status == 429
                && o.headers
                    .get("x-sluice-reason")
                    .is_some_and(|v| v == "provider-pause")
                && o.headers
                    .get("x-sluice-limit")
                    .is_some_and(|v| v == "provider-rate")
        })
        .count();
    let paused = envoy.limit_stat("provider-rate", "paused")?;
    let provider_refused = envoy.limit_stat("provider-rate", "provider_refused")?;
    println!(
        "retry-after 3 s: {} calls by 16 clients; the provider's 429 (answered {provoked}) at {refused_at:?}; \
         the provider saw {} calls in the pause after the first {in_flight_grace:?}, the next {resumed:?} after the 429; \
         callers got {by_pause} × 429 provider-pause of {} × 429; stats: paused {paused}, provider_refused {provider_refused}",
        outcomes.len(),
        during.len(),
        count(&outcomes, 429),
    );
    assert_eq!(provoked, 429, "the provider's refusal reaches its caller");
    assert!(
        during.is_empty(),
        "{} calls went during the pause: {:?}",
        during.len(),
        &during[..during.len().min(5)]
    );
    let resumed = resumed.ok_or_else(|| anyhow::anyhow!("calls never resumed"))?;
    assert!(
        resumed >= Duration::from_millis(2900) && resumed <= Duration::from_millis(3100),
        "calls resumed {resumed:?} after the 429 (3 s ± 100 ms)"
    );
    assert!(
        by_pause > 0,
        "callers are told the provider paused the limit"
    );
    assert_eq!(
        paused, 1.0,
        "one pause, begun by the worker that saw the 429"
    );
    assert_eq!(provider_refused, 1.0);
    assert!(
        envoy
            .log()
            .contains("limit provider-rate paused for 3000 ms"),
        "a log line for the pause"
    );
    Ok(())
}

/// Waits that do not parse pause nothing and are counted; a wait longer
/// than `max_pause` (2 s here), however far, pauses for 2 s; Envoy keeps
/// answering throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_and_huge_waits_are_ignored_or_capped() -> anyhow::Result<()> {
    let (_mock, envoy) = setup("2s").await?;
    let url = envoy.url("/v1/orders");
    let http = load::client();
    let long = "9".repeat(4000);
    let malformed = [
        "-3",
        "soon",
        "1.5",
        "3 s",
        "Tue, 99 Foo 2026 25:61:61 GMT",
        &long,
    ];
    for wait in malformed {
        let provoked = provoke(&http, &url, 429, wait).await?;
        let next = plain(&http, &url).await?.status().as_u16();
        println!(
            "Retry-After {:?}: provider {provoked}, next call {next}",
            &wait[..wait.len().min(32)]
        );
        assert_eq!(provoked, 429);
        assert_eq!(next, 200, "{wait:?} must not pause");
    }
    let huge = [
        "99999999999999999999",
        "Fri, 31 Dec 9999 23:59:59 GMT",
        "86400",
    ];
    for wait in huge {
        let provoked = provoke(&http, &url, 503, wait).await?;
        let started = std::time::Instant::now();
        let first = plain(&http, &url).await?;
        let first_status = first.status().as_u16();
        let retry_after = first
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let mut resumed = None;
        while started.elapsed() < Duration::from_secs(5) {
            if plain(&http, &url).await?.status().as_u16() == 200 {
                resumed = Some(started.elapsed());
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        println!(
            "Retry-After {wait:?}: provider {provoked}; next call {first_status} (Retry-After {retry_after:?}); calls resumed after {resumed:?}"
        );
        assert_eq!(provoked, 503);
        assert_eq!(first_status, 429, "{wait:?} pauses");
        assert!(
            retry_after.is_some_and(|s| s <= 2),
            "the caller's wait is within the cap"
        );
        let resumed = resumed.ok_or_else(|| anyhow::anyhow!("{wait:?} paused past 5 s"))?;
        // Not before the cap; after it, within what a loaded machine adds
        // to this loop's calls (2.17 s was seen beside the other suites).
        // The cap to 10 ms, neither sooner nor later, is the worker's
        // unit test's (filter/src/tests/provider.rs).
        assert!(
            resumed >= Duration::from_millis(1850) && resumed <= Duration::from_millis(3500),
            "{wait:?} paused {resumed:?}, not the 2 s cap"
        );
    }
    settle().await;
    let malformed_stat = envoy.limit_stat("provider-rate", "signal_malformed")?;
    let capped = envoy.limit_stat("provider-rate", "pause_capped")?;
    let paused = envoy.limit_stat("provider-rate", "paused")?;
    println!("stats: signal_malformed {malformed_stat}, pause_capped {capped}, paused {paused}");
    assert_eq!(malformed_stat as usize, malformed.len());
    assert_eq!(capped as usize, huge.len());
    assert_eq!(paused as usize, huge.len());
    assert!(!envoy.log().contains("panicked"), "the filter never panics");
    Ok(())
}

/// A run of `seconds` against a provider of `signals` whose limit starts at
/// 100 a second and drops to `drop_to` at 2 s (0: never), with a hidden
/// consumer sending `hidden_per_second` straight to it; Sluice's limit is
/// 100 a second, listening to the provider as `listen` says (None: not at
/// all).
struct Run {
    windows: Vec<sluice_demo::provider::Window>,
    calls: usize,
    sluice_refused_locally: usize,
}

async fn run_against_provider(
    signals: sluice_demo::provider::Signals,
    listen: Option<&str>,
    (drop_to, hidden_per_second): (u64, u64),
    seconds: u64,
) -> anyhow::Result<Run> {
    use sluice_demo::provider::MockProvider;
    let provider = MockProvider::start(100, signals, Duration::from_millis(10)).await?;
    let listen = listen
        .map(|provider| format!(r#", "provider": {provider}"#))
        .unwrap_or_default();
    let config = format!(
        r#"{{"instance": "e2e-follow", "fallback": {{"version": 1, "policies": [
            {{"name": "api", "match": {{"host": "{HOST}"}},
              "rate": {{"requests": 100000, "period": "1s"}},
              "limits": [{{"name": "requests", "rate": {{"requests": 100, "period": "1s"}}{listen}}}]}}]}}}}"#
    );
    let envoy = Envoy::start(&config, provider.addr.port(), WORKERS)?;
    // Runs whole provider seconds: from the start of its next second.
    let until_next = Duration::from_secs(provider.elapsed().as_secs() + 1) - provider.elapsed();
    tokio::time::sleep(until_next).await;
    let first_second = provider.elapsed().as_secs();
    let url = envoy.url("/v1/orders");
    let load = tokio::spawn(closed_loop(
        24,
        Duration::from_secs(seconds),
        move |c, _| c.get(&url).header("host", HOST),
    ));
    let hidden = (hidden_per_second > 0).then(|| {
        let direct = format!("http://{}/v1/orders", provider.addr);
        tokio::spawn(async move {
            let http = load::client();
            let every = Duration::from_micros(1_000_000 / hidden_per_second);
            let mut tick = tokio::time::interval(every);
            let started = std::time::Instant::now();
            while started.elapsed() < Duration::from_secs(seconds) {
                tick.tick().await;
                let call = http.get(&direct).header("x-hidden", "1").send();
                tokio::spawn(call);
            }
        })
    });
    if drop_to > 0 {
        let at = Duration::from_secs(first_second + 2);
        tokio::time::sleep(at.saturating_sub(provider.elapsed())).await;
        provider.set_limit(drop_to);
    }
    let outcomes = load.await?;
    if let Some(hidden) = hidden {
        hidden.await?;
    }
    let windows = provider.windows();
    // The whole seconds of the run, after its first.
    let from = usize::try_from(first_second + 1)?;
    let to = usize::try_from(first_second + seconds)?.min(windows.len());
    Ok(Run {
        windows: windows.get(from..to).map(<[_]>::to_vec).unwrap_or_default(),
        calls: outcomes.len(),
        sluice_refused_locally: outcomes
            .iter()
            .filter(|o| o.status == 429 && o.headers.contains_key("x-sluice-policy"))
            .count(),
    })
}

/// How long a control run (Sluice not listening) lasts: its whole seconds
/// after the first are one before the provider's limit drops (at 2 s) and
/// two after it, which are all it needs to show the provider refusing.
const CONTROL_SECONDS: u64 = 4;

fn describe(run: &Run) -> String {
    run.windows
        .iter()
        .map(|w| {
            let hidden = if w.hidden_accepted + w.hidden_refused > 0 {
                format!(" + hidden {}/{}", w.hidden_accepted, w.hidden_refused)
            } else {
                String::new()
            };
            format!("{}/{} of {}{hidden}", w.accepted, w.refused, w.limit)
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn provider_refused_share(run: &Run) -> f64 {
    let refused: u64 = run.windows.iter().map(|w| w.refused).sum();
    let sent: u64 = run.windows.iter().map(|w| w.accepted + w.refused).sum();
    refused as f64 / sent.max(1) as f64
}

/// The provider's limit drops from 100/s to 40/s at 2 s; Sluice is told
/// 100/s. Following the provider's count (OpenAI's headers, and the IETF
/// fields), the provider refuses at most 1 % of the calls after the first
/// second; with OpenAI's millisecond resets it still gets at least 90 % of
/// its limit over the run. The same run not following it is reported
/// beside.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_providers_limit_drops_and_following_its_count_keeps_refusals_under_1_percent(
) -> anyhow::Result<()> {
    use sluice_demo::provider::Signals;
    let openai = run_against_provider(
        Signals::OpenAi,
        Some(r#"{"headers": "openai-requests"}"#),
        (40, 0),
        6,
    )
    .await?;
    let ietf =
        run_against_provider(Signals::Ietf, Some(r#"{"headers": "ietf"}"#), (40, 0), 6).await?;
    // The control: not following, the provider refuses from the drop on
    // (two seconds after it show it).
    let blind = run_against_provider(Signals::OpenAi, None, (40, 0), CONTROL_SECONDS).await?;
    for (name, run) in [
        ("following openai", &openai),
        ("following ietf", &ietf),
        ("not following", &blind),
    ] {
        println!(
            "limit 100 -> 40/s, {name}: {} calls, {} refused by Sluice; provider per second (accepted/refused of limit): {}; provider refused {:.2} %",
            run.calls,
            run.sluice_refused_locally,
            describe(run),
            100.0 * provider_refused_share(run)
        );
    }
    assert_eq!(openai.windows.len(), 5, "five whole seconds measured");
    for run in [&openai, &ietf] {
        assert!(provider_refused_share(run) <= 0.01, "{}", describe(run));
    }
    // OpenAI's resets are in milliseconds: the limit is used, 90 % of it
    // over the run and at least half of each second. Not 90 % of every
    // second: on a loaded machine the answers carrying the provider's
    // count come back late, and a follower of a stale count holds back
    // (a clean CI run with lint and the simulator beside it: 35 of 40 in
    // the second of the drop). What a follower serves whatever the
    // answers' delays is the simulator's claim, in virtual time:
    // `tests/sim/tests/listening.rs` (at least 90 % served a second).
    // The IETF `t` is whole seconds, which cannot place a one-second
    // window's reset: Sluice waits for it on the safe side (reported).
    let accepted: u64 = openai.windows.iter().map(|w| w.accepted).sum();
    let limits: u64 = openai.windows.iter().map(|w| w.limit).sum();
    assert!(
        accepted * 100 >= limits * 90 && openai.windows.iter().all(|w| w.accepted * 2 >= w.limit),
        "the provider's limit is still used: {}",
        describe(&openai)
    );
    assert!(
        provider_refused_share(&blind) > 0.2,
        "without following, the provider refuses: {}",
        describe(&blind)
    );
    Ok(())
}

/// A hidden consumer takes 30 of the provider's 100 a second. Following
/// the provider's count, Sluice's calls plus theirs stay within the
/// provider's limit: it refuses at most one of Sluice's calls a second
/// (the race for its last slot), and the two together use at least 90 %
/// of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hidden_consumer_shares_the_quota_and_following_leaves_them_room() -> anyhow::Result<()> {
    use sluice_demo::provider::Signals;
    let following = run_against_provider(
        Signals::OpenAi,
        Some(r#"{"headers": "openai-requests"}"#),
        (0, 30),
        6,
    )
    .await?;
    let blind = run_against_provider(Signals::OpenAi, None, (0, 30), CONTROL_SECONDS).await?;
    for (name, run) in [("following", &following), ("not following", &blind)] {
        let hidden_refused: u64 = run.windows.iter().map(|w| w.hidden_refused).sum();
        println!(
            "hidden consumer 30/s of 100/s, {name}: {} calls; provider per second (Sluice accepted/refused of limit + hidden accepted/refused): {}; \
             provider refused {:.2} % of Sluice's calls and {hidden_refused} of the hidden consumer's",
            run.calls,
            describe(run),
            100.0 * provider_refused_share(run)
        );
    }
    assert_eq!(following.windows.len(), 5);
    // The hidden consumer's calls are seen only in the answers that come
    // after them: the provider's last slot of a second can go to either,
    // so one of Sluice's calls a second may lose that race, never more.
    assert!(
        provider_refused_share(&following) <= 0.02,
        "{}",
        describe(&following)
    );
    for w in &following.windows {
        assert!(w.refused <= 1, "{}", describe(&following));
        assert!(w.accepted + w.hidden_accepted <= w.limit);
        assert!(
            (w.accepted + w.hidden_accepted) * 100 >= w.limit * 90,
            "the quota is used: {}",
            describe(&following)
        );
    }
    assert!(provider_refused_share(&blind) > 0.1, "{}", describe(&blind));
    Ok(())
}

/// The provider's limit drops from 100/s to 40/s at 2 s and it says only
/// "429" (no headers). Adapting, the provider refuses fewer than 5 % of
/// the calls after the first second and the rate settles within 10 % of
/// 40/s over the last 5 s; the same run without adapting is reported
/// beside.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapting_to_refusals_alone_settles_near_the_providers_new_limit() -> anyhow::Result<()> {
    use sluice_demo::provider::Signals;
    let adaptive =
        run_against_provider(Signals::None, Some(r#"{"adaptive": true}"#), (40, 0), 12).await?;
    let blind = run_against_provider(Signals::None, None, (40, 0), CONTROL_SECONDS).await?;
    let settled = |run: &Run| {
        let last: Vec<_> = run.windows.iter().rev().take(5).collect();
        last.iter().map(|w| w.accepted as f64).sum::<f64>() / last.len().max(1) as f64
    };
    for (name, run) in [("adaptive", &adaptive), ("not adapting", &blind)] {
        println!(
            "limit 100 -> 40/s, only 429s, {name}: {} calls; provider per second (accepted/refused of limit): {}; \
             provider refused {:.2} %; accepted {:.1}/s over the last 5 s",
            run.calls,
            describe(run),
            100.0 * provider_refused_share(run),
            settled(run)
        );
    }
    assert_eq!(adaptive.windows.len(), 11, "eleven whole seconds measured");
    assert!(
        provider_refused_share(&adaptive) < 0.05,
        "{}",
        describe(&adaptive)
    );
    let rate = settled(&adaptive);
    assert!(
        (36.0..=44.0).contains(&rate),
        "settled at {rate:.1}/s: {}",
        describe(&adaptive)
    );
    assert!(provider_refused_share(&blind) > 0.2, "{}", describe(&blind));
    Ok(())
}

/// Fleet mode: two Envoys share the limit through one admin (syncing
/// every 200 ms). Envoy a's provider answers 429 with `Retry-After: 3`;
/// a stops at once, and b once it hears of it from the admin, well within
/// the pause; both resume when it ends, 3 s after the 429, and not
/// before. The admin's live view shows the pause, why and for how long.
/// The bounds have room for a loaded machine (one run beside another
/// suite's unit tests saw b stop 809 ms after, its syncs late); how soon
/// b hears on an idle one is `make bench`'s (docs/BENCHMARKS.md section
/// 10, a member's pause through the admin: 125 ms).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_one_envoy_sees_pauses_the_other_envoy_through_the_admin() -> anyhow::Result<()> {
    use sluice_e2e::admin::{AdminProcess, SYNC_TOKEN};

    let dir = tempfile::tempdir()?;
    // The admin as its own process, as an operator runs it: in the test's
    // runtime beside the load's 16 connections on a loaded machine it
    // answered b's syncs late (b heard of the pause 1.88 s after a's 429,
    // in a clean run of bbb9aec).
    let admin = AdminProcess::start_in(dir.path(), &[]).await?;
    let op = admin.login().await?;
    op.create(serde_json::json!({
        "name": "api", "match": {"host": HOST},
        "rate": {"requests": 100000, "period": "1s"},
        "limits": [{"name": "provider-rate", "scope": "global",
                    "rate": {"requests": 100000, "period": "1s"},
                    "provider": {"max_pause": "10s"}}]}))
        .await?;
    let mock = MockApi::start("127.0.0.1:0".parse()?, MockLimits::default()).await?;
    let config = |instance: &str| {
        serde_json::json!({"instance": instance, "admin_cluster": "sluice_admin",
            "sync_interval": "200ms", "sync_token": SYNC_TOKEN,
            "fallback": {"version": 1, "policies": []}})
        .to_string()
    };
    let a = Envoy::start_with_admins(&config("fleet-a"), mock.addr.port(), &[admin.port], WORKERS)?;
    let b = Envoy::start_with_admins(&config("fleet-b"), mock.addr.port(), &[admin.port], 2)?;
    // Both hold a share before the load starts: a new admin leases none
    // for its first lease, and a fixed wait measured that too (the native
    // build's Envoys, quicker to start, beside the other suites refused
    // every call for 4 s, the 429 to provoke among them).
    op.wait_for_shares(&["fleet-a", "fleet-b"]).await?;
    mock.reset();
    let through = |envoy: &Envoy, tag: &'static str| {
        let url = envoy.url("/v1/orders");
        tokio::spawn(closed_loop(8, Duration::from_secs(8), move |c, _| {
            c.get(&url).header("host", HOST).header("x-api-key", tag)
        }))
    };
    let (load_a, load_b) = (through(&a, "a"), through(&b, "b"));
    // Shares follow the demand within a few leases.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let http = load::client();
    let provoked = provoke(&http, &a.url("/v1/orders"), 429, "3").await?;
    // The live view's frames come each second, from what the Envoys said
    // at their syncs: the newest, from 1 s after the 429 on, until one
    // shows the pause (one clean run's, on a loaded machine, did not yet
    // at 1 s) or the pause is nearly over.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let until = tokio::time::Instant::now() + Duration::from_millis(1500);
    let live = loop {
        let live = op.live_history().await?;
        if newest_pause(&live)["status"] == 429 || tokio::time::Instant::now() >= until {
            break live;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let (outcomes_a, outcomes_b) = (load_a.await?, load_b.await?);
    settle().await;

    let arrivals = mock.arrivals();
    let statuses = |outcomes: &[load::Outcome]| -> std::collections::BTreeMap<u16, usize> {
        outcomes.iter().fold(Default::default(), |mut m, o| {
            *m.entry(o.status).or_default() += 1;
            m
        })
    };
    let reasons = |outcomes: &[load::Outcome]| -> std::collections::BTreeMap<String, usize> {
        outcomes
            .iter()
            .filter(|o| o.status == 429)
            .fold(Default::default(), |mut m, o| {
                let h = |n: &str| o.header(n).unwrap_or("-");
                *m.entry(format!(
                    "{}/{}/{}",
                    h("x-sluice-limit"),
                    h("x-sluice-reason"),
                    o.started.as_millis() / 1000
                ))
                .or_default() += 1;
                m
            })
    };
    let refused_at = arrivals
        .iter()
        .find(|x| x.seq == Some(REFUSED_SEQ))
        .map(|x| x.at)
        .ok_or_else(|| {
            anyhow::anyhow!(
                "the refused call never reached the provider (answered {provoked}); a's callers got {:?}, b's {:?}",
                reasons(&outcomes_a),
                reasons(&outcomes_b)
            )
        })?;
    let from = |tag: &str| -> Vec<Duration> {
        arrivals
            .iter()
            .filter(|x| x.key.as_deref() == Some(tag))
            .map(|x| x.at)
            .collect()
    };
    let (at_a, at_b) = (from("a"), from("b"));
    // The last call each let through before stopping, and the first after.
    let stopped = |at: &[Duration]| {
        at.iter()
            .filter(|&&t| t > refused_at && t < refused_at + Duration::from_millis(2000))
            .max()
            .map_or(Duration::ZERO, |&t| t - refused_at)
    };
    let resumed = |at: &[Duration]| {
        at.iter()
            .filter(|&&t| t > refused_at + Duration::from_millis(2000))
            .min()
            .map(|&t| t - refused_at)
    };
    let (stopped_a, stopped_b) = (stopped(&at_a), stopped(&at_b));
    let (resumed_a, resumed_b) = (resumed(&at_a), resumed(&at_b));
    let before_b = at_b
        .iter()
        .filter(|&&t| t < refused_at && t + Duration::from_secs(1) > refused_at)
        .count();
    let statuses_b = statuses(&outcomes_b);
    let paused_b = b.limit_stat("provider-rate", "paused")?;
    // The newest frame looked at: the pause, why, how long it ran and
    // has left.
    let shown = newest_pause(&live);
    let (ran, left) = (
        shown["ran_ms"].as_u64().unwrap_or(0),
        shown["left_ms"].as_u64().unwrap_or(0),
    );
    // A pause relayed to b ends when a's does: b shows it shorter by how
    // late it heard (`stopped_b`, at most 1.5 s), give or take a frame's
    // rounding.
    let heard_late = u64::try_from(stopped_b.as_millis()).unwrap_or(u64::MAX);
    let shortest = 2_850u64.saturating_sub(heard_late);
    let pause_shown =
        shown["status"] == 429 && left > 0 && (shortest..=3_150).contains(&(ran + left));
    println!(
        "fleet pause: the provider's 429 (answered {provoked}) through a at {refused_at:?}; \
         a let its last call through {stopped_a:?} after it and resumed {resumed_a:?} after; \
         b ({before_b} calls in the second before) let its last through {stopped_b:?} after and resumed {resumed_b:?} after; \
         b's paused stat {paused_b}, its callers got {statuses_b:?}; {} arrivals from a; {} + {} calls by the clients; the live view's newest frame looked at: {shown}",
        at_a.len(),
        outcomes_a.len(),
        outcomes_b.len(),
    );
    assert_eq!(provoked, 429);
    assert!(before_b > 100, "b was calling before: {before_b}");
    // a's calls already on their way when the 429 came still arrive.
    assert!(
        stopped_a <= Duration::from_millis(200),
        "a stopped after {stopped_a:?}"
    );
    // b hears of it at its next sync after a's (a syncs within a tick):
    // within half the pause, however late a loaded machine runs them.
    assert!(
        stopped_b <= Duration::from_millis(1500),
        "b stopped after {stopped_b:?}"
    );
    for (name, resumed) in [("a", resumed_a), ("b", resumed_b)] {
        let resumed = resumed.ok_or_else(|| anyhow::anyhow!("{name} never resumed"))?;
        assert!(
            resumed >= Duration::from_millis(2900) && resumed <= Duration::from_millis(3500),
            "{name} resumed {resumed:?} after the 429 (3 s, and not before)"
        );
    }
    assert_eq!(paused_b, 1.0, "b paused once, on the admin's word");
    assert!(b.log().contains("relayed by the admin"));
    assert!(pause_shown, "the live view shows the pause: {shown}");
    Ok(())
}

/// The pause of limit `provider-rate` in the live view's newest frame
/// (null when there is none).
fn newest_pause(live: &serde_json::Value) -> serde_json::Value {
    live.as_array()
        .and_then(|frames| frames.last())
        .map(|f| f["limits"]["provider-rate"]["provider"]["pause"].clone())
        .unwrap_or_default()
}

/// `ratelimit_headers: always`: every answer a caller gets through Envoy
/// says where the limits stand, the provider's count included (OpenAI's
/// headers say 40 a second, below the policy's 100), and the provider's
/// own 429 with `Retry-After: 2` says 0 left for 2 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admitted_answers_tell_callers_where_the_limits_stand() -> anyhow::Result<()> {
    use sluice_demo::provider::{MockProvider, Signals};
    let provider = MockProvider::start(40, Signals::OpenAi, Duration::from_millis(1)).await?;
    let config = format!(
        r#"{{"instance": "e2e-tell", "fallback": {{"version": 1, "policies": [
            {{"name": "api", "match": {{"host": "{HOST}"}}, "ratelimit_headers": "always",
              "rate": {{"requests": 1000, "period": "1s"}},
              "limits": [{{"name": "requests", "rate": {{"requests": 100, "period": "1s"}},
                          "provider": {{"headers": "openai-requests", "max_pause": "10s"}}}}]}}]}}}}"#
    );
    let envoy = Envoy::start(&config, provider.addr.port(), WORKERS)?;
    let http = load::client();
    let url = envoy.url("/v1/orders");
    let mut told = Vec::new();
    for _ in 0..5 {
        let r = plain(&http, &url).await?;
        let field = |name: &str| {
            r.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_string()
        };
        told.push((
            r.status().as_u16(),
            field("ratelimit-policy"),
            field("ratelimit"),
        ));
    }
    let refused = provoke(&http, &url, 429, "2").await?;
    let after = plain(&http, &url).await?;
    let refused_told = {
        // The provider's own answer, passed on: read it again through a
        // call that is not refused by the pause (the mock answers any).
        after
            .headers()
            .get("ratelimit")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string()
    };
    println!(
        "tell callers: answers {told:?}; after the provider's 429 (answered {refused}) the next call got {} with RateLimit {refused_told:?}",
        after.status()
    );
    for (status, policy, state) in &told {
        assert_eq!(*status, 200);
        assert_eq!(policy, r#""api";q=1000;w=1, "requests";q=100;w=1"#);
        let left = state
            .split(", ")
            .find_map(|item| item.strip_prefix(r#""requests";r="#))
            .and_then(|rest| rest.split(';').next())
            .and_then(|n| n.parse::<u64>().ok());
        assert!(
            left.is_some_and(|n| n < 40),
            "the provider's count (40 a second) is told: {state}"
        );
    }
    assert_eq!(refused, 429);
    assert_eq!(after.status().as_u16(), 429, "paused");
    assert!(
        refused_told.contains(r#""requests";r=0;t=2"#),
        "{refused_told}"
    );
    Ok(())
}

/// A holder of the sync token posing as an Envoy ("rogue") reports, at
/// every sync for 8 s, that its provider paused a shared limit for a
/// minute. A real Envoy syncing with the same admin is held by that news
/// for the limit's `max_pause` (2 s) in total, not for the 8 s nor the
/// minute: the admin relays one stretch of news for at most `max_pause`,
/// and the Envoy takes no more from one stretch either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rogue_re_reporting_a_pause_holds_the_others_for_max_pause_in_total() -> anyhow::Result<()>
{
    use sluice_e2e::admin::{AdminProcess, SYNC_TOKEN};
    use sluice_wire::sync::{LimitReport, PauseReport, ProviderReport, SyncReport};

    let dir = tempfile::tempdir()?;
    // Its own process, as in the fleet pause above.
    let admin = AdminProcess::start_in(dir.path(), &[]).await?;
    let op = admin.login().await?;
    let version = op
        .create(serde_json::json!({
            "name": "api", "match": {"host": HOST},
            "rate": {"requests": 100000, "period": "1s"},
            "limits": [{"name": "provider-rate", "scope": "global",
                        "rate": {"requests": 100000, "period": "1s"},
                        "provider": {"max_pause": "2s"}}]}))
        .await?;
    let mock = MockApi::start("127.0.0.1:0".parse()?, MockLimits::default()).await?;
    let config = serde_json::json!({"instance": "honest", "admin_cluster": "sluice_admin",
        "sync_interval": "200ms", "sync_token": SYNC_TOKEN,
        "fallback": {"version": 1, "policies": []}})
    .to_string();
    let envoy = Envoy::start_with_admins(&config, mock.addr.port(), &[admin.port], 2)?;
    // Its share of the limit, within a few syncs.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let url = envoy.url("/v1/orders");
    let load = tokio::spawn(closed_loop(4, Duration::from_secs(10), move |c, _| {
        c.get(&url).header("host", HOST)
    }));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rogue = {
        let sync = format!("{}/api/v1/sync", admin.base());
        tokio::spawn(async move {
            let http = load::client();
            let started = std::time::Instant::now();
            let mut reports = 0;
            while started.elapsed() < Duration::from_secs(8) {
                let mut report = SyncReport {
                    instance: "rogue".into(),
                    policy_version: version,
                    at_ms: 1,
                    ..SyncReport::default()
                };
                report.limits.insert(
                    "provider-rate".into(),
                    LimitReport {
                        provider: Some(ProviderReport {
                            pause: Some(PauseReport {
                                ran_ms: 0,
                                left_ms: 60_000,
                                status: 429,
                                relayed: false,
                            }),
                            ..ProviderReport::default()
                        }),
                        ..LimitReport::default()
                    },
                );
                let _ = http
                    .post(&sync)
                    .header("authorization", format!("Bearer {SYNC_TOKEN}"))
                    .header("content-type", "application/json")
                    .body(serde_json::to_string(&report).unwrap_or_default())
                    .send()
                    .await;
                reports += 1;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            reports
        })
    };
    let reports = rogue.await?;
    let outcomes = load.await?;
    let paused: Vec<_> = outcomes
        .iter()
        .filter(|o| {
            o.status == 429
                && o.headers
                    .get("x-sluice-reason")
                    .is_some_and(|r| r == "provider-pause")
        })
        .map(|o| o.started)
        .collect();
    let held = match (paused.iter().min(), paused.iter().max()) {
        (Some(first), Some(last)) => *last - *first,
        _ => Duration::ZERO,
    };
    let passed = count(&outcomes, 200);
    let paused_stat = envoy.limit_stat("provider-rate", "paused")?;
    println!(
        "a rogue's pause news, {reports} reports of a 60 s pause over 8 s (max_pause 2 s): the honest Envoy refused \
         {} calls for the pause, over {held:.2?} from the first to the last; {passed} calls passed; pauses begun {paused_stat}",
        paused.len()
    );
    assert!(!paused.is_empty(), "the news was relayed");
    assert!(held <= Duration::from_millis(2_300), "held {held:?}");
    admin.kill();
    Ok(())
}
