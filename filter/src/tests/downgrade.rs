//! A money limit's downgrade rung through the worker: past its line a
//! team's calls of a dear model go for the cheaper one (the body the
//! provider gets names it, the answer says so, the limit is charged at
//! the cheaper prices), other teams and other models go as they came, and
//! the budget still stops at its size.

use serde_json::{json, Value};

use crate::testing::FakeHost;
use crate::tests::{req, status, worker, T0};
use crate::worker::{RequestBody, Verdict, Worker};

const LLM: &[u8] = b"api.llm.example";

/// 0.01 USD a day per team; past half of it, gpt-4o goes as gpt-4o-mini.
const TEAMS: &str = r#"{"version": 1,
    "prices": {"currency": "USD", "models": {
        "gpt-4o*": {"input": "2.50", "output": "10.00"},
        "gpt-4o-mini": {"input": "0.15", "output": "0.60"},
        "llama-3-70b": {"input": "0.50", "output": "1.00"}}},
    "policies": [{"name": "llm", "match": {"host": "api.llm.example"},
      "rate": {"requests": 1000, "period": "1s"},
      "limits": [{"name": "team-daily", "key": {"header": "x-team"},
                  "rate": {"requests": 10000, "period": "1d", "algorithm": "fixed_window"},
                  "cost": "price",
                  "downgrade": {"at": 0.5, "models": {"gpt-4o*": "gpt-4o-mini"}}}]}]}"#;

struct Answered {
    verdict: Verdict,
    /// The body the provider got, when the call's was replaced.
    sent: Option<Value>,
    downgraded: Option<String>,
}

/// A call of `team` for `model`, answered with the usage of 10 prompt
/// and 100 completion tokens of the model the provider was asked for.
fn call(host: &FakeHost, w: &mut Worker, id: u32, team: &str, model: &str) -> Answered {
    let team_header = [("x-team", team.as_bytes())];
    let headers = req(LLM, &team_header);
    let body = json!({"model": model, "max_tokens": 100, "messages": []}).to_string();
    let first = w.on_request_with(host, id, headers.as_slice(), RequestBody::Coming);
    assert_eq!(first, Verdict::ReadBody);
    let replaced_before = host.replaced_bodies.borrow().len();
    let verdict = w.on_request_with(
        host,
        id,
        headers.as_slice(),
        RequestBody::Read(Some(body.as_bytes())),
    );
    let sent = host
        .replaced_bodies
        .borrow()
        .get(replaced_before)
        .map(|(old_len, new)| {
            assert_eq!(*old_len, body.len(), "the whole body is replaced");
            serde_json::from_slice(new).unwrap_or(Value::Null)
        });
    let mut downgraded = None;
    if verdict == Verdict::Continue {
        let asked = sent
            .as_ref()
            .and_then(|s| s["model"].as_str().map(str::to_string))
            .unwrap_or_else(|| model.to_string());
        let answer_headers: Vec<(&str, &[u8])> =
            vec![(":status", b"200"), ("content-type", b"application/json")];
        let answered = w.on_answer_headers(host, id, answer_headers.as_slice(), false);
        downgraded = answered
            .set
            .iter()
            .find(|(name, _)| *name == "x-sluice-downgraded")
            .map(|(_, v)| v.clone());
        let usage = json!({"model": asked,
            "usage": {"prompt_tokens": 10, "completion_tokens": 100}})
        .to_string();
        w.on_answer_body(host, id, usage.as_bytes(), true);
        w.on_stream_end(host, id);
    }
    Answered {
        verdict,
        sent,
        downgraded,
    }
}

