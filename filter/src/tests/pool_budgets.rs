//! A pool whose members have money budgets, priced by the model the
//! request's JSON body names: the pool decides once the body is in, a
//! member whose budget cannot take the call's estimate is passed over
//! like a full one, and when every member's budget is spent the call is
//! refused by the budget that renews first.

use serde_json::json;

use crate::testing::FakeHost;
use crate::tests::pool::routed;
use crate::tests::{header_of, pass, req, status, worker, T0};
use crate::worker::{RequestBody, Verdict, Worker};

/// East first (priority), 5 000 micro-USD a day; west 3 000.
const POOL: &str = r#"{"version": 1,
    "prices": {"currency": "USD", "models": {"gpt-4o": {"input": "2.50", "output": "10.00"}}},
    "policies": [{"name": "llm", "match": {"host": "llm.example"},
      "rate": {"requests": 1000, "period": "1s"},
      "pool": {"rule": "priority", "members": [
        {"name": "east", "cluster": "llm-east",
         "limits": [{"name": "east-rps", "rate": {"requests": 100, "period": "1s"}, "provider": {}},
                    {"name": "east-usd", "rate": {"requests": 5000, "period": "1d", "algorithm": "fixed_window"},
                     "cost": "price"}]},
        {"name": "west", "cluster": "llm-west",
         "limits": [{"name": "west-rps", "rate": {"requests": 100, "period": "1s"}, "provider": {}},
                    {"name": "west-usd", "rate": {"requests": 3000, "period": "1d", "algorithm": "fixed_window"},
                     "cost": "price"}]}]}}]}"#;

const HOST: &[u8] = b"llm.example";

/// A call for gpt-4o (its estimate: 1 000 micro-USD and its prompt's),
/// answered with 10 prompt and 100 completion tokens (1 025) when it
/// goes. Returns the verdict once the body is in, and its route.
fn call(host: &FakeHost, w: &mut Worker, id: u32) -> (Verdict, Option<String>) {
    let headers = req(HOST, &[]);
    let first = w.on_request_with(host, id, headers.as_slice(), RequestBody::Coming);
    assert_eq!(first, Verdict::ReadBody, "a priced pool waits for the body");
    assert!(routed(host, id).is_none(), "nothing routed before the body");
    let body = json!({"model": "gpt-4o", "max_tokens": 100, "messages": []}).to_string();
    let verdict = w.on_request_with(
        host,
        id,
        headers.as_slice(),
        RequestBody::Read(Some(body.as_bytes())),
    );
    if verdict == Verdict::Continue {
        let answer: Vec<(&str, &[u8])> =
            vec![(":status", b"200"), ("content-type", b"application/json")];
        w.on_answer_headers(host, id, answer.as_slice(), false);
        let usage = json!({"model": "gpt-4o",
            "usage": {"prompt_tokens": 10, "completion_tokens": 100}})
        .to_string();
        w.on_answer_body(host, id, usage.as_bytes(), true);
        w.on_stream_end(host, id);
    }
    (verdict, routed(host, id))
}

#[test]
fn a_member_whose_budget_is_spent_is_passed_over_until_every_budget_refuses() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, POOL);
    let mut to = Vec::new();
    let refused = loop {
        let id = u32::try_from(to.len()).unwrap_or(u32::MAX) + 1;
        let (verdict, member) = call(&host, &mut w, id);
        if verdict != Verdict::Continue {
            assert_eq!(member, None, "a refused call is routed nowhere");
            break verdict;
        }
        to.push(member.expect("an admitted call is routed"));
        assert!(to.len() < 20, "never refused: {to:?}");
    };
    // 1 025 a call: east's 5 000 take four, west's 3 000 two; east first
    // while its budget can take a call, then west only.
    assert_eq!(
        to,
        ["llm-east", "llm-east", "llm-east", "llm-east", "llm-west", "llm-west"]
    );
    assert_eq!(status(&refused), 429);
    let limit = header_of(&refused, "x-sluice-limit");
    assert!(
        matches!(limit, Some("east-usd" | "west-usd")),
        "a budget refused: {limit:?}"
    );
    assert!(
        header_of(&refused, "x-sluice-renews-at").is_some(),
        "a budget's refusal says when it renews"
    );
    w.on_tick(&host);
    assert_eq!(host.metric("sluice.limit.east-usd.admitted"), 4);
    assert_eq!(host.metric("sluice.limit.west-usd.admitted"), 2);
    // A day on, both budgets are whole again: east first.
    pass(&host, &mut w, 86_400_000);
    assert_eq!(
        call(&host, &mut w, 100),
        (Verdict::Continue, Some("llm-east".into()))
    );
}

