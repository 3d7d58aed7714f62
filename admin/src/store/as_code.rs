//! Applying a whole policy set at once (policies as code) and reordering
//! the set: each one transaction under the write lock, the set validated
//! before it commits, one set version for the lot, every policy's change in
//! the history and the audit log.

use sluice_api::policy_diff::{diff_sets, SetDiff};
use sluice_api::Applied;
use sluice_shared::validate::validate_policy_set;
use sluice_shared::{FieldError, Policy, PolicySet, ValidationErrors};

use sluice_shared::price::PriceTable;

use super::blocking::{
    audit_order, bump, insert_new, list, prices, remove_policy, set_version, write_next_version,
    write_prices, BlockingStore,
};
use super::db::Sql;
use super::{now_ms, StoreError};

fn positions(
    sql: &mut dyn Sql,
    names: &[&str],
    sources: Option<&[String]>,
) -> Result<(), StoreError> {
    for (position, name) in names.iter().enumerate() {
        let position = i64::try_from(position).unwrap_or(i64::MAX);
        match sources.and_then(|s| s.get(position as usize)) {
            Some(source) => sql.execute(
                "UPDATE policies SET position = $2, source = $3 WHERE name = $1",
                &[(*name).into(), position.into(), source.as_str().into()],
            )?,
            None => sql.execute(
                "UPDATE policies SET position = $2 WHERE name = $1",
                &[(*name).into(), position.into()],
            )?,
        };
    }
    Ok(())
}

impl BlockingStore {
    /// Makes the store's policy set `desired` (in that order; `sources[i]`
    /// is where `desired[i]` came from), or with `dry_run` only says what
    /// that would change. Nothing is written when nothing changes.
    /// The files' `prices` are the set's (none given: none).
    pub fn apply_set(
        &self,
        desired: &[Policy],
        sources: &[String],
        desired_prices: Option<&PriceTable>,
        actor: &str,
        dry_run: bool,
    ) -> Result<Applied, StoreError> {
        validate_policy_set(&PolicySet {
            version: 1,
            prices: desired_prices.cloned(),
            policies: desired.to_vec(),
        })
        .map_err(StoreError::Invalid)?;
        if dry_run {
            return self.db.read(|sql| {
                let current: Vec<Policy> = list(sql)?.into_iter().map(|s| s.policy).collect();
                Ok(Applied {
                    diff: diff_sets(&current, desired),
                    version: set_version(sql)?,
                    applied: false,
                    prices_changed: prices(sql)?.as_ref() != desired_prices,
                })
            });
        }
        self.db.write(|sql| {
            let stored = list(sql)?;
            let current: Vec<Policy> = stored.iter().map(|s| s.policy.clone()).collect();
            let diff = diff_sets(&current, desired);
            let old_prices = prices(sql)?;
            let prices_changed = old_prices.as_ref() != desired_prices;
            let names: Vec<&str> = desired.iter().map(|p| p.name.as_str()).collect();
            if diff.is_empty() && !prices_changed {
                // Where each policy comes from may still have moved (a
                // file renamed): no Envoy needs to hear of it.
                positions(sql, &names, Some(sources))?;
                return Ok(Applied {
                    diff,
                    version: set_version(sql)?,
                    applied: false,
                    prices_changed,
                });
            }
            let at = now_ms();
            let version = bump(sql)?;
            record(sql, &diff, &stored, desired, version, at, actor)?;
            if prices_changed {
                write_prices(sql, old_prices.as_ref(), desired_prices, at, actor)?;
            }
            positions(sql, &names, Some(sources))?;
            Ok(Applied {
                diff,
                version,
                applied: true,
                prices_changed,
            })
        })
    }

