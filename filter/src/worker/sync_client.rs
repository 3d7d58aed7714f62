//! This worker's side of the sync with the admin: adding its counters to
//! the shared report, taking the Envoy's sync turn when it is due, sending
//! the report, and making sense of the answer. One VM per Envoy calls the
//! admin per interval; every VM installs what that call brought, from
//! shared data.

use std::collections::BTreeMap;

use sluice_filter_core::bucket::BucketState;
use sluice_filter_core::matcher::{CompiledPolicy, CompiledPolicySet, RequestAtHand};
use sluice_shared::key_view::KeyOutcome;
use sluice_shared::request_headers::RequestHeaders;
use sluice_shared::time::{Instant, Span};
use sluice_shared::PolicySet;
use sluice_wire::sync::{HeldShareReport, SyncReport};

use super::budgets::Budgets;
use super::ctx::Ctx;
use super::key_counts::KeyCounts;
use super::spend::SpendScan;
use super::sync_report::{fair_views, limit_reports};
use crate::entries::{state_key, LimitOf, Place};
use crate::host::{Host, Level};
use crate::metrics::FilterCounter;
use crate::report;
use crate::store::Store;
use crate::sync::fleet;
use crate::sync::watch;
use crate::sync::{self as policy_sync, Answer, Published, SetId, SyncSettings};

/// How often a worker adds its counters to the shared sync report (one
/// shared-data write, only while syncing and only with counts to add). The
/// admin reads demand off these counts: at 100 ms a sync could miss a
/// worker's last 100 ms of calls, and a 200 ms measurement then read half
/// the real rate.
const REPORT_EVERY: Span = Span::from_millis(20);

#[derive(Debug, Default)]
pub(super) struct SyncClient {
    /// Where to sync from (None: the fallback set, or sets another VM
    /// publishes, only).
    settings: Option<SyncSettings>,
    /// The admin's set this worker enforces (version 0: the fallback).
    admin_set: SetId,
    /// The stale answer last logged, so that each is logged once.
    stale_logged: Option<SetId>,
    /// The sync call this VM is waiting for: (token, sent at).
    pending_call: Option<(u32, Instant)>,
    reported_at: Instant,
    /// When this VM last brought the sync forward.
    hurried_at: Instant,
    /// News came within [`HURRY_EVERY`] of the last hurry: the sync is
    /// brought forward once that has passed, not dropped (a second freeing
    /// of fleet room 50 ms after the first otherwise waited a whole
    /// interval).
    hurry_owed: bool,
    /// When this VM last refused a call of a global policy.
    fleet_refused_at: Instant,
    /// Per-key counts for the live view.
    keys: KeyCounts,
    /// What keyed limits of an hour or longer spent, place by place.
    spend: SpendScan,
    /// The watch call this VM holds open (push): (token, sent at).
    watch_call: Option<WatchCall>,
    /// The watch is failing: logged once until it answers again.
    watch_failing: bool,
    /// Another VM holds the watch until then.
    watch_held_until: Instant,
    /// The longest wait between sync attempts while they fail, for the
    /// policies of this VM's last sync (None: none yet).
    longest_backoff: Option<Span>,
}

/// The watch call a VM holds open: its token, when it went, and the set
/// it named (the one this VM enforced then).
#[derive(Debug, Clone, Copy)]
pub(super) struct WatchCall {
    token: u32,
    sent: Instant,
    named: SetId,
}

/// How often one VM may bring the Envoy's sync forward: a provider
/// refusing call after call must not turn syncs into a flood.
const HURRY_EVERY: Span = Span::from_millis(100);

/// A VM that refuses a global policy's call after this long without
/// refusing one brings the sync forward: its load grew past its share (the
/// load moved here), and the admin learns it within milliseconds instead
/// of at the next interval. A VM refusing all along (its share is what the
/// others leave it) does not.
const FLEET_QUIET: Span = Span::from_secs(1);

impl SyncClient {
    pub fn configure(&mut self, settings: Option<SyncSettings>) {
        self.keys
            .configure(settings.as_ref().map(|s| s.token.as_deref()));
        self.settings = settings;
    }

