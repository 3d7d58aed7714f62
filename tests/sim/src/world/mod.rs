//! The event loop: virtual time, one queue of events ordered by time and
//! then by the order they were scheduled, so that a seed gives the same
//! run every time.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::rc::Rc;

use sluice_shared::fleet::Amount;
use sluice_shared::time::{Instant, Span};

use sluice_filter::sync::SyncSettings;

use crate::admin::SimAdmin;
use crate::callers::{Caller, LlmCall};
use crate::envoy::SimEnvoy;
use crate::fleet::{Carried, Fleet, FleetOutcome, Message, Network, Worker};
use crate::headers::Headers;
use crate::pool::PoolRoutes;
use crate::provider::{Provider, ProviderShape};
use crate::rng::SimRng;
use crate::trace::Trace;

mod calls;
mod faults;
mod upstream;

pub use faults::{Faults, Kill, Pause, Shed};
use upstream::Attempt;

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
    /// Envoys syncing with one admin (None: one Envoy on its own).
    pub fleet: Option<Fleet>,
    /// A pool's members, each its own provider, as Envoy routes to them
    /// (None: every call goes to `provider`).
    pub pool: Option<PoolRoutes>,
}

#[derive(Debug)]
enum Event {
    Send {
        conn: usize,
    },
    Answer {
        at: (usize, u64),
        stream: u32,
        conn: usize,
        status: u32,
        headers: Headers,
        body: Vec<Vec<u8>>,
    },
    /// Envoy tries a call a pool member refused on another member
    /// (`refusal`: that member's answer, which only the attempts filter
    /// hears).
    Retry {
        at: (usize, u64),
        attempt: Attempt,
        request: Headers,
        refusal: Headers,
    },
    Tick {
        at: (usize, u64),
        worker: usize,
        generation: u64,
    },
    Network(Message),
    Holds,
    Kill(Kill),
    Pause(Pause),
    Restart {
        envoy: usize,
    },
    Admin {
        up: bool,
    },
    AdminStall {
        lasting: Span,
    },
    Ledgers {
        up: bool,
    },
}

struct Connection {
    caller: usize,
    worker: usize,
    /// The Envoy and stream it waits on.
    busy: Option<(usize, u32)>,
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
    /// Each pool member's provider, in the pool's order (pool runs).
    pub members: Vec<Provider>,
    /// Streams, calls in flight and queued calls left after the drain.
    pub left_open: usize,
    pub left_in_flight: usize,
    pub left_waiting: usize,
    pub failed_writes: u64,
    /// Envoy's stats at the end, by name (`sluice.limit.<name>.<stat>`...).
    pub metrics: BTreeMap<String, i64>,
    /// When the callers began: a calendar second's phase chosen by seed.
    pub start: Instant,
    /// What the fleet did (fleet runs).
    pub fleet: Option<FleetOutcome>,
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
    let network = match &scenario.fleet {
        Some(fleet) => {
            let mut network = Network::new(fleet.clone(), SimAdmin::new(&scenario.policies, seed)?);
            for shed in &scenario.faults.sheds {
                network.turn_away(shed.envoy, start + shed.at, start + shed.at + shed.lasting);
            }
            Some(network)
        }
        None => None,
    };
    let envoys = network.as_ref().map_or(1, |n| n.fleet.envoys.max(1));
    let mut world = World {
        events: BTreeMap::new(),
        seq: 0,
        clock,
        rng,
        provider: Provider::new(scenario.provider.clone()),
        members: scenario
            .pool
            .iter()
            .flat_map(|p| &p.members)
            .map(|m| Provider::new(m.provider.clone()))
            .collect(),
        trace: Trace::new(start),
        connections: Vec::new(),
        callers: scenario.callers.clone(),
        start,
        stop_sending: start + scenario.duration,
        envoys: (0..envoys).map(|_| None).collect(),
        lives: vec![0; envoys],
        paused_until: vec![start; envoys],
        admin_stalled_until: start,
        network,
        scenario: scenario.clone(),
        failed_writes: 0,
        metrics: BTreeMap::new(),
    };
    for envoy in 0..envoys {
        world.envoys[envoy] = Some(world.new_envoy(envoy)?);
    }
    // Connections first, then the ticks: the seeds' draws in this order.
    world.connect(start, scenario.workers);
    for envoy in 0..envoys {
        world.schedule_ticks(envoy, start);
    }
    for kill in &scenario.faults.kills {
        world.schedule(start + kill.at, Event::Kill(*kill));
    }
    for pause in &scenario.faults.pauses {
        world.schedule(start + pause.at, Event::Pause(*pause));
    }
    for (from, span) in &scenario.faults.admin_down {
        world.schedule(start + *from, Event::Admin { up: false });
        world.schedule(start + *from + *span, Event::Admin { up: true });
    }
    for (from, lasting) in &scenario.faults.admin_stalls {
        world.schedule(start + *from, Event::AdminStall { lasting: *lasting });
    }
    for (from, span) in &scenario.faults.ledger_losses {
        world.schedule(start + *from, Event::Ledgers { up: false });
        world.schedule(start + *from + *span, Event::Ledgers { up: true });
    }
    let end = start + scenario.duration + DRAIN;
    while let Some(((at, _), event)) = world.events.pop_first() {
        let now = Instant::from_nanos(at);
        if now > end {
            break;
        }
        if let Some(until) = world.paused(&event).filter(|until| *until > now) {
            if let Event::Network(message) = &event {
                if let Some((at, given_up)) = message.given_up_before(until) {
                    world.schedule(at.max(now), Event::Network(given_up));
                }
            }
            world.schedule(until, event);
            continue;
        }
        world.clock.set(now);
        world.handle(now, event);
    }
    let (mut left_open, mut left_in_flight, mut left_waiting) = (0, 0, 0);
    for envoy in world.envoys.iter().flatten() {
        left_open += envoy.open_streams();
        left_in_flight += envoy
            .workers
            .iter()
            .map(|w| w.worker.in_flight())
            .sum::<usize>();
        left_waiting += envoy
            .workers
            .iter()
            .map(|w| w.worker.waiting())
            .sum::<usize>();
    }
    for index in 0..world.envoys.len() {
        world.retire(index);
    }
    Ok(Outcome {
        seed,
        left_open,
        left_in_flight,
        left_waiting,
        failed_writes: world.failed_writes,
        metrics: world.metrics,
        trace: world.trace,
        provider: world.provider,
        members: world.members,
        start,
        fleet: world.network.map(|n| n.outcome),
    })
}

