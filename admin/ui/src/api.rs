//! Calls to the admin's JSON API from the browser (same origin, session
//! cookie sent by the browser, CSRF token in a header on writes).

use gloo_net::http::{Request, RequestBuilder, Response};
use serde_json::Value;

#[derive(Debug, Clone, PartialEq)]
pub struct FieldError {
    pub path: String,
    pub message: String,
}

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

pub struct Reply {
    pub body: Value,
}

async fn finish(resp: Result<Response, gloo_net::Error>) -> Result<Reply, ApiError> {
    let resp = resp.map_err(|e| ApiError::Other(format!("network: {e}")))?;
    let status = resp.status();
    let text = resp.text().await.unwrap_or_default();
    let body: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    match status {
        200..=299 => Ok(Reply { body }),
        401 => Err(ApiError::Unauthorized),
        409 => Err(ApiError::Stale {
            current_version: body["current_version"].as_u64().unwrap_or(0),
        }),
        422 => Err(ApiError::Invalid(
            body["errors"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .map(|e| FieldError {
                            path: e["path"].as_str().unwrap_or_default().to_string(),
                            message: e["message"].as_str().unwrap_or_default().to_string(),
                        })
                        .collect()
                })
                .unwrap_or_default(),
        )),
        _ => Err(ApiError::Other(
            body["error"]
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| format!("HTTP {status}")),
        )),
    }
}

pub async fn get(path: &str) -> Result<Reply, ApiError> {
    finish(Request::get(path).send().await).await
}

fn with_body(req: RequestBuilder, csrf: &str, body: Option<&Value>) -> Result<Request, ApiError> {
    let req = req.header("x-csrf-token", csrf);
    match body {
        Some(b) => req.json(b).map_err(|e| ApiError::Other(e.to_string())),
        None => req.build().map_err(|e| ApiError::Other(e.to_string())),
    }
}

pub async fn post(path: &str, csrf: &str, body: &Value) -> Result<Reply, ApiError> {
    finish(
        with_body(Request::post(path), csrf, Some(body))?
            .send()
            .await,
    )
    .await
}

pub async fn put(path: &str, csrf: &str, if_match: u64, body: &Value) -> Result<Reply, ApiError> {
    let req = Request::put(path).header("if-match", &format!("\"{if_match}\""));
    finish(with_body(req, csrf, Some(body))?.send().await).await
}

pub async fn delete(path: &str, csrf: &str, if_match: u64) -> Result<Reply, ApiError> {
    let req = Request::delete(path).header("if-match", &format!("\"{if_match}\""));
    finish(with_body(req, csrf, None)?.send().await).await
}
