//! Host calls the SDK would make panic. `proxy_wasm::hostcalls` panics on
//! any status it does not expect (a header map that is gone after a reset,
//! a stream reset while paused), and a panic traps the VM: under
//! FAIL_RELOAD that worker fails closed and its slots stay taken until their
//! lease ends. These read and write the same ABI and turn every status that
//! is not Ok into None or false.

use std::ptr::null_mut;

use proxy_wasm::types::{BufferType, MapType};

const STATUS_OK: u32 = 0;
const STREAM_HTTP_REQUEST: u32 = 0;

#[allow(clashing_extern_declarations)]
#[link(wasm_import_module = "env")]
extern "C" {
    #[link_name = "proxy_get_header_map_value"]
    fn get_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;

    #[link_name = "proxy_get_header_map_pairs"]
    fn get_header_map_pairs(
        map_type: u32,
        return_map_data: *mut *mut u8,
        return_map_size: *mut usize,
    ) -> u32;

    #[link_name = "proxy_replace_header_map_value"]
    fn replace_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;

    #[link_name = "proxy_get_buffer_bytes"]
    fn get_buffer_bytes(
        buffer_type: u32,
        start: usize,
        max_size: usize,
        return_buffer_data: *mut *mut u8,
        return_buffer_size: *mut usize,
    ) -> u32;

    #[link_name = "proxy_remove_header_map_value"]
    fn remove_header_map_value(map_type: u32, key_data: *const u8, key_size: usize) -> u32;

    #[link_name = "proxy_set_buffer_bytes"]
    fn set_buffer_bytes(
        buffer_type: u32,
        start: usize,
        size: usize,
        buffer_data: *const u8,
        buffer_size: usize,
    ) -> u32;

    #[link_name = "proxy_set_property"]
    fn set_property_at(
        path_data: *const u8,
        path_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;

    #[link_name = "proxy_continue_stream"]
    fn continue_stream(stream_type: u32) -> u32;
}

/// Takes ownership of what the host handed back: it allocated it through
/// the SDK's `proxy_on_memory_allocate`, as a `Vec<u8>` of exactly `size`.
///
/// # Safety
/// `data` must be null or the host's allocation of `size` bytes.
unsafe fn take(data: *mut u8, size: usize) -> Vec<u8> {
    if data.is_null() {
        Vec::new()
    } else {
        Vec::from_raw_parts(data, size, size)
    }
}

/// One header's value as bytes; None when it is absent or the map is gone.
pub fn header(map: MapType, key: &str) -> Option<Vec<u8>> {
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    // SAFETY: the key is a valid slice for the call; on Ok the host wrote
    // an allocation of `size` bytes (or null) to `data`.
    unsafe {
        let status =
            get_header_map_value(map as u32, key.as_ptr(), key.len(), &mut data, &mut size);
        (status == STATUS_OK).then(|| take(data, size))
    }
}

/// Every header of `map`, serialized (see `header_pairs`); None when the
/// map is gone.
pub fn header_pairs(map: MapType) -> Option<Vec<u8>> {
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    // SAFETY: on Ok the host wrote an allocation of `size` bytes (or null)
    // to `data`.
    unsafe {
        let status = get_header_map_pairs(map as u32, &mut data, &mut size);
        (status == STATUS_OK).then(|| take(data, size))
    }
}

/// Sets a header of `map`; false when the host refused.
pub fn replace_header(map: MapType, key: &str, value: &[u8]) -> bool {
    // SAFETY: both slices are valid for the call.
    unsafe {
        replace_header_map_value(
            map as u32,
            key.as_ptr(),
            key.len(),
            value.as_ptr(),
            value.len(),
        ) == STATUS_OK
    }
}

/// Sets the current stream's property named by `path_parts` joined (one
/// segment: Envoy keeps it as filter state `wasm.<path>`); false when the
/// host refused, as it does once the stream's info is gone.
pub fn set_property(path_parts: &[&str], value: &[u8]) -> bool {
    // Built on the stack: this runs for every call Sluice decides.
    let mut path = [0u8; 64];
    let mut len = 0;
    for part in path_parts {
        let Some(room) = path.get_mut(len..len + part.len()) else {
            return false;
        };
        room.copy_from_slice(part.as_bytes());
        len += part.len();
    }
    // SAFETY: both slices are valid for the call.
    unsafe { set_property_at(path.as_ptr(), len, value.as_ptr(), value.len()) == STATUS_OK }
}

/// Removes a header of `map`; false when the host refused.
pub fn remove_header(map: MapType, key: &str) -> bool {
    // SAFETY: the key is a valid slice for the call.
    unsafe { remove_header_map_value(map as u32, key.as_ptr(), key.len()) == STATUS_OK }
}

/// Replaces the first `size` bytes of a buffer with `value` (the whole of
/// it when `size` is its length); false when the host refused.
pub fn replace_buffer(buffer: BufferType, size: usize, value: &[u8]) -> bool {
    // SAFETY: the value is a valid slice for the call.
    unsafe { set_buffer_bytes(buffer as u32, 0, size, value.as_ptr(), value.len()) == STATUS_OK }
}

/// Up to `max` bytes of a buffer from `start`; None when there is none.
pub fn buffer(buffer: BufferType, start: usize, max: usize) -> Option<Vec<u8>> {
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    // SAFETY: as for `header`.
    unsafe {
        let status = get_buffer_bytes(buffer as u32, start, max, &mut data, &mut size);
        (status == STATUS_OK && !data.is_null()).then(|| take(data, size))
    }
}

/// Lets the paused request of the effective context continue; false when
/// the stream is gone.
pub fn continue_request() -> bool {
    // SAFETY: a plain host call with an integer argument.
    unsafe { continue_stream(STREAM_HTTP_REQUEST) == STATUS_OK }
}
