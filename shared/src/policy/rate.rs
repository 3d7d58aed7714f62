//! Rates and calls in flight (`rate`, `concurrency`): how many calls per
//! period, by which algorithm, how many at once, and their checks.

use serde::{Deserialize, Serialize};

use super::bounds;
use super::check::Report;
use super::period::Period;
use crate::duration::DurationMs;

#[cfg(feature = "schema")]
use schemars::JsonSchema;
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RateSpec {
    #[serde(default)]
    pub algorithm: Algorithm,
    /// Requests (tokens) allowed per `period`.
    pub requests: u64,
    /// `"1s"`, `"1m"`, `"1h"`, `"250ms"`, milliseconds, or a calendar
    /// unit (`"calendar_day"`, `"calendar_week"`, `"calendar_month"`,
    /// `"calendar_quarter"`, `"calendar_year"`: `fixed_window` only),
    /// renewed at local midnight or on the 1st in `time_zone`.
    pub period: Period,
    /// The IANA time zone (`"Europe/Berlin"`) whose wall clock a calendar
    /// `period` is counted on. Default `"UTC"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_zone: Option<String>,
    /// Token bucket only: how many requests may go at once after an idle
    /// spell. Defaults to `requests`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u64>,
    /// Token bucket only: after an idle spell the rate starts lower and ramps
    /// up to full, for a backend that needs warming (Guava's SmoothWarmingUp).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warmup: Option<WarmupSpec>,
}

impl RateSpec {
    /// The bucket capacity in effect.
    pub fn effective_burst(&self) -> u64 {
        self.burst.unwrap_or(self.requests)
    }

    /// The calendar a calendar `period` counts on, in `time_zone` (UTC
    /// when none is named; a zone validation would refuse is taken as
    /// UTC too rather than panic).
    pub fn calendar(&self) -> Option<crate::calendar::Calendar> {
        let unit = self.period.calendar()?;
        let zone = self
            .time_zone
            .as_deref()
            .and_then(|name| crate::calendar::zone(name).ok())
            .unwrap_or(jiff::tz::TimeZone::UTC);
        Some(crate::calendar::Calendar::new(unit, zone))
    }

