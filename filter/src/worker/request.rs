//! A request through the worker: its body read as far as a decision
//! needs, its policy found, what it takes from each limit, the decision,
//! and what a call holding its limits hands over to the parts acting on
//! its answer ([`Parts::hold`], also for a call leaving the queue).

use std::sync::Arc;

use sluice_filter_core::matcher::{
    BodyJson, BucketKey, Classification, Classified, CompiledPolicy, CompiledPolicySet, KeySecrets,
    RequestAtHand,
};
use sluice_filter_core::pricing::CallPrice;
use sluice_shared::key_view::KeyOutcome;
use sluice_shared::request_headers::RequestHeaders;

use super::admission::{self, Decision};
use super::asked_usage::Asked;
use super::call::{Holding, PoolRoute};
use super::ctx::Ctx;
use super::downgrade::{AsItCame, Downgraded};
use super::held_slot::HeldSlot;
use super::limits::{Held, LimitInputs};
use super::pool::{self, PoolCall};
use super::streams::PolicyStats;
use super::telling::Told;
use super::{
    refusal, rpc_reply, spend, streams, Parts, RequestBody, Verdict, MAX_REQUEST_BODY_BYTES,
    PREFETCH_TICK, QUEUE_TICK,
};
use crate::host::{Host, Level};
use crate::metrics::{FilterCounter, LimitCounter, PolicyCounter};

impl Parts {
    /// Decides a request (with its body, once a policy asked for it):
    /// its policy, what it takes from each limit, the decision, and what
    /// the shell is to do with it.
    pub(super) fn request<H, R>(
        &mut self,
        ctx: &mut Ctx<'_, H>,
        context_id: u32,
        req: &R,
        body: RequestBody<'_>,
    ) -> Verdict
    where
        H: Host + ?Sized,
        R: RequestHeaders + ?Sized,
    {
        match body {
            // As the headers arrive, before any policy is found: a
            // caller's route header must not route a call no pool chose.
            RequestBody::Absent | RequestBody::Coming => self.route_headers.strip(ctx, req),
            RequestBody::Read(_) => self.body_waits.end(context_id),
        }
        let policies = Arc::clone(&self.policies);
        let raw = body.bytes();
        let body = body_json(ctx, body);
        let class = match self.classify(ctx, &policies, context_id, req, &body) {
            Ok(Some(class)) => class,
            Ok(None) => return Verdict::Continue,
            Err(verdict) => return verdict,
        };
        let Some(policy) = policies.policies.get(class.policy_index) else {
            return Verdict::Continue;
        };
        self.notice_how_it_read(ctx, policy, &class, &body);
        // Far from its limits a call spends a prefetch, for which the
        // clock's last reading will do while calls come densely.
        ctx.reuse_clock();
        let mut inputs = self.inputs_of(ctx, policy, context_id, req, &body);
        let mut deciding = admission::Deciding::new(&mut self.prefetches, &mut self.budgets);
        let (decision, held) =
            deciding.decide(ctx, policy, &class, &inputs.limits, inputs.pool.as_ref());
        let request = RequestAtHand::new(req, &body);
        if class.key != BucketKey::Policy {
            let (outcome, overflowed) = (key_outcome(&decision), deciding.overflowed);
            self.sync
                .count_key(policy, request, outcome, overflowed, ctx.now);
        }
        // Only a call admitted now holds its limits (a queued one takes
        // them when its turn comes): what it took moves to its holding.
        let admitted = held.map(|held| Admitted {
            context_id,
            pool_index: class.policy_index,
            held,
            downgraded: None,
        });
        let came = AsItCame {
            req,
            body: &body,
            raw,
        };
        let (slots, sent_body) =
            self.hold_if_admitted(ctx, &policies, admitted, &came, &mut inputs, request);
        if matches!(decision, Decision::Refuse(_)) && policy.is_global() {
            self.sync.fleet_refused(ctx);
        }
        if !matches!(decision, Decision::Refuse(_)) {
            let told = Told::of(&policies, class.policy_index);
            let sent = sent_body.as_deref().or(raw);
            let asked = sent.and_then(|raw| Asked::ask(ctx, policy, raw));
            self.calls.goes(context_id, told, asked);
        }
        let series = self.series.get(class.policy_index).copied();
        let series = series.unwrap_or_else(|| ctx.metrics.series_of(policy.name()));
        let decided = Decided {
            context_id,
            policy: PolicyStats { policy, series },
            decision,
            slots,
        };
        self.verdict(ctx, decided, inputs, request)
    }

