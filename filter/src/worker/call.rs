//! One call from its decision to its end: what each feature keeps of it
//! to act on its answer ([`Call`]), kept in one map by stream
//! ([`Calls`]), and what a call holding its further limits hands over as
//! it goes upstream ([`Holding`], `Parts::hold`), whether its request
//! was decided at once or its turn in the queue came.
//!
//! The order the parts act on an answer lives here, in
//! [`Calls::on_answer_headers`]: a pool call's route first (an answer
//! from another member than the one chosen changes whose limits listen),
//! then the provider's word (it may pause a limit), then the usage and
//! the stripping, and last what the answer tells the caller (after any
//! pause it began).

use rustc_hash::FxHashMap;
use std::sync::Arc;

use sluice_filter_core::matcher::CompiledPolicySet;
use sluice_filter_core::pricing::CallPrice;
use sluice_shared::request_headers::RequestHeaders;
use sluice_shared::time::Instant;

use super::asked_usage::Asked;
use super::attempts::AttemptMark;
use super::ctx::Ctx;
use super::decision_log::{self, DecisionLog, Field as LogField, Outcome};
use super::downgrade::{Downgraded, DOWNGRADED_HEADER};
use super::limits::{LimitPlace, PastWarning};
use super::listened::{Hearing, Listened};
use super::pool::{PoolCall, Routed, ROUTED_HEADER};
use super::spend::KeyLabels;
use super::telling::Told;
use super::usage::{HeldBytes, UsageOwed};
use super::warnings::{warn_value, WARN_HEADER};
use crate::host::Host;

/// What a call holding its further limits hands over as it goes.
#[derive(Debug)]
pub(super) struct Holding {
    pub context_id: u32,
    /// The policy whose limits it holds (for a pool call, its member's).
    pub policy_index: usize,
    /// What it took from each of them, with its key in each, and where.
    pub costs: Vec<u64>,
    pub keys: Vec<Option<u64>>,
    pub places: Vec<LimitPlace>,
    /// Its model's prices, for its money limits.
    pub price: Option<CallPrice>,
    /// Limits it left past a warning line.
    pub warnings: Vec<PastWarning>,
    /// Sent for a cheaper model than it named (a limit's `downgrade`).
    pub downgraded: Option<Box<Downgraded>>,
    /// A pool call a `route` rung sent to its member: what the answer's
    /// `x-sluice-routed` says.
    pub rerouted: Option<String>,
    /// Its keys' labels for the live view, found while its request was
    /// at hand.
    pub labels: KeyLabels,
    /// A pool call: its pool's policy, the member chosen, and what it
    /// would cost at each member.
    pub pool: Option<PoolRoute>,
}

impl Holding {
    /// What its access log line says of how it went: downgraded or routed
    /// (else as decided: admitted, or queued), what it took from each
    /// further limit, and its pool member.
    pub fn note_decision(&self, log: &mut DecisionLog, policies: &CompiledPolicySet) {
        if !log.is_on() {
            return;
        }
        let id = self.context_id;
        if self.downgraded.is_some() {
            log.verdict(id, Outcome::Downgraded);
        } else if self.rerouted.is_some() {
            log.verdict(id, Outcome::Routed);
        }
        if let Some(policy) = policies.policy(self.policy_index) {
            let taken = policy.limits.iter().zip(&self.costs);
            let cost = decision_log::per_limit(
                taken.map(|(limit, cost)| (limit.name.as_str(), limit.rate.taken(*cost))),
            );
            if !cost.is_empty() {
                log.note(id, LogField::Cost, cost);
            }
        }
        let member = self.pool.as_ref().and_then(|route| {
            let pool = policies.policy(route.pool_index)?.pool.as_deref()?;
            pool.members.get(route.chosen)
        });
        if let Some(member) = member {
            log.note(id, LogField::Member, member.name.clone());
        }
    }
}

#[derive(Debug)]
pub(super) struct PoolRoute {
    pub pool_index: usize,
    pub chosen: usize,
    pub call: Box<PoolCall>,
}

/// What the shell does with an answer's headers.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct AnswerHeaders {
    /// Its body is wanted, piece by piece ([`crate::Worker::on_answer_body`]).
    pub read_body: bool,
    /// Its pieces change length as they pass: it loses its
    /// `content-length`.
    pub strips: bool,
    /// Fields the answer gets, in place of upstream's of the same name.
    pub set: Vec<(&'static str, String)>,
    /// Fields the answer loses (Sluice's own, for Sluice alone).
    pub unset: Vec<&'static str>,
}

