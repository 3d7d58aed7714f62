//! What one Envoy's provider said, relayed to the others: a limit they
//! share (`scope: global`, unkeyed, listening to its provider, in the
//! policy set) that one Envoy finds paused by the provider (`Retry-After`)
//! or its adapted rate cut, every Envoy syncing here pauses or cuts too,
//! at its next sync. News of any other name is not heard.
//!
//! Only what a provider said first-hand is relayed: a pause an Envoy took
//! from this relay is reported as `relayed` and not passed on again, and a
//! cut within [`CUT_GUARD_MS`] of the one heard is the same overload.
//! Pause news comes in stretches ([`RelayedStretch`]): re-reported at
//! every sync, a pause is relayed for the limit's `max_pause` in total from
//! the first report, and again only once the news went quiet for as long.
//! Each stretch is logged with the instance that began it. Times are kept
//! by the admin's wall clock and sent as relative spans, so the Envoys'
//! clocks need not agree with it. Bounded whatever Envoys send: at most
//! [`MAX_LIMITS`] limits in memory.
//!
//! One admin keeps the news in memory; replicas sharing Redis (as their
//! fleet ledgers do) keep it there (`kv.rs`): two keys per limit, a pause
//! and a cut, that expire with the news, each changed only by
//! compare-and-set, so an Envoy hears what another said to any replica.

use std::collections::HashMap;

use sluice_shared::provider::RelayedStretch;
use sluice_shared::{Instant, PolicySet, Scope, Span};
use sluice_wire::sync::{
    LimitNews, ProviderNews, ProviderReport, SyncReport, MAX_PROVIDER_NEWS, RELAYED_CUT_FOR_MS,
};

use crate::kv::{Kv, KvError, RedisConnection, Write};

/// Limits whose news is kept in memory at once; past it, what ends first
/// goes.
pub const MAX_LIMITS: usize = 10_000;
/// Cuts this close to the one heard are of the same overload (the filter's
/// guard between its own cuts).
pub const CUT_GUARD_MS: u64 = 250;
/// A pause ending this close after the one heard is the same pause: the
/// Envoy reports it at every sync, each report a little late (the trip to
/// the admin, a loaded machine), which would otherwise move its end and
/// tell the others of a new pause. A provider's own waits come in whole
/// seconds, so a real new one ends later than this.
pub const PAUSE_SAME_MS: u64 = 500;
/// Tries of a change to news kept in Redis that other replicas raced.
const REDIS_TRIES: u32 = 5;

/// Where news is kept: [`pause_key`] and [`cut_key`] under it.
const NEWS_PREFIX: &str = "sluice:provider:";

/// A limit's pause news, under [`NEWS_PREFIX`].
fn pause_key(limit: &str) -> String {
    format!("pause:{limit}")
}

/// A limit's newest cut, under [`NEWS_PREFIX`].
fn cut_key(limit: &str) -> String {
    format!("cut:{limit}")
}

#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error(transparent)]
    Store(#[from] KvError),
    #[error("the news of {0} kept changing under this replica")]
    Contended(String),
}

/// A cut: when (ms, by the admin's clock), and which Envoy heard it.
#[derive(Debug, Clone, Default, PartialEq)]
struct Mark {
    at_ms: u64,
    status: u16,
    by: String,
}

impl Mark {
    fn encode(&self) -> String {
        format!("{} {} {}", self.at_ms, self.status, self.by)
    }

    /// None for a value no admin wrote.
    fn decode(raw: &str) -> Option<Self> {
        let mut parts = raw.splitn(3, ' ');
        Some(Mark {
            at_ms: parts.next()?.parse().ok()?,
            status: parts.next()?.parse().ok()?,
            by: parts.next()?.to_string(),
        })
    }

    /// Whether news at `at_ms` replaces this (`slack`: what is that close
    /// is the same news).
    fn older_than(this: Option<&Mark>, at_ms: u64, slack: u64) -> bool {
        this.is_none_or(|m| m.at_ms.saturating_add(slack) < at_ms)
    }
}

/// A limit's pause news: until when it is relayed, the provider's status,
/// the instance whose report began the stretch, and the stretch itself
/// (all ms by the admin's clock).
#[derive(Debug, Clone, Default, PartialEq)]
struct PauseMark {
    until_ms: u64,
    status: u16,
    began_ms: u64,
    heard_ms: u64,
    by: String,
}

