//! The proxy-wasm contexts: they translate Envoy callbacks into calls on the
//! [`Worker`] and carry out the actions it returns. Nothing here decides.

mod abi;

use std::borrow::Cow;
use std::cell::RefCell;
use std::rc::Rc;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType, Status};
use sluice_filter_core::matcher::CompiledPolicySet;
use sluice_filter_core::plugin::parse_plugin_config;
use sluice_shared::request_headers::RequestHeaders;
use sluice_shared::time::{Instant, Span};
use sluice_wire::sync::{
    BUDGETS_HEADER, EPOCH_HEADER, PROVIDER_HEADER, SHARES_HEADER, SYNC_NOW_HEADER,
};

use crate::host::{Host, Level, SetError};
use crate::kept_headers::KeptHeaders;
use crate::sync::{parse_status, ReplyBody, SyncReply, SyncSettings, MAX_RESPONSE_BYTES};
use crate::worker::{RequestBody, StreamAction, Verdict, Worker, MAX_REQUEST_BODY_BYTES};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(SluiceRoot::default()) });
}}

struct EnvoyHost;

impl Host for EnvoyHost {
    fn now(&self) -> Instant {
        hostcalls::get_current_time().map_or(Instant::EPOCH, Instant::from_system)
    }

    fn shared_get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        hostcalls::get_shared_data(key).unwrap_or((None, None))
    }

    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        match hostcalls::set_shared_data(key, Some(value), cas) {
            Ok(()) => Ok(()),
            Err(Status::CasMismatch) => Err(SetError::CasMismatch),
            Err(_) => Err(SetError::Failed),
        }
    }

    fn log(&self, level: Level, message: &str) {
        let level = match level {
            Level::Debug => LogLevel::Debug,
            Level::Info => LogLevel::Info,
            Level::Warn => LogLevel::Warn,
            Level::Error => LogLevel::Error,
        };
        let _ = hostcalls::log(level, message);
    }

    fn define_counter(&self, name: &str) -> Option<u32> {
        hostcalls::define_metric(MetricType::Counter, name).ok()
    }

    fn define_gauge(&self, name: &str) -> Option<u32> {
        hostcalls::define_metric(MetricType::Gauge, name).ok()
    }

    fn increment_metric(&self, id: u32, delta: i64) {
        let _ = hostcalls::increment_metric(id, delta);
    }

    fn reply(&self, context_id: u32, status: u32, headers: &[(&str, &str)], body: &[u8]) -> bool {
        if hostcalls::set_effective_context(context_id).is_err() {
            return false;
        }
        hostcalls::send_http_response(status, headers.to_vec(), Some(body)).is_ok()
    }

    fn remove_request_header(&self, name: &str) {
        let _ = abi::remove_header(MapType::HttpRequestHeaders, name);
    }

    fn set_request_header(&self, context_id: u32, name: &str, value: &str) -> bool {
        if hostcalls::set_effective_context(context_id).is_err() {
            return false;
        }
        abi::replace_header(MapType::HttpRequestHeaders, name, value.as_bytes())
    }

    fn replace_request_body(&self, old_len: usize, body: &[u8]) -> bool {
        abi::replace_buffer(BufferType::HttpRequestBody, old_len, body)
    }

    fn resume(&self, context_id: u32) -> bool {
        if hostcalls::set_effective_context(context_id).is_err() {
            return false;
        }
        abi::continue_request()
    }

    fn random_bytes(&self, buf: &mut [u8]) -> bool {
        getrandom::fill(buf).is_ok()
    }

    fn set_tick_period(&self, period: Span) {
        let _ = hostcalls::set_tick_period(period.as_duration());
    }

    fn dispatch_http_call(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout: Span,
    ) -> Option<u32> {
        hostcalls::dispatch_http_call(
            cluster,
            headers.to_vec(),
            Some(body),
            Vec::new(),
            timeout.as_duration(),
        )
        .ok()
    }
}

/// A request's or response's headers, read from Envoy as bytes (no
/// header value can make UTF-8 decoding panic), each at most once.
struct EnvoyHeaders {
    map: MapType,
    kept: KeptHeaders,
}

impl EnvoyHeaders {
    fn of(map: MapType) -> Self {
        Self {
            map,
            kept: KeptHeaders::default(),
        }
    }
}

impl RequestHeaders for EnvoyHeaders {
    fn header(&self, name: &str) -> Option<Cow<'_, [u8]>> {
        self.kept
            .value(name, |n| abi::header(self.map, n))
            .map(Cow::Borrowed)
    }
}

#[derive(Default)]
struct SluiceRoot {
    worker: Option<Rc<RefCell<Worker>>>,
    queue_ticket_header: bool,
}

