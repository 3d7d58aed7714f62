//! The filter's logic inside one Envoy worker VM, free of proxy-wasm: it
//! decides through `sluice-shared` and talks to Envoy through [`Host`].
//!
//! [`Worker`] only coordinates the four things Envoy asks of it: a request
//! arrives ([`Worker::on_request`]), time passes ([`Worker::on_tick`]), a
//! stream ends ([`Worker::on_stream_end`]), the admin answers a sync
//! ([`Worker::on_sync_reply`]). Each part owns its state:
//!
//! - [`admission`]: how a request is decided (start reading there);
//! - [`placement`]: which bucket of a keyed policy a request uses;
//! - [`streams`]: admitted and queued streams, their slots and leases;
//! - [`queue`]: turns for queued streams, and their timeouts;
//! - [`sync_client`]: policy sets and reports to and from the admin;
//! - [`shares`]: fleet mode's shares of global policies;
//! - [`budgets`]: long limits the admin holds across restarts.
//!
//! Host actions that can call back into the VM (a local reply, resuming a
//! paused stream) are returned to the caller instead of performed here, so
//! the glue can run them after it stops borrowing the worker.

mod admission;
mod budgets;
mod key_counts;
mod key_places;
mod limits;
mod placement;
mod provider;
mod queue;
mod refusal;
mod retry;
mod shares;
mod slots;
mod streams;
mod sync_client;
mod telling;
mod usage;

use std::rc::Rc;

use sluice_shared::key_hash::KeySecret;
use sluice_shared::key_view::KeyOutcome;
use sluice_shared::matcher::{BucketKey, CompiledPolicy, CompiledPolicySet, RequestJson};
use sluice_shared::request_headers::RequestHeaders;
use sluice_shared::time::{Instant, Span};

use crate::clock::{Clock, Clocked};
use crate::host::{Host, Level};
use crate::metrics::{FilterStat, Metrics, PolicySeries, PolicyStat};
use crate::prefetch::Prefetches;
use crate::store::Store;
use crate::sync::{Answer, SyncReply, SyncSettings};

pub use admission::Verdict;
pub use queue::StreamAction;
pub use refusal::LocalReply;
pub use usage::MAX_HELD_BYTES;

use admission::Decision;
use budgets::Budgets;
use shares::FleetShares;
use streams::Streams;
use sync_client::SyncClient;
use usage::{Ledger, Usages};

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
    holder: u64,
    policies: Rc<CompiledPolicySet>,
    /// Each policy's stats, in the order of `policies`.
    series: Vec<PolicySeries>,
    metrics: Metrics,
    store: Store,
    tick: Span,
    prefetches: Prefetches,
    streams: Streams,
    /// Admitted calls whose cost their response settles.
    usages: Usages,
    /// Admitted calls whose answer may pause their limits.
    listening: provider::Listening,
    /// Calls whose answer tells the caller where the limits stand.
    telling: telling::Telling,
    sync: SyncClient,
    shares: FleetShares,
    budgets: Budgets,
    /// The wall clock made monotonic (see [`crate::clock`]).
    clock: Rc<Clock>,
    /// What keys are hashed with; the same in every VM of the process.
    key_secret: KeySecret,
    /// When this worker last polled its queues (the previous tick).
    last_queue_poll: Instant,
    /// Policies naming a port whose requests came without one, noticed
    /// here (logged once per Envoy).
    port_hidden: rustc_hash::FxHashSet<String>,
}

impl Worker {
    /// A worker with a lease-holder id of its own, enforcing nothing yet.
    pub fn new<H: Host + ?Sized>(host: &H) -> Self {
        let mut store = Store::default();
        let holder = store.allocate_holder(host);
        let key_secret = store.key_secret(host);
        Self {
            holder,
            policies: Rc::new(CompiledPolicySet::empty()),
            series: Vec::new(),
            metrics: Metrics::default(),
            store,
            tick: IDLE_TICK,
            prefetches: Prefetches::default(),
            streams: Streams::default(),
            usages: Usages::default(),
            listening: provider::Listening::default(),
            telling: telling::Telling::default(),
            sync: SyncClient::default(),
            shares: FleetShares::default(),
            budgets: Budgets::default(),
            clock: Rc::new(Clock::default()),
            key_secret,
            last_queue_poll: Instant::EPOCH,
            port_hidden: Default::default(),
        }
    }

