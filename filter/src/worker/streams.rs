//! The streams this worker tracks: admitted ones holding a concurrency slot
//! until they end, and queued ones waiting for their turn. A slot is given
//! back exactly once, whatever ends the stream; a stream holding its slot
//! past the lease TTL gives it back as a crashed worker's would.

use std::collections::BTreeMap;
use std::sync::Arc;

use rustc_hash::FxHashMap;

use sluice_filter_core::bucket::BucketState;
use sluice_filter_core::matcher::CompiledPolicy;
use sluice_filter_core::mcp::RpcCall;
use sluice_filter_core::pricing::CallPrice;
use sluice_shared::time::{Instant, Span};

use super::ctx::Ctx;
use super::decision_log::DecisionLog;
use super::held_slot::HeldSlot;
use super::limits::LimitInputs;
use super::pool::PoolCall;
use super::spend::KeyLabels;
use crate::host::Host;
use crate::metrics::{Metrics, PolicyCounter, PolicySeries};
use crate::prefetch::{PrefetchKey, Prefetches, SpareSlots};

/// A queued stream's place: its ticket in the bucket's queue and when it
/// stops waiting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Turn {
    pub ticket: u64,
    pub deadline: Instant,
}

/// A queued call: the bucket it waits in, its prefetch key, its turn, and
/// what it takes from the policy's further limits (and by which keys) when
/// the turn comes.
pub(super) struct Waiting {
    pub bucket: Arc<str>,
    pub prefetch: PrefetchKey,
    pub turn: Turn,
    /// What it takes from its policy's further limits, when its turn comes.
    pub limits: LimitInputs,
    /// The call's model's prices, for its money limits.
    pub price: Option<CallPrice>,
    /// A pool call: what it would take at each member (chosen when its
    /// turn comes).
    pub pool: Option<Box<PoolCall>>,
    /// Its keys' labels for the live view, found while its request was
    /// at hand: written when it leaves holding its limits.
    pub labels: KeyLabels,
    /// Whom its refusal answers, for an MCP call (its wait may run out).
    pub rpc: Option<RpcCall>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum StreamState {
    /// Admitted, holding a concurrency slot until the stream ends.
    Holding,
    /// Paused in the bucket's queue.
    Waiting(Turn),
}

/// Where an admitted request's slot is: its bucket, and the worker's lease
/// there (what the release must name).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Slot {
    pub bucket: Arc<str>,
    pub lease: Option<Instant>,
}

/// A stream's part in its policy's further limits. Boxed: most policies
/// have none, and a stream is moved into and out of its map whole.
#[derive(Debug, Clone, Default)]
pub(super) struct Further {
    /// What a queued call takes from each further limit when its turn
    /// comes (empty otherwise).
    pub limits: LimitInputs,
    /// Its model's prices, for its money limits.
    pub price: Option<CallPrice>,
    /// A queued pool call: what it would take at each member.
    pub pool: Option<Box<PoolCall>>,
    /// A queued call's keys' labels for the live view.
    pub labels: KeyLabels,
    /// Slots it holds in the further concurrency limits.
    pub slots: Vec<HeldSlot>,
    /// Whom a queued MCP call's refusal answers.
    pub rpc: Option<RpcCall>,
}

/// A stream's policy and the stats series it is counted in.
#[derive(Debug, Clone, Copy)]
pub(super) struct PolicyStats<'a> {
    pub policy: &'a CompiledPolicy,
    pub series: PolicySeries,
}

#[derive(Debug, Clone)]
pub(super) struct Stream {
    pub policy: Arc<str>,
    /// Where its policy's stats are counted.
    pub series: PolicySeries,
    pub bucket: Arc<str>,
    /// The worker's lease its slot belongs to, once it holds one.
    pub lease: Option<Instant>,
    /// The prefetch a finished request's slot may go back to.
    pub prefetch: PrefetchKey,
    pub state: StreamState,
    pub since: Instant,
    /// The concurrency limit's lease TTL (None: the policy has no
    /// concurrency limit, and an admitted stream is not tracked).
    pub lease_ttl: Option<Span>,
    pub further: Option<Box<Further>>,
}

impl Stream {
    fn named_slots(&self) -> &[HeldSlot] {
        self.further.as_deref().map_or(&[], |f| &f.slots)
    }