/// What the shell does with a piece of an answer's body.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct AnswerPiece {
    /// More of the body is wanted.
    pub more: bool,
    /// What the caller gets in place of the piece (None: the piece as it
    /// is).
    pub passed: Option<Vec<u8>>,
}

/// What each feature keeps of one call to act on its answer; a part is
/// dropped once it has done so.
#[derive(Debug, Default)]
pub(super) struct Call {
    /// A pool call sent to a member, until its answer says who answered.
    routed: Option<Routed>,
    /// Its limits that read the answer for the provider's word.
    listened: Option<Listened>,
    /// Its limits whose cost the answer settles.
    usage: Option<UsageOwed>,
    /// Sent asking for its usage: its answer is stripped of it.
    asked: Option<Asked>,
    /// Its answer tells the caller where the limits stand.
    told: Option<Told>,
    /// What its answer is told: the limits it left past a warning line
    /// (`x-sluice-warn`), the model it was downgraded from and to
    /// (`x-sluice-downgraded`), the member a route rung sent it to
    /// (`x-sluice-routed`).
    said: Vec<(&'static str, String)>,
}

impl Call {
    fn is_done(&self) -> bool {
        self.routed.is_none()
            && self.listened.is_none()
            && self.usage.is_none()
            && self.asked.is_none()
            && self.told.is_none()
            && self.said.is_empty()
    }

    /// Takes up the parts `other` has.
    fn join(&mut self, other: Call) {
        let Call {
            routed,
            listened,
            usage,
            asked,
            told,
            said,
        } = other;
        self.routed = routed.or(self.routed.take());
        self.listened = listened.or(self.listened.take());
        self.usage = usage.or(self.usage.take());
        self.asked = asked.or(self.asked.take());
        self.told = told.or(self.told.take());
        // The parts of a split batch each say theirs: one field says all.
        for (name, value) in said {
            match self.said.iter_mut().find(|(n, _)| *n == name) {
                Some((_, said)) => {
                    said.push_str(", ");
                    said.push_str(&value);
                }
                None => self.said.push((name, value)),
            }
        }
    }
}

/// The calls of this worker whose answers some feature acts on, by stream.
#[derive(Debug, Default)]
pub(super) struct Calls {
    calls: FxHashMap<u32, Call>,
    /// What the usage readers of every call hold now.
    held: HeldBytes,
}

impl Calls {
    fn add(&mut self, context_id: u32, call: Call) {
        if !call.is_done() {
            self.calls.entry(context_id).or_default().join(call);
        }
    }

    /// The call was let go (or queued to go): its answer may tell the
    /// caller where the limits stand (`told`), and it may have been sent
    /// asking for its usage (`asked`).
    pub fn goes(&mut self, context_id: u32, told: Option<Told>, asked: Option<Asked>) {
        if told.is_none() && asked.is_none() {
            // Most calls: no `Call` built, checked and dropped for nothing.
            return;
        }
        let call = Call {
            told,
            asked,
            ..Call::default()
        };
        self.add(context_id, call);
    }

    /// The call holds its limits and goes upstream: the parts that act on
    /// its answer take what they need of `holding`.
    pub fn holds(&mut self, policies: &Arc<CompiledPolicySet>, holding: &Holding, now: Instant) {
        let routed = holding
            .pool
            .as_ref()
            .map(|route| Routed::new(policies, route.pool_index, route.chosen, &route.call, now));
        let mut call = Call {
            routed,
            ..Call::default()
        };
        if let Some(policy) = policies.policy(holding.policy_index) {
            let price = holding.price.as_ref();
            let (costs, places) = (&holding.costs, &holding.places);
            call.usage = UsageOwed::of(holding.context_id, policy, costs, places, price, now);
            call.said
                .extend(warn_value(&holding.warnings).map(|value| (WARN_HEADER, value)));
            call.said.extend(
                holding
                    .downgraded
                    .as_ref()
                    .map(|d| (DOWNGRADED_HEADER, d.header_value())),
            );
            call.said
                .extend(holding.rerouted.clone().map(|r| (ROUTED_HEADER, r)));
            let counted: Vec<_> = holding.places.iter().map(|p| p.counted).collect();
            call.listened = Listened::of(policies, holding.policy_index, &holding.keys, &counted);
        }
        self.add(holding.context_id, call);
    }

