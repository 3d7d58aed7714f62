//! The provider's count of what is left, as its answers' headers say it:
//! the IETF fields (draft-ietf-httpapi-ratelimit-headers: `RateLimit:
//! "name";r=50;t=30`, and the older drafts' `RateLimit-Remaining` /
//! `RateLimit-Reset`), or a vendor's own headers with their reset format.

use crate::policy::provider::{HeaderPreset, ProviderHeaders, ResetFormat};
use crate::request_headers::RequestHeaders;
use crate::time::{Instant, Span, NANOS_PER_SEC};

use super::{SignalError, MAX_VALUE_LEN};

pub const RATELIMIT: &str = "ratelimit";
pub const RATELIMIT_POLICY: &str = "ratelimit-policy";
const LEGACY_REMAINING: &str = "ratelimit-remaining";
const LEGACY_RESET: &str = "ratelimit-reset";

/// What one answer said of the provider's limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reading {
    pub remaining: u64,
    /// Until the count is full again; None when the answer does not say.
    pub reset_in: Option<Span>,
    /// The provider's limit (its quota per window), when it says it.
    pub limit: Option<u64>,
    /// The provider's window, when it says it (IETF `w`).
    pub window: Option<Span>,
}

/// Where a limit finds the provider's count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CountSource {
    /// The IETF `RateLimit` field's item named so (or its only item), else
    /// the older drafts' separate fields.
    Ietf { item: String },
    Vendor {
        limit: Option<String>,
        remaining: String,
        reset: Option<(String, ResetFormat)>,
    },
}

impl CountSource {
    /// `limit_name`: the IETF item a limit follows unless told another.
    pub fn new(spec: &ProviderHeaders, limit_name: &str) -> Self {
        let vendor = |limit: &str, remaining: &str, reset: &str, format| CountSource::Vendor {
            limit: Some(limit.to_string()),
            remaining: remaining.to_string(),
            reset: Some((reset.to_string(), format)),
        };
        match spec {
            ProviderHeaders::Preset(preset) => match preset {
                HeaderPreset::Ietf => CountSource::Ietf {
                    item: limit_name.to_string(),
                },
                HeaderPreset::OpenaiRequests => vendor(
                    "x-ratelimit-limit-requests",
                    "x-ratelimit-remaining-requests",
                    "x-ratelimit-reset-requests",
                    ResetFormat::Duration,
                ),
                HeaderPreset::OpenaiTokens => vendor(
                    "x-ratelimit-limit-tokens",
                    "x-ratelimit-remaining-tokens",
                    "x-ratelimit-reset-tokens",
                    ResetFormat::Duration,
                ),
                HeaderPreset::AnthropicRequests => vendor(
                    "anthropic-ratelimit-requests-limit",
                    "anthropic-ratelimit-requests-remaining",
                    "anthropic-ratelimit-requests-reset",
                    ResetFormat::Rfc3339,
                ),
                HeaderPreset::AnthropicTokens => vendor(
                    "anthropic-ratelimit-tokens-limit",
                    "anthropic-ratelimit-tokens-remaining",
                    "anthropic-ratelimit-tokens-reset",
                    ResetFormat::Rfc3339,
                ),
                HeaderPreset::AnthropicInputTokens => vendor(
                    "anthropic-ratelimit-input-tokens-limit",
                    "anthropic-ratelimit-input-tokens-remaining",
                    "anthropic-ratelimit-input-tokens-reset",
                    ResetFormat::Rfc3339,
                ),
                HeaderPreset::AnthropicOutputTokens => vendor(
                    "anthropic-ratelimit-output-tokens-limit",
                    "anthropic-ratelimit-output-tokens-remaining",
                    "anthropic-ratelimit-output-tokens-reset",
                    ResetFormat::Rfc3339,
                ),
                HeaderPreset::Github => vendor(
                    "x-ratelimit-limit",
                    "x-ratelimit-remaining",
                    "x-ratelimit-reset",
                    ResetFormat::EpochSeconds,
                ),
            },
            ProviderHeaders::Ietf(item) => CountSource::Ietf {
                item: item.ietf.clone(),
            },
            ProviderHeaders::Custom(custom) => CountSource::Vendor {
                limit: custom.limit.as_ref().map(|h| h.to_ascii_lowercase()),
                remaining: custom.remaining.to_ascii_lowercase(),
                reset: custom
                    .reset
                    .as_ref()
                    .map(|h| (h.to_ascii_lowercase(), custom.reset_format)),
            },
        }
    }

