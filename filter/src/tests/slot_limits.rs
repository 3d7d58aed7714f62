//! Further limits that are concurrency limits (Stripe's account-wide calls
//! in flight over per-endpoint policies, GitHub's 100 concurrent), through
//! workers against the in-memory host.

use crate::testing::FakeHost;
use crate::tests::{pass, req, status, worker, T0};
use crate::worker::{StreamAction, Verdict, Worker};

const PAY: &[u8] = b"api.pay.example";

/// Two endpoint policies with a rate each, and one account-wide limit of
/// `in_flight` calls (and a per-minute window of `per_minute`) they share.
fn account(in_flight: u32, per_minute: u64, on_limit: &str) -> String {
    let limits = format!(
        r#"[{{"name": "account-minute", "rate": {{"requests": {per_minute}, "period": "1m", "algorithm": "fixed_window"}}}},
            {{"name": "account-in-flight", "concurrency": {{"max_in_flight": {in_flight}, "lease_ttl": "2s"}}}}]"#
    );
    format!(
        r#"{{"version": 1, "policies": [
        {{"name": "charges", "match": {{"host": "api.pay.example", "path_prefix": "/v1/charges"}},
         "rate": {{"requests": 1000, "period": "1s"}}, "on_limit": {on_limit}, "limits": {limits}}},
        {{"name": "refunds", "match": {{"host": "api.pay.example", "path_prefix": "/v1/refunds"}},
         "rate": {{"requests": 1000, "period": "1s"}}, "on_limit": {on_limit}, "limits": {limits}}}]}}"#
    )
}

const REJECT: &str = r#"{"action": "reject"}"#;

fn call(host: &FakeHost, w: &mut Worker, id: u32, path: &str) -> Verdict {
    let mut r = req(PAY, &[]);
    r[1] = (":path", path.as_bytes());
    w.on_request(host, id, r.as_slice())
}

/// 200, or the limit that refused the call.
fn answer(v: &Verdict) -> Result<(), String> {
    match v {
        Verdict::Continue => Ok(()),
        Verdict::Reply(reply) => Err(reply
            .headers
            .iter()
            .find(|(n, _)| *n == "x-sluice-limit")
            .map_or_else(|| format!("{}", reply.status), |(_, v)| v.clone())),
        other => Err(format!("{other:?}")),
    }
}

#[test]
fn calls_in_flight_are_limited_across_the_policies_naming_the_limit() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, &account(3, 1000, REJECT));
    assert_eq!(answer(&call(&host, &mut w, 1, "/v1/charges")), Ok(()));
    assert_eq!(answer(&call(&host, &mut w, 2, "/v1/refunds")), Ok(()));
    assert_eq!(answer(&call(&host, &mut w, 3, "/v1/charges")), Ok(()));
    let refused = call(&host, &mut w, 4, "/v1/refunds");
    assert_eq!(answer(&refused), Err("account-in-flight".into()));
    let Verdict::Reply(reply) = refused else {
        unreachable!()
    };
    assert_eq!(reply.status, 429);
    let header = |name: &str| reply.header(name).map(str::to_string);
    assert_eq!(header("retry-after").as_deref(), Some("1"));
    assert!(
        header("ratelimit-policy")
            .is_some_and(|p| p.contains("\"account-in-flight\";q=3;qu=\"concurrent-requests\"")),
        "{:?}",
        header("ratelimit-policy")
    );
    // One ends, on either policy: its slot serves the next call.
    w.on_stream_end(&host, 2);
    assert_eq!(answer(&call(&host, &mut w, 5, "/v1/charges")), Ok(()));
    assert_eq!(
        answer(&call(&host, &mut w, 6, "/v1/charges")),
        Err("account-in-flight".into())
    );
    // Ended twice, a stream gives back one slot.
    w.on_stream_end(&host, 1);
    w.on_stream_end(&host, 1);
    assert_eq!(answer(&call(&host, &mut w, 7, "/v1/refunds")), Ok(()));
    assert_eq!(
        answer(&call(&host, &mut w, 8, "/v1/refunds")),
        Err("account-in-flight".into())
    );
    pass(&host, &mut w, 200);
    assert_eq!(host.metric("sluice.limit.account-in-flight.admitted"), 5);
    assert_eq!(host.metric("sluice.limit.account-in-flight.refused"), 3);
    for id in [3, 5, 7] {
        w.on_stream_end(&host, id);
    }
    assert_eq!(w.in_flight(), 0);
}

