//! One simulated Envoy: its workers (the real [`Worker`], each behind its
//! own [`SimHost`] over the Envoy's shared data), and each stream driven
//! through the real [`StreamShell`], the hooks both builds share.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::rc::Rc;

use sluice_filter::stream_shell::{Flow, ShellSettings, StreamIo, StreamShell};
use sluice_filter::sync::{ReplyBody, SyncReply, SyncSettings};
use sluice_filter::worker::{StreamAction, Worker};
use sluice_filter_core::matcher::CompiledPolicySet;
use sluice_shared::time::{Instant, Span};

use crate::headers::Headers;
use crate::host::{EnvoyShared, HostEffect, HttpCall, SimHost};
use crate::rng::SimRng;
use sluice_wire::sync_answer::{HttpAnswer, ReceivedHeaders};

/// One worker and its host.
pub struct SimWorker {
    pub worker: Worker,
    pub host: SimHost,
    /// The tick period the next tick was scheduled with.
    pub scheduled: Span,
    /// Bumped when the tick is scheduled again: older ticks are stale.
    pub tick_generation: u64,
    /// When it last ticked (applying the shares in force then).
    pub ticked_at: Option<Instant>,
}

/// What became of a call as its request's headers passed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Passage {
    /// On to the upstream, with these headers.
    Upstream(Headers),
    /// Waiting in the queue.
    Queued,
    /// Answered by Sluice.
    Refused(u32, Headers),
}

struct Stream {
    shell: StreamShell,
    worker: usize,
    request: Headers,
}

pub struct SimEnvoy {
    pub shared: Rc<EnvoyShared>,
    pub workers: Vec<SimWorker>,
    streams: BTreeMap<u32, Stream>,
    next_stream: u32,
    /// The attempts filter's workers (`role: attempts`, an upstream filter
    /// of the pool's member clusters), one beside each worker, whose
    /// thread runs the call's attempts too (none: not configured).
    attempts: Vec<SimWorker>,
    /// Each call's attempt now with the upstream, as that filter holds it.
    attempt_shells: BTreeMap<u32, StreamShell>,
}

/// A stream's Envoy side, as the shell sees it.
struct Io<'a> {
    worker: &'a mut Worker,
    waits: bool,
    answer: Headers,
    /// The request's body, buffered whole.
    body: Option<&'a [u8]>,
    /// The answer's piece now passing.
    piece: Vec<u8>,
}

impl<'a> Io<'a> {
    fn new(worker: &'a mut Worker) -> Self {
        Self {
            worker,
            waits: false,
            answer: Headers::default(),
            body: None,
            piece: Vec::new(),
        }
    }
}

impl StreamIo for Io<'_> {
    type AnswerHeaders = Headers;

    fn with_worker<R>(&mut self, f: impl FnOnce(&mut Worker) -> R) -> Option<R> {
        Some(f(self.worker))
    }

    fn waits(&mut self) {
        self.waits = true;
    }

    fn request_body(&mut self, size: usize) -> Option<Vec<u8>> {
        self.body.map(|b| b[..size.min(b.len())].to_vec())
    }

    fn answer_headers(&self) -> Headers {
        self.answer.clone()
    }

    fn set_answer_header(&mut self, name: &str, value: Option<&[u8]>) {
        match value {
            Some(v) => self.answer.set(name, &String::from_utf8_lossy(v)),
            None => self.answer.remove(name),
        }
    }

    fn answer_piece(&mut self, size: usize) -> Vec<u8> {
        self.piece[..size.min(self.piece.len())].to_vec()
    }

    fn replace_answer_piece(&mut self, _size: usize, passed: &[u8]) {
        self.piece = passed.to_vec();
    }
}

impl SimEnvoy {
    /// An Envoy of `workers` workers enforcing `policies` (a set's JSON)
    /// until the admin, if it syncs with one (`sync`), sends its own.
    pub fn new(
        (index, workers): (usize, usize),
        policies: &str,
        sync: Option<&SyncSettings>,
        clock: &Rc<Cell<Instant>>,
        rng: &Rc<RefCell<SimRng>>,
    ) -> Result<Self, String> {
        let shared = Rc::new(EnvoyShared::default());
        let mut built = Vec::with_capacity(workers);
        for w in 0..workers {
            let host = SimHost::new(
                Rc::clone(clock),
                Rc::clone(&shared),
                Rc::clone(rng),
                (w, crate::rng::splitmix64((index as u64) << 32 | w as u64)),
            );
            let set = CompiledPolicySet::from_json(policies).map_err(|e| e.to_string())?;
            let mut worker = Worker::new(&host);
            worker.set_sync(sync.cloned());
            worker.install(&host, set);
            worker.start_ticking(&host);
            let scheduled = host.tick.get();
            built.push(SimWorker {
                worker,
                host,
                scheduled,
                tick_generation: 0,
                ticked_at: None,
            });
        }
        Ok(Self {
            shared,
            workers: built,
            streams: BTreeMap::new(),
            next_stream: 1,
            attempts: Vec::new(),
            attempt_shells: BTreeMap::new(),
        })
    }

