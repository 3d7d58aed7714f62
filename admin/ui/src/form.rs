//! The policy editor's model: the policy as JSON, edited field by field
//! through JSON pointers, so every field of the schema has a form input
//! and the server's error paths (`rate.burst`) land under the right one.

use serde_json::{Map, Value};
use sluice_shared::fleet::Amount;
use sluice_shared::Policy;

/// `rate.burst` → `/rate/burst`; `match.headers[0].name` → `/match/headers/0/name`.
pub fn error_path_to_pointer(path: &str) -> String {
    let mut out = String::new();
    for part in path.split('.') {
        let (field, rest) = part.split_once('[').unwrap_or((part, ""));
        if !field.is_empty() {
            out.push('/');
            out.push_str(field);
        }
        for index in rest.split('[') {
            let index = index.trim_end_matches(']');
            if !index.is_empty() {
                out.push('/');
                out.push_str(index);
            }
        }
    }
    out
}

pub fn get(value: &Value, pointer: &str) -> Option<Value> {
    value.pointer(pointer).cloned()
}

/// The input's text for a field.
pub fn text_of(value: &Value, pointer: &str) -> String {
    match value.pointer(pointer) {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(items)) => items
            .iter()
            .map(
                |i| match (i.get("name").and_then(Value::as_str), i.get("equals")) {
                    (Some(name), Some(Value::String(equals))) => format!("{name}={equals}"),
                    (Some(name), None) => name.to_string(),
                    _ => i
                        .as_str()
                        .map(str::to_string)
                        .unwrap_or_else(|| i.to_string()),
                },
            )
            .collect::<Vec<_>>()
            .join(", "),
        // Weighed paths: `path*weight`, the weight left out when it is 1.
        Some(Value::Object(weights)) => weights
            .iter()
            .map(|(path, weight)| match weight.as_i64() {
                Some(1) => path.clone(),
                _ => format!("{path}*{weight}"),
            })
            .collect::<Vec<_>>()
            .join(", "),
        Some(other) => other.to_string(),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Text,
    /// An integer when the text is one, else a decimal (`3.4`);
    /// otherwise kept as text so the server can say what is wrong with it.
    Number,
    /// A duration: `1s`, `250ms`, or milliseconds.
    Duration,
    /// A comma-separated list.
    List,
    /// A comma-separated list of numbers (`0.8, 0.95`); an item that is
    /// none is kept as text, for the server to name.
    Numbers,
    /// A list whose items may carry a whole-number weight: `a, b*4, c*-1`;
    /// a map of item to weight when any weight is not 1.
    Weighted,
    /// One of these words (a select; empty: the default).
    Choice(&'static [&'static str]),
    /// `true` or `false` (a select of the two; empty: the default).
    Flag,
    /// Header conditions: `name=value, name=value` → `[{name, equals}]`.
    Headers,
}

pub const ALGORITHMS: &[&str] = &["token_bucket", "fixed_window", "sliding_window"];
pub const OVERFLOWS: &[&str] = &["shared", "reject"];
pub const KEY_LABELS: &[&str] = &["hash", "value", "field"];
pub const ACTIONS: &[&str] = &["reject", "queue"];
pub const MODES: &[&str] = &["enforce", "shadow"];
pub const SCOPES: &[&str] = &["instance", "global"];
pub const PRIORITIES: &[&str] = &["normal", "high"];
pub const RATELIMIT_HEADERS: &[&str] = &["refusals", "always"];
pub const USAGE_FORMATS: &[&str] = &["openai", "anthropic"];
/// A [`Kind::Flag`]'s words.
pub const FLAGS: &[&str] = &["true", "false"];