    /// Reads the count from an answer's headers. None: the answer does not
    /// carry it. A value that does not parse is an error (the caller
    /// counts it and ignores the whole reading).
    pub fn read<R: RequestHeaders + ?Sized>(
        &self,
        headers: &R,
        now: Instant,
    ) -> Result<Option<Reading>, SignalError> {
        match self {
            CountSource::Ietf { item } => {
                let reading = match headers.header(RATELIMIT) {
                    Some(value) => ietf_item(&value, item)?,
                    None => legacy_ietf(headers)?,
                };
                let Some(mut reading) = reading else {
                    return Ok(None);
                };
                if let Some(value) = headers.header(RATELIMIT_POLICY) {
                    // A policy field that does not parse leaves the count
                    // read from `RateLimit` standing.
                    if let Ok(Some((quota, window))) = ietf_policy(&value, item) {
                        reading.limit = Some(quota);
                        reading.window = window;
                    }
                }
                Ok(Some(reading))
            }
            CountSource::Vendor {
                limit,
                remaining,
                reset,
            } => {
                let Some(value) = headers.header(remaining) else {
                    return Ok(None);
                };
                let remaining = whole_number("remaining", &value)?;
                let reset_in = match reset {
                    Some((name, format)) => match headers.header(name) {
                        Some(value) => Some(reset_value(&value, *format, now)?),
                        None => None,
                    },
                    None => None,
                };
                let limit = match limit.as_ref().and_then(|name| headers.header(name)) {
                    // Azure's `-1` or `0` for "unknown": no limit said.
                    Some(value) => whole_number("limit", &value).ok().filter(|&l| l > 0),
                    None => None,
                };
                Ok(Some(Reading {
                    remaining,
                    reset_in,
                    limit,
                    window: None,
                }))
            }
        }
    }
}

/// The item named `name` of a structured list `field` (or its only item),
/// with its integer parameters read by `param`.
fn ietf_list_item(
    field: &'static str,
    value: &[u8],
    name: &str,
) -> Result<Option<sfv::Item>, SignalError> {
    if value.len() > 4 * MAX_VALUE_LEN {
        return Err(SignalError::malformed(field, "too long", value));
    }
    let list: sfv::List = sfv::Parser::new(value)
        .parse()
        .map_err(|_| SignalError::malformed(field, "not a structured field list", value))?;
    let mut items = list.into_iter().filter_map(|entry| match entry {
        sfv::ListEntry::Item(item) => Some(item),
        sfv::ListEntry::InnerList(_) => None,
    });
    let named = |item: &sfv::Item| match &item.bare_item {
        sfv::BareItem::String(s) => s.as_str() == name,
        sfv::BareItem::Token(t) => t.as_str() == name,
        _ => false,
    };
    let first = items.next();
    let rest: Vec<sfv::Item> = items.collect();
    Ok(match first {
        Some(item) if named(&item) => Some(item),
        Some(item) if rest.is_empty() => Some(item),
        _ => rest.into_iter().find(|i| named(i)),
    })
}

/// An item's parameter `key` as a non-negative whole number.
fn ietf_param(
    field: &'static str,
    value: &[u8],
    item: &sfv::Item,
    key: &str,
) -> Result<Option<u64>, SignalError> {
    match item.params.get(key) {
        None => Ok(None),
        Some(bare) => bare
            .as_integer()
            .and_then(|i| u64::try_from(i64::from(i)).ok())
            .map(Some)
            .ok_or_else(|| {
                SignalError::malformed(field, "a parameter is not a whole number", value)
            }),
    }
}

