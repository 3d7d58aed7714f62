//! Fuzzing with proptest: every parser and decoder that takes input from
//! outside (policy JSON from operators and the admin, the plugin
//! configuration, request headers, shared-data bytes another VM wrote,
//! sync reports) gets arbitrary input, and must answer with a value or a
//! typed error, never a panic.
//!
//! The budget is `SLUICE_FUZZ_CASES` cases per target: 10 000 in `make
//! test`, 1 000 000 in `make soak`. Each target prints what it ran.

use std::time::Instant;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use serde_json::{json, Map, Value};
use sluice_filter_core::bucket::BucketState;
use sluice_filter_core::matcher::{BodyJson, Classified, KeySecrets};
use sluice_filter_core::plugin::parse_plugin_config;
use sluice_filter_core::CompiledPolicySet;
use sluice_shared::limiter::{
    FixedWindowState, LeaseTable, RateState, SlidingWindowState, TokenBucketState,
};
use sluice_shared::{parse_policy_set, DurationMs, RequestHeaders};
use sluice_wire::sync::SyncReport;

fn budget() -> u32 {
    std::env::var("SLUICE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000)
}

/// Runs `check` on `budget()` inputs from `strategy`; a panic (or a
/// failed check) fails the test with the shrunk input.
fn fuzz<S: Strategy>(target: &str, strategy: S, check: impl Fn(S::Value) -> Result<(), String>)
where
    S::Value: std::fmt::Debug,
{
    let cases = budget();
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let started = Instant::now();
    let result = runner.run(&strategy, |input| {
        check(input).map_err(proptest::test_runner::TestCaseError::fail)
    });
    match result {
        Ok(()) => println!(
            "fuzz {target}: {cases} cases in {:.1?}, 0 panics",
            started.elapsed()
        ),
        Err(e) => panic!("fuzz {target}: {e}"),
    }
}

/// Words of the policy schema, so generated JSON reaches deep into the
/// validator instead of stopping at the first unknown field.
const KEYS: &[&str] = &[
    "version",
    "policies",
    "name",
    "match",
    "host",
    "path_prefix",
    "methods",
    "headers",
    "equals",
    "key",
    "header",
    "max_keys",
    "overflow",
    "rate",
    "algorithm",
    "requests",
    "period",
    "burst",
    "warmup",
    "cold_factor",
    "cost",
    "default",
    "max",
    "concurrency",
    "max_in_flight",
    "lease_ttl",
    "reserved_for_high",
    "on_limit",
    "action",
    "max_wait",
    "max_queue",
    "status",
    "body",
    "priority",
    "high",
    "mode",
    "instance",
    "admin_cluster",
    "sync_interval",
    "sync_token",
    "fallback",
    "policy_version",
    "at_ms",
    "admitted",
];

const WORDS: &[&str] = &[
    "1s",
    "0s",
    "100ms",
    "2m",
    "1h",
    "-1s",
    "1.5s",
    "99999999999999h",
    "",
    "*",
    "*.example.com",
    "api.bank.example",
    "token_bucket",
    "fixed_window",
    "sliding_window",
    "reject",
    "queue",
    "shadow",
    "enforce",
    "shared",
    "GET",
    "x-api-key",
    "<script>",
    "\u{0}",
    "é",
    "bank",
];

fn scalar() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<u64>().prop_map(|n| json!(n)),
        (0u64..2_000).prop_map(|n| json!(n)),
        any::<i64>().prop_map(|n| json!(n)),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        prop::sample::select(WORDS).prop_map(|w| json!(w)),
        ".{0,40}".prop_map(Value::String),
    ]
}

fn json_value() -> impl Strategy<Value = Value> {
    scalar().prop_recursive(5, 96, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            prop::collection::vec((prop::sample::select(KEYS), inner), 0..8).prop_map(|kv| {
                Value::Object(
                    kv.into_iter()
                        .map(|(k, v)| (k.to_string(), v))
                        .collect::<Map<_, _>>(),
                )
            }),
        ]
    })
}

