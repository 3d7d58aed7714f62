//! Listening that uses what the provider gives, through a real Envoy
//! (`--concurrency 4`): a sliding token quota is used as it frees, not
//! only at its reset; an adaptive limit whose provider's limit drops
//! settles under it, neither refused again and again nor idle.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice_demo::provider::{MockProvider, Signals, Strict};
use sluice_demo::sliding::SlidingTokens;
use sluice_e2e::envoy::Envoy;
use sluice_e2e::load::{self, closed_loop, Outcome};

const WORKERS: u32 = 4;
const HOST: &str = "api.llm.example";

/// A call's tokens: 50 to 400, spread as a mix of prompts would be.
fn tokens_of(i: u64) -> u64 {
    50 + (i.wrapping_mul(2_654_435_761) % 351)
}

/// Sends `per_second` calls a second for key `key` until `stop`, each
/// saying its tokens (which the provider counts and answers as its
/// usage) and an estimate 60 % above them (as an LLM call's
/// `max_tokens` is above what its answer uses); the outcomes.
fn paced_tokens(
    url: String,
    key: &'static str,
    per_second: u64,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Vec<Outcome>> {
    tokio::spawn(async move {
        let http = load::client();
        let origin = Instant::now();
        let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / per_second));
        let mut calls = Vec::new();
        let mut i = 0u64;
        while !stop.load(Ordering::SeqCst) {
            tick.tick().await;
            i += 1;
            let request = http
                .post(&url)
                .header("host", HOST)
                .header("x-key", key)
                .header("x-tokens", tokens_of(i).to_string())
                .header("x-estimate", (tokens_of(i) * 8 / 5).to_string());
            calls.push(tokio::spawn(load::send(request, origin)));
        }
        let mut outcomes = Vec::new();
        for call in calls {
            if let Ok(o) = call.await {
                outcomes.push(o);
            }
        }
        outcomes
    })
}

/// The provider allows 5 000 tokens per key in any 12 s and resets to
/// whole when a key's window empties; Sluice is told 10 000 per 12 s per
/// key and follows OpenAI's token headers. Two keys each ask for three
/// times the quota for 48 s, each call estimated 60 % above what its
/// answer's usage then says it used. After the first window, each key
/// uses at least 90 % of its quota, and the provider refuses at most
/// 0.5 % of the calls: the shape of OpenAI's 40 000 a minute told against 20 000 in a
/// sliding minute, at a fifth of the time. With `SLUICE_SLIDING_MINUTE`
/// set it runs the minute itself: 20 000 in any 60 s, told 40 000 a
/// minute, for 4 minutes (docs/BENCHMARKS.md, section 11).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sliding_token_quota_is_used_as_it_frees() -> anyhow::Result<()> {
    let minute = std::env::var_os("SLUICE_SLIDING_MINUTE").is_some();
    let (quota, window, run) = if minute {
        (20_000, Duration::from_secs(60), Duration::from_secs(240))
    } else {
        (5_000, Duration::from_secs(12), Duration::from_secs(48))
    };
    let per_second = if minute { 3 } else { 6 };
    let provider = SlidingTokens::start(quota, window, Duration::from_millis(20)).await?;
    let config = format!(
        r#"{{"instance": "e2e-sliding", "fallback": {{"version": 1, "policies": [
            {{"name": "llm", "match": {{"host": "{HOST}"}},
              "rate": {{"requests": 100000, "period": "1s"}},
              "limits": [{{"name": "tokens", "rate": {{"requests": {told}, "period": "{period}s"}},
                          "key": {{"header": "x-key"}},
                          "cost": {{"header": "x-estimate", "default": 1, "max": 8000}},
                          "usage": {{"json": ["usage.total_tokens"]}},
                          "provider": {{"headers": "openai-tokens"}}}}]}}]}}}}"#,
        told = 2 * quota,
        period = window.as_secs()
    );
    let envoy = Envoy::start(&config, provider.addr.port(), WORKERS)?;
    let started = provider.elapsed();
    let stop = Arc::new(AtomicBool::new(false));
    // 225 tokens a call on average: 6 calls a second is 1 350 tokens a
    // second, three times the quota's 417 (and above Sluice's 833); over
    // the minute, 3 a second is 675, twice its 333 (Sluice's 667).
    let loads: Vec<_> = ["alpha", "beta"]
        .into_iter()
        .map(|key| {
            paced_tokens(
                envoy.url("/v1/chat/completions"),
                key,
                per_second,
                stop.clone(),
            )
        })
        .collect();
    tokio::time::sleep(run).await;
    stop.store(true, Ordering::SeqCst);
    let mut outcomes = Vec::new();
    for l in loads {
        outcomes.extend(l.await?);
    }
    let calls = provider.calls();
    let from = started + window;
    let to = started + run;
    let windows = (to - from).as_secs_f64() / window.as_secs_f64();
    let refused = calls.iter().filter(|c| c.refused).count();
    let refused_share = refused as f64 / calls.len().max(1) as f64;
    let mut report = Vec::new();
    let mut used = Vec::new();
    for key in ["alpha", "beta"] {
        let served: u64 = calls
            .iter()
            .filter(|c| c.key == key && !c.refused && c.at >= from && c.at < to)
            .map(|c| c.tokens)
            .sum();
        let share = served as f64 / (quota as f64 * windows);
        report.push(format!("{key} {served} tokens ({:.1} %)", 100.0 * share));
        used.push(share);
    }
    let sluice_refused = outcomes
        .iter()
        .filter(|o| o.status == 429 && o.headers.contains_key("x-sluice-policy"))
        .count();
    println!(
        "sliding {quota} tokens per {} s per key, Sluice told {}: {} calls reached the provider, \
         {refused} refused ({:.2} %), {sluice_refused} held back by Sluice; served after the first window: {}",
        window.as_secs(),
        2 * quota,
        calls.len(),
        100.0 * refused_share,
        report.join(", ")
    );
    assert!(refused_share <= 0.005, "{}", report.join(", "));
    for share in used {
        assert!(share >= 0.9, "{}", report.join(", "));
        assert!(share <= 1.0 + 1e-9, "{}", report.join(", "));
    }
    Ok(())
}

