//! Budgets as the tree their stacking forms: a company's budget over its
//! teams', a team's over its API keys'. The tree is read from the order a
//! policy lists its limits in, widest first: a budget's parent is the
//! budget listed before it ([`budget_parents`]); a keyed budget's key hangs
//! under the key of its parent that the same calls carried (the filter
//! reports it, [`crate::spend::KeySpend::parent`]).
//!
//! Both the admin's `/api/v1/budgets` and the live view build the tree
//! here, from the policies and the fleet's merged spend reports.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::policy::{NamedLimit, Policy};
use crate::spend::{RefusedCall, SpendReport};

/// For each of `limits`, the index of its parent budget: the nearest
/// budget (a limit of an hour or longer) listed before it, for an unkeyed
/// budget only an unkeyed one (a company's budget is under no team's).
/// Limits shorter than an hour have none and are no one's.
pub fn budget_parents(limits: &[NamedLimit]) -> Vec<Option<usize>> {
    limits
        .iter()
        .enumerate()
        .map(|(index, limit)| {
            if !limit.spends_over_hours() {
                return None;
            }
            limits[..index].iter().rposition(|before| {
                before.spends_over_hours() && (limit.key.is_some() || before.key.is_none())
            })
        })
        .collect()
}

/// One node of the tree: an unkeyed budget, or one key of a keyed one.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct BudgetNode {
    /// The limit's name.
    pub limit: String,
    /// A keyed budget's key as the live view labels it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// Spent this period, in the limit's unit (money: micro-units).
    pub spent: u64,
    /// What it allows per period (a key: each key's).
    pub size: u64,
    /// Until it renews (0: nothing spent).
    #[serde(default)]
    pub renews_in_ms: u64,
    /// Its warning lines, as shares of `size`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warn_at: Vec<f64>,
    /// The tightest rung on a path from a root: of this node and those
    /// above it, the one that has used the largest share (the widest on a
    /// tie), which refuses first.
    #[serde(default)]
    pub tightest: bool,
    /// The last call it refused, and why (kept until a later one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_refused: Option<RefusedCall>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub children: Vec<BudgetNode>,
}

impl BudgetNode {
    /// The share of its size it has spent (1 for a budget of size 0).
    pub fn used(&self) -> f64 {
        if self.size == 0 {
            1.0
        } else {
            self.spent as f64 / self.size as f64
        }
    }
}

/// The tree of the budgets that `policies` stack, with what `spends` (by
/// limit name: the fleet's merged reports) says each spent. Roots are the
/// budgets with no parent; a key whose parent key is not among its parent
/// budget's reported top keys is a root of its own.
pub fn budget_tree(policies: &[Policy], spends: &BTreeMap<String, SpendReport>) -> Vec<BudgetNode> {
    let levels = Levels::of(policies);
    let mut roots: Vec<BudgetNode> = Vec::new();
    for name in &levels.order {
        if levels.parent.contains_key(name) {
            continue;
        }
        roots.extend(levels.nodes_of(name, spends, None));
    }
    // Keys whose parent key is not shown stand on their own.
    for name in &levels.order {
        let (Some(parent), Some(spend)) = (levels.parent.get(name), spends.get(name)) else {
            continue;
        };
        if !levels.keyed(parent) {
            continue;
        }
        let shown: BTreeSet<u64> = spends
            .get(parent)
            .map(|p| p.keys.iter().map(|k| k.hash).collect())
            .unwrap_or_default();
        for key in spend.keys.iter().filter(|k| !shown.contains(&k.parent)) {
            roots.push(levels.key_node(name, key, spend, spends));
        }
    }
    for root in &mut roots {
        mark_tightest(root, 0, None);
    }
    roots
}

/// The budgets of a set by name: their order of first appearance, their
/// parent, whether they are keyed, their warning lines.
struct Levels<'p> {
    order: Vec<String>,
    parent: BTreeMap<String, String>,
    limits: BTreeMap<String, &'p NamedLimit>,
}

