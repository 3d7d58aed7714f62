//! `/api/v1/users` and `/api/v1/tokens`: admins manage people and API
//! tokens. A password is hashed off the runtime; a token's secret is shown
//! once, in the answer that creates it, and kept only as its hash.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, patch};
use axum::{Json, Router};
use serde_json::Value;
use sluice_api::people::{
    format_token, CreatedToken, NewToken, NewUser, TokenList, UserChange, UserInfo, UserList,
};

use super::json_body::parse;
use crate::access::{Administrator, Operator};
use crate::auth::{hash_password, new_token_parts, token_hash};
use crate::error::ApiError;
use crate::store::{now_ms, AdminGuard};
use crate::AppState;

type Shared = Arc<AppState>;

pub fn routes() -> Router<Shared> {
    Router::new()
        .route("/api/v1/users", get(list_users).post(add_user))
        .route(
            "/api/v1/users/{name}",
            patch(change_user).delete(remove_user),
        )
        .route("/api/v1/tokens", get(list_tokens).post(create_token))
        .route("/api/v1/tokens/{id}", delete(revoke_token))
}

/// Hashes `password` with argon2 on the blocking pool.
async fn hash(password: String) -> Result<String, ApiError> {
    tokio::task::spawn_blocking(move || hash_password(&password))
        .await?
        .map_err(|e| ApiError::Internal(e.to_string()))
}

/// While an admin password exists, the last admin user may go.
fn guard(state: &AppState) -> AdminGuard {
    if state.credentials.has_bootstrap_password() {
        AdminGuard::None
    } else {
        AdminGuard::KeepOne
    }
}

/// Every user, for any caller: the UI names who changed what.
async fn list_users(
    State(state): State<Shared>,
    _caller: Operator,
) -> Result<Json<UserList>, ApiError> {
    Ok(Json(UserList {
        users: state.store.users().await?,
    }))
}

async fn add_user(
    State(state): State<Shared>,
    Administrator(admin): Administrator,
    Json(body): Json<Value>,
) -> Result<Response, ApiError> {
    let request: NewUser = parse(body)?;
    request.check().map_err(ApiError::InvalidRequest)?;
    let hash = hash(request.password).await?;
    let user = state
        .store
        .add_user(&request.name, request.role, hash, &admin.actor)
        .await?;
    tracing::info!(user = %user.name, role = %user.role, by = %admin.actor, "user added");
    Ok((StatusCode::CREATED, Json(user)).into_response())
}

async fn change_user(
    State(state): State<Shared>,
    Administrator(admin): Administrator,
    Path(name): Path<String>,
    Json(body): Json<Value>,
) -> Result<Json<UserInfo>, ApiError> {
    let request: UserChange = parse(body)?;
    request.check().map_err(ApiError::InvalidRequest)?;
    let changed_password = request.password.is_some();
    let hash = match request.password {
        Some(password) => Some(hash(password).await?),
        None => None,
    };
    let user = state
        .store
        .change_user(&name, request.role, hash, &admin.actor, guard(&state))
        .await?;
    tracing::info!(user = %user.name, role = %user.role, by = %admin.actor, "user changed");
    if changed_password {
        state.sessions.remove_user(&user.name);
    }
    state.access_changes.changed();
    Ok(Json(user))
}

async fn remove_user(
    State(state): State<Shared>,
    Administrator(admin): Administrator,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    state
        .store
        .remove_user(&name, &admin.actor, guard(&state))
        .await?;
    tracing::info!(user = %name, by = %admin.actor, "user removed");
    state.sessions.remove_user(&name);
    state.access_changes.changed();
    Ok(StatusCode::NO_CONTENT)
}

async fn list_tokens(
    State(state): State<Shared>,
    _admin: Administrator,
) -> Result<Json<TokenList>, ApiError> {
    Ok(Json(TokenList {
        tokens: state.store.tokens().await?,
        now_ms: now_ms(),
    }))
}

async fn create_token(
    State(state): State<Shared>,
    Administrator(admin): Administrator,
    Json(body): Json<Value>,
) -> Result<Response, ApiError> {
    let request: NewToken = parse(body)?;
    let lifetime = request.check().map_err(ApiError::InvalidRequest)?;
    let (id, secret) = new_token_parts().map_err(|e| ApiError::Internal(e.to_string()))?;
    let expires_ms = now_ms().saturating_add(lifetime.as_millis());
    let info = state
        .store
        .add_token(
            id.clone(),
            request.name,
            request.scope,
            token_hash(&secret),
            expires_ms,
            &admin.actor,
        )
        .await?;
    tracing::info!(token = %info.name, id = %info.id, scope = %info.scope, by = %admin.actor, "API token created");
    let created = CreatedToken {
        token: format_token(&id, &secret),
        info,
    };
    Ok((StatusCode::CREATED, Json(created)).into_response())
}

async fn revoke_token(
    State(state): State<Shared>,
    Administrator(admin): Administrator,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    state.store.revoke_token(&id, &admin.actor).await?;
    tracing::info!(id = %id, by = %admin.actor, "API token revoked");
    state.access_changes.changed();
    Ok(StatusCode::NO_CONTENT)
}
