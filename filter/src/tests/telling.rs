//! `ratelimit_headers: always`: the answer to each call that went tells
//! where the policy's limits stand, the provider's word included.

use crate::testing::FakeHost;
use crate::tests::{req, worker, T0};
use crate::worker::{Verdict, Worker};

const TELLING: &str = r#"{"version": 1, "policies": [
    {"name": "api", "match": {"host": "api.example"}, "ratelimit_headers": "always",
     "rate": {"requests": 10, "period": "1s", "burst": 5},
     "limits": [{"name": "per-minute", "rate": {"requests": 100, "period": "1m", "algorithm": "fixed_window"},
                 "provider": {"headers": "openai-requests", "max_pause": "10s"}},
                {"name": "in-flight", "concurrency": {"max_in_flight": 3}}]}]}"#;

fn call(host: &FakeHost, w: &mut Worker, id: u32) -> Verdict {
    w.on_request(host, id, req(b"api.example", &[]).as_slice())
}

/// The provider answers call `id`; the fields its caller gets.
fn told(
    host: &FakeHost,
    w: &mut Worker,
    id: u32,
    answer: &[(&str, &[u8])],
) -> Vec<(&'static str, String)> {
    assert!(w.awaits_answer(id));
    let fields = w.on_answer_headers(host, id, answer, true).set;
    assert!(!w.awaits_answer(id), "once");
    fields
}

fn field(fields: &[(&'static str, String)], name: &str) -> String {
    fields
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, v)| v.clone())
        .unwrap_or_default()
}

#[test]
fn every_answer_tells_where_each_limit_stands() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, TELLING);
    assert_eq!(call(&host, &mut w, 1), Verdict::Continue);
    assert_eq!(call(&host, &mut w, 2), Verdict::Continue);
    let fields = told(&host, &mut w, 1, &[(":status", b"200")]);
    assert_eq!(
        field(&fields, "ratelimit-policy"),
        r#""api";q=10;w=1, "per-minute";q=100;w=60, "in-flight";q=3;qu="concurrent-requests""#
    );
    // 5 of the burst less 2 (refilled in 200 ms); 98 of the minute's
    // window (its end within 60 s); 3 slots less the 2 calls in flight.
    let state = field(&fields, "ratelimit");
    assert!(
        state.starts_with(r#""api";r=3;t=1, "per-minute";r=98;t="#),
        "{state}"
    );
    assert!(state.ends_with(r#", "in-flight";r=1"#), "{state}");
}

#[test]
fn the_provider_saying_less_is_what_callers_are_told_and_a_pause_is_zero() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, TELLING);
    assert_eq!(call(&host, &mut w, 1), Verdict::Continue);
    let fields = told(
        &host,
        &mut w,
        1,
        &[
            (":status", b"200"),
            ("x-ratelimit-limit-requests", b"100"),
            ("x-ratelimit-remaining-requests", b"7"),
            ("x-ratelimit-reset-requests", b"5s"),
        ],
    );
    let state = field(&fields, "ratelimit");
    assert!(state.contains(r#""per-minute";r=7;t=5"#), "{state}");
    w.on_stream_end(&host, 1);

    assert_eq!(call(&host, &mut w, 2), Verdict::Continue);
    let fields = told(
        &host,
        &mut w,
        2,
        &[(":status", b"429"), ("retry-after", b"3")],
    );
    let state = field(&fields, "ratelimit");
    assert!(state.contains(r#""per-minute";r=0;t=3"#), "{state}");
}

#[test]
fn by_default_only_refusals_tell() {
    let host = FakeHost::at(T0);
    let quiet = TELLING.replace(r#""ratelimit_headers": "always","#, "");
    let mut w = worker(&host, &quiet);
    assert_eq!(call(&host, &mut w, 1), Verdict::Continue);
    // Its answer is read (a limit listens to the provider), never told.
    let answer = [(":status", &b"200"[..])];
    assert!(w
        .on_answer_headers(&host, 1, answer.as_slice(), true)
        .set
        .is_empty());
}
