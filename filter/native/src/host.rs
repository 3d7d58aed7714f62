//! The filter's [`Host`] seam for the native module: shared data in
//! process memory, Envoy's dynamic-module callbacks for the rest.

use std::sync::atomic::Ordering;
use std::time::SystemTime;

use sluice_filter::host::{Host, Level, SetError};
use sluice_shared::time::{Instant, Span};

use crate::abi::{self, EnvoyPtr, ModuleBuffer, ModuleHeader};
use crate::module::{now_ns, Module, Posted, Slot, MEMORY, MIN_TICK_NS};

/// The monotonic clock's origin: its first reading in this process.
static MONOTONIC_ORIGIN: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();

pub struct NativeHost<'a> {
    module: &'a Module,
    /// The worker being served (None: one being made).
    slot: Option<&'a Slot>,
    /// The stream whose hook is running, on its own thread (None: a tick,
    /// on the main thread).
    current: Option<(u32, EnvoyPtr)>,
}

impl<'a> NativeHost<'a> {
    pub fn detached(module: &'a Module) -> Self {
        Self {
            module,
            slot: None,
            current: None,
        }
    }

    pub fn ticking(module: &'a Module, slot: &'a Slot) -> Self {
        Self {
            module,
            slot: Some(slot),
            current: None,
        }
    }

    pub fn streaming(
        module: &'a Module,
        slot: &'a Slot,
        context_id: u32,
        filter: EnvoyPtr,
    ) -> Self {
        Self {
            module,
            slot: Some(slot),
            current: Some((context_id, filter)),
        }
    }

    /// The filter of stream `context_id` when its own hook is running.
    fn own(&self, context_id: u32) -> Option<EnvoyPtr> {
        self.current
            .filter(|(ctx, _)| *ctx == context_id)
            .map(|(_, filter)| filter)
    }
}

/// Logs through Envoy's dynamic-module logger.
pub fn log(level: Level, message: &str) {
    let level = match level {
        Level::Debug => abi::LOG_DEBUG,
        Level::Info => abi::LOG_INFO,
        Level::Warn => abi::LOG_WARN,
        Level::Error => abi::LOG_ERROR,
    };
    // SAFETY: the message lives through the call.
    unsafe { abi::envoy_dynamic_module_callback_log(level, ModuleBuffer::of(message.as_bytes())) };
}

/// Sends a local reply on `filter`'s stream.
///
/// # Safety
/// `filter` must be Envoy's, in one of its stream's hooks.
pub unsafe fn send_reply(filter: EnvoyPtr, status: u32, headers: &[(&str, &str)], body: &[u8]) {
    let headers: Vec<ModuleHeader> = headers
        .iter()
        .map(|(k, v)| ModuleHeader {
            key: ModuleBuffer::of(k.as_bytes()),
            value: ModuleBuffer::of(v.as_bytes()),
        })
        .collect();
    // SAFETY: the caller's promise; every buffer lives through the call.
    unsafe {
        abi::envoy_dynamic_module_callback_http_send_response(
            filter,
            status,
            headers.as_ptr(),
            headers.len(),
            ModuleBuffer::of(body),
            ModuleBuffer::of(b"sluice"),
        );
    }
}

/// Sets (None: removes) a header of `filter`'s request that Envoy may
/// route by, and has Envoy pick the route again (a pool's member; a
/// caller's own value removed), as proxy-wasm does on every change of
/// the request's headers.
///
/// # Safety
/// As [`send_reply`].
pub unsafe fn set_route_header(filter: EnvoyPtr, name: &str, value: Option<&[u8]>) -> bool {
    // SAFETY: the caller's promise.
    unsafe {
        let set = set_header(filter, abi::REQUEST_HEADER, name, value);
        abi::envoy_dynamic_module_callback_http_clear_route_cache(filter);
        set
    }
}

/// The dynamic metadata namespace of a call's decision fields:
/// `%DYNAMIC_METADATA(sluice:<field>)%`.
pub const LOG_NAMESPACE: &str = "sluice";

/// Sets decision field `field` of the stream.
///
/// # Safety
/// `filter` is a stream whose own hook is running.
pub unsafe fn set_log_field(filter: EnvoyPtr, field: &str, value: &str) {
    // SAFETY: the caller's promise.
    unsafe {
        abi::envoy_dynamic_module_callback_http_set_dynamic_metadata_string(
            filter,
            ModuleBuffer::of(LOG_NAMESPACE.as_bytes()),
            ModuleBuffer::of(field.as_bytes()),
            ModuleBuffer::of(value.as_bytes()),
        );
    }
}

/// Sets (or, with None, removes) a header of `filter`'s request or answer.
///
/// # Safety
/// As [`send_reply`].
pub unsafe fn set_header(
    filter: EnvoyPtr,
    header_type: u32,
    name: &str,
    value: Option<&[u8]>,
) -> bool {
    let value = value.map_or(ModuleBuffer::NONE, ModuleBuffer::of);
    // SAFETY: the caller's promise.
    unsafe {
        abi::envoy_dynamic_module_callback_http_set_header(
            filter,
            header_type,
            ModuleBuffer::of(name.as_bytes()),
            value,
        )
    }
}

