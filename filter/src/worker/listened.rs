//! A call's limits that listen to its provider (`provider` on a limit),
//! hearing its answer: a refusal counted, a wait that pauses them, an
//! adaptive rate cut, a count of what is left followed. What each of
//! those writes to shared data is `provider.rs`'s.

use std::sync::Arc;

use sluice_filter_core::matcher::{CompiledLimit, CompiledPolicySet};
use sluice_shared::provider::{Heard, PauseSignal, PauseWhy, ProviderTable, Throttle};
use sluice_shared::request_headers::RequestHeaders;
use sluice_shared::time::Span;

use super::ctx::Ctx;
use super::provider::{cut_rate, ignored, pause, pause_member, place_of_owner, relayed, Counted};
use super::retry::DEFAULT_RETRY;
use crate::host::Host;
use crate::metrics::LimitCounter;

/// One limit of an admitted call whose answer is read.
#[derive(Debug)]
struct Listener {
    limit: usize,
    key: Option<u64>,
    counted: Option<Counted>,
}

/// A call whose answer is read for the provider's word: under which set
/// and policy it went (a set installed since does not change what its
/// limits were).
#[derive(Debug)]
pub(super) struct Listened {
    set: Arc<CompiledPolicySet>,
    policy_index: usize,
    listeners: Vec<Listener>,
}

/// Which answer the limits hear, and so which of its words.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Hearing {
    /// The call's answer, its attempts unheard: all it says.
    Call,
    /// The call's answer, each of whose attempts the attempts filter heard
    /// ([`super::attempts`]): a member's own unkeyed limits take no
    /// refusal or wait from it again; the rest hear all it says.
    CallOfHeardAttempts,
    /// One attempt's answer: a member's own unkeyed limits hear its
    /// refusal and wait, and nothing else does.
    Attempt,
}

/// Whether the limit at `index` of a pool member's policy (`own_from`:
/// where the member's own begin) hears each attempt's refusal and wait:
/// a member's own, unkeyed (a keyed one's place is its key's, which only
/// the deciding filter knows).
fn heard_per_attempt(limit: &CompiledLimit, index: usize, own_from: usize) -> bool {
    index >= own_from && limit.keys.is_none()
}

/// What one answer said, as the limits hear it.
struct Answer<'a, R: ?Sized> {
    headers: &'a R,
    status: Option<u16>,
    /// Limits from this one on are a pool member's own (not its pool's).
    own_from: usize,
    hearing: Hearing,
}

impl Listened {
    /// A call of policy `policy_index` of `set` went: its limits with
    /// `provider` read its answer (`keys`: the call's key per further
    /// limit; `counted`: where it counts in each followed count). None:
    /// none of them listens.
    pub fn of(
        set: &Arc<CompiledPolicySet>,
        policy_index: usize,
        keys: &[Option<u64>],
        counted: &[Option<Counted>],
    ) -> Option<Self> {
        let policy = set.policy(policy_index)?;
        let listeners: Vec<Listener> = policy
            .limits
            .iter()
            .enumerate()
            .filter(|(_, l)| l.provider.is_some())
            .map(|(i, _)| Listener {
                limit: i,
                key: keys.get(i).copied().flatten(),
                counted: counted.get(i).copied().flatten(),
            })
            .collect();
        (!listeners.is_empty()).then(|| Self {
            set: Arc::clone(set),
            policy_index,
            listeners,
        })
    }

    /// The answer's headers came (`hearing`: which answer): a refusal the
    /// limits listen to is counted, and one with a wait pauses them; a
    /// count they follow caps what goes until its reset. Returns whether
    /// it began a pause or cut a rate: news for the other Envoys.
    pub fn on_answer_headers<H, R>(
        self,
        ctx: &mut Ctx<'_, H>,
        headers: &R,
        hearing: Hearing,
    ) -> bool
    where
        H: Host + ?Sized,
        R: RequestHeaders + ?Sized,
    {
        let Some(policy) = self.set.policy(self.policy_index) else {
            return false;
        };
        // A pool member's own limits (not its pool's): a refusal without a
        // wait passes the member over for a while.
        let own_from = policy
            .member_of
            .and_then(|(pool, at)| self.set.policies.get(pool)?.pool.as_ref()?.members.get(at))
            .map_or(usize::MAX, |m| m.own_limits);
        let status = headers
            .header(":status")
            .and_then(|s| std::str::from_utf8(&s).ok()?.parse::<u16>().ok());
        let answer = Answer {
            headers,
            status,
            own_from,
            hearing,
        };
        let mut news = false;
        for listener in &self.listeners {
            if let Some(limit) = policy.limits.get(listener.limit) {
                news |= hear(ctx, limit, listener, &answer);
            }
        }
        news
    }
}

