//! The live view of a keyed policy's keys: the busiest by admitted calls a
//! second, how many are active and how many found no place, and a box to
//! find a key (the admin names it as the Envoys do; the key is sent once,
//! in a POST body, and kept nowhere).

use leptos::prelude::*;
use leptos::task::spawn_local;
use sluice_api::{KeyLabelAnswer, KeyLabelRequest, KeysUse};
use sluice_shared::key_view::{join_pair, KeyEstimate};

use crate::api;
use crate::live::LiveFrames;
use crate::session::Session;

fn estimate(e: Option<KeyEstimate>) -> String {
    match e {
        Some(KeyEstimate::About(n)) => n.to_string(),
        Some(KeyEstimate::AtLeast(n)) => format!("over {n}"),
        None => "—".into(),
    }
}

/// The key a lookup asks about: the pasted key, and for a key of a
/// header and a body field (`key` with both), the pair as the Envoys
/// join it.
fn lookup_key(header: &str, field: &str) -> String {
    if field.is_empty() {
        return header.to_string();
    }
    join_pair(header.as_bytes(), field.as_bytes())
        .and_then(|pair| String::from_utf8(pair).ok())
        .unwrap_or_else(|| header.to_string())
}

#[component]
pub fn KeysNow(policy: String) -> impl IntoView {
    let frames = expect_context::<LiveFrames>();
    let session = expect_context::<Session>();
    let name = policy.clone();
    let keys = Memo::new(move |_| frames.latest().and_then(|f| f.keys.get(&name).cloned()));
    let typed = RwSignal::new(String::new());
    let typed_field = RwSignal::new(String::new());
    let found = RwSignal::new(None::<String>);
    let message = RwSignal::new(None::<String>);
    // Copy, so the handler can be handed to the view each time it shows.
    let policy_name = StoredValue::new(policy);
    let find = move |ev: leptos::ev::SubmitEvent| {
        ev.prevent_default();
        let key = lookup_key(&typed.get_untracked(), &typed_field.get_untracked());
        if key.is_empty() {
            return;
        }
        let path = policy_name.with_value(|p| format!("/api/v1/policies/{p}/key-label"));
        let csrf = session.csrf();
        spawn_local(async move {
            match api::post::<_, KeyLabelAnswer>(&path, &csrf, &KeyLabelRequest { key }).await {
                Ok(answer) => {
                    found.set(Some(answer.label));
                    message.set(None);
                }
                Err(e) => {
                    found.set(None);
                    message.set(Some(format!("Cannot look it up: {e}")));
                }
            }
        });
    };
    let rows = move || keys.get().map(|k: KeysUse| k.top).unwrap_or_default();
    let found_line = move || {
        let label = found.get()?;
        let listed = rows().into_iter().find(|k| k.label == label);
        Some(match listed {
            Some(k) => format!(
                "That key is {label}: {:.1} admitted/s, {:.1} refused/s.",
                k.admitted_per_s, k.refused_per_s
            ),
            None => format!("That key is {label}: not among the busiest keys now."),
        })
    };
    view! {
        <Show when=move || keys.get().is_some()>
            <div class="keys-now">
                <h3>"Busiest keys"</h3>
                <p class="keys-figures">
                    <span class="keys-active">{move || estimate(keys.get().and_then(|k| k.active))}</span>
                    " keys active in the last 10 s · "
                    <span class="keys-overflowed">{move || estimate(keys.get().and_then(|k| k.overflowed))}</span>
                    " found no place of their own (max_keys) · "
                    <span class="keys-calls">{move || format!("{:.1}", keys.get().map_or(0.0, |k| k.calls_per_s))}</span>
                    " calls/s over all keys"
                </p>
                // Finding a key hashes a guess: editors only (the admin
                // refuses viewers, limits and audits each lookup).
                <Show when=move || session.can_edit()>
                <form class="find-key" on:submit=find>
                    <label>"Find a key "
                        <input type="password" class="find-key-input" autocomplete="off" placeholder="paste a key"
                            prop:value=move || typed.get()
                            on:input=move |ev| typed.set(event_target_value(&ev))/>
                    </label>
                    <label>" and its body field "
                        <input type="text" class="find-key-field" autocomplete="off" placeholder="for a key of a header and a body field"
                            prop:value=move || typed_field.get()
                            on:input=move |ev| typed_field.set(event_target_value(&ev))/>
                    </label>
                    <button type="submit">"Find"</button>
                    <span class="find-key-result">{move || found_line().or_else(|| message.get())}</span>
                </form>
                </Show>
                <table class="top-keys">
                    <thead><tr><th>"Key"</th><th>"Admitted/s"</th><th>"Queued/s"</th><th>"Refused/s"</th><th>"± (counts shared with keys no longer listed)"</th></tr></thead>
                    <tbody>
                        <For each=rows key=|k| (k.label.clone(), format!("{k:?}")) children=move |k| {
                            let label = k.label.clone();
                            let is_found = move || found.get().as_deref() == Some(label.as_str());
                            view! {
                                <tr class=move || if is_found() { "top-key found" } else { "top-key" } data-label=k.label.clone()>
                                    <td class="key-label">{k.label.clone()}</td>
                                    <td class="key-admitted">{format!("{:.1}", k.admitted_per_s)}</td>
                                    <td class="key-queued">{format!("{:.1}", k.queued_per_s)}</td>
                                    <td class="key-refused">{format!("{:.1}", k.refused_per_s)}</td>
                                    <td class="key-uncertain">{if k.uncertain_per_s > 0.0 { format!("±{:.1}", k.uncertain_per_s) } else { String::new() }}</td>
                                </tr>
                            }
                        }/>
                    </tbody>
                </table>
            </div>
        </Show>
    }
}
