//! The filter's logic inside one Envoy worker VM, free of proxy-wasm: it
//! decides through `sluice-shared` and talks to Envoy through [`Host`].
//!
//! [`Worker`] only coordinates what Envoy asks of it: a request, its
//! answer's headers and body, a tick, a stream's end, the admin's answer
//! to a sync (`Worker::on_*`). For each event it builds one `Ctx`
//! (`ctx.rs`: Envoy behind the worker's clock, shared data, stats, its
//! holder id and the time), which every part takes as `&mut`. Each part
//! owns its state:
//!
//! - [`request`]: a request's path from its body to its verdict (an MCP
//!   batch split across policies: [`split_batch`]);
//! - [`admission`]: how a request is decided (start reading there);
//! - [`refusal`]: the reply a refused request gets ([`rpc_reply`]: as JSON-RPC);
//! - [`placement`]: which bucket of a keyed policy a request uses;
//! - [`streams`]: admitted and queued streams, their slots and leases;
//! - [`queue`]: turns for queued streams, and their timeouts;
//! - [`sync_client`]: policy sets and reports to and from the admin
//!   (its answers taken apart: [`sync_reply`]);
//! - [`decision_log`]: what Envoy's access log says of each decision;
//! - [`shares`]: fleet mode's shares of global policies;
//! - [`budgets`]: long limits the admin holds across restarts;
//! - [`call`]: what each feature keeps of a call to act on its answer,
//!   and the order they act in.
//!
//! Host actions that can call back into the VM (a local reply, resuming a paused stream) are
//! returned to the caller instead of performed here, so the glue runs them once the worker is free.

mod admission;
mod asked_usage;
mod attempts;
mod body_wait;
mod budgets;
mod call;
mod ctx;
mod decision_log;
mod downgrade;
mod fair;
mod held_slot;
mod key_counts;
mod key_places;
mod limits;
mod listened;
mod placement;
mod pool;
mod probe;
mod provider;
mod queue;
mod refusal;
mod request;
mod retry;
mod rpc_reply;
mod rungs;
mod shares;
mod slots;
mod spend;
mod split_batch;
mod streams;
mod sync_client;
mod sync_reply;
mod sync_report;
mod telling;
mod to_shell;
mod usage;
mod warnings;

use std::sync::Arc;

use sluice_filter_core::matcher::CompiledPolicySet;
use sluice_shared::key_hash::KeySecret;
use sluice_shared::request_headers::RequestHeaders;
use sluice_shared::time::{Instant, Span};

use crate::clock::{Clock, Clocked};
use crate::host::{Host, Level};
use crate::metrics::{FilterCounter, Metrics, PolicySeries};
use crate::prefetch::Prefetches;
use crate::store::Store;
use crate::sync::{SyncReply, SyncSettings};

pub use admission::Verdict;
pub use attempts::{Attempt, AttemptMark};
pub use call::{AnswerHeaders, AnswerPiece};
pub use decision_log::Field as LogField;
pub use to_shell::{LocalReply, StreamAction};
pub use usage::MAX_HELD_BYTES;

use budgets::Budgets;
use ctx::Ctx;
use decision_log::DecisionLog;
use shares::FleetShares;
use streams::Streams;
use sync_client::SyncClient;

/// A request's body, as far as deciding it is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestBody<'a> {
    /// None follows the headers.
    Absent,
    /// A body follows: a policy that reads it answers [`Verdict::ReadBody`].
    Coming,
    /// The body, read (None: too large to read).
    Read(Option<&'a [u8]>),
}

/// The most of a request's body read for an estimate; a larger one is
/// estimated at the cost's `max`.
pub const MAX_REQUEST_BODY_BYTES: usize = 1024 * 1024;

/// Tick period with nobody waiting: lease renewal and stats only.
pub const IDLE_TICK: Span = Span::from_millis(100);
/// Tick period while requests wait: how promptly a turn is noticed.
pub const QUEUE_TICK: Span = Span::from_millis(1);
/// Tick while prefetches hold spare slots: lapsed ones go back within it
/// (they count against `max_in_flight` meanwhile, and a bucket lets a
/// worker prefetch only while it has 4 times as many free).
pub const PREFETCH_TICK: Span = Span::from_millis(20);
/// Tick with nobody waiting while the admin pushes policy sets: how soon
/// every worker installs a set one VM received (a read of its version in
/// shared data per tick).
pub const PUSH_TICK: Span = Span::from_millis(20);

