//! A mock third-party API: it records every request it sees (when, with which
//! key and sequence number), tracks how many are in flight (sampled every
//! few milliseconds), can be slow on demand, and enforces limits of its own,
//! answering 429 as a real provider would. Its rate limit counts calls per
//! calendar second (of the wall clock), as providers that allow "100 calls
//! a second" count them.
//!
//! Slow on demand: header `x-mock-delay-ms` or query `delay_ms`. A refusal
//! on demand (as the provider's own, counted): header `x-mock-status` (an
//! error status) with `x-mock-retry-after` sent back as `Retry-After`.
//! `POST /v1/chat/completions` is an LLM-like provider ([`crate::llm`]).
//! Counters: `GET /__mock/stats` (JSON), `POST /__mock/reset`. An outage
//! (a pool member whose quota dropped to 0): `POST /__mock/down?secs=N`
//! answers every call 429 with `Retry-After: N` for N seconds.
//! When a caller sent a call: header [`SENT_HEADER`] ([`sent_stamp`]),
//! read only by callers in the mock's own process (the end-to-end tests).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};

use crate::llm::{LlmLimits, MockLlm};

const MAX_ARRIVALS: usize = 200_000;

/// The provider's own limits; 0 means none.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct MockLimits {
    pub max_per_second: u64,
    pub max_in_flight: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Arrival {
    /// Since the mock started (or was reset).
    pub at: Duration,
    pub key: Option<String>,
    pub seq: Option<u64>,
    pub host: Option<String>,
    /// Where the filter's queue took the request in (`queue_ticket_header`).
    pub queue_ticket: Option<u64>,
    /// The calendar second it came in (seconds since the Unix epoch).
    pub second: u64,
    /// When its caller sent it, on the same clock as `at` (0 when sent
    /// before the mock's start), from [`SENT_HEADER`]. Whatever passed it
    /// on (Envoy, the limiter) did so between `sent` and `at`.
    #[serde(default)]
    pub sent: Option<Duration>,
}

/// The header a caller in this process stamps a call with ([`sent_stamp`]).
pub const SENT_HEADER: &str = "x-mock-sent-us";

/// The instant [`sent_stamp`] counts from: one per process, so a stamp
/// means nothing to a mock in another process.
fn process_origin() -> Instant {
    static ORIGIN: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *ORIGIN.get_or_init(Instant::now)
}

/// Now, as the value of [`SENT_HEADER`]: microseconds since this process's
/// origin.
pub fn sent_stamp() -> u64 {
    u64::try_from(process_origin().elapsed().as_micros()).unwrap_or(u64::MAX)
}

/// A stamp's instant on the clock of a mock started at `start`; `None` for
/// a missing or unreadable stamp, or one from the future (not this
/// process's).
fn sent_since(start: Instant, stamp: Option<u64>, now: Instant) -> Option<Duration> {
    let sent = process_origin().checked_add(Duration::from_micros(stamp?))?;
    (sent <= now).then(|| sent.saturating_duration_since(start))
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MockStats {
    pub total: u64,
    pub rejected_by_mock: u64,
    pub in_flight: u64,
    pub max_in_flight: u64,
    pub uptime_ms: u64,
    /// Requests per second over the last full second.
    pub last_second: u64,
}

struct Inner {
    start: Mutex<Instant>,
    limits: MockLimits,
    /// The latest `MAX_ARRIVALS` arrivals: enough for any test, bounded
    /// for a long-running demo.
    arrivals: Mutex<VecDeque<Arrival>>,
    in_flight: AtomicU64,
    max_in_flight: AtomicU64,
    rejected: AtomicU64,
    samples: Mutex<VecDeque<u64>>,
    window: Mutex<(u64, u64)>,
    /// Until when every call is refused, and the `Retry-After` it is told.
    down: Mutex<Option<(Instant, u64)>>,
}

#[derive(Clone)]
pub struct MockApi {
    inner: Arc<Inner>,
    pub addr: SocketAddr,
}

struct InFlight<'a>(&'a Inner);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

#[derive(Deserialize)]
struct DelayQuery {
    delay_ms: Option<u64>,
}

impl MockApi {
    /// Starts on `addr` (port 0: any free port) on the current runtime.
    pub async fn start(addr: SocketAddr, limits: MockLimits) -> anyhow::Result<Self> {
        Ok(Self::start_with_llm(addr, limits, LlmLimits::default())
            .await?
            .0)
    }

