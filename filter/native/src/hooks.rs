//! The event hooks Envoy calls, by the names its ABI gives them. Each
//! catches any panic (a panic must not cross into Envoy): a request's
//! hooks then fail the call as `failure_mode` says (closed by default, as
//! the wasm build's trapped VM), the others answer as if the filter were
//! not there.

use std::cell::RefCell;
use std::ffi::{c_char, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use sluice_filter::host::{Host, Level};
use sluice_filter::sync::{ReplyBody, SyncReply, MAX_RESPONSE_BYTES};
use sluice_filter_core::plugin::parse_plugin_config;
use sluice_wire::sync_answer::ReceivedHeaders;

use crate::abi::{self, EnvoyBuffer, EnvoyHeader, EnvoyPtr};
use crate::host::{log, NativeHost};
use crate::module::{Module, Slot};
use crate::stream::Stream;
use crate::workers;

fn guarded<T>(fallback: T, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(fallback)
}

/// # Safety
/// `ptr` must be a module made by `config_new` and not yet destroyed.
unsafe fn module_of<'a>(ptr: *const c_void) -> Option<&'a Arc<Module>> {
    // SAFETY: the caller's promise.
    unsafe { ptr.cast::<Arc<Module>>().as_ref() }
}

/// # Safety
/// `ptr` must be a stream made by `filter_new` and not yet destroyed.
unsafe fn stream_of<'a>(ptr: *const c_void) -> Option<&'a mut Stream> {
    // SAFETY: the caller's promise; Envoy calls a stream's hooks one at a
    // time, on its thread.
    unsafe { ptr.cast::<Stream>().cast_mut().as_mut() }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const c_char {
    abi::ABI_VERSION.as_ptr()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    config: EnvoyPtr,
    _name: EnvoyBuffer,
    settings: EnvoyBuffer,
) -> *const c_void {
    guarded(std::ptr::null(), || {
        // SAFETY: Envoy's bytes for this hook.
        let raw = unsafe { settings.bytes() };
        let settings = match parse_plugin_config(raw) {
            Ok(settings) => settings,
            Err(errors) => {
                for e in &errors.errors {
                    log(
                        Level::Error,
                        &format!("sluice: invalid plugin configuration: {e}"),
                    );
                }
                // Envoy refuses the configuration.
                return std::ptr::null();
            }
        };
        // SAFETY: `config` is the configuration Envoy is creating.
        let module = unsafe { Module::new(config, settings) };
        workers::start_all(&module);
        let slot = workers::slot(&module, 0);
        let host = NativeHost::ticking(&module, &slot);
        let (holder, enforcing) = {
            let w = slot.worker();
            (w.holder(), w.policies().policies.len())
        };
        host.log(
            Level::Info,
            &format!(
                "sluice: instance {} (native module) holder {holder} enforcing {enforcing} fallback policies",
                module.settings.instance,
            ),
        );
        Box::into_raw(Box::new(module)).cast_const().cast()
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(module: *const c_void) {
    guarded((), || {
        if module.is_null() {
            return;
        }
        // SAFETY: made by `config_new`, destroyed once, after its streams.
        let module = unsafe { Box::from_raw(module.cast::<Arc<Module>>().cast_mut()) };
        module.shut_down();
    });
}

thread_local! {
    /// This thread's worker slot, and the generation of the module it is
    /// of (not its address: after a reload a new configuration may be
    /// made where a destroyed one was, and must not get the dead one's
    /// worker, whose policies are frozen and whose ticks have stopped).
    static SLOT: RefCell<Option<(u64, Arc<Slot>)>> = const { RefCell::new(None) };
}

fn slot_for(module: &Arc<Module>, filter: EnvoyPtr) -> Arc<Slot> {
    let key = module.generation;
    SLOT.with(|cached| {
        let mut cached = cached.borrow_mut();
        if let Some((k, slot)) = cached.as_ref() {
            if *k == key {
                return Arc::clone(slot);
            }
        }
        // SAFETY: Envoy's filter, in its `filter_new` hook.
        let index =
            unsafe { abi::envoy_dynamic_module_callback_http_filter_get_worker_index(filter) };
        let slot = workers::slot(module, index as usize + 1);
        *cached = Some((key, Arc::clone(&slot)));
        slot
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_new(
    module: *const c_void,
    filter: EnvoyPtr,
) -> *const c_void {
    guarded(std::ptr::null(), || {
        // SAFETY: Envoy passes the module `config_new` made.
        let Some(module) = (unsafe { module_of(module) }) else {
            return std::ptr::null();
        };
        let slot = slot_for(module, filter);
        let stream = Stream::new(Arc::clone(module), slot, filter);
        Box::into_raw(Box::new(stream)).cast_const().cast()
    })
}

/// Runs `f` on the stream, or answers `fallback` when there is none.
fn on_stream<T: Copy>(stream: *const c_void, fallback: T, f: impl FnOnce(&mut Stream) -> T) -> T {
    guarded(fallback, || {
        // SAFETY: Envoy passes the stream `filter_new` made.
        match unsafe { stream_of(stream) } {
            Some(s) => f(s),
            None => fallback,
        }
    })
}

/// Runs a request hook of the stream. A panic in it fails the call as
/// the configuration's `failure_mode` says: closed (the default, as the
/// wasm build's trapped VM under FAIL_RELOAD) answers 503 and holds the
/// call (`stop`); open lets it go on (`go_on`), as a filter that is not
/// there.
fn on_request_hook(
    filter: EnvoyPtr,
    stream: *const c_void,
    (go_on, stop): (u32, u32),
    f: impl FnOnce(&mut Stream) -> u32,
) -> u32 {
    // SAFETY: Envoy passes the stream `filter_new` made.
    let ran = catch_unwind(AssertUnwindSafe(|| unsafe { stream_of(stream) }.map(f)));
    match ran {
        Ok(status) => status.unwrap_or(go_on),
        Err(_) => {
            // SAFETY: as above; the stream outlives its hooks.
            let open = unsafe { stream_of(stream) }.is_some_and(|s| s.fails_open());
            if open {
                return go_on;
            }
            guarded((), || {
                // SAFETY: this stream's hook is running.
                unsafe {
                    crate::host::send_reply(
                        filter,
                        503,
                        &[("x-sluice-reason", "filter-failure")],
                        b"sluice: the rate limiter failed on this call (failure_mode: closed)\n",
                    )
                };
            });
            stop
        }
    }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    filter: EnvoyPtr,
    stream: *const c_void,
    end_of_stream: bool,
) -> u32 {
    on_request_hook(
        filter,
        stream,
        (abi::HEADERS_CONTINUE, abi::HEADERS_STOP_ALL_AND_BUFFER),
        |s| s.on_request_headers(end_of_stream),
    )
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    filter: EnvoyPtr,
    stream: *const c_void,
    end_of_stream: bool,
) -> u32 {
    on_request_hook(
        filter,
        stream,
        (abi::BODY_CONTINUE, abi::BODY_STOP_AND_BUFFER),
        |s| s.on_request_body(end_of_stream),
    )
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(
    filter: EnvoyPtr,
    stream: *const c_void,
) -> u32 {
    on_request_hook(
        filter,
        stream,
        (abi::TRAILERS_CONTINUE, abi::TRAILERS_STOP),
        Stream::on_request_trailers,
    )
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    _filter: EnvoyPtr,
    stream: *const c_void,
    end_of_stream: bool,
) -> u32 {
    on_stream(stream, abi::HEADERS_CONTINUE, |s| {
        s.on_response_headers(end_of_stream)
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
    _filter: EnvoyPtr,
    stream: *const c_void,
    end_of_stream: bool,
) -> u32 {
    on_stream(stream, abi::BODY_CONTINUE, |s| {
        s.on_response_body(end_of_stream)
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(
    _filter: EnvoyPtr,
    _stream: *const c_void,
) -> u32 {
    abi::TRAILERS_CONTINUE
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(
    _filter: EnvoyPtr,
    stream: *const c_void,
) {
    on_stream(stream, (), Stream::end);
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_destroy(stream: *const c_void) {
    guarded((), || {
        if !stream.is_null() {
            // SAFETY: made by `filter_new`, destroyed once, last.
            drop(unsafe { Box::from_raw(stream.cast::<Stream>().cast_mut()) });
        }
    });
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(
    _filter: EnvoyPtr,
    stream: *const c_void,
    _event: u64,
) {
    on_stream(stream, (), Stream::on_scheduled);
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_scheduled(
    _config: EnvoyPtr,
    module: *const c_void,
    _event: u64,
) {
    guarded((), || {
        // SAFETY: Envoy passes the module `config_new` made.
        if let Some(module) = unsafe { module_of(module) } {
            workers::tick_due(module);
        }
    });
}

/// One header of a callout's answer; None when absent.
fn answer_header<'a>(headers: &'a [EnvoyHeader], name: &str) -> Option<&'a [u8]> {
    headers.iter().find_map(|h| {
        // SAFETY: Envoy's bytes, alive through the hook.
        let key = unsafe { h.key.bytes() };
        key.eq_ignore_ascii_case(name.as_bytes())
            .then(|| unsafe { h.value.bytes() })
    })
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_callout_done(
    _config: EnvoyPtr,
    module: *const c_void,
    callout_id: u64,
    result: u32,
    headers: *const EnvoyHeader,
    headers_len: usize,
    chunks: *const EnvoyBuffer,
    chunks_len: usize,
) {
    guarded((), || {
        // SAFETY: Envoy passes the module `config_new` made.
        let Some(module) = (unsafe { module_of(module) }) else {
            return;
        };
        let Some((slot, token)) = workers::callout(module, callout_id) else {
            return;
        };
        // SAFETY: Envoy's arrays of the lengths it gives, alive through
        // the hook (empty when null).
        let (headers, chunks) = unsafe {
            (
                if headers.is_null() {
                    &[][..]
                } else {
                    std::slice::from_raw_parts(headers, headers_len)
                },
                if chunks.is_null() {
                    &[][..]
                } else {
                    std::slice::from_raw_parts(chunks, chunks_len)
                },
            )
        };
        let answered = result == abi::CALLOUT_SUCCESS;
        let header = |name: &str| answered.then(|| answer_header(headers, name)).flatten();
        // SAFETY: as above.
        let size: usize = chunks.iter().map(|c| c.length).sum();
        let body = (size <= MAX_RESPONSE_BYTES).then(|| {
            let mut body = Vec::with_capacity(size);
            for chunk in chunks {
                // SAFETY: as above.
                body.extend_from_slice(unsafe { chunk.bytes() });
            }
            body
        });
        let reply = SyncReply {
            headers: ReceivedHeaders::read(header),
            body: match &body {
                Some(b) if answered => ReplyBody::Read(Some(b)),
                Some(_) => ReplyBody::Read(None),
                None => ReplyBody::TooLarge(size),
            },
        };
        let host = NativeHost::ticking(module, &slot);
        slot.worker().on_sync_reply(&host, token, reply);
    });
}

macro_rules! unused_hooks {
    ($($name:ident($($arg:ident: $ty:ty),*);)*) => {$(
        /// Not used by Sluice; Envoy requires it.
        #[no_mangle]
        pub extern "C" fn $name($($arg: $ty),*) {}
    )*};
}

unused_hooks! {
    envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(_f: EnvoyPtr, _s: *const c_void);
    envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(_f: EnvoyPtr, _s: *const c_void);
    envoy_dynamic_module_on_http_filter_http_callout_done(_f: EnvoyPtr, _s: *const c_void, _id: u64, _r: u32, _h: *const c_void, _hl: usize, _b: *const c_void, _bl: usize);
    envoy_dynamic_module_on_http_filter_http_stream_headers(_f: EnvoyPtr, _s: *const c_void, _id: u64, _h: *const c_void, _hl: usize, _e: bool);
    envoy_dynamic_module_on_http_filter_http_stream_data(_f: EnvoyPtr, _s: *const c_void, _id: u64, _d: *const c_void, _dl: usize, _e: bool);
    envoy_dynamic_module_on_http_filter_http_stream_trailers(_f: EnvoyPtr, _s: *const c_void, _id: u64, _t: *const c_void, _tl: usize);
    envoy_dynamic_module_on_http_filter_http_stream_complete(_f: EnvoyPtr, _s: *const c_void, _id: u64);
    envoy_dynamic_module_on_http_filter_http_stream_reset(_f: EnvoyPtr, _s: *const c_void, _id: u64, _r: u32);
}
