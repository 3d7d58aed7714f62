//! Money: a price table (per model, per million tokens of input, output
//! and cached input; per MCP tool, per call; in one currency) and what a
//! call costs in it, in whole millionths of the currency ("micro-units").
//! No floating point in the books: prices are read from their decimal
//! text and every sum is integer arithmetic, rounded up once per call.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::policy::bounds;
use crate::policy::check::Report;
use crate::policy::prompt::PromptEstimate;
use crate::policy::usage::UsagePaths;

/// An amount of money in millionths of its currency. Written as a decimal
/// with at most 6 places, as text (`"2.50"`) or a number (`2.5`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Money(pub u64);

/// Why a decimal is not an amount of money.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MoneyError {
    #[error("{0:?} is not an amount: digits, at most one '.', at most 6 places after it")]
    NotAnAmount(String),
    #[error("{0:?} is more than {max}", max = Money::MAX)]
    TooLarge(String),
}

impl Money {
    /// Micro-units in one unit of the currency.
    pub const ONE: u64 = 1_000_000;
    /// A trillion units: no price or budget is near it, and every product
    /// of it with a token count fits an i128.
    pub const MAX: Money = Money(1_000_000_000_000 * Self::ONE);

    pub fn micros(self) -> u64 {
        self.0
    }

    /// Parses `"12"`, `"2.5"`, `"0.075"`: exact, never through a float.
    pub fn parse(text: &str) -> Result<Self, MoneyError> {
        let bad = || MoneyError::NotAnAmount(text.to_string());
        let (whole, fraction) = text.split_once('.').unwrap_or((text, ""));
        let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
        if whole.is_empty() || !digits(whole) || !digits(fraction) || fraction.len() > 6 {
            return Err(bad());
        }
        if text.contains('.') && fraction.is_empty() {
            return Err(bad());
        }
        let too_large = || MoneyError::TooLarge(text.to_string());
        let whole: u64 = whole.parse().map_err(|_| too_large())?;
        let fraction: u64 = format!("{fraction:0<6}").parse().map_err(|_| bad())?;
        let micros = whole
            .checked_mul(Self::ONE)
            .and_then(|w| w.checked_add(fraction))
            .ok_or_else(too_large)?;
        if micros > Self::MAX.0 {
            return Err(too_large());
        }
        Ok(Money(micros))
    }
}

impl fmt::Display for Money {
    /// The shortest decimal: `2.5`, `0.075`, `12`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (whole, fraction) = (self.0 / Self::ONE, self.0 % Self::ONE);
        if fraction == 0 {
            return write!(f, "{whole}");
        }
        let places = format!("{fraction:06}");
        write!(f, "{whole}.{}", places.trim_end_matches('0'))
    }
}

impl Serialize for Money {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for Money {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Money;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an amount: \"2.50\" or 2.5, at most 6 decimal places")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Money, E> {
                Money::parse(v).map_err(E::custom)
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Money, E> {
                Money::parse(&v.to_string()).map_err(E::custom)
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Money, E> {
                Money::parse(&v.to_string()).map_err(E::custom)
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Money, E> {
                // The shortest text that reads back as this number: `2.5`
                // for 2.5, never 2.4999…; then parsed exactly.
                Money::parse(&format!("{v}")).map_err(E::custom)
            }
        }
        d.deserialize_any(Visitor)
    }
}

#[cfg(feature = "schema")]
impl schemars::JsonSchema for Money {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Money".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "description": "An amount of money: a decimal with at most 6 places, as text (\"2.50\") or a number (2.5).",
            "oneOf": [
                { "type": "string", "pattern": "^[0-9]+(\\.[0-9]{1,6})?$" },
                { "type": "number", "minimum": 0 }
            ]
        })
    }
}

/// What models cost, per million tokens, in one currency.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct PriceTable {
    /// An ISO 4217 code (`USD`, `EUR`): every amount of the table, and of
    /// every limit whose cost is `price`, is in it.
    pub currency: String,
    /// By the model's name as the request's `model` field gives it; a
    /// name ending in `*` prices every model it begins (`gpt-4o-*`), the
    /// longest such entry first. An exact name wins over any prefix.
    pub models: BTreeMap<String, ModelPrice>,
    /// The price of a model not in `models`; without it such a call is
    /// refused by every limit whose cost is `price` (never free).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<ModelPrice>,
    /// What one MCP tool call costs (`tools/call`, in a policy with
    /// `match.mcp`), by the tool's name (`params.name`); a name ending in
    /// `*` prices every tool it begins, the longest first, an exact name
    /// before any prefix.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tools: BTreeMap<String, Money>,
    /// The price of a call of a tool not in `tools` (and of any other
    /// message such a policy counts); without it such a call is refused
    /// by every limit whose cost is `price` (never free).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_default: Option<Money>,
}

