//! A pool policy's call (`pool`): which member takes it, and what an
//! answer from another member (Envoy retried it there) means. The order
//! members are tried in is `sluice_shared::pool::order`'s; a member takes a
//! call as any policy's further limits do ([`limits::take`], all or
//! nothing), with the pool's policy's own further limits in front.

use std::sync::Arc;

use sluice_filter_core::matcher::{CompiledMember, CompiledPool};
use sluice_filter_core::matcher::{CompiledPolicy, CompiledPolicySet};
use sluice_shared::policy::PoolSpec;
use sluice_shared::pool::{self, MemberNow};
use sluice_shared::provider::PauseWhy;
use sluice_shared::request_headers::RequestHeaders;
use sluice_shared::time::Instant;

use super::budgets::Budgets;
use super::ctx::Ctx;
use super::limits::{self, LimitInputs, LimitPlace, Taken};
use super::listened;
use super::probe;
use super::provider;
use super::retry::DEFAULT_RETRY;
use super::rungs::Rungs;
use super::slots;
use crate::entries::{self, LimitState};
use crate::host::{Host, Level};
use crate::metrics::{FilterCounter, LimitCounter};

/// A pool call's inputs: per member, and its sticky key's hash.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct PoolCall {
    /// What it would take from each member's limits (its policy's and
    /// its own, in its policy's order).
    pub members: Vec<LimitInputs>,
    pub sticky: Option<u64>,
    /// Where a weighted draw starts (the call's own: calls spread).
    pub draw: u64,
}

/// A member took the call: which (its place in the pool) and what it
/// took.
pub(super) struct Chosen {
    pub member: usize,
    pub taken: Taken,
}

/// Tries the pool's members for the call, best first by the pool's rule
/// (the sticky key's own member first while it can take it), then those
/// full or paused (a member whose room was misread still gets its say).
/// The first whose limits take the call all keeps it. When none does, the
/// refusal is the one with the soonest room: its `Retry-After` is the
/// earliest any member can take a call again.
fn take<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    budgets: &mut Budgets,
    pool: &CompiledPool,
    call: &PoolCall,
) -> Result<Chosen, Taken> {
    let now = ctx.now;
    let (members, mut full_limits, probe_due) = members_now(ctx, pool, now);
    let mut order = pool::order(pool.rule, &members, call.sticky, call.draw);
    for rest in 0..members.len() {
        if !order.contains(&rest) {
            order.push(rest);
        }
    }
    let mut soonest: Option<Taken> = None;
    let mut refused = vec![false; members.len()];
    for at in order {
        let (Some(member), Some(inputs)) = (pool.members.get(at), call.members.get(at)) else {
            continue;
        };
        let taken = limits::take(ctx, budgets, &member.policy, inputs);
        let refused_for = match &taken {
            Taken::All { .. } => {
                let passed = PassedOver {
                    members: &members,
                    refused: &refused,
                    full_limits: &full_limits,
                };
                count_passed_over(ctx, pool, passed, Some(at), call);
                return settle(ctx, budgets, (pool, call), at, taken, &probe_due);
            }
            Taken::Refused {
                retry_after, limit, ..
            } => {
                if let (Some(flag), Some(names)) = (refused.get_mut(at), full_limits.get_mut(at)) {
                    *flag = true;
                    if let Some(name) = member.rate_limits().iter().find(|l| &l.name == limit) {
                        if !names.contains(&name.name.as_str()) {
                            names.push(name.name.as_str());
                        }
                    }
                }
                *retry_after
            }
            Taken::Unknown { .. } => DEFAULT_RETRY,
        };
        let sooner = match &soonest {
            Some(Taken::Refused { retry_after, .. }) => refused_for < *retry_after,
            Some(_) => true,
            None => true,
        };
        if sooner {
            soonest = Some(taken);
        }
    }
    let refusal = soonest.unwrap_or(Taken::Refused {
        limit: String::new(),
        retry_after: DEFAULT_RETRY,
        why: limits::Why::Limit,
        standing: None,
    });
    // The refusal itself is counted as one (`refused`) where it was made.
    if let Taken::Refused { limit, .. } = &refusal {
        for names in &mut full_limits {
            names.retain(|name| name != limit);
        }
    }
    let passed = PassedOver {
        members: &members,
        refused: &refused,
        full_limits: &full_limits,
    };
    count_passed_over(ctx, pool, passed, None, call);
    Err(refusal)
}