    /// The member clusters run the attempts filter, with the listener's
    /// configuration (`policies`, `sync`); Envoy `index`'s.
    pub fn hear_attempts(
        &mut self,
        index: usize,
        policies: &str,
        sync: Option<&SyncSettings>,
        (clock, rng): (&Rc<Cell<Instant>>, &Rc<RefCell<SimRng>>),
    ) -> Result<(), String> {
        let workers = self.workers.len();
        for w in 0..workers {
            let host = SimHost::new(
                Rc::clone(clock),
                Rc::clone(&self.shared),
                Rc::clone(rng),
                (
                    workers + w,
                    crate::rng::splitmix64((index as u64) << 32 | (workers + w) as u64),
                ),
            );
            let set = CompiledPolicySet::from_json(policies).map_err(|e| e.to_string())?;
            let mut worker = Worker::new(&host);
            worker.set_sync(sync.cloned());
            worker.install(&host, set);
            let scheduled = host.tick.get();
            self.attempts.push(SimWorker {
                worker,
                host,
                scheduled,
                tick_generation: 0,
                ticked_at: None,
            });
        }
        Ok(())
    }

    /// An attempt of call `id` (its request as Sluice passed it on) goes
    /// upstream: the attempts filter's request hook runs.
    pub fn attempt_goes(&mut self, id: u32, request: &Headers) {
        let Some(worker) = self.streams.get(&id).map(|s| s.worker) else {
            return;
        };
        let Some(w) = self.attempts.get_mut(worker) else {
            return;
        };
        let settings = ShellSettings {
            hears_attempts: true,
            ..ShellSettings::default()
        };
        let mut shell = StreamShell::new(id, settings);
        let mut io = Io::new(&mut w.worker);
        shell.on_request_headers(&w.host, &mut io, request, true);
        w.host.take_effects();
        self.attempt_shells.insert(id, shell);
    }

    /// The attempt's answer came back: the attempts filter's answer hook
    /// runs, and the answer goes on as it left it. Its worker then ticks:
    /// it holds no call, and its tick flushes its stats.
    pub fn attempt_answered(&mut self, id: u32, answer: Headers) -> Headers {
        let Some(mut shell) = self.attempt_shells.remove(&id) else {
            return answer;
        };
        let Some(worker) = self.streams.get(&id).map(|s| s.worker) else {
            return answer;
        };
        let Some(w) = self.attempts.get_mut(worker) else {
            return answer;
        };
        let mut io = Io::new(&mut w.worker);
        io.answer = answer;
        shell.on_answer_headers(&w.host, &mut io, true);
        shell.end(&w.host, &mut io);
        let answer = std::mem::take(&mut io.answer);
        w.worker.on_tick(&w.host);
        w.host.take_effects();
        answer
    }

    /// A call's request (its headers, then its body if it has one, all
    /// at once) reaches worker `worker`: its stream id and what became of
    /// it.
    pub fn request(
        &mut self,
        worker: usize,
        (request, body): (Headers, Option<&[u8]>),
    ) -> (u32, Passage) {
        let id = self.next_stream;
        self.next_stream = self.next_stream.wrapping_add(1).max(1);
        let mut shell = StreamShell::new(id, ShellSettings::default());
        let w = &mut self.workers[worker];
        let mut io = Io::new(&mut w.worker);
        io.body = body;
        let mut flow = shell.on_request_headers(&w.host, &mut io, &request, body.is_none());
        if let (Some(body), Flow::Continue | Flow::AwaitBody) = (body, &flow) {
            flow = shell.on_request_body(&w.host, &mut io, &request, body.len(), true);
        }
        let waits = io.waits;
        let mut stream = Stream {
            shell,
            worker,
            request,
        };
        let passage = match flow {
            Flow::Continue => {
                apply_header_effects(&mut stream.request, id, w.host.take_effects());
                Passage::Upstream(stream.request.clone())
            }
            Flow::Hold if waits => Passage::Queued,
            Flow::Hold | Flow::AwaitBody => match reply_of(id, w.host.take_effects()) {
                Some((status, headers)) => {
                    // Envoy ends the stream after the local reply.
                    self.end(worker, &mut stream);
                    return (id, Passage::Refused(status, headers));
                }
                None => Passage::Queued,
            },
        };
        self.streams.insert(id, stream);
        (id, passage)
    }