fn seconds(secs: u64) -> Span {
    Span::from_nanos(secs.saturating_mul(NANOS_PER_SEC))
}

/// `RateLimit`: `r` (required) and `t` (seconds).
fn ietf_item(value: &[u8], name: &str) -> Result<Option<Reading>, SignalError> {
    let Some(item) = ietf_list_item(RATELIMIT, value, name)? else {
        return Ok(None);
    };
    let remaining = ietf_param(RATELIMIT, value, &item, "r")?
        .ok_or_else(|| SignalError::malformed(RATELIMIT, "no `r` (remaining)", value))?;
    let reset_in = ietf_param(RATELIMIT, value, &item, "t")?.map(seconds);
    Ok(Some(Reading {
        remaining,
        reset_in,
        limit: None,
        window: None,
    }))
}

/// `RateLimit-Policy`: `q` (required, above 0) and `w` (seconds).
fn ietf_policy(value: &[u8], name: &str) -> Result<Option<(u64, Option<Span>)>, SignalError> {
    let Some(item) = ietf_list_item(RATELIMIT_POLICY, value, name)? else {
        return Ok(None);
    };
    let quota = ietf_param(RATELIMIT_POLICY, value, &item, "q")?
        .filter(|&q| q > 0)
        .ok_or_else(|| SignalError::malformed(RATELIMIT_POLICY, "no `q` (quota)", value))?;
    let window = ietf_param(RATELIMIT_POLICY, value, &item, "w")?
        .filter(|&w| w > 0)
        .map(seconds);
    Ok(Some((quota, window)))
}

/// Drafts up to -06: `RateLimit-Remaining` and `RateLimit-Reset` (seconds).
fn legacy_ietf<R: RequestHeaders + ?Sized>(headers: &R) -> Result<Option<Reading>, SignalError> {
    let Some(value) = headers.header(LEGACY_REMAINING) else {
        return Ok(None);
    };
    let remaining = whole_number(LEGACY_REMAINING, &value)?;
    let reset_in = match headers.header(LEGACY_RESET) {
        Some(v) => Some(Span::from_nanos(
            whole_number(LEGACY_RESET, &v)?.saturating_mul(NANOS_PER_SEC),
        )),
        None => None,
    };
    Ok(Some(Reading {
        remaining,
        reset_in,
        limit: None,
        window: None,
    }))
}

/// A non-negative whole number (Azure's `-1` and anything else is an
/// error).
fn whole_number(header: &'static str, value: &[u8]) -> Result<u64, SignalError> {
    let text = super::trimmed(header, value)?;
    if text.is_empty() || !super::all_digits(text) {
        return Err(SignalError::malformed(header, "not a whole number", value));
    }
    text.parse::<u64>()
        .map_err(|_| SignalError::malformed(header, "too large", value))
}

fn reset_value(value: &[u8], format: ResetFormat, now: Instant) -> Result<Span, SignalError> {
    const RESET: &str = "reset";
    let text = super::trimmed(RESET, value)?;
    let bad = |reason| SignalError::malformed(RESET, reason, value);
    match format {
        ResetFormat::Seconds => {
            let secs = whole_number(RESET, value)?;
            Ok(Span::from_nanos(secs.saturating_mul(NANOS_PER_SEC)))
        }
        ResetFormat::EpochSeconds => {
            let secs = whole_number(RESET, value)?;
            Ok(Instant::from_nanos(secs.saturating_mul(NANOS_PER_SEC)).since(now))
        }
        ResetFormat::Duration => {
            go_duration(text).ok_or_else(|| bad("not a duration like 1m30.5s"))
        }
        ResetFormat::Rfc3339 => rfc3339(text)
            .map(|at| at.since(now))
            .ok_or_else(|| bad("not an RFC 3339 time")),
    }
}

