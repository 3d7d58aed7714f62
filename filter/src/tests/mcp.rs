//! MCP tool calls through the worker (`match.mcp`): only the methods and
//! tools a policy names are counted, per agent; a batch takes all its
//! counted messages or none; a refused request gets a JSON-RPC error with
//! its own id, a refused notification a bare 429.

use proptest::strategy::Strategy;
use serde_json::{json, Value};

use crate::testing::FakeHost;
use crate::tests::{header_of, pass, req, status, worker, T0};
use crate::worker::{RequestBody, Verdict, Worker};

/// 3 searches a minute per agent; the rest of the MCP server is free.
const SEARCHES: &str = r#"{"version": 1, "policies": [
    {"name": "search", "match": {"host": "mcp.tools.example", "mcp": {"tools": ["search"]}},
     "key": {"header": "x-agent"},
     "rate": {"requests": 3, "period": "1m", "burst": 3}}]}"#;

pub(super) const MCP: &[u8] = b"mcp.tools.example";

pub(super) fn send(host: &FakeHost, w: &mut Worker, id: u32, agent: &str, body: &Value) -> Verdict {
    let agent_header = [("x-agent", agent.as_bytes())];
    let headers = req(MCP, &agent_header);
    let first = w.on_request_with(host, id, headers.as_slice(), RequestBody::Coming);
    assert_eq!(first, Verdict::ReadBody, "an MCP policy reads the body");
    let text = body.to_string();
    let verdict = w.on_request_with(
        host,
        id,
        headers.as_slice(),
        RequestBody::Read(Some(text.as_bytes())),
    );
    if verdict == Verdict::Continue {
        w.on_stream_end(host, id);
    }
    verdict
}

pub(super) fn tool_call(id: Value, tool: &str) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
           "params": {"name": tool, "arguments": {"q": "rivers"}}})
}

pub(super) fn body_of(v: &Verdict) -> Value {
    match v {
        Verdict::Reply(r) => serde_json::from_slice(&r.body).unwrap_or(Value::Null),
        _ => Value::Null,
    }
}

