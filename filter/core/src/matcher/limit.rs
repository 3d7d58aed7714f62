//! A policy's further limits, compiled: what each takes from a call (its
//! cost, its key), what it reads of the answer, and what it tells.

use sluice_shared::json_path::JsonPath;
use sluice_shared::key_hash::KeySecret;
use sluice_shared::key_view::{name_key, KeyName};
use sluice_shared::limiter::{ConcurrencyLimit, RateLimiter, Standing};
use sluice_shared::policy::downgrade::DowngradeSpec;
use sluice_shared::policy::{
    ConcurrencySpec, CostSpec, KeyLabel, KeyOverflow, NamedLimit, RateSpec, Scope, UsageSpec,
};
use sluice_shared::prompt::PromptTokens;
use sluice_shared::provider::CompiledProvider;
use sluice_shared::request_headers::RequestHeaders;
use sluice_shared::usage::CompiledUsage;
use sluice_shared::warn::WarnLines;

use super::fair::CompiledFair;
use super::request::{cost_header_of, cost_of, KeySecrets, KeySource};
use crate::body::BodyJson;
use crate::pricing::{CallPrice, CompiledPriceCost, Pricing, UNPRICED};

/// A policy's further rate limits, compiled in order, each knowing its
/// parent budget's place among them.
pub(crate) fn compile_limits(limits: &[NamedLimit]) -> Vec<CompiledLimit> {
    let parents = sluice_shared::budget_tree::budget_parents(limits);
    let mut compiled: Vec<CompiledLimit> = Vec::new();
    for (l, parent) in limits.iter().zip(parents) {
        let Some(rate) = &l.rate else { continue };
        let mut limit = CompiledLimit::new(l, rate);
        // A parent is a rate limit listed before: compiled already.
        let parent_name = parent.and_then(|i| limits.get(i)).map(|p| &p.name);
        limit.parent = parent_name.and_then(|name| compiled.iter().position(|c| &c.name == name));
        compiled.push(limit);
    }
    compiled
}

/// One of a policy's further limits, ready to count.
/// A rung's share of its limit, in thousandths (at least 1).
fn permille(share: f64) -> u64 {
    ((share * 1000.0).round() as u64).clamp(1, 1000)
}

#[derive(Debug, Clone)]
pub struct CompiledLimit {
    pub name: String,
    pub rate: RateLimiter,
    cost: CostSpec,
    cost_header: Option<String>,
    /// Where in the request's JSON body the estimate is read.
    cost_json: Option<JsonPath>,
    /// What the request's prompt adds to that estimate.
    cost_prompt: Option<PromptTokens>,
    /// A cost in money at the set's prices.
    price: Option<CompiledPriceCost>,
    /// Its warning lines (`warn_at`).
    pub warn: WarnLines,
    /// Callers are told its figures (`tell_spend`).
    pub tells_spend: bool,
    /// The limit's own `usage` (a money limit's is priced per call).
    usage_spec: Option<UsageSpec>,
    /// Where the real cost is read from the response.
    pub usage: Option<CompiledUsage>,
    /// Held by the admin across restarts ([`sluice_shared::NamedLimit::is_budget`]).
    pub budget: bool,
    /// Held by the admin per key ([`sluice_shared::NamedLimit::is_keyed_budget`]).
    pub keyed_budget: bool,
    /// Its spend is shown in the live view
    /// ([`sluice_shared::NamedLimit::spends_over_hours`]).
    pub spends_over_hours: bool,
    /// Its parent budget among the policy's compiled limits
    /// ([`sluice_shared::budget_tree::budget_parents`]): a keyed budget
    /// under a keyed one records which parent key its keys' calls carry.
    pub parent: Option<usize>,
    /// One limit per value of a request header or body field.
    key: Option<KeySource>,
    /// How the live view names its keys.
    pub key_label: KeyLabel,
    /// With `key`: how many keys hold a place, and what the others do.
    pub keys: Option<(u32, KeyOverflow)>,
    /// `scope: global`: this Envoy applies its share (see
    /// [`CompiledPolicy::apply_limit_share`]); `closed` while the share
    /// allows nothing (before the first).
    pub global: bool,
    pub closed: bool,
    /// What it takes from the provider's answers (`provider`).
    pub provider: Option<CompiledProvider>,
    /// `fair`: who shares its rate, with what weights.
    pub fair: Option<CompiledFair>,
    /// Its downgrade rung (`downgrade`), with its line in thousandths.
    pub downgrade: Option<(u64, DowngradeSpec)>,
    /// Its route rung (`route`): its line in thousandths, and the pool
    /// member past it calls go to.
    pub route: Option<(u64, String)>,
}

