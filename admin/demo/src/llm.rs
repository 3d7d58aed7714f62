//! A mock LLM provider, shaped like OpenAI's chat completions: requests
//! and tokens per window for each API key, usage in the JSON answer or in
//! the last event of a streamed one, and its own 429 once a key's window
//! is spent. It counts what a real provider would bill and hold against
//! the limit, so a test can check Sluice kept it inside.
//!
//! `POST /v1/chat/completions` with `{"max_tokens": N, "stream": bool}`;
//! the key comes from `authorization: Bearer KEY` (or `x-api-key`). A call's
//! prompt counts as OpenAI bills it ([`crate::tokens`]); its answer between a fifth
//! of `max_tokens` and all of it (a seeded sequence, so runs repeat), for
//! each of its `n` choices (1 to 128). As OpenAI's, a streamed answer
//! carries its usage (in a last chunk with no choices, and `"usage":null`
//! in each chunk before) only when the request asks for it
//! (`"stream_options": {"include_usage": true}`). A
//! single choice's text is short; several choices carry their text (a
//! token per 4 bytes), so `n` makes an answer large.
//! As OpenAI's, it caches prompts: a call whose body it has seen before
//! (from any key) reports its whole prompt as read from the cache
//! (`usage.prompt_tokens_details.cached_tokens`), still within
//! `prompt_tokens`; it remembers the last 4 096 bodies.
//! Tokens count in the window the call arrived in (windows aligned to the
//! Unix epoch, as Sluice's fixed windows are), once the call completes.
//! `GET /__llm/stats` (JSON), `POST /__llm/reset`.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};

/// The provider's limits for each key; 0 means none.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct LlmLimits {
    pub window: Duration,
    pub requests_per_window: u64,
    pub tokens_per_window: u64,
    /// Pause between the events of a streamed answer (and the wait
    /// before a JSON one).
    pub step: Duration,
    /// Events carrying content before the one carrying usage.
    pub content_events: u32,
    /// A JSON answer is sent 64 KiB at a time this far apart (zero: at
    /// once), as a slow provider's large answer arrives.
    #[serde(default)]
    pub json_chunk_every: Duration,
    /// A stream its client leaves is billed in full, as a provider that
    /// generates what was asked whether or not the caller stays (off:
    /// billed nothing, counted abandoned).
    #[serde(default)]
    pub bill_abandoned: bool,
}

impl Default for LlmLimits {
    fn default() -> Self {
        Self {
            window: Duration::from_secs(60),
            requests_per_window: 0,
            tokens_per_window: 0,
            step: Duration::from_millis(5),
            content_events: 4,
            json_chunk_every: Duration::ZERO,
            bill_abandoned: false,
        }
    }
}

/// What one key did in one window.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct WindowUse {
    pub requests: u64,
    /// Tokens of the calls that arrived in it and completed.
    pub tokens: u64,
    pub refused: u64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct LlmStats {
    /// Per key, per window start (ms since the epoch).
    pub windows: BTreeMap<String, BTreeMap<u64, WindowUse>>,
    pub completed: u64,
    /// What each key was billed, in millionths of the prices' currency
    /// (calls of a model with a price, [`MockLlm::set_prices`]).
    #[serde(default)]
    pub spent: BTreeMap<String, u64>,
    /// Streams the client left before their last event.
    pub abandoned: u64,
    pub refused: u64,
}

impl LlmStats {
    /// Windows where a key went over a limit: (key, window, use).
    pub fn violations(&self, limits: &LlmLimits) -> Vec<(String, u64, WindowUse)> {
        let mut out = Vec::new();
        for (key, windows) in &self.windows {
            for (start, used) in windows {
                let over_tokens =
                    limits.tokens_per_window > 0 && used.tokens > limits.tokens_per_window;
                let over_requests = limits.requests_per_window > 0
                    && used.requests - used.refused > limits.requests_per_window;
                if over_tokens || over_requests {
                    out.push((key.clone(), *start, *used));
                }
            }
        }
        out
    }
}

impl LlmStats {
    /// Tokens of every key in the latest window.
    pub fn latest_window_tokens(&self) -> u64 {
        let latest = self
            .windows
            .values()
            .filter_map(|w| w.keys().next_back())
            .max()
            .copied();
        self.windows
            .values()
            .filter_map(|w| latest.and_then(|l| w.get(&l)))
            .map(|u| u.tokens)
            .sum()
    }
}

/// A model's prices per million tokens, in millionths of a currency.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MockPrice {
    /// The model's name, or a prefix of names ending in `*`.
    pub model: String,
    pub input: u64,
    pub cached_input: u64,
    pub output: u64,
}

