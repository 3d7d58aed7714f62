//! Policy changes pushed to the Envoys. Besides its sync every interval,
//! each Envoy keeps one watch call open: the admin holds it until the
//! policy set changes, then answers with the new set at once, so an edit
//! is enforced within a round trip instead of up to a sync interval.
//! Reports, shares and provider news keep going with the syncs.
//!
//! A change is noticed when this admin writes (every write refreshes the
//! set's version) and, for edits made through another replica or the
//! command line, by reading the version once a second.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use sluice_shared::sync::{WatchRequest, EPOCH_HEADER, MAX_INSTANCE_LEN, SYNC_NOW_HEADER};
use tokio::sync::watch;

use crate::auth::bears;
use crate::error::ApiError;
use crate::AppState;

pub use sluice_shared::sync::{WAIT_HEADER, WATCH_PATH};
/// The longest hold: below the 30 s every other request is given, and
/// the filter's call timeout is the hold plus a margin.
pub const MAX_HOLD: Duration = Duration::from_secs(25);
/// How often the version is read for changes made elsewhere.
const POLL_EVERY: Duration = Duration::from_secs(1);

/// Who is told of a change, and of the admin stopping (a held watch is
/// answered at once then, so that shutting down does not wait for it).
pub struct Changes {
    seen: watch::Sender<u64>,
    stopping: watch::Sender<bool>,
    /// Bumped when a sync freed fleet room (see `fleet::Shares`).
    fleet: watch::Sender<u64>,
}

impl Default for Changes {
    fn default() -> Self {
        Self {
            seen: watch::channel(0).0,
            stopping: watch::channel(false).0,
            fleet: watch::channel(0).0,
        }
    }
}

impl Changes {
    /// The policy set's version as just read: a version other than the
    /// last one seen wakes every held watch (which answers with the set).
    pub fn observe(&self, version: u64) {
        self.seen.send_if_modified(|seen| {
            let changed = *seen != version;
            *seen = version;
            changed
        });
    }

    /// A sync freed fleet room: every held watch is answered `304` with
    /// [`SYNC_NOW_HEADER`], and its Envoy syncs at once (a watch then
    /// reopens within 50 ms, so news reaches each Envoy at most that often).
    pub fn fleet_news(&self) {
        self.fleet.send_modify(|n| *n = n.wrapping_add(1));
    }

    pub fn stop(&self) {
        self.stopping.send_replace(true);
    }
}

/// Reads the set's version once a second, for edits made through another
/// replica or the command line.
pub fn spawn_version_poller(state: Arc<AppState>) {
    tokio::spawn(async move {
        let mut every = tokio::time::interval(POLL_EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            every.tick().await;
            if *state.changes.stopping.borrow() {
                return;
            }
            if let Ok(version) = state.store.policy_set_version().await {
                state.changes.observe(version);
            }
        }
    });
}

/// `POST /api/v1/sync/watch` (the sync token): answered `200` with the
/// policy set as soon as it differs from the one named, or `304` after
/// the hold (`sluice-wait-ms`, at most [`MAX_HOLD`]).
pub async fn watch(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let mut held = HeldWatch {
        state: Arc::clone(&state),
        instance: None,
    };
    let answer = answer_watch(&state, &headers, &body, &mut held).await;
    // Answered (or refused): not a departure.
    held.instance = None;
    answer
}

/// A watch being held. Dropped before it is answered, its connection
/// closed: hyper drops the handler of a request whose client went away
/// (a SIGKILLed Envoy's kernel closes its connections), and the fleet
/// ledgers are told (see `Ledgers::departed`).
struct HeldWatch {
    state: Arc<AppState>,
    /// Set once the request is known good, cleared when it is answered.
    instance: Option<String>,
}

impl Drop for HeldWatch {
    fn drop(&mut self) {
        let Some(instance) = self.instance.take() else {
            return;
        };
        let state = Arc::clone(&self.state);
        // Drop cannot wait; the runtime is there while requests are served.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        runtime.spawn(async move {
            let noted = match state.store.policy_set().await {
                Ok(set) => state.fleet.departed(&set, &instance).await.map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            match noted {
                Ok(()) => tracing::info!(%instance, "watch connection closed unanswered; its fleet shares are freed unless it syncs again"),
                Err(e) => tracing::warn!(%instance, error = %e, "watch connection closed unanswered; not noted in the fleet ledgers"),
            }
        });
    }
}

async fn answer_watch(
    state: &Arc<AppState>,
    headers: &HeaderMap,
    body: &[u8],
    held: &mut HeldWatch,
) -> Result<Response, ApiError> {
    if let Some(expected) = &state.sync_token {
        if !bears(headers, expected) {
            return Err(ApiError::BadSyncToken);
        }
    }
    let request: WatchRequest =
        serde_json::from_slice(body).map_err(|e| ApiError::BadRequest(format!("watch: {e}")))?;
    if request.instance.is_empty() || request.instance.len() > MAX_INSTANCE_LEN {
        return Err(ApiError::BadRequest(format!(
            "watch: instance must be 1 to {MAX_INSTANCE_LEN} characters"
        )));
    }
    held.instance = Some(request.instance.clone());
    let hold = headers
        .get(WAIT_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(MAX_HOLD, Duration::from_millis)
        .min(MAX_HOLD);
    // Subscribed before the first read, so no change slips in between.
    let mut changes = state.changes.seen.subscribe();
    let mut stopping = state.changes.stopping.subscribe();
    let mut fleet = state.changes.fleet.subscribe();
    let deadline = tokio::time::Instant::now() + hold;
    let mut sync_now = false;
    loop {
        let set = state.store.policy_set().await?;
        let epoch = state.store.epoch().await?;
        let same_store = request.policy_epoch == epoch || request.policy_epoch == 0;
        // An Envoy ahead of this store (restored from a backup) is not
        // sent the older set: its next sync draws the store a new epoch,
        // and that set reaches it then.
        if set.version > request.policy_version || !same_store {
            tracing::info!(instance = %request.instance, from = request.policy_version, to = set.version, "pushing policy set");
            let mut response = Json(set).into_response();
            response
                .headers_mut()
                .insert(EPOCH_HEADER, HeaderValue::from(epoch));
            return Ok(response);
        }
        tokio::select! {
            changed = changes.changed() => if changed.is_err() { break },
            news = fleet.changed() => {
                sync_now = news.is_ok();
                break;
            }
            () = tokio::time::sleep_until(deadline) => break,
            _ = stopping.wait_for(|s| *s) => break,
        }
    }
    let epoch = state.store.epoch().await?;
    let mut response = (
        StatusCode::NOT_MODIFIED,
        [(
            header::HeaderName::from_static(EPOCH_HEADER),
            HeaderValue::from(epoch),
        )],
    )
        .into_response();
    if sync_now {
        response.headers_mut().insert(
            header::HeaderName::from_static(SYNC_NOW_HEADER),
            HeaderValue::from_static("1"),
        );
    }
    Ok(response)
}