pub struct Worker {
    /// The wall clock made monotonic (see [`crate::clock`]).
    clock: Clock,
    store: Store,
    metrics: Metrics,
    holder: u64,
    /// Decisions noted during an event, for Envoy's access log.
    decisions: DecisionLog,
    /// Each part's own state; every event reaches them with one [`Ctx`].
    parts: Parts,
}

/// What [`Worker`] coordinates, each part owning its state.
struct Parts {
    policies: Arc<CompiledPolicySet>,
    /// Each policy's stats, in the order of `policies`.
    series: Vec<PolicySeries>,
    tick: Span,
    prefetches: Prefetches,
    streams: Streams,
    /// What each feature keeps of a call to act on its answer.
    calls: call::Calls,
    /// The headers pools route by: a caller's own are removed.
    route_headers: pool::RouteHeaders,
    /// Calls whose headers wait for their body.
    body_waits: body_wait::BodyWaits,
    sync: SyncClient,
    shares: FleetShares,
    budgets: Budgets,
    /// What keys are hashed with; the same in every VM of the process.
    key_secret: KeySecret,
    /// What keys of limits of an hour or longer are hashed with, and
    /// their labels for the live view.
    spend_labels: spend::SpendLabels,
    /// When this worker last polled its queues (the previous tick).
    last_queue_poll: Instant,
    /// Queue heads their further limits refused, until they ask again.
    head_holds: queue::HeadHolds,
    /// Policies naming a port whose requests came without one, noticed
    /// here (logged once per Envoy).
    port_hidden: rustc_hash::FxHashSet<String>,
    /// What the attempts filter marks the attempts it heard with.
    attempt_mark: AttemptMark,
    /// Whether attempts naming no member were logged.
    attempts_unnamed: attempts::Unnamed,
}

/// When an event is handled: at a fresh reading of the clock; at its last
/// reading (`Recent`: the end of a stream, which settles nothing by the
/// clock unless it reads it); or not read yet (`Unread`: a request, which
/// reads it only once it is known to be limited, see [`Ctx::reuse_clock`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum When {
    Fresh,
    Recent,
    Unread,
}

impl Worker {
    /// A worker with a lease-holder id of its own, enforcing nothing yet.
    pub fn new<H: Host + ?Sized>(host: &H) -> Self {
        let mut store = Store::default();
        let holder = store.allocate_holder(host);
        let key_secret = store.key_secret(host);
        Self {
            clock: Clock::default(),
            store,
            metrics: Metrics::default(),
            holder,
            decisions: DecisionLog::default(),
            parts: Parts {
                policies: Arc::new(CompiledPolicySet::empty()),
                series: Vec::new(),
                tick: IDLE_TICK,
                prefetches: Prefetches::default(),
                streams: Streams::default(),
                calls: call::Calls::default(),
                route_headers: pool::RouteHeaders::default(),
                body_waits: body_wait::BodyWaits::default(),
                sync: SyncClient::default(),
                shares: FleetShares::default(),
                budgets: Budgets::default(),
                key_secret,
                spend_labels: spend::SpendLabels::default(),
                last_queue_poll: Instant::EPOCH,
                head_holds: queue::HeadHolds::default(),
                port_hidden: Default::default(),
                attempt_mark: AttemptMark::of(&key_secret),
                attempts_unnamed: Default::default(),
            },
        }
    }