/// A policy set made of schema-shaped parts: a mostly valid policy with
/// some of its fields replaced by arbitrary values.
fn policy_set_json() -> impl Strategy<Value = String> {
    let base = json!({"name": "bank", "match": {"host": "api.bank.example", "path_prefix": "/v1"},
        "key": {"header": "x-api-key", "max_keys": 10},
        "rate": {"requests": 100, "period": "1s", "burst": 20},
        "concurrency": {"max_in_flight": 8, "lease_ttl": "30s"},
        "on_limit": {"action": "queue", "max_wait": "2s"}});
    let paths: &[&[&str]] = &[
        &["name"],
        &["match"],
        &["match", "host"],
        &["match", "path_prefix"],
        &["key"],
        &["key", "max_keys"],
        &["rate"],
        &["rate", "requests"],
        &["rate", "period"],
        &["rate", "burst"],
        &["rate", "algorithm"],
        &["concurrency", "max_in_flight"],
        &["concurrency", "lease_ttl"],
        &["on_limit"],
        &["on_limit", "action"],
        &["cost"],
        &["priority"],
        &["mode"],
        &["extra"],
    ];
    (
        prop::collection::vec((prop::sample::select(paths), json_value()), 0..4),
        any::<u64>(),
        0usize..3,
    )
        .prop_map(move |(edits, version, copies)| {
            let mut policy = base.clone();
            for (path, value) in edits {
                let mut at = &mut policy;
                for (i, part) in path.iter().enumerate() {
                    if !at.is_object() {
                        *at = json!({});
                    }
                    if i + 1 == path.len() {
                        at[*part] = value.clone();
                    } else {
                        at = &mut at[*part];
                    }
                }
            }
            json!({"version": version, "policies": vec![policy; copies.max(1)]}).to_string()
        })
}

#[test]
fn policy_parser_and_validator() {
    fuzz(
        "policy set from arbitrary bytes",
        prop::collection::vec(any::<u8>(), 0..512),
        |bytes| {
            let text = String::from_utf8_lossy(&bytes);
            let _ = parse_policy_set(&text);
            Ok(())
        },
    );
    fuzz("policy set from arbitrary JSON", json_value(), |value| {
        let _ = parse_policy_set(&value.to_string());
        Ok(())
    });
    let accepted = std::sync::atomic::AtomicU32::new(0);
    fuzz(
        "policy set from schema-shaped JSON",
        policy_set_json(),
        |text| {
            match parse_policy_set(&text) {
                // What validation lets through compiles and survives a round trip.
                Ok(set) => {
                    accepted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let again = serde_json::to_string(&set).map_err(|e| e.to_string())?;
                    let reparsed = parse_policy_set(&again).map_err(|e| format!("{again}: {e}"))?;
                    if reparsed != set {
                        return Err(format!("round trip changed {text}"));
                    }
                    let _ = CompiledPolicySet::from_validated(set);
                    Ok(())
                }
                // A refusal always says where and why.
                Err(errors) => {
                    if errors.errors.is_empty()
                        || errors.errors.iter().any(|e| e.message.is_empty())
                    {
                        return Err(format!("an error without a reason for {text}: {errors:?}"));
                    }
                    Ok(())
                }
            }
        },
    );
    // Shrinking would re-run cases, so this is the share, near enough.
    let accepted = accepted.into_inner();
    println!(
        "fuzz policy set from schema-shaped JSON: {accepted} valid, the rest refused with reasons"
    );
    assert!(accepted > 0, "the generator reaches valid sets too");
}

#[test]
fn plugin_configuration_and_durations() {
    fuzz(
        "plugin configuration from arbitrary bytes",
        prop::collection::vec(any::<u8>(), 0..512),
        |bytes| {
            let _ = parse_plugin_config(&bytes);
            Ok(())
        },
    );
    fuzz(
        "plugin configuration from arbitrary JSON",
        json_value(),
        |value| {
            let _ = parse_plugin_config(value.to_string().as_bytes());
            Ok(())
        },
    );
    fuzz("durations", "[0-9.a-zµ -]{0,24}", |text| {
        let _ = DurationMs::parse(&text);
        Ok(())
    });
}