#[test]
fn a_call_refused_for_a_slot_takes_nothing_from_the_rate_limits() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, &account(1, 5, REJECT));
    assert_eq!(answer(&call(&host, &mut w, 1, "/v1/charges")), Ok(()));
    for id in 2..50 {
        assert_eq!(
            answer(&call(&host, &mut w, id, "/v1/refunds")),
            Err("account-in-flight".into())
        );
    }
    w.on_stream_end(&host, 1);
    // The minute's 5: 1 went, 4 are left whatever the 48 refusals did.
    for id in 50..54 {
        assert_eq!(answer(&call(&host, &mut w, id, "/v1/charges")), Ok(()));
        w.on_stream_end(&host, id);
    }
    assert_eq!(
        answer(&call(&host, &mut w, 54, "/v1/charges")),
        Err("account-minute".into())
    );
    // And a call the rate refuses takes no slot: the next one after a
    // minute finds its slot free.
    pass(&host, &mut w, 60_000);
    assert_eq!(answer(&call(&host, &mut w, 55, "/v1/charges")), Ok(()));
}

#[test]
fn two_workers_share_the_slots_and_a_dead_workers_come_back_after_its_lease() {
    let host = FakeHost::at(T0);
    let set = account(2, 1000, REJECT);
    let mut a = worker(&host, &set);
    let mut b = worker(&host, &set);
    assert_eq!(answer(&call(&host, &mut a, 1, "/v1/charges")), Ok(()));
    assert_eq!(answer(&call(&host, &mut b, 1, "/v1/refunds")), Ok(()));
    assert_eq!(
        answer(&call(&host, &mut a, 2, "/v1/charges")),
        Err("account-in-flight".into())
    );
    // b's VM dies holding its slot: no release, no renewal. a lives on.
    drop(b);
    a.on_stream_end(&host, 1);
    pass(&host, &mut a, 1_500);
    assert_eq!(answer(&call(&host, &mut a, 3, "/v1/charges")), Ok(()));
    assert_eq!(
        answer(&call(&host, &mut a, 4, "/v1/charges")),
        Err("account-in-flight".into())
    );
    // Past b's 2 s lease its slot is free; a's call 3, renewed by a's
    // ticks, still holds its own.
    pass(&host, &mut a, 1_000);
    assert_eq!(answer(&call(&host, &mut a, 5, "/v1/charges")), Ok(()));
    assert_eq!(
        answer(&call(&host, &mut a, 6, "/v1/charges")),
        Err("account-in-flight".into())
    );
}

#[test]
fn a_call_holding_its_slot_past_the_lease_gives_it_back() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, &account(1, 1000, REJECT));
    assert_eq!(answer(&call(&host, &mut w, 1, "/v1/charges")), Ok(()));
    pass(&host, &mut w, 1_900);
    assert_eq!(
        answer(&call(&host, &mut w, 2, "/v1/charges")),
        Err("account-in-flight".into())
    );
    // Past its 2 s lease TTL the never-ending call lets its slot go.
    pass(&host, &mut w, 300);
    assert_eq!(answer(&call(&host, &mut w, 3, "/v1/charges")), Ok(()));
    // Its late end frees nothing of the slot call 3 holds now.
    w.on_stream_end(&host, 1);
    assert_eq!(
        answer(&call(&host, &mut w, 4, "/v1/charges")),
        Err("account-in-flight".into())
    );
}