/// The JSON a field's text stands for; None removes the field.
pub fn parse_input(kind: Kind, text: &str) -> Option<Value> {
    let t = text.trim();
    if t.is_empty() {
        return None;
    }
    Some(match kind {
        Kind::Text | Kind::Duration | Kind::Choice(_) => Value::String(t.to_string()),
        // A pair without `=` goes as a name alone: the server says what is
        // missing.
        Kind::Headers => Value::Array(
            t.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(|pair| match pair.split_once('=') {
                    Some((name, value)) => {
                        serde_json::json!({"name": name.trim(), "equals": value.trim()})
                    }
                    None => serde_json::json!({ "name": pair }),
                })
                .collect(),
        ),
        Kind::Number => t
            .parse::<i64>()
            .map(Value::from)
            .ok()
            .or_else(|| {
                let decimal = t.parse::<f64>().ok()?;
                serde_json::Number::from_f64(decimal).map(Value::Number)
            })
            .unwrap_or_else(|| Value::String(t.to_string())),
        Kind::List => Value::Array(
            t.split(',')
                .map(|s| s.trim())
                .filter(|s| !s.is_empty())
                .map(|s| Value::String(s.to_string()))
                .collect(),
        ),
        Kind::Weighted => weighted(t),
        Kind::Numbers => Value::Array(
            t.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(|s| {
                    s.parse::<f64>()
                        .ok()
                        .and_then(serde_json::Number::from_f64)
                        .map_or_else(|| Value::String(s.to_string()), Value::Number)
                })
                .collect(),
        ),
        Kind::Flag => match t {
            "true" => Value::Bool(true),
            "false" => Value::Bool(false),
            other => Value::String(other.to_string()),
        },
    })
}

/// `a, b*4, c*-1`: a list while every weight is 1, else a map of item to
/// weight (a weight that is not a whole number is kept as text, for the
/// validation to name).
fn weighted(text: &str) -> Value {
    let items: Vec<(String, Value)> = text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|item| match item.rsplit_once('*') {
            Some((path, weight)) => {
                let weight = weight.trim();
                let value = weight
                    .parse::<i64>()
                    .map(Value::from)
                    .unwrap_or_else(|_| Value::String(weight.to_string()));
                (path.trim().to_string(), value)
            }
            None => (item.to_string(), Value::from(1)),
        })
        .collect();
    if items.iter().all(|(_, weight)| weight.as_i64() == Some(1)) {
        Value::Array(
            items
                .into_iter()
                .map(|(path, _)| Value::String(path))
                .collect(),
        )
    } else {
        Value::Object(items.into_iter().collect())
    }
}

/// Sets (or with None removes) the value at `pointer`, creating the objects
/// on the way and dropping objects left empty.
pub fn set(value: &mut Value, pointer: &str, new: Option<Value>) {
    let parts: Vec<&str> = pointer.split('/').skip(1).collect();
    set_in(value, &parts, new);
}

fn set_in(value: &mut Value, parts: &[&str], new: Option<Value>) {
    let Some((first, rest)) = parts.split_first() else {
        return;
    };
    // An item of a list (`/limits/0/name`): set inside it; the list keeps
    // its items even when one is left empty.
    if let (Some(items), Ok(index)) = (value.as_array_mut(), first.parse::<usize>()) {
        if let Some(item) = items.get_mut(index) {
            if rest.is_empty() {
                if let Some(v) = new {
                    *item = v;
                }
            } else {
                set_in(item, rest, new);
            }
        }
        return;
    }
    if !value.is_object() {
        *value = Value::Object(Map::new());
    }
    let Some(map) = value.as_object_mut() else {
        return;
    };
    if rest.is_empty() {
        match new {
            Some(v) => {
                map.insert((*first).to_string(), v);
            }
            None => {
                map.remove(*first);
            }
        }
        return;
    }
    if new.is_none() && !map.contains_key(*first) {
        return;
    }
    let child = map
        .entry((*first).to_string())
        .or_insert_with(|| Value::Object(Map::new()));
    set_in(child, rest, new);
    if child.as_object().is_some_and(|o| o.is_empty()) {
        map.remove(*first);
    }
}

/// One-line summaries for the policy table.
pub fn summary_match(p: &Policy) -> String {
    let host = &p.matcher.host;
    match &p.matcher.path_prefix {
        Some(prefix) => format!("{host}{prefix}"),
        None => host.clone(),
    }
}

pub fn summary_rate(p: &Policy) -> String {
    let Some(r) = &p.rate else {
        return "—".into();
    };
    let burst = r.burst.map(|b| format!(", burst {b}")).unwrap_or_default();
    let per_key = p
        .key
        .as_ref()
        .map(|k| format!(", per {}", k.source()))
        .unwrap_or_default();
    format!("{} / {}{}{}", r.requests, r.period, burst, per_key)
}