    /// The upstream's answer to stream `id` reached Envoy, its headers
    /// then each piece of its body: its hooks run and the stream ends.
    pub fn answer(&mut self, id: u32, (answer, body): (&Headers, &[Vec<u8>])) {
        let Some(mut stream) = self.streams.remove(&id) else {
            return;
        };
        let w = &mut self.workers[stream.worker];
        let mut io = Io::new(&mut w.worker);
        io.answer = answer.clone();
        stream
            .shell
            .on_answer_headers(&w.host, &mut io, body.is_empty());
        for (at, piece) in body.iter().enumerate() {
            io.piece.clone_from(piece);
            let last = at + 1 == body.len();
            stream
                .shell
                .on_answer_body(&w.host, &mut io, piece.len(), last);
        }
        w.host.take_effects();
        self.end(stream.worker, &mut stream);
    }

    /// The caller left stream `id` before its answer.
    pub fn abandon(&mut self, id: u32) {
        if let Some(mut stream) = self.streams.remove(&id) {
            self.end(stream.worker, &mut stream);
        }
    }

    fn end(&mut self, worker: usize, stream: &mut Stream) {
        let w = &mut self.workers[worker];
        let mut io = Io::new(&mut w.worker);
        stream.shell.end(&w.host, &mut io);
        w.host.take_effects();
    }

    /// Worker `worker`'s tick: the streams it resumed or answered.
    pub fn tick(&mut self, worker: usize) -> Vec<(u32, Passage)> {
        let w = &mut self.workers[worker];
        let actions = w.worker.on_tick(&w.host);
        w.host.take_effects();
        let mut out = Vec::new();
        for action in actions {
            match action {
                StreamAction::SetHeader(id, name, value) => {
                    if let Some(stream) = self.streams.get_mut(&id) {
                        stream.request.set(&name, &value);
                    }
                }
                StreamAction::LogField(..) => {}
                StreamAction::Resume(id) => {
                    if let Some(stream) = self.streams.get(&id) {
                        out.push((id, Passage::Upstream(stream.request.clone())));
                    }
                }
                StreamAction::Reply(id, reply) => {
                    if let Some(mut stream) = self.streams.remove(&id) {
                        let headers = Headers::of(&reply.header_pairs());
                        self.end(stream.worker, &mut stream);
                        out.push((id, Passage::Refused(reply.status, headers)));
                    }
                }
            }
        }
        out
    }

    /// The calls its workers dispatched since last asked.
    pub fn take_calls(&self) -> Vec<HttpCall> {
        std::mem::take(&mut self.shared.calls.borrow_mut())
    }

    /// The admin's answer to worker `worker`'s call `token` reached it,
    /// or (None) Envoy gave up on the call (refused, timed out).
    pub fn sync_reply(&mut self, worker: usize, token: u32, answer: Option<&HttpAnswer>) {
        let header = |name: &str| {
            answer.and_then(|a| {
                a.headers
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| v.as_bytes())
            })
        };
        let status = answer.map(|a| a.status.to_string());
        let headers = ReceivedHeaders::read(|name| match name {
            ":status" => status.as_deref().map(str::as_bytes),
            name => header(name),
        });
        let reply = SyncReply {
            headers,
            body: ReplyBody::Read(answer.map(|a| a.body.as_slice())),
        };
        let w = &mut self.workers[worker];
        w.worker.on_sync_reply(&w.host, token, reply);
        w.host.take_effects();
    }

    /// Streams still open (waiting, or with the upstream).
    pub fn open_streams(&self) -> usize {
        self.streams.len()
    }
}

fn apply_header_effects(request: &mut Headers, id: u32, effects: Vec<HostEffect>) {
    for effect in effects {
        match effect {
            HostEffect::SetHeader {
                context_id,
                name,
                value,
            } if context_id == id => request.set(&name, &value),
            HostEffect::RemoveHeader { name } => request.remove(&name),
            _ => {}
        }
    }
}

fn reply_of(id: u32, effects: Vec<HostEffect>) -> Option<(u32, Headers)> {
    effects.into_iter().find_map(|effect| match effect {
        HostEffect::Reply {
            context_id,
            status,
            headers,
        } if context_id == id => Some((
            status,
            Headers(
                headers
                    .into_iter()
                    .map(|(n, v)| (n, v.into_bytes()))
                    .collect(),
            ),
        )),
        _ => None,
    })
}
