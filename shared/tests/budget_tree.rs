//! Budgets as the tree their stacking forms: parents read from the order a
//! policy lists its limits in, keys hung under the parent key their calls
//! carried, the tightest rung of each path marked, keys whose parent is
//! not shown kept as roots rather than lost.

use std::collections::BTreeMap;

use sluice_shared::budget_tree::{budget_parents, budget_tree, BudgetNode};
use sluice_shared::parse_policy_set;
use sluice_shared::spend::{KeySpend, RefusedCall, SpendReport};
use sluice_shared::Policy;

const SET: &str = r#"{"version": 1, "policies": [{"name": "llm", "match": {"host": "api.openai.com"}, "rate": {"requests": 100, "period": "1s"},
  "limits": [
    {"name": "company", "rate": {"requests": 1000, "period": "30d"}, "warn_at": [0.8]},
    {"name": "per-second", "rate": {"requests": 10, "period": "1s"}},
    {"name": "team", "rate": {"requests": 400, "period": "30d"}, "key": {"header": "x-team", "label": "value"}},
    {"name": "api-key", "rate": {"requests": 100, "period": "1d"}, "key": {"header": "x-api-key"}},
    {"name": "region", "rate": {"requests": 900, "period": "1d"}}
  ]}]}"#;

fn policies() -> Vec<Policy> {
    parse_policy_set(SET)
        .unwrap_or_else(|e| panic!("{e}"))
        .policies
}

fn key(label: &str, hash: u64, spent: u64, size: u64, parent: u64) -> KeySpend {
    KeySpend {
        label: label.into(),
        hash,
        spent,
        size,
        parent,
    }
}

fn spends() -> BTreeMap<String, SpendReport> {
    let unkeyed = |spent, size| SpendReport {
        spent,
        size,
        renews_in_ms: 5_000,
        ..SpendReport::default()
    };
    let keyed = |keys: Vec<KeySpend>| SpendReport {
        spent: keys.iter().map(|k| k.spent).sum(),
        size: keys.first().map_or(0, |k| k.size),
        renews_in_ms: 7_000,
        spending_keys: keys.len() as u64,
        keys,
        refused: Vec::new(),
    };
    let mut company = unkeyed(700, 1000);
    company.refused = vec![RefusedCall {
        at_ms: 1_000,
        key: 0,
        reason: "spent".into(),
        spent: 990,
        size: 1000,
    }];
    let mut api_keys = keyed(vec![
        key("#k1", 21, 60, 100, 11),
        key("#k2", 22, 99, 100, 12),
        key("#k3", 23, 5, 100, 11),
        // Its team is not among the shown ones.
        key("#k4", 24, 40, 100, 99),
    ]);
    api_keys.refused = vec![RefusedCall {
        at_ms: 2_000,
        key: 22,
        reason: "model-unpriced".into(),
        ..RefusedCall::default()
    }];
    BTreeMap::from([
        ("company".into(), company),
        ("region".into(), unkeyed(100, 900)),
        (
            "team".into(),
            keyed(vec![
                key("search", 11, 380, 400, 0),
                key("ads", 12, 120, 400, 0),
            ]),
        ),
        ("api-key".into(), api_keys),
    ])
}

fn find<'a>(nodes: &'a [BudgetNode], limit: &str, key: Option<&str>) -> &'a BudgetNode {
    nodes
        .iter()
        .find(|n| n.limit == limit && n.key.as_deref() == key)
        .unwrap_or_else(|| panic!("no {limit} {key:?} in {nodes:#?}"))
}

#[test]
fn a_budgets_parent_is_the_one_listed_before_it_and_an_unkeyed_one_has_only_an_unkeyed_parent() {
    let set = policies();
    // company, per-second (under an hour: none), team, api-key, region.
    assert_eq!(
        budget_parents(&set[0].limits),
        vec![None, None, Some(0), Some(2), Some(0)]
    );
}

