//! Validation messages: every error, with its field path, in document order.

use sluice_shared::{parse_policy, parse_policy_set};

fn errors_of(json: &str) -> Vec<String> {
    match parse_policy_set(json) {
        Ok(set) => panic!("expected errors, got {set:?}"),
        Err(e) => e.errors.iter().map(ToString::to_string).collect(),
    }
}

fn set_with(policy: &str) -> String {
    format!(r#"{{"version": 1, "policies": [{policy}]}}"#)
}

#[test]
fn reports_the_field_path_and_reason() {
    assert_eq!(
        errors_of(&set_with(
            r#"{"name": "a", "match": {"host": "x"}, "rate": {"requests": 10, "period": "1s", "burst": 0}}"#
        )),
        vec!["policies[0].rate.burst: must be >= 1"]
    );
}

#[test]
fn reports_every_error_of_every_policy() {
    let json = r#"{"version": 1, "policies": [
        {"name": "ok", "match": {"host": "a.example"}, "rate": {"requests": 1, "period": "1s"}},
        {"name": "b@d", "match": {"host": "a*.x"}, "rate": {"requests": 0, "period": 0, "burst": 0},
         "on_limit": {"action": "queue", "status": 200},
         "concurrency": {"max_in_flight": 0, "reserved_for_high": 3}},
        {"name": "typo", "match": {"host": "x"}, "rate": {"requests": 1, "period": "1s", "brust": 3}}
    ]}"#;
    assert_eq!(
        errors_of(json),
        vec![
            "policies[1].name: only letters, digits, '-', '_' and '.' are allowed",
            "policies[1].match.host: '*' is allowed only as \"*\" or as a leading \"*.\" (e.g. \"*.example.com\")",
            "policies[1].rate.requests: must be >= 1",
            "policies[1].rate.period: must be at least 1ms",
            "policies[1].rate.burst: must be >= 1",
            "policies[1].concurrency.max_in_flight: must be >= 1",
            "policies[1].concurrency.reserved_for_high: must be less than max_in_flight, or normal requests could never pass",
            "policies[1].concurrency.reserved_for_high: needs `priority` on the policy, or no request is ever high priority",
            "policies[1].on_limit.status: must be an HTTP error status, 400 to 599",
            "policies[1].on_limit.max_wait: required when action is queue",
            "policies[2].rate.brust: unknown field `brust`, expected one of `algorithm`, `requests`, `period`, `time_zone`, `burst`, `warmup`",
        ]
    );
}

#[test]
fn refuses_unknown_fields_at_every_level() {
    assert_eq!(
        errors_of(r#"{"version": 1, "policies": [], "policy": []}"#),
        vec!["policy: unknown field, expected `version`, `prices` or `policies`"]
    );
    let errs = errors_of(&set_with(
        r#"{"name": "a", "match": {"host": "x", "hots": "y"}, "rate": {"requests": 1, "period": "1s"}}"#,
    ));
    assert_eq!(errs.len(), 1);
    assert!(
        errs[0].starts_with("policies[0].match.hots: unknown field `hots`"),
        "{errs:?}"
    );
    let errs = errors_of(&set_with(
        r#"{"name": "a", "match": {"host": "x"}, "limit": 5}"#,
    ));
    assert!(
        errs[0].starts_with("policies[0].limit: unknown field `limit`"),
        "{errs:?}"
    );
}

#[test]
fn refuses_duplicate_names() {
    let json = r#"{"version": 1, "policies": [
        {"name": "bank", "match": {"host": "a"}, "rate": {"requests": 1, "period": "1s"}},
        {"name": "other", "match": {"host": "b"}, "rate": {"requests": 1, "period": "1s"}},
        {"name": "bank", "match": {"host": "c"}, "rate": {"requests": 1, "period": "1s"}}
    ]}"#;
    assert_eq!(
        errors_of(json),
        vec!["policies[2].name: duplicate name \"bank\", already used by policies[0]"]
    );
}

