//! Which of the budget ladder's rungs a call's take reached: the first
//! limit it left at or past its `downgrade` line (the call goes for a
//! cheaper model, `downgrade.rs`) and the first past its `route` line (a
//! pool call goes to the rung's member, `pool.rs`). Read from where each
//! limit stood once the call's take was counted in it.

use sluice_filter_core::matcher::{CompiledLimit, CompiledPolicy};
use sluice_shared::limiter::StackedTake;

/// A limit's rung the call reached: the limit's index among the policy's
/// further limits, and the thousandths of it used. Kept small: it rides
/// in every take's answer.
type Reached = Option<(u32, u32)>;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Rungs {
    downgrade: Reached,
    route: Reached,
}

impl Rungs {
    /// The rungs `take` (all of the policy's further limits took the call)
    /// reached.
    pub(super) fn reached(policy: &CompiledPolicy, take: &StackedTake) -> Self {
        let first_past = |line_of: fn(&CompiledLimit) -> Option<u64>| {
            policy.limits.iter().enumerate().find_map(|(index, limit)| {
                let line = line_of(limit)?;
                let used = take.taken_standing(index)?.used_permille();
                let index = u32::try_from(index).ok()?;
                (used >= line).then_some((index, u32::try_from(used).unwrap_or(u32::MAX)))
            })
        };
        Self {
            downgrade: first_past(|l| l.downgrade.as_ref().map(|(line, _)| *line)),
            route: first_past(|l| l.route.as_ref().map(|(line, _)| *line)),
        }
    }

    /// The first limit past its downgrade line, and thousandths of it used.
    pub(super) fn downgrade(&self) -> Option<(usize, u64)> {
        self.downgrade
            .map(|(index, used)| (index as usize, u64::from(used)))
    }

    /// The first limit past its route line.
    pub(super) fn route(&self) -> Option<usize> {
        self.route.map(|(index, _)| index as usize)
    }
}