    /// Starts with the LLM-like provider's limits `llm`.
    pub async fn start_with_llm(
        addr: SocketAddr,
        limits: MockLimits,
        llm: LlmLimits,
    ) -> anyhow::Result<(Self, MockLlm)> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let inner = Arc::new(Inner {
            start: Mutex::new(Instant::now()),
            limits,
            arrivals: Mutex::new(VecDeque::new()),
            in_flight: AtomicU64::new(0),
            max_in_flight: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            samples: Mutex::new(VecDeque::new()),
            window: Mutex::new((0, 0)),
            down: Mutex::new(None),
        });
        let (llm, llm_routes) = MockLlm::routes(addr, llm);
        let app = Router::new()
            .route("/__mock/stats", get(stats))
            .route("/__mock/reset", post(reset))
            .route("/__mock/down", post(down))
            .fallback(any(handle))
            .with_state(inner.clone())
            .merge(llm_routes);
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        let sampler = inner.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(Duration::from_millis(5));
            loop {
                every.tick().await;
                let n = sampler.in_flight.load(Ordering::SeqCst);
                if let Ok(mut s) = sampler.samples.lock() {
                    if s.len() >= MAX_ARRIVALS {
                        s.pop_front();
                    }
                    s.push_back(n);
                }
            }
        });
        Ok((Self { inner, addr }, llm))
    }

    pub fn arrivals(&self) -> Vec<Arrival> {
        self.inner
            .arrivals
            .lock()
            .map(|a| a.iter().cloned().collect())
            .unwrap_or_default()
    }

    pub fn max_in_flight(&self) -> u64 {
        self.inner.max_in_flight.load(Ordering::SeqCst)
    }

    pub fn in_flight(&self) -> u64 {
        self.inner.in_flight.load(Ordering::SeqCst)
    }

    pub fn rejected_by_mock(&self) -> u64 {
        self.inner.rejected.load(Ordering::SeqCst)
    }

    /// In-flight counts sampled every 5 ms since the last reset.
    pub fn in_flight_samples(&self) -> Vec<u64> {
        self.inner
            .samples
            .lock()
            .map(|s| s.iter().copied().collect())
            .unwrap_or_default()
    }

    pub fn reset(&self) {
        reset_inner(&self.inner);
    }

    /// Its quota drops to 0 for `secs` seconds: every call meanwhile is
    /// answered 429 with `Retry-After: secs` (counted as refused).
    pub fn go_down(&self, secs: u64) {
        go_down(&self.inner, secs);
    }
}

fn go_down(inner: &Inner, secs: u64) {
    let until = Instant::now() + Duration::from_secs(secs.min(3600));
    if let Ok(mut d) = inner.down.lock() {
        *d = Some((until, secs.min(3600)));
    }
}

#[derive(Deserialize)]
struct DownQuery {
    secs: u64,
}

async fn down(State(inner): State<Arc<Inner>>, Query(query): Query<DownQuery>) -> StatusCode {
    go_down(&inner, query.secs);
    StatusCode::NO_CONTENT
}

/// While down: the refusal, with how long it has left.
fn refusal_while_down(inner: &Inner) -> Option<Response> {
    let (until, _) = (*inner.down.lock().ok()?)?;
    let left = until.checked_duration_since(Instant::now())?;
    let mut response = (
        StatusCode::TOO_MANY_REQUESTS,
        "mock: this deployment's quota is 0 for now\n",
    )
        .into_response();
    let secs = left.as_secs_f64().ceil().max(1.0) as u64;
    if let Ok(value) = secs.to_string().parse() {
        response
            .headers_mut()
            .insert(axum::http::header::RETRY_AFTER, value);
    }
    Some(response)
}

fn reset_inner(inner: &Inner) {
    if let Ok(mut s) = inner.start.lock() {
        *s = Instant::now();
    }
    if let Ok(mut a) = inner.arrivals.lock() {
        a.clear();
    }
    if let Ok(mut s) = inner.samples.lock() {
        s.clear();
    }
    inner
        .max_in_flight
        .store(inner.in_flight.load(Ordering::SeqCst), Ordering::SeqCst);
    inner.rejected.store(0, Ordering::SeqCst);
    // A reset starts the count of the current calendar second afresh: a
    // run just before must not use up the next run's second.
    if let Ok(mut w) = inner.window.lock() {
        *w = (0, 0);
    }
    if let Ok(mut d) = inner.down.lock() {
        *d = None;
    }
}

