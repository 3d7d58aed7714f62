//! The live view's budget tree: stacked budgets as the tree they form
//! (company → team → key), built by [`sluice_shared::budget_tree`] from
//! the newest frame, as `GET /api/v1/budgets` gives it. Each node shows
//! what it spent of its size, its warning lines, when it renews, why it
//! last refused a call; the tightest rung of each path (the one that
//! refuses first) stands out.

use std::collections::BTreeMap;

use leptos::prelude::*;
use sluice_shared::budget_tree::BudgetNode;

use crate::spend_bar::bar;
use crate::spend_text::{percent, refused_text, renews_in, BudgetSpec};

/// One node and, nested, the nodes under it.
fn node_view(node: BudgetNode, specs: &BTreeMap<String, BudgetSpec>, at_ms: u64) -> AnyView {
    let spec = specs.get(&node.limit).cloned().unwrap_or_default();
    let used = node.used();
    let name = node.key.clone().unwrap_or_else(|| node.limit.clone());
    let renewal = if node.renews_in_ms > 0 {
        renews_in(node.renews_in_ms)
    } else {
        "—".to_string()
    };
    let renews_at = spec.renews_at(at_ms, node.renews_in_ms);
    let refused = node
        .last_refused
        .as_ref()
        .map(|r| refused_text(r, &spec, at_ms));
    let children = node
        .children
        .into_iter()
        .map(|child| node_view(child, specs, at_ms))
        .collect_view();
    view! {
        <li class="budget-node" class:tightest=node.tightest data-limit=node.limit.clone() data-key=node.key.clone().unwrap_or_default()>
            <span class="node-name">{name}</span>
            {node.key.is_some().then(|| view! { " "<span class="node-limit">"(" {node.limit.clone()} ")"</span> })}
            " "<span class="node-spent">{spec.amount(node.spent)}</span>
            " of "<span class="node-size">{spec.amount(node.size)}</span>
            " "<span class="node-used">{percent(used)}</span>" "{bar(used, &spec)}
            " · renews in "<span class="node-renews-in">{renewal}</span>
            {renews_at.map(|at| view! { " (at "<span class="node-renews-at">{at}</span>")" })}
            {node.tightest.then(|| view! { " "<span class="tightest-mark" title="Of this path, the budget that refuses first">"tightest"</span> })}
            {refused.map(|text| view! { " · last refused "<span class="node-refused">{text}</span> })}
            <ul>{children}</ul>
        </li>
    }
    .into_any()
}

/// The tree of the frame's budgets; nothing when no budget is stacked
/// over another (the list below says it all).
pub fn tree_view(
    roots: Vec<BudgetNode>,
    specs: &BTreeMap<String, BudgetSpec>,
    at_ms: u64,
) -> impl IntoView {
    let nested = roots.iter().any(|r| !r.children.is_empty());
    nested.then(|| {
        let nodes = roots
            .into_iter()
            .map(|root| node_view(root, specs, at_ms))
            .collect_view();
        view! {
            <div id="budget-tree">
                <h3>"As a tree"</h3>
                <p class="legend">"Each budget under the one listed before it in its policy, each key under the key its calls carried there; the budget of each path that has used the largest share (which refuses first) is marked."</p>
                <ul class="budget-tree">{nodes}</ul>
            </div>
        }
    })
}