impl PriceTable {
    /// An empty table in `currency`.
    pub fn new(currency: &str) -> Self {
        Self {
            currency: currency.to_string(),
            models: BTreeMap::new(),
            default: None,
            tools: BTreeMap::new(),
            tool_default: None,
        }
    }
}

/// One model's prices per million tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ModelPrice {
    pub input: Money,
    pub output: Money,
    /// Input read from the provider's prompt cache; default: `input`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_input: Option<Money>,
}

impl ModelPrice {
    pub fn cached_input(&self) -> Money {
        self.cached_input.unwrap_or(self.input)
    }
}

/// How a provider reports the token kinds a price reads.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum UsageFormat {
    /// `usage.prompt_tokens` (cached ones included, as
    /// `usage.prompt_tokens_details.cached_tokens`) and
    /// `usage.completion_tokens`, in the JSON answer or a stream's last
    /// chunk.
    #[default]
    Openai,
    /// `usage.input_tokens` (cached reads apart, as
    /// `usage.cache_read_input_tokens`) and `usage.output_tokens`; in a
    /// stream, the input in `message_start`'s `message.usage`.
    Anthropic,
}

/// A limit whose cost is money (`"cost": "price"`, or `{"price": {...}}`
/// to set how the estimate is made): estimated before the call at the
/// model's prices, charged after it from the usage the answer reports.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct PriceCost {
    /// The request's field of the most output tokens it asks for, per
    /// choice (OpenAI's `n` and `best_of` ask for several: the estimate
    /// counts each).
    #[serde(default = "PriceCost::default_output")]
    pub output: String,
    /// Output tokens estimated when the request does not say.
    #[serde(default = "PriceCost::default_output_tokens")]
    pub default_output: u64,
    /// Output tokens per choice a call is charged when its usage cannot
    /// be read (an answer cut short, left by its caller, too large) and
    /// it did not say how many it wanted: with its prompt, the unread
    /// charge's ceiling. Default 32 768.
    #[serde(default = "PriceCost::default_max_output_tokens")]
    pub max_output: u64,
    /// How the prompt's input tokens are estimated; default: every
    /// string of the body (`"*"`), so that text under any field
    /// (`tools`, `instructions`, a schema) is counted.
    #[serde(default = "PriceCost::default_prompt")]
    pub prompt: PromptEstimate,
    /// How the answer reports its usage.
    #[serde(default)]
    pub usage: UsageFormat,
    /// Where the call's model is named: the body's `model` (the
    /// default), a header, or a segment of the path (Azure's
    /// `/openai/deployments/<name>/...`, which a caller cannot change
    /// without calling another deployment). The answer's own `model`
    /// prices it too, whichever is dearer.
    #[serde(default, skip_serializing_if = "ModelSource::is_default")]
    pub model: ModelSource,
}

/// Where a call names its model (see [`PriceCost::model`]): exactly one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ModelSource {
    /// A field of the request's JSON body.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub json: Option<String>,
    /// A request header.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// The path's segment right after this prefix
    /// (`/openai/deployments/`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path_after: Option<String>,
}

impl Default for ModelSource {
    fn default() -> Self {
        Self {
            json: Some("model".into()),
            header: None,
            path_after: None,
        }
    }
}

impl ModelSource {
    fn is_default(&self) -> bool {
        *self == Self::default()
    }
}

impl Default for PriceCost {
    fn default() -> Self {
        Self {
            output: Self::default_output(),
            default_output: Self::default_output_tokens(),
            max_output: Self::default_max_output_tokens(),
            prompt: Self::default_prompt(),
            usage: UsageFormat::default(),
            model: ModelSource::default(),
        }
    }
}

impl PriceCost {
    fn default_output() -> String {
        "max_tokens".into()
    }

    fn default_output_tokens() -> u64 {
        4096
    }

    fn default_max_output_tokens() -> u64 {
        32_768
    }

    fn default_prompt() -> PromptEstimate {
        PromptEstimate {
            paths: vec![PromptEstimate::EVERY_STRING.to_string()],
            chars_per_token: PromptEstimate::DEFAULT_CHARS_PER_TOKEN,
        }
    }

