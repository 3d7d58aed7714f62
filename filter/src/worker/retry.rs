//! How long a refused call is told to wait when nothing schedules its turn.

use sluice_shared::time::Span;

/// Retry-After for a refusal that has no schedule (contention, overflow, a
/// closed share, a queue wait that ran out).
pub const DEFAULT_RETRY: Span = Span::from_secs(1);

/// Retry-After of a call a concurrency limit refused: no schedule says
/// when a slot frees (rounded up to a second in the header). In queue mode
/// the call waits for one, within `max_wait`.
pub(super) const SLOT_RETRY: Span = Span::from_millis(1);
