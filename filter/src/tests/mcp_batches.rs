//! MCP batches no one policy decides whole (`split_batch`): each message
//! takes from the limits it would take sent alone, the batch goes only if
//! all of them have room, a refused batch gives back what its admitted
//! parts took, and each refused request is answered with its own limit.

use serde_json::{json, Value};

use super::mcp::{body_of, send, tool_call, MCP};
use crate::testing::FakeHost;
use crate::tests::{header_of, pass, req, status, worker, T0};
use crate::worker::{RequestBody, Verdict, Worker};

/// Searches per agent, slow calls apart, a few tools per tool name, a
/// tool whose calls wait in a queue, a tool shared fairly between agents,
/// a tool one call at a time, and documents keyed per tool holding slots
/// of a further limit.
pub(super) const SPLIT: &str = r#"{"version": 1, "policies": [
    {"name": "search", "match": {"host": "mcp.tools.example", "mcp": {"tools": ["search"]}},
     "key": {"header": "x-agent"},
     "rate": {"requests": 30, "period": "1m", "burst": 30}},
    {"name": "slow", "match": {"host": "mcp.tools.example", "mcp": {"tools": ["slow"]}},
     "concurrency": {"max_in_flight": 2}},
    {"name": "per-tool", "match": {"host": "mcp.tools.example", "mcp": {"tools": ["lookup", "translate"]}},
     "key": {"json": "params.name"},
     "rate": {"requests": 3, "period": "1m", "burst": 3}},
    {"name": "queued", "match": {"host": "mcp.tools.example", "mcp": {"tools": ["report"]}},
     "rate": {"requests": 1, "period": "1m", "burst": 1},
     "on_limit": {"action": "queue", "max_wait": "5m"}},
    {"name": "shared", "match": {"host": "mcp.tools.example", "mcp": {"tools": ["share"]}},
     "rate": {"requests": 10, "period": "1s"}, "fair": {"key": {"header": "x-agent"}}},
    {"name": "render", "match": {"host": "mcp.tools.example", "mcp": {"tools": ["render"]}},
     "concurrency": {"max_in_flight": 1}},
    {"name": "docs", "match": {"host": "mcp.tools.example", "mcp": {"tools": ["read_doc", "write_doc"]}},
     "key": {"json": "params.name"}, "rate": {"requests": 1000, "period": "1s"},
     "limits": [{"name": "doc-slots", "concurrency": {"max_in_flight": 3}}]}]}"#;

/// Sends `body` and keeps its stream open (an admitted call holds its
/// slots until [`Worker::on_stream_end`]).
fn open(host: &FakeHost, w: &mut Worker, id: u32, body: &Value) -> Verdict {
    let agent = [("x-agent", b"a".as_slice())];
    let headers = req(MCP, &agent);
    let first = w.on_request_with(host, id, headers.as_slice(), RequestBody::Coming);
    assert_eq!(first, Verdict::ReadBody);
    let text = body.to_string();
    w.on_request_with(
        host,
        id,
        headers.as_slice(),
        RequestBody::Read(Some(text.as_bytes())),
    )
}

/// How many of `n` calls of `tool` alone are admitted.
fn admitted_of(host: &FakeHost, w: &mut Worker, first_id: u32, tool: &str, n: u32) -> u32 {
    (first_id..first_id + n)
        .filter(|id| send(host, w, *id, "a", &tool_call(json!(id), tool)) == Verdict::Continue)
        .count() as u32
}

fn reason_of(v: &Verdict) -> Option<&str> {
    header_of(v, "x-sluice-reason")
}