#[test]
fn the_tree_goes_company_team_key_and_each_key_under_the_team_its_calls_carried() {
    let tree = budget_tree(&policies(), &spends());
    let company = find(&tree, "company", None);
    assert_eq!((company.spent, company.size), (700, 1000));
    assert_eq!(company.warn_at, vec![0.8]);
    assert_eq!(company.renews_in_ms, 5_000);
    let search = find(&company.children, "team", Some("search"));
    let ads = find(&company.children, "team", Some("ads"));
    assert_eq!((search.spent, search.size), (380, 400));
    let keys = |n: &BudgetNode| n.children.iter().map(|c| c.key.clone()).collect::<Vec<_>>();
    assert_eq!(keys(search), vec![Some("#k1".into()), Some("#k3".into())]);
    assert_eq!(keys(ads), vec![Some("#k2".into())]);
    // The unkeyed region budget is the company's other child.
    let region = find(&company.children, "region", None);
    assert!(region.children.is_empty());
    // #k4's team is not shown: it stands on its own, not lost.
    let k4 = find(&tree, "api-key", Some("#k4"));
    assert_eq!(k4.spent, 40);
    assert_eq!(tree.len(), 2);
}

#[test]
fn the_tightest_rung_of_each_path_is_marked_the_widest_on_a_tie() {
    let tree = budget_tree(&policies(), &spends());
    let company = find(&tree, "company", None);
    let search = find(&company.children, "team", Some("search"));
    let ads = find(&company.children, "team", Some("ads"));
    // company 70 %, search 95 %, #k1 60 %, #k3 5 %: search is tightest.
    assert!(search.tightest);
    assert!(search.children.iter().all(|k| !k.tightest));
    // ads 30 %, #k2 99 %: the key is.
    assert!(!ads.tightest);
    assert!(find(&ads.children, "api-key", Some("#k2")).tightest);
    // company 70 % over region 11 %: the company is, on that path.
    assert!(company.tightest);
    assert!(!find(&company.children, "region", None).tightest);

    let mut tie = spends();
    tie.insert(
        "team".into(),
        SpendReport {
            keys: vec![key("search", 11, 280, 400, 0)],
            ..SpendReport::default()
        },
    );
    let tree = budget_tree(&policies(), &tie);
    let company = find(&tree, "company", None);
    let search = find(&company.children, "team", Some("search"));
    // 70 % and 70 %: the wider, the company, refuses first.
    assert!(company.tightest);
    assert!(!search.tightest);
}

#[test]
fn hostile_or_missing_reports_make_a_smaller_tree_not_a_wrong_or_endless_one() {
    // Nothing reported yet: no nodes.
    assert!(budget_tree(&policies(), &BTreeMap::new()).is_empty());
    // Only keys, their teams never reported: each key its own root.
    let mut only_keys = spends();
    only_keys.retain(|name, _| name == "api-key");
    let tree = budget_tree(&policies(), &only_keys);
    assert_eq!(tree.len(), 4);
    assert!(tree.iter().all(|n| n.children.is_empty() && n.tightest));
    // A key claiming itself as parent, a budget of size 0, a report for a
    // limit the set does not have.
    let mut odd = spends();
    odd.insert(
        "team".into(),
        SpendReport {
            keys: vec![key("loop", 11, 5, 0, 11)],
            ..SpendReport::default()
        },
    );
    odd.insert("gone".into(), SpendReport::default());
    let tree = budget_tree(&policies(), &odd);
    let company = find(&tree, "company", None);
    let lp = find(&company.children, "team", Some("loop"));
    assert_eq!(lp.used(), 1.0);
    assert!(lp.tightest);
    assert!(tree.iter().all(|n| n.limit != "gone"));
}

#[test]
fn the_tree_is_json_for_the_api() {
    let tree = budget_tree(&policies(), &spends());
    let json = serde_json::to_value(&tree).unwrap_or_default();
    assert_eq!(json[0]["limit"], "company");
    assert_eq!(json[0]["children"][0]["key"], "search");
    assert_eq!(json[0]["children"][0]["tightest"], true);
    let back: Vec<BudgetNode> = serde_json::from_value(json).unwrap_or_default();
    assert_eq!(back, tree);
}

#[test]
fn each_node_says_why_it_last_refused_a_call() {
    let tree = budget_tree(&policies(), &spends());
    let company = find(&tree, "company", None);
    let why = |n: &BudgetNode| n.last_refused.as_ref().map(|r| (r.reason.clone(), r.spent));
    assert_eq!(why(company), Some(("spent".into(), 990)));
    let ads = find(&company.children, "team", Some("ads"));
    assert_eq!(why(ads), None, "refused nothing");
    let k2 = find(&ads.children, "api-key", Some("#k2"));
    assert_eq!(why(k2), Some(("model-unpriced".into(), 0)));
    let search = find(&company.children, "team", Some("search"));
    assert!(search.children.iter().all(|k| k.last_refused.is_none()));
}
