//! `/api/v1/policies`: one policy at a time, read by operators and
//! written by editors with `If-Match` naming the version they saw;
//! `/api/v1/validate` checks one without saving it.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::Value;
use sluice_api::{History, PolicyList, StoredPolicy, Validated};
use sluice_shared::validate::policy_from_value;
use sluice_shared::{FieldError, Policy, ValidationErrors};

use super::versions::{etag, if_match};
use crate::access::{Editor, Operator};
use crate::error::ApiError;
use crate::writes::SetWrite;
use crate::AppState;

type Shared = Arc<AppState>;

pub fn routes() -> Router<Shared> {
    Router::new()
        .route("/api/v1/policies", get(list_policies).post(create_policy))
        .route(
            "/api/v1/policies/{name}",
            get(get_policy).put(update_policy).delete(delete_policy),
        )
        .route("/api/v1/policies/{name}/history", get(policy_history))
        .route("/api/v1/validate", post(validate))
}

fn parse_policy_body(body: Value) -> Result<Policy, ApiError> {
    policy_from_value(body).map_err(ApiError::Invalid)
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

async fn create_policy(
    State(state): State<Shared>,
    editor: Editor,
    Json(body): Json<Value>,
) -> Result<Response, ApiError> {
    let write = SetWrite::begin(&state)?;
    let policy = parse_policy_body(body)?;
    let stored = state.store.create(policy, &editor.0.actor).await?;
    write.done("create").await;
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
    let write = SetWrite::begin(&state)?;
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
    write.done("update").await;
    tracing::info!(policy = %stored.policy.name, version = stored.version, "policy updated");
    Ok(with_etag(stored))
}

async fn delete_policy(
    State(state): State<Shared>,
    editor: Editor,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Result<StatusCode, ApiError> {
    let write = SetWrite::begin(&state)?;
    let expected = if_match(&headers)?;
    state.store.delete(&name, expected, &editor.0.actor).await?;
    write.done("delete").await;
    tracing::info!(policy = %name, "policy deleted");
    Ok(StatusCode::NO_CONTENT)
}

/// Checks a policy as the editor types, without saving it.
async fn validate(_op: Operator, Json(body): Json<Value>) -> Result<Json<Validated>, ApiError> {
    parse_policy_body(body)?;
    Ok(Json(Validated { ok: true }))
}
