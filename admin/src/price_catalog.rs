//! Prices from a public model-price catalog in LiteLLM's format
//! (`model_prices_and_context_window.json`: by model, the cost of one
//! token of input, of output and of cached input, in US dollars), merged
//! into the set's price table in Sluice's units: per million tokens, in
//! whole millionths. Conversion is exact, from the number's decimal text,
//! never through a float's product; an amount finer than a millionth a
//! million tokens is rounded up (a budget is never spent slower than the
//! catalog says). An entry that cannot be a Sluice price is left out and
//! named with its reason; the rest is imported.

use serde_json::{Map, Value};
use sluice_api::prices::{PriceChange, PricedModel, PricesImported, RefusedModel};
use sluice_shared::policy::bounds;
use sluice_shared::price::{self, ModelPrice, Money, PriceTable};

/// The catalog's currency: LiteLLM prices in US dollars.
pub const CATALOG_CURRENCY: &str = "USD";
/// Largest catalog read (LiteLLM's whole file is about 1.5 MB).
pub const MAX_CATALOG_BYTES: usize = 16 * 1024 * 1024;

/// The catalog's documentation entry, which prices nothing.
const SAMPLE_ENTRY: &str = "sample_spec";
const INPUT: &str = "input_cost_per_token";
const OUTPUT: &str = "output_cost_per_token";
const CACHED_INPUT: &str = "cache_read_input_token_cost";
const PROVIDER: &str = "litellm_provider";

/// Why a catalog could not be imported at all.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CatalogError {
    #[error("not a price catalog: {0}")]
    NotJson(String),
    #[error("not a price catalog: expected an object of models by name, found {0}")]
    NotAnObject(&'static str),
    #[error(
        "the catalog prices in {CATALOG_CURRENCY} and the set's table in {0}: import into a table in {CATALOG_CURRENCY}, or convert the catalog first"
    )]
    Currency(String),
}

/// Which of the catalog's entries to import: every one by default; with
/// `only`, those named (a name ending in `*` takes every model it
/// begins); with `providers`, those of these `litellm_provider`s.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selection {
    pub only: Vec<String>,
    pub providers: Vec<String>,
}

impl Selection {
    fn selects(&self, model: &str, entry: &Value) -> bool {
        let named = self.only.is_empty()
            || self
                .only
                .iter()
                .any(|pattern| match pattern.strip_suffix('*') {
                    Some(prefix) => model.starts_with(prefix),
                    None => model == pattern,
                });
        let provided = self.providers.is_empty()
            || entry
                .get(PROVIDER)
                .and_then(Value::as_str)
                .is_some_and(|p| self.providers.iter().any(|want| want == p));
        named && provided
    }
}

/// A catalog read: each selected entry's price, or why it has none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Catalog {
    entries: Vec<(String, Result<ModelPrice, String>)>,
    not_selected: usize,
}

/// Reads a catalog's text, keeping the entries `selection` takes.
pub fn read(text: &str, selection: &Selection) -> Result<Catalog, CatalogError> {
    let value: Value =
        serde_json::from_str(text).map_err(|e| CatalogError::NotJson(e.to_string()))?;
    let Value::Object(models) = value else {
        return Err(CatalogError::NotAnObject(kind_of(&value)));
    };
    let mut catalog = Catalog {
        entries: Vec::new(),
        not_selected: 0,
    };
    for (model, entry) in &models {
        if model == SAMPLE_ENTRY {
            continue;
        }
        if !selection.selects(model, entry) {
            catalog.not_selected += 1;
            continue;
        }
        let price = match entry {
            Value::Object(fields) => check_name(model).and_then(|()| price_of(fields)),
            other => Err(format!("an entry is an object, not {}", kind_of(other))),
        };
        catalog.entries.push((model.clone(), price));
    }
    Ok(catalog)
}