    /// The most tokens one request can ever take: beyond it a request could
    /// never be admitted.
    pub fn capacity(&self) -> u64 {
        match self.algorithm {
            Algorithm::TokenBucket => self.effective_burst(),
            Algorithm::FixedWindow | Algorithm::SlidingWindow => self.requests,
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// GCRA: smooth refill, bursts up to `burst`, no double burst at edges.
    #[default]
    TokenBucket,
    /// At most `requests` per aligned window; allows up to twice that across
    /// a window edge.
    FixedWindow,
    /// Weighted blend of the previous and current window; no edge burst.
    SlidingWindow,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct WarmupSpec {
    /// How long the ramp from cold to full rate takes. A bucket idle for at
    /// least this long is cold again.
    pub period: DurationMs,
    /// The cold rate is `requests / cold_factor`.
    #[serde(default = "WarmupSpec::default_cold_factor")]
    pub cold_factor: u32,
}

impl WarmupSpec {
    pub const DEFAULT_COLD_FACTOR: u32 = 3;

    fn default_cold_factor() -> u32 {
        Self::DEFAULT_COLD_FACTOR
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ConcurrencySpec {
    /// Requests allowed in flight at once, across all Envoy workers.
    pub max_in_flight: u32,
    /// A slot not released within this time is reclaimed (a crashed worker,
    /// a stream that never ends).
    #[serde(default = "ConcurrencySpec::default_lease_ttl")]
    pub lease_ttl: DurationMs,
    /// Slots only `high` priority requests may take (a priority lane).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub reserved_for_high: u32,
}

impl ConcurrencySpec {
    pub const DEFAULT_LEASE_TTL: DurationMs = DurationMs::from_secs(300);

    fn default_lease_ttl() -> DurationMs {
        Self::DEFAULT_LEASE_TTL
    }
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

pub(crate) fn check_rate(r: &mut Report, rate: &RateSpec) {
    check_rate_up_to(r, rate, bounds::MAX_REQUESTS);
}

/// A rate of at most `max_requests` a period (money counts millionths).
pub(crate) fn check_rate_up_to(r: &mut Report, rate: &RateSpec, max_requests: u64) {
    r.range_u64("rate.requests", rate.requests, 1, max_requests);
    match rate.period {
        Period::Every(length) => {
            r.range_ms(
                "rate.period",
                length,
                bounds::MIN_PERIOD_MS,
                bounds::MAX_PERIOD_MS,
            );
            if rate.time_zone.is_some() {
                r.at(
                    "rate.time_zone",
                    "applies only to a calendar period (\"calendar_day\", \"calendar_month\", ...)",
                );
            }
        }
        Period::Calendar(_) => check_calendar(r, rate),
    }
    let is_bucket = rate.algorithm == Algorithm::TokenBucket;
    if let Some(burst) = rate.burst {
        if !is_bucket {
            r.at("rate.burst", "applies only to algorithm token_bucket");
        } else {
            r.range_u64("rate.burst", burst, 1, bounds::MAX_BURST);
        }
    }
    // A period out of range is reported as such, not again as a refill.
    let period_ok = rate.period.calendar().is_none()
        && (bounds::MIN_PERIOD_MS..=bounds::MAX_PERIOD_MS).contains(&rate.period.as_millis());
    if is_bucket && rate.requests >= 1 && period_ok {
        let span_ms = u128::from(rate.effective_burst()) * u128::from(rate.period.as_millis())
            / u128::from(rate.requests);
        if span_ms > u128::from(bounds::MAX_BUCKET_SPAN_MS) {
            r.at(
                "rate.burst",
                "a full bucket would take more than 31 days to refill; lower burst or raise the rate",
            );
        }
    }
    if let Some(warmup) = &rate.warmup {
        if !is_bucket {
            r.at("rate.warmup", "applies only to algorithm token_bucket");
        }
        r.range_ms(
            "rate.warmup.period",
            warmup.period,
            1,
            bounds::MAX_WARMUP_MS,
        );
        r.range_u64(
            "rate.warmup.cold_factor",
            warmup.cold_factor.into(),
            bounds::MIN_COLD_FACTOR.into(),
            bounds::MAX_COLD_FACTOR.into(),
        );
    }
}

/// A calendar period: counted in windows, on a clock the zone exists for.
fn check_calendar(r: &mut Report, rate: &RateSpec) {
    if rate.algorithm != Algorithm::FixedWindow {
        r.at(
            "rate.algorithm",
            "a calendar period is counted in calendar windows: set `fixed_window`",
        );
    }
    if let Some(name) = &rate.time_zone {
        if let Err(e) = crate::calendar::zone(name) {
            r.at("rate.time_zone", e.to_string());
        }
    }
}

pub(crate) fn check_concurrency(r: &mut Report, conc: &ConcurrencySpec, has_priority: bool) {
    r.range_u64(
        "concurrency.max_in_flight",
        conc.max_in_flight.into(),
        1,
        bounds::MAX_IN_FLIGHT.into(),
    );
    r.range_ms(
        "concurrency.lease_ttl",
        conc.lease_ttl,
        bounds::MIN_LEASE_TTL_MS,
        bounds::MAX_LEASE_TTL_MS,
    );
    if conc.reserved_for_high > 0 {
        if conc.reserved_for_high >= conc.max_in_flight {
            r.at(
                "concurrency.reserved_for_high",
                "must be less than max_in_flight, or normal requests could never pass",
            );
        }
        if !has_priority {
            r.at(
                "concurrency.reserved_for_high",
                "needs `priority` on the policy, or no request is ever high priority",
            );
        }
    }
}

/// A `scope: global` `whose` (a policy or a limit) is leased in shares of
/// its rate: only a token bucket, without warm-up, splits that way.
pub(crate) fn check_rate_splits_into_shares(r: &mut Report, rate: &RateSpec, whose: &str) {
    if rate.algorithm != Algorithm::TokenBucket {
        r.at(
            "rate.algorithm",
            format!(
                "a `scope: global` {whose} needs `token_bucket`: windows cannot be split into shares"
            ),
        );
    }
    if rate.warmup.is_some() {
        r.at("rate.warmup", "not supported with `scope: global`");
    }
}
