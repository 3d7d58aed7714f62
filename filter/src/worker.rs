//! The filter's logic inside one Envoy worker VM, free of proxy-wasm: it
//! decides through `sluice-shared` and talks to Envoy through [`Host`].
//!
//! Host actions that can call back into the VM (a local reply, resuming a
//! paused stream) are returned to the caller instead of performed here, so
//! the glue can run them after it stops borrowing the worker.

use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;

use sluice_shared::bucket::{Admission, BucketLimits, BucketState, Granted};
use sluice_shared::fleet::{share_in_force, Amount};
use sluice_shared::headers::{rejection_headers, LimitKind};
use sluice_shared::limiter::Nanos;
use sluice_shared::matcher::{
    BucketKey, Classification, CompiledPolicy, CompiledPolicySet, RequestHeaders,
};
use sluice_shared::policy::KeyOverflow;

use crate::fleet::{self, HeldGrant, HeldGrants};
use crate::grants::{GrantKey, LocalGrants, SpareSlots};
use crate::host::{Host, Level};
use crate::metrics::{FilterStat, Metrics, PolicyStat};
use crate::store::{bucket_key, update, Place, StoreError, StoreStats};
use crate::sync::{self as policy_sync, Answer, SyncSettings};

/// Tick period with nobody waiting: lease renewal and stats only.
pub const IDLE_TICK_MS: u64 = 100;
/// Tick period while requests wait: how promptly a turn is noticed.
pub const QUEUE_TICK_MS: u64 = 1;
/// Tick while grants hold spare slots: lapsed ones go back within it.
pub const GRANT_TICK_MS: u64 = 10;
/// Places tried for a new key before it overflows.
const KEY_PROBES: u32 = 4;
/// Owner of the shared overflow bucket of a keyed policy.
const OVERFLOW_OWNER: u64 = u64::MAX;
/// Retry-After for a refusal that has no schedule (contention, overflow).
const DEFAULT_RETRY_NS: Nanos = 1_000_000_000;
/// How often a worker adds its counters to the shared sync report.
const REPORT_EVERY_NS: Nanos = 100_000_000;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalReply {
    pub status: u32,
    pub headers: Vec<(&'static str, String)>,
    pub body: Vec<u8>,
}

/// What to do with a request now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Continue,
    /// Queued: resumed (or refused) later from the tick.
    Pause {
        ticket: u64,
    },
    Reply(LocalReply),
}

/// What the tick asks the glue to do to a paused stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamAction {
    Resume(u32),
    Reply(u32, LocalReply),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StreamState {
    /// Admitted, holding a concurrency slot until the stream ends.
    Holding,
    /// Paused in the bucket's queue.
    Waiting { ticket: u64, deadline: Nanos },
}

#[derive(Debug, Clone)]
struct Stream {
    policy: String,
    bucket: String,
    /// The grant a finished request's slot may go back to.
    grant: GrantKey,
    state: StreamState,
    since: Nanos,
    lease_ttl: Nanos,
    has_concurrency: bool,
}

pub struct Worker {
    holder: u64,
    policies: Rc<CompiledPolicySet>,
    streams: HashMap<u32, Stream>,
    metrics: Metrics,
    store: StoreStats,
    flushed_store: StoreStats,
    renewed_at: HashMap<String, Nanos>,
    tick_ms: u64,
    grants: LocalGrants,
    sync: Option<SyncSettings>,
    /// Version of the admin's set this worker enforces (0: the fallback).
    admin_version: u64,
    /// The sync call this VM is waiting for: (token, sent at).
    pending_call: Option<(u32, Nanos)>,
    reported_at: Nanos,
    /// Fleet mode: the grants this worker last picked up, their sequence
    /// in shared data, and the share each global policy applies now.
    fleet_seq: u64,
    held: HeldGrants,
    applied: BTreeMap<String, Amount>,
}

