//! The policy set's price table: per model, per million tokens of input,
//! output and cached input, in one currency; and the price of a model not
//! listed (or none: such calls are refused by money limits); per MCP tool,
//! per call, and of a tool not listed. Amounts go to the server as the
//! text typed, read there exactly.

use leptos::prelude::*;
use leptos::task::spawn_local;
use serde_json::{json, Map, Value};
use sluice_api::PricesSaved;
use sluice_shared::price::{ModelPrice, PriceTable};

use crate::api::{self, ApiError};
use crate::session::Session;

/// Common currencies first in the select; the table's own is added.
const CURRENCIES: &[&str] = &[
    "USD", "EUR", "GBP", "JPY", "CHF", "CAD", "AUD", "CNY", "INR",
];

/// One row as typed: a model's name (or `*`-ended prefix) and its prices.
#[derive(Debug, Clone, Default, PartialEq)]
struct Row {
    id: u32,
    model: String,
    input: String,
    output: String,
    cached_input: String,
}

impl Row {
    fn from(id: u32, model: &str, price: &ModelPrice) -> Self {
        Self {
            id,
            model: model.to_string(),
            input: price.input.to_string(),
            output: price.output.to_string(),
            cached_input: price
                .cached_input
                .map(|m| m.to_string())
                .unwrap_or_default(),
        }
    }

    fn price(&self) -> Value {
        let mut price = json!({"input": self.input.trim(), "output": self.output.trim()});
        if !self.cached_input.trim().is_empty() {
            price["cached_input"] = Value::String(self.cached_input.trim().to_string());
        }
        price
    }
}

/// One tool's row as typed: its name (or `*`-ended prefix) and its price
/// per call.
#[derive(Debug, Clone, Default, PartialEq)]
struct ToolRow {
    id: u32,
    tool: String,
    price: String,
}

/// The tools' rows and the price of a tool not listed, as typed.
#[derive(Debug, Clone, Default, PartialEq)]
struct ToolPrices {
    rows: Vec<ToolRow>,
    default: String,
}

/// The table as the rows say it (`default`: the row of a model not
/// listed, when its prices are given).
fn table(currency: &str, rows: &[Row], default: &Row, tools: &ToolPrices) -> Value {
    let models: Map<String, Value> = rows
        .iter()
        .filter(|r| !r.model.trim().is_empty())
        .map(|r| (r.model.trim().to_string(), r.price()))
        .collect();
    let mut table = json!({"currency": currency.trim(), "models": models});
    if !default.input.trim().is_empty() || !default.output.trim().is_empty() {
        table["default"] = default.price();
    }
    let priced_tools: Map<String, Value> = tools
        .rows
        .iter()
        .filter(|r| !r.tool.trim().is_empty())
        .map(|r| {
            (
                r.tool.trim().to_string(),
                Value::String(r.price.trim().into()),
            )
        })
        .collect();
    if !priced_tools.is_empty() {
        table["tools"] = Value::Object(priced_tools);
    }
    if !tools.default.trim().is_empty() {
        table["tool_default"] = Value::String(tools.default.trim().into());
    }
    table
}

