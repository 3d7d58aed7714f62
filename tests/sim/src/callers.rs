//! Callers: connections that send calls of one tenant, each shaped as
//! real clients are: greedy (the next call as soon as the last ends, a
//! short wait after a refusal) or paced (a call every so often, its
//! connections in step, so they arrive together as small bursts).

use sluice_shared::time::Span;

#[derive(Debug, Clone)]
pub enum Shape {
    /// The next call when the last ends; about `backoff` after a 429
    /// (half to one and a half times it, drawn by seed), or, if it
    /// `heeds` the answer's `Retry-After` (as OpenAI's and Anthropic's
    /// SDKs do, up to a minute), that long and up to half `backoff` more.
    Greedy { backoff: Span, heeds: RetryAfter },
    /// A call every `every` on each connection (at most one in flight),
    /// every connection on the same grid.
    Paced { every: Span },
    /// A call every `every` on each connection, the connections' grids
    /// spread evenly over it: a steady rate of calls, one at a time.
    Steady { every: Span },
}

/// Whether a greedy caller waits what a refusal's `Retry-After` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryAfter {
    Heeded,
    Ignored,
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
    /// The request body of `call`, as serde_json writes it (keys in
    /// order, no spaces), written out directly: building it through a
    /// `serde_json::Value` took a quarter of a token run's time.
    pub fn body(&self, call: LlmCall) -> Vec<u8> {
        // Four characters a prompt token, none needing an escape.
        let content = "word".repeat(call.prompt as usize);
        let stream = if call.stream {
            r#","stream":true,"stream_options":{"include_usage":true}"#
        } else {
            ""
        };
        format!(
            r#"{{"max_tokens":{},"messages":[{{"content":"{content}","role":"user"}}],"model":"gpt-sim"{stream}}}"#,
            self.max_tokens
        )
        .into_bytes()
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The body written out is the one serde_json would write.
    #[test]
    fn a_body_is_what_serde_json_writes() {
        let calls = LlmCalls {
            prompt: (1, 3),
            output: (1, 2),
            max_tokens: 600,
            streamed: 0.5,
        };
        for stream in [false, true] {
            for prompt in [0, 1, 3] {
                let call = LlmCall {
                    prompt,
                    output: 1,
                    stream,
                };
                let mut expected = serde_json::json!({
                    "model": "gpt-sim",
                    "max_tokens": 600,
                    "messages": [{"role": "user", "content": "word".repeat(prompt as usize)}],
                });
                if stream {
                    expected["stream"] = true.into();
                    expected["stream_options"] = serde_json::json!({"include_usage": true});
                }
                assert_eq!(
                    String::from_utf8(calls.body(call)).unwrap(),
                    expected.to_string()
                );
            }
        }
    }
}
