//! One stream's hooks, turned into calls on its worker and its verdicts
//! into what Envoy does next: the part of a stream both builds share. Each
//! build's stream (the proxy-wasm context, the dynamic module's stream)
//! holds a [`StreamShell`], gives it a [`Host`] and a [`StreamIo`] for its
//! Envoy, and maps [`Flow`] to its own statuses. Nothing here decides: the
//! worker does.

use sluice_shared::request_headers::RequestHeaders;

use crate::host::Host;
use sluice_shared::policy::PoolSpec;

use crate::worker::{Attempt, AttemptMark, RequestBody, Verdict, Worker, MAX_REQUEST_BODY_BYTES};

/// What the stream does after a hook.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    /// It goes on.
    Continue,
    /// It stops here, what came of it buffered (a call waiting in the
    /// queue, a body read to its end, an answer sent by Sluice).
    Hold,
    /// Its headers stop here while its body comes on to this filter, to
    /// be read before anything of the call goes upstream: a call refused
    /// on its body never reaches the upstream. Only after the request's
    /// headers (proxy-wasm needs `allow_on_headers_stop_iteration` for
    /// it; the dynamic module's `StopIteration`).
    AwaitBody,
}

/// What a stream's shell asks of its Envoy beyond [`Host`]: its worker,
/// and its bodies and answer's headers, which only its own hooks reach.
pub trait StreamIo {
    /// The answer's headers, read as the worker asks for them.
    type AnswerHeaders: RequestHeaders;

    /// Runs `f` on the stream's worker; None when there is none to be had
    /// (a worker that failed to start, or is busy with a call that led
    /// here): the stream then passes untouched.
    fn with_worker<R>(&mut self, f: impl FnOnce(&mut Worker) -> R) -> Option<R>;
    /// The call waits in the queue: a tick will resume or answer it.
    fn waits(&mut self);
    /// The request's body read to its end: at most `size` bytes of it.
    fn request_body(&mut self, size: usize) -> Option<Vec<u8>>;
    fn answer_headers(&self) -> Self::AnswerHeaders;
    /// Sets (None: removes) a header of the answer.
    fn set_answer_header(&mut self, name: &str, value: Option<&[u8]>);
    /// The answer's piece now passing (`size` bytes).
    fn answer_piece(&mut self, size: usize) -> Vec<u8>;
    /// Puts `passed` in place of the piece now passing (`size` bytes).
    fn replace_answer_piece(&mut self, size: usize, passed: &[u8]);
}

/// What a stream's shell takes from the plugin's configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShellSettings {
    /// A waiting call's request carries its place in the queue
    /// (`x-sluice-queue-ticket`).
    pub queue_ticket_header: bool,
    /// A call decided on its body holds its headers until then
    /// (`hold_headers_for_body`).
    pub hold_headers_for_body: bool,
    /// Tests of the failure mode only (`panic_on_header`).
    pub panic_on_header: Option<std::sync::Arc<str>>,
    /// It hears attempts of pool calls instead of deciding calls (plugin
    /// `role: attempts`, an upstream filter of the member clusters).
    pub hears_attempts: bool,
}

impl ShellSettings {
    pub fn of(config: &sluice_filter_core::plugin::PluginConfig) -> Self {
        Self {
            queue_ticket_header: config.queue_ticket_header,
            hold_headers_for_body: config.hold_headers_for_body,
            panic_on_header: config.panic_on_header.as_deref().map(std::sync::Arc::from),
            hears_attempts: config.role == sluice_filter_core::plugin::Role::Attempts,
        }
    }
}

impl Default for ShellSettings {
    fn default() -> Self {
        Self {
            queue_ticket_header: false,
            hold_headers_for_body: true,
            panic_on_header: None,
            hears_attempts: false,
        }
    }
}

/// A stream's state between its hooks.
#[derive(Debug)]
pub struct StreamShell {
    context_id: u32,
    settings: ShellSettings,
    /// Held until its body is in: a cost is read from it.
    awaiting_body: bool,
    /// Its answer is read for what the call cost, or rewritten.
    reading_answer: bool,
    /// Its end was told to the worker.
    ended: bool,
    /// It waited in the queue.
    waited: bool,
    /// The pool call attempt it is (`hears_attempts`), its answer to come.
    attempt: Option<Attempt>,
}

