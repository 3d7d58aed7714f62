//! The audit log.

use leptos::prelude::*;
use leptos::task::spawn_local;
use serde_json::Value;
use sluice_api::AuditLog;

use crate::api;
use crate::session::Session;

#[component]
pub(super) fn AuditPage() -> impl IntoView {
    let session = expect_context::<Session>();
    let entries = RwSignal::new(Vec::<sluice_api::AuditEntry>::new());
    spawn_local(async move {
        match api::get::<AuditLog>("/api/v1/audit?limit=200").await {
            Ok(log) => entries.set(log.entries),
            Err(e) => session.check(&e),
        }
    });
    let show = |v: &Option<Value>| v.as_ref().map(Value::to_string).unwrap_or_default();
    view! {
        <h1>"Audit log"</h1>
        <table id="audit">
            <thead><tr><th>"When (UTC ms)"</th><th>"Who"</th><th>"What"</th><th>"Policy"</th><th>"Before"</th><th>"After"</th></tr></thead>
            <tbody>
                <For each=move || entries.get() key=|e| e.id children=move |e| view! {
                    <tr class="audit-row">
                        <td>{e.at_ms.to_string()}</td>
                        <td>{e.actor.clone()}</td>
                        <td>{e.action.clone()}</td>
                        <td>{e.target.clone()}</td>
                        <td><code>{show(&e.old)}</code></td>
                        <td><code>{show(&e.new)}</code></td>
                    </tr>
                }/>
            </tbody>
        </table>
    }
}
