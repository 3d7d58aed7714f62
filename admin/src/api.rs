//! The JSON API under `/api/v1`, the sync endpoint for filters, the live
//! SSE stream, `/metrics` and `/healthz`.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{ConnectInfo, DefaultBodyLimit, Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Extension;
use axum::{Json, Router};
use axum_extra::extract::cookie::{Cookie, CookieJar, SameSite};
use futures_util::stream::{self, Stream, StreamExt};
use serde::Deserialize;
use serde_json::Value;
use sluice_api::people::{check_name, Role, BOOTSTRAP_ADMIN};
use sluice_api::{
    Applied, ApplyRequest, AuditLog, FleetView, Health, History, Instance, InstanceList,
    KeyLabelAnswer, KeyLabelRequest, LoginRequest, PolicyList, PolicyOrder, SessionInfo,
    StoredPolicy, Validated,
};
use sluice_shared::key_view::{label_secret, name_key};
use sluice_shared::price::PriceTable;
use sluice_shared::validate::policy_from_value;
use sluice_shared::{FieldError, Policy, ValidationErrors};
use sluice_wire::sync::{SyncReport, SYNC_PATH};
use sluice_wire::sync_answer::AdminAnswer;
use tokio_stream::wrappers::BroadcastStream;

use crate::access::{Editor, Operator, Presented, SyncPeer, Via, Writer};
use crate::answer::http_answer;
use crate::as_code::{load, SourceFile};
use crate::auth::{bears, Credentials, SESSION_COOKIE};
use crate::error::ApiError;
use crate::login::Refused;
use crate::server::OverTls;
use crate::store::now_ms;
use crate::AppState;

type Shared = Arc<AppState>;

/// Largest request body: a policy set of a few hundred policies, or a sync
/// report, fits with room to spare.
const MAX_BODY: usize = 256 * 1024;

/// Longest a request may take (the live stream excepted): a client that
/// trickles its body, or a handler stuck on the store, gives up its
/// connection.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

pub fn routes() -> Router<Shared> {
    Router::new()
        .route("/api/v1/login", post(login))
        .route("/api/v1/logout", post(logout))
        .route("/api/v1/session", get(session))
        .route("/api/v1/policies", get(list_policies).post(create_policy))
        .route(
            "/api/v1/policies/{name}",
            get(get_policy).put(update_policy).delete(delete_policy),
        )
        .route("/api/v1/policies/{name}/history", get(policy_history))
        .route("/api/v1/policies/{name}/key-label", post(key_label))
        .route("/api/v1/validate", post(validate))
        .route("/api/v1/prices", get(get_prices).put(put_prices))
        .route("/api/v1/apply", post(apply))
        .route("/api/v1/order", axum::routing::put(reorder))
        .route("/api/v1/audit", get(audit_log))
        .route("/api/v1/instances", get(instances))
        .route("/api/v1/fleet", get(fleet))
        .merge(crate::people_api::routes())
        .route(SYNC_PATH, post(sync))
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        // Held up to 25 s (push), inside the 30 s every request has.
        .route(crate::push::WATCH_PATH, post(crate::push::watch))
        .layer(tower_http::timeout::TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            REQUEST_TIMEOUT,
        ))
        .route("/api/v1/live", get(live))
        .layer(DefaultBodyLimit::max(MAX_BODY))
}

fn etag(version: u64) -> HeaderValue {
    HeaderValue::from_str(&format!("\"{version}\"")).unwrap_or(HeaderValue::from_static("\"0\""))
}

/// `If-Match: "3"` (or `W/"3"`, or a bare 3) → 3.
fn if_match(headers: &HeaderMap) -> Result<u64, ApiError> {
    let raw = headers
        .get(header::IF_MATCH)
        .and_then(|v| v.to_str().ok())
        .ok_or(ApiError::PreconditionRequired)?;
    raw.trim()
        .trim_start_matches("W/")
        .trim_matches('"')
        .parse()
        .map_err(|_| ApiError::BadRequest(format!("If-Match: {raw:?} is not a policy version")))
}