    /// The usage paths of `format`, each weighed by `price` (micro-units
    /// per million tokens): their sum over a million is the call's cost.
    /// JSON answers and streams.
    pub fn weighed_usage(format: UsageFormat, price: &ModelPrice) -> (UsagePaths, UsagePaths) {
        let weight = |m: Money| i64::try_from(m.micros()).unwrap_or(i64::MAX);
        let (input, output, cached) = (
            weight(price.input),
            weight(price.output),
            weight(price.cached_input()),
        );
        // Every path, of any weight: the answer's model may price the
        // same counts again with other weights (`UsageReader`), and a path
        // that counts nothing need not be in the answer.
        let paths = |list: &[(&str, i64)]| {
            UsagePaths(list.iter().map(|(p, w)| (p.to_string(), *w)).collect())
        };
        match format {
            // Cached tokens are within prompt_tokens: they are charged
            // the difference of the two prices on top.
            UsageFormat::Openai => {
                let json = paths(&[
                    ("usage.prompt_tokens", input),
                    ("usage.prompt_tokens_details.cached_tokens", cached - input),
                    ("usage.completion_tokens", output),
                ]);
                (json.clone(), json)
            }
            UsageFormat::Anthropic => (
                paths(&[
                    ("usage.input_tokens", input),
                    ("usage.cache_read_input_tokens", cached),
                    ("usage.output_tokens", output),
                ]),
                paths(&[
                    ("message.usage.input_tokens", input),
                    ("message.usage.cache_read_input_tokens", cached),
                    ("usage.output_tokens", output),
                ]),
            ),
        }
    }
}

/// Tokens at a price per million: micro-units, rounded up.
pub fn cost_of(tokens: u64, per_million: Money) -> u64 {
    let product = u128::from(tokens) * u128::from(per_million.micros());
    u64::try_from(product.div_ceil(1_000_000)).unwrap_or(u64::MAX)
}

/// Rows of a price table by name, ready to look up: exact names, then
/// the longest prefix (a name ending in `*`), then the default.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ByName<T> {
    exact: BTreeMap<String, T>,
    /// `gpt-4o-*` as `gpt-4o-`, longest first.
    prefixes: Vec<(String, T)>,
    default: Option<T>,
}

impl<T> Default for ByName<T> {
    fn default() -> Self {
        Self {
            exact: BTreeMap::new(),
            prefixes: Vec::new(),
            default: None,
        }
    }
}

impl<T: Copy> ByName<T> {
    fn new(rows: &BTreeMap<String, T>, default: Option<T>) -> Self {
        let mut prefixes: Vec<(String, T)> = rows
            .iter()
            .filter_map(|(name, row)| Some((name.strip_suffix('*')?.to_string(), *row)))
            .collect();
        prefixes.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then_with(|| a.0.cmp(&b.0)));
        Self {
            exact: rows
                .iter()
                .filter(|(name, _)| !name.ends_with('*'))
                .map(|(name, row)| (name.clone(), *row))
                .collect(),
            prefixes,
            default,
        }
    }

    fn of(&self, name: Option<&str>) -> Option<&T> {
        let found = name.and_then(|n| {
            self.exact.get(n).or_else(|| {
                self.prefixes
                    .iter()
                    .find(|(prefix, _)| n.starts_with(prefix.as_str()))
                    .map(|(_, row)| row)
            })
        });
        found.or(self.default.as_ref())
    }
}

/// A [`PriceTable`] ready to look models and tools up.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CompiledPrices {
    pub currency: String,
    models: ByName<ModelPrice>,
    tools: ByName<Money>,
}

impl CompiledPrices {
    pub fn new(table: &PriceTable) -> Self {
        Self {
            currency: table.currency.clone(),
            models: ByName::new(&table.models, table.default),
            tools: ByName::new(&table.tools, table.tool_default),
        }
    }

    /// The prices of `model` (None: the request names none): the exact
    /// entry, else the longest prefix, else the default, else none.
    pub fn of(&self, model: Option<&str>) -> Option<&ModelPrice> {
        self.models.of(model)
    }

    /// What one call of `tool` costs (None: the message calls no tool),
    /// found as a model's price is; None when it has no price.
    pub fn of_tool(&self, tool: Option<&str>) -> Option<Money> {
        self.tools.of(tool).copied()
    }

    /// The dearest price a tool call can have (of a call whose tool
    /// cannot be read); None when no tool is priced.
    pub fn dearest_tool(&self) -> Option<Money> {
        self.tools
            .exact
            .values()
            .chain(self.tools.prefixes.iter().map(|(_, price)| price))
            .chain(&self.tools.default)
            .max()
            .copied()
    }
}

