//! Queue mode across several limits, through the worker against the
//! in-memory host: a call the further limits cannot take yet waits in its
//! policy's queue, FIFO, and takes every limit only when it leaves.

use crate::testing::FakeHost;
use crate::tests::{req, status, worker, T0};
use crate::worker::{LocalReply, StreamAction, Verdict, Worker};

const MAPS: &[u8] = b"api.maps.example";

fn policy(rate: &str, limits: &str, max_wait: &str) -> String {
    format!(
        r#"{{"version": 1, "policies": [
        {{"name": "maps", "match": {{"host": "api.maps.example"}}, "rate": {rate},
         "on_limit": {{"action": "queue", "max_wait": "{max_wait}", "max_queue": 100}},
         "limits": {limits}}}]}}"#
    )
}

/// (ms into a run, stream), in the order they happened.
type Events = Vec<(u64, u32)>;

/// Ticks every millisecond for `ms`; returns the streams resumed, and
/// those refused.
fn run(host: &FakeHost, w: &mut Worker, ms: u64) -> (Events, Events) {
    let (mut resumed, mut refused) = (Vec::new(), Vec::new());
    for at in 1..=ms {
        host.advance_ms(1);
        for action in w.on_tick(host) {
            match action {
                StreamAction::Resume(ctx) => resumed.push((at, ctx)),
                StreamAction::Reply(ctx, _) => refused.push((at, ctx)),
                StreamAction::SetHeader(..) | StreamAction::LogField(..) => {}
            }
        }
    }
    (resumed, refused)
}

fn arrive(host: &FakeHost, w: &mut Worker, ids: std::ops::Range<u32>) -> Vec<u32> {
    let r = req(MAPS, &[]);
    ids.map(|id| status(&w.on_request(host, id, r.as_slice())))
        .collect()
}

#[test]
fn calls_a_further_limit_holds_up_wait_in_order_and_leave_as_it_refills() {
    let host = FakeHost::at(T0);
    let mut w = worker(
        &host,
        &policy(
            r#"{"requests": 1000, "period": "1s"}"#,
            r#"[{"name": "per-second", "rate": {"requests": 2, "period": "1s", "algorithm": "fixed_window"}}]"#,
            "5s",
        ),
    );
    assert_eq!(arrive(&host, &mut w, 1..7), [200, 200, 0, 0, 0, 0]);
    let (resumed, refused) = run(&host, &mut w, 2500);
    assert!(refused.is_empty(), "{refused:?}");
    let order: Vec<u32> = resumed.iter().map(|(_, c)| *c).collect();
    assert_eq!(order, [3, 4, 5, 6], "first come, first served");
    // Each pair in the window it fits, within a tick of its start.
    let at: Vec<u64> = resumed.iter().map(|(t, _)| *t).collect();
    assert_eq!(at, [1000, 1000, 2000, 2000]);
    w.on_tick(&host);
    host.advance_ms(100);
    w.on_tick(&host);
    assert_eq!(host.metric("sluice.limit.per-second.queued"), 4);
    assert_eq!(host.metric("sluice.limit.per-second.admitted"), 6);
    assert_eq!(host.metric("sluice.limit.per-second.refused"), 0);
    assert_eq!(host.metric("sluice.policy.maps.queued"), 4);
}

#[test]
fn a_queued_call_leaves_only_when_the_bucket_and_every_limit_take_it_then() {
    let host = FakeHost::at(T0);
    // The policy's own rate: one a second. A further limit: one per 2 s.
    let mut w = worker(
        &host,
        &policy(
            r#"{"requests": 1, "period": "1s", "burst": 1}"#,
            r#"[{"name": "per-2s", "rate": {"requests": 1, "period": "2s", "algorithm": "fixed_window"}}]"#,
            "5s",
        ),
    );
    assert_eq!(arrive(&host, &mut w, 1..3), [200, 0]);
    // At 1 s the bucket would let it go; the further limit holds it to 2 s.
    let (first, _) = run(&host, &mut w, 1500);
    assert!(first.is_empty(), "{first:?}");
    // A call arriving meanwhile waits behind it.
    assert_eq!(arrive(&host, &mut w, 3..4), [0]);
    let (second, refused) = run(&host, &mut w, 3000);
    assert!(refused.is_empty());
    // Call 2 at 2 s (500 ms into this run); call 3's bucket turn is 3 s,
    // but the further limit's next window is 4 s.
    assert_eq!(second, [(500, 2), (2500, 3)]);
}