#[test]
fn refuses_zero_and_absurd_values() {
    let cases = [
        (r#""rate": {"requests": 2000000000, "period": "1s"}"#, "policies[0].rate.requests: must be <= 1000000000"),
        (r#""rate": {"requests": 1, "period": "32days"}"#, "policies[0].rate.period: must be at most 31d"),
        (r#""rate": {"requests": 1, "period": "1h", "burst": 1000}"#, "policies[0].rate.burst: a full bucket would take more than 31 days to refill; lower burst or raise the rate"),
        (r#""concurrency": {"max_in_flight": 5, "lease_ttl": "10ms"}"#, "policies[0].concurrency.lease_ttl: must be at least 1s"),
        (r#""concurrency": {"max_in_flight": 5}, "on_limit": {"action": "queue", "max_wait": "1h"}"#, "policies[0].on_limit.max_wait: must be at most 5m"),
        (r#""concurrency": {"max_in_flight": 5}, "on_limit": {"action": "queue", "max_wait": "1s", "max_queue": 0}"#, "policies[0].on_limit.max_queue: must be >= 1"),
        (r#""rate": {"requests": 5, "period": "1s", "warmup": {"period": "10s", "cold_factor": 1}}"#, "policies[0].rate.warmup.cold_factor: must be >= 2"),
        (r#""rate": {"requests": 5, "period": "1s"}, "key": {"header": "x-api-key", "max_keys": 0}"#, "policies[0].key.max_keys: must be >= 1"),
    ];
    for (fields, expected) in cases {
        let json = set_with(&format!(
            r#"{{"name": "a", "match": {{"host": "x"}}, {fields}}}"#
        ));
        assert_eq!(errors_of(&json), vec![expected], "for {fields}");
    }
}

#[test]
fn refuses_meaningless_combinations() {
    let cases = [
        (r#""mode": "shadow""#, "policies[0]: sets no limit: give it `rate`, `concurrency`, or both"),
        (r#""rate": {"algorithm": "fixed_window", "requests": 5, "period": "1s", "burst": 2}"#, "policies[0].rate.burst: applies only to algorithm token_bucket"),
        (r#""rate": {"algorithm": "sliding_window", "requests": 5, "period": "1s", "warmup": {"period": "1s"}}"#, "policies[0].rate.warmup: applies only to algorithm token_bucket"),
        (r#""rate": {"requests": 100, "period": "1s", "burst": 10}, "cost": 11"#, "policies[0].cost: must be <= 10 (the rate's burst), or such a request could never pass"),
        (r#""rate": {"algorithm": "fixed_window", "requests": 10, "period": "1s"}, "cost": {"header": "x-cost", "max": 20}"#, "policies[0].cost.max: must be <= 10 (the rate's requests per period), or such a request could never pass"),
        (r#""concurrency": {"max_in_flight": 5}, "cost": 3"#, "policies[0].cost: applies only to `rate`, and this policy has none"),
        (r#""rate": {"requests": 5, "period": "1s"}, "on_limit": {"max_wait": "1s"}"#, "policies[0].on_limit.max_wait: applies only when action is queue"),
        (r#""rate": {"requests": 5, "period": "1s"}, "on_limit": {"body": "x", "status": 302}"#, "policies[0].on_limit.status: must be an HTTP error status, 400 to 599"),
    ];
    for (fields, expected) in cases {
        let json = set_with(&format!(
            r#"{{"name": "a", "match": {{"host": "x"}}, {fields}}}"#
        ));
        assert_eq!(errors_of(&json), vec![expected], "for {fields}");
    }
}

#[test]
fn refuses_bad_matchers() {
    let cases = [
        (r#"{"host": ""}"#, "policies[0].match.host: must not be empty; use \"*\" to match any host"),
        (r#"{"host": "*."}"#, "policies[0].match.host: \"*.\" needs a domain after it, e.g. \"*.example.com\""),
        (r#"{"host": "api example"}"#, "policies[0].match.host: only letters, digits, '-', '.', and an optional \":port\" are allowed"),
        (r#"{"host": "api.example:99999"}"#, "policies[0].match.host: invalid port \"99999\""),
        (r#"{"host": "x", "path_prefix": "v1"}"#, "policies[0].match.path_prefix: must start with '/'"),
        (r#"{"host": "x", "methods": ["GET", "FETCH"]}"#, "policies[0].match.methods[1]: unknown method \"FETCH\", expected one of GET, HEAD, POST, PUT, DELETE, PATCH, OPTIONS, CONNECT, TRACE"),
        (r#"{"host": "x", "headers": [{"name": "bad name", "equals": "1"}]}"#, "policies[0].match.headers[0].name: \"bad name\" is not a valid header name"),
    ];
    for (matcher, expected) in cases {
        let json = set_with(&format!(
            r#"{{"name": "a", "match": {matcher}, "rate": {{"requests": 1, "period": "1s"}}}}"#
        ));
        assert_eq!(errors_of(&json), vec![expected], "for {matcher}");
    }
}

#[test]
fn not_json_or_wrong_shape_is_a_clear_error() {
    assert!(errors_of("{")[0].starts_with("not valid JSON: "));
    assert_eq!(
        errors_of("[]"),
        vec!["must be an object with \"version\" and \"policies\""]
    );
    assert_eq!(
        errors_of("{}"),
        vec!["version: missing field", "policies: missing field"]
    );
    assert_eq!(
        errors_of(r#"{"version": "7", "policies": {}}"#),
        vec![
            "version: invalid type: string \"7\", expected u64",
            "policies: must be a list of policies"
        ]
    );
}

#[test]
fn single_policy_paths_are_relative() {
    let err = parse_policy(
        r#"{"name": "a", "match": {"host": "x"}, "rate": {"requests": 0, "period": "1s"}}"#,
    )
    .unwrap_err();
    assert_eq!(err.to_string(), "rate.requests: must be >= 1");
}

#[test]
fn defaults_are_filled_and_round_trip() {
    let set = parse_policy_set(&set_with(
        r#"{"name": "a", "match": {"host": "x"}, "rate": {"requests": 10, "period": 1500}, "concurrency": {"max_in_flight": 3}}"#,
    ))
    .unwrap();
    let p = &set.policies[0];
    assert_eq!(p.rate.as_ref().unwrap().effective_burst(), 10);
    assert_eq!(
        p.concurrency.as_ref().unwrap().lease_ttl.as_millis(),
        300_000
    );
    assert_eq!(p.on_limit.status, 429);
    let text = serde_json::to_string(&set).unwrap();
    assert!(text.contains(r#""period":"1s 500ms""#), "{text}");
    assert_eq!(parse_policy_set(&text).unwrap(), set);
}

#[test]
fn global_scope_refuses_what_cannot_be_split_into_shares() {
    let err = parse_policy_set(&set_with(
        r#"{"name": "a", "match": {"host": "x"}, "scope": "global", "share_lease": "100ms",
            "key": {"header": "x-k"},
            "rate": {"requests": 10, "period": "1s", "algorithm": "fixed_window"}}"#,
    ))
    .unwrap_err()
    .to_string();
    for expected in [
        "policies[0].share_lease: must be at least 500ms",
        "policies[0].key: a `scope: global` policy cannot have per-key buckets",
        "policies[0].rate.algorithm: a `scope: global` policy needs `token_bucket`",
    ] {
        assert!(err.contains(expected), "{expected} not in {err}");
    }
    let err = parse_policy(
        r#"{"name": "a", "match": {"host": "x"}, "share_lease": "2s", "rate": {"requests": 10, "period": "1s"}}"#,
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "share_lease: only a `scope: global` policy has a share lease"
    );
    let ok = parse_policy(
        r#"{"name": "a", "match": {"host": "x"}, "scope": "global", "concurrency": {"max_in_flight": 1000}}"#,
    )
    .unwrap();
    assert_eq!(ok.share_lease().as_millis(), 3_000);
    assert!(serde_json::to_string(&ok)
        .unwrap()
        .contains(r#""scope":"global""#));
}

#[test]
fn further_limits_are_checked_field_by_field() {
    let errors = errors_of(&set_with(
        r#"{"name": "llm", "match": {"host": "api.llm.example"}, "rate": {"requests": 10, "period": "1s"},
            "on_limit": {"action": "queue", "max_wait": "1s"},
            "limits": [
              {"name": "tpm", "rate": {"requests": 1000, "period": "1m"}, "cost": {"header": "x-tokens", "max": 5000}},
              {"name": "tpm", "rate": {"requests": 5, "period": "32d"}},
              {"name": "bad name", "rate": {"requests": 0, "period": "1h"}}
            ]}"#,
    ));
    assert_eq!(
        errors,
        vec![
            "policies[0].limits[0].cost.max: must be <= 1000 (the rate's burst), or such a request could never pass",
            "policies[0].limits[1].rate.period: must be at most 31d",
            "policies[0].limits[1].name: duplicate name \"tpm\", already used by limits[0]",
            "policies[0].limits[2].name: only letters, digits, '-', '_' and '.' are allowed",
            "policies[0].limits[2].rate.requests: must be >= 1",
        ]
    );
    // A global policy's further limits are each Envoy's own, or leased
    // in shares of their own (`scope: global`).
    parse_policy_set(&set_with(
        r#"{"name": "fleet", "match": {"host": "*"}, "scope": "global", "rate": {"requests": 10, "period": "1s"},
            "limits": [{"name": "daily", "rate": {"requests": 1000, "period": "1d", "algorithm": "fixed_window"}},
                       {"name": "fleet-tokens", "scope": "global", "rate": {"requests": 9000, "period": "1m"}}]}"#,
    ))
    .expect("a global policy with further limits");
    let errors = errors_of(
        r#"{"version": 1, "policies": [
            {"name": "charges", "match": {"host": "api.stripe.example", "path_prefix": "/v1/charges"},
             "rate": {"requests": 25, "period": "1s"}, "limits": [{"name": "account", "rate": {"requests": 100, "period": "1s"}}]},
            {"name": "stripe", "match": {"host": "api.stripe.example"},
             "rate": {"requests": 25, "period": "1s"}, "limits": [{"name": "account", "rate": {"requests": 90, "period": "1s"}}]}
        ]}"#,
    );
    assert_eq!(
        errors,
        vec![
            "policies[0].limits[0].rate: limit \"account\" is also in policies[1] with another rate; a limit named in several policies is one limit",
            "policies[1].limits[0].rate: limit \"account\" is also in policies[0] with another rate; a limit named in several policies is one limit",
        ]
    );
    // A month-long window is a valid limit.
    let ok = set_with(
        r#"{"name": "llm", "match": {"host": "api.llm.example"}, "rate": {"requests": 10, "period": "1s"},
            "limits": [{"name": "monthly", "rate": {"requests": 1000000, "period": "31d", "algorithm": "fixed_window"}}]}"#,
    );
    assert!(parse_policy_set(&ok).is_ok());
}

/// Costs read from the request body and the response: every bad field
/// named, and the policy's own cost cannot read the body.
#[test]
fn response_costs_are_checked_field_by_field() {
    let errors = errors_of(&set_with(
        r#"{"name": "llm", "match": {"host": "api.llm.example"}, "rate": {"requests": 10, "period": "1s"},
            "cost": {"json": "max_tokens", "max": 5},
            "limits": [
              {"name": "tpm", "rate": {"requests": 1000, "period": "1m"},
               "cost": {"json": "max_tokens..x", "plus": 10, "default": 0, "max": 5000},
               "usage": {"header": "x-usage", "json": ["usage.total_tokens"]}},
              {"name": "tpd", "rate": {"requests": 100000, "period": "1d"},
               "usage": {"json": ["usage.", ""], "events": ["ok.path"], "max_body_bytes": 10, "unread": 0}},
              {"name": "rpm", "rate": {"requests": 100, "period": "1m"}, "usage": {}},
              {"name": "hdr", "rate": {"requests": 100, "period": "1m"}, "usage": {"header": "bad header", "events": ["a"], "ask_stream_usage": true}}
            ]}"#,
    ));
    assert_eq!(
        errors,
        vec![
            "policies[0].cost.json: a cost read from the request body is for `limits` only; the policy's own `cost` is a number or a header",
            "policies[0].limits[0].cost.json: \"max_tokens..x\" is not a path: names or indexes joined by '.', none empty (usage.total_tokens)",
            "policies[0].limits[0].cost.default: must be >= 1",
            "policies[0].limits[0].cost.max: must be <= 1000 (the rate's burst), or such a request could never pass",
            "policies[0].limits[0].usage: give either `header` or `json`, not both",
            "policies[0].limits[1].usage.json[0]: \"usage.\" is not a path: names or indexes joined by '.', none empty (usage.total_tokens)",
            "policies[0].limits[1].usage.json[1]: \"\" is not a path: names or indexes joined by '.', none empty (usage.total_tokens)",
            "policies[0].limits[1].usage.max_body_bytes: must be >= 1024",
            "policies[0].limits[1].usage.unread: must be >= 1",
            "policies[0].limits[2].usage: give `header` (a response header) or `json` (paths in the response body)",
            "policies[0].limits[3].usage.header: \"bad header\" is not a valid header name",
            "policies[0].limits[3].usage.events: applies only with `json`",
            "policies[0].limits[3].usage.ask_stream_usage: applies only with `json`: the usage asked for comes in the stream's events",
        ]
    );
    let ok = set_with(
        r#"{"name": "llm", "match": {"host": "api.llm.example"}, "rate": {"requests": 10, "period": "1s"},
            "limits": [{"name": "tpm", "rate": {"requests": 100000, "period": "1m"},
                        "cost": {"json": "max_tokens", "plus": 500, "default": 4000, "max": 20000},
                        "usage": {"json": ["usage.input_tokens", "usage.output_tokens"],
                                  "events": ["message.usage.input_tokens", "usage.output_tokens"]}}]}"#,
    );
    let set = parse_policy_set(&ok).unwrap_or_else(|e| panic!("{e}"));
    // What was accepted reads back the same.
    let again = serde_json::to_string(&set).unwrap_or_default();
    assert_eq!(parse_policy_set(&again).ok(), Some(set));
    // The unread charge: "max" (the default), "estimate" or tokens.
    for unread in [r#""max""#, r#""estimate""#, "25000"] {
        let set = ok.replace(
            r#""usage": {"json""#,
            &format!(r#""usage": {{"unread": {unread}, "json""#),
        );
        parse_policy_set(&set).unwrap_or_else(|e| panic!("{unread}: {e}"));
    }
    let wrong = ok.replace(
        r#""usage": {"json""#,
        r#""usage": {"unread": "sometimes", "json""#,
    );
    let e = parse_policy_set(&wrong).unwrap_err().to_string();
    assert!(
        e.contains("usage.unread")
            && e.contains("\"max\", \"estimate\" or a whole number of tokens"),
        "{e}"
    );
}

/// A prompt estimate names where the prompt is and a ratio a tokenizer
/// could have; each bad part named.
#[test]
fn a_prompt_estimate_is_checked_field_by_field() {
    let with = |prompt: &str| {
        set_with(&format!(
            r#"{{"name": "llm", "match": {{"host": "api.llm.example"}}, "rate": {{"requests": 10, "period": "1s"}},
                "limits": [{{"name": "tpm", "rate": {{"requests": 1000000, "period": "1m"}},
                            "cost": {{"json": "max_tokens", "plus_prompt": {prompt}, "max": 200000}}}}]}}"#
        ))
    };
    assert_eq!(
        errors_of(&with(r#"{"paths": []}"#)),
        vec!["policies[0].limits[0].cost.plus_prompt.paths: name at least one path (messages)"]
    );
    let deep = vec!["a"; 17].join(".");
    assert_eq!(
        errors_of(&with(&format!(
            r#"{{"paths": ["messages", "", "{deep}"], "chars_per_token": 0.1}}"#
        ))),
        vec![
            "policies[0].limits[0].cost.plus_prompt.paths[1]: \"\" is not a path: names or indexes joined by '.', none empty (usage.total_tokens)",
            "policies[0].limits[0].cost.plus_prompt.paths[2]: at most 16 names or indexes deep",
            "policies[0].limits[0].cost.plus_prompt.chars_per_token: must be between 0.25 and 64 characters",
        ]
    );
    let nine: Vec<String> = (0..9).map(|i| format!("\"p{i}\"")).collect();
    assert_eq!(
        errors_of(&with(&format!(
            r#"{{"paths": [{}], "chars_per_token": 65}}"#,
            nine.join(", ")
        ))),
        vec![
            "policies[0].limits[0].cost.plus_prompt.paths: at most 8 paths",
            "policies[0].limits[0].cost.plus_prompt.chars_per_token: must be between 0.25 and 64 characters",
        ]
    );
    let e = parse_policy_set(&with(r#"{"paths": ["messages"], "chars": 4}"#))
        .unwrap_err()
        .to_string();
    // An untagged cost names its field and every shape it may take.
    assert!(
        e.contains("policies[0].limits[0].cost:")
            && e.contains(r#""plus_prompt": {"paths": [...], "chars_per_token": ...}"#),
        "{e}"
    );
    // The default ratio is 4, and what was accepted reads back the same.
    let set = parse_policy_set(&with(r#"{"paths": ["messages", "input", "prompt"]}"#))
        .unwrap_or_else(|e| panic!("{e}"));
    let again = serde_json::to_string(&set).unwrap_or_default();
    assert!(again.contains(r#""chars_per_token":4.0"#), "{again}");
    assert_eq!(parse_policy_set(&again).ok(), Some(set));
}

#[test]
fn a_further_limits_key_is_checked_and_one_limit_has_one_key() {
    let errors = errors_of(&set_with(
        r#"{"name": "llm", "match": {"host": "api.llm.example"}, "rate": {"requests": 10, "period": "1s"},
            "limits": [{"name": "tpm", "key": {"header": "bad header", "max_keys": 0},
                        "rate": {"requests": 1000, "period": "1m"}}]}"#,
    ));
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(
        errors[0].starts_with("policies[0].limits[0].key.header: "),
        "{errors:?}"
    );
    assert!(
        errors[1].starts_with("policies[0].limits[0].key.max_keys: "),
        "{errors:?}"
    );
    let errors = errors_of(
        r#"{"version": 1, "policies": [
            {"name": "a", "match": {"host": "a.example"}, "rate": {"requests": 10, "period": "1s"},
             "limits": [{"name": "shared", "key": {"header": "x-key"}, "rate": {"requests": 5, "period": "1m"}}]},
            {"name": "b", "match": {"host": "b.example"}, "rate": {"requests": 10, "period": "1s"},
             "limits": [{"name": "shared", "rate": {"requests": 5, "period": "1m"}}]}]}"#,
    );
    assert_eq!(
        errors,
        vec![
            "policies[0].limits[0].key: limit \"shared\" is also in policies[1] with another key; a limit named in several policies is one limit",
            "policies[1].limits[0].key: limit \"shared\" is also in policies[0] with another key; a limit named in several policies is one limit",
        ]
    );
    // A keyed daily limit is a plain limit, not a budget the admin holds.
    let set = parse_policy_set(
        r#"{"version": 1, "policies": [{"name": "a", "match": {"host": "a.example"},
            "rate": {"requests": 10, "period": "1s"},
            "limits": [{"name": "daily-per-key", "key": {"header": "x-key"}, "rate": {"requests": 5, "period": "1d"}},
                       {"name": "daily", "rate": {"requests": 50, "period": "1d"}}]}]}"#,
    )
    .expect("valid");
    let budgets: Vec<bool> = set.policies[0]
        .limits
        .iter()
        .map(|l| l.is_budget())
        .collect();
    assert_eq!(budgets, [false, true]);
}

#[test]
fn a_global_further_limit_is_a_token_bucket_for_every_key() {
    let errors = errors_of(&set_with(
        r#"{"name": "llm", "match": {"host": "api.llm.example"}, "rate": {"requests": 10, "period": "1s"},
            "limits": [{"name": "fleet", "scope": "global", "key": {"header": "x-key"},
                        "rate": {"requests": 1000, "period": "1m", "algorithm": "fixed_window"}}]}"#,
    ));
    assert_eq!(
        errors,
        vec![
            "policies[0].limits[0].key: a `scope: global` limit cannot be per key: its shares are per Envoy",
            "policies[0].limits[0].rate.algorithm: a `scope: global` limit needs `token_bucket`: windows cannot be split into shares",
        ]
    );
    let set = parse_policy_set(&set_with(
        r#"{"name": "llm", "match": {"host": "api.llm.example"}, "key": {"header": "x-key"},
            "rate": {"requests": 10, "period": "1s"},
            "limits": [{"name": "fleet", "scope": "global", "rate": {"requests": 1000, "period": "1d"}}]}"#,
    ))
    .expect("a per-key policy with a fleet-wide limit");
    assert!(
        !set.policies[0].limits[0].is_budget(),
        "a global limit is leased, not held"
    );
}

#[test]
fn a_further_limit_is_a_rate_or_a_concurrency_limit_for_every_call() {
    let errors = errors_of(&set_with(
        r#"{"name": "pay", "match": {"host": "api.pay.example"}, "rate": {"requests": 10, "period": "1s"},
            "limits": [{"name": "both", "rate": {"requests": 5, "period": "1s"}, "concurrency": {"max_in_flight": 3}},
                       {"name": "neither"},
                       {"name": "per-key", "key": {"header": "x-key"}, "concurrency": {"max_in_flight": 3}},
                       {"name": "fleet", "scope": "global", "concurrency": {"max_in_flight": 3}},
                       {"name": "costly", "cost": 2, "usage": {"header": "x-used"}, "concurrency": {"max_in_flight": 3}},
                       {"name": "zero", "concurrency": {"max_in_flight": 0, "lease_ttl": "10ms"}},
                       {"name": "lane", "concurrency": {"max_in_flight": 3, "reserved_for_high": 1}}]}"#,
    ));
    assert_eq!(
        errors,
        vec![
            "policies[0].limits[0].concurrency: a limit is a `rate` or a `concurrency`, not both: make them two limits",
            "policies[0].limits[1].rate: missing field: a limit needs `rate` or `concurrency`",
            "policies[0].limits[2].key: a concurrency limit in `limits` is for every call of the policies naming it; for calls in flight per key use the policy's own `concurrency` with its `key`",
            "policies[0].limits[3].scope: a concurrency limit in `limits` is per Envoy; for calls in flight across the fleet use a `scope: global` policy's own `concurrency`",
            "policies[0].limits[4].cost: a concurrency limit takes one slot per call: no `cost`",
            "policies[0].limits[4].usage: a concurrency limit takes one slot per call: no `usage`",
            "policies[0].limits[5].concurrency.max_in_flight: must be >= 1",
            "policies[0].limits[5].concurrency.lease_ttl: must be at least 1s",
            "policies[0].limits[6].concurrency.reserved_for_high: the priority lane is the policy's own `concurrency`'s; a concurrency limit in `limits` has none",
        ]
    );
    // Named in two policies, it is one limit: one size.
    let two = |a: &str, b: &str| {
        errors_of(&format!(
            r#"{{"version": 1, "policies": [
            {{"name": "charges", "match": {{"host": "api.pay.example", "path_prefix": "/v1/charges"}},
             "rate": {{"requests": 25, "period": "1s"}}, "limits": [{{"name": "account", {a}}}]}},
            {{"name": "refunds", "match": {{"host": "api.pay.example", "path_prefix": "/v1/refunds"}},
             "rate": {{"requests": 25, "period": "1s"}}, "limits": [{{"name": "account", {b}}}]}}]}}"#
        ))
    };
    assert_eq!(
        two(r#""concurrency": {"max_in_flight": 20}"#, r#""concurrency": {"max_in_flight": 25}"#),
        [
            "policies[0].limits[0].concurrency: limit \"account\" is also in policies[1] with another concurrency; a limit named in several policies is one limit",
            "policies[1].limits[0].concurrency: limit \"account\" is also in policies[0] with another concurrency; a limit named in several policies is one limit",
        ]
    );
    // One name, one kind: their state is one entry in shared data.
    assert_eq!(
        two(r#""concurrency": {"max_in_flight": 20}"#, r#""rate": {"requests": 20, "period": "1s"}"#),
        [
            "policies[0].limits[0].rate: limit \"account\" is also in policies[1] with another rate; a limit named in several policies is one limit",
            "policies[1].limits[0].rate: limit \"account\" is also in policies[0] with another rate; a limit named in several policies is one limit",
        ]
    );
    let set = parse_policy_set(
        r#"{"version": 1, "policies": [
            {"name": "charges", "match": {"host": "api.pay.example", "path_prefix": "/v1/charges"},
             "rate": {"requests": 25, "period": "1s"},
             "limits": [{"name": "account", "rate": {"requests": 100, "period": "1s"}},
                        {"name": "account-in-flight", "concurrency": {"max_in_flight": 20}}]},
            {"name": "refunds", "match": {"host": "api.pay.example", "path_prefix": "/v1/refunds"},
             "rate": {"requests": 25, "period": "1s"},
             "limits": [{"name": "account", "rate": {"requests": 100, "period": "1s"}},
                        {"name": "account-in-flight", "concurrency": {"max_in_flight": 20}}]}]}"#,
    )
    .expect("Stripe's limits: per endpoint, for the account, and in flight");
    assert!(!set.policies[0].limits[1].is_budget());
}

#[test]
fn a_limit_listening_to_its_provider_is_checked_field_by_field() {
    let errors = errors_of(&set_with(
        r#"{"name": "llm", "match": {"host": "api.llm.example"}, "rate": {"requests": 10, "period": "1s"},
            "limits": [{"name": "ok", "rate": {"requests": 5, "period": "1s"}, "provider": {}},
                       {"name": "statuses", "rate": {"requests": 5, "period": "1s"},
                        "provider": {"pause_on": [200, 429, 429, 700]}},
                       {"name": "long", "rate": {"requests": 5, "period": "1s"},
                        "provider": {"max_pause": "2d"}},
                       {"name": "zero", "rate": {"requests": 5, "period": "1s"},
                        "provider": {"max_pause": 0}},
                       {"name": "slots", "concurrency": {"max_in_flight": 3}, "provider": {}},
                       {"name": "custom", "rate": {"requests": 5, "period": "1s"},
                        "provider": {"headers": {"remaining": "x quota", "reset": "", "reset_format": "epoch_seconds"}}},
                       {"name": "item", "rate": {"requests": 5, "period": "1s"},
                        "provider": {"headers": {"ietf": ""}}},
                       {"name": "presets", "rate": {"requests": 5, "period": "1s"},
                        "provider": {"headers": "openai-tokens"}}]}"#,
    ));
    assert_eq!(
        errors,
        vec![
            "policies[0].limits[1].provider.pause_on[0]: must be an error status (400 to 599): only a refusal pauses a limit",
            "policies[0].limits[1].provider.pause_on[2]: listed twice",
            "policies[0].limits[1].provider.pause_on[3]: must be an error status (400 to 599): only a refusal pauses a limit",
            "policies[0].limits[2].provider.max_pause: must be at most 1d",
            "policies[0].limits[3].provider.max_pause: must be at least 1ms",
            "policies[0].limits[4].provider: a provider's pauses and counts are for rate limits: put `provider` on the rate limit it mirrors",
            "policies[0].limits[5].provider.headers.remaining: \"x quota\" is not a valid header name",
            "policies[0].limits[5].provider.headers.reset: must not be empty",
            "policies[0].limits[6].provider.headers.ietf: the name of an item of the provider's `RateLimit` field: 1 to 64 characters",
        ]
    );
    let unknown_preset = errors_of(&set_with(
        r#"{"name": "llm", "match": {"host": "api.llm.example"}, "rate": {"requests": 10, "period": "1s"},
            "limits": [{"name": "x", "rate": {"requests": 5, "period": "1s"}, "provider": {"headers": "mistral"}}]}"#,
    ));
    assert_eq!(unknown_preset.len(), 1);
    assert!(
        unknown_preset[0].starts_with("policies[0].limits[0].provider.headers: ")
            && unknown_preset[0].contains("openai-requests"),
        "{unknown_preset:?}"
    );
    let unknown = errors_of(&set_with(
        r#"{"name": "llm", "match": {"host": "api.llm.example"}, "rate": {"requests": 10, "period": "1s"},
            "limits": [{"name": "x", "rate": {"requests": 5, "period": "1s"}, "provider": {"pause": "3s"}}]}"#,
    ));
    assert_eq!(unknown.len(), 1);
    assert!(
        unknown[0].starts_with("policies[0].limits[0].provider.pause"),
        "{unknown:?}"
    );
    // Named in two policies, the limit listens the same way in both.
    let two = errors_of(
        r#"{"version": 1, "policies": [
        {"name": "a", "match": {"host": "a.example"}, "rate": {"requests": 25, "period": "1s"},
         "limits": [{"name": "shared", "rate": {"requests": 5, "period": "1s"}, "provider": {}}]},
        {"name": "b", "match": {"host": "b.example"}, "rate": {"requests": 25, "period": "1s"},
         "limits": [{"name": "shared", "rate": {"requests": 5, "period": "1s"}}]}]}"#,
    );
    assert_eq!(
        two,
        [
            "policies[0].limits[0].provider: limit \"shared\" is also in policies[1] with another provider; a limit named in several policies is one limit",
            "policies[1].limits[0].provider: limit \"shared\" is also in policies[0] with another provider; a limit named in several policies is one limit",
        ]
    );
}

/// Matches and keys on the request's JSON body: a path that parses and
/// is not too deep, exactly one test per condition, one source per key;
/// each refusal names the field.
#[test]
fn body_matches_and_body_keys_are_checked_with_their_field() {
    let deep = vec!["a"; 17].join(".");
    let errors = errors_of(&set_with(&format!(
        r#"{{"name": "llm", "match": {{"host": "api.llm.example", "json": [
                {{"path": "", "equals": "x"}},
                {{"path": "model"}},
                {{"path": "model", "equals": "a", "prefix": "b"}},
                {{"path": "{deep}", "one_of": ["x"]}},
                {{"path": "model..name", "equals": "x"}}]}},
            "key": {{"json": "user..id", "header": "x user"}},
            "rate": {{"requests": 10, "period": "1s"}},
            "limits": [{{"name": "tpm", "key": {{"json": ""}}, "rate": {{"requests": 1000, "period": "1m"}}}},
                       {{"name": "rpm", "key": {{}}, "rate": {{"requests": 1000, "period": "1m"}}}},
                       {{"name": "per-team", "key": {{"header": "x-team", "label": "field"}},
                         "rate": {{"requests": 1000, "period": "1m"}}}}]}}"#
    )));
    let expected = [
        "policies[0].match.json[0].path: \"\" is not a path",
        "policies[0].match.json[1]: give exactly one of `equals`, `prefix` and `one_of`",
        "policies[0].match.json[2]: give exactly one of `equals`, `prefix` and `one_of`",
        "policies[0].match.json[3].path: at most 16 names or indexes deep",
        "policies[0].match.json[4].path: \"model..name\" is not a path",
        "policies[0].key.header:",
        "policies[0].key.json: \"user..id\" is not a path",
        "policies[0].limits[0].key.json: \"\" is not a path",
        "policies[0].limits[1].key: give `header` (a request header) or `json`",
        "policies[0].limits[2].key.label: `field` names a key of `header` and `json` by its body field",
    ];
    assert_eq!(errors.len(), expected.len(), "{errors:#?}");
    for want in expected {
        assert!(
            errors.iter().any(|e| e.starts_with(want)),
            "{want} not among {errors:#?}"
        );
    }
    let good = parse_policy_set(&set_with(
        r#"{"name": "llm", "match": {"host": "api.llm.example", "json": [{"path": "model", "one_of": ["gpt-4o", "gpt-4o-mini"]}]},
            "key": {"json": "user"}, "rate": {"requests": 10, "period": "1s"},
            "limits": [{"name": "tpm", "key": {"json": "model"}, "rate": {"requests": 1000, "period": "1m"}},
                       {"name": "tpm-per-api-key", "key": {"header": "authorization", "json": "model", "label": "field"},
                        "rate": {"requests": 1000, "period": "1m"}}]}"#,
    ));
    assert!(good.is_ok(), "{good:?}");
}

/// Weighed usage paths: a weight of 0, one past the bound and a set with
/// no positive weight are refused naming the field; a weight that is not
/// a whole number is refused by the parser, saying what is expected; a
/// list and a map of weights round-trip as they were written.
#[test]
fn weighed_usage_paths_are_checked_with_their_field() {
    let limit = |json: &str| {
        set_with(&format!(
            r#"{{"name": "llm", "match": {{"host": "api.llm.example"}}, "rate": {{"requests": 10, "period": "1s"}},
                "limits": [{{"name": "tpm", "rate": {{"requests": 1000, "period": "1m"}},
                            "cost": {{"json": "max_tokens", "default": 10, "max": 100}},
                            "usage": {{"json": {json}}}}}]}}"#
        ))
    };
    let errors = errors_of(&limit(r#"{"usage.a": 0, "usage.b": 1001, "usage.c": 2}"#));
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(
        errors[0].starts_with("policies[0].limits[0].usage.json[0]: \"usage.a\" has weight 0"),
        "{errors:?}"
    );
    assert!(
        errors[1].starts_with(
            "policies[0].limits[0].usage.json[1]: \"usage.b\": a weight between -1000 and 1000"
        ),
        "{errors:?}"
    );
    let errors = errors_of(&limit(r#"{"usage.cached": -1}"#));
    assert_eq!(
        errors,
        ["policies[0].limits[0].usage.json: no path counts up: give at least one a positive weight"]
    );
    let wrong = parse_policy_set(&limit(r#"{"usage.a": "four"}"#))
        .expect_err("a weight that is not a number")
        .to_string();
    assert!(
        wrong.contains("a list of paths, or a map of path to a whole-number weight"),
        "{wrong}"
    );
    for written in [
        r#"["usage.total_tokens"]"#,
        r#"{"usage.completion_tokens": 4, "usage.prompt_tokens": 1}"#,
    ] {
        let set = parse_policy_set(&limit(written)).unwrap_or_else(|e| panic!("{written}: {e}"));
        let usage = serde_json::to_value(&set.policies[0].limits[0].usage).unwrap_or_default();
        let back: serde_json::Value = serde_json::from_str(written).unwrap_or_default();
        assert_eq!(usage["json"], back, "{written}");
    }
}

/// Warning lines: shares of a rate limit, ascending, each named.
#[test]
fn warning_lines_are_shares_of_a_rate_limit() {
    let with = |warn: &str, limit: &str| {
        set_with(&format!(
            r#"{{"name": "llm", "match": {{"host": "a.example"}}, "rate": {{"requests": 10, "period": "1s"}},
                "limits": [{{"name": "l", {limit}, "warn_at": {warn}}}]}}"#
        ))
    };
    let rate = r#""rate": {"requests": 1000, "period": "1d", "algorithm": "fixed_window"}"#;
    assert!(parse_policy_set(&with("[0.8, 0.95]", rate)).is_ok());
    assert_eq!(
        errors_of(&with("[0, 0.9, 0.5, 1, 0.1, 0.2]", rate)),
        vec![
            "policies[0].limits[0].warn_at: at most 4 lines",
            "policies[0].limits[0].warn_at[0]: a share of the limit, between 0 and 1 (0.8 warns at 80 %)",
            "policies[0].limits[0].warn_at[2]: lines go up: each above the one before",
            "policies[0].limits[0].warn_at[3]: a share of the limit, between 0 and 1 (0.8 warns at 80 %)",
            "policies[0].limits[0].warn_at[4]: lines go up: each above the one before",
        ]
    );
    assert_eq!(
        errors_of(&with("[0.8]", r#""concurrency": {"max_in_flight": 5}"#)),
        vec!["policies[0].limits[0].warn_at: warning lines are for a `rate` limit: a concurrency limit has no share used"]
    );
    let e = parse_policy_set(&with(r#"["80%"]"#, rate))
        .unwrap_err()
        .to_string();
    assert!(e.contains("policies[0].limits[0].warn_at[0]"), "{e}");
}

#[test]
fn calendar_periods_are_fixed_windows_in_a_known_zone() {
    let with = |rate: &str, scope: &str| {
        set_with(&format!(
            r#"{{"name": "llm", "match": {{"host": "a.example"}}, "rate": {{"requests": 10, "period": "1s"}},
                "limits": [{{"name": "l", "rate": {rate}{scope}}}]}}"#
        ))
    };
    let monthly = r#"{"requests": 1000, "period": "calendar_month", "algorithm": "fixed_window", "time_zone": "Europe/Berlin"}"#;
    let set = parse_policy_set(&with(monthly, "")).unwrap_or_else(|e| panic!("{e}"));
    let rate = set.policies[0].limits[0]
        .rate
        .as_ref()
        .map(|r| r.period.to_string());
    assert_eq!(rate.as_deref(), Some("calendar_month"));
    assert!(set.policies[0].limits[0].is_budget());
    // No zone: UTC.
    assert!(parse_policy_set(&with(
        r#"{"requests": 5, "period": "calendar_year", "algorithm": "fixed_window"}"#,
        ""
    ))
    .is_ok());
    assert_eq!(
        errors_of(&with(
            r#"{"requests": 1000, "period": "calendar_day", "time_zone": "Mars/Olympus_Mons"}"#,
            ""
        )),
        vec![
            "policies[0].limits[0].rate.algorithm: a calendar period is counted in calendar windows: set `fixed_window`",
            "policies[0].limits[0].rate.time_zone: \"Mars/Olympus_Mons\" is no IANA time zone; write e.g. \"Europe/Berlin\", \"America/New_York\" or \"UTC\"",
        ]
    );
    assert_eq!(
        errors_of(&with(
            r#"{"requests": 1000, "period": "1d", "algorithm": "fixed_window", "time_zone": "Europe/Berlin"}"#,
            ""
        )),
        vec!["policies[0].limits[0].rate.time_zone: applies only to a calendar period (\"calendar_day\", \"calendar_month\", ...)"]
    );
    let long_zone = format!(
        r#"{{"requests": 1, "period": "calendar_day", "algorithm": "fixed_window", "time_zone": "{}"}}"#,
        "A/".repeat(5_000)
    );
    let e = errors_of(&with(&long_zone, ""));
    assert!(e[0].len() < 200, "a hostile zone name is cut short: {e:?}");
    // A fleet-wide limit is leased as a rate: windows, calendar or not,
    // cannot be split into shares.
    let e = errors_of(&with(monthly, r#", "scope": "global""#));
    assert!(
        e.iter()
            .any(|e| e.contains("windows cannot be split into shares")),
        "{e:?}"
    );
    let e = parse_policy_set(&with(
        r#"{"requests": 1, "period": "calendar_fortnight", "algorithm": "fixed_window"}"#,
        "",
    ))
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("is no calendar unit; write one of \"calendar_day\""),
        "{e}"
    );
}

#[test]
fn a_downgrade_is_a_money_limits_rung_to_priced_cheaper_models() {
    let with = |limit: &str| {
        format!(
            r#"{{"version": 1, "prices": {{"currency": "USD", "models": {{
                  "gpt-4o*": {{"input": "2.5", "output": "10"}}, "gpt-4o-mini": {{"input": "0.15", "output": "0.6"}}}}}},
                "policies": [{{"name": "llm", "match": {{"host": "a.example"}}, "rate": {{"requests": 10, "period": "1s"}},
                "limits": [{{"name": "l", "rate": {{"requests": 1000000, "period": "1d", "algorithm": "fixed_window"}}, {limit}}}]}}]}}"#
        )
    };
    let good = r#""cost": "price", "downgrade": {"at": 0.8, "models": {"gpt-4o*": "gpt-4o-mini"}}"#;
    let set = parse_policy_set(&with(good)).unwrap_or_else(|e| panic!("{e}"));
    let rung = set.policies[0].limits[0]
        .downgrade
        .as_ref()
        .map(|d| d.target("gpt-4o-2024"));
    assert_eq!(rung, Some(Some("gpt-4o-mini")));
    assert_eq!(
        errors_of(&with(r#""downgrade": {"at": 0, "models": {}}"#)),
        vec![
            "policies[0].limits[0].downgrade: a downgrade steps a budget in money down to cheaper models: give the limit `\"cost\": \"price\"`",
            "policies[0].limits[0].downgrade.at: a share of the limit, above 0 and at most 1 (0.8 downgrades past 80 %)",
            "policies[0].limits[0].downgrade.models: name at least one model and the cheaper one it goes to",
        ]
    );
    assert_eq!(
        errors_of(&with(
            r#""cost": "price", "downgrade": {"at": 1.5, "models": {"gpt-4o": "gpt-4o", "o1": "o1-*", "gpt-4-turbo": "claude-3-haiku"}}"#
        )),
        vec![
            "policies[0].limits[0].downgrade.at: a share of the limit, above 0 and at most 1 (0.8 downgrades past 80 %)",
            "policies[0].limits[0].downgrade.models.gpt-4o: goes to itself: name a cheaper model",
            "policies[0].limits[0].downgrade.models.o1: the model it goes to: a model's name, without `*`",
            "policies[0].limits[0].downgrade.models.gpt-4-turbo: goes to \"claude-3-haiku\", which the set's `prices` do not name: a downgrade is priced at its model's own price",
        ]
    );
    // The body is what is rewritten: a model named by a header cannot be.
    let e = errors_of(&with(
        r#""cost": {"price": {"model": {"header": "x-model"}}}, "downgrade": {"at": 0.8, "models": {"gpt-4o": "gpt-4o-mini"}}"#,
    ));
    assert!(
        e.iter().any(|e| e.ends_with("the price must read the model from it (`cost.price.model.json`)")),
        "{e:?}"
    );
    let e = errors_of(&with(
        r#""cost": "price", "downgrade": {"at": 0.8, "models": {"gpt-4o": "gpt-4o-mini"}, "to": "x"}"#,
    ));
    assert!(e[0].contains("unknown field `to`"), "{e:?}");
}

/// Prices and money limits: a known currency, amounts a provider could
/// charge, a price only where the set has prices, every bad part named.
#[test]
fn prices_and_money_limits_are_checked_field_by_field() {
    let set = |prices: &str, cost: &str| {
        format!(
            r#"{{"version": 1, {prices} "policies": [{{"name": "llm", "match": {{"host": "api.llm.example"}},
                "rate": {{"requests": 10, "period": "1s"}},
                "limits": [{{"name": "team-monthly", "key": {{"header": "x-team"}},
                            "rate": {{"requests": 500000000, "period": "30d", "algorithm": "fixed_window"}},
                            "cost": {cost}}}]}}]}}"#
        )
    };
    let good =
        r#""prices": {"currency": "USD", "models": {"gpt-4o": {"input": "2.50", "output": 10}}},"#;
    assert!(parse_policy_set(&set(good, r#""price""#)).is_ok());
    assert!(parse_policy_set(&set(
        good,
        r#"{"price": {"usage": "anthropic", "default_output": 1024}}"#
    ))
    .is_ok());
    assert_eq!(
        errors_of(&set("", r#""price""#)),
        vec!["policies[0].limits[0].cost: a price needs the set's `prices`: what each model costs, and in which currency"]
    );
    let bad = r#""prices": {"currency": "DOLLARS", "models": {
        "": {"input": 1, "output": 1},
        "gpt-*-mini": {"input": "1", "output": "200000"},
        "free": {"input": 0, "output": "0.0"}},
        "default": {"input": "100001", "output": 1}},"#;
    assert_eq!(
        errors_of(&set(bad, r#"{"price": {"output": "a..b", "default_output": 0, "prompt": {"paths": []}}}"#)),
        vec![
            "prices.currency: \"DOLLARS\" is not an ISO 4217 currency code (USD, EUR, GBP, JPY, ...)",
            "prices.models.: a name has 1 to 128 characters, `*` only at its end",
            "prices.models.free: input and output both free: give the model's price, or leave it out (then `default`, or refused)",
            "prices.models.gpt-*-mini: a name has 1 to 128 characters, `*` only at its end",
            "prices.models.gpt-*-mini.output: at most 100000 a million tokens: a price is per million tokens",
            "prices.default.input: at most 100000 a million tokens: a price is per million tokens",
            "policies[0].limits[0].cost.price.output: \"a..b\" is not a path: names or indexes joined by '.', none empty (usage.total_tokens)",
            "policies[0].limits[0].cost.price.default_output: must be >= 1",
            "policies[0].limits[0].cost.price.prompt.paths: name at least one path (messages)",
        ]
    );
    // Amounts that are not amounts: the field and what an amount is.
    for amount in [r#""-1""#, r#""2.5.0""#, "0.0000001", r#""1e3""#, "true"] {
        let prices = format!(
            r#""prices": {{"currency": "EUR", "models": {{"m": {{"input": {amount}, "output": 1}}}}}},"#
        );
        let e = parse_policy_set(&set(&prices, r#""price""#))
            .unwrap_err()
            .to_string();
        assert!(e.contains("prices.models.m.input"), "{amount}: {e}");
    }
    // A price is for further limits, and reads its usage its own way.
    let own = format!(
        r#"{{"version": 1, {good} "policies": [{{"name": "llm", "match": {{"host": "a.example"}},
            "rate": {{"requests": 10, "period": "1s"}}, "cost": "price"}}]}}"#
    );
    assert_eq!(
        errors_of(&own),
        vec!["policies[0].cost: a price is for `limits` only: give a further limit whose cost is `price`"]
    );
    let with_paths = set(
        good,
        r#""price", "usage": {"json": ["usage.total_tokens"]}"#,
    );
    assert_eq!(
        errors_of(&with_paths),
        vec!["policies[0].limits[0].usage: a price reads the answer's usage as `cost.price.usage` says (openai or anthropic): give only `ask_stream_usage`, `unread` or `max_body_bytes`"]
    );
    // A budget in money counts millionths per window: past a billion of
    // them, but not as a token bucket.
    let big = set(good, r#""price""#).replace("500000000", "5000000000000");
    assert!(parse_policy_set(&big).is_ok());
    let bucket = set(good, r#""price""#).replace(
        r#""algorithm": "fixed_window""#,
        r#""algorithm": "token_bucket""#,
    );
    assert_eq!(
        errors_of(&bucket),
        vec!["policies[0].limits[0].rate.algorithm: a budget in money is counted per period: fixed_window or sliding_window"]
    );
    // What was accepted reads back the same, amounts as exact text.
    let accepted = parse_policy_set(&set(
        r#""prices": {"currency": "JPY", "models": {"m*": {"input": 0.075, "output": "15", "cached_input": "0.0375"}}, "default": {"input": 1, "output": 2}},"#,
        r#""price""#,
    ))
    .unwrap_or_else(|e| panic!("{e}"));
    let again = serde_json::to_string(&accepted).unwrap_or_default();
    assert!(
        again.contains(r#""input":"0.075""#) && again.contains(r#""cached_input":"0.0375""#),
        "{again}"
    );
    assert_eq!(parse_policy_set(&again).ok(), Some(accepted));
}

#[test]
fn fair_shares_need_a_key_sane_weights_and_reservations_within_the_limit() {
    let ok = set_with(
        r#"{"name": "llm", "match": {"host": "x"}, "rate": {"requests": 100, "period": "1s"},
            "fair": {"key": {"header": "x-tenant"}, "weights": {"gold": 3, "batch": 0.5},
                     "default_weight": 1, "min": {"gold": 20, "batch": 80}}}"#,
    );
    let set = parse_policy_set(&ok).unwrap_or_else(|e| panic!("{e}"));
    let fair = set.policies[0].fair.as_ref().expect("fair");
    assert_eq!(fair.weights["gold"], 3.0);
    assert_eq!(fair.min["batch"], 80);
    assert_eq!(
        errors_of(&set_with(
            r#"{"name": "llm", "match": {"host": "x"}, "rate": {"requests": 100, "period": "1s"},
                "fair": {"key": {"header": "x-tenant"}, "min": {"gold": 60, "silver": 41}}}"#
        )),
        vec!["policies[0].fair.min: reservations add up to 101, more than the rate's 100: they would push the total past the limit"]
    );
    assert_eq!(
        errors_of(&set_with(
            r#"{"name": "llm", "match": {"host": "x"}, "rate": {"requests": 100, "period": "1s"},
                "fair": {"key": {}, "weights": {"gold": 0, "lead": 1001}, "default_weight": -1}}"#
        )),
        vec![
            "policies[0].fair.key: give `header` (a request header) or `json` (a path in the request's JSON body)",
            "policies[0].fair.default_weight: a weight is from 0.001 to 1000",
            "policies[0].fair.weights.gold: a weight is from 0.001 to 1000",
            "policies[0].fair.weights.lead: a weight is from 0.001 to 1000",
        ]
    );
    // Slots shared fairly: reservations within the slots a normal call
    // may take; in two units (rate and slots) none.
    let slots = r#"{"name": "llm", "match": {"host": "x"},
        "concurrency": {"max_in_flight": 10, "reserved_for_high": 2}, "priority": {"header": "x-priority"},
        "fair": {"key": {"header": "x-tenant"}, "min": {"gold": 8}}}"#;
    assert!(
        parse_policy_set(&set_with(slots)).is_ok(),
        "slots shared fairly"
    );
    assert_eq!(
        errors_of(&set_with(&slots.replace(r#""gold": 8"#, r#""gold": 9"#))),
        vec!["policies[0].fair.min: reservations add up to 9, more than the slots' (without those reserved for high priority) 8: they would push the total past the limit"]
    );
    assert_eq!(
        errors_of(&set_with(&slots.replace(
            r#""match": {"host": "x"},"#,
            r#""match": {"host": "x"}, "rate": {"requests": 100, "period": "1s"},"#
        ))),
        vec!["policies[0].fair.min: the policy shares both its `rate` and its `concurrency`: reservations would be in two units (put one of them in a further limit with its own `fair` to reserve)"]
    );
    assert_eq!(
        errors_of(&set_with(&slots.replace(
            r#""match": {"host": "x"},"#,
            r#""match": {"host": "x"}, "scope": "global","#
        ))),
        vec![
            "policies[0].fair: slots are shared fairly per Envoy: not with `scope: global` (a global policy's own `rate` can be)",
            "policies[0].fair.min: reservations are kept by each Envoy's table: not with `scope: global` (weights are weighed across the fleet)",
        ]
    );
    assert_eq!(
        errors_of(&set_with(
            r#"{"name": "llm", "match": {"host": "x"}, "rate": {"requests": 100, "period": "1s"},
                "key": {"header": "x-user"}, "fair": {"key": {"header": "x-tenant"}, "extra": 1}}"#
        ))
        .len(),
        1,
        "an unknown field is refused"
    );
    assert_eq!(
        errors_of(&set_with(
            r#"{"name": "llm", "match": {"host": "x"}, "rate": {"requests": 100, "period": "1s"},
                "key": {"header": "x-user"}, "fair": {"key": {"header": "x-tenant"}}}"#
        )),
        vec!["policies[0].fair: a policy with `key` has a bucket per key already: share one rate fairly with `fair`, or split it with `key`, not both"]
    );
    let queued = r#"{"name": "llm", "match": {"host": "x"}, "rate": {"requests": 100, "period": "1s"},
        "on_limit": {"action": "queue", "max_wait": "5s"}, "fair": {"key": {"header": "x-tenant"}}}"#;
    assert!(parse_policy_set(&set_with(queued)).is_ok(), "a fair queue");
    assert!(
        parse_policy_set(&set_with(
            &queued.replace(r#""x-tenant"}"#, r#""x-tenant"}, "min": {"gold": 10}"#)
        ))
        .is_ok(),
        "a fair queue keeps reservations"
    );
    // A further limit shares its own rate or slots; not one split by key;
    // across the fleet by weights only; and the policies naming it agree
    // on it.
    let limit = |fair_limit: &str| {
        format!(
            r#"{{"name": "llm", "match": {{"host": "x"}}, "rate": {{"requests": 1000, "period": "1s"}},
                "limits": [{fair_limit}]}}"#
        )
    };
    let tpm = r#"{"name": "tpm", "rate": {"requests": 100, "period": "1s"},
        "fair": {"key": {"header": "x-tenant"}, "weights": {"gold": 2}, "min": {"gold": 30}}}"#;
    assert!(
        parse_policy_set(&set_with(&limit(tpm))).is_ok(),
        "a limit shared fairly"
    );
    assert_eq!(
        errors_of(&set_with(&limit(
            r#"{"name": "slots", "concurrency": {"max_in_flight": 5}, "fair": {"key": {"header": "x-tenant"}, "min": {"a": 6}}},
               {"name": "keyed", "key": {"header": "x-user"}, "rate": {"requests": 10, "period": "1s"},
                "fair": {"key": {"header": "x-tenant"}, "min": {"a": 11}}},
               {"name": "fleet", "scope": "global", "rate": {"requests": 10, "period": "1s"},
                "fair": {"key": {"header": "x-tenant"}, "min": {"a": 5}}}"#
        ))),
        vec![
            "policies[0].limits[0].fair.min: reservations add up to 6, more than the slots' (without those reserved for high priority) 5: they would push the total past the limit",
            "policies[0].limits[1].fair: a limit with `key` has a bucket per key already: share its rate fairly with `fair`, or split it with `key`, not both",
            "policies[0].limits[1].fair.min: reservations add up to 11, more than the rate's 10: they would push the total past the limit",
            "policies[0].limits[2].fair.min: reservations are kept by each Envoy's table: not with `scope: global` (weights are weighed across the fleet)",
        ]
    );
    let two = format!(
        r#"{{"version": 1, "policies": [{}, {}]}}"#,
        limit(tpm),
        limit(r#"{"name": "tpm", "rate": {"requests": 100, "period": "1s"}}"#)
            .replace("\"llm\"", "\"other\"")
    );
    assert!(
        errors_of(&two).iter().any(|e| e.starts_with(
            "policies[1].limits[0].fair: limit \"tpm\" is also in policies[0] with another fair"
        )),
        "{:?}",
        errors_of(&two)
    );

    // Across the fleet: weights in reject mode; not reservations, not a
    // fair queue.
    let global = r#"{"name": "llm", "match": {"host": "x"}, "scope": "global",
        "rate": {"requests": 100, "period": "1s"}, "fair": {"key": {"header": "x-tenant"}}}"#;
    assert!(
        parse_policy_set(&set_with(global)).is_ok(),
        "fair across the fleet"
    );
    assert_eq!(
        errors_of(&set_with(&global.replace(
            r#""x-tenant"}"#,
            r#""x-tenant"}, "min": {"gold": 10}"#
        ))),
        vec!["policies[0].fair.min: reservations are kept by each Envoy's table: not with `scope: global` (weights are weighed across the fleet)"]
    );
    assert_eq!(
        errors_of(&set_with(&global.replace(
            r#""scope": "global","#,
            r#""scope": "global", "on_limit": {"action": "queue", "max_wait": "5s"},"#
        ))),
        vec!["policies[0].fair: a fair queue orders one Envoy's waiting calls: with `scope: global`, share fairly in reject mode"]
    );
}