#[test]
fn a_batch_across_policies_takes_from_each_messages_own_limit_until_it_ends() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, SPLIT);
    let mixed = json!([
        tool_call(json!(1), "search"),
        tool_call(json!(2), "slow"),
        tool_call(json!(3), "fetch")
    ]);
    assert_eq!(open(&host, &mut w, 1, &mixed), Verdict::Continue);
    // The batch holds one of the two slow slots while its stream lasts.
    assert_eq!(
        open(&host, &mut w, 2, &tool_call(json!(1), "slow")),
        Verdict::Continue
    );
    let third = open(&host, &mut w, 3, &tool_call(json!(1), "slow"));
    assert_eq!(header_of(&third, "x-sluice-policy"), Some("slow"));
    w.on_stream_end(&host, 1);
    assert_eq!(
        open(&host, &mut w, 4, &tool_call(json!(1), "slow")),
        Verdict::Continue
    );
    // Its search took one of the agent's thirty.
    assert_eq!(admitted_of(&host, &mut w, 10, "search", 35), 29);
}

#[test]
fn a_batch_goes_whole_or_not_at_all_and_each_refused_request_names_its_limit() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, SPLIT);
    for id in [1, 2] {
        assert_eq!(
            open(&host, &mut w, id, &tool_call(json!(id), "slow")),
            Verdict::Continue
        );
    }
    let batch = json!([tool_call(json!(7), "search"), tool_call(json!(8), "slow"),
                       {"jsonrpc": "2.0", "id": 9, "method": "tools/list"},
                       {"jsonrpc": "2.0", "method": "notifications/progress"}]);
    let refused = open(&host, &mut w, 3, &batch);
    assert_eq!(status(&refused), 200);
    assert_eq!(header_of(&refused, "x-sluice-policy"), Some("slow"));
    assert!(header_of(&refused, "retry-after").is_some());
    let answers = body_of(&refused);
    let answers = answers.as_array().expect("an answer per request");
    let ids: Vec<&Value> = answers.iter().map(|a| &a["id"]).collect();
    assert_eq!(
        ids,
        [&json!(7), &json!(8), &json!(9)],
        "no answer to a notification"
    );
    assert_eq!(answers[1]["error"]["code"], -32029);
    assert_eq!(answers[1]["error"]["data"]["policy"], "slow");
    for own_limit_had_room in [&answers[0], &answers[2]] {
        let message = own_limit_had_room["error"]["message"]
            .as_str()
            .unwrap_or("");
        assert!(message.starts_with("refused with its batch"), "{message}");
    }
    // The search it took went back: the agent has all thirty.
    assert_eq!(admitted_of(&host, &mut w, 10, "search", 35), 30);
}

#[test]
fn a_batch_keyed_per_message_takes_each_keys_tokens_and_gives_them_back_if_refused() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, SPLIT);
    let keyed = json!([
        tool_call(json!(1), "lookup"),
        tool_call(json!(2), "lookup"),
        tool_call(json!(3), "translate")
    ]);
    assert_eq!(send(&host, &mut w, 1, "a", &keyed), Verdict::Continue);
    assert_eq!(admitted_of(&host, &mut w, 10, "lookup", 3), 1);
    // lookup is spent: a batch naming it is refused, and the translate and
    // the slow call it took are given back.
    let refused_batch = json!([
        tool_call(json!(4), "translate"),
        tool_call(json!(5), "slow"),
        tool_call(json!(6), "lookup")
    ]);
    let refused = open(&host, &mut w, 2, &refused_batch);
    assert_eq!(header_of(&refused, "x-sluice-policy"), Some("per-tool"));
    let answers = body_of(&refused);
    assert_eq!(answers[2]["id"], 6);
    assert_eq!(answers[2]["error"]["data"]["policy"], "per-tool");
    assert!(answers[0]["error"]["message"]
        .as_str()
        .is_some_and(|m| m.starts_with("refused with its batch")));
    assert_eq!(admitted_of(&host, &mut w, 20, "translate", 3), 2);
    for id in [30, 31] {
        assert_eq!(
            open(&host, &mut w, id, &tool_call(json!(id), "slow")),
            Verdict::Continue,
            "the refused batch's slow slot was given back"
        );
    }
}