#[test]
fn a_wait_beyond_max_wait_is_refused_at_once_naming_the_limit() {
    let host = FakeHost::at(T0);
    let mut w = worker(
        &host,
        &policy(
            r#"{"requests": 1000, "period": "1s"}"#,
            r#"[{"name": "per-minute", "rate": {"requests": 2, "period": "1m", "algorithm": "fixed_window"}}]"#,
            "1s",
        ),
    );
    let r = req(MAPS, &[]);
    for id in 1..3 {
        assert_eq!(w.on_request(&host, id, r.as_slice()), Verdict::Continue);
    }
    let Verdict::Reply(refused) = w.on_request(&host, 3, r.as_slice()) else {
        panic!("a wait of a minute is not queued for a max_wait of 1 s");
    };
    assert_eq!(refused.status, 429);
    let header = |name: &str| {
        refused
            .headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.clone())
    };
    assert_eq!(header("x-sluice-limit").as_deref(), Some("per-minute"));
    let retry: u64 = header("retry-after")
        .and_then(|v| v.parse().ok())
        .expect("a Retry-After");
    assert!((1..=60).contains(&retry), "{retry}");
    host.advance_ms(100);
    w.on_tick(&host);
    assert_eq!(host.metric("sluice.limit.per-minute.refused"), 1);
    assert_eq!(host.metric("sluice.limit.per-minute.queued"), 0);
}

#[test]
fn queued_calls_the_limit_cannot_take_in_time_run_out_of_wait() {
    let host = FakeHost::at(T0);
    let mut w = worker(
        &host,
        &policy(
            r#"{"requests": 1000, "period": "1s"}"#,
            r#"[{"name": "per-second", "rate": {"requests": 2, "period": "1s", "algorithm": "fixed_window"}}]"#,
            "1500ms",
        ),
    );
    assert_eq!(arrive(&host, &mut w, 1..9), [200, 200, 0, 0, 0, 0, 0, 0]);
    let (resumed, refused) = run(&host, &mut w, 2000);
    assert_eq!(resumed, [(1000, 3), (1000, 4)]);
    let late: Vec<u32> = refused.iter().map(|(_, c)| *c).collect();
    assert_eq!(late.len(), 4, "{refused:?}");
    assert!(refused.iter().all(|(t, _)| (1500..=1502).contains(t)));
    assert_eq!(w.waiting(), 0);
}

/// A worker whose policy's further limit `units` holds 100 a second, a
/// call estimated at 60 and settled by its answer's `x-usage-units`: a
/// second call waits for the first's units to come back.
fn units_worker(host: &FakeHost) -> Worker {
    worker(
        host,
        &policy(
            r#"{"requests": 1000, "period": "1s"}"#,
            r#"[{"name": "units", "rate": {"requests": 100, "period": "1s", "algorithm": "fixed_window"},
                 "cost": {"header": "x-units", "default": 60, "max": 100},
                 "usage": {"header": "x-usage-units"}}]"#,
            "2s",
        ),
    )
}

#[test]
fn a_queued_call_settles_its_usage_once_it_left() {
    let host = FakeHost::at(T0);
    let mut w = units_worker(&host);
    let r = req(MAPS, &[]);
    assert_eq!(w.on_request(&host, 1, r.as_slice()), Verdict::Continue);
    assert!(w.awaits_answer(1));
    // 60 of 100 taken: the second call's 60 waits for the next second.
    assert!(matches!(
        w.on_request(&host, 2, r.as_slice()),
        Verdict::Pause { .. }
    ));
    assert!(!w.awaits_answer(2), "nothing taken while it waits");
    let (resumed, _) = run(&host, &mut w, 1000);
    assert_eq!(resumed, [(1000, 2)]);
    assert!(w.awaits_answer(2), "its response settles what it cost");
    let headers: Vec<(&str, &[u8])> = vec![(":status", b"200"), ("x-usage-units", b"10")];
    w.on_answer_headers(&host, 2, headers.as_slice(), true);
    w.on_stream_end(&host, 2);
    w.on_stream_end(&host, 1);
    host.advance_ms(100);
    w.on_tick(&host);
    // Call 1 never answered: the unread charge, the cost's max (100), not
    // its estimate (60); call 2: its usage, 10.
    assert_eq!(host.metric("sluice.limit.units.tokens"), 110);
    assert_eq!(host.metric("sluice.limit.units.usage_read"), 1);
}

