//! What a call costs (`cost`): one, a header, a JSON body value, or money
//! at the set's prices, and its checks.

use serde::{Deserialize, Serialize};

use super::bounds;
use super::check::{check_header_name, check_json_path, Report};
use super::prompt::{check_prompt_estimate, PromptEstimate};
use super::rate::{Algorithm, RateSpec};
use crate::price::PriceCost;

#[cfg(feature = "schema")]
use schemars::JsonSchema;
/// Tokens one request takes: a fixed number, read from a request header,
/// or (in `limits` only) read from a field of the request's JSON body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(
    untagged,
    expecting = "a number of tokens, {\"header\": ..., \"default\": ..., \"max\": ...}, {\"json\": ..., \"plus\": ..., \"plus_prompt\": {\"paths\": [...], \"chars_per_token\": ...}, \"default\": ..., \"max\": ...}, \"price\" or {\"price\": {\"output\": ..., \"default_output\": ..., \"prompt\": ..., \"usage\": \"openai\" or \"anthropic\"}}"
)]
pub enum CostSpec {
    Fixed(u64),
    FromHeader(CostFromHeader),
    FromRequestJson(CostFromRequestJson),
    /// Money at the set's `prices` (in `limits` only): the limit's
    /// `rate.requests` is then its budget in millionths of the currency.
    Price(PriceCostSpec),
}

/// `"price"`, or `{"price": {...}}` to set how it is estimated and read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(untagged)]
pub enum PriceCostSpec {
    Word(PriceWord),
    Set(PricedWith),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum PriceWord {
    Price,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct PricedWith {
    pub price: PriceCost,
}

impl PriceCostSpec {
    pub fn cost(&self) -> PriceCost {
        match self {
            PriceCostSpec::Word(_) => PriceCost::default(),
            PriceCostSpec::Set(with) => with.price.clone(),
        }
    }
}

impl Default for CostSpec {
    fn default() -> Self {
        CostSpec::Fixed(1)
    }
}

impl CostSpec {
    pub fn is_default(&self) -> bool {
        *self == CostSpec::Fixed(1)
    }

    /// The largest cost this spec can produce.
    pub fn max_cost(&self) -> u64 {
        match self {
            CostSpec::Fixed(n) => *n,
            CostSpec::FromHeader(h) => h.max.max(h.default),
            CostSpec::FromRequestJson(j) => j.max.max(j.default),
            // Money has no most: the estimate is the most a call can be.
            CostSpec::Price(_) => 0,
        }
    }

    /// Whether the cost is known only once the request's body is read.
    pub fn reads_request_body(&self) -> bool {
        matches!(self, CostSpec::FromRequestJson(_) | CostSpec::Price(_))
    }

    /// Whether the cost is money at the set's prices.
    pub fn is_price(&self) -> bool {
        matches!(self, CostSpec::Price(_))
    }
}

/// A header value that is not a whole number uses `default`; a value above
/// `max` counts as `max`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct CostFromHeader {
    pub header: String,
    #[serde(default = "CostFromHeader::default_cost")]
    pub default: u64,
    pub max: u64,
}

impl CostFromHeader {
    fn default_cost() -> u64 {
        1
    }
}

/// An estimate read from the request's JSON body: the whole number at
/// `json` (a dotted path, `max_tokens`) plus `plus` (a floor for what the
/// call costs beyond it, such as a prompt's framing), plus the prompt's
/// estimated tokens (`plus_prompt`), at most `max`. A JSON body without a
/// whole number at `json` costs `default` (and its prompt); one that is
/// not JSON costs `default`, one too large to read `max`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct CostFromRequestJson {
    pub json: String,
    #[serde(default)]
    pub plus: u64,
    /// Adds the prompt's size, so that a long prompt is admitted against
    /// about what it will cost before it is sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plus_prompt: Option<PromptEstimate>,
    #[serde(default = "CostFromHeader::default_cost")]
    pub default: u64,
    pub max: u64,
}