/// Go's duration syntax, as OpenAI sends it: `12ms`, `6m0s`, `1m30.5s`,
/// `1h2m`. Each part a decimal number and a unit (h, m, s, ms, us, µs,
/// ns); saturating, never panicking.
fn go_duration(text: &str) -> Option<Span> {
    if text.is_empty() {
        return None;
    }
    let mut total: u128 = 0;
    let mut rest = text;
    while !rest.is_empty() {
        let number_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (number, after) = rest.split_at(number_len);
        let unit_len = after
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(after.len());
        let (unit, after) = after.split_at(unit_len);
        let nanos_per_unit: u128 = match unit {
            "h" => 3600 * 1_000_000_000,
            "m" => 60 * 1_000_000_000,
            "s" => 1_000_000_000,
            "ms" => 1_000_000,
            "us" | "µs" => 1_000,
            "ns" => 1,
            _ => return None,
        };
        let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
        if whole.is_empty() && fraction.is_empty() {
            return None;
        }
        if !super::all_digits(whole) || !super::all_digits(fraction) {
            return None;
        }
        let whole: u128 = if whole.is_empty() {
            0
        } else {
            whole.get(..whole.len().min(20))?.parse().ok()?
        };
        let mut part = whole.saturating_mul(nanos_per_unit);
        // Digits past nanoseconds do not matter.
        let mut scale = nanos_per_unit;
        for digit in fraction.bytes().take(18) {
            scale /= 10;
            part = part.saturating_add(u128::from(digit - b'0') * scale);
        }
        total = total.saturating_add(part);
        rest = after;
    }
    Some(Span::from_nanos(u64::try_from(total).unwrap_or(u64::MAX)))
}

/// `2026-11-24T12:00:05Z`, with fractions or a numeric offset.
fn rfc3339(text: &str) -> Option<Instant> {
    if let Some(utc) = text.strip_suffix('Z').or_else(|| text.strip_suffix('z')) {
        return parse_utc(utc);
    }
    // A numeric offset: `+01:00` means the UTC time is an hour earlier.
    let split = text.len().checked_sub(6)?;
    let (local, offset) = (text.get(..split)?, text.get(split..)?);
    let sign = match offset.as_bytes().first()? {
        b'+' => 1i64,
        b'-' => -1i64,
        _ => return None,
    };
    let (hours, minutes) = offset.get(1..)?.split_once(':')?;
    let (hours, minutes): (i64, i64) = (hours.parse().ok()?, minutes.parse().ok()?);
    if hours > 23 || minutes > 59 {
        return None;
    }
    let offset_nanos = sign * (hours * 3600 + minutes * 60) * 1_000_000_000;
    let at = i128::from(parse_utc(local)?.as_nanos()) - i128::from(offset_nanos);
    u64::try_from(at).ok().map(Instant::from_nanos)
}