impl MockPrice {
    fn prices(&self, model: &str) -> bool {
        match self.model.strip_suffix('*') {
            Some(prefix) => model.starts_with(prefix),
            None => model == self.model,
        }
    }
}

struct Inner {
    limits: LlmLimits,
    /// What it bills, first match (exact names before prefixes).
    prices: Mutex<Vec<MockPrice>>,
    /// Tokens per window of each model that has its own limit.
    model_limits: Mutex<BTreeMap<String, u64>>,
    stats: Mutex<LlmStats>,
    seed: Mutex<u64>,
    /// Hashes of the bodies seen lately, oldest first: the prompt cache.
    cached: Mutex<std::collections::VecDeque<u64>>,
}

/// Bodies the prompt cache remembers.
const CACHED_BODIES: usize = 4096;

impl Inner {
    /// Whether `body` was seen before (and remembers it).
    fn seen_before(&self, body: &[u8]) -> bool {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        body.hash(&mut hasher);
        let hash = hasher.finish();
        let Ok(mut cached) = self.cached.lock() else {
            return false;
        };
        if cached.contains(&hash) {
            return true;
        }
        if cached.len() >= CACHED_BODIES {
            cached.pop_front();
        }
        cached.push_back(hash);
        false
    }
}

#[derive(Clone)]
pub struct MockLlm {
    inner: Arc<Inner>,
    pub addr: SocketAddr,
}

#[derive(Deserialize)]
struct Ask {
    #[serde(default)]
    model: Option<String>,
    max_tokens: Option<u64>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    stream_options: StreamOptions,
    n: Option<u64>,
}

#[derive(Deserialize, Default)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// Most choices one call may ask for.
pub const MAX_CHOICES: u64 = 128;

#[derive(Serialize)]
struct Usage {
    prompt_tokens: u64,
    completion_tokens: u64,
    total_tokens: u64,
    prompt_tokens_details: PromptDetails,
}

#[derive(Serialize)]
struct PromptDetails {
    /// Of `prompt_tokens`, those read from the prompt cache.
    cached_tokens: u64,
}

impl MockLlm {
    /// Starts on `addr` (port 0: any free port) on the current runtime.
    pub async fn start(addr: SocketAddr, limits: LlmLimits) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let (llm, app) = Self::routes(addr, limits);
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(llm)
    }

    /// The provider's routes, to serve beside others on `addr`:
    /// `POST /v1/chat/completions`, `GET /__llm/stats`, `POST /__llm/reset`.
    pub fn routes(addr: SocketAddr, limits: LlmLimits) -> (Self, Router) {
        let inner = Arc::new(Inner {
            limits,
            stats: Mutex::new(LlmStats::default()),
            seed: Mutex::new(0x9e37_79b9_7f4a_7c15),
            cached: Mutex::new(std::collections::VecDeque::new()),
            prices: Mutex::new(Vec::new()),
            model_limits: Mutex::new(BTreeMap::new()),
        });
        let app = Router::new()
            .route("/v1/chat/completions", post(complete))
            .route("/__llm/stats", get(stats))
            .route("/__llm/reset", post(reset))
            .with_state(inner.clone());
        (Self { inner, addr }, app)
    }

    pub fn stats(&self) -> LlmStats {
        self.inner
            .stats
            .lock()
            .map(|s| s.clone())
            .unwrap_or_default()
    }

    pub fn limits(&self) -> LlmLimits {
        self.inner.limits
    }

    /// Bills calls of these models (a model without a price is billed
    /// nothing, as the mock always did).
    pub fn set_prices(&self, prices: Vec<MockPrice>) {
        if let Ok(mut p) = self.inner.prices.lock() {
            *p = prices;
        }
    }

    /// Limits these models' tokens per window, for every key together
    /// (each model's window counts as the key `model:<name>`), as
    /// providers limit per model.
    pub fn set_model_limits(&self, limits: BTreeMap<String, u64>) {
        if let Ok(mut l) = self.inner.model_limits.lock() {
            *l = limits;
        }
    }

    pub fn reset(&self) {
        if let Ok(mut s) = self.inner.stats.lock() {
            *s = LlmStats::default();
        }
    }
}

fn epoch_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn key_of(headers: &HeaderMap) -> String {
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let api_key = headers.get("x-api-key").and_then(|v| v.to_str().ok());
    bearer.or(api_key).unwrap_or("-").to_string()
}

