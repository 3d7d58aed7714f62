//! Live utilization: turns the cumulative counters each Envoy reports on
//! sync into per-second rates, keeps the last minutes per policy, and
//! broadcasts one frame a second to the UI's SSE streams.
//!
//! Memory is bounded whatever the Envoys send: per instance only a few
//! samples of its counters (not its reports), at most [`MAX_INSTANCES`]
//! instances, each forgotten once silent for the instance TTL; history
//! frames keep per-policy figures only (per-instance figures are in the
//! newest frame) and are shared, not copied, with every stream.

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

/// One Envoy's keys of one policy, a second.
#[derive(Debug, Clone, Default)]
struct KeyRates {
    top: Vec<KeyUse>,
    calls_per_s: f64,
}

/// One report's key counts, over the span `since_ms..at_ms` of the Envoy's
/// clock.
#[derive(Debug, Clone)]
struct KeySpan {
    since_ms: u64,
    at_ms: u64,
    top: TopKeys,
}

impl KeyRates {
    /// Rates over the recent spans together: at least a second of them
    /// when there is, as for the policies' rates, so that a key calling a
    /// few times a second does not flicker between 0 and 8 at a 250 ms
    /// sync interval.
    fn of(spans: &VecDeque<KeySpan>) -> Option<Self> {
        let first = spans.front()?;
        let last = spans.back()?;
        // A span of nothing (or a clock gone back) gives no rate.
        let ms = last
            .at_ms
            .checked_sub(first.since_ms)
            .filter(|&ms| ms > 0)?;
        let seconds = Span::from_millis(ms).as_secs_f64();
        let mut summed: HashMap<&str, KeyUse> = HashMap::new();
        let mut calls = 0u64;
        for span in spans {
            calls = calls.saturating_add(span.top.total);
            for k in &span.top.keys {
                let sum = summed.entry(&k.label).or_insert_with(|| KeyUse {
                    label: k.label.clone(),
                    ..KeyUse::default()
                });
                sum.admitted_per_s += k.admitted as f64;
                sum.queued_per_s += k.queued as f64;
                sum.refused_per_s += k.refused as f64;
                sum.uncertain_per_s += k.error as f64;
            }
        }
        let top = summed
            .into_values()
            .map(|k| KeyUse {
                admitted_per_s: k.admitted_per_s / seconds,
                queued_per_s: k.queued_per_s / seconds,
                refused_per_s: k.refused_per_s / seconds,
                uncertain_per_s: k.uncertain_per_s / seconds,
                label: k.label,
            })
            .collect();
        Some(KeyRates {
            top,
            calls_per_s: calls as f64 / seconds,
        })
    }
}

/// Adds a report's key counts to an Envoy's recent spans of one policy,
/// keeping about a second of them. A span that does not begin where the
/// last ended (a report lost on the way) starts them over, since the
/// calls of the gap are missing.
fn add_span(spans: &mut VecDeque<KeySpan>, report: &KeysReport, at_ms: u64) {
    if spans
        .back()
        .is_some_and(|last| last.at_ms != report.since_ms)
    {
        spans.clear();
    }
    spans.push_back(KeySpan {
        since_ms: report.since_ms,
        at_ms,
        top: report.top.clone(),
    });
    while spans.len() > KEPT_SAMPLES
        || spans
            .get(1)
            .is_some_and(|next| at_ms.saturating_sub(next.since_ms) >= RATE_WINDOW_MS)
    {
        spans.pop_front();
    }
}

/// Which keys of a policy the Envoys saw, per second of the admin's clock
/// over the last [`KEYS_ACTIVE_FOR_MS`]: distinct keys are counted over
/// every Envoy, a key busy on two counting once.
#[derive(Debug, Default)]
struct SeenKeys {
    /// (second, keys seen, keys overflowed), oldest first.
    seconds: VecDeque<(u64, KeyBitmap, KeyBitmap)>,
}

impl SeenKeys {
    fn add(&mut self, now_ms: u64, report: &KeysReport) {
        let second = now_ms / 1000;
        match self.seconds.back_mut() {
            Some((s, seen, overflowed)) if *s == second => {
                seen.union(&report.seen);
                overflowed.union(&report.overflowed);
            }
            _ => self
                .seconds
                .push_back((second, report.seen.clone(), report.overflowed.clone())),
        }
        self.forget_before(now_ms);
    }

    fn forget_before(&mut self, now_ms: u64) {
        let oldest = now_ms.saturating_sub(KEYS_ACTIVE_FOR_MS) / 1000;
        while self.seconds.front().is_some_and(|(s, _, _)| *s < oldest) {
            self.seconds.pop_front();
        }
    }

