//! The provider's `Retry-After` pauses a limit with `provider`: for every
//! worker sharing the host's shared data, for its key where keyed, never
//! longer than `max_pause`, and never from a value that does not parse.

use sluice_shared::provider::ProviderTable;

use crate::entries;
use crate::testing::FakeHost;
use crate::tests::{pass, req, status, worker, T0};
use crate::worker::{StreamAction, Verdict, Worker};

/// 100 calls a second that the provider may pause, at most 10 s.
const LISTENING: &str = r#"{"version": 1, "policies": [
    {"name": "api", "match": {"host": "api.example"},
     "rate": {"requests": 1000, "period": "1s"},
     "limits": [{"name": "provider-rate", "rate": {"requests": 100, "period": "1s"},
                 "provider": {"max_pause": "10s"}}]}]}"#;

const HOST: &[u8] = b"api.example";

fn call(host: &FakeHost, w: &mut Worker, id: u32) -> Verdict {
    w.on_request(host, id, req(HOST, &[]).as_slice())
}

/// The provider answers call `id` with `status` and `extra` headers.
fn answer(host: &FakeHost, w: &mut Worker, id: u32, status: &[u8], extra: &[(&str, &[u8])]) {
    assert!(w.awaits_answer(id), "the answer of call {id} is read");
    let mut headers: Vec<(&str, &[u8])> = vec![(":status", status)];
    headers.extend_from_slice(extra);
    w.on_answer_headers(host, id, headers.as_slice(), true);
    w.on_stream_end(host, id);
}

fn header<'a>(v: &'a Verdict, name: &str) -> Option<&'a str> {
    match v {
        Verdict::Reply(r) => r
            .headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str()),
        _ => None,
    }
}

/// Time passes for two workers, each ticking as in Envoy.
fn pass_both(host: &FakeHost, (a, b): (&mut Worker, &mut Worker), ms: u64) {
    for _ in 0..ms / 100 {
        pass(host, a, 100);
        b.on_tick(host);
    }
}

#[test]
fn one_workers_429_with_retry_after_pauses_every_worker_for_that_long() {
    let host = FakeHost::at(T0);
    let mut a = worker(&host, LISTENING);
    let mut b = worker(&host, LISTENING);
    assert_eq!(call(&host, &mut a, 1), Verdict::Continue);
    answer(&host, &mut a, 1, b"429", &[("retry-after", b"3")]);

    let refused = call(&host, &mut b, 2);
    assert_eq!(status(&refused), 429, "the other worker stops too");
    assert_eq!(header(&refused, "x-sluice-limit"), Some("provider-rate"));
    assert_eq!(header(&refused, "x-sluice-reason"), Some("provider-pause"));
    assert_eq!(header(&refused, "retry-after"), Some("3"));

    pass_both(&host, (&mut a, &mut b), 2_900);
    let later = call(&host, &mut b, 3);
    assert_eq!(header(&later, "retry-after"), Some("1"), "the time left");
    pass_both(&host, (&mut a, &mut b), 100);
    assert_eq!(call(&host, &mut b, 4), Verdict::Continue, "over after 3 s");
    assert_eq!(call(&host, &mut a, 5), Verdict::Continue);

    a.on_tick(&host);
    b.on_tick(&host);
    assert_eq!(
        host.metric("sluice.limit.provider-rate.provider_refused"),
        1
    );
    assert_eq!(host.metric("sluice.limit.provider-rate.paused"), 1);
    assert_eq!(host.metric("sluice.limit.provider-rate.refused"), 2);
    assert!(host.logs.borrow().iter().any(|l| l
        .contains("limit provider-rate paused for 3000 ms")
        && l.contains("answered 429")));
}

#[test]
fn a_pause_takes_nothing_from_the_limits() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, LISTENING);
    assert_eq!(call(&host, &mut w, 1), Verdict::Continue);
    answer(&host, &mut w, 1, b"503", &[("retry-after-ms", b"250")]);
    for id in 2..500 {
        assert_eq!(status(&call(&host, &mut w, id)), 429);
    }
    pass(&host, &mut w, 250);
    // The 100 a second are all there: the refused calls took none.
    let admitted = (1000..1200)
        .filter(|&id| call(&host, &mut w, id) == Verdict::Continue)
        .count();
    assert_eq!(admitted, 100);
}

