//! Each attempt of a pool call heard from its member (plugin `role:
//! attempts`, a second worker as Envoy's upstream filter of the member
//! clusters): a member's refusal and its wait reach its limits even when
//! Envoy retried the call on the other member, and the deciding worker,
//! which sees the call's answer marked, does not hear them again. A mark a
//! provider forges changes nothing.

use crate::testing::FakeHost;
use crate::tests::pool::routed;
use crate::tests::{pass, req, worker, T0};
use crate::worker::{Attempt, AttemptMark, Verdict, Worker};

/// Two deployments, each 10 a second, each pausing on its provider's
/// 429 for as long as it says, up to a minute.
const POOL: &str = r#"{"version": 1, "policies": [
    {"name": "llm", "match": {"host": "llm.example"},
     "rate": {"requests": 1000, "period": "1s"},
     "pool": {"members": [
       {"name": "east", "cluster": "llm-east",
        "limits": [{"name": "east-rps", "rate": {"requests": 10, "period": "1s"},
                    "provider": {"max_pause": "60s"}}]},
       {"name": "west", "cluster": "llm-west",
        "limits": [{"name": "west-rps", "rate": {"requests": 10, "period": "1s"},
                    "provider": {"max_pause": "60s"}}]}]}},
    {"name": "bank", "match": {"host": "bank.example"},
     "rate": {"requests": 100, "period": "1s"}}]}"#;

const HOST: &[u8] = b"llm.example";

/// The deciding worker and the attempts worker of one Envoy.
fn workers(host: &FakeHost) -> (Worker, Worker) {
    (worker(host, POOL), worker(host, POOL))
}

/// An attempt of call `id` (routed by the deciding worker) goes.
fn attempt_of(host: &FakeHost, attempts: &mut Worker, id: u32) -> Attempt {
    let cluster = routed(host, id).expect("the call was routed");
    let extra = [("x-sluice-member", cluster.as_bytes())];
    let request = req(HOST, &extra);
    attempts
        .on_attempt(host, request.as_slice())
        .expect("an attempt of a pool call")
}

/// The deciding worker's call `id` answered with `headers`; the fields its
/// answer loses.
fn answer(
    host: &FakeHost,
    w: &mut Worker,
    id: u32,
    headers: &[(&str, &[u8])],
) -> Vec<&'static str> {
    let unset = w.on_answer_headers(host, id, headers, true).unset;
    w.on_stream_end(host, id);
    unset
}

/// Calls until one is routed to `cluster`; its id.
fn call_to(host: &FakeHost, w: &mut Worker, cluster: &str, from: u32) -> u32 {
    (from..from + 50)
        .find(|&id| {
            let sent = w.on_request(host, id, req(HOST, &[]).as_slice()) == Verdict::Continue;
            let there = sent && routed(host, id).as_deref() == Some(cluster);
            if sent && !there {
                answer(host, w, id, &[(":status", b"200")]);
            }
            there
        })
        .expect("a call routed there")
}

/// Whether a call now goes to east (the others answered at once).
fn east_takes_a_call(host: &FakeHost, w: &mut Worker, from: u32) -> bool {
    (from..from + 20).any(|id| {
        let sent = w.on_request(host, id, req(HOST, &[]).as_slice()) == Verdict::Continue;
        let east = sent && routed(host, id).as_deref() == Some("llm-east");
        if sent {
            answer(host, w, id, &[(":status", b"200")]);
        }
        east
    })
}

/// East refuses a call with `Retry-After: 30` and Envoy retries it on
/// west: east takes no call for 30 s (without the attempts heard, the
/// deciding worker paused it a second and probed it again and again), and
/// its refusal is counted once.
#[test]
fn a_refusal_envoy_retried_elsewhere_pauses_its_member_as_long_as_it_said() {
    let host = FakeHost::at(T0);
    let (mut w, mut attempts) = workers(&host);
    let id = call_to(&host, &mut w, "llm-east", 1);
    let first = attempt_of(&host, &mut attempts, id);
    let mark = attempts
        .on_attempt_answer(
            &host,
            &first,
            &[
                (":status", b"429".as_slice()),
                ("retry-after", b"30"),
                ("x-sluice-attempt-member", b"east"),
            ][..],
        )
        .expect("the attempt named its member");
    let retry = attempt_of(&host, &mut attempts, id);
    let again = attempts.on_attempt_answer(
        &host,
        &retry,
        &[
            (":status", b"200".as_slice()),
            ("x-sluice-attempt-member", b"west"),
        ][..],
    );
    assert_eq!(again.as_ref(), Some(&mark), "one mark per Envoy");
    let unset = answer(
        &host,
        &mut w,
        id,
        &[
            (":status", b"200"),
            ("x-sluice-member-answered", b"west"),
            (AttemptMark::HEADER, mark.value().as_bytes()),
        ],
    );
    assert_eq!(unset, [AttemptMark::HEADER], "the mark is Sluice's alone");
    for second in 1..30u32 {
        pass(&host, &mut w, 1_000);
        attempts.on_tick(&host);
        assert!(
            !east_takes_a_call(&host, &mut w, 1_000 * second),
            "east took a call {second} s after its Retry-After: 30"
        );
    }
    pass(&host, &mut w, 1_100);
    assert!(
        east_takes_a_call(&host, &mut w, 90_000),
        "east is back after 30 s"
    );
    w.on_tick(&host);
    attempts.on_tick(&host);
    assert_eq!(host.metric("sluice.limit.east-rps.provider_refused"), 1);
}

