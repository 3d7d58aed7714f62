//! One stream through the filter: Envoy's hooks handed to the stream
//! shell both builds share (`sluice_filter::stream_shell`) with this
//! build's I/O, and its flow turned into Envoy's statuses.

use std::borrow::Cow;
use std::sync::Arc;

use sluice_filter::kept_headers::KeptHeaders;
use sluice_filter::stream_shell::{Flow, StreamIo, StreamShell};
use sluice_filter::worker::Worker;
use sluice_shared::request_headers::RequestHeaders;

use crate::abi::{self, EnvoyBuffer, EnvoyPtr, ModuleBuffer};
use crate::host::{send_reply, set_header, set_log_field, set_route_header, NativeHost};
use crate::module::{next_context_id, Module, Posted, Slot};

/// A stream's headers (request or answer) as bytes, each read once.
struct NativeHeaders {
    filter: EnvoyPtr,
    header_type: u32,
    kept: KeptHeaders,
}

impl RequestHeaders for NativeHeaders {
    fn header(&self, name: &str) -> Option<Cow<'_, [u8]>> {
        self.kept
            .value(name, |n| read_header(self.filter, self.header_type, n))
            .map(Cow::Borrowed)
    }

    fn carries(&self, name: &str) -> bool {
        read_header(self.filter, self.header_type, name).is_some()
    }
}

fn read_header(filter: EnvoyPtr, header_type: u32, name: &str) -> Option<Vec<u8>> {
    let mut value = EnvoyBuffer::EMPTY;
    // SAFETY: the filter is Envoy's and one of its hooks is running; the
    // value Envoy hands out is copied before the hook returns.
    unsafe {
        let found = abi::envoy_dynamic_module_callback_http_get_header(
            filter,
            header_type,
            ModuleBuffer::of(name.as_bytes()),
            &mut value,
            0,
            std::ptr::null_mut(),
        );
        (found && !value.ptr.is_null()).then(|| value.bytes().to_vec())
    }
}

/// The bytes of one of the stream's bodies, in Envoy's chunks.
fn read_body(filter: EnvoyPtr, body_type: u32, into: &mut Vec<u8>) {
    // SAFETY: as for `read_header`; the chunk list is sized as Envoy says.
    unsafe {
        let count = abi::envoy_dynamic_module_callback_http_get_body_chunks_size(filter, body_type);
        if count == 0 {
            return;
        }
        let mut chunks = vec![EnvoyBuffer::EMPTY; count];
        if abi::envoy_dynamic_module_callback_http_get_body_chunks(
            filter,
            body_type,
            chunks.as_mut_ptr(),
        ) {
            for chunk in chunks {
                into.extend_from_slice(chunk.bytes());
            }
        }
    }
}

fn body_size(filter: EnvoyPtr, body_type: u32) -> usize {
    // SAFETY: as for `read_header`.
    unsafe { abi::envoy_dynamic_module_callback_http_get_body_size(filter, body_type) }
}

/// A stream's worker (its thread's slot) and the buffers its hooks reach,
/// for one hook.
struct NativeIo<'s> {
    module: &'s Module,
    slot: &'s Slot,
    filter: EnvoyPtr,
    context_id: u32,
}

impl StreamIo for NativeIo<'_> {
    type AnswerHeaders = NativeHeaders;

    fn with_worker<R>(&mut self, f: impl FnOnce(&mut Worker) -> R) -> Option<R> {
        Some(f(&mut self.slot.worker()))
    }

    fn waits(&mut self) {
        // SAFETY: this stream's hook, on its own thread.
        unsafe { self.module.open_mailbox(self.context_id, self.filter) };
    }

    fn request_body(&mut self, size: usize) -> Option<Vec<u8>> {
        let mut body = Vec::with_capacity(size);
        if !buffered_is_received(self.filter) {
            read_body(self.filter, abi::BUFFERED_REQUEST_BODY, &mut body);
        }
        read_body(self.filter, abi::RECEIVED_REQUEST_BODY, &mut body);
        Some(body)
    }

    fn answer_headers(&self) -> NativeHeaders {
        NativeHeaders {
            filter: self.filter,
            header_type: abi::RESPONSE_HEADER,
            kept: KeptHeaders::default(),
        }
    }

    fn set_answer_header(&mut self, name: &str, value: Option<&[u8]>) {
        // SAFETY: this stream's hook is running.
        unsafe { set_header(self.filter, abi::RESPONSE_HEADER, name, value) };
    }

    fn answer_piece(&mut self, _size: usize) -> Vec<u8> {
        let mut piece = Vec::new();
        read_body(self.filter, abi::RECEIVED_RESPONSE_BODY, &mut piece);
        piece
    }

    fn replace_answer_piece(&mut self, size: usize, passed: &[u8]) {
        // SAFETY: this stream's hook is running.
        unsafe {
            abi::envoy_dynamic_module_callback_http_drain_body(
                self.filter,
                abi::RECEIVED_RESPONSE_BODY,
                size,
            );
            abi::envoy_dynamic_module_callback_http_append_body(
                self.filter,
                abi::RECEIVED_RESPONSE_BODY,
                ModuleBuffer::of(passed),
            );
        }
    }
}