fn header(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

async fn handle(
    State(inner): State<Arc<Inner>>,
    Query(query): Query<DelayQuery>,
    headers: HeaderMap,
    _uri: Uri,
) -> Response {
    let now = Instant::now();
    let start = inner.start.lock().map(|s| *s).unwrap_or(now);
    let at = now.saturating_duration_since(start);
    let sent = sent_since(
        start,
        header(&headers, SENT_HEADER).and_then(|s| s.parse().ok()),
        now,
    );
    let second = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default();
    let now_in_flight = inner.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    let _guard = InFlight(&inner);
    inner
        .max_in_flight
        .fetch_max(now_in_flight, Ordering::SeqCst);
    if let Ok(mut a) = inner.arrivals.lock() {
        if a.len() >= MAX_ARRIVALS {
            a.pop_front();
        }
        a.push_back(Arrival {
            at,
            key: header(&headers, "x-api-key"),
            seq: header(&headers, "x-seq").and_then(|s| s.parse().ok()),
            host: header(&headers, "host"),
            queue_ticket: header(&headers, "x-sluice-queue-ticket").and_then(|s| s.parse().ok()),
            second,
            sent,
        });
    }
    let this_second = match inner.window.lock() {
        Ok(mut w) => {
            if w.0 != second {
                *w = (second, 0);
            }
            w.1 += 1;
            w.1
        }
        Err(_) => 0,
    };
    if let Some(refusal) = refusal_on_demand(&headers).or_else(|| refusal_while_down(&inner)) {
        inner.rejected.fetch_add(1, Ordering::SeqCst);
        return refusal;
    }
    let over_rate = inner.limits.max_per_second > 0 && this_second > inner.limits.max_per_second;
    let over_flight = inner.limits.max_in_flight > 0 && now_in_flight > inner.limits.max_in_flight;
    if over_rate || over_flight {
        inner.rejected.fetch_add(1, Ordering::SeqCst);
        return (
            StatusCode::TOO_MANY_REQUESTS,
            "mock: over the provider's limit\n",
        )
            .into_response();
    }
    let delay = header(&headers, "x-mock-delay-ms")
        .and_then(|d| d.parse().ok())
        .or(query.delay_ms)
        .unwrap_or(0);
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay.min(60_000))).await;
    }
    (StatusCode::OK, "ok\n").into_response()
}

/// The refusal a test asked for (`x-mock-status`, `x-mock-retry-after`).
pub(crate) fn refusal_on_demand(headers: &HeaderMap) -> Option<Response> {
    let status = header(headers, "x-mock-status")?
        .parse::<u16>()
        .ok()
        .and_then(|s| StatusCode::from_u16(s).ok())
        .filter(|s| s.is_client_error() || s.is_server_error())?;
    let mut response = (status, "mock: refused on demand\n").into_response();
    if let Some(wait) = headers.get("x-mock-retry-after") {
        response
            .headers_mut()
            .insert(axum::http::header::RETRY_AFTER, wait.clone());
    }
    Some(response)
}

async fn stats(State(inner): State<Arc<Inner>>) -> Json<MockStats> {
    let uptime = inner.start.lock().map(|s| s.elapsed()).unwrap_or_default();
    let last_second = inner
        .arrivals
        .lock()
        .map(|a| {
            let to = uptime.as_secs();
            a.iter()
                .filter(|x| to > 0 && x.at.as_secs() == to - 1)
                .count() as u64
        })
        .unwrap_or(0);
    Json(MockStats {
        total: inner.arrivals.lock().map(|a| a.len() as u64).unwrap_or(0),
        rejected_by_mock: inner.rejected.load(Ordering::SeqCst),
        in_flight: inner.in_flight.load(Ordering::SeqCst),
        max_in_flight: inner.max_in_flight.load(Ordering::SeqCst),
        uptime_ms: u64::try_from(uptime.as_millis()).unwrap_or(u64::MAX),
        last_second,
    })
}

async fn reset(State(inner): State<Arc<Inner>>) -> StatusCode {
    reset_inner(&inner);
    StatusCode::NO_CONTENT
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stamp_reads_on_the_mocks_clock_and_a_foreign_one_is_dropped() {
        let stamp = sent_stamp();
        let start = process_origin() + Duration::from_micros(stamp);
        let now = Instant::now() + Duration::from_millis(5);
        assert_eq!(
            sent_since(start, Some(stamp + 1_000), now),
            Some(Duration::from_millis(1))
        );
        // Sent before the mock's start: at its start.
        assert_eq!(sent_since(start, Some(0), now), Some(Duration::ZERO));
        assert_eq!(sent_since(start, Some(u64::MAX), now), None);
        assert_eq!(sent_since(start, None, now), None);
    }
}