/// Why `name` cannot name a row of a price table (a model or a tool):
/// none when it can.
pub fn name_problem(name: &str) -> Option<String> {
    let bare = name.strip_suffix('*').unwrap_or(name);
    (bare.is_empty() || name.len() > bounds::MAX_MODEL_NAME || bare.contains('*')).then(|| {
        format!(
            "a name has 1 to {} characters, `*` only at its end",
            bounds::MAX_MODEL_NAME
        )
    })
}

/// Why `price` cannot be a model's row of a price table: each problem
/// with the field it is on (`None`: the row as a whole).
pub fn model_price_problems(price: &ModelPrice) -> Vec<(Option<&'static str>, String)> {
    let most = Money(bounds::MAX_PRICE_PER_MILLION * Money::ONE);
    let mut problems: Vec<(Option<&'static str>, String)> = [
        ("input", Some(price.input)),
        ("output", Some(price.output)),
        ("cached_input", price.cached_input),
    ]
    .into_iter()
    .filter(|(_, amount)| amount.is_some_and(|a| a > most))
    .map(|(kind, _)| {
        (
            Some(kind),
            format!(
                "at most {} a million tokens: a price is per million tokens",
                bounds::MAX_PRICE_PER_MILLION
            ),
        )
    })
    .collect();
    if price.input.micros() == 0 && price.output.micros() == 0 {
        problems.push((
            None,
            "input and output both free: give the model's price, or leave it out (then `default`, or refused)".into(),
        ));
    }
    problems
}

/// Why `price` cannot be what one tool call costs, if it cannot.
pub fn tool_price_problem(price: Money) -> Option<String> {
    if price.micros() == 0 {
        return Some(
            "at least 0.000001: a call a money limit counts is never free (leave a free tool out of the policy's `match.mcp.tools`)".into(),
        );
    }
    (price > Money(bounds::MAX_PRICE_PER_CALL * Money::ONE)).then(|| {
        format!(
            "at most {} a call: a tool's price is per call",
            bounds::MAX_PRICE_PER_CALL
        )
    })
}

/// A price table: a known currency, named models, prices a provider
/// could charge.
pub(crate) fn check_prices(r: &mut Report, prices: &PriceTable) {
    if iso_currency::Currency::from_code(&prices.currency).is_none() {
        r.at(
            "currency",
            format!(
                "{:?} is not an ISO 4217 currency code (USD, EUR, GBP, JPY, ...)",
                prices.currency
            ),
        );
    }
    if prices.models.len() > bounds::MAX_PRICED_MODELS {
        r.at(
            "models",
            format!("at most {} models", bounds::MAX_PRICED_MODELS),
        );
    }
    for (name, price) in &prices.models {
        let at = format!("models.{name}");
        if let Some(problem) = name_problem(name) {
            r.at(&at, problem);
        }
        check_model_price(r, &at, price);
    }
    if let Some(default) = &prices.default {
        check_model_price(r, "default", default);
    }
    if prices.tools.len() > bounds::MAX_PRICED_MODELS {
        r.at(
            "tools",
            format!("at most {} tools", bounds::MAX_PRICED_MODELS),
        );
    }
    for (name, price) in &prices.tools {
        let at = format!("tools.{name}");
        for problem in name_problem(name)
            .into_iter()
            .chain(tool_price_problem(*price))
        {
            r.at(&at, problem);
        }
    }
    if let Some(problem) = prices.tool_default.and_then(tool_price_problem) {
        r.at("tool_default", problem);
    }
}

