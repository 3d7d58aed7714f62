//! One stream through the filter: Envoy's hooks turned into calls on its
//! worker, and the worker's verdicts into Envoy's statuses. As the wasm
//! build's stream context, nothing here decides.

use std::borrow::Cow;
use std::sync::Arc;

use sluice_filter::kept_headers::KeptHeaders;
use sluice_filter::worker::{RequestBody, Verdict, MAX_REQUEST_BODY_BYTES};
use sluice_shared::request_headers::RequestHeaders;

use crate::abi::{self, EnvoyBuffer, EnvoyPtr, ModuleBuffer};
use crate::host::{send_reply, set_header, set_route_header, NativeHost};
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

/// What the worker's verdict asks of the stream.
enum Next {
    Go,
    Hold,
}

pub struct Stream {
    module: Arc<Module>,
    slot: Arc<Slot>,
    filter: EnvoyPtr,
    context_id: u32,
    request: NativeHeaders,
    /// Held until its body is in: a cost is read from it.
    awaiting_body: bool,
    /// Its response is read for what the call cost.
    reading_response: bool,
    /// Its end was told to the worker.
    ended: bool,
    /// It waited, with a mailbox for the tick's word.
    waited: bool,
}

impl Stream {
    pub fn new(module: Arc<Module>, slot: Arc<Slot>, filter: EnvoyPtr) -> Self {
        Self {
            module,
            slot,
            filter,
            context_id: next_context_id(),
            request: NativeHeaders {
                filter,
                header_type: abi::REQUEST_HEADER,
                kept: KeptHeaders::default(),
            },
            awaiting_body: false,
            reading_response: false,
            ended: false,
            waited: false,
        }
    }