fn parse_policy_body(body: Value) -> Result<Policy, ApiError> {
    policy_from_value(body).map_err(ApiError::Invalid)
}

/// A browser-session cookie (no Max-Age): the server-side session expires
/// on its own after 12 h. `Secure` whenever the login came over TLS (or
/// `--secure-cookies`, behind a proxy that ends TLS), so a browser never
/// sends it over plain HTTP.
fn session_cookie(state: &AppState, over_tls: bool, value: String) -> Cookie<'static> {
    Cookie::build((SESSION_COOKIE, value))
        .http_only(true)
        .same_site(SameSite::Strict)
        .secure(state.config.secure_cookies || over_tls)
        .path("/")
        .build()
}

async fn login(
    State(state): State<Shared>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    tls: Option<Extension<OverTls>>,
    headers: HeaderMap,
    jar: CookieJar,
    Json(form): Json<LoginRequest>,
) -> Result<Response, ApiError> {
    let ip = state.config.addressing.client(peer.ip(), &headers);
    let user = form
        .user
        .as_deref()
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .unwrap_or(BOOTSTRAP_ADMIN)
        .to_string();
    // A name that could never be stored is refused before it costs a
    // throttle entry or a check.
    if check_name(&user).is_err() {
        state.metrics.login_failures.inc();
        return Err(ApiError::Unauthorized);
    }
    // The guess is taken from the throttles before the password is
    // checked, and checks wait for their turn: a storm of wrong logins
    // costs a few argon2 runs, not one each.
    let attempt = match state.login.attempt(&user, ip).await {
        Ok(attempt) => attempt,
        Err(refused) => {
            state.metrics.login_throttled.inc();
            tracing::warn!(%ip, %user, ?refused, "login refused unchecked");
            return Err(match refused {
                Refused::Throttled(wait) => ApiError::Throttled(wait.as_duration()),
                Refused::Busy => ApiError::Unavailable("too many logins at once; retry".into()),
            });
        }
    };
    // A stored user first; the admin password is the account `admin`
    // while no stored user takes that name.
    let stored = state.store.user(&user).await?;
    let (credentials, bootstrap) = match &stored {
        Some(record) => (Credentials::from_hash(&record.password_hash).ok(), false),
        None if user == BOOTSTRAP_ADMIN && state.credentials.has_bootstrap_password() => {
            (Some(state.credentials.clone()), true)
        }
        None => (None, false),
    };
    state.metrics.password_checks.inc();
    let ok = state.passwords.check(credentials, form.password).await;
    if !ok {
        drop(attempt);
        state.metrics.login_failures.inc();
        tracing::warn!(%ip, %user, "login failed");
        return Err(ApiError::Unauthorized);
    }
    attempt.succeeded();
    let fingerprint = stored
        .as_ref()
        .map(|r| crate::auth::password_fingerprint(&r.password_hash));
    let (token, session) = state
        .sessions
        .create(&user, bootstrap, fingerprint)
        .map_err(|e| ApiError::Internal(e.to_string()))?;
    state
        .store
        .audit_event(&user, "login", &ip.to_string())
        .await?;
    tracing::info!(%ip, %user, "login");
    let jar = jar.add(session_cookie(&state, tls.is_some(), token));
    let role = stored.map_or(Role::Admin, |r| r.info.role);
    let info = SessionInfo {
        user: session.user,
        csrf_token: session.csrf,
        insecure_dev: false,
        role,
        via: "password".into(),
    };
    Ok((jar, Json(info)).into_response())
}

async fn logout(
    State(state): State<Shared>,
    _caller: Writer,
    tls: Option<Extension<OverTls>>,
    jar: CookieJar,
) -> Response {
    if let Some(c) = jar.get(SESSION_COOKIE) {
        state.sessions.remove(c.value());
        state.access_changes.changed();
    }
    let jar = jar.remove(session_cookie(&state, tls.is_some(), String::new()));
    (jar, StatusCode::NO_CONTENT).into_response()
}

