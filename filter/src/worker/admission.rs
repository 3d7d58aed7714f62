//! Where a request is decided: from its classification (which policy, which
//! key, what cost and priority) to admit, queue or refuse.
//!
//! 1. A global policy whose fleet share allows nothing refuses at once.
//! 2. A prefetch this worker holds for the bucket admits without touching
//!    shared data (far from the bucket's limits).
//! 3. Otherwise the bucket decides in shared data, by compare-and-swap
//!    ([`placement`](super::placement) finds a keyed policy's bucket), and
//!    may hand this worker a prefetch for the requests that follow.
//!
//! A policy in shadow mode judges as `reject` would and lets everything
//! pass; [`Admitter::refuse`] is the one place either happens.

use std::sync::Arc;

use sluice_filter_core::bucket::{Admission, BucketLimits, Prefetched};
use sluice_filter_core::headers::LimitKind;
use sluice_filter_core::matcher::{Classification, CompiledPolicy};
use sluice_shared::fair::FairClaimant;
use sluice_shared::spend::RefusedCall;
use sluice_shared::time::{Instant, Span};

use super::budgets::Budgets;
use super::ctx::Ctx;
use super::decision_log::Outcome;
use super::fair::{self, Fair, FairSlot};
use super::held_slot::HeldSlot;
use super::key_places::owner_of;
use super::limits::{self, Held, LimitInputs, Taken, Why};
use super::placement::{self, Placed};
use super::pool::{self, PoolCall};
use super::refusal::{self, Refusal};
use super::retry::DEFAULT_RETRY;
use super::slots;
use super::to_shell::LocalReply;
use crate::entries::{self, LimitOf};
use crate::host::{Host, Level};
use crate::metrics::{LimitCounter, PolicyCounter};
use crate::prefetch::{PrefetchKey, Prefetches};

/// What to do with a request now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Continue,
    /// Queued: resumed (or refused) later from the tick.
    Pause {
        ticket: u64,
    },
    Reply(LocalReply),
    /// Decided only once the request's body is in (a cost read from it):
    /// hold the request and call back with its body.
    ReadBody,
}

/// What [`Admitter::decide`] made of a request, already counted in the
/// policy's stats except for admission itself (the stream is tracked and
/// counted by the caller).
pub(super) enum Decision {
    /// Not limited: shadow mode, or refused by nothing.
    Pass,
    Refuse(LocalReply),
    Admit {
        bucket: Arc<str>,
        key: PrefetchKey,
        /// The worker's lease the request's slot belongs to.
        lease: Option<Instant>,
        /// The bucket handed this worker spare slots along with it.
        prefetched_slots: bool,
        /// Its slot in the policy's fair slots table, held with the call.
        fair_slot: Option<HeldSlot>,
    },
    Queue {
        bucket: String,
        key: PrefetchKey,
        ticket: u64,
        deadline: Instant,
    },
}

impl Decision {
    /// What the access log says of it, unless it is a refusal (said from
    /// its answer).
    pub fn outcome(&self) -> Option<Outcome> {
        match self {
            Decision::Pass | Decision::Admit { .. } => Some(Outcome::Admitted),
            Decision::Queue { .. } => Some(Outcome::Queued),
            Decision::Refuse(_) => None,
        }
    }
}

/// Deciding one request: what of the worker's own parts it may touch,
/// besides the event's [`Ctx`].
pub(super) struct Deciding<'w> {
    pub prefetches: &'w mut Prefetches,
    pub budgets: &'w mut Budgets,
    /// Set when the request's key found no place of its own (for the
    /// live view's count of overflowing keys).
    pub overflowed: bool,
    /// A part of a split MCP batch ([`super::split_batch`]): decided
    /// without a prefetch, whose tokens could not be given back if
    /// another part is refused, and counted once the batch is decided.
    pub batch_part: bool,
}

impl<'w> Deciding<'w> {
    /// Deciding a call of its own (not a part of a batch).
    pub fn new(prefetches: &'w mut Prefetches, budgets: &'w mut Budgets) -> Self {
        Self {
            prefetches,
            budgets,
            overflowed: false,
            batch_part: false,
        }
    }

