//! A pool policy sends each call to a member that can take it: the member
//! with the most room by default, the sticky key's own while it has room;
//! a member its provider paused is passed over; when none can take it the
//! call is refused with the soonest any can; an answer from another member
//! (Envoy retried there) counts at that member and pauses the first.

use crate::host::Host;
use crate::testing::FakeHost;
use crate::tests::{header_of, pass, req, status, sync_settings, worker, T0};
use crate::worker::{StreamAction, Verdict, Worker};

/// Two deployments: east 10 a second, west 5 a second; each pauses on
/// its provider's 429.
const POOL: &str = r#"{"version": 1, "policies": [
    {"name": "llm", "match": {"host": "llm.example"},
     "rate": {"requests": 1000, "period": "1s"},
     "pool": {"sticky": {"header": "x-conversation"}, "members": [
       {"name": "east", "cluster": "llm-east",
        "limits": [{"name": "east-rpm", "rate": {"requests": 10, "period": "1s"},
                    "provider": {"max_pause": "60s"}}]},
       {"name": "west", "cluster": "llm-west",
        "limits": [{"name": "west-rpm", "rate": {"requests": 5, "period": "1s"},
                    "provider": {"max_pause": "60s"}}]}]}}]}"#;

const HOST: &[u8] = b"llm.example";

fn call(host: &FakeHost, w: &mut Worker, id: u32, extra: &[(&str, &[u8])]) -> Verdict {
    w.on_request(host, id, req(HOST, extra).as_slice())
}

/// Where call `id` was routed (the cluster its route header names).
pub(super) fn routed(host: &FakeHost, id: u32) -> Option<String> {
    host.set_headers
        .borrow()
        .iter()
        .rev()
        .find(|(c, name, _)| *c == id && name == "x-sluice-member")
        .map(|(_, _, v)| v.clone())
}

fn answer(host: &FakeHost, w: &mut Worker, id: u32, headers: &[(&str, &[u8])]) {
    w.on_answer_headers(host, id, headers, true);
    w.on_stream_end(host, id);
}

#[test]
fn calls_spread_by_room_and_fill_both_members_before_any_refusal() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, POOL);
    let mut to = std::collections::BTreeMap::<String, u32>::new();
    for id in 1..=15 {
        assert_eq!(call(&host, &mut w, id, &[]), Verdict::Continue, "call {id}");
        *to.entry(routed(&host, id).expect("routed")).or_default() += 1;
    }
    assert_eq!(to.get("llm-east"), Some(&10), "{to:?}");
    assert_eq!(to.get("llm-west"), Some(&5), "{to:?}");
    // Most room first: the members fill alike, west is not left for last.
    let first_six: Vec<_> = (1..=6).filter_map(|id| routed(&host, id)).collect();
    assert!(first_six.iter().any(|c| c == "llm-west"), "{first_six:?}");
    let refused = call(&host, &mut w, 16, &[]);
    assert_eq!(status(&refused), 429, "both full");
    assert_eq!(header_of(&refused, "retry-after"), Some("1"));
    pass(&host, &mut w, 1_000);
    assert_eq!(call(&host, &mut w, 17, &[]), Verdict::Continue);
    w.on_tick(&host);
    let admitted = host.metric("sluice.limit.east-rpm.admitted")
        + host.metric("sluice.limit.west-rpm.admitted");
    assert_eq!(admitted, 16, "each call counted at its one member");
}

#[test]
fn a_paused_member_is_passed_over_and_the_refusal_names_the_soonest_room() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, POOL);
    // East answers 429 for 30 s.
    let mut east_call = None;
    for id in 1..=4 {
        assert_eq!(call(&host, &mut w, id, &[]), Verdict::Continue);
        if routed(&host, id).as_deref() == Some("llm-east") && east_call.is_none() {
            east_call = Some(id);
        } else {
            answer(&host, &mut w, id, &[(":status", b"200")]);
        }
    }
    let east_call = east_call.expect("one call went east");
    answer(
        &host,
        &mut w,
        east_call,
        &[(":status", b"429"), ("retry-after", b"30")],
    );
    pass(&host, &mut w, 1_000);
    for id in 10..15 {
        assert_eq!(call(&host, &mut w, id, &[]), Verdict::Continue);
        assert_eq!(routed(&host, id).as_deref(), Some("llm-west"), "call {id}");
    }
    let refused = call(&host, &mut w, 15, &[]);
    assert_eq!(status(&refused), 429);
    assert_eq!(
        header_of(&refused, "retry-after"),
        Some("1"),
        "west has room within a second, east only in 29 s"
    );
    w.on_tick(&host);
    assert_eq!(host.metric("sluice.limit.east-rpm.paused"), 1);
}

