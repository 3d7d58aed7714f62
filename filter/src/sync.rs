//! Policy sync with the admin, through Envoy shared data so that one VM
//! talks to the admin per interval and every worker installs the result.
//!
//! - `sluice/sync`: whose turn it is: the next sync instant and the count of
//!   consecutive failures (for backoff). A VM claims a turn by CAS.
//! - `sluice/policyset`: the last good policy set from the admin, as its
//!   version (8 bytes) followed by its JSON. Written only with a newer
//!   version, and only after validation, so a bad answer never replaces it.
//! - `sluice/policyset/version`: the version alone, which every worker
//!   reads on its tick (8 bytes) to notice a new set cheaply.
//!
//! The counters the syncing VM reports are summed in shared data by
//! [`crate::report`].

use sluice_shared::plugin::PluginConfig;
use sluice_shared::sync::SYNC_PATH;
use sluice_shared::time::{Instant, Span};
use sluice_shared::validate::parse_policy_set;
use sluice_shared::PolicySet;

use crate::host::Host;
use crate::store::{Store, StoreError};

pub const SYNC_KEY: &str = "sluice/sync";
pub const POLICY_SET_KEY: &str = "sluice/policyset";
pub const POLICY_VERSION_KEY: &str = "sluice/policyset/version";

/// Longest wait between attempts while the admin keeps failing.
const MAX_BACKOFF: Span = Span::from_secs(30);
/// Larger answers are refused unread.
pub const MAX_RESPONSE_BYTES: usize = 1 << 20;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncSettings {
    pub instance: String,
    pub cluster: String,
    pub authority: String,
    pub interval: Span,
    pub token: Option<String>,
}

impl SyncSettings {
    /// None when the configuration names no admin cluster: no sync.
    pub fn from_config(config: &PluginConfig) -> Option<Self> {
        Some(Self {
            instance: config.instance.clone(),
            cluster: config.admin_cluster.clone()?,
            authority: config.admin_authority.clone(),
            interval: config.sync_interval.as_span(),
            token: config.sync_token.clone(),
        })
    }