    /// Counts a keyed request for the live view (when there is an admin).
    pub fn count_key<R: RequestHeaders + ?Sized>(
        &mut self,
        policy: &CompiledPolicy,
        request: RequestAtHand<'_, R>,
        outcome: KeyOutcome,
        overflowed: bool,
        now: Instant,
    ) {
        self.keys.record(policy, request, outcome, overflowed, now);
    }

    pub fn is_configured(&self) -> bool {
        self.settings.is_some()
    }

    /// Whether pushed sets may arrive (workers then look for them often).
    pub fn pushes(&self) -> bool {
        self.settings.as_ref().is_some_and(|s| s.push)
    }

    pub fn admin_version(&self) -> u64 {
        self.admin_set.version
    }

    /// The set another VM (or this one) published, if it is not the one
    /// this worker enforces (only a set that may replace it is ever
    /// published). Bucket states stay in shared data under each policy's
    /// name, so policies that did not change keep their state.
    pub fn pick_up_published_set<H: Host + ?Sized>(&mut self, host: &H) -> Option<PolicySet> {
        if policy_sync::published_id(host)? == self.admin_set {
            return None;
        }
        let (id, set) = policy_sync::published_set(host)?;
        if id == self.admin_set {
            return None;
        }
        self.admin_set = id;
        Some(set)
    }

    /// News for the other Envoys (a pause, a rate cut): the Envoy's next
    /// sync is brought forward to now, so that the admin hears of it
    /// within a tick instead of an interval.
    pub fn hurry<H: Host + ?Sized>(&mut self, ctx: &mut Ctx<'_, H>) {
        if ctx.now.since(self.hurried_at) < HURRY_EVERY {
            self.hurry_owed = self.settings.is_some();
            return;
        }
        self.hurry_now(ctx);
    }

    /// [`Self::hurry`] without waiting out [`HURRY_EVERY`]: for a step of
    /// the fleet protocol (saying a smaller share is held, so the admin
    /// frees the larger one's room), which only an answer brings, so it
    /// cannot flood.
    pub fn hurry_now<H: Host + ?Sized>(&mut self, ctx: &mut Ctx<'_, H>) {
        let (host, store, now) = (ctx.host, &mut *ctx.store, ctx.now);
        if self.settings.is_none() {
            return;
        }
        self.hurry_owed = false;
        self.hurried_at = now;
        // This VM's counters go with the news.
        self.reported_at = Instant::EPOCH;
        policy_sync::hurry(host, store, now);
    }

    /// This VM refused a call of a global policy (its share ran out).
    pub fn fleet_refused<H: Host + ?Sized>(&mut self, ctx: &mut Ctx<'_, H>) {
        let quiet = ctx.now.since(self.fleet_refused_at) >= FLEET_QUIET;
        self.fleet_refused_at = ctx.now;
        if quiet {
            // The refusal counted so far goes with the news.
            self.hurry(ctx);
        }
    }

    pub fn report_counters<H: Host + ?Sized>(&mut self, ctx: &mut Ctx<'_, H>) {
        let (host, store, metrics, now) = (ctx.host, &mut *ctx.store, &mut *ctx.metrics, ctx.now);
        if self.settings.is_none() || now - self.reported_at < REPORT_EVERY {
            return;
        }
        self.reported_at = now;
        let deltas = metrics.take_unreported();
        if !deltas.is_empty() {
            // A failure is counted and logged by the store; these counts
            // are then missing from the admin's view, not from Envoy's stats.
            let _ = report::add_to_report(host, store, &deltas);
        }
        let limit_deltas = metrics.take_unreported_limits();
        if !limit_deltas.is_empty() {
            let _ = report::add_to_limit_report(host, store, &limit_deltas);
        }
        let refused = metrics.take_refused();
        if !refused.is_empty() {
            let _ = report::add_refused(host, store, &refused);
        }
        self.keys.flush(host, store);
    }

