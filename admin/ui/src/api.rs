//! Calls to the admin's JSON API from the browser (same origin, session
//! cookie sent by the browser, CSRF token in a header on writes), typed
//! with the admin's own API types (`sluice_api`).

use gloo_net::http::{Request, RequestBuilder, Response};
use serde::de::DeserializeOwned;
use serde::Serialize;
use sluice_api::ErrorBody;
pub use sluice_shared::FieldError;

#[derive(Debug, Clone, PartialEq)]
pub enum ApiError {
    /// Not logged in (any more).
    Unauthorized,
    /// 422: the server's field errors.
    Invalid(Vec<FieldError>),
    /// 409: someone saved a newer version.
    Stale {
        current_version: u64,
    },
    Other(String),
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ApiError::Unauthorized => write!(f, "please log in again"),
            ApiError::Invalid(errors) => {
                let parts: Vec<String> = errors
                    .iter()
                    .map(|e| format!("{}: {}", e.path, e.message))
                    .collect();
                write!(f, "{}", parts.join("; "))
            }
            ApiError::Stale { current_version } => {
                write!(f, "changed by someone else (now version {current_version})")
            }
            ApiError::Other(m) => write!(f, "{m}"),
        }
    }
}

/// The body of a 2xx answer as `T`, or the error the server described.
async fn finish<T: DeserializeOwned>(
    resp: Result<Response, gloo_net::Error>,
) -> Result<T, ApiError> {
    let resp = resp.map_err(|e| ApiError::Other(format!("network: {e}")))?;
    let status = resp.status();
    let text = resp.text().await.unwrap_or_default();
    if (200..=299).contains(&status) {
        // An empty body (204) reads as JSON null, which `()` accepts.
        let text = if text.is_empty() { "null" } else { &text };
        return serde_json::from_str(text)
            .map_err(|e| ApiError::Other(format!("unexpected answer: {e}")));
    }
    let body: Option<ErrorBody> = serde_json::from_str(&text).ok();
    Err(match (status, body) {
        (401, _) => ApiError::Unauthorized,
        (
            409,
            Some(ErrorBody {
                current_version: Some(current_version),
                ..
            }),
        ) => ApiError::Stale { current_version },
        (422, body) => ApiError::Invalid(body.map(|b| b.errors).unwrap_or_default()),
        (_, Some(body)) => ApiError::Other(body.error),
        (_, None) => ApiError::Other(format!("HTTP {status}")),
    })
}

pub async fn get<T: DeserializeOwned>(path: &str) -> Result<T, ApiError> {
    finish(Request::get(path).send().await).await
}

/// `GET path?name=value&...`, the values encoded.
pub async fn get_query<T: DeserializeOwned>(
    path: &str,
    query: &[(&str, &str)],
) -> Result<T, ApiError> {
    let request = Request::get(path).query(query.iter().copied());
    finish(request.send().await).await
}

fn with_body<B: Serialize>(
    req: RequestBuilder,
    csrf: &str,
    body: Option<&B>,
) -> Result<Request, ApiError> {
    let req = req.header("x-csrf-token", csrf);
    match body {
        Some(b) => req.json(b).map_err(|e| ApiError::Other(e.to_string())),
        None => req.build().map_err(|e| ApiError::Other(e.to_string())),
    }
}

pub async fn post<B: Serialize, T: DeserializeOwned>(
    path: &str,
    csrf: &str,
    body: &B,
) -> Result<T, ApiError> {
    finish(
        with_body(Request::post(path), csrf, Some(body))?
            .send()
            .await,
    )
    .await
}

pub async fn put<B: Serialize, T: DeserializeOwned>(
    path: &str,
    csrf: &str,
    if_match: u64,
    body: &B,
) -> Result<T, ApiError> {
    let req = Request::put(path).header("if-match", &format!("\"{if_match}\""));
    finish(with_body(req, csrf, Some(body))?.send().await).await
}

/// `PUT` of something without versions (the price table).
pub async fn replace<B: Serialize, T: DeserializeOwned>(
    path: &str,
    csrf: &str,
    body: &B,
) -> Result<T, ApiError> {
    finish(
        with_body(Request::put(path), csrf, Some(body))?
            .send()
            .await,
    )
    .await
}

pub async fn delete(path: &str, csrf: &str, if_match: u64) -> Result<(), ApiError> {
    let req = Request::delete(path).header("if-match", &format!("\"{if_match}\""));
    finish(with_body::<()>(req, csrf, None)?.send().await).await
}

pub async fn patch<B: Serialize, T: DeserializeOwned>(
    path: &str,
    csrf: &str,
    body: &B,
) -> Result<T, ApiError> {
    finish(
        with_body(Request::patch(path), csrf, Some(body))?
            .send()
            .await,
    )
    .await
}

/// `DELETE` of something without versions (a user, a token).
pub async fn remove(path: &str, csrf: &str) -> Result<(), ApiError> {
    finish(
        with_body::<()>(Request::delete(path), csrf, None)?
            .send()
            .await,
    )
    .await
}
