//! The buckets one RLQS stream reported, and the token bucket each is
//! assigned: how Envoy's `rate_limit_quota` filter maps onto Sluice's
//! fleet ledgers. Pure: the stream (`super::stream`) feeds it reports and
//! shares, and sends what it answers.
//!
//! The mapping: a bucket whose id has `policy: <name>` draws on the
//! ledger `<name>`: a `scope: global` policy, or a global further limit
//! as `limits/<limit>`. Its other keys (a key, a tenant) only tell buckets
//! apart: the buckets of one stream that name one limit split that
//! stream's share in proportion to what each was asked in its latest
//! report.

use std::collections::{BTreeMap, HashMap};

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::r#type::v3::{RateLimitStrategy, TokenBucket};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    BucketAction as Action, QuotaAssignmentAction,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::BucketId;
use envoy_types::pb::google::protobuf::{Duration, UInt32Value};
use sluice_shared::fleet::share_limits::burst_for_share;
use sluice_shared::fleet::Usage;
use sluice_shared::policy::RateSpec;
use sluice_shared::Instant;

/// The bucket id key that names the limit a bucket draws on.
pub const POLICY_KEY: &str = "policy";

/// Buckets one stream may have: more are not assigned (Envoy's
/// `no_assignment_behavior` applies to them), so that a client cannot
/// grow the admin's memory or its answers without bound.
pub const MAX_BUCKETS: usize = 1_000;

/// The most bytes of keys and values in one bucket id.
pub const MAX_ID_BYTES: usize = 1_024;

/// Unassigned buckets remembered per stream, with why, for the Fleet page.
pub const MAX_UNASSIGNED_SHOWN: usize = 20;

/// Envoy 1.40 reads a token bucket's `fill_interval` in whole seconds and
/// refills it continuously at `tokens_per_fill` over it: a minute keeps
/// a share's rate to a sixtieth of a call a second.
const FILL_SECONDS: i64 = 60;

/// Why a bucket is given no assignment (Envoy then applies its
/// `no_assignment_behavior`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unassigned {
    #[error("its id has no `policy` key naming a limit")]
    NoPolicy,
    #[error("its id is longer than {MAX_ID_BYTES} bytes")]
    TooLong,
    #[error("the stream has {MAX_BUCKETS} buckets already")]
    TooMany,
    #[error("no `scope: global` policy or global limit is named {0:?}")]
    NotGlobal(String),
    #[error("{0:?} limits calls in flight only; a token bucket cannot enforce that")]
    NoRate(String),
    #[error(
        "the share lease of {0:?} is under a second, and Envoy's assignments last whole seconds"
    )]
    LeaseTooShort(String),
}

/// A bucket id as a map, ordered (Envoy's `bucket` is a protobuf map).
pub type BucketKey = BTreeMap<String, String>;

/// One bucket: its id as Envoy sent it, the ledger it draws on, and its
/// counters so far.
#[derive(Debug, Clone)]
struct Bucket {
    id: BucketId,
    limit: String,
    asked: u64,
    admitted: u64,
    /// Asked in its latest report: its weight within the stream's share.
    latest: u64,
}

/// What a stream's buckets of one limit used, as a sync's counters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LimitUsage {
    pub asked: u64,
    pub admitted: u64,
}

impl LimitUsage {
    pub fn at(self, at: Instant) -> Usage {
        Usage {
            asked: self.asked,
            admitted: self.admitted,
            in_flight: 0,
            waiting: 0,
            at,
            // A token bucket: Envoy's rate_limit_quota counts no calls in
            // flight.
            holds_no_slots: true,
        }
    }
}

/// Every bucket one stream reported.
#[derive(Debug, Default)]
pub struct Buckets {
    buckets: HashMap<BucketKey, Bucket>,
    /// Buckets of the latest report refused as it came, and buckets the
    /// latest assignment could not assign.
    in_report: Refused,
    in_assignment: Refused,
}

/// Buckets given no assignment: the first [`MAX_UNASSIGNED_SHOWN`] with
/// why, and how many in all.
#[derive(Debug, Default)]
struct Refused {
    shown: BTreeMap<BucketKey, Unassigned>,
    count: u64,
}

impl Refused {
    fn add(&mut self, key: BucketKey, why: Unassigned) {
        self.count = self.count.saturating_add(1);
        if self.shown.len() < MAX_UNASSIGNED_SHOWN {
            self.shown.insert(key, why);
        }
    }
}

