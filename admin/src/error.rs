//! API errors and how they look on the wire: a status and a JSON body
//! `{"error": "...", "errors": [{"path": "...", "message": "..."}]}`.

use std::time::Duration;

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use sluice_api::ErrorBody;
use sluice_shared::ValidationErrors;

use crate::store::StoreError;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("invalid policy: {0}")]
    Invalid(ValidationErrors),
    #[error("invalid request: {0}")]
    InvalidRequest(ValidationErrors),
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    BadToken(String),
    #[error("{0}")]
    NotFound(String),
    #[error("stale edit: {0}")]
    Stale(String, u64),
    #[error("If-Match with the version you edited is required")]
    PreconditionRequired,
    #[error("log in first")]
    Unauthorized,
    #[error("missing or wrong CSRF token")]
    Csrf,
    #[error("bad sync token")]
    BadSyncToken,
    #[error("too many failed logins; retry later")]
    Throttled(Duration),
    #[error("{0}")]
    TooMany(String),
    /// 429 with `Retry-After`.
    #[error("{0}")]
    Limited(String, Duration),
    #[error("internal error")]
    Internal(String),
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// 503 with `Retry-After`: the admin answers as many as it can.
    #[error("busy: {0}")]
    Busy(String, Duration),
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::NotFound(name) => ApiError::NotFound(format!("no policy named {name:?}")),
            StoreError::Stale { current, .. } => ApiError::Stale(e.to_string(), current),
            StoreError::Invalid(errors) => ApiError::Invalid(errors),
            StoreError::NoSuchUser(_) | StoreError::NoSuchToken(_) => {
                ApiError::NotFound(e.to_string())
            }
            StoreError::Exists(_) | StoreError::LastAdmin(_) => ApiError::Conflict(e.to_string()),
            other => ApiError::Internal(other.to_string()),
        }
    }
}

impl From<tokio::task::JoinError> for ApiError {
    fn from(e: tokio::task::JoinError) -> Self {
        ApiError::Internal(e.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = match &self {
            ApiError::Invalid(_) | ApiError::InvalidRequest(_) => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::Conflict(_) => StatusCode::CONFLICT,
            ApiError::BadToken(_) => StatusCode::UNAUTHORIZED,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Stale(..) => StatusCode::CONFLICT,
            ApiError::PreconditionRequired => StatusCode::PRECONDITION_REQUIRED,
            ApiError::Unauthorized | ApiError::BadSyncToken => StatusCode::UNAUTHORIZED,
            ApiError::Csrf => StatusCode::FORBIDDEN,
            ApiError::Throttled(_) | ApiError::TooMany(_) | ApiError::Limited(..) => {
                StatusCode::TOO_MANY_REQUESTS
            }
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::Unavailable(_) | ApiError::Busy(..) => StatusCode::SERVICE_UNAVAILABLE,
        };
        let body = match &self {
            ApiError::Invalid(errors) | ApiError::InvalidRequest(errors) => ErrorBody {
                errors: errors.errors.clone(),
                ..ErrorBody::new(self.to_string())
            },
            ApiError::Stale(message, current) => ErrorBody {
                current_version: Some(*current),
                ..ErrorBody::new(message.clone())
            },
            ApiError::Internal(detail) => {
                tracing::error!(%detail, "request failed");
                ErrorBody::new("internal error")
            }
            other => ErrorBody::new(other.to_string()),
        };
        let mut response = (status, Json(body)).into_response();
        if let ApiError::Throttled(wait) | ApiError::Limited(_, wait) | ApiError::Busy(_, wait) =
            &self
        {
            let secs = wait.as_secs().max(1).to_string();
            if let Ok(v) = HeaderValue::from_str(&secs) {
                response.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        if let ApiError::Stale(_, current) = &self {
            if let Ok(v) = HeaderValue::from_str(&format!("\"{current}\"")) {
                response.headers_mut().insert(header::ETAG, v);
            }
        }
        response
    }
}
