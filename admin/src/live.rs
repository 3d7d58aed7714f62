//! Live utilization: turns the cumulative counters each Envoy reports on
//! sync into per-second rates, keeps the last minutes per policy and per
//! instance, and broadcasts one frame a second to the UI's SSE streams.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Mutex;

use sluice_shared::api::{LiveFrame, Utilization};
use sluice_shared::sync::{PolicyReport, SyncReport};
use sluice_shared::Span;
use tokio::sync::broadcast;

/// Ten minutes of one-second frames.
pub const HISTORY_FRAMES: usize = 600;
/// An instance silent for longer no longer counts towards live figures.
pub const STALE_AFTER_MS: u64 = 5_000;

struct InstanceState {
    /// Recent reports, oldest first: rates are taken over about a second
    /// of the Envoy's clock, whatever its sync interval.
    reports: VecDeque<SyncReport>,
    received_ms: u64,
    rates: BTreeMap<String, Utilization>,
}

/// Rates span at least this much of the Envoy's clock when it can.
const RATE_WINDOW_MS: u64 = 1_000;
const KEPT_REPORTS: usize = 64;

pub struct Live {
    instances: Mutex<HashMap<String, InstanceState>>,
    history: Mutex<VecDeque<LiveFrame>>,
    pub frames: broadcast::Sender<LiveFrame>,
}

impl Default for Live {
    fn default() -> Self {
        Self {
            instances: Mutex::new(HashMap::new()),
            history: Mutex::new(VecDeque::new()),
            frames: broadcast::channel(64).0,
        }
    }
}

fn per_second(now: u64, before: u64, dt_ms: u64) -> f64 {
    // A counter that went down means the Envoy restarted: count from zero.
    let delta = if now >= before { now - before } else { now };
    delta as f64 / Span::from_millis(dt_ms).as_secs_f64()
}

fn rates(prev: Option<&PolicyReport>, cur: &PolicyReport, dt_ms: u64) -> Utilization {
    let zero = PolicyReport::default();
    let prev = prev.unwrap_or(&zero);
    let (admitted, rejected, queued, shadow) = if dt_ms == 0 {
        (0.0, 0.0, 0.0, 0.0)
    } else {
        (
            per_second(cur.admitted, prev.admitted, dt_ms),
            per_second(cur.rejected, prev.rejected, dt_ms),
            per_second(cur.queued, prev.queued, dt_ms),
            per_second(cur.shadow_limited, prev.shadow_limited, dt_ms),
        )
    };
    Utilization {
        admitted_per_s: admitted,
        rejected_per_s: rejected,
        queued_per_s: queued,
        shadow_limited_per_s: shadow,
        in_flight: cur.in_flight,
        max_in_flight: cur.max_in_flight,
        waiting: cur.waiting,
        tokens: cur.tokens,
    }
}

impl Live {
    /// Takes a report received at `now_ms`.
    pub fn ingest(&self, report: &SyncReport, now_ms: u64) {
        let Ok(mut instances) = self.instances.lock() else {
            return;
        };
        let mut state = instances.remove(&report.instance).unwrap_or(InstanceState {
            reports: VecDeque::new(),
            received_ms: now_ms,
            rates: BTreeMap::new(),
        });
        // A clock that went back means a new Envoy under the same name.
        if state
            .reports
            .back()
            .is_some_and(|r| r.at_ms >= report.at_ms)
        {
            state.reports.clear();
        }
        let base = state
            .reports
            .iter()
            .rev()
            .find(|r| r.at_ms + RATE_WINDOW_MS <= report.at_ms)
            .or(state.reports.front());
        state.rates = match base {
            Some(prev) => {
                let dt = report.at_ms - prev.at_ms;
                report
                    .policies
                    .iter()
                    .map(|(name, cur)| (name.clone(), rates(prev.policies.get(name), cur, dt)))
                    .collect()
            }
            None => report
                .policies
                .iter()
                .map(|(name, cur)| (name.clone(), rates(Some(cur), cur, 0)))
                .collect(),
        };
        if state.reports.len() >= KEPT_REPORTS {
            state.reports.pop_front();
        }
        while state
            .reports
            .front()
            .is_some_and(|r| r.at_ms + 10 * RATE_WINDOW_MS < report.at_ms)
        {
            state.reports.pop_front();
        }
        state.reports.push_back(report.clone());
        state.received_ms = now_ms;
        instances.insert(report.instance.clone(), state);
    }

    /// The frame for `now_ms`, from the instances heard from recently.
    pub fn frame(&self, now_ms: u64) -> LiveFrame {
        let mut frame = LiveFrame {
            at_ms: now_ms,
            ..LiveFrame::default()
        };
        let Ok(instances) = self.instances.lock() else {
            return frame;
        };
        for (id, state) in instances.iter() {
            if now_ms.saturating_sub(state.received_ms) > STALE_AFTER_MS {
                continue;
            }
            for (policy, u) in &state.rates {
                frame.policies.entry(policy.clone()).or_default().add(u);
            }
            frame.instances.insert(id.clone(), state.rates.clone());
        }
        frame
    }

    /// Records and broadcasts the frame for `now_ms`.
    pub fn tick(&self, now_ms: u64) {
        let frame = self.frame(now_ms);
        if let Ok(mut history) = self.history.lock() {
            if history.len() >= HISTORY_FRAMES {
                history.pop_front();
            }
            history.push_back(frame.clone());
        }
        // No receivers is fine: nobody is watching.
        let _ = self.frames.send(frame);
    }

    pub fn history(&self) -> Vec<LiveFrame> {
        self.history
            .lock()
            .map(|h| h.iter().cloned().collect())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(at_ms: u64, admitted: u64, in_flight: u64) -> SyncReport {
        let mut policies = BTreeMap::new();
        policies.insert(
            "bank".to_string(),
            PolicyReport {
                admitted,
                rejected: admitted / 2,
                in_flight,
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
            filter: BTreeMap::new(),
            shares: BTreeMap::new(),
        }
    }

    #[test]
    fn rates_come_from_counter_deltas_over_the_envoy_clock() {
        let live = Live::default();
        live.ingest(&report(10_000, 100, 4), 50_000);
        live.ingest(&report(12_000, 300, 7), 50_100);
        let frame = live.frame(50_200);
        let bank = frame.policies["bank"];
        assert_eq!(bank.admitted_per_s, 100.0);
        assert_eq!(bank.rejected_per_s, 50.0);
        assert_eq!(bank.in_flight, 7);
        assert_eq!(bank.tokens, Some(3));
        // A silent instance drops out of the live figures.
        assert!(live.frame(50_100 + STALE_AFTER_MS + 1).policies.is_empty());
    }

    #[test]
    fn a_restarted_envoy_does_not_give_negative_rates() {
        let live = Live::default();
        live.ingest(&report(10_000, 1000, 0), 1);
        live.ingest(&report(11_000, 20, 0), 2);
        assert_eq!(live.frame(3).policies["bank"].admitted_per_s, 20.0);
    }

    #[test]
    fn history_is_bounded() {
        let live = Live::default();
        for t in 0..(HISTORY_FRAMES as u64 + 10) {
            live.tick(t);
        }
        assert_eq!(live.history().len(), HISTORY_FRAMES);
    }
}