#[test]
fn a_batch_whose_parts_cannot_be_decided_together_is_refused_whole_and_counts_nothing() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, SPLIT);
    // A fair share is taken through its table: not given back with a batch.
    let shared = json!([tool_call(json!(1), "search"), tool_call(json!(2), "share")]);
    let refused = send(&host, &mut w, 1, "a", &shared);
    assert_eq!(reason_of(&refused), Some("batch-mixed"));
    for (i, answer) in body_of(&refused).as_array().unwrap().iter().enumerate() {
        assert_eq!(answer["id"], json!(i + 1));
        assert_eq!(answer["error"]["code"], -32600);
    }
    // Two policies' slots of their own: a stream holds one.
    let two_slots = json!([tool_call(json!(1), "slow"), tool_call(json!(2), "render")]);
    assert_eq!(
        reason_of(&send(&host, &mut w, 2, "a", &two_slots)),
        Some("batch-mixed")
    );
    // Past the bound: refused before anything is classified alone.
    let huge = Value::Array((0..200).map(|i| tool_call(json!(i), "lookup")).collect());
    let refused = send(&host, &mut w, 4, "a", &huge);
    assert_eq!(reason_of(&refused), Some("batch-too-large"));
    assert_eq!(body_of(&refused).as_array().map(Vec::len), Some(200));
    // Nothing refused was counted.
    assert_eq!(admitted_of(&host, &mut w, 10, "search", 35), 30);
    assert_eq!(admitted_of(&host, &mut w, 50, "lookup", 5), 3);
    assert_eq!(admitted_of(&host, &mut w, 60, "share", 1), 1);
}

#[test]
fn a_queueing_policys_part_of_a_batch_is_decided_at_once() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, SPLIT);
    let batch = json!([tool_call(json!(1), "search"), tool_call(json!(2), "report")]);
    assert_eq!(send(&host, &mut w, 1, "a", &batch), Verdict::Continue);
    // Alone, the next report would wait its turn (a minute on)...
    let alone = open(&host, &mut w, 2, &tool_call(json!(3), "report"));
    assert!(matches!(alone, Verdict::Pause { .. }), "{alone:?}");
    w.on_stream_end(&host, 2);
    // ...in a batch it cannot: refused at once, told when to retry, and
    // the batch's search given back.
    let refused = send(&host, &mut w, 3, "a", &batch);
    assert_eq!(header_of(&refused, "x-sluice-policy"), Some("queued"));
    let retry: u64 = header_of(&refused, "retry-after")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    assert!((1..=60).contains(&retry), "retry after {retry}");
    assert_eq!(body_of(&refused)[1]["error"]["data"]["policy"], "queued");
    assert_eq!(admitted_of(&host, &mut w, 10, "search", 35), 29);
}

#[test]
fn a_batch_inside_a_batch_takes_what_it_would_take_sent_alone() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, SPLIT);
    // No JSON-RPC, but no way past a limit either: its search is counted.
    let nested = json!([
        tool_call(json!(1), "lookup"),
        [tool_call(json!(2), "search")]
    ]);
    assert_eq!(send(&host, &mut w, 1, "a", &nested), Verdict::Continue);
    assert_eq!(admitted_of(&host, &mut w, 10, "search", 35), 29);
    assert_eq!(admitted_of(&host, &mut w, 50, "lookup", 5), 2);
}

/// The tools of [`SPLIT`] a property test calls (`fetch`: none limits it),
/// and what each policy allows: rate tokens, or slots in flight.
const TOOLS: [&str; 8] = [
    "search",
    "slow",
    "lookup",
    "translate",
    "render",
    "read_doc",
    "write_doc",
    "fetch",
];
const RATE_LIMITED: [(&str, u32); 3] = [("search", 30), ("lookup", 3), ("translate", 3)];
const SLOTS: [(&str, usize); 2] = [("slow", 2), ("render", 1)];

