//! Live utilization: turns the cumulative counters each Envoy reports on
//! sync into per-second rates, keeps the last minutes per policy, and
//! broadcasts one frame a second to the UI's SSE streams.
//!
//! Memory is bounded whatever the Envoys send: per instance only a few
//! samples of its counters (not its reports), at most [`MAX_INSTANCES`]
//! instances, each forgotten once silent for the instance TTL; history
//! frames keep per-policy figures only (per-instance figures are in the
//! newest frame) and are shared, not copied, with every stream.

mod keys;
#[cfg(test)]
mod tests;

use keys::{add_span, KeyRates, KeySpan, SeenKeys};

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use sluice_api::{
    FairKeyUse, KeyUse, KeysUse, LimitUse, LiveFrame, ProviderUse, Utilization,
    FAIR_OVERFLOW_LABEL, KEYS_ACTIVE_FOR_MS,
};
use sluice_shared::fair::{FairKeyView, OVERFLOW_KEY, WEIGHT_SCALE};
use sluice_shared::key_view::{hash_label, KeyBitmap, KeysReport, TopKeys, SHOWN_TOP_KEYS};
use sluice_shared::Span;
use sluice_wire::counts::{Counts, LiveCounts};
use sluice_wire::stats::{LimitCounter, PolicyCounter, ProviderCounter};
use sluice_wire::sync::{LimitReport, PolicyReport, SyncReport};
use tokio::sync::broadcast;

/// Ten minutes of one-second frames.
pub const HISTORY_FRAMES: usize = 600;
/// An instance silent for longer no longer counts towards live figures.
pub const STALE_AFTER_MS: u64 = 5_000;
/// Instances tracked at once; past it, the longest silent goes.
pub use sluice_wire::sync::MAX_INSTANCES;
/// Live streams one caller may have open at once (a few browser tabs).
pub const MAX_STREAMS_PER_CALLER: usize = 16;
/// Live streams open at once, for everyone.
pub const MAX_STREAMS: usize = 512;
/// Samples of an instance's counters kept: enough to span the rate window
/// at any sync interval down to 100 ms.
const KEPT_SAMPLES: usize = 16;
/// Rates span at least this much of the Envoy's clock when it can.
const RATE_WINDOW_MS: u64 = 1_000;

/// One sync's counters, by the Envoy's clock.
struct Sample {
    at_ms: u64,
    counts: BTreeMap<String, Counts<PolicyCounter>>,
    /// Per further limit: its own counters and its provider's.
    limit_counts: BTreeMap<String, (Counts<LimitCounter>, Counts<ProviderCounter>)>,
}

struct InstanceState {
    /// Recent samples, oldest first: rates are taken over about a second
    /// of the Envoy's clock, whatever its sync interval.
    samples: VecDeque<Sample>,
    received_ms: u64,
    /// Its filter's count of failed syncs, as last reported.
    sync_failures: u64,
    rates: BTreeMap<String, Utilization>,
    limit_rates: BTreeMap<String, LimitUse>,
    /// Per keyed policy, its keys' recent counts and their rates.
    key_spans: BTreeMap<String, VecDeque<KeySpan>>,
    key_rates: BTreeMap<String, KeyRates>,
    /// Per policy shared fairly, its keys as the last report had them.
    fair: BTreeMap<String, Vec<FairKeyView>>,
}

/// Keyed policies whose distinct keys are tracked at once: names come
/// from the Envoys' reports, so a hostile one must not grow this.
const MAX_SEEN_POLICIES: usize = 1000;

pub struct Live {
    instances: Mutex<HashMap<String, InstanceState>>,
    seen_keys: Mutex<HashMap<String, SeenKeys>>,
    history: Mutex<VecDeque<Arc<LiveFrame>>>,
    /// Instances silent for this long are forgotten.
    instance_ttl_ms: u64,
    pub frames: broadcast::Sender<Arc<LiveFrame>>,
    /// The live streams open, per caller.
    pub streams: Streams,
}

/// Live streams open, per caller, bounded per caller and in all.
#[derive(Default)]
pub struct Streams {
    open: Arc<Mutex<HashMap<String, usize>>>,
}

/// Why a live stream is not opened.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StreamsFull {
    #[error("{0} has {MAX_STREAMS_PER_CALLER} live streams open already; close one")]
    Caller(String),
    #[error("{MAX_STREAMS} live streams are open already; retry later")]
    All,
}

/// One open stream's place, given back when dropped.
pub struct StreamSeat {
    open: Arc<Mutex<HashMap<String, usize>>>,
    caller: String,
}