    /// Handles one event: the host behind this worker's clock, and the one
    /// context built for it.
    fn event<H: Host + ?Sized, R>(
        &mut self,
        host: &H,
        when: When,
        f: impl FnOnce(&mut Parts, &mut Ctx<'_, Clocked<'_, H>>) -> R,
    ) -> R {
        let clock = &self.clock;
        let host = &Clocked { host, clock };
        let (now, fresh) = match when {
            When::Fresh => (host.now(), true),
            When::Recent => match clock.last_reading() {
                Some(recent) => (recent, false),
                None => (host.now(), true),
            },
            When::Unread => (Instant::EPOCH, false),
        };
        let mut ctx = Ctx {
            host,
            clock,
            store: &mut self.store,
            metrics: &mut self.metrics,
            decisions: &mut self.decisions,
            holder: self.holder,
            now,
            fresh,
        };
        f(&mut self.parts, &mut ctx)
    }

    /// Runs this worker's clock at `scale` of real time (plugin
    /// `time_scale`; 1 is real time), its ticks and call timeouts
    /// stretched to match.
    pub fn set_time_scale(&mut self, scale: f64) {
        self.clock.set_scale(scale);
    }

    /// The tick period this worker wants, in real time.
    pub fn start_ticking<H: Host + ?Sized>(&mut self, host: &H) {
        self.event(host, When::Recent, |parts, ctx| {
            ctx.host.set_tick_period(parts.tick)
        });
    }

    /// The headers Envoy's routes match that only Sluice may set (the
    /// plugin's `route_headers`): removed from every request from now on.
    pub fn declare_route_headers(&mut self, names: &[String]) {
        self.parts.route_headers.declare(names);
    }

    /// Where to sync from (None: enforce the fallback set only).
    pub fn set_sync(&mut self, settings: Option<SyncSettings>) {
        self.parts
            .spend_labels
            .configure(settings.as_ref().map(|s| s.token.as_deref()));
        // Keyed budgets are held when their keys hash alike after a
        // restart: with the label secret.
        self.parts.budgets.configure(
            settings.is_some(),
            self.parts.spend_labels.secret().is_some(),
        );
        self.parts.sync.configure(settings);
    }

    /// Version of the admin's set this worker enforces (0: the fallback).
    pub fn admin_version(&self) -> u64 {
        self.parts.sync.admin_version()
    }

    pub fn holder(&self) -> u64 {
        self.holder
    }

