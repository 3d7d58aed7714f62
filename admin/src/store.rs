//! The SQLite store: policies in evaluation order with per-policy versions,
//! their history, the audit log and the Envoys seen by sync. Every write is
//! one transaction; the whole resulting policy set is validated before it
//! commits, so the store never holds a set a filter would refuse.

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use rusqlite::{params, Connection, OptionalExtension, Transaction};
use rusqlite_migration::{Migrations, M};
use serde::Serialize;
use sluice_shared::sync::SyncReport;
use sluice_shared::validate::validate_policy_set;
use sluice_shared::{FieldError, Policy, PolicySet, ValidationErrors};

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
    #[error("migrations: {0}")]
    Migration(#[from] rusqlite_migration::Error),
    #[error("stored data is corrupt: {0}")]
    Corrupt(String),
    #[error("store lock poisoned")]
    Poisoned,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct StoredPolicy {
    pub policy: Policy,
    pub version: u64,
    pub updated_at_ms: u64,
    pub updated_by: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct AuditEntry {
    pub id: i64,
    pub at_ms: u64,
    pub actor: String,
    pub action: String,
    pub target: String,
    pub old: Option<serde_json::Value>,
    pub new: Option<serde_json::Value>,
}

#[derive(Debug, Clone, Serialize)]
pub struct HistoryEntry {
    pub version: u64,
    pub set_version: u64,
    pub at_ms: u64,
    pub actor: String,
    pub policy: Option<Policy>,
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

const MIGRATIONS: &[M<'static>] = &[M::up(include_str!("../migrations/0001_init.sql"))];

#[derive(Clone)]
pub struct Store {
    conn: Arc<Mutex<Connection>>,
}

pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn to_json(policy: &Policy) -> String {
    serde_json::to_string(policy).unwrap_or_else(|_| "null".into())
}

fn from_json(body: &str) -> Result<Policy, StoreError> {
    serde_json::from_str(body).map_err(|e| StoreError::Corrupt(format!("policy body: {e}")))
}

/// Field paths of set-level errors (`policies[3].name`) name the policy the
/// operator is editing in the single-policy API.
fn relative_errors(errors: ValidationErrors, index: usize) -> ValidationErrors {
    let prefix = format!("policies[{index}].");
    ValidationErrors {
        errors: errors
            .errors
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

impl Store {
    /// Opens (creating if needed) the database file, in WAL mode, and runs
    /// the migrations.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let mut conn = Connection::open(path)?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        Migrations::from_slice(MIGRATIONS).to_latest(&mut conn)?;
        Ok(Self {
            conn: Arc::new(Mutex::new(conn)),
        })
    }

    fn lock(&self) -> Result<MutexGuard<'_, Connection>, StoreError> {
        self.conn.lock().map_err(|_| StoreError::Poisoned)
    }

    pub fn policy_set_version(&self) -> Result<u64, StoreError> {
        let conn = self.lock()?;
        set_version(&conn)
    }

    pub fn list(&self) -> Result<(u64, Vec<StoredPolicy>), StoreError> {
        let conn = self.lock()?;
        Ok((set_version(&conn)?, list(&conn)?))
    }

    pub fn policy_set(&self) -> Result<PolicySet, StoreError> {
        let (version, stored) = self.list()?;
        Ok(PolicySet {
            version,
            policies: stored.into_iter().map(|s| s.policy).collect(),
        })
    }

    pub fn get(&self, name: &str) -> Result<StoredPolicy, StoreError> {
        let conn = self.lock()?;
        get(&conn, name)?.ok_or_else(|| StoreError::NotFound(name.into()))
    }

    pub fn history(&self, name: &str) -> Result<Vec<HistoryEntry>, StoreError> {
        let conn = self.lock()?;
        let mut stmt = conn.prepare(
            "SELECT version, set_version, at_ms, actor, body FROM policy_history
             WHERE name = ?1 ORDER BY id DESC LIMIT 200",
        )?;
        let rows = stmt.query_map([name], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, i64>(1)?,
                r.get::<_, i64>(2)?,
                r.get(3)?,
                r.get::<_, Option<String>>(4)?,
            ))
        })?;
        let mut out = Vec::new();
        for row in rows {
            let (version, set_version, at_ms, actor, body) = row?;
            out.push(HistoryEntry {
                version: version as u64,
                set_version: set_version as u64,
                at_ms: at_ms as u64,
                actor,
                policy: body.as_deref().map(from_json).transpose()?,
            });
        }
        Ok(out)
    }

    /// Adds a policy at the end of the list (or at `position`).
    pub fn create(&self, policy: Policy, actor: &str) -> Result<StoredPolicy, StoreError> {
        let mut conn = self.lock()?;
        let tx = conn.transaction()?;
        if get(&tx, &policy.name)?.is_some() {
            return Err(StoreError::Invalid(ValidationErrors {
                errors: vec![FieldError {
                    path: "name".into(),
                    message: format!("a policy named {:?} already exists", policy.name),
                }],
            }));
        }
        let mut all: Vec<Policy> = list(&tx)?.into_iter().map(|s| s.policy).collect();
        all.push(policy.clone());
        check_set(&all, all.len() - 1)?;
        let position: i64 = tx.query_row(
            "SELECT COALESCE(MAX(position), -1) + 1 FROM policies",
            [],
            |r| r.get(0),
        )?;
        let at = now_ms();
        let set_version = bump(&tx)?;
        insert_new(&tx, &policy, position, set_version, at, actor, "create")?;
        tx.commit()?;
        Ok(StoredPolicy {
            policy,
            version: 1,
            updated_at_ms: at,
            updated_by: actor.into(),
        })
    }

    /// Fills a store that has never held a policy (set version 0) with
    /// `set`, in one transaction; a store that has, even one emptied since,
    /// is left alone. Returns how many policies were added.
    pub fn seed(&self, set: &PolicySet, actor: &str) -> Result<usize, StoreError> {
        validate_policy_set(set).map_err(StoreError::Invalid)?;
        let mut conn = self.lock()?;
        let tx = conn.transaction()?;
        if set_version(&tx)? > 0 || set.policies.is_empty() {
            return Ok(0);
        }
        let set_version = bump(&tx)?;
        let at = now_ms();
        for (position, policy) in set.policies.iter().enumerate() {
            insert_new(&tx, policy, position as i64, set_version, at, actor, "seed")?;
        }
        tx.commit()?;
        Ok(set.policies.len())
    }

    /// Replaces a policy if the caller saw its current version.
    pub fn update(
        &self,
        name: &str,
        policy: Policy,
        expected: u64,
        actor: &str,
    ) -> Result<StoredPolicy, StoreError> {
        let mut conn = self.lock()?;
        let tx = conn.transaction()?;
        let current = get(&tx, name)?.ok_or_else(|| StoreError::NotFound(name.into()))?;
        if current.version != expected {
            return Err(StoreError::Stale {
                name: name.into(),
                current: current.version,
                expected,
            });
        }
        let stored = list(&tx)?;
        let index = stored
            .iter()
            .position(|s| s.policy.name == name)
            .unwrap_or(0);
        let mut all: Vec<Policy> = stored.into_iter().map(|s| s.policy).collect();
        if let Some(slot) = all.get_mut(index) {
            *slot = policy.clone();
        }
        check_set(&all, index)?;
        let at = now_ms();
        let version = current.version + 1;
        tx.execute(
            "UPDATE policies SET name = ?1, body = ?2, version = ?3, updated_at_ms = ?4, updated_by = ?5 WHERE name = ?6",
            params![policy.name, to_json(&policy), version as i64, at as i64, actor, name],
        )?;
        let set_version = bump(&tx)?;
        history(
            &tx,
            &policy.name,
            version,
            set_version,
            Some(&policy),
            at,
            actor,
        )?;
        audit(
            &tx,
            at,
            actor,
            "update",
            name,
            Some(&current.policy),
            Some(&policy),
        )?;
        tx.commit()?;
        Ok(StoredPolicy {
            policy,
            version,
            updated_at_ms: at,
            updated_by: actor.into(),
        })
    }

    pub fn delete(&self, name: &str, expected: u64, actor: &str) -> Result<(), StoreError> {
        let mut conn = self.lock()?;
        let tx = conn.transaction()?;
        let current = get(&tx, name)?.ok_or_else(|| StoreError::NotFound(name.into()))?;
        if current.version != expected {
            return Err(StoreError::Stale {
                name: name.into(),
                current: current.version,
                expected,
            });
        }
        tx.execute("DELETE FROM policies WHERE name = ?1", [name])?;
        let at = now_ms();
        let set_version = bump(&tx)?;
        history(&tx, name, current.version + 1, set_version, None, at, actor)?;
        audit(&tx, at, actor, "delete", name, Some(&current.policy), None)?;
        tx.commit()?;
        Ok(())
    }

    /// An audit entry that is not a policy change (logins, ...).
    pub fn audit_event(&self, actor: &str, action: &str, target: &str) -> Result<(), StoreError> {
        let conn = self.lock()?;
        conn.execute(
            "INSERT INTO audit (at_ms, actor, action, target) VALUES (?1, ?2, ?3, ?4)",
            params![now_ms() as i64, actor, action, target],
        )?;
        Ok(())
    }

    /// Newest first; `before` pages back by id.
    pub fn audit_log(
        &self,
        limit: u32,
        before: Option<i64>,
    ) -> Result<Vec<AuditEntry>, StoreError> {
        let conn = self.lock()?;
        let mut stmt = conn.prepare(
            "SELECT id, at_ms, actor, action, target, old, new FROM audit
             WHERE id < ?1 ORDER BY id DESC LIMIT ?2",
        )?;
        let rows = stmt.query_map(params![before.unwrap_or(i64::MAX), limit.min(1000)], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, i64>(1)?,
                r.get(2)?,
                r.get(3)?,
                r.get(4)?,
                r.get::<_, Option<String>>(5)?,
                r.get::<_, Option<String>>(6)?,
            ))
        })?;
        let parse = |s: Option<String>| s.and_then(|s| serde_json::from_str(&s).ok());
        let mut out = Vec::new();
        for row in rows {
            let (id, at_ms, actor, action, target, old, new) = row?;
            out.push(AuditEntry {
                id,
                at_ms: at_ms as u64,
                actor,
                action,
                target,
                old: parse(old),
                new: parse(new),
            });
        }
        Ok(out)
    }

    pub fn record_sync(&self, report: &SyncReport) -> Result<(), StoreError> {
        let conn = self.lock()?;
        let at = now_ms() as i64;
        let body = serde_json::to_string(report).unwrap_or_else(|_| "{}".into());
        conn.execute(
            "INSERT INTO instances (id, first_seen_ms, last_sync_ms, policy_version, syncs, report)
             VALUES (?1, ?2, ?2, ?3, 1, ?4)
             ON CONFLICT (id) DO UPDATE SET last_sync_ms = ?2, policy_version = ?3, syncs = syncs + 1, report = ?4",
            params![report.instance, at, report.policy_version as i64, body],
        )?;
        Ok(())
    }

    pub fn instances(&self) -> Result<Vec<InstanceRow>, StoreError> {
        let conn = self.lock()?;
        let mut stmt = conn.prepare(
            "SELECT id, first_seen_ms, last_sync_ms, policy_version, syncs, report FROM instances ORDER BY id",
        )?;
        let rows = stmt.query_map([], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, i64>(1)?,
                r.get::<_, i64>(2)?,
                r.get::<_, i64>(3)?,
                r.get::<_, i64>(4)?,
                r.get::<_, String>(5)?,
            ))
        })?;
        let mut out = Vec::new();
        for row in rows {
            let (id, first, last, version, syncs, report) = row?;
            out.push(InstanceRow {
                id,
                first_seen_ms: first as u64,
                last_sync_ms: last as u64,
                policy_version: version as u64,
                syncs: syncs as u64,
                report: serde_json::from_str(&report).unwrap_or_default(),
            });
        }
        Ok(out)
    }

    pub fn journal_mode(&self) -> Result<String, StoreError> {
        let conn = self.lock()?;
        Ok(conn.query_row("PRAGMA journal_mode", [], |r| r.get(0))?)
    }

    /// SQLite's own consistency check: "ok" for a sound file.
    pub fn integrity_check(&self) -> Result<String, StoreError> {
        let conn = self.lock()?;
        Ok(conn.query_row("PRAGMA integrity_check", [], |r| r.get(0))?)
    }
}

