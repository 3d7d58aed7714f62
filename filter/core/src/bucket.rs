//! One bucket's complete shared state: rate limiter state, concurrency
//! leases and the wait queue, in one value. The filter swaps the whole value
//! with one compare-and-swap, so a request costs one read and one write of
//! shared data, and rate and concurrency are decided together: a request the
//! concurrency limit refuses never spends rate tokens, and the other way round.
//!
//! Queue mode keeps the waiting requests of every worker in one queue here
//! (high priority first, then by ticket; a `fair` policy's calls, within a
//! priority, by start-time fair queueing tags: [`FairTag`]). Each worker polls the bucket on its
//! tick and resumes its own waiters when they reach the head and the limits
//! allow; a waiter that gives up (client gone) leaves the queue, and everyone
//! behind moves up. Entries carry a deadline so a crashed worker's waiters
//! cannot block the queue past `max_wait`.

use crate::headers::LimitKind;
use crate::matcher::CompiledPolicy;
use sluice_shared::fair::{self, Claim, FairClaimant};
use sluice_shared::limiter::{
    ConcurrencyLimit, DecodeError, LeaseTable, RateLimiter, RateState, Reservation,
};
use sluice_shared::policy::{LimitAction, Priority};
use sluice_shared::time::{Instant, Span};

/// The limits of one policy, as the bucket applies them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketLimits {
    pub rate: Option<RateLimiter>,
    pub concurrency: Option<ConcurrencyLimit>,
    pub queue: Option<QueueLimits>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueLimits {
    pub max_wait: Span,
    pub max_queue: u32,
}

impl BucketLimits {
    pub fn of(policy: &CompiledPolicy) -> Self {
        let on_limit = &policy.policy.on_limit;
        Self {
            rate: policy.rate,
            concurrency: policy.concurrency,
            queue: match on_limit.action {
                LimitAction::Reject => None,
                LimitAction::Queue => Some(QueueLimits {
                    max_wait: on_limit.max_wait.map_or(Span::ZERO, |w| w.as_span()),
                    max_queue: on_limit.queue_max(),
                }),
            },
        }
    }
}

/// How long a worker may spend tokens it prefetched (see
/// [`BucketState::prefetch`]). Spending a token up to this long after the
/// bucket gave it can shift it into a later interval, so over any interval T
/// at most `burst + rate·(T + PREFETCH_TTL)` pass: under one token for rates
/// below 200/s, 0.5 % of a second's worth above (the filter adds at most
/// 3 calls per worker deciding on a reused clock reading: its `clock.rs`,
/// `MAX_REUSES`). Each prefetch costs a
/// round trip to shared data, which a shorter lifetime spreads over fewer
/// requests: at 1 ms, a worker answering 8 000 calls a second paid it every
/// 8 calls, a fifth of Sluice's cost per call (docs/PERFORMANCE.md).
pub const PREFETCH_TTL: Span = Span::from_millis(5);

/// A bucket lets a worker prefetch `n` requests only while it holds
/// `PREFETCH_SLACK · n` tokens and free slots.
pub const PREFETCH_SLACK: u64 = 4;

/// What [`BucketState::prefetch`] gave: `requests` more admissions, each
/// spending a token (when the policy has a rate) and a slot (when it has a
/// concurrency limit).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Prefetched {
    pub tokens: u64,
    pub slots: u32,
    pub requests: u64,
    /// The holder's lease the slots belong to.
    pub lease: Option<Instant>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Waiter {
    pub holder: u64,
    pub ticket: u64,
    pub cost: u64,
    pub priority: Priority,
    pub deadline: Instant,
    /// A `fair` policy's call: its key and place in the fair order.
    pub fair: Option<FairTag>,
}

/// Where a waiting call of a `fair` policy stands in start-time fair
/// queueing (Goyal, Vin and Cheng 1996): it starts at the later of the
/// queue's virtual time and the end of its key's calls already waiting,
/// and spans its cost per weight. Calls leave by start (arrival order
/// among equal starts): a key with nothing waiting starts at the virtual
/// time, ahead of a noisy key's backlog, so its wait is bounded by its
/// share; within a key, first come first served.
///
/// With reservations (`min`), a call spans its cost per its key's share
/// instead of its weight: the share among the keys waiting then, each
/// taken as greedy, reservations first ([`sluice_shared::fair::shares`]),
/// so a reserved key leaves at its reservation at least while it waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FairTag {
    pub key: u64,
    pub start: u64,
    pub end: u64,
    /// Its key's weight (thousandths) and reservation ([`fair::UNIT`]s a
    /// second), for the shares of the calls that come after.
    pub weight: u64,
    pub reserved: u64,
}

/// A `fair` policy's call as its queue places it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FairCall {
    pub who: FairClaimant,
    /// For a policy with reservations: the rate its keys share
    /// ([`fair::UNIT`]s a second). None: weights alone place its calls.
    pub reserving: Option<u64>,
    /// The rate its keys share ([`fair::UNIT`]s a second; 0 unknown): how
    /// fast the virtual time moves, so how long a call placed ahead of it
    /// waits.
    pub rate: u64,
}

/// Virtual time one token spans at weight 1 (1 000 thousandths).
pub const VIRTUAL_PER_TOKEN: u64 = 1_000_000;

/// With reservations, a key's share of the rate stands in for its weight,
/// in thousandths of the rate (a key with all of it weighs as one of
/// weight 1 alone).
const SHARE_AS_WEIGHT: u128 = fair::WEIGHT_SCALE as u128;

impl Waiter {
    /// Queue order: high priority first, then by fair start (0 for a
    /// policy without `fair`), then first come first served.
    fn rank(&self) -> (std::cmp::Reverse<Priority>, u64, u64) {
        (
            std::cmp::Reverse(self.priority),
            self.fair.map_or(0, |f| f.start),
            self.ticket,
        )
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BucketState {
    /// Hash of the key owning this place (0 for a policy without `key`).
    pub owner: u64,
    pub next_ticket: u64,
    pub rate: Option<RateState>,
    pub leases: LeaseTable,
    pub waiters: Vec<Waiter>,
    /// A fair queue's virtual time: the start of the call that left last
    /// (0 while nobody waits).
    pub virtual_now: u64,
    /// A fair queue's keys whose last call left with its end still ahead
    /// of the virtual time: (key, end). A key's next call starts there at
    /// the earliest, so that a key served one call at a time keeps to its
    /// share instead of starting at the virtual time each call. Ends the
    /// virtual time passed are forgotten (they no longer hold anyone
    /// back); at most [`Self::MAX_FINISHES`], the earliest dropped first.
    pub finishes: Vec<(u64, u64)>,
}

/// The outcome of a request arriving at a bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    Admitted {
        /// Rate tokens left and time to full, when the policy has a rate.
        rate: Option<(u64, Span)>,
        /// Concurrency slots left, when the policy has a concurrency limit.
        slots_left: Option<u64>,
        /// The holder's lease the slot was taken under (see
        /// [`LeaseTable`]); the release must name it.
        lease: Option<Instant>,
    },
    Rejected {
        kind: LimitKind,
        retry_after: Span,
    },
    Queued {
        ticket: u64,
        deadline: Instant,
    },
}