    /// Whether some feature acts on the answer of `context_id`.
    pub fn awaits(&self, context_id: u32) -> bool {
        // Most calls are of policies that never do: no hash at all.
        !self.calls.is_empty() && self.calls.contains_key(&context_id)
    }

    /// Calls whose answer has not yet settled what they cost.
    pub fn awaiting_usage(&self) -> usize {
        self.calls.values().filter(|c| c.usage.is_some()).count()
    }

    /// Bytes of answers' bodies held now to read their usage.
    pub fn held(&self) -> usize {
        self.held.get()
    }

    /// The answer's headers came: each part acts on them, in the order
    /// this module's header gives. Returns what the shell does with them,
    /// and whether the provider's word is news for the other Envoys.
    /// `mark`: what the attempts filter marks the attempts it heard with.
    pub fn on_answer_headers<H, R>(
        &mut self,
        ctx: &mut Ctx<'_, H>,
        context_id: u32,
        headers: &R,
        end_of_stream: bool,
        mark: &AttemptMark,
    ) -> (AnswerHeaders, bool)
    where
        H: Host + ?Sized,
        R: RequestHeaders + ?Sized,
    {
        let Some(call) = self.calls.get_mut(&context_id) else {
            return Default::default();
        };
        let mut hearing = Hearing::Call;
        let mut unset = Vec::new();
        if let Some(routed) = call.routed.take() {
            let (heard, marked) = mark.read(headers);
            if marked {
                unset.push(AttemptMark::HEADER);
            }
            if heard {
                hearing = Hearing::CallOfHeardAttempts;
            }
            routed.answered(ctx, headers, &mut call.listened, heard);
        }
        let news = call
            .listened
            .take()
            .is_some_and(|listened| listened.on_answer_headers(ctx, headers, hearing));
        let strips = !end_of_stream
            && call
                .asked
                .as_mut()
                .is_some_and(|asked| asked.on_answer_headers(headers));
        if !strips {
            call.asked = None;
        }
        let reads = call.usage.as_mut().is_some_and(|usage| {
            usage.on_answer_headers(ctx, headers, end_of_stream, &mut self.held)
        });
        if call.usage.as_ref().is_some_and(UsageOwed::is_settled) {
            call.usage = None;
        }
        let mut set = call.told.take().map(|t| t.headers(ctx)).unwrap_or_default();
        set.append(&mut call.said);
        if call.is_done() {
            self.calls.remove(&context_id);
        }
        let answer = AnswerHeaders {
            read_body: reads || strips,
            strips,
            set,
            unset,
        };
        (answer, news)
    }

    /// The next piece of the answer's body: read for its usage, and
    /// stripped of what asking for it added.
    pub fn on_answer_body<H: Host + ?Sized>(
        &mut self,
        ctx: &mut Ctx<'_, H>,
        context_id: u32,
        chunk: &[u8],
        end_of_stream: bool,
    ) -> AnswerPiece {
        let Some(call) = self.calls.get_mut(&context_id) else {
            return AnswerPiece::default();
        };
        let reads = call
            .usage
            .as_mut()
            .is_some_and(|usage| usage.on_answer_body(ctx, chunk, end_of_stream, &mut self.held));
        if call.usage.as_ref().is_some_and(UsageOwed::is_settled) {
            call.usage = None;
        }
        let passed = call
            .asked
            .as_mut()
            .and_then(|asked| asked.on_answer_body(ctx, chunk, end_of_stream));
        if end_of_stream {
            call.asked = None;
        }
        let more = reads || call.asked.is_some();
        if call.is_done() {
            self.calls.remove(&context_id);
        }
        AnswerPiece { more, passed }
    }

    /// The call ended, for whatever reason: what its answer did not
    /// settle is settled as aborted.
    pub fn end<H: Host + ?Sized>(&mut self, ctx: &mut Ctx<'_, H>, context_id: u32) {
        if self.calls.is_empty() {
            return;
        }
        if let Some(usage) = self.calls.remove(&context_id).and_then(|c| c.usage) {
            usage.on_end(ctx, &mut self.held);
        }
    }
}
