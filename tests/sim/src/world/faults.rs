//! Faults a run injects by seed: Envoys killed or paused, the admin
//! down or stalled, its ledgers lost (shared-data write failures are the
//! host's).

use sluice_shared::time::{Instant, Span};

use super::{Event, World};

/// Faults a run injects.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    /// The chance each shared-data write fails.
    pub write_failure: f64,
    /// Envoys killed (SIGKILL: their streams reset, their shared data
    /// gone) and started again.
    pub kills: Vec<Kill>,
    /// While the admin is unreachable: from this long into the run, for
    /// so long.
    pub admin_down: Vec<(Span, Span)>,
    /// Envoys paused (SIGSTOP, a machine too loaded to run them): what
    /// reaches them waits until they go on, and their workers then read
    /// a wall clock that moved on without them.
    pub pauses: Vec<Pause>,
    /// The admin stalled (a process the machine starves, or one waiting
    /// on its disk): from this long into the run, for so long. What
    /// reaches it (syncs, watches, closes) waits in its sockets, and its
    /// held watches are answered late; Envoys give up on their calls at
    /// their timeouts; when it goes on, its clock has moved on.
    pub admin_stalls: Vec<(Span, Span)>,
    /// The admin's ledger store (Redis) down from this long into the run
    /// for so long, then back empty (no persistence): syncs meanwhile get
    /// no shares, and every lease it knew is gone.
    pub ledger_losses: Vec<(Span, Span)>,
    /// Envoys whose syncs the admin turns away unread (503, as one past
    /// its capacity sheds them, or whose store fails them) while the
    /// others' go through.
    pub sheds: Vec<Shed>,
}

#[derive(Debug, Clone, Copy)]
pub struct Shed {
    pub envoy: usize,
    /// This long into the run.
    pub at: Span,
    /// Its syncs turned away for so long.
    pub lasting: Span,
}

#[derive(Debug, Clone, Copy)]
pub struct Pause {
    pub envoy: usize,
    /// This long into the run.
    pub at: Span,
    /// Paused for so long.
    pub lasting: Span,
}

#[derive(Debug, Clone, Copy)]
pub struct Kill {
    pub envoy: usize,
    /// This long into the run.
    pub at: Span,
    /// Down for so long, then started again.
    pub down_for: Span,
}

impl World {
    /// Envoy `kill.envoy` is killed: its callers' calls on it fail, its
    /// state is gone, the admin sees its connections close; it starts
    /// again `kill.down_for` later.
    pub(super) fn kill(&mut self, now: Instant, kill: Kill) {
        let index = kill.envoy;
        if self.envoys.get(index).is_none_or(Option::is_none) {
            return;
        }
        self.retire(index);
        self.lives[index] += 1;
        self.trace.note(now, format!("e{index} killed"));
        if let Some(network) = self.network.as_mut() {
            let carried = network.envoy_died(
                index,
                &Self::instance(index),
                now,
                &mut self.rng.borrow_mut(),
            );
            self.carried_later(carried);
        }
        for conn in 0..self.connections.len() {
            if matches!(self.connections[conn].busy, Some((e, _)) if e == index) {
                self.done(now, conn, (503, None));
            }
        }
        self.schedule(now + kill.down_for, Event::Restart { envoy: index });
    }
}
