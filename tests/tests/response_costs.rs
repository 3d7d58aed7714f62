//! Costs known after the response, through a real Envoy (`--concurrency
//! 4`) in front of a mock LLM provider that counts the tokens it would
//! bill in each window and refuses once a window is spent: calls are
//! admitted against `max_tokens` + a floor, and their usage (in the JSON
//! answer, or the last event of a streamed one) settles the difference.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice_demo::llm::{LlmLimits, MockLlm};
use sluice_e2e::envoy::Envoy;
use sluice_e2e::load::client;

const WORKERS: u32 = 4;
/// The provider's (and the policy's) tokens per 2 s window.
const TOKENS: u64 = 6000;
/// Added to `max_tokens` for the prompt: the mock's prompts are shorter.
const PLUS: u64 = 60;
const MAX_ESTIMATE: u64 = 2000;
/// The room a policy leaves the provider's window, 5 %: a call Sluice
/// admits in a window's last milliseconds reaches the provider after its
/// window turned and counts in the next one (a CI run saw a window go
/// over). With what the policy's window leaves unused, it covers one such
/// call of these tests (at most 499 tokens and its prompt) nearly always,
/// and keeps the provider's use above 90 %.
const HEADROOM: u64 = TOKENS / 20;
/// The policy's tokens per 2 s window.
const POLICY_TOKENS: u64 = TOKENS - HEADROOM;

fn policy() -> String {
    format!(
        r#"{{"name": "llm", "match": {{"host": "api.llm.example"}},
            "rate": {{"requests": 1000, "period": "1s"}},
            "limits": [{{"name": "tokens",
              "rate": {{"requests": {POLICY_TOKENS}, "period": "2s", "algorithm": "fixed_window"}},
              "cost": {{"json": "max_tokens", "plus": {PLUS}, "default": 1000, "max": {MAX_ESTIMATE}}},
              "usage": {{"json": ["usage.total_tokens"]}}}}]}}"#
    )
}

async fn setup(step: Duration) -> anyhow::Result<(MockLlm, Envoy)> {
    let limits = LlmLimits {
        window: Duration::from_secs(2),
        tokens_per_window: TOKENS,
        step,
        ..LlmLimits::default()
    };
    let llm = MockLlm::start("127.0.0.1:0".parse()?, limits).await?;
    let config = format!(
        r#"{{"instance": "e2e-usage", "fallback": {{"version": 1, "policies": [{}]}}}}"#,
        policy()
    );
    let envoy = Envoy::start(&config, llm.addr.port(), WORKERS)?;
    llm.reset();
    Ok((llm, envoy))
}

/// What one client call came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Call {
    /// Read to its end; the usage the provider reported.
    Completed(u64),
    /// Left by the client after its first piece; its estimate.
    Aborted(u64),
    Refused,
    Failed,
}

/// The usage in a JSON answer or in the last event of a streamed one.
fn usage_of(body: &str) -> Option<u64> {
    let last_json = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .rfind(|d| d.contains("usage"))
        .unwrap_or(body);
    let value: serde_json::Value = serde_json::from_str(last_json).ok()?;
    value.pointer("/usage/total_tokens")?.as_u64()
}

async fn one_call(
    http: &reqwest::Client,
    (url, key): (&str, &str),
    max_tokens: u64,
    stream: bool,
    abort: bool,
) -> Call {
    let body = serde_json::json!({"model": "m", "max_tokens": max_tokens, "stream": stream,
        "messages": [{"role": "user", "content": "hi"}]});
    let sent = http
        .post(url)
        .header("host", "api.llm.example")
        .header("authorization", key)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await;
    let Ok(mut response) = sent else {
        return Call::Failed;
    };
    match response.status().as_u16() {
        200 => {}
        429 => return Call::Refused,
        _ => return Call::Failed,
    }
    if abort {
        // The first piece, then the client goes away mid-stream.
        let _ = response.chunk().await;
        drop(response);
        return Call::Aborted((max_tokens + PLUS).min(MAX_ESTIMATE));
    }
    match response.text().await.ok().as_deref().and_then(usage_of) {
        Some(used) => Call::Completed(used),
        None => Call::Failed,
    }
}

/// `clients` callers for `duration`, `max_tokens` between 100 and 499,
/// streamed or not, aborting the calls `abort(n)` picks.
async fn run(
    envoy: &Envoy,
    clients: usize,
    duration: Duration,
    stream: bool,
    abort: fn(u64) -> bool,
) -> Vec<Call> {
    let url = envoy.url("/v1/chat/completions");
    let counter = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + duration;
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let (url, counter, http) = (url.clone(), counter.clone(), client());
        tasks.push(tokio::spawn(async move {
            let mut calls = Vec::new();
            while Instant::now() < deadline {
                let n = counter.fetch_add(1, Ordering::SeqCst);
                let max_tokens = 100 + (n * 37) % 400;
                let call = one_call(
                    &http,
                    (&url, "Bearer team-a"),
                    max_tokens,
                    stream,
                    stream && abort(n),
                )
                .await;
                if call == Call::Refused {
                    // Sluice refuses at once: do not spin.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                calls.push(call);
            }
            calls
        }));
    }
    let mut calls = Vec::new();
    for t in tasks {
        calls.extend(t.await.unwrap_or_default());
    }
    calls
}