/// A pool member with a rate its provider pauses.
fn member(name: &str, cluster: &str, limit: &str) -> String {
    format!(
        r#"{{"name": "{name}", "cluster": "{cluster}", "limits": [{{"name": "{limit}",
            "rate": {{"requests": 10, "period": "1s"}}, "provider": {{}}}}]}}"#
    )
}

#[test]
fn a_members_limit_may_be_one_for_the_fleet_as_any_further_limit() {
    let global = |key: &str| {
        format!(
            r#"{{"name": "east", "cluster": "llm-east", "limits": [{{"name": "east-rpm", "scope": "global",{key}
                "rate": {{"requests": 10, "period": "1s"}}, "provider": {{}}}}]}}"#
        )
    };
    let pool = |east: &str| {
        set_with(&format!(
            r#"{{"name": "llm", "match": {{"host": "llm.example"}}, "rate": {{"requests": 100, "period": "1s"}},
                "pool": {{"members": [{east}, {}]}}}}"#,
            member("west", "llm-west", "west-rpm")
        ))
    };
    let set = parse_policy_set(&pool(&global(""))).unwrap_or_else(|e| panic!("{e}"));
    assert!(set
        .limits()
        .any(|l| l.name == "east-rpm" && l.scope == sluice_shared::policy::Scope::Global));
    assert_eq!(
        errors_of(&pool(&global(r#" "key": {"header": "x-key"},"#))),
        vec!["policies[0].pool.members[0].limits[0].key: a `scope: global` limit cannot be per key: its shares are per Envoy"]
    );
}

#[test]
fn a_pool_is_read_with_its_defaults() {
    let json = set_with(&format!(
        r#"{{"name": "llm", "match": {{"host": "llm.example"}}, "rate": {{"requests": 100, "period": "1s"}},
            "pool": {{"members": [{}, {}]}}}}"#,
        member("east", "llm-east", "east-rpm"),
        member("west", "llm-west", "west-rpm")
    ));
    let set = parse_policy_set(&json).unwrap_or_else(|e| panic!("{e}"));
    let pool = set.policies[0].pool.as_ref().expect("pool");
    assert_eq!(pool.rule, sluice_shared::policy::PoolRule::MostRoom);
    assert_eq!(pool.route_header, "x-sluice-member");
    assert_eq!(pool.members[1].weight, 1.0);
}