struct World {
    events: BTreeMap<(u64, u64), Event>,
    seq: u64,
    clock: Rc<Cell<Instant>>,
    rng: Rc<RefCell<SimRng>>,
    provider: Provider,
    members: Vec<Provider>,
    trace: Trace,
    connections: Vec<Connection>,
    callers: Vec<Caller>,
    start: Instant,
    stop_sending: Instant,
    /// Each Envoy, None while it is down.
    envoys: Vec<Option<SimEnvoy>>,
    /// Each Envoy's life: bumped when it dies, so that what was meant for
    /// the dead process is dropped.
    lives: Vec<u64>,
    /// Each Envoy runs again from this instant on (a pause).
    paused_until: Vec<Instant>,
    /// The admin runs again from this instant on (a stall).
    admin_stalled_until: Instant,
    network: Option<Network>,
    scenario: Scenario,
    /// Summed over the Envoys' lives.
    failed_writes: u64,
    metrics: BTreeMap<String, i64>,
}

impl World {
    fn schedule(&mut self, at: Instant, event: Event) {
        self.seq += 1;
        self.events.insert((at.as_nanos(), self.seq), event);
    }

    /// Until when the Envoy `event` reaches is paused (None: it reaches
    /// none): a caller's call waits for its Envoy, as the kernel holds
    /// the connection, and so do answers, ticks and the admin's replies.
    /// What reaches the admin waits likewise while it stalls.
    fn paused(&self, event: &Event) -> Option<Instant> {
        let envoy = match event {
            Event::Network(Message::ToAdmin { .. } | Message::Closed { .. }) | Event::Holds => {
                return Some(self.admin_stalled_until);
            }
            Event::Send { conn } => {
                let caller = self.connections.get(*conn)?.caller;
                self.callers.get(caller)?.envoy
            }
            Event::Answer { at, .. } | Event::Retry { at, .. } | Event::Tick { at, .. } => at.0,
            Event::Network(Message::ToEnvoy { to, .. }) => to.envoy,
            _ => return None,
        };
        self.paused_until
            .get(envoy.min(self.envoys.len().saturating_sub(1)))
            .copied()
    }

    fn instance(envoy: usize) -> String {
        format!("sim-envoy-{envoy}")
    }

    /// Envoy `index` starts (again): fresh workers over fresh shared data,
    /// each ticking from a point the seed picks.
    fn start_envoy(&mut self, index: usize, now: Instant) -> Result<(), String> {
        self.envoys[index] = Some(self.new_envoy(index)?);
        self.schedule_ticks(index, now);
        Ok(())
    }

