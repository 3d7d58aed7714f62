//! Values in Envoy shared data, updated by compare-and-swap, and the one
//! place where a failure to do so is counted and logged.
//!
//! Envoy inserts a missing key whatever CAS token is passed, and overwrites
//! an existing key unconditionally when the token is 0. A worker that saw a
//! key missing therefore writes with a token no live entry carries
//! (`INSERT_CAS`): if another worker inserted the key in the meantime, the
//! write fails as a CAS mismatch and the update is retried on the real value,
//! instead of overwriting it.

use sluice_shared::key_hash::KeySecret;
use sluice_shared::time::{Instant, Span};
use sluice_wire::counts::Counter;

use crate::entries::{Codec, Entry, Plain, HOLDERS_KEY, KEY_SECRET_KEY};
use crate::host::{Host, Level, SetError};
use crate::metrics::{FilterCounter, Metrics};

/// Attempts before giving up on a contended value (and refusing the request
/// rather than spinning).
pub const MAX_CAS_ATTEMPTS: u32 = 16;

/// Envoy hands out CAS tokens from a counter starting at 1; the top value is
/// reached only after four billion writes, and then only matches by chance.
const INSERT_CAS: u32 = u32::MAX;

/// A failure of one kind is logged at most this often (it is counted every
/// time): a contended or failing host would otherwise flood Envoy's log.
const LOG_EVERY: Span = Span::from_secs(60);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreError {
    /// Every attempt lost the race.
    Contended,
    /// The host refused the write.
    HostFailed,
}

/// What can go wrong in shared data, each with its stat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    Contended,
    HostFailed,
    /// A value that does not decode (left by an incompatible version, or
    /// broken): replaced, never trusted.
    Unreadable,
}

impl Fault {
    const ALL: [Fault; 3] = [Fault::Contended, Fault::HostFailed, Fault::Unreadable];

    fn stat(self) -> FilterCounter {
        match self {
            Fault::Contended => FilterCounter::CasExhausted,
            Fault::HostFailed => FilterCounter::HostErrors,
            Fault::Unreadable => FilterCounter::StateDecodeErrors,
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Fault::Contended => "still contended after every compare-and-swap attempt",
            Fault::HostFailed => "refused by Envoy",
            Fault::Unreadable => "unreadable, replaced by a fresh value",
        }
    }
}

impl From<StoreError> for Fault {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Contended => Fault::Contended,
            StoreError::HostFailed => Fault::HostFailed,
        }
    }
}

/// Shared data as one worker sees it: the CAS loop, and the counts of what
/// went wrong, which reach Envoy's stats on the next flush.
#[derive(Debug, Default)]
pub struct Store {
    cas_retries: u64,
    faults: [u64; Fault::ALL.len()],
    /// When each kind of fault was last logged.
    logged_at: [Option<Instant>; Fault::ALL.len()],
}

impl Store {
    /// Reads the value at `key`, lets `f` decide on it (None when missing),
    /// and writes what `f` returns (None: leave it), retrying when another
    /// worker wrote in between. Every error is counted and logged here; the
    /// caller only decides what the failure means for its request.
    pub fn update<H: Host + ?Sized, R>(
        &mut self,
        host: &H,
        key: &str,
        mut f: impl FnMut(Option<&[u8]>) -> (R, Option<Vec<u8>>),
    ) -> Result<R, StoreError> {
        for attempt in 0..MAX_CAS_ATTEMPTS {
            if attempt > 0 {
                self.cas_retries += 1;
            }
            let (bytes, cas) = host.shared_get(key);
            let (result, new) = f(bytes.as_deref());
            let Some(new) = new else {
                return Ok(result);
            };
            match host.shared_set(key, &new, Some(cas.unwrap_or(INSERT_CAS))) {
                Ok(()) => return Ok(result),
                Err(SetError::CasMismatch) => continue,
                Err(SetError::Failed) => {
                    return Err(self.failed(host, key, StoreError::HostFailed))
                }
            }
        }
        Err(self.failed(host, key, StoreError::Contended))
    }

    /// [`Store::update`] of a value laid out by `codec`: `f` changes the
    /// value and says whether it changed. A missing value starts fresh; an
    /// unreadable one too, counted and logged.
    pub fn update_with<H: Host + ?Sized, C: Codec, R>(
        &mut self,
        host: &H,
        key: &str,
        codec: &C,
        mut f: impl FnMut(&mut C::Value) -> (R, bool),
    ) -> Result<R, StoreError> {
        let mut unreadable = false;
        let result = self.update(host, key, |bytes| {
            let decoded = bytes.map(|b| codec.decode(b));
            unreadable = matches!(decoded, Some(None));
            let mut value = decoded.flatten().unwrap_or_else(|| codec.fresh());
            let (result, changed) = f(&mut value);
            (result, changed.then(|| codec.encode(&value)))
        });
        if unreadable {
            self.record(host, key, Fault::Unreadable);
        }
        result
    }

    /// [`Store::update_with`] of an [`Entry`].
    pub fn update_as<T: Entry, H: Host + ?Sized, R>(
        &mut self,
        host: &H,
        key: &str,
        f: impl FnMut(&mut T) -> (R, bool),
    ) -> Result<R, StoreError> {
        self.update_with(host, key, &Plain::<T>::default(), f)
    }