impl CompiledLimit {
    /// `limit`, a rate limit of `rate`.
    pub(crate) fn new(l: &NamedLimit, rate: &RateSpec) -> Self {
        Self {
            name: l.name.clone(),
            rate: match &l.queue {
                Some(rung) => RateLimiter::from_spec(rate).paced_past(rung.at),
                None => RateLimiter::from_spec(rate),
            },
            cost: l.cost.clone(),
            cost_header: cost_header_of(&l.cost),
            cost_json: match &l.cost {
                CostSpec::FromRequestJson(j) => JsonPath::parse(&j.json),
                _ => None,
            },
            cost_prompt: match &l.cost {
                CostSpec::FromRequestJson(j) => j.plus_prompt.as_ref().map(PromptTokens::new),
                _ => None,
            },
            price: match &l.cost {
                CostSpec::Price(spec) => Some(CompiledPriceCost::new(spec.cost())),
                _ => None,
            },
            usage_spec: l.usage.clone(),
            warn: WarnLines::new(&l.warn_at),
            tells_spend: l.tell_spend,
            // A money limit reads its usage at each call's prices
            // ([`CompiledPolicy::priced_usage`]); this one says it
            // reads one.
            usage: match &l.cost {
                CostSpec::Price(_) => Some(CompiledUsage::new(
                    l.usage.as_ref().unwrap_or(&UsageSpec::default()),
                    &l.cost,
                )),
                _ => l.usage.as_ref().map(|u| CompiledUsage::new(u, &l.cost)),
            },
            budget: l.is_budget(),
            keyed_budget: l.is_keyed_budget(),
            spends_over_hours: l.spends_over_hours(),
            parent: None,
            key: l.key.as_ref().and_then(KeySource::new),
            key_label: l.key.as_ref().map(|k| k.label).unwrap_or_default(),
            keys: l.key.as_ref().map(|k| (k.max_keys.max(1), k.overflow)),
            global: l.scope == Scope::Global,
            closed: false,
            provider: l
                .provider
                .as_ref()
                .map(|p| CompiledProvider::new(p, &l.name, rate)),
            fair: l
                .fair
                .as_ref()
                .and_then(|f| CompiledFair::new(f, Some(rate), None)),
            downgrade: l.downgrade.as_ref().map(|d| (permille(d.at), d.clone())),
            route: l.route.as_ref().map(|r| (permille(r.at), r.member.clone())),
        }
    }

    /// Whether its take leaves a rung's line (`downgrade`, `route`)
    /// to watch: its standing after the take is wanted.
    /// Whether a refusal standing at `standing` was its queue rung's pace
    /// holding a call of `cost`, not its wall: the window has room for it.
    pub fn held_by_pace(&self, standing: &Standing, cost: u64) -> bool {
        self.rate.is_paced() && standing.spent.saturating_add(cost) <= standing.size
    }

    pub fn has_rungs(&self) -> bool {
        self.downgrade.is_some() || self.route.is_some()
    }

    /// The cheaper model a call of `model` goes to, when it left this
    /// limit at `used` (thousandths of it) at or past its downgrade line.
    pub fn downgrade_to(&self, model: &str, used_permille: u64) -> Option<&str> {
        let (line, spec) = self.downgrade.as_ref()?;
        if used_permille < *line {
            return None;
        }
        spec.target(model).filter(|to| *to != model)
    }

    /// Whether its cost is money at the set's prices.
    pub fn is_priced(&self) -> bool {
        self.price.is_some()
    }

    /// Its cost in money, when it is priced.
    pub(crate) fn price(&self) -> Option<&CompiledPriceCost> {
        self.price.as_ref()
    }

    /// Whether its cost is read from the request's body (a JSON field, or
    /// a model and an estimate for money).
    pub(crate) fn cost_reads_body(&self) -> bool {
        self.cost_json.is_some() || self.price.is_some()
    }

    /// Whether its cost is read from each message of a batch on its own
    /// (a JSON field); money for tool calls is priced for the whole
    /// batch, message by message.
    pub(crate) fn cost_reads_each_message(&self) -> bool {
        self.cost_json.is_some()
    }

    /// Whether its key is a body field this body lacks.
    pub(crate) fn key_unread(&self, body: &BodyJson) -> bool {
        self.key.as_ref().is_some_and(|k| k.unread(body))
    }