    /// The longest it may hold its slots: the shortest lease TTL among
    /// them (None: it holds none).
    fn slot_ttl(&self) -> Option<Span> {
        self.named_slots()
            .iter()
            .map(|s| s.ttl)
            .chain(self.lease_ttl)
            .min()
    }
}

#[derive(Debug, Default)]
pub(super) struct Streams {
    streams: FxHashMap<u32, Stream>,
    /// When this worker last renewed its lease in each bucket.
    renewed_at: FxHashMap<String, Instant>,
}

impl Streams {
    pub fn holding(&self) -> usize {
        self.count(|s| s.state == StreamState::Holding)
    }

    pub fn waiting(&self) -> usize {
        self.count(|s| matches!(s.state, StreamState::Waiting(_)))
    }

    /// Whether stream `context_id` waits for its turn.
    pub fn is_waiting(&self, context_id: u32) -> bool {
        !self.streams.is_empty()
            && self
                .streams
                .get(&context_id)
                .is_some_and(|s| matches!(s.state, StreamState::Waiting(_)))
    }

    fn count(&self, f: impl Fn(&Stream) -> bool) -> usize {
        self.streams.values().filter(|s| f(s)).count()
    }

    pub fn get(&self, context_id: u32) -> Option<&Stream> {
        self.streams.get(&context_id)
    }

    /// Which of `contexts` waits with `ticket`.
    /// What a queued call takes when its turn comes (a copy: it is taken
    /// only if the call leaves).
    pub fn further_of(&self, context_id: u32) -> Further {
        self.get(context_id)
            .and_then(|s| s.further.as_deref())
            .cloned()
            .unwrap_or_default()
    }

    pub fn with_ticket(&self, contexts: &[u32], ticket: u64) -> Option<u32> {
        contexts.iter().copied().find(|c| {
            self.streams
                .get(c)
                .is_some_and(|s| matches!(s.state, StreamState::Waiting(t) if t.ticket == ticket))
        })
    }

    /// Still waiting after its deadline.
    pub fn is_overdue(&self, context_id: u32, now: Instant) -> bool {
        self.streams
            .get(&context_id)
            .is_some_and(|s| matches!(s.state, StreamState::Waiting(t) if t.deadline < now))
    }

    /// Waiting streams, grouped by bucket, in the buckets' order. Every
    /// tick of a worker with a queue asks (each millisecond): one bucket
    /// name shared per group, where a map of groups cost a node and a
    /// reference count per waiter.
    pub fn waiting_by_bucket(&self) -> Vec<(Arc<str>, Vec<u32>)> {
        let mut group_of: FxHashMap<&str, usize> = FxHashMap::default();
        let mut groups: Vec<(Arc<str>, Vec<u32>)> = Vec::new();
        for (ctx, s) in &self.streams {
            if !matches!(s.state, StreamState::Waiting(_)) {
                continue;
            }
            match group_of.get(&*s.bucket).and_then(|&at| groups.get_mut(at)) {
                Some((_, contexts)) => contexts.push(*ctx),
                None => {
                    group_of.insert(&s.bucket, groups.len());
                    groups.push((Arc::clone(&s.bucket), vec![*ctx]));
                }
            }
        }
        groups.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        groups
    }

    /// Counts an admitted request and, under a concurrency limit, keeps its
    /// stream until it ends.
    pub fn admitted(
        &mut self,
        metrics: &mut Metrics,
        context_id: u32,
        counted: PolicyStats<'_>,
        slot: Slot,
        prefetch: PrefetchKey,
        now: Instant,
    ) {
        let PolicyStats { policy, series } = counted;
        metrics.add_to(series, PolicyCounter::Admitted, 1);
        if policy.concurrency.is_none() {
            return;
        }
        metrics.add_to(series, PolicyCounter::InFlight, 1);
        let Slot { bucket, lease } = slot;
        let mut stream = Self::stream(counted, bucket, prefetch, StreamState::Holding, now);
        stream.lease = lease;
        self.streams.insert(context_id, stream);
    }

    /// Counts a queued request and keeps its stream until its turn.
    pub fn queued(
        &mut self,
        metrics: &mut Metrics,
        context_id: u32,
        counted: PolicyStats<'_>,
        waiting: Waiting,
        now: Instant,
    ) {
        let Waiting {
            bucket,
            prefetch,
            turn,
            limits,
            price,
            pool,
            labels,
            rpc,
        } = waiting;
        metrics.add_to(counted.series, PolicyCounter::Queued, 1);
        let state = StreamState::Waiting(turn);
        self.track(context_id, counted, bucket, prefetch, state, now);
        if let Some(stream) = self.streams.get_mut(&context_id) {
            let further = stream.further.get_or_insert_with(Box::default);
            further.limits = limits;
            further.price = price;
            further.pool = pool;
            further.labels = labels;
            further.rpc = rpc;
        }
    }