pub fn summary_concurrency(p: &Policy) -> String {
    match &p.concurrency {
        Some(c) => format!("{} in flight", c.max_in_flight),
        None => "—".into(),
    }
}

/// The rate limit in requests per second, for utilization bars; None for a
/// per-key limit, whose total grows with the number of keys.
pub fn rate_per_second(p: &Policy) -> Option<f64> {
    if p.key.is_some() || p.rate.is_none() {
        return None;
    }
    Some(Amount::of_policy(p).rate)
}

/// Adds a further limit to the policy's `limits`, to be filled in.
pub fn add_limit(policy: &mut Value) {
    let Some(map) = policy.as_object_mut() else {
        return;
    };
    let limits = map
        .entry("limits")
        .or_insert_with(|| Value::Array(Vec::new()));
    if let Some(items) = limits.as_array_mut() {
        items.push(serde_json::json!({"name": "", "rate": {"requests": 1000, "period": "1m"}}));
    }
}

/// Sets `sub` (`/rate/requests`, `/concurrency/max_in_flight`, ...) of
/// the policy's `index`th further limit. A limit is a rate or a
/// concurrency limit: a value given to one drops the other.
pub fn set_limit_field(policy: &mut Value, index: usize, sub: &str, new: Option<Value>) {
    let other = if sub.starts_with("/concurrency/") {
        Some("rate")
    } else if sub.starts_with("/rate/") {
        Some("concurrency")
    } else {
        None
    };
    if let (Some(other), true) = (other, new.is_some()) {
        if let Some(limit) = policy
            .get_mut("limits")
            .and_then(|l| l.get_mut(index))
            .and_then(Value::as_object_mut)
        {
            limit.remove(other);
        }
    }
    set(policy, &format!("/limits/{index}{sub}"), new);
}