#[test]
fn a_queued_call_waits_out_a_pause_within_max_wait_and_is_refused_past_it() {
    let queued = LISTENING.replace(
        r#""provider": {"max_pause": "10s"}}]"#,
        r#""provider": {"max_pause": "10s"}}],
         "on_limit": {"action": "queue", "max_wait": "2s"}"#,
    );
    // A pause longer than max_wait: refused at once, saying how long.
    let host = FakeHost::at(T0);
    let mut w = worker(&host, &queued);
    assert_eq!(call(&host, &mut w, 1), Verdict::Continue);
    answer(&host, &mut w, 1, b"429", &[("retry-after", b"3")]);
    let refused = call(&host, &mut w, 2);
    assert_eq!(header(&refused, "x-sluice-reason"), Some("provider-pause"));
    assert_eq!(header(&refused, "retry-after"), Some("3"));

    // Within max_wait: the call waits and goes when the pause ends.
    let host = FakeHost::at(T0);
    let mut w = worker(&host, &queued);
    assert_eq!(call(&host, &mut w, 1), Verdict::Continue);
    answer(&host, &mut w, 1, b"429", &[("retry-after", b"1")]);
    assert!(matches!(call(&host, &mut w, 2), Verdict::Pause { .. }));
    host.advance_ms(990);
    assert!(w.on_tick(&host).is_empty(), "still paused");
    host.advance_ms(20);
    assert_eq!(w.on_tick(&host), vec![StreamAction::Resume(2)]);
}

#[test]
fn a_keyed_limit_pauses_only_the_key_the_provider_refused() {
    let keyed = LISTENING.replace(
        r#""rate": {"requests": 100, "period": "1s"},"#,
        r#""rate": {"requests": 100, "period": "1s"}, "key": {"header": "x-api-key", "max_keys": 4},"#,
    );
    let host = FakeHost::at(T0);
    let mut w = worker(&host, &keyed);
    let with_key = |key: &'static [u8]| {
        req(HOST, &[])
            .into_iter()
            .chain([("x-api-key", key)])
            .collect::<Vec<_>>()
    };
    assert_eq!(
        w.on_request(&host, 1, with_key(b"alice").as_slice()),
        Verdict::Continue
    );
    answer(&host, &mut w, 1, b"429", &[("retry-after", b"5")]);
    assert_eq!(
        status(&w.on_request(&host, 2, with_key(b"alice").as_slice())),
        429
    );
    for (id, key) in [(3, &b"bob"[..]), (4, b"carol"), (5, b"dave"), (6, b"erin")] {
        assert_eq!(
            w.on_request(&host, id, with_key(key).as_slice()),
            Verdict::Continue,
            "another key goes on"
        );
    }
}

#[test]
fn bad_waits_are_counted_and_never_pause_past_the_cap() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, LISTENING);
    let mut id = 1;
    for bad in [&b"-3"[..], b"soon", b"1.5", b"\xff", &[b'7'; 200]] {
        assert_eq!(call(&host, &mut w, id), Verdict::Continue);
        answer(&host, &mut w, id, b"429", &[("retry-after", bad)]);
        id += 1;
        assert_eq!(call(&host, &mut w, id), Verdict::Continue, "{bad:?} paused");
        w.on_stream_end(&host, id);
        id += 1;
    }
    // Huge and far-future waits pause for max_pause (10 s), no longer and
    // no shorter (the end-to-end test's bounds leave a loaded machine
    // room; these are to the 10 ms).
    for huge in [
        &b"99999999999999999999999"[..],
        b"Fri, 31 Dec 9999 23:59:59 GMT",
    ] {
        assert_eq!(call(&host, &mut w, id), Verdict::Continue);
        answer(&host, &mut w, id, b"429", &[("retry-after", huge)]);
        id += 1;
        assert_eq!(status(&call(&host, &mut w, id)), 429);
        id += 1;
        pass(&host, &mut w, 9_990);
        assert_eq!(status(&call(&host, &mut w, id)), 429, "paused to the cap");
        id += 1;
        pass(&host, &mut w, 10);
        assert_eq!(
            call(&host, &mut w, id),
            Verdict::Continue,
            "the cap ends it"
        );
        id += 1;
    }
    // A 200 asking to wait, and a 429 that does not say: no pause.
    assert_eq!(call(&host, &mut w, id), Verdict::Continue);
    answer(&host, &mut w, id, b"200", &[("retry-after", b"30")]);
    assert_eq!(call(&host, &mut w, id + 1), Verdict::Continue);
    answer(&host, &mut w, id + 1, b"429", &[]);
    assert_eq!(call(&host, &mut w, id + 2), Verdict::Continue);
    w.on_tick(&host);
    assert_eq!(
        host.metric("sluice.limit.provider-rate.signal_malformed"),
        5
    );
    assert_eq!(host.metric("sluice.limit.provider-rate.pause_capped"), 2);
    assert_eq!(host.metric("sluice.limit.provider-rate.paused"), 2);
    assert_eq!(
        host.metric("sluice.limit.provider-rate.provider_refused"),
        8
    );
}