    /// If it is this Envoy's turn to sync and this VM wins it, sends the
    /// utilization snapshot to the admin.
    pub fn maybe_sync<H: Host + ?Sized>(
        &mut self,
        ctx: &mut Ctx<'_, H>,
        budgets: &mut Budgets,
        policies: &CompiledPolicySet,
    ) {
        if self.hurry_owed && ctx.now.since(self.hurried_at) >= HURRY_EVERY {
            self.hurry(ctx);
        }
        let (host, store, metrics, now) = (ctx.host, &mut *ctx.store, &mut *ctx.metrics, ctx.now);
        let Some(settings) = &self.settings else {
            return;
        };
        if let Some((_, sent)) = self.pending_call {
            // Envoy answers every call, if only with a timeout; this is a
            // guard against a lost answer blocking sync for good.
            if now - sent < settings.timeout().saturating_mul(2) {
                return;
            }
            self.pending_call = None;
        }
        if !policy_sync::claim_turn(host, store, now, settings.interval) {
            return;
        }
        let longest_backoff = policy_sync::longest_backoff(policies);
        self.longest_backoff = Some(longest_backoff);
        let mut report = self.snapshot(host, store, policies, &settings.instance, now);
        report.budgets = budgets.report(host, policies, now);
        report.limits = limit_reports(host, policies, now, &mut self.spend);
        // Keys of a budget not known yet are being given back: the admin
        // has them already.
        report.budget_keys = self.spend.take_changed();
        report
            .budget_keys
            .retain(|name, _| report.budgets.get(name).is_some_and(|b| b.known));
        let body = serde_json::to_vec(&report).unwrap_or_default();
        let (headers, body) = policy_sync::request(settings, &body);
        let headers: Vec<(&str, &str)> = headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        match host.dispatch_http_call(&settings.cluster, &headers, &body, settings.timeout()) {
            Some(token) => self.pending_call = Some((token, now)),
            None => {
                metrics.add_filter(FilterCounter::SyncFailures, 1);
                policy_sync::finish_turn(
                    host,
                    store,
                    now,
                    settings.interval,
                    longest_backoff,
                    false,
                );
                host.log(
                    Level::Warn,
                    &format!(
                        "sluice: cannot call the admin through cluster {:?}; keeping policy set version {}",
                        settings.cluster, self.admin_set.version
                    ),
                );
            }
        }
    }

    fn snapshot<H: Host + ?Sized>(
        &self,
        host: &H,
        store: &mut Store,
        policies: &CompiledPolicySet,
        instance: &str,
        now: Instant,
    ) -> SyncReport {
        let counters = report::read_report(host);
        let mut reports = BTreeMap::new();
        for p in &policies.policies {
            let mut report =
                crate::counters::policy_report(counters.get(p.name()).copied().unwrap_or_default());
            report.max_in_flight = p.concurrency.map_or(0, |c| u64::from(c.max_in_flight));
            if p.max_keys().is_none() {
                // One bucket: its tokens and queue are the policy's.
                let state = store
                    .read_as::<BucketState, _>(
                        host,
                        &state_key(LimitOf::Policy(p.name()), Place::Single),
                    )
                    .unwrap_or_default();
                report.waiting = state.waiters.len() as u64;
                if let Some(limiter) = &p.rate {
                    let rate = state.rate.unwrap_or_else(|| limiter.initial_state());
                    report.tokens = Some(limiter.available(&rate, now));
                }
            }
            reports.insert(p.name().to_string(), report);
        }
        let (_, held) = fleet::published(host);
        SyncReport {
            instance: instance.to_string(),
            policy_version: self.admin_set.version,
            policy_epoch: self.admin_set.epoch,
            at_ms: now.as_millis(),
            policies: reports,
            filter: BTreeMap::new(),
            shares: held.iter().map(|(p, s)| (p.clone(), s.id)).collect(),
            held: held
                .into_iter()
                .map(|(p, s)| {
                    let report = HeldShareReport {
                        rate: s.amount.rate,
                        in_flight: s.amount.in_flight,
                        instances: s.instances,
                        tag: s.tag,
                    };
                    (p, report)
                })
                .collect(),
            limits: BTreeMap::new(),
            budget_keys: BTreeMap::new(),
            budgets: BTreeMap::new(),
            keys: report::take_keys_report(host, store, now, |name| policies.find(name).is_some()),
            fair: fair_views(host, store, policies, now),
        }
    }