fn check_model_price(r: &mut Report, at: &str, price: &ModelPrice) {
    for (kind, problem) in model_price_problems(price) {
        match kind {
            Some(kind) => r.at(&format!("{at}.{kind}"), problem),
            None => r.at(at, problem),
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn amounts_are_read_exactly_and_written_short() {
        for (text, micros, shown) in [
            ("2.50", 2_500_000, "2.5"),
            ("0.075", 75_000, "0.075"),
            ("12", 12_000_000, "12"),
            ("0.000001", 1, "0.000001"),
            ("0", 0, "0"),
        ] {
            let m = Money::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!((m.micros(), m.to_string().as_str()), (micros, shown));
        }
        for bad in [
            "",
            ".5",
            "5.",
            "1.0000001",
            "-1",
            "1e3",
            "1,5",
            "NaN",
            " 1",
            "1.2.3",
        ] {
            assert!(Money::parse(bad).is_err(), "{bad:?}");
        }
        assert!(matches!(
            Money::parse("1000000000001"),
            Err(MoneyError::TooLarge(_))
        ));
        assert!(matches!(
            Money::parse("99999999999999999999999"),
            Err(MoneyError::TooLarge(_))
        ));
        // Numbers read through their shortest text, never a float's error.
        let from_json = |j: &str| serde_json::from_str::<Money>(j).map(Money::micros).ok();
        assert_eq!(from_json("0.1"), Some(100_000));
        assert_eq!(from_json("2.675"), Some(2_675_000));
        assert_eq!(from_json("15"), Some(15_000_000));
        assert_eq!(from_json("0.0000001"), None);
        assert_eq!(from_json("-2"), None);
        assert_eq!(from_json("true"), None);
    }

    #[test]
    fn costs_round_up_once_per_call() {
        let per_million = Money::parse("0.15").unwrap_or_default();
        assert_eq!(cost_of(100, per_million), 15);
        assert_eq!(cost_of(1, per_million), 1, "0.15 micro-units round up");
        assert_eq!(cost_of(0, per_million), 0);
        assert_eq!(cost_of(u64::MAX, Money::MAX), u64::MAX, "saturates");
    }

    #[test]
    fn exact_names_then_the_longest_prefix_then_the_default() {
        let price = |input: &str| ModelPrice {
            input: Money::parse(input).unwrap_or_default(),
            output: Money::default(),
            cached_input: None,
        };
        let table = PriceTable {
            currency: "USD".into(),
            models: [
                ("gpt-4o".to_string(), price("2.5")),
                ("gpt-4o-*".to_string(), price("3")),
                ("gpt-4o-mini*".to_string(), price("0.15")),
            ]
            .into_iter()
            .collect(),
            default: None,
            tools: Default::default(),
            tool_default: None,
        };
        let prices = CompiledPrices::new(&table);
        let input = |m: Option<&str>| prices.of(m).map(|p| p.input.to_string());
        assert_eq!(input(Some("gpt-4o")).as_deref(), Some("2.5"));
        assert_eq!(input(Some("gpt-4o-2024-08-06")).as_deref(), Some("3"));
        assert_eq!(input(Some("gpt-4o-mini-2024")).as_deref(), Some("0.15"));
        assert_eq!(input(Some("claude")), None);
        assert_eq!(input(None), None);
        let with_default = CompiledPrices::new(&PriceTable {
            default: Some(price("10")),
            ..table
        });
        assert_eq!(
            with_default
                .of(Some("claude"))
                .map(|p| p.input.to_string())
                .as_deref(),
            Some("10")
        );
    }

    #[test]
    fn tools_are_priced_by_name_prefix_and_default_and_the_dearest_is_known() {
        let money = |text: &str| Money::parse(text).unwrap_or_default();
        let mut table = PriceTable::new("USD");
        table.tools = [
            ("search".to_string(), money("0.01")),
            ("render_*".to_string(), money("0.05")),
            ("render_pdf*".to_string(), money("0.2")),
        ]
        .into_iter()
        .collect();
        let prices = CompiledPrices::new(&table);
        let of = |tool: Option<&str>| prices.of_tool(tool).map(|m| m.to_string());
        assert_eq!(of(Some("search")).as_deref(), Some("0.01"));
        assert_eq!(of(Some("render_png")).as_deref(), Some("0.05"));
        assert_eq!(of(Some("render_pdf_a4")).as_deref(), Some("0.2"));
        assert_eq!(of(Some("fetch")), None);
        assert_eq!(of(None), None, "a message that calls no tool");
        assert_eq!(prices.dearest_tool(), Some(money("0.2")));
        table.tool_default = Some(money("1.5"));
        let prices = CompiledPrices::new(&table);
        assert_eq!(prices.of_tool(Some("fetch")), Some(money("1.5")));
        assert_eq!(prices.dearest_tool(), Some(money("1.5")));
        assert_eq!(
            CompiledPrices::new(&PriceTable::new("USD")).dearest_tool(),
            None
        );
    }

    proptest! {
        #[test]
        fn what_is_written_reads_back_the_same(micros in 0u64..=Money::MAX.0) {
            let m = Money(micros);
            prop_assert_eq!(Money::parse(&m.to_string()), Ok(m));
            let json = serde_json::to_string(&m).unwrap_or_default();
            prop_assert_eq!(serde_json::from_str::<Money>(&json).ok(), Some(m));
        }
    }
}