pub(crate) fn check_cost(r: &mut Report, cost: &CostSpec, rate: Option<&RateSpec>) {
    let capacity = rate.map(RateSpec::capacity);
    let over_capacity = |n: u64| capacity.is_some_and(|c| c >= 1 && n > c);
    let capacity_message = |c: Option<u64>| {
        format!(
            "must be <= {} (the rate's {}), or such a request could never pass",
            c.unwrap_or(0),
            if rate.is_some_and(|r| r.algorithm == Algorithm::TokenBucket) {
                "burst"
            } else {
                "requests per period"
            }
        )
    };
    match cost {
        CostSpec::Fixed(1) => {}
        _ if rate.is_none() => r.at("cost", "applies only to `rate`, and this policy has none"),
        CostSpec::Fixed(0) => r.at("cost", "must be >= 1"),
        CostSpec::Fixed(n) if over_capacity(*n) => r.at("cost", capacity_message(capacity)),
        CostSpec::Fixed(_) => {}
        CostSpec::FromHeader(h) => {
            check_header_name(r, "cost.header", &h.header);
            check_default_and_max(
                r,
                h.default,
                h.max,
                capacity_message(capacity),
                over_capacity,
            );
        }
        CostSpec::Price(spec) => {
            let price = spec.cost();
            check_json_path(r, "cost.price.output", &price.output);
            r.range_u64(
                "cost.price.default_output",
                price.default_output,
                1,
                bounds::MAX_BURST,
            );
            r.range_u64(
                "cost.price.max_output",
                price.max_output,
                price.default_output.max(1),
                bounds::MAX_BURST,
            );
            check_prompt_estimate(r, "cost.price.prompt", &price.prompt);
            check_model_source(r, &price.model);
        }
        CostSpec::FromRequestJson(j) => {
            check_json_path(r, "cost.json", &j.json);
            if j.plus > bounds::MAX_BURST {
                r.at("cost.plus", format!("must be <= {}", bounds::MAX_BURST));
            }
            if let Some(prompt) = &j.plus_prompt {
                check_prompt_estimate(r, "cost.plus_prompt", prompt);
            }
            check_default_and_max(
                r,
                j.default,
                j.max,
                capacity_message(capacity),
                over_capacity,
            );
        }
    }
}

/// Where a call names its model: exactly one of a body field, a header
/// and a path prefix (a segment after it).
pub(crate) fn check_model_source(r: &mut Report, source: &crate::price::ModelSource) {
    const FIELD: &str = "cost.price.model";
    match (&source.json, &source.header, &source.path_after) {
        (Some(path), None, None) => check_json_path(r, &format!("{FIELD}.json"), path),
        (None, Some(header), None) => check_header_name(r, &format!("{FIELD}.header"), header),
        (None, None, Some(prefix)) => {
            if !prefix.starts_with('/') || !prefix.ends_with('/') {
                r.at(
                    &format!("{FIELD}.path_after"),
                    "must start and end with '/': the model is the path's segment right after it",
                );
            } else if prefix.len() > bounds::MAX_PATH_PREFIX_LEN
                || prefix.bytes().any(|b| b <= b' ' || b == 0x7f)
            {
                r.at(
                    &format!("{FIELD}.path_after"),
                    format!(
                        "at most {} characters, no spaces or control characters",
                        bounds::MAX_PATH_PREFIX_LEN
                    ),
                );
            }
        }
        _ => r.at(
            FIELD,
            "give exactly one of `json` (a body field), `header` or `path_after` (the path's segment after it)",
        ),
    }
}

pub(crate) fn check_default_and_max(
    r: &mut Report,
    default: u64,
    max: u64,
    capacity_message: String,
    over_capacity: impl Fn(u64) -> bool,
) {
    if default == 0 {
        r.at("cost.default", "must be >= 1");
    } else if over_capacity(default) {
        r.at("cost.default", capacity_message.clone());
    }
    if max < default.max(1) {
        r.at("cost.max", "must be >= cost.default");
    } else if over_capacity(max) {
        r.at("cost.max", capacity_message);
    }
}
