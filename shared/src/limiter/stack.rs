//! All or nothing across several rate limits whose states live apart (one
//! shared-data entry each, swapped by compare-and-swap one at a time, so no
//! single swap can cover them all). A call takes its cost from each limit
//! in turn; refused by one, it gives back what it took from the others, so
//! a refused call leaves every count as it found it: nothing lost, nothing
//! counted twice. Then it looks at the limits it did not reach, so the
//! refusal can name the longest wait.
//!
//! Envoy's `local_ratelimit` with several descriptors and
//! envoyproxy/ratelimit keep what the earlier limits took when a later one
//! refuses; that is the bug this order of steps avoids.
//!
//! The caller drives it: [`StackedTake::next_limit`] says whose state the
//! next step needs, [`StackedTake::apply`] computes that step on the state
//! (and may run again on a fresher state when a swap loses a race), and
//! [`StackedTake::advance`] moves on once the new state is stored.

use super::{Decision, RateLimiter, RateState};
use crate::time::{Instant, Span};

/// Where a stacked take stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Taking from limit `.0`.
    Taking(usize),
    /// Refused; giving back to limit `at`.
    Refunding {
        at: usize,
    },
    /// Refused; looking at limit `at` for a longer wait.
    Peeking {
        at: usize,
    },
    Done,
}

/// The end of a stacked take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StackedOutcome {
    /// Every limit took its cost.
    Admitted,
    /// `limit` refused first; nothing was kept from any limit.
    /// `retry_after`: the longest wait among the limits that would refuse.
    Refused { limit: usize, retry_after: Span },
}

/// What one step did to the state it was given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepResult {
    /// Whether the state changed and must be stored.
    pub changed: bool,
    decision: Option<Decision>,
    /// Where the limit stood when it refused.
    standing: Option<Standing>,
}

/// Where a limit stands: what of its size is spent, and when it holds all
/// of it again (a budget's renewal). What a refusal tells the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Standing {
    pub spent: u64,
    pub size: u64,
    pub until_reset: Span,
    /// When that is (`now + until_reset`).
    pub renews_at: Instant,
}

impl Standing {
    /// Thousandths of the limit spent (0 for a limit of no size).
    pub fn used_permille(&self) -> u64 {
        if self.size == 0 {
            return 0;
        }
        u64::try_from(u128::from(self.spent) * 1000 / u128::from(self.size)).unwrap_or(u64::MAX)
    }

    pub fn of(limiter: &RateLimiter, state: &RateState, now: Instant) -> Self {
        let size = limiter.available(&limiter.initial_state(), now);
        let available = limiter.available(state, now);
        let until_reset = limiter.until_reset(state, now);
        Self {
            spent: size.saturating_sub(available),
            size,
            until_reset,
            renews_at: now + until_reset,
        }
    }
}

/// One call's take across several limits; see the module docs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StackedTake {
    costs: Vec<u64>,
    now: Instant,
    phase: Phase,
    /// The first limit that refused, if one did, and where it stood.
    refused: Option<usize>,
    standing: Option<Standing>,
    /// Limits whose standing after taking is wanted (their warning lines),
    /// and what it was.
    watched: Vec<bool>,
    taken_standings: Vec<Option<Standing>>,
    retry_after: Span,
}

impl StackedTake {
    /// A take of `costs[i]` from limit `i`, for each limit, at `now`.
    pub fn new(costs: Vec<u64>, now: Instant) -> Self {
        let phase = if costs.is_empty() {
            Phase::Done
        } else {
            Phase::Taking(0)
        };
        Self {
            costs,
            now,
            phase,
            refused: None,
            standing: None,
            watched: Vec::new(),
            taken_standings: Vec::new(),
            retry_after: Span::ZERO,
        }
    }

    /// The limit whose state the next step needs; None when it is over.
    pub fn next_limit(&self) -> Option<usize> {
        match self.phase {
            Phase::Taking(at) | Phase::Refunding { at, .. } | Phase::Peeking { at, .. } => Some(at),
            Phase::Done => None,
        }
    }

    /// Also tells where each limit `watched[i]` stands once it took its
    /// cost ([`Self::taken_standing`]).
    pub fn watching(mut self, watched: Vec<bool>) -> Self {
        self.taken_standings = vec![None; watched.len()];
        self.watched = watched;
        self
    }