    fn new_envoy(&self, index: usize) -> Result<SimEnvoy, String> {
        let sync = self.network.as_ref().map(|n| SyncSettings {
            instance: Self::instance(index),
            cluster: "sluice_admin".to_string(),
            authority: "admin.sim".to_string(),
            interval: n.fleet.interval,
            token: None,
            push: n.fleet.push,
        });
        let scenario = &self.scenario;
        let mut envoy = SimEnvoy::new(
            (index, scenario.workers),
            &scenario.policies,
            sync.as_ref(),
            &self.clock,
            &self.rng,
        )?;
        if scenario.pool.as_ref().is_some_and(|p| p.attempts_heard) {
            envoy.hear_attempts(
                index,
                &scenario.policies,
                sync.as_ref(),
                (&self.clock, &self.rng),
            )?;
        }
        envoy
            .shared
            .write_failure
            .set(scenario.faults.write_failure);
        Ok(envoy)
    }

    /// Each of Envoy `index`'s workers ticks from a point the seed picks.
    fn schedule_ticks(&mut self, index: usize, now: Instant) {
        let life = self.lives[index];
        for worker in 0..self.scenario.workers {
            let Some(period) = self.envoys[index]
                .as_ref()
                .map(|e| e.workers[worker].scheduled)
            else {
                return;
            };
            let offset = Span::from_nanos(self.rng.borrow_mut().between(0, period.as_nanos()));
            self.schedule(
                now + offset,
                Event::Tick {
                    at: (index, life),
                    worker,
                    generation: 0,
                },
            );
        }
    }

    /// Envoy `index`'s process ends: what it logged and counted is kept.
    fn retire(&mut self, index: usize) {
        let Some(envoy) = self.envoys[index].take() else {
            return;
        };
        for (at, line) in envoy.shared.logs.take() {
            let line = if self.envoys.len() > 1 {
                format!("e{index} {line}")
            } else {
                line
            };
            self.trace.note(at, line);
        }
        self.failed_writes += envoy.shared.failed_writes.get();
        for (name, value) in envoy.shared.metrics.borrow().iter() {
            *self.metrics.entry(name.clone()).or_default() += value;
        }
    }

    fn handle(&mut self, now: Instant, event: Event) {
        match event {
            Event::Send { conn } => self.send(now, conn),
            Event::Answer {
                at,
                stream,
                conn,
                status,
                headers,
                body,
            } => {
                if self.lives[at.0] != at.1 {
                    return;
                }
                if let Some(envoy) = self.envoys[at.0].as_mut() {
                    let headers = envoy.attempt_answered(stream, headers.clone());
                    envoy.answer(stream, (&headers, &body));
                }
                self.carry_calls(at.0, now);
                self.done(now, conn, (status, headers.retry_after()));
            }
            Event::Retry {
                at,
                attempt,
                request,
                refusal,
            } => {
                if self.lives[at.0] == at.1 {
                    if let Some(envoy) = self.envoys[at.0].as_mut() {
                        envoy.attempt_answered(attempt.stream, refusal);
                    }
                    self.upstream(now, attempt, request);
                }
            }
            Event::Tick {
                at,
                worker,
                generation,
            } => self.tick(now, at, (worker, generation)),
            Event::Network(message) => self.deliver(now, message),
            Event::Holds => {
                if let Some(network) = self.network.as_mut() {
                    let carried = network.end_holds(now, &mut self.rng.borrow_mut());
                    self.carried(now, carried);
                }
            }
            Event::Kill(kill) => self.kill(now, kill),
            Event::Pause(pause) => {
                if let Some(until) = self.paused_until.get_mut(pause.envoy) {
                    *until = (*until).max(now + pause.lasting);
                    self.trace.note(
                        now,
                        format!("e{} paused for {:?}", pause.envoy, pause.lasting),
                    );
                }
            }
            Event::AdminStall { lasting } => {
                self.admin_stalled_until = self.admin_stalled_until.max(now + lasting);
                self.trace
                    .note(now, format!("admin stalled for {lasting:?}"));
            }
            Event::Restart { envoy } => {
                if let Err(e) = self.start_envoy(envoy, now) {
                    self.trace.note(now, format!("e{envoy} did not start: {e}"));
                }
                self.trace.note(now, format!("e{envoy} started again"));
            }
            Event::Admin { up } => {
                if let Some(network) = self.network.as_mut() {
                    let carried = network.set_admin_up(up, now);
                    self.carried(now, carried);
                }
            }
            Event::Ledgers { up } => {
                if let Some(network) = self.network.as_mut() {
                    let carried = network.set_ledgers_up(up);
                    self.carried(now, carried);
                }
            }
        }
    }

    fn tick(
        &mut self,
        now: Instant,
        (envoy, life): (usize, u64),
        (worker, generation): (usize, u64),
    ) {
        if self.lives[envoy] != life {
            return;
        }
        let Some(e) = self.envoys[envoy].as_mut() else {
            return;
        };
        if e.workers[worker].tick_generation != generation {
            return;
        }
        let passed = e.tick(worker);
        e.workers[worker].ticked_at = Some(now);
        self.note_in_force(now);
        for (stream, passage) in passed {
            if let Some(conn) = self.conn_of(envoy, stream) {
                self.passed(now, (envoy, conn), stream, passage);
            }
        }
        self.tick_again(envoy, worker, now);
        self.carry_calls(envoy, now);
    }

