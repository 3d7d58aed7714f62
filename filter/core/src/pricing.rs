//! What a call of a policy with money limits costs before its answer is
//! in: the model it names (its body's `model`, a header, or a segment of
//! its path), each money limit's estimate (its prompt and the output it
//! asks for, once per choice it asks for), and the ceiling it is charged
//! when its answer cannot be read. What the answer then costs is read by
//! `sluice_shared::usage` (at the dearer of the call's model and the
//! answer's).

use std::sync::Arc;

use serde_json::Value;
use sluice_shared::json_path::JsonPath;
use sluice_shared::price::{self, CompiledPrices, ModelPrice, ModelSource, PriceCost};
use sluice_shared::prompt::PromptTokens;
use sluice_shared::request_headers::RequestHeaders;
use sluice_shared::usage::{CompiledUsage, Priced};

use crate::body::BodyJson;
use crate::mcp::McpMatcher;

/// The estimate of a money limit's call whose model has no price (and
/// the table no default): refused, never free.
pub const UNPRICED: u64 = u64::MAX;

/// The most of a request body read (the filter's bound): a body too large
/// to read is estimated as a prompt of at least this many characters.
const READ_BODY_BOUND: u64 = 1024 * 1024;

/// The most choices a call is taken to ask for (OpenAI's bound on `n`),
/// and what a body that cannot be read is taken to ask for when its
/// answer cannot be read either.
pub const MAX_CHOICES: u64 = 128;

/// A money limit, ready to estimate and price calls.
#[derive(Debug, Clone)]
pub struct CompiledPriceCost {
    spec: PriceCost,
    output: Option<JsonPath>,
    prompt: PromptTokens,
}

impl CompiledPriceCost {
    pub fn new(spec: PriceCost) -> Self {
        Self {
            output: JsonPath::parse(&spec.output),
            prompt: PromptTokens::new(&spec.prompt),
            spec,
        }
    }

    pub fn spec(&self) -> &PriceCost {
        &self.spec
    }

    /// The call's estimate in micro-units at `price`: its prompt at the
    /// input price and the output it asks for (or the default), once per
    /// choice, at the output price; [`UNPRICED`] without a price.
    pub fn estimate(&self, body: &BodyJson, price: Option<&ModelPrice>) -> u64 {
        let Some(price) = price else {
            return UNPRICED;
        };
        let (prompt, output) = match body {
            BodyJson::Json(v) => (
                self.prompt.tokens(v),
                self.asked(v)
                    .unwrap_or(self.spec.default_output)
                    .saturating_mul(choices(v)),
            ),
            // Unread: a prompt of at least all that could be read.
            BodyJson::TooLarge | BodyJson::Invalid | BodyJson::Duplicate(_) => (
                self.prompt.tokens_of_chars(READ_BODY_BOUND),
                self.spec.default_output,
            ),
            BodyJson::Coming | BodyJson::Absent => (0, self.spec.default_output),
        };
        charge(price, prompt, output)
    }

    /// What the call is charged when its usage cannot be read: its
    /// prompt's estimate and, per choice, the output it asked for or
    /// `max_output`; a body that could not be read, as large a prompt as
    /// could be read and `max_output` for as many choices as may be asked.
    pub fn ceiling(&self, body: &BodyJson, price: &ModelPrice) -> u64 {
        let (prompt, output) = match body {
            BodyJson::Json(v) => (
                self.prompt.tokens(v),
                self.asked(v)
                    .unwrap_or(self.spec.max_output)
                    .saturating_mul(choices(v)),
            ),
            BodyJson::TooLarge | BodyJson::Invalid | BodyJson::Duplicate(_) => (
                self.prompt.tokens_of_chars(READ_BODY_BOUND),
                self.spec.max_output.saturating_mul(MAX_CHOICES),
            ),
            BodyJson::Coming | BodyJson::Absent => (0, self.spec.max_output),
        };
        charge(price, prompt, output)
    }

    /// The output tokens per choice the body asks for.
    fn asked(&self, v: &Value) -> Option<u64> {
        self.output.as_ref().and_then(|p| p.find(v))
    }
}