#[test]
fn a_pool_needs_two_members_with_names_clusters_weights_and_limits_of_their_own() {
    let policy = |pool: &str, extra: &str| {
        set_with(&format!(
            r#"{{"name": "llm", "match": {{"host": "llm.example"}}, "rate": {{"requests": 100, "period": "1s"}},
                "limits": [{{"name": "org", "rate": {{"requests": 50, "period": "1s"}}}}]{extra},
                "pool": {pool}}}"#
        ))
    };
    assert_eq!(
        errors_of(&policy(
            &format!(r#"{{"members": [{}]}}"#, member("east", "a", "a-rpm")),
            ""
        )),
        vec!["policies[0].pool.members: a pool needs at least two members"]
    );
    let clash = format!(
        r#"{{"members": [{}, {}]}}"#,
        member("east", "same", "a-rpm"),
        member("east", "same", "org")
    );
    assert_eq!(
        errors_of(&policy(&clash, "")),
        vec![
            "policies[0].pool.members[1].name: duplicate name \"east\", already used by members[0]",
            "policies[0].pool.members[1].cluster: members[0] is routed to \"same\" already: each member is an upstream of its own",
            "policies[0].pool.members[1].limits[0].name: limit \"org\" is also named at policies[0].limits[0]: a pool member's limits are its own",
        ]
    );
    let bad = r#"{"rule": "fastest", "members": []}"#;
    let errors = errors_of(&policy(bad, ""));
    assert!(
        errors[0].starts_with("policies[0].pool.rule: unknown variant `fastest`"),
        "{errors:?}"
    );
    let no_provider = r#"{"members": [
        {"name": "a", "cluster": "a", "weight": 0, "limits": [{"name": "a-rpm", "rate": {"requests": 1, "period": "1s"}}]},
        {"name": "b", "cluster": "b c", "limits": []}]}"#;
    assert_eq!(
        errors_of(&policy(no_provider, "")),
        vec![
            "policies[0].pool.members[0].weight: must be a number from 0.001 to 1000",
            "policies[0].pool.members[0].limits: give one of a member's rate limits `provider` (e.g. {\"pause_on\": [429, 503]}), so that its refusals pause it and calls go to the other members",
            "policies[0].pool.members[1].cluster: an Envoy cluster's name: printable ASCII without spaces",
            "policies[0].pool.members[1].limits: a member needs at least one limit of its own (its rate, tokens or calls in flight), so that the pool knows its room",
        ]
    );
    let ok = format!(
        r#"{{"members": [{}, {}]}}"#,
        member("east", "a", "a-rpm"),
        member("west", "b", "b-rpm")
    );
    assert_eq!(
        errors_of(&policy(&ok, r#", "mode": "shadow""#)),
        vec!["policies[0].mode: a pool routes every call to a member: its policy limits in `reject` or `queue` mode, not in shadow mode"]
    );
    assert!(parse_policy_set(&policy(&ok, "")).is_ok());
    // A member's limit named by another policy is refused there too.
    let other = format!(
        r#"{{"version": 1, "policies": [
            {{"name": "llm", "match": {{"host": "llm.example"}}, "rate": {{"requests": 100, "period": "1s"}},
              "pool": {ok}}},
            {{"name": "other", "match": {{"host": "o.example"}}, "rate": {{"requests": 1, "period": "1s"}},
              "limits": [{{"name": "b-rpm", "rate": {{"requests": 10, "period": "1s"}}, "provider": {{}}}}]}}]}}"#
    );
    assert_eq!(
        errors_of(&other),
        vec!["policies[0].pool.members[1].limits[0].name: limit \"b-rpm\" is also named at policies[1].limits[0]: a pool member's limits are its own"]
    );
}