    /// Puts the policies in the order `names` (every policy, once), if the
    /// caller saw the set at `expected`.
    pub fn reorder(&self, names: &[String], expected: u64, actor: &str) -> Result<u64, StoreError> {
        self.db.write(|sql| {
            let current = set_version(sql)?;
            if current != expected {
                return Err(StoreError::Stale {
                    name: "the policy set".into(),
                    current,
                    expected,
                });
            }
            let before: Vec<String> = list(sql)?.into_iter().map(|s| s.policy.name).collect();
            let mut sorted_before = before.clone();
            let mut sorted_after = names.to_vec();
            sorted_before.sort();
            sorted_after.sort();
            if sorted_before != sorted_after {
                return Err(StoreError::Invalid(ValidationErrors {
                    errors: vec![FieldError {
                        path: "names".into(),
                        message: format!("must name every policy once: {}", before.join(", ")),
                    }],
                }));
            }
            if before == names {
                return Ok(current);
            }
            let names_ref: Vec<&str> = names.iter().map(String::as_str).collect();
            positions(sql, &names_ref, None)?;
            let version = bump(sql)?;
            audit_order(sql, now_ms(), actor, &before, names)?;
            Ok(version)
        })
    }
}

/// Writes the diff's policies (history and audit per policy).
fn record(
    sql: &mut dyn Sql,
    diff: &SetDiff,
    stored: &[sluice_api::StoredPolicy],
    desired: &[Policy],
    version: u64,
    at: u64,
    actor: &str,
) -> Result<(), StoreError> {
    let find = |name: &str| desired.iter().find(|p| p.name == name);
    let current = |name: &str| stored.iter().find(|s| s.policy.name == name);
    for old in diff.removed.iter().filter_map(|name| current(name)) {
        remove_policy(sql, old, version, at, actor)?;
    }
    for name in &diff.added {
        if let Some(policy) = find(name) {
            // Its place is set with the others' afterwards.
            insert_new(sql, policy, i64::MAX, version, at, actor, "create")?;
        }
    }
    for change in &diff.changed {
        if let (Some(policy), Some(old)) = (find(&change.name), current(&change.name)) {
            write_next_version(sql, old, policy, version, at, actor)?;
        }
    }
    if let Some(order) = &diff.order {
        let before: Vec<&str> = stored.iter().map(|s| s.policy.name.as_str()).collect();
        audit_order(sql, at, actor, &before, order)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use sluice_shared::validate::policy_from_value;

    fn policy(name: &str, host: &str, requests: u64) -> Policy {
        policy_from_value(json!({"name": name, "match": {"host": host}, "rate": {"requests": requests, "period": "1s"}}))
            .unwrap()
    }

    fn store() -> (tempfile::TempDir, BlockingStore) {
        let dir = tempfile::tempdir().unwrap();
        let store = BlockingStore::open(&dir.path().join("s.db")).unwrap();
        (dir, store)
    }

    /// The files' prices are the set's: a change alone is a new version,
    /// the same table again is none, no table removes it.
    #[test]
    fn applied_prices_are_the_sets_and_versioned_with_it() {
        let (_dir, store) = store();
        let desired = [policy("bank", "bank.example", 20)];
        let sources = ["a.yaml".to_string()];
        let table: PriceTable = serde_json::from_str(
            r#"{"currency": "EUR", "models": {"m": {"input": "1", "output": "2"}}}"#,
        )
        .unwrap();
        let first = store
            .apply_set(&desired, &sources, None, "ci", false)
            .unwrap();
        let dry = store
            .apply_set(&desired, &sources, Some(&table), "ci", true)
            .unwrap();
        assert!(dry.prices_changed && !dry.applied);
        let priced = store
            .apply_set(&desired, &sources, Some(&table), "ci", false)
            .unwrap();
        assert!(priced.applied && priced.prices_changed && priced.diff.is_empty());
        assert_eq!(priced.version, first.version + 1);
        assert_eq!(store.policy_set().unwrap().prices, Some(table.clone()));
        let again = store
            .apply_set(&desired, &sources, Some(&table), "ci", false)
            .unwrap();
        assert!(!again.applied && !again.prices_changed);
        let removed = store
            .apply_set(&desired, &sources, None, "ci", false)
            .unwrap();
        assert!(removed.applied && removed.prices_changed);
        assert_eq!(store.prices().unwrap(), None);
    }

    #[test]
    fn an_applied_set_replaces_the_store_in_one_version_and_again_changes_nothing() {
        let (_dir, store) = store();
        store
            .create(policy("old", "old.example", 1), "alice")
            .unwrap();
        store
            .create(policy("bank", "bank.example", 10), "alice")
            .unwrap();
        let desired = [policy("bank", "bank.example", 20), policy("any", "*", 100)];
        let sources = ["a.yaml".to_string(), "b.yaml".to_string()];
        let dry = store
            .apply_set(&desired, &sources, None, "ci", true)
            .unwrap();
        assert!(!dry.applied);
        assert_eq!(
            store.policy_set_version().unwrap(),
            2,
            "a dry run writes nothing"
        );
        let applied = store
            .apply_set(&desired, &sources, None, "ci", false)
            .unwrap();
        assert_eq!((applied.applied, applied.version), (true, 3));
        assert_eq!(applied.diff.added, ["any"]);
        assert_eq!(applied.diff.removed, ["old"]);
        assert_eq!(applied.diff.changed[0].fields[0].path, "rate.requests");
        let (_, listed) = store.list().unwrap();
        let got: Vec<(&str, u64, Option<&str>)> = listed
            .iter()
            .map(|s| (s.policy.name.as_str(), s.version, s.source.as_deref()))
            .collect();
        assert_eq!(
            got,
            [("bank", 2, Some("a.yaml")), ("any", 1, Some("b.yaml"))]
        );
        let again = store
            .apply_set(&desired, &sources, None, "ci", false)
            .unwrap();
        assert!(again.diff.is_empty() && !again.applied);
        assert_eq!(store.policy_set_version().unwrap(), 3);
        let actions: Vec<String> = store
            .audit_log(10, None)
            .unwrap()
            .into_iter()
            .map(|e| format!("{} {} {}", e.actor, e.action, e.target))
            .collect();
        assert_eq!(
            &actions[..3],
            ["ci update bank", "ci create any", "ci delete old"]
        );
    }

    #[test]
    fn a_set_that_fails_validation_changes_nothing() {
        let (_dir, store) = store();
        store
            .create(policy("bank", "bank.example", 10), "alice")
            .unwrap();
        let twice = [policy("x", "x.example", 1), policy("x", "y.example", 1)];
        let err = store
            .apply_set(&twice, &["a".into(), "b".into()], None, "ci", false)
            .unwrap_err();
        assert!(matches!(err, StoreError::Invalid(_)), "{err}");
        assert_eq!(store.policy_set_version().unwrap(), 1);
        assert_eq!(store.list().unwrap().1.len(), 1);
    }

    #[test]
    fn reordering_puts_a_specific_policy_before_a_wildcard() {
        let (_dir, store) = store();
        store.create(policy("any", "*", 100), "alice").unwrap();
        store
            .create(policy("bank", "bank.example", 10), "alice")
            .unwrap();
        let names = ["bank".to_string(), "any".to_string()];
        assert!(matches!(
            store.reorder(&names, 1, "alice"),
            Err(StoreError::Stale { current: 2, .. })
        ));
        assert!(matches!(
            store.reorder(&["bank".into()], 2, "alice"),
            Err(StoreError::Invalid(_))
        ));
        assert_eq!(store.reorder(&names, 2, "alice").unwrap(), 3);
        let order: Vec<String> = store
            .policy_set()
            .unwrap()
            .policies
            .into_iter()
            .map(|p| p.name)
            .collect();
        assert_eq!(order, names);
        assert_eq!(store.audit_log(1, None).unwrap()[0].action, "reorder");
    }
}