    /// The policy a request falls under and how (None: none limits it);
    /// Err: what the request gets instead (its body is asked for, or it
    /// names a key twice).
    fn classify<H, R>(
        &mut self,
        ctx: &mut Ctx<'_, H>,
        policies: &Arc<CompiledPolicySet>,
        context_id: u32,
        req: &R,
        body: &BodyJson,
    ) -> Result<Option<Classification>, Verdict>
    where
        H: Host + ?Sized,
        R: RequestHeaders + ?Sized,
    {
        let secrets = KeySecrets::new(&self.key_secret, self.spend_labels.secret());
        let (class, passed_over) = match policies.classify(req, secrets, body) {
            Classified::NeedsBody { from } => {
                return Err(self.await_body(ctx, context_id, req, from));
            }
            Classified::DuplicateKey { policy_index, key } => {
                let Some(policy) = policies.policies.get(policy_index) else {
                    return Ok(None);
                };
                ctx.metrics
                    .add(policy.name(), PolicyCounter::BodyRefused, 1);
                return Err(Verdict::Reply(refusal::duplicate_key(policy, &key)));
            }
            Classified::BatchRefused {
                policy_index,
                problem,
            } => {
                let Some(policy) = policies.policies.get(policy_index) else {
                    return Ok(None);
                };
                ctx.metrics
                    .add(policy.name(), PolicyCounter::BodyRefused, 1);
                let reply = refusal::batch_refused(policy, problem);
                let reply = match policy.rpc_call(body) {
                    Some(call) => rpc_reply::for_rpc(reply, &call),
                    None => reply,
                };
                return Err(Verdict::Reply(reply));
            }
            Classified::Split { parts } => {
                return Err(self.split_batch(ctx, policies, context_id, req, body, parts));
            }
            Classified::Decided { class, passed_over } => (class, passed_over),
        };
        for index in passed_over {
            if let Some(passed) = policies.policies.get(index) {
                ctx.metrics
                    .add(passed.name(), PolicyCounter::BodyUnmatched, 1);
            }
        }
        Ok(class)
    }

    /// Counts how the call's policy could read it: a port Envoy hid, a
    /// key its body lacks, a body that cannot be read.
    // Inlined into the hot caller as when it had only that one (a split
    // MCP batch calls it too): scenario 6 counts a call's every instruction.
    #[inline(always)]
    pub(super) fn notice_how_it_read<H: Host + ?Sized>(
        &mut self,
        ctx: &mut Ctx<'_, H>,
        policy: &CompiledPolicy,
        class: &Classification,
        body: &BodyJson,
    ) {
        if class.port_hidden {
            self.port_was_hidden(ctx, policy);
        }
        if policy.keys_from_body() {
            self.count_unread_keys(ctx, policy, body);
        }
        if body.unreadable() && policy.reads_request_body() {
            ctx.metrics
                .add(policy.name(), PolicyCounter::BodyUnreadable, 1);
        }
    }

    /// What the call takes from its policy's further limits and, for a
    /// pool call, from each member's; its model's prices.
    pub(super) fn inputs_of<H, R>(
        &self,
        ctx: &Ctx<'_, H>,
        policy: &CompiledPolicy,
        context_id: u32,
        req: &R,
        body: &BodyJson,
    ) -> CallInputs
    where
        H: Host + ?Sized,
        R: RequestHeaders + ?Sized,
    {
        let price = policy.call_price(req, body);
        let secrets = KeySecrets::new(&self.key_secret, self.spend_labels.secret());
        let fair_secret = self.spend_labels.secret().unwrap_or(&self.key_secret);
        let limits_of = |policy: &CompiledPolicy| LimitInputs {
            costs: policy.limit_costs(req, body, price.as_ref()),
            keys: policy.limit_keys(req, secrets, body),
            claimants: policy.limit_claimants(req, fair_secret, body),
        };
        let pool = policy.pool.as_ref().map(|pool| PoolCall {
            members: pool.members.iter().map(|m| limits_of(&m.policy)).collect(),
            sticky: pool.sticky_key(req, body),
            draw: ctx.now.as_nanos() ^ u64::from(context_id).rotate_left(32),
        });
        CallInputs {
            limits: limits_of(policy),
            pool,
            price,
        }
    }