    /// Ends the wait for call `token`; returns when it was sent, or None if
    /// it is not the call this VM waits for.
    /// Opens the watch call if push is on, no VM of this Envoy holds it and
    /// the last one did not fail just now.
    pub fn maybe_watch<H: Host + ?Sized>(&mut self, ctx: &mut Ctx<'_, H>) {
        let (host, store, metrics, now) = (ctx.host, &mut *ctx.store, &mut *ctx.metrics, ctx.now);
        let Some(settings) = self.settings.as_ref().filter(|s| s.push) else {
            return;
        };
        let call_limit = watch::HOLD + watch::MARGIN;
        if let Some(WatchCall { sent, .. }) = self.watch_call {
            // Envoy answers every call, if only with a timeout; a guard
            // against a lost answer keeping the watch closed for good.
            if now - sent < call_limit.saturating_mul(2) {
                return;
            }
            self.watch_call = None;
        }
        if now < self.watch_held_until {
            return;
        }
        if let Err(held_until) = watch::claim(host, store, now, now + call_limit) {
            // Another VM holds it: no shared-data read per tick meanwhile.
            // Its holder, not this VM, opens it again after an answer.
            self.watch_held_until = held_until;
            return;
        }
        let (headers, body) = watch::request(settings, self.admin_set);
        let headers: Vec<(&str, &str)> = headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        match host.dispatch_http_call(&settings.cluster, &headers, &body, call_limit) {
            Some(token) => {
                self.watch_call = Some(WatchCall {
                    token,
                    sent: now,
                    named: self.admin_set,
                })
            }
            None => {
                metrics.add_filter(FilterCounter::PushFailures, 1);
                watch::release(host, store, watch::retry_after(host, now));
            }
        }
    }

    /// This VM's watch call `token`, if it is that call (which it then is
    /// no more).
    pub fn take_watch(&mut self, token: u32) -> Option<WatchCall> {
        match self.watch_call {
            Some(call) if call.token == token => {
                self.watch_call = None;
                Some(call)
            }
            _ => None,
        }
    }

    /// The admin answered the watch (or Envoy gave up on it): a pushed set
    /// is published and returned to install, as a sync's would be. The
    /// watch opens again at once after an answer, after 1 to 3 s after a
    /// failure.
    pub fn on_watch_answer<H: Host + ?Sized>(
        &mut self,
        ctx: &mut Ctx<'_, H>,
        answer: Answer,
        epoch: u64,
        sync_now: bool,
        call: WatchCall,
    ) -> Option<PolicySet> {
        let (host, now) = (ctx.host, ctx.now);
        // The admin answered with a set other than the one the watch named:
        // news, even when a sync brought it here first. So is a word to
        // sync now: fleet room was freed that this Envoy may want.
        let sync_now = sync_now && matches!(answer, Answer::Unchanged);
        let news = sync_now
            || matches!(&answer, Answer::PolicySet(set)
            if (SetId { epoch, version: set.version }) != call.named);
        if sync_now {
            self.hurry(ctx);
        }
        let (ok, installed) = match answer {
            Answer::Unchanged => (true, None),
            Answer::PolicySet(set) => {
                let (ok, stat, installed) = self.take_set(host, ctx.store, set, epoch);
                ctx.metrics.add_filter(stat, 1);
                if installed.is_some() {
                    ctx.metrics.add_filter(FilterCounter::PushSets, 1);
                }
                (ok, installed)
            }
            Answer::Failed(why) => {
                if !self.watch_failing {
                    host.log(
                        Level::Warn,
                        &format!("sluice: the admin's push watch failed: {why}; retrying within 3 s, syncs go on"),
                    );
                }
                (false, None)
            }
        };
        self.watch_failing = !ok;
        if ok && news {
            // Even news opens the next watch at most every NEWS_GAP: an
            // admin that answers news after news cannot spin this VM.
            let reopen = (call.sent + watch::NEWS_GAP).max(now);
            watch::release(host, ctx.store, reopen);
            if reopen <= now {
                self.maybe_watch(ctx);
            }
        } else if ok {
            // An answer that brought nothing new comes after the hold; one
            // that comes at once (an admin that does not hold) must not
            // turn watches into a loop.
            watch::release(host, ctx.store, (call.sent + watch::MIN_GAP).max(now));
        } else {
            ctx.metrics.add_filter(FilterCounter::PushFailures, 1);
            watch::release(host, ctx.store, watch::retry_after(host, now));
        }
        installed
    }

