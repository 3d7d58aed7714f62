//! What handling one event may touch besides a part's own state: Envoy
//! (through the worker's clock), shared data, the stats, this worker's
//! lease-holder id, and the time. [`Worker`](super::Worker) builds one per
//! event and passes it down as `&mut`; a part takes it, and what of its
//! own state it needs, and nothing else of the worker.

use sluice_shared::time::Instant;

use super::decision_log::DecisionLog;
use crate::clock::Clock;
use crate::host::Host;
use crate::metrics::Metrics;
use crate::store::Store;

pub(super) struct Ctx<'a, H: Host + ?Sized> {
    /// Envoy, its clock this worker's (a [`Clocked`](crate::clock::Clocked)).
    pub host: &'a H,
    pub clock: &'a Clock,
    pub store: &'a mut Store,
    pub metrics: &'a mut Metrics,
    pub holder: u64,
    /// Decisions noted for the access log, handed to Envoy after the event.
    pub decisions: &'a mut DecisionLog,
    /// When the event is handled. Unless `fresh`, it is the clock's last
    /// reading (or, for a request not yet classified, not read at all):
    /// good for spending a prefetch or ending a stream only, so anything
    /// else calls [`Ctx::read_clock`] first.
    pub now: Instant,
    pub fresh: bool,
}

impl<H: Host + ?Sized> Ctx<'_, H> {
    /// Reads the clock, unless `now` was read for this event already.
    pub fn read_clock(&mut self) {
        if !self.fresh {
            self.now = self.host.now();
            self.fresh = true;
        }
    }

    /// For a request far from its limits: the clock's last reading while
    /// calls come densely ([`Clock::reuse`]), otherwise a fresh one.
    pub fn reuse_clock(&mut self) {
        if self.fresh {
            return;
        }
        match self.clock.reuse() {
            Some(reused) => self.now = reused,
            None => self.read_clock(),
        }
    }
}
