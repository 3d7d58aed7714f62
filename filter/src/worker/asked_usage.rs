//! The worker's side of `usage.ask_stream_usage`: a streamed call of a
//! policy that asks is sent asking for its usage, and its answer has what
//! that added taken out as it passes. What a body and an answer become is
//! decided in `sluice_shared::stream_usage`; this only keeps, per call,
//! where its answer's stripping stands.

use rustc_hash::FxHashMap;

use sluice_filter_core::matcher::CompiledPolicy;
use sluice_shared::request_headers::RequestHeaders;
use sluice_shared::stream_usage::{ask_for_usage, UsageChunkStripper};

use super::ctx::Ctx;
use crate::host::Host;
use crate::metrics::PolicyCounter;

#[derive(Debug, Default)]
pub(super) struct AskedStreams {
    /// Calls sent asking; their stripper once their answer is an event
    /// stream.
    calls: FxHashMap<u32, Asked>,
}

#[derive(Debug)]
struct Asked {
    policy: String,
    stripper: Option<UsageChunkStripper>,
}

impl AskedStreams {
    /// The request's body is in, `raw` as it came, and the call goes on
    /// under `policy`: a streamed request not asking for its usage is
    /// made to ask. True when it was.
    pub fn ask<H: Host + ?Sized>(
        &mut self,
        ctx: &mut Ctx<'_, H>,
        context_id: u32,
        policy: &CompiledPolicy,
        raw: &[u8],
    ) -> bool {
        if !policy.asks_stream_usage() {
            return false;
        }
        let Some(asking) = ask_for_usage(raw) else {
            return false;
        };
        if !ctx.host.replace_request_body(raw.len(), &asking) {
            return false;
        }
        ctx.metrics
            .add(policy.name(), PolicyCounter::StreamUsageAsked, 1);
        self.calls.insert(
            context_id,
            Asked {
                policy: policy.name().to_string(),
                stripper: None,
            },
        );
        true
    }

    /// The answer's headers: an event stream is stripped as it passes
    /// (true); any other answer (a refusal's JSON) goes as it is.
    pub fn on_headers<R: RequestHeaders + ?Sized>(&mut self, context_id: u32, headers: &R) -> bool {
        let Some(asked) = self.calls.get_mut(&context_id) else {
            return false;
        };
        let is_stream = headers.header("content-type").is_some_and(|ct| {
            ct.len() >= 17 && ct[..17].eq_ignore_ascii_case(b"text/event-stream")
        });
        if !is_stream {
            self.calls.remove(&context_id);
            return false;
        }
        asked.stripper = Some(UsageChunkStripper::default());
        true
    }

    /// What of the answer's next piece the caller gets; None when the
    /// answer is not stripped.
    pub fn strip<H: Host + ?Sized>(
        &mut self,
        ctx: &mut Ctx<'_, H>,
        context_id: u32,
        chunk: &[u8],
        end_of_stream: bool,
    ) -> Option<Vec<u8>> {
        let asked = self.calls.get_mut(&context_id)?;
        let stripper = asked.stripper.as_mut()?;
        let before = stripper.stripped;
        let passed = stripper.feed(chunk, end_of_stream);
        let stripped = stripper.stripped - before;
        if stripped > 0 {
            ctx.metrics.add(
                &asked.policy,
                PolicyCounter::StreamUsageStripped,
                i64::from(stripped),
            );
        }
        if end_of_stream {
            self.calls.remove(&context_id);
        }
        Some(passed)
    }

    /// Whether the answer of `context_id` is stripped as it passes.
    pub fn strips(&self, context_id: u32) -> bool {
        self.calls
            .get(&context_id)
            .is_some_and(|a| a.stripper.is_some())
    }

    /// Whether `context_id` was sent asking (its answer not in yet).
    pub fn awaits(&self, context_id: u32) -> bool {
        self.calls.contains_key(&context_id)
    }

    pub fn end(&mut self, context_id: u32) {
        self.calls.remove(&context_id);
    }
}