#[test]
fn searches_are_counted_per_agent_and_other_messages_pass() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, SEARCHES);
    let mut id = 0;
    let mut next = || {
        id += 1;
        id
    };
    for message in [
        json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}}),
        json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
        json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"}),
        tool_call(json!(3), "fetch"),
    ] {
        for _ in 0..5 {
            assert_eq!(
                send(&host, &mut w, next(), "a", &message),
                Verdict::Continue
            );
        }
    }
    for n in 0..3 {
        let v = send(&host, &mut w, next(), "a", &tool_call(json!(n), "search"));
        assert_eq!(v, Verdict::Continue, "search {n}");
    }
    let refused = send(
        &host,
        &mut w,
        next(),
        "a",
        &tool_call(json!("q-4"), "search"),
    );
    assert_eq!(
        status(&refused),
        200,
        "an MCP client reads a JSON-RPC error only on 200"
    );
    assert_eq!(
        header_of(&refused, "content-type"),
        Some("application/json")
    );
    assert_eq!(header_of(&refused, "x-sluice-policy"), Some("search"));
    let retry: u64 = header_of(&refused, "retry-after").unwrap().parse().unwrap();
    assert!((1..=20).contains(&retry), "{retry}");
    let error = body_of(&refused);
    assert_eq!(error["jsonrpc"], "2.0");
    assert_eq!(error["id"], "q-4");
    assert_eq!(error["error"]["code"], -32029);
    assert_eq!(error["error"]["data"]["policy"], "search");
    assert_eq!(error["error"]["data"]["retry_after_s"], retry);
    assert!(
        error["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("limited by sluice policy search")),
        "{error}"
    );
    // Another agent has its own three.
    for n in 0..3 {
        let v = send(&host, &mut w, next(), "b", &tool_call(json!(n), "search"));
        assert_eq!(v, Verdict::Continue);
    }
    // A refused notification has nobody to answer: 429, no body.
    let notification =
        json!({"jsonrpc": "2.0", "method": "tools/call", "params": {"name": "search"}});
    let refused = send(&host, &mut w, next(), "b", &notification);
    assert_eq!(status(&refused), 429);
    match &refused {
        Verdict::Reply(r) => assert!(r.body.is_empty()),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_batch_takes_all_its_counted_messages_or_none_and_answers_each_request() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, SEARCHES);
    let two = json!([tool_call(json!(1), "search"), tool_call(json!(2), "search"),
                     {"jsonrpc": "2.0", "id": 3, "method": "tools/list"}]);
    assert_eq!(send(&host, &mut w, 1, "a", &two), Verdict::Continue);
    // One search left: a batch of two is refused whole, each request named.
    let refused = send(&host, &mut w, 2, "a", &two);
    assert_eq!(status(&refused), 200);
    let answers = body_of(&refused);
    let ids: Vec<&Value> = answers
        .as_array()
        .unwrap()
        .iter()
        .map(|a| &a["id"])
        .collect();
    assert_eq!(ids, [&json!(1), &json!(2), &json!(3)]);
    assert!(answers[2]["error"]["message"]
        .as_str()
        .is_some_and(|m| m.starts_with("refused with its batch")));
    // The one left is still there.
    assert_eq!(
        send(&host, &mut w, 3, "a", &tool_call(json!(9), "search")),
        Verdict::Continue
    );
    // A batch of notifications only: a bare 429.
    let quiet = json!([{"jsonrpc": "2.0", "method": "tools/call", "params": {"name": "search"}}]);
    assert_eq!(status(&send(&host, &mut w, 4, "a", &quiet)), 429);
    // A minute on, the agent has its three again.
    pass(&host, &mut w, 60_000);
    assert_eq!(
        send(
            &host,
            &mut w,
            5,
            "a",
            &json!([
                tool_call(json!(1), "search"),
                tool_call(json!(2), "search"),
                tool_call(json!(3), "search")
            ])
        ),
        Verdict::Continue
    );
}

#[test]
fn a_body_that_is_no_json_falls_under_the_policy_and_one_that_is_no_call_does_not() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, SEARCHES);
    let headers = req(MCP, &[("x-agent", b"a")]);
    let mut unreadable = 0;
    for id in 1..=5 {
        let _ = w.on_request_with(&host, id, headers.as_slice(), RequestBody::Coming);
        let v = w.on_request_with(
            &host,
            id,
            headers.as_slice(),
            RequestBody::Read(Some(b"{not json")),
        );
        if v == Verdict::Continue {
            unreadable += 1;
            w.on_stream_end(&host, id);
        } else {
            // Not JSON-RPC that Sluice could read: the policy's own reply.
            assert_eq!(status(&v), 429);
        }
    }
    assert_eq!(unreadable, 3, "fail closed: counted as the policy's calls");
    // Valid JSON that is no JSON-RPC call is not the policy's.
    let other = json!({"model": "gpt-4o"});
    assert_eq!(send(&host, &mut w, 9, "a", &other), Verdict::Continue);
}

/// One dollar per agent run (`x-agent-run`) across its tool calls, priced
/// per call by tool, and its LLM calls, priced by tokens: one limit named
/// by both policies.
const RUN_BUDGET: &str = r#"{"version": 1,
    "prices": {"currency": "USD",
               "models": {"gpt-4o": {"input": "2.5", "output": "10"}},
               "tools": {"search": "0.01", "expensive": "0.25", "render_*": "0.05"}},
    "policies": [
      {"name": "tools", "match": {"host": "mcp.tools.example", "mcp": {}},
       "rate": {"requests": 1000, "period": "1s"},
       "limits": [{"name": "run", "key": {"header": "x-agent-run"},
                   "rate": {"requests": 1000000, "period": "1d", "algorithm": "fixed_window"},
                   "cost": "price"}]},
      {"name": "llm", "match": {"host": "llm.example"},
       "rate": {"requests": 1000, "period": "1s"},
       "limits": [{"name": "run", "key": {"header": "x-agent-run"},
                   "rate": {"requests": 1000000, "period": "1d", "algorithm": "fixed_window"},
                   "cost": "price"}]}]}"#;

