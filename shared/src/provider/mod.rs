//! What a provider's answer says about its own limit, and what Sluice does
//! with it: a refusal with `Retry-After` pauses the limit that mirrors the
//! provider's, for every worker, until the provider said to come back.
//!
//! Everything here reads text a provider (or anything between it and
//! Envoy) wrote: every value is bounded, and a value that does not parse
//! is an error the caller counts, never a pause.

mod adaptive;
mod counts;
mod probe;
mod relayed;
mod sliding;
mod table;

pub use adaptive::{Adaptive, AdaptiveLimit, Heard, Throttle};

pub use counts::{CountSource, Reading};
pub use relayed::RelayedStretch;
pub use table::{Allowed, Count, PauseSet, PauseWhy, ProviderTable, Row, RowState, CLOCK_SKEW};

use thiserror::Error;

use crate::policy::provider::ProviderSpec;
use crate::policy::rate::RateSpec;
use crate::request_headers::RequestHeaders;
use crate::time::{Instant, Span, NANOS_PER_MILLI, NANOS_PER_SEC};

pub const RETRY_AFTER: &str = "retry-after";
/// OpenAI's, in milliseconds (fractions allowed): finer than `Retry-After`.
pub const RETRY_AFTER_MS: &str = "retry-after-ms";

/// Longer values are not read: no real delay or date is this long.
pub(crate) const MAX_VALUE_LEN: usize = 64;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SignalError {
    #[error("{header}: {reason}: {value:?}")]
    Malformed {
        header: &'static str,
        reason: &'static str,
        value: String,
    },
}

impl SignalError {
    pub(crate) fn malformed(header: &'static str, reason: &'static str, value: &[u8]) -> Self {
        let shown = &value[..value.len().min(MAX_VALUE_LEN)];
        SignalError::Malformed {
            header,
            reason,
            value: String::from_utf8_lossy(shown).into_owned(),
        }
    }
}

/// How long an answer asks callers to wait: `retry-after-ms` when present
/// (it is the finer one), else `Retry-After` as delay-seconds or an HTTP
/// date (RFC 9110 §10.2.3). None: the answer does not say. A date in the
/// past is no wait; a wait too long to represent is [`Span::MAX`] (the
/// caller caps it).
pub fn retry_after<R: RequestHeaders + ?Sized>(
    headers: &R,
    now: Instant,
) -> Result<Option<Span>, SignalError> {
    if let Some(value) = headers.header(RETRY_AFTER_MS) {
        return retry_after_ms(&value).map(Some);
    }
    match headers.header(RETRY_AFTER) {
        Some(value) => retry_after_value(&value, now).map(Some),
        None => Ok(None),
    }
}

fn retry_after_ms(value: &[u8]) -> Result<Span, SignalError> {
    let text = trimmed(RETRY_AFTER_MS, value)?;
    let (whole, fraction) = text.split_once('.').unwrap_or((text, ""));
    if whole.is_empty() || !all_digits(whole) || !all_digits(fraction) {
        return Err(SignalError::malformed(
            RETRY_AFTER_MS,
            "not a number of milliseconds",
            value,
        ));
    }
    let millis = whole.parse::<u64>().unwrap_or(u64::MAX);
    // Sub-millisecond digits are rounded up: never earlier than asked.
    let round_up = u64::from(fraction.bytes().any(|b| b != b'0'));
    Ok(Span::from_nanos(
        millis
            .saturating_add(round_up)
            .saturating_mul(NANOS_PER_MILLI),
    ))
}

fn retry_after_value(value: &[u8], now: Instant) -> Result<Span, SignalError> {
    let text = trimmed(RETRY_AFTER, value)?;
    if all_digits(text) && !text.is_empty() {
        // Digits beyond u64 are a wait of "forever": capped by the caller.
        let secs = text.parse::<u64>().unwrap_or(u64::MAX);
        return Ok(Span::from_nanos(secs.saturating_mul(NANOS_PER_SEC)));
    }
    match httpdate::parse_http_date(text) {
        Ok(date) => Ok(Instant::from_system(date).since(now)),
        Err(_) => Err(SignalError::malformed(
            RETRY_AFTER,
            "neither delay-seconds nor an HTTP date",
            value,
        )),
    }
}

pub(crate) fn trimmed<'v>(header: &'static str, value: &'v [u8]) -> Result<&'v str, SignalError> {
    if value.len() > MAX_VALUE_LEN {
        return Err(SignalError::malformed(header, "too long", value));
    }
    std::str::from_utf8(value)
        .map(str::trim)
        .map_err(|_| SignalError::malformed(header, "not text", value))
}

