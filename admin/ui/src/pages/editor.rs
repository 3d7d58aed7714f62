//! Creating and editing a policy: every field as an input, the server's
//! validation shown under the field it names.

use leptos::prelude::*;
use leptos::task::spawn_local;
use leptos_router::hooks::{use_navigate, use_params_map};
use serde_json::{json, Value};
use sluice_api::{PolicyList, StoredPolicy, Validated};

use crate::api::{self, ApiError, FieldError};
use crate::fields::{FIELDS, LIMIT_FIELDS};
use crate::form::{self, Kind};
use crate::session::Session;

use super::Flash;

#[component]
pub(super) fn NewPolicyPage() -> impl IntoView {
    view! { <Editor name=None/> }
}

#[component]
pub(super) fn EditPolicyPage() -> impl IntoView {
    let params = use_params_map();
    view! {
        {move || {
            let name = params.read().get("name");
            view! { <Editor name=name/> }
        }}
    }
}

/// Whether an error at `error_pointer` belongs to the input at `pointer`
/// (a list's items belong to the list's input).
fn belongs_to(error_pointer: &str, pointer: &str) -> bool {
    error_pointer == pointer
        || error_pointer
            .strip_prefix(pointer)
            .is_some_and(|rest| rest.starts_with('/'))
}

/// Whether an error is shown under one of the further limits' inputs.
fn is_limit_field(error_pointer: &str) -> bool {
    let Some(rest) = error_pointer.strip_prefix("/limits/") else {
        return false;
    };
    let sub = rest.find('/').map_or("", |i| &rest[i..]);
    LIMIT_FIELDS.iter().any(|f| belongs_to(sub, f.1))
}

/// A field's input: a select of its words for a choice (the first option,
/// empty, leaves the field out), otherwise a text input. `on_text` gets the
/// text when it changes.
fn field_input(
    id: String,
    name: String,
    kind: Kind,
    text: impl Fn() -> String + Send + Sync + Clone + 'static,
    on_text: impl Fn(String) + 'static,
) -> AnyView {
    match kind {
        Kind::Flag => field_input(id, name, Kind::Choice(form::FLAGS), text, on_text),
        Kind::Choice(words) => {
            let options = words
                .iter()
                .map(|w| {
                    let text = text.clone();
                    view! { <option value=*w selected=move || text() == *w>{*w}</option> }
                })
                .collect_view();
            view! {
                <select id=id name=name on:change=move |ev| on_text(event_target_value(&ev))>
                    <option value="" selected={ let text = text.clone(); move || text().is_empty() }>"(default)"</option>
                    {options}
                </select>
            }
            .into_any()
        }
        // Lists are taken whole when the field is left (a trailing comma
        // mid-typing is not an item); other fields as they are typed.
        Kind::List | Kind::Numbers | Kind::Weighted | Kind::Headers => view! {
            <input id=id name=name prop:value=text on:change=move |ev| on_text(event_target_value(&ev))/>
        }
        .into_any(),
        // Also on change: clearing a field (a script, an autofill) may fire
        // no input event.
        _ => {
            let on_text = std::rc::Rc::new(on_text);
            let on_change = on_text.clone();
            view! {
                <input id=id name=name prop:value=text
                    on:input=move |ev| on_text(event_target_value(&ev))
                    on:change=move |ev| on_change(event_target_value(&ev))/>
            }
            .into_any()
        }
    }
}

fn field_id(pointer: &str) -> String {
    format!("field{}", pointer.replace('/', "-"))
}

