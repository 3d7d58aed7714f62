//! The callers' side of the world: connections sending calls on their
//! shape's schedule to their Envoy (or, while it is down, another), what
//! became of each as it passed Sluice, and when each connection calls
//! next.

use sluice_shared::time::{Instant, Span};

use super::{Attempt, Connection, Event, World};
use crate::callers::{LlmCall, RetryAfter, Shape};
use crate::envoy::Passage;
use crate::headers::Headers;

impl World {
    /// Every caller's connections, each on its Envoy's worker the seed
    /// picks (as the kernel hands connections to Envoy's workers), each
    /// starting at a point of its caller's grid.
    pub(super) fn connect(&mut self, start: Instant, workers: usize) {
        for (index, caller) in self.callers.clone().iter().enumerate() {
            let first = start + Span::from_millis(self.rng.borrow_mut().between(0, 50));
            for at in 0..caller.connections {
                let first = match caller.shape {
                    Shape::Steady { every } => {
                        first
                            + Span::from_nanos(
                                every.as_nanos() / caller.connections as u64 * at as u64,
                            )
                    }
                    _ => first,
                };
                let worker = self.rng.borrow_mut().index(workers);
                let conn = self.connections.len();
                self.connections.push(Connection {
                    caller: index,
                    worker,
                    busy: None,
                    next_at: first,
                    call: None,
                });
                self.schedule(first, Event::Send { conn });
            }
        }
    }

    pub(super) fn conn_of(&self, envoy: usize, stream: u32) -> Option<usize> {
        self.connections
            .iter()
            .position(|c| c.busy == Some((envoy, stream)))
    }

    /// Whether caller `caller` calls at `now`, else when it next does.
    pub(super) fn calling(&self, caller: usize, now: Instant) -> Result<(), Option<Instant>> {
        let active = &self.callers[caller].active;
        if active.is_empty() {
            return Ok(());
        }
        let mut next = None::<Instant>;
        for (from, span) in active {
            let (from, until) = (self.start + *from, self.start + *from + *span);
            if from <= now && now < until {
                return Ok(());
            }
            if from > now {
                next = Some(next.map_or(from, |n| n.min(from)));
            }
        }
        Err(next)
    }

    pub(super) fn send(&mut self, now: Instant, conn: usize) {
        if now >= self.stop_sending || self.connections[conn].busy.is_some() {
            return;
        }
        let caller = self.connections[conn].caller;
        if let Err(next) = self.calling(caller, now) {
            if let Some(next) = next {
                // On its own grid (paced and steady connections keep their
                // place in it), from when the caller calls again.
                let c = &mut self.connections[conn];
                match self.callers[caller].shape {
                    Shape::Paced { every } | Shape::Steady { every } if !every.is_zero() => {
                        while c.next_at < next {
                            c.next_at += every;
                        }
                    }
                    _ => c.next_at = next,
                }
                let at = c.next_at;
                self.schedule(at, Event::Send { conn });
            }
            return;
        }
        // Its Envoy, or while that one is down another the balancer in
        // front picks; with none up, the call fails.
        let home = self.callers[caller].envoy.min(self.envoys.len() - 1);
        let (envoy, worker) = if self.envoys[home].is_some() {
            (home, self.connections[conn].worker)
        } else {
            let up: Vec<usize> = (0..self.envoys.len())
                .filter(|e| self.envoys[*e].is_some())
                .collect();
            if up.is_empty() {
                self.trace.sent(now, &self.callers[caller].tenant.clone());
                self.trace
                    .refused(now, &self.callers[caller].tenant.clone(), "no envoy");
                self.done(now, conn, (503, None));
                return;
            }
            let mut rng = self.rng.borrow_mut();
            (up[rng.index(up.len())], rng.index(self.scenario.workers))
        };
        let c = &self.callers[caller];
        let request = Headers::of(&[
            (":authority", &c.host),
            (":path", "/"),
            (":method", "GET"),
            ("x-tenant", &c.tenant),
        ]);
        self.trace.sent(now, &c.tenant);
        let llm = c.llm.clone();
        let call = llm.as_ref().map(|l| {
            let mut rng = self.rng.borrow_mut();
            LlmCall {
                prompt: rng.between(l.prompt.0, l.prompt.1),
                output: rng.between(l.output.0, l.output.1),
                stream: rng.chance(l.streamed),
            }
        });
        let body = llm.zip(call).map(|(l, call)| l.body(call));
        self.connections[conn].call = call;
        let Some(e) = self.envoys[envoy].as_mut() else {
            return;
        };
        let (stream, passage) = e.request(worker, (request, body.as_deref()));
        self.connections[conn].busy = Some((envoy, stream));
        self.passed(now, (envoy, conn), stream, passage);
        self.retick(envoy, worker, now);
        self.carry_calls(envoy, now);
    }

    /// What became of a call of `conn`'s as it passed Sluice in `envoy`.
    pub(super) fn passed(
        &mut self,
        now: Instant,
        (envoy, conn): (usize, usize),
        stream: u32,
        passage: Passage,
    ) {
        let tenant = self.callers[self.connections[conn].caller].tenant.clone();
        match passage {
            Passage::Upstream(request) => {
                self.trace.admitted(now, &tenant);
                let attempt = Attempt {
                    envoy,
                    conn,
                    stream,
                    refused_by: None,
                };
                self.upstream(now, attempt, request);
            }
            Passage::Queued => self.trace.queued(now, &tenant),
            Passage::Refused(status, headers) => {
                let mut by = headers
                    .text("x-sluice-limit")
                    .or_else(|| headers.text("x-sluice-policy"))
                    .unwrap_or_default();
                if let Some(reason) = headers.text("x-sluice-reason") {
                    by = format!("{by}/{reason}");
                }
                self.trace.refused(now, &tenant, &by);
                self.done(now, conn, (status, headers.retry_after()));
            }
        }
    }

    /// `conn`'s call ended with `status` (and the `Retry-After` its
    /// answer had): its next call is scheduled.
    pub(super) fn done(
        &mut self,
        now: Instant,
        conn: usize,
        (status, retry_after): (u32, Option<Span>),
    ) {
        let c = &mut self.connections[conn];
        c.busy = None;
        let next = match &self.callers[c.caller].shape {
            Shape::Greedy { backoff, heeds } => {
                let nanos = backoff.as_nanos();
                let mut rng = self.rng.borrow_mut();
                match (status, heeds, retry_after) {
                    (200, ..) => now,
                    // The SDKs wait what it says, if under a minute; the
                    // half backoff more is their network's and timers'
                    // spread.
                    (_, RetryAfter::Heeded, Some(wait)) if wait <= Span::from_secs(60) => {
                        now + wait + Span::from_nanos(rng.between(0, nanos / 2))
                    }
                    // Half to one and a half times its backoff: real
                    // clients' timers and networks keep connections from
                    // retrying in lockstep.
                    _ => now + Span::from_nanos(rng.between(nanos / 2, nanos * 3 / 2)),
                }
            }
            Shape::Paced { every } | Shape::Steady { every } => {
                while c.next_at <= now {
                    c.next_at += *every;
                }
                c.next_at
            }
        };
        self.schedule(next, Event::Send { conn });
    }
}