/// The call's own answer is the attempt the attempts worker heard (east
/// refused it and Envoy did not retry): the deciding worker counts the
/// refusal no second time, and the pause is the attempt's.
#[test]
fn an_answer_whose_attempt_was_heard_is_not_heard_again() {
    let host = FakeHost::at(T0);
    let (mut w, mut attempts) = workers(&host);
    let id = call_to(&host, &mut w, "llm-east", 1);
    let refused: [(&str, &[u8]); 3] = [
        (":status", b"429"),
        ("retry-after", b"5"),
        ("x-sluice-attempt-member", b"east"),
    ];
    let attempt = attempt_of(&host, &mut attempts, id);
    let mark = attempts
        .on_attempt_answer(&host, &attempt, &refused[..])
        .expect("marked");
    answer(
        &host,
        &mut w,
        id,
        &[
            (":status", b"429"),
            ("retry-after", b"5"),
            (AttemptMark::HEADER, mark.value().as_bytes()),
        ],
    );
    w.on_tick(&host);
    attempts.on_tick(&host);
    assert_eq!(host.metric("sluice.limit.east-rps.provider_refused"), 1);
    pass(&host, &mut w, 4_000);
    assert!(!east_takes_a_call(&host, &mut w, 100), "paused 5 s");
    pass(&host, &mut w, 1_100);
    assert!(east_takes_a_call(&host, &mut w, 200), "back after 5 s");
}

/// A provider sends a mark of its own with a refusal: the deciding
/// worker hears the refusal as it would without one, and removes it.
#[test]
fn a_forged_mark_is_removed_and_hides_no_refusal() {
    let host = FakeHost::at(T0);
    let (mut w, _) = workers(&host);
    let id = call_to(&host, &mut w, "llm-east", 1);
    let unset = answer(
        &host,
        &mut w,
        id,
        &[
            (":status", b"429"),
            ("retry-after", b"20"),
            (AttemptMark::HEADER, b"0123456789abcdef"),
        ],
    );
    assert_eq!(unset, [AttemptMark::HEADER]);
    w.on_tick(&host);
    assert_eq!(host.metric("sluice.limit.east-rps.provider_refused"), 1);
    pass(&host, &mut w, 10_000);
    assert!(!east_takes_a_call(&host, &mut w, 100), "paused 20 s");
}

/// An attempt whose answer names no member (no upstream filter sets it)
/// is not marked, and the deciding worker hears the call as before; the
/// attempts worker says so once. A call of no pool is no attempt.
#[test]
fn an_attempt_naming_no_member_is_left_to_the_deciding_filter() {
    let host = FakeHost::at(T0);
    let (mut w, mut attempts) = workers(&host);
    let id = call_to(&host, &mut w, "llm-east", 1);
    for unnamed in [
        &[][..],
        &[("x-sluice-attempt-member", b"north".as_slice())][..],
    ] {
        let attempt = attempt_of(&host, &mut attempts, id);
        let mut headers = vec![(":status", b"429".as_slice()), ("retry-after", b"30")];
        headers.extend_from_slice(unnamed);
        assert_eq!(
            attempts.on_attempt_answer(&host, &attempt, headers.as_slice()),
            None
        );
    }
    let warned = host
        .logs
        .borrow()
        .iter()
        .filter(|l| l.contains("names no member of its pool"))
        .count();
    assert_eq!(warned, 1, "said once");
    attempts.on_tick(&host);
    assert_eq!(host.metric("sluice.limit.east-rps.provider_refused"), 0);
    let to_east = [("x-sluice-member", b"llm-east".as_slice())];
    let bank = req(b"bank.example", &to_east);
    assert!(
        attempts.on_attempt(&host, bank.as_slice()).is_some(),
        "routed by its header"
    );
    let to_bank = [("x-sluice-member", b"bank".as_slice())];
    let stray = req(b"bank.example", &to_bank);
    assert!(attempts.on_attempt(&host, stray.as_slice()).is_none());
    assert!(attempts
        .on_attempt(&host, req(HOST, &[]).as_slice())
        .is_none());
}
