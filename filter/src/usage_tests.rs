//! Costs known after the response (a further limit's `usage`): admitted
//! against an estimate, settled when the response ends, through the
//! worker against the in-memory host.

use crate::testing::FakeHost;
use crate::tests::{pass, req, status, worker, T0};
use crate::worker::{RequestBody, Verdict, Worker};

/// 10 000 tokens a minute (fixed window), the estimate `max_tokens` + 100
/// read from the request's JSON, the usage from the response's JSON (or,
/// streamed, from its last event).
const TOKENS_PER_MINUTE: &str = r#"{"version": 1, "policies": [
    {"name": "llm", "match": {"host": "api.llm.example"},
     "rate": {"requests": 1000, "period": "1s"},
     "limits": [{"name": "tpm", "rate": {"requests": 10000, "period": "1m", "algorithm": "fixed_window"},
                 "cost": {"json": "max_tokens", "plus": 100, "default": 2000, "max": 5000},
                 "usage": {"json": ["usage.prompt_tokens", "usage.completion_tokens"],
                           "max_body_bytes": 2048}}]}]}"#;

const LLM: &[u8] = b"api.llm.example";

/// Sends a call with `body`, as Envoy would: headers first (a body follows),
/// then the body.
fn call(host: &FakeHost, w: &mut Worker, id: u32, body: &[u8]) -> Verdict {
    let headers = req(LLM, &[]);
    let first = w.on_request_with(host, id, headers.as_slice(), RequestBody::Coming);
    assert_eq!(first, Verdict::ReadBody, "the estimate needs the body");
    w.on_request_with(host, id, headers.as_slice(), RequestBody::Read(Some(body)))
}

fn json_response(host: &FakeHost, w: &mut Worker, id: u32, chunks: &[&[u8]]) {
    let headers: Vec<(&str, &[u8])> =
        vec![(":status", b"200"), ("content-type", b"application/json")];
    let mut wanted = w.on_response_headers(host, id, headers.as_slice(), false);
    for (i, chunk) in chunks.iter().enumerate() {
        assert!(wanted, "the body is read until it ends");
        wanted = w.on_response_body(host, id, chunk, i + 1 == chunks.len());
    }
    assert!(!wanted, "nothing more wanted once the body ended");
    w.on_stream_end(host, id);
}

fn tokens_left(host: &FakeHost, w: &mut Worker) -> u64 {
    // Probe with calls of a known estimate until the limit refuses.
    let mut admitted = 0;
    for id in 9000..9100u32 {
        let v = call(host, w, id, br#"{"max_tokens": 900}"#);
        if status(&v) != 200 {
            break;
        }
        admitted += 1000;
        w.on_stream_end(host, id);
    }
    admitted
}

#[test]
fn a_json_usage_refunds_what_the_estimate_took_beyond_it() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, TOKENS_PER_MINUTE);
    // Estimate 4 900 + 100: the minute holds 10 000, so two calls fit.
    for id in 1..=2u32 {
        assert_eq!(
            call(&host, &mut w, id, br#"{"max_tokens": 4900}"#),
            Verdict::Continue
        );
    }
    let third = call(&host, &mut w, 3, br#"{"max_tokens": 4900}"#);
    assert_eq!(status(&third), 429, "the estimates fill the minute");
    // Each used 300 + 200: 9 000 of the 10 000 come back.
    for id in 1..=2u32 {
        json_response(
            &host,
            &mut w,
            id,
            &[
                br#"{"usage": {"prompt_tokens": 300, "#,
                br#""completion_tokens": 200}}"#,
            ],
        );
    }
    assert_eq!(tokens_left(&host, &mut w), 9000);
    w.on_tick(&host);
    assert_eq!(host.metric("sluice.limit.tpm.usage_read"), 2);
    // 2 × 500 read, then 9 calls of estimate 1 000 still in their window.
    assert_eq!(host.metric("sluice.limit.tpm.tokens"), 1000 + 9 * 1000);
    assert_eq!(host.metric("sluice.limit.tpm.usage_aborted"), 9);
}

#[test]
fn usage_above_the_estimate_is_a_debt_the_next_calls_pay_not_the_call_in_flight() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, TOKENS_PER_MINUTE);
    // The body has no max_tokens: the default estimate, 2 000.
    assert_eq!(
        call(&host, &mut w, 1, br#"{"model": "m"}"#),
        Verdict::Continue
    );
    json_response(
        &host,
        &mut w,
        1,
        &[br#"{"usage": {"prompt_tokens": 4000, "completion_tokens": 5000}}"#],
    );
    // 9 000 used: 1 000 left, one call of estimate 1 000.
    assert_eq!(tokens_left(&host, &mut w), 1000);
    w.on_tick(&host);
    assert_eq!(host.metric("sluice.limit.tpm.tokens"), 9000 + 1000);
}

#[test]
fn a_streamed_answer_settles_on_its_last_event_in_any_chunking() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, TOKENS_PER_MINUTE);
    assert_eq!(
        call(&host, &mut w, 1, br#"{"max_tokens": 4000, "stream": true}"#),
        Verdict::Continue
    );
    let headers: Vec<(&str, &[u8])> = vec![
        (":status", b"200"),
        ("content-type", b"text/event-stream; charset=utf-8"),
    ];
    assert!(w.on_response_headers(&host, 1, headers.as_slice(), false));
    let stream = b"data: {\"choices\": [{\"delta\": {\"content\": \"hi\"}}]}\n\n\
        data: {\"choices\": [], \"usage\": {\"prompt_tokens\": 40, \"completion_tokens\": 60}}\n\ndata: [DONE]\n\n";
    for piece in stream.chunks(7) {
        assert!(w.on_response_body(&host, 1, piece, false));
    }
    assert!(!w.on_response_body(&host, 1, b"", true));
    w.on_stream_end(&host, 1);
    assert_eq!(tokens_left(&host, &mut w), 9000, "100 used of 10 000");
}

