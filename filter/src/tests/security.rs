//! The third security review's items the worker and the stream shell
//! decide (docs/RELIABILITY.md, "Third security review"): a caller's own
//! route header never routes a call; nothing of a call that is decided on
//! its body goes on before the decision; a body Sluice cannot read is
//! decided under the policy whose headers it matched (fail closed); a
//! body naming a key twice is refused; a body that never comes ends in a
//! 408, not a hang.

use std::borrow::Cow;

use sluice_shared::request_headers::RequestHeaders;

use crate::stream_shell::{Flow, StreamIo, StreamShell};
use crate::testing::FakeHost;
use crate::tests::{header_of, pass, req, status, worker, T0};
use crate::worker::{StreamAction, Verdict, Worker};

/// A pool on `llm.example` routing by the default header, and a policy of
/// another host.
const POOL: &str = r#"{"version": 1, "policies": [
    {"name": "llm", "match": {"host": "llm.example"},
     "rate": {"requests": 1000, "period": "1s"},
     "pool": {"members": [
       {"name": "east", "cluster": "llm-east",
        "limits": [{"name": "east-rps", "rate": {"requests": 10, "period": "1s"}, "provider": {"max_pause": "60s"}}]},
       {"name": "west", "cluster": "llm-west",
        "limits": [{"name": "west-rps", "rate": {"requests": 10, "period": "1s"}, "provider": {"max_pause": "60s"}}]}]}},
    {"name": "bank", "match": {"host": "api.bank.example"}, "rate": {"requests": 100, "period": "1s"}}]}"#;

fn removed(host: &FakeHost) -> Vec<String> {
    host.removed_headers.borrow().clone()
}

/// Item 1: whatever host a call names, and whether or not a pool matches
/// it, the caller's `x-sluice-member` is removed as its headers arrive;
/// a pool call then carries only the member Sluice chose. Before the
/// first set with a pool (an empty fallback set) the headers the plugin's
/// configuration names (`route_headers`) are removed too; with neither,
/// no header is read for it. A call without the header costs no removal.
#[test]
fn a_callers_route_header_is_removed_from_every_request() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, POOL);
    for (id, authority) in [(1, &b"other.example"[..]), (2, b"api.bank.example")] {
        let v = w.on_request(
            &host,
            id,
            req(authority, &[("x-sluice-member", b"llm-east")]).as_slice(),
        );
        assert_eq!(v, Verdict::Continue);
    }
    assert_eq!(removed(&host), ["x-sluice-member", "x-sluice-member"]);
    assert!(host.set_headers.borrow().is_empty(), "no member named");
    // On the pool's host: removed, then set to the member chosen.
    let v = w.on_request(
        &host,
        3,
        req(b"llm.example", &[("x-sluice-member", b"llm-west")]).as_slice(),
    );
    assert_eq!(v, Verdict::Continue);
    assert_eq!(removed(&host).len(), 3);
    let set = host.set_headers.borrow().clone();
    assert_eq!(set.len(), 1);
    assert_eq!((set[0].0, set[0].1.as_str()), (3, "x-sluice-member"));
    // Without the header: nothing removed (a removal re-routes the call).
    w.on_request(&host, 4, req(b"other.example", &[]).as_slice());
    assert_eq!(removed(&host).len(), 3);
    w.on_tick(&host);
    assert_eq!(host.metric("sluice.route_header_stripped"), 3);

    // Before the first set with a pool: the headers the configuration
    // names.
    let host = FakeHost::at(T0);
    let mut w = worker(&host, r#"{"version": 1, "policies": []}"#);
    let stray = req(b"other.example", &[("x-sluice-member", b"llm-east")]);
    w.on_request(&host, 1, stray.as_slice());
    assert!(removed(&host).is_empty(), "no pool, none declared");
    w.declare_route_headers(&["x-sluice-member".to_string()]);
    w.on_request(&host, 2, stray.as_slice());
    assert_eq!(removed(&host), ["x-sluice-member"]);
}