fn completed(calls: &[Call]) -> impl Iterator<Item = u64> + '_ {
    calls.iter().filter_map(|c| match c {
        Call::Completed(n) => Some(*n),
        _ => None,
    })
}

/// The provider's windows wholly inside the run: (tokens used in each).
fn full_windows(llm: &MockLlm) -> Vec<u64> {
    let stats = llm.stats();
    let windows: Vec<u64> = stats
        .windows
        .values()
        .flat_map(|w| w.values().map(|u| u.tokens))
        .collect();
    // The first and the last window are partial.
    windows
        .get(1..windows.len().saturating_sub(1))
        .map(<[u64]>::to_vec)
        .unwrap_or_default()
}

async fn provider_held_and_used(stream: bool) -> anyhow::Result<()> {
    let (llm, envoy) = setup(Duration::from_millis(5)).await?;
    let calls = run(&envoy, 12, Duration::from_secs(9), stream, |_| false).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let stats = llm.stats();
    let used = full_windows(&llm);
    let least = used.iter().copied().min().unwrap_or(0);
    let mean = used.iter().sum::<u64>() as f64 / used.len().max(1) as f64;
    let usage: u64 = completed(&calls).sum();
    let refused = calls.iter().filter(|c| **c == Call::Refused).count();
    let failed = calls.iter().filter(|c| **c == Call::Failed).count();
    let charged = envoy.limit_stat("tokens", "tokens")?;
    let read = envoy.limit_stat("tokens", "usage_read")?;
    let violations = stats.violations(&llm.limits());
    println!(
        "usage from {}: {} calls, {} completed, {refused} refused by sluice, {failed} failed; \
         provider: tokens per full 2 s window {used:?} of {TOKENS} (least {:.1} %, mean {:.1} %; \
         the policy's {POLICY_TOKENS}), \
         refused {}, windows over the limit {}; sluice charged {charged} tokens, usage read {read}, \
         clients saw {usage}",
        if stream { "SSE streams" } else { "JSON answers" },
        calls.len(),
        stats.completed,
        least as f64 * 100.0 / TOKENS as f64,
        mean * 100.0 / TOKENS as f64,
        stats.refused,
        violations.len(),
    );
    assert!(
        violations.is_empty(),
        "over the provider's limit: {violations:?}"
    );
    assert_eq!(stats.refused, 0, "the provider refused calls");
    assert_eq!(failed, 0);
    assert!(used.len() >= 3, "windows: {used:?}");
    assert!(
        least as f64 >= 0.9 * TOKENS as f64,
        "a window used only {least} of the provider's {TOKENS}: {used:?}"
    );
    assert_eq!(
        charged as u64, usage,
        "charged = the usage the answers reported"
    );
    assert_eq!(read as usize, completed(&calls).count());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_from_json_answers_keep_the_provider_inside_its_limit_and_use_it(
) -> anyhow::Result<()> {
    provider_held_and_used(false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_from_streamed_answers_keep_the_provider_inside_its_limit_and_use_it(
) -> anyhow::Result<()> {
    provider_held_and_used(true).await
}

/// 30 % of streams left by their client after the first event: Sluice
/// charges those their estimate and the others what they used, to the token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborted_streams_are_charged_their_estimate_and_completed_ones_their_usage(
) -> anyhow::Result<()> {
    let (llm, envoy) = setup(Duration::from_millis(15)).await?;
    let calls = run(&envoy, 12, Duration::from_secs(5), true, |n| n % 10 < 3).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let aborted: Vec<u64> = calls
        .iter()
        .filter_map(|c| match c {
            Call::Aborted(e) => Some(*e),
            _ => None,
        })
        .collect();
    let usage: u64 = completed(&calls).sum();
    let expected = usage + aborted.iter().sum::<u64>();
    let charged = envoy.limit_stat("tokens", "tokens")?;
    let aborted_stat = envoy.limit_stat("tokens", "usage_aborted")?;
    let read = envoy.limit_stat("tokens", "usage_read")?;
    let stats = llm.stats();
    println!(
        "aborted streams: {} calls, {} completed (usage {usage}), {} aborted (estimates {}); \
         sluice charged {charged} (expected {expected}), usage_read {read}, usage_aborted {aborted_stat}; \
         provider saw {} abandoned, refused {}, windows over the limit {}",
        calls.len(),
        completed(&calls).count(),
        aborted.len(),
        aborted.iter().sum::<u64>(),
        stats.abandoned,
        stats.refused,
        stats.violations(&llm.limits()).len(),
    );
    assert!(aborted.len() >= 10, "too few aborted calls to judge");
    assert_eq!(charged as u64, expected);
    assert_eq!(aborted_stat as usize, aborted.len());
    assert_eq!(read as usize, completed(&calls).count());
    assert_eq!(stats.refused, 0);
    Ok(())
}

/// Tokens per API key and for the company at once: the provider allows each
/// key 3 000 tokens per 2 s window; the company's contract, 6 000 for all
/// keys together. Three keys want more than both: each key stays inside
/// its own limit, all of them inside the company's, and the provider
/// refuses nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_per_key_and_for_the_company_hold_together() -> anyhow::Result<()> {
    const PER_KEY: u64 = 3000;
    const COMPANY: u64 = 6000;
    let (per_key_policy, company_policy) = (PER_KEY - HEADROOM, COMPANY - HEADROOM);
    let limits = LlmLimits {
        window: Duration::from_secs(2),
        tokens_per_window: PER_KEY,
        step: Duration::from_millis(5),
        ..LlmLimits::default()
    };
    let llm = MockLlm::start("127.0.0.1:0".parse()?, limits).await?;
    let cost = format!(
        r#""cost": {{"json": "max_tokens", "plus": {PLUS}, "default": 1000, "max": {MAX_ESTIMATE}}},
           "usage": {{"json": ["usage.total_tokens"]}}"#
    );
    let config = format!(
        r#"{{"instance": "e2e-usage-keys", "fallback": {{"version": 1, "policies": [
        {{"name": "llm", "match": {{"host": "api.llm.example"}},
          "key": {{"header": "authorization"}},
          "rate": {{"requests": 1000, "period": "1s"}},
          "limits": [
            {{"name": "tokens-per-key", "key": {{"header": "authorization"}},
              "rate": {{"requests": {per_key_policy}, "period": "2s", "algorithm": "fixed_window"}}, {cost}}},
            {{"name": "company-tokens",
              "rate": {{"requests": {company_policy}, "period": "2s", "algorithm": "fixed_window"}}, {cost}}}]}}]}}}}"#
    );
    let envoy = Envoy::start(&config, llm.addr.port(), WORKERS)?;
    llm.reset();
    let url = envoy.url("/v1/chat/completions");
    let counter = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs(9);
    let mut tasks = Vec::new();
    for client_index in 0..12u64 {
        let (url, counter, http) = (url.clone(), counter.clone(), client());
        let key = format!("Bearer team-{}", client_index % 3);
        tasks.push(tokio::spawn(async move {
            let mut calls = Vec::new();
            while Instant::now() < deadline {
                let n = counter.fetch_add(1, Ordering::SeqCst);
                let max_tokens = 100 + (n * 37) % 400;
                let call = one_call(&http, (&url, &key), max_tokens, n % 2 == 0, false).await;
                if call == Call::Refused {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                calls.push(call);
            }
            calls
        }));
    }
    let mut calls = Vec::new();
    for t in tasks {
        calls.extend(t.await.unwrap_or_default());
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    let stats = llm.stats();
    // Per window, what each key used and all of them together.
    let mut per_window: std::collections::BTreeMap<u64, Vec<u64>> = Default::default();
    for windows in stats.windows.values() {
        for (start, used) in windows {
            per_window.entry(*start).or_default().push(used.tokens);
        }
    }
    let totals: Vec<u64> = per_window.values().map(|keys| keys.iter().sum()).collect();
    let full = totals
        .get(1..totals.len().saturating_sub(1))
        .map(<[u64]>::to_vec)
        .unwrap_or_default();
    let busiest_key = stats
        .windows
        .values()
        .flat_map(|w| w.values().map(|u| u.tokens))
        .max()
        .unwrap_or(0);
    let usage: u64 = completed(&calls).sum();
    let refused = calls.iter().filter(|c| **c == Call::Refused).count();
    let failed = calls.iter().filter(|c| **c == Call::Failed).count();
    let per_key_charged = envoy.limit_stat("tokens-per-key", "tokens")?;
    let company_charged = envoy.limit_stat("company-tokens", "tokens")?;
    let violations = stats.violations(&llm.limits());
    println!(
        "tokens per key and company: {} calls, {refused} refused by sluice, {failed} failed; provider: \
         all keys per full 2 s window {full:?} (company limit {COMPANY}, policy {company_policy}), busiest key in a \
         window {busiest_key} (limit {PER_KEY}, policy {per_key_policy}), refused {}, windows over a key's limit {}; sluice charged \
         per-key {per_key_charged}, company {company_charged}, clients saw {usage}",
        calls.len(),
        stats.refused,
        violations.len(),
    );
    assert!(violations.is_empty(), "over a key's limit: {violations:?}");
    assert!(
        totals.iter().all(|t| *t <= COMPANY),
        "over the company's: {totals:?}"
    );
    assert_eq!(stats.refused, 0, "the provider refused calls");
    assert_eq!(failed, 0);
    assert!(full.len() >= 3, "windows: {full:?}");
    assert!(
        full.iter().all(|t| *t as f64 >= 0.9 * COMPANY as f64),
        "the company's tokens mostly used: {full:?}"
    );
    assert_eq!(per_key_charged as u64, usage);
    assert_eq!(company_charged as u64, usage);
    Ok(())
}
