//! A budget's bar: the share it used, with a mark at each warning line
//! (red once passed), as the Budgets list and its tree draw it.

use leptos::prelude::*;

use crate::spend_text::{percent, BudgetSpec};

/// A bar of `ratio` with a mark at each warning line.
pub fn bar(ratio: f64, spec: &BudgetSpec) -> impl IntoView {
    let width = format!("width: {:.1}%", (ratio * 100.0).clamp(0.0, 100.0));
    let lines = spec
        .warn_at
        .iter()
        .map(|line| {
            let left = format!("left: {:.1}%", line * 100.0);
            let past = ratio >= *line;
            view! { <span class="warn-line" class:past-warning=past style=left title=percent(*line)></span> }
        })
        .collect_view();
    view! { <span class="spend-bar"><span class="spend-fill" style=width></span>{lines}</span> }
}