/// Why a request would have been limited, for shadow mode and rejections.
struct Refusal {
    kind: LimitKind,
    retry_after: Span,
}

impl BucketState {
    /// 2: leases carry when they began.
    const VERSION: u8 = 2;
    /// 3: version 2 and a fair queue: the virtual time, and each waiter's
    /// key, start and end (written only when a fair queue has any). Read,
    /// no longer written.
    const FAIR_VERSION_3: u8 = 3;
    /// 4: version 3 with each waiter's weight and reservation, and the
    /// keys' remembered ends.
    const FAIR_VERSION: u8 = 4;
    const WAITER_LEN: usize = 33;
    const FAIR_WAITER_LEN_3: usize = 24;
    const FAIR_WAITER_LEN: usize = 40;
    /// Upper bound on queue entries decoded from shared data.
    pub const MAX_WAITERS: usize = 100_000;
    /// Upper bound on a fair queue's remembered ends.
    pub const MAX_FINISHES: usize = 1_024;

    pub fn new(owner: u64) -> Self {
        Self {
            owner,
            ..Self::default()
        }
    }

    /// Drops expired leases and waiters whose deadline passed.
    pub fn cleanup(&mut self, now: Instant) -> u32 {
        self.waiters.retain(|w| w.deadline >= now);
        if self.waiters.is_empty() {
            self.virtual_now = 0;
            self.finishes.clear();
        }
        self.leases.reclaim_expired(now)
    }

    fn rate_state(&self, limiter: &RateLimiter) -> RateState {
        match self.rate {
            Some(s) => s,
            None => limiter.initial_state(),
        }
    }

    /// Takes, for `holder` to admit up to `wanted` more requests by itself
    /// (without coming back to shared data, within [`PREFETCH_TTL`]), a
    /// token per request from a token bucket and a slot per request from a
    /// concurrency limit. Only a bucket with no queue and nobody waiting
    /// lets a worker prefetch, and only while it holds at least
    /// [`PREFETCH_SLACK`] times the prefetch in tokens and in free slots:
    /// near a limit every request is decided here, one by one. A policy
    /// whose rate is a window prefetches nothing. `holder` must already hold
    /// a slot when there is a concurrency limit (call right after admitting
    /// its request).
    pub fn prefetch(
        &mut self,
        limits: &BucketLimits,
        holder: u64,
        now: Instant,
        wanted: u64,
    ) -> Prefetched {
        let none = Prefetched::default();
        if wanted == 0 || limits.queue.is_some() || !self.waiters.is_empty() {
            return none;
        }
        let mut n = wanted;
        let mut rate_state = None;
        match &limits.rate {
            Some(limiter @ RateLimiter::TokenBucket(_)) => {
                let state = self.rate_state(limiter);
                n = n.min(limiter.available(&state, now) / PREFETCH_SLACK);
                rate_state = Some((limiter, state));
            }
            Some(_) => return none,
            None => {}
        }
        if let Some(limit) = &limits.concurrency {
            n = n.min(u64::from(self.leases.free_for_normal(limit)) / PREFETCH_SLACK);
        }
        let Ok(slots) = u32::try_from(n) else {
            return none;
        };
        if n == 0 {
            return none;
        }
        if let Some((limiter, mut state)) = rate_state {
            if !limiter.try_acquire(&mut state, now, n).is_admit() {
                return none;
            }
            if let Some(limit) = &limits.concurrency {
                if !self.leases.acquire_many(limit, holder, now, slots) {
                    return none;
                }
            }
            self.rate = Some(state);
        } else if let Some(limit) = &limits.concurrency {
            if !self.leases.acquire_many(limit, holder, now, slots) {
                return none;
            }
        }
        Prefetched {
            tokens: if limits.rate.is_some() { n } else { 0 },
            slots: if limits.concurrency.is_some() {
                slots
            } else {
                0
            },
            requests: n,
            lease: limits
                .concurrency
                .and_then(|_| self.leases.lease_of(holder)),
        }
    }

    /// Gives back `n` prefetched slots of `holder`'s lease `lease` that it
    /// did not use.
    pub fn release_many(&mut self, holder: u64, lease: Instant, n: u32) -> u32 {
        self.leases.release_many(holder, lease, n)
    }

    /// Which lease `holder` holds in this bucket now.
    pub fn lease_of(&self, holder: u64) -> Option<Instant> {
        self.leases.lease_of(holder)
    }

    /// Tries to take rate tokens (as of `rate_at`) and a slot (as of `now`)
    /// at once; commits only if both allow it.
    fn try_take(
        &mut self,
        limits: &BucketLimits,
        holder: u64,
        (rate_at, now): (Instant, Instant),
        cost: u64,
        priority: Priority,
    ) -> Result<Admission, Refusal> {
        let mut rate_result = None;
        let mut new_rate = None;
        if let Some(limiter) = &limits.rate {
            let mut state = self.rate_state(limiter);
            match limiter.try_acquire(&mut state, rate_at, cost) {
                sluice_shared::limiter::Decision::Admit {
                    remaining,
                    reset_after,
                } => {
                    rate_result = Some((remaining, reset_after));
                    new_rate = Some(state);
                }
                sluice_shared::limiter::Decision::Deny { retry_after, .. } => {
                    return Err(Refusal {
                        kind: LimitKind::Rate,
                        retry_after,
                    })
                }
            }
        }
        let mut slots_left = None;
        if let Some(limit) = &limits.concurrency {
            let mut leases = self.leases.clone();
            match leases.acquire(limit, holder, now, priority) {
                sluice_shared::limiter::Decision::Admit { remaining, .. } => {
                    slots_left = Some(remaining);
                    self.leases = leases;
                }
                sluice_shared::limiter::Decision::Deny { retry_after, .. } => {
                    return Err(Refusal {
                        kind: LimitKind::Concurrency,
                        retry_after,
                    })
                }
            }
        }
        if new_rate.is_some() {
            self.rate = new_rate;
        }
        Ok(Admission::Admitted {
            rate: rate_result,
            slots_left,
            lease: slots_left.and(self.leases.lease_of(holder)),
        })
    }

    /// A request arrives. In queue mode it waits behind everyone who ranks
    /// ahead of it; it is refused at once if the queue is full or, for a
    /// rate limit, if its turn would come later than `max_wait`.
    pub fn admit(
        &mut self,
        limits: &BucketLimits,
        holder: u64,
        now: Instant,
        cost: u64,
        priority: Priority,
    ) -> Admission {
        self.arrive(limits, holder, now, (cost, priority, None), false)
    }

    /// [`Self::admit`] for any call: with `must_wait`, it waits whatever
    /// the bucket holds (one of its policy's further limits has no room
    /// yet), refused as `admit` refuses; `fair` is a `fair` policy's call,
    /// which its key places in the queue (None for any other policy's).
    pub fn admit_call(
        &mut self,
        limits: &BucketLimits,
        holder: u64,
        now: Instant,
        (cost, priority): (u64, Priority),
        fair: Option<FairCall>,
        must_wait: bool,
    ) -> Admission {
        self.arrive(limits, holder, now, (cost, priority, fair), must_wait)
    }