#[test]
fn queued_calls_wait_for_a_slot_in_order() {
    let host = FakeHost::at(T0);
    let queue = r#"{"action": "queue", "max_wait": "2s", "max_queue": 10}"#;
    let mut w = worker(&host, &account(1, 1000, queue));
    assert_eq!(status(&call(&host, &mut w, 1, "/v1/charges")), 200);
    assert_eq!(status(&call(&host, &mut w, 2, "/v1/charges")), 0);
    assert_eq!(status(&call(&host, &mut w, 3, "/v1/charges")), 0);
    let mut resumed = Vec::new();
    let tick = |w: &mut Worker, resumed: &mut Vec<u32>| {
        host.advance_ms(10);
        for action in w.on_tick(&host) {
            match action {
                StreamAction::Resume(ctx) => resumed.push(ctx),
                StreamAction::Reply(ctx, _) => panic!("{ctx} refused"),
                StreamAction::SetHeader(..) | StreamAction::LogField(..) => {}
            }
        }
    };
    for _ in 0..20 {
        tick(&mut w, &mut resumed);
    }
    assert!(resumed.is_empty(), "nobody left while the slot was held");
    w.on_stream_end(&host, 1);
    tick(&mut w, &mut resumed);
    assert_eq!(resumed, [2]);
    w.on_stream_end(&host, 2);
    tick(&mut w, &mut resumed);
    assert_eq!(resumed, [2, 3]);
    w.on_stream_end(&host, 3);
    tick(&mut w, &mut resumed);
    assert_eq!(w.in_flight(), 0);
    assert_eq!(w.waiting(), 0);
    assert_eq!(host.metric("sluice.limit.account-in-flight.queued"), 2);
}

#[test]
fn a_queued_call_whose_wait_runs_out_holds_no_slot() {
    let host = FakeHost::at(T0);
    let queue = r#"{"action": "queue", "max_wait": "1s", "max_queue": 10}"#;
    let mut w = worker(&host, &account(1, 1000, queue));
    assert_eq!(status(&call(&host, &mut w, 1, "/v1/charges")), 200);
    assert_eq!(status(&call(&host, &mut w, 2, "/v1/charges")), 0);
    pass(&host, &mut w, 1_200);
    assert_eq!(w.waiting(), 0, "refused at its deadline");
    w.on_stream_end(&host, 2);
    w.on_stream_end(&host, 1);
    assert_eq!(answer(&call(&host, &mut w, 3, "/v1/charges")), Ok(()));
}

#[test]
fn garbage_in_a_limits_entry_is_replaced_never_trusted() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, &account(2, 1000, REJECT));
    for garbage in [
        vec![],
        vec![0xff; 3],
        vec![0xff; 4],
        vec![1, 0, 0, 0, 9],
        vec![0xff; 4 + 28],
    ] {
        host.shared
            .borrow_mut()
            .insert("sluice/l/account-in-flight".into(), (garbage.clone(), 1));
        assert_eq!(
            answer(&call(&host, &mut w, 1, "/v1/charges")),
            Ok(()),
            "{garbage:?}"
        );
        w.on_stream_end(&host, 1);
    }
    assert_eq!(w.in_flight(), 0);
}

#[test]
fn shadow_mode_counts_a_full_limit_and_lets_the_call_go() {
    let host = FakeHost::at(T0);
    let set = account(1, 1000, REJECT).replace(
        r#""on_limit": {"action": "reject"}"#,
        r#""on_limit": {"action": "reject"}, "mode": "shadow""#,
    );
    let mut w = worker(&host, &set);
    assert_eq!(answer(&call(&host, &mut w, 1, "/v1/charges")), Ok(()));
    assert_eq!(answer(&call(&host, &mut w, 2, "/v1/charges")), Ok(()));
    pass(&host, &mut w, 200);
    assert_eq!(host.metric("sluice.limit.account-in-flight.refused"), 1);
    assert_eq!(host.metric("sluice.policy.charges.shadow_limited"), 1);
    w.on_stream_end(&host, 1);
    w.on_stream_end(&host, 2);
    assert_eq!(w.in_flight(), 0);
    // The slot call 1 held is free again.
    assert_eq!(answer(&call(&host, &mut w, 3, "/v1/refunds")), Ok(()));
    assert_eq!(host.metric("sluice.policy.charges.shadow_limited"), 1);
}

