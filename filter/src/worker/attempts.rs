//! Each attempt of a pool call, heard from the member that answered it
//! (plugin `role: attempts`: the filter as an upstream HTTP filter of the
//! member clusters, which Envoy runs once per attempt, its retries on
//! another member included). The deciding filter sees only the last
//! attempt's answer: a member's refusal that Envoy retried elsewhere
//! reaches it as a guess ([`super::probe`]), without the member's own
//! wait. Here each attempt's refusal and wait reach the member's own
//! unkeyed limits ([`Hearing::Attempt`]), in shared data like every other
//! worker's, and the answer is marked so that the deciding filter does
//! not hear them again ([`Hearing::CallOfHeardAttempts`]).

use std::sync::Arc;

use sluice_filter_core::matcher::CompiledPolicySet;
use sluice_shared::key_hash::KeySecret;
use sluice_shared::policy::PoolSpec;
use sluice_shared::request_headers::RequestHeaders;
use sluice_shared::time::Instant;

use super::ctx::Ctx;
use super::listened::{Hearing, Listened};
use super::probe;
use super::{When, Worker};
use crate::host::{Host, Level};

/// An attempt of a pool call going to a member: the pool its request was
/// routed to, under the set then enforced, and when it went.
#[derive(Debug)]
pub struct Attempt {
    set: Arc<CompiledPolicySet>,
    pool_index: usize,
    sent: Instant,
}

/// What the attempts filter marks the answers of the attempts it heard
/// with: a value of this Envoy process's own (from its key secret, the
/// same in every VM and worker), which a provider cannot forge to have
/// its refusals heard by nobody. The deciding filter removes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttemptMark(String);

impl AttemptMark {
    pub const HEADER: &'static str = "x-sluice-attempt-heard";

    pub fn of(secret: &KeySecret) -> Self {
        Self(format!("{:016x}", secret.hash("sluice/attempt-heard", b"")))
    }

    pub fn value(&self) -> &str {
        &self.0
    }

    /// Whether `headers` carry this mark (the attempt was heard), and
    /// whether they carry the field at all.
    pub fn read<R: RequestHeaders + ?Sized>(&self, headers: &R) -> (bool, bool) {
        match headers.header(Self::HEADER) {
            None => (false, false),
            Some(value) => (*value == *self.0.as_bytes(), true),
        }
    }
}

impl Worker {
    /// An attempt of a call goes upstream (plugin `role: attempts`): the
    /// pool it was routed to, to hear its answer against (None: no pool of
    /// the set enforced routes it).
    pub fn on_attempt<H, R>(&mut self, host: &H, req: &R) -> Option<Attempt>
    where
        H: Host + ?Sized,
        R: RequestHeaders + ?Sized,
    {
        self.event(host, When::Fresh, |parts, ctx| {
            goes(&parts.policies, req, ctx.now)
        })
    }

    /// The attempt's answer came: the member that gave it hears its
    /// refusal and wait. Returns what the answer is marked with for the
    /// deciding filter (None: it named no member, and is not marked).
    pub fn on_attempt_answer<H, R>(
        &mut self,
        host: &H,
        attempt: &Attempt,
        headers: &R,
    ) -> Option<AttemptMark>
    where
        H: Host + ?Sized,
        R: RequestHeaders + ?Sized,
    {
        self.event(host, When::Fresh, |parts, ctx| {
            let news = answered(ctx, attempt, headers, &mut parts.attempts_unnamed)?;
            if news {
                parts.sync.hurry(ctx);
            }
            Some(parts.attempt_mark.clone())
        })
    }
}

/// Whether this worker said once that attempts name no member.
#[derive(Debug, Default)]
pub(super) struct Unnamed(bool);

/// An attempt's request: the pool whose member cluster its route header
/// names (None: no pool of `set` routes it; it is not heard).
pub(super) fn goes<R: RequestHeaders + ?Sized>(
    set: &Arc<CompiledPolicySet>,
    req: &R,
    now: Instant,
) -> Option<Attempt> {
    let pool_index = set.policies.iter().position(|policy| {
        policy.pool.as_ref().is_some_and(|pool| {
            req.header(&pool.route_header)
                .is_some_and(|value| pool.members.iter().any(|m| *m.cluster.as_bytes() == *value))
        })
    })?;
    Some(Attempt {
        set: Arc::clone(set),
        pool_index,
        sent: now,
    })
}

/// The attempt's answer came: the member that gave it (named by
/// [`PoolSpec::ATTEMPT_MEMBER_HEADER`]) hears its refusal and wait, and a
/// served attempt ends a probe of it. Returns whether that is news for
/// the other Envoys, or None when the answer names no member of the pool
/// (it is then not marked, and the deciding filter hears it as before).
pub(super) fn answered<H, R>(
    ctx: &mut Ctx<'_, H>,
    attempt: &Attempt,
    headers: &R,
    unnamed: &mut Unnamed,
) -> Option<bool>
where
    H: Host + ?Sized,
    R: RequestHeaders + ?Sized,
{
    let pool = attempt
        .set
        .policies
        .get(attempt.pool_index)?
        .pool
        .as_ref()?;
    let member = headers
        .header(PoolSpec::ATTEMPT_MEMBER_HEADER)
        .and_then(|name| pool.member(&name))
        .and_then(|at| pool.members.get(at));
    let Some(member) = member else {
        if !std::mem::replace(&mut unnamed.0, true) {
            ctx.host.log(
                Level::Warn,
                &format!(
                    "sluice: an attempt's answer names no member of its pool in {}: set it per \
                     attempt from the endpoint's metadata (envoy/pool.yaml); until then a member's \
                     refusal is heard only when it is the call's answer",
                    PoolSpec::ATTEMPT_MEMBER_HEADER
                ),
            );
        }
        return None;
    };
    let news = Listened::of(&attempt.set, member.index, &[], &[])
        .is_some_and(|listened| listened.on_answer_headers(ctx, headers, Hearing::Attempt));
    probe::end_if_served(ctx, member, attempt.sent, headers);
    Some(news)
}