/// A head its further limits refused asks them again when they said it
/// could go, at most 20 ms later, instead of at every tick. Each tick
/// reads shared data once (the policy set's version), each asking twice
/// more: asking at every tick read it 2 997 times in these 999 ticks,
/// holding the head 1 099.
#[test]
fn a_refused_head_asks_its_limits_again_when_they_said_not_at_every_tick() {
    let host = FakeHost::at(T0);
    let mut w = worker(
        &host,
        &policy(
            r#"{"requests": 1000, "period": "1s"}"#,
            r#"[{"name": "per-second", "rate": {"requests": 1, "period": "1s", "algorithm": "fixed_window"}}]"#,
            "5s",
        ),
    );
    assert_eq!(arrive(&host, &mut w, 1..3), [200, 0]);
    let before = host.host_calls_of("shared_get");
    let (resumed, refused) = run(&host, &mut w, 999);
    let reads = host.host_calls_of("shared_get") - before;
    assert!(resumed.is_empty() && refused.is_empty());
    assert!(reads < 1500, "{reads} reads of shared data in 999 ticks");
    // It leaves on the tick its window starts, not up to 20 ms after.
    let (resumed, _) = run(&host, &mut w, 5);
    assert_eq!(resumed, [(1, 2)]);
}

/// Room the limit did not foresee (a call's answer saying it used less
/// than it took) reaches the waiting head within 20 ms.
#[test]
fn a_refused_head_takes_room_given_back_within_twenty_milliseconds() {
    let host = FakeHost::at(T0);
    let mut w = units_worker(&host);
    let r = req(MAPS, &[]);
    assert_eq!(w.on_request(&host, 1, r.as_slice()), Verdict::Continue);
    assert!(matches!(
        w.on_request(&host, 2, r.as_slice()),
        Verdict::Pause { .. }
    ));
    let (resumed, _) = run(&host, &mut w, 300);
    assert!(resumed.is_empty(), "{resumed:?}");
    // Call 1 used 10 of its 60: 90 free, the head's 60 fit now.
    let headers: Vec<(&str, &[u8])> = vec![(":status", b"200"), ("x-usage-units", b"10")];
    w.on_answer_headers(&host, 1, headers.as_slice(), true);
    w.on_stream_end(&host, 1);
    let (resumed, _) = run(&host, &mut w, 100);
    let [(at, 2)] = resumed.as_slice() else {
        panic!("call 2 did not leave once room was given back: {resumed:?}");
    };
    assert!(*at <= 20, "left {at} ms after the room came");
}

/// A budget's wall in queue mode: a call its day's budget refuses waits
/// for the renewal when the day ends within `max_wait` (and goes then),
/// and is refused at once, saying when it renews, when it ends later.
#[test]
fn a_budget_refusal_queues_only_when_the_budget_renews_within_max_wait() {
    const DAY_MS: u64 = 86_400_000;
    let host = FakeHost::at(T0);
    let mut w = worker(
        &host,
        &policy(
            r#"{"requests": 1000, "period": "1s"}"#,
            r#"[{"name": "daily", "rate": {"requests": 2, "period": "1d", "algorithm": "fixed_window"}}]"#,
            "5m",
        ),
    );
    // Six minutes before the day ends.
    let into_day = T0.as_millis() % DAY_MS;
    host.advance_ms(DAY_MS - into_day - 360_000);
    assert_eq!(arrive(&host, &mut w, 1..3), [200, 200]);
    let r = req(MAPS, &[]);
    let Verdict::Reply(refused) = w.on_request(&host, 3, r.as_slice()) else {
        panic!("six minutes to the renewal is beyond a max_wait of 5 m");
    };
    assert_eq!(refused.header("x-sluice-limit"), Some("daily"));
    assert!(refused.header("x-sluice-renews-at").is_some());
    // Four minutes before: queued, and goes as the day renews.
    host.advance_ms(120_000);
    assert_eq!(arrive(&host, &mut w, 4..5), [0]);
    let mut resumed_at = None;
    for step in 1..=2_500u64 {
        host.advance_ms(100);
        for action in w.on_tick(&host) {
            match action {
                StreamAction::Resume(4) => resumed_at = Some(step * 100),
                other => panic!("{other:?}"),
            }
        }
        if resumed_at.is_some() {
            break;
        }
    }
    let at = resumed_at.expect("the queued call went");
    assert!(
        (240_000..=240_100).contains(&at),
        "went {at} ms after queuing"
    );
}