/// A provider allows 30 calls per calendar second (the wall clock's, as
/// Envoy's), then 12 from its second 2 on; it counts refused calls too
/// and answers them 429 with `Retry-After: 1`, saying nothing else of its
/// limit. Sluice's limit is told 30 a second, adapts, and queues; 24
/// callers wait their turn for 47 s. Over the 45 s after the drop (the
/// simulator's run, `tests/sim/tests/listening.rs`) the provider refuses
/// at most 2 % of the calls, and from 20 s after it (settled: holding
/// under the limit it learned, with its ever rarer probes above) it
/// serves at least 80 % of its 12 a second, in no second more than 13
/// (the figures: the simulator's). `SLUICE_ADAPTIVE_SECONDS` sets how
/// long the callers call (docs/BENCHMARKS.md, section 11: 90).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adaptive_limit_settles_under_a_dropped_limit_and_uses_it() -> anyhow::Result<()> {
    let run: u64 = match std::env::var("SLUICE_ADAPTIVE_SECONDS") {
        Ok(seconds) => seconds.parse::<u64>()?.max(30),
        Err(_) => 47,
    };
    const DROPPED: u64 = 12;
    let strict = Strict {
        refused_count: true,
        retry_after: Some(1),
    };
    let provider =
        MockProvider::start_strict(30, Signals::None, Duration::from_millis(10), strict).await?;
    let config = format!(
        r#"{{"instance": "e2e-adaptive", "fallback": {{"version": 1, "policies": [
            {{"name": "api", "match": {{"host": "{HOST}"}},
              "rate": {{"requests": 100000, "period": "1s"}},
              "on_limit": {{"action": "queue", "max_wait": "30s", "max_queue": 1000}},
              "limits": [{{"name": "requests", "rate": {{"requests": 30, "period": "1s"}},
                          "provider": {{"adaptive": true}}}}]}}]}}}}"#
    );
    let envoy = Envoy::start(&config, provider.addr.port(), WORKERS)?;
    let until_next = Duration::from_secs(provider.elapsed().as_secs() + 1) - provider.elapsed();
    tokio::time::sleep(until_next).await;
    let first = provider.elapsed().as_secs();
    let url = envoy.url("/v1/orders");
    let load = tokio::spawn(closed_loop(24, Duration::from_secs(run), move |c, _| {
        c.get(&url).header("host", HOST)
    }));
    let drop_at = Duration::from_secs(first + 2);
    tokio::time::sleep(drop_at.saturating_sub(provider.elapsed())).await;
    provider.set_limit(DROPPED);
    let outcomes = load.await?;
    let windows = provider.windows();
    let from = usize::try_from(first + 2)?;
    let to = usize::try_from(first + run)?.min(windows.len());
    let after = windows.get(from..to).unwrap_or_default();
    let served: u64 = after.iter().map(|w| w.accepted).sum();
    let refused: u64 = after.iter().map(|w| w.refused).sum();
    let share = refused as f64 / (served + refused).max(1) as f64;
    let last = after.get(20..).unwrap_or_default();
    let settled = last.iter().map(|w| w.accepted).sum::<u64>() as f64 / last.len().max(1) as f64;
    let seconds: Vec<String> = after
        .iter()
        .map(|w| format!("{}/{}", w.accepted, w.refused))
        .collect();
    let waited_out = outcomes
        .iter()
        .filter(|o| o.status == 429 && o.headers.contains_key("x-sluice-policy"))
        .count();
    println!(
        "adaptive, queued, provider 30 -> {DROPPED}/s counting refusals, Retry-After: 1: after the drop \
         {refused} of {} refused ({:.2} %); served {settled:.1}/s from 20 s after it; {waited_out} calls \
         refused by Sluice; per second (served/refused): {}",
        served + refused,
        100.0 * share,
        seconds.join(" ")
    );
    assert_eq!(after.len() as u64, run - 2, "{seconds:?}");
    // Behaviour with margins: the drop is found and the new limit used.
    // The figures (at most 1 %, 90 % used, at 5-200 ms answers) are the
    // simulator's (`tests/sim/tests/listening.rs`: 1 000 seeds at most
    // 1.97 % refused and at least 9.9/s, the provider's seconds 0-10 ms
    // ahead of Envoy's; this run's 0.65 % and 10.7/s were once under the 90 %
    // this test held, on an idle machine). The provider counts the wall
    // clock's seconds: counted from its own start, a run whose seconds
    // began far into Envoy's held 7/s for 48 s (a known gap, see
    // docs/RELIABILITY.md).
    assert!(share <= 0.02, "{seconds:?}");
    assert!(settled >= 0.8 * DROPPED as f64, "{seconds:?}");
    assert!(
        last.iter().all(|w| w.accepted + w.refused <= DROPPED + 1),
        "{seconds:?}"
    );
    Ok(())
}
