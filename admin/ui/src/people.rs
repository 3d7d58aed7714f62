//! The People page (admins): users with their roles, API tokens with their
//! scope and expiry; add, change, remove, create (the token shown once),
//! revoke.

use leptos::prelude::*;
use leptos::task::spawn_local;
use serde_json::json;
use sluice_api::people::{
    CreatedToken, NewToken, NewUser, Role, TokenInfo, TokenList, TokenScope, UserInfo, UserList,
};

use crate::api::{self, ApiError};
use crate::session::Session;

fn field_errors(e: &ApiError) -> String {
    e.to_string()
}

#[component]
pub fn PeoplePage() -> impl IntoView {
    let session = expect_context::<Session>();
    view! {
        <Show when=move || session.can_administer() fallback=|| view! {
            <h1>"People"</h1>
            <p class="read-only" id="people-admins-only">"Managing users and API tokens takes an admin."</p>
        }>
            <People/>
        </Show>
    }
}

#[component]
fn People() -> impl IntoView {
    let session = expect_context::<Session>();
    let users = RwSignal::new(Vec::<UserInfo>::new());
    let tokens = RwSignal::new(Vec::<TokenInfo>::new());
    let now_ms = RwSignal::new(0u64);
    let message = RwSignal::new(None::<String>);
    let reload = move || {
        spawn_local(async move {
            match api::get::<UserList>("/api/v1/users").await {
                Ok(list) => users.set(list.users),
                Err(e) => {
                    session.check(&e);
                    message.set(Some(e.to_string()));
                }
            }
            match api::get::<TokenList>("/api/v1/tokens").await {
                Ok(list) => {
                    now_ms.set(list.now_ms);
                    tokens.set(list.tokens);
                }
                Err(e) => message.set(Some(e.to_string())),
            }
        });
    };
    reload();

    // Adding a user.
    let new_name = RwSignal::new(String::new());
    let new_role = RwSignal::new(Role::Viewer);
    let new_password = RwSignal::new(String::new());
    let add_user = move |ev: leptos::ev::SubmitEvent| {
        ev.prevent_default();
        let request = NewUser {
            name: new_name.get_untracked().trim().to_string(),
            role: new_role.get_untracked(),
            password: new_password.get_untracked(),
        };
        let csrf = session.csrf();
        spawn_local(async move {
            match api::post::<_, UserInfo>("/api/v1/users", &csrf, &request).await {
                Ok(user) => {
                    message.set(Some(format!("Added {} as {}.", user.name, user.role)));
                    new_name.set(String::new());
                    new_password.set(String::new());
                    reload();
                }
                Err(e) => message.set(Some(format!("Not added: {}", field_errors(&e)))),
            }
        });
    };

    // Creating a token.
    let token_name = RwSignal::new(String::new());
    let token_scope = RwSignal::new(TokenScope::Read);
    let token_expiry = RwSignal::new("90d".to_string());
    let created = RwSignal::new(None::<String>);
    let create_token = move |ev: leptos::ev::SubmitEvent| {
        ev.prevent_default();
        let request = NewToken {
            name: token_name.get_untracked().trim().to_string(),
            scope: token_scope.get_untracked(),
            expires_in: Some(token_expiry.get_untracked()),
        };
        let csrf = session.csrf();
        spawn_local(async move {
            match api::post::<_, CreatedToken>("/api/v1/tokens", &csrf, &request).await {
                Ok(answer) => {
                    created.set(Some(answer.token));
                    message.set(Some(format!(
                        "Token {} created: copy it now, it is not shown again.",
                        answer.info.name
                    )));
                    token_name.set(String::new());
                    reload();
                }
                Err(e) => message.set(Some(format!("Not created: {}", field_errors(&e)))),
            }
        });
    };

    let set_role = move |name: String, role: Role| {
        let csrf = session.csrf();
        spawn_local(async move {
            let path = format!("/api/v1/users/{name}");
            match api::patch::<_, UserInfo>(&path, &csrf, &json!({ "role": role })).await {
                Ok(user) => message.set(Some(format!("{} is now {}.", user.name, user.role))),
                Err(e) => message.set(Some(format!("Not changed: {e}"))),
            }
            reload();
        });
    };
    let remove_user = move |name: String| {
        let csrf = session.csrf();
        spawn_local(async move {
            match api::remove(&format!("/api/v1/users/{name}"), &csrf).await {
                Ok(()) => message.set(Some(format!("Removed {name}."))),
                Err(e) => message.set(Some(format!("Not removed: {e}"))),
            }
            reload();
        });
    };
    let revoke = move |id: String| {
        let csrf = session.csrf();
        spawn_local(async move {
            match api::remove(&format!("/api/v1/tokens/{id}"), &csrf).await {
                Ok(()) => message.set(Some(format!("Revoked token {id}."))),
                Err(e) => message.set(Some(format!("Not revoked: {e}"))),
            }
            reload();
        });
    };

    let role_options = move |selected: Role| {
        Role::ALL
            .into_iter()
            .map(|r| {
                view! { <option value=r.as_str() selected=r == selected title=r.describe()>{r.as_str()}</option> }
            })
            .collect_view()
    };

    view! {
        <h1>"People"</h1>
        <p class="message" id="people-message">{move || message.get()}</p>
        <h2>"Users"</h2>
        <table id="users">
            <thead><tr><th>"Name"</th><th>"Role"</th><th>"Added by"</th><th></th></tr></thead>
            <tbody>
                <For each=move || users.get() key=|u| (u.name.clone(), u.role) children=move |u| {
                    let (n1, n2) = (u.name.clone(), u.name.clone());
                    view! {
                        <tr class="user-row" data-user=u.name.clone()>
                            <td>{u.name.clone()}</td>
                            <td>
                                <select class="user-role" on:change=move |ev| {
                                    if let Ok(role) = event_target_value(&ev).parse::<Role>() {
                                        set_role(n1.clone(), role);
                                    }
                                }>{role_options(u.role)}</select>
                            </td>
                            <td>{u.created_by.clone()}</td>
                            <td><button type="button" class="remove-user" on:click=move |_| remove_user(n2.clone())>"Remove"</button></td>
                        </tr>
                    }
                }/>
            </tbody>
        </table>
        <form id="add-user" on:submit=add_user>
            <h3>"Add a user"</h3>
            <label class="field"><span>"Name (letters, digits, . _ - @ +)"</span>
                <input id="new-user-name" prop:value=move || new_name.get()
                    on:input=move |ev| new_name.set(event_target_value(&ev))/></label>
            <label class="field"><span>"Role"</span>
                <select id="new-user-role" on:change=move |ev| {
                    if let Ok(role) = event_target_value(&ev).parse::<Role>() { new_role.set(role); }
                }>{move || role_options(new_role.get())}</select>
                <span class="help">{move || new_role.get().describe()}</span></label>
            <label class="field"><span>"Password (12 characters or more)"</span>
                <input id="new-user-password" type="password" autocomplete="new-password"
                    prop:value=move || new_password.get()
                    on:input=move |ev| new_password.set(event_target_value(&ev))/></label>
            <button id="add-user-button" type="submit">"Add"</button>
        </form>

        <h2>"API tokens"</h2>
        <p>"For scripts and CI: send " <code>"Authorization: Bearer <token>"</code>
           ". Read tokens act as a viewer, write tokens as an editor; no token manages people."</p>
        <table id="tokens">
            <thead><tr><th>"Name"</th><th>"Id"</th><th>"Scope"</th><th>"Created by"</th><th>"Expires in"</th><th>"Last used"</th><th></th></tr></thead>
            <tbody>
                <For each=move || tokens.get() key=|t| t.id.clone() children=move |t| {
                    let id = t.id.clone();
                    let left = t.expires_ms.saturating_sub(now_ms.get_untracked());
                    let expires = if left == 0 { "expired".to_string() } else { format!("{:.1} days", left as f64 / 86_400_000.0) };
                    let used = t.last_used_ms.map_or("never".to_string(), |at| {
                        format!("{:.0} min ago", now_ms.get_untracked().saturating_sub(at) as f64 / 60_000.0)
                    });
                    view! {
                        <tr class="token-row" data-token=t.name.clone()>
                            <td>{t.name.clone()}</td>
                            <td><code>{t.id.clone()}</code></td>
                            <td>{t.scope.as_str()}</td>
                            <td>{t.created_by.clone()}</td>
                            <td>{expires}</td>
                            <td>{used}</td>
                            <td><button type="button" class="revoke-token" on:click=move |_| revoke(id.clone())>"Revoke"</button></td>
                        </tr>
                    }
                }/>
            </tbody>
        </table>
        <form id="create-token" on:submit=create_token>
            <h3>"Create a token"</h3>
            <label class="field"><span>"Name"</span>
                <input id="new-token-name" prop:value=move || token_name.get()
                    on:input=move |ev| token_name.set(event_target_value(&ev))/></label>
            <label class="field"><span>"Scope"</span>
                <select id="new-token-scope" on:change=move |ev| {
                    if let Ok(scope) = event_target_value(&ev).parse::<TokenScope>() { token_scope.set(scope); }
                }>
                    <option value="read" selected=true>"read (as a viewer)"</option>
                    <option value="write">"write (as an editor)"</option>
                </select></label>
            <label class="field"><span>"Expires after"</span>
                <select id="new-token-expiry" on:change=move |ev| token_expiry.set(event_target_value(&ev))>
                    <option value="1d">"1 day"</option>
                    <option value="30d">"30 days"</option>
                    <option value="90d" selected=true>"90 days"</option>
                    <option value="366d">"1 year"</option>
                </select></label>
            <button id="create-token-button" type="submit">"Create"</button>
        </form>
        <Show when=move || created.get().is_some()>
            <p class="token-once">"Your token (shown once): " <code id="new-token-secret">{move || created.get().unwrap_or_default()}</code></p>
        </Show>
    }
}