impl Host for NativeHost<'_> {
    fn now(&self) -> Instant {
        Instant::from_system(SystemTime::now())
    }

    fn monotonic(&self) -> Option<Instant> {
        let origin = MONOTONIC_ORIGIN.get_or_init(std::time::Instant::now);
        let elapsed = u64::try_from(origin.elapsed().as_nanos()).unwrap_or(u64::MAX);
        Some(Instant::from_nanos(elapsed))
    }

    fn shared_get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        MEMORY.get(key)
    }

    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        MEMORY.set(key, value, cas)
    }

    fn log(&self, level: Level, message: &str) {
        log(level, message);
    }

    fn define_counter(&self, name: &str) -> Option<u32> {
        let id = self.module.stats.define(name, false)?;
        // SAFETY: the configuration lives as long as its module.
        unsafe { self.module.stats.show(self.module.config(), id) };
        Some(id)
    }

    fn define_gauge(&self, name: &str) -> Option<u32> {
        let id = self.module.stats.define(name, true)?;
        // SAFETY: as above.
        unsafe { self.module.stats.show(self.module.config(), id) };
        Some(id)
    }

    fn increment_metric(&self, id: u32, delta: i64) {
        // SAFETY: the configuration lives as long as its module.
        unsafe { self.module.stats.add(self.module.config(), id, delta) };
    }

    fn reply(&self, context_id: u32, status: u32, headers: &[(&str, &str)], body: &[u8]) -> bool {
        if let Some(filter) = self.own(context_id) {
            // SAFETY: the stream's own hook is running.
            unsafe { send_reply(filter, status, headers, body) };
            return true;
        }
        self.module.post_to(
            context_id,
            Posted::Reply {
                status,
                headers: headers
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                body: body.to_vec(),
            },
        )
    }

    fn remove_request_header(&self, name: &str) {
        if let Some((_, filter)) = self.current {
            // SAFETY: the stream's own hook is running.
            unsafe { set_route_header(filter, name, None) };
        }
    }

    fn set_log_field(&self, context_id: u32, field: &str, value: &str) -> bool {
        if let Some(filter) = self.own(context_id) {
            // SAFETY: the stream's own hook is running.
            unsafe { set_log_field(filter, field, value) };
            return true;
        }
        // The worker hands other streams' fields over as tick actions; a
        // field for a stream not running now is posted to it all the same.
        let Some(field) = sluice_filter::worker::LogField::ALL
            .into_iter()
            .map(|f| f.name())
            .find(|name| *name == field)
        else {
            return false;
        };
        self.module
            .post_to(context_id, Posted::LogField(field, value.to_string()))
    }

    fn set_request_header(&self, context_id: u32, name: &str, value: &str) -> bool {
        if let Some(filter) = self.own(context_id) {
            // SAFETY: the stream's own hook is running.
            return unsafe { set_route_header(filter, name, Some(value.as_bytes())) };
        }
        self.module.post_to(
            context_id,
            Posted::SetHeader(name.to_string(), value.to_string()),
        )
    }

    fn replace_request_body(&self, _old_len: usize, body: &[u8]) -> bool {
        let Some((_, filter)) = self.current else {
            return false;
        };
        // SAFETY: the stream's own hook is running; the body is read to its
        // end, part buffered and the last part received: both go.
        unsafe {
            for body_type in [abi::BUFFERED_REQUEST_BODY, abi::RECEIVED_REQUEST_BODY] {
                let size = abi::envoy_dynamic_module_callback_http_get_body_size(filter, body_type);
                if size > 0 {
                    abi::envoy_dynamic_module_callback_http_drain_body(filter, body_type, size);
                }
            }
            abi::envoy_dynamic_module_callback_http_append_body(
                filter,
                abi::RECEIVED_REQUEST_BODY,
                ModuleBuffer::of(body),
            )
        }
    }

    fn resume(&self, context_id: u32) -> bool {
        self.module.post_to(context_id, Posted::Resume)
    }

    fn set_tick_period(&self, period: Span) {
        if let Some(slot) = self.slot {
            let period = u64::try_from(period.as_duration().as_nanos()).unwrap_or(u64::MAX);
            slot.period_ns.store(period, Ordering::Release);
            // As proxy-wasm's: the next tick is a period from now.
            let due = now_ns().saturating_add(period.max(MIN_TICK_NS));
            slot.due_ns.store(due, Ordering::Release);
            self.module.wake_ticker();
        }
    }

    fn random_bytes(&self, buf: &mut [u8]) -> bool {
        getrandom::fill(buf).is_ok()
    }

    fn dispatch_http_call(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout: Span,
    ) -> Option<u32> {
        // Only ticks call out, on the main thread, where the
        // configuration's callouts may be made.
        if self.current.is_some() {
            return None;
        }
        let slot = self.slot?;
        let timeout_ms = u64::try_from(timeout.as_duration().as_millis()).unwrap_or(u64::MAX);
        self.module
            .call_out(slot.index, cluster, headers, body, timeout_ms)
    }
}
