//! The audit log and the policy set's history, as the admin shows them.

use super::*;

pub(in crate::store) fn history(
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
pub(in crate::store) fn audit(
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
        at,
        actor,
        action,
        target,
        old.map(to_json),
        new.map(to_json),
    )
}

/// One audit entry: (when, who, what, of what), with what was before and
/// after as JSON text.
pub(in crate::store) fn audit_entry(
    sql: &mut dyn Sql,
    at: u64,
    actor: &str,
    action: &str,
    target: &str,
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

/// A new evaluation order in the audit log: the names before and after.
pub(in crate::store) fn audit_order<B: AsRef<str>, A: AsRef<str>>(
    sql: &mut dyn Sql,
    at: u64,
    actor: &str,
    before: &[B],
    after: &[A],
) -> Result<(), StoreError> {
    let json = |names: Vec<&str>| serde_json::Value::from(names).to_string();
    audit_entry(
        sql,
        at,
        actor,
        "reorder",
        "policies",
        Some(json(before.iter().map(AsRef::as_ref).collect())),
        Some(json(after.iter().map(AsRef::as_ref).collect())),
    )
}
