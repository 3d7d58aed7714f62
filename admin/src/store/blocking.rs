//! The store's blocking core: every query and transaction, run on the
//! caller's thread. The admin's handlers reach it through the async
//! [`Store`](super::Store); tools and tests may use it directly.

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
use super::{now_ms, InstanceRow, StoreError};

#[derive(Clone)]
pub struct BlockingStore {
    pub(super) db: Arc<Db>,
    /// How long warning-line rows of the audit log are kept, in ms.
    pub(super) warn_retention_ms: u64,
    /// What fleet shares are tagged with (`sluice_shared::fleet::share_tag`):
    /// drawn once per store, the same for every replica on it.
    fleet_secret: [u8; sluice_shared::fleet::share_tag::SECRET_LEN],
}

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

    /// The set's price table, if it has one.
    pub fn prices(&self) -> Result<Option<PriceTable>, StoreError> {
        self.db.read(prices)
    }

    /// Makes `table` the set's prices (None: none), checked with every
    /// policy (a money limit needs prices); the set's new version, or its
    /// version as it was when nothing changes.
    pub fn set_prices(&self, table: Option<PriceTable>, actor: &str) -> Result<u64, StoreError> {
        self.db.write(|sql| {
            let old = prices(sql)?;
            if old == table {
                return set_version(sql);
            }
            let all: Vec<Policy> = list(sql)?.into_iter().map(|s| s.policy).collect();
            validate_policy_set(&PolicySet {
                version: 1,
                prices: table.clone(),
                policies: all,
            })
            .map_err(StoreError::Invalid)?;
            let at = now_ms();
            let version = bump(sql)?;
            write_prices(sql, (old.as_ref(), table.as_ref()), at, actor)?;
            Ok(version)
        })
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
                write_prices(sql, (None, Some(prices)), at, actor)?;
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
            let current = get(sql, name)?.ok_or_else(|| StoreError::NotFound(name.into()))?;
            if current.version != expected {
                return Err(StoreError::Stale {
                    name: name.into(),
                    current: current.version,
                    expected,
                });
            }
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
            let version = write_next_version(sql, &current, &policy, (set_version, at, actor))?;
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
            let current = get(sql, name)?.ok_or_else(|| StoreError::NotFound(name.into()))?;
            if current.version != expected {
                return Err(StoreError::Stale {
                    name: name.into(),
                    current: current.version,
                    expected,
                });
            }
            let set_version = bump(sql)?;
            remove_policy(sql, &current, (set_version, now_ms(), actor))
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

    pub fn record_sync(&self, report: &SyncReport) -> Result<(), StoreError> {
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
        self.db.touch(|sql| {
            let previous = sql.query_one(
                "SELECT report FROM instances WHERE id = $1",
                &[report.instance.as_str().into()],
            )?;
            let known = previous.is_some();
            let previous: Option<SyncReport> = previous
                .and_then(|r| r.text(0).ok())
                .and_then(|text| serde_json::from_str(&text).ok());
            audit_warnings(sql, previous.as_ref(), report, self.warn_retention_ms)?;
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
        })
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

/// Inserts a policy new to the store (version 1) at `position`, with its
/// history entry and an audit entry for `action`.
pub(super) fn insert_new(
    sql: &mut dyn Sql,
    policy: &Policy,
    position: i64,
    set_version: u64,
    at: u64,
    actor: &str,
    action: &str,
) -> Result<(), StoreError> {
    sql.execute(
        "INSERT INTO policies (name, body, version, position, updated_at_ms, updated_by) VALUES ($1, $2, 1, $3, $4, $5)",
        &[
            policy.name.as_str().into(),
            to_json(policy).into(),
            position.into(),
            at.into(),
            actor.into(),
        ],
    )?;
    history(sql, &policy.name, 1, set_version, Some(policy), at, actor)?;
    audit(sql, at, actor, action, &policy.name, None, Some(policy))?;
    Ok(())
}

/// A random epoch: 62 bits, so it fits the settings table's integer on
/// every backend and is never 0 (which means "none" on the wire).
fn new_epoch() -> Result<u64, StoreError> {
    let bytes = crate::auth::random_bytes::<8>().map_err(|e| StoreError::Corrupt(e.to_string()))?;
    Ok((u64::from_le_bytes(bytes) >> 2).max(1))
}

fn epoch(sql: &mut dyn Sql) -> Result<u64, StoreError> {
    sql.query_one("SELECT value FROM settings WHERE key = 'store_epoch'", &[])?
        .ok_or_else(|| StoreError::Corrupt("no store_epoch setting".into()))?
        .uint(0)
}

pub(super) fn set_version(sql: &mut dyn Sql) -> Result<u64, StoreError> {
    sql.query_one(
        "SELECT value FROM settings WHERE key = 'policy_set_version'",
        &[],
    )?
    .ok_or_else(|| StoreError::Corrupt("no policy_set_version setting".into()))?
    .uint(0)
}

pub(super) fn bump(sql: &mut dyn Sql) -> Result<u64, StoreError> {
    sql.execute(
        "UPDATE settings SET value = value + 1 WHERE key = 'policy_set_version'",
        &[],
    )?;
    set_version(sql)
}

fn stored_policy(r: &Row) -> Result<StoredPolicy, StoreError> {
    Ok(StoredPolicy {
        policy: from_json(&r.text(0)?)?,
        version: r.uint(1)?,
        updated_at_ms: r.uint(2)?,
        updated_by: r.text(3)?,
        source: r.optional_text(4)?,
    })
}

pub(super) fn list(sql: &mut dyn Sql) -> Result<Vec<StoredPolicy>, StoreError> {
    sql.query(
        "SELECT body, version, updated_at_ms, updated_by, source FROM policies ORDER BY position",
        &[],
    )?
    .iter()
    .map(stored_policy)
    .collect()
}

fn get(sql: &mut dyn Sql, name: &str) -> Result<Option<StoredPolicy>, StoreError> {
    sql.query_one(
        "SELECT body, version, updated_at_ms, updated_by, source FROM policies WHERE name = $1",
        &[name.into()],
    )?
    .as_ref()
    .map(stored_policy)
    .transpose()
}

/// Replaces the stored price table `old` with `new` (validated with the
/// set), with its audit entry.
pub(super) fn write_prices(
    sql: &mut dyn Sql,
    (old, new): (Option<&PriceTable>, Option<&PriceTable>),
    at: u64,
    actor: &str,
) -> Result<(), StoreError> {
    sql.execute("DELETE FROM prices", &[])?;
    if let Some(table) = new {
        sql.execute(
            "INSERT INTO prices (id, body, updated_at_ms, updated_by) VALUES (1, $1, $2, $3)",
            &[to_json(table).into(), at.into(), actor.into()],
        )?;
    }
    audit_entry(
        sql,
        (at, actor, "prices", "prices"),
        old.map(to_json),
        new.map(to_json),
    )
}

/// A limit's warning-line crossings over one minute, as its audit row
/// holds them.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
struct WarnRow {
    crossed: u64,
    /// The Envoys that reported them, at most [`WARN_ROW_ENVOYS`]...
    envoys: Vec<String>,
    /// ...and how many reports came from others.
    #[serde(default, skip_serializing_if = "is_zero")]
    more_reports: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The audit log's record of the warning lines `report` says were crossed
/// since `previous` (the instance's report before; counts start again
/// when its Envoy restarts): one row per limit per minute, summing what
/// every Envoy reported in it, so that no sync (nor a sync token's holder
/// making its counter go up and down) grows the log faster than that.
/// Rows older than `retention_ms` are deleted as new ones are written.
fn audit_warnings(
    sql: &mut dyn Sql,
    previous: Option<&SyncReport>,
    report: &SyncReport,
    retention_ms: u64,
) -> Result<(), StoreError> {
    use sluice_wire::stats::LimitCounter;
    let now = now_ms();
    for (name, limit) in &report.limits {
        let count = limit.counts.get(LimitCounter::WarnCrossed);
        let before = previous
            .and_then(|p| p.limits.get(name))
            .map_or(0, |l| l.counts.get(LimitCounter::WarnCrossed));
        let crossed = if count >= before {
            count - before
        } else {
            count
        };
        if crossed == 0 {
            continue;
        }
        let recent = sql.query_one(
            "SELECT id, new FROM audit WHERE action = 'warn' AND target = $1 AND at_ms >= $2 \
             ORDER BY id DESC LIMIT 1",
            &[
                name.as_str().into(),
                now.saturating_sub(WARN_ROW_SPAN_MS).into(),
            ],
        )?;
        let found = match recent {
            Some(row) => Some((row.int(0)?, row.optional_text(1)?)),
            None => None,
        };
        let mut row: WarnRow = found
            .as_ref()
            .and_then(|(_, new)| new.as_deref())
            .and_then(|text| serde_json::from_str(text).ok())
            .unwrap_or_default();
        row.crossed = row.crossed.saturating_add(crossed);
        if !row.envoys.contains(&report.instance) {
            if row.envoys.len() < WARN_ROW_ENVOYS {
                row.envoys.push(report.instance.clone());
            } else {
                row.more_reports = row.more_reports.saturating_add(1);
            }
        }
        let text = serde_json::to_string(&row).unwrap_or_default();
        match found {
            Some((id, _)) => {
                sql.execute(
                    "UPDATE audit SET new = $1 WHERE id = $2",
                    &[text.into(), id.into()],
                )?;
            }
            None => {
                sql.execute(
                    "DELETE FROM audit WHERE action = 'warn' AND at_ms < $1",
                    &[now.saturating_sub(retention_ms).into()],
                )?;
                audit_entry(sql, (now, "sluice", "warn", name), None, Some(text))?;
            }
        }
    }
    Ok(())
}

/// Keeps what `report` says of its keyed budgets' keys: a key that spent
/// nothing (or gave its place up) is forgotten.
fn record_budget_keys(
    sql: &mut dyn Sql,
    report: &SyncReport,
    keyed: &BTreeMap<&str, (u64, u32)>,
) -> Result<(), StoreError> {
    let instance = report.instance.as_str();
    for (name, keys) in &report.budget_keys {
        let Some((_, max_keys)) = keyed.get(name.as_str()) else {
            continue;
        };
        for key in keys {
            // The hash as SQL's signed integer, bit for bit.
            let owner = key.owner as i64;
            if key.spent == 0 {
                sql.execute(
                    "DELETE FROM budget_keys WHERE instance = $1 AND name = $2 AND owner = $3",
                    &[instance.into(), name.as_str().into(), owner.into()],
                )?;
                continue;
            }
            sql.execute(
                "INSERT INTO budget_keys (instance, name, owner, spent, at_ms, updated_ms)
                 VALUES ($1, $2, $3, $4, $5, $6)
                 ON CONFLICT (instance, name, owner) DO UPDATE SET spent = $4, at_ms = $5,
                   updated_ms = $6",
                &[
                    instance.into(),
                    name.as_str().into(),
                    owner.into(),
                    key.spent.into(),
                    report.at_ms.into(),
                    now_ms().into(),
                ],
            )?;
        }
        // An Envoy holds at most `max_keys` keys of it: whatever reports
        // say, the store keeps the most recently heard of that many (and
        // any heard of at the same time as the last of them).
        sql.execute(
            "DELETE FROM budget_keys WHERE instance = $1 AND name = $2 AND updated_ms < (
               SELECT updated_ms FROM budget_keys WHERE instance = $1 AND name = $2
               ORDER BY updated_ms DESC LIMIT 1 OFFSET $3)",
            &[
                instance.into(),
                name.as_str().into(),
                u64::from(max_keys.saturating_sub(1)).into(),
            ],
        )?;
    }
    Ok(())
}

/// The next part of each keyed budget in `wanted` (name, period) the
/// admin holds for `report`'s instance: the keys after the last it took,
/// at most [`MAX_KEYS_ANSWERED`] in all, `more` when some are left. Keys
/// last heard of more than a period ago hold nothing of the period now
/// (on the Envoy's own clock): they are not sent.
fn give_back_budget_keys<'a>(
    sql: &mut dyn Sql,
    report: &SyncReport,
    wanted: impl Iterator<Item = (&'a str, u64)>,
    out: &mut BudgetsMessage,
) -> Result<(), StoreError> {
    let mut left = MAX_KEYS_ANSWERED;
    for (name, period_ms) in wanted {
        if left == 0 {
            break;
        }
        let from = match report.budgets.get(name).and_then(|b| b.resume_after) {
            Some(after) => match after.checked_add(1) {
                Some(next) => next,
                None => continue,
            },
            None => i64::MIN,
        };
        let rows = sql.query(
            "SELECT owner, spent, at_ms FROM budget_keys
             WHERE instance = $1 AND name = $2 AND owner >= $3 AND at_ms >= $4
             ORDER BY owner LIMIT $5",
            &[
                report.instance.as_str().into(),
                name.into(),
                from.into(),
                report.at_ms.saturating_sub(period_ms).into(),
                (left as u64 + 1).into(),
            ],
        )?;
        let more = rows.len() > left;
        let keys = rows
            .iter()
            .take(left)
            .map(|row| {
                Ok(HeldKey {
                    owner: row.int(0)? as u64,
                    spent: row.uint(1)?,
                    at_ms: row.uint(2)?,
                })
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        if keys.is_empty() {
            continue;
        }
        left -= keys.len();
        out.insert(
            name.to_string(),
            HeldBudget {
                keys,
                more,
                ..HeldBudget::default()
            },
        );
    }
    Ok(())
}

/// The set's price table, as stored (validated when it was written).
pub(super) fn prices(sql: &mut dyn Sql) -> Result<Option<PriceTable>, StoreError> {
    sql.query_one("SELECT body FROM prices WHERE id = 1", &[])?
        .map(|r| r.text(0).and_then(|body| from_json(&body)))
        .transpose()
}

fn check_set(sql: &mut dyn Sql, all: &[Policy], edited: usize) -> Result<(), StoreError> {
    let set = PolicySet {
        version: 1,
        prices: prices(sql)?,
        policies: all.to_vec(),
    };
    validate_policy_set(&set).map_err(|e| StoreError::Invalid(relative_errors(e, edited)))
}

fn history(
    sql: &mut dyn Sql,
    name: &str,
    version: u64,
    set_version: u64,
    policy: Option<&Policy>,
    at: u64,
    actor: &str,
) -> Result<(), StoreError> {
    sql.execute(
        "INSERT INTO policy_history (name, version, set_version, body, at_ms, actor) VALUES ($1, $2, $3, $4, $5, $6)",
        &[
            name.into(),
            version.into(),
            set_version.into(),
            policy.map(to_json).into(),
            at.into(),
            actor.into(),
        ],
    )?;
    Ok(())
}

/// A policy change in the audit log: the policy before and after.
fn audit(
    sql: &mut dyn Sql,
    at: u64,
    actor: &str,
    action: &str,
    target: &str,
    old: Option<&Policy>,
    new: Option<&Policy>,
) -> Result<(), StoreError> {
    audit_entry(
        sql,
        (at, actor, action, target),
        old.map(to_json),
        new.map(to_json),
    )
}

/// One audit entry: (when, who, what, of what), with what was before and
/// after as JSON text.
pub(super) fn audit_entry(
    sql: &mut dyn Sql,
    (at, actor, action, target): (u64, &str, &str, &str),
    old: Option<String>,
    new: Option<String>,
) -> Result<(), StoreError> {
    sql.execute(
        "INSERT INTO audit (at_ms, actor, action, target, old, new) VALUES ($1, $2, $3, $4, $5, $6)",
        &[
            at.into(),
            actor.into(),
            action.into(),
            target.into(),
            old.into(),
            new.into(),
        ],
    )?;
    Ok(())
}

/// Writes `policy` as the next version of `current` (by hand: no source
/// file), with its history and audit entries. Returns the new version.
pub(super) fn write_next_version(
    sql: &mut dyn Sql,
    current: &StoredPolicy,
    policy: &Policy,
    (set_version, at, actor): (u64, u64, &str),
) -> Result<u64, StoreError> {
    let name = current.policy.name.as_str();
    let version = current.version + 1;
    sql.execute(
        "UPDATE policies SET name = $1, body = $2, version = $3, updated_at_ms = $4, updated_by = $5, source = NULL WHERE name = $6",
        &[
            policy.name.as_str().into(),
            to_json(policy).into(),
            version.into(),
            at.into(),
            actor.into(),
            name.into(),
        ],
    )?;
    history(
        sql,
        &policy.name,
        version,
        set_version,
        Some(policy),
        at,
        actor,
    )?;
    audit(
        sql,
        at,
        actor,
        "update",
        name,
        Some(&current.policy),
        Some(policy),
    )?;
    Ok(version)
}

/// Deletes `current`, with its history and audit entries.
pub(super) fn remove_policy(
    sql: &mut dyn Sql,
    current: &StoredPolicy,
    (set_version, at, actor): (u64, u64, &str),
) -> Result<(), StoreError> {
    let name = current.policy.name.as_str();
    sql.execute("DELETE FROM policies WHERE name = $1", &[name.into()])?;
    history(sql, name, current.version + 1, set_version, None, at, actor)?;
    audit(sql, at, actor, "delete", name, Some(&current.policy), None)
}

/// A new evaluation order in the audit log: the names before and after.
pub(super) fn audit_order<B: AsRef<str>, A: AsRef<str>>(
    sql: &mut dyn Sql,
    at: u64,
    actor: &str,
    (before, after): (&[B], &[A]),
) -> Result<(), StoreError> {
    let json = |names: Vec<&str>| serde_json::Value::from(names).to_string();
    audit_entry(
        sql,
        (at, actor, "reorder", "policies"),
        Some(json(before.iter().map(AsRef::as_ref).collect())),
        Some(json(after.iter().map(AsRef::as_ref).collect())),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Warning rows past the retention go as a new one is written; other
    /// audit rows stay.
    #[test]
    fn warning_rows_past_their_retention_are_deleted() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let mut store =
            BlockingStore::open(&dir.path().join("s.db")).unwrap_or_else(|e| panic!("{e}"));
        store.warn_retention_ms = 86_400_000;
        let old = now_ms() - 2 * 86_400_000;
        store
            .db
            .touch(|sql| {
                audit_entry(
                    sql,
                    (old, "sluice", "warn", "team"),
                    None,
                    Some("{}".into()),
                )?;
                audit_entry(sql, (old, "alice", "update", "team"), None, None)
            })
            .unwrap_or_else(|e| panic!("{e}"));
        let report: SyncReport = serde_json::from_value(serde_json::json!({
            "instance": "envoy-a", "policy_version": 0, "at_ms": 1,
            "limits": {"team": {"warn_crossed": 2, "requests": 10, "period_ms": 1000}}}))
        .unwrap_or_else(|e| panic!("{e}"));
        store.record_sync(&report).unwrap_or_else(|e| panic!("{e}"));
        let rows = store
            .db
            .read(|sql| sql.query("SELECT action, at_ms FROM audit ORDER BY id", &[]))
            .unwrap_or_else(|e| panic!("{e}"));
        let kept: Vec<(String, bool)> = rows
            .iter()
            .map(|r| (r.text(0).unwrap_or_default(), r.uint(1).unwrap_or(0) == old))
            .collect();
        assert_eq!(
            kept,
            [("update".to_string(), true), ("warn".to_string(), false)],
            "the old warning row went, the person's change stayed"
        );
    }
}
