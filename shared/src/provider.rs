//! What a provider's answer says about its own limit, and what Sluice does
//! with it: a refusal with `Retry-After` pauses the limit that mirrors the
//! provider's, for every worker, until the provider said to come back.
//!
//! Everything here reads text a provider (or anything between it and
//! Envoy) wrote: every value is bounded, and a value that does not parse
//! is an error the caller counts, never a pause.

use thiserror::Error;

use crate::matcher::RequestHeaders;
use crate::policy::ProviderSpec;
use crate::time::{Instant, Span, NANOS_PER_MILLI, NANOS_PER_SEC};

pub const RETRY_AFTER: &str = "retry-after";
/// OpenAI's, in milliseconds (fractions allowed): finer than `Retry-After`.
pub const RETRY_AFTER_MS: &str = "retry-after-ms";

/// Longer values are not read: no real delay or date is this long.
const MAX_VALUE_LEN: usize = 64;

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
    fn malformed(header: &'static str, reason: &'static str, value: &[u8]) -> Self {
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

fn trimmed<'v>(header: &'static str, value: &'v [u8]) -> Result<&'v str, SignalError> {
    if value.len() > MAX_VALUE_LEN {
        return Err(SignalError::malformed(header, "too long", value));
    }
    std::str::from_utf8(value)
        .map(str::trim)
        .map_err(|_| SignalError::malformed(header, "not text", value))
}

fn all_digits(s: &str) -> bool {
    s.bytes().all(|b| b.is_ascii_digit())
}

/// A limit's `provider`, ready to read answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompiledProvider {
    pause_on: Vec<u16>,
    pub max_pause: Span,
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
    pub fn new(spec: &ProviderSpec) -> Self {
        Self {
            pause_on: spec.pause_on.clone(),
            max_pause: spec.max_pause().as_span(),
        }
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

/// The pauses of one limit (or of one group of a keyed limit's keys), as
/// kept in shared data: who is paused (the key's hash; 0 for an unkeyed
/// limit), since when and until when. Bounded: a full table gives the
/// place of the pause ending first to a new one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PauseTable {
    pauses: Vec<Pause>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pause {
    pub owner: u64,
    pub since: Instant,
    pub until: Instant,
}

/// How far ahead of a reader's clock a pause may have begun: the workers'
/// clocks differ by about one tick; a pause "beginning" later than this
/// was written by no worker and is ignored.
pub const CLOCK_SKEW: Span = Span::from_secs(1);

impl PauseTable {
    pub const MAX_PAUSES: usize = 8;
    const VERSION: u8 = 1;
    const ENTRY_LEN: usize = 24;

    pub fn pauses(&self) -> &[Pause] {
        &self.pauses
    }

    /// Until when `owner` is paused at `now` (None: it is not): never
    /// longer than `max_pause` after the pause began, whatever the entry
    /// says, and never for a pause that begins in the future.
    pub fn paused_until(&self, owner: u64, now: Instant, max_pause: Span) -> Option<Instant> {
        self.pauses
            .iter()
            .filter(|p| p.owner == owner && p.since <= now + CLOCK_SKEW)
            .map(|p| p.until.min(p.since + max_pause))
            .filter(|&until| until > now)
            .max()
    }

    /// Pauses `owner` from `now` for `wait`. A pause already running
    /// longer is kept. Returns whether the table changed.
    pub fn pause(&mut self, owner: u64, now: Instant, wait: Span) -> bool {
        let until = now + wait;
        self.pauses
            .retain(|p| p.until > now && p.since <= now + CLOCK_SKEW);
        if let Some(p) = self.pauses.iter_mut().find(|p| p.owner == owner) {
            if p.until >= until {
                return false;
            }
            *p = Pause {
                owner,
                since: now,
                until,
            };
            return true;
        }
        if self.pauses.len() >= Self::MAX_PAUSES {
            if let Some(first) = self
                .pauses
                .iter()
                .enumerate()
                .min_by_key(|(_, p)| p.until)
                .map(|(i, _)| i)
            {
                self.pauses.swap_remove(first);
            }
        }
        self.pauses.push(Pause {
            owner,
            since: now,
            until,
        });
        true
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(1 + self.pauses.len() * Self::ENTRY_LEN);
        out.push(Self::VERSION);
        for p in &self.pauses {
            out.extend_from_slice(&p.owner.to_le_bytes());
            out.extend_from_slice(&p.since.as_nanos().to_le_bytes());
            out.extend_from_slice(&p.until.as_nanos().to_le_bytes());
        }
        out
    }

    /// Bytes that are no table (garbage, another version) read as no
    /// pause: a broken entry must never stop calls.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let (&version, rest) = bytes.split_first()?;
        if version != Self::VERSION
            || rest.len() % Self::ENTRY_LEN != 0
            || rest.len() / Self::ENTRY_LEN > Self::MAX_PAUSES
        {
            return None;
        }
        let word = |b: &[u8]| b.try_into().ok().map(u64::from_le_bytes);
        let pauses = rest
            .chunks_exact(Self::ENTRY_LEN)
            .map(|c| {
                Some(Pause {
                    owner: word(c.get(0..8)?)?,
                    since: Instant::from_nanos(word(c.get(8..16)?)?),
                    until: Instant::from_nanos(word(c.get(16..24)?)?),
                })
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Self { pauses })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const NOW: Instant = Instant::from_millis(1_700_000_000_000);

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
        let provider = CompiledProvider::new(&ProviderSpec::default());
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

    #[test]
    fn a_pause_holds_its_owner_only_and_a_longer_one_wins() {
        let mut table = PauseTable::default();
        let cap = Span::from_secs(300);
        assert!(table.pause(7, NOW, Span::from_secs(3)));
        assert_eq!(
            table.paused_until(7, NOW, cap),
            Some(NOW + Span::from_secs(3))
        );
        assert_eq!(table.paused_until(8, NOW, cap), None);
        assert!(
            !table.pause(7, NOW, Span::from_secs(1)),
            "a shorter pause changes nothing"
        );
        assert!(table.pause(7, NOW, Span::from_secs(5)));
        assert_eq!(table.paused_until(7, NOW + Span::from_secs(5), cap), None);
        let back = PauseTable::decode(&table.encode()).unwrap();
        assert_eq!(back, table);
    }

    #[test]
    fn a_full_table_drops_the_pause_ending_first() {
        let mut table = PauseTable::default();
        for owner in 0..PauseTable::MAX_PAUSES as u64 {
            table.pause(owner, NOW, Span::from_secs(10 + owner));
        }
        table.pause(99, NOW, Span::from_secs(5));
        assert_eq!(table.pauses().len(), PauseTable::MAX_PAUSES);
        let cap = Span::from_secs(300);
        assert_eq!(table.paused_until(0, NOW, cap), None);
        assert!(table.paused_until(99, NOW, cap).is_some());
    }

    #[test]
    fn broken_entries_pause_nothing() {
        let cap = Span::from_secs(300);
        for bytes in [&b""[..], b"\x02", b"\x01\x00", &[1u8; 1 + 24 * 9]] {
            assert!(PauseTable::decode(bytes).is_none_or(|t| t.pauses().len() <= 8));
        }
        // A pause written with a far-future start, or an end past the cap:
        let mut table = PauseTable::default();
        table.pauses.push(Pause {
            owner: 0,
            since: NOW + Span::from_secs(3600),
            until: Instant::MAX,
        });
        assert_eq!(table.paused_until(0, NOW, cap), None);
        table.pauses[0].since = NOW;
        assert_eq!(table.paused_until(0, NOW, cap), Some(NOW + cap));
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
            let provider = CompiledProvider::new(&ProviderSpec::default());
            match provider.pause_for(Some(status), headers, Instant::from_millis(now_ms)) {
                PauseSignal::Pause { wait, .. } => {
                    prop_assert!(wait <= Span::from_secs(300));
                    prop_assert!(!wait.is_zero());
                }
                PauseSignal::None => prop_assert!(status != 429 && status != 503),
                PauseSignal::Refused | PauseSignal::Malformed(_) => {}
            }
        }

        #[test]
        fn any_bytes_decode_to_a_bounded_table_or_none(
            bytes in proptest::collection::vec(any::<u8>(), 0..300),
            now_ms in 0u64..4_000_000_000_000,
            owner in any::<u64>(),
        ) {
            let cap = Span::from_secs(300);
            let now = Instant::from_millis(now_ms);
            if let Some(table) = PauseTable::decode(&bytes) {
                prop_assert!(table.pauses().len() <= PauseTable::MAX_PAUSES);
                if let Some(until) = table.paused_until(owner, now, cap) {
                    prop_assert!(until > now);
                    prop_assert!(until <= now + CLOCK_SKEW + cap);
                }
            }
        }

        #[test]
        fn pauses_stay_bounded_and_each_lasts_what_it_asked(
            steps in proptest::collection::vec((0u64..12, 0u64..5_000, 1u64..10_000), 1..60),
        ) {
            let cap = Span::from_secs(300);
            let mut table = PauseTable::default();
            let mut now = NOW;
            for (owner, advance, wait_ms) in steps {
                now += Span::from_millis(advance);
                let before = table.paused_until(owner, now, cap);
                table.pause(owner, now, Span::from_millis(wait_ms));
                let after = table.paused_until(owner, now, cap);
                prop_assert!(after >= Some(now + Span::from_millis(wait_ms)));
                prop_assert!(after >= before);
                prop_assert!(table.pauses().len() <= PauseTable::MAX_PAUSES);
                prop_assert_eq!(PauseTable::decode(&table.encode()), Some(table.clone()));
            }
        }
    }
}
