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
        assert!(
            resumed >= Duration::from_millis(1850) && resumed <= Duration::from_millis(2150),
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
