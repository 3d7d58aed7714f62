//! The event loop: virtual time, one queue of events ordered by time and
//! then by the order they were scheduled, so that a seed gives the same
//! run every time.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::rc::Rc;

use sluice_shared::time::{Instant, Span};

use crate::callers::{Caller, LlmCall, Shape};
use crate::envoy::{Passage, SimEnvoy};
use crate::headers::Headers;
use crate::provider::{Provider, ProviderShape};
use crate::rng::SimRng;
use crate::trace::Trace;

/// Faults a run injects.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    /// The chance each shared-data write fails.
    pub write_failure: f64,
}

/// What to simulate.
#[derive(Debug, Clone)]
pub struct Scenario {
    pub workers: usize,
    /// The policy set's JSON.
    pub policies: String,
    pub provider: ProviderShape,
    pub callers: Vec<Caller>,
    /// How long callers call; the run then lets calls in flight end.
    pub duration: Span,
    pub faults: Faults,
}

#[derive(Debug)]
enum Event {
    Send {
        conn: usize,
    },
    Answer {
        stream: u32,
        conn: usize,
        status: u32,
        headers: Headers,
        body: Vec<Vec<u8>>,
    },
    Tick {
        worker: usize,
        generation: u64,
    },
}

struct Connection {
    caller: usize,
    worker: usize,
    /// The stream it waits on.
    busy: Option<u32>,
    /// Paced: its grid's next point.
    next_at: Instant,
    /// What its call in flight asks of an LLM.
    call: Option<LlmCall>,
}

/// How a run ended.
pub struct Outcome {
    pub seed: u64,
    pub trace: Trace,
    pub provider: Provider,
    /// Streams, calls in flight and queued calls left after the drain.
    pub left_open: usize,
    pub left_in_flight: usize,
    pub left_waiting: usize,
    pub failed_writes: u64,
    /// Envoy's stats at the end, by name (`sluice.limit.<name>.<stat>`...).
    pub metrics: BTreeMap<String, i64>,
    /// When the callers began: a calendar second's phase chosen by seed.
    pub start: Instant,
}

/// The first instant: far from zero, as Envoy's wall clock is.
const EPOCH_SECS: u64 = 1_800_000_000;
/// After the callers stop, how long calls may take to end.
const DRAIN: Span = Span::from_secs(30);

pub fn run(scenario: &Scenario, seed: u64) -> Result<Outcome, String> {
    let rng = Rc::new(RefCell::new(SimRng::new(seed)));
    let phase = rng.borrow_mut().between(0, 999_999_999);
    let start = Instant::from_nanos(EPOCH_SECS * 1_000_000_000 + phase);
    let clock = Rc::new(Cell::new(start));
    let mut envoy = SimEnvoy::new(0, scenario.workers, &scenario.policies, &clock, &rng)?;
    envoy
        .shared
        .write_failure
        .set(scenario.faults.write_failure);
    let mut world = World {
        events: BTreeMap::new(),
        seq: 0,
        clock,
        rng,
        provider: Provider::new(scenario.provider.clone()),
        trace: Trace::new(start),
        connections: Vec::new(),
        callers: scenario.callers.clone(),
        stop_sending: start + scenario.duration,
    };
    world.connect(start, scenario.workers);
    for worker in 0..scenario.workers {
        let period = envoy.workers[worker].scheduled;
        let offset = Span::from_nanos(world.rng.borrow_mut().between(0, period.as_nanos()));
        world.schedule(
            start + offset,
            Event::Tick {
                worker,
                generation: 0,
            },
        );
    }
    let end = start + scenario.duration + DRAIN;
    while let Some(((at, _), event)) = world.events.pop_first() {
        let now = Instant::from_nanos(at);
        if now > end {
            break;
        }
        world.clock.set(now);
        world.handle(&mut envoy, now, event);
    }
    for (at, line) in envoy.shared.logs.take() {
        world.trace.note(at, line);
    }
    let metrics = envoy.shared.metrics.borrow().clone();
    Ok(Outcome {
        seed,
        left_open: envoy.open_streams(),
        left_in_flight: envoy.workers.iter().map(|w| w.worker.in_flight()).sum(),
        left_waiting: envoy.workers.iter().map(|w| w.worker.waiting()).sum(),
        failed_writes: envoy.shared.failed_writes.get(),
        metrics,
        trace: world.trace,
        provider: world.provider,
        start,
    })
}