#[test]
fn a_broken_pause_entry_pauses_nothing_and_the_next_pause_replaces_it() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, LISTENING);
    for garbage in [&b""[..], b"\x01garbage", &[0xffu8; 97]] {
        host.shared
            .borrow_mut()
            .insert("sluice/p/provider-rate".into(), (garbage.to_vec(), 7));
        assert_eq!(call(&host, &mut w, 1), Verdict::Continue);
        w.on_stream_end(&host, 1);
    }
    assert_eq!(call(&host, &mut w, 2), Verdict::Continue);
    answer(&host, &mut w, 2, b"429", &[("retry-after", b"2")]);
    assert_eq!(status(&call(&host, &mut w, 3)), 429);
}

#[test]
fn a_call_that_ends_before_its_answer_is_forgotten() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, LISTENING);
    assert_eq!(call(&host, &mut w, 1), Verdict::Continue);
    assert!(w.awaits_answer(1));
    w.on_stream_end(&host, 1);
    assert!(!w.awaits_answer(1));
    // A late answer for it changes nothing.
    w.on_answer_headers(
        &host,
        1,
        [(":status", &b"429"[..]), ("retry-after", b"9")].as_slice(),
        true,
    );
    assert_eq!(call(&host, &mut w, 2), Verdict::Continue);
}

#[test]
fn limits_without_provider_read_no_answers() {
    let host = FakeHost::at(T0);
    let plain = LISTENING.replace(
        r#",
                 "provider": {"max_pause": "10s"}"#,
        "",
    );
    let mut w = worker(&host, &plain);
    assert_eq!(call(&host, &mut w, 1), Verdict::Continue);
    assert!(!w.awaits_answer(1));
}

/// The same 100 a second, following the provider's IETF `RateLimit`.
const FOLLOWING: &str = r#"{"version": 1, "policies": [
    {"name": "api", "match": {"host": "api.example"},
     "rate": {"requests": 1000, "period": "1s"},
     "limits": [{"name": "provider-rate", "rate": {"requests": 100, "period": "1s"},
                 "provider": {"headers": "ietf"}}]}]}"#;

fn ratelimit(value: &'static [u8]) -> [(&'static str, &'static [u8]); 1] {
    [("ratelimit", value)]
}

