//! The policy list with each policy's latest second.

use leptos::prelude::*;
use leptos::task::spawn_local;
use leptos_router::components::A;
use sluice_api::{ManagedState, PolicyList, StoredPolicy};
use sluice_shared::{Mode, Scope};
use sluice_wire::stats::PolicyCounter;

use crate::api;
use crate::form;
use crate::live::{LiveFrames, Utilization};
use crate::session::Session;

use super::Bar;

#[component]
pub(super) fn PoliciesPage() -> impl IntoView {
    let session = expect_context::<Session>();
    let frames = expect_context::<LiveFrames>();
    let policies = RwSignal::new(Vec::<StoredPolicy>::new());
    let set_version = RwSignal::new(0u64);
    let managed = RwSignal::new(None::<ManagedState>);
    let error = RwSignal::new(None::<String>);
    let load = move || {
        spawn_local(async move {
            match api::get::<PolicyList>("/api/v1/policies").await {
                Ok(list) => {
                    set_version.set(list.version);
                    managed.set(list.managed);
                    policies.set(list.policies);
                }
                Err(e) => {
                    session.check(&e);
                    error.set(Some(e.to_string()));
                }
            }
        });
    };
    load();
    // Moves a policy one place up (-1) or down (+1): evaluation order is
    // first match wins, so a specific policy goes before a wildcard.
    let shift = move |name: String, by: isize| {
        let mut names: Vec<String> =
            policies.with_untracked(|p| p.iter().map(|s| s.policy.name.clone()).collect());
        let Some(at) = names.iter().position(|n| *n == name) else {
            return;
        };
        let to = at as isize + by;
        if to < 0 || to as usize >= names.len() {
            return;
        }
        names.swap(at, to as usize);
        let csrf = session.csrf();
        let expected = set_version.get_untracked();
        spawn_local(async move {
            let order = sluice_api::PolicyOrder { names };
            match api::put::<_, ()>("/api/v1/order", &csrf, expected, &order).await {
                Ok(()) => error.set(None),
                Err(e) => error.set(Some(format!("Not moved: {e}"))),
            }
            load();
        });
    };
    let editable = move || session.can_edit() && managed.with(Option::is_none);
    let latest = move |name: &str| -> Utilization {
        frames
            .0
            .with(|f| f.back().and_then(|fr| fr.policies.get(name).copied()))
            .unwrap_or_default()
    };
    view! {
        <h1>"Policies"</h1>
        <Show when=move || managed.with(Option::is_some)>
            <p class="managed" id="managed">{move || managed.with(|m| m.as_ref().map(|m| format!(
                "Managed from {} (policies as code): change the files there.", m.dir)).unwrap_or_default())}</p>
            <p class="error" id="managed-error">{move || managed.with(|m| m.as_ref().and_then(|m| m.error.clone()).map(|e| format!(
                "The directory's last change was refused; the policies below stay in force. {e}")))}</p>
        </Show>
        <Show when=move || session.can_edit() fallback=|| view! {
            <p class="read-only" id="read-only">"You can watch and read; changing policies takes an editor."</p>
        }>
            <Show when=move || managed.with(Option::is_none)>
                <p><A href="/policies/new"><span id="new-policy">"New policy"</span></A></p>
            </Show>
        </Show>
        <p class="error">{move || error.get()}</p>
        <table id="policies">
            <thead><tr>
                <th>"Name"</th><th>"Match"</th><th>"Rate"</th><th>"Concurrency"</th><th>"Mode"</th>
                <th>"Admitted / s"</th><th>"In flight"</th><th>"From"</th><th>"Order"</th>
            </tr></thead>
            <tbody>
                <For each=move || policies.get() key=|s| (s.policy.name.clone(), s.version) children=move |s| {
                    let p = s.policy;
                    let name = p.name.clone();
                    let href = format!("/policies/{name}");
                    let rate = form::rate_per_second(&p).unwrap_or(0.0);
                    let max_flight = p.concurrency.as_ref().map_or(0.0, |c| f64::from(c.max_in_flight));
                    let n1 = name.clone();
                    let n2 = name.clone();
                    let n3 = name.clone();
                    let n4 = name.clone();
                    let label = name.clone();
                    let (up, down) = (name.clone(), name.clone());
                    let source = s.source.clone().unwrap_or_else(|| "by hand".into());
                    view! {
                        <tr class="policy-row" data-policy=name>
                            <td><A href=href>{label}</A></td>
                            <td>{form::summary_match(&p)}</td>
                            <td>{form::summary_rate(&p)}</td>
                            <td>{form::summary_concurrency(&p)}</td>
                            <td>{match p.mode { Mode::Enforce => "enforce", Mode::Shadow => "shadow" }}
                                {(p.scope == Scope::Global).then(|| {
                                    let fleet = format!("/fleet/{}", p.name);
                                    view! { " · "<A href=fleet><span class="global-link">"global"</span></A> }
                                })}</td>
                            <td><Bar value=Signal::derive(move || latest(&n1).counts.per_s(PolicyCounter::Admitted)) max=Signal::derive(move || rate)
                                label=Signal::derive(move || format!("{:.0}", latest(&n2).counts.per_s(PolicyCounter::Admitted)))/></td>
                            <td><Bar value=Signal::derive(move || latest(&n3).counts.now(PolicyCounter::InFlight) as f64) max=Signal::derive(move || max_flight)
                                label=Signal::derive(move || { let u = latest(&n4); if max_flight > 0.0 { format!("{} / {}", u.counts.now(PolicyCounter::InFlight), max_flight) } else { u.counts.now(PolicyCounter::InFlight).to_string() } })/></td>
                            <td class="policy-source">{source}</td>
                            <td><Show when=editable>
                                <button type="button" class="move-up" title="evaluate earlier" on:click={ let up = up.clone(); move |_| shift(up.clone(), -1) }>"↑"</button>
                                <button type="button" class="move-down" title="evaluate later" on:click={ let down = down.clone(); move |_| shift(down.clone(), 1) }>"↓"</button>
                            </Show></td>
                        </tr>
                    }
                }/>
            </tbody>
        </table>
    }
}