#[test]
fn a_pool_members_money_limit_needs_the_sets_prices() {
    let json = set_with(&format!(
        r#"{{"name": "llm", "match": {{"host": "llm.example"}}, "rate": {{"requests": 100, "period": "1s"}},
            "pool": {{"members": [{}, {{"name": "west", "cluster": "w", "limits": [
              {{"name": "w-rps", "rate": {{"requests": 10, "period": "1s"}}, "provider": {{}}}},
              {{"name": "w-usd", "rate": {{"algorithm": "fixed_window", "requests": 1000000, "period": "1d"}}, "cost": "price"}}]}}]}}}}"#,
        member("east", "e", "e-rps")
    ));
    assert_eq!(
        errors_of(&json),
        vec!["policies[0].pool.members[1].limits[1].cost: a price needs the set's `prices`: what each model costs, and in which currency"]
    );
}

/// A pool decides once the body is in when it reads it (its route header
/// is written before the held headers go on): a match, a sticky key and a
/// member's costs may read the JSON body. A pool's calls are sent for a
/// cheaper model by a downgrade on the pool policy's own limits, never on
/// a member's (a member whose budget cannot take a call is passed over).
#[test]
fn a_pool_may_read_the_request_body_and_downgrade_on_its_own_limits() {
    let json = set_with(&format!(
        r#"{{"name": "llm", "match": {{"host": "llm.example", "json": [{{"path": "model", "equals": "gpt-4o"}}]}},
            "rate": {{"requests": 100, "period": "1s"}},
            "pool": {{"sticky": {{"json": "user"}}, "members": [{}, {{"name": "west", "cluster": "w", "limits": [
              {{"name": "w-rps", "rate": {{"requests": 10, "period": "1s"}}, "provider": {{}}}},
              {{"name": "w-tpm", "rate": {{"requests": 100000, "period": "1m"}},
                "cost": {{"json": "max_tokens", "default": 100, "max": 1000}}}}]}}]}}}}"#,
        member("east", "e", "e-rps")
    ));
    parse_policy_set(&json).unwrap_or_else(|e| panic!("{e}"));
    let priced = format!(
        r#"{{"version": 1, "prices": {{"currency": "USD", "models": {{"gpt-4o": {{"input": "2.50", "output": "10.00"}},
              "gpt-4o-mini": {{"input": "0.15", "output": "0.60"}}}}}},
            "policies": [{{"name": "llm", "match": {{"host": "llm.example"}}, "rate": {{"requests": 100, "period": "1s"}},
            "pool": {{"members": [{}, {{"name": "west", "cluster": "w", "limits": [
              {{"name": "w-rps", "rate": {{"requests": 10, "period": "1s"}}, "provider": {{}}}},
              {{"name": "w-usd", "rate": {{"algorithm": "fixed_window", "requests": 1000000, "period": "1d"}}, "cost": "price"DOWNGRADE}}]}}]}}}}]}}"#,
        member("east", "e", "e-rps")
    );
    parse_policy_set(&priced.replace("DOWNGRADE", "")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        errors_of(&priced.replace(
            "DOWNGRADE",
            r#", "downgrade": {"at": 0.8, "models": {"gpt-4o": "gpt-4o-mini"}}"#
        )),
        vec!["policies[0].pool.members[1].limits[1].downgrade: a member whose budget cannot take a call is passed over already: put the downgrade on the pool policy's own `limits`"]
    );
    let own = priced.replace("DOWNGRADE", "").replace(
        r#""rate": {"requests": 100, "period": "1s"},
            "pool""#,
        r#""rate": {"requests": 100, "period": "1s"},
            "limits": [{"name": "team-usd", "key": {"header": "x-team"}, "cost": "price",
                        "rate": {"algorithm": "fixed_window", "requests": 5000000, "period": "1d"},
                        "downgrade": {"at": 0.8, "models": {"gpt-4o": "gpt-4o-mini"}}}],
            "pool""#,
    );
    assert!(own.contains("team-usd"));
    parse_policy_set(&own).unwrap_or_else(|e| panic!("{e}"));
}