impl StreamShell {
    /// Stream `context_id`.
    pub fn new(context_id: u32, settings: ShellSettings) -> Self {
        Self {
            context_id,
            settings,
            awaiting_body: false,
            reading_answer: false,
            ended: false,
            waited: false,
            attempt: None,
        }
    }

    pub fn context_id(&self) -> u32 {
        self.context_id
    }

    /// Whether it waited in the queue at some point.
    pub fn waited(&self) -> bool {
        self.waited
    }

    fn decide<H, Io, R>(
        &mut self,
        host: &H,
        io: &mut Io,
        request: &R,
        body: RequestBody<'_>,
    ) -> Flow
    where
        H: Host + ?Sized,
        Io: StreamIo + ?Sized,
        R: RequestHeaders + ?Sized,
    {
        let id = self.context_id;
        let Some(verdict) = io.with_worker(|w| w.on_request_with(host, id, request, body)) else {
            return Flow::Continue;
        };
        // The worker is free again: a reply runs the answer's hooks at once.
        match verdict {
            Verdict::Continue => Flow::Continue,
            Verdict::ReadBody => {
                // Nothing goes upstream before the decision: the router
                // would open the upstream request on the headers alone,
                // and a refused call would reach the provider (cut off,
                // but counted there).
                self.awaiting_body = true;
                if self.settings.hold_headers_for_body {
                    Flow::AwaitBody
                } else {
                    // The host cannot hold the headers and still bring the
                    // body: they go on, and a call refused on its body is
                    // reset upstream (the upstream saw it begin).
                    Flow::Continue
                }
            }
            Verdict::Pause { ticket } => {
                if self.settings.queue_ticket_header {
                    // Headers changed before the pause go upstream on resume.
                    host.set_request_header(id, "x-sluice-queue-ticket", &ticket.to_string());
                }
                io.waits();
                self.waited = true;
                Flow::Hold
            }
            Verdict::Reply(reply) => {
                host.reply(id, reply.status, &reply.header_pairs(), &reply.body);
                Flow::Hold
            }
        }
    }

    pub fn on_request_headers<H, Io, R>(
        &mut self,
        host: &H,
        io: &mut Io,
        request: &R,
        end_of_stream: bool,
    ) -> Flow
    where
        H: Host + ?Sized,
        Io: StreamIo + ?Sized,
        R: RequestHeaders + ?Sized,
    {
        if let Some(name) = &self.settings.panic_on_header {
            if request.header(name).is_some() {
                panic!("sluice: {name} asked for a panic (panic_on_header, for tests)");
            }
        }
        if self.settings.hears_attempts {
            // An attempt is decided already: it goes, heard on its answer.
            self.attempt = io.with_worker(|w| w.on_attempt(host, request)).flatten();
            return Flow::Continue;
        }
        let body = if end_of_stream {
            RequestBody::Absent
        } else {
            RequestBody::Coming
        };
        self.decide(host, io, request, body)
    }

    /// A piece of the request's body came; `size`: all of it so far.
    pub fn on_request_body<H, Io, R>(
        &mut self,
        host: &H,
        io: &mut Io,
        request: &R,
        size: usize,
        end_of_stream: bool,
    ) -> Flow
    where
        H: Host + ?Sized,
        Io: StreamIo + ?Sized,
        R: RequestHeaders + ?Sized,
    {
        if !self.awaiting_body {
            // A call waiting in the queue since its headers: its body
            // waits with it (a body let on would take its headers along).
            if self.waited && io.with_worker(|w| w.is_waiting(self.context_id)) == Some(true) {
                return Flow::Hold;
            }
            return Flow::Continue;
        }
        if size > MAX_REQUEST_BODY_BYTES {
            // Too large to read: decided as unreadable, without buffering
            // the rest.
            self.awaiting_body = false;
            return self.decide(host, io, request, RequestBody::Read(None));
        }
        if !end_of_stream {
            // Envoy buffers the body until its end.
            return Flow::Hold;
        }
        self.awaiting_body = false;
        let body = io.request_body(size);
        self.decide(host, io, request, RequestBody::Read(body.as_deref()))
    }