/// Ticks every millisecond for `ms`; returns the replies of the streams
/// refused, by stream.
fn refusals(host: &FakeHost, w: &mut Worker, ms: u64) -> Vec<(u32, LocalReply)> {
    let mut refused = Vec::new();
    for _ in 0..ms {
        host.advance_ms(1);
        for action in w.on_tick(host) {
            match action {
                StreamAction::Reply(ctx, reply) => refused.push((ctx, reply)),
                other => panic!("only refusals expected: {other:?}"),
            }
        }
    }
    refused
}

#[test]
fn a_wait_that_runs_out_behind_a_further_limit_is_refused_in_its_name() {
    let host = FakeHost::at(T0);
    let mut w = worker(
        &host,
        &policy(
            r#"{"requests": 1000, "period": "1s"}"#,
            r#"[{"name": "in-flight", "concurrency": {"max_in_flight": 1}}]"#,
            "1500ms",
        ),
    );
    // The first holds the only slot all along; the next two wait for it.
    assert_eq!(arrive(&host, &mut w, 1..4), [200, 0, 0]);
    let refused = refusals(&host, &mut w, 2000);
    let ids: Vec<u32> = refused.iter().map(|(id, _)| *id).collect();
    assert_eq!(ids, [2, 3], "both waits ran out");
    for (id, reply) in &refused {
        assert_eq!(reply.status, 429);
        assert_eq!(reply.header("x-sluice-limit"), Some("in-flight"), "{id}");
        assert_eq!(reply.header("x-sluice-policy"), Some("maps"));
        assert!(reply.header("retry-after").is_some());
        let body = String::from_utf8_lossy(&reply.body);
        assert!(body.contains("(limit in-flight)"), "{body}");
    }
    assert_eq!(host.metric("sluice.policy.maps.queue_timeouts"), 2);
}

#[test]
fn a_wait_that_runs_out_on_the_policys_own_limit_names_no_further_limit() {
    let host = FakeHost::at(T0);
    let mut w = worker(
        &host,
        r#"{"version": 1, "policies": [
        {"name": "maps", "match": {"host": "api.maps.example"},
         "concurrency": {"max_in_flight": 1, "lease_ttl": "10s"},
         "on_limit": {"action": "queue", "max_wait": "1s", "max_queue": 100}}]}"#,
    );
    assert_eq!(arrive(&host, &mut w, 1..3), [200, 0]);
    let refused = refusals(&host, &mut w, 1500);
    let [(2, reply)] = refused.as_slice() else {
        panic!("{refused:?}");
    };
    assert_eq!(reply.header("x-sluice-limit"), None);
    assert_eq!(reply.header("x-sluice-policy"), Some("maps"));
}

#[test]
fn a_budget_that_holds_a_queue_past_its_deadline_says_where_it_stands() {
    let host = FakeHost::at(T0);
    // A budget of 2 an hour beside a slot: the call queued for the slot
    // finds the budget spent when the slot frees, and waits out its turn.
    let mut w = worker(
        &host,
        &policy(
            r#"{"requests": 1000, "period": "1s"}"#,
            r#"[{"name": "hourly", "rate": {"requests": 2, "period": "1h", "algorithm": "fixed_window"}},
                {"name": "in-flight", "concurrency": {"max_in_flight": 1}}]"#,
            "2s",
        ),
    );
    assert_eq!(arrive(&host, &mut w, 1..2), [200]);
    // Queued behind the slot: the hour's second call fits the budget.
    assert_eq!(arrive(&host, &mut w, 2..4), [0, 0]);
    host.advance_ms(500);
    w.on_stream_end(&host, 1);
    let mut resumed = Vec::new();
    let mut refused = Vec::new();
    for _ in 0..2500 {
        host.advance_ms(1);
        for action in w.on_tick(&host) {
            match action {
                StreamAction::Resume(id) => {
                    resumed.push(id);
                    w.on_stream_end(&host, id);
                }
                StreamAction::Reply(id, reply) => refused.push((id, reply)),
                StreamAction::SetHeader(..) | StreamAction::LogField(..) => {}
            }
        }
    }
    assert_eq!(resumed, [2], "the budget's second call");
    let [(3, reply)] = refused.as_slice() else {
        panic!("{refused:?}");
    };
    assert_eq!(reply.header("x-sluice-limit"), Some("hourly"));
    assert_eq!(reply.header("x-sluice-spent"), Some("2"));
    assert_eq!(reply.header("x-sluice-budget"), Some("2"));
    assert!(reply.header("x-sluice-renews-in").is_some());
}