/// A request as Envoy hands it over: any header may be missing, huge or
/// not UTF-8.
#[derive(Debug)]
struct Request(Vec<(String, Vec<u8>)>);

impl RequestHeaders for Request {
    fn header(&self, name: &str) -> Option<std::borrow::Cow<'_, [u8]>> {
        self.0
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| std::borrow::Cow::Borrowed(v.as_slice()))
    }
}

fn request() -> impl Strategy<Value = Request> {
    let names = prop_oneof![
        prop::sample::select(
            &[
                ":authority",
                ":path",
                ":method",
                "x-api-key",
                "x-cost",
                "x-priority",
                "x-tenant",
            ][..]
        )
        .prop_map(str::to_string),
        "[a-z-]{1,12}",
    ];
    let values = prop_oneof![
        prop::collection::vec(any::<u8>(), 0..64),
        prop::sample::select(
            &[
                "api.bank.example",
                "API.BANK.EXAMPLE:443",
                "x.llm.example",
                "/v1/pay",
                "GET",
                "POST",
                "18446744073709551616",
                "-1",
                "0",
                "7",
                "high",
                "",
            ][..]
        )
        .prop_map(|s| s.as_bytes().to_vec()),
        (1usize..70_000).prop_map(|n| vec![b'k'; n]),
    ];
    prop::collection::vec((names, values), 0..8).prop_map(Request)
}

#[test]
fn matcher_on_arbitrary_headers() {
    let set = CompiledPolicySet::from_json(
        &json!({"version": 1, "policies": [
            {"name": "bank", "match": {"host": "api.bank.example", "path_prefix": "/v1",
              "methods": ["GET", "POST"], "headers": [{"name": "x-tenant", "equals": "a"}]},
             "key": {"header": "x-api-key", "max_keys": 100},
             "rate": {"requests": 100, "period": "1s"},
             "cost": {"header": "x-cost", "default": 1, "max": 50}},
            {"name": "llm", "match": {"host": "*.llm.example"},
             "concurrency": {"max_in_flight": 8, "reserved_for_high": 2},
             "priority": {"header": "x-priority"}},
            {"name": "rest", "match": {"host": "*"}, "rate": {"requests": 10, "period": "1s"}}]})
        .to_string(),
    )
    .unwrap_or_else(|e| panic!("the fuzzed policy set is valid: {e}"));
    fuzz("matcher and classification", request(), |req| {
        let secret = sluice_shared::KeySecret::from_bytes([3; sluice_shared::KeySecret::LEN]);
        let classified = set.classify(&req, KeySecrets::new(&secret, None), &BodyJson::Absent);
        let Some(c) = classified.class() else {
            return Err("the catch-all policy matches everything".into());
        };
        if c.cost == 0 || c.cost > 50 {
            return Err(format!("cost {} outside 1..=50", c.cost));
        }
        Ok(())
    });
}