    /// Where limit `index` (watched) stood once it took its cost, when
    /// every limit did.
    pub fn taken_standing(&self, index: usize) -> Option<Standing> {
        match self.refused {
            Some(_) => None,
            None => self.taken_standings.get(index).copied().flatten(),
        }
    }

    /// Where the limit that refused stood when it did.
    pub fn standing(&self) -> Option<Standing> {
        self.standing
    }

    /// The outcome, once [`Self::next_limit`] is None.
    pub fn outcome(&self) -> Option<StackedOutcome> {
        match self.phase {
            Phase::Done => Some(match self.refused {
                Some(limit) => StackedOutcome::Refused {
                    limit,
                    retry_after: self.retry_after.max(Span::from_nanos(1)),
                },
                None => StackedOutcome::Admitted,
            }),
            _ => None,
        }
    }

    /// Computes the next step on `state`, the current state of limit
    /// [`Self::next_limit`]. Pure towards `self`: after a lost swap, call
    /// it again on the fresher state.
    pub fn apply(&self, limiter: &RateLimiter, state: &mut RateState) -> StepResult {
        let cost = |at: usize| self.costs.get(at).copied().unwrap_or(0);
        match self.phase {
            Phase::Taking(at) => {
                let decision = limiter.try_acquire(state, self.now, cost(at));
                let wanted = !decision.is_admit() || self.watched.get(at) == Some(&true);
                let standing = wanted.then(|| Standing::of(limiter, state, self.now));
                StepResult {
                    changed: decision.is_admit(),
                    decision: Some(decision),
                    standing,
                }
            }
            Phase::Refunding { at, .. } => {
                let before = *state;
                limiter.refund(state, self.now, self.now, limiter.taken(cost(at)));
                StepResult {
                    changed: *state != before,
                    decision: None,
                    standing: None,
                }
            }
            Phase::Peeking { at, .. } => {
                let mut copy = *state;
                let decision = limiter.try_acquire(&mut copy, self.now, cost(at));
                StepResult {
                    changed: false,
                    decision: Some(decision),
                    standing: None,
                }
            }
            Phase::Done => StepResult {
                changed: false,
                decision: None,
                standing: None,
            },
        }
    }

    /// Moves on after the step's state was stored (or needed no storing).
    pub fn advance(&mut self, step: StepResult) {
        let last = self.costs.len().saturating_sub(1);
        self.phase = match (self.phase, step.decision) {
            (Phase::Taking(at), Some(Decision::Admit { .. })) => {
                if let Some(slot) = self.taken_standings.get_mut(at) {
                    *slot = step.standing;
                }
                if at >= last {
                    Phase::Done
                } else {
                    Phase::Taking(at + 1)
                }
            }
            (Phase::Taking(at), Some(Decision::Deny { retry_after, .. })) => {
                self.retry_after = self.retry_after.max(retry_after);
                self.refused = Some(at);
                self.standing = step.standing;
                self.refund_before(at)
            }
            (Phase::Refunding { at }, _) => self.refund_before(at),
            (Phase::Peeking { at }, decision) => {
                if let Some(Decision::Deny { retry_after, .. }) = decision {
                    self.retry_after = self.retry_after.max(retry_after);
                }
                self.peek_after(at)
            }
            (phase, _) => phase,
        };
    }

    /// The step could not be done (the state could not be stored): taking,
    /// it counts as a refusal by that limit, with `retry_after`; giving
    /// back or looking, that limit is passed over.
    pub fn give_up(&mut self, retry_after: Span) {
        self.phase = match self.phase {
            Phase::Taking(at) => {
                self.retry_after = self.retry_after.max(retry_after);
                self.refused = Some(at);
                self.refund_before(at)
            }
            Phase::Refunding { at } => self.refund_before(at),
            Phase::Peeking { at } => self.peek_after(at),
            Phase::Done => Phase::Done,
        };
    }

    /// Refunds the limits before `at` (nearest first), then peeks at the
    /// ones after the limit that refused.
    fn refund_before(&self, at: usize) -> Phase {
        match at.checked_sub(1) {
            Some(previous) => Phase::Refunding { at: previous },
            None => self.peek_after(self.refused.unwrap_or(0)),
        }
    }

    fn peek_after(&self, at: usize) -> Phase {
        if at + 1 < self.costs.len() {
            Phase::Peeking { at: at + 1 }
        } else {
            Phase::Done
        }
    }
}