    /// An answer slower than the interval is as good as none.
    pub fn timeout(&self) -> Span {
        self.interval
            .clamp(Span::from_millis(100), Span::from_secs(5))
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Turn {
    next_due: Instant,
    failures: u32,
}

impl Turn {
    fn decode(bytes: Option<&[u8]>) -> Self {
        let Some(b) = bytes.filter(|b| b.len() == 12) else {
            return Self::default();
        };
        let mut due = [0u8; 8];
        due.copy_from_slice(&b[..8]);
        let mut failures = [0u8; 4];
        failures.copy_from_slice(&b[8..]);
        Self {
            next_due: Instant::from_nanos(u64::from_le_bytes(due)),
            failures: u32::from_le_bytes(failures),
        }
    }

    fn encode(self) -> Vec<u8> {
        let mut out = self.next_due.as_nanos().to_le_bytes().to_vec();
        out.extend_from_slice(&self.failures.to_le_bytes());
        out
    }
}

/// Takes the sync turn if it is due: true means this VM syncs now.
pub fn claim_turn<H: Host + ?Sized>(
    host: &H,
    store: &mut Store,
    now: Instant,
    interval: Span,
) -> bool {
    store
        .update(host, SYNC_KEY, |cur| {
            let mut turn = Turn::decode(cur);
            if now < turn.next_due {
                return (false, None);
            }
            turn.next_due = now + interval;
            (true, Some(turn.encode()))
        })
        .unwrap_or(false)
}

/// After a sync: a failure pushes the next turn back, doubling up to 30 s;
/// a success clears the backoff.
pub fn finish_turn<H: Host + ?Sized>(
    host: &H,
    store: &mut Store,
    now: Instant,
    interval: Span,
    ok: bool,
) {
    // A failure is counted and logged by the store; the next claim then
    // comes at the interval, without backoff.
    let _ = store.update(host, SYNC_KEY, |cur| {
        let mut turn = Turn::decode(cur);
        if ok {
            if turn.failures == 0 {
                return ((), None);
            }
            turn.failures = 0;
        } else {
            turn.failures = turn.failures.saturating_add(1);
            let backoff = interval
                .saturating_mul(1 << turn.failures.min(16))
                .min(MAX_BACKOFF);
            turn.next_due = now + backoff.max(interval);
        }
        ((), Some(turn.encode()))
    });
}

pub(crate) fn read_u64(bytes: Option<&[u8]>) -> Option<u64> {
    let b = bytes?.get(..8)?;
    let mut a = [0u8; 8];
    a.copy_from_slice(b);
    Some(u64::from_le_bytes(a))
}

/// The version hint every worker polls.
pub fn published_version<H: Host + ?Sized>(host: &H) -> Option<u64> {
    read_u64(host.shared_get(POLICY_VERSION_KEY).0.as_deref())
}

/// The last good policy set from the admin, if any. A value that fails to
/// decode or validate is ignored (and never written in the first place).
pub fn published_set<H: Host + ?Sized>(host: &H) -> Option<PolicySet> {
    let bytes = host.shared_get(POLICY_SET_KEY).0?;
    let json = std::str::from_utf8(bytes.get(8..)?).ok()?;
    parse_policy_set(json).ok()
}

/// Stores a validated set for every worker, unless a newer one is there.
/// True if it was stored.
pub fn publish<H: Host + ?Sized>(
    host: &H,
    store: &mut Store,
    set: &PolicySet,
) -> Result<bool, StoreError> {
    let json = serde_json::to_vec(set).unwrap_or_default();
    let stored = store.update(host, POLICY_SET_KEY, |cur| {
        if read_u64(cur).is_some_and(|v| v >= set.version) {
            return (false, None);
        }
        let mut value = set.version.to_le_bytes().to_vec();
        value.extend_from_slice(&json);
        (true, Some(value))
    })?;
    if stored {
        store.update(host, POLICY_VERSION_KEY, |cur| {
            if read_u64(cur).is_some_and(|v| v >= set.version) {
                return ((), None);
            }
            ((), Some(set.version.to_le_bytes().to_vec()))
        })?;
    }
    Ok(stored)
}

/// The admin's answer to a sync call as Envoy hands it over: bytes, never
/// assumed to be UTF-8, any of them possibly missing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyncReply<'a> {
    /// None when Envoy gave up (connection refused, timeout, reset).
    pub status: Option<u16>,
    /// The fleet shares header.
    pub shares_header: Option<&'a [u8]>,
    pub body: ReplyBody<'a>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyBody<'a> {
    Read(Option<&'a [u8]>),
    /// Larger than [`MAX_RESPONSE_BYTES`]: refused unread.
    TooLarge(usize),
}

impl SyncReply<'_> {
    /// The admin answered as it does when all is well (200 or 304).
    pub fn answered(&self) -> bool {
        matches!(self.status, Some(200 | 304))
    }

    pub fn answer(&self) -> Answer {
        match self.body {
            ReplyBody::Read(body) => interpret(self.status, body),
            ReplyBody::TooLarge(size) => Answer::Failed(format!(
                "refused a {size}-byte answer (at most {MAX_RESPONSE_BYTES} bytes are read)"
            )),
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

/// What came back from the admin.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    /// 200 with a valid policy set.
    PolicySet(PolicySet),
    /// 304: the set we have is current.
    Unchanged,
    /// Anything else; the last good set stays.
    Failed(String),
}

pub fn interpret(status: Option<u16>, body: Option<&[u8]>) -> Answer {
    match status {
        Some(304) => Answer::Unchanged,
        Some(200) => {
            let Some(body) = body else {
                return Answer::Failed("empty answer".into());
            };
            let Ok(json) = std::str::from_utf8(body) else {
                return Answer::Failed("answer is not UTF-8".into());
            };
            match parse_policy_set(json) {
                Ok(set) => Answer::PolicySet(set),
                Err(errors) => Answer::Failed(format!("refused an invalid policy set: {errors}")),
            }
        }
        Some(status) => Answer::Failed(format!("admin answered HTTP {status}")),
        None => Answer::Failed("no answer (admin unreachable or too slow)".into()),
    }
}

/// The request to the admin: headers and body.
pub fn request(settings: &SyncSettings, body: &[u8]) -> (Vec<(String, String)>, Vec<u8>) {
    let mut headers = vec![
        (":method".to_string(), "POST".to_string()),
        (":path".to_string(), SYNC_PATH.to_string()),
        (":authority".to_string(), settings.authority.clone()),
        ("content-type".to_string(), "application/json".to_string()),
    ];
    if let Some(token) = &settings.token {
        headers.push(("authorization".to_string(), format!("Bearer {token}")));
    }
    (headers, body.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::FakeHost;

    const SEC: Span = Span::from_secs(1);

    fn at(secs: u64) -> Instant {
        Instant::from_nanos(secs * 1_000_000_000)
    }

    fn set(version: u64, requests: u64) -> PolicySet {
        parse_policy_set(&format!(
            r#"{{"version": {version}, "policies": [{{"name": "bank", "match": {{"host": "b"}}, "rate": {{"requests": {requests}, "period": "1s"}}}}]}}"#
        ))
        .unwrap()
    }

    #[test]
    fn one_vm_per_interval_gets_the_turn_and_failures_back_off() {
        let host = FakeHost::at(at(10));
        let mut store = Store::default();
        let secs = |n: u64| SEC.saturating_mul(n);
        assert!(claim_turn(&host, &mut store, at(10), SEC));
        assert!(
            !claim_turn(&host, &mut store, at(10) + Span::from_nanos(1), SEC),
            "a second VM waits"
        );
        assert!(claim_turn(&host, &mut store, at(11), SEC));
        // Three failures: 2 s, 4 s, 8 s.
        let mut now = at(11);
        for expected in [2, 4, 8] {
            finish_turn(&host, &mut store, now, SEC, false);
            assert!(!claim_turn(
                &host,
                &mut store,
                now + secs(expected) - Span::from_nanos(1),
                SEC
            ));
            now += secs(expected);
            assert!(claim_turn(&host, &mut store, now, SEC));
        }
        for _ in 0..20 {
            finish_turn(&host, &mut store, now, SEC, false);
        }
        assert!(
            claim_turn(&host, &mut store, now + secs(30), SEC),
            "backoff stops at 30 s"
        );
        finish_turn(&host, &mut store, now + secs(30), SEC, true);
        assert!(
            claim_turn(&host, &mut store, now + secs(31), SEC),
            "success: back to the interval"
        );
    }

    #[test]
    fn only_newer_valid_sets_are_published() {
        let host = FakeHost::at(Instant::EPOCH);
        let mut stats = Store::default();
        assert_eq!(published_version(&host), None);
        assert!(publish(&host, &mut stats, &set(3, 10)).unwrap());
        assert!(!publish(&host, &mut stats, &set(2, 99)).unwrap(), "older");
        assert!(
            !publish(&host, &mut stats, &set(3, 99)).unwrap(),
            "same version"
        );
        assert_eq!(published_version(&host), Some(3));
        assert_eq!(published_set(&host).unwrap(), set(3, 10));
        assert!(publish(&host, &mut stats, &set(4, 20)).unwrap());
        assert_eq!(published_set(&host).unwrap().version, 4);
    }

    #[test]
    fn status_comes_from_three_digits_only() {
        assert_eq!(parse_status(Some(b"200")), Some(200));
        assert_eq!(parse_status(Some(b"304")), Some(304));
        for bad in [&b""[..], b"20", b"2000", b"2a0", b"\xff\xfe\x00", b" 200"] {
            assert_eq!(parse_status(Some(bad)), None, "{bad:?}");
        }
        assert_eq!(parse_status(None), None);
        let reply = SyncReply {
            status: Some(200),
            shares_header: None,
            body: ReplyBody::TooLarge(3 << 20),
        };
        assert!(matches!(reply.answer(), Answer::Failed(why) if why.contains("3145728-byte")));
    }

    #[test]
    fn bad_answers_are_failures_never_sets() {
        assert_eq!(interpret(Some(304), None), Answer::Unchanged);
        assert!(matches!(
            interpret(Some(200), Some(br#"{"version": 2, "policies": []}"#)),
            Answer::PolicySet(_)
        ));
        for (status, body) in [
            (Some(200), Some(&b"garbage"[..])),
            (Some(200), Some(&b"\xff\xfe"[..])),
            (Some(200), None),
            (Some(200), Some(&br#"{"version": 2, "policies": [{"name": "x", "match": {"host": "a"}, "rate": {"requests": 0, "period": "1s"}}]}"#[..])),
            (Some(500), Some(&b"oops"[..])),
            (None, None),
        ] {
            assert!(matches!(interpret(status, body), Answer::Failed(_)), "{status:?} {body:?}");
        }
        let Answer::Failed(why) = interpret(Some(200), Some(br#"{"version": 2, "policies": [{"name": "x", "match": {"host": "a"}, "rate": {"requests": 0, "period": "1s"}}]}"#)) else {
            panic!()
        };
        assert!(why.contains("policies[0].rate.requests"), "{why}");
    }
}
