//! The Sluice admin service: policies in SQLite, edited through a JSON API
//! and a Leptos web UI, carried to every Envoy by the filter's sync, and
//! live utilization from what the Envoys report.

pub mod api;
pub mod auth;
pub mod error;
pub mod fleet;
pub mod live;
pub mod login;
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

use crate::auth::{Credentials, Sessions};
use crate::fleet::Ledgers;
use crate::live::Live;
use crate::login::{ClientAddressing, LoginGuard, PasswordChecker};
use crate::metrics::Metrics;
use crate::store::Store;

/// How long an Envoy that stopped syncing stays listed.
pub const DEFAULT_INSTANCE_TTL: sluice_shared::Span = sluice_shared::Span::from_secs(3600);

pub struct AppState {
    pub store: Store,
    pub credentials: Credentials,
    pub sessions: Sessions,
    /// Throttles and the bound on password checks in flight.
    pub login: LoginGuard,
    /// Where passwords are checked.
    pub passwords: PasswordChecker,
    /// Where a client's address comes from (the peer, or a trusted proxy).
    pub addressing: ClientAddressing,
    pub live: Live,
    pub metrics: Metrics,
    /// Bearer token filters must send to `/api/v1/sync` (none: any filter).
    pub sync_token: Option<String>,
    /// Mark the session cookie `Secure` (behind HTTPS).
    pub secure_cookies: bool,
    /// Global policies' shares (fleet mode).
    pub fleet: Ledgers,
    /// Instances silent for longer are forgotten (live view and store).
    pub instance_ttl: sluice_shared::Span,
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
            passwords: PasswordChecker::new(credentials.clone()),
            credentials,
            sessions: Sessions::default(),
            login: LoginGuard::default(),
            addressing: ClientAddressing::default(),
            live: Live::new(DEFAULT_INSTANCE_TTL),
            metrics: Metrics::default(),
            sync_token,
            secure_cookies,
            fleet: Ledgers::default(),
            instance_ttl: DEFAULT_INSTANCE_TTL,
        }
    }

    /// Forgets instances silent for `ttl` (default [`DEFAULT_INSTANCE_TTL`]).
    pub fn with_instance_ttl(mut self, ttl: sluice_shared::Span) -> Self {
        self.instance_ttl = ttl;
        self.live = Live::new(ttl);
        self
    }

    /// Believes `addressing.header` from the trusted proxies.
    pub fn with_addressing(mut self, addressing: ClientAddressing) -> Self {
        self.addressing = addressing;
        self
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
            let frame = state.live.tick(now);
            state.metrics.observe(&frame);
        }
    });
}

/// Forgets, once a minute, the instances not heard from for the instance
/// TTL, so that pod churn does not grow the store.
pub fn spawn_instance_pruner(state: Arc<AppState>) {
    tokio::spawn(async move {
        // Often enough that an instance is gone within one and a half TTLs.
        let period = INSTANCE_PRUNE_EVERY.min(state.instance_ttl.div(2).as_duration());
        let mut every = tokio::time::interval(period.max(Duration::from_millis(100)));
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            every.tick().await;
            let before = store::now_ms().saturating_sub(state.instance_ttl.as_millis());
            match state.store.prune_instances(before).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(instances = n, "forgot instances silent past the TTL"),
                Err(e) => tracing::warn!(error = %e, "pruning instances"),
            }
        }
    });
}

const INSTANCE_PRUNE_EVERY: Duration = Duration::from_secs(60);

/// Serves until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    ui_dir: Option<PathBuf>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    spawn_live_ticker(state.clone());
    spawn_instance_pruner(state.clone());
    let app = app(state, ui_dir);
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown)
    .await
}