/// The member a call the pool's own limits left past a `route` line
/// goes to (its place in the pool), from what `member`'s take said.
fn rung_member(pool: &CompiledPool, member: &CompiledMember, taken: &Taken) -> Option<usize> {
    let Taken::All { rungs, .. } = taken else {
        return None;
    };
    let (_, to) = member.policy.limits.get(rungs.route()?)?.route.as_ref()?;
    pool.member(to.as_bytes())
}

/// Counts a call its take left past a `route` line (it goes to the
/// rung's member) at that limit: `routed`.
fn count_routed<H: Host + ?Sized>(ctx: &mut Ctx<'_, H>, member: &CompiledMember, taken: &Taken) {
    let Taken::All { rungs, .. } = taken else {
        return;
    };
    if let Some(limit) = rungs
        .route()
        .and_then(|index| member.policy.limits.get(index))
    {
        ctx.metrics.add_limit(&limit.name, LimitCounter::Routed, 1);
    }
}

/// Gives back what a member's limits took of a call that goes elsewhere.
fn untake<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    policy: &CompiledPolicy,
    inputs: &LimitInputs,
    taken: Taken,
) {
    if let Taken::All {
        places,
        slots,
        fair,
        ..
    } = taken
    {
        let now = ctx.now;
        limits::give_back(ctx, policy, &inputs.costs, &places, now);
        super::fair::give_back_limits(ctx, policy, &fair, &inputs.costs, None);
        slots::release(ctx, &slots);
    }
}

/// Member `at`'s limits took the call (`taken`): it goes there, or, past
/// a `route` line, to the rung's member or nowhere (never to a dearer
/// member): what `at` took goes back, and the rung's member is asked.
fn settle<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    budgets: &mut Budgets,
    (pool, call): (&CompiledPool, &PoolCall),
    at: usize,
    taken: Taken,
    probe_due: &[bool],
) -> Result<Chosen, Taken> {
    let (Some(member), Some(inputs)) = (pool.members.get(at), call.members.get(at)) else {
        return Err(taken);
    };
    if let Some(route) = rung_member(pool, member, &taken).filter(|r| *r != at) {
        untake(ctx, &member.policy, inputs, taken);
        let (Some(rung), Some(inputs)) = (pool.members.get(route), call.members.get(route)) else {
            // Validation names a member of the pool: never here.
            return Err(Taken::Refused {
                limit: String::new(),
                retry_after: DEFAULT_RETRY,
                why: limits::Why::Limit,
                standing: None,
            });
        };
        let taken = limits::take(ctx, budgets, &rung.policy, inputs);
        if !matches!(taken, Taken::All { .. }) {
            return Err(taken);
        }
        return settle(ctx, budgets, (pool, call), route, taken, probe_due);
    }
    count_routed(ctx, member, &taken);
    if probe_due.get(at).copied().unwrap_or(false) {
        probe::begin(ctx, member);
    }
    Ok(Chosen { member: at, taken })
}

/// What a routed call's answer says (`x-sluice-routed`): the member the
/// rung sent it to and the limit whose line it passed, when its take
/// passed one.
pub(super) fn rerouted(
    policy: &CompiledPolicy,
    member: Option<usize>,
    rungs: &Rungs,
) -> Option<String> {
    let member = policy.pool.as_ref()?.members.get(member?)?;
    let limit = member.policy.limits.get(rungs.route()?)?;
    Some(format!("{}; limit={}", member.name, limit.name))
}

/// The answer's header naming the member a route rung sent the call to.
pub const ROUTED_HEADER: &str = "x-sluice-routed";

/// The members a pool call was offered to: how each stood, which refused
/// it, and which of their limits were full.
struct PassedOver<'a> {
    members: &'a [MemberNow],
    refused: &'a [bool],
    full_limits: &'a [Vec<&'a str>],
}