/// A pool's own route header is removed too, and still after a set that
/// no longer names it (Envoy's routes may match it yet).
#[test]
fn a_pools_own_route_header_stays_removed_after_the_pool_is_gone() {
    let host = FakeHost::at(T0);
    let custom = POOL.replace(
        r#""pool": {"members""#,
        r#""pool": {"route_header": "x-route", "members""#,
    );
    let mut w = worker(&host, &custom);
    let with_route = req(b"other.example", &[("x-route", b"llm-east")]);
    w.on_request(&host, 1, with_route.as_slice());
    assert_eq!(removed(&host), ["x-route"]);
    let without_pool = sluice_filter_core::matcher::CompiledPolicySet::from_json(
        r#"{"version": 2, "policies": [{"name": "bank", "match": {"host": "api.bank.example"}, "rate": {"requests": 100, "period": "1s"}}]}"#,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    w.install(&host, without_pool);
    w.on_request(&host, 2, with_route.as_slice());
    assert_eq!(removed(&host), ["x-route", "x-route"]);
}

/// Per model: gpt-4o allows 2 calls a minute; a catch-all after it.
const PER_MODEL: &str = r#"{"version": 1, "policies": [
    {"name": "gpt-4o", "match": {"host": "llm.example", "json": [{"path": "model", "equals": "gpt-4o"}]},
     "rate": {"requests": 2, "period": "60s", "burst": 2}},
    {"name": "rest", "match": {"host": "*"}, "rate": {"requests": 1000, "period": "1s"}}]}"#;

/// The request's headers as a stream's shell reads them.
struct Headers(Vec<(String, Vec<u8>)>);

impl RequestHeaders for Headers {
    fn header(&self, name: &str) -> Option<Cow<'_, [u8]>> {
        self.0
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| Cow::Borrowed(v.as_slice()))
    }
}

fn llm_request() -> Headers {
    Headers(vec![
        (":authority".into(), b"llm.example".to_vec()),
        (":path".into(), b"/v1/chat/completions".to_vec()),
        (":method".into(), b"POST".to_vec()),
    ])
}

/// One stream's Envoy, for its shell: the worker, the body Envoy buffered.
struct Io<'w> {
    worker: &'w mut Worker,
    body: Vec<u8>,
    waits: u32,
}

impl StreamIo for Io<'_> {
    type AnswerHeaders = Headers;

    fn with_worker<R>(&mut self, f: impl FnOnce(&mut Worker) -> R) -> Option<R> {
        Some(f(self.worker))
    }

    fn waits(&mut self) {
        self.waits += 1;
    }

    fn request_body(&mut self, size: usize) -> Option<Vec<u8>> {
        Some(self.body.iter().copied().take(size).collect())
    }

    fn answer_headers(&self) -> Headers {
        Headers(Vec::new())
    }

    fn set_answer_header(&mut self, _name: &str, _value: Option<&[u8]>) {}

    fn answer_piece(&mut self, _size: usize) -> Vec<u8> {
        Vec::new()
    }

    fn replace_answer_piece(&mut self, _size: usize, _passed: &[u8]) {}
}

/// Sends one call through a shell: its headers, then its body in two
/// pieces (or, with `trailers`, ended by trailers). Returns each hook's
/// flow.
fn through_shell(
    host: &FakeHost,
    w: &mut Worker,
    id: u32,
    body: &[u8],
    trailers: bool,
) -> Vec<Flow> {
    let request = llm_request();
    let mut shell = StreamShell::new(id, Default::default());
    let mut io = Io {
        worker: w,
        body: body.to_vec(),
        waits: 0,
    };
    let half = body.len() / 2;
    let mut flows = vec![shell.on_request_headers(host, &mut io, &request, false)];
    flows.push(shell.on_request_body(host, &mut io, &request, half, false));
    flows.push(shell.on_request_body(host, &mut io, &request, body.len(), !trailers));
    if trailers {
        flows.push(shell.on_request_trailers(host, &mut io, &request));
    }
    shell.end(host, &mut io);
    flows
}

/// Item 3: a call whose policy reads its body holds its headers until it
/// is decided: an admitted one goes on (headers and body together) at
/// its body's end, a refused one is answered there and nothing of it
/// went on.
#[test]
fn a_call_decided_on_its_body_holds_its_headers_until_the_decision() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, PER_MODEL);
    let body = br#"{"model": "gpt-4o", "messages": []}"#;
    for id in 1..=2 {
        assert_eq!(
            through_shell(&host, &mut w, id, body, false),
            [Flow::AwaitBody, Flow::Hold, Flow::Continue],
            "call {id}"
        );
    }
    assert_eq!(
        through_shell(&host, &mut w, 3, body, false),
        [Flow::AwaitBody, Flow::Hold, Flow::Hold],
        "refused: held, and answered by Sluice"
    );
    assert_eq!(*host.replies.borrow(), [(3, 429)]);
}