    /// Decides a request of `policy`; `limits` are what it takes from each
    /// of the policy's further limits and its key for each, which go first,
    /// all or nothing, and get their tokens back if the policy's own bucket
    /// refuses. Returns where the call holds its further limits' tokens,
    /// if it holds any.
    ///
    /// In queue mode a call the further limits cannot take now waits in the
    /// policy's queue (unless the wait they ask is beyond `max_wait`), and
    /// a queued call takes them only when its turn comes, with the bucket,
    /// so that it holds every limit at the moment it leaves.
    // Inlined into the hot caller as when it had only that one (a split
    // MCP batch calls it too): scenario 6 counts a call's every instruction.
    #[inline(always)]
    pub fn decide<H: Host + ?Sized>(
        &mut self,
        ctx: &mut Ctx<'_, H>,
        policy: &CompiledPolicy,
        class: &Classification,
        inputs: &LimitInputs,
        pool_call: Option<&PoolCall>,
    ) -> (Decision, Option<Held>) {
        let holds_any =
            !policy.limits.is_empty() || !policy.slot_limits.is_empty() || policy.pool.is_some();
        if !holds_any {
            // Most policies have one limit of their own: nothing further.
            return (self.decide_in_bucket(ctx, policy, class, false), None);
        }
        ctx.read_clock();
        let (taken, member) = pool::take_limits(ctx, self.budgets, policy, inputs, pool_call);
        // A pool call holds its member's limits, taken at its costs there.
        let limits_policy = pool::limits_of(policy, member);
        let limit_costs = match (member, pool_call) {
            (Some(at), Some(call)) => call
                .members
                .get(at)
                .map_or(&inputs.costs[..], |m| &m.costs[..]),
            _ => &inputs.costs[..],
        };
        // A pool member's keys are its own: its refusals are noted unkeyed.
        let keys = if member.is_none() {
            &inputs.keys[..]
        } else {
            &[]
        };
        // A batch's part does not wait: the rest of its batch holds.
        let waits = !self.batch_part;
        let (must_wait, held) = match after_limits(ctx, limits_policy, keys, taken, member, waits) {
            Ok(taken) => taken,
            Err(refused) => return (refused, None),
        };
        let decision = self.decide_in_bucket(ctx, policy, class, must_wait);
        let holds_limits = match decision {
            Decision::Pass | Decision::Admit { .. } => !must_wait,
            Decision::Refuse(_) | Decision::Queue { .. } => false,
        };
        if holds_limits {
            if !self.batch_part {
                limits::count_admitted(ctx.metrics, limits_policy, limit_costs);
            }
        } else if !must_wait {
            // Refused, or queued: a queued call takes its further limits
            // again when its turn comes.
            let now = ctx.now;
            limits::give_back(ctx, limits_policy, limit_costs, &held.places, now);
            fair::give_back_limits(ctx, limits_policy, &held.fair, limit_costs, None);
            slots::release(ctx, &held.slots);
        }
        (decision, holds_limits.then_some(held))
    }