    /// A call admitted now goes (past a downgrade line, for the cheaper
    /// model) holding its further limits: its slots, and the body it goes
    /// with when that changed.
    fn hold_if_admitted<H, R>(
        &mut self,
        ctx: &mut Ctx<'_, H>,
        policies: &Arc<CompiledPolicySet>,
        admitted: Option<Admitted>,
        came: &AsItCame<'_, R>,
        inputs: &mut CallInputs,
        request: RequestAtHand<'_, R>,
    ) -> (Vec<HeldSlot>, Option<Vec<u8>>)
    where
        H: Host + ?Sized,
        R: RequestHeaders + ?Sized,
    {
        let Some(mut call) = admitted else {
            return (Vec::new(), None);
        };
        if let Some(policy) = policies.policies.get(call.pool_index) {
            call.downgraded =
                self.downgrade(ctx, policy, call.context_id, &call.held, came, inputs);
        }
        let sent = call.downgraded.as_ref().map(|d| d.body.clone());
        (
            self.hold_admitted(ctx, policies, call, inputs, request),
            sent,
        )
    }

    /// A call admitted now holding its further limits (a pool call, its
    /// member's: it is routed there) hands them over; its slots.
    // Inlined into the hot caller as when it had only that one (a split
    // MCP batch calls it too): scenario 6 counts a call's every instruction.
    #[inline(always)]
    pub(super) fn hold_admitted<H, R>(
        &mut self,
        ctx: &mut Ctx<'_, H>,
        policies: &Arc<CompiledPolicySet>,
        call: Admitted,
        inputs: &mut CallInputs,
        request: RequestAtHand<'_, R>,
    ) -> Vec<HeldSlot>
    where
        H: Host + ?Sized,
        R: RequestHeaders + ?Sized,
    {
        let Admitted {
            context_id,
            pool_index,
            held,
            downgraded,
        } = call;
        // A pool call is decided, usage and answer, as its member's policy.
        let own = std::mem::take(&mut inputs.limits);
        let (limits, policy_index) = match policies.policies.get(pool_index) {
            Some(p) => {
                pool::inputs_at_member(p, pool_index, held.member, inputs.pool.as_ref(), own)
            }
            None => (own, pool_index),
        };
        let pool = policies.policy(pool_index).and_then(|p| p.pool.as_deref());
        let chosen = held
            .member
            .and_then(|at| Some((pool?, pool?.members.get(at)?)));
        if let Some((pool, member)) = chosen {
            pool::route(ctx, context_id, pool, member);
        }
        let rerouted = policies
            .policy(pool_index)
            .and_then(|p| pool::rerouted(p, held.member, &held.rungs));
        let labels = match policies.policy(policy_index) {
            Some(limits_policy) => {
                let own = &self.key_secret;
                self.spend_labels
                    .labels_of(limits_policy, request, &limits.keys, own)
            }
            None => Default::default(),
        };
        let holding = Holding {
            context_id,
            policy_index,
            costs: limits.costs,
            keys: limits.keys,
            places: held.places,
            price: inputs.price.take(),
            warnings: held.warnings,
            downgraded,
            rerouted,
            labels,
            pool: held
                .member
                .zip(inputs.pool.take())
                .map(|(chosen, call)| PoolRoute {
                    pool_index,
                    chosen,
                    call: Box::new(call),
                }),
        };
        self.hold(ctx, policies, holding);
        held.slots
    }

