//! The proxy-wasm contexts: they translate Envoy callbacks into calls on the
//! [`Worker`] and carry out the actions it returns. Nothing here decides.

mod abi;

use std::borrow::Cow;
use std::cell::{Cell, OnceCell, RefCell};
use std::rc::Rc;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType, Status};
use sluice_filter_core::matcher::CompiledPolicySet;
use sluice_filter_core::plugin::parse_plugin_config;
use sluice_shared::request_headers::RequestHeaders;
use sluice_shared::time::{Instant, Span};
use sluice_wire::sync_answer::ReceivedHeaders;

use crate::header_pairs::HeaderPairs;
use crate::host::{Host, Level, SetError};
use crate::stream_shell::{Flow, ShellSettings, StreamIo, StreamShell};
use crate::sync::{ReplyBody, SyncReply, SyncSettings, MAX_RESPONSE_BYTES};
use crate::worker::{StreamAction, Worker};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(SluiceRoot::default()) });
}}

/// Envoy's host calls made by one hook.
///
/// A stream's calls (reply, resume, set a header or a log field) act on
/// the hook's own stream unless the effective context is moved first; each
/// move is a host call of its own, and Envoy starts every hook on its own
/// context (and restores it after a nested one), so a move is made only
/// when the stream named is not the one the calls act on already.
struct EnvoyHost {
    acting_on: Cell<Option<u32>>,
}

impl EnvoyHost {
    /// In a root context's hook: no stream's calls yet.
    fn root() -> Self {
        Self {
            acting_on: Cell::new(None),
        }
    }

    /// In stream `context_id`'s own hook.
    fn stream(context_id: u32) -> Self {
        Self {
            acting_on: Cell::new(Some(context_id)),
        }
    }

    /// Makes the next calls act on stream `context_id`; false when it is
    /// gone.
    fn act_on(&self, context_id: u32) -> bool {
        if self.acting_on.get() == Some(context_id) {
            return true;
        }
        if hostcalls::set_effective_context(context_id).is_err() {
            return false;
        }
        self.acting_on.set(Some(context_id));
        true
    }
}

impl Host for EnvoyHost {
    fn now(&self) -> Instant {
        hostcalls::get_current_time().map_or(Instant::EPOCH, Instant::from_system)
    }

    fn monotonic(&self) -> Option<Instant> {
        // SAFETY: a WASI call Envoy's proxy-wasm host answers (clock 1,
        // its dispatcher's monotonic time); it writes only its result.
        unsafe { wasi::clock_time_get(wasi::CLOCKID_MONOTONIC, 1) }
            .ok()
            .map(Instant::from_nanos)
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
        if !self.act_on(context_id) {
            return false;
        }
        hostcalls::send_http_response(status, headers.to_vec(), Some(body)).is_ok()
    }

    fn remove_request_header(&self, name: &str) {
        let _ = abi::remove_header(MapType::HttpRequestHeaders, name);
    }

    fn set_request_header(&self, context_id: u32, name: &str, value: &str) -> bool {
        if !self.act_on(context_id) {
            return false;
        }
        abi::replace_header(MapType::HttpRequestHeaders, name, value.as_bytes())
    }

    fn set_log_field(&self, context_id: u32, field: &str, value: &str) -> bool {
        if !self.act_on(context_id) {
            return false;
        }
        // Envoy keeps it as filter state `wasm.<path>`, printed by
        // `%FILTER_STATE(wasm.sluice.<field>:PLAIN)%`.
        abi::set_property(&["sluice.", field], value.as_bytes())
    }

    fn replace_request_body(&self, old_len: usize, body: &[u8]) -> bool {
        abi::replace_buffer(BufferType::HttpRequestBody, old_len, body)
    }

    fn resume(&self, context_id: u32) -> bool {
        if !self.act_on(context_id) {
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
/// header value can make UTF-8 decoding panic) and kept for a decision
/// made once the body is in. `:authority`, which every policy's match
/// reads and most policies read alone, is read by itself (the cheapest
/// host call, for the commonest case: scenario 6); the first other header
/// asked for brings all of them in one host call, as one call costs more
/// than the serialized map of a few headers.
struct EnvoyHeaders {
    map: MapType,
    authority: OnceCell<Option<Vec<u8>>>,
    pairs: OnceCell<HeaderPairs>,
}

const AUTHORITY: &str = ":authority";

impl EnvoyHeaders {
    fn of(map: MapType) -> Self {
        Self {
            map,
            authority: OnceCell::new(),
            pairs: OnceCell::new(),
        }
    }

    fn pairs(&self) -> &HeaderPairs {
        self.pairs.get_or_init(|| {
            // A map that is gone, or does not read, holds nothing.
            abi::header_pairs(self.map)
                .and_then(HeaderPairs::parse)
                .unwrap_or_default()
        })
    }
}

impl RequestHeaders for EnvoyHeaders {
    fn header(&self, name: &str) -> Option<Cow<'_, [u8]>> {
        if name == AUTHORITY && self.pairs.get().is_none() {
            return self
                .authority
                .get_or_init(|| abi::header(self.map, AUTHORITY))
                .as_deref()
                .map(Cow::Borrowed);
        }
        self.pairs().get(name).map(Cow::Borrowed)
    }
}

#[derive(Default)]
struct SluiceRoot {
    worker: Option<Rc<RefCell<Worker>>>,
    shell: ShellSettings,
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
        let headers =
            ReceivedHeaders::read(|name| abi::header(MapType::HttpCallResponseHeaders, name));
        let body = if body_size > MAX_RESPONSE_BYTES {
            None
        } else {
            abi::buffer(BufferType::HttpCallResponseBody, 0, body_size)
        };
        let reply = SyncReply {
            headers,
            body: if body_size > MAX_RESPONSE_BYTES {
                ReplyBody::TooLarge(body_size)
            } else {
                ReplyBody::Read(body.as_deref())
            },
        };
        if let Ok(mut w) = worker.try_borrow_mut() {
            w.on_sync_reply(&EnvoyHost::root(), token, reply);
        }
    }
}

impl RootContext for SluiceRoot {
    fn on_configure(&mut self, _size: usize) -> bool {
        let host = EnvoyHost::root();
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
        self.shell = ShellSettings::of(&config);
        if config.failure_mode == sluice_filter_core::plugin::FailureMode::Open {
            host.log(
                Level::Warn,
                "sluice: failure_mode open is the native build's: in this wasm filter a failure \
                 follows Envoy's failure_policy (FAIL_OPEN to let calls through)",
            );
        }
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
        w.log_decisions(config.log_decisions);
        w.declare_route_headers(&config.route_headers);
        w.install(&host, set);
        w.set_sync(sync);
        w.start_ticking(&host);
        true
    }