/// Whether what Envoy buffered of the request's body is the piece just
/// received (the last hook's), not a piece before it.
fn buffered_is_received(filter: EnvoyPtr) -> bool {
    // SAFETY: this stream's hook is running.
    unsafe { abi::envoy_dynamic_module_callback_http_received_buffered_request_body(filter) }
}

pub struct Stream {
    module: Arc<Module>,
    slot: Arc<Slot>,
    filter: EnvoyPtr,
    shell: StreamShell,
    request: NativeHeaders,
}

impl Stream {
    pub fn new(module: Arc<Module>, slot: Arc<Slot>, filter: EnvoyPtr) -> Self {
        let shell = StreamShell::new(next_context_id(), module.shell.clone());
        Self {
            module,
            slot,
            filter,
            shell,
            request: NativeHeaders {
                filter,
                header_type: abi::REQUEST_HEADER,
                kept: KeptHeaders::default(),
            },
        }
    }

    /// The host and the I/O of one of this stream's hooks, and its shell.
    fn parts(
        &mut self,
    ) -> (
        NativeHost<'_>,
        NativeIo<'_>,
        &mut StreamShell,
        &NativeHeaders,
    ) {
        let context_id = self.shell.context_id();
        let host = NativeHost::streaming(&self.module, &self.slot, context_id, self.filter);
        let io = NativeIo {
            module: &self.module,
            slot: &self.slot,
            filter: self.filter,
            context_id,
        };
        (host, io, &mut self.shell, &self.request)
    }

    pub fn on_request_headers(&mut self, end_of_stream: bool) -> u32 {
        let (host, mut io, shell, request) = self.parts();
        match shell.on_request_headers(&host, &mut io, request, end_of_stream) {
            Flow::Continue => abi::HEADERS_CONTINUE,
            // Nothing of the request goes on, its body buffered, until
            // resumed.
            Flow::Hold => abi::HEADERS_STOP_ALL_AND_BUFFER,
            // The headers wait; the body comes on to this filter.
            Flow::AwaitBody => abi::HEADERS_STOP_ITERATION,
        }
    }

    pub fn on_request_body(&mut self, end_of_stream: bool) -> u32 {
        let filter = self.filter;
        let size = body_size(filter, abi::RECEIVED_REQUEST_BODY)
            + if buffered_is_received(filter) {
                0
            } else {
                body_size(filter, abi::BUFFERED_REQUEST_BODY)
            };
        let (host, mut io, shell, request) = self.parts();
        match shell.on_request_body(&host, &mut io, request, size, end_of_stream) {
            Flow::Continue => abi::BODY_CONTINUE,
            Flow::Hold | Flow::AwaitBody => abi::BODY_STOP_AND_BUFFER,
        }
    }

    pub fn on_request_trailers(&mut self) -> u32 {
        let (host, mut io, shell, request) = self.parts();
        match shell.on_request_trailers(&host, &mut io, request) {
            Flow::Continue => abi::TRAILERS_CONTINUE,
            Flow::Hold | Flow::AwaitBody => abi::TRAILERS_STOP,
        }
    }

    pub fn on_response_headers(&mut self, end_of_stream: bool) -> u32 {
        let (host, mut io, shell, _) = self.parts();
        shell.on_answer_headers(&host, &mut io, end_of_stream);
        abi::HEADERS_CONTINUE
    }

    pub fn on_response_body(&mut self, end_of_stream: bool) -> u32 {
        let size = body_size(self.filter, abi::RECEIVED_RESPONSE_BODY);
        let (host, mut io, shell, _) = self.parts();
        shell.on_answer_body(&host, &mut io, size, end_of_stream);
        abi::BODY_CONTINUE
    }

    /// A tick's word for this stream, on its own thread.
    pub fn on_scheduled(&mut self) {
        for posted in self.module.take_posted(self.shell.context_id()) {
            // SAFETY: this stream's hook (its scheduler's event) is running.
            unsafe {
                match posted {
                    Posted::SetHeader(name, value) => {
                        set_route_header(self.filter, &name, Some(value.as_bytes()));
                    }
                    Posted::LogField(field, value) => {
                        set_log_field(self.filter, field, &value);
                    }
                    Posted::Resume => {
                        abi::envoy_dynamic_module_callback_http_filter_continue_decoding(
                            self.filter,
                        );
                    }
                    Posted::Reply {
                        status,
                        headers,
                        body,
                    } => {
                        let headers: Vec<(&str, &str)> = headers
                            .iter()
                            .map(|(n, v)| (n.as_str(), v.as_str()))
                            .collect();
                        send_reply(self.filter, status, &headers, &body);
                    }
                }
            }
        }
    }

    /// Whether a failure on this stream lets its call through
    /// (`failure_mode: open`).
    pub fn fails_open(&self) -> bool {
        self.module.settings.failure_mode == sluice_filter_core::plugin::FailureMode::Open
    }

    pub fn end(&mut self) {
        let (host, mut io, shell, _) = self.parts();
        shell.end(&host, &mut io);
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.end();
        if self.shell.waited() {
            self.module.close_mailbox(self.shell.context_id());
        }
    }
}
