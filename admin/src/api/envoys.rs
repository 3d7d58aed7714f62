//! What Envoys and Prometheus call: the sync (reports in, policies,
//! shares and news out), the watch an edit is pushed on, `/metrics` and
//! `/healthz`.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use sluice_api::Health;
use sluice_wire::sync::{SyncReport, SYNC_PATH};
use sluice_wire::sync_answer::AdminAnswer;

use crate::access::SyncPeer;
use crate::answer::http_answer;
use crate::auth::bears;
use crate::error::ApiError;
use crate::store::now_ms;
use crate::AppState;

type Shared = Arc<AppState>;

pub fn routes() -> Router<Shared> {
    Router::new()
        .route(SYNC_PATH, post(sync))
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route(crate::push::WATCH_PATH, post(crate::push::watch))
}

/// When a shed sync is told to come back: the filter backs off on its
/// own (its interval, doubled after each failure, at most 5 s).
const SHED_RETRY_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

async fn sync(
    State(state): State<Shared>,
    peer: SyncPeer,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    // Shed before any work: a sync that waits its turn behind thousands
    // reaches its Envoy after its timeout, and is sent again.
    let Ok(_turn) = state.sync_turns.try_acquire() else {
        state.metrics.result("shed");
        // Its Envoy is alive and unheard: nobody silent is given away.
        state.fleet.turned_away();
        return Err(ApiError::Busy(
            "the admin answers as many syncs as it can (--max-syncs-in-flight); \
             keep the set and shares you hold and sync again later"
                .into(),
            SHED_RETRY_AFTER,
        ));
    };
    let report: SyncReport = serde_json::from_slice(&body).map_err(|e| {
        state.metrics.result("bad_request");
        ApiError::BadRequest(format!("sync report: {e}"))
    })?;
    report.check().map_err(|e| {
        state.metrics.result("bad_request");
        ApiError::BadRequest(e)
    })?;
    crate::push::departs_on_close(&state, &peer, &report.instance);
    let answer = answer_sync(&state, report).await?;
    state.metrics.result(if answer.set.is_some() {
        "policy_set"
    } else {
        "not_modified"
    });
    Ok(http_answer(&answer))
}

/// What the admin answers an Envoy's report: it records the report (the
/// live view, relayed provider news, fleet demand) and answers with the
/// set when the Envoy's is not current, and always with the store's epoch,
/// the Envoy's fleet shares, its budgets and other Envoys' provider news.
async fn answer_sync(state: &AppState, report: SyncReport) -> Result<AdminAnswer, ApiError> {
    let received_ms = now_ms();
    // The store keeps what the report says of the set's names only, and
    // hands the report back so kept: nothing below sees a made-up name.
    let recorded = state.store.record_sync(report).await.map_err(|e| {
        if matches!(e, crate::store::StoreError::TooManyInstances(..)) {
            state.metrics.result("too_many_instances");
            return ApiError::Unavailable(e.to_string());
        }
        // Its Envoy is alive and unheard (the store failed this sync, and
        // may not the others'): nobody silent is given away.
        state.fleet.turned_away();
        ApiError::from(e)
    })?;
    let (report, set, epoch) = (recorded.report, recorded.set, recorded.epoch);
    state.live.ingest(&report, received_ms);
    // The relay failing (Redis away) costs the Envoys the other Envoys'
    // news, never the sync.
    if let Err(e) = state.relay.hear(&report, &set, received_ms).await {
        tracing::warn!(instance = %report.instance, error = %e, "provider news not kept");
    }
    let provider = match state.relay.news_for(&report, &set, received_ms).await {
        Ok(news) => news,
        Err(e) => {
            tracing::warn!(instance = %report.instance, error = %e, "no provider news for this sync");
            Default::default()
        }
    };
    state.metrics.policy_set_version.set(set.version as i64);
    state.changes.observe(set.version);
    if recorded.renewed {
        tracing::warn!(
            instance = %report.instance,
            reported = report.policy_version,
            store = set.version,
            epoch,
            "an Envoy enforces a version this store never reached (restored from a backup?): new store epoch"
        );
    }
    let shares = match state.fleet.shares(&set, &report).await {
        Ok(shares) => {
            if shares.freed {
                state.changes.fleet_news();
            }
            shares.message
        }
        Err(e) => {
            // The Envoy keeps its last share until that lease runs out.
            state.metrics.result("fleet_error");
            tracing::error!(instance = %report.instance, error = %e, "no shares for this sync");
            Default::default()
        }
    };
    // An Envoy that names no epoch is older than epochs: its version alone
    // tells whether it is current.
    let same_store = report.policy_epoch == epoch || report.policy_epoch == 0;
    let current = set.version == report.policy_version && same_store;
    if !current {
        tracing::info!(instance = %report.instance, from = report.policy_version, to = set.version, "sending policy set");
    }
    Ok(AdminAnswer {
        version: Some(set.version),
        set: (!current).then(|| sluice_shared::PolicySet::clone(&set)),
        epoch,
        shares,
        budgets: recorded.budgets,
        provider,
        sync_now: false,
    })
}

async fn metrics(State(state): State<Shared>, headers: HeaderMap) -> Result<Response, ApiError> {
    if let Some(expected) = &state.config.metrics_token {
        if !bears(&headers, expected) {
            return Err(ApiError::Unauthorized);
        }
    }
    // The version as of the last sync or edit: a scrape costs no query.
    let open_metrics = headers
        .get(header::ACCEPT)
        .and_then(|a| a.to_str().ok())
        .is_some_and(|a| a.contains("application/openmetrics-text"));
    Ok(if open_metrics {
        (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            state.metrics.render(),
        )
            .into_response()
    } else {
        (
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            state.metrics.render_text(),
        )
            .into_response()
    })
}

async fn healthz(State(state): State<Shared>) -> Response {
    match state.health.check(&state.store).await {
        Some(version) => Json(Health {
            status: "ok".into(),
            policy_set_version: Some(version),
        })
        .into_response(),
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(Health {
                status: "store unavailable".into(),
                policy_set_version: None,
            }),
        )
            .into_response(),
    }
}
