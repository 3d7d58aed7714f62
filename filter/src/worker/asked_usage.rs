//! The worker's side of `usage.ask_stream_usage`: a streamed call of a
//! policy that asks is sent asking for its usage, and its answer has what
//! that added taken out as it passes. What a body and an answer become is
//! decided in `sluice_shared::stream_usage`; this only keeps, per call,
//! where its answer's stripping stands.

use sluice_filter_core::matcher::CompiledPolicy;
use sluice_shared::request_headers::RequestHeaders;
use sluice_shared::stream_usage::{ask_for_usage, UsageChunkStripper};

use super::ctx::Ctx;
use crate::host::Host;
use crate::metrics::PolicyCounter;

/// A call sent asking for its usage; its stripper once its answer is an
/// event stream.
#[derive(Debug)]
pub(super) struct Asked {
    policy: String,
    stripper: Option<UsageChunkStripper>,
}

impl Asked {
    /// The request's body is in, `raw` as it came, and the call goes on
    /// under `policy`: a streamed request not asking for its usage is
    /// made to ask (None: it was not).
    pub fn ask<H: Host + ?Sized>(
        ctx: &mut Ctx<'_, H>,
        policy: &CompiledPolicy,
        raw: &[u8],
    ) -> Option<Self> {
        if !policy.asks_stream_usage() {
            return None;
        }
        let asking = ask_for_usage(raw)?;
        if !ctx.host.replace_request_body(raw.len(), &asking) {
            return None;
        }
        ctx.metrics
            .add(policy.name(), PolicyCounter::StreamUsageAsked, 1);
        Some(Self {
            policy: policy.name().to_string(),
            stripper: None,
        })
    }

    /// The answer's headers: an event stream is stripped as it passes
    /// (true); any other answer (a refusal's JSON) goes as it is (false:
    /// nothing is left to do).
    pub fn on_answer_headers<R: RequestHeaders + ?Sized>(&mut self, headers: &R) -> bool {
        let is_stream = headers.header("content-type").is_some_and(|ct| {
            ct.len() >= 17 && ct[..17].eq_ignore_ascii_case(b"text/event-stream")
        });
        if is_stream {
            self.stripper = Some(UsageChunkStripper::default());
        }
        is_stream
    }

    /// What of the answer's next piece the caller gets (None: the answer
    /// is not stripped).
    pub fn on_answer_body<H: Host + ?Sized>(
        &mut self,
        ctx: &mut Ctx<'_, H>,
        chunk: &[u8],
        end_of_stream: bool,
    ) -> Option<Vec<u8>> {
        let stripper = self.stripper.as_mut()?;
        let before = stripper.stripped;
        let passed = stripper.feed(chunk, end_of_stream);
        let stripped = stripper.stripped - before;
        if stripped > 0 {
            ctx.metrics.add(
                &self.policy,
                PolicyCounter::StreamUsageStripped,
                i64::from(stripped),
            );
        }
        Some(passed)
    }
}
