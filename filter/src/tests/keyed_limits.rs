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
    w.on_answer_headers(&host, 1, answer.as_slice(), true);
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

/// The live view's per-key counts, as the syncing worker reports them:
/// by label, never by raw key, with the keys that found no place.
#[test]
fn the_sync_report_names_the_busiest_keys_by_label_and_counts_overflow() {
    use sluice_shared::key_view::{label_secret, name_key, KeyEstimate};
    use sluice_shared::KeyLabel;
    use sluice_wire::sync::SyncReport;

    let host = FakeHost::at(T0);
    let mut w = worker(
        &host,
        r#"{"version": 1, "policies": [
        {"name": "llm", "match": {"host": "api.llm.example"},
         "rate": {"requests": 5, "period": "1m"},
         "key": {"header": "authorization", "max_keys": 1}}]}"#,
    );
    let settings = crate::tests::sync_settings();
    let secret = label_secret(settings.token.as_deref());
    w.set_sync(Some(settings));
    let mut id = 0;
    let mut send = |w: &mut Worker, key: &str, n: u32| {
        for _ in 0..n {
            id += 1;
            let mut headers = req(LLM, &[]);
            headers.push(("authorization", key.as_bytes()));
            let _ = w.on_request(&host, id, headers.as_slice());
            w.on_stream_end(&host, id);
        }
    };
    // key-a holds the one place; b and c overflow into the shared bucket.
    send(&mut w, "sk-live-aaaa", 7);
    send(&mut w, "sk-live-bbbb", 2);
    send(&mut w, "sk-live-cccc", 1);
    let before = host.calls.borrow().len();
    for _ in 0..300 {
        host.advance_ms(10);
        w.on_tick(&host);
        if host.calls.borrow().len() > before {
            break;
        }
    }
    let calls = host.calls.borrow();
    let body = &calls.last().expect("a sync call").2;
    assert!(!String::from_utf8_lossy(body).contains("sk-live"));
    let report: SyncReport = serde_json::from_slice(body).expect("a report");
    let llm = &report.keys["llm"];
    let label = |k: &[u8]| name_key(&secret, "llm", k, KeyLabel::Hash).label;
    let a = llm
        .top
        .keys
        .iter()
        .find(|k| k.label == label(b"sk-live-aaaa"));
    let a = a.expect("key a listed");
    // 5 a minute for key a: 5 admitted, 2 refused.
    assert_eq!((a.calls, a.admitted, a.refused), (7, 5, 2));
    assert_eq!(llm.top.total, 10);
    assert_eq!(llm.seen.estimate(), KeyEstimate::About(3));
    assert_eq!(llm.overflowed.estimate(), KeyEstimate::About(2));
    assert!(llm.since_ms <= report.at_ms);
}
