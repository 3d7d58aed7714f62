//! The demo's load generator: steady calls to the demo APIs through the
//! egress listener, a little over each limit so the live view shows
//! admitted, refused and queued calls at once.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Outcomes per API since the last report.
#[derive(Default)]
pub struct LoadStats {
    apis: [ApiCounts; 6],
    since: Mutex<Option<Instant>>,
}

#[derive(Default)]
struct ApiCounts {
    ok: AtomicU64,
    limited: AtomicU64,
    failed: AtomicU64,
}

const APIS: [&str; 6] = ["bank", "llm", "fx", "maps", "pool", "agents"];
/// Where agents' calls (tools and LLM) are counted.
const AGENTS: usize = 5;

impl LoadStats {
    fn record(&self, api: usize, status: Option<u16>) {
        let Some(counts) = self.apis.get(api) else {
            return;
        };
        let counter = match status {
            Some(200..=299) => &counts.ok,
            Some(429) => &counts.limited,
            _ => &counts.failed,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Per-second figures since the previous call (None on the first).
    pub fn take_report(&self) -> Option<String> {
        let now = Instant::now();
        let since = self.since.lock().ok()?.replace(now);
        let secs = now.duration_since(since?).as_secs_f64().max(0.001);
        let parts: Vec<String> = APIS
            .iter()
            .zip(&self.apis)
            .map(|(name, c)| {
                let ok = c.ok.swap(0, Ordering::Relaxed) as f64 / secs;
                let limited = c.limited.swap(0, Ordering::Relaxed) as f64 / secs;
                let failed = c.failed.swap(0, Ordering::Relaxed);
                let failed = if failed > 0 {
                    format!(" {failed} failed")
                } else {
                    String::new()
                };
                format!("{name} {ok:.0} ok/s {limited:.0} limited/s{failed}")
            })
            .collect();
        Some(format!("load: {}", parts.join(" | ")))
    }
}

fn request(http: &reqwest::Client, port: u16, host: &str, path: &str) -> reqwest::RequestBuilder {
    http.get(format!("http://127.0.0.1:{port}{path}"))
        .header("host", host)
}

async fn send(stats: &LoadStats, api: usize, request: reqwest::RequestBuilder) -> Option<u16> {
    let status = match request.send().await {
        Ok(resp) => {
            let status = resp.status().as_u16();
            let _ = resp.bytes().await;
            Some(status)
        }
        Err(_) => None,
    };
    stats.record(api, status);
    status
}

/// `per_second` requests a second, each on its own task, whatever the
/// answers (an open loop, as independent callers are).
async fn open_loop<F>(stats: Arc<LoadStats>, api: usize, per_second: u32, build: F)
where
    F: Fn(u64) -> reqwest::RequestBuilder + Send + Sync + 'static,
{
    let mut every = tokio::time::interval(Duration::from_secs(1) / per_second.max(1));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    for n in 0u64.. {
        every.tick().await;
        let stats = Arc::clone(&stats);
        let request = build(n);
        tokio::spawn(async move {
            send(&stats, api, request).await;
        });
    }
}

/// Runs until aborted.
pub async fn run(port: u16, stats: Arc<LoadStats>) {
    let _ = stats.take_report();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(256)
        .build()
        .unwrap_or_else(|_| reqwest::Client::new());
    let mut tasks = tokio::task::JoinSet::new();
    let h = http.clone();
    tasks.spawn(open_loop(Arc::clone(&stats), 0, 150, move |n| {
        request(&h, port, "api.bank.example", &format!("/v1/payments/{n}"))
    }));
    let h = http.clone();
    tasks.spawn(open_loop(Arc::clone(&stats), 2, 25, move |_| {
        request(&h, port, "api.fx.example", "/v1/rates")
    }));
    // A pool of two deployments at 30/s each: 40/s fits while both serve;
    // while one is down (the demo takes it down now and then) the other
    // serves 30 and Sluice refuses the rest, the provider none.
    let h = http.clone();
    tasks.spawn(open_loop(Arc::clone(&stats), 4, 40, move |n| {
        request(&h, port, "api.pool.example", "/v1/complete")
            .header("x-conversation", format!("c{}", n % 16))
    }));
    // One key above its 10/s, two below: the live view's busiest keys.
    for (key, per_second) in [("key-a", 15), ("key-b", 8), ("key-c", 3)] {
        let h = http.clone();
        tasks.spawn(open_loop(Arc::clone(&stats), 3, per_second, move |_| {
            request(&h, port, "api.maps.example", "/v1/route").header("x-api-key", key)
        }));
    }
    // Twelve callers of a slow LLM that allows 8 in flight; two of them
    // are high priority and may use the 2 slots reserved for them. Half
    // the answers are streamed (not asking for their usage: the policy
    // asks); each asks for 200 to 1 000 tokens of gpt-4o or gpt-4o-mini,
    // for one of three teams with a daily budget in money.
    for caller in 0..12u64 {
        let h = http.clone();
        let stats = Arc::clone(&stats);
        tasks.spawn(async move {
            let team = ["team-a", "team-b", "team-c"][(caller % 3) as usize];
            for n in 0u64.. {
                let priority = if caller < 2 { "high" } else { "normal" };
                let model = if (n + caller) % 4 == 0 { "gpt-4o" } else { "gpt-4o-mini" };
                let ask = serde_json::json!({"model": model, "max_tokens": 200 + (n * 97 + caller * 31) % 800,
                    "stream": n % 2 == 0, "messages": [{"role": "user", "content": "Summarise this invoice."}]});
                let r = h
                    .post(format!("http://127.0.0.1:{port}/v1/chat/completions"))
                    .header("host", "api.llm.example")
                    .header("authorization", "Bearer demo-team")
                    .header("x-team", team)
                    .header("content-type", "application/json")
                    .header("x-priority", priority)
                    .body(ask.to_string());
                if send(&stats, 1, r).await != Some(200) {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        });
    }
    for name in ["agent-a", "agent-b", "agent-c"] {
        agent(&mut tasks, &http, port, &stats, name);
    }
    while tasks.join_next().await.is_some() {}
}

/// What an agent's call came to: (answered, refused by Sluice, refused
/// by its run's budget). A refused tool call is a JSON-RPC error on 200;
/// the limit that refused is in `x-sluice-limit` either way.
async fn agent_outcome(response: reqwest::Result<reqwest::Response>) -> (bool, bool, bool) {
    let Ok(response) = response else {
        return (false, false, false);
    };
    let status = response.status().as_u16();
    let spent = response
        .headers()
        .get("x-sluice-limit")
        .is_some_and(|v| v.as_bytes() == b"agent-run");
    let body: serde_json::Value = response.json().await.unwrap_or_default();
    let refused = status == 429 || body["error"]["code"] == -32029;
    (status == 200 && !refused, refused, spent)
}

/// One agent: a search every 3 s (20 a minute, against 10), an expensive
/// call every 4 s that takes 1.5 s (three agents, against 2 in flight),
/// an LLM call every 5 s; each run has 1 USD across them, and the agent
/// starts a new run when its budget refuses it.
fn agent(
    tasks: &mut tokio::task::JoinSet<()>,
    http: &reqwest::Client,
    port: u16,
    stats: &Arc<LoadStats>,
    name: &'static str,
) {
    let run = Arc::new(AtomicU64::new(1));
    let jobs: [(u64, &'static str); 3] = [(3_000, "search"), (4_000, "expensive"), (5_000, "llm")];
    for (every_ms, job) in jobs {
        let (h, stats, run) = (http.clone(), Arc::clone(stats), Arc::clone(&run));
        tasks.spawn(async move {
            let mut every = tokio::time::interval(Duration::from_millis(every_ms));
            for n in 0u64.. {
                every.tick().await;
                let number = run.load(Ordering::Relaxed);
                let run_id = format!("{name}-run-{number}");
                let call = if job == "llm" {
                    let ask = serde_json::json!({"model": "gpt-4o", "max_tokens": 300,
                        "messages": [{"role": "user", "content": "Plan the next step."}]});
                    h.post(format!("http://127.0.0.1:{port}/v1/chat/completions"))
                        .header("host", "api.llm.example")
                        .header("authorization", "Bearer demo-agents")
                        .header("x-caller", "agent")
                        .body(ask.to_string())
                } else {
                    let arguments = if job == "expensive" {
                        serde_json::json!({"delay_ms": 1500})
                    } else {
                        serde_json::json!({"q": "rivers"})
                    };
                    let message = serde_json::json!({"jsonrpc": "2.0", "id": n, "method": "tools/call",
                        "params": {"name": job, "arguments": arguments}});
                    h.post(format!("http://127.0.0.1:{port}/mcp"))
                        .header("host", "mcp.tools.example")
                        .header("x-agent-id", name)
                        .header("accept", "application/json, text/event-stream")
                        .body(message.to_string())
                }
                .header("content-type", "application/json")
                .header("x-agent-run", &run_id);
                let stats = Arc::clone(&stats);
                let run = Arc::clone(&run);
                tokio::spawn(async move {
                    let (answered, refused, spent) = agent_outcome(call.send().await).await;
                    let status = match (answered, refused) {
                        (true, _) => Some(200),
                        (false, true) => Some(429),
                        _ => None,
                    };
                    stats.record(AGENTS, status);
                    if spent {
                        // This run's dollar is spent: the next calls start
                        // another (once, however many calls were refused).
                        let _ = run.compare_exchange(number, number + 1, Ordering::Relaxed, Ordering::Relaxed);
                    }
                });
            }
        });
    }
}
