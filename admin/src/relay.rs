//! What one Envoy's provider said, relayed to the others: a limit they
//! share (`scope: global`) that one Envoy finds paused by the provider
//! (`Retry-After`) or its adapted rate cut, every Envoy syncing here
//! pauses or cuts too, at its next sync.
//!
//! Only what a provider said first-hand is relayed: a pause an Envoy took
//! from this relay is reported as `relayed` and not passed on again, and a
//! cut within [`CUT_GUARD_MS`] of the one heard is the same overload.
//! Times are kept by the admin's wall clock and sent as relative spans, so
//! the Envoys' clocks need not agree with it. Bounded whatever Envoys send:
//! at most [`MAX_LIMITS`] limits in memory, a pause of at most
//! [`MAX_PAUSE_MS`].
//!
//! One admin keeps the news in memory; replicas sharing Redis (as their
//! fleet ledgers do) keep it there, two keys per limit that expire with
//! the news, each changed only by a script that keeps the newer news: an
//! Envoy hears what another said to any replica.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use sluice_shared::sync::{
    LimitNews, ProviderNews, ProviderReport, SyncReport, MAX_PROVIDER_NEWS, RELAYED_CUT_FOR_MS,
};

/// Limits whose news is kept in memory at once; past it, what ends first
/// goes.
pub const MAX_LIMITS: usize = 10_000;
/// No provider pause is relayed for longer (the policy's own cap,
/// `max_pause`, is at most a day; each Envoy applies its own).
pub const MAX_PAUSE_MS: u64 = 24 * 60 * 60 * 1000;
/// Cuts this close to the one heard are of the same overload (the filter's
/// guard between its own cuts).
pub const CUT_GUARD_MS: u64 = 250;
/// A pause ending this close after the one heard is the same pause: the
/// Envoy reports it at every sync, each report a little late (the trip to
/// the admin, a loaded machine), which would otherwise move its end and
/// tell the others of a new pause. A provider's own waits come in whole
/// seconds, so a real new one ends later than this.
pub const PAUSE_SAME_MS: u64 = 500;

/// Keeps the value whose leading number (a time in ms) is newer than the
/// stored one's by more than ARGV[3] ms; expires it after ARGV[4] ms.
const KEEP_NEWER: &str = r#"
local current = redis.call('GET', KEYS[1])
if current then
  local at = tonumber(string.match(current, '^%d+'))
  if at and at + tonumber(ARGV[3]) >= tonumber(ARGV[1]) then return 0 end
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[4])
return 1
"#;

#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
}

/// One piece of news: when (a pause's end, a cut's moment, in ms by the
/// admin's clock), the provider's status, and which Envoy heard it.
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

/// A limit's news: the pause that runs longest, the newest cut.
#[derive(Debug, Clone, Default, PartialEq)]
struct Heard {
    pause: Option<Mark>,
    cut: Option<Mark>,
}

impl Heard {
    fn ends_ms(&self) -> u64 {
        let pause = self.pause.as_ref().map_or(0, |m| m.at_ms);
        let cut = self
            .cut
            .as_ref()
            .map_or(0, |m| m.at_ms.saturating_add(RELAYED_CUT_FOR_MS));
        pause.max(cut)
    }