#[test]
fn a_refusal_without_a_wait_passes_the_member_over_for_a_second() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, POOL);
    assert_eq!(call(&host, &mut w, 1, &[]), Verdict::Continue);
    let first = routed(&host, 1).expect("routed");
    answer(&host, &mut w, 1, &[(":status", b"429")]);
    for id in 2..=4 {
        assert_eq!(call(&host, &mut w, id, &[]), Verdict::Continue);
        assert_ne!(routed(&host, id), Some(first.clone()), "call {id}");
    }
    pass(&host, &mut w, 1_100);
    let back: Vec<_> = (5..=12)
        .map(|id| {
            assert_eq!(call(&host, &mut w, id, &[]), Verdict::Continue);
            routed(&host, id)
        })
        .collect();
    assert!(
        back.contains(&Some(first.clone())),
        "{first} is back: {back:?}"
    );
}

#[test]
fn a_sticky_key_stays_on_its_member_while_it_has_room() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, POOL);
    let mut homes = std::collections::BTreeSet::new();
    for (n, conversation) in ["c1", "c2", "c3", "c4", "c5", "c6"].iter().enumerate() {
        let id = 100 + n as u32;
        let extra: &[(&str, &[u8])] = &[("x-conversation", conversation.as_bytes())];
        assert_eq!(call(&host, &mut w, id, extra), Verdict::Continue);
        let home = routed(&host, id).expect("routed");
        answer(&host, &mut w, id, &[(":status", b"200")]);
        pass(&host, &mut w, 1_000);
        for again in 0..3 {
            let id = 200 + 10 * n as u32 + again;
            assert_eq!(call(&host, &mut w, id, extra), Verdict::Continue);
            assert_eq!(routed(&host, id), Some(home.clone()), "{conversation}");
            answer(&host, &mut w, id, &[(":status", b"200")]);
        }
        homes.insert(home);
        pass(&host, &mut w, 1_000);
    }
    assert_eq!(homes.len(), 2, "six conversations land on both members");
    // Its member full: the conversation goes to the other.
    let extra: &[(&str, &[u8])] = &[("x-conversation", b"c1")];
    let mut clusters = std::collections::BTreeSet::new();
    for id in 300..312 {
        assert_eq!(call(&host, &mut w, id, extra), Verdict::Continue);
        clusters.insert(routed(&host, id).expect("routed"));
    }
    assert_eq!(clusters.len(), 2, "spilled over once full: {clusters:?}");
}

#[test]
fn an_answer_from_another_member_counts_there_and_pauses_the_first() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, POOL);
    assert_eq!(call(&host, &mut w, 1, &[]), Verdict::Continue);
    let first = routed(&host, 1).expect("routed");
    let (other, other_limit, first_limit) = if first == "llm-east" {
        ("west", "west-rpm", "east-rpm")
    } else {
        ("east", "east-rpm", "west-rpm")
    };
    answer(
        &host,
        &mut w,
        1,
        &[
            (":status", b"429"),
            ("retry-after", b"20"),
            ("x-sluice-member-answered", other.as_bytes()),
        ],
    );
    w.on_tick(&host);
    assert_eq!(
        host.metric(&format!("sluice.limit.{other_limit}.pool_retried")),
        1
    );
    // The answer was the other member's: its limit paused for 20 s, and
    // the first one for a second.
    assert_eq!(
        host.metric(&format!("sluice.limit.{other_limit}.paused")),
        1
    );
    assert_eq!(
        host.metric(&format!("sluice.limit.{first_limit}.paused")),
        1
    );
    let refused = call(&host, &mut w, 2, &[]);
    assert_eq!(status(&refused), 429, "both paused");
    assert_eq!(header_of(&refused, "retry-after"), Some("1"));
    pass(&host, &mut w, 1_100);
    assert_eq!(call(&host, &mut w, 3, &[]), Verdict::Continue);
    assert_eq!(routed(&host, 3), Some(first));
}

/// The pool in queue mode (`max_wait`), both members filled by calls
/// 1 to 15 and call 16 queued.
fn full_pool_with_a_call_queued(host: &FakeHost, max_wait: &str) -> Worker {
    let queued = POOL.replace(
        r#""rate": {"requests": 1000, "period": "1s"},"#,
        &format!(
            r#""rate": {{"requests": 1000, "period": "1s"}}, "on_limit": {{"action": "queue", "max_wait": "{max_wait}"}},"#
        ),
    );
    let mut w = worker(host, &queued);
    for id in 1..=15 {
        assert_eq!(call(host, &mut w, id, &[]), Verdict::Continue);
    }
    let v = call(host, &mut w, 16, &[]);
    assert!(matches!(v, Verdict::Pause { .. }), "{v:?}");
    w
}

