//! Probing a pool member Envoy's retries steered calls away from
//! (`sluice_shared::provider::ProviderTable::begin_probe` says why): the
//! first call after its pause holds it for one more pause, its own answer
//! opens it to all, and only a failed probe doubles the pause. Every
//! worker reads and writes the member's provider rows in shared data, so
//! one probe goes per Envoy, not one per worker.

use sluice_filter_core::matcher::CompiledLimit;
use sluice_filter_core::matcher::CompiledMember;
use sluice_shared::provider::ProviderTable;
use sluice_shared::request_headers::RequestHeaders;
use sluice_shared::time::{Instant, Span};

use super::ctx::Ctx;
use super::retry::DEFAULT_RETRY;
use crate::entries::{self, provider_key};
use crate::host::{Host, Level};

/// The longest a member is passed over for refusals only Envoy's retry
/// saw (their `Retry-After` never reaches Sluice).
pub(super) const MAX_RETRIED_AWAY_PAUSE: Span = Span::from_secs(30);

/// The limits of a member whose provider rows a probe reads: its own
/// unkeyed rate limits that listen (a keyed one's row is its key's).
fn probed(member: &CompiledMember) -> impl Iterator<Item = &CompiledLimit> {
    member
        .rate_limits()
        .iter()
        .filter(|l| l.provider.is_some() && l.keys.is_none())
}

/// Whether `limit` is paused now, and whether a call to it now would be a
/// probe, from one read of its row.
pub(super) fn paused_or_due<H: Host + ?Sized>(
    host: &H,
    limit: &CompiledLimit,
    now: Instant,
) -> (bool, bool) {
    let Some(provider) = limit.provider.as_ref() else {
        return (false, false);
    };
    let (entry, owner) = provider_key(limit, None);
    let table: ProviderTable = entries::read_as(host, &entry);
    let paused = table.paused_until(owner, now, provider.max_pause).is_some();
    let due = limit.keys.is_none() && table.probe_due(owner, now);
    (paused, due)
}

/// A call goes to `member`, a probe of it due: it is held for the call.
pub(super) fn begin<H: Host + ?Sized>(ctx: &mut Ctx<'_, H>, member: &CompiledMember) {
    let now = ctx.now;
    for limit in probed(member) {
        let (entry, owner) = provider_key(limit, None);
        let began = ctx
            .store
            .update_as::<ProviderTable, _, _>(ctx.host, &entry, |table| {
                let hold = table.begin_probe(owner, now);
                (hold, hold.is_some())
            });
        // A failed write is counted and logged by the store: the call
        // goes unprobed, as it would have before.
        if let Ok(Some(hold)) = began {
            ctx.host.log(
                Level::Info,
                &format!(
                    "sluice: pool member {} probed with one call: limit {} passed over {} ms more unless it answers",
                    member.name,
                    limit.name,
                    hold.as_millis()
                ),
            );
        }
    }
}

/// `member` answered a call sent at `sent` with `headers`: when it served
/// the call (a 1xx, 2xx or 3xx), a probe of it ends ([`end`]).
pub(super) fn end_if_served<H, R>(
    ctx: &mut Ctx<'_, H>,
    member: &CompiledMember,
    sent: Instant,
    headers: &R,
) where
    H: Host + ?Sized,
    R: RequestHeaders + ?Sized,
{
    let served = headers
        .header(":status")
        .is_some_and(|s| s.first().is_some_and(|c| matches!(c, b'1' | b'2' | b'3')));
    if served {
        end(ctx, member, sent);
    }
}

/// `member` answered a call sent at `sent` itself: a probe of it running
/// ends (`ProviderTable::end_probe`), and its calls go as any other's
/// again. Most answers find nothing to change, and write nothing.
pub(super) fn end<H: Host + ?Sized>(ctx: &mut Ctx<'_, H>, member: &CompiledMember, sent: Instant) {
    let now = ctx.now;
    for limit in probed(member) {
        let (entry, owner) = provider_key(limit, None);
        // A failed write is counted and logged by the store: the hold
        // then runs out by itself.
        let _ = ctx
            .store
            .update_as::<ProviderTable, _, _>(ctx.host, &entry, |table| {
                ((), table.end_probe(owner, sent, now))
            });
    }
}

/// How long `limit` is passed over when Envoy retried a call sent to it
/// at `sent` on another member (`ProviderTable::retried_away_wait`).
pub(super) fn retried_away_wait<H: Host + ?Sized>(
    host: &H,
    limit: &CompiledLimit,
    sent: Instant,
) -> Span {
    let (entry, owner) = provider_key(limit, None);
    let table: ProviderTable = entries::read_as(host, &entry);
    table.retried_away_wait(owner, sent, (DEFAULT_RETRY, MAX_RETRIED_AWAY_PAUSE))
}