impl Streams {
    pub fn take(&self, caller: &str) -> Result<StreamSeat, StreamsFull> {
        let mut open = lock(&self.open);
        if open.values().sum::<usize>() >= MAX_STREAMS {
            return Err(StreamsFull::All);
        }
        let mine = open.entry(caller.to_string()).or_default();
        if *mine >= MAX_STREAMS_PER_CALLER {
            return Err(StreamsFull::Caller(caller.to_string()));
        }
        *mine += 1;
        Ok(StreamSeat {
            open: Arc::clone(&self.open),
            caller: caller.to_string(),
        })
    }

    /// Streams open now.
    pub fn open(&self) -> usize {
        lock(&self.open).values().sum()
    }
}

impl Drop for StreamSeat {
    fn drop(&mut self) {
        let mut open = lock(&self.open);
        if let Some(n) = open.get_mut(&self.caller) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                open.remove(&self.caller);
            }
        }
    }
}

impl Default for Live {
    fn default() -> Self {
        Self::new(Span::from_secs(600))
    }
}

/// A lock, recovered if a panic poisoned it: every value behind these locks
/// is replaced whole, never left half-changed.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn rates(prev: Option<&Counts<PolicyCounter>>, cur: &PolicyReport, dt_ms: u64) -> Utilization {
    Utilization {
        counts: LiveCounts::between(prev, &cur.counts, Span::from_millis(dt_ms)),
        max_in_flight: cur.max_in_flight,
        waiting: cur.waiting,
        tokens: cur.tokens,
    }
}

/// A limit's use on `instance` over the last `dt_ms`.
fn limit_rates(
    instance: &str,
    prev: Option<&(Counts<LimitCounter>, Counts<ProviderCounter>)>,
    cur: &LimitReport,
    dt_ms: u64,
) -> LimitUse {
    let span = Span::from_millis(dt_ms);
    let provider = cur.provider.map(|p| ProviderUse {
        remaining: p.remaining,
        limit: p.limit,
        pause: p.pause,
        paused_by: p
            .pause
            .filter(|pause| !pause.relayed)
            .map(|_| instance.to_string()),
        rate: p.rate,
        counts: LiveCounts::between(prev.map(|(_, p)| p), &p.counts, span),
    });
    LimitUse {
        counts: LiveCounts::between(prev.map(|(l, _)| l), &cur.counts, span),
        requests: cur.requests,
        period_ms: cur.period_ms,
        available: cur.available,
        in_flight: cur.in_flight,
        provider,
        spend: cur.spend.clone(),
    }
}

impl Live {
    pub fn new(instance_ttl: Span) -> Self {
        Self {
            instances: Mutex::new(HashMap::new()),
            seen_keys: Mutex::new(HashMap::new()),
            history: Mutex::new(VecDeque::new()),
            instance_ttl_ms: instance_ttl.as_millis(),
            frames: broadcast::channel(64).0,
            streams: Streams::default(),
        }
    }

    /// How long an instance is kept without a report (the one setting;
    /// the store's pruning reads it here too).
    pub fn instance_ttl(&self) -> Span {
        Span::from_millis(self.instance_ttl_ms)
    }