/// Removes the policy's `index`th further limit (and `limits` once empty).
pub fn remove_limit(policy: &mut Value, index: usize) {
    let Some(map) = policy.as_object_mut() else {
        return;
    };
    let now_empty = match map.get_mut("limits").and_then(Value::as_array_mut) {
        Some(items) if index < items.len() => {
            items.remove(index);
            items.is_empty()
        }
        _ => false,
    };
    if now_empty {
        map.remove("limits");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn error_paths_become_pointers() {
        assert_eq!(error_path_to_pointer("rate.burst"), "/rate/burst");
        assert_eq!(
            error_path_to_pointer("match.headers[0].name"),
            "/match/headers/0/name"
        );
        assert_eq!(error_path_to_pointer("name"), "/name");
    }

    #[test]
    fn fields_are_set_and_removed_without_leaving_empty_objects() {
        let mut p = json!({"name": "a"});
        set(&mut p, "/rate/requests", parse_input(Kind::Number, "100"));
        set(&mut p, "/rate/period", parse_input(Kind::Duration, "1s"));
        set(
            &mut p,
            "/match/methods",
            parse_input(Kind::List, "GET, POST"),
        );
        assert_eq!(
            p,
            json!({"name": "a", "rate": {"requests": 100, "period": "1s"}, "match": {"methods": ["GET", "POST"]}})
        );
        assert_eq!(text_of(&p, "/match/methods"), "GET, POST");
        set(&mut p, "/rate/requests", None);
        set(&mut p, "/rate/period", parse_input(Kind::Duration, " "));
        assert_eq!(
            p,
            json!({"name": "a", "match": {"methods": ["GET", "POST"]}})
        );
        // Not a number: kept as text for the server to refuse with a reason.
        assert_eq!(parse_input(Kind::Number, "3.4"), Some(json!(3.4)));
        assert_eq!(parse_input(Kind::Flag, "true"), Some(json!(true)));
        assert_eq!(parse_input(Kind::Flag, "false"), Some(json!(false)));
        assert_eq!(parse_input(Kind::Flag, ""), None);
        assert_eq!(
            parse_input(Kind::Numbers, "0.8, 0.95"),
            Some(json!([0.8, 0.95]))
        );
        assert_eq!(
            parse_input(Kind::Numbers, "0.8, most"),
            Some(json!([0.8, "most"]))
        );
        assert_eq!(parse_input(Kind::Number, "NaN"), Some(json!("NaN")));
        set(&mut p, "/rate/burst", parse_input(Kind::Number, "ten"));
        assert_eq!(p["rate"]["burst"], "ten");
    }

    #[test]
    fn summaries_and_rates() {
        let policy = |v: Value| -> Policy { serde_json::from_value(v).unwrap() };
        let mut p = json!({"name": "bank", "match": {"host": "api.bank.example", "path_prefix": "/v1"},
            "rate": {"requests": 120, "period": "1m", "burst": 10}, "concurrency": {"max_in_flight": 4}});
        assert_eq!(summary_match(&policy(p.clone())), "api.bank.example/v1");
        assert_eq!(summary_rate(&policy(p.clone())), "120 / 1m, burst 10");
        p["key"] = json!({"header": "x-api-key"});
        assert_eq!(
            summary_rate(&policy(p.clone())),
            "120 / 1m, burst 10, per x-api-key"
        );
        assert_eq!(rate_per_second(&policy(p.clone())), None);
        p.as_object_mut().unwrap().remove("key");
        assert_eq!(summary_concurrency(&policy(p.clone())), "4 in flight");
        assert_eq!(rate_per_second(&policy(p)), Some(2.0));
    }

    #[test]
    fn a_further_limit_is_a_rate_or_a_concurrency_limit() {
        let mut p = json!({"name": "api", "limits": [{"name": "a", "rate": {"requests": 1, "period": "1m"}}]});
        set_limit_field(&mut p, 0, "/concurrency/max_in_flight", Some(json!(20)));
        assert_eq!(
            p["limits"][0],
            json!({"name": "a", "concurrency": {"max_in_flight": 20}})
        );
        // Clearing a field drops nothing else.
        set_limit_field(&mut p, 0, "/rate/burst", None);
        assert_eq!(p["limits"][0]["concurrency"]["max_in_flight"], 20);
        set_limit_field(&mut p, 0, "/rate/requests", Some(json!(5)));
        assert_eq!(
            p["limits"][0],
            json!({"name": "a", "rate": {"requests": 5}})
        );
        set_limit_field(&mut p, 0, "/name", Some(json!("b")));
        assert_eq!(p["limits"][0]["rate"]["requests"], 5);
        // A limit that is not there is not made.
        set_limit_field(&mut p, 4, "/concurrency/max_in_flight", Some(json!(1)));
        assert_eq!(p["limits"].as_array().map(Vec::len), Some(1));
    }

    #[test]
    fn a_further_limits_fields_are_set_inside_the_list() {
        let mut p = json!({"name": "llm", "limits": [{"name": "a", "rate": {"requests": 1, "period": "1m"}}]});
        set(
            &mut p,
            "/limits/0/usage/json",
            parse_input(Kind::List, "usage.input_tokens, usage.output_tokens"),
        );
        set(
            &mut p,
            "/limits/0/cost/json",
            parse_input(Kind::Text, "max_tokens"),
        );
        set(&mut p, "/limits/3/name", parse_input(Kind::Text, "nowhere"));
        assert_eq!(
            p["limits"],
            json!([{"name": "a", "rate": {"requests": 1, "period": "1m"},
                    "cost": {"json": "max_tokens"},
                    "usage": {"json": ["usage.input_tokens", "usage.output_tokens"]}}])
        );
        add_limit(&mut p);
        assert_eq!(p["limits"][1]["rate"]["requests"], 1000);
        remove_limit(&mut p, 0);
        remove_limit(&mut p, 7);
        assert_eq!(p["limits"].as_array().map(Vec::len), Some(1));
        remove_limit(&mut p, 0);
        assert!(p.get("limits").is_none());
        assert_eq!(
            error_path_to_pointer("limits[0].usage.json[1]"),
            "/limits/0/usage/json/1"
        );
    }
}

/// One line on what a field does, by its pointer (a further limit's by
/// the pointer below `/limits/<index>`).
pub fn help(pointer: &str) -> &'static str {
    match pointer {
        "/name" => "Letters, digits, - _ . ; unique in the set.",
        "/match/host" => "The request's :authority: exact, *.suffix for subdomains, or * for any.",
        "/match/path_prefix" => "Only paths starting with this (empty: any path).",
        "/match/methods" => "Only these methods, e.g. GET, POST (empty: any).",
        "/match/headers" => "Only requests whose headers equal these values, e.g. x-tenant=acme.",
        "/key/header" => "One bucket per value of this header (per API key, per tenant).",
        "/key/json" => "Or one bucket per value of this field of the request's JSON body (model, user, metadata.team); the body is then read before the call is decided.",
        "/key/max_keys" => "Keys tracked at once; an idle key gives its place to a new one.",
        "/key/overflow" => "Past max keys: share one extra bucket, or refuse the newcomers.",
        "/key/label" => "How the live view names keys: a hash (raw keys stay in Envoy), the value for non-secret ones, or for a key of a header and a body field the field alone (an API key's model).",
        "/rate/algorithm" => "token_bucket smooths with a burst; windows count per period.",
        "/rate/requests" => "Calls (or cost units) allowed per period.",
        "/rate/period" => "The period: 1s, 1m, 1h, up to 31d; or a calendar unit (calendar_day, calendar_week, calendar_month, calendar_quarter, calendar_year; fixed_window), renewed at local midnight or on the 1st.",
        "/rate/time_zone" => "The IANA zone a calendar period renews in (Europe/Berlin, America/New_York); default UTC.",
        "/rate/burst" => {
            "Calls allowed at once after an idle spell (token bucket; default: requests)."
        }
        "/rate/warmup/period" => "Ramp up to the full rate over this long after idling.",
        "/rate/warmup/cold_factor" => {
            "How much slower a cold start begins (e.g. 3: a third of the rate)."
        }
        "/cost/header" => "A call costs this request header's number (e.g. tokens asked for).",
        "/cost/json" => "Or this path in the request's JSON body, e.g. max_tokens.",
        "/cost/default" => "The cost when the header or field is missing or not a number.",
        "/cost/max" => "Costs above this are counted as this.",
        "/cost/plus" => "Added to every estimate (e.g. a chat's framing: 3 tokens a message and 3 for the reply).",
        "/usage/ask_stream_usage" => "OpenAI-style streams that do not ask for their usage are sent asking; what that adds to the answer is taken out before the caller sees it.",
        "/warn_at" => "Warning lines, shares of the limit (0.8, 0.95): calls past one get x-sluice-warn, and each crossing goes to the audit log.",
        "/cost/price/usage" => "Makes the limit count money at the price table's prices (its rate then counts millionths of the currency: 500 USD is 500000000); how the answer reports its tokens.",
        "/cost/price/output" => "The request's field of the most output tokens it asks for; the estimate prices that much output.",
        "/cost/price/default_output" => "Output tokens estimated for a request that does not say.",
        "/cost/price/prompt/paths" => "Where the prompt is (default messages, input, prompt, system): its characters are priced as input.",
        "/cost/price/prompt/chars_per_token" => "Characters a token holds: 4 for English, about 3.4 for JSON.",
        "/cost/plus_prompt/paths" => "Where the prompt is in the request's JSON (messages, input, prompt): its text's characters are added to the estimate.",
        "/cost/plus_prompt/chars_per_token" => "Characters a token holds: 4 for English, about 3.4 for JSON or code.",
        "/usage/header" => "The real cost, from this response header, settles the estimate.",
        "/usage/json" => "Or these paths in the response's JSON (their sum); a weight after a star counts a path that many times (usage.completion_tokens*4) or takes it off (usage.prompt_tokens_details.cached_tokens*-1).",
        "/usage/events" => "Read the usage from a streamed (event-stream) answer.",
        "/usage/max_body_bytes" => "The largest answer read for its usage.",
        "/usage/unread" => {
            "An answer whose usage cannot be read is charged: max (the cost's most), estimate, or a number."
        }
        "/concurrency/max_in_flight" => "Calls in flight at once, across every worker.",
        "/concurrency/lease_ttl" => "A slot whose call never ended is taken back after this.",
        "/concurrency/reserved_for_high" => "Slots only high-priority calls may take.",
        "/on_limit/action" => "reject answers at once; queue waits for room up to max wait.",
        "/on_limit/status" => "The refusal's status (default 429).",
        "/on_limit/body" => "The refusal's body.",
        "/on_limit/max_wait" => "Longest a queued call waits before it is refused.",
        "/on_limit/max_queue" => "Most calls waiting at once; more are refused.",
        "/priority/header" => "This header says a call's priority: high or normal.",
        "/priority/default" => "The priority of calls without the header.",
        "/mode" => "shadow counts what it would refuse and refuses nothing.",
        "/scope" => "global: one limit for every Envoy, shared out by the admin.",
        "/share_lease" => "How long a global policy's share lasts without a sync.",
        "/ratelimit_headers" => "always: every answer tells callers what is left (RateLimit).",
        _ => "",
    }
}