/// Request bodies: JSON of any shape (deep, huge numbers, fields of every
/// type where the match, the keys and the prompt estimate look), and bytes
/// that are not JSON. Classifying on them never panics, costs stay in
/// 1..=max however long the prompt, a body that cannot be read falls under
/// the policy whose headers it matched (one naming a key twice is refused
/// there), and the catch-all takes every other call.
#[test]
fn matcher_on_arbitrary_bodies() {
    let set = CompiledPolicySet::from_json(
        &json!({"version": 1,
            "prices": {"currency": "USD", "models": {"gpt-4o": {"input": 2.5, "output": 10}, "user*": {"input": 100000, "output": 100000}}},
            "policies": [
            {"name": "gpt", "match": {"host": "*", "json": [{"path": "model", "prefix": "gpt-"},
                                                          {"path": "meta.tier", "one_of": ["1", "true", "gold"]}]},
             "key": {"json": "user"}, "rate": {"requests": 100, "period": "1s"},
             "limits": [{"name": "tokens", "key": {"json": "messages.0.role"},
                         "rate": {"requests": 1000, "period": "1m"},
                         "cost": {"json": "max_tokens", "default": 5, "max": 500,
                                  "plus_prompt": {"paths": ["messages", "meta.tier"], "chars_per_token": 0.25}}},
                        {"name": "money", "rate": {"requests": 1000000000, "period": "1d", "algorithm": "fixed_window"},
                         "cost": {"price": {"output": "max_tokens", "prompt": {"paths": ["messages", "model"], "chars_per_token": 0.25}}}}]},
            {"name": "rest", "match": {"host": "*"}, "rate": {"requests": 10, "period": "1s"}}]})
        .to_string(),
    )
    .unwrap_or_else(|e| panic!("the fuzzed policy set is valid: {e}"));
    let scalar = prop_oneof![
        any::<String>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| json!(f)),
        any::<bool>().prop_map(Value::from),
        Just(Value::Null),
        prop::sample::select(&["gpt-4o", "gpt-", "claude", "gold", "user", "1"][..])
            .prop_map(Value::from),
    ];
    let value = scalar.prop_recursive(6, 64, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
            prop::collection::btree_map(
                prop::sample::select(
                    &[
                        "model",
                        "meta",
                        "tier",
                        "user",
                        "messages",
                        "role",
                        "max_tokens",
                        "0"
                    ][..]
                )
                .prop_map(str::to_string),
                inner,
                0..8
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    });
    let body = prop_oneof![
        value.prop_map(|v| v.to_string().into_bytes()),
        prop::collection::vec(any::<u8>(), 0..256),
        (1usize..2_000).prop_map(|n| "[".repeat(n).into_bytes()),
    ];
    fuzz("matcher on request bodies", body, |body| {
        let secret = sluice_shared::KeySecret::from_bytes([3; sluice_shared::KeySecret::LEN]);
        let headers = Request(vec![(":authority".into(), b"api.llm.example".to_vec())]);
        let parsed = BodyJson::parse(&body);
        let classified = set.classify(&headers, KeySecrets::new(&secret, None), &parsed);
        if let Classified::DuplicateKey { policy_index, .. } = classified {
            return match (&parsed, policy_index) {
                (BodyJson::Duplicate(_), 0) => Ok(()),
                _ => Err(format!("refused a body as naming a key twice: {parsed:?}")),
            };
        }
        let Some(c) = classified.class() else {
            return Err("the catch-all policy matches every body".into());
        };
        let policy = &set.policies[c.policy_index];
        let price = policy.call_price(&headers, &parsed);
        let costs = policy.limit_costs(&headers, &parsed, price.as_ref());
        if costs.first().is_some_and(|&c| c == 0 || c > 500) {
            return Err(format!("costs {costs:?} outside 1..=500"));
        }
        // Money: at least 1, or refused as unpriced; the call's usage is
        // priced or, unpriced, not read.
        match (costs.get(1), price) {
            (Some(&sluice_filter_core::matcher::UNPRICED), None) | (None, _) => {}
            (Some(&c), Some(_)) if c >= 1 && c != sluice_filter_core::matcher::UNPRICED => {}
            (c, p) => return Err(format!("money cost {c:?} with price {p:?}")),
        }
        let _ = policy.priced_usage(1, price.as_ref());
        let _ = policy.limit_keys(&headers, KeySecrets::new(&secret, Some(&secret)), &parsed);
        let _ = policy.key_name(&headers, &secret, &parsed);
        if parsed.unreadable() && policy.name() != "gpt" {
            return Err(
                "a body that cannot be read passed on from the policy its headers matched".into(),
            );
        }
        Ok(())
    });
}

