//! `/api/v1/policies/{name}/key-label`: an editor looks up the label the
//! live view shows for a raw key (throttled: a label is a hash an
//! attacker must not be able to test keys against at speed).

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::routing::post;
use axum::{Json, Router};
use serde_json::Value;
use sluice_api::{KeyLabelAnswer, KeyLabelRequest};
use sluice_shared::key_view::{label_secret, name_key};
use sluice_shared::{FieldError, ValidationErrors};

use crate::access::Editor;
use crate::error::ApiError;
use crate::store::now_ms;
use crate::AppState;

type Shared = Arc<AppState>;

pub fn routes() -> Router<Shared> {
    Router::new().route("/api/v1/policies/{name}/key-label", post(key_label))
}

/// The longest key the live view will name: far above any API key, and
/// below anything Envoy would pass as one header.
const MAX_KEY_LEN: usize = 8 * 1024;

/// The label the live view shows for a key typed in. A POST, so that the
/// key (an API key, say) stays out of URLs and access logs.
/// Key lookups per caller: a few at once, then one every 6 s. A lookup
/// hashes a guessed key the way the Envoys do, so it is an editor's, and
/// counted and audited.
const KEY_LOOKUP_BURST: u64 = 10;

const KEY_LOOKUP_EVERY: sluice_shared::Span = sluice_shared::Span::from_secs(6);

/// Throttles key lookups per caller.
pub fn key_lookup_throttle() -> crate::login::KeyedThrottle<String> {
    crate::login::KeyedThrottle::new(
        KEY_LOOKUP_BURST,
        KEY_LOOKUP_EVERY,
        crate::login::MAX_TRACKED,
    )
}

async fn key_label(
    State(state): State<Shared>,
    Editor(editor): Editor,
    Path(name): Path<String>,
    Json(body): Json<Value>,
) -> Result<Json<KeyLabelAnswer>, ApiError> {
    let now = sluice_shared::Instant::from_millis(now_ms());
    if !state.key_lookups.take(&editor.actor, now) {
        let wait = state
            .key_lookups
            .wait(&editor.actor, now)
            .unwrap_or(KEY_LOOKUP_EVERY);
        tracing::warn!(actor = %editor.actor, policy = %name, "key lookup refused: over the limit");
        return Err(ApiError::Limited(
            format!(
                "{} looked up {KEY_LOOKUP_BURST} keys in a row: one more every {} s",
                editor.actor,
                KEY_LOOKUP_EVERY.as_secs()
            ),
            wait.as_duration(),
        ));
    }
    let KeyLabelRequest { key } = super::json_body::parse(body)?;
    let invalid = |message: String| {
        ApiError::InvalidRequest(ValidationErrors {
            errors: vec![FieldError {
                path: "key".into(),
                message,
            }],
        })
    };
    if key.is_empty() || key.len() > MAX_KEY_LEN {
        return Err(invalid(format!("must be 1 to {MAX_KEY_LEN} bytes")));
    }
    let stored = state.store.get(&name).await?;
    let Some(spec) = &stored.policy.key else {
        return Err(invalid(format!("policy {name:?} has no key")));
    };
    let secret = label_secret(state.config.sync_token.as_deref());
    let named = name_key(&secret, &name, key.as_bytes(), spec.label);
    // The label, never the key, goes into the audit log.
    state
        .store
        .audit_event(
            &editor.actor,
            "key.lookup",
            &format!("{name} {}", named.label),
        )
        .await?;
    tracing::info!(actor = %editor.actor, policy = %name, label = %named.label, "key looked up");
    Ok(Json(KeyLabelAnswer {
        policy: name,
        label: named.label,
    }))
}