#[cfg(test)]
mod help_tests {
    use super::*;

    #[test]
    fn headers_read_and_write_as_name_value_pairs() {
        let value = parse_input(Kind::Headers, "x-tenant=acme, x-env = prod, broken").unwrap();
        assert_eq!(
            value,
            serde_json::json!([
                {"name": "x-tenant", "equals": "acme"},
                {"name": "x-env", "equals": "prod"},
                {"name": "broken"}
            ])
        );
        let policy = serde_json::json!({"match": {"headers": value}});
        assert_eq!(
            text_of(&policy, "/match/headers"),
            "x-tenant=acme, x-env=prod, broken"
        );
        assert_eq!(
            parse_input(Kind::Choice(MODES), "shadow"),
            Some(Value::String("shadow".into()))
        );
        assert_eq!(parse_input(Kind::Choice(MODES), ""), None);
    }

    /// Every word a select offers is one the policy schema takes.
    #[test]
    fn every_choice_is_accepted_by_the_schema() {
        use sluice_shared::{Algorithm, KeyLabel, KeyOverflow, LimitAction, Mode, Scope};
        fn takes<T: serde::de::DeserializeOwned>(words: &[&str]) {
            for w in words {
                assert!(
                    serde_json::from_value::<T>(Value::String((*w).into())).is_ok(),
                    "{w}"
                );
            }
        }
        takes::<Algorithm>(ALGORITHMS);
        takes::<KeyOverflow>(OVERFLOWS);
        takes::<KeyLabel>(KEY_LABELS);
        takes::<LimitAction>(ACTIONS);
        takes::<Mode>(MODES);
        takes::<Scope>(SCOPES);
    }

