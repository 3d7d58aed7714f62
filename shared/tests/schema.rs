//! The published JSON Schema (docs/policy.schema.json) must be what the code
//! generates, so the document can never drift from the parser.
#![cfg(feature = "schema")]

#[test]
fn published_schema_matches_the_code() {
    let generated = sluice_shared::policy_set_schema();
    let published: serde_json::Value =
        serde_json::from_str(include_str!("../../docs/policy.schema.json"))
            .expect("docs/policy.schema.json is JSON");
    assert!(
        generated == published,
        "docs/policy.schema.json is stale: run `make schema`"
    );
}

#[test]
fn schema_names_every_top_level_policy_field() {
    let schema = sluice_shared::policy_set_schema();
    let policy = &schema["$defs"]["Policy"]["properties"];
    for field in [
        "name",
        "match",
        "key",
        "rate",
        "cost",
        "concurrency",
        "on_limit",
        "priority",
        "mode",
    ] {
        assert!(
            policy.get(field).is_some(),
            "schema lacks {field}: {policy}"
        );
    }
    assert_eq!(
        schema["$defs"]["Policy"]["additionalProperties"],
        serde_json::json!(false)
    );
}