    pub fn take_pending(&mut self, token: u32) -> Option<Instant> {
        match self.pending_call {
            Some((pending, sent)) if pending == token => {
                self.pending_call = None;
                Some(sent)
            }
            _ => None,
        }
    }

    /// The admin's answer, from the store of `epoch`: a valid set that may
    /// replace the one held is published for every VM and returned for
    /// this one to install; an older version of the same store is kept out
    /// and counted as stale; anything else keeps the set in force. Ends
    /// the sync turn, backing off after a failure.
    pub fn on_answer<H: Host + ?Sized>(
        &mut self,
        ctx: &mut Ctx<'_, H>,
        answer: Answer,
        epoch: u64,
    ) -> Option<PolicySet> {
        let (host, store, metrics) = (ctx.host, &mut *ctx.store, &mut *ctx.metrics);
        let mut installed = None;
        let (ok, stat) = match answer {
            Answer::Unchanged => (true, FilterCounter::SyncOk),
            Answer::PolicySet(set) => {
                let (ok, stat, set) = self.take_set(host, store, set, epoch);
                if set.is_some() {
                    metrics.add_filter(FilterCounter::SyncSets, 1);
                }
                installed = set;
                (ok, stat)
            }
            Answer::Failed(why) => {
                host.log(
                    Level::Warn,
                    &format!(
                        "sluice: sync with the admin failed: {why}; keeping policy set version {}",
                        self.admin_set.version
                    ),
                );
                (false, FilterCounter::SyncFailures)
            }
        };
        metrics.add_filter(stat, 1);
        if let Some(settings) = &self.settings {
            let longest = self.longest_backoff.unwrap_or(policy_sync::MAX_BACKOFF);
            policy_sync::finish_turn(host, store, host.now(), settings.interval, longest, ok);
        }
        installed
    }

    /// A set the admin sent (synced or pushed), from the store of `epoch`:
    /// published for every VM if it may replace the one held. Whether the
    /// admin answered well, the stat to count, and the set to install here.
    fn take_set<H: Host + ?Sized>(
        &mut self,
        host: &H,
        store: &mut Store,
        set: PolicySet,
        epoch: u64,
    ) -> (bool, FilterCounter, Option<PolicySet>) {
        let offered = SetId {
            epoch,
            version: set.version,
        };
        match policy_sync::publish(host, store, offered, &set) {
            Ok(Published::Stored | Published::Held) => (
                true,
                FilterCounter::SyncOk,
                self.pick_up_published_set(host),
            ),
            Ok(Published::Stale { held }) => {
                self.log_stale(host, offered, held);
                // The admin answered; there is nothing to back off from.
                (true, FilterCounter::SyncStale, None)
            }
            // The store counted and logged why.
            Err(_) => (false, FilterCounter::SyncFailures, None),
        }
    }

    fn log_stale<H: Host + ?Sized>(&mut self, host: &H, offered: SetId, held: SetId) {
        if self.stale_logged == Some(offered) {
            return;
        }
        self.stale_logged = Some(offered);
        host.log(
            Level::Warn,
            &format!(
                "sluice: the admin sent policy set version {} of store {} but this Envoy enforces version {} of the same store; \
                 keeping it (counted in sluice.sync_stale; an admin whose store was restored answers with a new store epoch)",
                offered.version, offered.epoch, held.version
            ),
        );
    }
}