    /// Where `call` costing `cost` starts and ends in the fair order. Key
    /// 0 stands for none in the layout: a key hashed to 0 is taken as 1.
    fn fair_tag(&self, call: FairCall, cost: u64) -> FairTag {
        let who = call.who;
        let key = who.key.max(1);
        let start = self
            .waiters
            .iter()
            .filter_map(|w| w.fair)
            .filter(|f| f.key == key)
            .map(|f| f.end)
            .max()
            .unwrap_or(0)
            .max(self.finish_of(key))
            .max(self.virtual_now);
        let weight = match call.reserving {
            None => who.weight,
            Some(capacity) => self.share_as_weight(who, key, capacity),
        };
        let span = cost
            .max(1)
            .saturating_mul(VIRTUAL_PER_TOKEN)
            .checked_div(weight.max(1))
            .unwrap_or(u64::MAX)
            .max(1);
        FairTag {
            key,
            start,
            end: start.saturating_add(span),
            weight: who.weight,
            reserved: who.reserved,
        }
    }

    /// How long a call tagged `tag` waits while every key waiting keeps
    /// its queue: the virtual time moves at the rate times
    /// [`VIRTUAL_PER_TOKEN`] over the weights waiting (by shares, which add
    /// up to one whole).
    fn fair_wait(&self, call: FairCall, tag: FairTag) -> Span {
        let ahead = tag.start.saturating_sub(self.virtual_now);
        if ahead == 0 || call.rate == 0 {
            return Span::ZERO;
        }
        let weights: u128 = match call.reserving {
            Some(_) => SHARE_AS_WEIGHT,
            None => {
                let mut keys: Vec<(u64, u64)> = vec![(tag.key, call.who.weight)];
                for w in self.waiters.iter().filter_map(|w| w.fair) {
                    if keys.iter().all(|(k, _)| *k != w.key) {
                        keys.push((w.key, w.weight));
                    }
                }
                keys.iter().map(|(_, w)| u128::from((*w).max(1))).sum()
            }
        };
        // An estimate: f64 keeps the product of large factors in range.
        let seconds = ahead as f64 * weights as f64 * fair::UNIT as f64
            / (call.rate as f64 * VIRTUAL_PER_TOKEN as f64);
        Span::from_nanos((seconds * 1e9).min(u64::MAX as f64) as u64)
    }

    /// Where `key`'s last call that left ended (0: it ends nowhere ahead).
    fn finish_of(&self, key: u64) -> u64 {
        self.finishes
            .iter()
            .find(|(k, _)| *k == key)
            .map_or(0, |(_, end)| *end)
    }

    /// `who`'s share of `capacity` among the keys waiting and itself, all
    /// greedy, reservations first: in thousandths of the capacity.
    fn share_as_weight(&self, who: FairClaimant, key: u64, capacity: u64) -> u64 {
        let mut keys: Vec<(u64, Claim)> = vec![(
            key,
            Claim {
                weight: who.weight,
                demand: capacity,
                reserved: who.reserved,
            },
        )];
        for tag in self.waiters.iter().filter_map(|w| w.fair) {
            if keys.iter().all(|(k, _)| *k != tag.key) {
                keys.push((
                    tag.key,
                    Claim {
                        weight: tag.weight,
                        demand: capacity,
                        reserved: tag.reserved,
                    },
                ));
            }
        }
        let claims: Vec<Claim> = keys.iter().map(|(_, c)| *c).collect();
        let mine = fair::shares(capacity, &claims)
            .first()
            .copied()
            .unwrap_or(0);
        let part = u128::from(mine) * SHARE_AS_WEIGHT / u128::from(capacity.max(1));
        u64::try_from(part).unwrap_or(u64::MAX)
    }

    fn arrive(
        &mut self,
        limits: &BucketLimits,
        holder: u64,
        now: Instant,
        (cost, priority, fair): (u64, Priority, Option<FairCall>),
        must_wait: bool,
    ) -> Admission {
        self.cleanup(now);
        let someone_ahead = self.waiters.iter().any(|w| w.priority >= priority);
        let refusal = if someone_ahead || must_wait {
            None
        } else {
            match self.try_take(limits, holder, (now, now), cost, priority) {
                Ok(admitted) => return admitted,
                Err(refusal) => Some(refusal),
            }
        };
        let Some(queue) = limits.queue else {
            let refusal = refusal.unwrap_or(Refusal {
                kind: LimitKind::Rate,
                retry_after: Span::from_nanos(1),
            });
            return Admission::Rejected {
                kind: refusal.kind,
                retry_after: refusal.retry_after,
            };
        };
        let kind = refusal
            .as_ref()
            .map_or_else(|| LimitKind::for_limits(limits.rate.is_some()), |r| r.kind);
        if self.waiters.len() >= queue.max_queue as usize {
            return Admission::Rejected {
                kind,
                retry_after: queue.max_wait.max(Span::from_nanos(1)),
            };
        }
        let fair_call = fair;
        let fair = fair.map(|call| self.fair_tag(call, cost));
        if let (Some(call), Some(tag)) = (fair_call, fair) {
            // Calls of other keys that come later may start ahead of it
            // (their share), so the rate's projection below, of the calls
            // ahead now, is too hopeful: a call that would run out of time
            // is refused now, and its key's later calls do not start
            // behind a span it never used.
            let wait = self.fair_wait(call, tag);
            if wait > queue.max_wait {
                return Admission::Rejected {
                    kind: LimitKind::Rate,
                    retry_after: (wait - queue.max_wait).max(Span::from_millis(1)),
                };
            }
        }
        if let Some(limiter) = &limits.rate {
            // The turns of everyone ahead, then ours, as reservations on a
            // copy of the rate state: exact as long as nobody leaves.
            let mut projected = self.rate_state(limiter);
            let me = Waiter {
                holder,
                ticket: self.next_ticket,
                cost,
                priority,
                deadline: Instant::EPOCH,
                fair,
            };
            let mut ahead: Vec<&Waiter> = self
                .waiters
                .iter()
                .filter(|w| w.rank() < me.rank())
                .collect();
            ahead.sort_by_key(|w| w.rank());
            for w in ahead {
                let _ = limiter.reserve(&mut projected, now, w.cost, Span::MAX);
            }
            if let Reservation::Deny { retry_after } =
                limiter.reserve(&mut projected, now, cost, queue.max_wait)
            {
                return Admission::Rejected {
                    kind: LimitKind::Rate,
                    retry_after,
                };
            }
        }
        let ticket = self.next_ticket;
        self.next_ticket = self.next_ticket.wrapping_add(1);
        let deadline = now + queue.max_wait;
        self.waiters.push(Waiter {
            holder,
            ticket,
            cost,
            priority,
            deadline,
            fair,
        });
        Admission::Queued { ticket, deadline }
    }