/// A request of one of [`TOOLS`] (by index), or `tools/list`; with an id
/// or as a notification.
fn any_message() -> impl proptest::strategy::Strategy<Value = Value> {
    use proptest::prelude::*;
    (0..TOOLS.len() + 1, any::<bool>(), 0u32..1000).prop_map(|(tool, notify, id)| {
        let mut message = match TOOLS.get(tool) {
            Some(tool) => tool_call(json!(id), tool),
            None => json!({"jsonrpc": "2.0", "id": id, "method": "tools/list"}),
        };
        if notify {
            if let Some(m) = message.as_object_mut() {
                m.remove("id");
            }
        }
        message
    })
}

/// How many messages of `body` call `tool`.
fn calls_of(body: &Value, tool: &str) -> usize {
    let messages = match body {
        Value::Array(batch) => batch.as_slice(),
        one => std::slice::from_ref(one),
    };
    messages
        .iter()
        .filter(|m| m["method"] == "tools/call" && m["params"]["name"] == tool)
        .count()
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 200, ..Default::default() })]

    /// Any sequence of messages and batches across the policies of
    /// [`SPLIT`], some held open, 10 ms apart (under 1 token of any rate
    /// renews in all): no limit ever lets more through than it allows, a
    /// stream never holds more slots than its policy's, every refusal
    /// answers each request, and a refused batch keeps nothing:
    /// afterwards each limit still admits exactly what it has left.
    #[test]
    fn split_batches_never_pass_a_limit_and_a_refused_one_keeps_nothing(
        bodies in proptest::collection::vec(
            (proptest::collection::vec(any_message(), 1..7), proptest::prelude::any::<bool>(),
             proptest::prelude::any::<bool>()),
            1..30,
        ),
    ) {
        let host = FakeHost::at(T0);
        let mut w = worker(&host, SPLIT);
        let mut taken = [0u32; RATE_LIMITED.len()];
        let mut open_streams: Vec<(u32, Value)> = Vec::new();
        for (n, (messages, alone, keep_open)) in bodies.into_iter().enumerate() {
            let id = u32::try_from(n).unwrap_or(u32::MAX - 1) + 1;
            let body = match (alone, messages.as_slice()) {
                (true, [one]) => one.clone(),
                _ => Value::Array(messages),
            };
            // Past a prefetch's lifetime: this worker prefetches no tokens
            // (whose lapse would keep some from the count at the end).
            pass(&host, &mut w, 10);
            let verdict = open(&host, &mut w, id, &body);
            match &verdict {
                Verdict::Continue => {
                    for (i, (tool, limit)) in RATE_LIMITED.iter().enumerate() {
                        taken[i] += calls_of(&body, tool) as u32;
                        proptest::prop_assert!(taken[i] <= *limit, "{} took {} of {}", tool, taken[i], limit);
                    }
                    if keep_open {
                        open_streams.push((id, body));
                    } else {
                        w.on_stream_end(&host, id);
                    }
                    for (tool, max) in SLOTS {
                        let holding = open_streams.iter().filter(|(_, b)| calls_of(b, tool) > 0).count();
                        proptest::prop_assert!(holding <= max, "{} streams hold {}", holding, tool);
                    }
                    let docs: usize = open_streams
                        .iter()
                        .map(|(_, b)| calls_of(b, "read_doc") + calls_of(b, "write_doc"))
                        .sum();
                    proptest::prop_assert!(docs <= 3, "{} documents in flight", docs);
                }
                Verdict::Reply(reply) => {
                    w.on_stream_end(&host, id);
                    let requests = match &body {
                        Value::Array(batch) => batch.iter().filter(|m| m.get("id").is_some()).count(),
                        one => usize::from(one.get("id").is_some()),
                    };
                    if requests == 0 {
                        // Refused for a limit, or (400) as a batch no
                        // policy can decide.
                        let unsplit = reason_of(&verdict).is_some_and(|r| r.starts_with("batch-"));
                        proptest::prop_assert_eq!(reply.status, if unsplit { 400 } else { 429 });
                    } else {
                        proptest::prop_assert_eq!(reply.status, 200);
                        let answer: Value = serde_json::from_slice(&reply.body).unwrap_or(Value::Null);
                        let answered = answer.as_array().map_or(1, Vec::len);
                        proptest::prop_assert_eq!(answered, requests, "{} answered {}", body, answer);
                    }
                }
                other => proptest::prop_assert!(false, "{:?}", other),
            }
        }
        for (id, _) in open_streams {
            w.on_stream_end(&host, id);
        }
        let mut next = 10_000;
        for (i, (tool, limit)) in RATE_LIMITED.iter().enumerate() {
            let left = admitted_of(&host, &mut w, next, tool, limit + 2);
            next += limit + 2;
            proptest::prop_assert_eq!(taken[i] + left, *limit, "{} leaked", tool);
        }
        for (tool, max) in SLOTS {
            let ids: Vec<u32> = (next..next + max as u32 + 1).collect();
            next += max as u32 + 1;
            let held = ids
                .iter()
                .filter(|id| open(&host, &mut w, **id, &tool_call(json!(id), tool)) == Verdict::Continue)
                .count();
            proptest::prop_assert_eq!(held, max, "{} slots leaked", tool);
        }
        let docs = (next..next + 4)
            .filter(|id| open(&host, &mut w, *id, &tool_call(json!(id), "read_doc")) == Verdict::Continue)
            .count();
        proptest::prop_assert_eq!(docs, 3, "doc-slots leaked");
    }
}

