//! The live view: each policy's last two minutes, further limits' use,
//! and the limits that listen to their provider.

use leptos::prelude::*;
use leptos::task::spawn_local;
use sluice_api::PolicyList;
use sluice_shared::duration::DurationMs;
use sluice_shared::Scope;
use sluice_wire::stats::{LimitCounter, PolicyCounter, ProviderCounter};

use crate::api;
use crate::budgets::BudgetsNow;
use crate::fair_keys::FairKeysNow;
use crate::form;
use crate::keys::KeysNow;
use crate::live::{LiveFrames, Utilization};
use crate::pools::PoolsNow;

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
                .map(|u| {
                    u.counts
                        .per_s(PolicyCounter::Admitted)
                        .max(u.counts.per_s(PolicyCounter::Rejected))
                        .max(u.counts.per_s(PolicyCounter::Queued))
                })
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
                u.counts.per_s(PolicyCounter::Admitted),
                u.counts.per_s(PolicyCounter::Rejected),
                u.counts.per_s(PolicyCounter::Queued)
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
                <polyline class="line-admitted" points=line(|u| u.counts.per_s(PolicyCounter::Admitted))></polyline>
                <polyline class="line-rejected" points=line(|u| u.counts.per_s(PolicyCounter::Rejected))></polyline>
                <polyline class="line-queued" points=line(|u| u.counts.per_s(PolicyCounter::Queued))></polyline>
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
pub(super) fn LivePage() -> impl IntoView {
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
                        <span class="admitted-now">{move || format!("{:.0}", now.get().counts.per_s(PolicyCounter::Admitted))}</span>" admitted/s · "
                        <span class="rejected-now">{move || format!("{:.0}", now.get().counts.per_s(PolicyCounter::Rejected))}</span>" rejected/s · "
                        <span class="shadow-now">{move || format!("{:.0}", now.get().counts.per_s(PolicyCounter::ShadowLimited))}</span>" would have been refused/s (shadow) · "
                        <span class="queued-now">{move || format!("{:.0}", now.get().counts.per_s(PolicyCounter::Queued))}</span>" queued/s · in flight "
                        <span class="in-flight-now">{move || { let u = now.get(); if u.max_in_flight > 0 { format!("{} of {}", u.counts.now(PolicyCounter::InFlight), u.max_in_flight) } else { u.counts.now(PolicyCounter::InFlight).to_string() } }}</span>
                        " · tokens left "<span class="tokens-now">{move || now.get().tokens.map(|t| t.to_string()).unwrap_or_else(|| "—".into())}</span>
                        " · waiting "{move || now.get().waiting}
                    </p>
                    <Show when=move || { now.get().counts.now(PolicyCounter::PortHidden) > 0 }>
                        <p class="port-hidden warning">
                            "This policy names a port, but "<span class="port-hidden-count">{move || now.get().counts.now(PolicyCounter::PortHidden)}</span>
                            " of its calls came without one (the Envoy strips ports before filters run: "
                            <code>"strip_any_host_port"</code>"). They are matched by the host alone, whatever their port."
                        </p>
                    </Show>
                    <table class="per-instance">
                        <thead><tr><th>"Instance"</th><th>"Admitted/s"</th><th>"Rejected/s"</th><th>"Queued/s"</th><th>"In flight"</th><th>"Tokens"</th></tr></thead>
                        <tbody>
                            <For each=per_instance key=|(id, u)| (id.clone(), format!("{u:?}")) children=|(id, u)| view! {
                                <tr><td>{id}</td><td>{format!("{:.0}", u.counts.per_s(PolicyCounter::Admitted))}</td><td>{format!("{:.0}", u.counts.per_s(PolicyCounter::Rejected))}</td>
                                <td>{format!("{:.0}", u.counts.per_s(PolicyCounter::Queued))}</td><td>{u.counts.now(PolicyCounter::InFlight)}</td><td>{u.tokens.map(|t| t.to_string()).unwrap_or_default()}</td></tr>
                            }/>
                        </tbody>
                    </table>
                    <KeysNow policy=name.clone()/>
                    <FairKeysNow name=name.clone() title="Fair shares".to_string()/>
                </section>
            }
        }/>
        <PoolsNow/>
        <LimitsNow/>
        <BudgetsNow/>
        <ProvidersNow/>
    }
}

/// How a pause reads: how long it has left, why, since when, and whose
/// provider began it.
fn describe_pause(p: &sluice_wire::sync::PauseReport, by: Option<&str>) -> String {
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
                                    <td class="provider-refused-now">{format!("{:.1}", p.counts.per_s(ProviderCounter::Refused))}</td>
                                    <td class="provider-pauses">{p.counts.now(ProviderCounter::Pauses)}</td>
                                    <td class="provider-cuts">{p.counts.now(ProviderCounter::Cuts)}</td>
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
                        admitted: u.map_or(0.0, |u| u.counts.per_s(LimitCounter::Admitted)),
                        adapted: p.and_then(|p| p.rate),
                        refused: p.map_or(0.0, |p| p.counts.per_s(ProviderCounter::Refused)),
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
                                    <td class="limit-admitted-now">{format!("{:.1}", u.counts.per_s(LimitCounter::Admitted))}</td>
                                    <td class="limit-refused-now">{format!("{:.1}", u.counts.per_s(LimitCounter::Refused))}</td>
                                </tr>
                            }
                        }/>
                    </tbody>
                </table>
                // A limit shared fairly: its keys' shares.
                <For each=limits key=|(n, _)| n.clone() children=|(name, _)| {
                    let title = format!("Fair shares of {name}");
                    view! { <FairKeysNow name=format!("limits/{name}") title=title/> }
                }/>
            </section>
        </Show>
    }
}
