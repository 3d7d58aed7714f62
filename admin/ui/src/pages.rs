//! The pages: login, policies, policy editor, live view, fleet (global
//! policies' shares), audit log, instances.

use leptos::prelude::*;
use leptos::task::spawn_local;
use leptos_router::components::{Route, Router, Routes, A};
use leptos_router::hooks::{use_navigate, use_params_map};
use leptos_router::path;
use serde_json::{json, Value};
use sluice_shared::api::{
    AuditLog, FleetPolicy, FleetView, InstanceList, LoginRequest, ManagedState, PolicyList,
    SessionInfo, StoredPolicy, Validated,
};
use sluice_shared::duration::DurationMs;
use sluice_shared::people::Role;
use sluice_shared::{Mode, Scope, Span};

use crate::api::{self, ApiError, FieldError};
use crate::form::{self, Kind};
use crate::keys::KeysNow;
use crate::live::{self, LiveFrames, Utilization};

#[derive(Clone, Copy)]
pub(crate) struct Session(pub(crate) RwSignal<Option<SessionInfo>>);

impl Session {
    fn role(&self) -> Role {
        self.0
            .with(|s| s.as_ref().map(|s| s.role).unwrap_or_default())
    }

    pub(crate) fn can_edit(&self) -> bool {
        self.role().can_edit()
    }

    pub(crate) fn can_administer(&self) -> bool {
        self.role().can_administer()
    }

    pub(crate) fn csrf(&self) -> String {
        self.0
            .with_untracked(|s| s.as_ref().map(|s| s.csrf_token.clone()).unwrap_or_default())
    }

    /// A 401 anywhere means the session is over: back to the login page.
    pub(crate) fn check(&self, e: &ApiError) {
        if *e == ApiError::Unauthorized {
            self.0.set(None);
        }
    }
}

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