/// Who the caller is, for the UI: by session, proxy header or token.
async fn session(Operator(caller): Operator) -> Json<SessionInfo> {
    let csrf_token = match &caller.via {
        Via::Session { csrf } => csrf.clone(),
        // A proxy's user proves a write with any value in the header.
        Via::Proxy => "proxy".into(),
        Via::Token { .. } | Via::Dev => String::new(),
    };
    Json(SessionInfo {
        insecure_dev: caller.via == Via::Dev,
        via: caller.via.as_str().into(),
        user: caller.actor,
        csrf_token,
        role: caller.role,
    })
}

/// A policy with its version as the `ETag`.
fn with_etag(stored: StoredPolicy) -> Response {
    ([(header::ETAG, etag(stored.version))], Json(stored)).into_response()
}

async fn list_policies(State(state): State<Shared>, _op: Operator) -> Result<Response, ApiError> {
    let mut list: PolicyList = state.store.list().await?;
    list.managed = state.managed.as_ref().map(|m| m.state());
    Ok(([(header::ETAG, etag(list.version))], Json(list)).into_response())
}

async fn get_policy(
    State(state): State<Shared>,
    _op: Operator,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    Ok(with_etag(state.store.get(&name).await?))
}

async fn policy_history(
    State(state): State<Shared>,
    _op: Operator,
    Path(name): Path<String>,
) -> Result<Json<History>, ApiError> {
    let history = state.store.history(&name).await?;
    Ok(Json(History { history }))
}

/// The longest key the live view will name: far above any API key, and
/// below anything Envoy would pass as one header.
const MAX_KEY_LEN: usize = 8 * 1024;

/// The label the live view shows for a key typed in. A POST, so that the
/// key (an API key, say) stays out of URLs and access logs.
/// Key lookups per caller: a few at once, then one every 6 s. A lookup
/// hashes a guessed key the way the Envoys do, so it is an editor's, and
/// counted and audited.
const KEY_LOOKUP_BURST: u64 = 10;
const KEY_LOOKUP_EVERY: sluice_shared::Span = sluice_shared::Span::from_secs(6);

/// Throttles key lookups per caller.
pub fn key_lookup_throttle() -> crate::login::KeyedThrottle<String> {
    crate::login::KeyedThrottle::new(
        KEY_LOOKUP_BURST,
        KEY_LOOKUP_EVERY,
        crate::login::MAX_TRACKED,
    )
}

async fn key_label(
    State(state): State<Shared>,
    Editor(editor): Editor,
    Path(name): Path<String>,
    Json(body): Json<Value>,
) -> Result<Json<KeyLabelAnswer>, ApiError> {
    let now = sluice_shared::Instant::from_millis(now_ms());
    if !state.key_lookups.take(&editor.actor, now) {
        let wait = state
            .key_lookups
            .wait(&editor.actor, now)
            .unwrap_or(KEY_LOOKUP_EVERY);
        tracing::warn!(actor = %editor.actor, policy = %name, "key lookup refused: over the limit");
        return Err(ApiError::Limited(
            format!(
                "{} looked up {KEY_LOOKUP_BURST} keys in a row: one more every {} s",
                editor.actor,
                KEY_LOOKUP_EVERY.as_secs()
            ),
            wait.as_duration(),
        ));
    }
    let KeyLabelRequest { key } = crate::people_api::parse(body)?;
    let invalid = |message: String| {
        ApiError::InvalidRequest(ValidationErrors {
            errors: vec![FieldError {
                path: "key".into(),
                message,
            }],
        })
    };
    if key.is_empty() || key.len() > MAX_KEY_LEN {
        return Err(invalid(format!("must be 1 to {MAX_KEY_LEN} bytes")));
    }
    let stored = state.store.get(&name).await?;
    let Some(spec) = &stored.policy.key else {
        return Err(invalid(format!("policy {name:?} has no key")));
    };
    let secret = label_secret(state.config.sync_token.as_deref());
    let named = name_key(&secret, &name, key.as_bytes(), spec.label);
    // The label, never the key, goes into the audit log.
    state
        .store
        .audit_event(
            &editor.actor,
            "key.lookup",
            &format!("{name} {}", named.label),
        )
        .await?;
    tracing::info!(actor = %editor.actor, policy = %name, label = %named.label, "key looked up");
    Ok(Json(KeyLabelAnswer {
        policy: name,
        label: named.label,
    }))
}