impl Inner {
    fn window_of(&self, at_ms: u64) -> u64 {
        let window = u64::try_from(self.limits.window.as_millis())
            .unwrap_or(1)
            .max(1);
        at_ms - at_ms % window
    }

    /// Where a call of `model` by API key `key` counts, and its tokens
    /// per window: its model's own account when models have limits
    /// ([`MockLlm::set_model_limits`]), else the key's.
    fn account_of(&self, key: &str, model: Option<&str>) -> (String, u64) {
        let limits = self.model_limits.lock().ok();
        match model.and_then(|m| Some((m, *limits.as_ref()?.get(m)?))) {
            Some((model, tokens)) => (format!("model:{model}"), tokens),
            None => (key.to_string(), self.limits.tokens_per_window),
        }
    }

    /// Counts an arrival; false when the account's window is already spent.
    fn admit(&self, (key, tokens_per_window): (&str, u64), window: u64) -> bool {
        let Ok(mut stats) = self.stats.lock() else {
            return false;
        };
        let used = stats
            .windows
            .entry(key.to_string())
            .or_default()
            .entry(window)
            .or_default();
        used.requests += 1;
        let over_requests = self.limits.requests_per_window > 0
            && used.requests - used.refused > self.limits.requests_per_window;
        let over_tokens = tokens_per_window > 0 && used.tokens >= tokens_per_window;
        if over_requests || over_tokens {
            used.refused += 1;
            stats.refused += 1;
            return false;
        }
        true
    }

    /// A call completed: its tokens in `key`'s window, its bill to `payer`.
    fn completed(&self, (key, payer): (&str, &str), window: u64, tokens: u64, spent: u64) {
        if let Ok(mut stats) = self.stats.lock() {
            *stats.spent.entry(payer.to_string()).or_default() += spent;
            let used = stats
                .windows
                .entry(key.to_string())
                .or_default()
                .entry(window)
                .or_default();
            used.tokens += tokens;
            stats.completed += 1;
        }
    }

    fn abandoned(&self) {
        if let Ok(mut stats) = self.stats.lock() {
            stats.abandoned += 1;
        }
    }

    /// What a call of `model` with `usage` is billed, in micro-units,
    /// rounded up once: fresh input, cached input and output each at
    /// their price per million.
    fn bill(&self, model: Option<&str>, usage: &Usage) -> u64 {
        let Ok(prices) = self.prices.lock() else {
            return 0;
        };
        let Some(model) = model else {
            return 0;
        };
        let price = prices
            .iter()
            .find(|p| p.model == model)
            .or_else(|| prices.iter().find(|p| p.prices(model)));
        let Some(price) = price else {
            return 0;
        };
        let cached = usage.prompt_tokens_details.cached_tokens;
        let per_million = u128::from(usage.prompt_tokens - cached) * u128::from(price.input)
            + u128::from(cached) * u128::from(price.cached_input)
            + u128::from(usage.completion_tokens) * u128::from(price.output);
        u64::try_from(per_million.div_ceil(1_000_000)).unwrap_or(u64::MAX)
    }

    /// The next answer length: xorshift, between a fifth of `max` and `max`.
    fn answer_tokens(&self, max: u64) -> u64 {
        let Ok(mut seed) = self.seed.lock() else {
            return max;
        };
        let mut x = *seed;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *seed = x;
        let least = (max / 5).max(1);
        least + x % (max.saturating_sub(least) + 1)
    }
}

