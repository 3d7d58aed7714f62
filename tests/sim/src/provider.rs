//! Simulated upstreams, shaped as `PROVIDERS.md` describes real ones: a
//! number of calls per calendar second (counted as they arrive, refused
//! past it with 429 and, if the provider says so, `Retry-After`), and an
//! answer time drawn between two bounds.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

use sluice_shared::time::{Instant, Span};

use crate::headers::Headers;
use crate::rng::SimRng;

#[derive(Debug, Clone)]
pub struct ProviderShape {
    /// Calls allowed in each calendar second.
    pub per_second: u64,
    /// Answer times, drawn evenly between the two.
    pub latency: (Span, Span),
    /// A 429 says `Retry-After: 1`.
    pub retry_after: bool,
    /// Calls in flight at once (None: no such limit); past it, 429.
    pub max_in_flight: Option<u64>,
    /// From this long after the first call on, `per_second` is the second
    /// figure: a limit that drops (or recovers) without saying so.
    pub change: Option<(Span, u64)>,
    /// Refused calls count against the second's limit too (as some
    /// providers count every call they see).
    pub counts_refused: bool,
}

/// What the provider saw in one calendar second.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProviderSecond {
    pub served: u64,
    pub refused: u64,
    /// Served by tenant (the `x-tenant` header, or "").
    pub by_tenant: BTreeMap<String, u64>,
}

pub struct Provider {
    pub shape: ProviderShape,
    pub seconds: BTreeMap<u64, ProviderSecond>,
    /// When each call in flight is answered.
    answering: BinaryHeap<Reverse<u64>>,
    /// The most calls it had in flight at once.
    pub most_in_flight: u64,
    first_call: Option<Instant>,
}

/// The provider's answer to one call.
pub struct Answer {
    pub status: u32,
    pub headers: Headers,
    /// When it reaches Envoy, after the call arrived.
    pub after: Span,
}

impl Provider {
    pub fn new(shape: ProviderShape) -> Self {
        Self {
            shape,
            seconds: BTreeMap::new(),
            answering: BinaryHeap::new(),
            most_in_flight: 0,
            first_call: None,
        }
    }

    /// A call arriving at `now`.
    pub fn call(&mut self, now: Instant, request: &Headers, rng: &mut SimRng) -> Answer {
        let first = *self.first_call.get_or_insert(now);
        let limit = match self.shape.change {
            Some((after, changed)) if now.since(first) >= after => changed,
            _ => self.shape.per_second,
        };
        let second = now.as_nanos() / 1_000_000_000;
        let tenant = request.text("x-tenant").unwrap_or_default();
        let seen = self.seconds.entry(second).or_default();
        let (low, high) = self.shape.latency;
        let after = Span::from_nanos(rng.between(low.as_nanos(), high.as_nanos()));
        while self
            .answering
            .peek()
            .is_some_and(|Reverse(at)| *at <= now.as_nanos())
        {
            self.answering.pop();
        }
        let in_flight = self.answering.len() as u64;
        let full = self
            .shape
            .max_in_flight
            .is_some_and(|most| in_flight >= most);
        let counted = if self.shape.counts_refused {
            seen.served + seen.refused
        } else {
            seen.served
        };
        if full || counted >= limit {
            seen.refused += 1;
            let mut headers = Headers::of(&[(":status", "429")]);
            if self.shape.retry_after {
                headers.set("retry-after", "1");
            }
            // A refusal comes back as late as an answer may: the
            // provider's front end and the way back take their time.
            return Answer {
                status: 429,
                headers,
                after,
            };
        }
        seen.served += 1;
        *seen.by_tenant.entry(tenant).or_default() += 1;
        self.answering.push(Reverse((now + after).as_nanos()));
        self.most_in_flight = self.most_in_flight.max(in_flight + 1);
        Answer {
            status: 200,
            headers: Headers::of(&[(":status", "200")]),
            after,
        }
    }

    pub fn refused(&self) -> u64 {
        self.seconds.values().map(|s| s.refused).sum()
    }

    pub fn served(&self) -> u64 {
        self.seconds.values().map(|s| s.served).sum()
    }
}
