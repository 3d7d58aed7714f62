//! Policy changes pushed to the Envoys. Besides its sync every interval,
//! each Envoy keeps one watch call open: the admin holds it until the
//! policy set changes, then answers with the new set at once, so an edit
//! is enforced within a round trip instead of up to a sync interval.
//! Reports, shares and provider news keep going with the syncs.
//!
//! A change is noticed when this admin writes (every write refreshes the
//! set's version) and, for edits made through another replica or the
//! command line, by reading the version once a second.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use sluice_wire::sync::{check_instance, WatchRequest};
use sluice_wire::sync_answer::AdminAnswer;
use tokio::sync::watch;

use crate::access::SyncPeer;
use crate::answer::http_answer;
use crate::error::ApiError;
use crate::AppState;

pub use sluice_wire::sync::{WAIT_HEADER, WATCH_PATH};
/// The longest hold: below the 30 s every other request is given, and
/// the filter's call timeout is the hold plus a margin.
pub const MAX_HOLD: Duration = Duration::from_secs(25);
/// How often the version is read for changes made elsewhere.
const POLL_EVERY: Duration = Duration::from_secs(1);
/// Watches held at once, one per instance.
pub use sluice_wire::sync::MAX_INSTANCES as MAX_HELD_WATCHES;

/// Who is told of a change, and of the admin stopping (a held watch is
/// answered at once then, so that shutting down does not wait for it).
pub struct Changes {
    seen: watch::Sender<u64>,
    stopping: watch::Sender<bool>,
    /// Bumped when a sync freed fleet room (see `fleet::Shares`).
    fleet: watch::Sender<u64>,
    /// The watch each instance holds: a newer one answers the older at
    /// once, so an instance holds one however many it opens, and a change
    /// costs a store read per instance, not per watch.
    held: Mutex<HashMap<String, Holder>>,
    next_ticket: AtomicU64,
}

/// See [`Changes::listen`].
pub struct Listening {
    pub versions: watch::Receiver<u64>,
    pub fleet: watch::Receiver<u64>,
    pub stopping: watch::Receiver<bool>,
}

/// The newest watch of one instance: its ticket, and how the one it
/// replaces is told.
struct Holder {
    ticket: u64,
    replaced: watch::Sender<bool>,
}

impl Default for Changes {
    fn default() -> Self {
        Self {
            seen: watch::channel(0).0,
            stopping: watch::channel(false).0,
            fleet: watch::channel(0).0,
            held: Mutex::new(HashMap::new()),
            next_ticket: AtomicU64::new(1),
        }
    }
}

/// Why a watch is not held.
#[derive(Debug, PartialEq, Eq)]
pub enum HoldRefused {
    /// [`MAX_HELD_WATCHES`] instances hold one already.
    Full,
}

/// A watch's place as its instance's newest. Dropped, it frees the place
/// unless a newer watch took it.
pub struct Hold<'a> {
    changes: &'a Changes,
    instance: String,
    ticket: u64,
    /// Turns true when a newer watch of the same instance replaces this one.
    pub replaced: watch::Receiver<bool>,
}

