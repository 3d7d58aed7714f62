//! Each call's decision as Envoy's access log reads it (the plugin's
//! `log_decisions`): set on the stream in its own hook, or by a tick's
//! action ahead of the one that lets it go or answers it.

use crate::host::Host;
use crate::testing::FakeHost;
use crate::tests::{req, status, worker, T0};
use crate::worker::{RequestBody, StreamAction, Verdict, Worker};

/// 10 000 tokens a minute, estimated from the request, settled from the
/// answer's usage; one call in flight, others waiting up to 700 ms.
const POLICIES: &str = r#"{"version": 1, "policies": [
    {"name": "llm", "match": {"host": "api.llm.example"},
     "rate": {"requests": 1000, "period": "1s"},
     "limits": [{"name": "tpm", "rate": {"requests": 10000, "period": "1m", "algorithm": "fixed_window"},
                 "cost": {"json": "max_tokens", "plus": 100, "default": 2000, "max": 5000},
                 "usage": {"json": ["usage.prompt_tokens", "usage.completion_tokens"]}}]},
    {"name": "maps", "match": {"host": "api.maps.example"},
     "concurrency": {"max_in_flight": 1},
     "on_limit": {"action": "queue", "max_wait": "700ms", "max_queue": 10}}]}"#;

fn logging(host: &FakeHost) -> Worker {
    let mut w = worker(host, POLICIES);
    w.log_decisions(true);
    w
}

fn llm_call(host: &FakeHost, w: &mut Worker, id: u32, body: &[u8]) -> Verdict {
    let headers = req(b"api.llm.example", &[]);
    w.on_request_with(host, id, headers.as_slice(), RequestBody::Coming);
    w.on_request_with(host, id, headers.as_slice(), RequestBody::Read(Some(body)))
}

fn fields(host: &FakeHost, id: u32) -> Vec<(&'static str, String)> {
    crate::worker::LogField::ALL
        .into_iter()
        .filter_map(|f| Some((f.name(), host.log_field(id, f.name())?)))
        .collect()
}

fn owned(pairs: &[(&'static str, &str)]) -> Vec<(&'static str, String)> {
    pairs.iter().map(|(f, v)| (*f, v.to_string())).collect()
}

#[test]
fn an_admitted_call_says_its_policy_and_cost_and_then_what_it_was_charged() {
    let host = FakeHost::at(T0);
    let mut w = logging(&host);
    let v = llm_call(&host, &mut w, 1, br#"{"max_tokens": 4900}"#);
    assert_eq!(v, Verdict::Continue);
    assert_eq!(
        fields(&host, 1),
        owned(&[
            ("policy", "llm"),
            ("verdict", "admitted"),
            ("cost", "tpm=5000")
        ])
    );
    let headers: Vec<(&str, &[u8])> =
        vec![(":status", b"200"), ("content-type", b"application/json")];
    w.on_answer_headers(&host, 1, headers.as_slice(), false);
    w.on_answer_body(
        &host,
        1,
        br#"{"usage": {"prompt_tokens": 300, "completion_tokens": 200}}"#,
        true,
    );
    assert_eq!(host.log_field(1, "charged").as_deref(), Some("tpm=500"));
}

#[test]
fn a_refused_call_says_the_limit_that_refused_it() {
    let host = FakeHost::at(T0);
    let mut w = logging(&host);
    for id in 1..=2 {
        llm_call(&host, &mut w, id, br#"{"max_tokens": 4900}"#);
    }
    let refused = llm_call(&host, &mut w, 3, br#"{"max_tokens": 4900}"#);
    assert_eq!(status(&refused), 429);
    assert_eq!(
        fields(&host, 3),
        owned(&[("policy", "llm"), ("verdict", "refused"), ("limit", "tpm")])
    );
}

/// Carries out a tick's actions as the shells do, checking each stream's
/// fields come before what lets it go or answers it; the streams resumed
/// and answered.
fn tick(host: &FakeHost, w: &mut Worker) -> (Vec<u32>, Vec<u32>) {
    let (mut resumed, mut answered) = (Vec::new(), Vec::new());
    for action in w.on_tick(host) {
        match action {
            StreamAction::LogField(id, field, value) => {
                assert!(
                    !resumed.contains(&id) && !answered.contains(&id),
                    "{id}'s {field} set after it went"
                );
                host.set_log_field(id, field, &value);
            }
            StreamAction::Resume(id) => resumed.push(id),
            StreamAction::Reply(id, _) => answered.push(id),
            StreamAction::SetHeader(..) => {}
        }
    }
    (resumed, answered)
}

#[test]
fn a_queued_call_says_how_long_it_waited_whether_it_went_or_timed_out() {
    let host = FakeHost::at(T0);
    let mut w = logging(&host);
    let maps = req(b"api.maps.example", &[]);
    let verdicts: Vec<u32> = (1..=3)
        .map(|id| status(&w.on_request(&host, id, maps.as_slice())))
        .collect();
    assert_eq!(verdicts, [200, 0, 0], "one at once, two queued");
    assert_eq!(host.log_field(2, "verdict").as_deref(), Some("queued"));
    let (mut resumed, mut answered) = (Vec::new(), Vec::new());
    for at in 1..=100 {
        host.advance_ms(10);
        if at == 50 {
            w.on_stream_end(&host, 1);
        }
        let (r, a) = tick(&host, &mut w);
        resumed.extend(r);
        answered.extend(a);
    }
    // The first call ends 500 ms on: the second goes; the third's wait
    // runs out at 700 ms.
    assert_eq!((resumed, answered), (vec![2], vec![3]));
    let waited = |id| -> u64 {
        host.log_field(id, "wait_ms")
            .and_then(|ms| ms.parse().ok())
            .expect("a wait")
    };
    assert!((490..=510).contains(&waited(2)), "{}", waited(2));
    assert_eq!(host.log_field(2, "verdict").as_deref(), Some("queued"));
    assert!((700..=710).contains(&waited(3)), "{}", waited(3));
    assert_eq!(host.log_field(3, "verdict").as_deref(), Some("refused"));
    assert_eq!(host.log_field(3, "policy").as_deref(), Some("maps"));
}

#[test]
fn with_log_decisions_off_no_field_is_set() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, POLICIES);
    w.log_decisions(false);
    llm_call(&host, &mut w, 1, br#"{"max_tokens": 4900}"#);
    let maps = req(b"api.maps.example", &[]);
    for id in 2..=4 {
        w.on_request(&host, id, maps.as_slice());
    }
    for _ in 0..100 {
        host.advance_ms(10);
        tick(&host, &mut w);
    }
    assert_eq!(host.host_calls_of("set_log_field"), 0);
}
