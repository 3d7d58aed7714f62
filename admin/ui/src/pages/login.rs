//! The login page.

use leptos::prelude::*;
use leptos::task::spawn_local;
use sluice_api::{LoginRequest, SessionInfo};

use crate::api::{self, ApiError};
use crate::session::Session;

#[component]
pub(super) fn Login() -> impl IntoView {
    let session = expect_context::<Session>();
    let user = RwSignal::new(String::new());
    let password = RwSignal::new(String::new());
    let error = RwSignal::new(None::<String>);
    let submit = move |ev: leptos::ev::SubmitEvent| {
        ev.prevent_default();
        let pw = password.get_untracked();
        let name = user.get_untracked().trim().to_string();
        spawn_local(async move {
            let login = LoginRequest {
                user: (!name.is_empty()).then_some(name),
                password: pw,
            };
            match api::post::<_, SessionInfo>("/api/v1/login", "", &login).await {
                Ok(info) => session.0.set(Some(info)),
                Err(ApiError::Unauthorized) => {
                    error.set(Some("Wrong user name or password.".into()))
                }
                Err(e) => error.set(Some(e.to_string())),
            }
        });
    };
    view! {
        <main class="login">
            <h1>"Sluice"</h1>
            <form id="login" on:submit=submit>
                <label>"User (empty: admin)"
                    <input id="user" autocomplete="username"
                        prop:value=move || user.get()
                        on:input=move |ev| user.set(event_target_value(&ev))/>
                </label>
                <label>"Password"
                    <input id="password" type="password" autocomplete="current-password"
                        prop:value=move || password.get()
                        on:input=move |ev| password.set(event_target_value(&ev))/>
                </label>
                <button id="login-button" type="submit">"Log in"</button>
                <p class="error" id="login-error">{move || error.get()}</p>
            </form>
        </main>
    }
}
