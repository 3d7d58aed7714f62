//! What one Envoy's provider said, relayed to the others: a limit they
//! share (`scope: global`) that one Envoy finds paused by the provider
//! (`Retry-After`) or its adapted rate cut, every Envoy syncing here
//! pauses or cuts too, at its next sync.
//!
//! Only what a provider said first-hand is relayed: a pause an Envoy took
//! from this relay is reported as `relayed` and not passed on again, and a
//! cut within [`CUT_GUARD_MS`] of the one heard is the same overload.
//! Times are kept by this admin's clock and sent as relative spans, so the
//! Envoys' clocks need not agree with it. Bounded whatever Envoys send:
//! at most [`MAX_LIMITS`] limits, a pause of at most [`MAX_PAUSE_MS`].

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use sluice_shared::sync::{
    LimitNews, ProviderNews, SyncReport, MAX_PROVIDER_NEWS, RELAYED_CUT_FOR_MS,
};

/// Limits whose news is kept at once; past it, what ends first goes.
pub const MAX_LIMITS: usize = 10_000;
/// No provider pause is relayed for longer (the policy's own cap,
/// `max_pause`, is at most a day; each Envoy applies its own).
pub const MAX_PAUSE_MS: u64 = 24 * 60 * 60 * 1000;
/// Cuts this close to the one heard are of the same overload (the filter's
/// guard between its own cuts).
pub const CUT_GUARD_MS: u64 = 250;

#[derive(Debug, Clone, Default, PartialEq)]
struct Heard {
    pause_until_ms: u64,
    status: u16,
    paused_by: String,
    cut_at_ms: u64,
    cut_by: String,
}

impl Heard {
    fn ends_ms(&self) -> u64 {
        self.pause_until_ms
            .max(self.cut_at_ms.saturating_add(RELAYED_CUT_FOR_MS))
    }
}

#[derive(Debug, Default)]
pub struct ProviderRelay {
    heard: Mutex<HashMap<String, Heard>>,
}

impl ProviderRelay {
    /// Takes the news in `report`, received at `now_ms` by this admin's
    /// clock.
    pub fn hear(&self, report: &SyncReport, now_ms: u64) {
        let mut heard = lock(&self.heard);
        for (name, limit) in &report.limits {
            let Some(provider) = &limit.provider else {
                continue;
            };
            let pause = provider
                .pause
                .filter(|p| !p.relayed && p.left_ms > 0)
                .map(|p| (now_ms.saturating_add(p.left_ms.min(MAX_PAUSE_MS)), p.status));
            let cut = provider
                .cut_ago_ms
                .filter(|&ago| ago < RELAYED_CUT_FOR_MS)
                .map(|ago| now_ms.saturating_sub(ago));
            if pause.is_none() && cut.is_none() {
                continue;
            }
            if !heard.contains_key(name) && heard.len() >= MAX_LIMITS {
                heard.retain(|_, h| h.ends_ms() > now_ms);
                if heard.len() >= MAX_LIMITS {
                    if let Some(first) = heard
                        .iter()
                        .min_by_key(|(_, h)| h.ends_ms())
                        .map(|(n, _)| n.clone())
                    {
                        heard.remove(&first);
                    }
                }
            }
            let entry = heard.entry(name.clone()).or_default();
            if let Some((until, status)) = pause {
                if until > entry.pause_until_ms {
                    entry.pause_until_ms = until;
                    entry.status = status;
                    entry.paused_by.clone_from(&report.instance);
                }
            }
            if let Some(at) = cut {
                if at > entry.cut_at_ms.saturating_add(CUT_GUARD_MS) {
                    entry.cut_at_ms = at;
                    entry.cut_by.clone_from(&report.instance);
                }
            }
        }
    }

    /// The news for `report`'s Envoy at `now_ms`: pauses still running and
    /// recent cuts of the limits it reported, that other Envoys heard.
    pub fn news_for(&self, report: &SyncReport, now_ms: u64) -> ProviderNews {
        let heard = lock(&self.heard);
        let mut news = ProviderNews::new();
        if heard.is_empty() {
            return news;
        }
        for name in report.limits.keys() {
            if news.len() >= MAX_PROVIDER_NEWS {
                break;
            }
            let Some(h) = heard.get(name) else {
                continue;
            };
            let mut item = LimitNews::default();
            if h.pause_until_ms > now_ms && h.paused_by != report.instance {
                item.pause_ms = Some(h.pause_until_ms - now_ms);
                item.status = h.status;
            }
            let ago = now_ms.saturating_sub(h.cut_at_ms);
            if h.cut_at_ms > 0 && ago < RELAYED_CUT_FOR_MS && h.cut_by != report.instance {
                item.cut_ago_ms = Some(ago);
            }
            if item != LimitNews::default() {
                news.insert(name.clone(), item);
            }
        }
        news
    }

