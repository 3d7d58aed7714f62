//! The live view of a rate or slots shared fairly (`fair`, a policy's own
//! or a further limit's): per key, its weight, its share of the limit now,
//! what it used and what it asked (slots: holds and wants), the most
//! demanding first, summed over the Envoys.

use leptos::prelude::*;
use sluice_api::FairKeyUse;

use crate::live::LiveFrames;

/// `name`: the policy's, or `limits/<limit>` for a further limit's.
#[component]
pub fn FairKeysNow(name: String, title: String) -> impl IntoView {
    let frames = expect_context::<LiveFrames>();
    let keys = Memo::new(move |_| frames.latest().and_then(|f| f.fair.get(&name).cloned()));
    let rows = move || keys.get().unwrap_or_default();
    // Slots shared fairly are counted at once, not a second.
    let in_slots = move || keys.get().is_some_and(|k| k.iter().any(|k| k.slots));
    let figures = move || {
        if in_slots() {
            "Each key's share of the slots now (by weight, among the keys that want them), \
             the calls it holds in flight and the slots it wants (all it can get just after a refusal)."
        } else {
            "Each key's share of the limit now (by weight, among the keys that want it), \
             what it used and what it asked, a second."
        }
    };
    let heading = move |per_second: &'static str, in_flight: &'static str| {
        move || if in_slots() { in_flight } else { per_second }
    };
    view! {
        <Show when=move || keys.get().is_some()>
            <div class="fair-now">
                <h3>{title.clone()}</h3>
                <p class="fair-figures">{figures}</p>
                <table class="fair-keys">
                    <thead><tr>
                        <th>"Key"</th><th>"Weight"</th>
                        <th>{heading("Share/s", "Share (slots)")}</th>
                        <th>{heading("Used/s", "Holding")}</th>
                        <th>{heading("Asked/s", "Wanting")}</th>
                    </tr></thead>
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
