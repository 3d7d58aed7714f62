//! Every field of a policy the editor shows, by JSON pointer: its label,
//! help and kind of input. Checked against `docs/policy.schema.json` by a
//! test, so the form cannot drift from the schema.

use crate::form::{self, Kind};

/// Every field of a policy, by JSON pointer.
pub const FIELDS: &[(&str, &str, &str, Kind)] = &[
    (
        "Match",
        "Host (exact or *.suffix)",
        "/match/host",
        Kind::Text,
    ),
    ("Match", "Path prefix", "/match/path_prefix", Kind::Text),
    (
        "Match",
        "Methods (comma separated)",
        "/match/methods",
        Kind::List,
    ),
    (
        "Match",
        "Headers (name=value, comma separated)",
        "/match/headers",
        Kind::Headers,
    ),
    (
        "Key",
        "Key header (one bucket per value)",
        "/key/header",
        Kind::Text,
    ),
    (
        "Key",
        "Or a field of the JSON body (e.g. user, model)",
        "/key/json",
        Kind::Text,
    ),
    ("Key", "Max keys", "/key/max_keys", Kind::Number),
    (
        "Key",
        "Past max keys",
        "/key/overflow",
        Kind::Choice(form::OVERFLOWS),
    ),
    (
        "Key",
        "Keys shown in the live view as",
        "/key/label",
        Kind::Choice(form::KEY_LABELS),
    ),
    (
        "Rate",
        "Algorithm",
        "/rate/algorithm",
        Kind::Choice(form::ALGORITHMS),
    ),
    ("Rate", "Requests", "/rate/requests", Kind::Number),
    (
        "Rate",
        "Per period (1s, 1m, 1h or ms)",
        "/rate/period",
        Kind::Duration,
    ),
    ("Rate", "Burst", "/rate/burst", Kind::Number),
    (
        "Rate",
        "Warm-up period",
        "/rate/warmup/period",
        Kind::Duration,
    ),
    (
        "Rate",
        "Warm-up cold factor",
        "/rate/warmup/cold_factor",
        Kind::Number,
    ),
    ("Cost", "Cost header", "/cost/header", Kind::Text),
    ("Cost", "Default cost", "/cost/default", Kind::Number),
    ("Cost", "Max cost", "/cost/max", Kind::Number),
    (
        "Concurrency",
        "Max in flight",
        "/concurrency/max_in_flight",
        Kind::Number,
    ),
    (
        "Concurrency",
        "Lease TTL",
        "/concurrency/lease_ttl",
        Kind::Duration,
    ),
    (
        "Concurrency",
        "Reserved for high priority",
        "/concurrency/reserved_for_high",
        Kind::Number,
    ),
    (
        "Over the limit",
        "Action",
        "/on_limit/action",
        Kind::Choice(form::ACTIONS),
    ),
    ("Over the limit", "Status", "/on_limit/status", Kind::Number),
    ("Over the limit", "Body", "/on_limit/body", Kind::Text),
    (
        "Over the limit",
        "Max wait (queue)",
        "/on_limit/max_wait",
        Kind::Duration,
    ),
    (
        "Over the limit",
        "Max queue",
        "/on_limit/max_queue",
        Kind::Number,
    ),
    (
        "Priority",
        "Priority header",
        "/priority/header",
        Kind::Text,
    ),
    (
        "Priority",
        "Default priority",
        "/priority/default",
        Kind::Choice(form::PRIORITIES),
    ),
    ("Mode", "Mode", "/mode", Kind::Choice(form::MODES)),
    ("Mode", "Scope", "/scope", Kind::Choice(form::SCOPES)),
    (
        "Mode",
        "Share lease (global)",
        "/share_lease",
        Kind::Duration,
    ),
    (
        "Over the limit",
        "RateLimit headers to callers",
        "/ratelimit_headers",
        Kind::Choice(form::RATELIMIT_HEADERS),
    ),
];