#[test]
fn a_body_that_names_no_priced_model_is_refused_by_the_pool_not_routed() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, POOL);
    let headers = req(HOST, &[]);
    assert_eq!(
        w.on_request_with(&host, 1, headers.as_slice(), RequestBody::Coming),
        Verdict::ReadBody
    );
    for (id, body) in [
        (1, &br#"{"model": "o9-unknown", "max_tokens": 10}"#[..]),
        (2, b"not json"),
        (3, br#"{"model": 7}"#),
    ] {
        let v = w.on_request_with(&host, id, headers.as_slice(), RequestBody::Read(Some(body)));
        assert_ne!(v, Verdict::Continue, "{}", String::from_utf8_lossy(body));
        assert_eq!(routed(&host, id), None);
    }
}

/// A team's 10 calls a day; past half of them, its calls go to the
/// self-hosted `local` member (3 a second) instead of `cloud`, the
/// pool's first choice.
const ROUTED: &str = r#"{"version": 1, "policies": [{"name": "llm", "match": {"host": "llm.example"},
    "rate": {"requests": 1000, "period": "1s"},
    "limits": [{"name": "team-daily", "key": {"header": "x-team"},
                "rate": {"requests": 10, "period": "1d", "algorithm": "fixed_window"},
                "route": {"at": 0.5, "member": "local"}}],
    "pool": {"rule": "priority", "members": [
      {"name": "cloud", "cluster": "llm-cloud",
       "limits": [{"name": "cloud-rps", "rate": {"requests": 100, "period": "1s"}, "provider": {}}]},
      {"name": "local", "cluster": "llm-local",
       "limits": [{"name": "local-rps", "rate": {"requests": 3, "period": "1s"}, "provider": {}}]}]}}]}"#;

/// A call of `team`, answered 200 when it goes: its verdict, its route,
/// and the answer's `x-sluice-routed`.
fn team_call(
    host: &FakeHost,
    w: &mut Worker,
    id: u32,
    team: &str,
) -> (Verdict, Option<String>, Option<String>) {
    let team_header = [("x-team", team.as_bytes())];
    let verdict = w.on_request(host, id, req(HOST, &team_header).as_slice());
    let mut said = None;
    if verdict == Verdict::Continue {
        let ok: [(&str, &[u8]); 1] = [(":status", b"200")];
        let answer = w.on_answer_headers(host, id, ok.as_slice(), true);
        said = answer
            .set
            .iter()
            .find(|(name, _)| *name == "x-sluice-routed")
            .map(|(_, v)| v.clone());
        w.on_stream_end(host, id);
    }
    (verdict, routed(host, id), said)
}

#[test]
fn past_its_route_line_a_teams_calls_go_to_the_rungs_member_or_nowhere() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, ROUTED);
    for id in 1..=4 {
        let (verdict, to, said) = team_call(&host, &mut w, id, "a");
        assert_eq!(verdict, Verdict::Continue);
        assert_eq!(
            (to.as_deref(), said),
            (Some("llm-cloud"), None),
            "call {id}"
        );
    }
    // The fifth leaves the team's day half used: local from then on.
    for id in 5..=7 {
        let (verdict, to, said) = team_call(&host, &mut w, id, "a");
        assert_eq!(verdict, Verdict::Continue, "call {id}");
        assert_eq!(to.as_deref(), Some("llm-local"), "call {id}");
        assert_eq!(said.as_deref(), Some("local; limit=team-daily"));
    }
    // Local is full for this second: refused, never sent to cloud.
    let (refused, to, _) = team_call(&host, &mut w, 8, "a");
    assert_eq!(status(&refused), 429);
    assert_eq!(header_of(&refused, "x-sluice-limit"), Some("local-rps"));
    assert_eq!(to, None);
    // Another team's day is its own: cloud.
    let (_, to, said) = team_call(&host, &mut w, 9, "b");
    assert_eq!((to.as_deref(), said), (Some("llm-cloud"), None));
    pass(&host, &mut w, 1_000);
    let (verdict, to, _) = team_call(&host, &mut w, 10, "a");
    assert_eq!(verdict, Verdict::Continue);
    assert_eq!(to.as_deref(), Some("llm-local"));
    w.on_tick(&host);
    assert_eq!(host.metric("sluice.limit.team-daily.routed"), 4);
    // What cloud took of the routed calls went back: it counted 5 calls.
    assert_eq!(host.metric("sluice.limit.cloud-rps.admitted"), 5);
    assert_eq!(host.metric("sluice.limit.local-rps.admitted"), 4);
    // The refused call took nothing of the team's day: 8 of 10 used, two
    // more go (to local), the third is refused by the day.
    pass(&host, &mut w, 1_000);
    for id in 11..=12 {
        assert_eq!(team_call(&host, &mut w, id, "a").0, Verdict::Continue);
    }
    let (refused, _, _) = team_call(&host, &mut w, 13, "a");
    assert_eq!(header_of(&refused, "x-sluice-limit"), Some("team-daily"));
}