#[test]
fn shared_data_decoders() {
    let bytes = prop::collection::vec(any::<u8>(), 0..600);
    fuzz("shared-data decoders on arbitrary bytes", bytes, |bytes| {
        let _ = RateState::decode(&bytes);
        let _ = LeaseTable::decode(&bytes);
        let _ = TokenBucketState::decode(&bytes);
        let _ = FixedWindowState::decode(&bytes);
        let _ = SlidingWindowState::decode(&bytes);
        if let Ok(state) = BucketState::decode(&bytes) {
            // What decodes re-encodes to a value that decodes the same.
            let again = BucketState::decode(&state.encode()).map_err(|e| format!("{e:?}"))?;
            if again != state {
                return Err(format!("{state:?} did not survive a round trip"));
            }
        }
        Ok(())
    });
    fuzz("sync reports from arbitrary JSON", json_value(), |value| {
        if let Ok(report) = serde_json::from_value::<SyncReport>(value) {
            let _ = report.check();
        }
        Ok(())
    });
}

/// Splits `bytes` at the given points (each taken modulo the length).
fn chunked(bytes: &[u8], cuts: &[usize]) -> Vec<Vec<u8>> {
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
    points.sort_unstable();
    let mut out = Vec::new();
    let mut from = 0;
    for p in points.into_iter().chain([bytes.len()]) {
        out.push(bytes[from..p].to_vec());
        from = p;
    }
    out
}

#[test]
fn response_usage_from_arbitrary_bodies() {
    use sluice_shared::json_path::JsonPath;
    use sluice_shared::usage::UsageReader;
    // Weighed as a limit may weigh them: a discount among them.
    let paths = || {
        [
            ("usage.total_tokens", 1),
            ("message.usage.input_tokens", 4),
            ("usage.output_tokens", -1),
        ]
        .iter()
        .filter_map(|(p, weight)| Some((JsonPath::parse(p)?, *weight)))
        .collect::<Vec<_>>()
    };
    let input = (
        prop::collection::vec(any::<u8>(), 0..2_000),
        prop::collection::vec(any::<usize>(), 0..8),
        any::<bool>(),
    );
    fuzz(
        "response usage from arbitrary bytes in arbitrary chunks",
        input,
        |(bytes, cuts, stream)| {
            let ct: &[u8] = if stream {
                b"text/event-stream"
            } else {
                b"application/json"
            };
            let mut reader = UsageReader::new(paths(), Some(ct), 1_024);
            for piece in chunked(&bytes, &cuts) {
                reader.feed(&piece);
            }
            let _ = reader.finish();
            Ok(())
        },
    );
    // A well-formed stream reads the same however the network cuts it.
    let events = prop::collection::vec((0u64..1_000_000, 0u64..1_000_000, any::<bool>()), 1..20);
    fuzz(
        "event-stream usage does not depend on chunking",
        (events, prop::collection::vec(any::<usize>(), 0..12)),
        |(events, cuts)| {
            let mut body = Vec::new();
            for (input, output, crlf) in &events {
                let nl: &str = if *crlf { "\r\n" } else { "\n" };
                body.extend_from_slice(
                    format!(
                        "event: x{nl}data: {{\"message\": {{\"usage\": {{\"input_tokens\": {input}}}}}, \"usage\": {{\"output_tokens\": {output}, \"total_tokens\": {}}}}}{nl}{nl}",
                        input + output
                    )
                    .as_bytes(),
                );
            }
            body.extend_from_slice(b"data: [DONE]\n\n");
            let whole = {
                let mut r = UsageReader::new(paths(), Some(b"text/event-stream"), 1_024);
                r.feed(&body);
                r.finish()
            };
            let mut r = UsageReader::new(paths(), Some(b"text/event-stream"), 1_024);
            for piece in chunked(&body, &cuts) {
                r.feed(&piece);
            }
            let pieces = r.finish();
            let (input, output, _) = events.last().copied().unwrap_or_default();
            // total + 4 × input - output, as the paths weigh them.
            let expected = Ok((input + output) + 4 * input - output);
            if whole != expected || pieces != expected {
                return Err(format!(
                    "whole {whole:?}, in pieces {pieces:?}, expected {expected:?}"
                ));
            }
            Ok(())
        },
    );
}
