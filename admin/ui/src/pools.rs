//! The live view of pools: per member its calls, share, room, pause and the
//! calls Envoy retried onto it ([`crate::pool_view`] reads them).

use leptos::prelude::*;
use leptos::task::spawn_local;
use sluice_api::PolicyList;
use sluice_shared::Policy;

use crate::api;
use crate::live::LiveFrames;
use crate::pool_view::{pools_now, MemberNow};

fn member_row(m: MemberNow) -> impl IntoView {
    let room = m
        .room
        .map_or_else(|| "—".to_string(), |r| format!("{:.0} %", r * 100.0));
    let paused = m
        .paused_for_s
        .map_or_else(String::new, |s| format!("paused, {s:.1} s more"));
    view! {
        <tr class="pool-member" data-member=m.name.clone() class:paused=m.paused_for_s.is_some()>
            <td>{m.name.clone()}</td>
            <td><code>{m.cluster.clone()}</code></td>
            <td class="member-calls">{format!("{:.1}", m.calls_per_s)}</td>
            <td class="member-share">{format!("{:.0} %", m.share * 100.0)}</td>
            <td class="member-room">{room}</td>
            <td class="member-paused">{paused}</td>
            <td class="member-retried">{format!("{:.1}", m.retried_here_per_s)}</td>
        </tr>
    }
}

#[component]
pub fn PoolsNow() -> impl IntoView {
    let frames = expect_context::<LiveFrames>();
    let policies = RwSignal::new(Vec::<Policy>::new());
    spawn_local(async move {
        if let Ok(list) = api::get::<PolicyList>("/api/v1/policies").await {
            policies.set(list.policies.into_iter().map(|s| s.policy).collect());
        }
    });
    let pools = move || {
        let limits = frames.latest().map(|f| f.limits).unwrap_or_default();
        policies.with(|p| pools_now(p, &limits))
    };
    view! {
        <Show when=move || !pools().is_empty()>
            <section id="live-pools">
                <h2>"Pools"</h2>
                <p class="legend">"Each member's calls a second and its share of the pool's, what is left of its tightest limit, its provider's pause, and the calls Envoy retried onto it after another member refused them."</p>
                <For each=pools key=|(n, m)| (n.clone(), format!("{m:?}")) children=|(name, members)| {
                    view! {
                        <div class="live-pool" data-policy=name.clone()>
                            <h3>{name.clone()}</h3>
                            <table class="pool-members">
                                <thead><tr><th>"Member"</th><th>"Cluster"</th><th>"Calls/s"</th><th>"Share"</th><th>"Room now"</th><th>"Pause"</th><th>"Retried here/s"</th></tr></thead>
                                <tbody>{members.into_iter().map(member_row).collect_view()}</tbody>
                            </table>
                        </div>
                    }
                }/>
            </section>
        </Show>
    }
}
