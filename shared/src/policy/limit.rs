//! A further limit (`limits`): a named rate or concurrency limit on the
//! calls of every policy naming it, and its checks.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::bounds;
use super::check::{check_name, join_path, Report};
use super::cost::{check_cost, CostSpec};
use super::downgrade::{check_downgrade, DowngradeSpec};
use super::fair::{check_fair_spec, FairSpec, Reservable};
use super::key::{check_key, KeySpec};
use super::provider::{check_provider, ProviderSpec};
use super::queue_rung::QueueRungSpec;
use super::rate::{
    check_concurrency, check_rate, check_rate_splits_into_shares, check_rate_up_to, Algorithm,
    ConcurrencySpec, RateSpec,
};
use super::route::RouteSpec;
use super::usage::{check_price_usage, check_usage, UsageSpec};
use crate::duration::DurationMs;
use crate::warn::check_warn_at;

#[cfg(feature = "schema")]
use schemars::JsonSchema;
/// One more limit of a policy (see [`Policy::limits`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct NamedLimit {
    /// Letters, digits, `-`, `_`, `.`; unique in the policy. Policies that
    /// name the same limit share it and must give it the same `rate`. A
    /// refusal names it in the `x-sluice-limit` header; its stats are
    /// `sluice.limit.<name>.*`.
    pub name: String,
    /// Split this limit into one per value of a request header (tokens per
    /// minute per API key), whatever the policy's own `key`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<KeySpec>,
    /// A rate limit: so many calls (or tokens) per period.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<RateSpec>,
    /// Or a concurrency limit: so many calls in flight at once, for every
    /// policy naming it (Stripe's account-wide concurrency over
    /// per-endpoint policies). One slot per call, held until it ends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<ConcurrencySpec>,
    /// Tokens one call takes from this limit (with `usage`: its estimate).
    #[serde(default, skip_serializing_if = "CostSpec::is_default")]
    pub cost: CostSpec,
    /// The call's real cost, read from its response.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<UsageSpec>,
    /// `global`: one limit for every Envoy syncing with the admin, which
    /// leases each a share (as for a `global` policy), beside the
    /// policy's own limits, which may be per key and per Envoy.
    #[serde(default, skip_serializing_if = "Scope::is_instance")]
    pub scope: Scope,
    /// Listen to the provider this limit mirrors: its `Retry-After` on a
    /// refusal pauses the limit for every worker (and key, where keyed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<ProviderSpec>,
    /// Warning lines, as shares of the limit (`[0.8, 0.95]`): a call that
    /// leaves it past one gets `x-sluice-warn: "<limit>";used=0.81`, and
    /// each crossing is counted (`warn_crossed`) and written to the
    /// admin's audit log once.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warn_at: Vec<f64>,
    /// A money limit's rung before its wall: past `at` (a share of it),
    /// a call naming a dear model is sent for the cheaper one `models`
    /// gives (its body's model rewritten, priced at the new model; the
    /// answer says `x-sluice-downgraded: gpt-4o -> gpt-4o-mini`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub downgrade: Option<DowngradeSpec>,
    /// A pool policy's rung before its wall: past `at` (a share of the
    /// limit), a call goes to the pool member `member` names instead of
    /// the pool's choice (the answer says `x-sluice-routed`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route: Option<RouteSpec>,
    /// A rung before its wall on a fixed window: past `at` (a share of
    /// the limit), the rest of the window is released evenly until it
    /// renews, and a call ahead of that pace waits in the policy's queue
    /// until the pace reaches it or its `max_wait` runs out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<QueueRungSpec>,
    /// Whether callers are told its figures: what is spent of it and its
    /// size (a refusal's `x-sluice-spent` and `x-sluice-budget`, its
    /// quota in `RateLimit-Policy`, its remaining in `RateLimit`, the
    /// share used in `x-sluice-warn`). `false` for a limit every caller
    /// shares whose spend is the company's business, not theirs (an
    /// unkeyed money budget): a refusal then says only that it is spent
    /// and when it renews. Default `true`.
    #[serde(default = "tells_by_default", skip_serializing_if = "is_true")]
    pub tell_spend: bool,
    /// Share this limit's `rate` or `concurrency` fairly between the
    /// values of a key, by weight (as a policy's `fair` shares its own):
    /// tokens per minute or calls in flight divided between tenants.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fair: Option<FairSpec>,
}

