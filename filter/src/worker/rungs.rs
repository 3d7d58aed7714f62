//! Which of the budget ladder's rungs a call's take reached: the first
//! limit it left at or past its `downgrade` line (the call goes for a
//! cheaper model, `downgrade.rs`) and the first past its `route` line (a
//! pool call goes to the rung's member, `pool.rs`). Read from where each
//! limit stood once the call's take was counted in it.

use sluice_filter_core::matcher::CompiledPolicy;
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
    /// reached. One pass, a limit without a rung skipped at once: every
    /// call of a policy with further limits comes here.
    pub(super) fn reached(policy: &CompiledPolicy, take: &StackedTake) -> Self {
        let mut rungs = Self::default();
        for (index, limit) in policy.limits.iter().enumerate() {
            if !limit.has_rungs() {
                continue;
            }
            let (Some(standing), Ok(at)) = (take.taken_standing(index), u32::try_from(index))
            else {
                continue;
            };
            let used = standing.used_permille();
            let past = |line: Option<u64>| {
                line.is_some_and(|line| used >= line)
                    .then_some((at, u32::try_from(used).unwrap_or(u32::MAX)))
            };
            rungs.downgrade = rungs
                .downgrade
                .or_else(|| past(limit.downgrade.as_ref().map(|(line, _)| *line)));
            rungs.route = rungs
                .route
                .or_else(|| past(limit.route.as_ref().map(|(line, _)| *line)));
        }
        rungs
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
