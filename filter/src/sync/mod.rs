//! Policy sync with the admin, through Envoy shared data so that one VM
//! talks to the admin per interval and every worker installs the result.
//!
//! - `sluice/sync`: whose turn it is: the next sync instant and the count of
//!   consecutive failures (for backoff). A VM claims a turn by CAS.
//! - `sluice/policyset`: the last good policy set from the admin, as its
//!   [`SetId`] (16 bytes) followed by its JSON. Written only after
//!   validation, and only with a set that may replace the one there (a
//!   newer version, or a set from another store), so a bad answer never
//!   replaces it.
//! - `sluice/policyset/version`: the [`SetId`] alone, which every worker
//!   reads on its tick to notice a new set cheaply.
//!
//! The counters the syncing VM reports are summed in shared data by
//! [`crate::report`]. The held watch for pushed edits is [`watch`], fleet
//! shares [`fleet`]; the worker's side of all three is
//! `worker/sync_client.rs` and `worker/shares.rs`.

pub mod fleet;
pub mod watch;

use sluice_filter_core::matcher::CompiledPolicySet;
use sluice_filter_core::plugin::PluginConfig;
use sluice_shared::fleet::{sync_backoff_bound, FleetTerms};
use sluice_shared::time::{Instant, Span};
use sluice_shared::validate::parse_policy_set;
use sluice_shared::{PolicySet, Scope};
use sluice_wire::sync::SYNC_PATH;
use sluice_wire::sync_answer::ReceivedHeaders;

use crate::entries::{self, Entry, POLICY_SET_KEY, POLICY_VERSION_KEY, SYNC_KEY};
use crate::host::Host;
use crate::store::{Store, StoreError};

/// Longest wait between attempts while the admin keeps failing.
pub(crate) const MAX_BACKOFF: Span = Span::from_millis(sluice_wire::sync::MAX_SYNC_BACKOFF_MS);
/// Larger answers are refused unread.
pub const MAX_RESPONSE_BYTES: usize = 1 << 20;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncSettings {
    pub instance: String,
    pub cluster: String,
    pub authority: String,
    pub interval: Span,
    pub token: Option<String>,
    /// Keep a watch open for pushed policy sets.
    pub push: bool,
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
            push: config.sync_push,
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

impl Entry for Turn {
    fn decode(bytes: &[u8]) -> Option<Self> {
        let due = <[u8; 8]>::try_from(bytes.get(..8)?).ok()?;
        let failures = <[u8; 4]>::try_from(bytes.get(8..)?).ok()?;
        Some(Self {
            next_due: Instant::from_nanos(u64::from_le_bytes(due)),
            failures: u32::from_le_bytes(failures),
        })
    }

    fn encode(&self) -> Vec<u8> {
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
        .update_as::<Turn, _, _>(host, SYNC_KEY, |turn| {
            if now < turn.next_due {
                return (false, false);
            }
            turn.next_due = now + interval;
            (true, true)
        })
        .unwrap_or(false)
}

/// Brings this Envoy's next sync forward to `now` (news the admin should
/// relay at once), unless syncs are backing off after failures.
pub fn hurry<H: Host + ?Sized>(host: &H, store: &mut Store, now: Instant) {
    // A failure is counted and logged by the store; the news then goes at
    // the next regular sync.
    let _ = store.update_as::<Turn, _, _>(host, SYNC_KEY, |turn| {
        if turn.failures > 0 || turn.next_due <= now {
            return ((), false);
        }
        turn.next_due = now;
        ((), true)
    });
}

/// After a sync: a failure pushes the next turn back, the interval after
/// one failure (a lost answer, noticed only at its timeout), then doubling
/// up to `longest` (5 s, or half the shortest share lease held:
/// [`longest_backoff`]; so syncs resume within it of the admin answering
/// again); a success clears the backoff. (Doubling from the first, one lost
/// answer left an Envoy three intervals without a sync, a lease at the
/// default 1 s and 3 s: its share lapsed to its fallback; the simulated
/// fleet, `tests/sim/tests/fleet_shares.rs` with 1 % of messages lost.)
pub fn finish_turn<H: Host + ?Sized>(
    host: &H,
    store: &mut Store,
    now: Instant,
    interval: Span,
    longest: Span,
    ok: bool,
) {
    // A failure is counted and logged by the store; the next claim then
    // comes at the interval, without backoff.
    let _ = store.update_as::<Turn, _, _>(host, SYNC_KEY, |turn| {
        if ok {
            if turn.failures == 0 {
                return ((), false);
            }
            turn.failures = 0;
        } else {
            turn.failures = turn.failures.saturating_add(1);
            let backoff = interval
                .saturating_mul(1 << (turn.failures - 1).min(16))
                .min(longest);
            turn.next_due = now + backoff.max(interval);
        }
        ((), true)
    });
}

/// The longest wait between sync attempts while they fail, for an Envoy
/// enforcing `policies`: 5 s, or half the shortest lease of a share of a
/// global policy or limit it may hold (`sync_backoff_bound`).
pub fn longest_backoff(policies: &CompiledPolicySet) -> Span {
    let leases = policies.all().flat_map(|p| {
        let own = p
            .is_global()
            .then(|| FleetTerms::of_policy(&p.policy).lease);
        let limits = p
            .rate_limit_specs()
            .filter(|(spec, _)| spec.scope == Scope::Global)
            .map(|(spec, _)| FleetTerms::of_limit(spec).lease);
        own.into_iter().chain(limits)
    });
    sync_backoff_bound(leases, MAX_BACKOFF)
}

pub(crate) fn read_u64(bytes: Option<&[u8]>) -> Option<u64> {
    let b = bytes?.get(..8)?;
    let mut a = [0u8; 8];
    a.copy_from_slice(b);
    Some(u64::from_le_bytes(a))
}

/// Which policy set: the admin's store it came from (its epoch, drawn at
/// random when the store was created; 0 from an admin that does not say)
/// and its version in that store.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SetId {
    pub epoch: u64,
    pub version: u64,
}

impl SetId {
    /// A set may replace the one held when it is newer in the same store,
    /// or comes from another store (the admin's database was replaced or
    /// restored: its versions start again).
    pub fn replaces(self, held: SetId) -> bool {
        self.epoch != held.epoch || self.version > held.version
    }

    fn encode(self) -> [u8; 16] {
        let mut out = [0u8; 16];
        out[..8].copy_from_slice(&self.version.to_le_bytes());
        out[8..].copy_from_slice(&self.epoch.to_le_bytes());
        out
    }

    /// From the first 16 bytes of `bytes`.
    fn decode(bytes: &[u8]) -> Option<SetId> {
        Some(SetId {
            version: read_u64(Some(bytes))?,
            epoch: read_u64(bytes.get(8..))?,
        })
    }
}

/// [`POLICY_VERSION_KEY`]: the id alone (None: no set published yet).
impl Entry for Option<SetId> {
    fn decode(bytes: &[u8]) -> Option<Self> {
        SetId::decode(bytes).map(Some)
    }

    fn encode(&self) -> Vec<u8> {
        self.map(|id| id.encode().to_vec()).unwrap_or_default()
    }
}

/// [`POLICY_SET_KEY`]: the set's id, then its JSON, validated only when a
/// worker installs it (a publish compares ids and never parses a set).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishedSet {
    pub id: SetId,
    pub json: Vec<u8>,
}