    /// The request headers its decision may read: its key's, its cost's,
    /// its fair key's.
    pub(crate) fn decision_headers(&self) -> [Option<&str>; 3] {
        [
            self.key.as_ref().and_then(KeySource::header),
            self.cost_header.as_deref(),
            self.fair.as_ref().and_then(CompiledFair::key_header),
        ]
    }

    /// The hash of the request's key for it (None without `key`), under its
    /// name; with the label secret when it spends over hours (the live
    /// view's, the same on every Envoy), else with this Envoy's own.
    pub(crate) fn key_hash<R: RequestHeaders + ?Sized>(
        &self,
        req: &R,
        secrets: KeySecrets<'_>,
        body: &BodyJson,
    ) -> Option<u64> {
        let value = self.key.as_ref()?.value(req, body);
        let secret = match secrets.label {
            Some(label) if self.spends_over_hours => label,
            _ => secrets.own,
        };
        Some(secret.hash(&self.name, value.as_deref().unwrap_or_default()))
    }

    /// The request's key as the live view names it (None without `key`).
    pub(crate) fn key_name<R: RequestHeaders + ?Sized>(
        &self,
        req: &R,
        secret: &KeySecret,
        body: &BodyJson,
    ) -> Option<KeyName> {
        let value = self.key.as_ref()?.value(req, body);
        Some(name_key(
            secret,
            &self.name,
            value.as_deref().unwrap_or_default(),
            self.key_label,
        ))
    }

    /// What a call of `messages` MCP messages (1 for any other) takes
    /// from it; `body` as far as it was read, `price` the call's (tool
    /// calls': already the sum of their messages').
    pub(crate) fn call_cost<R: RequestHeaders + ?Sized>(
        &self,
        req: &R,
        body: &BodyJson,
        price: Option<&CallPrice>,
        messages: u64,
    ) -> u64 {
        match (price, &self.price) {
            (Some(CallPrice::Tools(total)), Some(_)) => *total,
            _ => self.message_cost(req, body, price).saturating_mul(messages),
        }
    }

    fn message_cost<R: RequestHeaders + ?Sized>(
        &self,
        req: &R,
        body: &BodyJson,
        price: Option<&CallPrice>,
    ) -> u64 {
        match (&self.cost, &self.cost_json) {
            // A body that cannot be read could ask for anything: it is
            // estimated at the most the cost may be, never its default.
            (CostSpec::FromRequestJson(spec), Some(_)) if body.unreadable() => spec.max.max(1),
            (CostSpec::Price(_), _) => self.price.as_ref().map_or(UNPRICED, |p| {
                p.estimate(body, price.and_then(CallPrice::model))
            }),
            (CostSpec::FromRequestJson(spec), Some(path)) => {
                let json = body.json();
                let asked = json.and_then(|v| path.find(v));
                let prompt = match (json, &self.cost_prompt) {
                    (Some(v), Some(prompt)) => prompt.tokens(v),
                    _ => 0,
                };
                asked
                    .map_or(spec.default, |n| n.saturating_add(spec.plus))
                    .saturating_add(prompt)
                    .clamp(1, spec.max.max(1))
            }
            _ => cost_of(&self.cost, self.cost_header.as_deref(), req),
        }
    }

    /// What a call of `price` is charged once its answer is in: a money
    /// limit's usage at the call's model's prices (or its answer's, when
    /// dearer; None for an unpriced call, which was refused, and for tool
    /// calls, charged their price), any other limit's own.
    pub(crate) fn priced_usage(
        &self,
        price: Option<&CallPrice>,
        pricing: Option<&Pricing>,
    ) -> Option<CompiledUsage> {
        match (&self.price, price, pricing) {
            (Some(cost), Some(price), Some(pricing)) => {
                pricing.usage(self.usage_spec.as_ref(), &self.cost, cost, price)
            }
            (Some(_), _, _) => None,
            (None, _, _) => self.usage.clone(),
        }
    }
}

/// One of a policy's further concurrency limits, ready to count.
#[derive(Debug, Clone)]
pub struct CompiledSlotLimit {
    pub name: String,
    pub limit: ConcurrencyLimit,
    /// `fair`: who shares its slots, with what weights.
    pub fair: Option<CompiledFair>,
}

impl CompiledSlotLimit {
    /// `limit`, a concurrency limit of `slots`.
    pub(crate) fn new(l: &NamedLimit, slots: &ConcurrencySpec) -> Self {
        Self {
            name: l.name.clone(),
            limit: ConcurrencyLimit::from_spec(slots),
            fair: l
                .fair
                .as_ref()
                .and_then(|f| CompiledFair::new(f, None, Some(slots))),
        }
    }
}