    /// Takes a report received at `now_ms`. The rates are worked out
    /// before the lock is taken; under it only the result is stored.
    pub fn ingest(&self, report: &SyncReport, now_ms: u64) {
        let previous = {
            let mut instances = lock(&self.instances);
            instances.remove(&report.instance)
        };
        let mut state = previous.unwrap_or(InstanceState {
            samples: VecDeque::new(),
            received_ms: now_ms,
            sync_failures: 0,
            rates: BTreeMap::new(),
            limit_rates: BTreeMap::new(),
            key_spans: BTreeMap::new(),
            key_rates: BTreeMap::new(),
            fair: BTreeMap::new(),
        });
        // A clock that went back means a new Envoy under the same name.
        if state
            .samples
            .back()
            .is_some_and(|s| s.at_ms >= report.at_ms)
        {
            state.samples.clear();
        }
        let base = state
            .samples
            .iter()
            .rev()
            .find(|s| s.at_ms.saturating_add(RATE_WINDOW_MS) <= report.at_ms)
            .or(state.samples.front());
        let dt = base.map_or(0, |b| report.at_ms.saturating_sub(b.at_ms));
        state.rates = report
            .policies
            .iter()
            .map(|(name, cur)| {
                let prev = base.and_then(|b| b.counts.get(name));
                (name.clone(), rates(prev, cur, dt))
            })
            .collect();
        state.limit_rates = report
            .limits
            .iter()
            .map(|(name, cur)| {
                let prev = base.and_then(|b| b.limit_counts.get(name));
                (name.clone(), limit_rates(&report.instance, prev, cur, dt))
            })
            .collect();
        while state.samples.len() >= KEPT_SAMPLES
            || state
                .samples
                .front()
                .is_some_and(|s| s.at_ms.saturating_add(10 * RATE_WINDOW_MS) < report.at_ms)
        {
            state.samples.pop_front();
        }
        state.samples.push_back(Sample {
            at_ms: report.at_ms,
            counts: report
                .policies
                .iter()
                .map(|(name, r)| (name.clone(), r.counts))
                .collect(),
            limit_counts: report
                .limits
                .iter()
                .map(|(name, r)| {
                    let provider = r.provider.map(|p| p.counts).unwrap_or_default();
                    (name.clone(), (r.counts, provider))
                })
                .collect(),
        });
        // Policies no longer reported (or of another set) are forgotten.
        state
            .key_spans
            .retain(|name, _| report.keys.contains_key(name));
        for (name, keys) in &report.keys {
            add_span(
                state.key_spans.entry(name.clone()).or_default(),
                keys,
                report.at_ms,
            );
        }
        state.key_rates = state
            .key_spans
            .iter()
            .filter_map(|(name, spans)| Some((name.clone(), KeyRates::of(spans)?)))
            .collect();
        if !report.keys.is_empty() {
            let mut seen = lock(&self.seen_keys);
            for (name, keys) in &report.keys {
                if seen.len() < MAX_SEEN_POLICIES || seen.contains_key(name) {
                    seen.entry(name.clone()).or_default().add(now_ms, keys);
                }
            }
        }
        state.fair = report.fair.clone();
        state.received_ms = now_ms;
        state.sync_failures = report.filter.get("sync_failures").copied().unwrap_or(0);
        let mut instances = lock(&self.instances);
        if instances.len() >= MAX_INSTANCES {
            // Room for this one: the longest silent goes.
            if let Some(oldest) = instances
                .iter()
                .min_by_key(|(_, s)| s.received_ms)
                .map(|(id, _)| id.clone())
            {
                instances.remove(&oldest);
            }
        }
        instances.insert(report.instance.clone(), state);
    }

    /// Per instance tracked: how long since its last sync (ms) and its
    /// filter's failed syncs, for `/metrics`.
    pub fn sync_health(&self, now_ms: u64) -> Vec<(String, u64, u64)> {
        lock(&self.instances)
            .iter()
            .map(|(id, s)| {
                (
                    id.clone(),
                    now_ms.saturating_sub(s.received_ms),
                    s.sync_failures,
                )
            })
            .collect()
    }

    /// Instances tracked now.
    pub fn tracked(&self) -> usize {
        lock(&self.instances).len()
    }

    /// The frame for `now_ms`, from the instances heard from recently.
    pub fn frame(&self, now_ms: u64) -> LiveFrame {
        let mut frame = LiveFrame {
            at_ms: now_ms,
            ..LiveFrame::default()
        };
        let instances = lock(&self.instances);
        for (id, state) in instances.iter() {
            if now_ms.saturating_sub(state.received_ms) > STALE_AFTER_MS {
                continue;
            }
            for (policy, u) in &state.rates {
                frame.policies.entry(policy.clone()).or_default().add(u);
            }
            for (limit, u) in &state.limit_rates {
                frame.limits.entry(limit.clone()).or_default().add(u);
            }
            frame.instances.insert(id.clone(), state.rates.clone());
        }
        for spend in frame.limits.values_mut().filter_map(|u| u.spend.as_mut()) {
            spend.keep_top();
        }
        frame.keys = Self::keys_use(instances.values(), now_ms);
        frame.fair = Self::fair_use(instances.values(), now_ms);
        drop(instances);
        for (name, seen) in lock(&self.seen_keys).iter() {
            let (active, overflowed) = seen.union();
            let keys = frame.keys.entry(name.clone()).or_default();
            keys.active = Some(active.estimate());
            keys.overflowed = Some(overflowed.estimate());
        }
        frame
    }