    pub fn policies(&self) -> &CompiledPolicySet {
        &self.parts.policies
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    pub fn in_flight(&self) -> usize {
        self.parts.streams.holding()
    }

    /// The share of each global policy (by its name) and global further
    /// limit (as `policy/limit`) this worker enforces, as of its last
    /// tick.
    pub fn shares_in_force(
        &self,
    ) -> &std::collections::BTreeMap<String, sluice_shared::fleet::Amount> {
        self.parts.shares.applied()
    }

    pub fn waiting(&self) -> usize {
        self.parts.streams.waiting()
    }

    /// Whether stream `context_id` waits in a queue now.
    pub fn is_waiting(&self, context_id: u32) -> bool {
        self.parts.streams.is_waiting(context_id)
    }

    /// Bytes of response bodies held now to read their usage (at most
    /// [`usage::MAX_HELD_BYTES`]).
    pub fn response_bytes_held(&self) -> usize {
        self.parts.calls.held()
    }

    /// Replaces the policy set. Bucket states live in shared data under the
    /// policy's name, so an edited policy keeps its state; streams already
    /// admitted or waiting keep their bucket.
    pub fn install<H: Host + ?Sized>(&mut self, host: &H, set: CompiledPolicySet) {
        // Installing reads no time of its own (shares read the clock).
        self.event(host, When::Recent, |parts, ctx| parts.install(ctx, set))
    }

    /// Decides a request that has no body.
    pub fn on_request<H, R>(&mut self, host: &H, context_id: u32, req: &R) -> Verdict
    where
        H: Host + ?Sized,
        R: RequestHeaders + ?Sized,
    {
        self.on_request_with(host, context_id, req, RequestBody::Absent)
    }

    /// Decides a request, or asks for its body first
    /// ([`Verdict::ReadBody`]) when its policy reads a cost from it.
    pub fn on_request_with<H, R>(
        &mut self,
        host: &H,
        context_id: u32,
        req: &R,
        body: RequestBody<'_>,
    ) -> Verdict
    where
        H: Host + ?Sized,
        R: RequestHeaders + ?Sized,
    {
        let verdict = self.event(host, When::Unread, |parts, ctx| {
            parts.request(ctx, context_id, req, body)
        });
        if let Verdict::Reply(reply) = &verdict {
            self.decisions.refused(context_id, reply);
        }
        self.decisions.write(host);
        verdict
    }

    /// Whether each call's decision is set on its stream for Envoy's
    /// access log (the plugin's `log_decisions`).
    pub fn log_decisions(&mut self, on: bool) {
        self.decisions.set_on(on);
    }

    /// The stream ended, for whatever reason: give back its slot, or its
    /// place in the queue. Safe to call more than once.
    pub fn on_stream_end<H: Host + ?Sized>(&mut self, host: &H, context_id: u32) {
        // A slot goes back to a prefetch by the clock's last reading: a
        // fresh one is a host call on every stream's end, and a slot kept
        // in a prefetch that just lapsed goes back at the next tick.
        self.event(host, When::Recent, |parts, ctx| {
            parts.stream_end(ctx, context_id)
        });
        self.decisions.write(host);
    }

    /// Whether some feature acts on the answer to stream `context_id`
    /// (reads it for what the call cost or what the provider says,
    /// rewrites it, or tells the caller where the limits stand).
    pub fn awaits_answer(&self, context_id: u32) -> bool {
        self.parts.calls.awaits(context_id)
    }

    /// Calls whose response has not yet settled what they cost.
    pub fn awaiting_usage(&self) -> usize {
        self.parts.calls.awaiting_usage()
    }

    /// The answer's headers arrived: what the shell does with them (its
    /// body wanted, its length changing, the fields it gets).
    pub fn on_answer_headers<H, R>(
        &mut self,
        host: &H,
        context_id: u32,
        headers: &R,
        end_of_stream: bool,
    ) -> AnswerHeaders
    where
        H: Host + ?Sized,
        R: RequestHeaders + ?Sized,
    {
        // Most answers concern no feature: no clock read, no event.
        if !self.parts.calls.awaits(context_id) {
            return AnswerHeaders::default();
        }
        let answer = self.event(host, When::Fresh, |parts, ctx| {
            let (answer, news) = parts.calls.on_answer_headers(
                ctx,
                context_id,
                headers,
                end_of_stream,
                &parts.attempt_mark,
            );
            if news {
                parts.sync.hurry(ctx);
            }
            answer
        });
        self.decisions.write(host);
        answer
    }

    /// The next piece of the answer's body: whether more is wanted, and
    /// what the caller gets of it.
    pub fn on_answer_body<H: Host + ?Sized>(
        &mut self,
        host: &H,
        context_id: u32,
        chunk: &[u8],
        end_of_stream: bool,
    ) -> AnswerPiece {
        if !self.parts.calls.awaits(context_id) {
            return AnswerPiece::default();
        }
        let piece = self.event(host, When::Fresh, |parts, ctx| {
            parts
                .calls
                .on_answer_body(ctx, context_id, chunk, end_of_stream)
        });
        self.decisions.write(host);
        piece
    }

    /// A stream the tick asked to resume was already gone.
    pub fn on_resume_failed<H: Host + ?Sized>(&mut self, host: &H, context_id: u32) {
        self.on_stream_end(host, context_id);
    }

    /// Periodic work: hand turns to waiting requests, time out the ones
    /// that waited too long, reclaim slots of streams past their lease,
    /// renew this worker's leases, take up what the admin sent, report to
    /// it, flush stats.
    pub fn on_tick<H: Host + ?Sized>(&mut self, host: &H) -> Vec<StreamAction> {
        let actions = self.event(host, When::Fresh, |parts, ctx| parts.tick(ctx));
        self.decisions.ahead_of(actions)
    }

    /// The admin answered the sync call `token` (or Envoy gave up on it).
    pub fn on_sync_reply<H: Host + ?Sized>(&mut self, host: &H, token: u32, reply: SyncReply<'_>) {
        self.event(host, When::Fresh, |parts, ctx| {
            parts.sync_reply(ctx, token, reply)
        })
    }
}

impl Parts {
    fn install<H: Host + ?Sized>(&mut self, ctx: &mut Ctx<'_, H>, set: CompiledPolicySet) {
        self.series = set
            .policies
            .iter()
            .map(|p| ctx.metrics.define_policy(ctx.host, p.name()))
            .collect();
        self.route_headers.learn(&set);
        self.policies = Arc::new(set);
        for spare in self.prefetches.clear() {
            streams::give_back(ctx, spare);
        }
        self.shares.forget_applied();
        self.apply_shares(ctx);
    }