    fn track(
        &mut self,
        context_id: u32,
        counted: PolicyStats<'_>,
        bucket: Arc<str>,
        prefetch: PrefetchKey,
        state: StreamState,
        now: Instant,
    ) {
        let stream = Self::stream(counted, bucket, prefetch, state, now);
        self.streams.insert(context_id, stream);
    }

    fn stream(
        counted: PolicyStats<'_>,
        bucket: Arc<str>,
        prefetch: PrefetchKey,
        state: StreamState,
        now: Instant,
    ) -> Stream {
        let PolicyStats { policy, series } = counted;
        Stream {
            policy: policy.shared_name(),
            series,
            bucket,
            lease: None,
            prefetch,
            state,
            since: now,
            lease_ttl: policy.concurrency.map(|c| c.lease_ttl),
            further: None,
        }
    }

    /// An admitted stream holds `slots` of its policy's further
    /// concurrency limits until it ends (tracked even when the policy has
    /// no concurrency of its own).
    pub fn hold_slots(
        &mut self,
        context_id: u32,
        counted: PolicyStats<'_>,
        slots: Vec<HeldSlot>,
        now: Instant,
    ) {
        if slots.is_empty() {
            return;
        }
        if !self.streams.contains_key(&context_id) {
            let unused = (usize::MAX, sluice_filter_core::matcher::BucketKey::Policy);
            self.track(
                context_id,
                counted,
                Arc::from(""),
                unused,
                StreamState::Holding,
                now,
            );
            if let Some(stream) = self.streams.get_mut(&context_id) {
                // No slot of the policy's own: only the named ones.
                stream.lease_ttl = None;
            }
        }
        if let Some(stream) = self.streams.get_mut(&context_id) {
            stream
                .further
                .get_or_insert_with(Box::default)
                .slots
                .extend(slots);
        }
    }

    /// A waiting stream's turn came: it goes upstream now, holding a slot
    /// when its policy has a concurrency limit.
    pub fn turn_came(
        &mut self,
        metrics: &mut Metrics,
        decisions: &mut DecisionLog,
        context_id: u32,
        lease: Option<Instant>,
        now: Instant,
    ) {
        let Some(stream) = self.streams.get_mut(&context_id) else {
            return;
        };
        decisions.waited(context_id, now - stream.since);
        metrics.add_to(stream.series, PolicyCounter::Admitted, 1);
        if stream.lease_ttl.is_some() {
            metrics.add_to(stream.series, PolicyCounter::InFlight, 1);
        }
        // Kept while it holds a slot: its policy's, or (from
        // [`Self::hold_slots`]) a further limit's.
        stream.state = StreamState::Holding;
        stream.lease = lease;
        stream.since = now;
        if stream.lease_ttl.is_none() {
            self.streams.remove(&context_id);
        }
    }

    /// The stream ended, for whatever reason: give back its slot, or its
    /// place in the queue. Safe to call more than once.
    pub fn end<H: Host + ?Sized>(
        &mut self,
        ctx: &mut Ctx<'_, H>,
        prefetches: &mut Prefetches,
        context_id: u32,
    ) {
        if self.streams.is_empty() {
            // Policies without a concurrency limit keep no streams.
            return;
        }
        let Some(stream) = self.streams.remove(&context_id) else {
            return;
        };
        match stream.state {
            StreamState::Holding => {
                super::slots::release(ctx, stream.named_slots());
                let (host, store, metrics) = (ctx.host, &mut *ctx.store, &mut *ctx.metrics);
                let (holder, now) = (ctx.holder, ctx.now);
                if stream.lease_ttl.is_none() {
                    // It held only further limits' slots.
                    return;
                }
                metrics.add_to(stream.series, PolicyCounter::InFlight, -1);
                if prefetches.return_slot(stream.prefetch, stream.lease, || now) {
                    // Kept for this worker's next request while the prefetch lives.
                    return;
                }
                let Some(lease) = stream.lease else {
                    return;
                };
                // A failure is counted and logged by the store; the lease
                // then expires and gives the slot back.
                let _ = store.update_as::<BucketState, _, _>(host, &stream.bucket, |s| {
                    let r = s.release(holder, lease);
                    (r, r)
                });
            }
            StreamState::Waiting(turn) => {
                let (host, store, holder) = (ctx.host, &mut *ctx.store, ctx.holder);
                ctx.metrics
                    .add_to(stream.series, PolicyCounter::QueueAbandoned, 1);
                // On failure the waiter's deadline takes it out of the queue.
                let _ = store.update_as::<BucketState, _, _>(host, &stream.bucket, |s| {
                    let c = s.cancel(holder, turn.ticket);
                    (c, c)
                });
            }
        }
    }

