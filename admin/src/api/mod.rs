//! The admin's HTTP API, a router per resource merged here: sessions,
//! policies, a key's label, the policy set (apply, order, prices), people
//! and tokens, the views of the fleet, and what Envoys and Prometheus
//! call. Every request but the live stream gives up after
//! [`REQUEST_TIMEOUT`]; every body is at most [`MAX_BODY`]. What every
//! write to the policy set does besides its change is `crate::writes`'.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::DefaultBodyLimit;
use axum::http::StatusCode;
use axum::Router;

use crate::AppState;

mod envoys;
mod json_body;
mod key_label;
mod people;
mod policies;
mod policy_set;
mod session;
mod versions;
mod views;

pub use key_label::key_lookup_throttle;

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
        .merge(session::routes())
        .merge(policies::routes())
        .merge(key_label::routes())
        .merge(policy_set::routes())
        .merge(views::routes())
        .merge(people::routes())
        // The watch is held up to 25 s (push), inside the 30 s every
        // request has.
        .merge(envoys::routes())
        .layer(tower_http::timeout::TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            REQUEST_TIMEOUT,
        ))
        .merge(views::live_routes())
        .layer(DefaultBodyLimit::max(MAX_BODY))
}