impl Context for SluiceRoot {
    fn on_http_call_response(
        &mut self,
        token: u32,
        _headers: usize,
        body_size: usize,
        _trailers: usize,
    ) {
        let Some(worker) = &self.worker else {
            return;
        };
        // Everything read as bytes, any of it possibly missing: no :status
        // means Envoy gave up (connection refused, timeout, reset).
        let status =
            parse_status(abi::header(MapType::HttpCallResponseHeaders, ":status").as_deref());
        let shares = abi::header(MapType::HttpCallResponseHeaders, SHARES_HEADER);
        let epoch = abi::header(MapType::HttpCallResponseHeaders, EPOCH_HEADER);
        let budgets = abi::header(MapType::HttpCallResponseHeaders, BUDGETS_HEADER);
        let provider = abi::header(MapType::HttpCallResponseHeaders, PROVIDER_HEADER);
        let sync_now = abi::header(MapType::HttpCallResponseHeaders, SYNC_NOW_HEADER).is_some();
        let body = if body_size > MAX_RESPONSE_BYTES {
            None
        } else {
            abi::buffer(BufferType::HttpCallResponseBody, 0, body_size)
        };
        let reply = SyncReply {
            status,
            shares_header: shares.as_deref(),
            epoch_header: epoch.as_deref(),
            budgets_header: budgets.as_deref(),
            provider_header: provider.as_deref(),
            sync_now,
            body: if body_size > MAX_RESPONSE_BYTES {
                ReplyBody::TooLarge(body_size)
            } else {
                ReplyBody::Read(body.as_deref())
            },
        };
        if let Ok(mut w) = worker.try_borrow_mut() {
            w.on_sync_reply(&EnvoyHost, token, reply);
        }
    }
}

impl RootContext for SluiceRoot {
    fn on_configure(&mut self, _size: usize) -> bool {
        let host = EnvoyHost;
        let raw = self.get_plugin_configuration().unwrap_or_default();
        let config = match parse_plugin_config(&raw) {
            Ok(config) => config,
            Err(errors) => {
                for e in &errors.errors {
                    host.log(
                        Level::Error,
                        &format!("sluice: invalid plugin configuration: {e}"),
                    );
                }
                return false;
            }
        };
        let worker = self
            .worker
            .get_or_insert_with(|| Rc::new(RefCell::new(Worker::new(&host))));
        let Ok(mut w) = worker.try_borrow_mut() else {
            return false;
        };
        let sync = SyncSettings::from_config(&config);
        let set = CompiledPolicySet::from_validated(config.fallback);
        host.log(
            Level::Info,
            &format!(
                "sluice: instance {} holder {} enforcing {} fallback policies (version {})",
                config.instance,
                w.holder(),
                set.policies.len(),
                set.version
            ),
        );
        w.set_time_scale(config.time_scale);
        w.install(&host, set);
        w.set_sync(sync);
        w.start_ticking(&host);
        self.queue_ticket_header = config.queue_ticket_header;
        true
    }

