//! The store's blocking core: every query and transaction, run on the
//! caller's thread. The admin's handlers reach it through the async
//! [`Store`](super::Store); tools and tests may use it directly.

mod budget_keys;
mod history;
mod price_table;
mod rows;
#[cfg(test)]
mod tests;

pub(super) use budget_keys::{audit_rungs, give_back_budget_keys, record_budget_keys};
pub(super) use history::{audit, audit_entry, audit_order, history};
pub(super) use rows::{
    bump, check_set, current_at, epoch, get, insert_new, list, new_epoch, prices, remove_policy,
    set_version, version_and_epoch, write_next_version, write_prices,
};

use std::path::Path;
use std::sync::Arc;

use sluice_api::{AuditEntry, HistoryEntry, StoredPolicy};
use std::collections::{BTreeMap, BTreeSet};

use sluice_shared::price::PriceTable;
use sluice_shared::validate::validate_policy_set;
use sluice_shared::{FieldError, Policy, PolicySet, ValidationErrors};
use sluice_wire::sync::{
    BudgetsMessage, HeldBudget, HeldKey, SyncReport, BUDGET_RETENTION_MS, MAX_BUDGETS_ANSWERED,
    MAX_KEYS_ANSWERED,
};

use super::db::{Db, Row, Sql};
use super::{now_ms, InstanceRow, RecordedSync, StoreError};

#[derive(Clone)]
pub struct BlockingStore {
    pub(super) db: Arc<Db>,
    /// How long warning-line rows of the audit log are kept, in ms.
    pub(super) warn_retention_ms: u64,
    /// What fleet shares are tagged with (`sluice_shared::fleet::share_tag`):
    /// drawn once per store, the same for every replica on it.
    fleet_secret: [u8; sluice_shared::fleet::share_tag::SECRET_LEN],
    /// The set as the last sync read it (see [`Self::record_sync`]).
    set_cache: Arc<std::sync::Mutex<Option<CachedSet>>>,
}

struct CachedSet {
    set: Arc<PolicySet>,
    read_at: std::time::Instant,
}

/// A set read for the syncs is read again after this, whatever its
/// version says: a database restored under a running admin may reach the
/// same version with other policies.
const SET_REREAD: std::time::Duration = std::time::Duration::from_secs(1);

/// Warning-line rows of the audit log are kept this long by default
/// (`--warn-retention`).
pub const DEFAULT_WARN_RETENTION_MS: u64 = 30 * 86_400_000;

/// A limit's crossings of its warning lines are written to one audit row
/// per this long, however many syncs report them.
const WARN_ROW_SPAN_MS: u64 = 60_000;

/// Envoys named in one warning row, at most (the rest are counted).
const WARN_ROW_ENVOYS: usize = 8;

fn to_json<T: serde::Serialize>(value: &T) -> String {
    serde_json::to_string(value).unwrap_or_else(|_| "null".into())
}

fn from_json<T: serde::de::DeserializeOwned>(body: &str) -> Result<T, StoreError> {
    serde_json::from_str(body).map_err(|e| StoreError::Corrupt(format!("stored JSON: {e}")))
}

/// Field paths of set-level errors (`policies[3].name`) name the policy the
/// operator is editing in the single-policy API.
fn relative_errors(errors: ValidationErrors, index: usize) -> ValidationErrors {
    let prefix = format!("policies[{index}].");
    let mut errors = errors.errors;
    // What the set says of the other policies (a shared limit they now
    // disagree on) is said of the edited one too; its own errors suffice.
    if errors.iter().any(|e| e.path.starts_with(&prefix)) {
        errors.retain(|e| e.path.starts_with(&prefix));
    }
    ValidationErrors {
        errors: errors
            .into_iter()
            .map(|e| FieldError {
                path: e
                    .path
                    .strip_prefix(&prefix)
                    .map(str::to_string)
                    .unwrap_or(e.path),
                message: e.message,
            })
            .collect(),
    }
}