/// Item 4: a body ended by trailers (HTTP/2) is read at the trailers and
/// decided on what it says, not as an unread body.
#[test]
fn a_body_ended_by_trailers_is_read_at_the_trailers() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, PER_MODEL);
    let body = br#"{"model": "gpt-4o"}"#;
    for id in 1..=2 {
        let flows = through_shell(&host, &mut w, id, body, true);
        assert_eq!(
            flows,
            [Flow::AwaitBody, Flow::Hold, Flow::Hold, Flow::Continue]
        );
    }
    through_shell(&host, &mut w, 3, body, true);
    assert_eq!(*host.replies.borrow(), [(3, 429)]);
    w.on_tick(&host);
    assert_eq!(host.metric("sluice.policy.gpt-4o.admitted"), 2);
    assert_eq!(host.metric("sluice.policy.rest.admitted"), 0);
}

/// A call queued on its headers keeps its body back while it waits (a
/// body let on would take the headers along, past the queue).
#[test]
fn a_queued_calls_body_waits_with_it() {
    let host = FakeHost::at(T0);
    let queued = r#"{"version": 1, "policies": [
        {"name": "fx", "match": {"host": "llm.example"}, "rate": {"requests": 1, "period": "1s", "burst": 1},
         "on_limit": {"action": "queue", "max_wait": "5s"}}]}"#;
    let mut w = worker(&host, queued);
    let request = llm_request();
    let mut flows = Vec::new();
    for id in 1..=2 {
        let mut shell = StreamShell::new(id, Default::default());
        let mut io = Io {
            worker: &mut w,
            body: b"{}".to_vec(),
            waits: 0,
        };
        flows.push(shell.on_request_headers(&host, &mut io, &request, false));
        flows.push(shell.on_request_body(&host, &mut io, &request, 2, true));
    }
    assert_eq!(
        flows,
        [Flow::Continue, Flow::Continue, Flow::Hold, Flow::Hold],
        "the second call waits, its body too"
    );
}

fn per_model_call(host: &FakeHost, w: &mut Worker, id: u32, body: Option<&[u8]>) -> Verdict {
    let r = req(b"llm.example", &[]);
    let v = w.on_request_with(host, id, r.as_slice(), crate::worker::RequestBody::Coming);
    assert_eq!(v, Verdict::ReadBody);
    w.on_request_with(
        host,
        id,
        r.as_slice(),
        crate::worker::RequestBody::Read(body),
    )
}