impl PauseMark {
    fn encode(&self) -> String {
        format!(
            "{} {} {} {} {}",
            self.until_ms, self.status, self.began_ms, self.heard_ms, self.by
        )
    }

    fn decode(raw: &str) -> Option<Self> {
        let mut parts = raw.splitn(5, ' ');
        Some(PauseMark {
            until_ms: parts.next()?.parse().ok()?,
            status: parts.next()?.parse().ok()?,
            began_ms: parts.next()?.parse().ok()?,
            heard_ms: parts.next()?.parse().ok()?,
            by: parts.next()?.to_string(),
        })
    }

    fn stretch(&self) -> RelayedStretch {
        RelayedStretch {
            began: Instant::from_millis(self.began_ms),
            heard: Instant::from_millis(self.heard_ms),
        }
    }

    /// `current` after `by` reported a pause of `left_ms` at `now_ms`;
    /// and whether that report began a stretch.
    fn heard(
        current: Option<&PauseMark>,
        now_ms: u64,
        left_ms: u64,
        status: u16,
        by: &str,
        max_pause: Span,
    ) -> (PauseMark, bool) {
        let now = Instant::from_millis(now_ms);
        let mut stretch = current.map(PauseMark::stretch).unwrap_or_default();
        let fresh = stretch.begins_anew(now, max_pause);
        let until = stretch.hear(now, Span::from_millis(left_ms), max_pause);
        let mut mark = match current {
            Some(m) if !fresh => m.clone(),
            _ => PauseMark {
                by: by.to_string(),
                ..PauseMark::default()
            },
        };
        mark.began_ms = stretch.began.as_millis();
        mark.heard_ms = stretch.heard.as_millis();
        if let Some(until) = until.map(Instant::as_millis) {
            if mark.until_ms.saturating_add(PAUSE_SAME_MS) < until {
                mark.until_ms = until;
                mark.status = status;
            }
        }
        (mark, fresh && until.is_some())
    }

    /// How long the mark matters after `now_ms`: while its pause runs,
    /// and while news heard next would still be of its stretch.
    fn keep_for_ms(&self, now_ms: u64, max_pause: Span) -> u64 {
        let quiet_at = self.heard_ms.saturating_add(max_pause.as_millis());
        self.until_ms.max(quiet_at).saturating_sub(now_ms)
    }
}

/// A limit's news: the pause that runs longest, the newest cut.
#[derive(Debug, Clone, Default, PartialEq)]
struct Heard {
    pause: Option<PauseMark>,
    cut: Option<Mark>,
}

impl Heard {
    /// What of it is news to `instance` at `now_ms`.
    fn news_for(&self, instance: &str, now_ms: u64) -> Option<LimitNews> {
        let mut item = LimitNews::default();
        if let Some(pause) = self
            .pause
            .as_ref()
            .filter(|m| m.until_ms > now_ms && m.by != instance)
        {
            item.pause_ms = Some(pause.until_ms - now_ms);
            item.status = pause.status;
        }
        if let Some(cut) = self.cut.as_ref().filter(|m| {
            m.at_ms > 0 && now_ms.saturating_sub(m.at_ms) < RELAYED_CUT_FOR_MS && m.by != instance
        }) {
            item.cut_ago_ms = Some(now_ms.saturating_sub(cut.at_ms));
        }
        (item != LimitNews::default()).then_some(item)
    }
}

/// The limits of `set` whose news is relayed, with their `max_pause`:
/// global, unkeyed (keys are hashed with a secret of each Envoy) and
/// listening to their provider. A limit named in several policies takes
/// the shortest `max_pause` any gives it.
fn relayed_limits(set: &PolicySet) -> HashMap<&str, Span> {
    let mut limits: HashMap<&str, Span> = HashMap::new();
    for limit in set.limits() {
        let Some(provider) = &limit.provider else {
            continue;
        };
        if limit.scope != Scope::Global || limit.key.is_some() {
            continue;
        }
        let max_pause = provider.max_pause().as_span();
        limits
            .entry(limit.name.as_str())
            .and_modify(|m| *m = (*m).min(max_pause))
            .or_insert(max_pause);
    }
    limits
}