    /// Per keyed policy, its keys' rates summed over the live instances,
    /// the busiest first.
    fn keys_use<'a>(
        instances: impl Iterator<Item = &'a InstanceState>,
        now_ms: u64,
    ) -> BTreeMap<String, KeysUse> {
        let mut by_label: BTreeMap<&str, (f64, HashMap<&str, KeyUse>)> = BTreeMap::new();
        for state in instances {
            if now_ms.saturating_sub(state.received_ms) > STALE_AFTER_MS {
                continue;
            }
            for (policy, rates) in &state.key_rates {
                let (calls, keys) = by_label.entry(policy).or_default();
                *calls += rates.calls_per_s;
                for k in &rates.top {
                    let sum = keys.entry(&k.label).or_insert_with(|| KeyUse {
                        label: k.label.clone(),
                        ..KeyUse::default()
                    });
                    sum.admitted_per_s += k.admitted_per_s;
                    sum.queued_per_s += k.queued_per_s;
                    sum.refused_per_s += k.refused_per_s;
                    sum.uncertain_per_s += k.uncertain_per_s;
                }
            }
        }
        by_label
            .into_iter()
            .map(|(policy, (calls_per_s, keys))| {
                let mut top: Vec<KeyUse> = keys.into_values().collect();
                top.sort_by(|a, b| {
                    b.admitted_per_s
                        .total_cmp(&a.admitted_per_s)
                        .then_with(|| b.refused_per_s.total_cmp(&a.refused_per_s))
                        .then_with(|| a.label.cmp(&b.label))
                });
                top.truncate(SHOWN_TOP_KEYS);
                let keys = KeysUse {
                    top,
                    calls_per_s,
                    ..KeysUse::default()
                };
                (policy.to_string(), keys)
            })
            .collect()
    }

    /// Per policy shared fairly, its keys summed over the live instances
    /// (a key is hashed alike on every Envoy), the most demanding first.
    fn fair_use<'a>(
        instances: impl Iterator<Item = &'a InstanceState>,
        now_ms: u64,
    ) -> BTreeMap<String, Vec<FairKeyUse>> {
        let mut by_key: BTreeMap<&str, HashMap<u64, FairKeyView>> = BTreeMap::new();
        for state in instances {
            if now_ms.saturating_sub(state.received_ms) > STALE_AFTER_MS {
                continue;
            }
            for (policy, keys) in &state.fair {
                let summed = by_key.entry(policy).or_default();
                for k in keys {
                    let sum = summed.entry(k.key).or_insert(FairKeyView {
                        key: k.key,
                        ..FairKeyView::default()
                    });
                    sum.weight = sum.weight.max(k.weight);
                    sum.share += k.share;
                    sum.used += k.used;
                    sum.demand += k.demand;
                    sum.slots |= k.slots;
                }
            }
        }
        by_key
            .into_iter()
            .map(|(policy, keys)| {
                let mut top: Vec<FairKeyView> = keys.into_values().collect();
                top.sort_by(|a, b| b.demand.total_cmp(&a.demand).then(a.key.cmp(&b.key)));
                top.truncate(SHOWN_TOP_KEYS);
                let shown = top
                    .into_iter()
                    .map(|k| FairKeyUse {
                        label: if k.key == OVERFLOW_KEY {
                            FAIR_OVERFLOW_LABEL.to_string()
                        } else {
                            hash_label(k.key)
                        },
                        weight: k.weight as f64 / WEIGHT_SCALE as f64,
                        share_per_s: k.share,
                        used_per_s: k.used,
                        demand_per_s: k.demand,
                        slots: k.slots,
                    })
                    .collect();
                (policy.to_string(), shown)
            })
            .collect()
    }

    /// Forgets instances silent past the TTL, then records and broadcasts
    /// the frame for `now_ms`. Returns the frame.
    pub fn tick(&self, now_ms: u64) -> Arc<LiveFrame> {
        let ttl = self.instance_ttl_ms;
        lock(&self.instances).retain(|_, s| now_ms.saturating_sub(s.received_ms) <= ttl);
        lock(&self.seen_keys).retain(|_, seen| {
            seen.forget_before(now_ms);
            !seen.seconds.is_empty()
        });
        let frame = Arc::new(self.frame(now_ms));
        {
            let mut history = lock(&self.history);
            if history.len() >= HISTORY_FRAMES {
                history.pop_front();
            }
            // History keeps the per-policy figures; the per-instance ones
            // are in the frame broadcast now.
            history.push_back(Arc::new(LiveFrame {
                instances: BTreeMap::new(),
                keys: BTreeMap::new(),
                fair: BTreeMap::new(),
                ..(*frame).clone()
            }));
        }
        // No receivers is fine: nobody is watching.
        let _ = self.frames.send(Arc::clone(&frame));
        frame
    }

    /// The recent frames, shared (not copied) with the caller.
    pub fn history(&self) -> Vec<Arc<LiveFrame>> {
        lock(&self.history).iter().cloned().collect()
    }
}