impl Entry for Option<PublishedSet> {
    fn decode(bytes: &[u8]) -> Option<Self> {
        let id = SetId::decode(bytes)?;
        let json = bytes.get(16..)?.to_vec();
        Some(Some(PublishedSet { id, json }))
    }

    fn encode(&self) -> Vec<u8> {
        let Some(set) = self else {
            return Vec::new();
        };
        let mut value = set.id.encode().to_vec();
        value.extend_from_slice(&set.json);
        value
    }
}

/// The id every worker polls.
pub fn published_id<H: Host + ?Sized>(host: &H) -> Option<SetId> {
    entries::read_as::<Option<SetId>, _>(host, POLICY_VERSION_KEY)
}

/// The last good policy set from the admin, and its id, if any. A value
/// that fails to decode or validate is ignored (and never written in the
/// first place).
pub fn published_set<H: Host + ?Sized>(host: &H) -> Option<(SetId, PolicySet)> {
    let published = entries::read_as::<Option<PublishedSet>, _>(host, POLICY_SET_KEY)?;
    let json = std::str::from_utf8(&published.json).ok()?;
    parse_policy_set(json).ok().map(|set| (published.id, set))
}

/// What [`publish`] did with a set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Published {
    /// Stored for every worker.
    Stored,
    /// It is the set already held.
    Held,
    /// An older version of the same store than the one held: kept out.
    Stale { held: SetId },
}

/// Stores a validated set for every worker, if it may replace the one
/// there (see [`SetId::replaces`]).
pub fn publish<H: Host + ?Sized>(
    host: &H,
    store: &mut Store,
    id: SetId,
    set: &PolicySet,
) -> Result<Published, StoreError> {
    let json = serde_json::to_vec(set).unwrap_or_default();
    let outcome = store.update_as::<Option<PublishedSet>, _, _>(host, POLICY_SET_KEY, |cur| {
        match cur.as_ref().map(|held| held.id) {
            Some(held) if held == id => return (Published::Held, false),
            Some(held) if !id.replaces(held) => return (Published::Stale { held }, false),
            _ => {}
        }
        *cur = Some(PublishedSet {
            id,
            json: json.clone(),
        });
        (Published::Stored, true)
    })?;
    if outcome == Published::Stored {
        store.update_as::<Option<SetId>, _, _>(host, POLICY_VERSION_KEY, |held| {
            *held = Some(id);
            ((), true)
        })?;
    }
    Ok(outcome)
}