fn run_call(host: &FakeHost, w: &mut Worker, id: u32, to: &[u8], run: &str, body: &str) -> Verdict {
    let run_header = [("x-agent-run", run.as_bytes())];
    let headers = req(to, &run_header);
    let first = w.on_request_with(host, id, headers.as_slice(), RequestBody::Coming);
    assert_eq!(first, Verdict::ReadBody);
    w.on_request_with(
        host,
        id,
        headers.as_slice(),
        RequestBody::Read(Some(body.as_bytes())),
    )
}

fn tool_run_call(host: &FakeHost, w: &mut Worker, id: u32, run: &str, body: &Value) -> Verdict {
    let v = run_call(host, w, id, MCP, run, &body.to_string());
    if v == Verdict::Continue {
        w.on_stream_end(host, id);
    }
    v
}

/// Item 1 of step 4: a money limit prices each tool call at its tool's
/// price (a batch, the sum of its messages'), charged as priced (an MCP
/// answer reports no usage), and an LLM call of the same run at its
/// tokens, from one budget; a tool without a price is refused, never free.
#[test]
fn one_budget_per_run_covers_its_tool_calls_and_its_llm_tokens() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, RUN_BUDGET);
    // Three expensive calls: 0.75.
    for id in 1..=3 {
        let v = tool_run_call(&host, &mut w, id, "r1", &tool_call(json!(id), "expensive"));
        assert_eq!(v, Verdict::Continue, "expensive call {id}");
    }
    // The run's LLM call: estimated at 1 000 output tokens (0.01 and its
    // prompt), charged what its answer reports: 0.01 and 40 prompt tokens.
    let llm = r#"{"model": "gpt-4o", "max_tokens": 1000, "messages": []}"#;
    assert_eq!(
        run_call(&host, &mut w, 10, b"llm.example", "r1", llm),
        Verdict::Continue
    );
    let answer =
        br#"{"model": "gpt-4o", "usage": {"prompt_tokens": 40, "completion_tokens": 1000}}"#;
    let headers: Vec<(&str, &[u8])> =
        vec![(":status", b"200"), ("content-type", b"application/json")];
    assert!(
        w.on_answer_headers(&host, 10, headers.as_slice(), false)
            .read_body
    );
    w.on_answer_body(&host, 10, answer, true);
    w.on_stream_end(&host, 10);
    // Spent 0.760100; a batch of an expensive call and a search (0.26)
    // would pass the dollar: refused whole, each request its error.
    let batch = json!([
        tool_call(json!("b1"), "expensive"),
        tool_call(json!("b2"), "search")
    ]);
    let refused = tool_run_call(&host, &mut w, 11, "r1", &batch);
    assert_eq!(status(&refused), 200);
    let errors = body_of(&refused);
    assert_eq!(errors[0]["id"], "b1");
    assert_eq!(errors[1]["id"], "b2");
    let data = &errors[0]["error"]["data"];
    assert_eq!(data["limit"], "run");
    assert_eq!(data["spent"], "0.7601");
    assert_eq!(data["budget"], "1");
    assert_eq!(data["currency"], "USD");
    // T0 is 2027-01-15T08:00:00Z: the run's day renews at UTC midnight.
    assert_eq!(data["renews_at"], "2027-01-16T00:00:00Z");
    assert_eq!(data["renews_in_s"], 16 * 3600);
    // Its messages alone fit: 0.25 and 0.01 (of 0.2399 left: the search,
    // then a render_ tool at its prefix's price, not the expensive call).
    let search = tool_run_call(&host, &mut w, 12, "r1", &tool_call(json!(12), "search"));
    assert_eq!(search, Verdict::Continue);
    let render = tool_run_call(&host, &mut w, 13, "r1", &tool_call(json!(13), "render_pdf"));
    assert_eq!(render, Verdict::Continue);
    let dear = tool_run_call(&host, &mut w, 14, "r1", &tool_call(json!(14), "expensive"));
    assert_eq!(body_of(&dear)["error"]["data"]["spent"], "0.8201");
    // A tool without a price is refused, whatever is left.
    let unpriced = tool_run_call(&host, &mut w, 15, "r2", &tool_call(json!(15), "fetch"));
    let error = body_of(&unpriced);
    assert_eq!(error["id"], 15);
    assert_eq!(error["error"]["data"]["reason"], "tool-unpriced");
    assert!(error["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("a tool it calls has no price")));
    // Another run has its own dollar.
    let other = tool_run_call(&host, &mut w, 16, "r2", &tool_call(json!(16), "expensive"));
    assert_eq!(other, Verdict::Continue);
}

fn message() -> impl Strategy<Value = Value> {
    use proptest::prelude::*;
    let method = prop_oneof![
        Just("tools/call"),
        Just("tools/list"),
        Just("initialize"),
        Just("resources/read")
    ];
    let tool = prop_oneof![
        Just(json!("search")),
        Just(json!("expensive")),
        Just(json!("render_a")),
        Just(json!("fetch")),
        Just(json!("")),
        Just(json!(7)),
        Just(Value::Null)
    ];
    let id = prop_oneof![
        Just(None),
        Just(Some(json!(1))),
        Just(Some(json!("a"))),
        Just(Some(Value::Null)),
        Just(Some(json!({"nested": [1]})))
    ];
    (method, tool, id).prop_map(|(method, tool, id)| {
        let mut m = json!({"jsonrpc": "2.0", "method": method, "params": {"name": tool}});
        if let Some(id) = id {
            m["id"] = id;
        }
        m
    })
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 200, ..Default::default() })]

    /// Any JSON-RPC message or batch (any method, tool, id; too many
    /// messages; bytes that are no JSON) through a set with tool prices,
    /// keyed budgets and a rate: no panic, and every refusal an MCP client
    /// can read answers each request of its body with that request's id.
    #[test]
    fn any_mcp_body_is_decided_and_its_refusal_answers_its_ids(
        bodies in proptest::collection::vec(
            proptest::prop_oneof![
                message().prop_map(|m| m.to_string().into_bytes()),
                proptest::collection::vec(message(), 0..6).prop_map(|b| Value::Array(b).to_string().into_bytes()),
                proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64),
            ],
            1..40,
        ),
    ) {
        let host = FakeHost::at(T0);
        let mut w = worker(&host, RUN_BUDGET);
        for (n, body) in bodies.iter().enumerate() {
            let id = u32::try_from(n).unwrap_or(u32::MAX);
            let run_header = [("x-agent-run", b"r".as_slice())];
            let headers = req(MCP, &run_header);
            let _ = w.on_request_with(&host, id, headers.as_slice(), RequestBody::Coming);
            let verdict = w.on_request_with(&host, id, headers.as_slice(), RequestBody::Read(Some(body)));
            match &verdict {
                Verdict::Continue => w.on_stream_end(&host, id),
                Verdict::Reply(r) if r.status == 200 => {
                    let sent: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
                    let answer: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
                    let requests: Vec<&Value> = match &sent {
                        Value::Array(batch) => batch.iter().filter(|m| m.get("id").is_some()).collect(),
                        one => vec![one],
                    };
                    let answers: Vec<&Value> = match &answer {
                        Value::Array(all) => all.iter().collect(),
                        one => vec![one],
                    };
                    proptest::prop_assert_eq!(requests.len(), answers.len(), "{} answered {}", sent, answer);
                    for (request, answer) in requests.iter().zip(&answers) {
                        proptest::prop_assert_eq!(&request["id"], &answer["id"]);
                        proptest::prop_assert!(answer["error"]["code"].is_i64(), "{}", answer);
                    }
                }
                Verdict::Reply(r) => proptest::prop_assert!(r.status >= 400, "{:?}", r),
                other => proptest::prop_assert!(false, "{:?}", other),
            }
        }
    }
}