    /// What the shell is told to do with a decided call, its stream kept
    /// as admitted or queued.
    fn verdict<H, R>(
        &mut self,
        ctx: &mut Ctx<'_, H>,
        decided: Decided<'_>,
        inputs: CallInputs,
        request: RequestAtHand<'_, R>,
    ) -> Verdict
    where
        H: Host + ?Sized,
        R: RequestHeaders + ?Sized,
    {
        let Decided {
            context_id,
            policy,
            decision,
            mut slots,
        } = decided;
        let now = ctx.now;
        ctx.decisions
            .decided(context_id, policy.policy.name(), decision.outcome());
        match decision {
            Decision::Pass => {
                self.streams.hold_slots(context_id, policy, slots, now);
                Verdict::Continue
            }
            Decision::Refuse(reply) => Verdict::Reply(match policy.policy.rpc_call(request.body) {
                Some(call) => rpc_reply::for_rpc(reply, &call),
                None => reply,
            }),
            Decision::Admit {
                bucket,
                key,
                lease,
                prefetched_slots,
                fair_slot,
            } => {
                slots.extend(fair_slot);
                let slot = streams::Slot { bucket, lease };
                self.streams
                    .admitted(ctx.metrics, context_id, policy, slot, key, now);
                self.streams.hold_slots(context_id, policy, slots, now);
                if prefetched_slots {
                    // Spare slots must go back soon after their prefetch lapses.
                    self.set_tick(ctx, self.tick.min(PREFETCH_TICK));
                }
                Verdict::Continue
            }
            Decision::Queue {
                bucket,
                key,
                ticket,
                deadline,
            } => {
                let labels = self.labels_of_queued(
                    policy.policy,
                    request,
                    &inputs.limits.keys,
                    &inputs.pool,
                );
                let waiting = streams::Waiting {
                    bucket: bucket.into(),
                    prefetch: key,
                    turn: streams::Turn { ticket, deadline },
                    labels,
                    limits: inputs.limits,
                    price: inputs.price,
                    pool: inputs.pool.map(Box::new),
                    rpc: policy.policy.rpc_call(request.body),
                };
                self.streams
                    .queued(ctx.metrics, context_id, policy, waiting, now);
                self.set_tick(ctx, QUEUE_TICK);
                Verdict::Pause { ticket }
            }
        }
    }

    /// A call holds its limits and goes upstream (decided at once, or
    /// its turn in the queue came): each part that acts on its answer
    /// takes what it needs of it, here for both ways.
    pub(super) fn hold<H: Host + ?Sized>(
        &mut self,
        ctx: &mut Ctx<'_, H>,
        policies: &Arc<CompiledPolicySet>,
        call: Holding,
    ) {
        call.note_decision(ctx.decisions, policies);
        self.spend_labels.record(ctx, &call.labels);
        self.calls.holds(policies, &call, ctx.now);
    }

    /// The live-view labels of a queued call's keys, found while its
    /// request is at hand: in its policy's limits, and for a pool call in
    /// each member's it may leave for.
    fn labels_of_queued<R: RequestHeaders + ?Sized>(
        &self,
        policy: &CompiledPolicy,
        request: RequestAtHand<'_, R>,
        keys: &[Option<u64>],
        pool_call: &Option<PoolCall>,
    ) -> spend::KeyLabels {
        let members = policy.pool.iter().flat_map(|pool| pool.members.iter());
        let inputs = pool_call.iter().flat_map(|call| call.members.iter());
        let members = members
            .zip(inputs)
            .map(|(m, i)| (&m.policy, i.keys.as_slice()));
        let own = &self.key_secret;
        self.spend_labels
            .labels_of_all(policy, request, keys, members, own)
    }

    /// A call policies from `from` on decide on its body: it is asked for
    /// (its headers wait for it, see `stream_shell`), unless it says it is
    /// too large to read, when it is decided now as a body that cannot be
    /// read, nothing buffered (Envoy answers 413 to a body held past its
    /// own buffer limit, 1 MiB by default).
    fn await_body<H, R>(
        &mut self,
        ctx: &mut Ctx<'_, H>,
        context_id: u32,
        req: &R,
        from: usize,
    ) -> Verdict
    where
        H: Host + ?Sized,
        R: RequestHeaders + ?Sized,
    {
        if declared_length(req).is_some_and(|n| n > MAX_REQUEST_BODY_BYTES) {
            return self.request(ctx, context_id, req, RequestBody::Read(None));
        }
        // Read while the headers pass: the host answers header reads no
        // more once the body comes.
        let policies = Arc::clone(&self.policies);
        policies.keep_headers_for_body(req, from);
        if policies.may_rewrite_body(req, from) {
            // Its body may change length (asked for its usage, or a
            // cheaper model): the length it came with must not go
            // upstream with it.
            ctx.host.remove_request_header("content-length");
        }
        ctx.reuse_clock();
        // Every tick, even the idle one, notices a wait past its end.
        self.body_waits.start(context_id, ctx.now);
        Verdict::ReadBody
    }

