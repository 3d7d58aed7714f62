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

mod encoding;
mod fair_order;
mod queue;
#[cfg(test)]
mod tests;

pub use fair_order::{FairCall, FairTag, VIRTUAL_PER_TOKEN};
pub use queue::Waiter;

use crate::headers::LimitKind;
use crate::matcher::CompiledPolicy;
use sluice_shared::fair::{self, Claim, FairClaimant};
use sluice_shared::limiter::{
    ConcurrencyLimit, DecodeError, LeaseTable, RateLimiter, RateState, Reservation,
};
use sluice_shared::policy::{LimitAction, Priority};
use sluice_shared::time::{Instant, Span};

/// The limits of one policy, as the bucket applies them.
#[derive(Debug, Clone, PartialEq, Eq)]
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
            rate: policy.rate.clone(),
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
    /// The concurrency limit has slots to spare (at least
    /// [`PREFETCH_SLACK`] free, nobody waiting): a slot the holder's call
    /// gives back may stay with the holder until its prefetch lapses, to go
    /// back with its next write to the bucket, even when the rate handed
    /// out nothing. Near a rate limit every call is then one round to
    /// shared data, not two (its decision, and its slot's return).
    pub keeps_slots: bool,
}

/// A call as the bucket weighs it: what it costs, its priority, and, for a
/// `fair` policy's call, where its key places it in the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketCall {
    pub cost: u64,
    pub priority: Priority,
    pub fair: Option<FairCall>,
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
        if wanted == 0 || limits.queue.is_some() || !self.waiters.is_empty() {
            return Prefetched::default();
        }
        let free_slots = limits
            .concurrency
            .as_ref()
            .map(|limit| u64::from(self.leases.free_for_normal(limit)));
        let lease = limits
            .concurrency
            .and_then(|_| self.leases.lease_of(holder));
        // What the holder gets when the rate hands out nothing.
        let none = Prefetched {
            lease,
            keeps_slots: free_slots.is_some_and(|free| free >= PREFETCH_SLACK),
            ..Prefetched::default()
        };
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
        if let Some(free) = free_slots {
            n = n.min(free / PREFETCH_SLACK);
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
            // Taking slots renews the holder's lease; it stays the same lease.
            lease,
            keeps_slots: limits.concurrency.is_some(),
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
        rate_at: Instant,
        now: Instant,
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
        let call = BucketCall {
            cost,
            priority,
            fair: None,
        };
        self.admit_call(limits, holder, now, call, false)
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
}
