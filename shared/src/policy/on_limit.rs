//! What a policy does with a call past its limit (`on_limit`: refuse or
//! queue) and how a call's priority is found (`priority`), and their checks.

use serde::{Deserialize, Serialize};

use super::bounds;
use super::check::Report;
use crate::duration::DurationMs;

#[cfg(feature = "schema")]
use schemars::JsonSchema;
/// What a request over the limit gets.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct OnLimit {
    #[serde(default)]
    pub action: LimitAction,
    /// Status of the local reply (also after a queue wait runs out).
    #[serde(default = "OnLimit::default_status")]
    pub status: u16,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<String>,
    /// `queue` only: the longest a request waits for its turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_wait: Option<DurationMs>,
    /// `queue` only: the most requests waiting at once, per Envoy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_queue: Option<u32>,
}

impl OnLimit {
    pub const DEFAULT_STATUS: u16 = 429;
    pub const DEFAULT_MAX_QUEUE: u32 = 1000;

    fn default_status() -> u16 {
        Self::DEFAULT_STATUS
    }

    pub fn queue_max(&self) -> u32 {
        self.max_queue.unwrap_or(Self::DEFAULT_MAX_QUEUE)
    }
}

impl Default for OnLimit {
    fn default() -> Self {
        Self {
            action: LimitAction::Reject,
            status: Self::DEFAULT_STATUS,
            body: None,
            max_wait: None,
            max_queue: None,
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum LimitAction {
    /// Answer at once with `status`, `Retry-After` and RateLimit headers.
    #[default]
    Reject,
    /// Hold the request until its turn, up to `max_wait`, then reject.
    Queue,
}

/// A request's priority: from a header whose value is `high` or `normal`
/// (case-insensitive); anything else, or no header, gives `default`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct PrioritySpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    #[serde(default)]
    pub default: Priority,
}

#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Priority {
    #[default]
    Normal,
    High,
}

pub(crate) fn check_on_limit(r: &mut Report, on_limit: &OnLimit) {
    if !(400..=599).contains(&on_limit.status) {
        r.at(
            "on_limit.status",
            "must be an HTTP error status, 400 to 599",
        );
    }
    if let Some(body) = &on_limit.body {
        if body.len() > bounds::MAX_BODY_LEN {
            r.at(
                "on_limit.body",
                format!("at most {} bytes", bounds::MAX_BODY_LEN),
            );
        }
    }
    match on_limit.action {
        LimitAction::Queue => {
            match on_limit.max_wait {
                None => r.at("on_limit.max_wait", "required when action is queue"),
                Some(wait) => r.range_ms("on_limit.max_wait", wait, 1, bounds::MAX_WAIT_MS),
            }
            if let Some(max_queue) = on_limit.max_queue {
                r.range_u64(
                    "on_limit.max_queue",
                    max_queue.into(),
                    1,
                    bounds::MAX_QUEUE.into(),
                );
            }
        }
        LimitAction::Reject => {
            if on_limit.max_wait.is_some() {
                r.at("on_limit.max_wait", "applies only when action is queue");
            }
            if on_limit.max_queue.is_some() {
                r.at("on_limit.max_queue", "applies only when action is queue");
            }
        }
    }
}