/// A route rung: on a pool policy's own rate limit, naming one of its
/// members, its share in (0, 1]; refused on a policy without a pool, on a
/// member's limit and on a concurrency limit, each with its field.
#[test]
fn a_route_rung_names_a_member_of_its_own_pool() {
    let pool = |route: &str, member_route: &str| {
        set_with(&format!(
            r#"{{"name": "llm", "match": {{"host": "llm.example"}}, "rate": {{"requests": 100, "period": "1s"}},
                "limits": [{{"name": "team-daily", "key": {{"header": "x-team"}},
                             "rate": {{"requests": 1000, "period": "1d", "algorithm": "fixed_window"}}{route}}}],
                "pool": {{"members": [{}, {{"name": "local", "cluster": "l", "limits": [
                  {{"name": "l-rps", "rate": {{"requests": 10, "period": "1s"}}, "provider": {{}}{member_route}}}]}}]}}}}"#,
            member("cloud", "c", "c-rps")
        ))
    };
    parse_policy_set(&pool(r#", "route": {"at": 0.9, "member": "local"}"#, ""))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        errors_of(&pool(r#", "route": {"at": 0, "member": "nowhere"}"#, "")),
        vec![
            "policies[0].limits[0].route.at: a share of the limit, above 0 and at most 1 (0.9 routes past 90 %)",
            "policies[0].limits[0].route.member: \"nowhere\" is no member of this pool (its members: cloud, local)",
        ]
    );
    assert_eq!(
        errors_of(&pool("", r#", "route": {"at": 0.5, "member": "cloud"}"#)),
        vec!["policies[0].pool.members[1].limits[0].route: a member's full limit passes the member over already: put the route rung on the pool policy's own `limits`"]
    );
    assert_eq!(
        errors_of(&set_with(
            r#"{"name": "api", "match": {"host": "a.example"}, "rate": {"requests": 10, "period": "1s"},
                "limits": [{"name": "daily", "rate": {"requests": 100, "period": "1d"}, "route": {"at": 0.5, "member": "x"}},
                           {"name": "slots", "concurrency": {"max_in_flight": 2}, "route": {"at": 0.5, "member": "x"}}]}"#
        )),
        vec![
            "policies[0].limits[0].route: a route rung sends calls to a member of the policy's pool: this policy has no `pool`",
            "policies[0].limits[1].route: a route rung sends calls to a member of the policy's pool: this policy has no `pool`",
        ]
    );
}

/// A queue rung: on a policy's own fixed-window limit, in a policy that
/// queues, its share in (0, 1), a keyed limit only under the policy's own
/// key; refused on a token bucket (so on a global limit), a concurrency
/// limit and a pool member's limit, each with its field.
#[test]
fn a_queue_rung_paces_a_window_of_a_queueing_policy() {
    let paced = |on_limit: &str, key: &str, limits: &str| {
        set_with(&format!(
            r#"{{"name": "llm", "match": {{"host": "llm.example"}}, "rate": {{"requests": 100, "period": "1s"}}{on_limit}{key},
                "limits": [{limits}]}}"#
        ))
    };
    let queue = r#", "on_limit": {"action": "queue", "max_wait": "30s"}"#;
    let team = r#", "key": {"header": "x-team"}"#;
    let daily = |rest: &str| {
        format!(
            r#"{{"name": "daily", "rate": {{"requests": 1000, "period": "1d", "algorithm": "fixed_window"}}, "queue": {{"at": 0.8}}{rest}}}"#
        )
    };
    for ok in [
        paced(queue, "", &daily("")),
        paced(
            queue,
            team,
            &daily(r#", "key": {"header": "X-Team", "max_keys": 50}"#),
        ),
    ] {
        parse_policy_set(&ok).unwrap_or_else(|e| panic!("{e}"));
    }
    assert_eq!(
        errors_of(&paced("", "", &daily(r#", "key": {"header": "x-team"}"#))),
        vec![
            "policies[0].limits[0].queue: a queue rung holds calls in the policy's queue: set `on_limit.action: queue` (and its `max_wait`, the longest a call is held)",
            "policies[0].limits[0].queue.key: a paced key's calls wait in their policy key's queue: give the policy the same `key` (x-team), or one key's paced call would hold every other key's behind it",
        ]
    );
    assert_eq!(
        errors_of(&paced(
            queue,
            "",
            r#"{"name": "bucket", "rate": {"requests": 1000, "period": "1h"}, "queue": {"at": 1}},
               {"name": "slots", "concurrency": {"max_in_flight": 2}, "queue": {"at": 0.5}}"#
        )),
        vec![
            "policies[0].limits[0].queue: a queue rung paces the rest of a window: give the limit `algorithm: fixed_window`",
            "policies[0].limits[0].queue.at: a share of the limit, above 0 and below 1 (0.8 paces the last 20 %)",
            "policies[0].limits[1].queue: a queue rung paces a limit's window: a concurrency limit has none",
        ]
    );
    assert_eq!(
        errors_of(&set_with(&format!(
            r#"{{"name": "llm", "match": {{"host": "llm.example"}}, "rate": {{"requests": 100, "period": "1s"}}{queue},
                "pool": {{"members": [{}, {{"name": "local", "cluster": "l", "limits": [
                  {{"name": "l-daily", "rate": {{"requests": 10, "period": "1d", "algorithm": "fixed_window"}}, "queue": {{"at": 0.5}}}},
                  {{"name": "l-rps", "rate": {{"requests": 10, "period": "1s"}}, "provider": {{}}}}]}}]}}}}"#,
            member("cloud", "c", "c-rps")
        ))),
        vec!["policies[0].pool.members[1].limits[0].queue: a member's paced limit would pass the member over, not hold the call: put the queue rung on the pool policy's own `limits`"]
    );
}

/// Third security review, item 1, was: a pool after a policy that reads
/// the body would route its calls before that policy passed them on. A
/// pool now routes a call once it is decided, body and all, so it may
/// follow a body reader (the e2e `pools` test sends such calls through
/// Envoy). A pool's route header cannot be a credential, framing, pseudo
/// or hop-by-hop header.
#[test]
fn a_pool_may_follow_a_body_reader_but_not_route_by_a_protected_header() {
    let pool = |host: &str, route: &str| {
        format!(
            r#"{{"name": "llm", "match": {{"host": "{host}"}}, "rate": {{"requests": 100, "period": "1s"}},
                "pool": {{{route}"members": [{}, {}]}}}}"#,
            member("east", "llm-east", "east-rps"),
            member("west", "llm-west", "west-rps")
        )
    };
    let per_model = r#"{"name": "gpt-4o", "match": {"host": "*.llm.example", "json": [{"path": "model", "equals": "gpt-4o"}]},
                        "rate": {"requests": 10, "period": "1m"}}"#;
    let two = |a: &str, b: &str| format!(r#"{{"version": 1, "policies": [{a}, {b}]}}"#);
    // A pool after a body reader of its calls decides once the body is
    // in, as the reader does: accepted.
    for ok in [
        two(per_model, &pool("api.llm.example", "")),
        two(&pool("api.llm.example", ""), per_model),
        two(per_model, &pool("api.other.example", "")),
    ] {
        parse_policy_set(&ok).unwrap_or_else(|e| panic!("{e}"));
    }
    for header in [
        "authorization",
        "Host",
        "content-length",
        "x-api-key",
        "connection",
        "transfer-encoding",
    ] {
        let errors = errors_of(&set_with(&pool(
            "llm.example",
            &format!(r#""route_header": "{header}", "#),
        )));
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            errors[0]
                .starts_with("policies[0].pool.route_header: Sluice writes the chosen member here"),
            "{errors:?}"
        );
    }
    assert!(errors_of(&set_with(&pool(
        "llm.example",
        r#""route_header": ":authority", "#
    )))[0]
        .starts_with("policies[0].pool.route_header:"));
}

