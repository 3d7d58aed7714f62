//! Where windows begin and end: at multiples of the period since the
//! epoch, or at a calendar's edges.

use std::sync::Arc;

use crate::calendar::Calendar;
use crate::time::{Instant, Span};

/// The start of the window of length `period` (at least 1 ns) `now` is in.
pub(super) fn align(now: Instant, period: Span) -> Instant {
    now - Span::from_nanos(now.as_nanos() % period.as_nanos().max(1))
}

/// Windows of `period` from the aligned `earlier` to the aligned `later`.
pub(super) fn windows_between(earlier: Instant, later: Instant, period: Span) -> u64 {
    later.since(earlier).as_nanos() / period.as_nanos().max(1)
}

/// Where a fixed window's edges fall: every `period` since the epoch, or
/// at the calendar's (local midnight, the 1st), which every Envoy tells
/// alike from the same zone rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Edges {
    Every(Span),
    Calendar(Arc<Calendar>),
}

impl Edges {
    /// The start of the window `now` is in. A calendar cannot tell windows
    /// past the year 9999, which no `Instant` reaches; were it to fail,
    /// the window would start now.
    pub(super) fn align(&self, now: Instant) -> Instant {
        match self {
            Self::Every(period) => align(now, *period),
            Self::Calendar(c) => c.window(now).map_or(now, |w| w.start),
        }
    }

    /// Whole windows from the one starting at `earlier` to the one
    /// starting at `later`.
    pub(super) fn between(&self, earlier: Instant, later: Instant) -> u64 {
        match self {
            Self::Every(period) => windows_between(earlier, later, *period),
            Self::Calendar(c) => c.windows_between(earlier, later).unwrap_or(0),
        }
    }

    /// The start of the window `n` after the one starting at `start`.
    pub(super) fn after(&self, start: Instant, n: u64) -> Instant {
        match self {
            Self::Every(period) => start + period.saturating_mul(n),
            Self::Calendar(c) => u32::try_from(n)
                .ok()
                .and_then(|n| c.nth_after(start, n).ok())
                .unwrap_or(Instant::MAX),
        }
    }
}
