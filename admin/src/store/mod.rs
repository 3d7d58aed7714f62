//! The store: policies in evaluation order with per-policy versions, their
//! history, the audit log and the Envoys seen by sync, in SQLite (one admin)
//! or PostgreSQL (replicas on several hosts). Every write is one
//! transaction under the store's write lock; the whole resulting policy set
//! is validated before it commits, so the store never holds a set a filter
//! would refuse.

mod as_code;
mod blocking;
mod db;
mod people;

use std::path::Path;
use std::sync::Arc;

use serde::Serialize;
use sluice_api::people::{Role, TokenInfo, TokenScope, UserInfo};
use sluice_api::{AuditEntry, HistoryEntry, PolicyList, StoredPolicy};
use sluice_shared::price::PriceTable;
use sluice_shared::{Instant, Policy, PolicySet, ValidationErrors};
use sluice_wire::sync::{BudgetsMessage, SyncReport};

pub use blocking::BlockingStore;
pub use people::{AdminGuard, TokenRecord, UserRecord};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("no policy named {0:?}")]
    NotFound(String),
    #[error("policy {name:?} is at version {current}, not {expected}")]
    Stale {
        name: String,
        current: u64,
        expected: u64,
    },
    #[error("{0}")]
    Invalid(ValidationErrors),
    #[error("database: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("database: {}", with_causes(.0))]
    Postgres(#[from] postgres::Error),
    #[error("migrations: {0}")]
    Migration(#[from] rusqlite_migration::Error),
    #[error("{0}")]
    Exists(String),
    #[error("no user named {0:?}")]
    NoSuchUser(String),
    #[error("no token with id {0:?}")]
    NoSuchToken(String),
    #[error("{0:?} is the last admin: make another user admin first (or start with SLUICE_ADMIN_PASSWORD)")]
    LastAdmin(String),
    #[error("stored data is corrupt: {0}")]
    Corrupt(String),
    #[error("{0} instances are known already: {1:?} is not added (instances silent past the TTL are forgotten)")]
    TooManyInstances(usize, String),
    #[error("store lock poisoned")]
    Poisoned,
    #[error("store task failed: {0}")]
    Task(String),
    #[error("database unavailable: {0}")]
    Unavailable(String),
    #[error("database TLS: {0}")]
    Tls(String),
}

/// An error and what caused it, in one line: PostgreSQL's client says
/// "db error" or "error performing TLS handshake", and the reason (the
/// server's message, the certificate problem) is in its source.
fn with_causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

#[derive(Debug, Clone, Serialize)]
pub struct InstanceRow {
    pub id: String,
    pub first_seen_ms: u64,
    pub last_sync_ms: u64,
    pub policy_version: u64,
    pub syncs: u64,
    pub report: SyncReport,
}

/// The wall clock, as the core's time type.
pub fn now() -> Instant {
    Instant::from_system(std::time::SystemTime::now())
}

/// The wall clock in milliseconds since the epoch, as the API and the
/// store write times.
pub fn now_ms() -> u64 {
    now().as_millis()
}

/// What a sync is answered from.
/// What [`BlockingStore::record_sync`] kept of a report, and the set and
/// epoch it read in the same transaction.
pub struct RecordedSync {
    pub report: SyncReport,
    pub set: Arc<PolicySet>,
    pub epoch: u64,
}

pub struct SyncAnswer {
    pub report: SyncReport,
    pub set: Arc<PolicySet>,
    pub epoch: u64,
    /// The report named a version of this epoch the store has not reached,
    /// and the store drew a new epoch.
    pub renewed: bool,
    /// The budgets held for the instance that it does not know yet.
    pub budgets: BudgetsMessage,
}

/// The store as the async handlers use it: each call runs the blocking
/// query on Tokio's blocking pool, so no handler holds a runtime thread
/// while SQLite or PostgreSQL works.
#[derive(Clone)]
pub struct Store {
    blocking: BlockingStore,
}

impl Store {
    /// Opens (creating if needed) the SQLite file, in WAL mode, and runs
    /// the migrations. Blocking: call it at start or off the runtime.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        BlockingStore::open(path).map(|blocking| Self { blocking })
    }

    /// Connects to PostgreSQL (`postgres://user:password@host:port/db`,
    /// `?sslmode=require` for TLS, with `ca` for a private CA) and runs the
    /// migrations. Blocking: call it at start or off the runtime.
    pub fn open_postgres(url: &str, ca: Option<&Path>) -> Result<Self, StoreError> {
        BlockingStore::open_postgres(url, ca).map(|blocking| Self { blocking })
    }

    /// "sqlite" or "postgres".
    pub fn kind(&self) -> &'static str {
        self.blocking.kind()
    }

    /// The blocking core, for tools and tests that run off the runtime.
    /// Keeps warning-line rows of the audit log this long (default 30
    /// days); the people's changes stay.
    pub fn with_warn_retention(mut self, retention: sluice_shared::Span) -> Self {
        self.blocking.warn_retention_ms = retention.as_millis();
        self
    }

    /// What this store's admins tag fleet shares with (the same for every
    /// replica on it, and across restarts).
    pub fn fleet_secret(&self) -> [u8; sluice_shared::fleet::share_tag::SECRET_LEN] {
        self.blocking.fleet_secret()
    }

    pub fn blocking(&self) -> &BlockingStore {
        &self.blocking
    }

    async fn run<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&BlockingStore) -> Result<T, StoreError> + Send + 'static,
    {
        let store = self.blocking.clone();
        tokio::task::spawn_blocking(move || f(&store))
            .await
            .map_err(|e| StoreError::Task(e.to_string()))?
    }

    pub async fn policy_set_version(&self) -> Result<u64, StoreError> {
        self.run(|s| s.policy_set_version()).await
    }

    pub async fn list(&self) -> Result<PolicyList, StoreError> {
        self.run(|s| s.list())
            .await
            .map(|(version, policies)| PolicyList {
                version,
                policies,
                managed: None,
            })
    }

    /// The store's epoch (see [`sluice_wire::sync::EPOCH_HEADER`]).
    pub async fn epoch(&self) -> Result<u64, StoreError> {
        self.run(|s| s.epoch()).await
    }

    pub async fn policy_set(&self) -> Result<PolicySet, StoreError> {
        self.run(|s| s.policy_set()).await
    }

    /// The set and the epoch a watch answers with (see
    /// [`BlockingStore::current`]).
    pub async fn current(&self) -> Result<(Arc<PolicySet>, u64), StoreError> {
        self.run(|s| s.current()).await
    }

    pub async fn get(&self, name: &str) -> Result<StoredPolicy, StoreError> {
        let name = name.to_string();
        self.run(move |s| s.get(&name)).await
    }

    pub async fn history(&self, name: &str) -> Result<Vec<HistoryEntry>, StoreError> {
        let name = name.to_string();
        self.run(move |s| s.history(&name)).await
    }

    pub async fn create(&self, policy: Policy, actor: &str) -> Result<StoredPolicy, StoreError> {
        let actor = actor.to_string();
        self.run(move |s| s.create(policy, &actor)).await
    }

    pub async fn update(
        &self,
        name: &str,
        policy: Policy,
        expected: u64,
        actor: &str,
    ) -> Result<StoredPolicy, StoreError> {
        let (name, actor) = (name.to_string(), actor.to_string());
        self.run(move |s| s.update(&name, policy, expected, &actor))
            .await
    }

    pub async fn delete(&self, name: &str, expected: u64, actor: &str) -> Result<(), StoreError> {
        let (name, actor) = (name.to_string(), actor.to_string());
        self.run(move |s| s.delete(&name, expected, &actor)).await
    }

    pub async fn audit_event(
        &self,
        actor: &str,
        action: &str,
        target: &str,
    ) -> Result<(), StoreError> {
        let (actor, action, target) = (actor.to_string(), action.to_string(), target.to_string());
        self.run(move |s| s.audit_event(&actor, &action, &target))
            .await
    }

    pub async fn audit_log(
        &self,
        limit: u32,
        before: Option<i64>,
    ) -> Result<Vec<AuditEntry>, StoreError> {
        self.run(move |s| s.audit_log(limit, before)).await
    }

    /// Records the sync (what it says of names the set has; an instance
    /// beyond [`sluice_wire::sync::MAX_INSTANCES`] is refused) and returns the report so
    /// kept, the policy set to answer it with, and the store's epoch. An Envoy reporting a version of this epoch the
    /// store has not reached renews the epoch first (see
    /// [`BlockingStore::renew_epoch`]).
    pub async fn record_sync(&self, report: SyncReport) -> Result<SyncAnswer, StoreError> {
        self.run(move |s| {
            let RecordedSync {
                report,
                set,
                mut epoch,
            } = s.record_sync(report)?;
            let mut renewed = false;
            if report.policy_epoch == epoch && report.policy_version > set.version {
                epoch = s.renew_epoch(epoch)?;
                renewed = true;
            }
            let budgets = s.record_budgets(&report, &set)?;
            Ok(SyncAnswer {
                report,
                set,
                epoch,
                renewed,
                budgets,
            })
        })
        .await
    }

    pub async fn instances(&self, after: &str, limit: u32) -> Result<Vec<InstanceRow>, StoreError> {
        let after = after.to_string();
        self.run(move |s| s.instances(&after, limit)).await
    }

    pub async fn prune_instances(&self, before_ms: u64) -> Result<u64, StoreError> {
        self.run(move |s| s.prune_instances(before_ms)).await
    }

    pub async fn add_user(
        &self,
        name: &str,
        role: Role,
        password_hash: String,
        actor: &str,
    ) -> Result<UserInfo, StoreError> {
        let (name, actor) = (name.to_string(), actor.to_string());
        self.run(move |s| s.add_user(&name, role, &password_hash, &actor))
            .await
    }

    pub async fn users(&self) -> Result<Vec<UserInfo>, StoreError> {
        self.run(|s| s.users()).await
    }

    pub async fn user(&self, name: &str) -> Result<Option<UserRecord>, StoreError> {
        let name = name.to_string();
        self.run(move |s| s.user(&name)).await
    }

    pub async fn change_user(
        &self,
        name: &str,
        role: Option<Role>,
        password_hash: Option<String>,
        actor: &str,
        guard: AdminGuard,
    ) -> Result<UserInfo, StoreError> {
        let (name, actor) = (name.to_string(), actor.to_string());
        self.run(move |s| s.change_user(&name, role, password_hash.as_deref(), &actor, guard))
            .await
    }

    pub async fn remove_user(
        &self,
        name: &str,
        actor: &str,
        guard: AdminGuard,
    ) -> Result<(), StoreError> {
        let (name, actor) = (name.to_string(), actor.to_string());
        self.run(move |s| s.remove_user(&name, &actor, guard)).await
    }

    pub async fn add_token(
        &self,
        id: String,
        name: String,
        scope: TokenScope,
        secret_hash: String,
        expires_ms: u64,
        actor: &str,
    ) -> Result<TokenInfo, StoreError> {
        let actor = actor.to_string();
        self.run(move |s| s.add_token(&id, &name, scope, &secret_hash, expires_ms, &actor))
            .await
    }

    pub async fn tokens(&self) -> Result<Vec<TokenInfo>, StoreError> {
        self.run(|s| s.tokens()).await
    }

    pub async fn token(&self, id: &str) -> Result<Option<TokenRecord>, StoreError> {
        let id = id.to_string();
        self.run(move |s| s.token(&id)).await
    }

    pub async fn token_used(&self, id: &str, now: u64) -> Result<(), StoreError> {
        let id = id.to_string();
        self.run(move |s| s.token_used(&id, now)).await
    }

    pub async fn revoke_token(&self, id: &str, actor: &str) -> Result<(), StoreError> {
        let (id, actor) = (id.to_string(), actor.to_string());
        self.run(move |s| s.revoke_token(&id, &actor)).await
    }

    pub async fn apply_set(
        &self,
        desired: Vec<Policy>,
        sources: Vec<String>,
        prices: Option<PriceTable>,
        actor: &str,
        dry_run: bool,
    ) -> Result<sluice_api::Applied, StoreError> {
        let actor = actor.to_string();
        self.run(move |s| s.apply_set(&desired, &sources, prices.as_ref(), &actor, dry_run))
            .await
    }

    pub async fn prices(&self) -> Result<Option<PriceTable>, StoreError> {
        self.run(|s| s.prices()).await
    }

    pub async fn set_prices(
        &self,
        table: Option<PriceTable>,
        actor: &str,
    ) -> Result<u64, StoreError> {
        let actor = actor.to_string();
        self.run(move |s| s.set_prices(table, &actor)).await
    }

    pub async fn import_prices(
        &self,
        catalog: crate::price_catalog::Catalog,
        actor: &str,
        dry_run: bool,
    ) -> Result<sluice_api::prices::PricesImported, StoreError> {
        let actor = actor.to_string();
        self.run(move |s| s.import_prices(&catalog, &actor, dry_run))
            .await
    }

    pub async fn reorder(
        &self,
        names: Vec<String>,
        expected: u64,
        actor: &str,
    ) -> Result<u64, StoreError> {
        let actor = actor.to_string();
        self.run(move |s| s.reorder(&names, expected, &actor)).await
    }
}