    fn host(&self) -> NativeHost<'_> {
        NativeHost::streaming(&self.module, &self.slot, self.context_id, self.filter)
    }

    fn decide(&mut self, body: RequestBody<'_>) -> Next {
        let verdict = {
            let host = self.host();
            let mut w = self.slot.worker();
            w.on_request_with(&host, self.context_id, &self.request, body)
        };
        match verdict {
            Verdict::Continue => Next::Go,
            Verdict::ReadBody => {
                // The headers go on and the body is held, as in the wasm
                // build: a call refused on its body is reset upstream
                // before any of its body is sent.
                self.awaiting_body = true;
                Next::Go
            }
            Verdict::Pause { ticket } => {
                if self.module.queue_ticket_header {
                    // SAFETY: this stream's hook is running.
                    unsafe {
                        set_header(
                            self.filter,
                            abi::REQUEST_HEADER,
                            "x-sluice-queue-ticket",
                            Some(ticket.to_string().as_bytes()),
                        )
                    };
                }
                // SAFETY: this stream's hook, on its own thread.
                unsafe { self.module.open_mailbox(self.context_id, self.filter) };
                self.waited = true;
                Next::Hold
            }
            Verdict::Reply(reply) => {
                let headers: Vec<(&str, &str)> = reply
                    .headers
                    .iter()
                    .map(|(n, v)| (*n, v.as_str()))
                    .collect();
                // SAFETY: this stream's hook is running; no worker is held
                // (a local reply runs the answer's hooks at once).
                unsafe { send_reply(self.filter, reply.status, &headers, &reply.body) };
                Next::Hold
            }
        }
    }

    pub fn on_request_headers(&mut self, end_of_stream: bool) -> u32 {
        let body = if end_of_stream {
            RequestBody::Absent
        } else {
            RequestBody::Coming
        };
        match self.decide(body) {
            Next::Go => abi::HEADERS_CONTINUE,
            // Nothing of the request goes on, its body buffered, until
            // resumed.
            Next::Hold => abi::HEADERS_STOP_ALL_AND_BUFFER,
        }
    }

    pub fn on_request_body(&mut self, end_of_stream: bool) -> u32 {
        if !self.awaiting_body {
            return abi::BODY_CONTINUE;
        }
        // SAFETY: this stream's hook is running.
        let buffered_is_received = unsafe {
            abi::envoy_dynamic_module_callback_http_received_buffered_request_body(self.filter)
        };
        let size = body_size(self.filter, abi::RECEIVED_REQUEST_BODY)
            + if buffered_is_received {
                0
            } else {
                body_size(self.filter, abi::BUFFERED_REQUEST_BODY)
            };
        let next = if size > MAX_REQUEST_BODY_BYTES {
            // Too large to read for an estimate: decided on the cost's
            // max, without buffering the rest.
            self.awaiting_body = false;
            self.decide(RequestBody::Read(None))
        } else if !end_of_stream {
            return abi::BODY_STOP_AND_BUFFER;
        } else {
            self.awaiting_body = false;
            let mut body = Vec::with_capacity(size);
            if !buffered_is_received {
                read_body(self.filter, abi::BUFFERED_REQUEST_BODY, &mut body);
            }
            read_body(self.filter, abi::RECEIVED_REQUEST_BODY, &mut body);
            self.decide(RequestBody::Read(Some(&body)))
        };
        match next {
            Next::Go => abi::BODY_CONTINUE,
            Next::Hold => abi::BODY_STOP_AND_BUFFER,
        }
    }

    pub fn on_request_trailers(&mut self) -> u32 {
        if !self.awaiting_body {
            return abi::TRAILERS_CONTINUE;
        }
        // A body ended by trailers was not read: decided on the cost's max.
        self.awaiting_body = false;
        match self.decide(RequestBody::Read(None)) {
            Next::Go => abi::TRAILERS_CONTINUE,
            Next::Hold => abi::TRAILERS_STOP,
        }
    }

    pub fn on_response_headers(&mut self, end_of_stream: bool) -> u32 {
        let mut told = Vec::new();
        {
            let host =
                NativeHost::streaming(&self.module, &self.slot, self.context_id, self.filter);
            let mut w = self.slot.worker();
            if w.reads_response(self.context_id) {
                let headers = NativeHeaders {
                    filter: self.filter,
                    header_type: abi::RESPONSE_HEADER,
                    kept: KeptHeaders::default(),
                };
                self.reading_response =
                    w.on_response_headers(&host, self.context_id, &headers, end_of_stream);
                if w.strips_answer(self.context_id) {
                    // Its pieces change length as they pass.
                    // SAFETY: this stream's hook is running.
                    unsafe {
                        set_header(self.filter, abi::RESPONSE_HEADER, "content-length", None)
                    };
                }
            }
            if w.tells(self.context_id) {
                told = w.answer_headers(&host, self.context_id);
            }
        }
        for (name, value) in told {
            // SAFETY: this stream's hook is running.
            unsafe {
                set_header(
                    self.filter,
                    abi::RESPONSE_HEADER,
                    name,
                    Some(value.as_bytes()),
                )
            };
        }
        abi::HEADERS_CONTINUE
    }

    pub fn on_response_body(&mut self, end_of_stream: bool) -> u32 {
        if !self.reading_response {
            return abi::BODY_CONTINUE;
        }
        // Passed on as it comes: only this piece is read, never buffered.
        let mut chunk = Vec::new();
        read_body(self.filter, abi::RECEIVED_RESPONSE_BODY, &mut chunk);
        let host = NativeHost::streaming(&self.module, &self.slot, self.context_id, self.filter);
        let mut w = self.slot.worker();
        let usage_wanted = w.on_response_body(&host, self.context_id, &chunk, end_of_stream);
        if let Some(passed) = w.strip_answer(&host, self.context_id, &chunk, end_of_stream) {
            if passed != chunk {
                // SAFETY: this stream's hook is running.
                unsafe {
                    abi::envoy_dynamic_module_callback_http_drain_body(
                        self.filter,
                        abi::RECEIVED_RESPONSE_BODY,
                        chunk.len(),
                    );
                    abi::envoy_dynamic_module_callback_http_append_body(
                        self.filter,
                        abi::RECEIVED_RESPONSE_BODY,
                        ModuleBuffer::of(&passed),
                    );
                }
            }
        }
        self.reading_response = usage_wanted || w.strips_answer(self.context_id);
        abi::BODY_CONTINUE
    }

    /// A tick's word for this stream, on its own thread.
    pub fn on_scheduled(&mut self) {
        for posted in self.module.take_posted(self.context_id) {
            // SAFETY: this stream's hook (its scheduler's event) is running.
            unsafe {
                match posted {
                    Posted::SetHeader(name, value) => {
                        set_route_header(self.filter, &name, value.as_bytes());
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

    pub fn end(&mut self) {
        if std::mem::replace(&mut self.ended, true) {
            return;
        }
        let host = self.host();
        self.slot.worker().on_stream_end(&host, self.context_id);
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.end();
        if self.waited {
            self.module.close_mailbox(self.context_id);
        }
    }
}
