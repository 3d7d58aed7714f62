//! A policy's or the set's version on the wire: `ETag` on what is read,
//! `If-Match` on a write naming the version its writer saw (a write made
//! on an older one is refused, not lost over another's).

use axum::http::{header, HeaderMap, HeaderValue};

use crate::error::ApiError;

pub(super) fn etag(version: u64) -> HeaderValue {
    HeaderValue::from_str(&format!("\"{version}\"")).unwrap_or(HeaderValue::from_static("\"0\""))
}

/// `If-Match: "3"` (or `W/"3"`, or a bare 3) → 3.
pub(super) fn if_match(headers: &HeaderMap) -> Result<u64, ApiError> {
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
