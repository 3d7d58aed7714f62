//! The limits an instance applies for its share of a global policy: the
//! policy's own, scaled down.

use super::Amount;
use crate::limiter::{ConcurrencyLimit, RateLimiter, TokenBucket};
use crate::policy::{Policy, RateSpec};
use crate::time::Span;

/// The limits an instance applies for its share of a global policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareLimits {
    pub rate: Option<RateLimiter>,
    pub concurrency: Option<ConcurrencyLimit>,
    /// The share allows no request at all (before the first share, or
    /// while the others hold the whole limit).
    pub closed: bool,
}

pub const MIN_SHARE_BURST: u64 = 2;

/// Rates are kept per hour so that a share of a fraction of a request per
/// second still refills.
const SHARE_PERIOD: Span = Span::from_secs(3_600);

/// Scales a global policy's limits down to `share`: the rate to the share's
/// rate and the burst in proportion, the slots to the share's slots and the
/// high-priority lane in proportion.
///
/// The burst is at least [`MIN_SHARE_BURST`] (or the policy's, if smaller):
/// a bucket of one token admits a call only when it is exactly due, and
/// calls that arrive on their own clock then lose up to a third of the
/// share. The fleet's burst is so at most `burst + MIN_SHARE_BURST · n`.
pub fn limits_for_share(policy: &Policy, share: Amount) -> ShareLimits {
    let limit = Amount::of_policy(policy);
    let mut closed = false;
    let rate = policy.rate.as_ref().map(|spec| {
        let (rate, shut) = rate_for_share(spec, limit.rate, share.rate);
        closed |= shut;
        rate
    });
    let concurrency = policy.concurrency.as_ref().map(|spec| {
        let slots = share.in_flight.min(spec.max_in_flight);
        let reserved = if spec.max_in_flight > 0 {
            (u64::from(spec.reserved_for_high) * u64::from(slots) / u64::from(spec.max_in_flight))
                as u32
        } else {
            0
        };
        ConcurrencyLimit {
            max_in_flight: slots,
            reserved_for_high: reserved,
            lease_ttl: spec.lease_ttl.as_span(),
        }
    });
    ShareLimits {
        rate,
        concurrency,
        closed,
    }
}

/// A rate of `limit_rate` per second (as `spec` says it) scaled down to a
/// share of `share_rate`; true when the share allows nothing.
pub fn rate_for_share(spec: &RateSpec, limit_rate: f64, share_rate: f64) -> (RateLimiter, bool) {
    let per_hour = (share_rate.max(0.0) * 3600.0).floor() as u64;
    let rate = RateLimiter::TokenBucket(TokenBucket::new(
        per_hour.max(1),
        SHARE_PERIOD,
        burst_for_share(spec, limit_rate, share_rate),
        None,
    ));
    (rate, per_hour == 0)
}

/// The burst of a share of `share_rate` a second of a limit of
/// `limit_rate` (as `spec` says it): the policy's in proportion, at least
/// [`MIN_SHARE_BURST`] (or the policy's, if smaller). A stock Envoy's
/// share through RLQS (the admin's `rlqs`) gets the same.
pub fn burst_for_share(spec: &RateSpec, limit_rate: f64, share_rate: f64) -> u64 {
    let fraction = if limit_rate > 0.0 {
        (share_rate / limit_rate).clamp(0.0, 1.0)
    } else {
        0.0
    };
    let full_burst = spec.effective_burst();
    let burst = ((full_burst as f64) * fraction).floor() as u64;
    burst.max(MIN_SHARE_BURST.min(full_burst)).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_share_scales_rate_burst_and_slots() {
        let policy: Policy = serde_json::from_str(
            r#"{"name": "p", "match": {"host": "a"}, "scope": "global",
                "rate": {"requests": 300, "period": "1s", "burst": 30},
                "concurrency": {"max_in_flight": 40, "reserved_for_high": 10}}"#,
        )
        .unwrap();
        let limits = limits_for_share(
            &policy,
            Amount {
                rate: 100.0,
                in_flight: 20,
            },
        );
        assert!(!limits.closed);
        let Some(RateLimiter::TokenBucket(bucket)) = limits.rate else {
            panic!("{limits:?}")
        };
        assert_eq!(bucket.burst(), 10);
        let c = limits.concurrency.unwrap();
        assert_eq!((c.max_in_flight, c.reserved_for_high), (20, 5));
        assert!(limits_for_share(&policy, Amount::default()).closed);
        let tiny = limits_for_share(
            &policy,
            Amount {
                rate: 0.5,
                in_flight: 1,
            },
        );
        assert!(!tiny.closed, "half a request per second still refills");
    }
}