    /// Admits `holder`'s waiters that reached the head of the queue and fit
    /// the limits now. Returns their tickets, in the order admitted.
    /// `previous_poll` is when `holder` last polled: a rate turn that came
    /// before it, without the waiter being admitted then, was held up by
    /// another limit, and is not charged as of that earlier instant.
    pub fn poll(
        &mut self,
        limits: &BucketLimits,
        holder: u64,
        previous_poll: Instant,
        now: Instant,
    ) -> Vec<u64> {
        let mut admitted = Vec::new();
        while let Some(ticket) = self.poll_head(limits, holder, previous_poll, now) {
            admitted.push(ticket);
        }
        admitted
    }

    /// [`Self::poll`] for the head of the queue only: drops the waiters
    /// whose wait ran out on the way, and admits the head if it is
    /// `holder`'s and fits the limits now. A policy with further limits
    /// polls this way, taking them for the head before it leaves.
    pub fn poll_head(
        &mut self,
        limits: &BucketLimits,
        holder: u64,
        previous_poll: Instant,
        now: Instant,
    ) -> Option<u64> {
        self.leases.reclaim_expired(now);
        while let Some(head) = self.waiters.iter().min_by_key(|w| w.rank()).copied() {
            let expired = head.deadline < now;
            if head.holder != holder && !expired {
                return None;
            }
            // A waiter whose turn came before its deadline still goes, even
            // when the tick that notices it comes a little late.
            let rate_at = self.turn_of(limits, &head, previous_poll, now);
            let admissible = head.holder == holder
                && !(expired && rate_at > head.deadline)
                && self
                    .try_take(limits, holder, (rate_at, now), head.cost, head.priority)
                    .is_ok();
            if !admissible && !expired {
                return None;
            }
            self.waiters.retain(|w| w.ticket != head.ticket);
            self.leave(&head, admissible);
            if admissible {
                return Some(head.ticket);
            }
        }
        None
    }

    /// The instant the head waiter's rate turn came, if it has come: the
    /// rate limit is charged as of then, not as of the tick that noticed it,
    /// so a late tick does not push every later turn back. Never earlier
    /// than the holder's previous poll: a waiter whose turn had come by then
    /// but who still waited (for a concurrency slot) leaves now, and
    /// charging it as of its old turn would let every such waiter catch up
    /// at once, faster than the rate.
    fn turn_of(
        &self,
        limits: &BucketLimits,
        head: &Waiter,
        previous_poll: Instant,
        now: Instant,
    ) -> Instant {
        let (Some(limiter), Some(queue)) = (&limits.rate, &limits.queue) else {
            return now;
        };
        let enqueued_at = (head.deadline - queue.max_wait).min(now);
        let earliest = enqueued_at.max(previous_poll).min(now);
        let mut projected = self.rate_state(limiter);
        match limiter.reserve(&mut projected, enqueued_at, head.cost, Span::MAX) {
            Reservation::At { instant } => instant.clamp(earliest, now),
            Reservation::Deny { .. } => now,
        }
    }

    /// A waiter left the head of the queue (`served`, or out of time): a
    /// fair queue's virtual time moves to its start, and starts afresh once
    /// nobody waits. Only a served call's end holds its key's next call
    /// back: one that ran out of time used none of its span.
    fn leave(&mut self, head: &Waiter, served: bool) {
        if let Some(tag) = head.fair {
            self.virtual_now = self.virtual_now.max(tag.start);
        }
        if let Some(tag) = head.fair.filter(|_| served) {
            match self.finishes.iter_mut().find(|(k, _)| *k == tag.key) {
                Some((_, end)) => *end = (*end).max(tag.end),
                None => self.finishes.push((tag.key, tag.end)),
            }
            let now = self.virtual_now;
            self.finishes.retain(|(_, end)| *end > now);
            if self.finishes.len() > Self::MAX_FINISHES {
                self.finishes
                    .sort_by_key(|(_, end)| std::cmp::Reverse(*end));
                self.finishes.truncate(Self::MAX_FINISHES);
            }
        }
        if self.waiters.is_empty() {
            self.virtual_now = 0;
            self.finishes.clear();
        }
    }

    /// Removes a waiter that gave up. False if it was not queued (any more).
    pub fn cancel(&mut self, holder: u64, ticket: u64) -> bool {
        let before = self.waiters.len();
        self.waiters
            .retain(|w| !(w.holder == holder && w.ticket == ticket));
        self.waiters.len() != before
    }

    pub fn release(&mut self, holder: u64, lease: Instant) -> bool {
        self.leases.release(holder, lease)
    }

    pub fn renew(&mut self, holder: u64, now: Instant, ttl: Span) -> bool {
        self.leases.renew(holder, now, ttl)
    }

    /// True when this state holds nothing a fresh one would not: its place
    /// may go to another key without giving anything away.
    pub fn is_idle(&self, limits: &BucketLimits, now: Instant) -> bool {
        let rate_idle = match (&limits.rate, &self.rate) {
            (Some(limiter), Some(state)) => limiter.is_idle(state, now),
            _ => true,
        };
        let leases_idle = self
            .leases
            .leases()
            .iter()
            .all(|l| l.expires_at < now || l.count == 0);
        let queue_idle = self.waiters.iter().all(|w| w.deadline < now);
        rate_idle && leases_idle && queue_idle
    }