    fn on_tick(&mut self) {
        let Some(worker) = &self.worker else {
            return;
        };
        let host = EnvoyHost::root();
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
                StreamAction::LogField(ctx, field, value) => {
                    host.set_log_field(ctx, field, &value);
                }
                StreamAction::Resume(ctx) => {
                    if !host.resume(ctx) {
                        if let Ok(mut w) = worker.try_borrow_mut() {
                            w.on_resume_failed(&host, ctx);
                        }
                    }
                }
                StreamAction::Reply(ctx, reply) => {
                    host.reply(ctx, reply.status, &reply.header_pairs(), &reply.body);
                }
            }
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(SluiceStream {
            context_id,
            shell: StreamShell::new(context_id, self.shell.clone()),
            io: WasmIo {
                worker: self.worker.clone(),
            },
            request: EnvoyHeaders::of(MapType::HttpRequestHeaders),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct SluiceStream {
    context_id: u32,
    shell: StreamShell,
    io: WasmIo,
    /// Read once, whether the call is decided on its headers or its body.
    request: EnvoyHeaders,
}

impl SluiceStream {
    /// The host calls of this stream's own hook.
    fn host(&self) -> EnvoyHost {
        EnvoyHost::stream(self.context_id)
    }
}

/// A stream's worker (its VM's) and the buffers its hooks reach.
struct WasmIo {
    worker: Option<Rc<RefCell<Worker>>>,
}

impl StreamIo for WasmIo {
    type AnswerHeaders = EnvoyHeaders;

    fn with_worker<R>(&mut self, f: impl FnOnce(&mut Worker) -> R) -> Option<R> {
        // Busy: a reply sent while the worker decides runs the answer's
        // hooks at once.
        let mut w = self.worker.as_ref()?.try_borrow_mut().ok()?;
        Some(f(&mut w))
    }

    fn waits(&mut self) {}

    fn request_body(&mut self, size: usize) -> Option<Vec<u8>> {
        abi::buffer(BufferType::HttpRequestBody, 0, size)
    }

    fn answer_headers(&self) -> EnvoyHeaders {
        EnvoyHeaders::of(MapType::HttpResponseHeaders)
    }

    fn set_answer_header(&mut self, name: &str, value: Option<&[u8]>) {
        match value {
            Some(value) => abi::replace_header(MapType::HttpResponseHeaders, name, value),
            None => abi::remove_header(MapType::HttpResponseHeaders, name),
        };
    }

    fn answer_piece(&mut self, size: usize) -> Vec<u8> {
        abi::buffer(BufferType::HttpResponseBody, 0, size).unwrap_or_default()
    }

    fn replace_answer_piece(&mut self, size: usize, passed: &[u8]) {
        abi::replace_buffer(BufferType::HttpResponseBody, size, passed);
    }
}

fn action(flow: Flow) -> Action {
    match flow {
        Flow::Continue => Action::Continue,
        // After the headers, a pause is Envoy's StopIteration: with the
        // plugin's `allow_on_headers_stop_iteration` the body still comes
        // to this filter (without it, Envoy stops the whole stream and
        // the body wait ends it, see `Worker::on_tick`).
        Flow::Hold | Flow::AwaitBody => Action::Pause,
    }
}

impl Context for SluiceStream {}

impl HttpContext for SluiceStream {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let flow =
            self.shell
                .on_request_headers(&self.host(), &mut self.io, &self.request, end_of_stream);
        action(flow)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let flow = self.shell.on_request_body(
            &self.host(),
            &mut self.io,
            &self.request,
            body_size,
            end_of_stream,
        );
        action(flow)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        action(
            self.shell
                .on_request_trailers(&self.host(), &mut self.io, &self.request),
        )
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        self.shell
            .on_answer_headers(&self.host(), &mut self.io, end_of_stream);
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.shell
            .on_answer_body(&self.host(), &mut self.io, body_size, end_of_stream);
        Action::Continue
    }

    fn on_log(&mut self) {
        self.shell.end(&self.host(), &mut self.io);
    }
}

impl Drop for SluiceStream {
    fn drop(&mut self) {
        // on_log runs for every stream Envoy logs; this covers any other end.
        self.shell.end(&self.host(), &mut self.io);
    }
}
