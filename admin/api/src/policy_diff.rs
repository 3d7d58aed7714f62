//! What applying a policy set would change: policies added, removed,
//! changed field by field, and the order. Pure, so that the admin's
//! `apply --dry-run`, its API and the UI say the same.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use sluice_shared::Policy;

/// One field that differs: its path (`rate.requests`, `limits[0].name`)
/// and its value before and after (None: absent).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FieldChange {
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub old: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub new: Option<Value>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicyChange {
    pub name: String,
    pub fields: Vec<FieldChange>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SetDiff {
    pub added: Vec<String>,
    pub changed: Vec<PolicyChange>,
    pub removed: Vec<String>,
    /// The new order of names, when it differs from the old one beyond
    /// what adding and removing does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub order: Option<Vec<String>>,
}

impl SetDiff {
    pub fn is_empty(&self) -> bool {
        self.added.is_empty()
            && self.changed.is_empty()
            && self.removed.is_empty()
            && self.order.is_none()
    }
}

fn as_value(policy: &Policy) -> Value {
    serde_json::to_value(policy).unwrap_or(Value::Null)
}

/// The differences between two JSON values, by path.
fn diff_values(path: &str, old: Option<&Value>, new: Option<&Value>, out: &mut Vec<FieldChange>) {
    match (old, new) {
        (Some(Value::Object(a)), Some(Value::Object(b))) => {
            let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            for key in keys {
                let sub = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                diff_values(&sub, a.get(key), b.get(key), out);
            }
        }
        (Some(Value::Array(a)), Some(Value::Array(b))) if a.len() == b.len() => {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                diff_values(&format!("{path}[{i}]"), Some(x), Some(y), out);
            }
        }
        (a, b) if a != b => out.push(FieldChange {
            path: path.to_string(),
            old: a.cloned(),
            new: b.cloned(),
        }),
        _ => {}
    }
}

/// What turning `current` into `desired` changes (both in evaluation
/// order; names are unique in each).
pub fn diff_sets(current: &[Policy], desired: &[Policy]) -> SetDiff {
    let old: BTreeMap<&str, &Policy> = current.iter().map(|p| (p.name.as_str(), p)).collect();
    let new: BTreeMap<&str, &Policy> = desired.iter().map(|p| (p.name.as_str(), p)).collect();
    let mut diff = SetDiff::default();
    for policy in desired {
        match old.get(policy.name.as_str()) {
            None => diff.added.push(policy.name.clone()),
            Some(before) => {
                let mut fields = Vec::new();
                diff_values(
                    "",
                    Some(&as_value(before)),
                    Some(&as_value(policy)),
                    &mut fields,
                );
                if !fields.is_empty() {
                    diff.changed.push(PolicyChange {
                        name: policy.name.clone(),
                        fields,
                    });
                }
            }
        }
    }
    diff.removed = current
        .iter()
        .filter(|p| !new.contains_key(p.name.as_str()))
        .map(|p| p.name.clone())
        .collect();
    // The kept policies' relative order.
    let kept_before: Vec<&str> = current
        .iter()
        .map(|p| p.name.as_str())
        .filter(|n| new.contains_key(n))
        .collect();
    let kept_after: Vec<&str> = desired
        .iter()
        .map(|p| p.name.as_str())
        .filter(|n| old.contains_key(n))
        .collect();
    let appended_only = desired
        .iter()
        .map(|p| p.name.as_str())
        .skip_while(|n| old.contains_key(n))
        .all(|n| !old.contains_key(n));
    if kept_before != kept_after || !appended_only {
        diff.order = Some(desired.iter().map(|p| p.name.clone()).collect());
    }
    diff
}

fn short(value: &Option<Value>) -> String {
    match value {
        None => "(none)".into(),
        Some(v) => v.to_string(),
    }
}

impl fmt::Display for SetDiff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            return writeln!(f, "no changes");
        }
        for name in &self.added {
            writeln!(f, "+ {name}")?;
        }
        for change in &self.changed {
            writeln!(f, "~ {}", change.name)?;
            for field in &change.fields {
                writeln!(
                    f,
                    "    {}: {} -> {}",
                    field.path,
                    short(&field.old),
                    short(&field.new)
                )?;
            }
        }
        for name in &self.removed {
            writeln!(f, "- {name}")?;
        }
        if let Some(order) = &self.order {
            writeln!(f, "order: {}", order.join(", "))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;
    use sluice_shared::validate::policy_from_value;

    fn policy(value: Value) -> Policy {
        policy_from_value(value).unwrap()
    }

    fn bank(requests: u64) -> Policy {
        policy(
            json!({"name": "bank", "match": {"host": "bank.example"}, "rate": {"requests": requests, "period": "1s"}}),
        )
    }

    fn shop() -> Policy {
        policy(
            json!({"name": "shop", "match": {"host": "*.shop.example"}, "concurrency": {"max_in_flight": 5}}),
        )
    }

    fn any() -> Policy {
        policy(
            json!({"name": "any", "match": {"host": "*"}, "rate": {"requests": 1000, "period": "1s"}}),
        )
    }

    #[test]
    fn the_same_set_is_no_change() {
        let set = [bank(10), shop()];
        let diff = diff_sets(&set, &set);
        assert!(diff.is_empty());
        assert_eq!(diff.to_string(), "no changes\n");
    }

    #[test]
    fn added_changed_field_by_field_and_removed() {
        let diff = diff_sets(&[bank(10), shop()], &[bank(20), any()]);
        assert_eq!(diff.added, ["any"]);
        assert_eq!(diff.removed, ["shop"]);
        assert_eq!(diff.order, None, "appending is no reordering");
        assert_eq!(
            diff.changed,
            [PolicyChange {
                name: "bank".into(),
                fields: vec![FieldChange {
                    path: "rate.requests".into(),
                    old: Some(json!(10)),
                    new: Some(json!(20)),
                }],
            }]
        );
        assert_eq!(
            diff.to_string(),
            "+ any\n~ bank\n    rate.requests: 10 -> 20\n- shop\n"
        );
    }

    #[test]
    fn a_field_added_or_dropped_shows_as_none() {
        let mut burst = bank(10);
        burst.rate.as_mut().unwrap().burst = Some(30);
        let diff = diff_sets(&[bank(10)], &[burst]);
        assert_eq!(diff.changed[0].fields[0].path, "rate.burst");
        assert_eq!(diff.changed[0].fields[0].old, None);
        assert!(diff.to_string().contains("rate.burst: (none) -> 30"));
    }

    #[test]
    fn a_specific_policy_moved_before_a_wildcard_is_a_new_order() {
        let diff = diff_sets(&[any(), bank(10)], &[bank(10), any()]);
        assert_eq!(diff.order, Some(vec!["bank".into(), "any".into()]));
        assert!(diff.added.is_empty() && diff.changed.is_empty());
        // A policy added in front of kept ones reorders too.
        let diff = diff_sets(&[any()], &[bank(10), any()]);
        assert_eq!(diff.order, Some(vec!["bank".into(), "any".into()]));
    }

    proptest! {
        #[test]
        fn diffing_a_set_against_any_reordering_of_itself_changes_no_policy(
            order in Just(vec![0usize, 1, 2]).prop_shuffle()
        ) {
            let set = [bank(10), shop(), any()];
            let shuffled: Vec<Policy> = order.iter().map(|&i| set[i].clone()).collect();
            let diff = diff_sets(&set, &shuffled);
            prop_assert!(diff.added.is_empty() && diff.removed.is_empty() && diff.changed.is_empty());
            prop_assert_eq!(diff.order.is_some(), order != vec![0, 1, 2]);
        }
    }
}
