//! A dynamic module whose every HTTP filter hook lets the call through
//! untouched: what Envoy itself spends on a dynamic module per request,
//! the floor under Sluice's native build (`make bench` scenario 6,
//! variant (m)).

use std::ffi::{c_char, c_void};

type Ptr = *const c_void;

/// A byte range as Envoy passes it.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Buffer {
    pub ptr: *const u8,
    pub length: usize,
}

/// The ABI version of Envoy 1.40.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const c_char {
    c"v0.2.0".as_ptr()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    _config: Ptr,
    _name: Buffer,
    _settings: Buffer,
) -> Ptr {
    static CONFIG: u8 = 0;
    std::ptr::addr_of!(CONFIG).cast()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_new(config: Ptr, _filter: Ptr) -> Ptr {
    config
}

/// Hooks that answer "continue" (0).
macro_rules! continuing {
    ($($name:ident($($arg:ident: $ty:ty),*);)*) => {$(
        #[no_mangle]
        pub extern "C" fn $name($($arg: $ty),*) -> u32 { 0 }
    )*};
}

continuing! {
    envoy_dynamic_module_on_http_filter_request_headers(_f: Ptr, _m: Ptr, _end: bool);
    envoy_dynamic_module_on_http_filter_request_body(_f: Ptr, _m: Ptr, _end: bool);
    envoy_dynamic_module_on_http_filter_request_trailers(_f: Ptr, _m: Ptr);
    envoy_dynamic_module_on_http_filter_response_headers(_f: Ptr, _m: Ptr, _end: bool);
    envoy_dynamic_module_on_http_filter_response_body(_f: Ptr, _m: Ptr, _end: bool);
    envoy_dynamic_module_on_http_filter_response_trailers(_f: Ptr, _m: Ptr);
}

/// Hooks with nothing to do.
macro_rules! ignored {
    ($($name:ident($($arg:ident: $ty:ty),*);)*) => {$(
        #[no_mangle]
        pub extern "C" fn $name($($arg: $ty),*) {}
    )*};
}

ignored! {
    envoy_dynamic_module_on_http_filter_config_destroy(_c: Ptr);
    envoy_dynamic_module_on_http_filter_destroy(_m: Ptr);
    envoy_dynamic_module_on_http_filter_stream_complete(_f: Ptr, _m: Ptr);
    envoy_dynamic_module_on_http_filter_scheduled(_f: Ptr, _m: Ptr, _event: u64);
    envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(_f: Ptr, _m: Ptr);
    envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(_f: Ptr, _m: Ptr);
    envoy_dynamic_module_on_http_filter_http_callout_done(_f: Ptr, _m: Ptr, _id: u64, _r: u32, _h: Ptr, _hl: usize, _b: Ptr, _bl: usize);
    envoy_dynamic_module_on_http_filter_http_stream_headers(_f: Ptr, _m: Ptr, _id: u64, _h: Ptr, _hl: usize, _e: bool);
    envoy_dynamic_module_on_http_filter_http_stream_data(_f: Ptr, _m: Ptr, _id: u64, _d: Ptr, _dl: usize, _e: bool);
    envoy_dynamic_module_on_http_filter_http_stream_trailers(_f: Ptr, _m: Ptr, _id: u64, _t: Ptr, _tl: usize);
    envoy_dynamic_module_on_http_filter_http_stream_complete(_f: Ptr, _m: Ptr, _id: u64);
    envoy_dynamic_module_on_http_filter_http_stream_reset(_f: Ptr, _m: Ptr, _id: u64, _r: u32);
}