    /// What the Envoys running now enforce of each global policy, added
    /// up: each Envoy's workers apply the shares it holds alike, at their
    /// ticks; a paused Envoy admits nothing, and each of its workers
    /// applies its shares again at its first tick when it goes on (the
    /// share that lapsed meanwhile gives nothing: `lapsed_asleep`).
    fn note_in_force(&mut self, now: Instant) {
        let Some(network) = self.network.as_mut() else {
            return;
        };
        let mut in_force: BTreeMap<String, Amount> = BTreeMap::new();
        for (index, envoy) in self.envoys.iter().enumerate() {
            let Some(envoy) = envoy.as_ref().filter(|_| self.paused_until[index] <= now) else {
                continue;
            };
            let mut most: BTreeMap<&String, Amount> = BTreeMap::new();
            let went_on = self.paused_until[index];
            for w in envoy
                .workers
                .iter()
                .filter(|w| w.ticked_at >= Some(went_on))
            {
                for (name, amount) in w.worker.shares_in_force() {
                    let m = most.entry(name).or_default();
                    *m = m.max(*amount);
                }
            }
            for (name, amount) in most {
                let sum = in_force.entry(name.clone()).or_default();
                *sum = sum.plus(amount);
            }
        }
        network.in_force(now, &in_force);
    }

    /// A call of Envoy `envoy`'s workers' to the admin goes out.
    fn carry_calls(&mut self, envoy: usize, now: Instant) {
        let Some(e) = self.envoys[envoy].as_ref() else {
            return;
        };
        let calls = e.take_calls();
        let life = self.lives[envoy];
        for call in calls {
            let Some(network) = self.network.as_mut() else {
                return;
            };
            let from = Worker {
                envoy,
                life,
                worker: call.worker,
            };
            let carried = network.dispatch(from, call, now, &mut self.rng.borrow_mut());
            self.carried_later(carried);
        }
    }

    fn carried(&mut self, now: Instant, carried: Carried) {
        for line in &carried.notes {
            self.trace.note(now, line.clone());
        }
        self.carried_later(carried);
    }

    fn carried_later(&mut self, carried: Carried) {
        for (at, message) in carried.later {
            self.schedule(at, Event::Network(message));
        }
        if let Some(at) = carried.hold_ends {
            self.schedule(at, Event::Holds);
        }
    }

    fn deliver(&mut self, now: Instant, message: Message) {
        let Some(network) = self.network.as_mut() else {
            return;
        };
        match message {
            Message::Closed { instance } => network.closed(&instance, now),
            Message::ToAdmin { from, call, sent } => {
                let carried = network.at_admin((from, call, sent), now, &mut self.rng.borrow_mut());
                self.carried(now, carried);
            }
            Message::ToEnvoy {
                to,
                token,
                answer,
                shares,
            } => {
                if self.lives[to.envoy] != to.life {
                    return;
                }
                let Some(envoy) = self.envoys[to.envoy].as_mut() else {
                    return;
                };
                envoy.sync_reply(to.worker, token, answer.as_ref());
                if let Some(shares) = shares.filter(|_| answer.is_some()) {
                    for line in network.took(to, shares, now) {
                        self.trace.note(now, line);
                    }
                }
                self.retick(to.envoy, to.worker, now);
                self.carry_calls(to.envoy, now);
            }
        }
    }

    /// A hook may have changed how often the worker ticks (a queue
    /// began): Envoy's timer is set again at once.
    fn retick(&mut self, envoy: usize, worker: usize, now: Instant) {
        let Some(e) = self.envoys[envoy].as_mut() else {
            return;
        };
        let w = &e.workers[worker];
        if w.host.tick.get() != w.scheduled {
            self.tick_again(envoy, worker, now);
        }
    }

    /// Worker `worker`'s next tick, at the period it asked for last; any
    /// tick scheduled before is stale.
    fn tick_again(&mut self, envoy: usize, worker: usize, now: Instant) {
        let Some(e) = self.envoys[envoy].as_mut() else {
            return;
        };
        let w = &mut e.workers[worker];
        w.scheduled = w.host.tick.get();
        w.tick_generation += 1;
        let (at, generation) = (now + w.scheduled, w.tick_generation);
        let life = self.lives[envoy];
        self.schedule(
            at,
            Event::Tick {
                at: (envoy, life),
                worker,
                generation,
            },
        );
    }
}