/// Item 4: once gpt-4o's calls are spent, a body Sluice cannot read (too
/// large, not JSON, a byte order mark before it is read through) is
/// decided under gpt-4o, whose headers it matched: refused naming it,
/// never let through by the catch-all. With `unreadable: next` it goes on.
#[test]
fn a_body_sluice_cannot_read_is_decided_under_the_policy_it_matched() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, PER_MODEL);
    let model = br#"{"model": "gpt-4o"}"#;
    for id in 1..=2 {
        assert_eq!(
            per_model_call(&host, &mut w, id, Some(model)),
            Verdict::Continue
        );
    }
    let bom = [b"\xEF\xBB\xBF".as_slice(), model].concat();
    let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
    for (id, body) in [
        (3, None),
        (4, Some(&b"not json"[..])),
        (5, Some(bom.as_slice())),
        (6, Some(deep.as_bytes())),
    ] {
        let v = per_model_call(&host, &mut w, id, body);
        assert_eq!(status(&v), 429, "call {id}");
        assert_eq!(
            header_of(&v, "x-sluice-policy"),
            Some("gpt-4o"),
            "call {id}"
        );
    }
    // Another model's readable body goes on to the catch-all.
    let other = per_model_call(&host, &mut w, 7, Some(br#"{"model": "gpt-4o-mini"}"#));
    assert_eq!(other, Verdict::Continue);
    w.on_tick(&host);
    assert_eq!(host.metric("sluice.policy.gpt-4o.body_unreadable"), 3);

    let next = PER_MODEL.replace(
        r#""equals": "gpt-4o"}]}"#,
        r#""equals": "gpt-4o"}], "unreadable": "next"}"#,
    );
    let host = FakeHost::at(T0);
    let mut w = worker(&host, &next);
    for id in 1..=2 {
        per_model_call(&host, &mut w, id, Some(model));
    }
    assert_eq!(
        per_model_call(&host, &mut w, 3, Some(b"not json")),
        Verdict::Continue
    );
}

/// Also: a body naming `model` twice, in either order, is refused with
/// 400 naming the key, under a policy that reads the body; nothing of it
/// is counted against the limits.
#[test]
fn a_body_naming_a_key_twice_is_refused_in_either_order() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, PER_MODEL);
    for (id, body) in [
        (1, &br#"{"model": "gpt-4o", "model": "gpt-4o-mini"}"#[..]),
        (2, br#"{"model": "gpt-4o-mini", "model": "gpt-4o"}"#),
    ] {
        let v = per_model_call(&host, &mut w, id, Some(body));
        assert_eq!(status(&v), 400, "call {id}");
        assert_eq!(header_of(&v, "x-sluice-reason"), Some("body-duplicate-key"));
        let Verdict::Reply(reply) = &v else {
            panic!("a reply");
        };
        assert!(
            String::from_utf8_lossy(&reply.body).contains("\"model\""),
            "{:?}",
            reply.body
        );
    }
    // gpt-4o's two calls are still there.
    let model = br#"{"model": "gpt-4o"}"#;
    for id in 3..=4 {
        assert_eq!(
            per_model_call(&host, &mut w, id, Some(model)),
            Verdict::Continue
        );
    }
}

/// A call whose headers wait for a body that never comes (an Envoy that
/// does not bring it while the headers wait) is answered 408 after 10 s,
/// logged once, counted; one whose body came is not.
#[test]
fn a_body_that_never_comes_ends_in_a_408_not_a_hang() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, PER_MODEL);
    let r = req(b"llm.example", &[]);
    for id in 1..=2 {
        let v = w.on_request_with(&host, id, r.as_slice(), crate::worker::RequestBody::Coming);
        assert_eq!(v, Verdict::ReadBody);
    }
    w.on_request_with(
        &host,
        2,
        r.as_slice(),
        crate::worker::RequestBody::Read(Some(br#"{"model": "gpt-4o"}"#)),
    );
    pass(&host, &mut w, 9_900);
    host.advance_ms(200);
    let actions = w.on_tick(&host);
    let replies: Vec<(u32, u32)> = actions
        .iter()
        .filter_map(|a| match a {
            StreamAction::Reply(id, reply) => Some((*id, reply.status)),
            _ => None,
        })
        .collect();
    assert_eq!(replies, [(1, 408)]);
    pass(&host, &mut w, 20_000);
    assert_eq!(host.metric("sluice.body_wait_timeouts"), 1);
    let told = host
        .logs
        .borrow()
        .iter()
        .filter(|l| l.contains("allow_on_headers_stop_iteration"))
        .count();
    assert_eq!(told, 1);
}

/// A body that says it is larger than what Sluice reads is decided on its
/// headers as one it cannot read (fail closed), nothing held: Envoy would
/// answer 413 to a body held past its own buffer limit.
#[test]
fn a_body_declared_too_large_is_decided_on_its_headers() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, PER_MODEL);
    let model = br#"{"model": "gpt-4o"}"#;
    for id in 1..=2 {
        assert_eq!(
            per_model_call(&host, &mut w, id, Some(model)),
            Verdict::Continue
        );
    }
    let large = req(b"llm.example", &[("content-length", b"1100000")]);
    let v = w.on_request_with(
        &host,
        3,
        large.as_slice(),
        crate::worker::RequestBody::Coming,
    );
    assert_eq!(status(&v), 429);
    assert_eq!(header_of(&v, "x-sluice-policy"), Some("gpt-4o"));
    let small = req(b"llm.example", &[("content-length", b"20")]);
    let v = w.on_request_with(
        &host,
        4,
        small.as_slice(),
        crate::worker::RequestBody::Coming,
    );
    assert_eq!(v, Verdict::ReadBody);
}

/// A money budget at gpt-4o's prices (2.5 and 10 USD a million tokens in
/// and out), `budget` micro-USD a day; the model read where `model` says
/// (default: the body's `model`).
fn money(budget: u64, model: &str) -> String {
    format!(
        r#"{{"version": 1, "prices": {{"currency": "USD", "models": {{
              "gpt-4o": {{"input": "2.5", "output": "10"}}, "gpt-4o-*": {{"input": "2.5", "output": "10"}},
              "gpt-4o-mini": {{"input": "0.15", "output": "0.6"}}}}}},
            "policies": [{{"name": "llm", "match": {{"host": "llm.example"}}, "rate": {{"requests": 1000, "period": "1s"}},
              "limits": [{{"name": "budget", "rate": {{"requests": {budget}, "period": "1d", "algorithm": "fixed_window"}},
                           "cost": {{"price": {{{model}}}}}}}]}}]}}"#
    )
}

fn priced_call(host: &FakeHost, w: &mut Worker, id: u32, path: &[u8], body: &[u8]) -> Verdict {
    let r: Vec<(&str, &[u8])> = vec![
        (":authority", b"llm.example"),
        (":path", path),
        (":method", b"POST"),
    ];
    let v = w.on_request_with(host, id, r.as_slice(), crate::worker::RequestBody::Coming);
    assert_eq!(v, Verdict::ReadBody);
    w.on_request_with(
        host,
        id,
        r.as_slice(),
        crate::worker::RequestBody::Read(Some(body)),
    )
}

