//! A pool's members as the shipped `envoy/pool.yaml` routes to them:
//! Sluice writes the chosen member's cluster into the pool's route
//! header, a route per member sends the call to that member's upstream,
//! a 429 or 503 from it is tried once more on the other member (Envoy's
//! retry, which Sluice does not see), and the answer names the member
//! that gave it (`x-sluice-member-answered`, from the endpoint's
//! metadata). With `attempts_heard`, the member clusters also run Sluice
//! as an upstream filter of role `attempts`, which hears each attempt's
//! answer, named by `x-sluice-attempt-member`.

use crate::provider::ProviderShape;

/// The answer's header naming the member that answered.
pub const ANSWERED_HEADER: &str = "x-sluice-member-answered";
/// Each attempt's answer's header naming the member that gave it.
pub const ATTEMPT_MEMBER_HEADER: &str = "x-sluice-attempt-member";

/// Statuses Envoy tries once more on another member
/// (`retriable_status_codes`).
pub const RETRIED_STATUSES: [u32; 2] = [429, 503];

#[derive(Debug, Clone)]
pub struct PoolRoutes {
    /// The header Sluice writes the chosen member's cluster into.
    pub route_header: String,
    pub members: Vec<PoolMember>,
    /// The member clusters run the attempts filter (`envoy/pool.yaml`).
    pub attempts_heard: bool,
}

#[derive(Debug, Clone)]
pub struct PoolMember {
    /// The member's name in the policy, which its answers carry.
    pub name: String,
    /// The cluster Sluice names for it (a route matches it exactly).
    pub cluster: String,
    pub provider: ProviderShape,
}

impl PoolRoutes {
    /// The member a request's route header names (None: no route
    /// matches, and Envoy answers 404 itself).
    pub fn named(&self, cluster: Option<&str>) -> Option<usize> {
        let cluster = cluster?;
        self.members.iter().position(|m| m.cluster == cluster)
    }

    /// The member Envoy retries on after `tried` refused: the next one
    /// (`previous_priorities` passes over the one tried), if any.
    pub fn retry_after(&self, tried: usize) -> Option<usize> {
        (self.members.len() > 1).then(|| (tried + 1) % self.members.len())
    }
}
