//! The Sluice admin service: policies in SQLite, edited through a JSON API
//! and a Leptos web UI, carried to every Envoy by the filter's sync, and
//! live utilization from what the Envoys report.

#![forbid(unsafe_code)]

pub mod access;
mod answer;
pub mod api;
pub mod as_code;
pub mod auth;
pub mod clock;
pub mod error;
mod expiring;
pub mod fleet;
pub mod kv;
pub mod live;
pub mod login;
pub mod managed;
pub mod metrics;
pub mod people_cli;
pub mod price_catalog;
pub mod push;
pub mod relay;
pub mod rlqs;
pub mod secrets;
pub mod server;
pub mod store;
pub mod writes;

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

/// What the admin was told at its start: how it answers, whom it
/// believes, what it asks of callers. Read only while it serves.
#[derive(Default)]
pub struct AdminConfig {
    /// Bearer token filters must send to `/api/v1/sync` (none: any filter).
    pub sync_token: Option<String>,
    /// Mark the session cookie `Secure` (behind HTTPS).
    pub secure_cookies: bool,
    /// Bearer token `/metrics` asks for (none: open, as Prometheus expects
    /// by default; it lists policy names).
    pub metrics_token: Option<String>,
    /// Connection limits for [`serve`].
    pub server_limits: server::ServerLimits,
    /// With `--insecure-dev`: the Host names requests may carry (a guard
    /// against DNS rebinding, since nothing asks for a login).
    pub allowed_hosts: Vec<String>,
    /// A reverse proxy's user header, believed from its addresses only.
    pub proxy_users: access::ProxyUsers,
    /// Where a client's address comes from (the peer, or a trusted proxy).
    pub addressing: ClientAddressing,
}

/// The admin while it serves: its configuration, and the services every
/// request may use.
pub struct AppState {
    pub config: AdminConfig,
    pub store: Store,
    pub credentials: Credentials,
    pub sessions: Sessions,
    /// Throttles and the bound on password checks in flight.
    pub login: LoginGuard,
    /// Where passwords are checked.
    pub passwords: PasswordChecker,
    pub live: Live,
    pub metrics: Metrics,
    /// Global policies' shares (fleet mode).
    pub fleet: Ledgers,
    /// Pauses and rate cuts one Envoy's provider asked for, for the others.
    pub relay: relay::ProviderRelay,
    /// `/healthz`'s store check, at most once a second.
    pub health: HealthProbe,
    /// `--managed-dir`: the policies are the directory's.
    pub managed: Option<Arc<managed::Managed>>,
    /// Held watches, told of policy changes (push).
    pub changes: push::Changes,
    /// Told when a way in may have closed (live streams ask again).
    pub access_changes: access::AccessChanges,
    /// Key lookups (`key-label`), per caller.
    pub key_lookups: login::KeyedThrottle<String>,
    /// Stock Envoys' RLQS streams open now.
    pub rlqs: Arc<rlqs::Clients>,
    /// Syncs being answered now: one past `--max-syncs-in-flight` is shed
    /// (`api::envoys`).
    pub sync_turns: tokio::sync::Semaphore,
}

/// Syncs answered at once by default. At 5 000 Envoys a second on two
/// cores the admin fell behind and every sync waited its turn until the
/// Envoys' timeouts (BENCHMARKS.md section 12); past this many, a sync is
/// answered `503` at once and its Envoy keeps its set and shares and
/// syncs again after its backoff.
pub const DEFAULT_MAX_SYNCS_IN_FLIGHT: usize = 256;

/// The store's health, checked at most once a second however often
/// `/healthz` is asked.
#[derive(Default)]
pub struct HealthProbe {
    last: tokio::sync::Mutex<Option<(std::time::Instant, Option<u64>)>>,
}

impl HealthProbe {
    const FRESH: Duration = Duration::from_secs(1);

    /// The policy set version, or None when the store does not answer.
    pub async fn check(&self, store: &Store) -> Option<u64> {
        let mut last = self.last.lock().await;
        if let Some((at, result)) = *last {
            if at.elapsed() < Self::FRESH {
                return result;
            }
        }
        // A database that is down may take the pool's whole wait to say
        // so; a health check answers within a second either way.
        let result = tokio::time::timeout(Self::FRESH, store.policy_set_version())
            .await
            .ok()
            .and_then(Result::ok);
        *last = Some((std::time::Instant::now(), result));
        result
    }
}