pub(crate) fn all_digits(s: &str) -> bool {
    s.bytes().all(|b| b.is_ascii_digit())
}

/// A limit's `provider`, ready to read answers.
#[derive(Debug, Clone, PartialEq)]
pub struct CompiledProvider {
    pause_on: Vec<u16>,
    pub max_pause: Span,
    /// Where the provider's count is read (`headers`).
    pub count: Option<CountSource>,
    /// How long a count holds when the answer does not say: the limit's
    /// own period.
    pub default_reset: Span,
    /// `adaptive`: the limit's own rate per second, which the adapted
    /// rate climbs back to.
    pub adaptive: Option<f64>,
}

/// What one answer means for the limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PauseSignal {
    /// Not a refusal this limit listens to.
    None,
    /// A refusal without a usable wait (no `Retry-After`, or 0).
    Refused,
    /// A refusal asking to wait `wait` (at most `max_pause`; `capped`
    /// when the provider asked for longer).
    Pause { wait: Span, capped: bool },
    /// A refusal whose wait did not parse: no pause.
    Malformed(SignalError),
}

impl CompiledProvider {
    /// For the limit named `limit_name` whose period is `period`.
    pub fn new(spec: &ProviderSpec, limit_name: &str, rate: &RateSpec) -> Self {
        let period = rate.period.as_span();
        Self {
            adaptive: spec
                .adaptive
                .then(|| crate::fleet::Amount::per_second(rate)),
            pause_on: spec.pause_on.clone(),
            max_pause: spec.max_pause().as_span(),
            count: spec
                .headers
                .as_ref()
                .map(|h| CountSource::new(h, limit_name)),
            default_reset: period,
        }
    }

    /// What the answer says is left of the provider's limit, and until
    /// when (at most `max_pause`: a reset further away is not waited
    /// for). None: not said, or not followed.
    pub fn count_in<R: RequestHeaders + ?Sized>(
        &self,
        headers: &R,
        now: Instant,
    ) -> Result<Option<Count>, SignalError> {
        let Some(source) = &self.count else {
            return Ok(None);
        };
        Ok(source.read(headers, now)?.map(|reading| Count {
            remaining: reading.remaining,
            reset_in: reading
                .reset_in
                .unwrap_or(self.default_reset)
                .min(self.max_pause),
            limit: reading.limit,
            // A window is never longer than a pause may be, nor than the
            // limit's own period says unless the provider says otherwise.
            window: reading
                .window
                .unwrap_or(self.default_reset)
                .min(self.max_pause),
        }))
    }

    /// The limit as its adaptive rows see it (None: it does not adapt).
    pub fn adaptive_limit(&self) -> Option<AdaptiveLimit> {
        self.adaptive.map(|full| AdaptiveLimit {
            full,
            period: self.default_reset,
        })
    }

    /// Whether the provider's answers are read on every call (to follow
    /// its count, or to adapt to its refusals).
    pub fn counts_calls(&self) -> bool {
        self.count.is_some() || self.adaptive.is_some()
    }

