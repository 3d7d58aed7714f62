//! Simulated upstreams, shaped as `PROVIDERS.md` describes real ones: a
//! number of calls per calendar second (counted as they arrive, refused
//! past it with 429 and, if the provider says so, `Retry-After`), and an
//! answer time drawn between two bounds.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};

use sluice_shared::time::{Instant, Span};

use crate::callers::LlmCall;
use crate::headers::Headers;
use crate::rng::SimRng;

/// A quota of tokens per key (the `x-tenant` header) in any window of
/// `window` (a sliding window: a call's tokens come back one window after
/// it), its answers saying what is left as OpenAI's do
/// (`x-ratelimit-{limit,remaining,reset}-tokens`).
#[derive(Debug, Clone)]
pub struct TokenQuota {
    pub per_window: u64,
    pub window: Span,
    pub reset: ResetSays,
}

/// What `x-ratelimit-reset-tokens` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResetSays {
    /// When the key's window is empty, its quota whole again (the newest
    /// tokens age out): OpenAI's "resets to its initial state".
    WholeAgain,
    /// When the oldest tokens in the window age out.
    OldestFree,
}

#[derive(Debug, Clone)]
pub struct ProviderShape {
    /// Calls allowed in each calendar second.
    pub per_second: u64,
    /// Answer times, drawn evenly between the two.
    pub latency: (Span, Span),
    /// What a 429 says in `Retry-After`, in seconds (None: nothing).
    pub retry_after: Option<u64>,
    /// Calls in flight at once (None: no such limit); past it, 429.
    pub max_in_flight: Option<u64>,
    /// From this long after the first call on, `per_second` is the second
    /// figure: a limit that drops (or recovers) without saying so.
    pub change: Option<(Span, u64)>,
    /// Refused calls count against the second's limit too (as some
    /// providers count every call they see).
    pub counts_refused: bool,
    /// A quota of tokens per key besides (None: calls only).
    pub tokens: Option<TokenQuota>,
    /// How far the provider's clock runs ahead of Envoy's: its calendar
    /// seconds begin this long before Envoy's (the two machines' clocks
    /// differ, and a call reaches the provider a trip after it went).
    pub clock_ahead: Span,
}

impl ProviderShape {
    /// A provider of calls only: `per_second` in each calendar second,
    /// answers in `latency`, a 429 saying `Retry-After: 1`, no other limit,
    /// its clock Envoy's.
    pub fn calls(per_second: u64, latency: (Span, Span)) -> Self {
        Self {
            per_second,
            latency,
            retry_after: Some(1),
            max_in_flight: None,
            change: None,
            counts_refused: false,
            tokens: None,
            clock_ahead: Span::ZERO,
        }
    }
}

/// What the provider saw in one calendar second.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProviderSecond {
    pub served: u64,
    pub refused: u64,
    /// Served by tenant (the `x-tenant` header, or "").
    pub by_tenant: BTreeMap<String, u64>,
    /// Tokens served by tenant.
    pub tokens_by_tenant: BTreeMap<String, u64>,
}

pub struct Provider {
    pub shape: ProviderShape,
    /// Per key, the tokens in its window, oldest first.
    windows: BTreeMap<String, VecDeque<(Instant, u64)>>,
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
    /// Its body in the pieces it comes in (none: no body).
    pub body: Vec<Vec<u8>>,
    /// When it reaches Envoy, after the call arrived.
    pub after: Span,
}

impl Provider {
    pub fn new(shape: ProviderShape) -> Self {
        Self {
            shape,
            windows: BTreeMap::new(),
            seconds: BTreeMap::new(),
            answering: BinaryHeap::new(),
            most_in_flight: 0,
            first_call: None,
        }
    }