impl Drop for Hold<'_> {
    fn drop(&mut self) {
        let mut held = lock(&self.changes.held);
        if held
            .get(&self.instance)
            .is_some_and(|h| h.ticket == self.ticket)
        {
            held.remove(&self.instance);
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
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
    /// [`sluice_wire::sync::SYNC_NOW_HEADER`], and its Envoy syncs at once (a watch then
    /// reopens within 50 ms, so news reaches each Envoy at most that often).
    pub fn fleet_news(&self) {
        self.fleet.send_modify(|n| *n = n.wrapping_add(1));
    }

    pub fn stop(&self) {
        self.stopping.send_replace(true);
    }

    /// What a long-lived stream listens to (an RLQS client's, `rlqs`):
    /// the policy set's version, fleet news, and the admin stopping.
    pub fn listen(&self) -> Listening {
        Listening {
            versions: self.seen.subscribe(),
            fleet: self.fleet.subscribe(),
            stopping: self.stopping.subscribe(),
        }
    }

    /// Makes a watch `instance`'s only held one: the one it held before
    /// is answered now.
    pub fn hold(&self, instance: &str) -> Result<Hold<'_>, HoldRefused> {
        let ticket = self.next_ticket.fetch_add(1, Ordering::Relaxed);
        let (replaced_tx, replaced) = watch::channel(false);
        let mut held = lock(&self.held);
        if !held.contains_key(instance) && held.len() >= MAX_HELD_WATCHES {
            return Err(HoldRefused::Full);
        }
        let newer = Holder {
            ticket,
            replaced: replaced_tx,
        };
        if let Some(older) = held.insert(instance.to_string(), newer) {
            older.replaced.send_replace(true);
        }
        Ok(Hold {
            changes: self,
            instance: instance.to_string(),
            ticket,
            replaced,
        })
    }

    /// Instances holding a watch now.
    pub fn held(&self) -> usize {
        lock(&self.held).len()
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
    peer: SyncPeer,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let request: WatchRequest = serde_json::from_slice(body.as_ref())
        .map_err(|e| ApiError::BadRequest(format!("watch: {e}")))?;
    check_instance(&request.instance)
        .map_err(|e| ApiError::BadRequest(format!("watch: instance: {e}")))?;
    departs_on_close(&state, &peer, &request.instance);
    answer_watch(&state, &headers, &request).await
}

/// From now on, `instance` closing this connection is taken as its
/// departure: its process may be gone (a SIGKILLed Envoy's kernel closes
/// its connections, a held watch's or one idle between syncs), and its
/// fleet shares go to the others if it does not sync again within three
/// sync intervals (see `Ledgers::departed`). A live Envoy that closes a
/// connection syncs on over another and keeps its shares.
pub fn departs_on_close(state: &Arc<AppState>, peer: &SyncPeer, instance: &str) {
    let (state, instance) = (Arc::clone(state), instance.to_string());
    peer.0.set(move || {
        // Run from the connection's task, so within the runtime.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        runtime.spawn(async move {
            let noted = match state.store.current().await.map(|(set, _)| set) {
                Ok(set) => state.fleet.departed(&set, &instance).await.map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            match noted {
                Ok(()) => tracing::info!(%instance, "an Envoy's connection closed; its fleet shares are freed unless it syncs again"),
                Err(e) => tracing::warn!(%instance, error = %e, "an Envoy's connection closed; not noted in the fleet ledgers"),
            }
        });
    });
}

async fn answer_watch(
    state: &Arc<AppState>,
    headers: &HeaderMap,
    request: &WatchRequest,
) -> Result<Response, ApiError> {
    let mut place = state.changes.hold(&request.instance).map_err(|_| {
        ApiError::Unavailable(format!(
            "{MAX_HELD_WATCHES} instances hold a watch already; sync instead"
        ))
    })?;
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
        let (set, epoch) = state.store.current().await?;
        let same_store = request.policy_epoch == epoch || request.policy_epoch == 0;
        // An Envoy ahead of this store (restored from a backup) is not
        // sent the older set: its next sync draws the store a new epoch,
        // and that set reaches it then.
        if set.version > request.policy_version || !same_store {
            tracing::info!(instance = %request.instance, from = request.policy_version, to = set.version, "pushing policy set");
            let answer = AdminAnswer {
                set: Some(sluice_shared::PolicySet::clone(&set)),
                epoch,
                ..AdminAnswer::default()
            };
            return Ok(http_answer(&answer));
        }
        tokio::select! {
            changed = changes.changed() => if changed.is_err() { break },
            news = fleet.changed() => {
                sync_now = news.is_ok();
                break;
            }
            () = tokio::time::sleep_until(deadline) => break,
            _ = stopping.wait_for(|s| *s) => break,
            // A newer watch of the same instance holds its place now.
            _ = place.replaced.wait_for(|r| *r) => break,
        }
    }
    let answer = AdminAnswer {
        epoch: state.store.epoch().await?,
        sync_now,
        ..AdminAnswer::default()
    };
    Ok(http_answer(&answer))
}