impl Buckets {
    /// Takes one report: each bucket's counts added to what it had (Envoy
    /// reports what it allowed and denied since its previous report).
    pub fn report(&mut self, usages: &[BucketQuotaUsage]) {
        self.in_report = Refused::default();
        for usage in usages {
            let Some(id) = usage.bucket_id.as_ref() else {
                continue;
            };
            match self.bucket(id) {
                Ok(bucket) => {
                    let asked = usage
                        .num_requests_allowed
                        .saturating_add(usage.num_requests_denied);
                    bucket.asked = bucket.asked.saturating_add(asked);
                    bucket.admitted = bucket.admitted.saturating_add(usage.num_requests_allowed);
                    bucket.latest = asked;
                }
                Err(why) => self.in_report.add(key_of(id), why),
            }
        }
    }

    /// The bucket `id` names, added if it is new and may be.
    fn bucket(&mut self, id: &BucketId) -> Result<&mut Bucket, Unassigned> {
        let bytes: usize = id.bucket.iter().map(|(k, v)| k.len() + v.len()).sum();
        if bytes > MAX_ID_BYTES {
            return Err(Unassigned::TooLong);
        }
        let key = key_of(id);
        let known = self.buckets.contains_key(&key);
        if !known && self.buckets.len() >= MAX_BUCKETS {
            return Err(Unassigned::TooMany);
        }
        let limit = id
            .bucket
            .get(POLICY_KEY)
            .filter(|p| !p.is_empty())
            .ok_or(Unassigned::NoPolicy)?
            .clone();
        Ok(self.buckets.entry(key).or_insert_with(|| Bucket {
            id: id.clone(),
            limit,
            asked: 0,
            admitted: 0,
            latest: 0,
        }))
    }

    /// The limits the buckets draw on, each with its buckets' counters
    /// summed.
    pub fn usage_by_limit(&self) -> BTreeMap<String, LimitUsage> {
        let mut out: BTreeMap<String, LimitUsage> = BTreeMap::new();
        for bucket in self.buckets.values() {
            let usage = out.entry(bucket.limit.clone()).or_insert(LimitUsage {
                asked: 0,
                admitted: 0,
            });
            usage.asked = usage.asked.saturating_add(bucket.asked);
            usage.admitted = usage.admitted.saturating_add(bucket.admitted);
        }
        out
    }

    /// The buckets of `limit` given their parts of a share of `share_rate`
    /// a second: in proportion to what each was asked in its latest
    /// report (one call each at least, so an idle bucket still gets some).
    pub fn assign(
        &self,
        limit: &str,
        terms: &Terms<'_>,
        share_rate: f64,
        ttl: Duration,
    ) -> Vec<BucketAction> {
        let ours: Vec<&Bucket> = self.buckets.values().filter(|b| b.limit == limit).collect();
        let weights: f64 = ours.iter().map(|b| weight(b)).sum();
        ours.iter()
            .map(|bucket| {
                let part = share_rate * weight(bucket) / weights;
                BucketAction {
                    bucket_id: Some(bucket.id.clone()),
                    bucket_action: Some(Action::QuotaAssignmentAction(QuotaAssignmentAction {
                        assignment_time_to_live: Some(ttl),
                        rate_limit_strategy: Some(strategy(terms, part)),
                    })),
                }
            })
            .collect()
    }

    /// A new assignment: which buckets it cannot assign is judged again.
    pub fn start_assignment(&mut self) {
        self.in_assignment = Refused::default();
    }

    /// Buckets of `limit` are refused `why` (the set names no such global
    /// limit now, or it cannot be assigned).
    pub fn refuse_limit(&mut self, limit: &str, why: &Unassigned) {
        for (key, bucket) in &self.buckets {
            if bucket.limit == limit {
                self.in_assignment.add(key.clone(), why.clone());
            }
        }
    }

    pub fn len(&self) -> usize {
        self.buckets.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buckets.is_empty()
    }

    /// Buckets given no assignment, as the Fleet page shows them (the
    /// first few, with why), and how many in all: those of the latest
    /// report, and those the latest assignment could not assign.
    pub fn refused(&self) -> (Vec<(BucketKey, String)>, u64) {
        let shown = self
            .in_report
            .shown
            .iter()
            .chain(&self.in_assignment.shown)
            .take(MAX_UNASSIGNED_SHOWN)
            .map(|(k, why)| (k.clone(), why.to_string()))
            .collect();
        let count = self
            .in_report
            .count
            .saturating_add(self.in_assignment.count);
        (shown, count)
    }
}

fn weight(bucket: &Bucket) -> f64 {
    bucket.latest as f64 + 1.0
}

