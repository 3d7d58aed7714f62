//! The pages: login, policies, policy editor, prices, live view, fleet (global
//! policies' shares), audit log, instances, people; and what they share
//! (the shell with its navigation, a flash message, a bar).

mod audit;
mod editor;
mod fleet;
mod instances;
mod live_view;
mod login;
mod policies;
mod prices;

use leptos::prelude::*;
use leptos::task::spawn_local;
use leptos_router::components::{Route, Router, Routes, A};
use leptos_router::path;
use serde_json::json;
use sluice_api::SessionInfo;

use crate::api;
use crate::live;
use crate::session::Session;

use audit::AuditPage;
use editor::{EditPolicyPage, NewPolicyPage};
use fleet::FleetPage;
use instances::InstancesPage;
use live_view::LivePage;
use login::Login;
use policies::PoliciesPage;
use prices::PricesPage;

#[component]
pub fn App() -> impl IntoView {
    let session = Session(RwSignal::new(None));
    let checked = RwSignal::new(false);
    provide_context(session);
    spawn_local(async move {
        if let Ok(info) = api::get::<SessionInfo>("/api/v1/session").await {
            session.0.set(Some(info));
        }
        checked.set(true);
    });
    view! {
        <Show when=move || checked.get() fallback=|| view! { <p class="loading">"Loading…"</p> }>
            <Show when=move || session.0.with(Option::is_some) fallback=Login>
                <Shell/>
            </Show>
        </Show>
    }
}

/// A message that survives one navigation ("Saved ..." after creating).
#[derive(Clone, Copy)]
struct Flash(RwSignal<Option<String>>);

#[component]
fn Shell() -> impl IntoView {
    let session = expect_context::<Session>();
    provide_context(live::connect());
    provide_context(Flash(RwSignal::new(None)));
    let logout = move |_| {
        let csrf = session.csrf();
        spawn_local(async move {
            let _ = api::post::<_, ()>("/api/v1/logout", &csrf, &json!({})).await;
            session.0.set(None);
        });
    };
    let insecure = move || {
        session
            .0
            .with(|s| s.as_ref().is_some_and(|s| s.insecure_dev))
    };
    view! {
        <Router>
            <header>
                <span class="brand">"Sluice"</span>
                <nav>
                    <A href="/">"Policies"</A>
                    <A href="/prices">"Prices"</A>
                    <A href="/live">"Live"</A>
                    <A href="/fleet">"Fleet"</A>
                    <A href="/instances">"Instances"</A>
                    <A href="/audit">"Audit log"</A>
                    <Show when=move || session.can_administer()>
                        <A href="/people"><span id="people-link">"People"</span></A>
                    </Show>
                </nav>
                <span class="user" id="who">{move || session.0.with(|s| s.as_ref().map(|s| format!("{} ({})", s.user, s.role)).unwrap_or_default())}</span>
                <button id="logout" on:click=logout>"Log out"</button>
            </header>
            <Show when=insecure>
                <p class="warning">"--insecure-dev: no login is required. Local trial only."</p>
            </Show>
            <main>
                <Routes fallback=|| view! { <p>"Not found."</p> }>
                    <Route path=path!("/") view=PoliciesPage/>
                    <Route path=path!("/policies/new") view=NewPolicyPage/>
                    <Route path=path!("/policies/:name") view=EditPolicyPage/>
                    <Route path=path!("/prices") view=PricesPage/>
                    <Route path=path!("/live") view=LivePage/>
                    <Route path=path!("/fleet") view=FleetPage/>
                    <Route path=path!("/fleet/:name") view=FleetPage/>
                    <Route path=path!("/instances") view=InstancesPage/>
                    <Route path=path!("/audit") view=AuditPage/>
                    <Route path=path!("/people") view=crate::people::PeoplePage/>
                </Routes>
            </main>
        </Router>
    }
}

/// A horizontal bar: `value` of `max`, as SVG (no inline styles: the CSP
/// allows none).
#[component]
fn Bar(
    #[prop(into)] value: Signal<f64>,
    #[prop(into)] max: Signal<f64>,
    #[prop(into)] label: Signal<String>,
) -> impl IntoView {
    let width = move || {
        let m = max.get();
        if m <= 0.0 {
            0.0
        } else {
            (value.get() / m).clamp(0.0, 1.0) * 120.0
        }
    };
    view! {
        <span class="bar">
            <svg width="120" height="10" viewBox="0 0 120 10">
                <rect class="bar-bg" x="0" y="0" width="120" height="10"></rect>
                <rect class="bar-fg" x="0" y="0" width=move || format!("{:.1}", width()) height="10"></rect>
            </svg>
            <span class="bar-label">{move || label.get()}</span>
        </span>
    }
}