    /// A stream holding a slot longer than the lease TTL (one that never
    /// ends) gives the slot back, as a crashed worker's slots come back.
    pub fn expire_stuck<H: Host + ?Sized>(
        &mut self,
        ctx: &mut Ctx<'_, H>,
        prefetches: &mut Prefetches,
    ) {
        let now = ctx.now;
        let stuck: Vec<(u32, PolicySeries)> = self
            .streams
            .iter()
            .filter(|(_, s)| {
                s.state == StreamState::Holding
                    && s.slot_ttl().is_some_and(|ttl| now - s.since > ttl)
            })
            .map(|(c, s)| (*c, s.series))
            .collect();
        for (context_id, series) in stuck {
            ctx.metrics.add_to(series, PolicyCounter::LeasesExpired, 1);
            self.end(ctx, prefetches, context_id);
        }
    }

    /// Keeps this worker's leases alive while it holds slots: renewing at a
    /// quarter of the TTL leaves three chances before a lease could lapse.
    pub fn renew_leases<H: Host + ?Sized>(&mut self, ctx: &mut Ctx<'_, H>) {
        let (holder, now) = (ctx.holder, ctx.now);
        // Bucket names, further limits' keys (`sluice/l/...`) and fair
        // slots tables' (`sluice/fs/...`, `sluice/fsl/...`) differ.
        let mut buckets: BTreeMap<&str, (Span, Held)> = BTreeMap::new();
        for s in self.streams.values() {
            if s.state != StreamState::Holding {
                continue;
            }
            let named = s.named_slots().iter().map(|n| {
                let held = if n.fair_key.is_some() {
                    Held::FairSlots
                } else {
                    Held::Limit
                };
                (n.key.as_str(), n.ttl, held)
            });
            let own = s.lease_ttl.map(|ttl| (&*s.bucket, ttl, Held::Bucket));
            for (key, ttl, held) in own.into_iter().chain(named) {
                let shortest = buckets.entry(key).or_insert((ttl, held));
                shortest.0 = shortest.0.min(ttl);
            }
        }
        self.renewed_at
            .retain(|b, _| buckets.contains_key(b.as_str()));
        for (bucket, (ttl, held)) in buckets {
            let last = self
                .renewed_at
                .get(bucket)
                .copied()
                .unwrap_or(Instant::EPOCH);
            if now - last < ttl.div(4) {
                continue;
            }
            let renewed = match held {
                Held::Limit => super::slots::renew(ctx, bucket, false, ttl),
                Held::FairSlots => super::slots::renew(ctx, bucket, true, ttl),
                Held::Bucket => ctx
                    .store
                    .update_as::<BucketState, _, _>(ctx.host, bucket, |s| {
                        let r = s.renew(holder, now, ttl);
                        (r, r)
                    })
                    .map(|_| ()),
            };
            // On failure (counted by the store) the next tick tries again.
            if renewed.is_ok() {
                self.renewed_at.insert(bucket.to_string(), now);
            }
        }
    }
}

/// What holds a worker's lease: a policy's bucket, a further concurrency
/// limit's lease table, or a fair slots table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Held {
    Bucket,
    Limit,
    FairSlots,
}

/// Gives prefetched slots this worker did not use back to their bucket
/// (a failure is counted by the store; the lease then expires).
pub(super) fn give_back<H: Host + ?Sized>(ctx: &mut Ctx<'_, H>, spare: SpareSlots) {
    let Some(lease) = spare.lease else {
        return;
    };
    let holder = ctx.holder;
    let _ = ctx
        .store
        .update_as::<BucketState, _, _>(ctx.host, &spare.bucket, |s| {
            let n = s.release_many(holder, lease, spare.slots);
            (n, n > 0)
        });
}