async fn complete(State(inner): State<Arc<Inner>>, headers: HeaderMap, body: Bytes) -> Response {
    let payer = key_of(&headers);
    let window = inner.window_of(epoch_ms());
    let Ok(ask) = serde_json::from_slice::<Ask>(&body) else {
        let error = serde_json::json!({"error": {"type": "invalid_request_error"}});
        return (StatusCode::BAD_REQUEST, Json(error)).into_response();
    };
    let (key, tokens_per_window) = inner.account_of(&payer, ask.model.as_deref());
    if !inner.admit((&key, tokens_per_window), window) {
        let error = serde_json::json!({"error": {"type": "rate_limit_exceeded",
            "message": "mock llm: over this key's limit"}});
        return (StatusCode::TOO_MANY_REQUESTS, Json(error)).into_response();
    }
    let prompt = serde_json::from_slice::<serde_json::Value>(&body)
        .map_or(1, |v| crate::tokens::prompt_tokens(&v, body.len()));
    let max_tokens = ask.max_tokens.unwrap_or(256).clamp(1, 100_000);
    let choices = ask.n.unwrap_or(1).clamp(1, MAX_CHOICES);
    let answers: Vec<u64> = (0..choices)
        .map(|_| inner.answer_tokens(max_tokens))
        .collect();
    let completion: u64 = answers.iter().sum();
    let cached_tokens = if inner.seen_before(&body) { prompt } else { 0 };
    let usage = Usage {
        prompt_tokens: prompt,
        completion_tokens: completion,
        total_tokens: prompt + completion,
        prompt_tokens_details: PromptDetails { cached_tokens },
    };
    let spent = inner.bill(ask.model.as_deref(), &usage);
    if !ask.stream {
        tokio::time::sleep(inner.limits.step).await;
        inner.completed((&key, &payer), window, usage.total_tokens, spent);
        let text = |tokens: u64| {
            if choices == 1 {
                "ok".to_string()
            } else {
                "tok ".repeat(usize::try_from(tokens).unwrap_or(0))
            }
        };
        let choices: Vec<serde_json::Value> = answers
            .iter()
            .enumerate()
            .map(|(i, tokens)| {
                serde_json::json!({"index": i, "message": {"role": "assistant", "content": text(*tokens)}})
            })
            .collect();
        let answer = serde_json::json!({
            "object": "chat.completion",
            "model": ask.model,
            "choices": choices,
            "usage": usage,
        });
        let every = inner.limits.json_chunk_every;
        if every.is_zero() {
            return Json(answer).into_response();
        }
        return trickled_json(answer.to_string().into_bytes(), every);
    }
    stream_answer(
        inner,
        (key, payer, window, spent),
        usage,
        ask.stream_options.include_usage,
    )
}

/// A JSON body sent 64 KiB at a time, `every` apart.
fn trickled_json(body: Vec<u8>, every: Duration) -> Response {
    const CHUNK: usize = 64 * 1024;
    let chunks: Vec<Bytes> = body.chunks(CHUNK).map(Bytes::copy_from_slice).collect();
    let pieces = futures_util::stream::iter(chunks).then(move |chunk| async move {
        tokio::time::sleep(every).await;
        Ok::<_, Infallible>(chunk)
    });
    let mut response = Body::from_stream(pieces).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    response
}

/// Counts a stream as abandoned unless it reached its last event.
struct Progress {
    inner: Arc<Inner>,
    key: String,
    window: u64,
    usage: Usage,
    /// The request asked for the usage chunk.
    with_usage: bool,
    /// What the call is billed once it completes, and who pays it.
    spent: u64,
    payer: String,
    sent: u32,
    done: bool,
}

impl Drop for Progress {
    fn drop(&mut self) {
        if !self.done {
            self.inner.abandoned();
            if self.inner.limits.bill_abandoned {
                let total = self.usage.total_tokens;
                self.inner
                    .completed((&self.key, &self.payer), self.window, total, self.spent);
            }
        }
    }
}

fn stream_answer(
    inner: Arc<Inner>,
    (key, payer, window, spent): (String, String, u64, u64),
    usage: Usage,
    with_usage: bool,
) -> Response {
    let progress = Progress {
        inner,
        key,
        window,
        usage,
        with_usage,
        spent,
        payer,
        sent: 0,
        done: false,
    };
    let events = futures_util::stream::unfold(progress, |mut p| async move {
        if p.done {
            return None;
        }
        tokio::time::sleep(p.inner.limits.step).await;
        let event = if p.sent < p.inner.limits.content_events {
            p.sent += 1;
            // As OpenAI's: with usage asked for, every chunk before the
            // last says `"usage":null`.
            let usage = if p.with_usage { ",\"usage\":null" } else { "" };
            format!("data: {{\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"tok {}\"}}}}]{usage}}}\n\n", p.sent)
        } else {
            p.done = true;
            p.inner
                .completed((&p.key, &p.payer), p.window, p.usage.total_tokens, p.spent);
            if p.with_usage {
                let last = serde_json::json!({"object": "chat.completion.chunk", "choices": [], "usage": p.usage});
                format!("data: {last}\n\ndata: [DONE]\n\n")
            } else {
                "data: [DONE]\n\n".to_string()
            }
        };
        Some((Ok::<_, Infallible>(Bytes::from(event)), p))
    });
    let mut response = Body::from_stream(events).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/event-stream"),
    );
    response
}

async fn stats(State(inner): State<Arc<Inner>>) -> Json<LlmStats> {
    Json(inner.stats.lock().map(|s| s.clone()).unwrap_or_default())
}

async fn reset(State(inner): State<Arc<Inner>>) -> StatusCode {
    if let Ok(mut s) = inner.stats.lock() {
        *s = LlmStats::default();
    }
    StatusCode::NO_CONTENT
}
