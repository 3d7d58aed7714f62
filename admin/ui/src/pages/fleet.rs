//! Global policies' shares: each Envoy's share next to what it uses.

use leptos::prelude::*;
use leptos::task::spawn_local;
use leptos_router::components::A;
use leptos_router::hooks::use_params_map;
use sluice_api::{FleetPolicy, FleetView, RlqsClient};
use sluice_shared::Span;

use crate::api;
use crate::session::Session;

use super::Bar;

/// How often the fleet page asks for the shares again.
const FLEET_REFRESH_MS: u32 = 1_000;

/// Global policies (`/fleet`) or one of them (`/fleet/:name`): the limit,
/// and each Envoy's share of it next to what it uses and wants.
#[component]
pub(super) fn FleetPage() -> impl IntoView {
    let session = expect_context::<Session>();
    let params = use_params_map();
    let policies = RwSignal::new(Vec::<FleetPolicy>::new());
    let rlqs = RwSignal::new(Vec::<RlqsClient>::new());
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
                    rlqs.set(view.rlqs);
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
        <Show when=move || !rlqs.get().is_empty()>
            <RlqsClients clients=rlqs.get() now_ms=now_ms.get()/>
        </Show>
    }
}

/// Stock Envoys drawing on the global limits through RLQS (Envoy's
/// `rate_limit_quota` filter): what each is assigned, and its buckets that
/// are not, with why.
#[component]
fn RlqsClients(clients: Vec<RlqsClient>, now_ms: u64) -> impl IntoView {
    let rows = clients
        .into_iter()
        .map(|c| {
            let reported = if c.last_report_ms == 0 {
                "no report yet".to_string()
            } else {
                let ago = now_ms.saturating_sub(c.last_report_ms);
                format!("{:.1} s ago", Span::from_millis(ago).as_secs_f64())
            };
            let assigned = c
                .assigned
                .iter()
                .map(|a| {
                    format!(
                        "{}: {} bucket{} at {:.1}/s",
                        a.limit,
                        a.buckets,
                        if a.buckets == 1 { "" } else { "s" },
                        a.rate
                    )
                })
                .collect::<Vec<_>>()
                .join("; ");
            let unassigned = c
                .unassigned
                .iter()
                .map(|u| {
                    let id = u
                        .bucket
                        .iter()
                        .map(|(k, v)| format!("{k}={v}"))
                        .collect::<Vec<_>>()
                        .join(",");
                    view! { <li>{format!("{{{id}}}: {}", u.reason)}</li> }
                })
                .collect_view();
            let count = c.unassigned_count;
            view! {
                <tr class="rlqs-client" data-instance=c.instance.clone()>
                    <td>{c.instance.clone()}</td>
                    <td>{c.peer.clone()}</td>
                    <td>{c.domain.clone()}</td>
                    <td class="rlqs-assigned">{assigned}</td>
                    <td class="rlqs-unassigned">
                        {(count > 0).then(|| format!("{count} not assigned"))}
                        <ul>{unassigned}</ul>
                    </td>
                    <td>{reported}</td>
                </tr>
            }
        })
        .collect_view();
    view! {
        <section class="rlqs-clients">
            <h2>"Stock Envoys (RLQS)"</h2>
            <p class="legend">"Envoys without the Sluice filter, whose rate_limit_quota filter streams to this admin. "
                "Each bucket naming a global policy draws a token bucket from its share above (rlqs:<name>); "
                "a bucket that cannot is given no assignment, and its Envoy applies its no_assignment_behavior."</p>
            <table class="fleet-members">
                <thead><tr><th>"Envoy"</th><th>"From"</th><th>"Domain"</th><th>"Assigned"</th><th>"Not assigned"</th><th>"Last report"</th></tr></thead>
                <tbody>{rows}</tbody>
            </table>
        </section>
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
    // A global further limit (`limits/<name>`) has no page of its own.
    let title = name.clone();
    let heading = if title.starts_with("limits/") {
        view! { <h2>{title}</h2> }.into_any()
    } else {
        let href = format!("/policies/{title}");
        view! { <h2><A href=href>{title}</A></h2> }.into_any()
    };
    let lease = policy.lease;
    let recovering = policy.recovering.then(|| view! {
        <p class="recovering">"Recovering: the record of this policy's shares was lost (Redis restarted?). "
            "Shares are learned back from the Envoys' syncs and do not grow until every lost lease has ended."</p>
    });
    view! {
        <section class="fleet-policy live-policy" data-policy=name>
            {heading}
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