#[test]
fn a_queued_pool_call_goes_to_the_member_that_frees_first() {
    let host = FakeHost::at(T0);
    let mut w = full_pool_with_a_call_queued(&host, "3s");
    let (mut resumed, mut routes) = (Vec::new(), Vec::new());
    for _ in 0..15 {
        host.advance_ms(100);
        for action in w.on_tick(&host) {
            match action {
                StreamAction::Resume(id) => resumed.push(id),
                StreamAction::SetHeader(id, name, value) => {
                    assert_eq!(name, "x-sluice-member");
                    routes.push((id, value));
                }
                StreamAction::Reply(id, _) => panic!("{id} refused"),
                StreamAction::LogField(..) => {}
            }
        }
    }
    assert_eq!(resumed, vec![16]);
    assert_eq!(routes.len(), 1, "routed as it resumed: {routes:?}");
    assert_eq!(routes[0].0, 16);
}

/// One deadline for queue and failover: a pool call that waits in the
/// queue and then finds every member paused is refused when its own wait
/// (`max_wait` from its arrival) runs out, in the name of the member's
/// limit that has room first, telling what is left of that wait.
#[test]
fn a_queued_pool_call_that_finds_every_member_paused_is_refused_at_its_own_deadline() {
    let host = FakeHost::at(T0);
    let mut w = full_pool_with_a_call_queued(&host, "2s");
    // While it waits for the next second's room, both providers ask for
    // 30 s (then 20 s) of quiet.
    let east = (1..=15).find(|id| routed(&host, *id).as_deref() == Some("llm-east"));
    let west = (1..=15).find(|id| routed(&host, *id).as_deref() == Some("llm-west"));
    let (Some(east), Some(west)) = (east, west) else {
        panic!("both members took calls");
    };
    host.advance_ms(300);
    answer(
        &host,
        &mut w,
        east,
        &[(":status", b"429"), ("retry-after", b"30")],
    );
    answer(
        &host,
        &mut w,
        west,
        &[(":status", b"429"), ("retry-after", b"20")],
    );
    let mut refused = Vec::new();
    for ms in 301..=6_000u64 {
        host.advance_ms(1);
        for action in w.on_tick(&host) {
            match action {
                StreamAction::Reply(id, reply) => refused.push((ms, id, reply)),
                other => panic!("nothing but its refusal: {other:?}"),
            }
        }
    }
    let [(at, 16, reply)] = refused.as_slice() else {
        panic!("{refused:?}");
    };
    assert!(
        (2_000..=2_002).contains(at),
        "refused {at} ms after it came"
    );
    assert_eq!(reply.status, 429);
    assert_eq!(reply.header("x-sluice-limit"), Some("west-rpm"));
    assert_eq!(reply.header("x-sluice-reason"), Some("provider-pause"));
    let retry: u64 = reply
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .expect("a Retry-After");
    assert!(
        (18..=19).contains(&retry),
        "west's pause less the wait: {retry}"
    );
}