/// Searches and slow calls, each with a daily limit warning at half.
const WARNED: &str = r#"{"version": 1, "policies": [
    {"name": "search", "match": {"host": "mcp.tools.example", "mcp": {"tools": ["search"]}},
     "rate": {"requests": 100, "period": "1s"},
     "limits": [{"name": "searches-a-day", "warn_at": [0.5],
                 "rate": {"requests": 2, "period": "1d", "algorithm": "fixed_window"}}]},
    {"name": "slow", "match": {"host": "mcp.tools.example", "mcp": {"tools": ["slow"]}},
     "concurrency": {"max_in_flight": 2},
     "limits": [{"name": "slow-a-day", "warn_at": [0.5],
                 "rate": {"requests": 2, "period": "1d", "algorithm": "fixed_window"}}]}]}"#;

#[test]
fn a_split_batchs_answer_warns_of_every_part_past_its_line() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, WARNED);
    let batch = json!([tool_call(json!(1), "search"), tool_call(json!(2), "slow")]);
    assert_eq!(open(&host, &mut w, 1, &batch), Verdict::Continue);
    let headers: Vec<(&str, &[u8])> = vec![(":status", b"200")];
    let answer = w.on_answer_headers(&host, 1, headers.as_slice(), true);
    let warned: Vec<&str> = answer
        .set
        .iter()
        .filter(|(name, _)| *name == "x-sluice-warn")
        .map(|(_, value)| value.as_str())
        .collect();
    assert_eq!(warned.len(), 1, "one field: {warned:?}");
    for limit in ["searches-a-day", "slow-a-day"] {
        assert!(warned[0].contains(limit), "{limit} in {warned:?}");
    }
    w.on_stream_end(&host, 1);
}

#[test]
fn a_batch_shared_data_cannot_record_is_refused_and_takes_nothing() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, SPLIT);
    let batch = json!([
        tool_call(json!(1), "search"),
        tool_call(json!(2), "slow"),
        tool_call(json!(3), "lookup")
    ]);
    // Every write to shared data fails (endless contention): fail closed.
    host.always_mismatch.set(true);
    let refused = open(&host, &mut w, 1, &batch);
    assert_eq!(status(&refused), 200);
    let answers = body_of(&refused);
    assert_eq!(answers.as_array().map(Vec::len), Some(3), "{answers}");
    w.on_stream_end(&host, 1);
    host.always_mismatch.set(false);
    pass(&host, &mut w, 10);
    assert_eq!(open(&host, &mut w, 2, &batch), Verdict::Continue);
    w.on_stream_end(&host, 2);
    assert_eq!(admitted_of(&host, &mut w, 10, "search", 35), 29);
    assert_eq!(admitted_of(&host, &mut w, 50, "lookup", 5), 2);
}
