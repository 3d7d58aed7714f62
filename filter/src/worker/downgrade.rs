//! The worker's side of a money limit's downgrade rung (`downgrade`): a
//! call admitted now whose take left the limit (its key's, where keyed)
//! at or past the rung's line, naming a model the rung names, is sent for
//! the cheaper model: its JSON body's model rewritten, and what the dear
//! model's estimate took beyond the cheap one's given back, so the limit
//! holds the cheap call's estimate until its usage settles it (at the
//! cheaper model's prices, or the answer's model's when dearer). What a
//! rung says and checks is `sluice_shared::policy::downgrade`'s.
//!
//! The call is judged at its own model's estimate, then downgraded: near
//! the wall a call that would fit only at the cheaper price is refused,
//! never let through on a guess. A queued call goes as it came. A pool
//! call is judged as its member's policy (the pool's own limits and the
//! member's); sent for the cheaper model, it takes the cheaper model's
//! costs at every member.

// What the call takes once sent for the cheaper model.
#[path = "downgrade_call.rs"]
mod taking;

use serde_json::Value;
use sluice_filter_core::body::BodyJson;
use sluice_filter_core::matcher::CompiledPolicy;
use sluice_shared::request_headers::RequestHeaders;

use super::ctx::Ctx;
use super::limits::Held;
use crate::host::Host;
use crate::metrics::LimitCounter;

/// The header of a downgraded call's answer: `gpt-4o -> gpt-4o-mini`.
pub const DOWNGRADED_HEADER: &str = "x-sluice-downgraded";

/// A call sent for a cheaper model, and the body it went with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Downgraded {
    pub limit: String,
    pub from: String,
    pub to: String,
    pub body: Vec<u8>,
}

impl Downgraded {
    pub fn header_value(&self) -> String {
        format!("{} -> {}", self.from, self.to)
    }
}

/// A request as it came: its headers, its body read, and its bytes.
pub(super) struct AsItCame<'a, R: ?Sized> {
    pub req: &'a R,
    pub body: &'a BodyJson,
    /// None: its body was not read.
    pub raw: Option<&'a [u8]>,
}

/// Sends the call `held` (of `policy`: for a pool call, its member's) for
/// the cheaper model its take reached, if any: rewrites its body. None: no line reached, no model the rung names, or
/// a body that cannot be rewritten (it goes as it came).
pub(super) fn rewrite<H, R>(
    ctx: &mut Ctx<'_, H>,
    policy: &CompiledPolicy,
    held: &Held,
    came: &AsItCame<'_, R>,
) -> Option<Downgraded>
where
    H: Host + ?Sized,
    R: RequestHeaders + ?Sized,
{
    let AsItCame { req, body, raw } = *came;
    let raw = raw?;
    let (index, used) = held.rungs.downgrade()?;
    let limit = policy.limits.get(index)?;
    let (from, path) = policy.body_model(req, body)?;
    let to = limit.downgrade_to(&from, used)?.to_string();
    let mut json = body.json()?.clone();
    *path.value_in_mut(&mut json)? = Value::String(to.clone());
    let rewritten = serde_json::to_vec(&json).ok()?;
    if !ctx.host.replace_request_body(raw.len(), &rewritten) {
        return None;
    }
    ctx.metrics
        .add_limit(&limit.name, LimitCounter::Downgraded, 1);
    Some(Downgraded {
        limit: limit.name.clone(),
        from,
        to,
        body: rewritten,
    })
}