fn answer_json(host: &FakeHost, w: &mut Worker, id: u32, body: &[u8]) {
    let headers: Vec<(&str, &[u8])> =
        vec![(":status", b"200"), ("content-type", b"application/json")];
    let mut wanted = w
        .on_answer_headers(host, id, headers.as_slice(), false)
        .read_body;
    let pieces: Vec<&[u8]> = body.chunks(64 * 1024).collect();
    for (i, piece) in pieces.iter().enumerate() {
        assert!(wanted, "read to its end");
        wanted = w
            .on_answer_body(host, id, piece, i + 1 == pieces.len())
            .more;
    }
    w.on_stream_end(host, id);
}

/// Item 2: `n: 128` asks for 128 answers: at 0.10 USD the call is refused
/// up front (its estimate is 128 answers of 1 000 tokens); under a budget
/// that admits it, its 300 KiB answer (past the 256 KiB read for usage)
/// is charged at least its bill, read from the answer's end.
#[test]
fn many_choices_are_estimated_and_a_huge_answer_is_charged_its_bill() {
    let body = br#"{"model": "gpt-4o", "n": 128, "max_tokens": 1000, "messages": [{"role": "user", "content": "Write."}]}"#;
    let host = FakeHost::at(T0);
    let mut w = worker(&host, &money(100_000, ""));
    let v = priced_call(&host, &mut w, 1, b"/v1/chat/completions", body);
    assert_eq!(status(&v), 429, "128 answers of 1 000 tokens are 1.28 USD");

    let host = FakeHost::at(T0);
    let mut w = worker(&host, &money(10_000_000, ""));
    assert_eq!(
        priced_call(&host, &mut w, 1, b"/v1/chat/completions", body),
        Verdict::Continue
    );
    let text = "tok ".repeat(300 * 1024 / 4);
    let answer = format!(
        r#"{{"id": "x", "object": "chat.completion", "model": "gpt-4o", "choices": [{{"index": 0, "message": {{"content": "{text}"}}}}],
            "usage": {{"prompt_tokens": 20, "completion_tokens": 64000, "total_tokens": 64020}}}}"#
    );
    assert!(answer.len() > 300 * 1024);
    answer_json(&host, &mut w, 1, answer.as_bytes());
    w.on_tick(&host);
    let bill = 64_000 * 10 + 20 * 25 / 10;
    let charged = host.metric("sluice.limit.budget.tokens");
    assert!(charged >= bill, "charged {charged}, billed {bill}");
    assert_eq!(host.metric("sluice.limit.budget.usage_read"), 1);
}

/// Item 7: a deployment URL names gpt-4o while the body says
/// gpt-4o-mini: priced as gpt-4o. Priced by the body, a call whose
/// answer names a dearer model than the body did is charged at the
/// answer's model.
#[test]
fn money_is_priced_at_the_deployment_and_at_the_model_that_answered() {
    let body = br#"{"model": "gpt-4o-mini", "max_tokens": 1000}"#;
    let answer = br#"{"model": "gpt-4o-2024-08-06", "usage": {"prompt_tokens": 1000, "completion_tokens": 1000}}"#;
    let gpt4o = 1000 * 25 / 10 + 1000 * 10;
    let mini = 1000 * 15 / 100 + 1000 * 6 / 10;
    for (model, path) in [
        (
            r#""model": {"path_after": "/openai/deployments/"}"#,
            &b"/openai/deployments/gpt-4o/chat/completions"[..],
        ),
        ("", b"/v1/chat/completions"),
    ] {
        let host = FakeHost::at(T0);
        let mut w = worker(&host, &money(10_000_000, model));
        assert_eq!(priced_call(&host, &mut w, 1, path, body), Verdict::Continue);
        answer_json(&host, &mut w, 1, answer);
        w.on_tick(&host);
        assert_eq!(host.metric("sluice.limit.budget.tokens"), gpt4o, "{model}");
    }
    // The answer naming the model asked for: its own price.
    let host = FakeHost::at(T0);
    let mut w = worker(&host, &money(10_000_000, ""));
    priced_call(&host, &mut w, 1, b"/v1/chat/completions", body);
    answer_json(
        &host,
        &mut w,
        1,
        br#"{"model": "gpt-4o-mini", "usage": {"prompt_tokens": 1000, "completion_tokens": 1000}}"#,
    );
    w.on_tick(&host);
    assert_eq!(host.metric("sluice.limit.budget.tokens"), mini);
}