impl<'p> Levels<'p> {
    /// A limit named in several policies takes its parent from the first
    /// list naming it (the policy's own limits, then its pool members').
    fn of(policies: &'p [Policy]) -> Self {
        let mut levels = Levels {
            order: Vec::new(),
            parent: BTreeMap::new(),
            limits: BTreeMap::new(),
        };
        let lists = policies.iter().flat_map(|p| {
            std::iter::once(p.limits.as_slice()).chain(
                p.pool
                    .iter()
                    .flat_map(|pool| pool.members.iter().map(|m| m.limits.as_slice())),
            )
        });
        for list in lists {
            for (limit, parent) in list.iter().zip(budget_parents(list)) {
                if !limit.spends_over_hours() || levels.limits.contains_key(&limit.name) {
                    continue;
                }
                levels.order.push(limit.name.clone());
                levels.limits.insert(limit.name.clone(), limit);
                if let Some(parent) = parent.and_then(|i| list.get(i)) {
                    levels
                        .parent
                        .insert(limit.name.clone(), parent.name.clone());
                }
            }
        }
        levels
    }

    fn keyed(&self, name: &str) -> bool {
        self.limits.get(name).is_some_and(|l| l.key.is_some())
    }

    fn warn_at(&self, name: &str) -> Vec<f64> {
        self.limits
            .get(name)
            .map(|l| l.warn_at.clone())
            .unwrap_or_default()
    }

    /// The nodes `name` contributes under a parent node: its one node if
    /// unkeyed; if keyed, its keys under `parent_key` (a key of a keyed
    /// parent) or all of them (no parent key).
    fn nodes_of(
        &self,
        name: &str,
        spends: &BTreeMap<String, SpendReport>,
        parent_key: Option<u64>,
    ) -> Vec<BudgetNode> {
        let Some(spend) = spends.get(name) else {
            return Vec::new();
        };
        if !self.keyed(name) {
            return vec![BudgetNode {
                limit: name.to_string(),
                key: None,
                spent: spend.spent,
                size: spend.size,
                renews_in_ms: spend.renews_in_ms,
                warn_at: self.warn_at(name),
                tightest: false,
                last_refused: last_refused(spend, 0),
                children: self.children_of(name, None, spends),
            }];
        }
        spend
            .keys
            .iter()
            .filter(|k| parent_key.is_none_or(|p| k.parent == p))
            .map(|k| self.key_node(name, k, spend, spends))
            .collect()
    }

    fn key_node(
        &self,
        name: &str,
        key: &crate::spend::KeySpend,
        spend: &SpendReport,
        spends: &BTreeMap<String, SpendReport>,
    ) -> BudgetNode {
        BudgetNode {
            limit: name.to_string(),
            key: Some(key.label.clone()),
            spent: key.spent,
            size: key.size,
            renews_in_ms: spend.renews_in_ms,
            warn_at: self.warn_at(name),
            tightest: false,
            last_refused: last_refused(spend, key.hash),
            children: self.children_of(name, Some(key.hash), spends),
        }
    }

    /// The nodes under `name` (its key `key`, if keyed).
    fn children_of(
        &self,
        name: &str,
        key: Option<u64>,
        spends: &BTreeMap<String, SpendReport>,
    ) -> Vec<BudgetNode> {
        self.order
            .iter()
            .filter(|child| self.parent.get(*child).is_some_and(|p| p == name))
            .flat_map(|child| self.nodes_of(child, spends, key))
            .collect()
    }
}

/// The last call `spend`'s limit refused for `key` (0: unkeyed).
fn last_refused(spend: &SpendReport, key: u64) -> Option<RefusedCall> {
    spend.refused.iter().find(|r| r.key == key).cloned()
}

/// Marks, on every path from `node` (at `depth`) down, the node that has
/// used the largest share; `best` is the path's best above it (share,
/// depth). Returns the depths above `node` still to be marked.
fn mark_tightest(
    node: &mut BudgetNode,
    depth: usize,
    best: Option<(f64, usize)>,
) -> BTreeSet<usize> {
    let used = node.used();
    // On a tie the wider (the one above) stays the tightest.
    let best = match best {
        Some((share, at)) if share >= used => (share, at),
        _ => (used, depth),
    };
    let mut marks = BTreeSet::new();
    if node.children.is_empty() {
        marks.insert(best.1);
    }
    for child in &mut node.children {
        marks.extend(mark_tightest(child, depth + 1, Some(best)));
    }
    node.tightest = marks.remove(&depth);
    marks
}