    /// A call arriving at `now` (`llm`: what it asks of an LLM).
    pub fn call(
        &mut self,
        now: Instant,
        (request, llm): (&Headers, Option<LlmCall>),
        rng: &mut SimRng,
    ) -> Answer {
        let first = *self.first_call.get_or_insert(now);
        let limit = match self.shape.change {
            Some((after, changed)) if now.since(first) >= after => changed,
            _ => self.shape.per_second,
        };
        let second = (now + self.shape.clock_ahead).as_nanos() / 1_000_000_000;
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
        let by_calls = full || counted >= limit;
        let tokens = llm.map_or(0, |c| c.prompt + c.output);
        let quota = self.shape.tokens.clone();
        let told = quota
            .as_ref()
            .filter(|_| !by_calls)
            .map(|q| token_window(&mut self.windows, (q, &tenant), now, tokens));
        let over_quota = told.as_ref().is_some_and(|t| !t.served);
        let seen = self.seconds.entry(second).or_default();
        if by_calls || over_quota {
            seen.refused += 1;
            let mut headers = Headers::of(&[(":status", "429")]);
            if let Some(wait) = self.shape.retry_after {
                headers.set("retry-after", &wait.to_string());
            }
            if let (Some(told), Some(quota)) = (&told, &quota) {
                told.say(&mut headers, quota);
            }
            // A refusal comes back as late as an answer may: the
            // provider's front end and the way back take their time.
            return Answer {
                status: 429,
                headers,
                body: Vec::new(),
                after,
            };
        }
        seen.served += 1;
        *seen.by_tenant.entry(tenant.clone()).or_default() += 1;
        *seen.tokens_by_tenant.entry(tenant).or_default() += tokens;
        self.answering.push(Reverse((now + after).as_nanos()));
        self.most_in_flight = self.most_in_flight.max(in_flight + 1);
        let mut headers = Headers::of(&[(":status", "200")]);
        if let (Some(told), Some(quota)) = (&told, &quota) {
            told.say(&mut headers, quota);
        }
        if let Some(call) = llm {
            let kind = if call.stream {
                "text/event-stream"
            } else {
                "application/json"
            };
            headers.set("content-type", kind);
        }
        Answer {
            status: 200,
            body: llm.map(answer_body).unwrap_or_default(),
            headers,
            after,
        }
    }

    /// When its limit changes (`change`), once it has had a call.
    pub fn changes_at(&self) -> Option<Instant> {
        Some(self.first_call? + self.shape.change?.0)
    }

    pub fn refused(&self) -> u64 {
        self.seconds.values().map(|s| s.refused).sum()
    }

    pub fn served(&self) -> u64 {
        self.seconds.values().map(|s| s.served).sum()
    }
}

/// What a token quota decided of one call, and what its answer says.
struct TokensTold {
    served: bool,
    remaining: u64,
    reset_in: Span,
}

impl TokensTold {
    fn say(&self, headers: &mut Headers, quota: &TokenQuota) {
        headers.set("x-ratelimit-limit-tokens", &quota.per_window.to_string());
        headers.set("x-ratelimit-remaining-tokens", &self.remaining.to_string());
        // OpenAI's duration form: "6m0s", "1.5s", "12ms".
        let ms = self.reset_in.as_millis();
        let reset = if ms < 1000 {
            format!("{ms}ms")
        } else if ms < 60_000 {
            format!("{}.{:03}s", ms / 1000, ms % 1000)
        } else {
            format!("{}m{}.{:03}s", ms / 60_000, ms % 60_000 / 1000, ms % 1000)
        };
        headers.set("x-ratelimit-reset-tokens", &reset);
    }
}

/// A call of `tokens` reaching `key`'s sliding window at `now`: served if
/// they fit.
fn token_window(
    windows: &mut BTreeMap<String, VecDeque<(Instant, u64)>>,
    (quota, key): (&TokenQuota, &str),
    now: Instant,
    tokens: u64,
) -> TokensTold {
    let window = windows.entry(key.to_string()).or_default();
    while window
        .front()
        .is_some_and(|(at, _)| now.since(*at) >= quota.window)
    {
        window.pop_front();
    }
    let used: u64 = window.iter().map(|c| c.1).sum();
    let served = used + tokens <= quota.per_window;
    if served {
        window.push_back((now, tokens));
    }
    let used = used + if served { tokens } else { 0 };
    let reset_from = match quota.reset {
        ResetSays::WholeAgain => window.back(),
        ResetSays::OldestFree => window.front(),
    };
    TokensTold {
        served,
        remaining: quota.per_window.saturating_sub(used),
        reset_in: reset_from.map_or(Span::ZERO, |(at, _)| (*at + quota.window).since(now)),
    }
}

/// The answer's body: a chat completion with its usage, or its event
/// stream in pieces (the usage in the last event before `[DONE]`).
fn answer_body(call: LlmCall) -> Vec<Vec<u8>> {
    let usage = serde_json::json!({
        "prompt_tokens": call.prompt,
        "completion_tokens": call.output,
        "total_tokens": call.prompt + call.output,
    });
    if !call.stream {
        let body = serde_json::json!({"object": "chat.completion", "usage": usage});
        return vec![body.to_string().into_bytes()];
    }
    let chunk = |content: serde_json::Value| {
        format!(
            "data: {}\n\n",
            serde_json::json!({"choices": [{"delta": {"content": content}}], "usage": null})
        )
    };
    vec![
        chunk("Hello".into()).into_bytes(),
        chunk(" world".into()).into_bytes(),
        format!(
            "data: {}\n\ndata: [DONE]\n\n",
            serde_json::json!({"choices": [], "usage": usage})
        )
        .into_bytes(),
    ]
}
