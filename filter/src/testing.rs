//! An in-memory host with Envoy's shared-data semantics, for unit tests:
//! a missing key is inserted whatever CAS token is passed, a token of 0
//! overwrites unconditionally, and any other token must match the entry's.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;

use sluice_shared::time::{Instant, Span};

use crate::host::{Host, Level, SetError};

/// An HTTP call the filter sent: (cluster, headers, body).
pub type SentCall = (String, Vec<(String, String)>, Vec<u8>);

type Hook = Box<dyn FnOnce(&mut HashMap<String, (Vec<u8>, u32)>, &mut u32)>;

#[derive(Default)]
pub struct FakeHost {
    /// The wall clock: setting it alone is a step of the wall clock.
    pub now: Cell<Instant>,
    /// The monotonic clock ([`FakeHost::advance_ms`] moves both).
    pub monotonic: Cell<Instant>,
    pub shared: RefCell<HashMap<String, (Vec<u8>, u32)>>,
    next_cas: Cell<u32>,
    pub metrics: RefCell<HashMap<String, i64>>,
    metric_names: RefCell<Vec<String>>,
    pub replies: RefCell<Vec<(u32, u32)>>,
    pub resumed: RefCell<Vec<u32>>,
    pub gone: RefCell<Vec<u32>>,
    pub logs: RefCell<Vec<String>>,
    /// Runs just before the next write: another worker's interleaved write.
    pub before_next_set: RefCell<Option<Hook>>,
    /// Every write fails with a CAS mismatch (endless contention).
    pub always_mismatch: Cell<bool>,
    pub tick: Cell<Span>,
    /// HTTP calls sent: (cluster, headers, body).
    pub calls: RefCell<Vec<SentCall>>,
    /// Where the random source is: hosts with different values give
    /// different bytes (two Envoy processes).
    pub random_state: Cell<u64>,
    /// The host has no random source.
    pub random_fails: Cell<bool>,
    /// Host calls made, by the name of the call: in Envoy each crosses
    /// out of the VM, and most call back into it, far dearer than the
    /// filter's own work.
    pub host_calls: RefCell<HashMap<&'static str, u64>>,
    /// Request headers removed, in order.
    pub removed_headers: RefCell<Vec<String>>,
    /// Request headers set: (stream, name, value).
    pub set_headers: RefCell<Vec<(u32, String, String)>>,
    /// Decision fields set for the access log: (stream, field) to value.
    pub log_fields: RefCell<HashMap<(u32, String), String>>,
    /// Request bodies replaced: (the length replaced, the new body).
    pub replaced_bodies: RefCell<Vec<(usize, Vec<u8>)>>,
}

impl FakeHost {
    pub fn at(now: Instant) -> Self {
        let h = Self::default();
        h.now.set(now);
        h.monotonic.set(now);
        h.next_cas.set(1);
        h
    }

    /// Real time passes: the wall clock and the monotonic one move.
    pub fn advance_ms(&self, ms: u64) {
        self.now.set(self.now.get() + Span::from_millis(ms));
        self.monotonic
            .set(self.monotonic.get() + Span::from_millis(ms));
    }

    fn count(&self, call: &'static str) {
        *self.host_calls.borrow_mut().entry(call).or_default() += 1;
    }

    /// Host calls of every kind made so far.
    pub fn host_calls_made(&self) -> u64 {
        self.host_calls.borrow().values().sum()
    }

    /// Host calls of one kind made so far.
    pub fn host_calls_of(&self, call: &str) -> u64 {
        self.host_calls.borrow().get(call).copied().unwrap_or(0)
    }

    /// The decision field `field` set on stream `context_id`, if any.
    pub fn log_field(&self, context_id: u32, field: &str) -> Option<String> {
        self.log_fields
            .borrow()
            .get(&(context_id, field.to_string()))
            .cloned()
    }

    pub fn metric(&self, name: &str) -> i64 {
        self.metrics.borrow().get(name).copied().unwrap_or(0)
    }
}

impl Host for FakeHost {
    fn now(&self) -> Instant {
        self.count("now");
        self.now.get()
    }

