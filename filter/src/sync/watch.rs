//! Push: one VM per Envoy keeps a watch call open to the admin (see
//! [`sluice_wire::sync::WATCH_PATH`]), which answers it as soon as the
//! policy set changes. Which VM holds it is a lease in shared data,
//! `sluice/sync/watch`: the instant until which the watch is someone's
//! (8 bytes, nanoseconds). A VM claims an expired lease by CAS; the holder
//! gives it up when its call ends, at once after an answer and after a
//! random 1 to 3 s after a failure, so that Envoys do not all call back
//! together when an admin restarts.

use sluice_shared::time::{Instant, Span};
use sluice_wire::sync::{WatchRequest, WAIT_HEADER, WATCH_PATH};

use crate::entries::WATCH_KEY;
use crate::host::Host;
use crate::store::Store;
use crate::sync::{SetId, SyncSettings};

/// How long the admin is asked to hold a watch.
pub const HOLD: Span = Span::from_secs(20);
/// Envoy gives up on a call this much after the hold.
pub const MARGIN: Span = Span::from_secs(5);
/// Watches that bring nothing new open at most this often.
pub const MIN_GAP: Span = Span::from_secs(1);
/// Watches that bring news open at most this often.
pub const NEWS_GAP: Span = Span::from_millis(50);
/// A failed watch is retried after a random wait in this range.
pub const RETRY_MIN: Span = Span::from_secs(1);
pub const RETRY_SPREAD_MS: u64 = 2_000;

/// Claims the watch until `until` if nobody holds it at `now`; otherwise
/// says until when it is held (not worth asking again before).
pub fn claim<H: Host + ?Sized>(
    host: &H,
    store: &mut Store,
    now: Instant,
    until: Instant,
) -> Result<(), Instant> {
    store
        // Broken or missing: nobody's (held until the epoch), so claimable.
        .update_as::<Instant, _, _>(host, WATCH_KEY, |held_until| {
            if now < *held_until {
                return (Err(*held_until), false);
            }
            *held_until = until;
            (Ok(()), true)
        })
        // A store failure (counted and logged there): try on a later tick.
        .unwrap_or(Err(now))
}

/// Gives the watch up: claimable from `from` on.
pub fn release<H: Host + ?Sized>(host: &H, store: &mut Store, from: Instant) {
    // A failure is counted and logged by the store; the lease then lapses
    // on its own after the hold.
    let _ = store.update_as::<Instant, _, _>(host, WATCH_KEY, |held_until| {
        *held_until = from;
        ((), true)
    });
}

/// When to try again after a failed watch: 1 to 3 s, drawn at random.
pub fn retry_after<H: Host + ?Sized>(host: &H, now: Instant) -> Instant {
    let mut bytes = [0; 8];
    let spread = if host.random_bytes(&mut bytes) {
        u64::from_le_bytes(bytes) % RETRY_SPREAD_MS
    } else {
        // No random source: the clock's low bits still spread Envoys.
        now.as_nanos() % RETRY_SPREAD_MS
    };
    now + RETRY_MIN + Span::from_millis(spread)
}

/// The watch call for an Envoy enforcing `held`.
pub fn request(settings: &SyncSettings, held: SetId) -> (Vec<(String, String)>, Vec<u8>) {
    let mut headers = vec![
        (":method".to_string(), "POST".to_string()),
        (":path".to_string(), WATCH_PATH.to_string()),
        (":authority".to_string(), settings.authority.clone()),
        ("content-type".to_string(), "application/json".to_string()),
        (WAIT_HEADER.to_string(), HOLD.as_millis().to_string()),
    ];
    if let Some(token) = &settings.token {
        headers.push(("authorization".to_string(), format!("Bearer {token}")));
    }
    let body = WatchRequest {
        instance: settings.instance.clone(),
        policy_version: held.version,
        policy_epoch: held.epoch,
    };
    (headers, serde_json::to_vec(&body).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::FakeHost;

    #[test]
    fn one_vm_holds_the_watch_until_it_gives_it_up() {
        let host = FakeHost::at(Instant::EPOCH + Span::from_secs(10));
        let (mut a, mut b) = (Store::default(), Store::default());
        let now = host.now();
        assert_eq!(claim(&host, &mut a, now, now + HOLD + MARGIN), Ok(()));
        assert_eq!(
            claim(&host, &mut b, now + Span::from_secs(3), now + HOLD),
            Err(now + HOLD + MARGIN)
        );
        release(&host, &mut a, now + Span::from_secs(4));
        assert!(claim(&host, &mut b, now + Span::from_secs(3), now + HOLD).is_err());
        assert!(claim(&host, &mut b, now + Span::from_secs(4), now + HOLD).is_ok());
    }

    #[test]
    fn a_broken_lease_is_nobodys() {
        let host = FakeHost::at(Instant::EPOCH + Span::from_secs(10));
        let mut store = Store::default();
        host.shared_set(WATCH_KEY, b"garbage", None).unwrap();
        assert!(claim(&host, &mut store, host.now(), host.now() + HOLD).is_ok());
    }

    #[test]
    fn retries_spread_over_two_seconds() {
        let host = FakeHost::at(Instant::EPOCH + Span::from_secs(10));
        let waits: Vec<u64> = (0..50)
            .map(|_| retry_after(&host, host.now()).since(host.now()).as_millis())
            .collect();
        assert!(
            waits.iter().all(|w| (1_000..3_000).contains(w)),
            "{waits:?}"
        );
        let spread = waits.iter().max().unwrap() - waits.iter().min().unwrap();
        assert!(spread > 500, "{waits:?}");
    }
}