#[component]
fn Editor(name: Option<String>) -> impl IntoView {
    let session = expect_context::<Session>();
    let navigate = use_navigate();
    let is_new = name.is_none();
    let policy = RwSignal::new(json!({"name": "", "match": {"host": ""}}));
    let version = RwSignal::new(0u64);
    let errors = RwSignal::new(Vec::<FieldError>::new());
    let flash = expect_context::<Flash>();
    let message = RwSignal::new(flash.0.get_untracked());
    flash.0.set(None);
    let conflict = RwSignal::new(None::<u64>);
    let json_text = RwSignal::new(String::new());
    // Policies managed from a directory are read only here.
    let managed_from = RwSignal::new(None::<String>);
    spawn_local(async move {
        if let Ok(list) = api::get::<PolicyList>("/api/v1/policies").await {
            managed_from.set(list.managed.map(|m| m.dir));
        }
    });
    let editable = move || session.can_edit() && managed_from.with(Option::is_none);

    let load = {
        let name = name.clone();
        move || {
            let Some(name) = name.clone() else { return };
            spawn_local(async move {
                match api::get::<StoredPolicy>(&format!("/api/v1/policies/{name}")).await {
                    Ok(stored) => {
                        policy.set(serde_json::to_value(&stored.policy).unwrap_or(Value::Null));
                        version.set(stored.version);
                        conflict.set(None);
                        errors.set(Vec::new());
                    }
                    Err(e) => {
                        session.check(&e);
                        message.set(Some(e.to_string()));
                    }
                }
            });
        }
    };
    load();
    Effect::new(move |_| {
        json_text.set(serde_json::to_string_pretty(&policy.get()).unwrap_or_default());
    });

    // Ask the server after every change: its messages show under the fields.
    // Checked as you type: only the answer to the latest check is shown
    // (answers to earlier keystrokes may arrive after it).
    let checks = StoredValue::new(0u64);
    let validate = move || {
        let p = policy.get_untracked();
        let csrf = session.csrf();
        checks.update_value(|n| *n += 1);
        let this = checks.get_value();
        spawn_local(async move {
            let answer = api::post::<_, Validated>("/api/v1/validate", &csrf, &p).await;
            if checks.get_value() != this {
                return;
            }
            match answer {
                Ok(_) => errors.set(Vec::new()),
                Err(ApiError::Invalid(list)) => errors.set(list),
                Err(e) => session.check(&e),
            }
        });
    };
    let error_for = move |pointer: String| {
        move || {
            errors.with(|list| {
                list.iter()
                    .filter(|e| belongs_to(&form::error_path_to_pointer(&e.path), &pointer))
                    .map(|e| e.message.clone())
                    .collect::<Vec<_>>()
                    .join("; ")
            })
        }
    };
    let other_errors = move || {
        errors.with(|list| {
            list.iter()
                .filter(|e| {
                    let p = form::error_path_to_pointer(&e.path);
                    p != "/name" && !FIELDS.iter().any(|f| f.2 == p) && !is_limit_field(&p)
                })
                .map(|e| format!("{}: {}", e.path, e.message))
                .collect::<Vec<_>>()
        })
    };

    let save = {
        let navigate = navigate.clone();
        move |ev: leptos::ev::SubmitEvent| {
            ev.prevent_default();
            let p = policy.get_untracked();
            let csrf = session.csrf();
            let v = version.get_untracked();
            let navigate = navigate.clone();
            spawn_local(async move {
                let name = form::text_of(&p, "/name");
                let result = if is_new {
                    api::post::<_, StoredPolicy>("/api/v1/policies", &csrf, &p).await
                } else {
                    api::put::<_, StoredPolicy>(&format!("/api/v1/policies/{name}"), &csrf, v, &p)
                        .await
                };
                match result {
                    Ok(stored) => {
                        version.set(stored.version);
                        errors.set(Vec::new());
                        message.set(Some(format!(
                            "Saved {name} (version {}). Envoys pick it up on their next sync.",
                            version.get_untracked()
                        )));
                        if is_new {
                            flash.0.set(message.get_untracked());
                            navigate(&format!("/policies/{name}"), Default::default());
                        }
                    }
                    Err(ApiError::Invalid(list)) => {
                        message.set(Some("Not saved: fix the fields marked below.".into()));
                        errors.set(list);
                    }
                    Err(ApiError::Stale { current_version }) => {
                        conflict.set(Some(current_version));
                        message.set(None);
                    }
                    Err(e) => {
                        session.check(&e);
                        message.set(Some(format!("Not saved: {e}")));
                    }
                }
            });
        }
    };
    let delete = {
        let navigate = navigate.clone();
        move |_| {
            let p = policy.get_untracked();
            let csrf = session.csrf();
            let v = version.get_untracked();
            let navigate = navigate.clone();
            spawn_local(async move {
                let name = form::text_of(&p, "/name");
                match api::delete(&format!("/api/v1/policies/{name}"), &csrf, v).await {
                    Ok(_) => navigate("/", Default::default()),
                    Err(ApiError::Stale { current_version }) => conflict.set(Some(current_version)),
                    Err(e) => message.set(Some(format!("Not deleted: {e}"))),
                }
            });
        }
    };
    let reload = load.clone();

    let mut section = "";
    let mut rows = Vec::new();
    for (group, label, pointer, kind) in FIELDS.iter().copied() {
        if group != section {
            section = group;
            rows.push(view! { <h3>{group}</h3> }.into_any());
        }
        let id = field_id(pointer);
        let input = field_input(
            id.clone(),
            pointer.to_string(),
            kind,
            move || form::text_of(&policy.get(), pointer),
            move |text| {
                policy.update(|p| form::set(p, pointer, form::parse_input(kind, &text)));
                validate();
            },
        );
        rows.push(
            view! {
                <label class="field">
                    <span>{label}</span>
                    {input}
                    <span class="help">{form::help(pointer)}</span>
                    <span class="field-error" id=format!("{id}-error")>{error_for(pointer.to_string())}</span>
                </label>
            }
            .into_any(),
        );
    }

    // Further limits: a group of inputs for each, redrawn when one is
    // added or removed.
    let limit_count = Memo::new(move |_| {
        policy.with(|p| {
            p.get("limits")
                .and_then(Value::as_array)
                .map_or(0, Vec::len)
        })
    });
    let limit_groups = move || {
        (0..limit_count.get())
            .map(|index| {
                let inputs = LIMIT_FIELDS
                    .iter()
                    .copied()
                    .map(|(label, sub, kind)| {
                        let pointer = format!("/limits/{index}{sub}");
                        let id = field_id(&pointer);
                        let shown = pointer.clone();
                        let input = field_input(
                            id.clone(),
                            pointer.clone(),
                            kind,
                            move || form::text_of(&policy.get(), &shown),
                            move |text| {
                                policy.update(|p| form::set_limit_field(p, index, sub, form::parse_input(kind, &text)));
                                validate();
                            },
                        );
                        view! {
                            <label class="field">
                                <span>{label}</span>
                                {input}
                                <span class="help">{form::help(sub)}</span>
                                <span class="field-error" id=format!("{id}-error")>{error_for(pointer)}</span>
                            </label>
                        }
                    })
                    .collect_view();
                view! {
                    <fieldset class="limit" id=format!("limit-{index}")>
                        <legend>{format!("Further limit {}", index + 1)}</legend>
                        {inputs}
                        <button type="button" id=format!("remove-limit-{index}")
                            on:click=move |_| { policy.update(|p| form::remove_limit(p, index)); validate(); }>
                            "Remove this limit"
                        </button>
                    </fieldset>
                }
            })
            .collect_view()
    };

    view! {
        <h1>{if is_new { "New policy".to_string() } else { format!("Policy {}", name.clone().unwrap_or_default()) }}</h1>
        <form id="policy-form" on:submit=save>
            <label class="field">
                <span>"Name"</span>
                <input id="field-name" prop:value=move || form::text_of(&policy.get(), "/name") prop:readonly=!is_new
                    on:change=move |ev| {
                        let text = event_target_value(&ev);
                        policy.update(|p| form::set(p, "/name", Some(Value::String(text.trim().to_string()))));
                        validate();
                    }/>
                <span class="field-error" id="field-name-error">{error_for("/name".to_string())}</span>
            </label>
            {rows}
            <h3>"Further limits (all must let a call through; costs may come from the response)"</h3>
            {limit_groups}
            <button type="button" id="add-limit"
                on:click=move |_| { policy.update(form::add_limit); validate(); }>"Add a limit"</button>
            <h3>"As JSON (every field, e.g. match.headers)"</h3>
            <textarea id="policy-json" rows="12" prop:value=move || json_text.get()
                on:change=move |ev| {
                    let text = event_target_value(&ev);
                    match serde_json::from_str::<Value>(&text) {
                        Ok(v) => { policy.set(v); validate(); }
                        Err(e) => errors.set(vec![FieldError { path: "(json)".into(), message: e.to_string() }]),
                    }
                }></textarea>
            <ul class="errors" id="other-errors">
                <For each=other_errors key=|e| e.clone() children=|e| view! { <li>{e}</li> }/>
            </ul>
            <Show when=move || conflict.get().is_some()>
                <p class="conflict" id="conflict">
                    {move || format!("Someone saved this policy since you opened it (now version {}). Your edit was not saved.", conflict.get().unwrap_or(0))}
                    <button type="button" id="reload" on:click={ let reload = reload.clone(); move |_| reload() }>"Load their version"</button>
                </p>
            </Show>
            <p class="message" id="message">{move || message.get()}</p>
            <Show when=editable fallback=move || view! {
                <p class="read-only" id="read-only">{move || match managed_from.get() {
                    Some(dir) => format!("Read only: managed from {dir} (policies as code); change the files there."),
                    None => "Read only: changing policies takes an editor.".to_string(),
                }}</p>
            }>
                <button id="save" type="submit">"Save"</button>
            </Show>
            <Show when=move || !is_new && editable()>
                <button id="delete" type="button" on:click=delete.clone()>"Delete"</button>
            </Show>
        </form>
    }
}
