//! The policy set's rows: the epoch and version, each policy, the
//! prices, and writing the next version of the set in one transaction.

use super::*;

/// Inserts a policy new to the store (version 1) at `position`, with its
/// history entry and an audit entry for `action`.
pub(in crate::store) fn insert_new(
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
pub(in crate::store) fn new_epoch() -> Result<u64, StoreError> {
    let bytes = crate::auth::random_bytes::<8>().map_err(|e| StoreError::Corrupt(e.to_string()))?;
    Ok((u64::from_le_bytes(bytes) >> 2).max(1))
}

pub(in crate::store) fn epoch(sql: &mut dyn Sql) -> Result<u64, StoreError> {
    sql.query_one("SELECT value FROM settings WHERE key = 'store_epoch'", &[])?
        .ok_or_else(|| StoreError::Corrupt("no store_epoch setting".into()))?
        .uint(0)
}

pub(in crate::store) fn set_version(sql: &mut dyn Sql) -> Result<u64, StoreError> {
    sql.query_one(
        "SELECT value FROM settings WHERE key = 'policy_set_version'",
        &[],
    )?
    .ok_or_else(|| StoreError::Corrupt("no policy_set_version setting".into()))?
    .uint(0)
}

pub(in crate::store) fn bump(sql: &mut dyn Sql) -> Result<u64, StoreError> {
    sql.execute(
        "UPDATE settings SET value = value + 1 WHERE key = 'policy_set_version'",
        &[],
    )?;
    set_version(sql)
}

pub(in crate::store) fn stored_policy(r: &Row) -> Result<StoredPolicy, StoreError> {
    Ok(StoredPolicy {
        policy: from_json(&r.text(0)?)?,
        version: r.uint(1)?,
        updated_at_ms: r.uint(2)?,
        updated_by: r.text(3)?,
        source: r.optional_text(4)?,
    })
}

pub(in crate::store) fn list(sql: &mut dyn Sql) -> Result<Vec<StoredPolicy>, StoreError> {
    sql.query(
        "SELECT body, version, updated_at_ms, updated_by, source FROM policies ORDER BY position",
        &[],
    )?
    .iter()
    .map(stored_policy)
    .collect()
}

pub(in crate::store) fn get(
    sql: &mut dyn Sql,
    name: &str,
) -> Result<Option<StoredPolicy>, StoreError> {
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
pub(in crate::store) fn write_prices(
    sql: &mut dyn Sql,
    old: Option<&PriceTable>,
    new: Option<&PriceTable>,
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
        at,
        actor,
        "prices",
        "prices",
        old.map(to_json),
        new.map(to_json),
    )
}

/// The set's price table, as stored (validated when it was written).
pub(in crate::store) fn prices(sql: &mut dyn Sql) -> Result<Option<PriceTable>, StoreError> {
    sql.query_one("SELECT body FROM prices WHERE id = 1", &[])?
        .map(|r| r.text(0).and_then(|body| from_json(&body)))
        .transpose()
}

pub(in crate::store) fn check_set(
    sql: &mut dyn Sql,
    all: &[Policy],
    edited: usize,
) -> Result<(), StoreError> {
    let set = PolicySet {
        version: 1,
        prices: prices(sql)?,
        policies: all.to_vec(),
    };
    validate_policy_set(&set).map_err(|e| StoreError::Invalid(relative_errors(e, edited)))
}

/// Writes `policy` as the next version of `current` (by hand: no source
/// file), with its history and audit entries. Returns the new version.
pub(in crate::store) fn write_next_version(
    sql: &mut dyn Sql,
    current: &StoredPolicy,
    policy: &Policy,
    set_version: u64,
    at: u64,
    actor: &str,
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
pub(in crate::store) fn remove_policy(
    sql: &mut dyn Sql,
    current: &StoredPolicy,
    set_version: u64,
    at: u64,
    actor: &str,
) -> Result<(), StoreError> {
    let name = current.policy.name.as_str();
    sql.execute("DELETE FROM policies WHERE name = $1", &[name.into()])?;
    history(sql, name, current.version + 1, set_version, None, at, actor)?;
    audit(sql, at, actor, "delete", name, Some(&current.policy), None)
}

/// The stored policy `name`, if the caller saw its current version
/// (`expected`): an edit or removal of anything else is refused.
pub(in crate::store) fn current_at(
    sql: &mut dyn Sql,
    name: &str,
    expected: u64,
) -> Result<StoredPolicy, StoreError> {
    let current = get(sql, name)?.ok_or_else(|| StoreError::NotFound(name.into()))?;
    if current.version != expected {
        return Err(StoreError::Stale {
            name: name.into(),
            current: current.version,
            expected,
        });
    }
    Ok(current)
}

/// The policy set's version and the store's epoch, in one statement: a
/// sync reads both in its own transaction.
pub(in crate::store) fn version_and_epoch(sql: &mut dyn Sql) -> Result<(u64, u64), StoreError> {
    let rows = sql.query(
        "SELECT key, value FROM settings WHERE key IN ('policy_set_version', 'store_epoch')",
        &[],
    )?;
    let (mut version, mut epoch) = (None, None);
    for row in &rows {
        match row.text(0)?.as_str() {
            "policy_set_version" => version = Some(row.uint(1)?),
            _ => epoch = Some(row.uint(1)?),
        }
    }
    Ok((
        version.ok_or_else(|| StoreError::Corrupt("no policy_set_version setting".into()))?,
        epoch.ok_or_else(|| StoreError::Corrupt("no store_epoch setting".into()))?,
    ))
}