    pub fn encode(&self) -> Vec<u8> {
        let rate = self.rate.map(|r| r.encode()).unwrap_or_default();
        let leases = self.leases.encode();
        let mut out = Vec::with_capacity(
            1 + 16 + 1 + rate.len() + leases.len() + 4 + self.waiters.len() * Self::WAITER_LEN,
        );
        let fair = self.virtual_now != 0
            || !self.finishes.is_empty()
            || self.waiters.iter().any(|w| w.fair.is_some());
        out.push(if fair {
            Self::FAIR_VERSION
        } else {
            Self::VERSION
        });
        out.extend_from_slice(&self.owner.to_le_bytes());
        out.extend_from_slice(&self.next_ticket.to_le_bytes());
        out.push(u8::try_from(rate.len()).unwrap_or(0));
        out.extend_from_slice(&rate);
        out.extend_from_slice(&leases);
        out.extend_from_slice(&u32::try_from(self.waiters.len()).unwrap_or(0).to_le_bytes());
        for w in &self.waiters {
            out.extend_from_slice(&w.holder.to_le_bytes());
            out.extend_from_slice(&w.ticket.to_le_bytes());
            out.extend_from_slice(&w.cost.to_le_bytes());
            out.extend_from_slice(&w.deadline.as_nanos().to_le_bytes());
            out.push(match w.priority {
                Priority::Normal => 0,
                Priority::High => 1,
            });
        }
        if fair {
            out.extend_from_slice(&self.virtual_now.to_le_bytes());
            for w in &self.waiters {
                // Key 0 stands for none (fair tables take key 0 for 1).
                let tag = w.fair.unwrap_or(FairTag {
                    key: 0,
                    start: 0,
                    end: 0,
                    weight: 0,
                    reserved: 0,
                });
                for v in [tag.key, tag.start, tag.end, tag.weight, tag.reserved] {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
            out.extend_from_slice(
                &u32::try_from(self.finishes.len())
                    .unwrap_or(0)
                    .to_le_bytes(),
            );
            for (key, end) in &self.finishes {
                out.extend_from_slice(&key.to_le_bytes());
                out.extend_from_slice(&end.to_le_bytes());
            }
        }
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        let mut r = Reader { bytes, at: 0 };
        let version = r.u8()?;
        if ![Self::VERSION, Self::FAIR_VERSION_3, Self::FAIR_VERSION].contains(&version) {
            return Err(DecodeError::UnknownTag(version));
        }
        let owner = r.u64()?;
        let next_ticket = r.u64()?;
        let rate_len = usize::from(r.u8()?);
        let rate = if rate_len == 0 {
            None
        } else {
            Some(RateState::decode(r.take(rate_len)?)?)
        };
        let lease_count = r.u32()? as usize;
        if lease_count > LeaseTable::MAX_HOLDERS {
            return Err(r.too_short(lease_count * LeaseTable::LEASE_LEN));
        }
        let mut lease_bytes = (lease_count as u32).to_le_bytes().to_vec();
        lease_bytes.extend_from_slice(r.take(lease_count * LeaseTable::LEASE_LEN)?);
        let leases = LeaseTable::decode(&lease_bytes)?;
        let waiter_count = r.u32()? as usize;
        if waiter_count > Self::MAX_WAITERS {
            return Err(r.too_short(waiter_count * Self::WAITER_LEN));
        }
        let mut waiters = Vec::with_capacity(waiter_count);
        for _ in 0..waiter_count {
            waiters.push(Waiter {
                holder: r.u64()?,
                ticket: r.u64()?,
                cost: r.u64()?,
                deadline: Instant::from_nanos(r.u64()?),
                priority: if r.u8()? == 1 {
                    Priority::High
                } else {
                    Priority::Normal
                },
                fair: None,
            });
        }
        let mut virtual_now = 0;
        let mut finishes = Vec::new();
        if version != Self::VERSION {
            let with_shares = version == Self::FAIR_VERSION;
            let len = if with_shares {
                Self::FAIR_WAITER_LEN
            } else {
                Self::FAIR_WAITER_LEN_3
            };
            virtual_now = r.u64()?;
            if bytes.len().saturating_sub(r.at) < waiter_count * len {
                return Err(r.too_short(waiter_count * len));
            }
            for w in &mut waiters {
                let (key, start, end) = (r.u64()?, r.u64()?, r.u64()?);
                // Version 3 knew weights only: a weight of 1, nothing
                // reserved.
                let (weight, reserved) = if with_shares {
                    (r.u64()?, r.u64()?)
                } else {
                    (fair::WEIGHT_SCALE, 0)
                };
                w.fair = (key != 0).then_some(FairTag {
                    key,
                    start,
                    end,
                    weight,
                    reserved,
                });
            }
            if with_shares {
                let count = r.u32()? as usize;
                if count > Self::MAX_FINISHES {
                    return Err(r.too_short(count * 16));
                }
                for _ in 0..count {
                    finishes.push((r.u64()?, r.u64()?));
                }
            }
        }
        if r.at != bytes.len() {
            return Err(DecodeError::Length {
                expected: r.at,
                found: bytes.len(),
            });
        }
        Ok(Self {
            owner,
            next_ticket,
            rate,
            leases,
            waiters,
            virtual_now,
            finishes,
        })
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn too_short(&self, wanted: usize) -> DecodeError {
        DecodeError::Length {
            expected: self.at.saturating_add(wanted),
            found: self.bytes.len(),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self.at.checked_add(n).ok_or_else(|| self.too_short(n))?;
        let slice = self
            .bytes
            .get(self.at..end)
            .ok_or_else(|| self.too_short(n))?;
        self.at = end;
        Ok(slice)
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64, DecodeError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_shared::limiter::TokenBucket;
    use std::collections::BTreeMap;

    const SEC: Span = Span::from_secs(1);
    const T0: Instant = Instant::from_nanos(1_800_000_000 * 1_000_000_000);

    fn ms(n: u64) -> Span {
        Span::from_millis(n)
    }

    fn rate_queue(per_sec: u64, max_wait: Span) -> BucketLimits {
        BucketLimits {
            rate: Some(RateLimiter::TokenBucket(TokenBucket::new(
                per_sec, SEC, 1, None,
            ))),
            concurrency: None,
            queue: Some(QueueLimits {
                max_wait,
                max_queue: 1000,
            }),
        }
    }

    fn slots(max: u32, reserved: u32, queue: Option<QueueLimits>) -> BucketLimits {
        BucketLimits {
            rate: None,
            concurrency: Some(ConcurrencyLimit {
                max_in_flight: max,
                reserved_for_high: reserved,
                lease_ttl: SEC.saturating_mul(60),
            }),
            queue,
        }
    }

    /// Polls every millisecond for `ms`; the keys of the calls that left,
    /// in order (`keys` maps ticket to key).
    fn drain_fairly(
        b: &mut BucketState,
        limits: &BucketLimits,
        keys: &BTreeMap<u64, u64>,
        ms_total: u64,
    ) -> Vec<u64> {
        let mut left = Vec::new();
        for t in 1..=ms_total {
            for ticket in b.poll(limits, 1, T0 + ms(t - 1), T0 + ms(t)) {
                left.push(keys[&ticket]);
            }
        }
        left
    }

    /// A fair call of `key` at `weight` (thousandths), nothing reserved.
    fn weighted(key: u64, weight: u64) -> FairCall {
        FairCall {
            who: FairClaimant {
                key,
                weight,
                reserved: 0,
            },
            reserving: None,
            rate: 0,
        }
    }

    /// A fair call of `key` at `weight` arriving at `at`; its ticket noted
    /// in `keys` when it waits.
    fn arrive_fairly(
        b: &mut BucketState,
        limits: &BucketLimits,
        keys: &mut BTreeMap<u64, u64>,
        at: Instant,
        (key, weight): (u64, u64),
    ) -> Admission {
        let a = b.admit_call(
            limits,
            1,
            at,
            (1, Priority::Normal),
            Some(weighted(key, weight)),
            false,
        );
        if let Admission::Queued { ticket, .. } = a {
            keys.insert(ticket, key);
        }
        a
    }

    #[test]
    fn greedy_keys_of_a_fair_queue_keep_their_weights_and_none_runs_out_of_time() {
        let limits = rate_queue(50, SEC);
        let mut b = BucketState::new(0);
        let mut keys = BTreeMap::new();
        let mut served = BTreeMap::new();
        let mut left = 0u64;
        let call = |key: u64, weight: u64| FairCall {
            rate: 50 * fair::UNIT,
            ..weighted(key, weight)
        };
        // Keys 7 (weight 1) and 8 (weight 3) each offer 500 a second, ten
        // times the rate, for 4 s.
        for t in 0..4_000u64 {
            let now = T0 + ms(t);
            if t % 2 == 0 {
                for (key, weight) in [(7, 1_000), (8, 3_000)] {
                    let a = b.admit_call(
                        &limits,
                        1,
                        now,
                        (1, Priority::Normal),
                        Some(call(key, weight)),
                        false,
                    );
                    if let Admission::Queued { ticket, .. } = a {
                        keys.insert(ticket, key);
                    }
                }
            }
            for ticket in b.poll(&limits, 1, now, now + ms(1)) {
                left += 1;
                if t >= 1_000 {
                    *served.entry(keys[&ticket]).or_insert(0u64) += 1;
                }
            }
        }
        // A call that would wait past `max_wait` was refused when it came,
        // not queued to run out of time: every call queued was served or
        // still waits.
        let expired = keys.len() as u64 - left - b.waiters.len() as u64;
        assert!(expired <= 2, "{expired} ran out of time");
        let (seven, eight) = (served[&7], served[&8]);
        assert!(seven + eight >= 145, "the rate over 3 s: {served:?}");
        let part = seven as f64 / (seven + eight) as f64;
        assert!((part - 0.25).abs() <= 0.03, "weight 1 of 4: {served:?}");
    }

    #[test]
    fn a_fair_queue_lets_a_quiet_key_past_a_noisy_keys_backlog() {
        let limits = rate_queue(50, SEC.saturating_mul(10));
        let mut b = BucketState::new(0);
        let mut keys = BTreeMap::new();
        // The noisy key (7) queues 100 calls: two seconds of the rate.
        for _ in 0..100 {
            arrive_fairly(&mut b, &limits, &mut keys, T0, (7, 1_000));
        }
        // After 200 ms the quiet key (9) comes: it is next but one.
        let early = drain_fairly(&mut b, &limits, &keys, 200);
        assert!(early.iter().all(|k| *k == 7));
        let at = T0 + ms(200);
        assert!(matches!(
            arrive_fairly(&mut b, &limits, &mut keys, at, (9, 1_000)),
            Admission::Queued { .. }
        ));
        let mut next = Vec::new();
        for t in 201..=260u64 {
            for ticket in b.poll(&limits, 1, T0 + ms(t - 1), T0 + ms(t)) {
                next.push(keys[&ticket]);
            }
        }
        assert!(next.iter().take(2).any(|k| *k == 9), "{next:?}");
        // Without fairness it waits behind the whole backlog.
        let mut fifo = BucketState::new(0);
        for _ in 0..100 {
            fifo.admit(&limits, 1, T0, 1, Priority::Normal);
        }
        assert!(matches!(
            fifo.admit(&limits, 1, at, 1, Priority::Normal),
            Admission::Queued { ticket: 99, .. }
        ));
        // The state, fair tags and all, survives its bytes; a state
        // without a fair queue keeps the older layout.
        assert_eq!(BucketState::decode(&b.encode()), Ok(b.clone()));
        assert_eq!(fifo.encode()[0], 2);
        assert_eq!(b.encode()[0], 4);
        // Version 3 (tags without weights) still reads: weight 1, nothing
        // reserved.
        let v4 = b.encode();
        let tags_len = b.waiters.len() * BucketState::FAIR_WAITER_LEN;
        let fair_at = v4.len() - 8 - tags_len - 4 - b.finishes.len() * 16;
        let mut v3 = v4[..fair_at + 8].to_vec();
        v3[0] = 3;
        for tag in v4[fair_at + 8..fair_at + 8 + tags_len].chunks(BucketState::FAIR_WAITER_LEN) {
            v3.extend_from_slice(&tag[..BucketState::FAIR_WAITER_LEN_3]);
        }
        let read = BucketState::decode(&v3).expect("version 3");
        assert_eq!(read.waiters.len(), b.waiters.len());
        assert!(read.waiters.iter().zip(&b.waiters).all(|(r, w)| r
            .fair
            .map(|f| (f.key, f.start, f.end, f.weight, f.reserved))
            == w.fair.map(|f| (f.key, f.start, f.end, 1_000, 0))));
    }

    #[test]
    fn a_key_served_one_call_at_a_time_keeps_to_its_weight() {
        let limits = rate_queue(100, SEC.saturating_mul(10));
        let mut b = BucketState::new(0);
        let mut keys = BTreeMap::new();
        for _ in 0..300 {
            arrive_fairly(&mut b, &limits, &mut keys, T0, (1, 1_000));
        }
        // Key 2 (weight 0.1) sends its next call as soon as its last left.
        let mut light = 0;
        for t in 1..=2_000u64 {
            let at = T0 + ms(t);
            if !b.waiters.iter().any(|w| w.fair.is_some_and(|f| f.key == 2)) {
                arrive_fairly(&mut b, &limits, &mut keys, at, (2, 100));
            }
            for ticket in b.poll(&limits, 1, T0 + ms(t - 1), at) {
                light += u32::from(keys[&ticket] == 2);
            }
        }
        // A tenth of key 1's pace: about 18 of 200, not every other call.
        assert!((10..=25).contains(&light), "{light} of 200");
        assert!(!b.finishes.is_empty());
        assert_eq!(BucketState::decode(&b.encode()), Ok(b.clone()));
    }

    #[test]
    fn a_fair_queue_keeps_a_reservation_for_a_backlogged_key() {
        let limits = rate_queue(100, SEC.saturating_mul(10));
        let capacity = 100 * fair::UNIT;
        let call = |key: u64, reserved: u64| FairCall {
            who: FairClaimant {
                key,
                weight: 1_000,
                reserved: reserved * fair::UNIT,
            },
            reserving: Some(capacity),
            rate: capacity,
        };
        let run = |a_reserved: u64| {
            let mut b = BucketState::new(0);
            let mut keys = BTreeMap::new();
            // Three greedy keys of weight 1, each with 300 calls waiting;
            // key 1 has 60 a second of the 100 reserved.
            for _ in 0..300 {
                for (key, reserved) in [(1, a_reserved), (2, 0), (3, 0)] {
                    let a = b.admit_call(
                        &limits,
                        1,
                        T0,
                        (1, Priority::Normal),
                        Some(call(key, reserved)),
                        false,
                    );
                    if let Admission::Queued { ticket, .. } = a {
                        keys.insert(ticket, key);
                    }
                }
            }
            let left = drain_fairly(&mut b, &limits, &keys, 2_000);
            let of = |k: u64| left.iter().filter(|l| **l == k).count();
            (of(1), of(2), of(3))
        };
        // Over 2 s (200 calls): its 60 a second, and a third of the other
        // 40 beside (as `fair::shares` divides a rate): 73/13/13.
        let (a, b, c) = run(60);
        assert!((140..=160).contains(&a), "{a}/{b}/{c}");
        assert!(
            (20..=32).contains(&b) && (20..=32).contains(&c),
            "{a}/{b}/{c}"
        );
        // Without the reservation, a third each.
        let (a, b, c) = run(0);
        assert!((63..=70).contains(&a), "{a}/{b}/{c}");
    }

    #[test]
    fn backlogged_keys_leave_a_fair_queue_by_weight_and_in_order_within_a_key() {
        let limits = rate_queue(100, SEC.saturating_mul(10));
        let mut b = BucketState::new(0);
        let mut keys = BTreeMap::new();
        for _ in 0..300 {
            arrive_fairly(&mut b, &limits, &mut keys, T0, (1, 1_000));
            arrive_fairly(&mut b, &limits, &mut keys, T0, (2, 2_000));
        }
        let mut order = Vec::new();
        for t in 1..=3_000u64 {
            for ticket in b.poll(&limits, 1, T0 + ms(t - 1), T0 + ms(t)) {
                order.push(ticket);
            }
        }
        let twos = order.iter().take(300).filter(|t| keys[*t] == 2).count();
        assert!(
            (195..=205).contains(&twos),
            "{twos} of the first 300 to weight 2"
        );
        for key in [1, 2] {
            let mine: Vec<u64> = order.iter().copied().filter(|t| keys[t] == key).collect();
            assert!(
                mine.windows(2).all(|w| w[0] < w[1]),
                "first come first served within key {key}"
            );
        }
        // Everyone gone: the virtual time starts afresh.
        let rest = drain_fairly(&mut b, &limits, &keys, 20_000);
        assert!(
            b.waiters.is_empty(),
            "{} left over, {} drained",
            b.waiters.len(),
            rest.len()
        );
        assert_eq!(b.virtual_now, 0);
    }

    proptest::proptest! {
        /// Whatever the arrivals (keys, weights, costs, times): nothing
        /// panics, the state survives its bytes, calls of one key leave in
        /// the order they came, and the rate holds.
        #[test]
        fn a_fair_queue_keeps_order_within_a_key_and_the_rate(
            calls in proptest::collection::vec((0u64..5, 1u64..3_000_000, 1u64..4, 0u64..30), 1..150),
        ) {
            let limits = rate_queue(100, SEC.saturating_mul(5));
            let mut b = BucketState::new(0);
            let mut keys = BTreeMap::new();
            let mut now = T0;
            let mut left: Vec<u64> = Vec::new();
            let mut admitted_cost = 0;
            for (key, weight, cost, step) in calls {
                let previous = now;
                now += ms(step);
                for ticket in b.poll(&limits, 1, previous, now) {
                    left.push(ticket);
                }
                let a = b.admit_call(&limits, 1, now, (cost, Priority::Normal), Some(weighted(key + 1, weight)), false);
                match a {
                    Admission::Queued { ticket, .. } => { keys.insert(ticket, (key, cost)); }
                    Admission::Admitted { .. } => admitted_cost += cost,
                    Admission::Rejected { .. } => {}
                }
                proptest::prop_assert_eq!(BucketState::decode(&b.encode()), Ok(b.clone()));
            }
            let end = now + SEC.saturating_mul(6);
            for ticket in b.poll(&limits, 1, now, end) {
                left.push(ticket);
            }
            for key in 0..5 {
                let mine: Vec<u64> = left.iter().copied().filter(|t| keys[t].0 == key).collect();
                proptest::prop_assert!(mine.windows(2).all(|w| w[0] < w[1]), "key {} out of order: {:?}", key, mine);
            }
            let total: u64 = admitted_cost + left.iter().map(|t| keys[t].1).sum::<u64>();
            let seconds = (end - T0).as_secs_f64();
            proptest::prop_assert!(total as f64 <= 1.0 + 100.0 * seconds, "{} in {} s", total, seconds);
        }
    }

    #[test]
    fn broken_fair_bytes_are_refused() {
        let limits = rate_queue(10, SEC);
        let mut b = BucketState::new(0);
        for k in 1..4 {
            b.admit_call(
                &limits,
                1,
                T0,
                (1, Priority::Normal),
                Some(weighted(k, 500)),
                false,
            );
        }
        let bytes = b.encode();
        for cut in [1, 8, 24, 25] {
            assert!(
                BucketState::decode(&bytes[..bytes.len() - cut]).is_err(),
                "cut {cut}"
            );
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(BucketState::decode(&longer).is_err());
    }

    #[test]
    fn queue_admits_in_arrival_order_at_the_rate() {
        let limits = rate_queue(50, SEC.saturating_mul(2));
        let mut b = BucketState::new(0);
        let mut outcomes = Vec::new();
        for i in 0..150u64 {
            outcomes.push(b.admit(&limits, 1 + i % 4, T0, 1, Priority::Normal));
        }
        let admitted_now = outcomes
            .iter()
            .filter(|o| matches!(o, Admission::Admitted { .. }))
            .count();
        let queued = outcomes
            .iter()
            .filter(|o| matches!(o, Admission::Queued { .. }))
            .count();
        let rejected = outcomes
            .iter()
            .filter(|o| matches!(o, Admission::Rejected { .. }))
            .count();
        assert_eq!((admitted_now, queued, rejected), (1, 100, 49));
        // Each worker polls every millisecond; turns come every 20 ms, in ticket order.
        let mut released = Vec::new();
        for t in 0..=2000u64 {
            for holder in 1..=4 {
                for ticket in b.poll(&limits, holder, T0 + ms(t.saturating_sub(1)), T0 + ms(t)) {
                    released.push((t, ticket));
                }
            }
        }
        assert_eq!(released.len(), 100);
        for (i, (t, ticket)) in released.iter().enumerate() {
            assert_eq!(*ticket, i as u64);
            assert_eq!(*t, 20 * (i as u64 + 1));
        }
    }

    #[test]
    fn late_polls_do_not_push_later_turns_back() {
        let limits = rate_queue(50, SEC.saturating_mul(2));
        let mut b = BucketState::new(0);
        let queued = (0..150u64)
            .filter(|_| {
                matches!(
                    b.admit(&limits, 1, T0, 1, Priority::Normal),
                    Admission::Queued { .. }
                )
            })
            .count();
        assert_eq!(queued, 100);
        // Ticks 7 ms apart: each release is up to 7 ms late, but the turns
        // stay on the 20 ms grid, so every queued request makes its deadline.
        let mut released = Vec::new();
        for t in (0..=2100u64).step_by(7) {
            for _ in b.poll(&limits, 1, T0 + ms(t.saturating_sub(7)), T0 + ms(t)) {
                released.push(t);
            }
        }
        assert_eq!(released.len(), 100);
        for (i, t) in released.iter().enumerate() {
            let turn = 20 * (i as u64 + 1);
            assert!((turn..turn + 7).contains(t), "turn {i} at {t} ms");
        }
    }

    /// The defect of issue 16: 20/s (burst 1) and 5 in flight, queued.
    /// The first 5 calls hold their slots for a second; the waiters' rate
    /// turns come and go meanwhile. When the slots come back, the waiters
    /// must still leave at the rate, not all at once as of their old turns.
    #[test]
    fn waiters_held_up_by_slots_still_leave_at_the_rate() {
        let mut limits = rate_queue(20, SEC.saturating_mul(10));
        limits.concurrency = Some(ConcurrencyLimit {
            max_in_flight: 5,
            reserved_for_high: 0,
            lease_ttl: SEC.saturating_mul(60),
        });
        let mut b = BucketState::new(0);
        let mut admitted_at: Vec<u64> = Vec::new();
        let mut ends: Vec<u64> = Vec::new();
        // The first five calls take a second each, the others 10 ms.
        let admit = |admitted_at: &mut Vec<u64>, ends: &mut Vec<u64>, t: u64| {
            let held = if admitted_at.len() < 5 { 1_000 } else { 10 };
            admitted_at.push(t);
            ends.push(t + held);
        };
        for t in 0..=6_000u64 {
            let now = T0 + ms(t);
            while let Some(i) = ends.iter().position(|end| *end == t) {
                ends.swap_remove(i);
                assert!(b.release(1, b.lease_of(1).unwrap()));
            }
            if t < 40 {
                match b.admit(&limits, 1, now, 1, Priority::Normal) {
                    Admission::Admitted { .. } => admit(&mut admitted_at, &mut ends, t),
                    Admission::Queued { .. } => {}
                    Admission::Rejected { .. } => panic!("refused at {t} ms"),
                }
            }
            for _ in b.poll(&limits, 1, T0 + ms(t.saturating_sub(1)), now) {
                admit(&mut admitted_at, &mut ends, t);
            }
        }
        assert_eq!(admitted_at.len(), 40, "every waiter left in time");
        // A rate of 20/s with a burst of 1: releases at least 50 ms apart,
        // but for the poll period (a turn may be noticed 1 ms late).
        let gaps: Vec<u64> = admitted_at.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(gaps.iter().all(|g| *g >= 49), "release gaps {gaps:?} ms");
    }

    #[test]
    fn a_waiter_that_leaves_frees_its_place() {
        let limits = rate_queue(10, SEC);
        let mut b = BucketState::new(0);
        assert!(matches!(
            b.admit(&limits, 1, T0, 1, Priority::Normal),
            Admission::Admitted { .. }
        ));
        let mut tickets = Vec::new();
        for _ in 0..10 {
            match b.admit(&limits, 1, T0, 1, Priority::Normal) {
                Admission::Queued { ticket, .. } => tickets.push(ticket),
                other => panic!("{other:?}"),
            }
        }
        assert!(matches!(
            b.admit(&limits, 2, T0, 1, Priority::Normal),
            Admission::Rejected { .. }
        ));
        assert!(b.cancel(1, tickets[3]));
        assert!(matches!(
            b.admit(&limits, 2, T0, 1, Priority::Normal),
            Admission::Queued { .. }
        ));
    }

    #[test]
    fn slots_go_to_high_priority_first_then_fifo() {
        let q = QueueLimits {
            max_wait: SEC.saturating_mul(10),
            max_queue: 10,
        };
        // Three slots, one of them only for high priority.
        let limits = slots(3, 1, Some(q));
        let mut b = BucketState::new(0);
        let admitted = |a: Admission| matches!(a, Admission::Admitted { .. });
        assert!(admitted(b.admit(&limits, 1, T0, 1, Priority::Normal)));
        assert!(admitted(b.admit(&limits, 1, T0, 1, Priority::Normal)));
        assert!(matches!(
            b.admit(&limits, 1, T0, 1, Priority::Normal),
            Admission::Queued { ticket: 0, .. }
        ));
        assert!(matches!(
            b.admit(&limits, 2, T0, 1, Priority::Normal),
            Admission::Queued { ticket: 1, .. }
        ));
        // No high request waits: a high one takes the reserved slot at once...
        assert!(admitted(b.admit(&limits, 2, T0, 1, Priority::High)));
        // ...and the next high one queues ahead of the normal ones.
        assert!(matches!(
            b.admit(&limits, 2, T0, 1, Priority::High),
            Admission::Queued { ticket: 2, .. }
        ));
        assert_eq!(
            b.poll(&limits, 1, T0, T0),
            Vec::<u64>::new(),
            "head is holder 2's"
        );
        assert!(b.release(1, b.lease_of(1).unwrap()));
        assert_eq!(b.poll(&limits, 2, T0, T0), vec![2]);
        assert_eq!(
            b.poll(&limits, 2, T0, T0),
            Vec::<u64>::new(),
            "ticket 0 is next, and it is holder 1's"
        );
        assert_eq!(
            b.poll(&limits, 1, T0, T0),
            Vec::<u64>::new(),
            "normal requests stop one short of 3"
        );
        assert!(b.release(2, b.lease_of(2).unwrap()));
        assert_eq!(
            b.poll(&limits, 1, T0, T0),
            Vec::<u64>::new(),
            "2 in flight is still the normal ceiling"
        );
        assert!(b.release(2, b.lease_of(2).unwrap()));
        assert_eq!(b.poll(&limits, 1, T0, T0), vec![0]);
        assert_eq!(b.leases.in_flight(), 2);
    }

    #[test]
    fn a_crashed_workers_waiters_expire() {
        let q = QueueLimits {
            max_wait: SEC,
            max_queue: 10,
        };
        let limits = slots(1, 0, Some(q));
        let mut b = BucketState::new(0);
        assert!(matches!(
            b.admit(&limits, 9, T0, 1, Priority::Normal),
            Admission::Admitted { .. }
        ));
        assert!(matches!(
            b.admit(&limits, 9, T0, 1, Priority::Normal),
            Admission::Queued { .. }
        ));
        assert!(b.release(9, b.lease_of(9).unwrap()));
        // Holder 9 died: its waiter blocks the head until its deadline.
        assert!(matches!(
            b.admit(&limits, 2, T0 + Span::from_nanos(10), 1, Priority::Normal),
            Admission::Queued { .. }
        ));
        assert_eq!(
            b.poll(&limits, 2, T0, T0 + Span::from_nanos(10)),
            Vec::<u64>::new()
        );
        assert_eq!(
            b.poll(&limits, 2, T0, T0 + SEC + Span::from_nanos(1)),
            vec![1]
        );
    }

    #[test]
    fn reject_mode_takes_rate_and_slot_together() {
        let limits = BucketLimits {
            rate: Some(RateLimiter::TokenBucket(TokenBucket::new(1, SEC, 2, None))),
            concurrency: Some(ConcurrencyLimit {
                max_in_flight: 1,
                reserved_for_high: 0,
                lease_ttl: SEC,
            }),
            queue: None,
        };
        let mut b = BucketState::new(0);
        assert!(matches!(
            b.admit(&limits, 1, T0, 1, Priority::Normal),
            Admission::Admitted { .. }
        ));
        let before = b.rate;
        assert!(matches!(
            b.admit(&limits, 1, T0, 1, Priority::Normal),
            Admission::Rejected {
                kind: LimitKind::Concurrency,
                ..
            }
        ));
        assert_eq!(b.rate, before, "a refused request spends no tokens");
    }

    #[test]
    fn round_trips_and_refuses_garbage() {
        let limits = rate_queue(5, SEC);
        let mut b = BucketState::new(77);
        b.admit(&limits, 1, T0, 1, Priority::Normal);
        b.admit(&limits, 2, T0, 1, Priority::High);
        let mut s = slots(3, 0, None);
        s.rate = limits.rate;
        b.admit(&s, 3, T0, 1, Priority::Normal);
        assert_eq!(BucketState::decode(&b.encode()), Ok(b.clone()));
        let bytes = b.encode();
        for cut in 0..bytes.len() {
            assert!(BucketState::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        assert!(BucketState::decode(&[1, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]).is_err());
    }
}