/// Counts the call at the members it passed over for want of room
/// (`sluice_shared::pool::passed_over`), on each limit of theirs that had
/// none: the demand their fleet shares are sized by.
fn count_passed_over<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    pool: &CompiledPool,
    passed: PassedOver<'_>,
    taken_by: Option<usize>,
    call: &PoolCall,
) {
    let PassedOver {
        members,
        refused,
        full_limits,
    } = passed;
    for at in pool::passed_over(pool.rule, members, refused, taken_by, call.sticky) {
        for name in full_limits.get(at).map_or(&[][..], Vec::as_slice) {
            ctx.metrics.add_limit(name, LimitCounter::PassedOver, 1);
        }
    }
}

/// Takes a call's further limits: for a pool call, a member's ([`take`]),
/// else the policy's own. Returns what they said and the member that took
/// it (its place in the pool).
pub(super) fn take_limits<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    budgets: &mut Budgets,
    policy: &CompiledPolicy,
    inputs: &LimitInputs,
    call: Option<&PoolCall>,
) -> (Taken, Option<usize>) {
    match (&policy.pool, call) {
        (Some(pool), Some(call)) => match take(ctx, budgets, pool, call) {
            Ok(chosen) => (chosen.taken, Some(chosen.member)),
            Err(refused) => (refused, None),
        },
        _ => (limits::take(ctx, budgets, policy, inputs), None),
    }
}

/// Each member as the choice sees it ([`member_now`]), in the pool's
/// order: its state, its full limits, whether a call to it is a probe.
fn members_now<'p, H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    pool: &'p CompiledPool,
    now: Instant,
) -> (Vec<MemberNow>, Vec<Vec<&'p str>>, Vec<bool>) {
    let mut members = Vec::with_capacity(pool.members.len());
    let mut full_limits = Vec::with_capacity(pool.members.len());
    let mut probe_due = Vec::with_capacity(pool.members.len());
    for member in &pool.members {
        let (state, full, due) = member_now(ctx, member, now);
        members.push(state);
        full_limits.push(full);
        probe_due.push(due);
    }
    (members, full_limits, probe_due)
}

/// A member as the choice sees it: what is left of its tightest limit of
/// its own, as a part of that limit, and whether its provider paused it;
/// the names of its limits with no room left; and whether a call to it
/// now would be a probe ([`probe`]). A keyed limit's room is its key's,
/// which the take finds: it is not read here.
fn member_now<'m, H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    member: &'m CompiledMember,
    now: Instant,
) -> (MemberNow, Vec<&'m str>, bool) {
    let mut room: f64 = 1.0;
    let mut paused = false;
    let mut probe_due = false;
    let mut full = Vec::new();
    for limit in member.rate_limits() {
        let (limit_paused, due) = probe::paused_or_due(ctx.host, limit, now);
        paused |= limit_paused;
        probe_due |= due;
        if limit.keys.is_some() {
            continue;
        }
        let state = entries::read(
            ctx.host,
            &entries::state_key(entries::LimitOf::Named(&limit.name), entries::Place::Single),
            &LimitState(&limit.rate),
        );
        let whole = limit
            .rate
            .available(&limit.rate.initial_state(), now)
            .max(1);
        let left = limit.rate.available(&state, now);
        if left == 0 {
            full.push(limit.name.as_str());
        }
        room = room.min(left as f64 / whole as f64);
    }
    for limit in member.slot_limits() {
        let max = limit.limit.max_in_flight.max(1);
        let held = slots::in_flight(ctx.host, &limit.name, now);
        if held >= max {
            full.push(limit.name.as_str());
        }
        room = room.min(f64::from(max.saturating_sub(held)) / f64::from(max));
    }
    let now = MemberNow {
        id: member.id,
        room,
        paused,
        weight: member.weight,
    };
    (now, full, probe_due)
}

/// A pool call sent to a member, until its answer's headers come: under
/// which set, pool and member, and what it would cost at each member.
#[derive(Debug)]
pub(super) struct Routed {
    pub set: Arc<CompiledPolicySet>,
    pub pool_index: usize,
    pub chosen: usize,
    pub costs: Vec<Vec<u64>>,
    pub keys: Vec<Vec<Option<u64>>>,
    /// When it was sent: whether its answer tells of the member as it was
    /// before a pause began or since ([`probe`]).
    pub sent: Instant,
}