    fn monotonic(&self) -> Option<Instant> {
        self.count("monotonic");
        Some(self.monotonic.get())
    }

    fn shared_get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        self.count("shared_get");
        match self.shared.borrow().get(key) {
            Some((v, cas)) => (Some(v.clone()), Some(*cas)),
            None => (None, None),
        }
    }

    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        self.count("shared_set");
        let mut map = self.shared.borrow_mut();
        let mut counter = self.next_cas.get().max(1);
        if let Some(hook) = self.before_next_set.borrow_mut().take() {
            hook(&mut map, &mut counter);
        }
        if self.always_mismatch.get() {
            return Err(SetError::CasMismatch);
        }
        crate::shared_memory::apply_set(&mut map, key, value, cas, counter)?;
        self.next_cas.set(counter + 1);
        Ok(())
    }

    fn log(&self, level: Level, message: &str) {
        self.count("log");
        self.logs.borrow_mut().push(format!("{level:?} {message}"));
    }

    fn define_counter(&self, name: &str) -> Option<u32> {
        self.count("define_counter");
        let mut names = self.metric_names.borrow_mut();
        let id = names.iter().position(|n| n == name).unwrap_or_else(|| {
            names.push(name.to_string());
            names.len() - 1
        });
        Some(id as u32)
    }

    fn define_gauge(&self, name: &str) -> Option<u32> {
        self.count("define_gauge");
        self.define_counter(name)
    }

    fn increment_metric(&self, id: u32, delta: i64) {
        self.count("increment_metric");
        if let Some(name) = self.metric_names.borrow().get(id as usize) {
            *self.metrics.borrow_mut().entry(name.clone()).or_default() += delta;
        }
    }

    fn reply(&self, context_id: u32, status: u32, _headers: &[(&str, &str)], _body: &[u8]) -> bool {
        self.count("reply");
        self.replies.borrow_mut().push((context_id, status));
        true
    }

    fn remove_request_header(&self, name: &str) {
        self.count("remove_request_header");
        self.removed_headers.borrow_mut().push(name.to_string());
    }

    fn set_request_header(&self, context_id: u32, name: &str, value: &str) -> bool {
        self.count("set_request_header");
        if self.gone.borrow().contains(&context_id) {
            return false;
        }
        self.set_headers
            .borrow_mut()
            .push((context_id, name.to_string(), value.to_string()));
        true
    }

    fn set_log_field(&self, context_id: u32, field: &str, value: &str) -> bool {
        self.count("set_log_field");
        if self.gone.borrow().contains(&context_id) {
            return false;
        }
        self.log_fields
            .borrow_mut()
            .insert((context_id, field.to_string()), value.to_string());
        true
    }

    fn replace_request_body(&self, old_len: usize, body: &[u8]) -> bool {
        self.count("replace_request_body");
        self.replaced_bodies
            .borrow_mut()
            .push((old_len, body.to_vec()));
        true
    }

    fn resume(&self, context_id: u32) -> bool {
        self.count("resume");
        if self.gone.borrow().contains(&context_id) {
            return false;
        }
        self.resumed.borrow_mut().push(context_id);
        true
    }

    fn set_tick_period(&self, period: Span) {
        self.count("set_tick_period");
        self.tick.set(period);
    }

    fn random_bytes(&self, buf: &mut [u8]) -> bool {
        self.count("random_bytes");
        if self.random_fails.get() {
            return false;
        }
        // splitmix64: distinct, well-spread bytes; secrecy is not tested here.
        for chunk in buf.chunks_mut(8) {
            let state = self.random_state.get().wrapping_add(0x9e37_79b9_7f4a_7c15);
            self.random_state.set(state);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            chunk.copy_from_slice(&z.to_le_bytes()[..chunk.len()]);
        }
        true
    }

    fn dispatch_http_call(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        _timeout: Span,
    ) -> Option<u32> {
        self.count("dispatch_http_call");
        let mut calls = self.calls.borrow_mut();
        calls.push((
            cluster.to_string(),
            headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            body.to_vec(),
        ));
        Some(calls.len() as u32)
    }
}