/// Inserts a policy new to the store (version 1) at `position`, with its
/// history entry and an audit entry for `action`.
fn insert_new(
    tx: &Transaction<'_>,
    policy: &Policy,
    position: i64,
    set_version: u64,
    at: u64,
    actor: &str,
    action: &str,
) -> Result<(), StoreError> {
    tx.execute(
        "INSERT INTO policies (name, body, version, position, updated_at_ms, updated_by) VALUES (?1, ?2, 1, ?3, ?4, ?5)",
        params![policy.name, to_json(policy), position, at as i64, actor],
    )?;
    history(tx, &policy.name, 1, set_version, Some(policy), at, actor)?;
    audit(tx, at, actor, action, &policy.name, None, Some(policy))?;
    Ok(())
}

fn set_version(conn: &Connection) -> Result<u64, StoreError> {
    let v: i64 = conn.query_row(
        "SELECT value FROM settings WHERE key = 'policy_set_version'",
        [],
        |r| r.get(0),
    )?;
    Ok(v as u64)
}

fn bump(tx: &Transaction<'_>) -> Result<u64, StoreError> {
    tx.execute(
        "UPDATE settings SET value = value + 1 WHERE key = 'policy_set_version'",
        [],
    )?;
    set_version(tx)
}

fn list(conn: &Connection) -> Result<Vec<StoredPolicy>, StoreError> {
    let mut stmt = conn.prepare(
        "SELECT body, version, updated_at_ms, updated_by FROM policies ORDER BY position",
    )?;
    let rows = stmt.query_map([], |r| {
        Ok((
            r.get::<_, String>(0)?,
            r.get::<_, i64>(1)?,
            r.get::<_, i64>(2)?,
            r.get::<_, String>(3)?,
        ))
    })?;
    let mut out = Vec::new();
    for row in rows {
        let (body, version, at, by) = row?;
        out.push(StoredPolicy {
            policy: from_json(&body)?,
            version: version as u64,
            updated_at_ms: at as u64,
            updated_by: by,
        });
    }
    Ok(out)
}