impl Routed {
    /// Pool call `call` of the pool at `pool_index` of `set`, sent to its
    /// member `chosen` at `sent`.
    pub fn new(
        set: &Arc<CompiledPolicySet>,
        pool_index: usize,
        chosen: usize,
        call: &PoolCall,
        sent: Instant,
    ) -> Self {
        Self {
            set: Arc::clone(set),
            pool_index,
            chosen,
            costs: call.members.iter().map(|m| m.costs.clone()).collect(),
            keys: call.members.iter().map(|m| m.keys.clone()).collect(),
            sent,
        }
    }

    /// The answer's headers came: when they name another member of the
    /// pool than the one chosen ([`PoolSpec::ANSWERED_BY_HEADER`], set by
    /// Envoy's route), Envoy retried the call there: that member's limits
    /// read the answer in place of the chosen one's (`listened`).
    /// `attempts_heard`: the attempts filter heard each attempt, the
    /// chosen member's refusal with it ([`super::attempts`]).
    pub fn answered<H, R>(
        self,
        ctx: &mut Ctx<'_, H>,
        headers: &R,
        listened: &mut Option<listened::Listened>,
        attempts_heard: bool,
    ) where
        H: Host + ?Sized,
        R: RequestHeaders + ?Sized,
    {
        if let Some(theirs) = self.answered_elsewhere(ctx, headers, attempts_heard) {
            *listened = theirs;
        }
    }

    /// The limits of the member that answered that read the answer, when
    /// it was not the one chosen (None: it was).
    fn answered_elsewhere<H, R>(
        self,
        ctx: &mut Ctx<'_, H>,
        headers: &R,
        attempts_heard: bool,
    ) -> Option<Option<listened::Listened>>
    where
        H: Host + ?Sized,
        R: RequestHeaders + ?Sized,
    {
        let routed = self;
        let (pool_index, chosen) = (routed.pool_index, routed.chosen);
        let policy = routed.set.policies.get(pool_index)?;
        let pool = policy.pool.as_ref()?;
        let at = headers
            .header(PoolSpec::ANSWERED_BY_HEADER)
            .and_then(|name| pool.member(&name))
            .unwrap_or(chosen);
        if at == chosen {
            if let Some(member) = pool.members.get(chosen) {
                probe::end_if_served(ctx, member, routed.sent, headers);
            }
            return None;
        }
        let index = answered_by(ctx, &routed, at, attempts_heard)?;
        let keys = routed.keys.get(at).map_or(&[][..], Vec::as_slice);
        Some(listened::Listened::of(&routed.set, index, keys, &[]))
    }
}

/// The request headers pools route by, of every set this worker has
/// enforced (its fallback set's, the admin's) and those the plugin's
/// configuration names (`route_headers`, for Envoy's routes before any
/// set names them): a caller's own value of each is removed from every
/// request as its headers arrive, so that only the member Sluice chose
/// routes a call (Envoy's member routes match these headers, and a caller
/// naming a member would reach it with its credential and past its
/// limits). An Envoy without pools names none, and its calls read no
/// header for it (scenario 6 counts what each read costs).
#[derive(Debug, Default)]
pub(super) struct RouteHeaders(Vec<String>);

/// The most route headers remembered; a set names one per pool, and a
/// pool policy's is usually the default.
const MAX_ROUTE_HEADERS: usize = 32;

impl RouteHeaders {
    /// The headers the plugin's configuration names (its
    /// `route_headers`: Envoy's routes match them before any set names
    /// them), as well as those already known.
    pub fn declare(&mut self, names: &[String]) {
        for name in names {
            self.remember(name);
        }
    }

    fn remember(&mut self, name: &str) {
        if self.0.len() < MAX_ROUTE_HEADERS && !self.0.iter().any(|h| h == name) {
            self.0.push(name.to_string());
        }
    }

    /// Remembers the route headers of `set`, as well as those before it:
    /// a header a set no longer routes by may still be matched by
    /// Envoy's routes.
    pub fn learn(&mut self, set: &CompiledPolicySet) {
        for name in set.route_headers() {
            self.remember(name);
        }
    }

