//! Who is calling and what they may do. A request is let in by one of:
//! an API token (`Authorization: Bearer sluice_…`), a trusted reverse
//! proxy's user header (from the proxy's addresses only), or a session
//! cookie; `--insecure-dev` lets everyone in as `dev`. The role comes from
//! the store on every request, so a removed user or a lowered role takes
//! effect at once, on every replica.
//!
//! CSRF: a session's writes carry its token in `x-csrf-token`. A proxy's
//! user has no session here, so its writes must carry the header with any
//! value: a custom header makes a cross-site request a CORS one, which this
//! admin never allows. Tokens are not ambient (a browser never sends them
//! on its own) and need neither.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::extract::{ConnectInfo, FromRequestParts};
use axum::http::request::Parts;
use axum_extra::extract::cookie::CookieJar;
use ipnet::IpNet;
use sluice_api::people::{check_name, parse_token, Role};

use crate::auth::{constant_time_eq, token_hash, CSRF_HEADER, SESSION_COOKIE};
use crate::error::ApiError;
use crate::server::OnPeerClose;
use crate::store::now_ms;
use crate::AppState;

type Shared = Arc<AppState>;

/// A reverse proxy that authenticates people and names them in a header.
#[derive(Debug, Clone, Default)]
pub struct ProxyUsers {
    /// e.g. `x-forwarded-user`; None: off.
    pub header: Option<String>,
    /// The proxy's addresses: the header is believed from these only.
    pub proxies: Vec<IpNet>,
}

impl ProxyUsers {
    /// The user the proxy names, if the request comes from the proxy and
    /// carries the header. A header given twice is refused: a proxy that
    /// appends to a client's own would let the client pick the first.
    fn user<'a>(
        &self,
        peer: Option<IpAddr>,
        parts: &'a Parts,
    ) -> Result<Option<&'a str>, ApiError> {
        let (Some(header), Some(peer)) = (self.header.as_deref(), peer) else {
            return Ok(None);
        };
        if !self.proxies.iter().any(|n| n.contains(&peer)) {
            return Ok(None);
        }
        let mut values = parts.headers.get_all(header).iter();
        let Some(first) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err(ApiError::BadRequest(format!(
                "{header} is given more than once: the proxy must set it, not add to the client's"
            )));
        }
        Ok(first.to_str().ok().map(str::trim))
    }
}

/// How a caller was let in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Via {
    /// A session cookie; writes carry this CSRF token.
    Session { csrf: String },
    /// A trusted proxy's user header.
    Proxy,
    /// An API token (its id).
    Token { id: String },
    /// `--insecure-dev`.
    Dev,
}

impl Via {
    pub fn as_str(&self) -> &'static str {
        match self {
            Via::Session { .. } => "password",
            Via::Proxy => "proxy",
            Via::Token { .. } => "token",
            Via::Dev => "dev",
        }
    }
}

/// Who is calling: the name the audit log records, and their role.
#[derive(Debug, Clone)]
pub struct Caller {
    /// A user's name, or `token:<name>` for an API token.
    pub actor: String,
    pub role: Role,
    pub via: Via,
}

impl Caller {
    /// Refuses a write that does not carry what its way in asks for.
    fn check_csrf(&self, parts: &Parts) -> Result<(), ApiError> {
        // Reads change nothing: only writes need the proof.
        if parts.method.is_safe() {
            return Ok(());
        }
        let sent = parts.headers.get(CSRF_HEADER).and_then(|v| v.to_str().ok());
        match &self.via {
            Via::Session { csrf } if sent != Some(csrf.as_str()) => Err(ApiError::Csrf),
            Via::Proxy if sent.is_none_or(str::is_empty) => Err(ApiError::Csrf),
            _ => Ok(()),
        }
    }
}

fn bearer(parts: &Parts) -> Option<&str> {
    crate::auth::bearer(&parts.headers).map(str::trim)
}

fn peer(parts: &Parts) -> Option<IpAddr> {
    parts
        .extensions
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.ip())
}

async fn by_token(state: &AppState, text: &str) -> Result<Caller, ApiError> {
    let unknown = || ApiError::BadToken("unknown or revoked API token".into());
    let (id, secret) = parse_token(text).ok_or_else(unknown)?;
    let record = state.store.token(id).await?.ok_or_else(unknown)?;
    if !constant_time_eq(token_hash(secret).as_bytes(), record.secret_hash.as_bytes()) {
        return Err(unknown());
    }
    let now = now_ms();
    if record.info.expires_ms <= now {
        return Err(ApiError::BadToken(format!(
            "API token {:?} expired (at {} ms since the epoch); create a new one",
            record.info.name, record.info.expires_ms
        )));
    }
    if let Err(e) = state.store.token_used(id, now).await {
        tracing::warn!(token = %record.info.name, error = %e, "token use not noted");
    }
    Ok(Caller {
        actor: format!("token:{}", record.info.name),
        role: record.info.scope.role(),
        via: Via::Token { id: id.into() },
    })
}

/// The role of the stored user `name`, or why they may not come in.
async fn stored_role(state: &AppState, name: &str) -> Result<Option<Role>, ApiError> {
    Ok(state.store.user(name).await?.map(|u| u.info.role))
}

/// Told whenever a way in may have closed here (a password changed, a
/// user removed, a token revoked, a logout), so that what outlives one
/// request (a live stream) asks again at once.
pub struct AccessChanges(tokio::sync::watch::Sender<u64>);

impl Default for AccessChanges {
    fn default() -> Self {
        Self(tokio::sync::watch::channel(0).0)
    }
}