fn parse_utc(text: &str) -> Option<Instant> {
    let time = humantime::parse_rfc3339(&format!("{text}Z")).ok()?;
    Some(Instant::from_system(time))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::provider::{CustomHeaders, IetfItem};
    use proptest::prelude::*;

    /// 2023-11-14T22:13:20Z.
    const NOW: Instant = Instant::from_millis(1_700_000_000_000);

    fn read(
        source: &CountSource,
        headers: &[(&str, &[u8])],
    ) -> Result<Option<Reading>, SignalError> {
        source.read(headers, NOW)
    }

    fn reading(remaining: u64, reset_ms: Option<u64>) -> Result<Option<Reading>, SignalError> {
        Ok(Some(Reading {
            remaining,
            reset_in: reset_ms.map(Span::from_millis),
            limit: None,
            window: None,
        }))
    }

    fn with_limit(
        r: Result<Option<Reading>, SignalError>,
        limit: u64,
        window_s: Option<u64>,
    ) -> Result<Option<Reading>, SignalError> {
        r.map(|r| {
            r.map(|r| Reading {
                limit: Some(limit),
                window: window_s.map(Span::from_secs),
                ..r
            })
        })
    }

    fn preset(p: HeaderPreset) -> CountSource {
        CountSource::new(&ProviderHeaders::Preset(p), "burst")
    }

    #[test]
    fn ietf_items_by_name_or_the_only_one_and_the_older_fields() {
        let ietf = preset(HeaderPreset::Ietf);
        let two: &[(&str, &[u8])] = &[("RateLimit", br#""daily";r=900;t=3600, "burst";r=50;t=30"#)];
        assert_eq!(read(&ietf, two), reading(50, Some(30_000)));
        assert_eq!(
            read(&ietf, &[("ratelimit", br#""other";r=7"#)]),
            reading(7, None)
        );
        assert_eq!(
            read(&ietf, &[("ratelimit", b"burst;r=3;t=1")]),
            reading(3, Some(1000)),
            "a token name (older drafts)"
        );
        assert_eq!(
            read(&ietf, &[("ratelimit", br#""a";r=1, "b";r=2"#)]),
            Ok(None),
            "neither is this limit's"
        );
        let named = CountSource::new(
            &ProviderHeaders::Ietf(IetfItem {
                ietf: "daily".into(),
            }),
            "x",
        );
        assert_eq!(read(&named, two), reading(900, Some(3_600_000)));
        let with_policy: &[(&str, &[u8])] = &[
            ("ratelimit", br#""burst";r=50;t=30"#),
            (
                "ratelimit-policy",
                br#""daily";q=1000;w=86400, "burst";q=100;w=60"#,
            ),
        ];
        assert_eq!(
            read(&ietf, with_policy),
            with_limit(reading(50, Some(30_000)), 100, Some(60))
        );
        let bad_policy: &[(&str, &[u8])] = &[
            ("ratelimit", br#""burst";r=50"#),
            ("ratelimit-policy", br#""burst";q=0"#),
        ];
        assert_eq!(
            read(&ietf, bad_policy),
            reading(50, None),
            "a bad policy field leaves the count"
        );
        let legacy: &[(&str, &[u8])] = &[("ratelimit-remaining", b"12"), ("ratelimit-reset", b"2")];
        assert_eq!(read(&ietf, legacy), reading(12, Some(2000)));
        assert_eq!(read(&ietf, &[]), Ok(None));
    }

    #[test]
    fn malformed_ietf_fields_are_errors() {
        let ietf = preset(HeaderPreset::Ietf);
        for bad in [
            &br#""burst";t=3"#[..],
            br#""burst";r=-1"#,
            br#""burst";r=1.5"#,
            br#""burst";r="x""#,
            br#""burst;r=1"#,
            b"\xff",
        ] {
            assert!(
                read(&ietf, &[("ratelimit", bad)]).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        assert!(read(&ietf, &[("ratelimit-remaining", b"-1")]).is_err());
    }

    #[test]
    fn openai_resets_are_go_durations() {
        let openai = preset(HeaderPreset::OpenaiTokens);
        let h = |reset: &'static [u8]| -> Vec<(&'static str, &'static [u8])> {
            vec![
                ("x-ratelimit-limit-tokens", b"30000"),
                ("x-ratelimit-remaining-tokens", b"29000"),
                ("x-ratelimit-reset-tokens", reset),
            ]
        };
        assert_eq!(
            read(&openai, &h(b"12ms")),
            with_limit(reading(29_000, Some(12)), 30_000, None)
        );
        let at = |reset| read(&openai, &h(reset)).map(|r| r.and_then(|r| r.reset_in));
        assert_eq!(at(b"6m0s"), Ok(Some(Span::from_secs(360))));
        assert_eq!(at(b"1m30.5s"), Ok(Some(Span::from_millis(90_500))));
        assert_eq!(at(b"1h2m3s"), Ok(Some(Span::from_secs(3_723))));
        assert_eq!(at(b"0.25s"), Ok(Some(Span::from_millis(250))));
        for bad in [&b"12"[..], b"s", b"1x", b"1..5s", b"-1s", b""] {
            assert!(
                read(&openai, &h(bad)).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        // Azure sometimes sends -1.
        let azure: &[(&str, &[u8])] = &[("x-ratelimit-remaining-requests", b"-1")];
        assert!(read(&preset(HeaderPreset::OpenaiRequests), azure).is_err());
    }

    #[test]
    fn anthropic_resets_are_rfc3339_times_and_github_epoch_seconds() {
        let anthropic = preset(HeaderPreset::AnthropicInputTokens);
        let h = |reset: &'static [u8]| -> Vec<(&'static str, &'static [u8])> {
            vec![
                ("anthropic-ratelimit-input-tokens-remaining", b"4000"),
                ("anthropic-ratelimit-input-tokens-reset", reset),
            ]
        };
        assert_eq!(
            read(&anthropic, &h(b"2023-11-14T22:13:50Z")),
            reading(4000, Some(30_000))
        );
        assert_eq!(
            read(&anthropic, &h(b"2023-11-14T22:13:20.5Z")),
            reading(4000, Some(500))
        );
        assert_eq!(
            read(&anthropic, &h(b"2023-11-14T23:13:50+01:00")),
            reading(4000, Some(30_000))
        );
        assert_eq!(
            read(&anthropic, &h(b"2023-11-14T22:00:00Z")),
            reading(4000, Some(0)),
            "a past reset"
        );
        for bad in [
            &b"tomorrow"[..],
            b"2023-13-14T22:13:50Z",
            b"2023-11-14T22:13:50+25:00",
        ] {
            assert!(read(&anthropic, &h(bad)).is_err());
        }
        let github = preset(HeaderPreset::Github);
        let h: &[(&str, &[u8])] = &[
            ("x-ratelimit-limit", b"5000"),
            ("x-ratelimit-remaining", b"4999"),
            ("x-ratelimit-reset", b"1700000060"),
        ];
        assert_eq!(
            read(&github, h),
            with_limit(reading(4999, Some(60_000)), 5000, None)
        );
    }

    #[test]
    fn a_custom_mapping_reads_its_headers() {
        let custom = CountSource::new(
            &ProviderHeaders::Custom(CustomHeaders {
                limit: None,
                remaining: "X-Quota-Left".into(),
                reset: Some("X-Quota-Reset".into()),
                reset_format: ResetFormat::Seconds,
            }),
            "x",
        );
        let h: &[(&str, &[u8])] = &[("x-quota-left", b"5"), ("x-quota-reset", b"10")];
        assert_eq!(read(&custom, h), reading(5, Some(10_000)));
        assert_eq!(read(&custom, &[("x-quota-left", b"5")]), reading(5, None));
    }

    proptest! {
        #[test]
        fn any_header_bytes_read_without_panic(
            value in proptest::collection::vec(any::<u8>(), 0..120),
            reset in proptest::collection::vec(any::<u8>(), 0..40),
            which in 0usize..5,
        ) {
            let source = [
                preset(HeaderPreset::Ietf),
                preset(HeaderPreset::OpenaiRequests),
                preset(HeaderPreset::AnthropicTokens),
                preset(HeaderPreset::Github),
                preset(HeaderPreset::Ietf),
            ][which].clone();
            let names = [
                ("ratelimit", "x"),
                ("x-ratelimit-remaining-requests", "x-ratelimit-reset-requests"),
                ("anthropic-ratelimit-tokens-remaining", "anthropic-ratelimit-tokens-reset"),
                ("x-ratelimit-remaining", "x-ratelimit-reset"),
                ("ratelimit-remaining", "ratelimit-reset"),
            ][which];
            let headers: &[(&str, &[u8])] = &[(names.0, &value), (names.1, &reset)];
            let _ = source.read(headers, NOW);
        }

        #[test]
        fn go_durations_any_text(text in "[0-9.hmsuµn]{0,24}") {
            let _ = go_duration(&text);
        }
    }
}
