//! The Envoys seen, and the policy version each runs.

use leptos::prelude::*;
use leptos::task::spawn_local;
use sluice_api::InstanceList;
use sluice_shared::Span;

use crate::api;
use crate::session::Session;

#[component]
pub(super) fn InstancesPage() -> impl IntoView {
    let session = expect_context::<Session>();
    let rows = RwSignal::new(Vec::<sluice_api::Instance>::new());
    let now_ms = RwSignal::new(0u64);
    spawn_local(async move {
        // Page by page: a fleet may have thousands.
        let mut all = Vec::new();
        let mut after = String::new();
        loop {
            let query = [("limit", "1000"), ("after", after.as_str())];
            match api::get_query::<InstanceList>("/api/v1/instances", &query).await {
                Ok(page) => {
                    now_ms.set(page.now_ms);
                    all.extend(page.instances);
                    match page.next {
                        Some(next) => after = next,
                        None => break,
                    }
                }
                Err(e) => {
                    session.check(&e);
                    break;
                }
            }
        }
        rows.set(all);
    });
    view! {
        <h1>"Instances"</h1>
        <table id="instances">
            <thead><tr><th>"Envoy"</th><th>"Status"</th><th>"Last sync"</th><th>"Policy version"</th><th>"Syncs"</th></tr></thead>
            <tbody>
                <For each=move || rows.get() key=|r| r.id.clone() children=move |r| {
                    let ago = Span::from_millis(now_ms.get_untracked().saturating_sub(r.last_sync_ms)).as_secs();
                    view! {
                        <tr class="instance-row">
                            <td>{r.id.clone()}</td>
                            <td>{if r.live { "live" } else { "silent" }}</td>
                            <td>{format!("{ago} s ago")}</td>
                            <td>{r.policy_version.to_string()}</td>
                            <td>{r.syncs.to_string()}</td>
                        </tr>
                    }
                }/>
            </tbody>
        </table>
    }
}
