//! Calls whose headers wait while their body is read (a policy decides on
//! it): nothing of such a call goes upstream until it is decided. Envoy
//! brings the body to the filter only when the headers' pause lets it
//! (proxy-wasm: the plugin's `allow_on_headers_stop_iteration`); where it
//! does not, the body never comes, and without this the call would hang
//! until Envoy's own timeout. A call whose body has not come within
//! [`BODY_WAIT`] is answered 408, and the first such answer is logged with
//! the setting to check.

use rustc_hash::FxHashMap;
use sluice_shared::time::{Instant, Span};

use super::ctx::Ctx;
use super::to_shell::LocalReply;
use super::to_shell::StreamAction;
use crate::host::{Host, Level};
use crate::metrics::FilterCounter;

/// The longest a call's headers wait for its body.
pub const BODY_WAIT: Span = Span::from_secs(10);

#[derive(Debug, Default)]
pub(super) struct BodyWaits {
    since: FxHashMap<u32, Instant>,
    told: bool,
}

impl BodyWaits {
    /// Stream `context_id`'s headers wait for its body from `now`.
    pub fn start(&mut self, context_id: u32, now: Instant) {
        self.since.insert(context_id, now);
    }

    /// Its body came (or the stream ended).
    pub fn end(&mut self, context_id: u32) {
        if !self.since.is_empty() {
            self.since.remove(&context_id);
        }
    }

    /// The calls waited for past [`BODY_WAIT`]: each answered 408.
    pub fn expire<H: Host + ?Sized>(&mut self, ctx: &mut Ctx<'_, H>) -> Vec<StreamAction> {
        if self.since.is_empty() {
            return Vec::new();
        }
        let now = ctx.now;
        let mut late: Vec<u32> = self
            .since
            .iter()
            .filter(|(_, since)| now.since(**since) >= BODY_WAIT)
            .map(|(id, _)| *id)
            .collect();
        late.sort_unstable();
        for id in &late {
            self.since.remove(id);
        }
        if late.is_empty() {
            return Vec::new();
        }
        ctx.metrics.add_filter(
            FilterCounter::BodyWaitTimeouts,
            i64::try_from(late.len()).unwrap_or(i64::MAX),
        );
        if !std::mem::replace(&mut self.told, true) {
            ctx.host.log(
                Level::Error,
                &format!(
                    "sluice: a request's body did not come within {} s of its headers, which wait for it \
                     (a policy decides on the body): answered 408. If this happens to every such call, \
                     Envoy does not let this filter read a body while it holds the headers: set \
                     `allow_on_headers_stop_iteration: true` in the wasm filter's `config` (Envoy 1.35 or later)",
                    BODY_WAIT.as_millis() / 1000
                ),
            );
        }
        late.into_iter()
            .map(|id| StreamAction::Reply(id, timed_out()))
            .collect()
    }
}

/// The answer to a call whose body did not come in time.
fn timed_out() -> LocalReply {
    LocalReply {
        status: 408,
        headers: vec![
            ("x-sluice-reason", "body-timeout".to_string()),
            ("content-type", "text/plain".to_string()),
        ],
        body: format!(
            "the request's body did not arrive within {} s\n",
            BODY_WAIT.as_millis() / 1000
        )
        .into_bytes(),
    }
}