impl Worker {
    pub fn new(holder: u64) -> Self {
        Self {
            holder,
            policies: Rc::new(CompiledPolicySet::empty()),
            streams: HashMap::new(),
            metrics: Metrics::default(),
            store: StoreStats::default(),
            flushed_store: StoreStats::default(),
            renewed_at: HashMap::new(),
            tick_ms: IDLE_TICK_MS,
            grants: LocalGrants::default(),
            sync: None,
            admin_version: 0,
            pending_call: None,
            reported_at: 0,
            fleet_seq: 0,
            held: HeldGrants::new(),
            applied: BTreeMap::new(),
        }
    }

    /// Where to sync from (None: enforce the fallback set only).
    pub fn set_sync(&mut self, settings: Option<SyncSettings>) {
        self.sync = settings;
    }

    pub fn admin_version(&self) -> u64 {
        self.admin_version
    }

    pub fn holder(&self) -> u64 {
        self.holder
    }

    pub fn policies(&self) -> &CompiledPolicySet {
        &self.policies
    }

    /// Replaces the policy set. Bucket states live in shared data under the
    /// policy's name, so an edited policy keeps its state; streams already
    /// admitted or waiting keep their bucket.
    pub fn install<H: Host + ?Sized>(&mut self, host: &H, set: CompiledPolicySet) {
        for p in &set.policies {
            self.metrics.define_policy(host, p.name());
        }
        self.policies = Rc::new(set);
        for spare in self.grants.clear() {
            self.give_back(host, spare);
        }
        self.applied.clear();
        self.apply_shares(host, host.now());
    }

    /// Gives each global policy the limits of the share in force now: the
    /// newest grant while it runs, then its fallback. Without an admin
    /// there is nobody to share with, and a global policy is enforced
    /// whole, as an instance one.
    fn apply_shares<H: Host + ?Sized>(&mut self, host: &H, now: Nanos) {
        if self.sync.is_none() {
            return;
        }
        let mut changes = Vec::new();
        for (i, p) in self.policies.policies.iter().enumerate() {
            if !p.is_global() {
                continue;
            }
            let grant = self.held.get(p.name()).map(HeldGrant::as_grant);
            let share = share_in_force(grant, Amount::of_policy(&p.policy), now / 1_000_000);
            if self.applied.get(p.name()) != Some(&share) {
                changes.push((i, share));
            }
        }
        if changes.is_empty() {
            return;
        }
        let policies = Rc::make_mut(&mut self.policies);
        for (i, share) in changes {
            if let Some(p) = policies.policies.get_mut(i) {
                p.apply_share(share);
                host.log(
                    Level::Debug,
                    &format!(
                        "sluice: global policy {} now allows {:.1}/s, {} in flight{}",
                        p.name(),
                        share.rate,
                        share.in_flight,
                        if p.fleet_closed { " (closed)" } else { "" }
                    ),
                );
                self.applied.insert(p.name().to_string(), share);
            }
        }
    }

    /// Takes up grants another VM's sync published.
    fn pick_up_grants<H: Host + ?Sized>(&mut self, host: &H) {
        if self.sync.is_none() || fleet::published_seq(host) == self.fleet_seq {
            return;
        }
        let (seq, held) = fleet::published(host);
        self.fleet_seq = seq;
        self.held = held;
    }

    /// Gives granted slots this worker did not use back to their bucket.
    fn give_back<H: Host + ?Sized>(&mut self, host: &H, spare: SpareSlots) {
        let holder = self.holder;
        let given = update(
            host,
            &spare.bucket,
            &mut self.store,
            || BucketState::new(0),
            |s| {
                let n = s.release_many(holder, spare.slots);
                (n, n > 0)
            },
        );
        if given.is_err() {
            self.metrics.add_filter(FilterStat::HostErrors, 1);
        }
    }

    pub fn in_flight(&self) -> usize {
        self.streams
            .values()
            .filter(|s| s.state == StreamState::Holding)
            .count()
    }

