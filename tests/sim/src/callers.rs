//! Callers: connections that send calls of one tenant, each shaped as
//! real clients are: greedy (the next call as soon as the last ends, a
//! short wait after a refusal) or paced (a call every so often, its
//! connections in step, so they arrive together as small bursts).

use sluice_shared::time::Span;

#[derive(Debug, Clone)]
pub enum Shape {
    /// The next call when the last ends; about `backoff` after a 429
    /// (half to one and a half times it, drawn by seed).
    Greedy { backoff: Span },
    /// A call every `every` on each connection (at most one in flight),
    /// every connection on the same grid.
    Paced { every: Span },
}

#[derive(Debug, Clone)]
pub struct Caller {
    pub tenant: String,
    pub host: String,
    pub connections: usize,
    pub shape: Shape,
}