impl AppState {
    pub fn new(
        store: Store,
        credentials: Credentials,
        sync_token: Option<String>,
        secure_cookies: bool,
    ) -> Self {
        let fleet_secret = store.fleet_secret();
        Self {
            config: AdminConfig {
                sync_token,
                secure_cookies,
                ..AdminConfig::default()
            },
            store,
            passwords: PasswordChecker::new(),
            credentials,
            sessions: Sessions::default(),
            login: LoginGuard::default(),
            live: Live::new(DEFAULT_INSTANCE_TTL),
            metrics: Metrics::default(),
            fleet: Ledgers::default().with_secret(fleet_secret),
            relay: relay::ProviderRelay::default(),
            health: HealthProbe::default(),
            managed: None,
            changes: push::Changes::default(),
            access_changes: access::AccessChanges::default(),
            key_lookups: api::key_lookup_throttle(),
            rlqs: Arc::default(),
            sync_turns: tokio::sync::Semaphore::new(DEFAULT_MAX_SYNCS_IN_FLIGHT),
        }
    }

    /// Answers at most `max` syncs at once (`--max-syncs-in-flight`).
    pub fn with_max_syncs_in_flight(mut self, max: usize) -> Self {
        self.sync_turns = tokio::sync::Semaphore::new(max.min(tokio::sync::Semaphore::MAX_PERMITS));
        self
    }

    /// Takes the policies from `dir` (policies as code, managed mode).
    pub fn with_managed_dir(mut self, dir: PathBuf) -> Self {
        self.managed = Some(Arc::new(managed::Managed::new(dir)));
        self
    }

    /// Believes a reverse proxy's user header (off by default).
    pub fn with_proxy_users(mut self, proxy_users: access::ProxyUsers) -> Self {
        self.config.proxy_users = proxy_users;
        self
    }

    /// Connection limits (how many, how long to send headers).
    pub fn with_server_limits(mut self, limits: server::ServerLimits) -> Self {
        self.config.server_limits = limits;
        self
    }

    /// `/metrics` asks for this bearer token.
    pub fn with_metrics_token(mut self, token: Option<String>) -> Self {
        self.config.metrics_token = token;
        self
    }

    /// With `--insecure-dev`: the Host names requests may carry besides
    /// the loopback ones.
    pub fn with_allowed_hosts(mut self, hosts: Vec<String>) -> Self {
        self.config.allowed_hosts = hosts;
        self
    }

    /// Forgets instances silent for `ttl` (default [`DEFAULT_INSTANCE_TTL`]).
    pub fn with_instance_ttl(mut self, ttl: sluice_shared::Span) -> Self {
        self.live = Live::new(ttl);
        self
    }

    /// Believes `addressing.header` from the trusted proxies.
    pub fn with_addressing(mut self, addressing: ClientAddressing) -> Self {
        self.config.addressing = addressing;
        self
    }

    /// Keeps fleet ledgers and the provider news relayed between Envoys
    /// in Redis, through `connection`, for several replicas.
    pub fn with_redis(mut self, connection: &kv::RedisConnection) -> Self {
        self.fleet = Ledgers::redis(connection).with_secret(self.store.fleet_secret());
        self.relay = relay::ProviderRelay::redis(connection);
        self
    }
}

/// The UI's security headers: only our own scripts (and wasm) run, nothing
/// frames the admin.
const CONTENT_SECURITY_POLICY: &str =
    "default-src 'self'; script-src 'self' 'wasm-unsafe-eval'; style-src 'self'; img-src 'self' data:; frame-ancestors 'none'";