    /// Limits with news kept now.
    pub fn len(&self) -> usize {
        lock(&self.heard).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock leaves plain data: keep going.
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_shared::sync::{LimitReport, PauseReport, ProviderReport};

    fn report(instance: &str, provider: Option<ProviderReport>) -> SyncReport {
        let mut r = SyncReport {
            instance: instance.into(),
            ..SyncReport::default()
        };
        r.limits.insert(
            "rpm".into(),
            LimitReport {
                provider,
                ..LimitReport::default()
            },
        );
        r
    }

    fn paused(left_ms: u64, relayed: bool) -> Option<ProviderReport> {
        Some(ProviderReport {
            pause: Some(PauseReport {
                ran_ms: 10,
                left_ms,
                status: 429,
                relayed,
            }),
            ..ProviderReport::default()
        })
    }

    #[test]
    fn a_pause_one_envoy_saw_reaches_the_others_for_what_is_left() {
        let relay = ProviderRelay::default();
        relay.hear(&report("a", paused(3_000, false)), 1_000);
        let news = relay.news_for(&report("b", None), 1_500);
        assert_eq!(news["rpm"].pause_ms, Some(2_500));
        assert_eq!(news["rpm"].status, 429);
        assert!(
            relay.news_for(&report("a", None), 1_500).is_empty(),
            "not back to its source"
        );
        assert!(relay.news_for(&report("b", None), 4_000).is_empty(), "over");
        // b reports the pause it took from the relay: not news.
        relay.hear(&report("b", paused(2_600, true)), 1_600);
        assert!(relay.news_for(&report("a", None), 1_700).is_empty());
    }

    #[test]
    fn a_cut_is_relayed_for_a_while_and_its_echo_is_not_a_new_one() {
        let relay = ProviderRelay::default();
        let cut = |ago| {
            Some(ProviderReport {
                cut_ago_ms: Some(ago),
                ..ProviderReport::default()
            })
        };
        relay.hear(&report("a", cut(100)), 10_000);
        assert_eq!(
            relay
                .news_for(&report("b", None), 10_400)
                .get("rpm")
                .and_then(|n| n.cut_ago_ms),
            Some(500)
        );
        // b followed it and reports it back, a few ms apart: still a's.
        relay.hear(&report("b", cut(495)), 10_400);
        assert!(relay.news_for(&report("a", None), 10_500).is_empty());
        assert!(relay
            .news_for(&report("c", None), 10_000 + RELAYED_CUT_FOR_MS)
            .is_empty());
        // Old news is not taken.
        relay.hear(&report("c", cut(RELAYED_CUT_FOR_MS)), 20_000);
        assert!(relay.news_for(&report("a", None), 20_000).is_empty());
    }

    #[test]
    fn hostile_reports_are_bounded() {
        let relay = ProviderRelay::default();
        relay.hear(&report("a", paused(u64::MAX, false)), 1_000);
        let news = relay.news_for(&report("b", None), 1_000);
        assert_eq!(news["rpm"].pause_ms, Some(MAX_PAUSE_MS));
        for i in 0..MAX_LIMITS + 10 {
            let mut r = report("a", None);
            r.limits.clear();
            r.limits.insert(
                format!("l{i}"),
                LimitReport {
                    provider: paused(1_000 + i as u64, false),
                    ..LimitReport::default()
                },
            );
            relay.hear(&r, 2_000);
        }
        assert_eq!(relay.len(), MAX_LIMITS);
        // Only the limits an Envoy reports are news to it, at most so many.
        let mut many = report("b", None);
        many.limits = (0..MAX_LIMITS)
            .map(|i| (format!("l{i}"), LimitReport::default()))
            .collect();
        assert_eq!(relay.news_for(&many, 2_000).len(), MAX_PROVIDER_NEWS);
    }
}