struct World {
    events: BTreeMap<(u64, u64), Event>,
    seq: u64,
    clock: Rc<Cell<Instant>>,
    rng: Rc<RefCell<SimRng>>,
    provider: Provider,
    trace: Trace,
    connections: Vec<Connection>,
    callers: Vec<Caller>,
    stop_sending: Instant,
}

impl World {
    fn schedule(&mut self, at: Instant, event: Event) {
        self.seq += 1;
        self.events.insert((at.as_nanos(), self.seq), event);
    }

    /// Every caller's connections, each on a worker the seed picks (as
    /// the kernel hands connections to Envoy's workers), each starting
    /// at a point of its caller's grid.
    fn connect(&mut self, start: Instant, workers: usize) {
        for (index, caller) in self.callers.clone().iter().enumerate() {
            let first = start + Span::from_millis(self.rng.borrow_mut().between(0, 50));
            for _ in 0..caller.connections {
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

    fn handle(&mut self, envoy: &mut SimEnvoy, now: Instant, event: Event) {
        match event {
            Event::Send { conn } => self.send(envoy, now, conn),
            Event::Answer {
                stream,
                conn,
                status,
                headers,
                body,
            } => {
                envoy.answer(stream, (&headers, &body));
                self.done(now, conn, status);
            }
            Event::Tick { worker, generation } => {
                if envoy.workers[worker].tick_generation != generation {
                    return;
                }
                for (stream, passage) in envoy.tick(worker) {
                    if let Some(conn) = self.conn_of(stream) {
                        self.passed(now, conn, stream, passage);
                    }
                }
                let w = &mut envoy.workers[worker];
                w.scheduled = w.host.tick.get();
                w.tick_generation += 1;
                let (at, generation) = (now + w.scheduled, w.tick_generation);
                self.schedule(at, Event::Tick { worker, generation });
            }
        }
    }

    fn conn_of(&self, stream: u32) -> Option<usize> {
        self.connections.iter().position(|c| c.busy == Some(stream))
    }

    fn send(&mut self, envoy: &mut SimEnvoy, now: Instant, conn: usize) {
        if now >= self.stop_sending || self.connections[conn].busy.is_some() {
            return;
        }
        let (caller, worker) = (self.connections[conn].caller, self.connections[conn].worker);
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
        let (stream, passage) = envoy.request(worker, (request, body.as_deref()));
        self.connections[conn].busy = Some(stream);
        self.passed(now, conn, stream, passage);
        // A call may have changed how often the worker ticks (a queue
        // began): Envoy's timer is set again at once.
        let w = &mut envoy.workers[worker];
        if w.host.tick.get() != w.scheduled {
            w.scheduled = w.host.tick.get();
            w.tick_generation += 1;
            let (at, generation) = (now + w.scheduled, w.tick_generation);
            self.schedule(at, Event::Tick { worker, generation });
        }
    }

    /// What became of a call of `conn`'s as it passed Sluice.
    fn passed(&mut self, now: Instant, conn: usize, stream: u32, passage: Passage) {
        let tenant = self.callers[self.connections[conn].caller].tenant.clone();
        match passage {
            Passage::Upstream(request) => {
                self.trace.admitted(now, &tenant);
                let call = self.connections[conn].call;
                let answer = self
                    .provider
                    .call(now, (&request, call), &mut self.rng.borrow_mut());
                self.trace.provider(now, &tenant, answer.status);
                self.schedule(
                    now + answer.after,
                    Event::Answer {
                        stream,
                        conn,
                        status: answer.status,
                        headers: answer.headers,
                        body: answer.body,
                    },
                );
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
                self.done(now, conn, status);
            }
        }
    }

    /// `conn`'s call ended with `status`: its next call is scheduled.
    fn done(&mut self, now: Instant, conn: usize, status: u32) {
        let c = &mut self.connections[conn];
        c.busy = None;
        let next = match &self.callers[c.caller].shape {
            Shape::Greedy { backoff } => {
                if status == 200 {
                    now
                } else {
                    // Half to one and a half times its backoff: real
                    // clients' timers and networks keep connections from
                    // retrying in lockstep.
                    let nanos = backoff.as_nanos();
                    now + Span::from_nanos(self.rng.borrow_mut().between(nanos / 2, nanos * 3 / 2))
                }
            }
            Shape::Paced { every } => {
                while c.next_at <= now {
                    c.next_at += *every;
                }
                c.next_at
            }
        };
        self.schedule(next, Event::Send { conn });
    }
}