/// The table with the catalog's prices in it (a model it names gets the
/// catalog's price, the others keep theirs), and what changed.
pub fn merge(
    current: Option<&PriceTable>,
    catalog: &Catalog,
) -> Result<(PriceTable, PricesImported), CatalogError> {
    let mut table = match current {
        Some(table) if table.currency != CATALOG_CURRENCY => {
            return Err(CatalogError::Currency(table.currency.clone()))
        }
        Some(table) => table.clone(),
        None => PriceTable::new(CATALOG_CURRENCY),
    };
    let mut imported = PricesImported {
        not_selected: catalog.not_selected,
        ..PricesImported::default()
    };
    for (model, price) in &catalog.entries {
        let price = match price {
            Ok(price) => *price,
            Err(reason) => {
                imported.refused.push(RefusedModel {
                    model: model.clone(),
                    reason: reason.clone(),
                });
                continue;
            }
        };
        match table.models.insert(model.clone(), price) {
            None => imported.added.push(PricedModel {
                model: model.clone(),
                price,
            }),
            Some(before) if before == price => imported.unchanged += 1,
            Some(before) => imported.changed.push(PriceChange {
                model: model.clone(),
                before,
                after: price,
            }),
        }
    }
    // Reported by name, whatever order the catalog gave.
    imported.added.sort_by(|a, b| a.model.cmp(&b.model));
    imported.changed.sort_by(|a, b| a.model.cmp(&b.model));
    imported.refused.sort_by(|a, b| a.model.cmp(&b.model));
    Ok((table, imported))
}

/// The import for people, a line a model (`+` added, `~` changed, `!`
/// refused), as the CLI prints it before its verdict.
pub fn describe(imported: &PricesImported) -> String {
    let mut out = String::new();
    for a in &imported.added {
        out.push_str(&format!("+ {}: {}\n", a.model, price_text(&a.price)));
    }
    for c in &imported.changed {
        out.push_str(&format!(
            "~ {}: {} (was {})\n",
            c.model,
            price_text(&c.after),
            price_text(&c.before)
        ));
    }
    for r in &imported.refused {
        out.push_str(&format!("! {}: {}\n", r.model, r.reason));
    }
    out.push_str(&format!(
        "{} added, {} changed, {} unchanged, {} refused, {} not selected\n",
        imported.added.len(),
        imported.changed.len(),
        imported.unchanged,
        imported.refused.len(),
        imported.not_selected
    ));
    out
}

fn price_text(price: &ModelPrice) -> String {
    let mut text = format!("input {}, output {}", price.input, price.output);
    if let Some(cached) = price.cached_input {
        text.push_str(&format!(", cached input {cached}"));
    }
    text.push_str(" a million tokens");
    text
}

/// A catalog's name is one model's: the table's name rule, and no `*`
/// (which would make it a prefix of every model it begins).
fn check_name(model: &str) -> Result<(), String> {
    if model.contains('*') {
        return Err("a model's name has no `*` in a catalog".into());
    }
    price::name_problem(model).map_or(Ok(()), Err)
}

fn price_of(fields: &Map<String, Value>) -> Result<ModelPrice, String> {
    let input = per_million(fields, INPUT)?;
    let output = per_million(fields, OUTPUT)?;
    let cached_input = per_million(fields, CACHED_INPUT)?;
    let (input, output) = match (input, output) {
        (Some(input), Some(output)) => (input, output),
        (None, None) => return Err(format!("not priced per token (no {INPUT} or {OUTPUT})")),
        (None, Some(_)) => return Err(format!("no {INPUT}")),
        (Some(_), None) => return Err(format!("no {OUTPUT}")),
    };
    let price = ModelPrice {
        input,
        output,
        // The table's default for cached input is the input's price.
        cached_input: cached_input.filter(|c| *c != input),
    };
    // The table's own rules, named by the catalog's fields.
    match price::model_price_problems(&price).into_iter().next() {
        None => Ok(price),
        Some((Some(kind), problem)) => Err(format!("{}: {problem}", catalog_field(kind))),
        Some((None, _)) => Err("free in the catalog: Sluice prices no model at 0 (a call of a model the table does not price takes `default`, or is refused)".into()),
    }
}