impl NamedLimit {
    /// Where a global limit's share is in the fleet's messages: beside the
    /// global policies' (whose names have no `/`).
    pub fn fleet_name(&self) -> String {
        format!("limits/{}", self.name)
    }

    /// A limit this long is a budget: an Envoy syncing with an admin gets
    /// back what it spent of it after a restart, so a restart does not
    /// refill a daily or monthly limit.
    pub const BUDGET_MIN_PERIOD: DurationMs = DurationMs::from_secs(3600);

    /// A keyed limit is not: the admin holds one record per limit.
    pub fn is_budget(&self) -> bool {
        self.spends_over_hours() && self.key.is_none() && self.scope == Scope::Instance
    }

    /// A keyed budget: the admin holds what each key spent, so that a
    /// restart refills no key's day or month either (with a sync token,
    /// which keeps a key's hash the same across restarts).
    pub fn is_keyed_budget(&self) -> bool {
        self.spends_over_hours() && self.key.is_some() && self.scope == Scope::Instance
    }

    /// A rate limit of an hour or longer, keyed or not: the live view shows
    /// what it has spent (per key: the top spenders) against its size.
    pub fn spends_over_hours(&self) -> bool {
        self.rate
            .as_ref()
            .is_some_and(|r| r.period.length() >= Self::BUDGET_MIN_PERIOD)
    }
}

/// Who a policy's limits are for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    /// Every Envoy enforces the whole limit on its own calls.
    #[default]
    Instance,
    /// The limit is for every Envoy syncing with the admin, together: the
    /// admin leases each a share, weighted by the demand it reports
    /// (fleet mode, docs/FLEET.md).
    Global,
}

impl Scope {
    pub const DEFAULT_SHARE_LEASE: DurationMs = DurationMs::from_secs(3);

    pub fn is_instance(&self) -> bool {
        *self == Scope::Instance
    }
}

/// Limits under `field` (a policy's `limits`, a pool member's).
pub(crate) fn check_named_limits(r: &mut Report, field: &str, limits: &[NamedLimit]) {
    if limits.is_empty() {
        return;
    }
    if limits.len() > bounds::MAX_LIMITS {
        r.at(field, format!("at most {} limits", bounds::MAX_LIMITS));
    }
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for (index, limit) in limits.iter().enumerate() {
        let mut lr = Report::new(
            r.errors,
            &join_path(&r.prefix, &format!("{field}[{index}]")),
        );
        check_name(&mut lr, &limit.name);
        if let Some(key) = &limit.key {
            check_key(&mut lr, key);
        }
        match (&limit.rate, &limit.concurrency) {
            (Some(rate), None) => check_rate_limit(&mut lr, limit, rate),
            (None, Some(conc)) => {
                check_slot_limit(&mut lr, limit, conc);
                if let Some(fair) = &limit.fair {
                    check_limit_fair(&mut lr, limit, fair);
                }
            }
            (Some(_), Some(_)) => lr.at(
                "concurrency",
                "a limit is a `rate` or a `concurrency`, not both: make them two limits",
            ),
            (None, None) => lr.at(
                "rate",
                "missing field: a limit needs `rate` or `concurrency`",
            ),
        }
        if let Some(first) = seen.insert(&limit.name, index) {
            lr.at(
                "name",
                format!(
                    "duplicate name {:?}, already used by limits[{first}]",
                    limit.name
                ),
            );
        }
    }
}

