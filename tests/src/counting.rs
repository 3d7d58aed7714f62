//! An upstream that counts every request it sees begin, and how much of
//! each one's body arrived: what a provider that counts requests counts,
//! a call cut off after its headers included.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::Router;

/// What the upstream saw, in arrival order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Seen {
    /// Requests whose headers arrived.
    pub begun: u64,
    /// The body's length of each request read to its end.
    pub complete: Vec<usize>,
    /// Requests whose body was cut off (reset, closed).
    pub cut: u64,
    /// Each request's `x-sluice-member`, `x-api-key` and `x-test-id`
    /// headers, as they came.
    pub headers: Vec<(Option<String>, Option<String>, Option<String>)>,
}

pub struct CountingUpstream {
    pub addr: SocketAddr,
    seen: Arc<Mutex<Seen>>,
}

impl CountingUpstream {
    pub async fn start() -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let seen = Arc::new(Mutex::new(Seen::default()));
        let app = Router::new().fallback(count).with_state(Arc::clone(&seen));
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self { addr, seen })
    }

    pub fn seen(&self) -> Seen {
        self.seen.lock().map(|s| s.clone()).unwrap_or_default()
    }
}

async fn count(
    State(seen): State<Arc<Mutex<Seen>>>,
    headers: HeaderMap,
    body: Body,
) -> &'static str {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    if let Ok(mut s) = seen.lock() {
        s.begun += 1;
        s.headers.push((
            header("x-sluice-member"),
            header("x-api-key"),
            header("x-test-id"),
        ));
    }
    let read = axum::body::to_bytes(body, 64 * 1024 * 1024).await;
    if let Ok(mut s) = seen.lock() {
        match read {
            Ok(bytes) => s.complete.push(bytes.len()),
            Err(_) => s.cut += 1,
        }
    }
    "{\"ok\": true}"
}