/// What one Envoy saw itself: a pause of so long with the provider's
/// status, and when its rate was cut (ms, by this admin's clock).
struct FirstHand {
    pause: Option<(u64, u16)>,
    cut: Option<u64>,
}

fn first_hand(provider: &ProviderReport, now_ms: u64) -> FirstHand {
    let pause = provider
        .pause
        .filter(|p| !p.relayed && p.left_ms > 0)
        .map(|p| (p.left_ms, p.status));
    let cut = provider
        .cut_ago_ms
        .filter(|&ago| ago < RELAYED_CUT_FOR_MS)
        .map(|ago| now_ms.saturating_sub(ago));
    FirstHand { pause, cut }
}

fn log_began(name: &str, mark: &PauseMark, now_ms: u64) {
    tracing::warn!(
        limit = %name,
        instance = %mark.by,
        status = mark.status,
        relayed_for_ms = mark.until_ms.saturating_sub(now_ms),
        "the provider paused a shared limit: relayed to the other Envoys (news of this stretch holds them at most max_pause)"
    );
}

pub struct ProviderRelay {
    news: Kv,
}

impl Default for ProviderRelay {
    fn default() -> Self {
        Self {
            news: Kv::memory(NEWS_PREFIX, 2 * MAX_LIMITS),
        }
    }
}

impl ProviderRelay {
    /// News kept in Redis, through `connection` (the fleet ledgers').
    pub fn redis(connection: &RedisConnection) -> Self {
        Self {
            news: Kv::redis(connection, NEWS_PREFIX),
        }
    }

    /// Takes the news in `report` of the limits `set` relays, received at
    /// `now_ms` by this admin's clock.
    pub async fn hear(
        &self,
        report: &SyncReport,
        set: &PolicySet,
        now_ms: u64,
    ) -> Result<(), RelayError> {
        let relayed = relayed_limits(set);
        let news = report.limits.iter().filter_map(|(name, l)| {
            let max_pause = *relayed.get(name.as_str())?;
            Some((name, max_pause, first_hand(l.provider.as_ref()?, now_ms)))
        });
        let by = report.instance.as_str();
        for (name, max_pause, FirstHand { pause, cut }) in news {
            if let Some((left_ms, status)) = pause {
                let stored = self
                    .news
                    .update(&pause_key(name), REDIS_TRIES, |raw| {
                        let (mark, began) = PauseMark::heard(
                            PauseMark::decode(raw).as_ref(),
                            now_ms,
                            left_ms,
                            status,
                            by,
                            max_pause,
                        );
                        let keep_ms = mark.keep_for_ms(now_ms, max_pause).saturating_add(1_000);
                        let value = mark.encode();
                        Ok::<_, RelayError>(((mark, began), Write::Set { value, keep_ms }))
                    })
                    .await?;
                match stored {
                    Some((mark, true)) => log_began(name, &mark, now_ms),
                    Some(_) => {}
                    None => return Err(RelayError::Contended(name.clone())),
                }
            }
            if let Some(at_ms) = cut {
                let stored = self
                    .news
                    .update(&cut_key(name), REDIS_TRIES, |raw| {
                        if !Mark::older_than(Mark::decode(raw).as_ref(), at_ms, CUT_GUARD_MS) {
                            return Ok::<_, RelayError>(((), Write::Keep));
                        }
                        let mark = Mark {
                            at_ms,
                            status: 0,
                            by: by.to_string(),
                        };
                        let value = mark.encode();
                        let keep_ms = RELAYED_CUT_FOR_MS + 1_000;
                        Ok(((), Write::Set { value, keep_ms }))
                    })
                    .await?;
                if stored.is_none() {
                    return Err(RelayError::Contended(name.clone()));
                }
            }
        }
        Ok(())
    }