#[test]
fn past_its_line_a_teams_dear_calls_go_for_the_cheaper_model_until_the_budget_stops_them() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, TEAMS);
    // At gpt-4o's prices a call costs 1 025 micro-USD (its estimate:
    // 1 000 and its prompt): 5 calls leave half the budget behind.
    let mut id = 0;
    let mut dear = 0;
    loop {
        id += 1;
        let a = call(&host, &mut w, id, "team-a", "gpt-4o");
        assert_eq!(a.verdict, Verdict::Continue, "call {id}");
        if a.sent.is_some() {
            assert_eq!(
                a.sent.as_ref().map(|s| s["model"].clone()),
                Some(json!("gpt-4o-mini"))
            );
            assert_eq!(a.downgraded.as_deref(), Some("gpt-4o -> gpt-4o-mini"));
            break;
        }
        assert_eq!(a.downgraded, None, "call {id}");
        dear += 1;
        assert!(dear < 10, "never downgraded");
    }
    assert_eq!(dear, 4, "the fifth call's take reached half the budget");
    // From then on every gpt-4o call of the team goes as gpt-4o-mini (62
    // micro-USD each, charged at its prices), a model the rung does not
    // name goes as it is, and another team is not touched.
    let other = call(&host, &mut w, 1000, "team-b", "gpt-4o");
    assert_eq!((other.sent, other.downgraded), (None, None));
    let llama = call(&host, &mut w, 1001, "team-a", "llama-3-70b");
    assert_eq!(llama.verdict, Verdict::Continue);
    assert_eq!((llama.sent, llama.downgraded), (None, None));
    let mut cheap = 1;
    let refused = loop {
        id += 1;
        let a = call(&host, &mut w, id, "team-a", "gpt-4o-2024-08-06");
        if a.verdict != Verdict::Continue {
            break a.verdict;
        }
        assert_eq!(
            a.sent.as_ref().map(|s| s["model"].clone()),
            Some(json!("gpt-4o-mini")),
            "call {id}"
        );
        assert_eq!(
            a.downgraded.as_deref(),
            Some("gpt-4o-2024-08-06 -> gpt-4o-mini")
        );
        cheap += 1;
        assert!(cheap < 1000, "never refused");
    };
    // Judged at its own model's estimate (1 000 and more), a dear call is
    // refused once less than that is left, never let through on the
    // cheaper price: some 4 000 micro-USD of cheap calls, ~60 of them.
    assert_eq!(status(&refused), 429);
    let spent: u64 = crate::tests::header_of(&refused, "x-sluice-spent")
        .map(|s| (s.parse::<f64>().unwrap_or(0.0) * 1e6).round() as u64)
        .unwrap_or(0);
    assert!(spent <= 10_000, "{spent}");
    assert!((50..80).contains(&cheap), "{cheap} cheap calls");
    w.on_tick(&host);
    assert_eq!(
        host.metric("sluice.limit.team-daily.downgraded"),
        i64::from(cheap)
    );
}

/// The same budget on a pool policy's own limits, its two deployments
/// each with a rate of its own and a day's budget priced at the call's
/// model: past the line every gpt-4o call is sent as gpt-4o-mini to a
/// member, each member's budget holding the cheaper estimate (so a
/// member is not passed over for what the dear estimate would have
/// taken), until the pool's budget stops them.
#[test]
fn a_pools_budget_sends_its_calls_for_the_cheaper_model_past_its_line() {
    let pooled = TEAMS.replace(
        r#""downgrade": {"at": 0.5, "models": {"gpt-4o*": "gpt-4o-mini"}}}]}]}"#,
        r#""downgrade": {"at": 0.5, "models": {"gpt-4o*": "gpt-4o-mini"}}}],
      "pool": {"members": [
        {"name": "east", "cluster": "llm-east",
         "limits": [{"name": "east-rps", "rate": {"requests": 100, "period": "1s"}, "provider": {}},
                    {"name": "east-daily", "rate": {"requests": 6000, "period": "1d", "algorithm": "fixed_window"},
                     "cost": "price"}]},
        {"name": "west", "cluster": "llm-west",
         "limits": [{"name": "west-rps", "rate": {"requests": 100, "period": "1s"}, "provider": {}},
                    {"name": "west-daily", "rate": {"requests": 6000, "period": "1d", "algorithm": "fixed_window"},
                     "cost": "price"}]}]}}]}"#,
    );
    assert_ne!(pooled, TEAMS);
    let host = FakeHost::at(T0);
    let mut w = worker(&host, &pooled);
    let mut id = 0;
    let (mut dear, mut cheap) = (0, 0);
    let refused = loop {
        id += 1;
        let a = call(&host, &mut w, id, "team-a", "gpt-4o");
        if a.verdict != Verdict::Continue {
            break a.verdict;
        }
        let member = super::pool::routed(&host, id);
        assert!(member.is_some(), "call {id} routed");
        match a.sent {
            None => {
                assert_eq!(cheap, 0, "call {id}: dear after a cheap one");
                dear += 1;
            }
            Some(sent) => {
                assert_eq!(sent["model"], json!("gpt-4o-mini"), "call {id}");
                assert_eq!(a.downgraded.as_deref(), Some("gpt-4o -> gpt-4o-mini"));
                cheap += 1;
            }
        }
        assert!(id < 1000, "never refused");
    };
    assert_eq!(dear, 4, "the fifth call's take reached half the budget");
    // As without a pool: ~60 cheap calls until less than one dear estimate
    // is left of the team's budget; the members' budgets, charged at the
    // cheaper prices too, never refused one.
    assert!((50..80).contains(&cheap), "{cheap} cheap calls");
    assert_eq!(
        crate::tests::header_of(&refused, "x-sluice-limit"),
        Some("team-daily")
    );
    w.on_tick(&host);
    assert_eq!(
        host.metric("sluice.limit.team-daily.downgraded"),
        i64::from(cheap)
    );
}