/// Item 12: a key on a credential header is never labelled by its value;
/// item 4's `unreadable` goes with `match.json`; the money limits of one
/// policy read the call's model in one place, and `max_output` is at
/// least `default_output`.
#[test]
fn credential_keys_unreadable_bodies_and_money_models_are_checked_with_their_field() {
    let keyed = |header: &str| {
        set_with(&format!(
            r#"{{"name": "a", "match": {{"host": "x"}}, "rate": {{"requests": 1, "period": "1s"}},
                "key": {{"header": "{header}", "label": "value"}}}}"#
        ))
    };
    for header in [
        "authorization",
        "Cookie",
        "x-api-key",
        "api-key",
        "proxy-authorization",
    ] {
        let errors = errors_of(&keyed(header));
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            errors[0].starts_with("policies[0].key.label: "),
            "{errors:?}"
        );
    }
    parse_policy_set(&keyed("x-tenant")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        errors_of(&set_with(
            r#"{"name": "a", "match": {"host": "x", "unreadable": "next"}, "rate": {"requests": 1, "period": "1s"}}"#
        )),
        vec!["policies[0].match.unreadable: applies only with `match.json` or `match.mcp`: without conditions on the body a policy matches by its headers alone"]
    );
    let money = |second: &str| {
        format!(
            r#"{{"version": 1, "prices": {{"currency": "USD", "models": {{"gpt-4o": {{"input": "2.5", "output": "10"}}}}}},
                "policies": [{{"name": "llm", "match": {{"host": "x"}}, "rate": {{"requests": 10, "period": "1s"}},
                  "limits": [{{"name": "team", "rate": {{"requests": 1000000, "period": "1d", "algorithm": "fixed_window"}}, "cost": "price"}},
                             {{"name": "company", "rate": {{"requests": 9000000, "period": "1d", "algorithm": "fixed_window"}},
                               "cost": {{"price": {second}}}}}]}}]}}"#
        )
    };
    parse_policy_set(&money(r#"{"model": {"json": "model"}}"#)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        errors_of(&money(r#"{"model": {"header": "x-model"}}"#)),
        vec!["policies[0].limits[1].cost.price.model: the policy's money limits price a call at one model: policies[0].limits[0] reads it elsewhere"]
    );
    assert_eq!(
        errors_of(&money(r#"{"model": {"header": "x-model", "json": "model"}}"#))[0],
        "policies[0].limits[1].cost.price.model: give exactly one of `json` (a body field), `header` or `path_after` (the path's segment after it)"
    );
    assert_eq!(
        errors_of(&money(r#"{"model": {"path_after": "openai/deployments"}}"#))[0],
        "policies[0].limits[1].cost.price.model.path_after: must start and end with '/': the model is the path's segment right after it"
    );
    assert_eq!(
        errors_of(&money(r#"{"default_output": 5000, "max_output": 100}"#)),
        vec!["policies[0].limits[1].cost.price.max_output: must be >= 5000"]
    );
}

/// `match.mcp` (issue 52): methods and tools named as MCP names them,
/// bounded, tools only with `tools/call`.
#[test]
fn mcp_matches_are_checked_with_their_field() {
    let with = |mcp: &str| {
        set_with(&format!(
            r#"{{"name": "a", "match": {{"host": "mcp.example", "mcp": {mcp}}}, "rate": {{"requests": 1, "period": "1s"}}}}"#
        ))
    };
    let policy = parse_policy_set(&with(r#"{"tools": ["search", "github_*"]}"#))
        .unwrap_or_else(|e| panic!("{e}"));
    let mcp = policy.policies[0].matcher.mcp.as_ref().unwrap();
    assert_eq!(mcp.methods, ["tools/call"], "the default");
    parse_policy_set(&with(r#"{"methods": ["tools/call", "resources/read"]}"#))
        .unwrap_or_else(|e| panic!("{e}"));
    let many: Vec<String> = (0..300).map(|i| format!("\"t{i}\"")).collect();
    for (mcp, error) in [
        (
            r#"{"methods": []}"#.to_string(),
            "policies[0].match.mcp.methods: name at least one",
        ),
        (
            r#"{"methods": ["tools list"]}"#.to_string(),
            "policies[0].match.mcp.methods[0]: no spaces",
        ),
        (
            r#"{"tools": ["*"]}"#.to_string(),
            "policies[0].match.mcp.tools[0]: 1 to 128",
        ),
        (
            r#"{"tools": ["a*b"]}"#.to_string(),
            "policies[0].match.mcp.tools[0]: `*` only at its end",
        ),
        (
            format!(r#"{{"tools": [{}]}}"#, many.join(",")),
            "policies[0].match.mcp.tools: at most 256",
        ),
        (
            r#"{"methods": ["ping"], "tools": ["search"]}"#.to_string(),
            "policies[0].match.mcp.tools: tools are named by `tools/call`",
        ),
        (
            r#"{"tool": ["search"]}"#.to_string(),
            "unknown field `tool`",
        ),
    ] {
        let errors = errors_of(&with(&mcp));
        assert!(
            errors.iter().any(|e| e.contains(error)),
            "{mcp}: {errors:?}"
        );
    }
    parse_policy_set(&set_with(
        r#"{"name": "a", "match": {"host": "x", "mcp": {}, "unreadable": "next"}, "rate": {"requests": 1, "period": "1s"}}"#,
    ))
    .unwrap_or_else(|e| panic!("{e}"));
}

/// Step 4 item 1: tool prices are per call, never free, under a bound,
/// named as models are; an MCP policy's money limit needs them.
#[test]
fn tool_prices_are_checked_and_an_mcp_money_limit_needs_them() {
    let set = |tools: &str| {
        format!(
            r#"{{"version": 1, "prices": {{"currency": "USD", "models": {{"gpt-4o": {{"input": 2.5, "output": 10}}}}{tools}}},
              "policies": [{{"name": "agents", "match": {{"host": "mcp.example", "mcp": {{"tools": ["search"]}}}},
                "rate": {{"requests": 10, "period": "1s"}},
                "limits": [{{"name": "run", "key": {{"header": "x-run"}},
                            "rate": {{"requests": 1000000, "period": "1d", "algorithm": "fixed_window"}},
                            "cost": "price"}}]}}]}}"#
        )
    };
    assert!(parse_policy_set(&set(r#", "tools": {"search": "0.01"}"#)).is_ok());
    assert!(parse_policy_set(&set(r#", "tool_default": 0.002"#)).is_ok());
    assert_eq!(
        errors_of(&set("")),
        vec!["policies[0].limits[0].cost: the policy counts MCP tool calls, priced by tool, and the set's `prices` price no tool: give `prices.tools` or `prices.tool_default`"]
    );
    assert_eq!(
        errors_of(&set(
            r#", "tools": {"free": 0, "dear": "10001", "a*b": "1", "": "1"}, "tool_default": "0""#
        )),
        vec![
            "prices.tools.: a name has 1 to 128 characters, `*` only at its end",
            "prices.tools.a*b: a name has 1 to 128 characters, `*` only at its end",
            "prices.tools.dear: at most 10000 a call: a tool's price is per call",
            "prices.tools.free: at least 0.000001: a call a money limit counts is never free (leave a free tool out of the policy's `match.mcp.tools`)",
            "prices.tool_default: at least 0.000001: a call a money limit counts is never free (leave a free tool out of the policy's `match.mcp.tools`)",
        ]
    );
    let e = parse_policy_set(&set(r#", "tools": {"search": "-1"}"#))
        .unwrap_err()
        .to_string();
    assert!(e.contains("prices.tools"), "{e}");
}
