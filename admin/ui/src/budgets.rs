//! The live view of budgets (limits of an hour or longer): what each spent
//! this period against its size and warning lines, when it renews, a month
//! at the last minute's pace, and a keyed one's top 20 spenders. The words
//! are [`crate::spend_text`]'s.

use std::collections::BTreeMap;

use leptos::prelude::*;
use leptos::task::spawn_local;
use sluice_api::PolicyList;
use sluice_shared::budget_tree::budget_tree;
use sluice_shared::price::PriceTable;
use sluice_shared::spend::SpendReport;
use sluice_shared::Policy;
use sluice_wire::stats::LimitCounter;

use crate::api;
use crate::budget_tree::tree_view;
use crate::live::LiveFrames;
use crate::spend_bar::bar;
use crate::spend_text::{budget_specs, month_projection, percent, renews_in, used, BudgetSpec};

/// Frames the month's projection averages: the last minute.
const PACE_FRAMES: usize = 60;

#[component]
pub fn BudgetsNow() -> impl IntoView {
    let frames = expect_context::<LiveFrames>();
    let specs = RwSignal::new(BTreeMap::<String, BudgetSpec>::new());
    let policies = RwSignal::new(Vec::<Policy>::new());
    spawn_local(async move {
        let prices = api::get::<Option<PriceTable>>("/api/v1/prices")
            .await
            .ok()
            .flatten();
        if let Ok(list) = api::get::<PolicyList>("/api/v1/policies").await {
            let list: Vec<_> = list.policies.into_iter().map(|s| s.policy).collect();
            specs.set(budget_specs(&list, prices.as_ref()));
            policies.set(list);
        }
    });
    // Each budget with its definition, so that a row is drawn again once
    // the definitions are in, as well as each second.
    let budgets = move || {
        let specs = specs.get();
        frames
            .latest()
            .map(|f| {
                f.limits
                    .iter()
                    .filter_map(|(name, u)| {
                        let spec = specs.get(name).cloned().unwrap_or_default();
                        Some((name.clone(), u.spend.clone()?, spec))
                    })
                    .collect::<Vec<(String, SpendReport, BudgetSpec)>>()
            })
            .unwrap_or_default()
    };
    let tree = move || {
        let frame = frames.latest()?;
        let spends = frame
            .limits
            .iter()
            .filter_map(|(name, u)| Some((name.clone(), u.spend.clone()?)))
            .collect();
        let roots = policies.with(|p| budget_tree(p, &spends));
        Some(specs.with(|s| tree_view(roots, s, frame.at_ms)))
    };
    view! {
        <Show when=move || !budgets().is_empty()>
            <section id="live-budgets">
                <h2>"Budgets"</h2>
                <p class="legend">"Limits of an hour or longer: spent this period against the budget (the Envoys' added up; a keyed one's per key), its warning lines, and a 30-day month at the last minute's pace."</p>
                {tree}
                <For each=budgets key=|(n, s, spec)| (n.clone(), format!("{s:?} {spec:?}")) children=move |(name, spend, spec)| {
                    let pace_name = name.clone();
                    let month = frames.0.with(|all| {
                        month_projection(
                            all.iter()
                                .rev()
                                .take(PACE_FRAMES)
                                .filter_map(|f| f.limits.get(&pace_name))
                                .map(|u| u.counts.per_s(LimitCounter::Tokens)),
                        )
                    });
                    let at_ms = frames.latest().map_or(0, |f| f.at_ms);
                    let keyed = !spend.keys.is_empty() || spend.spending_keys > 0;
                    let whole = used(spend.spent, spend.size);
                    let warn_text = if spec.warn_at.is_empty() {
                        "—".to_string()
                    } else {
                        spec.warn_at.iter().map(|l| percent(*l)).collect::<Vec<_>>().join(", ")
                    };
                    let key_rows = spend
                        .keys
                        .iter()
                        .map(|k| {
                            let share = used(k.spent, k.size);
                            view! {
                                <tr class="budget-key" data-key=k.label.clone()>
                                    <td class="key-label">{k.label.clone()}</td>
                                    <td class="key-spent">{spec.amount(k.spent)}</td>
                                    <td class="key-size">{spec.amount(k.size)}</td>
                                    <td class="key-share">{percent(share)}" "{bar(share, &spec)}</td>
                                </tr>
                            }
                        })
                        .collect_view();
                    view! {
                        <div class="live-budget" data-limit=name.clone()>
                            <h3>{name.clone()}</h3>
                            <p class="figures">
                                "Spent "<span class="spent">{spec.amount(spend.spent)}</span>
                                {if keyed {
                                    view! { " by "<span class="spending-keys">{spend.spending_keys}</span>" keys, each of "<span class="budget-size">{spec.amount(spend.size)}</span> }.into_any()
                                } else {
                                    view! { " of "<span class="budget-size">{spec.amount(spend.size)}</span>" ("<span class="spent-share">{percent(whole)}</span>") "{bar(whole, &spec)} }.into_any()
                                }}
                                " · warn at "<span class="warn-lines">{warn_text}</span>
                                " · renews in "<span class="renews-in">{if spend.renews_in_ms > 0 { renews_in(spend.renews_in_ms) } else { "—".to_string() }}</span>
                                {spec.renews_at(at_ms, spend.renews_in_ms).map(|at| view! { " (at "<span class="renews-at">{at}</span>")" })}
                                " · a month at this pace "<span class="month-projection">{spec.amount_f(month)}</span>
                            </p>
                            {keyed.then(|| view! {
                                <table class="budget-keys">
                                    <thead><tr><th>"Key"</th><th>"Spent"</th><th>"Of"</th><th>"Used"</th></tr></thead>
                                    <tbody>{key_rows}</tbody>
                                </table>
                            })}
                        </div>
                    }
                }/>
            </section>
        </Show>
    }
}