    /// The policy's own bucket decides the call: from a prefetch, or in
    /// shared data (after its fair share and fair slot, if shared fairly).
    fn decide_in_bucket<H: Host + ?Sized>(
        &mut self,
        ctx: &mut Ctx<'_, H>,
        policy: &CompiledPolicy,
        class: &Classification,
        must_wait: bool,
    ) -> Decision {
        if let Some(refused) = refused_by_share(ctx, policy, class) {
            return refused;
        }
        let key: PrefetchKey = (class.policy_index, class.key);
        // A fair policy's every call goes through its table: nothing is
        // prefetched past it.
        let shared_fairly = policy.fair.is_some();
        if !must_wait && !shared_fairly && !self.batch_part {
            if let Some(admitted) = self.admit_from_prefetch(ctx, policy, class) {
                return admitted;
            }
        }
        ctx.read_clock();
        let fair = match take_fair(ctx, policy, class) {
            Ok(fair) => fair,
            Err(refused) => return refused,
        };
        let mut limits = BucketLimits::of(policy);
        if policy.is_shadow() || self.batch_part {
            // Shadow mode judges as `reject` would; a batch's part does
            // not wait while the rest of its batch holds its limits.
            limits.queue = None;
        }
        let wanted = if shared_fairly || self.batch_part {
            0
        } else {
            self.prefetches.wanted(key, ctx.now)
        };
        // The prefetch this decision replaces gives its spare slots back in
        // the same write (a write of its own would be a second round trip
        // to shared data for every prefetch).
        // A batch's part leaves this worker's prefetch as it is: what it
        // holds stays for the calls that follow.
        let spare = if self.batch_part {
            None
        } else {
            self.prefetches.take_spare(key)
        };
        let request = placement::Request {
            prefetch: wanted,
            must_wait,
            spare: spare.as_ref(),
        };
        let placed = placement::place_and_admit(ctx, policy, &limits, class, request);
        let returned = placed.as_ref().is_ok_and(|p| p.spare_returned);
        if let Some(spare) = spare.filter(|_| !returned) {
            super::streams::give_back(ctx, spare);
        }
        let Ok(placed) = placed else {
            // The store counted and logged why; a request it cannot decide
            // is refused rather than let through unchecked.
            slots::release(ctx, fair.slot.as_slice());
            let by_default = Refusal::Policy {
                kind: LimitKind::for_limits(policy.rate.is_some()),
            };
            return refuse(ctx, policy, &by_default, DEFAULT_RETRY);
        };
        self.overflowed = placed.overflowed;
        self.after_placement(ctx, policy, class, placed, fair)
    }

    /// A prefetch this worker holds for the call's bucket admits it
    /// without touching shared data (None: none holds what it costs).
    fn admit_from_prefetch<H: Host + ?Sized>(
        &mut self,
        ctx: &mut Ctx<'_, H>,
        policy: &CompiledPolicy,
        class: &Classification,
    ) -> Option<Decision> {
        let key: PrefetchKey = (class.policy_index, class.key);
        let cost = policy.rate.is_some().then_some(class.cost);
        let slot = policy.concurrency.is_some();
        let spent = self.prefetches.spend(key, cost, slot, ctx.now)?;
        // A keyed policy's buckets end in a place number or this.
        self.overflowed =
            policy.max_keys().is_some() && spent.bucket.ends_with(entries::OVERFLOW_SUFFIX);
        Some(Decision::Admit {
            bucket: Arc::clone(spent.bucket),
            key,
            lease: spent.lease,
            prefetched_slots: false,
            fair_slot: None,
        })
    }

    /// What the bucket made of the call: admitted (with what it handed
    /// this worker ahead), refused (its fair share's tokens back), or
    /// queued.
    fn after_placement<H: Host + ?Sized>(
        &mut self,
        ctx: &mut Ctx<'_, H>,
        policy: &CompiledPolicy,
        class: &Classification,
        placed: Placed,
        fair: FairTaken,
    ) -> Decision {
        let key: PrefetchKey = (class.policy_index, class.key);
        let Placed {
            bucket,
            admission,
            prefetched,
            ..
        } = placed;
        match admission {
            Admission::Admitted { lease, .. } => {
                let bucket = self.record_prefetch(ctx, key, &bucket, prefetched);
                Decision::Admit {
                    bucket,
                    key,
                    lease,
                    prefetched_slots: prefetched.slots > 0,
                    fair_slot: fair.slot,
                }
            }
            Admission::Rejected { kind, retry_after } => {
                slots::release(ctx, fair.slot.as_slice());
                if let Some(who) = fair.who {
                    fair::refused_after(ctx, policy, who, class.cost, kind);
                }
                self.record_prefetch(ctx, key, &bucket, Prefetched::default());
                refuse(ctx, policy, &Refusal::Policy { kind }, retry_after)
            }
            Admission::Queued { ticket, deadline } => {
                // A queue-mode policy takes no gate (`CompiledPolicy::queues`).
                slots::release(ctx, fair.slot.as_slice());
                self.record_prefetch(ctx, key, &bucket, Prefetched::default());
                Decision::Queue {
                    bucket,
                    key,
                    ticket,
                    deadline,
                }
            }
        }
    }