    pub fn waiting(&self) -> usize {
        self.streams
            .values()
            .filter(|s| matches!(s.state, StreamState::Waiting { .. }))
            .count()
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    pub fn on_request<H, R>(&mut self, host: &H, context_id: u32, req: &R) -> Verdict
    where
        H: Host + ?Sized,
        R: RequestHeaders + ?Sized,
    {
        let policies = Rc::clone(&self.policies);
        let Some(class) = policies.classify(req) else {
            return Verdict::Continue;
        };
        let Some(policy) = policies.policies.get(class.policy_index) else {
            return Verdict::Continue;
        };
        let name = policy.name();
        let now = host.now();
        let shadow = policy.is_shadow();
        if policy.fleet_closed {
            // This Envoy's share of a global limit is nothing right now.
            if shadow {
                self.metrics.add(name, PolicyStat::ShadowLimited, 1);
                return Verdict::Continue;
            }
            self.metrics.add(name, PolicyStat::Rejected, 1);
            return Verdict::Reply(rejection(policy, LimitKind::Rate, DEFAULT_RETRY_NS));
        }
        let mut limits = BucketLimits::of(policy);
        if shadow {
            // Shadow mode judges as `reject` would, and lets everything pass.
            limits.queue = None;
        }
        let grant_key: GrantKey = (class.policy_index, class.key);
        let cost = policy.rate.is_some().then_some(class.cost);
        if let Some(bucket) = self
            .grants
            .spend(grant_key, cost, policy.concurrency.is_some(), now)
        {
            let bucket = bucket.to_string();
            return self.admitted(context_id, policy, bucket, grant_key, now);
        }
        let wanted = self.grants.wanted(grant_key, now);
        let outcome = self.place_and_admit(host, policy, &limits, &class, now, wanted);
        if let Ok((bucket, admission, granted)) = &outcome {
            let granted = match admission {
                Admission::Admitted { .. } => *granted,
                _ => Granted::default(),
            };
            if let Some(spare) = self.grants.record(grant_key, bucket, granted, now) {
                self.give_back(host, spare);
            }
            if granted.slots > 0 && self.tick_ms > GRANT_TICK_MS {
                self.tick_ms = GRANT_TICK_MS;
                host.set_tick_period_ms(GRANT_TICK_MS);
            }
        }
        let outcome = outcome.map(|(bucket, admission, _)| (bucket, admission));
        match outcome {
            Err(error) => {
                host.log(
                    Level::Warn,
                    &format!(
                        "sluice: policy {name}: shared state unavailable ({error:?}); refusing"
                    ),
                );
                if shadow {
                    self.metrics.add(name, PolicyStat::ShadowLimited, 1);
                    return Verdict::Continue;
                }
                self.metrics.add(name, PolicyStat::Rejected, 1);
                Verdict::Reply(rejection(policy, LimitKind::Rate, DEFAULT_RETRY_NS))
            }
            Ok((bucket, Admission::Admitted { .. })) => {
                self.admitted(context_id, policy, bucket, grant_key, now)
            }
            Ok((_, Admission::Rejected { kind, retry_after })) => {
                if shadow {
                    self.metrics.add(name, PolicyStat::ShadowLimited, 1);
                    host.log(
                        Level::Debug,
                        &format!(
                            "sluice: shadow policy {name} would have refused a request ({kind:?})"
                        ),
                    );
                    return Verdict::Continue;
                }
                self.metrics.add(name, PolicyStat::Rejected, 1);
                Verdict::Reply(rejection(policy, kind, retry_after))
            }
            Ok((bucket, Admission::Queued { ticket, deadline })) => {
                self.metrics.add(name, PolicyStat::Queued, 1);
                self.streams.insert(
                    context_id,
                    Stream {
                        policy: name.to_string(),
                        bucket,
                        grant: grant_key,
                        state: StreamState::Waiting { ticket, deadline },
                        since: now,
                        lease_ttl: policy.concurrency.map_or(0, |c| c.lease_ttl_ns),
                        has_concurrency: policy.concurrency.is_some(),
                    },
                );
                if self.tick_ms != QUEUE_TICK_MS {
                    self.tick_ms = QUEUE_TICK_MS;
                    host.set_tick_period_ms(QUEUE_TICK_MS);
                }
                Verdict::Pause { ticket }
            }
        }
    }

    /// Counts an admitted request and, under a concurrency limit, keeps
    /// its slot's stream until it ends.
    fn admitted(
        &mut self,
        context_id: u32,
        policy: &CompiledPolicy,
        bucket: String,
        grant: GrantKey,
        now: Nanos,
    ) -> Verdict {
        let name = policy.name();
        self.metrics.add(name, PolicyStat::Admitted, 1);
        if let Some(conc) = &policy.concurrency {
            self.metrics.add(name, PolicyStat::InFlight, 1);
            self.streams.insert(
                context_id,
                Stream {
                    policy: name.to_string(),
                    bucket,
                    grant,
                    state: StreamState::Holding,
                    since: now,
                    lease_ttl: conc.lease_ttl_ns,
                    has_concurrency: true,
                },
            );
        }
        Verdict::Continue
    }

    /// Finds the request's bucket (probing places for a keyed policy) and
    /// admits it there, taking up to `wanted` tokens more for this worker
    /// when the bucket grants them. Returns the bucket's key, the outcome
    /// and the tokens granted.
    fn place_and_admit<H: Host + ?Sized>(
        &mut self,
        host: &H,
        policy: &CompiledPolicy,
        limits: &BucketLimits,
        class: &Classification,
        now: Nanos,
        wanted: u64,
    ) -> Result<(String, Admission, Granted), StoreError> {
        let holder = self.holder;
        let name = policy.name();
        let admit = |s: &mut BucketState| {
            let a = s.admit(limits, holder, now, class.cost, class.priority);
            let granted = match a {
                Admission::Admitted { .. } => s.grant(limits, holder, now, wanted),
                _ => Granted::default(),
            };
            let changed = !matches!(a, Admission::Rejected { .. });
            ((a, granted), changed)
        };
        let BucketKey::Keyed(hash) = class.key else {
            let key = bucket_key(name, Place::Single);
            let (a, granted) = update(host, &key, &mut self.store, || BucketState::new(0), admit)?;
            return Ok((key, a, granted));
        };
        let owner = if hash == 0 || hash == OVERFLOW_OWNER {
            1
        } else {
            hash
        };
        let max_keys = policy.max_keys().unwrap_or(1).max(1);
        let first = (owner % u64::from(max_keys)) as u32;
        for probe in 0..KEY_PROBES.min(max_keys) {
            let slot = ((u64::from(first) + u64::from(probe)) % u64::from(max_keys)) as u32;
            let key = bucket_key(name, Place::Slot(slot));
            let mut evicted = false;
            let outcome = update(
                host,
                &key,
                &mut self.store,
                || BucketState::new(0),
                |s| {
                    evicted = false;
                    let mut claimed = false;
                    if s.owner != owner {
                        if s.owner != 0 && !s.is_idle(limits, now) {
                            return (None, false);
                        }
                        evicted = s.owner != 0;
                        claimed = true;
                        *s = BucketState::new(owner);
                    }
                    let (a, changed) = admit(s);
                    (Some(a), changed || claimed)
                },
            )?;
            if let Some((a, granted)) = outcome {
                if evicted {
                    self.metrics.add(name, PolicyStat::KeyEvictions, 1);
                }
                return Ok((key, a, granted));
            }
        }
        self.metrics.add(name, PolicyStat::KeyOverflow, 1);
        if policy.key_overflow() == Some(KeyOverflow::Reject) {
            let kind = if policy.rate.is_some() {
                LimitKind::Rate
            } else {
                LimitKind::Concurrency
            };
            return Ok((
                String::new(),
                Admission::Rejected {
                    kind,
                    retry_after: DEFAULT_RETRY_NS,
                },
                Granted::default(),
            ));
        }
        let key = bucket_key(name, Place::Overflow);
        let a = update(
            host,
            &key,
            &mut self.store,
            || BucketState::new(OVERFLOW_OWNER),
            admit,
        )?;
        Ok((key, a.0, a.1))
    }

    /// The stream ended, for whatever reason: give back its slot, or its
    /// place in the queue. Safe to call more than once.
    pub fn on_stream_end<H: Host + ?Sized>(&mut self, host: &H, context_id: u32) {
        let Some(stream) = self.streams.remove(&context_id) else {
            return;
        };
        let holder = self.holder;
        match stream.state {
            StreamState::Holding => {
                self.metrics.add(&stream.policy, PolicyStat::InFlight, -1);
                if self.grants.return_slot(stream.grant, || host.now()) {
                    // Kept for this worker's next request while the grant lives.
                    return;
                }
                let released = update(
                    host,
                    &stream.bucket,
                    &mut self.store,
                    || BucketState::new(0),
                    |s| {
                        let r = s.release(holder);
                        (r, r)
                    },
                );
                if released.is_err() {
                    self.metrics.add_filter(FilterStat::HostErrors, 1);
                    host.log(
                        Level::Warn,
                        &format!(
                            "sluice: could not release a slot of {}; its lease will expire",
                            stream.policy
                        ),
                    );
                }
            }
            StreamState::Waiting { ticket, .. } => {
                self.metrics
                    .add(&stream.policy, PolicyStat::QueueAbandoned, 1);
                let _ = update(
                    host,
                    &stream.bucket,
                    &mut self.store,
                    || BucketState::new(0),
                    |s| {
                        let c = s.cancel(holder, ticket);
                        (c, c)
                    },
                );
            }
        }
    }

    /// A stream the tick asked to resume was already gone.
    pub fn on_resume_failed<H: Host + ?Sized>(&mut self, host: &H, context_id: u32) {
        self.on_stream_end(host, context_id);
    }

    /// Periodic work: hand turns to waiting requests, time out the ones
    /// that waited too long, reclaim slots of streams past their lease,
    /// renew this worker's leases, flush stats.
    pub fn on_tick<H: Host + ?Sized>(&mut self, host: &H) -> Vec<StreamAction> {
        let now = host.now();
        let mut actions = Vec::new();
        self.serve_queues(host, now, &mut actions);
        for spare in self.grants.prune(now) {
            self.give_back(host, spare);
        }
        self.expire_stuck_streams(host, now);
        self.renew_leases(host, now);
        self.pick_up_published_set(host);
        self.pick_up_grants(host);
        self.apply_shares(host, now);
        self.report_counters(host, now);
        self.maybe_sync(host, now);
        self.flush(host);
        let wanted = if self.waiting() > 0 {
            QUEUE_TICK_MS
        } else if self.grants.holds_slots() {
            GRANT_TICK_MS
        } else {
            IDLE_TICK_MS
        };
        if wanted != self.tick_ms {
            self.tick_ms = wanted;
            host.set_tick_period_ms(wanted);
        }
        actions
    }

    fn serve_queues<H: Host + ?Sized>(
        &mut self,
        host: &H,
        now: Nanos,
        actions: &mut Vec<StreamAction>,
    ) {
        let mut by_bucket: BTreeMap<String, Vec<u32>> = BTreeMap::new();
        for (ctx, s) in &self.streams {
            if matches!(s.state, StreamState::Waiting { .. }) {
                by_bucket.entry(s.bucket.clone()).or_default().push(*ctx);
            }
        }
        let policies = Rc::clone(&self.policies);
        let holder = self.holder;
        for (bucket, contexts) in by_bucket {
            let Some(policy_name) = contexts
                .first()
                .and_then(|c| self.streams.get(c))
                .map(|s| s.policy.clone())
            else {
                continue;
            };
            let Some((_, policy)) = policies.find(&policy_name) else {
                // The policy is gone: nothing limits these requests any more.
                for ctx in contexts {
                    self.on_stream_end(host, ctx);
                    actions.push(StreamAction::Resume(ctx));
                }
                continue;
            };
            let limits = BucketLimits::of(policy);
            let admitted = update(
                host,
                &bucket,
                &mut self.store,
                || BucketState::new(0),
                |s| {
                    let tickets = s.poll(&limits, holder, now);
                    let changed = !tickets.is_empty();
                    (tickets, changed)
                },
            )
            .unwrap_or_default();
            for ticket in admitted {
                let Some(ctx) = contexts.iter().copied().find(|c| {
                    self.streams.get(c).is_some_and(|s| {
                        s.state
                            == StreamState::Waiting {
                                ticket,
                                deadline: waiting_deadline(s),
                            }
                    })
                }) else {
                    continue;
                };
                self.metrics.add(&policy_name, PolicyStat::Admitted, 1);
                let has_concurrency = self.streams.get(&ctx).is_some_and(|s| s.has_concurrency);
                if has_concurrency {
                    self.metrics.add(&policy_name, PolicyStat::InFlight, 1);
                    if let Some(s) = self.streams.get_mut(&ctx) {
                        s.state = StreamState::Holding;
                        s.since = now;
                    }
                } else {
                    self.streams.remove(&ctx);
                }
                actions.push(StreamAction::Resume(ctx));
            }
            for ctx in contexts {
                let timed_out = self.streams.get(&ctx).is_some_and(
                    |s| matches!(s.state, StreamState::Waiting { deadline, .. } if deadline < now),
                );
                if timed_out {
                    self.on_stream_end(host, ctx);
                    self.metrics
                        .add(&policy_name, PolicyStat::QueueAbandoned, -1);
                    self.metrics.add(&policy_name, PolicyStat::QueueTimeouts, 1);
                    self.metrics.add(&policy_name, PolicyStat::Rejected, 1);
                    let kind = if policy.rate.is_some() {
                        LimitKind::Rate
                    } else {
                        LimitKind::Concurrency
                    };
                    actions.push(StreamAction::Reply(
                        ctx,
                        rejection(policy, kind, DEFAULT_RETRY_NS),
                    ));
                }
            }
        }
    }

    /// A stream holding a slot longer than the lease TTL (one that never
    /// ends) gives the slot back, as a crashed worker's slots come back.
    fn expire_stuck_streams<H: Host + ?Sized>(&mut self, host: &H, now: Nanos) {
        let stuck: Vec<u32> = self
            .streams
            .iter()
            .filter(|(_, s)| {
                s.state == StreamState::Holding && now.saturating_sub(s.since) > s.lease_ttl
            })
            .map(|(c, _)| *c)
            .collect();
        for ctx in stuck {
            if let Some(policy) = self.streams.get(&ctx).map(|s| s.policy.clone()) {
                self.metrics.add(&policy, PolicyStat::LeasesExpired, 1);
            }
            self.on_stream_end(host, ctx);
        }
    }

    /// Keeps this worker's leases alive while it holds slots: renewing at a
    /// quarter of the TTL leaves three chances before a lease could lapse.
    fn renew_leases<H: Host + ?Sized>(&mut self, host: &H, now: Nanos) {
        let mut buckets: BTreeMap<String, Nanos> = BTreeMap::new();
        for s in self.streams.values() {
            if s.state == StreamState::Holding {
                let ttl = buckets.entry(s.bucket.clone()).or_insert(s.lease_ttl);
                *ttl = (*ttl).min(s.lease_ttl);
            }
        }
        self.renewed_at.retain(|b, _| buckets.contains_key(b));
        let holder = self.holder;
        for (bucket, ttl) in buckets {
            let last = self.renewed_at.get(&bucket).copied().unwrap_or(0);
            if now.saturating_sub(last) < ttl / 4 {
                continue;
            }
            let ok = update(
                host,
                &bucket,
                &mut self.store,
                || BucketState::new(0),
                |s| {
                    let r = s.renew(holder, now, ttl);
                    (r, r)
                },
            );
            if ok.is_ok() {
                self.renewed_at.insert(bucket, now);
            }
        }
    }

    fn flush<H: Host + ?Sized>(&mut self, host: &H) {
        let s = self.store;
        let f = self.flushed_store;
        let delta = |a: u64, b: u64| i64::try_from(a.saturating_sub(b)).unwrap_or(i64::MAX);
        self.metrics
            .add_filter(FilterStat::CasRetries, delta(s.cas_retries, f.cas_retries));
        self.metrics.add_filter(
            FilterStat::CasExhausted,
            delta(s.cas_exhausted, f.cas_exhausted),
        );
        self.metrics.add_filter(
            FilterStat::StateDecodeErrors,
            delta(s.decode_errors, f.decode_errors),
        );
        self.flushed_store = s;
        self.metrics.flush(host);
    }

    /// Installs the admin's set another VM published, if newer than ours.
    /// Bucket states stay in shared data under each policy's name, so
    /// policies that did not change keep their state.
    fn pick_up_published_set<H: Host + ?Sized>(&mut self, host: &H) {
        let Some(version) = policy_sync::published_version(host) else {
            return;
        };
        if version <= self.admin_version {
            return;
        }
        match policy_sync::published_set(host) {
            Some(set) if set.version > self.admin_version => {
                let (n, v) = (set.policies.len(), set.version);
                self.admin_version = v;
                self.install(host, CompiledPolicySet::from_validated(set));
                self.metrics.add_filter(FilterStat::PolicySetsInstalled, 1);
                host.log(
                    Level::Info,
                    &format!(
                        "sluice: holder {} now enforcing policy set version {v} ({n} policies)",
                        self.holder
                    ),
                );
            }
            _ => {}
        }
    }

    fn report_counters<H: Host + ?Sized>(&mut self, host: &H, now: Nanos) {
        if self.sync.is_none() || now.saturating_sub(self.reported_at) < REPORT_EVERY_NS {
            return;
        }
        self.reported_at = now;
        let deltas = self.metrics.take_unreported();
        if !deltas.is_empty() && policy_sync::add_to_report(host, &mut self.store, &deltas).is_err()
        {
            self.metrics.add_filter(FilterStat::HostErrors, 1);
        }
    }

    /// If it is this Envoy's turn to sync and this VM wins it, sends the
    /// utilization snapshot to the admin.
    fn maybe_sync<H: Host + ?Sized>(&mut self, host: &H, now: Nanos) {
        let Some(settings) = self.sync.clone() else {
            return;
        };
        if let Some((_, sent)) = self.pending_call {
            // Envoy answers every call, if only with a timeout; this is a
            // guard against a lost answer blocking sync for good.
            if now.saturating_sub(sent) < settings.timeout_ms() * 2_000_000 {
                return;
            }
            self.pending_call = None;
        }
        if !policy_sync::claim_turn(host, &mut self.store, now, settings.interval_ns) {
            return;
        }
        let report = self.snapshot(host, &settings, now);
        let body = serde_json::to_vec(&report).unwrap_or_default();
        let (headers, body) = policy_sync::request(&settings, &body);
        let headers: Vec<(&str, &str)> = headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        match host.dispatch_http_call(&settings.cluster, &headers, &body, settings.timeout_ms()) {
            Some(token) => self.pending_call = Some((token, now)),
            None => {
                self.metrics.add_filter(FilterStat::SyncFailures, 1);
                policy_sync::finish_turn(host, &mut self.store, now, settings.interval_ns, false);
                host.log(
                    Level::Warn,
                    &format!("sluice: cannot call the admin through cluster {:?}; keeping policy set version {}", settings.cluster, self.admin_version),
                );
            }
        }
    }

    fn snapshot<H: Host + ?Sized>(
        &self,
        host: &H,
        settings: &SyncSettings,
        now: Nanos,
    ) -> sluice_shared::sync::SyncReport {
        let counters = policy_sync::read_report(host);
        let mut policies = BTreeMap::new();
        for p in &self.policies.policies {
            let mut report = counters
                .get(p.name())
                .copied()
                .unwrap_or_default()
                .to_report();
            report.max_in_flight = p.concurrency.map_or(0, |c| u64::from(c.max_in_flight));
            if p.max_keys().is_none() {
                // One bucket: its tokens and queue are the policy's.
                let key = bucket_key(p.name(), Place::Single);
                if let Some(Ok(state)) = host.shared_get(&key).0.as_deref().map(BucketState::decode)
                {
                    report.waiting = state.waiters.len() as u64;
                    if let (Some(limiter), Some(rate)) = (&p.rate, &state.rate) {
                        report.tokens = Some(limiter.available(rate, now));
                    } else if let Some(limiter) = &p.rate {
                        report.tokens = Some(limiter.available(&limiter.initial_state(), now));
                    }
                } else if let Some(limiter) = &p.rate {
                    report.tokens = Some(limiter.available(&limiter.initial_state(), now));
                }
            }
            policies.insert(p.name().to_string(), report);
        }
        let (_, held) = fleet::published(host);
        sluice_shared::sync::SyncReport {
            instance: settings.instance.clone(),
            policy_version: self.admin_version,
            at_ms: now / 1_000_000,
            policies,
            filter: BTreeMap::new(),
            grants: held.into_iter().map(|(p, g)| (p, g.id)).collect(),
        }
    }

    /// The fleet shares in the answer to sync call `token` (its
    /// `sluice-grants` header); called before the answer itself.
    pub fn on_sync_grants<H: Host + ?Sized>(
        &mut self,
        host: &H,
        token: u32,
        status: Option<u16>,
        header: Option<&[u8]>,
    ) {
        let Some((pending, sent)) = self.pending_call else {
            return;
        };
        if pending != token || !matches!(status, Some(200 | 304)) {
            return;
        }
        let Some(header) = header else {
            return;
        };
        let Some(grants) = fleet::parse_header(header, sent) else {
            self.metrics.add_filter(FilterStat::SyncFailures, 1);
            host.log(
                Level::Warn,
                "sluice: the admin's sluice-grants header does not parse; keeping the shares held",
            );
            return;
        };
        if fleet::publish(host, &mut self.store, &grants).is_err() {
            self.metrics.add_filter(FilterStat::HostErrors, 1);
            return;
        }
        self.pick_up_grants(host);
        self.apply_shares(host, host.now());
    }

    /// The admin answered (or Envoy gave up on it: `status` None).
    pub fn on_sync_response<H: Host + ?Sized>(
        &mut self,
        host: &H,
        token: u32,
        status: Option<u16>,
        body: Option<&[u8]>,
    ) {
        self.on_sync_answer(host, token, policy_sync::interpret(status, body));
    }

    /// The answer to the sync call `token`, already interpreted (the shell
    /// refuses an oversized body before reading it).
    pub fn on_sync_answer<H: Host + ?Sized>(&mut self, host: &H, token: u32, answer: Answer) {
        if self.pending_call.map(|(t, _)| t) != Some(token) {
            return;
        }
        self.pending_call = None;
        let Some(settings) = self.sync.clone() else {
            return;
        };
        let now = host.now();
        let ok = match answer {
            Answer::Unchanged => true,
            Answer::PolicySet(set) => match policy_sync::publish(host, &mut self.store, &set) {
                Ok(_) => {
                    self.pick_up_published_set(host);
                    true
                }
                Err(e) => {
                    host.log(
                        Level::Warn,
                        &format!(
                            "sluice: could not store policy set version {}: {e:?}",
                            set.version
                        ),
                    );
                    false
                }
            },
            Answer::Failed(why) => {
                host.log(
                    Level::Warn,
                    &format!(
                        "sluice: sync with the admin failed: {why}; keeping policy set version {}",
                        self.admin_version
                    ),
                );
                false
            }
        };
        self.metrics.add_filter(
            if ok {
                FilterStat::SyncOk
            } else {
                FilterStat::SyncFailures
            },
            1,
        );
        policy_sync::finish_turn(host, &mut self.store, now, settings.interval_ns, ok);
    }

    pub fn count(&mut self, stat: FilterStat) {
        self.metrics.add_filter(stat, 1);
    }
}

fn waiting_deadline(s: &Stream) -> Nanos {
    match s.state {
        StreamState::Waiting { deadline, .. } => deadline,
        StreamState::Holding => 0,
    }
}

fn rejection(policy: &CompiledPolicy, kind: LimitKind, retry_after: Nanos) -> LocalReply {
    let mut headers = rejection_headers(&policy.policy, kind, retry_after);
    headers.push(("content-type", "text/plain; charset=utf-8".to_string()));
    let body = match &policy.policy.on_limit.body {
        Some(body) => body.as_bytes().to_vec(),
        None => format!("limited by sluice policy {}\n", policy.name()).into_bytes(),
    };
    LocalReply {
        status: u32::from(policy.policy.on_limit.status),
        headers,
        body,
    }
}