fn key_of(id: &BucketId) -> BucketKey {
    id.bucket
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// What a limit's token buckets are made from: its rate as the policy
/// states it, and the whole limit a second.
pub struct Terms<'a> {
    pub spec: &'a RateSpec,
    pub limit_rate: f64,
}

/// The token bucket for `rate` a second of the limit: its burst as a
/// Sluice Envoy's share of it would have (`burst_for_share`, the one
/// place a share's burst is decided), refilled over [`FILL_SECONDS`]; a share
/// too small to refill at all refuses every call.
pub fn strategy(terms: &Terms<'_>, rate: f64) -> RateLimitStrategy {
    // NaN counts as nothing.
    let per_fill = (rate * FILL_SECONDS as f64).floor();
    if per_fill.is_nan() || per_fill < 1.0 {
        return RateLimitStrategy {
            strategy: Some(Strategy::BlanketRule(BlanketRule::DenyAll as i32)),
        };
    }
    let burst = burst_for_share(terms.spec, terms.limit_rate, rate);
    let burst = u32::try_from(burst).unwrap_or(u32::MAX);
    RateLimitStrategy {
        strategy: Some(Strategy::TokenBucket(TokenBucket {
            max_tokens: burst,
            tokens_per_fill: Some(UInt32Value {
                value: per_fill.min(f64::from(u32::MAX)) as u32,
            }),
            fill_interval: Some(Duration {
                seconds: FILL_SECONDS,
                nanos: 0,
            }),
        })),
    }
}