/// The admin's answer to a sync call as Envoy hands it over: its headers
/// read once by `sluice_wire`'s one reader, its body as bytes, never
/// assumed to be UTF-8, possibly missing.
#[derive(Debug, Clone, PartialEq)]
pub struct SyncReply<'a> {
    pub headers: ReceivedHeaders,
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
        matches!(self.headers.status, Some(200 | 304))
    }

    pub fn answer(&self) -> Answer {
        match self.body {
            ReplyBody::Read(body) => interpret(self.headers.status, body),
            ReplyBody::TooLarge(size) => Answer::Failed(format!(
                "refused a {size}-byte answer (at most {MAX_RESPONSE_BYTES} bytes are read)"
            )),
        }
    }
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

    /// An Envoy holding shares waits at most half the shortest lease
    /// between failing syncs: the admin keeps a silent one's reservation
    /// a lease and a half after it last heard it.
    #[test]
    fn syncs_back_off_within_half_the_shortest_share_lease() {
        let compiled = |json: &str| CompiledPolicySet::from_json(json).expect("a valid set");
        let local = compiled(
            r#"{"version": 1, "policies": [{"name": "bank", "match": {"host": "b"}, "rate": {"requests": 5, "period": "1s"}}]}"#,
        );
        assert_eq!(longest_backoff(&local), MAX_BACKOFF);
        let global = compiled(
            r#"{"version": 1, "policies": [
                {"name": "bank", "match": {"host": "b"}, "rate": {"requests": 5, "period": "1s"}},
                {"name": "llm", "match": {"host": "l"}, "scope": "global", "share_lease": "2s",
                 "rate": {"requests": 300, "period": "1s"}}]}"#,
        );
        assert_eq!(longest_backoff(&global), SEC);
        let host = FakeHost::at(at(10));
        let mut store = Store::default();
        assert!(claim_turn(
            &host,
            &mut store,
            at(10),
            Span::from_millis(200)
        ));
        let mut now = at(10);
        for _ in 0..10 {
            finish_turn(&host, &mut store, now, Span::from_millis(200), SEC, false);
            now += SEC;
            assert!(claim_turn(&host, &mut store, now, Span::from_millis(200)));
        }
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
        // Four failures: the interval, 2 s, 4 s, then the cap of 5 s.
        let mut now = at(11);
        for expected in [1, 2, 4, 5] {
            finish_turn(&host, &mut store, now, SEC, MAX_BACKOFF, false);
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
            finish_turn(&host, &mut store, now, SEC, MAX_BACKOFF, false);
        }
        assert!(
            !claim_turn(&host, &mut store, now + secs(5) - Span::from_nanos(1), SEC),
            "backing off"
        );
        assert!(
            claim_turn(&host, &mut store, now + secs(5), SEC),
            "backoff stops at 5 s"
        );
        finish_turn(&host, &mut store, now + secs(5), SEC, MAX_BACKOFF, true);
        assert!(
            claim_turn(&host, &mut store, now + secs(6), SEC),
            "success: back to the interval"
        );
    }

    #[test]
    fn only_newer_sets_or_sets_of_another_store_are_published() {
        let host = FakeHost::at(Instant::EPOCH);
        let mut store = Store::default();
        let id = |epoch, version| SetId { epoch, version };
        assert_eq!(published_id(&host), None);
        let publish =
            |store: &mut Store, id: SetId, s: PolicySet| publish(&host, store, id, &s).unwrap();
        assert_eq!(publish(&mut store, id(7, 3), set(3, 10)), Published::Stored);
        assert_eq!(
            publish(&mut store, id(7, 2), set(2, 99)),
            Published::Stale { held: id(7, 3) },
            "older, same store"
        );
        assert_eq!(publish(&mut store, id(7, 3), set(3, 99)), Published::Held);
        assert_eq!(published_id(&host), Some(id(7, 3)));
        assert_eq!(published_set(&host).unwrap(), (id(7, 3), set(3, 10)));
        assert_eq!(publish(&mut store, id(7, 4), set(4, 20)), Published::Stored);
        // The admin's store was replaced: its versions start again.
        assert_eq!(publish(&mut store, id(9, 1), set(1, 5)), Published::Stored);
        assert_eq!(published_set(&host).unwrap(), (id(9, 1), set(1, 5)));
    }

    #[test]
    fn an_answer_too_large_to_read_is_a_failure() {
        let reply = SyncReply {
            headers: ReceivedHeaders {
                status: Some(200),
                ..ReceivedHeaders::default()
            },
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