    /// Weighed usage paths: `path*weight` in the input, a list while every
    /// weight is 1, a map otherwise, and shown back as they were typed.
    #[test]
    fn weighed_paths_read_and_show_as_typed() {
        let typed = "usage.prompt_tokens, usage.completion_tokens*4, usage.cached*-1";
        let value = parse_input(Kind::Weighted, typed);
        assert_eq!(
            value,
            Some(
                serde_json::json!({"usage.prompt_tokens": 1, "usage.completion_tokens": 4, "usage.cached": -1})
            )
        );
        let mut p = serde_json::json!({"usage": {}});
        set(&mut p, "/usage/json", value);
        let mut shown: Vec<String> = text_of(&p, "/usage/json")
            .split(", ")
            .map(str::to_string)
            .collect();
        shown.sort();
        assert_eq!(
            shown,
            [
                "usage.cached*-1",
                "usage.completion_tokens*4",
                "usage.prompt_tokens"
            ]
        );
        assert_eq!(
            parse_input(Kind::Weighted, "a, b*1"),
            Some(serde_json::json!(["a", "b"]))
        );
        assert_eq!(
            parse_input(Kind::Weighted, "a*x"),
            Some(serde_json::json!({"a": "x"})),
            "kept for the validation to name"
        );
    }

    #[test]
    fn every_choice_and_common_field_has_help() {
        for pointer in [
            "/rate/algorithm",
            "/key/overflow",
            "/key/label",
            "/on_limit/action",
            "/mode",
            "/scope",
            "/share_lease",
            "/match/headers",
        ] {
            assert!(!help(pointer).is_empty(), "{pointer}");
        }
    }
}