    /// Runs this worker's clock at `scale` of real time (plugin
    /// `time_scale`; 1 is real time), its ticks and call timeouts
    /// stretched to match.
    pub fn set_time_scale(&mut self, scale: f64) {
        self.clock.set_scale(scale);
    }

    /// The tick period this worker wants, in real time.
    pub fn start_ticking<H: Host + ?Sized>(&mut self, host: &H) {
        let clock = Rc::clone(&self.clock);
        let host = &Clocked {
            host,
            clock: &clock,
        };
        host.set_tick_period(self.tick);
    }

    /// Where to sync from (None: enforce the fallback set only).
    pub fn set_sync(&mut self, settings: Option<SyncSettings>) {
        self.budgets.configure(settings.is_some());
        self.sync.configure(settings);
    }

    /// Version of the admin's set this worker enforces (0: the fallback).
    pub fn admin_version(&self) -> u64 {
        self.sync.admin_version()
    }

    pub fn holder(&self) -> u64 {
        self.holder
    }

    pub fn policies(&self) -> &CompiledPolicySet {
        &self.policies
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    pub fn in_flight(&self) -> usize {
        self.streams.holding()
    }

    pub fn waiting(&self) -> usize {
        self.streams.waiting()
    }

    /// Bytes of response bodies held now to read their usage (at most
    /// [`usage::MAX_HELD_BYTES`]).
    pub fn response_bytes_held(&self) -> usize {
        self.usages.held()
    }

    /// Replaces the policy set. Bucket states live in shared data under the
    /// policy's name, so an edited policy keeps its state; streams already
    /// admitted or waiting keep their bucket.
    pub fn install<H: Host + ?Sized>(&mut self, host: &H, set: CompiledPolicySet) {
        let clock = Rc::clone(&self.clock);
        let host = &Clocked {
            host,
            clock: &clock,
        };
        self.install_clocked(host, set)
    }

    fn install_clocked<H: Host + ?Sized>(&mut self, host: &H, set: CompiledPolicySet) {
        self.series = set
            .policies
            .iter()
            .map(|p| self.metrics.define_policy(host, p.name()))
            .collect();
        self.policies = Rc::new(set);
        for spare in self.prefetches.clear() {
            streams::give_back(host, &mut self.store, self.holder, spare);
        }
        self.shares.forget_applied();
        self.apply_shares(host);
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
        let clock = Rc::clone(&self.clock);
        let host = &Clocked {
            host,
            clock: &clock,
        };
        self.request(host, context_id, req, body)
    }

    fn request<H, R>(
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
        let policies = Rc::clone(&self.policies);
        let Some(class) = policies.classify(req, &self.key_secret) else {
            return Verdict::Continue;
        };
        let Some(policy) = policies.policies.get(class.policy_index) else {
            return Verdict::Continue;
        };
        if class.port_hidden {
            self.port_was_hidden(host, policy);
        }
        let body = match body {
            RequestBody::Coming if policy.reads_request_body() => {
                // Read while the headers pass: the host answers header
                // reads no more once the body comes.
                for header in policy.decision_headers() {
                    let _ = req.header(header);
                }
                return Verdict::ReadBody;
            }
            RequestBody::Read(None) if policy.reads_request_body() => {
                self.metrics.add_filter(FilterStat::RequestBodyTooLarge, 1);
                RequestJson::TooLarge
            }
            RequestBody::Read(Some(body)) => RequestJson::Read(body),
            RequestBody::Read(None) | RequestBody::Absent | RequestBody::Coming => {
                RequestJson::None
            }
        };
        // Far from its limits a call spends a prefetch, for which the
        // clock's last reading will do while calls come densely.
        let reused = self.clock.reuse();
        let mut admitter = admission::Admitter {
            host,
            store: &mut self.store,
            metrics: &mut self.metrics,
            prefetches: &mut self.prefetches,
            budgets: &mut self.budgets,
            holder: self.holder,
            now: reused.unwrap_or_else(|| host.now()),
            now_reused: reused.is_some(),
            overflowed: false,
        };
        let limit_costs = policy.limit_costs(req, body);
        let limit_keys = policy.limit_keys(req, &self.key_secret);
        let (decision, held) = admitter.decide(policy, &class, (&limit_costs, &limit_keys));
        let now = admitter.now;
        if class.key != BucketKey::Policy {
            let outcome = match decision {
                Decision::Pass | Decision::Admit { .. } => KeyOutcome::Admitted,
                Decision::Queue { .. } => KeyOutcome::Queued,
                Decision::Refuse(_) => KeyOutcome::Refused,
            };
            let overflowed = admitter.overflowed;
            self.sync.count_key(policy, req, (outcome, overflowed), now);
        }
        let slots = match held {
            Some(held) => {
                if policy.reads_usage() {
                    self.usages
                        .expect(context_id, policy, (&limit_costs, &held.places), now);
                }
                let counted: Vec<_> = held.places.iter().map(|p| p.counted).collect();
                self.listening.expect(
                    context_id,
                    (&policies, class.policy_index),
                    &limit_keys,
                    &counted,
                );
                held.slots
            }
            None => Vec::new(),
        };
        if !matches!(decision, Decision::Refuse(_)) {
            self.telling
                .expect(context_id, &policies, class.policy_index);
        }
        let series = match self.series.get(class.policy_index) {
            Some(series) => *series,
            None => self.metrics.series_of(policy.name()),
        };
        let policy = (policy, series);
        match decision {
            Decision::Pass => {
                self.streams.hold_slots(context_id, policy, slots, now);
                Verdict::Continue
            }
            Decision::Refuse(reply) => Verdict::Reply(reply),
            Decision::Admit {
                bucket,
                key,
                lease,
                prefetched_slots,
            } => {
                let slot = streams::Slot { bucket, lease };
                self.streams
                    .admitted(&mut self.metrics, context_id, policy, slot, key, now);
                self.streams.hold_slots(context_id, policy, slots, now);
                if prefetched_slots {
                    // Spare slots must go back soon after their prefetch lapses.
                    self.set_tick(host, self.tick.min(PREFETCH_TICK));
                }
                Verdict::Continue
            }
            Decision::Queue {
                bucket,
                key,
                ticket,
                deadline,
            } => {
                self.streams.queued(
                    &mut self.metrics,
                    context_id,
                    policy,
                    bucket.into(),
                    key,
                    (streams::Turn { ticket, deadline }, limit_costs, limit_keys),
                    now,
                );
                self.set_tick(host, QUEUE_TICK);
                Verdict::Pause { ticket }
            }
        }
    }

    /// A call of `policy`, which names a port, came without one (Envoy
    /// strips ports before filters run: `strip_any_host_port`): it was
    /// matched by its host alone. Counted; logged once per policy and
    /// Envoy, so the operator learns the port means nothing here.
    fn port_was_hidden<H: Host + ?Sized>(&mut self, host: &H, policy: &CompiledPolicy) {
        self.metrics.add(policy.name(), PolicyStat::PortHidden, 1);
        if self.port_hidden.contains(policy.name()) {
            return;
        }
        self.port_hidden.insert(policy.name().to_string());
        let marker = crate::entries::port_hidden_key(policy.name());
        let first = self
            .store
            .update_as::<crate::entries::Marker, _, _>(host, &marker, |seen| {
                let first = !seen.0;
                seen.0 = true;
                (first, first)
            });
        if matches!(first, Ok(true)) {
            host.log(
                Level::Warn,
                &format!(
                    "sluice: policy {} names the port in {:?}, but its requests come without one \
                     (does this Envoy strip ports, strip_any_host_port?): they are matched by the host alone",
                    policy.name(),
                    policy.policy.matcher.host
                ),
            );
        }
    }

    /// The stream ended, for whatever reason: give back its slot, or its
    /// place in the queue. Safe to call more than once.
    pub fn on_stream_end<H: Host + ?Sized>(&mut self, host: &H, context_id: u32) {
        let clock = Rc::clone(&self.clock);
        let host = &Clocked {
            host,
            clock: &clock,
        };
        self.stream_end(host, context_id)
    }

    fn stream_end<H: Host + ?Sized>(&mut self, host: &H, context_id: u32) {
        self.listening.forget(context_id);
        self.telling.forget(context_id);
        if self.usages.awaits(context_id) {
            let mut ledger = Ledger {
                host,
                store: &mut self.store,
                metrics: &mut self.metrics,
                now: host.now(),
            };
            self.usages.on_end(&mut ledger, context_id);
        }
        // A slot goes back to a prefetch by the clock's last reading: a
        // fresh one is a host call on every stream's end, and a slot kept
        // in a prefetch that just lapsed goes back at the next tick.
        let recent = self.clock.last_reading();
        self.streams.end(
            host,
            &mut self.store,
            &mut self.metrics,
            &mut self.prefetches,
            (self.holder, recent),
            context_id,
        );
    }

    /// Whether the stream's response is read: for what the call cost, or
    /// for what the provider says of its limit.
    pub fn reads_response(&self, context_id: u32) -> bool {
        self.usages.awaits(context_id) || self.listening.awaits(context_id)
    }

    /// Whether the stream's answer tells its caller where the limits
    /// stand (`ratelimit_headers: always`).
    pub fn tells(&self, context_id: u32) -> bool {
        self.telling.awaits(context_id)
    }

    /// The fields the answer to stream `context_id` gets (once).
    pub fn answer_headers<H: Host + ?Sized>(
        &mut self,
        host: &H,
        context_id: u32,
    ) -> Vec<(&'static str, String)> {
        let clock = Rc::clone(&self.clock);
        let host = &Clocked {
            host,
            clock: &clock,
        };
        let now = host.now();
        self.telling.headers(host, &mut self.store, context_id, now)
    }

    /// Calls whose response has not yet settled what they cost.
    pub fn awaiting_usage(&self) -> usize {
        self.usages.len()
    }

    /// The response's headers arrived. True while its body is wanted.
    pub fn on_response_headers<H, R>(
        &mut self,
        host: &H,
        context_id: u32,
        headers: &R,
        end_of_stream: bool,
    ) -> bool
    where
        H: Host + ?Sized,
        R: RequestHeaders + ?Sized,
    {
        let clock = Rc::clone(&self.clock);
        let host = &Clocked {
            host,
            clock: &clock,
        };
        let now = host.now();
        let news = self.listening.on_headers(
            (host, &mut self.store, &mut self.metrics),
            context_id,
            headers,
            now,
        );
        if news {
            self.sync.hurry(host, &mut self.store, now);
        }
        let mut ledger = Ledger {
            host,
            store: &mut self.store,
            metrics: &mut self.metrics,
            now,
        };
        self.usages
            .on_headers(&mut ledger, context_id, headers, end_of_stream)
    }

    /// The next piece of the response's body. True while more is wanted.
    pub fn on_response_body<H: Host + ?Sized>(
        &mut self,
        host: &H,
        context_id: u32,
        chunk: &[u8],
        end_of_stream: bool,
    ) -> bool {
        let clock = Rc::clone(&self.clock);
        let host = &Clocked {
            host,
            clock: &clock,
        };
        let mut ledger = Ledger {
            host,
            store: &mut self.store,
            metrics: &mut self.metrics,
            now: host.now(),
        };
        self.usages
            .on_body(&mut ledger, context_id, chunk, end_of_stream)
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
        let clock = Rc::clone(&self.clock);
        let host = &Clocked {
            host,
            clock: &clock,
        };
        self.tick(host)
    }

    fn tick<H: Host + ?Sized>(&mut self, host: &H) -> Vec<StreamAction> {
        let now = host.now();
        let previous_poll = std::mem::replace(&mut self.last_queue_poll, now);
        let policies = Rc::clone(&self.policies);
        let mut served = queue::Served::default();
        let actions = queue::serve(
            host,
            &mut queue::Parts {
                store: &mut self.store,
                metrics: &mut self.metrics,
                streams: &mut self.streams,
                prefetches: &mut self.prefetches,
                budgets: &mut self.budgets,
            },
            &policies,
            self.holder,
            (previous_poll, now),
            &mut served,
        );
        for left in served.with_limits {
            if let Some(policy) = policies.policies.get(left.policy_index) {
                if policy.reads_usage() {
                    self.usages
                        .expect(left.context_id, policy, (&left.costs, &left.places), now);
                }
                let counted: Vec<_> = left.places.iter().map(|p| p.counted).collect();
                self.listening.expect(
                    left.context_id,
                    (&policies, left.policy_index),
                    &left.keys,
                    &counted,
                );
            }
        }
        for spare in self.prefetches.prune(now) {
            streams::give_back(host, &mut self.store, self.holder, spare);
        }
        self.streams.expire_stuck(
            host,
            &mut self.store,
            &mut self.metrics,
            &mut self.prefetches,
            self.holder,
            now,
        );
        self.streams
            .renew_leases(host, &mut self.store, self.holder, now);
        if let Some(set) = self.sync.pick_up_published_set(host) {
            self.install_from_admin(host, set);
        }
        self.apply_shares(host);
        self.sync
            .report_counters(host, &mut self.store, &mut self.metrics, now);
        self.sync.maybe_sync(
            host,
            &mut self.store,
            &mut self.metrics,
            &mut self.budgets,
            &self.policies,
            now,
        );
        self.sync
            .maybe_watch(host, &mut self.store, &mut self.metrics, now);
        self.store.flush_into(&mut self.metrics);
        self.metrics.flush(host);
        let period = if self.streams.waiting() > 0 {
            QUEUE_TICK
        } else if self.prefetches.holds_slots() {
            PREFETCH_TICK
        } else if self.sync.pushes() {
            PUSH_TICK
        } else {
            IDLE_TICK
        };
        self.set_tick(host, period);
        actions
    }

    /// The admin answered the sync call `token` (or Envoy gave up on it).
    pub fn on_sync_reply<H: Host + ?Sized>(&mut self, host: &H, token: u32, reply: SyncReply<'_>) {
        let clock = Rc::clone(&self.clock);
        let host = &Clocked {
            host,
            clock: &clock,
        };
        self.sync_reply(host, token, reply)
    }

    fn sync_reply<H: Host + ?Sized>(&mut self, host: &H, token: u32, reply: SyncReply<'_>) {
        if let Some(call) = self.sync.take_watch(token) {
            let epoch = crate::sync::parse_epoch(reply.epoch_header);
            if let Some(set) = self.sync.on_watch_answer(
                host,
                &mut self.store,
                &mut self.metrics,
                (reply.answer(), epoch, reply.sync_now),
                call,
            ) {
                self.install_from_admin(host, set);
            }
            return;
        }
        let Some(sent_at) = self.sync.take_pending(token) else {
            return;
        };
        if let Some(header) = reply.shares_header.filter(|_| reply.answered()) {
            let taken =
                self.shares
                    .take_header(host, &mut self.store, &mut self.metrics, header, sent_at);
            if let Some(shares::Shrank(shrank)) = taken {
                self.apply_shares(host);
                if shrank {
                    // The admin frees the old share's room for the others
                    // only once this Envoy says it holds the new one.
                    self.sync.hurry(host, &mut self.store, host.now());
                }
            }
        }
        let answer = reply.answer();
        let answered = matches!(answer, Answer::Unchanged | Answer::PolicySet(_));
        let epoch = crate::sync::parse_epoch(reply.epoch_header);
        if let Some(set) =
            self.sync
                .on_answer(host, &mut self.store, &mut self.metrics, answer, epoch)
        {
            self.install_from_admin(host, set);
        }
        if answered {
            let policies = Rc::clone(&self.policies);
            if let Some(header) = reply.provider_header {
                let now = host.now();
                provider::take_news(
                    (host, &mut self.store, &mut self.metrics),
                    &policies,
                    header,
                    now.since(sent_at).div(2),
                    now,
                );
            }
            self.budgets.on_answer(
                host,
                &mut self.store,
                &mut self.metrics,
                &policies,
                reply.budgets_header,
                host.now(),
            );
        }
    }

    /// Installs a set the admin sent, which this VM or another published.
    fn install_from_admin<H: Host + ?Sized>(&mut self, host: &H, set: sluice_shared::PolicySet) {
        let (n, version) = (set.policies.len(), set.version);
        self.install_clocked(host, CompiledPolicySet::from_validated(set));
        self.metrics.add_filter(FilterStat::PolicySetsInstalled, 1);
        host.log(
            Level::Info,
            &format!(
                "sluice: holder {} now enforcing policy set version {version} ({n} policies)",
                self.holder
            ),
        );
    }

    /// Gives each global policy the limits of its share in force now.
    /// Without an admin there is nobody to share with, and a global policy
    /// is enforced whole, as an instance one.
    fn apply_shares<H: Host + ?Sized>(&mut self, host: &H) {
        if !self.sync.is_configured() {
            return;
        }
        self.shares.pick_up(host);
        self.shares.apply(host, &mut self.policies, host.now());
    }

    /// The one place the tick period changes.
    fn set_tick<H: Host + ?Sized>(&mut self, host: &H, period: Span) {
        if period != self.tick {
            self.tick = period;
            host.set_tick_period(period);
        }
    }
}