    /// Reads an answer of status `status` with `headers`, at `now`.
    pub fn pause_for<R: RequestHeaders + ?Sized>(
        &self,
        status: Option<u16>,
        headers: &R,
        now: Instant,
    ) -> PauseSignal {
        if !status.is_some_and(|s| self.pause_on.contains(&s)) {
            return PauseSignal::None;
        }
        match retry_after(headers, now) {
            Ok(Some(wait)) if wait.is_zero() => PauseSignal::Refused,
            Ok(Some(wait)) => PauseSignal::Pause {
                wait: wait.min(self.max_pause),
                capped: wait > self.max_pause,
            },
            Ok(None) => PauseSignal::Refused,
            Err(e) => PauseSignal::Malformed(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const NOW: Instant = Instant::from_millis(1_700_000_000_000);

    fn per_second(requests: u64) -> RateSpec {
        RateSpec {
            algorithm: Default::default(),
            requests,
            period: crate::DurationMs::from_secs(1).into(),
            time_zone: None,
            burst: None,
            warmup: None,
        }
    }

    fn signal(
        provider: &CompiledProvider,
        status: Option<u16>,
        headers: &[(&str, &[u8])],
        now: Instant,
    ) -> PauseSignal {
        provider.pause_for(status, headers, now)
    }

    fn wait(headers: &[(&str, &[u8])]) -> Result<Option<Span>, SignalError> {
        retry_after(headers, NOW)
    }

    #[test]
    fn delay_seconds_and_http_dates_are_waits() {
        assert_eq!(wait(&[("retry-after", b"3")]), Ok(Some(Span::from_secs(3))));
        assert_eq!(
            wait(&[("Retry-After", b" 30 ")]),
            Ok(Some(Span::from_secs(30)))
        );
        // 2023-11-14T22:13:20Z is NOW; ten seconds later:
        let date = b"Tue, 14 Nov 2023 22:13:30 GMT";
        assert_eq!(
            wait(&[("retry-after", date)]),
            Ok(Some(Span::from_secs(10)))
        );
        let past = b"Tue, 14 Nov 2023 22:13:00 GMT";
        assert_eq!(wait(&[("retry-after", past)]), Ok(Some(Span::ZERO)));
        assert_eq!(wait(&[]), Ok(None));
    }

    #[test]
    fn retry_after_ms_wins_and_rounds_up() {
        let both: &[(&str, &[u8])] = &[("retry-after", b"2"), ("retry-after-ms", b"1500")];
        assert_eq!(wait(both), Ok(Some(Span::from_millis(1500))));
        assert_eq!(
            wait(&[("retry-after-ms", b"12.25")]),
            Ok(Some(Span::from_millis(13)))
        );
        assert_eq!(
            wait(&[("retry-after-ms", b"12.000")]),
            Ok(Some(Span::from_millis(12)))
        );
    }

    #[test]
    fn negative_fractional_garbage_and_long_values_are_errors() {
        for bad in [
            &b"-3"[..],
            b"1.5",
            b"soon",
            b"",
            b"\xff\xfe",
            b"3 s",
            b"Tue, 31 Feb 2023 99:99:99 GMT",
            &[b'9'; 100],
        ] {
            assert!(
                wait(&[("retry-after", bad)]).is_err(),
                "{:?} accepted",
                String::from_utf8_lossy(bad)
            );
        }
        for bad in [&b"-1"[..], b".5", b"1e3", b"12.x"] {
            assert!(wait(&[("retry-after-ms", bad)]).is_err());
        }
    }

    #[test]
    fn huge_waits_saturate_for_the_cap() {
        let huge = b"99999999999999999999";
        assert_eq!(wait(&[("retry-after", huge)]), Ok(Some(Span::MAX)));
        let far = b"Fri, 31 Dec 9999 23:59:59 GMT";
        let w = wait(&[("retry-after", far)]).unwrap().unwrap();
        assert!(w > Span::from_secs(365 * 86_400 * 100), "{w:?}");
    }

    #[test]
    fn only_listed_refusals_pause_and_never_past_the_cap() {
        let provider = CompiledProvider::new(&ProviderSpec::default(), "x", &per_second(100));
        let h: &[(&str, &[u8])] = &[("retry-after", b"3")];
        assert_eq!(signal(&provider, Some(200), h, NOW), PauseSignal::None);
        assert_eq!(signal(&provider, None, h, NOW), PauseSignal::None);
        assert_eq!(
            signal(&provider, Some(429), h, NOW),
            PauseSignal::Pause {
                wait: Span::from_secs(3),
                capped: false
            }
        );
        assert_eq!(
            signal(&provider, Some(503), &[("retry-after", &b"86400"[..])], NOW),
            PauseSignal::Pause {
                wait: Span::from_secs(300),
                capped: true
            }
        );
        assert_eq!(signal(&provider, Some(429), &[], NOW), PauseSignal::Refused);
        assert_eq!(
            signal(&provider, Some(429), &[("retry-after", &b"0"[..])], NOW),
            PauseSignal::Refused
        );
        assert!(matches!(
            signal(&provider, Some(429), &[("retry-after", &b"-3"[..])], NOW),
            PauseSignal::Malformed(_)
        ));
    }

    proptest! {
        #[test]
        fn any_header_value_reads_without_panic_and_within_the_cap(
            value in proptest::collection::vec(any::<u8>(), 0..80),
            ms in any::<bool>(),
            status in 100u16..600,
            now_ms in 0u64..4_000_000_000_000,
        ) {
            let name = if ms { "retry-after-ms" } else { "retry-after" };
            let headers: &[(&str, &[u8])] = &[(name, &value)];
            let provider = CompiledProvider::new(&ProviderSpec::default(), "x", &per_second(100));
            match provider.pause_for(Some(status), headers, Instant::from_millis(now_ms)) {
                PauseSignal::Pause { wait, .. } => {
                    prop_assert!(wait <= Span::from_secs(300));
                    prop_assert!(!wait.is_zero());
                }
                PauseSignal::None => prop_assert!(status != 429 && status != 503),
                PauseSignal::Refused | PauseSignal::Malformed(_) => {}
            }
        }

    }
}
