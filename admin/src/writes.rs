//! What every write to the policy set does besides the change itself
//! (which the store makes in one transaction with its audit row and the
//! set's new version): refused while policies are managed from a
//! directory, counted on `/metrics`, and published: pushed to every Envoy
//! watching, and the set's version and policies shown on `/metrics`.

use crate::error::ApiError;
use crate::AppState;

/// A write to the policy set through the API, from its check to its
/// publication.
#[must_use = "a write is published by `done`"]
pub struct SetWrite<'a> {
    state: &'a AppState,
}

impl<'a> SetWrite<'a> {
    /// A write may begin: not while the policies are managed from a
    /// directory (policies as code), the only way to change them then.
    pub fn begin(state: &'a AppState) -> Result<Self, ApiError> {
        match &state.managed {
            Some(managed) => Err(ApiError::Conflict(format!(
                "policies are managed from {} (policies as code): change the files there",
                managed.dir.display()
            ))),
            None => Ok(Self { state }),
        }
    }

    /// The store made the change: counted as a write of `kind`, and published.
    pub async fn done(self, kind: &'static str) {
        self.state.metrics.write(kind);
        publish_set(self.state).await;
    }
}

/// Publishes the set as the store now holds it: its version to every
/// Envoy watching (the push; the watch answers at once), and its version
/// and policies to `/metrics` (a scrape itself reads nothing from the
/// store). After every write, a managed directory's apply, and at start.
pub async fn publish_set(state: &AppState) {
    if let Ok(set) = state.store.policy_set().await {
        state.changes.observe(set.version);
        state.metrics.policy_set_version.set(set.version as i64);
        state.metrics.observe_policies(&set);
    }
}
