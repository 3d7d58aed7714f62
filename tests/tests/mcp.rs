//! Agents' MCP tool calls through a real Envoy (`--concurrency 2`) in
//! front of the mock MCP server: three agents call four tools, one at a
//! time and in batches, for 6 s (60 s in `make soak`). The server never answers more
//! searches than each agent's limit allows, nor more slow calls at once
//! than their limit; every refused request gets a JSON-RPC error with its
//! own id; a batch is answered whole or refused whole, one across both
//! policies too; what the policies do not name (`fetch`, `tools/list`) is
//! never refused (issue 52, item 1).

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sluice_demo::mcp::MockMcp;
use sluice_e2e::envoy::Envoy;
use sluice_e2e::load::client;

const WORKERS: u32 = 2;
const HOST: &str = "mcp.tools.example";
/// Each agent's searches: a bunch of 6, then 30 a minute.
const SEARCH_BURST: u64 = 6;
const SEARCH_PER_MINUTE: u64 = 30;
const SLOW_IN_FLIGHT: u64 = 2;

fn policies() -> String {
    json!({"instance": "e2e-mcp", "fallback": {"version": 1, "policies": [
        {"name": "searches", "match": {"host": HOST, "mcp": {"tools": ["search"]}},
         "key": {"header": "x-agent-id", "label": "value"},
         "rate": {"requests": SEARCH_PER_MINUTE, "period": "1m", "burst": SEARCH_BURST}},
        {"name": "slow-tools", "match": {"host": HOST, "mcp": {"tools": ["slow"]}},
         "concurrency": {"max_in_flight": SLOW_IN_FLIGHT}}
    ]}})
    .to_string()
}

/// One POST to the MCP endpoint: (status, body as JSON, `Retry-After`).
async fn post(
    http: &reqwest::Client,
    url: &str,
    agent: &str,
    body: &Value,
) -> anyhow::Result<(u16, Value, Option<String>)> {
    let response = http
        .post(url)
        .header("host", HOST)
        .header("x-agent-id", agent)
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .body(body.to_string())
        .send()
        .await?;
    let status = response.status().as_u16();
    let retry = response
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let text = response.text().await?;
    let value = if text.is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text).unwrap_or(Value::String(text))
    };
    Ok((status, value, retry))
}

fn tool_call(id: u64, tool: &str) -> Value {
    let arguments = if tool == "slow" {
        json!({"delay_ms": 400})
    } else {
        json!({"q": "rivers"})
    };
    json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
           "params": {"name": tool, "arguments": arguments}})
}

#[derive(Default, Debug)]
struct Seen {
    answered: u64,
    refused: u64,
    batches_whole: u64,
    batches_refused: u64,
}

/// Checks one answer to `sent` (a message or a batch); Err names what is
/// wrong.
fn check(sent: &Value, status: u16, got: &Value, seen: &mut Seen) -> anyhow::Result<()> {
    anyhow::ensure!(status == 200, "status {status} for {sent}: {got}");
    let pairs: Vec<(&Value, &Value)> = match (sent, got) {
        (Value::Array(sent), Value::Array(got)) => {
            anyhow::ensure!(sent.len() == got.len(), "{sent:?} answered {got:?}");
            sent.iter().zip(got).collect()
        }
        (Value::Object(_), Value::Object(_)) => vec![(sent, got)],
        _ => anyhow::bail!("{sent} answered {got}"),
    };
    let errors = pairs
        .iter()
        .filter(|(_, a)| a.get("error").is_some())
        .count();
    for (message, answer) in &pairs {
        anyhow::ensure!(answer["id"] == message["id"], "{message} answered {answer}");
        if let Some(error) = answer.get("error") {
            anyhow::ensure!(error["code"] == -32029, "{error}");
            anyhow::ensure!(error["data"]["retry_after_s"].as_u64().is_some(), "{error}");
            let tool = message["params"]["name"].as_str().unwrap_or("");
            anyhow::ensure!(
                sent.is_array() || matches!(tool, "search" | "slow"),
                "{tool} refused: {error}"
            );
        }
    }
    if sent.is_array() {
        anyhow::ensure!(
            errors == 0 || errors == pairs.len(),
            "a batch half refused: {got}"
        );
        if errors == 0 {
            seen.batches_whole += 1;
        } else {
            seen.batches_refused += 1;
        }
    }
    seen.refused += errors as u64;
    seen.answered += (pairs.len() - errors) as u64;
    Ok(())
}