async fn create_policy(
    State(state): State<Shared>,
    editor: Editor,
    Json(body): Json<Value>,
) -> Result<Response, ApiError> {
    refuse_if_managed(&state)?;
    let policy = parse_policy_body(body)?;
    let stored = state.store.create(policy, &editor.0.actor).await?;
    state.metrics.write("create");
    refresh_set_version(&state).await;
    tracing::info!(policy = %stored.policy.name, "policy created");
    let location = HeaderValue::from_str(&format!("/api/v1/policies/{}", stored.policy.name)).ok();
    let mut response = with_etag(stored);
    *response.status_mut() = StatusCode::CREATED;
    if let Some(l) = location {
        response.headers_mut().insert(header::LOCATION, l);
    }
    Ok(response)
}

async fn update_policy(
    State(state): State<Shared>,
    editor: Editor,
    Path(name): Path<String>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Result<Response, ApiError> {
    refuse_if_managed(&state)?;
    let expected = if_match(&headers)?;
    let policy = parse_policy_body(body)?;
    if policy.name != name {
        return Err(ApiError::Invalid(ValidationErrors {
            errors: vec![FieldError {
                path: "name".into(),
                message: format!(
                    "must be {name:?}, the policy being edited (create a new policy to rename)"
                ),
            }],
        }));
    }
    let stored = state
        .store
        .update(&name, policy, expected, &editor.0.actor)
        .await?;
    state.metrics.write("update");
    refresh_set_version(&state).await;
    tracing::info!(policy = %stored.policy.name, version = stored.version, "policy updated");
    Ok(with_etag(stored))
}

async fn delete_policy(
    State(state): State<Shared>,
    editor: Editor,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Result<StatusCode, ApiError> {
    refuse_if_managed(&state)?;
    let expected = if_match(&headers)?;
    state.store.delete(&name, expected, &editor.0.actor).await?;
    state.metrics.write("delete");
    refresh_set_version(&state).await;
    tracing::info!(policy = %name, "policy deleted");
    Ok(StatusCode::NO_CONTENT)
}

/// In managed mode the directory is the only way to change policies.
fn refuse_if_managed(state: &AppState) -> Result<(), ApiError> {
    match &state.managed {
        Some(managed) => Err(ApiError::Conflict(format!(
            "policies are managed from {} (policies as code): change the files there",
            managed.dir.display()
        ))),
        None => Ok(()),
    }
}

#[derive(Deserialize)]
struct ApplyQuery {
    #[serde(default)]
    dry_run: bool,
}

/// Policies as code over the API (a CI job with a write token): the files
/// as text, read and validated as `sluice-admin apply` does, applied in
/// one transaction, or with `?dry_run=true` only diffed.
async fn apply(
    State(state): State<Shared>,
    Editor(editor): Editor,
    Query(query): Query<ApplyQuery>,
    Json(body): Json<Value>,
) -> Result<Json<Applied>, ApiError> {
    refuse_if_managed(&state)?;
    let request: ApplyRequest =
        serde_json::from_value(body).map_err(|e| ApiError::BadRequest(format!("apply: {e}")))?;
    let files: Vec<SourceFile> = request
        .files
        .into_iter()
        .map(|f| SourceFile {
            path: f.path,
            text: f.text,
        })
        .collect();
    let loaded = load(&files).map_err(ApiError::Invalid)?;
    let prices = loaded.prices();
    let applied = state
        .store
        .apply_set(
            (loaded.policies, loaded.sources, prices),
            &editor.actor,
            query.dry_run,
        )
        .await?;
    if applied.applied {
        state.metrics.write("apply");
        refresh_set_version(&state).await;
        tracing::info!(by = %editor.actor, version = applied.version, "policies applied");
    }
    Ok(Json(applied))
}

/// A new evaluation order (first match wins): every policy's name, with
/// `If-Match` naming the set version the caller saw.
async fn reorder(
    State(state): State<Shared>,
    Editor(editor): Editor,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Result<Response, ApiError> {
    refuse_if_managed(&state)?;
    let expected = if_match(&headers)?;
    let order: PolicyOrder =
        serde_json::from_value(body).map_err(|e| ApiError::BadRequest(format!("order: {e}")))?;
    let version = state
        .store
        .reorder(order.names, expected, &editor.actor)
        .await?;
    state.metrics.write("reorder");
    refresh_set_version(&state).await;
    Ok(([(header::ETAG, etag(version))], StatusCode::NO_CONTENT).into_response())
}

/// Keeps `/metrics`' policy set version current after a write (a scrape
/// itself reads nothing from the store).
pub async fn refresh_set_version(state: &AppState) {
    if let Ok(set) = state.store.policy_set().await {
        state.changes.observe(set.version);
        state.metrics.policy_set_version.set(set.version as i64);
        state.metrics.observe_policies(&set);
    }
}

/// The set's price table (`null`: none).
async fn get_prices(
    State(state): State<Shared>,
    _op: Operator,
) -> Result<Json<Option<PriceTable>>, ApiError> {
    Ok(Json(state.store.prices().await?))
}

/// Replaces the set's price table (`null` removes it), checked with every
/// policy: a money limit needs prices. 422 names each bad field
/// (`prices.models.gpt-4o.input`).
async fn put_prices(
    State(state): State<Shared>,
    editor: Editor,
    Json(body): Json<Value>,
) -> Result<Json<sluice_api::PricesSaved>, ApiError> {
    refuse_if_managed(&state)?;
    let table = match body {
        Value::Null => None,
        body => {
            let mut errors = Vec::new();
            match sluice_shared::validate::typed_at::<PriceTable>(body, "prices", &mut errors) {
                Some(table) => Some(table),
                None => return Err(ApiError::Invalid(ValidationErrors { errors })),
            }
        }
    };
    let version = state.store.set_prices(table, &editor.0.actor).await?;
    state.metrics.write("prices");
    refresh_set_version(&state).await;
    tracing::info!(by = %editor.0.actor, version, "prices saved");
    Ok(Json(sluice_api::PricesSaved { version }))
}

/// Checks a policy as the editor types, without saving it.
async fn validate(_op: Operator, Json(body): Json<Value>) -> Result<Json<Validated>, ApiError> {
    parse_policy_body(body)?;
    Ok(Json(Validated { ok: true }))
}

#[derive(Deserialize)]
struct AuditQuery {
    limit: Option<u32>,
    before: Option<i64>,
}

async fn audit_log(
    State(state): State<Shared>,
    _op: Operator,
    Query(q): Query<AuditQuery>,
) -> Result<Json<AuditLog>, ApiError> {
    let entries = state
        .store
        .audit_log(q.limit.unwrap_or(100), q.before)
        .await?;
    Ok(Json(AuditLog { entries }))
}

/// A page of `GET /instances`: `?limit=` (1 to 1000, default 100) after
/// `?after=` (the previous page's `next`).
#[derive(Deserialize)]
struct InstancesQuery {
    limit: Option<u32>,
    after: Option<String>,
}

const MAX_INSTANCES_PAGE: u32 = 1000;

async fn instances(
    State(state): State<Shared>,
    _op: Operator,
    Query(q): Query<InstancesQuery>,
) -> Result<Json<InstanceList>, ApiError> {
    let limit = q.limit.unwrap_or(100).clamp(1, MAX_INSTANCES_PAGE);
    let rows = state
        .store
        .instances(q.after.as_deref().unwrap_or(""), limit)
        .await?;
    let now_ms = now_ms();
    let next = (rows.len() == limit as usize)
        .then(|| rows.last().map(|r| r.id.clone()))
        .flatten();
    let instances = rows
        .into_iter()
        .map(|r| Instance {
            live: now_ms.saturating_sub(r.last_sync_ms) <= crate::live::STALE_AFTER_MS,
            id: r.id,
            first_seen_ms: r.first_seen_ms,
            last_sync_ms: r.last_sync_ms,
            policy_version: r.policy_version,
            syncs: r.syncs,
            report: r.report,
        })
        .collect();
    Ok(Json(InstanceList {
        instances,
        now_ms,
        next,
    }))
}

/// How often a live stream asks whether its credentials still let it in,
/// besides whenever a way in closed on this admin (a revocation made on
/// another replica is noticed within this).
const LIVE_RECHECK_EVERY: Duration = Duration::from_secs(5);

async fn live(
    State(state): State<Shared>,
    Operator(caller): Operator,
    presented: Presented,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    let seat = state
        .live
        .streams
        .take(&caller.actor)
        .map_err(|full| ApiError::TooMany(full.to_string()))?;
    // Shared frames, serialized straight from the history: nothing is
    // copied per stream.
    let history = state.live.history();
    let shared: Vec<&sluice_api::LiveFrame> = history.iter().map(|f| &**f).collect();
    let first = Event::default()
        .event("history")
        .json_data(&shared)
        .unwrap_or_default();
    let frames = BroadcastStream::new(state.live.frames.subscribe()).filter_map(|f| async move {
        // A lagging client skips frames rather than stalling the others.
        let frame = f.ok()?;
        Some(Ok(Event::default()
            .event("frame")
            .json_data(&*frame)
            .unwrap_or_default()))
    });
    // The stream ends when what let it in no longer does (a password
    // changed, the user removed, a token revoked, a logout).
    let recheck = Arc::clone(&state);
    let ended = async move {
        let mut changes = recheck.access_changes.subscribe();
        loop {
            tokio::select! {
                _ = changes.changed() => {}
                () = tokio::time::sleep(LIVE_RECHECK_EVERY) => {}
            }
            if !presented.still_let_in(&recheck).await {
                tracing::info!(actor = %caller.actor, "live stream ended: its credentials no longer let it in");
                return;
            }
        }
    };
    let events = stream::once(async move { Ok(first) })
        .chain(frames)
        .take_until(ended)
        // The seat is given back when the stream goes.
        .map(move |event| {
            let _held = &seat;
            event
        });
    Ok(Sse::new(events).keep_alive(KeepAlive::new().interval(Duration::from_secs(15))))
}

async fn sync(
    State(state): State<Shared>,
    peer: SyncPeer,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let report: SyncReport = serde_json::from_slice(&body).map_err(|e| {
        state.metrics.result("bad_request");
        ApiError::BadRequest(format!("sync report: {e}"))
    })?;
    report.check().map_err(|e| {
        state.metrics.result("bad_request");
        ApiError::BadRequest(e)
    })?;
    crate::push::departs_on_close(&state, &peer, &report.instance);
    let answer = answer_sync(&state, report).await?;
    state.metrics.result(if answer.set.is_some() {
        "policy_set"
    } else {
        "not_modified"
    });
    Ok(http_answer(&answer))
}

/// What the admin answers an Envoy's report: it records the report (the
/// live view, relayed provider news, fleet demand) and answers with the
/// set when the Envoy's is not current, and always with the store's epoch,
/// the Envoy's fleet shares, its budgets and other Envoys' provider news.
async fn answer_sync(state: &AppState, report: SyncReport) -> Result<AdminAnswer, ApiError> {
    let received_ms = now_ms();
    // The store keeps what the report says of the set's names only, and
    // hands the report back so kept: nothing below sees a made-up name.
    let recorded = state.store.record_sync(report).await.map_err(|e| {
        if matches!(e, crate::store::StoreError::TooManyInstances(..)) {
            state.metrics.result("too_many_instances");
            return ApiError::Unavailable(e.to_string());
        }
        ApiError::from(e)
    })?;
    let (report, set, epoch) = (recorded.report, recorded.set, recorded.epoch);
    state.live.ingest(&report, received_ms);
    // The relay failing (Redis away) costs the Envoys the other Envoys'
    // news, never the sync.
    if let Err(e) = state.relay.hear(&report, &set, received_ms).await {
        tracing::warn!(instance = %report.instance, error = %e, "provider news not kept");
    }
    let provider = match state.relay.news_for(&report, &set, received_ms).await {
        Ok(news) => news,
        Err(e) => {
            tracing::warn!(instance = %report.instance, error = %e, "no provider news for this sync");
            Default::default()
        }
    };
    state.metrics.policy_set_version.set(set.version as i64);
    state.changes.observe(set.version);
    if recorded.renewed {
        tracing::warn!(
            instance = %report.instance,
            reported = report.policy_version,
            store = set.version,
            epoch,
            "an Envoy enforces a version this store never reached (restored from a backup?): new store epoch"
        );
    }
    let shares = match state.fleet.shares(&set, &report).await {
        Ok(shares) => {
            if shares.freed {
                state.changes.fleet_news();
            }
            shares.message
        }
        Err(e) => {
            // The Envoy keeps its last share until that lease runs out.
            state.metrics.result("fleet_error");
            tracing::error!(instance = %report.instance, error = %e, "no shares for this sync");
            Default::default()
        }
    };
    // An Envoy that names no epoch is older than epochs: its version alone
    // tells whether it is current.
    let same_store = report.policy_epoch == epoch || report.policy_epoch == 0;
    let current = set.version == report.policy_version && same_store;
    if !current {
        tracing::info!(instance = %report.instance, from = report.policy_version, to = set.version, "sending policy set");
    }
    Ok(AdminAnswer {
        version: Some(set.version),
        set: (!current).then_some(set),
        epoch,
        shares,
        budgets: recorded.budgets,
        provider,
        sync_now: false,
    })
}

/// Each global policy's limit and how it is shared out now.
async fn fleet(State(state): State<Shared>, _op: Operator) -> Result<Json<FleetView>, ApiError> {
    let set = state.store.policy_set().await?;
    let now = state.fleet.now();
    let policies = state
        .fleet
        .views(&set)
        .await
        .map_err(|e| ApiError::Unavailable(e.to_string()))?;
    Ok(Json(FleetView {
        now_ms: now.as_millis(),
        policies,
    }))
}

async fn metrics(State(state): State<Shared>, headers: HeaderMap) -> Result<Response, ApiError> {
    if let Some(expected) = &state.config.metrics_token {
        if !bears(&headers, expected) {
            return Err(ApiError::Unauthorized);
        }
    }
    // The version as of the last sync or edit: a scrape costs no query.
    let open_metrics = headers
        .get(header::ACCEPT)
        .and_then(|a| a.to_str().ok())
        .is_some_and(|a| a.contains("application/openmetrics-text"));
    Ok(if open_metrics {
        (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            state.metrics.render(),
        )
            .into_response()
    } else {
        (
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            state.metrics.render_text(),
        )
            .into_response()
    })
}

async fn healthz(State(state): State<Shared>) -> Response {
    match state.health.check(&state.store).await {
        Some(version) => Json(Health {
            status: "ok".into(),
            policy_set_version: Some(version),
        })
        .into_response(),
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(Health {
                status: "store unavailable".into(),
                policy_set_version: None,
            }),
        )
            .into_response(),
    }
}
