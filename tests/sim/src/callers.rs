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
    /// A call every `every` on each connection, the connections' grids
    /// spread evenly over it: a steady rate of calls, one at a time.
    Steady { every: Span },
}

/// Calls to an LLM's chat completions: a JSON body asking for
/// `max_tokens` of output with a prompt of `prompt` tokens (four
/// characters each), streamed (asking for the usage at the end) with
/// chance `streamed`; the answer is `output` tokens long, which only the
/// answer tells.
#[derive(Debug, Clone)]
pub struct LlmCalls {
    pub prompt: (u64, u64),
    pub output: (u64, u64),
    pub max_tokens: u64,
    pub streamed: f64,
}

/// One call's draw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LlmCall {
    pub prompt: u64,
    pub output: u64,
    pub stream: bool,
}

impl LlmCalls {
    /// The request body of `call`.
    pub fn body(&self, call: LlmCall) -> Vec<u8> {
        let mut body = serde_json::json!({
            "model": "gpt-sim",
            "max_tokens": self.max_tokens,
            "messages": [{"role": "user", "content": "word".repeat(call.prompt as usize)}],
        });
        if call.stream {
            body["stream"] = true.into();
            body["stream_options"] = serde_json::json!({"include_usage": true});
        }
        body.to_string().into_bytes()
    }
}

#[derive(Debug, Clone)]
pub struct Caller {
    pub tenant: String,
    pub host: String,
    pub connections: usize,
    pub shape: Shape,
    /// Calls with a body, to an LLM (None: bodiless calls).
    pub llm: Option<LlmCalls>,
    /// The Envoy its connections go to (fleet runs; while it is down, the
    /// balancer in front sends its calls to another).
    pub envoy: usize,
    /// When it calls: (from, for how long) into the run; empty: always.
    pub active: Vec<(Span, Span)>,
}