#[component]
pub(super) fn PricesPage() -> impl IntoView {
    let session = expect_context::<Session>();
    let currency = RwSignal::new("USD".to_string());
    let rows = RwSignal::new(Vec::<Row>::new());
    let default = RwSignal::new(Row::default());
    let tools = RwSignal::new(ToolPrices::default());
    let next_id = RwSignal::new(0u32);
    let message = RwSignal::new(String::new());
    let errors = RwSignal::new(Vec::<String>::new());
    spawn_local(async move {
        match api::get::<Option<PriceTable>>("/api/v1/prices").await {
            Ok(Some(t)) => {
                currency.set(t.currency.clone());
                let loaded: Vec<Row> = t
                    .models
                    .iter()
                    .enumerate()
                    .map(|(i, (m, p))| Row::from(i as u32, m, p))
                    .collect();
                let tool_rows: Vec<ToolRow> = t
                    .tools
                    .iter()
                    .enumerate()
                    .map(|(i, (tool, price))| ToolRow {
                        id: (loaded.len() + i) as u32,
                        tool: tool.clone(),
                        price: price.to_string(),
                    })
                    .collect();
                next_id.set((loaded.len() + tool_rows.len()) as u32);
                tools.set(ToolPrices {
                    rows: tool_rows,
                    default: t.tool_default.map(|m| m.to_string()).unwrap_or_default(),
                });
                rows.set(loaded);
                if let Some(d) = &t.default {
                    default.set(Row::from(u32::MAX, "", d));
                }
            }
            Ok(None) => {}
            Err(e) => session.check(&e),
        }
    });
    let saved = move |result: Result<PricesSaved, ApiError>, what: &str| match result {
        Ok(s) => {
            errors.set(Vec::new());
            message.set(format!("{what}: policy set version {}", s.version));
        }
        Err(ApiError::Invalid(list)) => {
            message.set(String::new());
            errors.set(
                list.iter()
                    .map(|e| format!("{}: {}", e.path, e.message))
                    .collect(),
            );
        }
        Err(e) => {
            session.check(&e);
            message.set(String::new());
            errors.set(vec![e.to_string()]);
        }
    };
    let save = move |_| {
        let body = rows.with(|r| table(&currency.get(), r, &default.get(), &tools.get()));
        let csrf = session.csrf();
        spawn_local(async move {
            saved(api::replace("/api/v1/prices", &csrf, &body).await, "Saved");
        });
    };
    let remove = move |_| {
        let csrf = session.csrf();
        spawn_local(async move {
            saved(
                api::replace("/api/v1/prices", &csrf, &Value::Null).await,
                "Removed",
            );
        });
    };
    let add = move |_| {
        let id = next_id.get();
        next_id.set(id + 1);
        rows.update(|r| {
            r.push(Row {
                id,
                ..Row::default()
            })
        });
    };
    let edit = move |id: u32, f: fn(&mut Row, String)| {
        move |ev| {
            let text = event_target_value(&ev);
            rows.update(|r| {
                if let Some(row) = r.iter_mut().find(|row| row.id == id) {
                    f(row, text);
                }
            });
        }
    };
    let add_tool = move |_| {
        let id = next_id.get();
        next_id.set(id + 1);
        tools.update(|t| {
            t.rows.push(ToolRow {
                id,
                ..ToolRow::default()
            })
        });
    };
    let edit_tool = move |id: u32, f: fn(&mut ToolRow, String)| {
        move |ev| {
            let text = event_target_value(&ev);
            tools.update(|t| {
                if let Some(row) = t.rows.iter_mut().find(|row| row.id == id) {
                    f(row, text);
                }
            });
        }
    };
    let edit_default = move |f: fn(&mut Row, String)| {
        move |ev| {
            let text = event_target_value(&ev);
            default.update(|d| f(d, text));
        }
    };
    let currencies = move || {
        let current = currency.get();
        let mut list: Vec<String> = CURRENCIES.iter().map(|c| c.to_string()).collect();
        if !list.contains(&current) {
            list.insert(0, current);
        }
        list
    };
    view! {
        <h1>"Prices"</h1>
        <p class="help">"What each model costs, per million tokens, for limits whose cost is money (\"cost\": \"price\"). A name ending in * prices every model it begins; a model not listed is charged the default, or refused without one. Amounts: at most 6 decimal places."</p>
        <label for="prices-currency">"Currency"</label>
        <select id="prices-currency" on:change=move |ev| currency.set(event_target_value(&ev))>
            {move || currencies().into_iter().map(|c| {
                let selected = c == currency.get();
                view! { <option value=c.clone() selected=selected>{c.clone()}</option> }
            }).collect_view()}
        </select>
        <table id="prices">
            <thead><tr><th>"Model"</th><th>"Input"</th><th>"Output"</th><th>"Cached input"</th><th></th></tr></thead>
            <tbody>
                <For each=move || rows.get() key=|r| r.id children=move |r| {
                    let id = r.id;
                    view! {
                        <tr class="price-row">
                            <td><input id=format!("price-{id}-model") prop:value=r.model.clone() on:change=edit(id, |row, t| row.model = t)/></td>
                            <td><input id=format!("price-{id}-input") prop:value=r.input.clone() on:change=edit(id, |row, t| row.input = t)/></td>
                            <td><input id=format!("price-{id}-output") prop:value=r.output.clone() on:change=edit(id, |row, t| row.output = t)/></td>
                            <td><input id=format!("price-{id}-cached") prop:value=r.cached_input.clone() on:change=edit(id, |row, t| row.cached_input = t)/></td>
                            <td><button class="remove-price" on:click=move |_| rows.update(|all| all.retain(|row| row.id != id))>"Remove"</button></td>
                        </tr>
                    }
                }/>
                <tr id="price-default">
                    <td>"(any other model)"</td>
                    <td><input id="price-default-input" prop:value=move || default.get().input on:change=edit_default(|d, t| d.input = t)/></td>
                    <td><input id="price-default-output" prop:value=move || default.get().output on:change=edit_default(|d, t| d.output = t)/></td>
                    <td><input id="price-default-cached" prop:value=move || default.get().cached_input on:change=edit_default(|d, t| d.cached_input = t)/></td>
                    <td></td>
                </tr>
            </tbody>
        </table>
        <button id="add-price" on:click=add>"Add a model"</button>
        <h2>"MCP tools, per call"</h2>
        <p class="help">"What one call of each tool costs, for money limits of policies that count MCP tool calls (match.mcp). A tool not listed is charged the last row's price, or refused without one."</p>
        <table id="tool-prices">
            <thead><tr><th>"Tool"</th><th>"Price per call"</th><th></th></tr></thead>
            <tbody>
                <For each=move || tools.get().rows key=|r| r.id children=move |r| {
                    let id = r.id;
                    view! {
                        <tr class="tool-price-row">
                            <td><input id=format!("tool-{id}-name") prop:value=r.tool.clone() on:change=edit_tool(id, |row, t| row.tool = t)/></td>
                            <td><input id=format!("tool-{id}-price") prop:value=r.price.clone() on:change=edit_tool(id, |row, t| row.price = t)/></td>
                            <td><button class="remove-tool-price" on:click=move |_| tools.update(|all| all.rows.retain(|row| row.id != id))>"Remove"</button></td>
                        </tr>
                    }
                }/>
                <tr id="tool-price-default">
                    <td>"(any other tool)"</td>
                    <td><input id="tool-default-price" prop:value=move || tools.get().default on:change=move |ev| { let text = event_target_value(&ev); tools.update(|t| t.default = text) }/></td>
                    <td></td>
                </tr>
            </tbody>
        </table>
        <button id="add-tool-price" on:click=add_tool>"Add a tool"</button>
        <button id="save-prices" on:click=save>"Save"</button>
        <button id="remove-prices" on:click=remove>"Remove the table"</button>
        <p id="prices-message">{move || message.get()}</p>
        <ul id="prices-errors">
            {move || errors.get().into_iter().map(|e| view! { <li>{e}</li> }).collect_view()}
        </ul>
    }
}
