//! What operators read about the running fleet: the audit log, the
//! Envoys that synced, the fleet's shares, and the live view's stream.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::routing::get;
use axum::{Json, Router};
use futures_util::stream::{self, Stream, StreamExt};
use serde::Deserialize;
use sluice_api::{AuditLog, BudgetTree, FleetView, Instance, InstanceList};
use sluice_shared::budget_tree::budget_tree;
use tokio_stream::wrappers::BroadcastStream;

use crate::access::{Operator, Presented};
use crate::error::ApiError;
use crate::store::now_ms;
use crate::AppState;

type Shared = Arc<AppState>;

pub fn routes() -> Router<Shared> {
    Router::new()
        .route("/api/v1/audit", get(audit_log))
        .route("/api/v1/instances", get(instances))
        .route("/api/v1/fleet", get(fleet))
        .route("/api/v1/budgets", get(budgets))
}

/// The live view's stream: held open as long as the browser watches, so
/// outside the request timeout.
pub fn live_routes() -> Router<Shared> {
    Router::new().route("/api/v1/live", get(live))
}

#[derive(Deserialize)]
struct AuditQuery {
    limit: Option<u32>,
    before: Option<i64>,
}

async fn audit_log(
    State(state): State<Shared>,
    _op: Operator,
    Query(q): Query<AuditQuery>,
) -> Result<Json<AuditLog>, ApiError> {
    let entries = state
        .store
        .audit_log(q.limit.unwrap_or(100), q.before)
        .await?;
    Ok(Json(AuditLog { entries }))
}

/// A page of `GET /instances`: `?limit=` (1 to 1000, default 100) after
/// `?after=` (the previous page's `next`).
#[derive(Deserialize)]
struct InstancesQuery {
    limit: Option<u32>,
    after: Option<String>,
}

const MAX_INSTANCES_PAGE: u32 = 1000;

async fn instances(
    State(state): State<Shared>,
    _op: Operator,
    Query(q): Query<InstancesQuery>,
) -> Result<Json<InstanceList>, ApiError> {
    let limit = q.limit.unwrap_or(100).clamp(1, MAX_INSTANCES_PAGE);
    let rows = state
        .store
        .instances(q.after.as_deref().unwrap_or(""), limit)
        .await?;
    let now_ms = now_ms();
    let next = (rows.len() == limit as usize)
        .then(|| rows.last().map(|r| r.id.clone()))
        .flatten();
    let instances = rows
        .into_iter()
        .map(|r| Instance {
            live: now_ms.saturating_sub(r.last_sync_ms) <= crate::live::STALE_AFTER_MS,
            id: r.id,
            first_seen_ms: r.first_seen_ms,
            last_sync_ms: r.last_sync_ms,
            policy_version: r.policy_version,
            syncs: r.syncs,
            report: r.report,
        })
        .collect();
    Ok(Json(InstanceList {
        instances,
        now_ms,
        next,
    }))
}

/// Each global policy's limit and how it is shared out now.
async fn fleet(State(state): State<Shared>, _op: Operator) -> Result<Json<FleetView>, ApiError> {
    let set = state.store.policy_set().await?;
    let now = state.fleet.now();
    let policies = state
        .fleet
        .views(&set)
        .await
        .map_err(|e| ApiError::Unavailable(e.to_string()))?;
    Ok(Json(FleetView {
        now_ms: now.as_millis(),
        policies,
        rlqs: state.rlqs.views(),
    }))
}

/// The budgets as a tree, from the live Envoys' latest spend.
async fn budgets(State(state): State<Shared>, _op: Operator) -> Result<Json<BudgetTree>, ApiError> {
    let set = state.store.policy_set().await?;
    let prices = state.store.prices().await?;
    let at_ms = now_ms();
    let spends = state
        .live
        .frame(at_ms)
        .limits
        .into_iter()
        .filter_map(|(name, used)| Some((name, used.spend?)))
        .collect();
    Ok(Json(BudgetTree {
        at_ms,
        currency: prices.map(|p| p.currency),
        roots: budget_tree(&set.policies, &spends),
    }))
}

/// How often a live stream asks whether its credentials still let it in,
/// besides whenever a way in closed on this admin (a revocation made on
/// another replica is noticed within this).
const LIVE_RECHECK_EVERY: Duration = Duration::from_secs(5);

async fn live(
    State(state): State<Shared>,
    Operator(caller): Operator,
    presented: Presented,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    let seat = state
        .live
        .streams
        .take(&caller.actor)
        .map_err(|full| ApiError::TooMany(full.to_string()))?;
    // Shared frames, serialized straight from the history: nothing is
    // copied per stream.
    let history = state.live.history();
    let shared: Vec<&sluice_api::LiveFrame> = history.iter().map(|f| &**f).collect();
    let first = Event::default()
        .event("history")
        .json_data(&shared)
        .unwrap_or_default();
    let frames = BroadcastStream::new(state.live.frames.subscribe()).filter_map(|f| async move {
        // A lagging client skips frames rather than stalling the others.
        let frame = f.ok()?;
        Some(Ok(Event::default()
            .event("frame")
            .json_data(&*frame)
            .unwrap_or_default()))
    });
    // The stream ends when what let it in no longer does (a password
    // changed, the user removed, a token revoked, a logout).
    let recheck = Arc::clone(&state);
    let ended = async move {
        let mut changes = recheck.access_changes.subscribe();
        loop {
            tokio::select! {
                _ = changes.changed() => {}
                () = tokio::time::sleep(LIVE_RECHECK_EVERY) => {}
            }
            if !presented.still_let_in(&recheck).await {
                tracing::info!(actor = %caller.actor, "live stream ended: its credentials no longer let it in");
                return;
            }
        }
    };
    let events = stream::once(async move { Ok(first) })
        .chain(frames)
        .take_until(ended)
        // The seat is given back when the stream goes.
        .map(move |event| {
            let _held = &seat;
            event
        });
    Ok(Sse::new(events).keep_alive(KeepAlive::new().interval(Duration::from_secs(15))))
}