#[test]
fn an_aborted_stream_a_malformed_body_and_a_huge_one_are_charged_their_estimate() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, TOKENS_PER_MINUTE);
    // Aborted mid-stream: headers and part of the body, then the end.
    assert_eq!(
        call(&host, &mut w, 1, br#"{"max_tokens": 900}"#),
        Verdict::Continue
    );
    let sse: Vec<(&str, &[u8])> = vec![("content-type", b"text/event-stream")];
    assert!(w.on_response_headers(&host, 1, sse.as_slice(), false));
    assert!(w.on_response_body(&host, 1, b"data: {\"usage\": {\"prompt_tokens\": 1", false));
    w.on_stream_end(&host, 1);
    // Not JSON.
    assert_eq!(
        call(&host, &mut w, 2, br#"{"max_tokens": 900}"#),
        Verdict::Continue
    );
    json_response(&host, &mut w, 2, &[b"<html>502 Bad Gateway</html>"]);
    // A path missing, and a number that is not whole.
    assert_eq!(
        call(&host, &mut w, 3, br#"{"max_tokens": 900}"#),
        Verdict::Continue
    );
    json_response(
        &host,
        &mut w,
        3,
        &[br#"{"usage": {"prompt_tokens": -5, "completion_tokens": 1.5}}"#],
    );
    // Past max_body_bytes (2 KiB): read no further, settled at once.
    assert_eq!(
        call(&host, &mut w, 4, br#"{"max_tokens": 900}"#),
        Verdict::Continue
    );
    let json: Vec<(&str, &[u8])> = vec![("content-type", b"application/json")];
    assert!(w.on_response_headers(&host, 4, json.as_slice(), false));
    let big = vec![b' '; 3000];
    assert!(
        !w.on_response_body(&host, 4, &big, false),
        "stops reading past the bound"
    );
    w.on_stream_end(&host, 4);
    // Never answered (the upstream reset before headers).
    assert_eq!(
        call(&host, &mut w, 5, br#"{"max_tokens": 900}"#),
        Verdict::Continue
    );
    w.on_stream_end(&host, 5);
    assert_eq!(w.awaiting_usage(), 0);
    // Five estimates of 1 000 stay taken.
    assert_eq!(tokens_left(&host, &mut w), 5000);
    w.on_tick(&host);
    assert_eq!(host.metric("sluice.limit.tpm.usage_aborted"), 2 + 5);
    assert_eq!(host.metric("sluice.limit.tpm.usage_malformed"), 2);
    assert_eq!(host.metric("sluice.limit.tpm.usage_too_large"), 1);
    assert_eq!(host.metric("sluice.limit.tpm.usage_read"), 0);
    assert_eq!(host.metric("sluice.limit.tpm.tokens"), 10 * 1000);
}

#[test]
fn a_request_body_that_is_not_json_or_too_large_costs_the_default_estimate() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, TOKENS_PER_MINUTE);
    let headers = req(LLM, &[]);
    // Not JSON, a negative and a huge max_tokens (capped at max 5 000).
    for (id, body) in [
        (1u32, b"not json".as_slice()),
        (2, br#"{"max_tokens": -1}"#),
    ] {
        assert_eq!(call(&host, &mut w, id, body), Verdict::Continue);
    }
    assert_eq!(
        w.on_request_with(&host, 3, headers.as_slice(), RequestBody::Read(None)),
        Verdict::Continue,
        "too large to read: default"
    );
    // 3 × 2 000 taken: 4 000 left, and a max_tokens past `max` costs 5 000.
    assert_eq!(
        status(&call(&host, &mut w, 4, br#"{"max_tokens": 99999999999}"#)),
        429
    );
    assert_eq!(tokens_left(&host, &mut w), 4000);
    w.on_tick(&host);
    assert_eq!(host.metric("sluice.request_body_too_large"), 1);
    // A request without a body is decided at once on the default.
    pass(&host, &mut w, 60_000);
    let v = w.on_request_with(&host, 10, headers.as_slice(), RequestBody::Absent);
    assert_eq!(v, Verdict::Continue);
}

/// Usage from a response header, under a token bucket: a response with no
/// such header, or garbage in it, keeps the estimate.
#[test]
fn usage_from_a_response_header_and_garbage_in_it() {
    let host = FakeHost::at(T0);
    let policy = r#"{"version": 1, "policies": [
        {"name": "api", "match": {"host": "api.llm.example"},
         "rate": {"requests": 1000, "period": "1s"},
         "limits": [{"name": "units", "rate": {"requests": 100, "period": "1m", "burst": 100},
                     "cost": {"header": "x-units", "default": 30, "max": 100},
                     "usage": {"header": "X-Usage-Units"}}]}]}"#;
    let mut w = worker(&host, policy);
    let go = |w: &mut Worker, id: u32, response: &[(&str, &[u8])]| {
        let v = w.on_request(&host, id, req(LLM, &[]).as_slice());
        assert_eq!(v, Verdict::Continue);
        assert!(
            !w.on_response_headers(&host, id, response, false),
            "no body read for a header"
        );
        w.on_stream_end(&host, id);
    };
    go(&mut w, 1, &[("x-usage-units", b" 10 ")]);
    go(&mut w, 2, &[("x-usage-units", b"-3")]);
    go(&mut w, 3, &[("x-usage-units", b"\xff\xfe")]);
    go(&mut w, 4, &[("content-type", b"text/plain")]);
    // 10 + 3 × 30: the bucket of 100 is empty.
    let v = w.on_request(&host, 5, req(LLM, &[("x-units", b"1")]).as_slice());
    assert_eq!(status(&v), 429);
    w.on_tick(&host);
    assert_eq!(host.metric("sluice.limit.units.usage_read"), 1);
    assert_eq!(host.metric("sluice.limit.units.usage_malformed"), 3);
    assert_eq!(host.metric("sluice.limit.units.tokens"), 100);
}

fn usage_cases() -> u32 {
    std::env::var("SLUICE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
        .map_or(500, |n| (n / 10).max(1))
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: usage_cases(), ..Default::default() })]

    /// Any request body, any response headers and body in any pieces, the
    /// call ended at any point: no panic, every call settled exactly once
    /// (read, or charged its estimate and counted), nothing left waiting.
    #[test]
    fn the_response_path_never_panics_and_settles_every_call(
        calls in proptest::collection::vec((
            proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200),
            proptest::prop_oneof![
                proptest::prelude::Just(b"application/json".to_vec()),
                proptest::prelude::Just(b"text/event-stream".to_vec()),
                proptest::collection::vec(proptest::prelude::any::<u8>(), 0..40),
            ],
            proptest::collection::vec(proptest::collection::vec(proptest::prelude::any::<u8>(), 0..700), 0..6),
            0usize..8,
        ), 1..20),
    ) {
        let host = FakeHost::at(T0);
        let mut w = worker(&host, TOKENS_PER_MINUTE);
        let mut admitted = 0i64;
        for (id, (body, content_type, chunks, stop_at)) in calls.iter().enumerate() {
            let id = id as u32;
            // A new minute every few calls: most calls get through.
            host.advance_ms(15_000);
            if call(&host, &mut w, id, body) != Verdict::Continue {
                continue;
            }
            admitted += 1;
            // stop_at 0: no response at all; past the chunks: the body ends.
            if *stop_at > 0 {
                let headers: Vec<(&str, &[u8])> = vec![("content-type", content_type.as_slice())];
                let mut wanted = w.on_response_headers(&host, id, headers.as_slice(), chunks.is_empty());
                for (i, chunk) in chunks.iter().enumerate().take(*stop_at - 1) {
                    if !wanted {
                        break;
                    }
                    wanted = w.on_response_body(&host, id, chunk, i + 1 == chunks.len());
                }
            }
            w.on_stream_end(&host, id);
            w.on_stream_end(&host, id);
        }
        proptest::prop_assert_eq!(w.awaiting_usage(), 0);
        w.on_tick(&host);
        let settled: i64 = ["usage_read", "usage_too_large", "usage_malformed", "usage_aborted"]
            .iter()
            .map(|s| host.metric(&format!("sluice.limit.tpm.{s}")))
            .sum();
        proptest::prop_assert_eq!(settled, admitted);
    }
}