    /// Remembers what the bucket handed out (possibly nothing: then only
    /// that this worker used the bucket), giving back the spare slots of the
    /// prefetch it replaces. Returns the bucket's name, shared with the
    /// prefetch that keeps it.
    fn record_prefetch<H: Host + ?Sized>(
        &mut self,
        ctx: &mut Ctx<'_, H>,
        key: PrefetchKey,
        bucket: &str,
        prefetched: Prefetched,
    ) -> Arc<str> {
        if bucket.is_empty() || self.batch_part {
            return Arc::from(bucket);
        }
        let (name, spare) = self.prefetches.record(key, bucket, prefetched, ctx.now);
        if let Some(spare) = spare {
            super::streams::give_back(ctx, spare);
        }
        name
    }
}

/// What the further limits made of a call: it holds them (false, what
/// it holds), or it waits in the queue for them (true; a queue-mode
/// policy whose limits ask no longer than `max_wait`, unless it may not
/// wait: `waits` false). Err: refused.
#[inline(always)]
fn after_limits<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    policy: &CompiledPolicy,
    keys: &[Option<u64>],
    taken: Taken,
    member: Option<usize>,
    waits: bool,
) -> Result<(bool, Held), Decision> {
    match taken {
        Taken::All {
            places,
            slots,
            warnings,
            fair,
            rungs,
        } => {
            let held = Held {
                places,
                slots,
                warnings,
                fair,
                member,
                rungs,
            };
            Ok((false, held))
        }
        Taken::Refused {
            limit,
            retry_after,
            why,
            ..
        } if waits && queue_wait(policy).is_some_and(|max_wait| retry_after <= max_wait) => {
            ctx.metrics.add_limit(&limit, LimitCounter::Queued, 1);
            if why == Why::Paced {
                ctx.metrics.add_limit(&limit, LimitCounter::Paced, 1);
            }
            Ok((true, Held::default()))
        }
        Taken::Refused {
            limit,
            retry_after,
            why,
            standing,
        } => {
            ctx.metrics.add_limit(&limit, LimitCounter::Refused, 1);
            if why == Why::Paced {
                ctx.metrics.add_limit(&limit, LimitCounter::Paced, 1);
            }
            let refusal = Refusal::Limit {
                limit,
                why,
                standing,
            };
            note_refused(ctx, policy, keys, &refusal);
            Err(refuse(ctx, policy, &refusal, retry_after))
        }
        Taken::Unknown { limit } => {
            let refusal = Refusal::BudgetUnknown { limit };
            Err(refuse(ctx, policy, &refusal, DEFAULT_RETRY))
        }
    }
}

/// Notes a call a budget (a limit of an hour or longer) refused, for the
/// budget tree: its key there, why, and where the budget stood.
fn note_refused<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    policy: &CompiledPolicy,
    keys: &[Option<u64>],
    refusal: &Refusal,
) {
    let Refusal::Limit {
        limit, standing, ..
    } = refusal
    else {
        return;
    };
    let Some(holder) = policy.holder_of(limit) else {
        return;
    };
    let Some(index) = holder
        .limits
        .iter()
        .position(|l| &l.name == limit && l.spends_over_hours)
    else {
        return;
    };
    // A pool member's refusal is the pool's, whose keys are not the
    // member's: noted unkeyed.
    let own = std::ptr::eq(holder, policy);
    let key = own
        .then(|| keys.get(index).copied().flatten())
        .flatten()
        .map_or(0, owner_of);
    let (spent, size) = standing.map_or((0, 0), |s| (s.spent, s.size));
    let call = RefusedCall {
        at_ms: ctx.now.as_millis(),
        key,
        reason: refusal.reason().unwrap_or("spent").to_string(),
        spent,
        size,
    };
    ctx.metrics.note_refused(limit, call);
}