fn charge(price: &ModelPrice, prompt: u64, output: u64) -> u64 {
    price::cost_of(prompt, price.input)
        .saturating_add(price::cost_of(output, price.output))
        .max(1)
}

/// The answers a call asks for: OpenAI's `n` (choices) and `best_of`
/// (completions made to pick from, each billed), at least one, at most
/// [`MAX_CHOICES`]. A field that is not a whole number counts as not
/// there (the provider refuses such a call).
fn choices(v: &Value) -> u64 {
    let field = |name: &str| v.get(name).and_then(Value::as_u64).unwrap_or(1);
    field("n").max(field("best_of")).clamp(1, MAX_CHOICES)
}

/// Where a call's model is read.
#[derive(Debug, Clone)]
enum ModelFrom {
    Json(JsonPath),
    /// Lower case.
    Header(String),
    PathAfter(String),
}

impl ModelFrom {
    fn new(source: &ModelSource) -> Option<Self> {
        match (&source.json, &source.header, &source.path_after) {
            (Some(path), _, _) => JsonPath::parse(path).map(Self::Json),
            (None, Some(header), _) => Some(Self::Header(header.to_ascii_lowercase())),
            (None, None, Some(prefix)) => Some(Self::PathAfter(prefix.clone())),
            (None, None, None) => None,
        }
    }

    /// The model the call names (None: it names none).
    fn read<R: RequestHeaders + ?Sized>(&self, req: &R, body: &BodyJson) -> Option<String> {
        match self {
            Self::Json(path) => path.text_in(body.json()?).map(|m| m.into_owned()),
            Self::Header(name) => {
                let value = req.header(name)?;
                std::str::from_utf8(value.trim_ascii())
                    .ok()
                    .map(str::to_string)
            }
            Self::PathAfter(prefix) => {
                let path = req.header(":path")?;
                let rest = path.strip_prefix(prefix.as_bytes())?;
                let end = rest
                    .iter()
                    .position(|b| matches!(b, b'/' | b'?' | b'#'))
                    .unwrap_or(rest.len());
                let segment = std::str::from_utf8(rest.get(..end)?).ok()?;
                (!segment.is_empty()).then(|| segment.to_string())
            }
        }
    }
}

/// A policy's money: the set's prices and where its calls name their
/// model (its money limits agree on it, validation sees to that).
#[derive(Debug, Clone)]
pub struct Pricing {
    pub prices: Arc<CompiledPrices>,
    model: Option<ModelFrom>,
}

/// A call's prices, read once as it is decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallPrice {
    /// A model's call: its model's prices, and the most any of its money
    /// limits charges it when its answer cannot be read.
    Tokens {
        model: ModelPrice,
        unread_ceiling: u64,
    },
    /// MCP tool calls (one, or a batch's): what they cost together, in
    /// micro-units, known before the call and charged as it is.
    Tools(u64),
}

impl CallPrice {
    /// The model's prices of a model's call.
    pub fn model(&self) -> Option<&ModelPrice> {
        match self {
            Self::Tokens { model, .. } => Some(model),
            Self::Tools(_) => None,
        }
    }
}

impl Pricing {
    pub fn new(prices: Arc<CompiledPrices>, source: &ModelSource) -> Self {
        Self {
            prices,
            model: ModelFrom::new(source),
        }
    }

    /// The model the call names, as its prices are found (None: none).
    pub fn model_named<R: RequestHeaders + ?Sized>(
        &self,
        req: &R,
        body: &BodyJson,
    ) -> Option<String> {
        self.model.as_ref()?.read(req, body)
    }

    /// Where in the JSON body the call names its model (None: it is read
    /// from a header or the path).
    pub fn model_json(&self) -> Option<&JsonPath> {
        match self.model.as_ref()? {
            ModelFrom::Json(path) => Some(path),
            ModelFrom::Header(_) | ModelFrom::PathAfter(_) => None,
        }
    }

