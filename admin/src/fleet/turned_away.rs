//! When an admin last turned a sync away before its Envoy was heard (it
//! shed it, or its store failed it), and so until when its ledgers keep
//! their silent members (`Ledger::keep_the_silent_until`).

use std::sync::atomic::{AtomicU64, Ordering};

use sluice_shared::fleet::FleetTerms;
use sluice_shared::{Instant, Span};
use sluice_wire::sync::MAX_SYNC_BACKOFF_MS;

/// In milliseconds of the lease clock; 0: never.
#[derive(Debug, Default)]
pub(super) struct TurnedAway(AtomicU64);

impl TurnedAway {
    /// A sync was turned away at `now`.
    pub(super) fn note(&self, now: Instant) {
        self.0.fetch_max(now.as_millis(), Ordering::Relaxed);
    }

    /// Until when a ledger of `terms` keeps its silent members: a lease
    /// and a half and two of an Envoy's longest backoffs after the last
    /// sync turned away (the Envoy's next attempt may be lost too);
    /// None if none ever was.
    pub(super) fn silent_kept_until(&self, terms: &FleetTerms) -> Option<Instant> {
        let at = self.0.load(Ordering::Relaxed);
        (at > 0).then(|| {
            Instant::from_millis(at)
                + terms.lease
                + terms.lease.div(2)
                + Span::from_millis(2 * MAX_SYNC_BACKOFF_MS)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_shared::fleet::Amount;

    #[test]
    fn the_silent_are_kept_from_the_latest_sync_turned_away() {
        let terms = FleetTerms {
            limit: Amount {
                rate: 10.0,
                in_flight: 0,
            },
            lease: Span::from_secs(2),
            floor_fraction: 0.05,
        };
        let turned = TurnedAway::default();
        assert_eq!(turned.silent_kept_until(&terms), None);
        turned.note(Instant::from_millis(20_000));
        turned.note(Instant::from_millis(10_000));
        assert_eq!(
            turned.silent_kept_until(&terms),
            Some(Instant::from_millis(20_000 + 3_000 + 10_000))
        );
    }
}