#[component]
fn Login() -> impl IntoView {
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

#[component]
fn PoliciesPage() -> impl IntoView {
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
            let order = sluice_shared::api::PolicyOrder { names };
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
                            <td><Bar value=Signal::derive(move || latest(&n1).admitted_per_s) max=Signal::derive(move || rate)
                                label=Signal::derive(move || format!("{:.0}", latest(&n2).admitted_per_s))/></td>
                            <td><Bar value=Signal::derive(move || latest(&n3).in_flight as f64) max=Signal::derive(move || max_flight)
                                label=Signal::derive(move || { let u = latest(&n4); if max_flight > 0.0 { format!("{} / {}", u.in_flight, max_flight) } else { u.in_flight.to_string() } })/></td>
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

#[component]
fn NewPolicyPage() -> impl IntoView {
    view! { <Editor name=None/> }
}

#[component]
fn EditPolicyPage() -> impl IntoView {
    let params = use_params_map();
    view! {
        {move || {
            let name = params.read().get("name");
            view! { <Editor name=name/> }
        }}
    }
}

/// Every field of a policy, by JSON pointer.
const FIELDS: &[(&str, &str, &str, Kind)] = &[
    (
        "Match",
        "Host (exact or *.suffix)",
        "/match/host",
        Kind::Text,
    ),
    ("Match", "Path prefix", "/match/path_prefix", Kind::Text),
    (
        "Match",
        "Methods (comma separated)",
        "/match/methods",
        Kind::List,
    ),
    (
        "Match",
        "Headers (name=value, comma separated)",
        "/match/headers",
        Kind::Headers,
    ),
    (
        "Key",
        "Key header (one bucket per value)",
        "/key/header",
        Kind::Text,
    ),
    ("Key", "Max keys", "/key/max_keys", Kind::Number),
    (
        "Key",
        "Past max keys",
        "/key/overflow",
        Kind::Choice(form::OVERFLOWS),
    ),
    (
        "Key",
        "Keys shown in the live view as",
        "/key/label",
        Kind::Choice(form::KEY_LABELS),
    ),
    (
        "Rate",
        "Algorithm",
        "/rate/algorithm",
        Kind::Choice(form::ALGORITHMS),
    ),
    ("Rate", "Requests", "/rate/requests", Kind::Number),
    (
        "Rate",
        "Per period (1s, 1m, 1h or ms)",
        "/rate/period",
        Kind::Duration,
    ),
    ("Rate", "Burst", "/rate/burst", Kind::Number),
    (
        "Rate",
        "Warm-up period",
        "/rate/warmup/period",
        Kind::Duration,
    ),
    (
        "Rate",
        "Warm-up cold factor",
        "/rate/warmup/cold_factor",
        Kind::Number,
    ),
    ("Cost", "Cost header", "/cost/header", Kind::Text),
    ("Cost", "Default cost", "/cost/default", Kind::Number),
    ("Cost", "Max cost", "/cost/max", Kind::Number),
    (
        "Concurrency",
        "Max in flight",
        "/concurrency/max_in_flight",
        Kind::Number,
    ),
    (
        "Concurrency",
        "Lease TTL",
        "/concurrency/lease_ttl",
        Kind::Duration,
    ),
    (
        "Concurrency",
        "Reserved for high priority",
        "/concurrency/reserved_for_high",
        Kind::Number,
    ),
    (
        "Over the limit",
        "Action",
        "/on_limit/action",
        Kind::Choice(form::ACTIONS),
    ),
    ("Over the limit", "Status", "/on_limit/status", Kind::Number),
    ("Over the limit", "Body", "/on_limit/body", Kind::Text),
    (
        "Over the limit",
        "Max wait (queue)",
        "/on_limit/max_wait",
        Kind::Duration,
    ),
    (
        "Over the limit",
        "Max queue",
        "/on_limit/max_queue",
        Kind::Number,
    ),
    (
        "Priority",
        "Priority header",
        "/priority/header",
        Kind::Text,
    ),
    (
        "Priority",
        "Default priority",
        "/priority/default",
        Kind::Choice(form::PRIORITIES),
    ),
    ("Mode", "Mode", "/mode", Kind::Choice(form::MODES)),
    ("Mode", "Scope", "/scope", Kind::Choice(form::SCOPES)),
    (
        "Mode",
        "Share lease (global)",
        "/share_lease",
        Kind::Duration,
    ),
    (
        "Over the limit",
        "RateLimit headers to callers",
        "/ratelimit_headers",
        Kind::Choice(form::RATELIMIT_HEADERS),
    ),
];

/// The fields of one further limit, by pointer below `/limits/<index>`.
const LIMIT_FIELDS: &[(&str, &str, Kind)] = &[
    ("Name (letters, digits, - _ .)", "/name", Kind::Text),
    (
        "Algorithm",
        "/rate/algorithm",
        Kind::Choice(form::ALGORITHMS),
    ),
    ("Requests (or tokens)", "/rate/requests", Kind::Number),
    (
        "Per period (1s, 1m, 1h, 1d or ms; at most 31d)",
        "/rate/period",
        Kind::Duration,
    ),
    ("Burst", "/rate/burst", Kind::Number),
    (
        "Or calls in flight at once (a concurrency limit instead of a rate)",
        "/concurrency/max_in_flight",
        Kind::Number,
    ),
    (
        "Concurrency: a slot not given back returns after (default 5m)",
        "/concurrency/lease_ttl",
        Kind::Duration,
    ),
    (
        "Per key: request header (e.g. authorization)",
        "/key/header",
        Kind::Text,
    ),
    ("Per key: most keys held", "/key/max_keys", Kind::Number),
    (
        "Scope (global: one limit for every Envoy)",
        "/scope",
        Kind::Choice(form::SCOPES),
    ),
    ("Estimate: from request header", "/cost/header", Kind::Text),
    (
        "Estimate: from request JSON field (e.g. max_tokens)",
        "/cost/json",
        Kind::Text,
    ),
    (
        "Estimate: plus (e.g. the prompt)",
        "/cost/plus",
        Kind::Number,
    ),
    ("Estimate: default", "/cost/default", Kind::Number),
    ("Estimate: max", "/cost/max", Kind::Number),
    ("Real cost: response header", "/usage/header", Kind::Text),
    (
        "Real cost: response JSON paths, summed (comma separated)",
        "/usage/json",
        Kind::List,
    ),
    (
        "Real cost: paths in a streamed answer (default: the same)",
        "/usage/events",
        Kind::List,
    ),
    (
        "Real cost: most body bytes read",
        "/usage/max_body_bytes",
        Kind::Number,
    ),
];

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
        Kind::List | Kind::Headers => view! {
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

/// Admitted, rejected and queued per second over the last two minutes,
/// with a time axis, the limit drawn as a line, and the values of the
/// second under the pointer.
#[component]
fn Chart(name: String, #[prop(into)] limit: Signal<Option<f64>>) -> impl IntoView {
    let frames = expect_context::<LiveFrames>();
    const W: f64 = 480.0;
    const H: f64 = 100.0;
    const SPAN: usize = 120;
    // The last SPAN seconds of this policy, oldest first.
    let recent = {
        let name = name.clone();
        move || {
            frames.0.with(|all| {
                all.iter()
                    .rev()
                    .take(SPAN)
                    .rev()
                    .map(|f| f.policies.get(&name).copied().unwrap_or_default())
                    .collect::<Vec<Utilization>>()
            })
        }
    };
    let top = {
        let recent = recent.clone();
        move || {
            recent()
                .iter()
                .map(|u| u.admitted_per_s.max(u.rejected_per_s).max(u.queued_per_s))
                .fold(limit.get().unwrap_or(1.0).max(1.0), f64::max)
                * 1.1
        }
    };
    let y = move |v: f64, top: f64| H - v / top * (H - 20.0);
    let x = move |i: usize, len: usize| (SPAN.saturating_sub(len) + i) as f64 * W / SPAN as f64;
    let limit_y = {
        let top = top.clone();
        move || limit.get().map(|l| format!("{:.1}", y(l, top())))
    };
    let hover = RwSignal::new(None::<f64>);
    let under_pointer = {
        let recent = recent.clone();
        move || {
            let at = hover.get()?;
            let values = recent();
            let slot = (at / W * SPAN as f64) as usize;
            let index = slot.checked_sub(SPAN.saturating_sub(values.len()))?;
            let u = values.get(index)?;
            let ago = values.len().saturating_sub(index + 1);
            Some(format!(
                "{ago} s ago: {:.0} admitted/s, {:.0} rejected/s, {:.0} queued/s",
                u.admitted_per_s, u.rejected_per_s, u.queued_per_s
            ))
        }
    };
    let top_label = {
        let top = top.clone();
        move || format!("{:.0}/s", top() / 1.1)
    };
    let line = |pick: fn(&Utilization) -> f64| {
        let recent = recent.clone();
        let top = top.clone();
        move || {
            let values = recent();
            let top = top();
            values
                .iter()
                .enumerate()
                .map(|(i, u)| format!("{:.1},{:.1}", x(i, values.len()), y(pick(u), top)))
                .collect::<Vec<_>>()
                .join(" ")
        }
    };
    view! {
        <div class="chart-box" data-policy=name.clone()>
            <svg class="chart" width="480" height="114" viewBox="0 0 480 114"
                on:mousemove=move |ev: leptos::ev::MouseEvent| hover.set(Some(f64::from(ev.offset_x())))
                on:mouseleave=move |_| hover.set(None)>
                <rect class="chart-bg" x="0" y="0" width="480" height="100"></rect>
                {move || limit_y().map(|ly| view! {
                    <line class="line-limit" x1="0" x2="480" y1=ly.clone() y2=ly></line>
                })}
                <polyline class="line-admitted" points=line(|u| u.admitted_per_s)></polyline>
                <polyline class="line-rejected" points=line(|u| u.rejected_per_s)></polyline>
                <polyline class="line-queued" points=line(|u| u.queued_per_s)></polyline>
                {move || hover.get().map(|hx| view! {
                    <line class="pointer" x1=format!("{hx:.0}") x2=format!("{hx:.0}") y1="0" y2="100"></line>
                })}
                <text x="4" y="12" class="chart-top">{top_label}</text>
                {move || limit.get().map(|l| view! { <text x="476" y="12" text-anchor="end" class="chart-limit">{format!("limit {l:.0}/s")}</text> })}
                <text x="0" y="112" class="axis">"−120 s"</text>
                <text x="240" y="112" text-anchor="middle" class="axis">"−60 s"</text>
                <text x="480" y="112" text-anchor="end" class="axis">"now"</text>
            </svg>
            <p class="chart-pointer">{under_pointer}</p>
        </div>
    }
}

#[component]
fn LivePage() -> impl IntoView {
    let frames = expect_context::<LiveFrames>();
    // Each policy's rate (per Envoy, or the fleet's for a global one), for
    // the limit line.
    let rates = RwSignal::new(std::collections::BTreeMap::<String, (f64, bool)>::new());
    spawn_local(async move {
        if let Ok(list) = api::get::<PolicyList>("/api/v1/policies").await {
            rates.set(
                list.policies
                    .iter()
                    .filter_map(|s| {
                        let rate = form::rate_per_second(&s.policy)?;
                        Some((
                            s.policy.name.clone(),
                            (rate, s.policy.scope == Scope::Global),
                        ))
                    })
                    .collect(),
            );
        }
    });
    let names = move || {
        frames
            .latest()
            .map(|f| f.policies.keys().cloned().collect::<Vec<_>>())
            .unwrap_or_default()
    };
    view! {
        <h1>"Live"</h1>
        <p class="legend">"Last 2 minutes, per second: "<span class="admitted">"admitted"</span>", "<span class="rejected">"rejected"</span>", "<span class="queued">"queued"</span>", and the "<span class="limit">"limit"</span>" (the policy's rate times the Envoys reporting it). Point at a chart for that second's values."</p>
        <Show when=move || frames.0.with(|f| f.is_empty())>
            <p>"No Envoy has reported yet."</p>
        </Show>
        <For each=names key=|n| n.clone() children=move |name| {
            let n = name.clone();
            let now = Memo::new(move |_| frames.latest().and_then(|f| f.policies.get(&n).copied()).unwrap_or_default());
            let n2 = name.clone();
            let per_instance = move || {
                frames.latest().map(|f| {
                    f.instances.iter().filter_map(|(id, p)| p.get(&n2).map(|u| (id.clone(), *u))).collect::<Vec<_>>()
                }).unwrap_or_default()
            };
            let n3 = name.clone();
            let limit = Signal::derive(move || {
                let (rate, global) = rates.with(|r| r.get(&n3).copied())?;
                if global {
                    return Some(rate);
                }
                let envoys = frames
                    .latest()
                    .map_or(0, |f| f.instances.values().filter(|p| p.contains_key(&n3)).count());
                Some(rate * envoys.max(1) as f64)
            });
            view! {
                <section class="live-policy" data-policy=name.clone()>
                    <h2>{name.clone()}</h2>
                    <Chart name=name.clone() limit=limit/>
                    <p class="figures">
                        <span class="admitted-now">{move || format!("{:.0}", now.get().admitted_per_s)}</span>" admitted/s · "
                        <span class="rejected-now">{move || format!("{:.0}", now.get().rejected_per_s)}</span>" rejected/s · "
                        <span class="shadow-now">{move || format!("{:.0}", now.get().shadow_limited_per_s)}</span>" would have been refused/s (shadow) · "
                        <span class="queued-now">{move || format!("{:.0}", now.get().queued_per_s)}</span>" queued/s · in flight "
                        <span class="in-flight-now">{move || { let u = now.get(); if u.max_in_flight > 0 { format!("{} of {}", u.in_flight, u.max_in_flight) } else { u.in_flight.to_string() } }}</span>
                        " · tokens left "<span class="tokens-now">{move || now.get().tokens.map(|t| t.to_string()).unwrap_or_else(|| "—".into())}</span>
                        " · waiting "{move || now.get().waiting}
                    </p>
                    <Show when=move || { now.get().port_hidden > 0 }>
                        <p class="port-hidden warning">
                            "This policy names a port, but "<span class="port-hidden-count">{move || now.get().port_hidden}</span>
                            " of its calls came without one (the Envoy strips ports before filters run: "
                            <code>"strip_any_host_port"</code>"). They are matched by the host alone, whatever their port."
                        </p>
                    </Show>
                    <table class="per-instance">
                        <thead><tr><th>"Instance"</th><th>"Admitted/s"</th><th>"Rejected/s"</th><th>"Queued/s"</th><th>"In flight"</th><th>"Tokens"</th></tr></thead>
                        <tbody>
                            <For each=per_instance key=|(id, u)| (id.clone(), format!("{u:?}")) children=|(id, u)| view! {
                                <tr><td>{id}</td><td>{format!("{:.0}", u.admitted_per_s)}</td><td>{format!("{:.0}", u.rejected_per_s)}</td>
                                <td>{format!("{:.0}", u.queued_per_s)}</td><td>{u.in_flight}</td><td>{u.tokens.map(|t| t.to_string()).unwrap_or_default()}</td></tr>
                            }/>
                        </tbody>
                    </table>
                    <KeysNow policy=name.clone()/>
                </section>
            }
        }/>
        <LimitsNow/>
        <ProvidersNow/>
    }
}

/// How a pause reads: how long it has left, why, since when, and whose
/// provider began it.
fn describe_pause(p: &sluice_shared::sync::PauseReport, by: Option<&str>) -> String {
    let status = if p.status > 0 {
        format!("the provider answered {}", p.status)
    } else {
        "the provider asked".to_string()
    };
    let whose = match by {
        Some(instance) => format!(" (seen by {instance})"),
        None if p.relayed => " (seen by another Envoy)".to_string(),
        None => String::new(),
    };
    format!(
        "paused {:.1} s more: {status} with a wait {:.1} s ago{whose}",
        p.left_ms as f64 / 1000.0,
        p.ran_ms as f64 / 1000.0
    )
}

/// The further limits that listen to their provider: what the provider
/// says is left beside Sluice's own count, pauses (how long, why), the
/// adapted rate, and over time, each second's calls, the adapted rate,
/// the provider's refusals and pauses.
#[component]
fn ProvidersNow() -> impl IntoView {
    let frames = expect_context::<LiveFrames>();
    let listening = move || {
        frames
            .latest()
            .map(|f| {
                f.limits
                    .iter()
                    .filter_map(|(n, u)| u.provider.clone().map(|p| (n.clone(), u.clone(), p)))
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default()
    };
    let names = move || {
        listening()
            .into_iter()
            .map(|(n, _, _)| n)
            .collect::<Vec<_>>()
    };
    view! {
        <Show when=move || !listening().is_empty()>
            <section id="live-providers">
                <h2>"What the providers say"</h2>
                <p class="legend">"Per second: "<span class="admitted">"let through"</span>", "
                    <span class="adapted">"adapted rate"</span>", "<span class="rejected">"refused by the provider"</span>
                    "; shaded: paused on the provider's word."</p>
                <table class="providers-now">
                    <thead><tr><th>"Limit"</th><th>"Left (Sluice)"</th><th>"Left (provider)"</th><th>"Pause"</th>
                        <th>"Adapted rate"</th><th>"Provider refusals/s"</th><th>"Pauses"</th><th>"Rate cuts"</th></tr></thead>
                    <tbody>
                        <For each=listening key=|(n, u, _)| (n.clone(), format!("{u:?}")) children=|(name, u, p)| {
                            let own = if u.period_ms > 0 {
                                u.requests as f64 * 1000.0 / u.period_ms as f64
                            } else {
                                0.0
                            };
                            view! {
                                <tr class="live-provider" data-limit=name.clone()>
                                    <td>{name.clone()}</td>
                                    <td class="sluice-left">{u.available.map(|a| a.to_string()).unwrap_or_else(|| "—".into())}</td>
                                    <td class="provider-left">{p.remaining.map(|r| match p.limit {
                                        Some(l) => format!("{r} of {l}"),
                                        None => r.to_string(),
                                    }).unwrap_or_else(|| "—".into())}</td>
                                    <td class="provider-pause">{p.pause.as_ref().map(|pause| describe_pause(pause, p.paused_by.as_deref())).unwrap_or_else(|| "—".into())}</td>
                                    <td class="adapted-rate">{p.rate.map(|r| format!("{r:.1}/s of {own:.1}/s")).unwrap_or_else(|| "—".into())}</td>
                                    <td class="provider-refused-now">{format!("{:.1}", p.refused_per_s)}</td>
                                    <td class="provider-pauses">{p.pauses}</td>
                                    <td class="provider-cuts">{p.cuts}</td>
                                </tr>
                            }
                        }/>
                    </tbody>
                </table>
                <For each=names key=|n| n.clone() children=|name| {
                    let (title, attr) = (name.clone(), name.clone());
                    view! {
                        <div class="provider-chart-box" data-limit=attr>
                            <h3>{title}</h3>
                            <ProviderChart name=name/>
                        </div>
                    }
                }/>
            </section>
        </Show>
    }
}

/// One second of a limit that listens to its provider, as charted.
#[derive(Debug, Clone, Copy, PartialEq)]
struct ProviderSecond {
    admitted: f64,
    adapted: Option<f64>,
    refused: f64,
    paused: bool,
}

/// The last two minutes of one limit that listens to its provider.
#[component]
fn ProviderChart(name: String) -> impl IntoView {
    let frames = expect_context::<LiveFrames>();
    const W: f64 = 480.0;
    const H: f64 = 100.0;
    const SPAN: usize = 120;
    let recent = Memo::new(move |_| {
        frames.0.with(|all| {
            all.iter()
                .rev()
                .take(SPAN)
                .rev()
                .map(|f| {
                    let u = f.limits.get(&name);
                    let p = u.and_then(|u| u.provider.as_ref());
                    ProviderSecond {
                        admitted: u.map_or(0.0, |u| u.admitted_per_s),
                        adapted: p.and_then(|p| p.rate),
                        refused: p.map_or(0.0, |p| p.refused_per_s),
                        paused: p.is_some_and(|p| p.pause.is_some()),
                    }
                })
                .collect::<Vec<_>>()
        })
    });
    let top = Memo::new(move |_| {
        recent.with(|data| {
            data.iter()
                .map(|d| d.admitted.max(d.adapted.unwrap_or(0.0)).max(d.refused))
                .fold(1.0, f64::max)
        })
    });
    let x_of = move |i: usize, n: usize| (SPAN.saturating_sub(n) + i) as f64 * W / SPAN as f64;
    let line = move |pick: fn(&ProviderSecond) -> Option<f64>| {
        move || {
            let data = recent.get();
            let top = top.get();
            data.iter()
                .enumerate()
                .filter_map(|(i, d)| {
                    pick(d).map(|v| {
                        format!("{:.1},{:.1}", x_of(i, data.len()), H - v / top * (H - 20.0))
                    })
                })
                .collect::<Vec<_>>()
                .join(" ")
        }
    };
    let paused = move || {
        let data = recent.get();
        data.iter()
            .enumerate()
            .filter(|(_, d)| d.paused)
            .map(|(i, _)| {
                let x = x_of(i, data.len());
                view! { <rect class="paused-second" x=format!("{x:.1}") y="0" width=format!("{:.1}", W / SPAN as f64) height="100"></rect> }
            })
            .collect_view()
    };
    view! {
        <svg class="chart provider-chart" width="480" height="100" viewBox="0 0 480 100">
            <rect class="chart-bg" x="0" y="0" width="480" height="100"></rect>
            {paused}
            <polyline class="line-admitted" points=line(|d| Some(d.admitted))></polyline>
            <polyline class="line-adapted" points=line(|d| d.adapted)></polyline>
            <polyline class="line-rejected" points=line(|d| Some(d.refused))></polyline>
            <text x="4" y="12" class="chart-top">{move || format!("{:.0}/s", top.get())}</text>
        </svg>
    }
}

/// Each further limit's use against its size: tokens charged per period at
/// the current pace, and what it holds now (a daily budget's "left today").
#[component]
fn LimitsNow() -> impl IntoView {
    let frames = expect_context::<LiveFrames>();
    let limits = move || {
        frames
            .latest()
            .map(|f| {
                f.limits
                    .iter()
                    .map(|(n, u)| (n.clone(), u.clone()))
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default()
    };
    view! {
        <Show when=move || !limits().is_empty()>
            <section id="live-limits">
                <h2>"Further limits"</h2>
                <table class="limits-now">
                    <thead><tr><th>"Limit"</th><th>"Used per period at this pace (in flight now)"</th><th>"Of"</th><th>"Left now"</th><th>"Admitted/s"</th><th>"Refused/s"</th></tr></thead>
                    <tbody>
                        <For each=limits key=|(n, u)| (n.clone(), format!("{u:?}")) children=|(name, u)| {
                            // A concurrency limit: calls in flight now against its size.
                            let (used, size) = if u.is_concurrency() {
                                (u.in_flight.unwrap_or(0) as f64, format!("{} in flight", u.requests))
                            } else {
                                (u.used_per_period(), format!("{} per {}", u.requests, DurationMs::from_millis(u.period_ms)))
                            };
                            let share = if u.requests > 0 { format!(" ({:.0} %)", used * 100.0 / u.requests as f64) } else { String::new() };
                            view! {
                                <tr class="live-limit" data-limit=name.clone()>
                                    <td>{name.clone()}</td>
                                    <td class="used-per-period">{format!("{used:.0}{share}")}</td>
                                    <td class="limit-size">{size}</td>
                                    <td class="left-now">{u.available.map(|a| a.to_string()).unwrap_or_else(|| "—".into())}</td>
                                    <td class="limit-admitted-now">{format!("{:.1}", u.admitted_per_s)}</td>
                                    <td class="limit-refused-now">{format!("{:.1}", u.refused_per_s)}</td>
                                </tr>
                            }
                        }/>
                    </tbody>
                </table>
            </section>
        </Show>
    }
}

/// How often the fleet page asks for the shares again.
const FLEET_REFRESH_MS: u32 = 1_000;

/// Global policies (`/fleet`) or one of them (`/fleet/:name`): the limit,
/// and each Envoy's share of it next to what it uses and wants.
#[component]
fn FleetPage() -> impl IntoView {
    let session = expect_context::<Session>();
    let params = use_params_map();
    let policies = RwSignal::new(Vec::<FleetPolicy>::new());
    let now_ms = RwSignal::new(0u64);
    let error = RwSignal::new(None::<String>);
    let loaded = RwSignal::new(false);
    let open = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let still_open = open.clone();
    on_cleanup(move || open.store(false, std::sync::atomic::Ordering::Relaxed));
    spawn_local(async move {
        while still_open.load(std::sync::atomic::Ordering::Relaxed) {
            match api::get::<FleetView>("/api/v1/fleet").await {
                Ok(view) => {
                    now_ms.set(view.now_ms);
                    policies.set(view.policies);
                    error.set(None);
                }
                Err(e) => {
                    session.check(&e);
                    error.set(Some(e.to_string()));
                }
            }
            loaded.set(true);
            gloo_timers::future::TimeoutFuture::new(FLEET_REFRESH_MS).await;
        }
    });
    let shown = move || {
        let only = params.read().get("name");
        policies
            .get()
            .into_iter()
            .filter(|p| only.as_deref().is_none_or(|n| p.policy == n))
            .collect::<Vec<_>>()
    };
    view! {
        <h1>"Fleet"</h1>
        <p class="legend">"Global policies: one limit shared by every Envoy. Each Envoy holds a leased share, weighted by what it asks for; the shares never add up to more than the limit."</p>
        <p class="error" id="fleet-error">{move || error.get()}</p>
        <Show when=move || loaded.get() && shown().is_empty()>
            <p id="fleet-empty">"No global policy here. Set a policy's scope to global to share its limit across Envoys."</p>
        </Show>
        {move || shown().into_iter().map(|p| view! { <FleetPolicy policy=p now_ms=now_ms.get()/> }).collect_view()}
    }
}

#[component]
fn FleetPolicy(policy: FleetPolicy, now_ms: u64) -> impl IntoView {
    let name = policy.policy.clone();
    let (limit, reserved) = (policy.limit, policy.reserved);
    let used = policy.members.iter().fold((0.0, 0u64), |(r, f), m| {
        (r + m.used.rate, f + u64::from(m.used.in_flight))
    });
    let (limit_rate, limit_flight) = (limit.rate, limit.in_flight);
    let rows = policy
        .members
        .into_iter()
        .map(|m| {
            let ago_ms = now_ms.saturating_sub(m.last_sync.as_millis());
            let (share_rate, used_rate) = (m.share.rate, m.used.rate);
            let (share_flight, used_flight) = (m.share.in_flight, m.used.in_flight);
            view! {
                <tr class="fleet-member" data-instance=m.instance.clone()>
                    <td>{m.instance.clone()}</td>
                    <td class="share-rate">{format!("{share_rate:.1}")}</td>
                    <td class="used-rate"><Bar value=Signal::derive(move || used_rate) max=Signal::derive(move || share_rate)
                        label=Signal::derive(move || format!("{used_rate:.1}"))/></td>
                    <td class="demand-rate">{format!("{:.1}", m.demand.rate)}</td>
                    <td class="share-in-flight">{share_flight}</td>
                    <td class="used-in-flight"><Bar value=Signal::derive(move || used_flight as f64) max=Signal::derive(move || share_flight as f64)
                        label=Signal::derive(move || used_flight.to_string())/></td>
                    <td>{format!("{:.1} s ago", Span::from_millis(ago_ms).as_secs_f64())}</td>
                </tr>
            }
        })
        .collect_view();
    let href = format!("/policies/{name}");
    let title = name.clone();
    let lease = policy.lease;
    let recovering = policy.recovering.then(|| view! {
        <p class="recovering">"Recovering: the record of this policy's shares was lost (Redis restarted?). "
            "Shares are learned back from the Envoys' syncs and do not grow until every lost lease has ended."</p>
    });
    view! {
        <section class="fleet-policy live-policy" data-policy=name>
            <h2><A href=href>{title}</A></h2>
            <p class="figures">
                "Limit "<span class="limit">{format!("{limit_rate:.1}/s")}{(limit_flight > 0).then(|| format!(", {limit_flight} in flight"))}</span>
                " · shared out "<span class="reserved">{format!("{:.1}/s", reserved.rate)}{(limit_flight > 0).then(|| format!(", {}", reserved.in_flight))}</span>
                " · used "<span class="used">{format!("{:.1}/s", used.0)}{(limit_flight > 0).then(|| format!(", {} in flight", used.1))}</span>
                " · lease "{format!("{:.1} s", lease.as_secs_f64())}
            </p>
            {recovering}
            <table class="fleet-members">
                <thead><tr><th>"Envoy"</th><th>"Share /s"</th><th>"Used /s"</th><th>"Asked /s"</th><th>"Share in flight"</th><th>"In flight"</th><th>"Last sync"</th></tr></thead>
                <tbody>{rows}</tbody>
            </table>
        </section>
    }
}

#[component]
fn InstancesPage() -> impl IntoView {
    let session = expect_context::<Session>();
    let rows = RwSignal::new(Vec::<sluice_shared::api::Instance>::new());
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

#[component]
fn AuditPage() -> impl IntoView {
    let session = expect_context::<Session>();
    let entries = RwSignal::new(Vec::<sluice_shared::api::AuditEntry>::new());
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
