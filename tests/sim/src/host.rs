//! The filter's [`Host`] in virtual time: one per worker, over its
//! Envoy's shared data (the native module's [`SharedMemory`], the same
//! compare-and-swap rule Envoy keeps) and the simulation's one clock.
//! Faults come from the run's seed: a shared-data write that fails.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::rc::Rc;

use sluice_filter::host::{Host, Level, SetError};
use sluice_filter::shared_memory::SharedMemory;
use sluice_shared::time::{Instant, Span};

use crate::rng::SimRng;

/// What every worker of one Envoy shares: its shared data and its stats.
#[derive(Default)]
pub struct EnvoyShared {
    pub data: SharedMemory,
    pub metrics: RefCell<BTreeMap<String, i64>>,
    metric_names: RefCell<Vec<String>>,
    /// Each write fails with this chance (a fault the seed injects).
    pub write_failure: Cell<f64>,
    /// Writes that failed by fault.
    pub failed_writes: Cell<u64>,
    /// What the workers logged at info and above, with when: the trace
    /// shows it under its second (a rate cut, a pause, a refused write).
    pub logs: RefCell<Vec<(Instant, String)>>,
    /// Calls the workers dispatched (to the admin) that the simulation
    /// has yet to carry.
    pub calls: RefCell<Vec<HttpCall>>,
    next_token: Cell<u32>,
}

/// A call a worker dispatched through an Envoy cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpCall {
    pub token: u32,
    pub worker: usize,
    pub path: String,
    pub body: Vec<u8>,
    /// Envoy answers it no later than this after it went.
    pub timeout: Span,
}

impl EnvoyShared {
    pub fn metric(&self, name: &str) -> i64 {
        self.metrics.borrow().get(name).copied().unwrap_or(0)
    }
}

/// What a stream's hook asked of its Envoy, for the simulation to carry
/// out once the hook returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostEffect {
    Reply {
        context_id: u32,
        status: u32,
        headers: Vec<(String, String)>,
    },
    SetHeader {
        context_id: u32,
        name: String,
        value: String,
    },
    RemoveHeader {
        name: String,
    },
}

/// One worker's host.
pub struct SimHost {
    clock: Rc<Cell<Instant>>,
    pub envoy: Rc<EnvoyShared>,
    rng: Rc<RefCell<SimRng>>,
    /// The tick period the worker asked for last.
    pub tick: Cell<Span>,
    pub effects: RefCell<Vec<HostEffect>>,
    /// This worker's random source (a VM's own, different per Envoy).
    random_state: Cell<u64>,
    /// Which of its Envoy's workers this is.
    worker: usize,
}

impl SimHost {
    pub fn new(
        clock: Rc<Cell<Instant>>,
        envoy: Rc<EnvoyShared>,
        rng: Rc<RefCell<SimRng>>,
        (worker, random_state): (usize, u64),
    ) -> Self {
        Self {
            clock,
            envoy,
            rng,
            tick: Cell::new(Span::from_millis(100)),
            effects: RefCell::new(Vec::new()),
            random_state: Cell::new(random_state),
            worker,
        }
    }

    pub fn take_effects(&self) -> Vec<HostEffect> {
        std::mem::take(&mut self.effects.borrow_mut())
    }
}

impl Host for SimHost {
    fn now(&self) -> Instant {
        self.clock.get()
    }

    /// Virtual time has no steps: the monotonic clock is the clock.
    fn monotonic(&self) -> Option<Instant> {
        Some(self.clock.get())
    }

    fn shared_get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        self.envoy.data.get(key)
    }

    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        let chance = self.envoy.write_failure.get();
        if chance > 0.0 && self.rng.borrow_mut().chance(chance) {
            self.envoy
                .failed_writes
                .set(self.envoy.failed_writes.get() + 1);
            return Err(SetError::Failed);
        }
        self.envoy.data.set(key, value, cas)
    }

    fn log(&self, level: Level, message: &str) {
        if level >= Level::Info {
            self.envoy
                .logs
                .borrow_mut()
                .push((self.clock.get(), format!("{level:?} {message}")));
        }
    }

    fn define_counter(&self, name: &str) -> Option<u32> {
        let mut names = self.envoy.metric_names.borrow_mut();
        let id = names.iter().position(|n| n == name).unwrap_or_else(|| {
            names.push(name.to_string());
            names.len() - 1
        });
        u32::try_from(id).ok()
    }

    fn define_gauge(&self, name: &str) -> Option<u32> {
        self.define_counter(name)
    }

    fn increment_metric(&self, id: u32, delta: i64) {
        let names = self.envoy.metric_names.borrow();
        if let Some(name) = names.get(id as usize) {
            *self
                .envoy
                .metrics
                .borrow_mut()
                .entry(name.clone())
                .or_default() += delta;
        }
    }

    fn reply(&self, context_id: u32, status: u32, headers: &[(&str, &str)], _body: &[u8]) -> bool {
        self.effects.borrow_mut().push(HostEffect::Reply {
            context_id,
            status,
            headers: headers
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect(),
        });
        true
    }

    fn remove_request_header(&self, name: &str) {
        self.effects.borrow_mut().push(HostEffect::RemoveHeader {
            name: name.to_string(),
        });
    }

    fn set_request_header(&self, context_id: u32, name: &str, value: &str) -> bool {
        self.effects.borrow_mut().push(HostEffect::SetHeader {
            context_id,
            name: name.to_string(),
            value: value.to_string(),
        });
        true
    }

    /// The simulation judges rates and waits, not access log lines.
    fn set_log_field(&self, _context_id: u32, _field: &str, _value: &str) -> bool {
        true
    }

    fn replace_request_body(&self, _old_len: usize, _body: &[u8]) -> bool {
        true
    }

    fn resume(&self, _context_id: u32) -> bool {
        // The simulation resumes the streams the tick names itself.
        true
    }

    fn set_tick_period(&self, period: Span) {
        self.tick.set(period);
    }

    fn random_bytes(&self, buf: &mut [u8]) -> bool {
        for chunk in buf.chunks_mut(8) {
            let next = crate::rng::splitmix64(self.random_state.get());
            self.random_state.set(next);
            chunk.copy_from_slice(&next.to_le_bytes()[..chunk.len()]);
        }
        true
    }

    fn dispatch_http_call(
        &self,
        _cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout: Span,
    ) -> Option<u32> {
        let token = self.envoy.next_token.get().wrapping_add(1).max(1);
        self.envoy.next_token.set(token);
        let path = headers
            .iter()
            .find(|(name, _)| *name == ":path")
            .map(|(_, value)| value.to_string())
            .unwrap_or_default();
        self.envoy.calls.borrow_mut().push(HttpCall {
            token,
            worker: self.worker,
            path,
            body: body.to_vec(),
            timeout,
        });
        Some(token)
    }
}