    fn on_tick(&mut self) {
        let Some(worker) = &self.worker else {
            return;
        };
        let host = EnvoyHost;
        let actions = match worker.try_borrow_mut() {
            Ok(mut w) => w.on_tick(&host),
            Err(_) => return,
        };
        // Run after the borrow ends: a reply or resume may call back into us.
        for action in actions {
            match action {
                StreamAction::SetHeader(ctx, name, value) => {
                    host.set_request_header(ctx, &name, &value);
                }
                StreamAction::Resume(ctx) => {
                    if !host.resume(ctx) {
                        if let Ok(mut w) = worker.try_borrow_mut() {
                            w.on_resume_failed(&host, ctx);
                        }
                    }
                }
                StreamAction::Reply(ctx, reply) => {
                    let headers: Vec<(&str, &str)> = reply
                        .headers
                        .iter()
                        .map(|(n, v)| (*n, v.as_str()))
                        .collect();
                    host.reply(ctx, reply.status, &headers, &reply.body);
                }
            }
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(SluiceStream {
            context_id,
            worker: self.worker.clone(),
            queue_ticket_header: self.queue_ticket_header,
            request: EnvoyHeaders::of(MapType::HttpRequestHeaders),
            awaiting_body: false,
            reading_response: false,
            ended: false,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct SluiceStream {
    context_id: u32,
    worker: Option<Rc<RefCell<Worker>>>,
    queue_ticket_header: bool,
    /// Read once, whether the call is decided on its headers or its body.
    request: EnvoyHeaders,
    /// Held until its body is in: a cost is read from it.
    awaiting_body: bool,
    /// Its response is read for what the call cost.
    reading_response: bool,
    /// Its end was told to the worker (by `on_log`, or on drop).
    ended: bool,
}

impl SluiceStream {
    fn end(&mut self) {
        if std::mem::replace(&mut self.ended, true) {
            return;
        }
        if let Some(worker) = &self.worker {
            if let Ok(mut w) = worker.try_borrow_mut() {
                w.on_stream_end(&EnvoyHost, self.context_id);
            }
        }
    }

    fn decide(&mut self, body: RequestBody<'_>) -> Action {
        let Some(worker) = &self.worker else {
            return Action::Continue;
        };
        let host = EnvoyHost;
        let verdict = match worker.try_borrow_mut() {
            Ok(mut w) => w.on_request_with(&host, self.context_id, &self.request, body),
            Err(_) => return Action::Continue,
        };
        match verdict {
            Verdict::Continue => Action::Continue,
            Verdict::ReadBody => {
                // Envoy turns a pause of the headers into a pause of the
                // whole stream (no body callbacks until resumed), so the
                // headers go on and the body is held instead: a call
                // refused on its body is reset upstream before any of its
                // body is sent.
                self.awaiting_body = true;
                Action::Continue
            }
            Verdict::Pause { ticket } => {
                if self.queue_ticket_header {
                    // Headers changed before the pause go upstream on resume.
                    abi::replace_header(
                        MapType::HttpRequestHeaders,
                        "x-sluice-queue-ticket",
                        ticket.to_string().as_bytes(),
                    );
                }
                Action::Pause
            }
            Verdict::Reply(reply) => {
                let headers: Vec<(&str, &str)> = reply
                    .headers
                    .iter()
                    .map(|(n, v)| (*n, v.as_str()))
                    .collect();
                host.reply(self.context_id, reply.status, &headers, &reply.body);
                Action::Pause
            }
        }
    }
}

impl Context for SluiceStream {}

impl HttpContext for SluiceStream {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let body = if end_of_stream {
            RequestBody::Absent
        } else {
            RequestBody::Coming
        };
        self.decide(body)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !self.awaiting_body {
            return Action::Continue;
        }
        if body_size > MAX_REQUEST_BODY_BYTES {
            // Too large to read for an estimate: decided on the cost's
            // max, without buffering the rest.
            self.awaiting_body = false;
            return self.decide(RequestBody::Read(None));
        }
        if !end_of_stream {
            // Envoy buffers the body until its end.
            return Action::Pause;
        }
        self.awaiting_body = false;
        let body = abi::buffer(BufferType::HttpRequestBody, 0, body_size);
        self.decide(RequestBody::Read(Some(body.as_deref().unwrap_or_default())))
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        if !self.awaiting_body {
            return Action::Continue;
        }
        // A body ended by trailers was not read: decided on the cost's max.
        self.awaiting_body = false;
        self.decide(RequestBody::Read(None))
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let Some(worker) = &self.worker else {
            return Action::Continue;
        };
        let mut told = Vec::new();
        if let Ok(mut w) = worker.try_borrow_mut() {
            if w.reads_response(self.context_id) {
                let headers = EnvoyHeaders::of(MapType::HttpResponseHeaders);
                self.reading_response =
                    w.on_response_headers(&EnvoyHost, self.context_id, &headers, end_of_stream);
                if w.strips_answer(self.context_id) {
                    // Its pieces change length as they pass.
                    abi::remove_header(MapType::HttpResponseHeaders, "content-length");
                }
            }
            if w.tells(self.context_id) {
                told = w.answer_headers(&EnvoyHost, self.context_id);
            }
        }
        // Sluice's view replaces fields of the same name from upstream: it
        // already takes in what the provider said.
        for (name, value) in told {
            self.set_http_response_header(name, Some(&value));
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !self.reading_response {
            return Action::Continue;
        }
        let Some(worker) = &self.worker else {
            return Action::Continue;
        };
        // Passed on as it comes: only this piece is read, never buffered
        // (a stripped answer holds back at most an event's start).
        let chunk = abi::buffer(BufferType::HttpResponseBody, 0, body_size).unwrap_or_default();
        if let Ok(mut w) = worker.try_borrow_mut() {
            let usage_wanted =
                w.on_response_body(&EnvoyHost, self.context_id, &chunk, end_of_stream);
            if let Some(passed) = w.strip_answer(&EnvoyHost, self.context_id, &chunk, end_of_stream)
            {
                if passed != chunk {
                    abi::replace_buffer(BufferType::HttpResponseBody, body_size, &passed);
                }
            }
            self.reading_response = usage_wanted || w.strips_answer(self.context_id);
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        self.end();
    }
}

impl Drop for SluiceStream {
    fn drop(&mut self) {
        // on_log runs for every stream Envoy logs; this covers any other end.
        self.end();
    }
}