/// How long an assignment lasts: Envoy 1.40 reads only the whole seconds
/// of `assignment_time_to_live`, so what is left of the share's lease,
/// rounded down (never past the lease the ledger reserves for it).
/// `None` under a second: such a share cannot be assigned.
pub fn time_to_live(lease_left_ms: u64) -> Option<Duration> {
    let seconds = lease_left_ms / 1_000;
    (seconds >= 1).then(|| Duration {
        seconds: i64::try_from(seconds).unwrap_or(i64::MAX),
        nanos: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(pairs: &[(&str, &str)]) -> BucketId {
        BucketId {
            bucket: pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }

    fn usage(pairs: &[(&str, &str)], allowed: u64, denied: u64) -> BucketQuotaUsage {
        BucketQuotaUsage {
            bucket_id: Some(id(pairs)),
            time_elapsed: None,
            num_requests_allowed: allowed,
            num_requests_denied: denied,
        }
    }

    fn spec(requests: u64, burst: u64) -> RateSpec {
        serde_json::from_value(serde_json::json!(
            {"requests": requests, "period": "1s", "burst": burst}
        ))
        .unwrap()
    }

    fn token_bucket(strategy: &RateLimitStrategy) -> Option<&TokenBucket> {
        match &strategy.strategy {
            Some(Strategy::TokenBucket(bucket)) => Some(bucket),
            _ => None,
        }
    }

    #[test]
    fn buckets_of_one_limit_sum_their_counts_and_split_its_share_by_what_each_was_asked() {
        let mut buckets = Buckets::default();
        buckets.report(&[
            usage(&[("policy", "llm"), ("key", "a")], 10, 5),
            usage(&[("policy", "llm"), ("key", "b")], 4, 0),
            usage(&[("policy", "bank")], 1, 0),
        ]);
        buckets.report(&[usage(&[("policy", "llm"), ("key", "a")], 29, 0)]);
        let by_limit = buckets.usage_by_limit();
        assert_eq!(
            by_limit["llm"],
            LimitUsage {
                asked: 48,
                admitted: 43
            }
        );
        assert_eq!(by_limit["bank"].asked, 1);

        // a was asked 29 in its latest report, b 4: 30 to 5 of 70/s.
        let terms = Terms {
            spec: &spec(300, 30),
            limit_rate: 300.0,
        };
        let ttl = Duration {
            seconds: 2,
            nanos: 0,
        };
        let actions = buckets.assign("llm", &terms, 70.0, ttl);
        assert_eq!(actions.len(), 2);
        let mut rates: Vec<(String, u32, u32)> = actions
            .iter()
            .map(|a| {
                let key = a.bucket_id.as_ref().unwrap().bucket["key"].clone();
                let Some(Action::QuotaAssignmentAction(q)) = &a.bucket_action else {
                    panic!("{a:?}")
                };
                assert_eq!(q.assignment_time_to_live, Some(ttl));
                let bucket = token_bucket(q.rate_limit_strategy.as_ref().unwrap()).unwrap();
                (
                    key,
                    bucket.tokens_per_fill.unwrap().value,
                    bucket.max_tokens,
                )
            })
            .collect();
        rates.sort();
        // 60 and 10 a second: 3 600 and 600 a minute; bursts of a fifth of
        // the policy's 30, and its floor of 2.
        assert_eq!(rates, vec![("a".into(), 3_600, 6), ("b".into(), 600, 2)]);
    }

    #[test]
    fn a_bucket_that_names_no_limit_or_is_too_long_or_one_too_many_is_refused_and_remembered() {
        let mut buckets = Buckets::default();
        let long = "x".repeat(MAX_ID_BYTES);
        buckets.report(&[
            usage(&[("service", "llm")], 1, 0),
            usage(&[("policy", "")], 1, 0),
            usage(&[("policy", "llm"), ("key", &long)], 1, 0),
        ]);
        assert!(buckets.is_empty());
        let (shown, count) = buckets.refused();
        assert_eq!(count, 3);
        let reasons: Vec<&str> = shown.iter().map(|(_, why)| why.as_str()).collect();
        assert!(
            reasons.iter().any(|r| r.contains("longer than")),
            "{reasons:?}"
        );
        assert_eq!(
            reasons.iter().filter(|r| r.contains("no `policy`")).count(),
            2
        );

        // 10 000 buckets in one report: the first MAX_BUCKETS are kept, the
        // rest refused, and only a few of those remembered.
        let many: Vec<BucketQuotaUsage> = (0..10_000)
            .map(|i| usage(&[("policy", "llm"), ("key", &i.to_string())], 1, 0))
            .collect();
        for _ in 0..2 {
            buckets.report(&many);
        }
        assert_eq!(buckets.len(), MAX_BUCKETS);
        let (shown, count) = buckets.refused();
        assert_eq!(count, 9_000, "counted once for the latest report");
        assert!(shown.len() <= MAX_UNASSIGNED_SHOWN);
        // A known bucket still counts when the table is full.
        buckets.report(&[usage(&[("policy", "llm"), ("key", "0")], 5, 0)]);
        assert_eq!(buckets.usage_by_limit()["llm"].asked, 2 * 1_000 + 5);
    }

    #[test]
    fn counts_that_would_overflow_saturate() {
        let mut buckets = Buckets::default();
        for _ in 0..3 {
            buckets.report(&[usage(&[("policy", "llm")], u64::MAX, u64::MAX)]);
        }
        let used = buckets.usage_by_limit()["llm"];
        assert_eq!((used.asked, used.admitted), (u64::MAX, u64::MAX));
    }

    #[test]
    fn a_limit_refused_as_a_whole_names_each_of_its_buckets_until_the_next_assignment() {
        let mut buckets = Buckets::default();
        buckets.report(&[usage(&[("policy", "gone")], 1, 0)]);
        buckets.start_assignment();
        buckets.refuse_limit("gone", &Unassigned::NotGlobal("gone".into()));
        let (shown, count) = buckets.refused();
        assert_eq!(count, 1);
        assert!(
            shown[0].1.contains("no `scope: global` policy"),
            "{shown:?}"
        );
        buckets.start_assignment();
        assert_eq!(buckets.refused().1, 0);
    }

    #[test]
    fn a_share_becomes_a_token_bucket_refilled_over_a_minute_or_a_refusal_when_too_small() {
        let terms = Terms {
            spec: &spec(290, 6),
            limit_rate: 290.0,
        };
        let bucket = strategy(&terms, 145.5);
        let bucket = token_bucket(&bucket).unwrap();
        assert_eq!(bucket.tokens_per_fill.unwrap().value, 8_730);
        assert_eq!(bucket.fill_interval.unwrap().seconds, 60);
        assert_eq!(bucket.max_tokens, 3, "half the limit: half its burst");
        // A sixtieth of a call a second still refills; less refuses all.
        assert!(token_bucket(&strategy(&terms, 1.0 / 60.0)).is_some());
        for nothing in [0.0, 0.01, -5.0, f64::NAN] {
            assert_eq!(
                strategy(&terms, nothing).strategy,
                Some(Strategy::BlanketRule(BlanketRule::DenyAll as i32)),
                "{nothing}"
            );
        }
        // A share past u32's tokens a minute is capped, not wrapped.
        let huge = strategy(&terms, 1e12);
        assert_eq!(
            token_bucket(&huge).unwrap().tokens_per_fill.unwrap().value,
            u32::MAX
        );
    }

    #[test]
    fn an_assignment_lasts_the_whole_seconds_left_of_its_lease() {
        assert_eq!(time_to_live(999), None);
        assert_eq!(time_to_live(2_000).map(|d| d.seconds), Some(2));
        assert_eq!(time_to_live(2_999).map(|d| d.seconds), Some(2));
    }
}
