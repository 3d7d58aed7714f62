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
    let mut wanted = w
        .on_answer_headers(host, id, headers.as_slice(), false)
        .read_body;
    for (i, chunk) in chunks.iter().enumerate() {
        assert!(wanted, "the body is read until it ends");
        wanted = w
            .on_answer_body(host, id, chunk, i + 1 == chunks.len())
            .more;
    }
    assert!(!wanted, "nothing more wanted once the body ended");
    w.on_stream_end(host, id);
}

/// Probes with calls estimated at 1 000 (and using just that) until the
/// limit refuses: what it had left, to the thousand. The probes stay
/// charged, as usage read.
fn tokens_left(host: &FakeHost, w: &mut Worker) -> u64 {
    let mut admitted = 0;
    for id in 9000..9200u32 {
        let v = call(host, w, id, br#"{"max_tokens": 900}"#);
        if status(&v) != 200 {
            break;
        }
        admitted += 1000;
        json_response(
            host,
            w,
            id,
            &[br#"{"usage": {"prompt_tokens": 400, "completion_tokens": 600}}"#],
        );
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
    // The two calls and the 9 probes.
    assert_eq!(host.metric("sluice.limit.tpm.usage_read"), 2 + 9);
    // 2 × 500 read, then 9 probes of 1 000 in the same window.
    assert_eq!(host.metric("sluice.limit.tpm.tokens"), 1000 + 9 * 1000);
    assert_eq!(host.metric("sluice.limit.tpm.usage_aborted"), 0);
}

#[test]
fn a_call_the_provider_refused_used_nothing() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, TOKENS_PER_MINUTE);
    for id in 1..=2u32 {
        assert_eq!(
            call(&host, &mut w, id, br#"{"max_tokens": 4900}"#),
            Verdict::Continue
        );
    }
    assert_eq!(
        status(&call(&host, &mut w, 3, br#"{"max_tokens": 4900}"#)),
        429
    );
    // The provider refused call 1, its body an error without usage: its
    // 5 000 come back, not charged the unread charge.
    let headers: Vec<(&str, &[u8])> =
        vec![(":status", b"429"), ("content-type", b"application/json")];
    let wanted = w
        .on_answer_headers(&host, 1, headers.as_slice(), false)
        .read_body;
    assert!(!wanted, "nothing of its body is read");
    w.on_stream_end(&host, 1);
    assert_eq!(
        call(&host, &mut w, 4, br#"{"max_tokens": 4900}"#),
        Verdict::Continue
    );
    assert_eq!(host.metric("sluice.limit.tpm.usage_malformed"), 0);
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
    assert!(
        w.on_answer_headers(&host, 1, headers.as_slice(), false)
            .read_body
    );
    let stream = b"data: {\"choices\": [{\"delta\": {\"content\": \"hi\"}}]}\n\n\
        data: {\"choices\": [], \"usage\": {\"prompt_tokens\": 40, \"completion_tokens\": 60}}\n\ndata: [DONE]\n\n";
    for piece in stream.chunks(7) {
        assert!(w.on_answer_body(&host, 1, piece, false).more);
    }
    assert!(!w.on_answer_body(&host, 1, b"", true).more);
    w.on_stream_end(&host, 1);
    assert_eq!(tokens_left(&host, &mut w), 9000, "100 used of 10 000");
}

/// A minute of 100 000 tokens, the rest as [`TOKENS_PER_MINUTE`], and
/// what a call whose usage is unread is charged.
fn large_minute(unread: &str) -> String {
    TOKENS_PER_MINUTE
        .replace(r#""requests": 10000"#, r#""requests": 100000"#)
        .replace(
            r#""max_body_bytes": 2048"#,
            &format!(r#""max_body_bytes": 2048{unread}"#),
        )
}

/// Calls whose usage goes unread in every way a caller or a provider can
/// make it: each is charged the most its cost can be (5 000), not its
/// estimate (1 000, from the caller's own max_tokens), and counted.
#[test]
fn an_aborted_stream_an_unreadable_body_and_a_huge_one_are_charged_the_unread_charge() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, &large_minute(""));
    unread_in_every_way(&host, &mut w);
    // Five charged 5 000 each.
    assert_eq!(tokens_left(&host, &mut w), 100_000 - 5 * 5000);
    w.on_tick(&host);
    assert_eq!(host.metric("sluice.limit.tpm.usage_aborted"), 2);
    assert_eq!(host.metric("sluice.limit.tpm.usage_malformed"), 1);
    assert_eq!(host.metric("sluice.limit.tpm.usage_missing"), 1);
    assert_eq!(host.metric("sluice.limit.tpm.usage_too_large"), 1);
    assert_eq!(host.metric("sluice.limit.tpm.usage_read"), 75);
    assert_eq!(host.metric("sluice.limit.tpm.tokens"), 100_000);
    // Charged a number of tokens instead, never less than the estimate;
    // or, asked for, the estimate as before.
    for (unread, each) in [
        (r#", "unread": 3000"#, 3000),
        (r#", "unread": 10"#, 1000),
        (r#", "unread": "estimate""#, 1000),
    ] {
        let host = FakeHost::at(T0);
        let mut w = worker(&host, &large_minute(unread));
        unread_in_every_way(&host, &mut w);
        assert_eq!(tokens_left(&host, &mut w), 100_000 - 5 * each, "{unread}");
    }
}

/// Five calls estimated at 1 000 whose usage is not read: one aborted
/// mid-stream, one answered with a body that is not JSON, one without
/// usage, one too large to read, one never answered.
fn unread_in_every_way(host: &FakeHost, w: &mut Worker) {
    // Aborted mid-stream: headers and part of the body, then the end.
    assert_eq!(
        call(host, w, 1, br#"{"max_tokens": 900}"#),
        Verdict::Continue
    );
    let sse: Vec<(&str, &[u8])> = vec![("content-type", b"text/event-stream")];
    assert!(
        w.on_answer_headers(host, 1, sse.as_slice(), false)
            .read_body
    );
    assert!(
        w.on_answer_body(host, 1, b"data: {\"usage\": {\"prompt_tokens\": 1", false)
            .more
    );
    w.on_stream_end(host, 1);
    // Not JSON.
    assert_eq!(
        call(host, w, 2, br#"{"max_tokens": 900}"#),
        Verdict::Continue
    );
    json_response(host, w, 2, &[b"<html>502 Bad Gateway</html>"]);
    // No whole number at the paths: missing, negative, fractional.
    assert_eq!(
        call(host, w, 3, br#"{"max_tokens": 900}"#),
        Verdict::Continue
    );
    json_response(
        host,
        w,
        3,
        &[br#"{"usage": {"prompt_tokens": -5, "completion_tokens": 1.5}}"#],
    );
    // Past max_body_bytes (2 KiB), and no usage where a large answer
    // keeps it (its end): too large.
    assert_eq!(
        call(host, w, 4, br#"{"max_tokens": 900}"#),
        Verdict::Continue
    );
    let json: Vec<(&str, &[u8])> = vec![("content-type", b"application/json")];
    assert!(
        w.on_answer_headers(host, 4, json.as_slice(), false)
            .read_body
    );
    let big = vec![b' '; 3000];
    assert!(
        !w.on_answer_body(host, 4, &big, true).more,
        "read to its end"
    );
    w.on_stream_end(host, 4);
    // Never answered (the upstream reset before headers).
    assert_eq!(
        call(host, w, 5, br#"{"max_tokens": 900}"#),
        Verdict::Continue
    );
    w.on_stream_end(host, 5);
    assert_eq!(w.awaiting_usage(), 0);
}

#[test]
fn a_request_body_that_cannot_be_read_costs_its_max() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, TOKENS_PER_MINUTE);
    let headers = req(LLM, &[]);
    // Not JSON: it could ask for anything, as a body too large to read:
    // estimated at the cost's max (5 000), not its default. A negative
    // max_tokens is not a whole number: the default (2 000).
    for (id, body) in [
        (1u32, b"not json".as_slice()),
        (2, br#"{"max_tokens": -1}"#),
    ] {
        assert_eq!(call(&host, &mut w, id, body), Verdict::Continue);
    }
    // Too large to read: 5 000, which the 3 000 left cannot take; a
    // max_tokens past `max` costs 5 000 too.
    assert_eq!(
        status(&w.on_request_with(&host, 3, headers.as_slice(), RequestBody::Read(None))),
        429,
    );
    assert_eq!(
        status(&call(&host, &mut w, 4, br#"{"max_tokens": 99999999999}"#)),
        429
    );
    assert_eq!(tokens_left(&host, &mut w), 3000);
    w.on_tick(&host);
    assert_eq!(host.metric("sluice.request_body_too_large"), 1);
    // A request without a body is decided at once on the default.
    pass(&host, &mut w, 60_000);
    let v = w.on_request_with(&host, 10, headers.as_slice(), RequestBody::Absent);
    assert_eq!(v, Verdict::Continue);
}

/// Usage from a response header, under a token bucket: a response with no
/// such header, or garbage in it, is charged the cost's max.
#[test]
fn usage_from_a_response_header_and_garbage_in_it() {
    let host = FakeHost::at(T0);
    let policy = r#"{"version": 1, "policies": [
        {"name": "api", "match": {"host": "api.llm.example"},
         "rate": {"requests": 1000, "period": "1s"},
         "limits": [{"name": "units", "rate": {"requests": 400, "period": "1m", "burst": 400},
                     "cost": {"header": "x-units", "default": 30, "max": 100},
                     "usage": {"header": "X-Usage-Units"}}]}]}"#;
    let mut w = worker(&host, policy);
    let go = |w: &mut Worker, id: u32, response: &[(&str, &[u8])]| {
        let v = w.on_request(&host, id, req(LLM, &[]).as_slice());
        assert_eq!(v, Verdict::Continue);
        assert!(
            !w.on_answer_headers(&host, id, response, false).read_body,
            "no body read for a header"
        );
        w.on_stream_end(&host, id);
    };
    go(&mut w, 1, &[("x-usage-units", b" 10 ")]);
    go(&mut w, 2, &[("x-usage-units", b"-3")]);
    go(&mut w, 3, &[("x-usage-units", b"\xff\xfe")]);
    go(&mut w, 4, &[("content-type", b"text/plain")]);
    // 10 + 3 × 100 (the unread charge, not the estimate 30) of 400: a
    // call of 100 no longer fits (it would, charged the estimates).
    let v = w.on_request(&host, 5, req(LLM, &[("x-units", b"100")]).as_slice());
    assert_eq!(status(&v), 429);
    w.on_tick(&host);
    assert_eq!(host.metric("sluice.limit.units.usage_read"), 1);
    assert_eq!(host.metric("sluice.limit.units.usage_malformed"), 2);
    assert_eq!(host.metric("sluice.limit.units.usage_missing"), 1);
    assert_eq!(host.metric("sluice.limit.units.tokens"), 310);
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
                let mut wanted = w.on_answer_headers(&host, id, headers.as_slice(), chunks.is_empty()).read_body;
                for (i, chunk) in chunks.iter().enumerate().take(*stop_at - 1) {
                    if !wanted {
                        break;
                    }
                    wanted = w.on_answer_body(&host, id, chunk, i + 1 == chunks.len()).more;
                }
            }
            w.on_stream_end(&host, id);
            w.on_stream_end(&host, id);
        }
        proptest::prop_assert_eq!(w.awaiting_usage(), 0);
        w.on_tick(&host);
        let settled: i64 = ["usage_read", "usage_too_large", "usage_malformed", "usage_aborted", "usage_missing"]
            .iter()
            .map(|s| host.metric(&format!("sluice.limit.tpm.{s}")))
            .sum();
        proptest::prop_assert_eq!(settled, admitted);
    }
}

/// 2 000 calls at once whose answers are each as large as the limit reads
/// (16 MiB): the worker never holds more than [`MAX_HELD_BYTES`] of them;
/// a body that would pass it is not read, charged the unread charge and
/// counted, and answers small enough are still read.
#[test]
fn many_large_answers_at_once_stay_under_the_workers_cap() {
    use crate::worker::MAX_HELD_BYTES;
    const CALLS: u32 = 2_000;
    const BODY: usize = 16 * 1024 * 1024;
    const CHUNK: usize = 256 * 1024;
    let host = FakeHost::at(T0);
    let policy = TOKENS_PER_MINUTE
        .replace(
            r#""requests": 1000, "period": "1s""#,
            r#""requests": 100000, "period": "1s""#,
        )
        .replace(
            r#""requests": 10000, "period": "1m""#,
            r#""requests": 1000000000, "period": "1m""#,
        )
        .replace(
            r#""default": 2000, "max": 5000"#,
            r#""default": 1000, "max": 1000"#,
        )
        .replace(
            r#""max_body_bytes": 2048"#,
            &format!(r#""max_body_bytes": {BODY}"#),
        );
    let mut w = worker(&host, &policy);
    let json: Vec<(&str, &[u8])> = vec![(":status", b"200"), ("content-type", b"application/json")];
    for id in 1..=CALLS + 10 {
        assert_eq!(
            call(&host, &mut w, id, br#"{"max_tokens": 900}"#),
            Verdict::Continue
        );
        assert!(
            w.on_answer_headers(&host, id, json.as_slice(), false)
                .read_body
        );
    }
    // Ten small answers, read whole.
    for id in CALLS + 1..=CALLS + 10 {
        let body = br#"{"usage": {"prompt_tokens": 10, "completion_tokens": 20}}"#;
        assert!(!w.on_answer_body(&host, id, body, true).more);
        w.on_stream_end(&host, id);
    }
    // The large ones, a chunk each in turn, for as long as each is read.
    let chunk = vec![b' '; CHUNK];
    let mut reading: Vec<(u32, usize)> = (1..=CALLS).map(|id| (id, 0)).collect();
    let mut most = 0;
    while !reading.is_empty() {
        reading.retain_mut(|(id, sent)| {
            *sent += CHUNK;
            let last = *sent >= BODY;
            let wanted = w.on_answer_body(&host, *id, &chunk, last).more;
            most = most.max(w.response_bytes_held());
            if !wanted {
                w.on_stream_end(&host, *id);
            }
            wanted && !last
        });
    }
    assert_eq!(w.awaiting_usage(), 0);
    assert_eq!(w.response_bytes_held(), 0);
    w.on_tick(&host);
    let too_large = host.metric("sluice.limit.tpm.usage_too_large");
    println!(
        "{CALLS} answers of {} MiB at once: at most {:.1} MiB held (cap {} MiB); {too_large} not read past it, \
         charged the unread charge; 10 small ones read",
        BODY / 1024 / 1024,
        most as f64 / 1024.0 / 1024.0,
        MAX_HELD_BYTES / 1024 / 1024
    );
    assert!(most <= MAX_HELD_BYTES, "{most}");
    assert!(most > MAX_HELD_BYTES / 2, "the cap was reached: {most}");
    assert_eq!(host.metric("sluice.usage_buffer_full"), too_large);
    // The few read to their end (blanks: no usage in them) fitted together.
    let whole = host.metric("sluice.limit.tpm.usage_malformed");
    assert_eq!(too_large + whole, i64::from(CALLS));
    assert!(
        whole <= i64::try_from(MAX_HELD_BYTES / BODY).unwrap_or(0),
        "{whole}"
    );
    assert_eq!(host.metric("sluice.limit.tpm.usage_read"), 10);
    // 10 read (30 each) and 2 000 charged the max, 1 000 each.
    assert_eq!(
        host.metric("sluice.limit.tpm.tokens"),
        10 * 30 + i64::from(CALLS) * 1000
    );
}

/// Request headers as a proxy-wasm host gives them: readable while the
/// headers pass, not once the body comes (what was read before stays
/// known, as the Envoy glue keeps it).
struct PhasedHeaders<'a> {
    all: Vec<(&'a str, &'a [u8])>,
    passing: std::cell::Cell<bool>,
    kept: std::cell::RefCell<Vec<(String, Option<Vec<u8>>)>>,
}

impl sluice_shared::request_headers::RequestHeaders for PhasedHeaders<'_> {
    fn header(&self, name: &str) -> Option<std::borrow::Cow<'_, [u8]>> {
        if let Some((_, v)) = self.kept.borrow().iter().find(|(n, _)| n == name) {
            return v.clone().map(std::borrow::Cow::Owned);
        }
        if !self.passing.get() {
            return None;
        }
        let value = self.all.as_slice().header(name).map(|v| v.into_owned());
        self.kept
            .borrow_mut()
            .push((name.to_string(), value.clone()));
        value.map(std::borrow::Cow::Owned)
    }
}

/// A policy deciding on the request's body keys a further limit by a
/// header: the header is read while the headers pass, so each key has
/// its own limit (read only once the body came, every key would share
/// one, the empty key's).
#[test]
fn a_body_reading_policy_keys_its_limits_by_headers_read_while_they_pass() {
    let host = FakeHost::at(T0);
    let policy = r#"{"version": 1, "policies": [
        {"name": "llm", "match": {"host": "api.llm.example"}, "rate": {"requests": 1000, "period": "1s"},
         "priority": {"header": "x-priority", "default": "normal"},
         "limits": [{"name": "per-key", "key": {"header": "authorization"},
                     "rate": {"requests": 1000, "period": "1m", "algorithm": "fixed_window"},
                     "cost": {"json": "max_tokens", "default": 100, "max": 1000}},
                    {"name": "per-team", "key": {"header": "x-team"},
                     "rate": {"requests": 5000, "period": "1m"},
                     "cost": {"header": "x-weight", "default": 1, "max": 10}}]}]}"#;
    let mut w = worker(&host, policy);
    let mut admitted = std::collections::BTreeMap::new();
    for (id, key) in (1..=8u32).zip([b"Bearer a".as_slice(), b"Bearer b"].into_iter().cycle()) {
        let extra: [(&str, &[u8]); 4] = [
            ("authorization", key),
            ("x-team", b"t1"),
            ("x-weight", b"2"),
            ("x-priority", b"high"),
        ];
        let headers = PhasedHeaders {
            all: req(LLM, &extra),
            passing: std::cell::Cell::new(true),
            kept: Default::default(),
        };
        assert_eq!(
            w.on_request_with(&host, id, &headers, RequestBody::Coming),
            Verdict::ReadBody
        );
        headers.passing.set(false);
        let v = w.on_request_with(
            &host,
            id,
            &headers,
            RequestBody::Read(Some(br#"{"max_tokens": 400}"#)),
        );
        *admitted.entry(key).or_insert(0) += u32::from(v == Verdict::Continue);
    }
    // 1 000 a minute per key at 400 a call: two calls each, not two in all.
    assert_eq!(admitted.values().copied().collect::<Vec<_>>(), [2, 2]);
}

/// `ask_stream_usage`: a streamed call not asking is sent asking (its body
/// replaced, its length dropped while its headers pass); its answer's
/// usage chunk is taken out and still read; a call already asking, and a
/// refusal's JSON answer, go as they are.
#[test]
fn a_stream_is_asked_for_its_usage_and_the_answer_loses_what_that_added() {
    let policies = TOKENS_PER_MINUTE.replace(
        r#""max_body_bytes": 2048}"#,
        r#""max_body_bytes": 2048, "ask_stream_usage": true}"#,
    );
    let host = FakeHost::at(T0);
    let mut w = worker(&host, &policies);
    let body = br#"{"max_tokens": 900, "stream": true}"#;
    assert_eq!(call(&host, &mut w, 1, body), Verdict::Continue);
    assert_eq!(*host.removed_headers.borrow(), ["content-length"]);
    let replaced = host.replaced_bodies.borrow().clone();
    assert_eq!(
        replaced,
        [(
            body.len(),
            br#"{"stream_options":{"include_usage":true},"max_tokens": 900, "stream": true}"#
                .to_vec()
        )]
    );
    let headers: Vec<(&str, &[u8])> =
        vec![(":status", b"200"), ("content-type", b"text/event-stream")];
    let answer = w.on_answer_headers(&host, 1, headers.as_slice(), false);
    assert!(answer.read_body && answer.strips);
    let content = b"data: {\"choices\":[{\"delta\":{}}],\"usage\":null}\n\n";
    let usage = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":400,\"completion_tokens\":500}}\n\ndata: [DONE]\n\n";
    let mut got = Vec::new();
    for (chunk, end) in [(&content[..], false), (&usage[..], true)] {
        got.extend(
            w.on_answer_body(&host, 1, chunk, end)
                .passed
                .unwrap_or_default(),
        );
    }
    assert_eq!(
        String::from_utf8_lossy(&got),
        "data: {\"choices\":[{\"delta\":{}}]}\n\ndata: [DONE]\n\n"
    );
    w.on_stream_end(&host, 1);
    pass(&host, &mut w, 100);
    assert_eq!(host.metric("sluice.limit.tpm.usage_read"), 1);
    assert_eq!(host.metric("sluice.policy.llm.stream_usage_asked"), 1);
    assert_eq!(host.metric("sluice.policy.llm.stream_usage_stripped"), 1);
    // Already asking: the body goes as it is, the answer too.
    let asking =
        br#"{"max_tokens": 900, "stream": true, "stream_options": {"include_usage": true}}"#;
    assert_eq!(call(&host, &mut w, 2, asking), Verdict::Continue);
    assert_eq!(host.replaced_bodies.borrow().len(), 1);
    let answer = w.on_answer_headers(&host, 2, headers.as_slice(), false);
    assert!(answer.read_body && !answer.strips);
    assert_eq!(w.on_answer_body(&host, 2, usage, true).passed, None);
    w.on_stream_end(&host, 2);
    // Asked, but the provider answered JSON (a refusal): left as it is.
    assert_eq!(call(&host, &mut w, 3, body), Verdict::Continue);
    let json: Vec<(&str, &[u8])> = vec![(":status", b"429"), ("content-type", b"application/json")];
    assert!(!w.on_answer_headers(&host, 3, json.as_slice(), false).strips);
    w.on_stream_end(&host, 3);
}

/// Without `ask_stream_usage` nothing of the request is touched.
#[test]
fn without_asking_no_body_or_length_is_touched() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, TOKENS_PER_MINUTE);
    assert_eq!(
        call(&host, &mut w, 1, br#"{"max_tokens": 900, "stream": true}"#),
        Verdict::Continue
    );
    assert!(host.removed_headers.borrow().is_empty());
    assert!(host.replaced_bodies.borrow().is_empty());
}
