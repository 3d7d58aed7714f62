//! The policy set as a whole: policies as code applied in one transaction
//! (`/api/v1/apply`), the evaluation order (`/api/v1/order`), the price
//! table (`/api/v1/prices`) and a price catalog merged into it
//! (`/api/v1/prices/import`).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::Value;
use sluice_api::{Applied, ApplyRequest, PolicyOrder};
use sluice_shared::price::PriceTable;
use sluice_shared::ValidationErrors;

use super::versions::{etag, if_match};
use crate::access::{Editor, Operator};
use crate::as_code::{load, SourceFile};
use crate::error::ApiError;
use crate::price_catalog::{self, Selection, MAX_CATALOG_BYTES};
use crate::writes::SetWrite;
use crate::AppState;

type Shared = Arc<AppState>;

pub fn routes() -> Router<Shared> {
    Router::new()
        .route("/api/v1/apply", post(apply))
        .route("/api/v1/order", put(reorder))
        .route("/api/v1/prices", get(get_prices).put(put_prices))
        .route(
            "/api/v1/prices/import",
            // A whole public catalog is larger than any other body.
            post(import_prices).layer(DefaultBodyLimit::max(MAX_CATALOG_BYTES)),
        )
}

#[derive(Deserialize)]
struct ApplyQuery {
    #[serde(default)]
    dry_run: bool,
}

/// Policies as code over the API (a CI job with a write token): the files
/// as text, read and validated as `sluice-admin apply` does, applied in
/// one transaction, or with `?dry_run=true` only diffed.
async fn apply(
    State(state): State<Shared>,
    Editor(editor): Editor,
    Query(query): Query<ApplyQuery>,
    Json(body): Json<Value>,
) -> Result<Json<Applied>, ApiError> {
    let write = SetWrite::begin(&state)?;
    let request: ApplyRequest =
        serde_json::from_value(body).map_err(|e| ApiError::BadRequest(format!("apply: {e}")))?;
    let files: Vec<SourceFile> = request
        .files
        .into_iter()
        .map(|f| SourceFile {
            path: f.path,
            text: f.text,
        })
        .collect();
    let loaded = load(&files).map_err(ApiError::Invalid)?;
    let prices = loaded.prices();
    let applied = state
        .store
        .apply_set(
            loaded.policies,
            loaded.sources,
            prices,
            &editor.actor,
            query.dry_run,
        )
        .await?;
    if applied.applied {
        write.done("apply").await;
        tracing::info!(by = %editor.actor, version = applied.version, "policies applied");
    }
    Ok(Json(applied))
}

/// A new evaluation order (first match wins): every policy's name, with
/// `If-Match` naming the set version the caller saw.
async fn reorder(
    State(state): State<Shared>,
    Editor(editor): Editor,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Result<Response, ApiError> {
    let write = SetWrite::begin(&state)?;
    let expected = if_match(&headers)?;
    let order: PolicyOrder =
        serde_json::from_value(body).map_err(|e| ApiError::BadRequest(format!("order: {e}")))?;
    let version = state
        .store
        .reorder(order.names, expected, &editor.actor)
        .await?;
    write.done("reorder").await;
    Ok(([(header::ETAG, etag(version))], StatusCode::NO_CONTENT).into_response())
}

/// The set's price table (`null`: none).
async fn get_prices(
    State(state): State<Shared>,
    _op: Operator,
) -> Result<Json<Option<PriceTable>>, ApiError> {
    Ok(Json(state.store.prices().await?))
}

/// Replaces the set's price table (`null` removes it), checked with every
/// policy: a money limit needs prices. 422 names each bad field
/// (`prices.models.gpt-4o.input`).
async fn put_prices(
    State(state): State<Shared>,
    editor: Editor,
    Json(body): Json<Value>,
) -> Result<Json<sluice_api::PricesSaved>, ApiError> {
    let write = SetWrite::begin(&state)?;
    let table = match body {
        Value::Null => None,
        body => {
            let mut errors = Vec::new();
            match sluice_shared::validate::typed_at::<PriceTable>(body, "prices", &mut errors) {
                Some(table) => Some(table),
                None => return Err(ApiError::Invalid(ValidationErrors { errors })),
            }
        }
    };
    let version = state.store.set_prices(table, &editor.0.actor).await?;
    write.done("prices").await;
    tracing::info!(by = %editor.0.actor, version, "prices saved");
    Ok(Json(sluice_api::PricesSaved { version }))
}

#[derive(Deserialize)]
struct ImportQuery {
    #[serde(default)]
    dry_run: bool,
    /// Models, comma-separated (`gpt-4o,claude-*`).
    #[serde(default)]
    only: Option<String>,
    /// `litellm_provider`s, comma-separated.
    #[serde(default)]
    provider: Option<String>,
}

fn listed(text: Option<&str>) -> Vec<String> {
    text.map(|t| {
        t.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect()
    })
    .unwrap_or_default()
}

/// Merges a price catalog in LiteLLM's format (the body) into the set's
/// prices: each model added, changed or refused (and why); with
/// `?dry_run=true` only what would change. 400: not a catalog; 422: the
/// table it makes would be refused (another currency, too many models).
async fn import_prices(
    State(state): State<Shared>,
    editor: Editor,
    Query(query): Query<ImportQuery>,
    body: Bytes,
) -> Result<Json<sluice_api::prices::PricesImported>, ApiError> {
    let write = SetWrite::begin(&state)?;
    let selection = Selection {
        only: listed(query.only.as_deref()),
        providers: listed(query.provider.as_deref()),
    };
    // Up to 16 MiB of JSON: read off the async workers.
    let catalog = tokio::task::spawn_blocking(move || {
        let text = std::str::from_utf8(&body)
            .map_err(|_| ApiError::BadRequest("not a price catalog: not UTF-8 text".into()))?;
        price_catalog::read(text, &selection).map_err(|e| ApiError::BadRequest(e.to_string()))
    })
    .await??;
    let imported = state
        .store
        .import_prices(catalog, &editor.0.actor, query.dry_run)
        .await?;
    if imported.applied {
        write.done("prices import").await;
        tracing::info!(by = %editor.0.actor, version = imported.version, "prices imported");
    }
    Ok(Json(imported))
}