#[test]
fn the_providers_count_caps_what_goes_until_its_reset_less_what_went_since() {
    let host = FakeHost::at(T0);
    let mut a = worker(&host, FOLLOWING);
    let mut b = worker(&host, FOLLOWING);
    assert_eq!(call(&host, &mut a, 1), Verdict::Continue);
    for id in 2..=4 {
        assert_eq!(call(&host, &mut b, id), Verdict::Continue);
    }
    // Call 1's answer: 5 left until the reset in 1 s. Calls 2-4 went since.
    answer(
        &host,
        &mut a,
        1,
        b"200",
        &ratelimit(br#""provider-rate";r=5;t=1"#),
    );
    assert_eq!(call(&host, &mut b, 5), Verdict::Continue);
    assert_eq!(call(&host, &mut a, 6), Verdict::Continue);
    let refused = call(&host, &mut b, 7);
    assert_eq!(status(&refused), 429, "5 - 3 went: nothing left");
    assert_eq!(
        header(&refused, "x-sluice-reason"),
        Some("provider-remaining")
    );
    assert_eq!(header(&refused, "x-sluice-limit"), Some("provider-rate"));
    assert_eq!(header(&refused, "retry-after"), Some("1"));
    // Call 2's answer (it went before calls 3-6) says 4 left: 4 - 4 since.
    answer(
        &host,
        &mut b,
        2,
        b"200",
        &ratelimit(br#""provider-rate";r=4;t=1"#),
    );
    assert_eq!(status(&call(&host, &mut a, 8)), 429);
    pass_both(&host, (&mut a, &mut b), 1_000);
    assert_eq!(
        call(&host, &mut a, 9),
        Verdict::Continue,
        "the provider's window turned"
    );
    a.on_tick(&host);
    assert_eq!(host.metric("sluice.limit.provider-rate.count_read"), 2);
}

#[test]
fn a_count_never_raises_the_limit_above_its_own_rate() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, FOLLOWING);
    assert_eq!(call(&host, &mut w, 1), Verdict::Continue);
    // "1 000 left in the next second": the limit's own 100 a second hold.
    answer(
        &host,
        &mut w,
        1,
        b"200",
        &ratelimit(br#""provider-rate";r=1000;t=1"#),
    );
    let mut admitted = 0;
    for id in 2..1002u32 {
        host.advance_ms(1);
        if call(&host, &mut w, id) == Verdict::Continue {
            admitted += 1;
            w.on_stream_end(&host, id);
        }
    }
    // A full bucket of 100, then 100 a second: at most 199 in the second.
    assert!((100..=199).contains(&admitted), "{admitted} went");
}

#[test]
fn a_call_another_limit_refuses_gives_its_count_back() {
    let tight = FOLLOWING.replace(
        r#""rate": {"requests": 1000, "period": "1s"},"#,
        r#""rate": {"requests": 1, "period": "1s", "burst": 1},"#,
    );
    let host = FakeHost::at(T0);
    let mut w = worker(&host, &tight);
    assert_eq!(call(&host, &mut w, 1), Verdict::Continue);
    answer(
        &host,
        &mut w,
        1,
        b"200",
        &ratelimit(br#""provider-rate";r=2;t=10"#),
    );
    // The policy's own 1 a second refuses these: each gives its count back.
    pass(&host, &mut w, 1_000);
    assert_eq!(call(&host, &mut w, 2), Verdict::Continue);
    for id in 3..50 {
        assert_eq!(status(&call(&host, &mut w, id)), 429);
    }
    pass(&host, &mut w, 1_000);
    assert_eq!(
        call(&host, &mut w, 50),
        Verdict::Continue,
        "the second of the 2 left"
    );
    pass(&host, &mut w, 1_000);
    let refused = call(&host, &mut w, 51);
    assert_eq!(
        header(&refused, "x-sluice-reason"),
        Some("provider-remaining")
    );
}

#[test]
fn malformed_counts_are_ignored_and_counted() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, FOLLOWING);
    let mut id = 1;
    for bad in [
        &br#""provider-rate";r=-1"#[..],
        br#""provider-rate";t=1"#,
        br#""provider-rate";r=0.5"#,
        b"\xff\xfe",
        br#"("provider-rate");r=0"#,
    ] {
        assert_eq!(call(&host, &mut w, id), Verdict::Continue);
        answer(&host, &mut w, id, b"200", &[("ratelimit", bad)]);
        id += 1;
    }
    assert_eq!(call(&host, &mut w, id), Verdict::Continue, "nothing capped");
    w.on_tick(&host);
    assert_eq!(
        host.metric("sluice.limit.provider-rate.signal_malformed"),
        4
    );
    assert_eq!(host.metric("sluice.limit.provider-rate.count_read"), 0);
}

#[test]
fn a_count_of_zero_on_a_refusal_holds_calls_until_the_reset_and_a_queue_waits_for_it() {
    let queued = FOLLOWING.replace(
        r#""provider": {"headers": "ietf"}}]"#,
        r#""provider": {"headers": "openai-requests"}}],
         "on_limit": {"action": "queue", "max_wait": "2s"}"#,
    );
    let host = FakeHost::at(T0);
    let mut w = worker(&host, &queued);
    assert_eq!(call(&host, &mut w, 1), Verdict::Continue);
    answer(
        &host,
        &mut w,
        1,
        b"429",
        &[
            ("x-ratelimit-remaining-requests", b"0"),
            ("x-ratelimit-reset-requests", b"1.5s"),
        ],
    );
    assert!(matches!(call(&host, &mut w, 2), Verdict::Pause { .. }));
    host.advance_ms(100);
    assert!(w.on_tick(&host).is_empty());
    for _ in 0..13 {
        pass(&host, &mut w, 100);
    }
    assert!(w.on_tick(&host).is_empty(), "1.4 s: still nothing left");
    host.advance_ms(100);
    assert_eq!(w.on_tick(&host), vec![StreamAction::Resume(2)]);
}