    /// The call's prices under the money limits `limits` (None: its model
    /// has no price, and the table no default).
    pub fn call_price<'a, R: RequestHeaders + ?Sized>(
        &self,
        req: &R,
        body: &BodyJson,
        limits: impl Iterator<Item = &'a CompiledPriceCost>,
    ) -> Option<CallPrice> {
        let named = self.model.as_ref().and_then(|m| m.read(req, body));
        let model = *self.prices.of(named.as_deref())?;
        let unread_ceiling = limits.map(|l| l.ceiling(body, &model)).max().unwrap_or(0);
        Some(CallPrice::Tokens {
            model,
            unread_ceiling,
        })
    }

    /// The price of the MCP messages `mcp` counts in `body`, each at its
    /// tool's price (a message that calls no tool: `tool_default`); a
    /// body that cannot be read, at the dearest price a message could
    /// have (fail closed). None when one has no price.
    pub fn tools_price(&self, mcp: &McpMatcher, body: &BodyJson) -> Option<CallPrice> {
        let total = match body.json() {
            Some(json) => mcp.counted_tools(json).try_fold(0u64, |sum, tool| {
                Some(sum.saturating_add(self.prices.of_tool(tool)?.micros()))
            })?,
            None => self.prices.dearest_tool()?.micros(),
        };
        Some(CallPrice::Tools(total.max(1)))
    }

    /// How a money limit (`usage`: its own settings) reads a call's answer
    /// at `call`'s prices, and at the answer's model's when dearer; None
    /// for tool calls, charged their price.
    pub fn usage(
        &self,
        usage: Option<&sluice_shared::policy::UsageSpec>,
        cost: &sluice_shared::policy::CostSpec,
        limit: &CompiledPriceCost,
        call: &CallPrice,
    ) -> Option<CompiledUsage> {
        let CallPrice::Tokens {
            model,
            unread_ceiling,
        } = call
        else {
            // A tool call's price is known before it is made: nothing
            // of its answer is read.
            return None;
        };
        Some(CompiledUsage::priced(
            usage,
            cost,
            Priced {
                format: limit.spec.usage,
                price: model,
                prices: Some(&self.prices),
                unread_ceiling: Some(*unread_ceiling),
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;
    use sluice_shared::price::Money;

    use super::*;

    fn gpt4o() -> ModelPrice {
        ModelPrice {
            input: Money::parse("2.5").unwrap_or_default(),
            output: Money::parse("10").unwrap_or_default(),
            cached_input: None,
        }
    }

    /// Item 2 of the third review: `n` and `best_of` multiply the output
    /// a call asks for; text under any field counts towards its prompt.
    #[test]
    fn the_estimate_counts_every_choice_and_every_string() {
        let cost = CompiledPriceCost::new(PriceCost::default());
        let one = BodyJson::Json(json!({"model": "gpt-4o", "max_tokens": 1000}));
        let many = BodyJson::Json(json!({"model": "gpt-4o", "max_tokens": 1000, "n": 128}));
        let best =
            BodyJson::Json(json!({"model": "gpt-4o", "max_tokens": 1000, "n": 2, "best_of": 5}));
        let price = gpt4o();
        let at = |b: &BodyJson| cost.estimate(b, Some(&price));
        // 1 000 output tokens at 10 a million: 10 000 micro-units, and
        // the prompt ("gpt-4o": 2 tokens at 2.5).
        assert_eq!(at(&one), 10_000 + 5);
        assert_eq!(at(&many), 128 * 10_000 + 5);
        assert_eq!(at(&best), 5 * 10_000 + 5);
        let huge_n = BodyJson::Json(json!({"max_tokens": 1000, "n": 1_000_000}));
        assert_eq!(at(&huge_n), MAX_CHOICES * 10_000, "at most 128 choices");
        // 4 000 characters under `tools` are 1 000 prompt tokens.
        let tools =
            BodyJson::Json(json!({"max_tokens": 1, "tools": [{"description": "x".repeat(4000)}]}));
        assert_eq!(at(&tools), 2_500 + 10);
    }

    /// Unread usage is charged a ceiling: the output asked for, or
    /// `max_output`, per choice; never the estimate alone.
    #[test]
    fn the_ceiling_is_the_most_output_per_choice() {
        let cost = CompiledPriceCost::new(PriceCost::default());
        let price = gpt4o();
        let asked = BodyJson::Json(json!({"max_tokens": 100, "n": 3}));
        assert_eq!(cost.ceiling(&asked, &price), 3 * 1_000);
        let unsaid = BodyJson::Json(json!({"messages": []}));
        assert_eq!(cost.ceiling(&unsaid, &price), 327_680);
        assert!(cost.ceiling(&unsaid, &price) > cost.estimate(&unsaid, Some(&price)));
        assert!(cost.ceiling(&BodyJson::TooLarge, &price) >= MAX_CHOICES * 327_680);
    }

    fn pricing(source: ModelSource) -> Pricing {
        let table = sluice_shared::price::PriceTable {
            currency: "USD".into(),
            models: [("gpt-4o".to_string(), gpt4o())].into_iter().collect(),
            default: None,
            tools: Default::default(),
            tool_default: None,
        };
        Pricing::new(Arc::new(CompiledPrices::new(&table)), &source)
    }

    /// Item 7: a policy names where its model comes from; a deployment
    /// URL's segment cannot be changed by the body.
    #[test]
    fn the_model_comes_from_the_body_a_header_or_the_path() {
        let cost = CompiledPriceCost::new(PriceCost::default());
        let body = BodyJson::Json(json!({"model": "gpt-4o-mini"}));
        let req: &[(&str, &[u8])] = &[
            (
                ":path",
                b"/openai/deployments/gpt-4o/chat/completions?api-version=1",
            ),
            ("x-model", b"gpt-4o"),
        ];
        let by_body = pricing(ModelSource::default());
        assert_eq!(by_body.call_price(req, &body, [&cost].into_iter()), None);
        let by_path = pricing(ModelSource {
            json: None,
            header: None,
            path_after: Some("/openai/deployments/".into()),
        });
        let found = by_path.call_price(req, &body, [&cost].into_iter());
        assert_eq!(found.as_ref().and_then(CallPrice::model), Some(&gpt4o()));
        let by_header = pricing(ModelSource {
            json: None,
            header: Some("X-Model".into()),
            path_after: None,
        });
        assert!(by_header
            .call_price(req, &body, [&cost].into_iter())
            .is_some());
        let other: &[(&str, &[u8])] = &[(":path", b"/openai/deployments/")];
        assert_eq!(by_path.call_price(other, &body, [&cost].into_iter()), None);
    }

    /// Step 4 item 1: MCP messages are priced by tool, a batch at the sum
    /// of its counted messages'; a body that cannot be read at the
    /// dearest tool (fail closed); an unpriced tool prices nothing.
    #[test]
    fn tool_calls_are_priced_per_message_and_unread_at_the_dearest() {
        let money = |text: &str| Money::parse(text).unwrap_or_default();
        let mut table = sluice_shared::price::PriceTable::new("USD");
        table.tools = [
            ("search".to_string(), money("0.01")),
            ("expensive".to_string(), money("0.25")),
        ]
        .into_iter()
        .collect();
        let pricing = Pricing::new(
            Arc::new(CompiledPrices::new(&table)),
            &ModelSource::default(),
        );
        let every_tool = McpMatcher::new(&sluice_shared::McpMatch::default());
        let call = |tool: &str| json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": tool}});
        let price = |body: BodyJson| pricing.tools_price(&every_tool, &body);
        assert_eq!(
            price(BodyJson::Json(call("search"))),
            Some(CallPrice::Tools(10_000))
        );
        let batch = json!([call("search"), call("expensive"), {"jsonrpc": "2.0", "id": 3, "method": "tools/list"}]);
        assert_eq!(
            price(BodyJson::Json(batch)),
            Some(CallPrice::Tools(260_000)),
            "tools/list is not counted, so not priced"
        );
        assert_eq!(price(BodyJson::Json(call("fetch"))), None);
        assert_eq!(price(BodyJson::TooLarge), Some(CallPrice::Tools(250_000)));
        assert_eq!(price(BodyJson::Invalid), Some(CallPrice::Tools(250_000)));
    }
}