    /// Keys read from a body that lacks them: those calls share the
    /// bucket of calls without a key, and are counted.
    fn count_unread_keys<H: Host + ?Sized>(
        &mut self,
        ctx: &mut Ctx<'_, H>,
        policy: &CompiledPolicy,
        body: &BodyJson,
    ) {
        if policy.key_unread(body) {
            ctx.metrics.add(policy.name(), PolicyCounter::KeyUnread, 1);
        }
        for limit in policy.limits_key_unread(body) {
            ctx.metrics
                .add_limit(&limit.name, LimitCounter::KeyUnread, 1);
        }
    }

    /// A call of `policy`, which names a port, came without one (Envoy
    /// strips ports before filters run: `strip_any_host_port`): it was
    /// matched by its host alone. Counted; logged once per policy and
    /// Envoy, so the operator learns the port means nothing here.
    fn port_was_hidden<H: Host + ?Sized>(&mut self, ctx: &mut Ctx<'_, H>, policy: &CompiledPolicy) {
        ctx.metrics.add(policy.name(), PolicyCounter::PortHidden, 1);
        if self.port_hidden.contains(policy.name()) {
            return;
        }
        self.port_hidden.insert(policy.name().to_string());
        let marker = crate::entries::port_hidden_key(policy.name());
        let first =
            ctx.store
                .update_as::<crate::entries::Marker, _, _>(ctx.host, &marker, |seen| {
                    let first = !seen.0;
                    seen.0 = true;
                    (first, first)
                });
        if matches!(first, Ok(true)) {
            ctx.host.log(
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
}

/// How a keyed call's decision counts for its key.
fn key_outcome(decision: &Decision) -> KeyOutcome {
    match decision {
        Decision::Pass | Decision::Admit { .. } => KeyOutcome::Admitted,
        Decision::Queue { .. } => KeyOutcome::Queued,
        Decision::Refuse(_) => KeyOutcome::Refused,
    }
}

/// The body's length as its `content-length` says (None: it does not,
/// or not as a number).
fn declared_length<R: RequestHeaders + ?Sized>(req: &R) -> Option<usize> {
    let value = req.header("content-length")?;
    let text = std::str::from_utf8(value.trim_ascii()).ok()?;
    text.parse::<u64>()
        .ok()
        .map(|n| usize::try_from(n).unwrap_or(usize::MAX))
}

/// A request's body as its decision reads it: read only when a policy
/// asked for it (`Verdict::ReadBody`).
fn body_json<H: Host + ?Sized>(ctx: &mut Ctx<'_, H>, body: RequestBody<'_>) -> BodyJson {
    match body {
        RequestBody::Absent => BodyJson::Absent,
        RequestBody::Coming => BodyJson::Coming,
        RequestBody::Read(Some(body)) => BodyJson::parse(body),
        RequestBody::Read(None) => {
            ctx.metrics
                .add_filter(FilterCounter::RequestBodyTooLarge, 1);
            BodyJson::TooLarge
        }
    }
}

/// What a call takes, found from its request before it is decided.
pub(super) struct CallInputs {
    /// From its policy's further limits.
    pub limits: LimitInputs,
    /// A pool call: from each member's.
    pub pool: Option<PoolCall>,
    /// Its model's prices, for its money limits.
    pub price: Option<CallPrice>,
}

/// A call admitted now holding its further limits.
pub(super) struct Admitted {
    pub context_id: u32,
    /// Its policy's index (a pool call's pool's).
    pub pool_index: usize,
    pub held: Held,
    pub downgraded: Option<Box<Downgraded>>,
}

/// A call as decided, with the slots it holds.
struct Decided<'p> {
    context_id: u32,
    policy: PolicyStats<'p>,
    decision: Decision,
    slots: Vec<HeldSlot>,
}

impl<'a> RequestBody<'a> {
    /// Its bytes, when read.
    pub(super) fn bytes(&self) -> Option<&'a [u8]> {
        match self {
            Self::Read(raw) => *raw,
            Self::Absent | Self::Coming => None,
        }
    }
}