mod across_workers {
    use proptest::prelude::*;
    use sluice_filter_core::matcher::CompiledPolicySet;
    use sluice_shared::limiter::{LeaseTable, RateState};

    use super::*;
    use crate::host::Host;

    const SET: &str = r#"{"version": 1, "policies": [
        {"name": "charges", "match": {"host": "api.pay.example"}, "rate": {"requests": 1000, "period": "1s"},
         "limits": [{"name": "minute", "rate": {"requests": 40, "period": "1m", "algorithm": "fixed_window"}},
                    {"name": "slots", "concurrency": {"max_in_flight": 3, "lease_ttl": "30s"}},
                    {"name": "fewer-slots", "concurrency": {"max_in_flight": 2, "lease_ttl": "30s"}}]}]}"#;

    fn in_flight(host: &FakeHost, limit: &str) -> u32 {
        host.shared_get(&format!("sluice/l/{limit}"))
            .0
            .and_then(|b| LeaseTable::decode(&b).ok())
            .map_or(0, |t| t.in_flight())
    }

    fn minute_count(host: &FakeHost) -> u64 {
        let set = CompiledPolicySet::from_json(SET).unwrap_or_else(|e| panic!("{e}"));
        let minute = &set.policies[0].limits[0].rate;
        match host
            .shared_get("sluice/l/minute")
            .0
            .and_then(|b| minute.decode_state(&b).ok())
        {
            Some(RateState::FixedWindow(s)) => s.count,
            _ => 0,
        }
    }

    proptest! {
        /// Four workers' calls and ends in any order, with compare-and-swap
        /// conflicts: the slots held in each limit are exactly the calls
        /// open, never more than the smaller limit, and the minute counts
        /// exactly the calls that went (a call refused for a slot kept
        /// nothing of the minute, nor of the other limit's slots).
        #[test]
        fn slots_are_never_lost_or_double_counted(
            steps in prop::collection::vec((0usize..4, 0u8..4, 0u64..30, any::<bool>()), 1..150),
        ) {
            let host = FakeHost::at(T0);
            let mut workers: Vec<Worker> = (0..4).map(|_| worker(&host, SET)).collect();
            let mut open: Vec<Vec<u32>> = vec![Vec::new(); 4];
            let mut went = 0u64;
            for (ctx, (wi, action, ms, conflict)) in steps.into_iter().enumerate() {
                let ctx = ctx as u32;
                let w = &mut workers[wi];
                // Another worker writes just before this step's first
                // write: that compare-and-swap fails once and is retried.
                if conflict {
                    *host.before_next_set.borrow_mut() = Some(Box::new(|map, counter| {
                        for (_, cas) in map.values_mut() {
                            *cas = *counter;
                            *counter += 1;
                        }
                    }));
                }
                match action {
                    0 | 1 => match call(&host, w, ctx, "/v1/charges") {
                        Verdict::Continue => {
                            open[wi].push(ctx);
                            went += 1;
                        }
                        Verdict::Reply(r) => prop_assert_eq!(r.status, 429),
                        other => prop_assert!(false, "{:?}", other),
                    },
                    2 => {
                        if let Some(c) = open[wi].pop() {
                            w.on_stream_end(&host, c);
                        }
                    }
                    _ => {
                        host.advance_ms(ms);
                        for w in &mut workers {
                            let _ = w.on_tick(&host);
                        }
                    }
                }
                let holding: usize = open.iter().map(Vec::len).sum();
                prop_assert_eq!(in_flight(&host, "slots") as usize, holding);
                prop_assert_eq!(in_flight(&host, "fewer-slots") as usize, holding);
                prop_assert!(holding <= 2);
                prop_assert_eq!(minute_count(&host), went);
            }
            for (wi, ctxs) in open.into_iter().enumerate() {
                for c in ctxs {
                    workers[wi].on_stream_end(&host, c);
                }
            }
            prop_assert_eq!(in_flight(&host, "slots"), 0);
            prop_assert_eq!(in_flight(&host, "fewer-slots"), 0);
        }
    }
}
