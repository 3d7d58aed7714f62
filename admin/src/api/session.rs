//! `/api/v1/login`, `/logout`, `/session`: a person signs in with a
//! password (throttled per address and name) and gets a session cookie.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{ConnectInfo, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Extension;
use axum::{Json, Router};
use axum_extra::extract::cookie::{Cookie, CookieJar, SameSite};
use sluice_api::people::{check_name, Role, BOOTSTRAP_ADMIN};
use sluice_api::{LoginRequest, SessionInfo};

use crate::access::{Operator, Via, Writer};
use crate::auth::{Credentials, SESSION_COOKIE};
use crate::error::ApiError;
use crate::login::Refused;
use crate::server::OverTls;
use crate::AppState;

type Shared = Arc<AppState>;

pub fn routes() -> Router<Shared> {
    Router::new()
        .route("/api/v1/login", post(login))
        .route("/api/v1/logout", post(logout))
        .route("/api/v1/session", get(session))
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
