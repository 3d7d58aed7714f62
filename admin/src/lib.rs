//! The Sluice admin service: policies in SQLite, edited through a JSON API
//! and a Leptos web UI, carried to every Envoy by the filter's sync, and
//! live utilization from what the Envoys report.

pub mod api;
pub mod auth;
pub mod error;
pub mod fleet;
pub mod live;
pub mod metrics;
pub mod store;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::http::{header, HeaderValue};
use axum::Router;
use tower_http::services::{ServeDir, ServeFile};
use tower_http::set_header::SetResponseHeaderLayer;
use tower_http::trace::TraceLayer;

use crate::auth::{Credentials, LoginThrottle, Sessions};
use crate::fleet::Ledgers;
use crate::live::Live;
use crate::metrics::Metrics;
use crate::store::Store;

pub struct AppState {
    pub store: Store,
    pub credentials: Credentials,
    pub sessions: Sessions,
    pub throttle: LoginThrottle,
    pub live: Live,
    pub metrics: Metrics,
    /// Bearer token filters must send to `/api/v1/sync` (none: any filter).
    pub sync_token: Option<String>,
    /// Mark the session cookie `Secure` (behind HTTPS).
    pub secure_cookies: bool,
    /// Global policies' shares (fleet mode).
    pub fleet: Ledgers,
}

impl AppState {
    pub fn new(
        store: Store,
        credentials: Credentials,
        sync_token: Option<String>,
        secure_cookies: bool,
    ) -> Self {
        Self {
            store,
            credentials,
            sessions: Sessions::default(),
            throttle: LoginThrottle::default(),
            live: Live::default(),
            metrics: Metrics::default(),
            sync_token,
            secure_cookies,
            fleet: Ledgers::default(),
        }
    }

    /// Keeps fleet ledgers in `ledgers` (Redis, for several replicas).
    pub fn with_ledgers(mut self, ledgers: Ledgers) -> Self {
        self.fleet = ledgers;
        self
    }
}

/// The UI's security headers: only our own scripts (and wasm) run, nothing
/// frames the admin.
const CONTENT_SECURITY_POLICY: &str =
    "default-src 'self'; script-src 'self' 'wasm-unsafe-eval'; style-src 'self'; img-src 'self' data:; frame-ancestors 'none'";

pub fn app(state: Arc<AppState>, ui_dir: Option<PathBuf>) -> Router {
    let mut router = api::routes().with_state(state);
    if let Some(dir) = ui_dir {
        let index = dir.join("index.html");
        // Client-side routes (/policies/bank, /live) all load the app.
        router = router.fallback_service(ServeDir::new(dir).fallback(ServeFile::new(index)));
    }
    router
        .layer(SetResponseHeaderLayer::if_not_present(
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(CONTENT_SECURITY_POLICY),
        ))
        .layer(SetResponseHeaderLayer::overriding(
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        ))
        .layer(SetResponseHeaderLayer::overriding(
            header::X_FRAME_OPTIONS,
            HeaderValue::from_static("DENY"),
        ))
        .layer(TraceLayer::new_for_http())
}

/// Publishes one live frame a second, to the SSE streams and `/metrics`.
pub fn spawn_live_ticker(state: Arc<AppState>) {
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(1));
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            every.tick().await;
            let now = store::now_ms();
            state.live.tick(now);
            state.metrics.observe(&state.live.frame(now));
        }
    });
}

/// Serves until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    ui_dir: Option<PathBuf>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    spawn_live_ticker(state.clone());
    let app = app(state, ui_dir);
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown)
    .await
}
