//! A mock MCP server (Streamable HTTP, `POST /mcp`): JSON-RPC 2.0
//! messages, one or a batch, answered as JSON. Its tools: `search` and
//! `fetch` (quick), `slow` (takes `delay_ms` of its arguments, default
//! 1 s), `expensive` (quick unless given `delay_ms`, but a real one would
//! bill it). It counts
//! every tool call it answers, per tool and per agent (header
//! `x-agent-id`), and the most calls of each tool it held at once:
//! what a limit in front of it must keep under. `initialize` hands out
//! an `Mcp-Session-Id`; notifications get 202 and no body, as the
//! transport says. Counters: `GET /__mcp/stats`, `POST /__mcp/reset`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// The tools it offers.
pub const TOOLS: [&str; 4] = ["search", "fetch", "slow", "expensive"];
/// The longest `slow` waits, whatever it is asked.
const MAX_DELAY_MS: u64 = 30_000;

/// What it answered: tool calls per tool, per agent (`-` without the
/// header), and the most of each tool in flight at once.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct McpStats {
    pub calls: BTreeMap<String, BTreeMap<String, u64>>,
    pub most_in_flight: BTreeMap<String, u64>,
    /// Messages that were not JSON-RPC it could answer.
    pub malformed: u64,
}

impl McpStats {
    /// Calls of `tool` by `agent`.
    pub fn calls_of(&self, tool: &str, agent: &str) -> u64 {
        self.calls
            .get(tool)
            .and_then(|a| a.get(agent))
            .copied()
            .unwrap_or(0)
    }

    /// Calls of `tool` by everyone.
    pub fn tool_calls(&self, tool: &str) -> u64 {
        self.calls.get(tool).map_or(0, |a| a.values().sum())
    }
}

#[derive(Default)]
struct Inner {
    stats: Mutex<McpStats>,
    in_flight: Mutex<BTreeMap<String, u64>>,
    sessions: AtomicU64,
}

pub struct MockMcp {
    inner: Arc<Inner>,
    pub addr: SocketAddr,
}

impl MockMcp {
    /// Starts on `addr` (port 0: any free port) on the current runtime.
    pub async fn start(addr: SocketAddr) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let (mcp, app) = Self::routes(listener.local_addr()?);
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(mcp)
    }

    /// The server's routes, to serve beside others on `addr` (an agent's
    /// MCP server and its LLM behind one upstream).
    pub fn routes(addr: SocketAddr) -> (Self, Router) {
        let inner = Arc::new(Inner::default());
        let app = routes(Arc::clone(&inner));
        (Self { inner, addr }, app)
    }

    pub fn stats(&self) -> McpStats {
        lock(&self.inner.stats).clone()
    }

    pub fn reset(&self) {
        *lock(&self.inner.stats) = McpStats::default();
    }
}

fn routes(inner: Arc<Inner>) -> Router {
    Router::new()
        .route("/mcp", post(serve_mcp))
        .route("/__mcp/stats", get(stats))
        .route("/__mcp/reset", post(reset))
        .with_state(inner)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

async fn stats(State(inner): State<Arc<Inner>>) -> Json<McpStats> {
    Json(lock(&inner.stats).clone())
}

async fn reset(State(inner): State<Arc<Inner>>) -> StatusCode {
    *lock(&inner.stats) = McpStats::default();
    StatusCode::NO_CONTENT
}

async fn serve_mcp(State(inner): State<Arc<Inner>>, headers: HeaderMap, body: Bytes) -> Response {
    let agent = headers
        .get("x-agent-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-")
        .to_string();
    let Ok(message) = serde_json::from_slice::<Value>(&body) else {
        lock(&inner.stats).malformed += 1;
        let error = json!({"jsonrpc": "2.0", "id": null,
            "error": {"code": -32700, "message": "parse error"}});
        return (StatusCode::BAD_REQUEST, Json(error)).into_response();
    };
    let (messages, batch) = match message {
        Value::Array(batch) => (batch, true),
        one => (vec![one], false),
    };
    let mut answers = Vec::new();
    let mut session = None;
    for message in &messages {
        if message.get("method").and_then(Value::as_str) == Some("initialize") {
            session = Some(inner.sessions.fetch_add(1, Ordering::Relaxed) + 1);
        }
        if let Some(answer) = answer(&inner, &agent, message).await {
            answers.push(answer);
        }
    }
    let mut response = match (answers.is_empty(), batch) {
        (true, _) => StatusCode::ACCEPTED.into_response(),
        (false, true) => Json(Value::Array(answers)).into_response(),
        (false, false) => Json(answers.remove(0)).into_response(),
    };
    if let Some(session) = session {
        if let Ok(value) = format!("mock-session-{session}").parse() {
            response.headers_mut().insert("mcp-session-id", value);
        }
    }
    response
}

#[derive(Deserialize)]
struct Call {
    name: String,
    #[serde(default)]
    arguments: Value,
}

/// The answer to one message; None for a notification (no `id`).
async fn answer(inner: &Inner, agent: &str, message: &Value) -> Option<Value> {
    let id = message.get("id")?.clone();
    let result = match message.get("method").and_then(Value::as_str) {
        Some("initialize") => Ok(json!({"protocolVersion": "2025-06-18",
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "sluice-mock-mcp", "version": env!("CARGO_PKG_VERSION")}})),
        Some("ping") => Ok(json!({})),
        Some("tools/list") => Ok(json!({"tools": TOOLS.iter().map(|t| json!({
            "name": t, "description": format!("the mock's {t}"),
            "inputSchema": {"type": "object"}})).collect::<Vec<_>>()})),
        Some("tools/call") => match message
            .get("params")
            .cloned()
            .map(serde_json::from_value::<Call>)
        {
            Some(Ok(call)) if TOOLS.contains(&call.name.as_str()) => {
                Ok(call_tool(inner, agent, &call).await)
            }
            Some(Ok(call)) => Err((-32602, format!("unknown tool {:?}", call.name))),
            _ => Err((-32602, "tools/call takes params.name".to_string())),
        },
        Some(other) => Err((-32601, format!("method not found: {other}"))),
        None => {
            lock(&inner.stats).malformed += 1;
            Err((-32600, "invalid request".to_string()))
        }
    };
    Some(match result {
        Ok(result) => json!({"jsonrpc": "2.0", "id": id, "result": result}),
        Err((code, message)) => {
            json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}})
        }
    })
}

async fn call_tool(inner: &Inner, agent: &str, call: &Call) -> Value {
    {
        let mut in_flight = lock(&inner.in_flight);
        let now = in_flight.entry(call.name.clone()).or_default();
        *now += 1;
        let mut stats = lock(&inner.stats);
        let most = stats.most_in_flight.entry(call.name.clone()).or_default();
        *most = (*most).max(*now);
        *stats
            .calls
            .entry(call.name.clone())
            .or_default()
            .entry(agent.to_string())
            .or_default() += 1;
    }
    let default_delay = if call.name == "slow" { 1_000 } else { 0 };
    let delay = call
        .arguments
        .get("delay_ms")
        .and_then(Value::as_u64)
        .unwrap_or(default_delay)
        .min(MAX_DELAY_MS);
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    if let Some(now) = lock(&inner.in_flight).get_mut(&call.name) {
        *now = now.saturating_sub(1);
    }
    json!({"content": [{"type": "text", "text": format!("{} for {agent}: done", call.name)}],
           "isError": false})
}