    /// Removes each route header the request came with (read first: a
    /// removal makes Envoy pick the route again, which a request without
    /// the header need not pay for).
    pub fn strip<H, R>(&self, ctx: &mut Ctx<'_, H>, req: &R)
    where
        H: Host + ?Sized,
        R: RequestHeaders + ?Sized,
    {
        for name in &self.0 {
            if req.carries(name) {
                ctx.host.remove_request_header(name);
                ctx.metrics
                    .add_filter(FilterCounter::RouteHeaderStripped, 1);
            }
        }
    }
}

/// Writes the chosen member's cluster into the request's route header, so
/// that Envoy's route (`cluster_header`) sends the call there.
pub(super) fn route<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    context_id: u32,
    pool: &CompiledPool,
    member: &CompiledMember,
) {
    if !ctx
        .host
        .set_request_header(context_id, &pool.route_header, &member.cluster)
    {
        ctx.host.log(
            Level::Warn,
            &format!(
                "sluice: could not route a call to pool member {} (cluster {}): the request is gone",
                member.name, member.cluster
            ),
        );
    }
}

/// A pool call sent to one member at `sent` and answered by another
/// (Envoy retried it there): the answering member's own rate limits are
/// charged the call's cost too, whatever they hold (it reached that
/// member), and the member first chosen, which refused it, is passed over
/// for a while ([`probe::retried_away_wait`]: its `Retry-After` went to
/// Envoy's retry, not here), unless the attempts filter heard that refusal
/// itself (`attempts_heard`), with its wait. Returns the answering
/// member's policy number, whose limits read the answer from now on.
fn answered_by<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    routed: &Routed,
    at: usize,
    attempts_heard: bool,
) -> Option<usize> {
    let (set, pool_index, chosen, sent) =
        (&*routed.set, routed.pool_index, routed.chosen, routed.sent);
    let costs = routed.costs.get(at)?;
    let pool = set.policies.get(pool_index)?.pool.as_ref()?;
    let member = pool.members.get(at)?;
    let now = ctx.now;
    for (index, limit) in member.policy.limits.iter().enumerate() {
        if index < member.own_limits || limit.keys.is_some() {
            // The pool's own limits took the call once; a keyed limit's
            // place is its key's, which this answer does not tell.
            continue;
        }
        let cost = limit.rate.taken(costs.get(index).copied().unwrap_or(1));
        let place = LimitPlace::unkeyed(&limit.name);
        limits::adjust(ctx, &place, &limit.rate, 0, cost, now);
        ctx.metrics
            .add_limit(&limit.name, LimitCounter::PoolRetried, 1);
    }
    if let Some(first) = pool.members.get(chosen) {
        // An unkeyed limit heard the refusal per attempt, with its wait.
        let unheard = first
            .rate_limits()
            .iter()
            .filter(|l| !(attempts_heard && l.keys.is_none()));
        for limit in unheard {
            let wait = probe::retried_away_wait(ctx.host, limit, sent);
            provider::pause_member(ctx, limit, PauseWhy::default(), wait);
        }
    }
    Some(member.index)
}

/// The limits a call of `policy` takes, and what it takes from each: the
/// chosen member's for a pool call, else the policy's own.
pub(super) fn limits_of(policy: &CompiledPolicy, member: Option<usize>) -> &CompiledPolicy {
    member
        .and_then(|at| policy.pool.as_ref()?.members.get(at))
        .map_or(policy, |m| &m.policy)
}

/// What a call of `policy` (number `policy_index`) takes from the limits
/// it holds, and the number of the policy it is decided as, usage and
/// answer: the chosen member's for a pool call sent to one (`call`: what
/// it takes at each member), else the policy's own (`own`).
pub(super) fn inputs_at_member(
    policy: &CompiledPolicy,
    policy_index: usize,
    member: Option<usize>,
    call: Option<&PoolCall>,
    own: LimitInputs,
) -> (LimitInputs, usize) {
    match (member, call, &policy.pool) {
        (Some(at), Some(call), Some(pool)) => {
            let inputs = call.members.get(at).cloned().unwrap_or_default();
            (
                inputs,
                pool.members.get(at).map_or(policy_index, |m| m.index),
            )
        }
        _ => (own, policy_index),
    }
}