async fn agent(url: String, agent: &'static str, run: Duration) -> anyhow::Result<Seen> {
    let http = client();
    let mut seen = Seen::default();
    let until = Instant::now() + run;
    let mut id = 0u64;
    let mut n = 0u64;
    while Instant::now() < until {
        n += 1;
        id += 10;
        let sent = match n % 7 {
            0 => json!([tool_call(id, "search"), tool_call(id + 1, "search")]),
            1 => json!({"jsonrpc": "2.0", "id": id, "method": "tools/list"}),
            2 => tool_call(id, "fetch"),
            3 => tool_call(id, "slow"),
            4 => json!([tool_call(id, "fetch"), tool_call(id + 1, "search")]),
            // Across both policies: split, each part its own policy's.
            5 => json!([tool_call(id, "search"), tool_call(id + 1, "slow")]),
            _ => tool_call(id, "search"),
        };
        let (status, got, _) = post(&http, &url, agent, &sent).await?;
        check(&sent, status, &got, &mut seen)?;
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    Ok(seen)
}

/// How long the agents call: 6 s in `make test`; `make soak` runs it for
/// 60 s in both builds (`SLUICE_MCP_RUN_SECONDS`, 1 to 3 600).
fn run_seconds() -> u64 {
    std::env::var("SLUICE_MCP_RUN_SECONDS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(6, |s| s.clamp(1, 3_600))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_tool_calls_stay_within_each_limit_and_refusals_answer_their_ids(
) -> anyhow::Result<()> {
    let mcp = MockMcp::start("127.0.0.1:0".parse()?).await?;
    let envoy = Envoy::start(&policies(), mcp.addr.port(), WORKERS)?;
    let url = envoy.url("/mcp");
    let run = Duration::from_secs(run_seconds());
    let started = Instant::now();
    let agents = ["agent-a", "agent-b", "agent-c"];
    let mut tasks = Vec::new();
    for name in agents {
        tasks.push(tokio::spawn(agent(url.clone(), name, run)));
    }
    let mut seen = Vec::new();
    for task in tasks {
        seen.push(task.await??);
    }
    let elapsed = started.elapsed().as_secs_f64();
    let stats = mcp.stats();
    println!("mcp: {elapsed:.1} s, per agent {seen:?}; the server answered {stats:?}");
    // The bound no schedule can break: the burst and what a minute's
    // rate adds over the run.
    let allowed = SEARCH_BURST + (SEARCH_PER_MINUTE as f64 * elapsed / 60.0).floor() as u64;
    for name in agents {
        let searches = stats.calls_of("search", name);
        assert!(
            (SEARCH_BURST..=allowed).contains(&searches),
            "{name}: {searches} searches, at most {allowed}"
        );
        assert!(stats.calls_of("fetch", name) > 0, "{name} fetched");
    }
    assert!(
        stats.most_in_flight.get("slow").copied().unwrap_or(0) <= SLOW_IN_FLIGHT,
        "{stats:?}"
    );
    for s in &seen {
        assert!(s.refused > 0, "each agent went past its searches: {s:?}");
        assert!(s.batches_whole > 0 && s.batches_refused > 0, "{s:?}");
    }
    assert_eq!(stats.malformed, 0);

    // Past its searches, a notification is refused with a bare 429, a
    // request with an error carrying its id. A search the agent's rate
    // gave back meanwhile (one every 2 s) is admitted and spends it: the
    // next try is refused.
    let http = client();
    let notification = json!({"jsonrpc": "2.0", "method": "tools/call",
        "params": {"name": "search", "arguments": {}}});
    let mut tries = 0;
    let (status, body, retry) = loop {
        tries += 1;
        let answer = post(&http, &url, "agent-a", &notification).await?;
        if answer.0 != 202 || tries == 10 {
            break answer;
        }
    };
    assert_eq!((status, body), (429, Value::Null), "after {tries} tries");
    assert!(retry.is_some());
    let mut tries = 0;
    let (status, body, retry) = loop {
        tries += 1;
        let answer = post(&http, &url, "agent-a", &tool_call(77, "search")).await?;
        if answer.1.get("error").is_some() || tries == 10 {
            break answer;
        }
    };
    assert_eq!(status, 200);
    assert_eq!(body["id"], 77, "{body}");
    assert_eq!(body["error"]["data"]["policy"], "searches");
    assert!(retry.is_some());
    Ok(())
}

/// A batch across two policies through Envoy: refused whole while one
/// policy has no room, its other part's token given back (3 searches an
/// hour, none renewed during the test: a token kept would show); admitted
/// once both have room, each message taking from its own policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_across_policies_goes_only_when_each_has_room() -> anyhow::Result<()> {
    let set = json!({"instance": "e2e-mcp-split", "fallback": {"version": 1, "policies": [
        {"name": "searches", "match": {"host": HOST, "mcp": {"tools": ["search"]}},
         "key": {"header": "x-agent-id"},
         "rate": {"requests": 3, "period": "1h", "burst": 3}},
        {"name": "slow-tools", "match": {"host": HOST, "mcp": {"tools": ["slow"]}},
         "concurrency": {"max_in_flight": SLOW_IN_FLIGHT}}
    ]}});
    let mcp = MockMcp::start("127.0.0.1:0".parse()?).await?;
    let envoy = Envoy::start(&set.to_string(), mcp.addr.port(), WORKERS)?;
    let url = envoy.url("/mcp");
    let http = client();
    // Two slow calls of 5 s hold both slots.
    let slow = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
        "params": {"name": "slow", "arguments": {"delay_ms": 5000}}});
    let holding: Vec<_> = (0..SLOW_IN_FLIGHT)
        .map(|_| {
            let (http, url, slow) = (http.clone(), url.clone(), slow.clone());
            tokio::spawn(async move { post(&http, &url, "holder", &slow).await })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(4);
    while mcp.stats().most_in_flight.get("slow").copied().unwrap_or(0) < SLOW_IN_FLIGHT {
        anyhow::ensure!(Instant::now() < deadline, "the slow calls never arrived");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let batch = json!([tool_call(7, "search"), tool_call(8, "slow")]);
    let (status, refused, retry) = post(&http, &url, "agent-z", &batch).await?;
    assert_eq!(status, 200, "{refused}");
    assert!(retry.is_some());
    assert_eq!(refused[0]["id"], 7, "{refused}");
    let message = refused[0]["error"]["message"].as_str().unwrap_or("");
    assert!(message.starts_with("refused with its batch"), "{refused}");
    assert_eq!(refused[1]["id"], 8, "{refused}");
    assert_eq!(refused[1]["error"]["data"]["policy"], "slow-tools");
    for call in holding {
        let (status, answer, _) = call.await??;
        assert_eq!(status, 200, "{answer}");
        assert!(answer.get("result").is_some(), "{answer}");
    }
    // Both have room now: the batch goes, each message to the server.
    let (_, answered, _) = post(&http, &url, "agent-z", &batch).await?;
    let answers = answered.as_array().map_or(0, Vec::len);
    assert!(
        answered[0].get("result").is_some() && answers == 2,
        "{answered}"
    );
    // Its search took one of three; the refused batch's went back.
    let mut admitted = 0;
    for id in 20..25 {
        let (_, answer, _) = post(&http, &url, "agent-z", &tool_call(id, "search")).await?;
        if answer.get("result").is_some() {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 2);
    let stats = mcp.stats();
    assert_eq!(stats.calls_of("search", "agent-z"), 3, "{stats:?}");
    assert_eq!(stats.calls_of("slow", "agent-z"), 1, "{stats:?}");
    Ok(())
}

/// The least of a burst of 10 that calls spread over workers get (the
/// book's "Prefetch": the worst case for a burst of 10 is 6).
const BURST_AT_WORST: u64 = 6;

/// The agents' policies and prices of `make run`'s set
/// (`envoy/demo-policies.json`), as the test's fallback: what the demo
/// promises is what Envoy does.
fn demo_agents_policies() -> anyhow::Result<String> {
    let path = sluice_e2e::envoy::workspace_root().join("envoy/demo-policies.json");
    let set: Value = serde_json::from_str(&std::fs::read_to_string(path)?)?;
    let agents: Vec<Value> = set["policies"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["name"].as_str().is_some_and(|n| n.starts_with("agent-")))
        .cloned()
        .collect();
    anyhow::ensure!(agents.len() == 4, "the demo's agents' policies: {agents:?}");
    Ok(
        json!({"instance": "e2e-mcp-demo", "fallback": {"version": 1,
        "prices": set["prices"], "policies": agents}})
        .to_string(),
    )
}

/// A call to the demo's LLM as an agent of `run`: (status, the limit
/// that refused it).
async fn agent_llm_call(
    http: &reqwest::Client,
    url: &str,
    run: &str,
) -> anyhow::Result<(u16, Option<String>)> {
    let ask = json!({"model": "gpt-4o", "max_tokens": 300,
        "messages": [{"role": "user", "content": "Plan the next step."}]});
    let response = http
        .post(url)
        .header("host", "api.llm.example")
        .header("authorization", format!("Bearer {run}"))
        .header("x-caller", "agent")
        .header("x-agent-run", run)
        .header("content-type", "application/json")
        .body(ask.to_string())
        .send()
        .await?;
    let status = response.status().as_u16();
    let limit = response
        .headers()
        .get("x-sluice-limit")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let _ = response.bytes().await?;
    Ok((status, limit))
}

async fn run_tool_call(
    http: &reqwest::Client,
    url: &str,
    agent: &str,
    run: &str,
    body: &Value,
) -> anyhow::Result<Value> {
    let response = http
        .post(url)
        .header("host", HOST)
        .header("x-agent-id", agent)
        .header("x-agent-run", run)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await?;
    anyhow::ensure!(response.status() == 200, "{}", response.status());
    Ok(response.json().await?)
}

/// `make run`'s agents' policies through Envoy (issue 52, item 1): 10
/// searches a minute per agent, 2 expensive calls in flight, and 1 USD
/// per run across its tool calls (priced per call by tool) and its LLM
/// calls (priced by tokens): the MCP server and the LLM together never
/// bill a run more than its dollar, and the refusal says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_agents_get_ten_searches_two_expensive_calls_and_a_dollar_a_run(
) -> anyhow::Result<()> {
    use sluice_demo::llm::{LlmLimits, MockLlm, MockPrice};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (mcp, mcp_routes) = MockMcp::routes(addr);
    let (llm, llm_routes) = MockLlm::routes(addr, LlmLimits::default());
    llm.set_prices(vec![MockPrice {
        model: "gpt-4o".into(),
        input: 2_500_000,
        cached_input: 1_250_000,
        output: 10_000_000,
    }]);
    tokio::spawn(async move {
        let _ = axum::serve(listener, mcp_routes.merge(llm_routes)).await;
    });
    let envoy = Envoy::start(&demo_agents_policies()?, addr.port(), WORKERS)?;
    let (mcp_url, llm_url) = (envoy.url("/mcp"), envoy.url("/v1/chat/completions"));
    let http = client();

    // Searches: a burst of 10, then one every 6 s. Calls spread over the
    // workers can lose part of a burst to tokens a worker prefetched and
    // did not spend (at worst 4 of 10: "Prefetch" in the book), never
    // pass more.
    let started = Instant::now();
    let mut refused = 0;
    for n in 0..14 {
        let answer =
            run_tool_call(&http, &mcp_url, "searcher", "s-1", &tool_call(n, "search")).await?;
        anyhow::ensure!(answer["id"] == n, "{answer}");
        if answer.get("error").is_some() {
            assert_eq!(
                answer["error"]["data"]["policy"], "agent-search",
                "{answer}"
            );
            refused += 1;
        }
    }
    let allowed = 10 + started.elapsed().as_secs() / 6;
    let searches = mcp.stats().calls_of("search", "searcher");
    assert!(
        (BURST_AT_WORST..=allowed).contains(&searches),
        "{searches} searches, at most {allowed}"
    );
    assert_eq!(searches + refused, 14);

    // Expensive calls that take 3 s, five at once from five runs: two in flight.
    let mut calls = Vec::new();
    for n in 0..5u64 {
        let (http, url) = (http.clone(), mcp_url.clone());
        let call = json!({"jsonrpc": "2.0", "id": n, "method": "tools/call",
            "params": {"name": "expensive", "arguments": {"delay_ms": 3000}}});
        calls.push(tokio::spawn(async move {
            run_tool_call(&http, &url, "parallel", &format!("p-{n}"), &call).await
        }));
    }
    let mut parallel_refused = 0;
    for call in calls {
        let answer = call.await??;
        if answer.get("error").is_some() {
            assert_eq!(
                answer["error"]["data"]["policy"], "agent-expensive",
                "{answer}"
            );
            parallel_refused += 1;
        }
    }
    let most = mcp
        .stats()
        .most_in_flight
        .get("expensive")
        .copied()
        .unwrap_or(0);
    assert!(most <= 2, "{most} expensive calls at once");
    assert!(parallel_refused >= 1, "five at once, two slots");

    // One run's dollar: its LLM calls and its expensive calls (0.25 each)
    // until the run is refused; the providers billed it at most the dollar.
    let mut llm_refused = None;
    let mut tool_refusal = Value::Null;
    for n in 0..12u64 {
        let (status, limit) = agent_llm_call(&http, &llm_url, "run-1").await?;
        if status != 200 {
            llm_refused = Some((status, limit));
        }
        let answer = run_tool_call(
            &http,
            &mcp_url,
            "spender",
            "run-1",
            &tool_call(n, "expensive"),
        )
        .await?;
        if answer.get("error").is_some() {
            tool_refusal = answer;
            break;
        }
    }
    let data = &tool_refusal["error"]["data"];
    assert_eq!(data["limit"], "agent-run", "{tool_refusal}");
    assert_eq!(
        (data["budget"].as_str(), data["currency"].as_str()),
        (Some("1"), Some("USD"))
    );
    let tools_billed = mcp.stats().calls_of("expensive", "spender") * 250_000;
    let llm_billed = llm.stats().spent.get("run-1").copied().unwrap_or(0);
    println!(
        "mcp demo: {searches} searches of 14, {parallel_refused} of 5 expensive calls refused at once (most {most}); \
         run-1 billed {tools_billed} micro-USD by tools and {llm_billed} by the LLM; the LLM refused {llm_refused:?}"
    );
    assert!(tools_billed > 0 && llm_billed > 0);
    assert!(
        tools_billed + llm_billed <= 1_000_000,
        "billed past the dollar"
    );
    // Another run has its own dollar.
    let other = run_tool_call(
        &http,
        &mcp_url,
        "spender",
        "run-2",
        &tool_call(99, "expensive"),
    )
    .await?;
    assert!(other.get("error").is_none(), "{other}");
    Ok(())
}
