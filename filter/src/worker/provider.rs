//! What the provider says, for the limits that listen (`provider`): its
//! `Retry-After` on a refusal pauses the limit (for a keyed limit: that
//! key), and its count of what is left caps what goes until its reset,
//! for every worker, through one shared-data entry per limit (per group
//! of keys; [`ProviderTable`]). A call reads the entry before the limit
//! is taken and, when the count is followed, counts itself in it once
//! every limit took it.

use sluice_filter_core::matcher::{CompiledLimit, CompiledPolicySet};
use sluice_shared::provider::{Allowed, Heard, PauseWhy, ProviderTable, Throttle};
use sluice_shared::time::{Instant, Span};

use sluice_wire::sync::{PauseReport, ProviderNews, ProviderReport, MAX_PROVIDER_NEWS};

use super::ctx::Ctx;
use crate::counters::LimitCounters;
use crate::entries::{self, provider_key};
use crate::host::{Host, Level};
use crate::metrics::{FilterCounter, LimitCounter, Metrics};
use crate::store::StoreError;

/// How long `limit` stays paused for a call with key `key` (None: it is
/// not paused). A missing or broken entry pauses nothing.
pub(super) fn paused<H: Host + ?Sized>(
    host: &H,
    limit: &CompiledLimit,
    key: Option<u64>,
    now: Instant,
) -> Option<Span> {
    let provider = limit.provider.as_ref()?;
    let (entry, owner) = provider_key(limit, key);
    let table: ProviderTable = entries::read_as(host, &entry);
    table
        .paused_until(owner, now, provider.max_pause)
        .map(|until| until.since(now))
}

/// A call's place in its limit's provider count: the row, the row's
/// count with the call in it, and when it went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counted {
    pub owner: u64,
    pub admitted: u64,
    pub sent: Instant,
}

/// What the provider's count says of a call costing `cost` on `limit`.
pub(super) enum CountSays {
    /// The limit does not follow a count.
    NotFollowed,
    Counted(Counted),
    /// Nothing left until the provider's reset, `wait` from now.
    Exhausted {
        wait: Span,
    },
}

/// Counts a call in the provider's count of `limit`, if it follows one.
pub(super) fn count<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    limit: &CompiledLimit,
    key: Option<u64>,
    cost: u64,
) -> Result<CountSays, StoreError> {
    let now = ctx.now;
    let Some(provider) = limit.provider.as_ref().filter(|p| p.counts_calls()) else {
        return Ok(CountSays::NotFollowed);
    };
    let (entry, owner) = provider_key(limit, key);
    ctx.store
        .update_as::<ProviderTable, _, _>(ctx.host, &entry, |table| {
            match table.admit(owner, now, cost, provider.adaptive_limit()) {
                Allowed::Yes { admitted } => (
                    CountSays::Counted(Counted {
                        owner,
                        admitted,
                        sent: now,
                    }),
                    true,
                ),
                Allowed::No { until } => (
                    CountSays::Exhausted {
                        wait: until.since(now),
                    },
                    false,
                ),
            }
        })
}

/// A counted call did not go after all: its tokens go back.
pub(super) fn uncount<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    limit: &CompiledLimit,
    counted: Counted,
    cost: u64,
) {
    let now = ctx.now;
    let (entry, _) = place_of_owner(limit, counted.owner);
    // On failure (counted and logged by the store) the tokens stay
    // counted: the provider's count errs on the safe side.
    let _ = ctx
        .store
        .update_as::<ProviderTable, _, _>(ctx.host, &entry, |table| {
            let before = table.clone();
            table.give_back(counted.owner, counted.admitted, cost, now);
            ((), *table != before)
        });
}

/// The entry of a row known by its owner (the key's hash, or 0).
pub(super) fn place_of_owner(limit: &CompiledLimit, owner: u64) -> (String, u64) {
    provider_key(limit, limit.keys.is_some().then_some(owner))
}

/// Where a call counts in the provider's count its limit follows, and
/// what it was counted there: settled when its usage is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Followed {
    entry: String,
    counted: Counted,
    cost: u64,
}

impl Followed {
    pub(super) fn new(limit: &CompiledLimit, counted: Counted, cost: u64) -> Self {
        Self {
            entry: place_of_owner(limit, counted.owner).0,
            counted,
            cost,
        }
    }

    /// The call used `used` tokens: the provider's count Sluice keeps
    /// holds that, not the estimate it was counted.
    pub(super) fn settle<H: Host + ?Sized>(&self, ctx: &mut Ctx<'_, H>, used: u64) {
        let now = ctx.now;
        let counted = self.counted;
        // On failure (counted and logged by the store) the estimate
        // stays counted.
        let _ = ctx
            .store
            .update_as::<ProviderTable, _, _>(ctx.host, &self.entry, |table| {
                let changed = table.settle(
                    counted.owner,
                    counted.admitted,
                    counted.sent,
                    self.cost,
                    used,
                    now,
                );
                ((), changed)
            });
    }
}