/// The catalog's name of a table's price field.
fn catalog_field(kind: &str) -> &'static str {
    match kind {
        "input" => INPUT,
        "output" => OUTPUT,
        _ => CACHED_INPUT,
    }
}

/// `field`'s cost of one token as the cost of a million, or None when the
/// entry does not give it.
fn per_million(fields: &Map<String, Value>, field: &str) -> Result<Option<Money>, String> {
    match fields.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => micros_per_million(&n.to_string())
            .map(|m| Some(Money(m)))
            .map_err(|why| format!("{field} {n}: {why}")),
        Some(other) => Err(format!("{field} is {}, not a number", kind_of(other))),
    }
}

/// A per-token cost's decimal text (`2.5e-6`, `0.000015`, `3`) as
/// millionths per million tokens: the number times 10¹², exactly, rounded
/// up past the millionth.
fn micros_per_million(text: &str) -> Result<u64, String> {
    if text.starts_with('-') {
        return Err("a price is not negative".into());
    }
    let (mantissa, exponent) = match text.split_once(['e', 'E']) {
        Some((m, e)) => (m, e.parse::<i32>().map_err(|_| "not a decimal")?),
        None => (text, 0),
    };
    let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits: String = whole.chars().chain(fraction.chars()).collect();
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err("not a decimal".into());
    }
    let significant = digits.trim_start_matches('0');
    let trimmed = significant.trim_end_matches('0');
    if trimmed.is_empty() {
        return Ok(0);
    }
    let dropped_zeros = i64::try_from(significant.len() - trimmed.len()).unwrap_or(i64::MAX);
    let fraction_len = i64::try_from(fraction.len()).unwrap_or(i64::MAX);
    // value = trimmed × 10^(exponent − fraction_len + dropped_zeros); in
    // millionths per million tokens, 12 places more.
    let shift = i64::from(exponent) - fraction_len + dropped_zeros + 12;
    let too_large = || {
        format!(
            "more than {} a million tokens",
            bounds::MAX_PRICE_PER_MILLION
        )
    };
    let value: u128 = trimmed.parse().map_err(|_| too_large())?;
    if shift >= 0 {
        let scale = u32::try_from(shift)
            .ok()
            .and_then(|s| 10u128.checked_pow(s))
            .ok_or_else(too_large)?;
        let micros = value.checked_mul(scale).ok_or_else(too_large)?;
        return u64::try_from(micros).map_err(|_| too_large());
    }
    // Finer than a millionth a million tokens: one millionth more.
    let divisor = u32::try_from(-shift)
        .ok()
        .and_then(|s| 10u128.checked_pow(s));
    let micros = match divisor {
        Some(d) => value.div_ceil(d),
        None => 1,
    };
    u64::try_from(micros).map_err(|_| too_large())
}

