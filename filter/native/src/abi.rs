//! The parts of Envoy's dynamic-module C ABI (version [`ABI_VERSION`], as
//! Envoy 1.40 speaks it) that Sluice calls, declared by hand: the types as
//! laid out in C, and the callbacks Envoy exports. The event hooks Envoy
//! calls are in `hooks.rs`.

use std::ffi::c_void;

/// What `envoy_dynamic_module_on_program_init` answers; Envoy logs
/// "Dynamic module ABI version v0.2.0 matched." when it is its own.
pub const ABI_VERSION: &std::ffi::CStr = c"v0.2.0";

/// Envoy's side of a filter, a filter configuration or a scheduler.
pub type EnvoyPtr = *mut c_void;

/// Bytes the module owns for the length of a call.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ModuleBuffer {
    pub ptr: *const u8,
    pub length: usize,
}

impl ModuleBuffer {
    pub fn of(bytes: &[u8]) -> Self {
        Self {
            ptr: bytes.as_ptr(),
            length: bytes.len(),
        }
    }

    /// No value at all (removes a header when set).
    pub const NONE: Self = Self {
        ptr: std::ptr::null(),
        length: 0,
    };
}

/// Bytes Envoy owns, valid until the hook that handed them out returns.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EnvoyBuffer {
    pub ptr: *const u8,
    pub length: usize,
}

impl EnvoyBuffer {
    pub const EMPTY: Self = Self {
        ptr: std::ptr::null(),
        length: 0,
    };

    /// # Safety
    /// Envoy must have handed out this buffer for the current hook.
    pub unsafe fn bytes<'a>(self) -> &'a [u8] {
        if self.ptr.is_null() {
            &[]
        } else {
            // SAFETY: the caller's promise: Envoy's bytes, alive for the hook.
            unsafe { std::slice::from_raw_parts(self.ptr, self.length) }
        }
    }
}

/// A header the module passes (a reply's, a callout's).
#[repr(C)]
pub struct ModuleHeader {
    pub key: ModuleBuffer,
    pub value: ModuleBuffer,
}

/// A header Envoy passes (a callout's answer).
#[repr(C)]
pub struct EnvoyHeader {
    pub key: EnvoyBuffer,
    pub value: EnvoyBuffer,
}

pub const REQUEST_HEADER: u32 = 0;
pub const RESPONSE_HEADER: u32 = 2;

pub const RECEIVED_REQUEST_BODY: u32 = 0;
pub const BUFFERED_REQUEST_BODY: u32 = 1;
pub const RECEIVED_RESPONSE_BODY: u32 = 2;

pub const HEADERS_CONTINUE: u32 = 0;
/// The headers wait; the body's hooks still run.
pub const HEADERS_STOP_ITERATION: u32 = 1;
/// Nothing of the request goes on, its body buffered, until continued.
pub const HEADERS_STOP_ALL_AND_BUFFER: u32 = 3;
pub const BODY_CONTINUE: u32 = 0;
pub const BODY_STOP_AND_BUFFER: u32 = 1;
pub const TRAILERS_CONTINUE: u32 = 0;
pub const TRAILERS_STOP: u32 = 1;

pub const CALLOUT_INIT_SUCCESS: u32 = 0;
pub const CALLOUT_SUCCESS: u32 = 0;
pub const METRICS_SUCCESS: u32 = 0;

pub const LOG_DEBUG: u32 = 1;
pub const LOG_INFO: u32 = 2;
pub const LOG_WARN: u32 = 3;
pub const LOG_ERROR: u32 = 4;