impl BlockingStore {
    /// Opens (creating if needed) the SQLite file, in WAL mode, and runs
    /// the migrations.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        Self::with_epoch(Db::sqlite(path)?)
    }

    /// Connects to PostgreSQL (`postgres://user:password@host:port/db`) and
    /// runs the migrations. Blocking: call it off the async runtime.
    pub fn open_postgres(url: &str, ca: Option<&Path>) -> Result<Self, StoreError> {
        Self::with_epoch(Db::postgres(url, ca)?)
    }

    /// Gives a store its epoch the first time it is opened (replicas
    /// opening it together agree on the first one written).
    fn with_epoch(db: Db) -> Result<Self, StoreError> {
        let mut store = Self {
            db: Arc::new(db),
            warn_retention_ms: DEFAULT_WARN_RETENTION_MS,
            fleet_secret: [0; sluice_shared::fleet::share_tag::SECRET_LEN],
            set_cache: Arc::default(),
        };
        let epoch = new_epoch()?;
        let secret = [new_epoch()?, new_epoch()?];
        let halves = store.db.touch(|sql| {
            sql.execute(
                "INSERT INTO settings (key, value) VALUES ('store_epoch', $1) ON CONFLICT (key) DO NOTHING",
                &[epoch.into()],
            )?;
            let mut halves = [0u64; 2];
            for (i, (half, drawn)) in halves.iter_mut().zip(secret).enumerate() {
                let key = format!("fleet_secret_{i}");
                sql.execute(
                    "INSERT INTO settings (key, value) VALUES ($1, $2) ON CONFLICT (key) DO NOTHING",
                    &[key.as_str().into(), drawn.into()],
                )?;
                *half = sql
                    .query_one("SELECT value FROM settings WHERE key = $1", &[key.as_str().into()])?
                    .ok_or_else(|| StoreError::Corrupt(format!("no {key} setting")))?
                    .uint(0)?;
            }
            Ok(halves)
        })?;
        store.fleet_secret[..8].copy_from_slice(&halves[0].to_le_bytes());
        store.fleet_secret[8..].copy_from_slice(&halves[1].to_le_bytes());
        Ok(store)
    }

    /// What this store's admins tag fleet shares with.
    pub fn fleet_secret(&self) -> [u8; sluice_shared::fleet::share_tag::SECRET_LEN] {
        self.fleet_secret
    }

    /// The store's epoch: which store a policy set version belongs to.
    pub fn epoch(&self) -> Result<u64, StoreError> {
        self.db.read(epoch)
    }

    /// Draws a new epoch if the store still has `seen`: Envoys report a
    /// version of this epoch the store has not reached (it was restored
    /// from a backup, or an Envoy took a forged answer), and only a new
    /// epoch makes them take the store's set again. Returns the epoch in
    /// force afterwards (another replica's, if it renewed first).
    pub fn renew_epoch(&self, seen: u64) -> Result<u64, StoreError> {
        let fresh = new_epoch()?;
        self.db.touch(|sql| {
            sql.execute(
                "UPDATE settings SET value = $1 WHERE key = 'store_epoch' AND value = $2",
                &[fresh.into(), seen.into()],
            )?;
            epoch(sql)
        })
    }

    /// "sqlite" or "postgres".
    pub fn kind(&self) -> &'static str {
        self.db.kind()
    }

    pub fn policy_set_version(&self) -> Result<u64, StoreError> {
        self.db.read(set_version)
    }

    pub fn list(&self) -> Result<(u64, Vec<StoredPolicy>), StoreError> {
        self.db.read(|sql| Ok((set_version(sql)?, list(sql)?)))
    }

    pub fn policy_set(&self) -> Result<PolicySet, StoreError> {
        self.db.read(|sql| {
            Ok(PolicySet {
                version: set_version(sql)?,
                prices: prices(sql)?,
                policies: list(sql)?.into_iter().map(|s| s.policy).collect(),
            })
        })
    }

    /// The policy set and the store's epoch as a watch answers with them:
    /// one read of the version and the epoch, the set parsed again only
    /// when its version moved (see [`Self::record_sync`]). A thousand
    /// watches woken by an edit each parsed every policy anew.
    pub fn current(&self) -> Result<(Arc<PolicySet>, u64), StoreError> {
        let (version, epoch) = self.db.read(version_and_epoch)?;
        let set = match self.cached_set().filter(|set| set.version == version) {
            Some(set) => set,
            None => self.reread_set()?,
        };
        Ok((set, epoch))
    }

    /// The set last read, unless [`SET_REREAD`] has passed since.
    fn cached_set(&self) -> Option<Arc<PolicySet>> {
        self.set_cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .filter(|c| c.read_at.elapsed() < SET_REREAD)
            .map(|c| Arc::clone(&c.set))
    }

    /// The set read from the store, and kept for the next syncs.
    fn reread_set(&self) -> Result<Arc<PolicySet>, StoreError> {
        let set = Arc::new(self.policy_set()?);
        *self
            .set_cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(CachedSet {
            set: Arc::clone(&set),
            read_at: std::time::Instant::now(),
        });
        Ok(set)
    }

    pub fn get(&self, name: &str) -> Result<StoredPolicy, StoreError> {
        self.db
            .read(|sql| get(sql, name))?
            .ok_or_else(|| StoreError::NotFound(name.into()))
    }

    pub fn history(&self, name: &str) -> Result<Vec<HistoryEntry>, StoreError> {
        let rows = self.db.read(|sql| {
            sql.query(
                "SELECT version, set_version, at_ms, actor, body FROM policy_history
                 WHERE name = $1 ORDER BY id DESC LIMIT 200",
                &[name.into()],
            )
        })?;
        rows.iter()
            .map(|r| {
                Ok(HistoryEntry {
                    version: r.uint(0)?,
                    set_version: r.uint(1)?,
                    at_ms: r.uint(2)?,
                    actor: r.text(3)?,
                    policy: r.optional_text(4)?.as_deref().map(from_json).transpose()?,
                })
            })
            .collect()
    }

    /// Adds a policy at the end of the list.
    pub fn create(&self, policy: Policy, actor: &str) -> Result<StoredPolicy, StoreError> {
        self.db.write(|sql| {
            if get(sql, &policy.name)?.is_some() {
                return Err(StoreError::Invalid(ValidationErrors {
                    errors: vec![FieldError {
                        path: "name".into(),
                        message: format!("a policy named {:?} already exists", policy.name),
                    }],
                }));
            }
            let mut all: Vec<Policy> = list(sql)?.into_iter().map(|s| s.policy).collect();
            all.push(policy.clone());
            check_set(sql, &all, all.len() - 1)?;
            let position = sql
                .query_one("SELECT COALESCE(MAX(position), -1) + 1 FROM policies", &[])?
                .map_or(Ok(0), |r| r.int(0))?;
            let at = now_ms();
            let set_version = bump(sql)?;
            insert_new(sql, &policy, position, set_version, at, actor, "create")?;
            Ok(StoredPolicy {
                policy,
                version: 1,
                updated_at_ms: at,
                updated_by: actor.into(),
                source: None,
            })
        })
    }

    /// Fills a store that has never held a policy (set version 0) with
    /// `set`, in one transaction; a store that has, even one emptied since,
    /// is left alone. Returns how many policies were added.
    pub fn seed(&self, set: &PolicySet, actor: &str) -> Result<usize, StoreError> {
        validate_policy_set(set).map_err(StoreError::Invalid)?;
        self.db.write(|sql| {
            if set_version(sql)? > 0 || set.policies.is_empty() {
                return Ok(0);
            }
            let set_version = bump(sql)?;
            let at = now_ms();
            for (position, policy) in set.policies.iter().enumerate() {
                let position = i64::try_from(position).unwrap_or(i64::MAX);
                insert_new(sql, policy, position, set_version, at, actor, "seed")?;
            }
            if let Some(prices) = &set.prices {
                write_prices(sql, None, Some(prices), at, actor)?;
            }
            Ok(set.policies.len())
        })
    }

    /// Replaces a policy if the caller saw its current version.
    pub fn update(
        &self,
        name: &str,
        policy: Policy,
        expected: u64,
        actor: &str,
    ) -> Result<StoredPolicy, StoreError> {
        self.db.write(|sql| {
            let current = current_at(sql, name, expected)?;
            let stored = list(sql)?;
            let index = stored
                .iter()
                .position(|s| s.policy.name == name)
                .unwrap_or(0);
            let mut all: Vec<Policy> = stored.into_iter().map(|s| s.policy).collect();
            if let Some(slot) = all.get_mut(index) {
                *slot = policy.clone();
            }
            check_set(sql, &all, index)?;
            let at = now_ms();
            let set_version = bump(sql)?;
            let version = write_next_version(sql, &current, &policy, set_version, at, actor)?;
            Ok(StoredPolicy {
                policy,
                version,
                updated_at_ms: at,
                updated_by: actor.into(),
                source: None,
            })
        })
    }

    pub fn delete(&self, name: &str, expected: u64, actor: &str) -> Result<(), StoreError> {
        self.db.write(|sql| {
            let current = current_at(sql, name, expected)?;
            let set_version = bump(sql)?;
            remove_policy(sql, &current, set_version, now_ms(), actor)
        })
    }

    /// An audit entry that is not a policy change (logins, ...).
    pub fn audit_event(&self, actor: &str, action: &str, target: &str) -> Result<(), StoreError> {
        self.db.touch(|sql| {
            sql.execute(
                "INSERT INTO audit (at_ms, actor, action, target) VALUES ($1, $2, $3, $4)",
                &[now_ms().into(), actor.into(), action.into(), target.into()],
            )
            .map(drop)
        })
    }

    /// Newest first; `before` pages back by id.
    pub fn audit_log(
        &self,
        limit: u32,
        before: Option<i64>,
    ) -> Result<Vec<AuditEntry>, StoreError> {
        let rows = self.db.read(|sql| {
            sql.query(
                "SELECT id, at_ms, actor, action, target, old, new FROM audit
                 WHERE id < $1 ORDER BY id DESC LIMIT $2",
                &[
                    before.unwrap_or(i64::MAX).into(),
                    i64::from(limit.min(1000)).into(),
                ],
            )
        })?;
        let parse = |s: Option<String>| s.and_then(|s| serde_json::from_str(&s).ok());
        rows.iter()
            .map(|r| {
                Ok(AuditEntry {
                    id: r.int(0)?,
                    at_ms: r.uint(1)?,
                    actor: r.text(2)?,
                    action: r.text(3)?,
                    target: r.text(4)?,
                    old: parse(r.optional_text(5)?),
                    new: parse(r.optional_text(6)?),
                })
            })
            .collect()
    }

    /// Records `report`, what it says of the set's names only, and reads
    /// the set's version and the store's epoch, in one transaction: the
    /// set itself is parsed again only when its version moved or
    /// [`SET_REREAD`] passed (each sync parsing every policy and price
    /// anew was a tenth of its CPU). (Three transactions a sync, the
    /// version, the record and the epoch each its own, were some fourteen
    /// round trips to PostgreSQL.) An instance beyond
    /// [`sluice_wire::sync::MAX_INSTANCES`] is refused.
    pub fn record_sync(&self, mut report: SyncReport) -> Result<RecordedSync, StoreError> {
        // A set read again (none cached, or the version moved) is the one
        // to answer with, even if an edit lands meanwhile: the next sync
        // brings it. Read before the record when none is cached, rather
        // than after a transaction that finds none.
        let (mut set, mut reread) = match self.cached_set() {
            Some(set) => (set, false),
            None => (self.reread_set()?, true),
        };
        loop {
            let recorded = self.db.note(|sql| {
                let (version, epoch) = version_and_epoch(sql)?;
                if !reread && set.version != version {
                    return Ok(None);
                }
                report.keep_known(&set);
                self.write_instance(sql, &report)?;
                Ok(Some(epoch))
            })?;
            match recorded {
                Some(epoch) => return Ok(RecordedSync { report, set, epoch }),
                None => {
                    set = self.reread_set()?;
                    reread = true;
                }
            }
        }
    }

    /// The instance's row: when it synced, and its report.
    fn write_instance(&self, sql: &mut dyn Sql, report: &SyncReport) -> Result<(), StoreError> {
        // The changed keys of keyed budgets (up to 2 048 each) are kept in
        // `budget_keys`, not again in every instance row.
        let body = if report.budget_keys.is_empty() {
            serde_json::to_string(report)
        } else {
            serde_json::to_string(&SyncReport {
                budget_keys: Default::default(),
                ..report.clone()
            })
        }
        .unwrap_or_else(|_| "{}".into());
        // The previous report only for what its limits did since: a
        // report of policies alone reads none back.
        let reads_previous = !report.limits.is_empty();
        let row = sql.query_one(
            if reads_previous {
                "SELECT report FROM instances WHERE id = $1"
            } else {
                "SELECT 1 FROM instances WHERE id = $1"
            },
            &[report.instance.as_str().into()],
        )?;
        let known = row.is_some();
        let previous: Option<SyncReport> = row
            .filter(|_| reads_previous)
            .and_then(|r| r.text(0).ok())
            .and_then(|text| serde_json::from_str(&text).ok());
        audit_rungs(sql, previous.as_ref(), report, self.warn_retention_ms)?;
        if !known {
            let count = sql
                .query_one("SELECT COUNT(*) FROM instances", &[])?
                .map_or(Ok(0), |r| r.uint(0))?;
            if count >= sluice_wire::sync::MAX_INSTANCES as u64 {
                return Err(StoreError::TooManyInstances(
                    sluice_wire::sync::MAX_INSTANCES,
                    report.instance.clone(),
                ));
            }
        }
        sql.execute(
            "INSERT INTO instances (id, first_seen_ms, last_sync_ms, policy_version, syncs, report)
                 VALUES ($1, $2, $2, $3, 1, $4)
                 ON CONFLICT (id) DO UPDATE SET last_sync_ms = $2, policy_version = $3,
                   syncs = instances.syncs + 1, report = $4",
            &[
                report.instance.as_str().into(),
                now_ms().into(),
                report.policy_version.into(),
                body.into(),
            ],
        )
        .map(drop)
    }

    /// Keeps what `report` says of its known budgets, and returns the
    /// budgets held for its instance that it does not know: those it
    /// reports unknown (it just started) and those of `set` it does not
    /// report yet (the set it is about to get).
    pub fn record_budgets(
        &self,
        report: &SyncReport,
        set: &PolicySet,
    ) -> Result<BudgetsMessage, StoreError> {
        let wanted: BTreeSet<&str> = report
            .budgets
            .iter()
            .filter(|(_, b)| !b.known)
            .map(|(name, _)| name.as_str())
            .chain(
                set.limits()
                    .filter(|l| {
                        (l.is_budget() || l.is_keyed_budget())
                            && !report.budgets.contains_key(&l.name)
                    })
                    .map(|l| l.name.as_str()),
            )
            .collect();
        // Keyed budgets: their periods and how many keys they hold.
        let keyed: BTreeMap<&str, (u64, u32)> = set
            .limits()
            .filter(|l| l.is_keyed_budget())
            .filter_map(|l| {
                let period = l.rate.as_ref()?.period.as_millis();
                Some((l.name.as_str(), (period, l.key.as_ref()?.max_keys)))
            })
            .collect();
        // A keyed budget's record is its keys' (`budget_keys`).
        let known: Vec<(&String, HeldBudget)> = report
            .budgets
            .iter()
            .filter(|(name, b)| b.known && !keyed.contains_key(name.as_str()))
            .map(|(name, b)| (name, b.held()))
            .collect();
        if wanted.is_empty() && known.is_empty() && report.budget_keys.is_empty() {
            return Ok(BudgetsMessage::new());
        }
        let instance = report.instance.as_str();
        self.db.touch(|sql| {
            record_budget_keys(sql, report, &keyed)?;
            for (name, held) in &known {
                sql.execute(
                    "INSERT INTO budgets (instance, name, available, size, at_ms, updated_ms)
                     VALUES ($1, $2, $3, $4, $5, $6)
                     ON CONFLICT (instance, name) DO UPDATE SET available = $3, size = $4,
                       at_ms = $5, updated_ms = $6",
                    &[
                        instance.into(),
                        name.as_str().into(),
                        held.available.into(),
                        held.size.into(),
                        held.at_ms.into(),
                        now_ms().into(),
                    ],
                )?;
            }
            if wanted.is_empty() {
                return Ok(BudgetsMessage::new());
            }
            let rows = sql.query(
                "SELECT name, available, size, at_ms FROM budgets WHERE instance = $1
                 ORDER BY name LIMIT $2",
                &[instance.into(), (MAX_BUDGETS_ANSWERED as u64).into()],
            )?;
            let mut out = BudgetsMessage::new();
            for row in rows {
                let name = row.text(0)?;
                if wanted.contains(name.as_str()) && !keyed.contains_key(name.as_str()) {
                    let held = HeldBudget {
                        available: row.uint(1)?,
                        size: row.uint(2)?,
                        at_ms: row.uint(3)?,
                        ..HeldBudget::default()
                    };
                    out.insert(name, held);
                }
            }
            let wanted_keyed = keyed
                .iter()
                .filter(|(name, _)| wanted.contains(**name))
                .map(|(name, (period, _))| (*name, *period));
            give_back_budget_keys(sql, report, wanted_keyed, &mut out)?;
            Ok(out)
        })
    }

    /// Instances by id, `limit` of them after `after` (a page).
    pub fn instances(&self, after: &str, limit: u32) -> Result<Vec<InstanceRow>, StoreError> {
        let rows = self.db.read(|sql| {
            sql.query(
                "SELECT id, first_seen_ms, last_sync_ms, policy_version, syncs, report FROM instances
                 WHERE id > $1 ORDER BY id LIMIT $2",
                &[after.into(), i64::from(limit).into()],
            )
        })?;
        rows.iter()
            .map(|r| {
                Ok(InstanceRow {
                    id: r.text(0)?,
                    first_seen_ms: r.uint(1)?,
                    last_sync_ms: r.uint(2)?,
                    policy_version: r.uint(3)?,
                    syncs: r.uint(4)?,
                    report: serde_json::from_str(&r.text(5)?).unwrap_or_default(),
                })
            })
            .collect()
    }

    /// Forgets the instances last heard from before `before_ms`; returns how
    /// many.
    pub fn prune_instances(&self, before_ms: u64) -> Result<u64, StoreError> {
        self.db.touch(|sql| {
            // A budget outlives its instance's silence: an Envoy down for a
            // day still gets back what it spent of its month.
            let forgotten = now_ms().saturating_sub(BUDGET_RETENTION_MS);
            sql.execute(
                "DELETE FROM budgets WHERE updated_ms < $1",
                &[forgotten.into()],
            )?;
            sql.execute(
                "DELETE FROM budget_keys WHERE updated_ms < $1",
                &[forgotten.into()],
            )?;
            sql.execute(
                "DELETE FROM instances WHERE last_sync_ms < $1",
                &[before_ms.into()],
            )
        })
    }

    /// SQLite's journal mode ("wal"); None on PostgreSQL.
    pub fn journal_mode(&self) -> Result<Option<String>, StoreError> {
        self.db.sqlite_pragma("journal_mode")
    }

    /// SQLite's own consistency check ("ok" for a sound file); None on
    /// PostgreSQL.
    pub fn integrity_check(&self) -> Result<Option<String>, StoreError> {
        self.db.sqlite_pragma("integrity_check")
    }
}