fn get(conn: &Connection, name: &str) -> Result<Option<StoredPolicy>, StoreError> {
    let row = conn
        .query_row(
            "SELECT body, version, updated_at_ms, updated_by FROM policies WHERE name = ?1",
            [name],
            |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, i64>(1)?,
                    r.get::<_, i64>(2)?,
                    r.get::<_, String>(3)?,
                ))
            },
        )
        .optional()?;
    row.map(|(body, version, at, by)| {
        Ok(StoredPolicy {
            policy: from_json(&body)?,
            version: version as u64,
            updated_at_ms: at as u64,
            updated_by: by,
        })
    })
    .transpose()
}

fn check_set(all: &[Policy], edited: usize) -> Result<(), StoreError> {
    let set = PolicySet {
        version: 1,
        policies: all.to_vec(),
    };
    validate_policy_set(&set).map_err(|e| StoreError::Invalid(relative_errors(e, edited)))
}

fn history(
    tx: &Transaction<'_>,
    name: &str,
    version: u64,
    set_version: u64,
    policy: Option<&Policy>,
    at: u64,
    actor: &str,
) -> Result<(), StoreError> {
    tx.execute(
        "INSERT INTO policy_history (name, version, set_version, body, at_ms, actor) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        params![name, version as i64, set_version as i64, policy.map(to_json), at as i64, actor],
    )?;
    Ok(())
}

fn audit(
    tx: &Transaction<'_>,
    at: u64,
    actor: &str,
    action: &str,
    target: &str,
    old: Option<&Policy>,
    new: Option<&Policy>,
) -> Result<(), StoreError> {
    tx.execute(
        "INSERT INTO audit (at_ms, actor, action, target, old, new) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        params![at as i64, actor, action, target, old.map(to_json), new.map(to_json)],
    )?;
    Ok(())
}
