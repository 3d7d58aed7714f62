//! Managed mode (`--managed-dir`): the policy set is the directory's. It is
//! read at start and whenever its files change (checked every
//! [`POLL_INTERVAL`]); a change that fails validation is refused whole and
//! shown, and the last good set stays in force. Nobody edits policies in
//! the UI or the API meanwhile.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sluice_api::ManagedState;

use crate::as_code::{load, read_path, SourceFile};
use crate::store::now_ms;
use crate::AppState;

/// How often the directory is looked at: a change is in force within this
/// and a sync interval.
pub const POLL_INTERVAL: Duration = Duration::from_secs(2);

pub struct Managed {
    pub dir: PathBuf,
    state: Mutex<ManagedState>,
    /// The files as last read, to tell a change.
    last: Mutex<Option<Vec<SourceFile>>>,
}

impl Managed {
    pub fn new(dir: PathBuf) -> Self {
        Self {
            state: Mutex::new(ManagedState {
                dir: dir.display().to_string(),
                ..Default::default()
            }),
            dir,
            last: Mutex::new(None),
        }
    }

    pub fn state(&self) -> ManagedState {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn set(&self, f: impl FnOnce(&mut ManagedState)) {
        f(&mut self.state.lock().unwrap_or_else(|p| p.into_inner()));
    }

    /// Who the audit log names for the directory's changes.
    pub fn actor(&self) -> String {
        format!("managed:{}", self.dir.display())
    }

    /// Reads the directory and applies it if its files changed. Returns
    /// whether the policy set changed.
    pub async fn sync_once(&self, state: &AppState) -> bool {
        let dir = self.dir.clone();
        let files = match tokio::task::spawn_blocking(move || read_path(&dir)).await {
            Ok(Ok(files)) => files,
            Ok(Err(e)) => return self.refused(state, e.to_string()),
            Err(e) => return self.refused(state, e.to_string()),
        };
        {
            let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
            if last.as_ref() == Some(&files) {
                return false;
            }
            *last = Some(files.clone());
        }
        let loaded = match load(&files) {
            Ok(loaded) => loaded,
            Err(errors) => return self.refused(state, errors.to_string()),
        };
        let prices = loaded.prices();
        match state
            .store
            .apply_set(
                loaded.policies,
                loaded.sources,
                prices,
                &self.actor(),
                false,
            )
            .await
        {
            Ok(applied) => {
                self.set(|s| {
                    s.applied_ms = now_ms();
                    s.error = None;
                });
                state.metrics.managed_error.set(0);
                if applied.applied {
                    crate::writes::publish_set(state).await;
                    tracing::info!(dir = %self.dir.display(), version = applied.version, changes = %applied.diff.to_string().trim_end().replace('\n', "; "), "managed policies applied");
                }
                applied.applied
            }
            Err(e) => {
                // The store may be away: read the files again next time.
                *self.last.lock().unwrap_or_else(|p| p.into_inner()) = None;
                self.refused(state, e.to_string())
            }
        }
    }

    fn refused(&self, state: &AppState, error: String) -> bool {
        tracing::error!(dir = %self.dir.display(), %error, "managed policies not applied; the last good set stays");
        state.metrics.managed_error.set(1);
        self.set(|s| s.error = Some(error));
        false
    }
}

/// Looks at the directory every [`POLL_INTERVAL`] for as long as the
/// admin runs.
pub fn watch(state: Arc<AppState>) {
    tokio::spawn(async move {
        let Some(managed) = state.managed.clone() else {
            return;
        };
        let mut tick = tokio::time::interval(POLL_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            managed.sync_once(&state).await;
        }
    });
}
