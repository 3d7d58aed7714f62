//! Every entry this filter keeps in Envoy shared data: its key, and for the
//! limit state several parts share (further limits, budgets, slots), how
//! its bytes read. A new entry goes here, so that no two parts pick the
//! same key and every layout is found in one place. Keys start `sluice/`;
//! the names of policies and limits in them are validated names.

use sluice_shared::limiter::{RateLimiter, RateState};
use sluice_shared::matcher::CompiledLimit;

/// The sync state shared by the workers (`sync::SyncState`).
pub const SYNC_KEY: &str = "sluice/sync";
/// The policy set the admin last sent, as its JSON.
pub const POLICY_SET_KEY: &str = "sluice/policyset";
/// Which set that is (`sync::SetId`).
pub const POLICY_VERSION_KEY: &str = "sluice/policyset/version";
/// The held watch for pushed edits (`watch`).
pub const WATCH_KEY: &str = "sluice/sync/watch";
/// The fleet shares the admin leased (`fleet`).
pub const SHARES_KEY: &str = "sluice/fleet/shares";
/// The next holder id a worker takes (`store::Store::next_holder`).
pub const HOLDERS_KEY: &str = "sluice/holders";
/// The secret keys are hashed with, drawn once per Envoy.
pub const KEY_SECRET_KEY: &str = "sluice/key-secret";
/// Policy counters gathered for the next report (`report`).
pub const REPORT_KEY: &str = "sluice/report";
/// Further limits' counters gathered for the next report.
pub const LIMIT_REPORT_KEY: &str = "sluice/report/limits";
/// Per-key counts gathered for the next report.
pub const KEYS_REPORT_KEY: &str = "sluice/report/keys";

const BUCKET_PREFIX: &str = "sluice/b/";
/// The last part of a keyed policy's overflow bucket.
pub const OVERFLOW_SUFFIX: &str = "/overflow";

/// Which of a policy's buckets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// An unkeyed policy's one bucket.
    Single,
    /// One of a keyed policy's `max_keys` places.
    Slot(u32),
    /// The bucket a keyed policy's overflowing keys share.
    Overflow,
}

/// Where a policy's bucket lives (`bucket::BucketState`).
pub fn bucket_key(policy: &str, place: Place) -> String {
    match place {
        // Not `format!`: this runs on every round to shared data, and the
        // formatting machinery costs several times the copy.
        Place::Single => [BUCKET_PREFIX, policy].concat(),
        Place::Slot(i) => format!("{BUCKET_PREFIX}{policy}/{i}"),
        Place::Overflow => [BUCKET_PREFIX, policy, OVERFLOW_SUFFIX].concat(),
    }
}

/// Where a further limit lives: by its name alone, so every policy naming
/// it counts against the one limit. Its state ([`limit_state`]), or for a
/// concurrency limit its slot table.
pub fn limit_key(limit: &str) -> String {
    format!("sluice/l/{limit}")
}

/// A keyed limit's places: `max_keys` of them (Some), plus one the
/// overflowing keys share (None). Each holds [`owned_limit_state`].
pub fn keyed_limit_key(limit: &str, place: Option<u32>) -> String {
    match place {
        Some(i) => format!("sluice/l/{limit}/{i}"),
        None => format!("sluice/l/{limit}/overflow"),
    }
}

/// Marks a budget's state as one the admin's budgets header set.
pub fn budget_known_key(limit: &str) -> String {
    format!("sluice/bk/{limit}")
}

/// Marks that a policy's port-hidden warning was logged in this Envoy.
pub fn port_hidden_key(policy: &str) -> String {
    format!("sluice/port-hidden/{policy}")
}

/// Where a limit's provider table lives, and whose row it is there: an
/// unkeyed limit has one entry (row 0); a keyed one spreads its keys over
/// `max_keys` entries, each holding the rows of the keys hashed to it.
pub fn provider_key(limit: &CompiledLimit, key: Option<u64>) -> (String, u64) {
    match (key, limit.keys) {
        (Some(hash), Some((max_keys, _))) => (
            format!(
                "sluice/p/{}/{}",
                limit.name,
                hash % u64::from(max_keys.max(1))
            ),
            hash,
        ),
        _ => (format!("sluice/p/{}", limit.name), 0),
    }
}

/// Reads a limit's state; bytes that are no state of this limiter (another
/// algorithm after an edit, or garbage) start it afresh.
pub fn limit_state(rate: &RateLimiter, bytes: Option<&[u8]>) -> RateState {
    bytes
        .and_then(|b| rate.decode_state(b).ok())
        .unwrap_or_else(|| rate.initial_state())
}

/// A keyed limit's entry: its owner's hash, then its state; a missing or
/// unreadable one is nobody's (0) and fresh.
pub fn owned_limit_state(rate: &RateLimiter, bytes: Option<&[u8]>) -> (u64, RateState) {
    let owner = bytes
        .and_then(|b| b.get(..8))
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map(u64::from_le_bytes);
    match (owner, bytes.and_then(|b| b.get(8..))) {
        (Some(owner), Some(rest)) => match rate.decode_state(rest) {
            Ok(state) => (owner, state),
            Err(_) => (0, rate.initial_state()),
        },
        _ => (0, rate.initial_state()),
    }
}

/// The bytes of a keyed limit's entry.
pub fn encode_owned_limit_state(owner: u64, state: &RateState) -> Vec<u8> {
    let mut out = owner.to_le_bytes().to_vec();
    out.extend_from_slice(&state.encode());
    out
}
