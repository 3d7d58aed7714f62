//! The bucket's queue: a call that cannot go now waits (high priority
//! first, then by ticket or fair tag); each worker polls for its own
//! waiters' turns; a waiter leaves when served, gone or past its deadline.

use super::*;

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

impl BucketState {
    /// [`Self::admit`] for any call: with `must_wait`, it waits whatever
    /// the bucket holds (one of its policy's further limits has no room
    /// yet), refused as `admit` refuses; `fair` is a `fair` policy's call,
    /// which its key places in the queue (None for any other policy's).
    pub fn admit_call(
        &mut self,
        limits: &BucketLimits,
        holder: u64,
        now: Instant,
        call: BucketCall,
        must_wait: bool,
    ) -> Admission {
        let BucketCall {
            cost,
            priority,
            fair,
        } = call;
        self.cleanup(now);
        let someone_ahead = self.waiters.iter().any(|w| w.priority >= priority);
        let refusal = if someone_ahead || must_wait {
            None
        } else {
            match self.try_take(limits, holder, now, now, cost, priority) {
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
                    .try_take(limits, holder, rate_at, now, head.cost, head.priority)
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
    pub(super) fn turn_of(
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
    pub(super) fn leave(&mut self, head: &Waiter, served: bool) {
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
}