    fn union(&self) -> (KeyBitmap, KeyBitmap) {
        let (mut seen, mut overflowed) = (KeyBitmap::default(), KeyBitmap::default());
        for (_, s, o) in &self.seconds {
            seen.union(s);
            overflowed.union(o);
        }
        (seen, overflowed)
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_wire::counts::Counter;

    fn counts<C: Counter>(values: &[(C, u64)]) -> Counts<C> {
        let mut counts = Counts::default();
        for &(c, v) in values {
            counts.set(c, v);
        }
        counts
    }

    fn report(at_ms: u64, admitted: u64, in_flight: u64) -> SyncReport {
        let mut policies = BTreeMap::new();
        policies.insert(
            "bank".to_string(),
            PolicyReport {
                counts: counts(&[
                    (PolicyCounter::Admitted, admitted),
                    (PolicyCounter::Rejected, admitted / 2),
                    (PolicyCounter::InFlight, in_flight),
                ]),
                max_in_flight: 10,
                tokens: Some(3),
                ..PolicyReport::default()
            },
        );
        SyncReport {
            instance: "e1".into(),
            policy_version: 1,
            at_ms,
            policies,
            ..SyncReport::default()
        }
    }

    #[test]
    fn rates_come_from_counter_deltas_over_the_envoy_clock() {
        let live = Live::default();
        live.ingest(&report(10_000, 100, 4), 50_000);
        live.ingest(&report(12_000, 300, 7), 50_100);
        let frame = live.frame(50_200);
        let bank = frame.policies["bank"];
        assert_eq!(bank.counts.per_s(PolicyCounter::Admitted), 100.0);
        assert_eq!(bank.counts.per_s(PolicyCounter::Rejected), 50.0);
        assert_eq!(bank.counts.now(PolicyCounter::InFlight), 7);
        assert_eq!(bank.tokens, Some(3));
        // A silent instance drops out of the live figures.
        assert!(live.frame(50_100 + STALE_AFTER_MS + 1).policies.is_empty());
    }

    #[test]
    fn a_further_limits_use_is_summed_over_envoys_against_its_size() {
        let live = Live::default();
        let with_limit = |instance: &str, at_ms: u64, tokens: u64, available: u64| {
            let mut r = report(at_ms, 0, 0);
            r.instance = instance.into();
            r.limits.insert(
                "tpm".into(),
                LimitReport {
                    counts: counts(&[
                        (LimitCounter::Admitted, tokens / 100),
                        (LimitCounter::Refused, 1),
                        (LimitCounter::Tokens, tokens),
                    ]),
                    requests: 30_000,
                    period_ms: 60_000,
                    available: Some(available),
                    in_flight: None,
                    provider: None,
                    spend: None,
                },
            );
            r
        };
        live.ingest(&with_limit("e1", 10_000, 1_000, 500), 1);
        live.ingest(&with_limit("e1", 12_000, 1_600, 400), 2);
        live.ingest(&with_limit("e2", 5_000, 0, 900), 3);
        live.ingest(&with_limit("e2", 6_000, 100, 800), 4);
        let tpm = live.frame(5).limits["tpm"].clone();
        // 300/s from e1 and 100/s from e2.
        assert_eq!(tpm.counts.per_s(LimitCounter::Tokens), 400.0);
        assert_eq!(tpm.used_per_period(), 24_000.0);
        assert_eq!((tpm.requests, tpm.period_ms), (30_000, 60_000));
        assert_eq!(tpm.available, Some(1_200));
    }

    #[test]
    fn a_budgets_spend_is_summed_over_envoys_and_its_keys_by_hash() {
        use sluice_shared::spend::{KeySpend, SpendReport};
        let live = Live::default();
        let key = |label: &str, hash: u64, spent: u64| KeySpend {
            label: label.into(),
            hash,
            spent,
            size: 1_000,
        };
        let with_spend = |instance: &str, keys: Vec<KeySpend>| {
            let mut r = report(10_000, 0, 0);
            r.instance = instance.into();
            r.limits.insert(
                "team-daily".into(),
                LimitReport {
                    requests: 1_000,
                    period_ms: 86_400_000,
                    spend: Some(SpendReport {
                        spent: keys.iter().map(|k| k.spent).sum(),
                        size: 1_000,
                        spending_keys: keys.len() as u64,
                        keys,
                        ..SpendReport::default()
                    }),
                    ..LimitReport::default()
                },
            );
            r
        };
        live.ingest(
            &with_spend("e1", vec![key("team-a", 1, 300), key("team-b", 2, 200)]),
            1,
        );
        live.ingest(&with_spend("e2", vec![key("team-b", 2, 250)]), 2);
        let spend = live.frame(3).limits["team-daily"]
            .spend
            .clone()
            .expect("spend");
        assert_eq!((spend.spent, spend.spending_keys), (750, 3));
        let keys: Vec<(&str, u64, u64)> = spend
            .keys
            .iter()
            .map(|k| (k.label.as_str(), k.spent, k.size))
            .collect();
        assert_eq!(keys, [("team-b", 450, 2_000), ("team-a", 300, 1_000)]);
    }

    #[test]
    fn a_concurrency_limits_calls_in_flight_are_summed_over_envoys() {
        let live = Live::default();
        let with_slots = |instance: &str, at_ms: u64, in_flight: u64| {
            let mut r = report(at_ms, 0, 0);
            r.instance = instance.into();
            r.limits.insert(
                "account-in-flight".into(),
                LimitReport {
                    counts: counts(&[(LimitCounter::Admitted, 10), (LimitCounter::Tokens, 10)]),
                    requests: 20,
                    period_ms: 0,
                    available: Some(20 - in_flight),
                    in_flight: Some(in_flight),
                    provider: None,
                    spend: None,
                },
            );
            r
        };
        live.ingest(&with_slots("e1", 5_000, 6), 1);
        live.ingest(&with_slots("e2", 5_000, 9), 2);
        let slots = live.frame(3).limits["account-in-flight"].clone();
        assert!(slots.is_concurrency());
        assert_eq!(slots.in_flight, Some(15));
        assert_eq!(slots.requests, 20);
    }

    #[test]
    fn a_restarted_envoy_does_not_give_negative_rates() {
        let live = Live::default();
        live.ingest(&report(10_000, 1000, 0), 1);
        live.ingest(&report(11_000, 20, 0), 2);
        let bank = live.frame(3).policies["bank"];
        assert_eq!(bank.counts.per_s(PolicyCounter::Admitted), 20.0);
    }

    #[test]
    fn history_is_bounded() {
        let live = Live::default();
        for t in 0..(HISTORY_FRAMES as u64 + 10) {
            live.tick(t);
        }
        assert_eq!(live.history().len(), HISTORY_FRAMES);
    }

    #[test]
    fn huge_and_hostile_values_never_panic_or_poison() {
        let live = Live::default();
        let mut huge = report(u64::MAX, u64::MAX, u64::MAX);
        huge.instance = "e2".into();
        live.ingest(&report(0, 0, 0), 1);
        live.ingest(&huge, 2);
        live.ingest(&report(u64::MAX - 5, u64::MAX, u64::MAX), 3);
        live.ingest(&huge, 4);
        // Two instances at u64::MAX in flight each: the sum saturates.
        let bank = live.frame(5).policies["bank"];
        assert_eq!(bank.counts.now(PolicyCounter::InFlight), u64::MAX);
        live.tick(6);
        assert_eq!(live.history().len(), 1);
    }

    #[test]
    fn instances_are_bounded_and_forgotten_when_silent() {
        let live = Live::new(Span::from_secs(60));
        for i in 0..(MAX_INSTANCES + 50) {
            let mut r = report(1_000, 10, 0);
            r.instance = format!("e{i}");
            live.ingest(&r, i as u64);
        }
        assert_eq!(live.tracked(), MAX_INSTANCES);
        live.tick(200_000);
        assert_eq!(live.tracked(), 0, "silent past the TTL");
    }

    #[test]
    fn fair_keys_are_summed_over_envoys_by_hash_and_shown_by_demand() {
        let live = Live::default();
        let key = |key: u64, share: f64, demand: f64| FairKeyView {
            key,
            weight: 2 * WEIGHT_SCALE,
            share,
            used: share,
            demand,
            slots: false,
        };
        let mut a = report(1_000, 0, 0);
        a.instance = "a".into();
        a.fair.insert(
            "llm".into(),
            vec![key(7, 20.0, 100.0), key(OVERFLOW_KEY, 5.0, 5.0)],
        );
        let mut b = report(1_000, 0, 0);
        b.instance = "b".into();
        b.fair
            .insert("llm".into(), vec![key(7, 10.0, 50.0), key(9, 30.0, 40.0)]);
        live.ingest(&a, 1);
        live.ingest(&b, 2);
        let frame = live.tick(3);
        let shown: Vec<(&str, f64, f64, f64)> = frame.fair["llm"]
            .iter()
            .map(|k| (k.label.as_str(), k.weight, k.share_per_s, k.demand_per_s))
            .collect();
        let (seven, nine) = (hash_label(7), hash_label(9));
        assert_eq!(
            shown,
            [
                (seven.as_str(), 2.0, 30.0, 150.0),
                (nine.as_str(), 2.0, 30.0, 40.0),
                (FAIR_OVERFLOW_LABEL, 2.0, 5.0, 5.0)
            ]
        );
        // Per key, in the newest frame only.
        assert!(live.history()[0].fair.is_empty());
        // At most the top 20 of many keys.
        let mut many = report(1_000, 0, 0);
        many.fair.insert(
            "llm".into(),
            (1..=64).map(|k| key(k, 1.0, k as f64)).collect(),
        );
        live.ingest(&many, 4);
        let frame = live.frame(5);
        assert_eq!(frame.fair["llm"].len(), SHOWN_TOP_KEYS);
        assert_eq!(frame.fair["llm"][0].label, hash_label(64));
    }

    fn keyed(instance: &str, at_ms: u64, since_ms: u64, calls: &[(&[u8], u64)]) -> SyncReport {
        use sluice_shared::key_view::{label_secret, name_key, KeyOutcome, ENVOY_TOP_KEYS};
        let secret = label_secret(Some("t"));
        let mut keys = KeysReport {
            since_ms,
            ..KeysReport::default()
        };
        for (key, n) in calls {
            let name = name_key(&secret, "llm", key, sluice_shared::KeyLabel::Hash);
            for _ in 0..*n {
                keys.record(&name, KeyOutcome::Admitted, false, ENVOY_TOP_KEYS);
            }
        }
        let mut r = report(at_ms, 0, 0);
        r.instance = instance.into();
        r.keys.insert("llm".into(), keys);
        r
    }

    #[test]
    fn keys_are_summed_over_envoys_and_counted_once_when_on_both() {
        use sluice_shared::key_view::KeyEstimate;
        let live = Live::default();
        // e1: a 20/s, b 5/s over 2 s; e2: b 30/s over 1 s, c 1/s.
        live.ingest(
            &keyed("e1", 12_000, 10_000, &[(b"a", 40), (b"b", 10)]),
            100_000,
        );
        live.ingest(
            &keyed("e2", 6_000, 5_000, &[(b"b", 30), (b"c", 1)]),
            100_200,
        );
        let frame = live.frame(100_300);
        let llm = &frame.keys["llm"];
        let rates: Vec<f64> = llm.top.iter().map(|k| k.admitted_per_s).collect();
        assert_eq!(rates, [35.0, 20.0, 1.0]);
        assert_eq!(llm.calls_per_s, 56.0);
        assert_eq!(llm.active, Some(KeyEstimate::About(3)));
        assert_eq!(llm.overflowed, Some(KeyEstimate::About(0)));
        // Keys live in the newest frame only.
        live.tick(100_400);
        assert!(live.history()[0].keys.is_empty());
        // Ten seconds later the keys are no longer active.
        let later = live.tick(100_300 + KEYS_ACTIVE_FOR_MS + 1_000);
        assert!(later.keys.is_empty(), "{:?}", later.keys);
    }

    #[test]
    fn hostile_key_reports_give_no_rates_and_cannot_grow_the_view() {
        let live = Live::default();
        // A span of nothing or backwards: no rates, no panic.
        live.ingest(&keyed("e1", 5_000, 5_000, &[(b"a", 4)]), 1);
        live.ingest(&keyed("e2", 5_000, u64::MAX, &[(b"a", 4)]), 2);
        let frame = live.frame(3);
        assert!(frame.keys["llm"].top.is_empty());
        for i in 0..(MAX_SEEN_POLICIES + 20) {
            let mut r = keyed("e3", 5_000 + i as u64, 4_000, &[(b"a", 1)]);
            let keys = r.keys.remove("llm").unwrap();
            r.keys.insert(format!("p{i}"), keys);
            live.ingest(&r, 4);
        }
        assert!(lock(&live.seen_keys).len() <= MAX_SEEN_POLICIES);
    }

    #[test]
    fn a_keys_rate_spans_a_second_of_short_reports() {
        let live = Live::default();
        // 250 ms reports of a key calling 4 times a second: 1, 2, 1, 0.
        for (i, n) in [1u64, 2, 1, 0, 1].into_iter().enumerate() {
            let at = 10_000 + 250 * (i as u64 + 1);
            live.ingest(&keyed("e1", at, at - 250, &[(b"a", n)]), at);
        }
        let llm = &live.frame(11_300).keys["llm"];
        // The last second: 2, 1, 0, 1.
        assert_eq!(llm.top[0].admitted_per_s, 4.0);
        // A report that does not follow on (a gap) starts the spans over.
        live.ingest(&keyed("e1", 20_000, 19_500, &[(b"a", 3)]), 11_400);
        assert_eq!(live.frame(11_500).keys["llm"].top[0].admitted_per_s, 6.0);
    }
}