extern "C" {
    pub fn envoy_dynamic_module_callback_log(level: u32, message: ModuleBuffer);

    pub fn envoy_dynamic_module_callback_http_get_header(
        filter: EnvoyPtr,
        header_type: u32,
        key: ModuleBuffer,
        result: *mut EnvoyBuffer,
        index: usize,
        count: *mut usize,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_set_header(
        filter: EnvoyPtr,
        header_type: u32,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool;
    /// Returns void in Envoy 1.40 and bool in 1.39: declared void, the
    /// result is never read.
    pub fn envoy_dynamic_module_callback_http_set_dynamic_metadata_string(
        filter: EnvoyPtr,
        namespace: ModuleBuffer,
        key: ModuleBuffer,
        value: ModuleBuffer,
    );
    pub fn envoy_dynamic_module_callback_http_send_response(
        filter: EnvoyPtr,
        status: u32,
        headers: *const ModuleHeader,
        headers_len: usize,
        body: ModuleBuffer,
        details: ModuleBuffer,
    );
    pub fn envoy_dynamic_module_callback_http_filter_continue_decoding(filter: EnvoyPtr);
    pub fn envoy_dynamic_module_callback_http_get_body_chunks_size(
        filter: EnvoyPtr,
        body_type: u32,
    ) -> usize;
    pub fn envoy_dynamic_module_callback_http_get_body_chunks(
        filter: EnvoyPtr,
        body_type: u32,
        chunks: *mut EnvoyBuffer,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_get_body_size(
        filter: EnvoyPtr,
        body_type: u32,
    ) -> usize;
    pub fn envoy_dynamic_module_callback_http_drain_body(
        filter: EnvoyPtr,
        body_type: u32,
        bytes: usize,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_append_body(
        filter: EnvoyPtr,
        body_type: u32,
        data: ModuleBuffer,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_received_buffered_request_body(
        filter: EnvoyPtr,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_filter_get_worker_index(filter: EnvoyPtr) -> u32;
    /// Envoy's worker threads; on the main thread only.
    pub fn envoy_dynamic_module_callback_get_concurrency() -> u32;
    /// Envoy picks the request's route again (after a header it routes by
    /// was set).
    pub fn envoy_dynamic_module_callback_http_clear_route_cache(filter: EnvoyPtr);

    pub fn envoy_dynamic_module_callback_http_filter_scheduler_new(filter: EnvoyPtr) -> EnvoyPtr;
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_commit(
        scheduler: EnvoyPtr,
        event: u64,
    );
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_delete(scheduler: EnvoyPtr);

    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_new(
        config: EnvoyPtr,
    ) -> EnvoyPtr;
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
        scheduler: EnvoyPtr,
        event: u64,
    );
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_delete(scheduler: EnvoyPtr);

    pub fn envoy_dynamic_module_callback_http_filter_config_http_callout(
        config: EnvoyPtr,
        callout_id: *mut u64,
        cluster: ModuleBuffer,
        headers: *const ModuleHeader,
        headers_len: usize,
        body: ModuleBuffer,
        timeout_ms: u64,
    ) -> u32;

    pub fn envoy_dynamic_module_callback_http_filter_config_define_counter(
        config: EnvoyPtr,
        name: ModuleBuffer,
        labels: *const ModuleBuffer,
        labels_len: usize,
        id: *mut usize,
    ) -> u32;
    pub fn envoy_dynamic_module_callback_http_filter_config_define_gauge(
        config: EnvoyPtr,
        name: ModuleBuffer,
        labels: *const ModuleBuffer,
        labels_len: usize,
        id: *mut usize,
    ) -> u32;
    pub fn envoy_dynamic_module_callback_http_filter_config_increment_counter(
        config: EnvoyPtr,
        id: usize,
        labels: *const ModuleBuffer,
        labels_len: usize,
        value: u64,
    ) -> u32;
    pub fn envoy_dynamic_module_callback_http_filter_config_increment_gauge(
        config: EnvoyPtr,
        id: usize,
        labels: *const ModuleBuffer,
        labels_len: usize,
        value: u64,
    ) -> u32;
    pub fn envoy_dynamic_module_callback_http_filter_config_decrement_gauge(
        config: EnvoyPtr,
        id: usize,
        labels: *const ModuleBuffer,
        labels_len: usize,
        value: u64,
    ) -> u32;
}