/// A provider refused a call of adaptive `limit` (`owner`: the row;
/// `heard`: this Envoy's call or another's, at `at`): its rate is cut
/// (once per overload), for every worker. Returns whether it was.
pub(super) fn cut_rate<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    limit: &CompiledLimit,
    owner: u64,
    heard: Heard,
    at: Instant,
    throttle: Throttle,
) -> bool {
    let (host, now) = (ctx.host, ctx.now);
    let full = throttle.full;
    let (entry, _) = place_of_owner(limit, owner);
    let cut = ctx
        .store
        .update_as::<ProviderTable, _, _>(ctx.host, &entry, |table| {
            let before = table.row(owner).map(|r| r.adaptive);
            let cut = table.throttled(owner, heard, at, now, throttle);
            let after = table.row(owner).map(|r| r.adaptive);
            let rate = after.and_then(|a| a.rate(now, full));
            // A refusal of the overload already cut for cuts nothing, but
            // may narrow what is known of the limit: that is kept too.
            ((cut, rate), cut || after != before)
        });
    let Ok((true, rate)) = cut else {
        return false;
    };
    ctx.metrics.add_limit(&limit.name, LimitCounter::RateCut, 1);
    let whose = match heard {
        Heard::Here { .. } => "the provider refused a call",
        Heard::Relayed => "another Envoy's provider refused a call (relayed by the admin)",
    };
    host.log(
        Level::Info,
        &format!(
            "sluice: limit {}: {whose}; rate cut to {:.1}/s (of {full:.1}/s)",
            limit.name,
            rate.unwrap_or(full)
        ),
    );
    true
}

/// A provider signal that did not parse: counted, logged at debug level
/// (a provider sending garbage on every answer must not flood the log).
pub(super) fn ignored<H: Host + ?Sized>(
    host: &H,
    metrics: &mut Metrics,
    limit: &str,
    error: &sluice_shared::provider::SignalError,
) {
    metrics.add_limit(limit, LimitCounter::SignalMalformed, 1);
    host.log(
        Level::Debug,
        &format!("sluice: limit {limit}: provider signal ignored: {error}"),
    );
}

/// Writes a pause of `wait` from `now` into the limit's entry, for every
/// worker to read, with a log line when it begins or grows one and the
/// stat `paused` when it begins one (`why`: the provider's answer, and
/// whether another Envoy heard it; `capped`: the provider asked for more
/// than `max_pause`). Returns whether it began or grew one.
pub(super) fn pause<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    limit: &CompiledLimit,
    key: Option<u64>,
    why: PauseWhy,
    wait: Span,
    capped: bool,
) -> bool {
    let (host, now) = (ctx.host, ctx.now);
    let (entry, owner) = provider_key(limit, key);
    let max_pause = limit.provider.as_ref().map_or(wait, |p| p.max_pause);
    // Relayed news: the admin relays a running pause at every sync, each
    // time a little off (the trip there and back): the same pause, within
    // RELAY_SLACK. However often it is relayed, news holds the limit for
    // max_pause in total until this Envoy's own provider refuses
    // (RelayedStretch).
    let began = ctx
        .store
        .update_as::<ProviderTable, _, _>(ctx.host, &entry, |table| {
            let (changed, began) = table.hear_pause(owner, now, wait, why, max_pause, RELAY_SLACK);
            (began, changed)
        });
    // A failed write is counted and logged by the store: no pause then.
    let Ok(Some(set)) = began else {
        return false;
    };
    // Counted once a pause: relayed news arrives again at every sync, a
    // trip that took longer moving its end later (a loaded machine's
    // sync answer half a second late grew one by more than RELAY_SLACK,
    // and `paused` said 2 for one pause).
    if set.began {
        ctx.metrics.add_limit(&limit.name, LimitCounter::Paused, 1);
    }
    let what = if set.began {
        "paused"
    } else {
        "pause extended"
    };
    let whose = if key.is_some() { " for this key" } else { "" };
    let cap = if capped { " (cut to max_pause)" } else { "" };
    let status = match why.status {
        0 => "?".to_string(),
        s => s.to_string(),
    };
    let heard = if why.relayed {
        format!("another Envoy's provider answered {status} with a wait (relayed by the admin)")
    } else if why.status == 0 {
        "Envoy retried a call it refused on another pool member".to_string()
    } else {
        format!("the provider answered {status} with a wait")
    };
    // A warning: the provider is refusing calls, which an operator wants
    // to see at Envoy's usual log level.
    host.log(
        Level::Warn,
        &format!(
            "sluice: limit {} {what}{whose} for {} ms{cap}: {heard}",
            limit.name,
            set.until.since(now).as_millis(),
        ),
    );
    true
}

