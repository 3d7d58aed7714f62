//! Further limits with their own `key` (tokens per minute per API key beside
//! a company-wide limit), through the worker against the in-memory host.

use crate::host::Host;
use crate::testing::FakeHost;
use crate::tests::{req, worker, T0};
use crate::worker::{Verdict, Worker};

const LLM: &[u8] = b"api.llm.example";

fn policy(per_key: &str) -> String {
    format!(
        r#"{{"version": 1, "policies": [
        {{"name": "llm", "match": {{"host": "api.llm.example"}},
         "rate": {{"requests": 1000, "period": "1s"}},
         "limits": [{{"name": "per-key", "key": {per_key},
                      "rate": {{"requests": 3, "period": "1m", "algorithm": "fixed_window"}},
                      "cost": {{"header": "x-units", "default": 1, "max": 3}},
                      "usage": {{"header": "x-usage-units"}}}},
                    {{"name": "company", "rate": {{"requests": 5, "period": "1m", "algorithm": "fixed_window"}}}}]}}]}}"#
    )
}

/// The call's answer: 200, or the limit that refused it.
fn call(host: &FakeHost, w: &mut Worker, id: u32, key: &str) -> Result<(), String> {
    let r = req(LLM, &[]);
    let mut headers = r.clone();
    headers.push(("authorization", key.as_bytes()));
    match w.on_request(host, id, headers.as_slice()) {
        Verdict::Continue => Ok(()),
        Verdict::Reply(reply) => Err(reply
            .headers
            .iter()
            .find(|(n, _)| *n == "x-sluice-limit")
            .map_or_else(
                || format!("{} without a limit", reply.status),
                |(_, v)| v.clone(),
            )),
        other => Err(format!("{other:?}")),
    }
}

#[test]
fn each_key_has_its_own_limit_beside_the_company_wide_one() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, &policy(r#"{"header": "authorization"}"#));
    for id in 1..4 {
        assert_eq!(call(&host, &mut w, id, "key-a"), Ok(()));
    }
    // key-a's 3 are spent; the company's 5 are not.
    assert_eq!(call(&host, &mut w, 4, "key-a"), Err("per-key".into()));
    // That refusal took nothing from the company: key-b gets its 2.
    assert_eq!(call(&host, &mut w, 5, "key-b"), Ok(()));
    assert_eq!(call(&host, &mut w, 6, "key-b"), Ok(()));
    assert_eq!(call(&host, &mut w, 7, "key-b"), Err("company".into()));
    assert_eq!(call(&host, &mut w, 8, "key-c"), Err("company".into()));
}

#[test]
fn keys_beyond_max_keys_share_an_overflow_limit_or_are_refused() {
    let host = FakeHost::at(T0);
    let mut shared = worker(
        &host,
        &policy(r#"{"header": "authorization", "max_keys": 1}"#),
    );
    assert_eq!(call(&host, &mut shared, 1, "key-a"), Ok(()));
    // key-a's place is busy: key-b and key-c share the overflow's 3.
    assert_eq!(call(&host, &mut shared, 2, "key-b"), Ok(()));
    assert_eq!(call(&host, &mut shared, 3, "key-c"), Ok(()));
    assert_eq!(call(&host, &mut shared, 4, "key-b"), Ok(()));
    assert_eq!(call(&host, &mut shared, 5, "key-c"), Err("per-key".into()));

    let host = FakeHost::at(T0);
    let mut strict = worker(
        &host,
        &policy(r#"{"header": "authorization", "max_keys": 1, "overflow": "reject"}"#),
    );
    assert_eq!(call(&host, &mut strict, 1, "key-a"), Ok(()));
    assert_eq!(call(&host, &mut strict, 2, "key-b"), Err("per-key".into()));
    // Refused, it took nothing from the company: 4 more for key-a... up
    // to its own 3.
    assert_eq!(call(&host, &mut strict, 3, "key-a"), Ok(()));
    assert_eq!(call(&host, &mut strict, 4, "key-a"), Ok(()));
    assert_eq!(call(&host, &mut strict, 5, "key-a"), Err("per-key".into()));
}

#[test]
fn an_idle_keys_place_goes_to_a_new_key() {
    let host = FakeHost::at(T0);
    let set = policy(r#"{"header": "authorization", "max_keys": 1, "overflow": "reject"}"#);
    let mut w = worker(&host, &set);
    assert_eq!(call(&host, &mut w, 1, "key-a"), Ok(()));
    assert_eq!(call(&host, &mut w, 2, "key-b"), Err("per-key".into()));
    // A minute on, key-a's window is over: its place is idle.
    host.advance_ms(60_000);
    let mut w = worker(&host, &set);
    for id in 3..6 {
        assert_eq!(call(&host, &mut w, id, "key-b"), Ok(()), "{id}");
    }
    assert_eq!(call(&host, &mut w, 6, "key-a"), Err("per-key".into()));
}

#[test]
fn usage_settles_on_the_keys_own_place() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, &policy(r#"{"header": "authorization"}"#));
    let r = req(LLM, &[]);
    let mut headers = r.clone();
    headers.push(("authorization", b"key-a"));
    headers.push(("x-units", b"3"));
    // Estimated 3: key-a's limit is full.
    assert_eq!(
        w.on_request(&host, 1, headers.as_slice()),
        Verdict::Continue
    );
    assert_eq!(call(&host, &mut w, 2, "key-a"), Err("per-key".into()));
    // It used 1: 2 go back to key-a.
    let answer: Vec<(&str, &[u8])> = vec![(":status", b"200"), ("x-usage-units", b"1")];
    w.on_response_headers(&host, 1, answer.as_slice(), true);
    w.on_stream_end(&host, 1);
    assert_eq!(call(&host, &mut w, 3, "key-a"), Ok(()));
    assert_eq!(call(&host, &mut w, 4, "key-a"), Ok(()));
    assert_eq!(call(&host, &mut w, 5, "key-a"), Err("per-key".into()));
}

#[test]
fn garbage_in_a_keyed_place_is_nobodys_and_fresh() {
    let host = FakeHost::at(T0);
    let mut w = worker(
        &host,
        &policy(r#"{"header": "authorization", "max_keys": 1}"#),
    );
    for bytes in [&b""[..], b"\x01", &[0xff; 8], &[0xff; 40]] {
        host.shared_set("sluice/l/per-key/0", bytes, None)
            .expect("a fake host stores anything");
        assert_eq!(call(&host, &mut w, 1, "key-a"), Ok(()), "{bytes:?}");
        w.on_stream_end(&host, 1);
        host.shared_set("sluice/l/company", b"", None)
            .expect("a fake host stores anything");
    }
}