    /// The value at `key` without changing it (None when missing or
    /// unreadable, which is counted).
    pub fn read_as<T: Entry, H: Host + ?Sized>(&mut self, host: &H, key: &str) -> Option<T> {
        let bytes = host.shared_get(key).0?;
        let value = T::decode(&bytes);
        if value.is_none() {
            self.record(host, key, Fault::Unreadable);
        }
        value
    }

    /// A lease-holder id unique among all VMs of this Envoy process (shared
    /// data lives as long as the process), so a restarted VM never inherits
    /// the leases of the one it replaces.
    pub fn allocate_holder<H: Host + ?Sized>(&mut self, host: &H) -> u64 {
        let next = self.update_as::<u64, _, _>(host, HOLDERS_KEY, |count| {
            *count = count.wrapping_add(1).max(1);
            (*count, true)
        });
        // Unique enough: the clock in nanoseconds, kept clear of counter values.
        next.unwrap_or_else(|_| host.now().as_nanos() | (1 << 63))
    }

    /// The secret keyed policies hash their keys with (see
    /// [`sluice_shared::key_hash`]): drawn from the host's random source by
    /// the first VM of this Envoy process, read by every other, so that all
    /// workers put a key in the same bucket. A new process draws a new one.
    pub fn key_secret<H: Host + ?Sized>(&mut self, host: &H) -> KeySecret {
        let drawn = self.update(host, KEY_SECRET_KEY, |bytes| {
            if let Some(secret) = bytes.and_then(KeySecret::decode) {
                return (secret, None);
            }
            let secret = KeySecret::from_bytes(draw_secret(host));
            (secret, Some(secret.to_bytes().to_vec()))
        });
        // Without shared data, this worker still hashes with a secret; it
        // only places keys apart from the other workers.
        drawn.unwrap_or_else(|_| KeySecret::from_bytes(draw_secret(host)))
    }

    /// Adds what happened since the last flush to the filter's stats.
    pub fn flush_into(&mut self, metrics: &mut Metrics) {
        let as_delta = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        metrics.add_filter(FilterCounter::CasRetries, as_delta(self.cas_retries));
        self.cas_retries = 0;
        for (fault, count) in Fault::ALL.iter().zip(self.faults.iter_mut()) {
            metrics.add_filter(fault.stat(), as_delta(*count));
            *count = 0;
        }
    }

    fn failed<H: Host + ?Sized>(&mut self, host: &H, key: &str, error: StoreError) -> StoreError {
        self.record(host, key, error.into());
        error
    }

    fn record<H: Host + ?Sized>(&mut self, host: &H, key: &str, fault: Fault) {
        let i = fault as usize;
        self.faults[i] += 1;
        let now = host.now();
        if self.logged_at[i].is_some_and(|at| now - at < LOG_EVERY) {
            return;
        }
        self.logged_at[i] = Some(now);
        host.log(
            Level::Warn,
            &format!(
                "sluice: shared data {key:?}: {} (logged once a minute; counted in sluice.{})",
                fault.describe(),
                fault.stat().name()
            ),
        );
    }
}

/// Random bytes for a key secret. A host without a random source (none
/// known) gets one from the clock, which an attacker could guess: said
/// loudly in the log.
fn draw_secret<H: Host + ?Sized>(host: &H) -> [u8; KeySecret::LEN] {
    let mut bytes = [0; KeySecret::LEN];
    if !host.random_bytes(&mut bytes) {
        host.log(
            Level::Error,
            "sluice: the host gave no random bytes; keys are hashed with a secret from the clock, which can be guessed",
        );
        let nanos = host.now().as_nanos().to_le_bytes();
        bytes[..8].copy_from_slice(&nanos);
        bytes[8..].copy_from_slice(&nanos.map(|b| b.rotate_left(3) ^ 0x5a));
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::FakeHost;

    #[test]
    fn every_fault_is_counted_but_logged_once_a_minute() {
        let host = FakeHost::at(Instant::from_nanos(1));
        let mut store = Store::default();
        host.always_mismatch.set(true);
        for _ in 0..3 {
            let r: Result<(), _> = store.update(&host, "k", |_| ((), Some(vec![1])));
            assert_eq!(r, Err(StoreError::Contended));
        }
        assert_eq!(host.logs.borrow().len(), 1, "{:?}", host.logs.borrow());
        host.advance_ms(60_000);
        let _ = store.update(&host, "k", |_| ((), Some(vec![1])));
        assert_eq!(host.logs.borrow().len(), 2);
        let mut metrics = Metrics::default();
        store.flush_into(&mut metrics);
        assert_eq!(metrics.pending_filter(FilterCounter::CasExhausted), 4);
        assert_eq!(
            metrics.pending_filter(FilterCounter::CasRetries),
            4 * i64::from(MAX_CAS_ATTEMPTS - 1)
        );
    }

    #[test]
    fn holders_are_unique_per_process() {
        let host = FakeHost::at(Instant::from_nanos(1));
        let mut store = Store::default();
        let a = store.allocate_holder(&host);
        let b = Store::default().allocate_holder(&host);
        assert_ne!(a, b);
    }
}