    pub fn on_request_trailers<H, Io, R>(&mut self, host: &H, io: &mut Io, request: &R) -> Flow
    where
        H: Host + ?Sized,
        Io: StreamIo + ?Sized,
        R: RequestHeaders + ?Sized,
    {
        if !self.awaiting_body {
            if self.waited && io.with_worker(|w| w.is_waiting(self.context_id)) == Some(true) {
                return Flow::Hold;
            }
            return Flow::Continue;
        }
        // A body ended by trailers (HTTP/2, gRPC): all of it is buffered
        // by now, and read as one ended without them.
        self.awaiting_body = false;
        let body = io
            .request_body(MAX_REQUEST_BODY_BYTES + 1)
            .filter(|b| b.len() <= MAX_REQUEST_BODY_BYTES);
        self.decide(host, io, request, RequestBody::Read(body.as_deref()))
    }

    pub fn on_answer_headers<H, Io>(&mut self, host: &H, io: &mut Io, end_of_stream: bool)
    where
        H: Host + ?Sized,
        Io: StreamIo + ?Sized,
    {
        if self.settings.hears_attempts {
            self.attempt_answered(host, io);
            return;
        }
        let id = self.context_id;
        let headers = io.answer_headers();
        let Some(answer) =
            io.with_worker(|w| w.on_answer_headers(host, id, &headers, end_of_stream))
        else {
            return;
        };
        for name in answer.unset {
            io.set_answer_header(name, None);
        }
        self.reading_answer = answer.read_body;
        if answer.strips {
            // Its pieces change length as they pass.
            io.set_answer_header("content-length", None);
        }
        // Sluice's view replaces fields of the same name from upstream: it
        // already takes in what the provider said.
        for (name, value) in answer.set {
            io.set_answer_header(name, Some(value.as_bytes()));
        }
    }

    /// An attempt's answer came: its member hears it, and it is marked
    /// for the deciding filter; the member's name was for this filter
    /// alone.
    fn attempt_answered<H, Io>(&mut self, host: &H, io: &mut Io)
    where
        H: Host + ?Sized,
        Io: StreamIo + ?Sized,
    {
        let Some(attempt) = self.attempt.take() else {
            return;
        };
        let headers = io.answer_headers();
        let mark = io
            .with_worker(|w| w.on_attempt_answer(host, &attempt, &headers))
            .flatten();
        if let Some(mark) = mark {
            io.set_answer_header(PoolSpec::ATTEMPT_MEMBER_HEADER, None);
            io.set_answer_header(AttemptMark::HEADER, Some(mark.value().as_bytes()));
        }
    }

    /// A piece of the answer (`size` bytes) passes: read for its usage, or
    /// rewritten, never buffered (a stripped answer holds back at most an
    /// event's start).
    pub fn on_answer_body<H, Io>(&mut self, host: &H, io: &mut Io, size: usize, end_of_stream: bool)
    where
        H: Host + ?Sized,
        Io: StreamIo + ?Sized,
    {
        if !self.reading_answer {
            return;
        }
        let id = self.context_id;
        let piece = io.answer_piece(size);
        let Some(answer) = io.with_worker(|w| w.on_answer_body(host, id, &piece, end_of_stream))
        else {
            return;
        };
        if let Some(passed) = answer.passed.filter(|p| *p != piece) {
            io.replace_answer_piece(piece.len(), &passed);
        }
        self.reading_answer = answer.more;
    }

    /// The stream ended (logged, or dropped): told to the worker once.
    pub fn end<H, Io>(&mut self, host: &H, io: &mut Io)
    where
        H: Host + ?Sized,
        Io: StreamIo + ?Sized,
    {
        if std::mem::replace(&mut self.ended, true) {
            return;
        }
        let id = self.context_id;
        io.with_worker(|w| w.on_stream_end(host, id));
    }
}