fn kind_of(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "true or false",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn money(text: &str) -> Money {
        Money::parse(text).unwrap()
    }

    #[test]
    fn a_per_token_cost_becomes_its_price_per_million_tokens_exactly() {
        for (text, micros) in [
            ("2.5e-6", 2_500_000),
            ("2.5E-06", 2_500_000),
            ("0.000015", 15_000_000),
            ("1e-7", 100_000),
            ("1.5e-7", 150_000),
            ("3", 3_000_000_000_000),
            ("0", 0),
            ("0.0", 0),
            ("6e-8", 60_000),
            ("1.1e-6", 1_100_000),
            ("0.0000003", 300_000),
        ] {
            assert_eq!(micros_per_million(text), Ok(micros), "{text}");
        }
    }

    #[test]
    fn an_amount_finer_than_a_millionth_a_million_tokens_is_rounded_up() {
        assert_eq!(micros_per_million("1.2345678e-9"), Ok(1235));
        assert_eq!(micros_per_million("1.2345678e-13"), Ok(1));
        assert_eq!(micros_per_million("1e-19"), Ok(1));
        assert_eq!(micros_per_million("1e-400"), Ok(1));
    }

    #[test]
    fn a_cost_that_is_no_price_is_named() {
        assert!(micros_per_million("-1e-6").is_err());
        assert!(micros_per_million("1e400").is_err());
        assert!(micros_per_million("99999999999999999999999999999999999999999").is_err());
        assert!(micros_per_million("").is_err());
    }

    const CATALOG: &str = r#"{
        "sample_spec": {"input_cost_per_token": 0.0, "output_cost_per_token": 0.0, "litellm_provider": "one of https://docs.litellm.ai/docs/providers"},
        "gpt-4o": {"input_cost_per_token": 2.5e-06, "output_cost_per_token": 1e-05, "cache_read_input_token_cost": 1.25e-06, "litellm_provider": "openai", "mode": "chat"},
        "gpt-4o-mini": {"input_cost_per_token": 1.5e-07, "output_cost_per_token": 6e-07, "litellm_provider": "openai"},
        "claude-sonnet": {"input_cost_per_token": 3e-06, "output_cost_per_token": 1.5e-05, "cache_read_input_token_cost": 3e-06, "litellm_provider": "anthropic"},
        "dall-e-3": {"output_cost_per_image": 0.04, "litellm_provider": "openai"},
        "free-model": {"input_cost_per_token": 0, "output_cost_per_token": 0, "litellm_provider": "ollama"},
        "odd": {"input_cost_per_token": "0.1", "output_cost_per_token": 1e-06, "litellm_provider": "openai"},
        "half": {"input_cost_per_token": 1e-06, "litellm_provider": "openai"},
        "dear": {"input_cost_per_token": 1, "output_cost_per_token": 1, "litellm_provider": "openai"},
        "bad*name": {"input_cost_per_token": 1e-06, "output_cost_per_token": 1e-06},
        "list": [1, 2]
    }"#;

    fn refused(imported: &PricesImported) -> Vec<(&str, &str)> {
        imported
            .refused
            .iter()
            .map(|r| (r.model.as_str(), r.reason.as_str()))
            .collect()
    }

    #[test]
    fn a_catalog_imports_what_it_prices_per_token_and_names_the_rest() {
        let catalog = read(CATALOG, &Selection::default()).unwrap();
        let (table, imported) = merge(None, &catalog).unwrap();
        assert_eq!(table.currency, "USD");
        assert_eq!(
            table.models["gpt-4o"],
            ModelPrice {
                input: money("2.5"),
                output: money("10"),
                cached_input: Some(money("1.25")),
            }
        );
        assert_eq!(table.models["gpt-4o-mini"].input, money("0.15"));
        assert_eq!(
            table.models["claude-sonnet"].cached_input, None,
            "a cached input priced as the input is the table's default"
        );
        let added: Vec<&str> = imported.added.iter().map(|a| a.model.as_str()).collect();
        assert_eq!(added, ["claude-sonnet", "gpt-4o", "gpt-4o-mini"]);
        let refused = refused(&imported);
        let names: Vec<&str> = refused.iter().map(|(m, _)| *m).collect();
        assert_eq!(
            names,
            [
                "bad*name",
                "dall-e-3",
                "dear",
                "free-model",
                "half",
                "list",
                "odd"
            ]
        );
        for (model, reason) in refused {
            let expected = match model {
                "bad*name" => "no `*`",
                "dall-e-3" => "not priced per token",
                "dear" => "at most 100000 a million tokens",
                "free-model" => "free in the catalog",
                "half" => "no output_cost_per_token",
                "list" => "an entry is an object, not a list",
                "odd" => "input_cost_per_token is a string, not a number",
                _ => unreachable!(),
            };
            assert!(reason.contains(expected), "{model}: {reason}");
        }
        assert!(!table.models.contains_key("sample_spec"));
    }

    #[test]
    fn the_description_names_each_model_and_counts_the_rest() {
        let only = Selection {
            only: vec!["gpt-4o".into(), "half".into()],
            providers: vec![],
        };
        let (_, imported) = merge(None, &read(CATALOG, &only).unwrap()).unwrap();
        assert_eq!(
            describe(&imported),
            "+ gpt-4o: input 2.5, output 10, cached input 1.25 a million tokens\n\
             ! half: no output_cost_per_token\n\
             1 added, 0 changed, 0 unchanged, 1 refused, 8 not selected\n"
        );
    }

    #[test]
    fn a_selection_takes_named_models_and_providers() {
        let only = Selection {
            only: vec!["gpt-4o-*".into(), "claude-sonnet".into()],
            providers: vec![],
        };
        let (table, imported) = merge(None, &read(CATALOG, &only).unwrap()).unwrap();
        assert_eq!(
            table.models.keys().collect::<Vec<_>>(),
            ["claude-sonnet", "gpt-4o-mini"]
        );
        assert_eq!(imported.not_selected, 8);
        let anthropic = Selection {
            only: vec![],
            providers: vec!["anthropic".into()],
        };
        let (table, _) = merge(None, &read(CATALOG, &anthropic).unwrap()).unwrap();
        assert_eq!(table.models.keys().collect::<Vec<_>>(), ["claude-sonnet"]);
    }

    #[test]
    fn an_import_changes_only_the_models_it_prices() {
        let mut current = PriceTable {
            currency: "USD".into(),
            models: Default::default(),
            default: Some(ModelPrice {
                input: money("1"),
                output: money("2"),
                cached_input: None,
            }),
            tools: Default::default(),
            tool_default: None,
        };
        let mine = ModelPrice {
            input: money("9"),
            output: money("9"),
            cached_input: None,
        };
        current.models.insert("in-house".into(), mine);
        current.models.insert(
            "gpt-4o".into(),
            ModelPrice {
                input: money("5"),
                output: money("15"),
                cached_input: None,
            },
        );
        current.models.insert(
            "gpt-4o-mini".into(),
            ModelPrice {
                input: money("0.15"),
                output: money("0.6"),
                cached_input: None,
            },
        );
        let only = Selection {
            only: vec!["gpt-4o*".into()],
            providers: vec![],
        };
        let (table, imported) = merge(Some(&current), &read(CATALOG, &only).unwrap()).unwrap();
        assert_eq!(table.models["in-house"], mine);
        assert_eq!(table.default, current.default);
        assert_eq!(imported.unchanged, 1);
        assert_eq!(imported.changed.len(), 1);
        assert_eq!(imported.changed[0].model, "gpt-4o");
        assert_eq!(imported.changed[0].before.input, money("5"));
        assert_eq!(imported.changed[0].after.input, money("2.5"));
        assert!(imported.added.is_empty());
    }

    #[test]
    fn a_table_in_another_currency_or_a_file_that_is_no_catalog_is_refused_whole() {
        let euros = PriceTable {
            currency: "EUR".into(),
            models: Default::default(),
            default: None,
            tools: Default::default(),
            tool_default: None,
        };
        let catalog = read(CATALOG, &Selection::default()).unwrap();
        assert_eq!(
            merge(Some(&euros), &catalog).unwrap_err(),
            CatalogError::Currency("EUR".into())
        );
        assert!(matches!(
            read("[1, 2]", &Selection::default()),
            Err(CatalogError::NotAnObject("a list"))
        ));
        assert!(matches!(
            read("{\"gpt-4o\": ", &Selection::default()),
            Err(CatalogError::NotJson(_))
        ));
    }
}