/// What `limit` hears of `answer` for the call (`listener`: its place in
/// the call). Returns whether it is news for the other Envoys.
fn hear<H, R>(
    ctx: &mut Ctx<'_, H>,
    limit: &CompiledLimit,
    listener: &Listener,
    answer: &Answer<'_, R>,
) -> bool
where
    H: Host + ?Sized,
    R: RequestHeaders + ?Sized,
{
    let now = ctx.now;
    let (headers, status, own_from) = (answer.headers, answer.status, answer.own_from);
    let mut news = false;
    let Some(provider) = &limit.provider else {
        return news;
    };
    let per_attempt = heard_per_attempt(limit, listener.limit, own_from);
    let hears_signal = match answer.hearing {
        Hearing::Call => true,
        Hearing::CallOfHeardAttempts => !per_attempt,
        Hearing::Attempt if per_attempt => true,
        Hearing::Attempt => return news,
    };
    let signal = provider.pause_for(status, headers, now);
    if let (Some(full), Some(counted), false) = (
        provider.adaptive,
        listener.counted,
        matches!(signal, PauseSignal::None),
    ) {
        let heard = Heard::Here {
            admitted: counted.admitted,
            sent: counted.sent,
        };
        let throttle = Throttle {
            full,
            wait: match signal {
                PauseSignal::Pause { wait, .. } => wait,
                _ => Span::ZERO,
            },
            period: provider.default_reset,
        };
        news |= cut_rate(ctx, limit, counted.owner, heard, now, throttle) && relayed(limit);
    }
    if hears_signal {
        news |= hear_refusal(ctx, limit, listener, signal, answer);
    }
    if let Some(counted) = listener.counted {
        follow_count(ctx, limit, counted, headers);
    }
    news
}

/// What `limit` hears of a refusal in `answer` (`signal`), for the call's
/// `listener` (a pool member's own limit is passed over for a while by a
/// refusal without a wait too). Returns whether it is news for the other
/// Envoys.
fn hear_refusal<H, R>(
    ctx: &mut Ctx<'_, H>,
    limit: &CompiledLimit,
    listener: &Listener,
    signal: PauseSignal,
    answer: &Answer<'_, R>,
) -> bool
where
    H: Host + ?Sized,
    R: RequestHeaders + ?Sized,
{
    // A pause an attempt began ends with a probe
    // (`sluice_shared::provider::probe`), as one Envoy's retry began does,
    // so that the member's calls do not all go at once when it ends, each
    // retried on the other members beyond their room if it still refuses.
    let why = PauseWhy {
        status: answer.status.unwrap_or(0),
        probe: answer.hearing == Hearing::Attempt,
        ..PauseWhy::default()
    };
    let member_own = listener.limit >= answer.own_from;
    let refused = !matches!(signal, PauseSignal::None);
    if refused {
        ctx.metrics
            .add_limit(&limit.name, LimitCounter::ProviderRefused, 1);
    }
    match signal {
        PauseSignal::None => false,
        PauseSignal::Refused | PauseSignal::Malformed(_) => {
            if let PauseSignal::Malformed(e) = &signal {
                ignored(ctx.host, ctx.metrics, &limit.name, e);
            }
            if member_own {
                pause_member(ctx, limit, why, DEFAULT_RETRY);
            }
            false
        }
        PauseSignal::Pause { wait, capped } => {
            if capped {
                ctx.metrics
                    .add_limit(&limit.name, LimitCounter::PauseCapped, 1);
            }
            pause(ctx, limit, listener.key, why, wait, capped) && relayed(limit)
        }
    }
}

/// The provider's count of what is left, in the answer's headers: the
/// limit follows it until its reset, for every worker.
fn follow_count<H, R>(ctx: &mut Ctx<'_, H>, limit: &CompiledLimit, counted: Counted, headers: &R)
where
    H: Host + ?Sized,
    R: RequestHeaders + ?Sized,
{
    let (host, now) = (ctx.host, ctx.now);
    let Some(provider) = &limit.provider else {
        return;
    };
    match provider.count_in(headers, now) {
        Ok(None) => {}
        Ok(Some(count)) => {
            ctx.metrics
                .add_limit(&limit.name, LimitCounter::CountRead, 1);
            let (entry, _) = place_of_owner(limit, counted.owner);
            // On failure (counted and logged by the store) the
            // next answer brings the count again.
            let _ = ctx
                .store
                .update_as::<ProviderTable, _, _>(ctx.host, &entry, |table| {
                    (
                        (),
                        table.follow(counted.owner, counted.admitted, count, now),
                    )
                });
        }
        Err(e) => ignored(host, ctx.metrics, &limit.name, &e),
    }
}