/// The fields of one further limit, by pointer below `/limits/<index>`.
pub const LIMIT_FIELDS: &[(&str, &str, Kind)] = &[
    ("Name (letters, digits, - _ .)", "/name", Kind::Text),
    (
        "Algorithm",
        "/rate/algorithm",
        Kind::Choice(form::ALGORITHMS),
    ),
    ("Requests (or tokens)", "/rate/requests", Kind::Number),
    (
        "Per period (1s, 1m, 1h, 1d or ms, at most 31d; or calendar_day, calendar_month ...)",
        "/rate/period",
        Kind::Duration,
    ),
    (
        "Calendar period: time zone (e.g. Europe/Berlin; default UTC)",
        "/rate/time_zone",
        Kind::Text,
    ),
    ("Burst", "/rate/burst", Kind::Number),
    (
        "Or calls in flight at once (a concurrency limit instead of a rate)",
        "/concurrency/max_in_flight",
        Kind::Number,
    ),
    (
        "Concurrency: a slot not given back returns after (default 5m)",
        "/concurrency/lease_ttl",
        Kind::Duration,
    ),
    (
        "Per key: request header (e.g. authorization)",
        "/key/header",
        Kind::Text,
    ),
    (
        "Or per key: a field of the JSON body (e.g. model)",
        "/key/json",
        Kind::Text,
    ),
    ("Per key: most keys held", "/key/max_keys", Kind::Number),
    (
        "Scope (global: one limit for every Envoy)",
        "/scope",
        Kind::Choice(form::SCOPES),
    ),
    ("Estimate: from request header", "/cost/header", Kind::Text),
    (
        "Estimate: from request JSON field (e.g. max_tokens)",
        "/cost/json",
        Kind::Text,
    ),
    (
        "Estimate: plus (e.g. the prompt)",
        "/cost/plus",
        Kind::Number,
    ),
    (
        "Estimate: plus the prompt at these JSON paths (comma separated)",
        "/cost/plus_prompt/paths",
        Kind::List,
    ),
    (
        "Estimate: the prompt's characters per token (default 4)",
        "/cost/plus_prompt/chars_per_token",
        Kind::Number,
    ),
    ("Estimate: default", "/cost/default", Kind::Number),
    (
        "Money: cost in money at the price table, usage read as",
        "/cost/price/usage",
        Kind::Choice(form::USAGE_FORMATS),
    ),
    (
        "Money: request field of the most output tokens (default max_tokens)",
        "/cost/price/output",
        Kind::Text,
    ),
    (
        "Money: output tokens estimated when not asked (default 4096)",
        "/cost/price/default_output",
        Kind::Number,
    ),
    (
        "Money: the prompt at these JSON paths (comma separated)",
        "/cost/price/prompt/paths",
        Kind::List,
    ),
    (
        "Money: the prompt's characters per token",
        "/cost/price/prompt/chars_per_token",
        Kind::Number,
    ),
    ("Estimate: max", "/cost/max", Kind::Number),
    ("Real cost: response header", "/usage/header", Kind::Text),
    (
        "Real cost: response JSON paths, summed (comma separated; path*4 weighs one)",
        "/usage/json",
        Kind::Weighted,
    ),
    (
        "Real cost: paths in a streamed answer (default: the same)",
        "/usage/events",
        Kind::Weighted,
    ),
    (
        "Warn at (shares of the limit, e.g. 0.8, 0.95)",
        "/warn_at",
        Kind::Numbers,
    ),
    (
        "Real cost: ask streams for their usage",
        "/usage/ask_stream_usage",
        Kind::Flag,
    ),
    (
        "Real cost: most body bytes read",
        "/usage/max_body_bytes",
        Kind::Number,
    ),
    (
        "Real cost: unread answers charged",
        "/usage/unread",
        Kind::Number,
    ),
];

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use serde_json::Value;

    use super::*;

    /// Fields of the schema without an input of their own: the editor's
    /// JSON of the policy, below the inputs, edits them (and keeps them
    /// when inputs change).
    const NOT_IN_THE_FORM: &[&str] = &[
        // Its own input above the others (renaming is refused).
        "/name",
        // The list itself: its items are `LIMIT_FIELDS`.
        "/limits",
        // A policy's own cost from the request's JSON is set on a further
        // limit in the form, where token limits live.
        "/cost/json",
        "/cost/plus",
        "/cost/plus_prompt/chars_per_token",
        "/cost/plus_prompt/paths",
        // A price is a further limit's cost only.
        "/cost/price/default_output",
        "/cost/price/output",
        "/cost/price/prompt/chars_per_token",
        "/cost/price/prompt/paths",
        "/cost/price/usage",
        "/cost/price/max_output",
        "/cost/price/model/header",
        "/cost/price/model/json",
        "/cost/price/model/path_after",
        // Where a money limit reads the call's model (the body's `model`
        // by default), and its unread ceiling: in the policy's JSON.
        "/limits/cost/price/max_output",
        "/limits/cost/price/model/header",
        "/limits/cost/price/model/json",
        "/limits/cost/price/model/path_after",
        // A body that cannot be read falls under the policy by default;
        // `next` is in the policy's JSON, beside its `match.json`.
        "/match/unreadable",
        // A limit's figures kept from callers: in the policy's JSON.
        "/limits/tell_spend",
        // Rarely set on a further limit; in the policy's JSON.
        "/limits/concurrency/reserved_for_high",
        "/limits/key/label",
        "/limits/key/overflow",
        // A money limit's downgrade rung (a share and a map of models):
        // in the policy's JSON.
        "/limits/downgrade/at",
        "/limits/downgrade/models",
        // A pool's route rung (a share and a member's name): in the
        // policy's JSON, beside the pool it names.
        "/limits/route/at",
        "/limits/route/member",
        // A queue rung (a share of a fixed window, paced past it): in the
        // policy's JSON, beside its queue's `on_limit`.
        "/limits/queue/at",
        // A calendar period for a policy's own rate (a budget is a
        // further limit's): in the policy's JSON.
        "/rate/time_zone",
        "/limits/rate/warmup/cold_factor",
        "/limits/rate/warmup/period",
        // A pool (members, each a cluster with limits of its own): in the
        // policy's JSON.
        "/pool/members",
        "/pool/route_header",
        "/pool/rule",
        "/pool/sticky/header",
        "/pool/sticky/json",
        // Fair shares (a key, weights and reservations by key value): in
        // the policy's JSON.
        "/fair/default_weight",
        "/fair/key/header",
        "/fair/key/json",
        "/fair/key/label",
        "/fair/key/max_keys",
        "/fair/key/overflow",
        "/fair/min",
        "/fair/weights",
        "/limits/fair/default_weight",
        "/limits/fair/key/header",
        "/limits/fair/key/json",
        "/limits/fair/key/label",
        "/limits/fair/key/max_keys",
        "/limits/fair/key/overflow",
        "/limits/fair/min",
        "/limits/fair/weights",
        // Conditions on the request's JSON body (path and equals, prefix
        // or one_of): in the policy's JSON.
        "/match/json",
        // MCP tool calls (JSON-RPC methods and tools counted): in the
        // policy's JSON.
        "/match/mcp/methods",
        "/match/mcp/tools",
        // Listening to the provider: vendor header names and formats.
        "/limits/provider/adaptive",
        "/limits/provider/headers/ietf",
        "/limits/provider/headers/limit",
        "/limits/provider/headers/remaining",
        "/limits/provider/headers/reset",
        "/limits/provider/headers/reset_format",
        "/limits/provider/max_pause",
        "/limits/provider/pause_on",
    ];

    fn schema() -> Value {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/policy.schema.json");
        let text = std::fs::read_to_string(path).expect("docs/policy.schema.json");
        serde_json::from_str(&text).expect("the schema is JSON")
    }

    /// Follows `$ref`s within the schema.
    fn deref<'a>(schema: &'a Value, node: &'a Value) -> &'a Value {
        match node.get("$ref").and_then(Value::as_str) {
            Some(r) => deref(
                schema,
                schema
                    .pointer(r.trim_start_matches('#'))
                    .unwrap_or_else(|| panic!("{r} is not in the schema")),
            ),
            None => node,
        }
    }

    /// The object (or objects: one per variant) a node may be.
    fn variants<'a>(schema: &'a Value, node: &'a Value) -> Vec<&'a Value> {
        let node = deref(schema, node);
        let branches = ["anyOf", "oneOf", "allOf"]
            .iter()
            .filter_map(|k| node.get(*k).and_then(Value::as_array))
            .flatten()
            .flat_map(|b| variants(schema, b))
            .collect::<Vec<_>>();
        if branches.is_empty() {
            vec![node]
        } else {
            branches
        }
    }

    /// The schema node at a policy field's JSON pointer.
    fn field<'a>(schema: &'a Value, start: &'a Value, pointer: &str) -> Option<&'a Value> {
        let mut node = start;
        for part in pointer.trim_start_matches('/').split('/') {
            node = variants(schema, node)
                .into_iter()
                .find_map(|v| v.get("properties").and_then(|p| p.get(part)))?;
        }
        Some(node)
    }

    /// The words a field may take (`enum` and `const`s, through its
    /// variants).
    fn words(schema: &Value, node: &Value) -> BTreeSet<String> {
        variants(schema, node)
            .into_iter()
            .flat_map(|v| {
                let listed = v.get("enum").and_then(Value::as_array).cloned();
                let one = v.get("const").cloned().map(|c| vec![c]);
                listed.or(one).unwrap_or_default()
            })
            .filter_map(|w| w.as_str().map(str::to_string))
            .collect()
    }

    /// Every leaf of an object node, as pointers below `prefix`.
    fn leaves(schema: &Value, node: &Value, prefix: &str, out: &mut BTreeSet<String>) {
        let objects: Vec<&Value> = variants(schema, node)
            .into_iter()
            .filter(|v| v.get("properties").is_some())
            .collect();
        if objects.is_empty() {
            out.insert(prefix.to_string());
            return;
        }
        for object in objects {
            for (name, child) in object["properties"].as_object().into_iter().flatten() {
                leaves(schema, child, &format!("{prefix}/{name}"), out);
            }
        }
    }

    fn check(schema: &Value, start: &Value, pointer: &str, kind: Kind) {
        let node = field(schema, start, pointer)
            .unwrap_or_else(|| panic!("the form's {pointer} is no field of the schema"));
        if let Kind::Choice(choices) = kind {
            let offered: BTreeSet<String> = choices.iter().map(|c| c.to_string()).collect();
            assert_eq!(offered, words(schema, node), "the choices of {pointer}");
        }
    }

    #[test]
    fn every_field_of_the_form_is_a_field_of_the_schema_with_its_words() {
        let schema = schema();
        let policy = &schema["$defs"]["Policy"];
        let limit = &schema["$defs"]["NamedLimit"];
        for (_, _, pointer, kind) in FIELDS {
            check(&schema, policy, pointer, *kind);
            assert!(!form::help(pointer).is_empty(), "no help for {pointer}");
        }
        for (_, pointer, kind) in LIMIT_FIELDS {
            check(&schema, limit, pointer, *kind);
            assert!(!form::help(pointer).is_empty(), "no help for {pointer}");
        }
    }

    #[test]
    fn every_field_of_the_schema_is_in_the_form_or_said_not_to_be() {
        let schema = schema();
        let mut in_schema = BTreeSet::new();
        leaves(&schema, &schema["$defs"]["Policy"], "", &mut in_schema);
        let mut limit = BTreeSet::new();
        leaves(
            &schema,
            &schema["$defs"]["NamedLimit"],
            "/limits",
            &mut limit,
        );
        in_schema.extend(limit);
        let mut in_form: BTreeSet<String> =
            FIELDS.iter().map(|(_, _, p, _)| p.to_string()).collect();
        in_form.extend(LIMIT_FIELDS.iter().map(|(_, p, _)| format!("/limits{p}")));
        let missing: Vec<&String> = in_schema
            .iter()
            .filter(|p| !in_form.contains(*p) && !NOT_IN_THE_FORM.contains(&p.as_str()))
            .collect();
        assert!(missing.is_empty(), "not in the form: {missing:?}");
        for pointer in NOT_IN_THE_FORM {
            assert!(
                in_schema.contains(*pointer),
                "{pointer}: no field of the schema"
            );
            assert!(
                !in_form.contains(*pointer),
                "{pointer}: in the form after all"
            );
        }
    }
}