#[test]
fn a_member_refusing_every_call_envoy_retries_is_probed_ever_less_often() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, POOL);
    // Calls go where they go; each one sent east is answered by west.
    let mut pauses_of_east = Vec::new();
    let mut id = 0;
    while pauses_of_east.len() < 4 && id < 2_000 {
        id += 1;
        if call(&host, &mut w, id, &[]) != Verdict::Continue {
            pass(&host, &mut w, 100);
            continue;
        }
        if routed(&host, id).as_deref() == Some("llm-east") {
            pauses_of_east.push(host.now());
            answer(
                &host,
                &mut w,
                id,
                &[(":status", b"200"), ("x-sluice-member-answered", b"west")],
            );
        } else {
            answer(&host, &mut w, id, &[(":status", b"200")]);
        }
        pass(&host, &mut w, 100);
    }
    let gaps: Vec<u64> = pauses_of_east
        .windows(2)
        .map(|w| (w[1] - w[0]).as_millis())
        .collect();
    assert_eq!(gaps.len(), 3, "east was tried 4 times: {gaps:?}");
    // Passed over 1 s, then 2 s, then 4 s (a tick of 100 ms late at most).
    for (gap, want) in gaps.iter().zip([1_000u64, 2_000, 4_000]) {
        assert!((want..=want + 200).contains(gap), "gaps {gaps:?}");
    }
    // East answering a call itself ends the backoff.
    pass(&host, &mut w, 8_000);
    let mut east_ok = None;
    for n in 0..12 {
        let id = 5_000 + n;
        assert_eq!(call(&host, &mut w, id, &[]), Verdict::Continue);
        if routed(&host, id).as_deref() == Some("llm-east") && east_ok.is_none() {
            east_ok = Some(id);
            answer(
                &host,
                &mut w,
                id,
                &[(":status", b"200"), ("x-sluice-member-answered", b"east")],
            );
        } else {
            answer(&host, &mut w, id, &[(":status", b"200")]);
        }
    }
    assert!(east_ok.is_some());
    pass(&host, &mut w, 1_000);
    let mut again = None;
    for n in 0..12 {
        let id = 6_000 + n;
        assert_eq!(call(&host, &mut w, id, &[]), Verdict::Continue);
        if routed(&host, id).as_deref() == Some("llm-east") {
            again = Some(host.now());
            answer(
                &host,
                &mut w,
                id,
                &[(":status", b"200"), ("x-sluice-member-answered", b"west")],
            );
            break;
        }
        answer(&host, &mut w, id, &[(":status", b"200")]);
    }
    let again = again.expect("east tried again");
    pass(&host, &mut w, 1_100);
    let back = (0..12).any(|n| {
        let id = 7_000 + n;
        call(&host, &mut w, id, &[]) == Verdict::Continue
            && routed(&host, id).as_deref() == Some("llm-east")
    });
    assert!(
        back,
        "a first refusal after a served call pauses east 1 s again ({again:?})"
    );
}

/// Where each of calls `ids` went, alternating between two workers; each
/// one routed west is answered there at once.
fn spread(
    host: &FakeHost,
    workers: &mut [&mut Worker; 2],
    ids: std::ops::Range<u32>,
) -> Vec<String> {
    let mut to = Vec::new();
    for id in ids {
        let w = &mut *workers[id as usize % 2];
        if call(host, w, id, &[]) != Verdict::Continue {
            to.push("refused".to_string());
            continue;
        }
        let member = routed(host, id).unwrap_or_default();
        if member == "llm-west" {
            answer(host, w, id, &[(":status", b"200")]);
        }
        to.push(member);
    }
    to
}

/// An answer from west to a call sent east: Envoy retried it there.
const RETRIED_ON_WEST: [(&str, &[u8]); 2] =
    [(":status", b"200"), ("x-sluice-member-answered", b"west")];

/// Two workers over `host`, east paused for a second by a call Envoy
/// retried on west (east, with the most room, took the first call), and
/// that second over.
fn east_retried_away_once(host: &FakeHost) -> (Worker, Worker) {
    let mut w1 = worker(host, POOL);
    let w2 = worker(host, POOL);
    assert_eq!(call(host, &mut w1, 1, &[]), Verdict::Continue);
    assert_eq!(routed(host, 1).as_deref(), Some("llm-east"));
    answer(host, &mut w1, 1, &RETRIED_ON_WEST);
    pass(host, &mut w1, 1_100);
    (w1, w2)
}

/// A member Envoy retried calls away from is probed when its pause ends:
/// one call goes to it, from whichever worker, and every other call of
/// every worker goes elsewhere until that call's answer: its own opens
/// the member to all, another's (Envoy retried it too) doubles the pause.
#[test]
fn a_paused_member_is_probed_with_one_call_and_opened_by_its_own_answer() {
    let host = FakeHost::at(T0);
    let (mut w1, mut w2) = east_retried_away_once(&host);
    // The pause over, one call probes east; the others, from both
    // workers, go west while it is out.
    let mut both = [&mut w1, &mut w2];
    let to = spread(&host, &mut both, 10..16);
    let probes: Vec<u32> = (10..16)
        .zip(&to)
        .filter(|(_, m)| *m == "llm-east")
        .map(|(id, _)| id)
        .collect();
    assert_eq!(probes.len(), 1, "one probe: {to:?}");
    assert_eq!(
        host.metric("sluice.limit.east-rpm.paused"),
        1,
        "a probe is no new pause"
    );
    // Envoy retried the probe too: east passed over for 2 s now.
    let probe = probes[0];
    let w = &mut *both[probe as usize % 2];
    answer(&host, w, probe, &RETRIED_ON_WEST);
    pass(&host, w, 1_500);
    let to = spread(&host, &mut both, 20..24);
    assert!(
        !to.iter().any(|m| m == "llm-east"),
        "still passed over: {to:?}"
    );
    pass(&host, both[0], 600);
    let to = spread(&host, &mut both, 30..34);
    let probe = (30..34)
        .zip(&to)
        .find(|(_, m)| *m == "llm-east")
        .map(|(id, _)| id);
    let probe = probe.unwrap_or_else(|| panic!("probed again after 2 s: {to:?}"));
    // East answers it itself: open to all again, calls go by room.
    let w = &mut *both[probe as usize % 2];
    answer(
        &host,
        w,
        probe,
        &[(":status", b"200"), ("x-sluice-member-answered", b"east")],
    );
    let to = spread(&host, &mut both, 40..44);
    assert!(
        to.iter().filter(|m| *m == "llm-east").count() >= 2,
        "east takes calls again: {to:?}"
    );
}