    /// The news for `report`'s Envoy at `now_ms`: pauses still running and
    /// recent cuts of the limits of `set` that relay and that it reported
    /// listening to their provider, that other Envoys heard.
    pub async fn news_for(
        &self,
        report: &SyncReport,
        set: &PolicySet,
        now_ms: u64,
    ) -> Result<ProviderNews, RelayError> {
        let relayed = relayed_limits(set);
        let listening: Vec<&String> = report
            .limits
            .iter()
            .filter(|(name, l)| l.provider.is_some() && relayed.contains_key(name.as_str()))
            .map(|(name, _)| name)
            .take(MAX_PROVIDER_NEWS)
            .collect();
        let mut news = ProviderNews::new();
        if listening.is_empty() {
            return Ok(news);
        }
        let keys: Vec<String> = listening
            .iter()
            .flat_map(|name| [pause_key(name), cut_key(name)])
            .collect();
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        let raw = self.news.get_many(&keys).await?;
        for (name, pair) in listening.into_iter().zip(raw.chunks(2)) {
            let value = |i: usize| pair.get(i).and_then(Option::as_deref);
            let heard = Heard {
                pause: value(0).and_then(PauseMark::decode),
                cut: value(1).and_then(Mark::decode),
            };
            if let Some(item) = heard.news_for(&report.instance, now_ms) {
                news.insert(name.clone(), item);
            }
        }
        Ok(news)
    }

