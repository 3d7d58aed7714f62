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
        }
    }
}

/// Every bucket one stream reported.
#[derive(Debug, Default)]
pub struct Buckets {
    buckets: HashMap<BucketKey, Bucket>,
    /// Buckets refused when reported, with why (at most
    /// [`MAX_UNASSIGNED_SHOWN`]), and how many were in all.
    refused: BTreeMap<BucketKey, Unassigned>,
    refused_count: u64,
}

impl Buckets {
    /// Takes one report: each bucket's counts added to what it had (Envoy
    /// reports what it allowed and denied since its previous report).
    pub fn report(&mut self, usages: &[BucketQuotaUsage]) {
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
                Err(why) => self.refuse(key_of(id), why),
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

    /// Notes a bucket that is not assigned (the first few, for the UI).
    pub fn refuse(&mut self, key: BucketKey, why: Unassigned) {
        let new = !self.refused.contains_key(&key);
        if new {
            self.refused_count = self.refused_count.saturating_add(1);
        }
        if !new || self.refused.len() < MAX_UNASSIGNED_SHOWN {
            self.refused.insert(key, why);
        }
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

    /// Buckets of `limit` are refused `why` (the set names no such global
    /// limit now, or it cannot be assigned).
    pub fn refuse_limit(&mut self, limit: &str, why: &Unassigned) {
        let keys: Vec<BucketKey> = self
            .buckets
            .iter()
            .filter(|(_, b)| b.limit == limit)
            .map(|(k, _)| k.clone())
            .collect();
        for key in keys {
            self.refuse(key, why.clone());
        }
    }

    /// Forgets why buckets were refused before: they are judged again
    /// against the set of now.
    pub fn clear_refusals_of_known(&mut self) {
        let buckets = &self.buckets;
        self.refused.retain(|key, _| !buckets.contains_key(key));
    }

    pub fn len(&self) -> usize {
        self.buckets.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buckets.is_empty()
    }

    /// Refused buckets as the Fleet page shows them, and how many in all.
    pub fn refused(&self) -> (Vec<(BucketKey, String)>, u64) {
        let shown = self
            .refused
            .iter()
            .map(|(k, why)| (k.clone(), why.to_string()))
            .collect();
        (shown, self.refused_count.max(self.refused.len() as u64))
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
    let per_fill = (rate.max(0.0) * FILL_SECONDS as f64).floor();
    if !(per_fill >= 1.0) {
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