/// A further rate limit: its rate, its cost, and what `scope: global`
/// can split into shares.
pub(crate) fn check_rate_limit(lr: &mut Report, limit: &NamedLimit, rate: &RateSpec) {
    if limit.cost.is_price() {
        check_rate_up_to(lr, rate, bounds::MAX_MONEY_BUDGET);
        if rate.algorithm == Algorithm::TokenBucket {
            lr.at(
                "rate.algorithm",
                "a budget in money is counted per period: fixed_window or sliding_window",
            );
        }
    } else {
        check_rate(lr, rate);
    }
    if limit.scope == Scope::Global {
        if limit.key.is_some() {
            lr.at(
                "key",
                "a `scope: global` limit cannot be per key: its shares are per Envoy",
            );
        }
        check_rate_splits_into_shares(lr, rate, "limit");
    }
    check_cost(lr, &limit.cost, Some(rate));
    check_warn_at(lr, &limit.warn_at);
    if let Some(downgrade) = &limit.downgrade {
        let model = match &limit.cost {
            CostSpec::Price(spec) => Some(&spec.cost().model),
            _ => None,
        };
        check_downgrade(lr, downgrade, limit.cost.is_price(), model);
    }
    match &limit.usage {
        Some(usage) if limit.cost.is_price() => check_price_usage(lr, usage),
        Some(usage) => check_usage(lr, usage),
        None => {}
    }
    if let Some(provider) = &limit.provider {
        check_provider(lr, provider);
    }
    if let Some(fair) = &limit.fair {
        check_limit_fair(lr, limit, fair);
    }
}

/// A further concurrency limit: one slot per call, for every policy
/// naming it, on this Envoy. What it would mean per key, per fleet or with
/// a cost is refused here rather than enforced as something else.
pub(crate) fn check_slot_limit(lr: &mut Report, limit: &NamedLimit, conc: &ConcurrencySpec) {
    if conc.reserved_for_high > 0 {
        lr.at(
            "concurrency.reserved_for_high",
            "the priority lane is the policy's own `concurrency`'s; a concurrency limit in `limits` has none",
        );
    }
    let without_lane = ConcurrencySpec {
        reserved_for_high: 0,
        ..conc.clone()
    };
    check_concurrency(lr, &without_lane, false);
    if limit.downgrade.is_some() {
        lr.at(
            "downgrade",
            "a downgrade steps a budget in money down to cheaper models: a concurrency limit has none",
        );
    }
    if !limit.warn_at.is_empty() {
        lr.at(
            "warn_at",
            "warning lines are for a `rate` limit: a concurrency limit has no share used",
        );
    }
    if limit.key.is_some() {
        lr.at(
            "key",
            "a concurrency limit in `limits` is for every call of the policies naming it; for calls in flight per key use the policy's own `concurrency` with its `key`",
        );
    }
    if limit.scope == Scope::Global {
        lr.at(
            "scope",
            "a concurrency limit in `limits` is per Envoy; for calls in flight across the fleet use a `scope: global` policy's own `concurrency`",
        );
    }
    if !CostSpec::is_default(&limit.cost) {
        lr.at(
            "cost",
            "a concurrency limit takes one slot per call: no `cost`",
        );
    }
    if limit.usage.is_some() {
        lr.at(
            "usage",
            "a concurrency limit takes one slot per call: no `usage`",
        );
    }
    if limit.provider.is_some() {
        lr.at(
            "provider",
            "a provider's pauses and counts are for rate limits: put `provider` on the rate limit it mirrors",
        );
    }
}

/// A further limit's `fair`: its own `rate` or `concurrency` shared by
/// weight (a global rate across the fleet, by weights only; not beside a
/// per-key split).
pub(crate) fn check_limit_fair(lr: &mut Report, limit: &NamedLimit, fair: &FairSpec) {
    let mut fr = Report::new(lr.errors, &join_path(&lr.prefix, "fair"));
    check_key(&mut fr, &fair.key);
    let rate = match (&limit.rate, &limit.concurrency) {
        (Some(rate), _) => rate,
        (None, Some(slots)) => {
            // Its `key`, `scope` and `cost` are refused as any concurrency
            // limit's are.
            check_fair_spec(&mut fr, fair, Some(Reservable::slots(slots)));
            return;
        }
        (None, None) => return,
    };
    if limit.key.is_some() {
        fr.at(
            "",
            "a limit with `key` has a bucket per key already: share its rate fairly with `fair`, or split it with `key`, not both",
        );
    }
    if limit.scope == Scope::Global && !fair.min.is_empty() {
        fr.at(
            "min",
            "reservations are kept by each Envoy's table: not with `scope: global` (weights are weighed across the fleet)",
        );
    }
    if limit.cost.is_price() {
        fr.at(
            "",
            "a budget in money is not shared fairly: give it a `key`",
        );
    }
    check_fair_spec(&mut fr, fair, Some(Reservable::rate(rate)));
}

fn tells_by_default() -> bool {
    true
}

fn is_true(b: &bool) -> bool {
    *b
}
