//! Everything the filter asks of Envoy, behind one trait: the worker logic
//! runs against Envoy in production and against an in-memory host in tests.

use sluice_shared::time::{Instant, Span};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetError {
    /// Someone else wrote the value since we read it.
    CasMismatch,
    /// The host refused for another reason.
    Failed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Debug,
    Info,
    Warn,
    Error,
}

pub trait Host {
    /// The host's clock (the wall clock in Envoy).
    fn now(&self) -> Instant;
    /// A clock that only ever moves as real time passes, from an origin of
    /// its own (None where the host has none): tells a paused reader from
    /// a wall clock that stepped.
    fn monotonic(&self) -> Option<Instant>;
    /// The value and its CAS token; (None, None) when the key is missing.
    fn shared_get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>);
    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError>;
    fn log(&self, level: Level, message: &str);
    fn define_counter(&self, name: &str) -> Option<u32>;
    fn define_gauge(&self, name: &str) -> Option<u32>;
    fn increment_metric(&self, id: u32, delta: i64);
    /// Sends a local reply on stream `context_id` (which may be paused).
    fn reply(&self, context_id: u32, status: u32, headers: &[(&str, &str)], body: &[u8]) -> bool;
    /// Removes a header of the request now passing (its headers only);
    /// Envoy picks its route again (a route may match the header).
    fn remove_request_header(&self, name: &str);
    /// Sets a header of stream `context_id`'s request (passing now, or
    /// paused and about to resume); Envoy picks its route again. False
    /// when the stream is gone.
    fn set_request_header(&self, context_id: u32, name: &str, value: &str) -> bool;
    /// Sets field `field` of stream `context_id`'s decision, for Envoy's
    /// access log (wasm: filter state `wasm.sluice.<field>`;
    /// native: dynamic metadata `sluice`/`<field>`). Called from the
    /// stream's own hook or by a tick's action for it. False when the
    /// stream is gone or the host refused.
    fn set_log_field(&self, context_id: u32, field: &str, value: &str) -> bool;
    /// Replaces the body of the request now passing, `old_len` bytes
    /// buffered to its end, with `body`. False when the host refused.
    fn replace_request_body(&self, old_len: usize, body: &[u8]) -> bool;
    /// Lets paused stream `context_id` continue. False if it is gone.
    fn resume(&self, context_id: u32) -> bool;
    fn set_tick_period(&self, period: Span);
    /// Fills `buf` from the host's random source (WASI `random_get` in
    /// Envoy). False when there is none.
    fn random_bytes(&self, buf: &mut [u8]) -> bool;
    /// Sends an HTTP call through an Envoy cluster; the answer comes back
    /// to the root context. Returns the call's token.
    fn dispatch_http_call(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout: Span,
    ) -> Option<u32>;
}