/// A global policy whose share allows the call nothing refuses it at
/// once: its share is nothing now, or holds fewer tokens than the call
/// costs (no wait makes it fit).
fn refused_by_share<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    policy: &CompiledPolicy,
    class: &Classification,
) -> Option<Decision> {
    if policy.fleet_closed {
        let by_default = Refusal::Policy {
            kind: LimitKind::for_limits(policy.rate.is_some()),
        };
        return Some(refuse(ctx, policy, &by_default, DEFAULT_RETRY));
    }
    let burst = policy.share_burst().filter(|&b| class.cost > b)?;
    ctx.host.log(
        Level::Debug,
        &format!(
            "sluice: global policy {}: a call costing {} is above this Envoy's share (burst {burst}); refused",
            policy.name(),
            class.cost
        ),
    );
    let refusal = Refusal::AboveShareBurst {
        cost: class.cost,
        burst,
    };
    Some(refuse(ctx, policy, &refusal, DEFAULT_RETRY))
}

/// What a call took of its policy's fair shares: its share of the rate
/// (as whom), and its slot in the fair slots table.
struct FairTaken {
    who: Option<FairClaimant>,
    slot: Option<HeldSlot>,
}

/// The call takes its fair share of the rate, then its key's slot gate
/// (after the rate's share, so a refusal there gives the rate's tokens
/// back to the key). Err: how it was refused.
fn take_fair<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    policy: &CompiledPolicy,
    class: &Classification,
) -> Result<FairTaken, Decision> {
    let who = match fair::take(ctx, policy, class) {
        Fair::NotShared => None,
        Fair::Taken(who) => Some(who),
        Fair::Refused { retry_after } => {
            if !policy.is_shadow() {
                ctx.metrics
                    .add(policy.name(), PolicyCounter::FairRefused, 1);
            }
            return Err(refuse(ctx, policy, &Refusal::FairShare, retry_after));
        }
    };
    let own_slots = fair::own_slot_terms(policy, class);
    let slot = match fair::take_slot(ctx, LimitOf::Policy(policy.name()), own_slots, class.fair) {
        FairSlot::NotShared => None,
        FairSlot::Taken(slot) => Some(slot),
        FairSlot::Refused { retry_after, full } => {
            if let Some(who) = who {
                fair::refused_after(ctx, policy, who, class.cost, LimitKind::Concurrency);
            }
            let refusal = if full {
                Refusal::Policy {
                    kind: LimitKind::Concurrency,
                }
            } else {
                if !policy.is_shadow() {
                    ctx.metrics
                        .add(policy.name(), PolicyCounter::FairRefused, 1);
                }
                Refusal::FairShare
            };
            return Err(refuse(ctx, policy, &refusal, retry_after));
        }
    };
    Ok(FairTaken { who, slot })
}

/// The one place a limit says no: shadow mode counts it and lets the
/// request pass; otherwise it is counted and answered.
fn refuse<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    policy: &CompiledPolicy,
    refusal: &Refusal,
    retry_after: Span,
) -> Decision {
    let name = policy.name();
    if policy.is_shadow() {
        ctx.metrics.add(name, PolicyCounter::ShadowLimited, 1);
        ctx.host.log(
            Level::Debug,
            &format!("sluice: shadow policy {name} would have refused a request ({refusal:?})"),
        );
        return Decision::Pass;
    }
    ctx.metrics.add(name, PolicyCounter::Rejected, 1);
    Decision::Refuse(refusal::render(policy, refusal, retry_after))
}

/// A queue-mode policy's `max_wait` (shadow mode judges as `reject`).
fn queue_wait(policy: &CompiledPolicy) -> Option<Span> {
    let max_wait = policy.policy.on_limit.max_wait;
    policy
        .queues()
        .then(|| max_wait.map_or(Span::ZERO, |w| w.as_span()))
}