    /// What of it is news to `instance` at `now_ms`.
    fn news_for(&self, instance: &str, now_ms: u64) -> Option<LimitNews> {
        let mut item = LimitNews::default();
        if let Some(pause) = self
            .pause
            .as_ref()
            .filter(|m| m.at_ms > now_ms && m.by != instance)
        {
            item.pause_ms = Some(pause.at_ms - now_ms);
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

/// What an Envoy's report says first-hand of a limit at `now_ms`: a pause
/// (its end, the status) and a cut (its moment).
/// What one Envoy saw itself: a pause until (ms, by this admin's clock)
/// with the provider's status, and when its rate was cut.
struct FirstHand {
    pause: Option<(u64, u16)>,
    cut: Option<u64>,
}

fn first_hand(provider: &ProviderReport, now_ms: u64) -> FirstHand {
    let pause = provider
        .pause
        .filter(|p| !p.relayed && p.left_ms > 0)
        .map(|p| (now_ms.saturating_add(p.left_ms.min(MAX_PAUSE_MS)), p.status));
    let cut = provider
        .cut_ago_ms
        .filter(|&ago| ago < RELAYED_CUT_FOR_MS)
        .map(|ago| now_ms.saturating_sub(ago));
    FirstHand { pause, cut }
}

enum Backend {
    Memory(Mutex<HashMap<String, Heard>>),
    Redis {
        connection: redis::aio::ConnectionManager,
        prefix: String,
    },
}

pub struct ProviderRelay {
    backend: Backend,
}

impl Default for ProviderRelay {
    fn default() -> Self {
        Self {
            backend: Backend::Memory(Mutex::new(HashMap::new())),
        }
    }
}

impl ProviderRelay {
    /// News kept in Redis, through `connection` (the fleet ledgers').
    pub fn redis(connection: redis::aio::ConnectionManager) -> Self {
        Self {
            backend: Backend::Redis {
                connection,
                prefix: "sluice:provider:".to_string(),
            },
        }
    }

    /// Takes the news in `report`, received at `now_ms` by this admin's
    /// clock.
    pub async fn hear(&self, report: &SyncReport, now_ms: u64) -> Result<(), RelayError> {
        let news: Vec<(&String, FirstHand)> = report
            .limits
            .iter()
            .filter_map(|(name, l)| Some((name, first_hand(l.provider.as_ref()?, now_ms))))
            .filter(|(_, seen)| seen.pause.is_some() || seen.cut.is_some())
            .collect();
        if news.is_empty() {
            return Ok(());
        }
        match &self.backend {
            Backend::Memory(heard) => {
                let mut heard = lock(heard);
                for (name, FirstHand { pause, cut }) in news {
                    make_room(&mut heard, name, now_ms);
                    let entry = heard.entry(name.clone()).or_default();
                    if let Some((until, status)) = pause {
                        if Mark::older_than(entry.pause.as_ref(), until, PAUSE_SAME_MS) {
                            entry.pause = Some(Mark {
                                at_ms: until,
                                status,
                                by: report.instance.clone(),
                            });
                        }
                    }
                    if let Some(at) = cut {
                        if Mark::older_than(entry.cut.as_ref(), at, CUT_GUARD_MS) {
                            entry.cut = Some(Mark {
                                at_ms: at,
                                status: 0,
                                by: report.instance.clone(),
                            });
                        }
                    }
                }
                Ok(())
            }
            Backend::Redis { connection, prefix } => {
                let script = redis::Script::new(KEEP_NEWER);
                let mut connection = connection.clone();
                for (name, FirstHand { pause, cut }) in news {
                    if let Some((until, status)) = pause {
                        let mark = Mark {
                            at_ms: until,
                            status,
                            by: report.instance.clone(),
                        };
                        let _: i64 = script
                            .key(format!("{prefix}pause:{name}"))
                            .arg(until)
                            .arg(mark.encode())
                            .arg(PAUSE_SAME_MS)
                            .arg((until - now_ms).saturating_add(1_000))
                            .invoke_async(&mut connection)
                            .await?;
                    }
                    if let Some(at) = cut {
                        let mark = Mark {
                            at_ms: at,
                            status: 0,
                            by: report.instance.clone(),
                        };
                        let _: i64 = script
                            .key(format!("{prefix}cut:{name}"))
                            .arg(at)
                            .arg(mark.encode())
                            .arg(CUT_GUARD_MS)
                            .arg(RELAYED_CUT_FOR_MS + 1_000)
                            .invoke_async(&mut connection)
                            .await?;
                    }
                }
                Ok(())
            }
        }
    }

    /// The news for `report`'s Envoy at `now_ms`: pauses still running and
    /// recent cuts of the limits it reported listening to their provider,
    /// that other Envoys heard.
    pub async fn news_for(
        &self,
        report: &SyncReport,
        now_ms: u64,
    ) -> Result<ProviderNews, RelayError> {
        let listening: Vec<&String> = report
            .limits
            .iter()
            .filter(|(_, l)| l.provider.is_some())
            .map(|(name, _)| name)
            .collect();
        let mut news = ProviderNews::new();
        if listening.is_empty() {
            return Ok(news);
        }
        let heard: Vec<Heard> = match &self.backend {
            Backend::Memory(heard) => {
                let heard = lock(heard);
                listening
                    .iter()
                    .map(|name| heard.get(*name).cloned().unwrap_or_default())
                    .collect()
            }
            Backend::Redis { connection, prefix } => {
                let mut connection = connection.clone();
                let keys: Vec<String> = listening
                    .iter()
                    .flat_map(|name| {
                        [
                            format!("{prefix}pause:{name}"),
                            format!("{prefix}cut:{name}"),
                        ]
                    })
                    .collect();
                let raw: Vec<Option<String>> = redis::cmd("MGET")
                    .arg(&keys)
                    .query_async(&mut connection)
                    .await?;
                raw.chunks(2)
                    .map(|pair| Heard {
                        pause: pair
                            .first()
                            .cloned()
                            .flatten()
                            .as_deref()
                            .and_then(Mark::decode),
                        cut: pair
                            .get(1)
                            .cloned()
                            .flatten()
                            .as_deref()
                            .and_then(Mark::decode),
                    })
                    .collect()
            }
        };
        for (name, heard) in listening.into_iter().zip(heard) {
            if news.len() >= MAX_PROVIDER_NEWS {
                break;
            }
            if let Some(item) = heard.news_for(&report.instance, now_ms) {
                news.insert(name.clone(), item);
            }
        }
        Ok(news)
    }

    /// Limits with news kept in memory now (0 with Redis).
    pub fn len(&self) -> usize {
        match &self.backend {
            Backend::Memory(heard) => lock(heard).len(),
            Backend::Redis { .. } => 0,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Room for `name`'s news: past [`MAX_LIMITS`], news that ended goes,
/// then what ends first.
fn make_room(heard: &mut HashMap<String, Heard>, name: &str, now_ms: u64) {
    if heard.contains_key(name) || heard.len() < MAX_LIMITS {
        return;
    }
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

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock leaves plain data: keep going.
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_shared::sync::{LimitReport, PauseReport};

    fn report(instance: &str, provider: Option<ProviderReport>) -> SyncReport {
        let mut r = SyncReport {
            instance: instance.into(),
            ..SyncReport::default()
        };
        r.limits.insert(
            "rpm".into(),
            LimitReport {
                provider: Some(provider.unwrap_or_default()),
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

    fn cut(ago: u64) -> Option<ProviderReport> {
        Some(ProviderReport {
            cut_ago_ms: Some(ago),
            ..ProviderReport::default()
        })
    }

    async fn news(relay: &ProviderRelay, instance: &str, now_ms: u64) -> ProviderNews {
        relay
            .news_for(&report(instance, None), now_ms)
            .await
            .unwrap_or_default()
    }

    #[tokio::test]
    async fn a_pause_one_envoy_saw_reaches_the_others_for_what_is_left() {
        let relay = ProviderRelay::default();
        relay
            .hear(&report("a", paused(3_000, false)), 1_000)
            .await
            .ok();
        let to_b = news(&relay, "b", 1_500).await;
        assert_eq!(to_b["rpm"].pause_ms, Some(2_500));
        assert_eq!(to_b["rpm"].status, 429);
        assert!(
            news(&relay, "a", 1_500).await.is_empty(),
            "not back to its source"
        );
        assert!(news(&relay, "b", 4_000).await.is_empty(), "over");
        // b reports the pause it took from the relay: not news.
        relay
            .hear(&report("b", paused(2_600, true)), 1_600)
            .await
            .ok();
        assert!(news(&relay, "a", 1_700).await.is_empty());
    }

    #[tokio::test]
    async fn later_reports_of_the_same_pause_do_not_move_its_end() {
        let relay = ProviderRelay::default();
        relay
            .hear(&report("a", paused(3_000, false)), 1_000)
            .await
            .ok();
        // The next report arrived 300 ms late: its end reads 300 ms later.
        relay
            .hear(&report("a", paused(2_750, false)), 1_550)
            .await
            .ok();
        assert_eq!(news(&relay, "b", 2_000).await["rpm"].pause_ms, Some(2_000));
        // The provider asked again, a second more: a new end.
        relay
            .hear(&report("a", paused(3_000, false)), 2_000)
            .await
            .ok();
        assert_eq!(news(&relay, "b", 2_000).await["rpm"].pause_ms, Some(3_000));
    }

    #[tokio::test]
    async fn a_cut_is_relayed_for_a_while_and_its_echo_is_not_a_new_one() {
        let relay = ProviderRelay::default();
        relay.hear(&report("a", cut(100)), 10_000).await.ok();
        let to_b = news(&relay, "b", 10_400).await;
        assert_eq!(to_b.get("rpm").and_then(|n| n.cut_ago_ms), Some(500));
        // b followed it and reports it back, a few ms apart: still a's.
        relay.hear(&report("b", cut(495)), 10_400).await.ok();
        assert!(news(&relay, "a", 10_500).await.is_empty());
        assert!(news(&relay, "c", 10_000 + RELAYED_CUT_FOR_MS)
            .await
            .is_empty());
        // Old news is not taken.
        relay
            .hear(&report("c", cut(RELAYED_CUT_FOR_MS)), 20_000)
            .await
            .ok();
        assert!(news(&relay, "a", 20_000).await.is_empty());
    }

    #[tokio::test]
    async fn hostile_reports_are_bounded() {
        let relay = ProviderRelay::default();
        relay
            .hear(&report("a", paused(u64::MAX, false)), 1_000)
            .await
            .ok();
        assert_eq!(
            news(&relay, "b", 1_000).await["rpm"].pause_ms,
            Some(MAX_PAUSE_MS)
        );
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
            relay.hear(&r, 2_000).await.ok();
        }
        assert_eq!(relay.len(), MAX_LIMITS);
        // Only the limits an Envoy reports listening are news to it, at
        // most so many.
        let mut many = report("b", None);
        many.limits = (0..MAX_LIMITS)
            .map(|i| {
                let limit = LimitReport {
                    provider: Some(ProviderReport::default()),
                    ..LimitReport::default()
                };
                (format!("l{i}"), limit)
            })
            .collect();
        let told = relay.news_for(&many, 2_000).await.unwrap_or_default();
        assert_eq!(told.len(), MAX_PROVIDER_NEWS);
    }

    #[test]
    fn marks_round_trip_and_garbage_is_no_mark() {
        let mark = Mark {
            at_ms: 1_700_000_000_123,
            status: 503,
            by: "envoy with spaces".into(),
        };
        assert_eq!(Mark::decode(&mark.encode()), Some(mark));
        for bad in ["", "x 1 a", "1 x a", "1 2", "-1 429 a"] {
            assert_eq!(Mark::decode(bad), None, "{bad:?}");
        }
    }
}