/// A member's provider row that does not decode (shared data is
/// anyone's to break) probes nothing and pauses nothing: calls go as they
/// would to a member never paused, nothing panics, and once a retried
/// call pauses the member again its probe is held as before.
#[test]
fn a_broken_provider_row_probes_nothing_and_breaks_nothing() {
    let host = FakeHost::at(T0);
    let (mut w1, mut w2) = east_retried_away_once(&host);
    if let Some(entry) = host.shared.borrow_mut().get_mut("sluice/p/east-rpm") {
        entry.0 = b"\xff\x00 not a provider table".to_vec();
    }
    let mut both = [&mut w1, &mut w2];
    let to = spread(&host, &mut both, 10..14);
    assert!(to.iter().all(|m| m != "refused"), "every call went: {to:?}");
    assert!(
        to.iter().filter(|m| *m == "llm-east").count() >= 2,
        "no probe held: {to:?}"
    );
    for id in (10..14).filter(|id| to[(*id - 10) as usize] == "llm-east") {
        answer(&host, both[id as usize % 2], id, &RETRIED_ON_WEST);
    }
    pass(&host, both[0], 1_100);
    let to = spread(&host, &mut both, 20..26);
    assert_eq!(
        to.iter().filter(|m| *m == "llm-east").count(),
        1,
        "one probe once the row is written again: {to:?}"
    );
}

#[test]
fn a_call_spilled_over_is_counted_at_the_full_member_it_passed_over() {
    let host = FakeHost::at(T0);
    let priority = POOL.replace(r#""pool": {"#, r#""pool": {"rule": "priority", "#);
    let mut w = worker(&host, &priority);
    w.set_sync(Some(sync_settings()));
    let mut to = std::collections::BTreeMap::<String, u32>::new();
    for id in 1..=15 {
        assert_eq!(call(&host, &mut w, id, &[]), Verdict::Continue, "call {id}");
        *to.entry(routed(&host, id).expect("routed")).or_default() += 1;
    }
    assert_eq!(to.get("llm-east"), Some(&10), "primary first: {to:?}");
    // Both full: the refusal is counted where it was made, the other
    // member passed over.
    assert_eq!(status(&call(&host, &mut w, 16, &[])), 429);
    w.on_tick(&host);
    assert_eq!(host.metric("sluice.limit.east-rpm.passed_over"), 5);
    assert_eq!(
        host.metric("sluice.limit.east-rpm.refused") + host.metric("sluice.limit.west-rpm.refused"),
        1
    );
    assert_eq!(
        host.metric("sluice.limit.east-rpm.passed_over")
            + host.metric("sluice.limit.west-rpm.passed_over"),
        6
    );
    // The sync report carries it: fleet mode counts it as asked of east.
    pass(&host, &mut w, 1_000);
    let calls = host.calls.borrow().clone();
    let report: sluice_wire::sync::SyncReport =
        serde_json::from_slice(&calls.last().expect("a sync").2).expect("a report");
    assert_eq!(
        report.limits["east-rpm"].counts[crate::metrics::LimitCounter::PassedOver],
        5
    );
    // A paused member is not passed over: its provider wants no calls.
    assert_eq!(call(&host, &mut w, 20, &[]), Verdict::Continue);
    assert_eq!(routed(&host, 20).as_deref(), Some("llm-east"));
    answer(
        &host,
        &mut w,
        20,
        &[(":status", b"429"), ("retry-after", b"30")],
    );
    for id in 21..=24 {
        assert_eq!(call(&host, &mut w, id, &[]), Verdict::Continue);
        assert_eq!(routed(&host, id).as_deref(), Some("llm-west"));
    }
    w.on_tick(&host);
    assert_eq!(host.metric("sluice.limit.east-rpm.passed_over"), 5);
}