    fn stream_end<H: Host + ?Sized>(&mut self, ctx: &mut Ctx<'_, H>, context_id: u32) {
        self.body_waits.end(context_id);
        self.calls.end(ctx, context_id);
        self.streams.end(ctx, &mut self.prefetches, context_id);
    }

    fn tick<H: Host + ?Sized>(&mut self, ctx: &mut Ctx<'_, H>) -> Vec<StreamAction> {
        let now = ctx.now;
        let previous_poll = std::mem::replace(&mut self.last_queue_poll, now);
        let policies = Arc::clone(&self.policies);
        let mut served = queue::Served::default();
        let mut actions = queue::serve(
            ctx,
            &mut queue::Parts {
                streams: &mut self.streams,
                prefetches: &mut self.prefetches,
                budgets: &mut self.budgets,
                holds: &mut self.head_holds,
            },
            &policies,
            previous_poll,
            &mut served,
        );
        for holding in served.with_limits {
            let context_id = holding.context_id;
            let route = holding.pool.as_ref();
            actions.extend(route.and_then(|r| queue::route_to(&policies, r, context_id)));
            self.hold(ctx, &policies, holding);
            actions.push(StreamAction::Resume(context_id));
        }
        actions.extend(self.body_waits.expire(ctx));
        for spare in self.prefetches.prune(now) {
            streams::give_back(ctx, spare);
        }
        self.streams.expire_stuck(ctx, &mut self.prefetches);
        self.streams.renew_leases(ctx);
        if let Some(set) = self.sync.pick_up_published_set(ctx.host) {
            self.install_from_admin(ctx, set);
        }
        self.apply_shares(ctx);
        self.sync.report_counters(ctx);
        self.sync.maybe_sync(ctx, &mut self.budgets, &self.policies);
        self.sync.maybe_watch(ctx);
        ctx.store.flush_into(ctx.metrics);
        ctx.metrics.flush(ctx.host);
        let period = if self.streams.waiting() > 0 {
            QUEUE_TICK
        } else if self.prefetches.holds_slots() {
            PREFETCH_TICK
        } else if self.sync.pushes() {
            PUSH_TICK
        } else {
            IDLE_TICK
        };
        self.set_tick(ctx, period);
        actions
    }

    /// Installs a set the admin sent, which this VM or another published.
    fn install_from_admin<H: Host + ?Sized>(
        &mut self,
        ctx: &mut Ctx<'_, H>,
        set: sluice_shared::PolicySet,
    ) {
        let (n, version) = (set.policies.len(), set.version);
        self.install(ctx, CompiledPolicySet::from_validated(set));
        ctx.metrics
            .add_filter(FilterCounter::PolicySetsInstalled, 1);
        ctx.host.log(
            Level::Info,
            &format!(
                "sluice: holder {} now enforcing policy set version {version} ({n} policies)",
                ctx.holder
            ),
        );
    }

    /// Gives each global policy the limits of its share in force now.
    /// Without an admin there is nobody to share with, and a global policy
    /// is enforced whole, as an instance one.
    fn apply_shares<H: Host + ?Sized>(&mut self, ctx: &mut Ctx<'_, H>) {
        if !self.sync.is_configured() {
            return;
        }
        self.shares.pick_up(ctx.host);
        self.shares
            .apply(ctx.host, &mut self.policies, ctx.host.now());
    }

    /// The one place the tick period changes.
    fn set_tick<H: Host + ?Sized>(&mut self, ctx: &mut Ctx<'_, H>, period: Span) {
        if period != self.tick {
            self.tick = period;
            ctx.host.set_tick_period(period);
        }
    }
}
