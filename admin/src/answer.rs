//! The one place an answer to an Envoy (a sync's or a watch's, laid out
//! by [`sluice_wire::sync_answer`]) becomes axum's response.

use axum::http::{header::HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use sluice_wire::sync_answer::AdminAnswer;

/// A header value that cannot be sent is left out: the Envoy then keeps
/// what it holds (its shares until their lease ends, its budgets unknown).
pub fn http_answer(answer: &AdminAnswer) -> Response {
    let answer = answer.http();
    let status = StatusCode::from_u16(answer.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = (status, answer.body).into_response();
    for (name, value) in answer.headers {
        if let Ok(value) = HeaderValue::from_str(&value) {
            response
                .headers_mut()
                .insert(HeaderName::from_static(name), value);
        }
    }
    response
}
