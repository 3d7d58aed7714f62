//! The live view of a rate shared fairly (`fair`, a policy's own or a
//! further limit's): per key, its weight, its share of the limit now, what
//! it used and what it asked, the most demanding first, summed over the
//! Envoys.

use leptos::prelude::*;
use sluice_api::FairKeyUse;

use crate::live::LiveFrames;

/// `name`: the policy's, or `limits/<limit>` for a further limit's.
#[component]
pub fn FairKeysNow(name: String, title: String) -> impl IntoView {
    let frames = expect_context::<LiveFrames>();
    let keys = Memo::new(move |_| frames.latest().and_then(|f| f.fair.get(&name).cloned()));
    let rows = move || keys.get().unwrap_or_default();
    view! {
        <Show when=move || keys.get().is_some()>
            <div class="fair-now">
                <h3>{title.clone()}</h3>
                <p class="fair-figures">
                    "Each key's share of the limit now (by weight, among the keys that want it), "
                    "what it used and what it asked, a second."
                </p>
                <table class="fair-keys">
                    <thead><tr><th>"Key"</th><th>"Weight"</th><th>"Share/s"</th><th>"Used/s"</th><th>"Asked/s"</th></tr></thead>
                    <tbody>
                        <For each=rows key=|k: &FairKeyUse| (k.label.clone(), format!("{k:?}")) children=move |k| {
                            view! {
                                <tr class="fair-key" data-label=k.label.clone()>
                                    <td class="key-label">{k.label.clone()}</td>
                                    <td class="fair-weight">{format!("{}", k.weight)}</td>
                                    <td class="fair-share">{format!("{:.1}", k.share_per_s)}</td>
                                    <td class="fair-used">{format!("{:.1}", k.used_per_s)}</td>
                                    <td class="fair-demand">{format!("{:.1}", k.demand_per_s)}</td>
                                </tr>
                            }
                        }/>
                    </tbody>
                </table>
            </div>
        </Show>
    }
}