    /// Pauses and cuts kept in memory now (0 with Redis).
    pub fn len(&self) -> usize {
        self.news.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_wire::sync::{LimitReport, PauseReport};

    /// A set relaying `rpm` (global, unkeyed, listening, max_pause 5 s),
    /// beside limits it does not relay: `keyed` and `local`.
    fn set() -> PolicySet {
        serde_json::from_value(serde_json::json!({"version": 1, "policies": [
            {"name": "p", "match": {"host": "a"}, "rate": {"requests": 100, "period": "1s"}, "limits": [
                {"name": "rpm", "scope": "global", "rate": {"requests": 100, "period": "1m"},
                 "provider": {"max_pause": "5s"}},
                {"name": "keyed", "key": {"header": "x-key"}, "rate": {"requests": 100, "period": "1m"},
                 "provider": {}},
                {"name": "local", "rate": {"requests": 100, "period": "1m"}, "provider": {}}
            ]}
        ]}))
        .expect("a valid set")
    }

    fn report_on(instance: &str, limit: &str, provider: Option<ProviderReport>) -> SyncReport {
        let mut r = SyncReport {
            instance: instance.into(),
            ..SyncReport::default()
        };
        r.limits.insert(
            limit.into(),
            LimitReport {
                provider: Some(provider.unwrap_or_default()),
                ..LimitReport::default()
            },
        );
        r
    }

    fn report(instance: &str, provider: Option<ProviderReport>) -> SyncReport {
        report_on(instance, "rpm", provider)
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

    fn cut(ago: u64) -> Option<ProviderReport> {
        Some(ProviderReport {
            cut_ago_ms: Some(ago),
            ..ProviderReport::default()
        })
    }

    async fn hear(relay: &ProviderRelay, report: &SyncReport, now_ms: u64) {
        relay.hear(report, &set(), now_ms).await.ok();
    }

    async fn news(relay: &ProviderRelay, instance: &str, now_ms: u64) -> ProviderNews {
        relay
            .news_for(&report(instance, None), &set(), now_ms)
            .await
            .unwrap_or_default()
    }

    #[tokio::test]
    async fn a_pause_one_envoy_saw_reaches_the_others_for_what_is_left() {
        let relay = ProviderRelay::default();
        hear(&relay, &report("a", paused(3_000, false)), 1_000).await;
        let to_b = news(&relay, "b", 1_500).await;
        assert_eq!(to_b["rpm"].pause_ms, Some(2_500));
        assert_eq!(to_b["rpm"].status, 429);
        assert!(
            news(&relay, "a", 1_500).await.is_empty(),
            "not back to its source"
        );
        assert!(news(&relay, "b", 4_000).await.is_empty(), "over");
        // b reports the pause it took from the relay: not news.
        hear(&relay, &report("b", paused(2_600, true)), 1_600).await;
        assert!(news(&relay, "a", 1_700).await.is_empty());
    }

    #[tokio::test]
    async fn later_reports_of_the_same_pause_do_not_move_its_end() {
        let relay = ProviderRelay::default();
        hear(&relay, &report("a", paused(3_000, false)), 1_000).await;
        // The next report arrived 300 ms late: its end reads 300 ms later.
        hear(&relay, &report("a", paused(2_750, false)), 1_550).await;
        assert_eq!(news(&relay, "b", 2_000).await["rpm"].pause_ms, Some(2_000));
        // The provider asked again, a second more: a new end.
        hear(&relay, &report("a", paused(3_000, false)), 2_000).await;
        assert_eq!(news(&relay, "b", 2_000).await["rpm"].pause_ms, Some(3_000));
    }

    #[tokio::test]
    async fn a_pause_re_reported_at_every_sync_is_relayed_for_max_pause_in_total() {
        let relay = ProviderRelay::default();
        let mut relayed_until = 0;
        // A rogue reports "a day more" every 200 ms for a minute.
        for i in 0..300u64 {
            let now = 10_000 + 200 * i;
            hear(&relay, &report("rogue", paused(86_400_000, false)), now).await;
            if let Some(ms) = news(&relay, "b", now)
                .await
                .get("rpm")
                .and_then(|n| n.pause_ms)
            {
                relayed_until = relayed_until.max(now + ms);
            }
        }
        assert_eq!(
            relayed_until,
            10_000 + 5_000,
            "max_pause from the first report"
        );
        // Quiet for max_pause: a new pause is news again, and who began
        // it is the instance that reported it first.
        hear(&relay, &report("c", paused(1_000, false)), 80_000).await;
        assert_eq!(news(&relay, "b", 80_000).await["rpm"].pause_ms, Some(1_000));
        assert!(news(&relay, "c", 80_000).await.is_empty());
    }

    #[tokio::test]
    async fn only_the_sets_shared_unkeyed_listening_limits_are_relayed() {
        let relay = ProviderRelay::default();
        for limit in ["keyed", "local", "made-up"] {
            hear(&relay, &report_on("a", limit, paused(3_000, false)), 1_000).await;
            let to_b = relay
                .news_for(&report_on("b", limit, None), &set(), 1_000)
                .await
                .unwrap_or_default();
            assert!(to_b.is_empty(), "{limit}");
        }
        assert!(relay.is_empty());
    }

    #[tokio::test]
    async fn a_cut_is_relayed_for_a_while_and_its_echo_is_not_a_new_one() {
        let relay = ProviderRelay::default();
        hear(&relay, &report("a", cut(100)), 10_000).await;
        let to_b = news(&relay, "b", 10_400).await;
        assert_eq!(to_b.get("rpm").and_then(|n| n.cut_ago_ms), Some(500));
        // b followed it and reports it back, a few ms apart: still a's.
        hear(&relay, &report("b", cut(495)), 10_400).await;
        assert!(news(&relay, "a", 10_500).await.is_empty());
        assert!(news(&relay, "c", 10_000 + RELAYED_CUT_FOR_MS)
            .await
            .is_empty());
        // Old news is not taken.
        hear(&relay, &report("c", cut(RELAYED_CUT_FOR_MS)), 20_000).await;
        assert!(news(&relay, "a", 20_000).await.is_empty());
    }

    #[tokio::test]
    async fn hostile_reports_are_bounded() {
        let relay = ProviderRelay::default();
        hear(&relay, &report("a", paused(u64::MAX, false)), 1_000).await;
        assert_eq!(news(&relay, "b", 1_000).await["rpm"].pause_ms, Some(5_000));
        // Names the set does not have are not kept, however many.
        for i in 0..MAX_LIMITS + 10 {
            let r = report_on("a", &format!("l{i}"), paused(1_000, false));
            hear(&relay, &r, 2_000).await;
        }
        assert_eq!(relay.len(), 1);
    }

    #[test]
    fn marks_round_trip_and_garbage_is_no_mark() {
        let mark = Mark {
            at_ms: 1_700_000_000_123,
            status: 503,
            by: "envoy-1".into(),
        };
        assert_eq!(Mark::decode(&mark.encode()), Some(mark));
        let pause = PauseMark {
            until_ms: 1_700_000_003_000,
            status: 429,
            began_ms: 1_700_000_000_000,
            heard_ms: 1_700_000_001_000,
            by: "envoy-1".into(),
        };
        assert_eq!(PauseMark::decode(&pause.encode()), Some(pause));
        for bad in ["", "x 1 a", "1 x a", "1 2", "-1 429 a"] {
            assert_eq!(Mark::decode(bad), None, "{bad:?}");
            assert_eq!(PauseMark::decode(bad), None, "{bad:?}");
        }
    }
}
