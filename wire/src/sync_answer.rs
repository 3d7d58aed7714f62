//! What the admin answers to a sync or a watch: written by
//! [`AdminAnswer::http`] in the admin and read by [`ReceivedHeaders::read`]
//! in both of the filter's shells, nowhere else.
//!
//! The policy set travels in the body, everything else in headers. A
//! `304` (the Envoy's set is current: by far the most common answer)
//! carries no body, yet every answer must carry the store's epoch, the
//! Envoy's fleet shares, its budgets and other Envoys' provider news; and
//! filters of the earlier releases read them there. Each header is read
//! on its own, so one that does not parse costs only what it carries.

use serde::de::DeserializeOwned;

use crate::sync::{
    BudgetsMessage, ProviderNews, SharesMessage, BUDGETS_HEADER, EPOCH_HEADER, MAX_KEYS_ANSWERED,
    PROVIDER_HEADER, SHARES_HEADER, SYNC_NOW_HEADER,
};
use sluice_shared::policy::PolicySet;

/// The most of one answer header a filter reads (a well-behaved admin
/// sends a few hundred bytes per policy; Envoy's own limit is 60 KiB).
pub const MAX_ANSWER_HEADER: usize = 64 * 1024;

/// One answer of the admin to an Envoy.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AdminAnswer {
    /// The set to enforce (`200`), or None: the Envoy's is current (`304`).
    pub set: Option<PolicySet>,
    /// The store's set version, as an `ETag` (sync answers).
    pub version: Option<u64>,
    /// The store's epoch ([`EPOCH_HEADER`]), on every answer.
    pub epoch: u64,
    /// The Envoy's shares of global policies (fleet mode).
    pub shares: SharesMessage,
    /// Budgets the admin holds for the Envoy that it does not know yet.
    pub budgets: BudgetsMessage,
    /// What other Envoys' providers said of limits they share.
    pub provider: ProviderNews,
    /// A watch's `304`: fleet room was freed; sync now.
    pub sync_now: bool,
}

/// An answer as HTTP: status, headers (each only when it has something to
/// say), body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpAnswer {
    pub status: u16,
    pub headers: Vec<(&'static str, String)>,
    pub body: Vec<u8>,
}

impl AdminAnswer {
    pub fn http(&self) -> HttpAnswer {
        let mut headers = vec![(EPOCH_HEADER, self.epoch.to_string())];
        if let Some(version) = self.version {
            headers.push(("etag", format!("\"{version}\"")));
        }
        if !self.shares.is_empty() {
            headers.extend(json(&self.shares).map(|v| (SHARES_HEADER, v)));
        }
        if !self.budgets.is_empty() {
            headers.extend(json(&self.budgets).map(|v| (BUDGETS_HEADER, v)));
        }
        if !self.provider.is_empty() {
            headers.extend(json(&self.provider).map(|v| (PROVIDER_HEADER, v)));
        }
        if self.sync_now {
            headers.push((SYNC_NOW_HEADER, "1".to_string()));
        }
        match &self.set {
            Some(set) => {
                headers.push(("content-type", "application/json".to_string()));
                HttpAnswer {
                    status: 200,
                    headers,
                    body: serde_json::to_vec(set).unwrap_or_default(),
                }
            }
            None => HttpAnswer {
                status: 304,
                headers,
                body: Vec::new(),
            },
        }
    }
}

/// A header's value as JSON (None: it cannot be written, and the header
/// is left out).
fn json<T: serde::Serialize>(value: &T) -> Option<String> {
    serde_json::to_string(value).ok()
}

/// The headers of an admin's answer as an Envoy received them, read once:
/// its status, its epoch, and what each further header said (or why it
/// could not be read). Each shell hands [`Self::read`] its way of looking
/// a header up (bytes, any of them possibly missing or hostile); the
/// worker takes the parts from here and reads no header itself.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReceivedHeaders {
    /// None when Envoy gave up (connection refused, timeout, reset), or
    /// `:status` is not three digits.
    pub status: Option<u16>,
    /// The store's epoch ([`EPOCH_HEADER`]); 0 when it names none.
    pub epoch: u64,
    /// The Envoy's fleet shares ([`SHARES_HEADER`]), if sent.
    pub shares: Option<Result<SharesMessage, String>>,
    /// Budgets the admin holds for it ([`BUDGETS_HEADER`]), if sent.
    pub budgets: Option<Result<BudgetsMessage, String>>,
    /// Other Envoys' provider news ([`PROVIDER_HEADER`]), if sent.
    pub news: Option<Result<ProviderNews, String>>,
    /// A watch's answer says to sync now ([`SYNC_NOW_HEADER`]).
    pub sync_now: bool,
}

