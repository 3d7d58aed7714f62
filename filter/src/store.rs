//! Bucket states in Envoy shared data, updated by compare-and-swap.
//!
//! Envoy inserts a missing key whatever CAS token is passed, and overwrites
//! an existing key unconditionally when the token is 0. A worker that saw a
//! key missing therefore writes with a token no live entry carries
//! (`INSERT_CAS`): if another worker inserted the key in the meantime, the
//! write fails as a CAS mismatch and the update is retried on the real value,
//! instead of overwriting it.

use sluice_shared::bucket::BucketState;

use crate::host::{Host, SetError};

/// Attempts before giving up on a contended bucket (and refusing the request
/// rather than spinning).
pub const MAX_CAS_ATTEMPTS: u32 = 16;

/// Envoy hands out CAS tokens from a counter starting at 1; the top value is
/// reached only after four billion writes, and then only matches by chance.
const INSERT_CAS: u32 = u32::MAX;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    pub cas_retries: u64,
    pub cas_exhausted: u64,
    pub decode_errors: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreError {
    /// Every attempt lost the race.
    Contended,
    /// The host refused the write.
    HostFailed,
}

/// Where a policy's bucket lives in shared data.
pub fn bucket_key(policy: &str, place: Place) -> String {
    match place {
        Place::Single => format!("sluice/b/{policy}"),
        Place::Slot(i) => format!("sluice/b/{policy}/{i}"),
        Place::Overflow => format!("sluice/b/{policy}/overflow"),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    Single,
    Slot(u32),
    Overflow,
}

/// Reads the bucket, lets `f` change it, and writes it back if `f` says it
/// changed, retrying when another worker wrote in between. A value that does
/// not decode (left by an incompatible version) is replaced by `fresh()`.
pub fn update<H: Host + ?Sized, R>(
    host: &H,
    key: &str,
    stats: &mut StoreStats,
    fresh: impl Fn() -> BucketState,
    mut f: impl FnMut(&mut BucketState) -> (R, bool),
) -> Result<R, StoreError> {
    for attempt in 0..MAX_CAS_ATTEMPTS {
        if attempt > 0 {
            stats.cas_retries += 1;
        }
        let (bytes, cas) = host.shared_get(key);
        let mut state = match bytes.as_deref().map(BucketState::decode) {
            Some(Ok(state)) => state,
            Some(Err(_)) => {
                stats.decode_errors += 1;
                fresh()
            }
            None => fresh(),
        };
        let (result, changed) = f(&mut state);
        if !changed {
            return Ok(result);
        }
        let token = cas.unwrap_or(INSERT_CAS);
        match host.shared_set(key, &state.encode(), Some(token)) {
            Ok(()) => return Ok(result),
            Err(SetError::CasMismatch) => continue,
            Err(SetError::Failed) => return Err(StoreError::HostFailed),
        }
    }
    stats.cas_exhausted += 1;
    Err(StoreError::Contended)
}

/// Like [`update`], for a value that is not a bucket: `f` sees the current
/// bytes (None when missing) and returns the new bytes, or None to leave the
/// value as it is.
pub fn update_bytes<H: Host + ?Sized, R>(
    host: &H,
    key: &str,
    stats: &mut StoreStats,
    mut f: impl FnMut(Option<&[u8]>) -> (R, Option<Vec<u8>>),
) -> Result<R, StoreError> {
    for attempt in 0..MAX_CAS_ATTEMPTS {
        if attempt > 0 {
            stats.cas_retries += 1;
        }
        let (bytes, cas) = host.shared_get(key);
        let (result, new) = f(bytes.as_deref());
        let Some(new) = new else {
            return Ok(result);
        };
        match host.shared_set(key, &new, Some(cas.unwrap_or(INSERT_CAS))) {
            Ok(()) => return Ok(result),
            Err(SetError::CasMismatch) => continue,
            Err(SetError::Failed) => return Err(StoreError::HostFailed),
        }
    }
    stats.cas_exhausted += 1;
    Err(StoreError::Contended)
}

const HOLDERS_KEY: &str = "sluice/holders";

/// A lease-holder id unique among all VMs of this Envoy process (shared data
/// lives as long as the process), so a restarted VM never inherits the
/// leases of the one it replaces.
pub fn allocate_holder<H: Host + ?Sized>(host: &H) -> u64 {
    for _ in 0..MAX_CAS_ATTEMPTS {
        let (bytes, cas) = host.shared_get(HOLDERS_KEY);
        let current = bytes
            .and_then(|b| <[u8; 8]>::try_from(b.as_slice()).ok())
            .map_or(0, u64::from_le_bytes);
        let next = current.wrapping_add(1).max(1);
        match host.shared_set(
            HOLDERS_KEY,
            &next.to_le_bytes(),
            Some(cas.unwrap_or(INSERT_CAS)),
        ) {
            Ok(()) => return next,
            Err(SetError::CasMismatch) => continue,
            Err(SetError::Failed) => break,
        }
    }
    // Unique enough: the clock in nanoseconds, kept clear of counter values.
    host.now() | (1 << 63)
}
