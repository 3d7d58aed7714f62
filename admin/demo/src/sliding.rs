//! A provider whose token quota slides: at most `quota` tokens per key in
//! any window of `window`, a call's tokens (`x-tokens`) coming back one
//! window after it was served, and said in its answer's usage
//! (`{"usage": {"total_tokens": ...}}`). Its answers speak as OpenAI's do
//! (`x-ratelimit-{limit,remaining,reset}-tokens`), the reset saying when
//! the key's window is empty, so its quota whole again; a call over the
//! quota gets 429 with `Retry-After` (whole seconds until enough frees).
//! It keeps every call it served, by key, for the tests' measure.

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use axum::Router;

/// One call the provider answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Served {
    /// Since the provider started.
    pub at: Duration,
    pub key: String,
    pub tokens: u64,
    pub refused: bool,
}

#[derive(Default)]
struct Book {
    /// Per key, the tokens in its window, oldest first.
    windows: BTreeMap<String, VecDeque<(Instant, u64)>>,
    calls: Vec<Served>,
}

struct Inner {
    start: Instant,
    quota: u64,
    window: Duration,
    delay: Duration,
    book: Mutex<Book>,
}

#[derive(Clone)]
pub struct SlidingTokens {
    inner: Arc<Inner>,
    pub addr: SocketAddr,
}

impl SlidingTokens {
    /// Starts on a free loopback port, on the current runtime; answers
    /// take `delay`.
    pub async fn start(quota: u64, window: Duration, delay: Duration) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let inner = Arc::new(Inner {
            start: Instant::now(),
            quota,
            window,
            delay,
            book: Mutex::new(Book::default()),
        });
        let app = Router::new()
            .fallback(any(handle))
            .with_state(inner.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self { inner, addr })
    }

    /// Since the provider started.
    pub fn elapsed(&self) -> Duration {
        self.inner.start.elapsed()
    }

    /// Every call answered so far, in order.
    pub fn calls(&self) -> Vec<Served> {
        self.inner
            .book
            .lock()
            .map(|b| b.calls.clone())
            .unwrap_or_default()
    }
}

/// What the provider decided of one call.
struct Answer {
    served: bool,
    remaining: u64,
    whole_in: Duration,
    retry_in: Duration,
}

fn decide(inner: &Inner, key: &str, tokens: u64) -> Answer {
    let now = Instant::now();
    let Ok(mut book) = inner.book.lock() else {
        return Answer {
            served: false,
            remaining: 0,
            whole_in: inner.window,
            retry_in: inner.window,
        };
    };
    let window = book.windows.entry(key.to_string()).or_default();
    while window
        .front()
        .is_some_and(|(at, _)| now.duration_since(*at) >= inner.window)
    {
        window.pop_front();
    }
    let used: u64 = window.iter().map(|c| c.1).sum();
    let served = used + tokens <= inner.quota;
    if served {
        window.push_back((now, tokens));
    }
    let used = used + if served { tokens } else { 0 };
    let whole_in = window.back().map_or(Duration::ZERO, |(at, _)| {
        (*at + inner.window).duration_since(now)
    });
    // Refused: until enough of the oldest leaves.
    let mut left = used;
    let mut retry_in = inner.window;
    for (at, t) in window.iter() {
        left -= t;
        if left + tokens <= inner.quota {
            retry_in = (*at + inner.window).duration_since(now);
            break;
        }
    }
    book.calls.push(Served {
        at: now.duration_since(inner.start),
        key: key.to_string(),
        tokens,
        refused: !served,
    });
    Answer {
        served,
        remaining: inner.quota.saturating_sub(used),
        whole_in,
        retry_in,
    }
}

async fn handle(State(inner): State<Arc<Inner>>, headers: HeaderMap) -> Response {
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let key = text("x-key").unwrap_or_default().to_string();
    let tokens = text("x-tokens")
        .and_then(|t| t.parse::<u64>().ok())
        .unwrap_or(1);
    let answer = decide(&inner, &key, tokens);
    if !inner.delay.is_zero() {
        tokio::time::sleep(inner.delay).await;
    }
    let mut response = if answer.served {
        // The tokens it served as an LLM's answer says them.
        let usage = serde_json::json!({"usage": {"total_tokens": tokens}});
        (
            StatusCode::OK,
            [("content-type", "application/json")],
            usage.to_string(),
        )
            .into_response()
    } else {
        (
            StatusCode::TOO_MANY_REQUESTS,
            "provider: over the token quota\n",
        )
            .into_response()
    };
    let out = response.headers_mut();
    let mut put = |name: &'static str, value: String| {
        if let Ok(v) = HeaderValue::from_str(&value) {
            out.insert(name, v);
        }
    };
    put("x-ratelimit-limit-tokens", inner.quota.to_string());
    put("x-ratelimit-remaining-tokens", answer.remaining.to_string());
    put(
        "x-ratelimit-reset-tokens",
        format!("{:.3}s", answer.whole_in.as_secs_f64()),
    );
    if !answer.served {
        put(
            "retry-after",
            answer.retry_in.as_secs_f64().ceil().max(1.0).to_string(),
        );
    }
    response
}