pub fn app(state: Arc<AppState>, ui_dir: Option<PathBuf>) -> Router {
    let guard = state.credentials.is_insecure().then(|| {
        let allowed: Arc<[String]> = state.config.allowed_hosts.clone().into();
        axum::middleware::from_fn(move |req, next| {
            insecure_dev_host_guard(Arc::clone(&allowed), req, next)
        })
    });
    let body_deadline = state.config.server_limits.header_read_timeout;
    // RLQS beside the API, outside its request timeout (and the body
    // deadline below): a stream lasts as long as its Envoy.
    let mut router = api::routes()
        .with_state(Arc::clone(&state))
        .merge(rlqs::routes(state));
    if let Some(dir) = ui_dir {
        let index = dir.join("index.html");
        // Client-side routes (/policies/bank, /live) all load the app. The
        // UI build writes each file brotli- and gzip-compressed beside it
        // (`make ui`): a browser that takes either gets that, a fifth of
        // the wasm's size, and no CPU is spent compressing per request.
        let app = ServeDir::new(dir)
            .precompressed_br()
            .precompressed_gzip()
            .fallback(
                ServeFile::new(index)
                    .precompressed_br()
                    .precompressed_gzip(),
            );
        router = router.fallback_service(app);
    }
    if let Some(guard) = guard {
        router = router.layer(guard);
    }
    router
        .layer(axum::middleware::map_request(
            move |req: axum::extract::Request| {
                let streams = req.uri().path() == rlqs::STREAM_PATH;
                let deadline = (!streams).then_some(body_deadline);
                server::body_deadline(deadline, req)
            },
        ))
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

/// With `--insecure-dev` nothing asks for a login, so a web page that
/// points a DNS name at 127.0.0.1 could drive the admin from the operator's
/// browser (DNS rebinding). Requests must name the admin by a loopback
/// name, or one the operator allowed (`--allowed-host`).
async fn insecure_dev_host_guard(
    allowed: Arc<[String]>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    // HTTP/2 names the host in `:authority` (a gRPC stream, an RLQS
    // client's), HTTP/1.1 in `Host`.
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .or_else(|| req.uri().authority().map(|a| a.as_str()))
        .map(|h| host_name(h).to_ascii_lowercase());
    let ok = host.as_deref().is_some_and(|h| {
        matches!(h, "localhost" | "127.0.0.1" | "[::1]" | "::1")
            || allowed.iter().any(|a| a.eq_ignore_ascii_case(h))
    });
    if ok {
        return next.run(req).await;
    }
    (
        axum::http::StatusCode::MISDIRECTED_REQUEST,
        "--insecure-dev answers only requests to localhost (or an --allowed-host)\n",
    )
        .into_response()
}

/// The host of a Host header, without its port.
fn host_name(host: &str) -> &str {
    if let Some(rest) = host.strip_prefix('[') {
        return rest
            .split(']')
            .next()
            .map_or(host, |h| &host[..h.len() + 2]);
    }
    host.rsplit_once(':')
        .filter(|(_, port)| port.chars().all(|c| c.is_ascii_digit()))
        .map_or(host, |(name, _)| name)
}

/// Live ticks between two readings of the policies' sizes.
const POLICY_SIZES_EVERY: u64 = 5;

/// Publishes one live frame a second, to the SSE streams and `/metrics`.
pub fn spawn_live_ticker(state: Arc<AppState>) {
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(1));
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let mut ticks = 0u64;
        loop {
            every.tick().await;
            let now = store::now_ms();
            let frame = state.live.tick(now);
            state.metrics.observe(&frame);
            state.metrics.rlqs_streams.set(state.rlqs.open() as i64);
            state
                .metrics
                .observe_instances(&state.live.sync_health(now));
            // The policies' sizes, for /metrics' limit lines: a read every
            // few seconds (edits also refresh them at once).
            if ticks % POLICY_SIZES_EVERY == 0 {
                if let Ok(set) = state.store.policy_set().await {
                    state.metrics.observe_policies(&set);
                }
            }
            ticks += 1;
        }
    });
}

/// Forgets, once a minute, the instances not heard from for the instance
/// TTL, so that pod churn does not grow the store.
pub fn spawn_instance_pruner(state: Arc<AppState>) {
    tokio::spawn(async move {
        // Often enough that an instance is gone within one and a half TTLs.
        let period = INSTANCE_PRUNE_EVERY.min(state.live.instance_ttl().div(2).as_duration());
        let mut every = tokio::time::interval(period.max(Duration::from_millis(100)));
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            every.tick().await;
            let before = store::now_ms().saturating_sub(state.live.instance_ttl().as_millis());
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
    serve_with_tls(listener, None, state, ui_dir, shutdown).await
}

/// Serves plain HTTP on `listener` and, when given, HTTPS on the second
/// listener, until `shutdown` resolves.
pub async fn serve_with_tls(
    listener: tokio::net::TcpListener,
    tls_listener: Option<(tokio::net::TcpListener, Arc<rustls::ServerConfig>)>,
    state: Arc<AppState>,
    ui_dir: Option<PathBuf>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    spawn_live_ticker(state.clone());
    spawn_instance_pruner(state.clone());
    push::spawn_version_poller(state.clone());
    writes::publish_set(&state).await;
    let limits = state.config.server_limits;
    let state_for_stop = Arc::clone(&state);
    let app = app(state, ui_dir);
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let stopped_too = stopped.clone();
    let until = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let tls_task = tls_listener.map(|(tls_listener, config)| {
        tokio::spawn(server::serve(
            tls_listener,
            app.clone(),
            Some(config),
            limits,
            until(stopped_too),
        ))
    });
    let stopping = Arc::clone(&state_for_stop);
    tokio::spawn(async move {
        shutdown.await;
        // Held watches answer now, so that no connection holds us up.
        stopping.changes.stop();
        let _ = stop.send(true);
    });
    let plain = server::serve(listener, app, None, limits, until(stopped)).await;
    if let Some(task) = tls_task {
        task.await.map_err(std::io::Error::other)??;
    }
    plain
}