/// A pool member's limit whose provider refused a call without saying how
/// long to wait (`wait`: `DEFAULT_RETRY`, as a provider that names none
/// is given), or whose refusal only Envoy's retry saw (`status` 0): the
/// pool passes the member over meanwhile, so that calls go to the others
/// (`why.probe`: an attempt's refusal, the pause ends with a probe).
pub(super) fn pause_member<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    limit: &CompiledLimit,
    why: PauseWhy,
    wait: Span,
) -> bool {
    if limit.provider.is_none() {
        return false;
    }
    pause(ctx, limit, None, why, wait, false)
}

/// Whether what `limit`'s provider says is relayed to and from the other
/// Envoys: a limit they share (`scope: global`), unkeyed (keys are hashed
/// with a secret of each Envoy and never leave it).
pub(super) fn relayed(limit: &CompiledLimit) -> bool {
    limit.global && limit.keys.is_none() && limit.provider.is_some()
}

/// What `limit`'s provider said, for the report to the admin
/// (`counters`: the limit's since the Envoy started). None for a limit
/// that does not listen.
pub(super) fn report<H: Host + ?Sized>(
    host: &H,
    limit: &CompiledLimit,
    counters: &LimitCounters,
    now: Instant,
) -> Option<ProviderReport> {
    let provider = limit.provider.as_ref()?;
    let mut report = ProviderReport {
        counts: counters.provider,
        ..ProviderReport::default()
    };
    if limit.keys.is_none() {
        let (entry, owner) = provider_key(limit, None);
        let table: ProviderTable = entries::read_as(host, &entry);
        let state = table.state(owner, now, provider.max_pause, provider.adaptive);
        report.remaining = state.remaining;
        report.limit = state.provider_limit;
        // A probe's hold is no provider's word: the other Envoys would
        // wait it out without probing.
        report.pause = state
            .paused
            .filter(|(_, _, why)| !why.hold)
            .map(|(since, until, why)| PauseReport {
                ran_ms: now.since(since).as_millis(),
                left_ms: until.since(now).as_millis(),
                status: why.status,
                relayed: why.relayed,
            });
        report.rate = state.rate;
        report.cut_ago_ms = state.cut_at.map(|at| now.since(at).as_millis());
    }
    Some(report)
}

/// A relayed pause ending no more than this after the one running is
/// the same pause: each relay of it is off by the trips to and from the
/// admin, which on a loaded machine vary by more than 100 ms; a provider's
/// own waits come in whole seconds, so a real new pause ends later.
const RELAY_SLACK: Span = Span::from_millis(500);

/// The admin relayed what other Envoys' providers said: each pause still
/// running and each recent rate cut of a limit they share is taken as if
/// this Envoy had seen it (`delay`: how long ago the admin answered).
/// A header that is no news is counted and logged, and changes nothing.
pub(super) fn take_news<H: Host + ?Sized>(
    ctx: &mut Ctx<'_, H>,
    policies: &CompiledPolicySet,
    news: Result<ProviderNews, String>,
    delay: Span,
) {
    let (host, now) = (ctx.host, ctx.now);
    let news: ProviderNews = match news {
        Ok(news) => news,
        Err(why) => {
            ctx.metrics
                .add_filter(FilterCounter::ProviderNewsMalformed, 1);
            host.log(
                Level::Warn,
                &format!("sluice: the admin's provider news was ignored: {why}"),
            );
            return;
        }
    };
    for (name, item) in news.iter().take(MAX_PROVIDER_NEWS) {
        let Some(limit) = policies
            .all()
            .flat_map(|p| p.limits.iter())
            .find(|l| &l.name == name && relayed(l))
        else {
            continue;
        };
        let Some(provider) = &limit.provider else {
            continue;
        };
        if let Some(ms) = item.pause_ms {
            let wait = (Span::from_millis(ms) - delay).min(provider.max_pause);
            if !wait.is_zero() {
                let why = PauseWhy {
                    status: item.status,
                    relayed: true,
                    ..PauseWhy::default()
                };
                pause(ctx, limit, None, why, wait, false);
            }
        }
        if let (Some(ago), Some(full)) = (item.cut_ago_ms, provider.adaptive) {
            let at = now - (Span::from_millis(ago) + delay);
            cut_rate(ctx, limit, 0, Heard::Relayed, at, Throttle::plain(full));
        }
    }
}

/// What the provider allows of unkeyed `limit` now, and until when: 0
/// while it is paused, the provider's count while one is in force (None:
/// it says nothing, or the limit is keyed).
pub(super) fn says<H: Host + ?Sized>(
    host: &H,
    limit: &CompiledLimit,
    now: Instant,
) -> Option<(u64, Span)> {
    let provider = limit.provider.as_ref()?;
    if limit.keys.is_some() {
        return None;
    }
    let (entry, owner) = provider_key(limit, None);
    let table: ProviderTable = entries::read_as(host, &entry);
    let state = table.state(owner, now, provider.max_pause, None);
    if let Some((_, until, _)) = state.paused {
        return Some((0, until.since(now)));
    }
    Some((state.remaining?, state.count_until?.since(now)))
}