const ADAPTIVE: &str = r#"{"version": 1, "policies": [
    {"name": "api", "match": {"host": "api.example"},
     "rate": {"requests": 1000, "period": "1s"},
     "limits": [{"name": "provider-rate", "rate": {"requests": 100, "period": "1s"},
                 "provider": {"adaptive": true}}]}]}"#;

#[test]
fn an_adaptive_limit_cuts_its_rate_once_per_overload_for_every_worker() {
    let host = FakeHost::at(T0);
    let mut a = worker(&host, ADAPTIVE);
    let mut b = worker(&host, ADAPTIVE);
    // A second at 100 a second, every answer fine.
    for id in 1..=100u32 {
        assert_eq!(call(&host, &mut a, id), Verdict::Continue);
        answer(&host, &mut a, id, b"200", &[]);
        pass(&host, &mut a, 10);
        b.on_tick(&host);
    }
    // Two calls go, then both are refused: one cut, not two.
    assert_eq!(call(&host, &mut a, 200), Verdict::Continue);
    assert_eq!(call(&host, &mut a, 201), Verdict::Continue);
    answer(&host, &mut a, 200, b"429", &[]);
    answer(&host, &mut a, 201, b"429", &[]);
    // The other worker now sends at about 70 a second.
    let mut went = 0;
    for id in 300..1300u32 {
        host.advance_ms(1);
        if id % 100 == 0 {
            a.on_tick(&host);
            b.on_tick(&host);
        }
        if call(&host, &mut b, id) == Verdict::Continue {
            went += 1;
            w_end(&host, &mut b, id);
        }
    }
    a.on_tick(&host);
    b.on_tick(&host);
    assert!(
        (70..=85).contains(&went),
        "{went} went in the second after the cut"
    );
    assert_eq!(host.metric("sluice.limit.provider-rate.rate_cut"), 1);
    assert!(host.logs.borrow().iter().any(|l| l.contains("rate cut to")));
}

fn w_end(host: &FakeHost, w: &mut Worker, id: u32) {
    w.on_stream_end(host, id);
}

/// Sends a call of `w`'s every 10 ms for a second from `host`'s now (the
/// adapted pace holds some back); the ids of those that went.
fn a_second_of_calls(host: &FakeHost, w: &mut Worker, next_id: &mut u32) -> Vec<u32> {
    let mut went = Vec::new();
    for _ in 0..100 {
        *next_id += 1;
        if call(host, w, *next_id) == Verdict::Continue {
            went.push(*next_id);
        }
        host.advance_ms(10);
    }
    went
}

/// Answers come back out of order: a refusal heard after the cut, of a
/// call that went earlier in its clock-aligned window, says the provider
/// allowed fewer than the cut's refusal did. It cuts nothing more, but
/// the limit known from the window's count follows it, for every worker:
/// before, that narrowing was never written back to shared data (the
/// simulator's adaptive runs at 100-200 ms answers refused 0.78 % of
/// their calls on average; 0.60 % with it kept).
#[test]
fn a_later_refusal_of_the_same_overload_narrows_a_known_limit_for_every_worker() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, ADAPTIVE);
    let mut id = 0;
    // Second 0: the 13th call is refused (12 went before it), heard late.
    let first = a_second_of_calls(&host, &mut w, &mut id);
    answer(&host, &mut w, first[12], b"429", &[]);
    // Second 1 quiet; in second 2 again the call after 12 is refused: the
    // provider's window is the clock's and holds 12.
    pass(&host, &mut w, 1_000);
    let third = a_second_of_calls(&host, &mut w, &mut id);
    answer(&host, &mut w, third[12], b"429", &[]);
    let known = |host: &FakeHost| {
        let table: ProviderTable = entries::read_as(host, "sluice/p/provider-rate");
        let row = table.row(0).map(|r| r.adaptive).unwrap_or_default();
        (row.w_max, row.hits)
    };
    assert_eq!(known(&host), (12.0, 1), "the limit is known as 12 a second");
    // The 11th call of second 2 (10 before it) was refused too.
    answer(&host, &mut w, third[10], b"429", &[]);
    assert_eq!(known(&host), (10.0, 1), "the known limit follows it");
    w.on_tick(&host);
    assert_eq!(host.metric("sluice.limit.provider-rate.rate_cut"), 2);
}