impl ReceivedHeaders {
    /// The answer whose header `name` (lower case; `:status` for the
    /// status) is `header(name)`.
    pub fn read<V: AsRef<[u8]>>(mut header: impl FnMut(&str) -> Option<V>) -> Self {
        Self {
            status: parse_status(header(":status").as_ref().map(AsRef::as_ref)),
            epoch: read_epoch(header(EPOCH_HEADER).as_ref().map(AsRef::as_ref)),
            shares: header(SHARES_HEADER).map(|v| read_shares(v.as_ref())),
            budgets: header(BUDGETS_HEADER).map(|v| read_budgets(v.as_ref())),
            news: header(PROVIDER_HEADER).map(|v| read_news(v.as_ref())),
            sync_now: header(SYNC_NOW_HEADER).is_some(),
        }
    }
}

/// An HTTP status from the bytes of `:status`; None for anything that is
/// not three digits.
pub fn parse_status(value: Option<&[u8]>) -> Option<u16> {
    let value = value?;
    if value.len() != 3 || !value.iter().all(u8::is_ascii_digit) {
        return None;
    }
    value.iter().try_fold(0u16, |n, d| {
        n.checked_mul(10)?.checked_add(u16::from(d - b'0'))
    })
}

/// The epoch an answer names; 0 when it names none (or something that is
/// not a number).
fn read_epoch(value: Option<&[u8]>) -> u64 {
    value
        .and_then(|v| std::str::from_utf8(v).ok())
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// The fleet shares header.
fn read_shares(value: &[u8]) -> Result<SharesMessage, String> {
    read_json(value)
}

/// The budgets header: at most [`MAX_KEYS_ANSWERED`] keys in all.
fn read_budgets(value: &[u8]) -> Result<BudgetsMessage, String> {
    let budgets: BudgetsMessage = read_json(value)?;
    let keys: usize = budgets.values().map(|b| b.keys.len()).sum();
    if keys > MAX_KEYS_ANSWERED {
        return Err(format!("{keys} keys, more than {MAX_KEYS_ANSWERED}"));
    }
    Ok(budgets)
}

/// The provider news header.
fn read_news(value: &[u8]) -> Result<ProviderNews, String> {
    read_json(value)
}

fn read_json<T: DeserializeOwned>(value: &[u8]) -> Result<T, String> {
    if value.len() > MAX_ANSWER_HEADER {
        return Err(format!(
            "{} bytes, at most {MAX_ANSWER_HEADER} are read",
            value.len()
        ));
    }
    serde_json::from_slice(value).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sync::{HeldBudget, LimitNews, ShareMessage};
    use sluice_shared::validate::parse_policy_set;

    fn header<'a>(answer: &'a HttpAnswer, name: &str) -> Option<&'a [u8]> {
        answer
            .headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_bytes())
    }

    #[test]
    fn what_the_admin_writes_the_filter_reads() {
        let set = parse_policy_set(
            r#"{"version": 3, "policies": [{"name": "a", "match": {"host": "*"}, "rate": {"requests": 1, "period": "1s"}}]}"#,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let mut answer = AdminAnswer {
            set: Some(set.clone()),
            version: Some(3),
            epoch: 77,
            ..AdminAnswer::default()
        };
        answer.shares.insert(
            "a".into(),
            ShareMessage {
                rate: 2.5,
                in_flight: 4,
                lease_ms: 2_000,
                instances: 3,
                id: 9,
                tag: 11,
            },
        );
        answer.budgets.insert("daily".into(), HeldBudget::default());
        answer.provider.insert(
            "tpm".into(),
            LimitNews {
                pause_ms: Some(1500),
                ..LimitNews::default()
            },
        );
        let http = answer.http();
        assert_eq!(http.status, 200);
        assert_eq!(read_epoch(header(&http, EPOCH_HEADER)), 77);
        assert_eq!(header(&http, "etag"), Some(&b"\"3\""[..]));
        let shares = read_shares(header(&http, SHARES_HEADER).unwrap_or_default());
        assert_eq!(shares, Ok(answer.shares.clone()));
        let budgets = read_budgets(header(&http, BUDGETS_HEADER).unwrap_or_default());
        assert_eq!(budgets, Ok(answer.budgets.clone()));
        let news = read_news(header(&http, PROVIDER_HEADER).unwrap_or_default());
        assert_eq!(news, Ok(answer.provider.clone()));
        let body: PolicySet = serde_json::from_slice(&http.body).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(body, set);
        assert_eq!(header(&http, SYNC_NOW_HEADER), None);
    }

    #[test]
    fn a_current_set_is_a_bodiless_304_that_still_carries_the_rest() {
        let answer = AdminAnswer {
            epoch: 5,
            sync_now: true,
            ..AdminAnswer::default()
        };
        let http = answer.http();
        assert_eq!((http.status, http.body.len()), (304, 0));
        assert_eq!(read_epoch(header(&http, EPOCH_HEADER)), 5);
        assert_eq!(header(&http, SYNC_NOW_HEADER), Some(&b"1"[..]));
        // Nothing to say: no header at all.
        assert_eq!(header(&http, SHARES_HEADER), None);
        assert_eq!(header(&http, BUDGETS_HEADER), None);
        assert_eq!(header(&http, PROVIDER_HEADER), None);
    }

    #[test]
    fn status_comes_from_three_digits_only() {
        assert_eq!(parse_status(Some(b"200")), Some(200));
        assert_eq!(parse_status(Some(b"304")), Some(304));
        for bad in [&b""[..], b"20", b"2000", b"2a0", b"\xff\xfe\x00", b" 200"] {
            assert_eq!(parse_status(Some(bad)), None, "{bad:?}");
        }
        assert_eq!(parse_status(None), None);
    }

    #[test]
    fn the_shells_reader_takes_what_the_admin_wrote_and_says_why_a_header_is_not_read() {
        let mut answer = AdminAnswer {
            epoch: 9,
            sync_now: true,
            ..AdminAnswer::default()
        };
        answer.budgets.insert("daily".into(), HeldBudget::default());
        let http = answer.http();
        let status = http.status.to_string();
        let read = ReceivedHeaders::read(|name| match name {
            ":status" => Some(status.as_bytes()),
            name => header(&http, name),
        });
        assert_eq!(read.status, Some(304));
        assert_eq!(read.epoch, 9);
        assert_eq!(read.budgets, Some(Ok(answer.budgets.clone())));
        assert_eq!((read.shares, read.news, read.sync_now), (None, None, true));
        let broken = ReceivedHeaders::read(|name| match name {
            ":status" => Some(&b"2x0"[..]),
            SHARES_HEADER => Some(&b"{not json"[..]),
            EPOCH_HEADER => Some(&b"\xff"[..]),
            _ => None,
        });
        assert_eq!((broken.status, broken.epoch), (None, 0));
        assert!(matches!(broken.shares, Some(Err(_))), "{:?}", broken.shares);
        assert_eq!(
            ReceivedHeaders::read(|_| None::<&[u8]>),
            ReceivedHeaders::default()
        );
    }

    #[test]
    fn broken_or_oversized_headers_are_refused_with_why() {
        assert!(read_shares(b"{not json").is_err());
        assert!(read_budgets(b"[]").is_err());
        let huge = vec![b' '; MAX_ANSWER_HEADER + 1];
        let refused = read_news(&huge).err().unwrap_or_default();
        assert!(refused.contains("at most 65536"), "{refused}");
        assert_eq!(read_epoch(Some(b"x1")), 0);
        assert_eq!(read_epoch(Some(b" 12 ")), 12);
        assert_eq!(read_epoch(None), 0);
        assert_eq!(read_epoch(Some(b"\xff")), 0);
    }
}
