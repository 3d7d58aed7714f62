//! A provider whose true limit Sluice is not told: so many calls per
//! calendar second (the wall clock's, as a provider keying its counter by
//! `floor(unix time)` has them), a limit the test may change
//! while it runs, shared with anyone else calling it (a hidden consumer
//! sends `x-hidden: 1`). Every answer may say what is left, as OpenAI
//! does (`x-ratelimit-*-requests`, reset as `250ms`) or as the IETF
//! fields do; a call over the limit gets 429. Answers take `delay` (calls
//! stay in flight). Per window it counts what it accepted and refused, for
//! Sluice's calls and the hidden consumer's apart. As the plain mock does,
//! it refuses on demand (`x-mock-status`, `x-mock-retry-after`). Started
//! [`Strict`], it also counts the calls it refuses against the window
//! (as many providers do) and answers them with `Retry-After`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use axum::Router;

/// How the provider's answers speak of its limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signals {
    /// Only 429 when over.
    None,
    /// `x-ratelimit-{limit,remaining,reset}-requests`, reset as `NNNms`.
    OpenAi,
    /// `RateLimit-Policy: "requests";q=N;w=1`, `RateLimit: "requests";r=R;t=T`.
    Ietf,
}

/// One calendar second at the provider.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Window {
    pub limit: u64,
    pub accepted: u64,
    pub refused: u64,
    pub hidden_accepted: u64,
    pub hidden_refused: u64,
}

/// How a provider treats calls over its limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Strict {
    /// Refused calls count against the window too.
    pub refused_count: bool,
    /// `Retry-After` on its 429s, in seconds (None: not sent).
    pub retry_after: Option<u64>,
}

struct Inner {
    start: Instant,
    limit: AtomicU64,
    signals: Signals,
    strict: Strict,
    delay: Duration,
    windows: Mutex<Vec<Window>>,
}

#[derive(Clone)]
pub struct MockProvider {
    inner: Arc<Inner>,
    pub addr: SocketAddr,
}

impl MockProvider {
    /// Starts on a free loopback port, on the current runtime.
    pub async fn start(limit: u64, signals: Signals, delay: Duration) -> anyhow::Result<Self> {
        Self::start_strict(limit, signals, delay, Strict::default()).await
    }

    /// Starts as [`Self::start`], treating calls over the limit as
    /// `strict` says.
    pub async fn start_strict(
        limit: u64,
        signals: Signals,
        delay: Duration,
        strict: Strict,
    ) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let inner = Arc::new(Inner {
            start: calendar_second_start(),
            limit: AtomicU64::new(limit),
            signals,
            strict,
            delay,
            windows: Mutex::new(Vec::new()),
        });
        let app = Router::new()
            .fallback(any(handle))
            .with_state(inner.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self { inner, addr })
    }

    /// The provider's limit from now on (the customer's plan changed).
    pub fn set_limit(&self, limit: u64) {
        self.inner.limit.store(limit, Ordering::SeqCst);
    }

    /// Since the start of the calendar second the provider started in.
    pub fn elapsed(&self) -> Duration {
        self.inner.start.elapsed()
    }

    /// Every calendar second so far, from the one it started in.
    pub fn windows(&self) -> Vec<Window> {
        self.inner
            .windows
            .lock()
            .map(|w| w.clone())
            .unwrap_or_default()
    }
}

async fn handle(State(inner): State<Arc<Inner>>, headers: HeaderMap) -> Response {
    // A refusal a test asks for (`x-mock-status`, `x-mock-retry-after`),
    // counted nowhere.
    if let Some(refusal) = crate::mock::refusal_on_demand(&headers) {
        return refusal;
    }
    let at = inner.start.elapsed();
    let second = usize::try_from(at.as_secs()).unwrap_or(usize::MAX);
    let hidden = headers.contains_key("x-hidden");
    let limit = inner.limit.load(Ordering::SeqCst);
    let (accepted, used) = match inner.windows.lock() {
        Ok(mut windows) => {
            if windows.len() <= second {
                windows.resize(second.saturating_add(1).min(100_000), Window::default());
            }
            match windows.get_mut(second) {
                Some(w) => {
                    w.limit = limit;
                    let used = w.accepted
                        + w.hidden_accepted
                        + if inner.strict.refused_count {
                            w.refused + w.hidden_refused
                        } else {
                            0
                        };
                    let accepted = used < limit;
                    match (accepted, hidden) {
                        (true, false) => w.accepted += 1,
                        (true, true) => w.hidden_accepted += 1,
                        (false, false) => w.refused += 1,
                        (false, true) => w.hidden_refused += 1,
                    }
                    (accepted, used + 1)
                }
                None => (false, limit),
            }
        }
        Err(_) => (false, limit),
    };
    if !inner.delay.is_zero() {
        tokio::time::sleep(inner.delay).await;
    }
    let reset = Duration::from_secs(at.as_secs() + 1).saturating_sub(at);
    let remaining = limit.saturating_sub(used);
    let mut response = if accepted {
        (StatusCode::OK, "ok\n").into_response()
    } else {
        (StatusCode::TOO_MANY_REQUESTS, "provider: over the limit\n").into_response()
    };
    if let (false, Some(secs)) = (accepted, inner.strict.retry_after) {
        if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
            response.headers_mut().insert("retry-after", v);
        }
    }
    let out = response.headers_mut();
    let mut put = |name: &'static str, value: String| {
        if let Ok(v) = HeaderValue::from_str(&value) {
            out.insert(name, v);
        }
    };
    match inner.signals {
        Signals::None => {}
        Signals::OpenAi => {
            put("x-ratelimit-limit-requests", limit.to_string());
            put("x-ratelimit-remaining-requests", remaining.to_string());
            put(
                "x-ratelimit-reset-requests",
                format!("{}ms", reset.as_millis().max(1)),
            );
        }
        Signals::Ietf => {
            put("ratelimit-policy", format!("\"requests\";q={limit};w=1"));
            put(
                "ratelimit",
                format!(
                    "\"requests\";r={remaining};t={}",
                    reset.as_secs_f64().ceil() as u64
                ),
            );
        }
    }
    response
}

/// The start of the wall clock's current second: Envoy's clock and the
/// provider's then count the same seconds (apart by the trip), as they
/// do when a real provider's clock is set by NTP.
fn calendar_second_start() -> Instant {
    let now = Instant::now();
    let into = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| Duration::from_nanos(u64::from(d.subsec_nanos())))
        .unwrap_or_default();
    now.checked_sub(into).unwrap_or(now)
}