impl AccessChanges {
    pub fn changed(&self) {
        self.0.send_modify(|n| *n = n.wrapping_add(1));
    }

    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.0.subscribe()
    }
}

/// What a request presented to come in (its headers and address), to ask
/// later whether that still lets it in.
#[derive(Clone)]
pub struct Presented {
    headers: axum::http::HeaderMap,
    peer: Option<ConnectInfo<SocketAddr>>,
}

impl Presented {
    /// Whether these credentials still let a caller in.
    pub async fn still_let_in(&self, state: &AppState) -> bool {
        let (mut parts, ()) = axum::http::Request::new(()).into_parts();
        parts.headers = self.headers.clone();
        if let Some(peer) = self.peer {
            parts.extensions.insert(peer);
        }
        caller(state, &parts).await.is_ok()
    }
}

impl FromRequestParts<Shared> for Presented {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &Shared,
    ) -> Result<Self, std::convert::Infallible> {
        Ok(Presented {
            headers: parts.headers.clone(),
            peer: parts.extensions.get::<ConnectInfo<SocketAddr>>().copied(),
        })
    }
}

/// Who is behind `parts`, or 401.
pub async fn caller(state: &AppState, parts: &Parts) -> Result<Caller, ApiError> {
    if state.credentials.is_insecure() {
        return Ok(Caller {
            actor: "dev".into(),
            role: Role::Admin,
            via: Via::Dev,
        });
    }
    if let Some(token) = bearer(parts) {
        return by_token(state, token).await;
    }
    if let Some(name) = state.config.proxy_users.user(peer(parts), parts)? {
        check_name(name).map_err(|e| {
            ApiError::Forbidden(format!("the proxy's user header names no valid user: {e}"))
        })?;
        let role = stored_role(state, name).await?.ok_or_else(|| {
            ApiError::Forbidden(format!(
                "{name:?} (named by the proxy) has no account here: an admin adds it with \
                 `sluice-admin user add {name} --role viewer`"
            ))
        })?;
        return Ok(Caller {
            actor: name.into(),
            role,
            via: Via::Proxy,
        });
    }
    let jar = CookieJar::from_headers(&parts.headers);
    let token = jar.get(SESSION_COOKIE).ok_or(ApiError::Unauthorized)?;
    let session = state
        .sessions
        .get(token.value())
        .ok_or(ApiError::Unauthorized)?;
    let role = if session.bootstrap {
        Role::Admin
    } else {
        // Removed, or given a new password, since they logged in: the
        // session is over.
        let stored = state
            .store
            .user(&session.user)
            .await?
            .filter(|u| {
                session.password.as_deref()
                    == Some(crate::auth::password_fingerprint(&u.password_hash).as_str())
            })
            .ok_or(ApiError::Unauthorized)?;
        stored.info.role
    };
    Ok(Caller {
        actor: session.user,
        role,
        via: Via::Session { csrf: session.csrf },
    })
}

/// An Envoy with the sync token (`/api/v1/sync` and its watch), checked
/// from the headers before any of the body is read: a client without the
/// token is answered 401 at once, however slowly it sends its body. Holds
/// what its connection does when the Envoy closes it (see
/// `push::departs_on_close`).
pub struct SyncPeer(pub OnPeerClose);

impl FromRequestParts<Shared> for SyncPeer {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &Shared) -> Result<Self, ApiError> {
        match &state.config.sync_token {
            Some(expected) if !crate::auth::bears(&parts.headers, expected) => {
                state.metrics.result("unauthorized");
                Err(ApiError::BadSyncToken)
            }
            // Not served through `server` (a test's router): nothing to
            // run, as a connection that never closes.
            _ => Ok(SyncPeer(
                parts
                    .extensions
                    .get::<OnPeerClose>()
                    .cloned()
                    .unwrap_or_default(),
            )),
        }
    }
}

/// Any caller let in: may read.
pub struct Operator(pub Caller);

/// Any caller, on a write that carries its CSRF proof (logging out).
pub struct Writer(pub Caller);

/// A caller who may change policies, on a write that carries its CSRF
/// proof.
pub struct Editor(pub Caller);

/// A caller who may manage users and tokens, likewise.
pub struct Administrator(pub Caller);

impl FromRequestParts<Shared> for Operator {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &Shared) -> Result<Self, ApiError> {
        caller(state, parts).await.map(Operator)
    }
}

impl FromRequestParts<Shared> for Writer {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &Shared) -> Result<Self, ApiError> {
        let caller = caller(state, parts).await?;
        caller.check_csrf(parts)?;
        Ok(Writer(caller))
    }
}

impl FromRequestParts<Shared> for Editor {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &Shared) -> Result<Self, ApiError> {
        let caller = caller(state, parts).await?;
        if !caller.role.can_edit() {
            return Err(ApiError::Forbidden(format!(
                "{} is a {}: changing policies takes an editor or an admin",
                caller.actor, caller.role
            )));
        }
        caller.check_csrf(parts)?;
        Ok(Editor(caller))
    }
}

impl FromRequestParts<Shared> for Administrator {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &Shared) -> Result<Self, ApiError> {
        let caller = caller(state, parts).await?;
        if !caller.role.can_administer() {
            let what = if matches!(caller.via, Via::Token { .. }) {
                "API tokens never manage users or tokens"
            } else {
                "managing users and tokens takes an admin"
            };
            return Err(ApiError::Forbidden(format!(
                "{} is a {}: {what}",
                caller.actor, caller.role
            )));
        }
        caller.check_csrf(parts)?;
        Ok(Administrator(caller))
    }
}
