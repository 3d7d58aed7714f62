//! Push: one VM per Envoy keeps a watch open; a pushed set is installed
//! and published for the other VMs, which take it on their next tick; the
//! watch reopens at once after an answer, and only after 1 to 3 s after a
//! failure; a bad pushed set changes nothing.

use sluice_shared::time::Span;

use crate::testing::FakeHost;
use crate::tests::{reply, reply_with, req, sync_settings, worker, T0};
use crate::worker::{Verdict, Worker, PUSH_TICK};

const ONE: &str = r#"{"version": 1, "policies": [
    {"name": "bank", "match": {"host": "api.bank.example"}, "rate": {"requests": 1, "period": "1m"}}]}"#;
const TWO: &[u8] = br#"{"version": 2, "policies": [
    {"name": "bank", "match": {"host": "api.bank.example"}, "rate": {"requests": 1000, "period": "1m"}}]}"#;

fn pushing(host: &FakeHost) -> Worker {
    let mut w = worker(host, ONE);
    w.set_sync(Some(crate::sync::SyncSettings {
        push: true,
        ..sync_settings()
    }));
    w
}

/// The tokens of the calls to `path` sent so far.
fn calls_to(host: &FakeHost, path: &str) -> Vec<u32> {
    host.calls
        .borrow()
        .iter()
        .enumerate()
        .filter(|(_, (_, headers, _))| headers.iter().any(|(k, v)| k == ":path" && v == path))
        .map(|(i, _)| i as u32 + 1)
        .collect()
}

/// The tokens of the watch calls sent so far.
fn watches(host: &FakeHost) -> Vec<u32> {
    calls_to(host, sluice_wire::sync::WATCH_PATH)
}

fn admitted(host: &FakeHost, w: &mut Worker, id: u32) -> bool {
    let v = w.on_request(host, id, req(b"api.bank.example", &[]).as_slice());
    w.on_stream_end(host, id);
    v == Verdict::Continue
}

#[test]
fn a_pushed_set_is_enforced_by_every_worker_within_a_tick() {
    let host = FakeHost::at(T0);
    let mut a = pushing(&host);
    let mut b = pushing(&host);
    a.on_tick(&host);
    b.on_tick(&host);
    // One watch for the Envoy, whichever VM holds it.
    let open = watches(&host);
    assert_eq!(open.len(), 1, "{open:?}");
    let body = &host.calls.borrow()[open[0] as usize - 1].2.clone();
    let named: serde_json::Value = serde_json::from_slice(body).unwrap();
    assert_eq!(named["instance"], "unit");
    assert!(admitted(&host, &mut a, 1));
    assert!(!admitted(&host, &mut a, 2), "1 a minute");
    // The admin answers the watch with version 2: the VM installs it and
    // opens the next watch at once.
    host.advance_ms(60);
    a.on_sync_reply(&host, open[0], reply(Some(200), None, Some(TWO)));
    // The next watch opens at once (60 ms after the last went).
    assert_eq!(watches(&host).len(), 2);
    // The bucket keeps its state across the edit: at 1000 a minute a
    // token comes every 60 ms.
    host.advance_ms(100);
    assert!(admitted(&host, &mut a, 3));
    // The other VM installs it on its next tick.
    host.advance_ms(PUSH_TICK.as_millis().max(60));
    b.on_tick(&host);
    assert!(admitted(&host, &mut b, 4));
    // Counted once for the Envoy, as a push.
    b.on_tick(&host);
    a.on_tick(&host);
    assert_eq!(host.metric("sluice.push_sets"), 1);
    assert_eq!(host.metric("sluice.sync_sets"), 0);
}

#[test]
fn a_failed_watch_reopens_after_one_to_three_seconds_and_a_bad_set_changes_nothing() {
    let host = FakeHost::at(T0);
    let mut w = pushing(&host);
    w.on_tick(&host);
    let first = watches(&host)[0];
    // Garbage from the admin: the set in force stays.
    w.on_sync_reply(&host, first, reply(Some(200), None, Some(b"{not json")));
    assert!(admitted(&host, &mut w, 1));
    assert!(!admitted(&host, &mut w, 2));
    let mut reopened = None;
    for step in 1..=400u64 {
        host.advance_ms(10);
        w.on_tick(&host);
        if watches(&host).len() > 1 {
            reopened = Some(step * 10);
            break;
        }
    }
    let after = reopened.expect("the watch reopens");
    assert!(
        (1_000..=3_010).contains(&after),
        "reopened after {after} ms"
    );
    // Envoy gave up on it (no status): the same.
    let second = *watches(&host).last().unwrap();
    w.on_sync_reply(&host, second, reply(None, None, None));
    host.advance_ms(900);
    w.on_tick(&host);
    assert_eq!(watches(&host).len(), 2);
    host.advance_ms(Span::from_secs(3).as_millis());
    w.on_tick(&host);
    assert_eq!(watches(&host).len(), 3);
}

/// An admin that answers at once without a new set (one that does not
/// hold) gets at most one watch a second.
#[test]
fn an_admin_that_does_not_hold_gets_a_watch_a_second() {
    let host = FakeHost::at(T0);
    let mut w = pushing(&host);
    let one = ONE.as_bytes();
    for _ in 0..300 {
        host.advance_ms(10);
        w.on_tick(&host);
        let open = *watches(&host).last().unwrap();
        // Answered at once: the same set, or 304.
        let body = if open % 2 == 0 { Some(one) } else { None };
        let status = if open % 2 == 0 { 200 } else { 304 };
        w.on_sync_reply(&host, open, reply(Some(status), None, body));
    }
    let n = watches(&host).len();
    assert!((3..=4).contains(&n), "{n} watches in 3 s");
}

#[test]
fn without_push_no_watch_is_opened() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, ONE);
    w.set_sync(Some(sync_settings()));
    for _ in 0..10 {
        host.advance_ms(100);
        w.on_tick(&host);
    }
    assert!(watches(&host).is_empty());
}

/// A set the sync brought first, then the watch: still news (the admin
/// pushed it), so the next watch opens at once, not a second later.
#[test]
fn a_push_that_loses_the_race_to_a_sync_still_reopens_the_watch_at_once() {
    let host = FakeHost::at(T0);
    let mut w = pushing(&host);
    w.on_tick(&host);
    let watch = watches(&host)[0];
    host.advance_ms(100);
    let calls = host.calls.borrow().len() as u32;
    let sync = (1..=calls).find(|t| !watches(&host).contains(t)).unwrap();
    w.on_sync_reply(&host, sync, reply(Some(200), None, Some(TWO)));
    w.on_sync_reply(&host, watch, reply(Some(200), None, Some(TWO)));
    assert_eq!(watches(&host).len(), 2, "reopened at once");
    // The set came once: by the sync, which the stats tell.
    w.on_tick(&host);
    assert_eq!(host.metric("sluice.sync_sets"), 1);
    assert_eq!(host.metric("sluice.push_sets"), 0);
}

/// An admin that answers news after news at once gets at most 20
/// watches a second.
#[test]
fn news_after_news_opens_at_most_twenty_watches_a_second() {
    let host = FakeHost::at(T0);
    let mut w = pushing(&host);
    let mut answered = std::collections::BTreeSet::new();
    let mut version = 1;
    for _ in 0..100 {
        host.advance_ms(10);
        w.on_tick(&host);
        for open in watches(&host) {
            if answered.insert(open) {
                version += 1;
                let set = format!(r#"{{"version": {version}, "policies": []}}"#);
                w.on_sync_reply(&host, open, reply(Some(200), None, Some(set.as_bytes())));
            }
        }
    }
    let n = watches(&host).len();
    assert!((15..=21).contains(&n), "{n} watches in 1 s");
}

/// The same with several VMs: still one watch a second for the Envoy.
#[test]
fn several_vms_share_one_watch_a_second_when_answers_bring_nothing() {
    let host = FakeHost::at(T0);
    let mut vms: Vec<Worker> = (0..3).map(|_| pushing(&host)).collect();
    let mut answered = std::collections::BTreeSet::new();
    for _ in 0..300 {
        host.advance_ms(10);
        for w in vms.iter_mut() {
            w.on_tick(&host);
        }
        for open in watches(&host) {
            if answered.insert(open) {
                for w in vms.iter_mut() {
                    w.on_sync_reply(&host, open, reply(Some(304), None, None));
                }
            }
        }
    }
    let n = watches(&host).len();
    assert!((3..=4).contains(&n), "{n} watches in 3 s");
}

/// The tokens of the sync calls (not watches) sent so far.
fn syncs(host: &FakeHost) -> Vec<u32> {
    calls_to(host, sluice_wire::sync::SYNC_PATH)
}

/// Ticks every 10 ms for up to `limit_ms`; how long until a sync call more
/// than `before` was sent.
fn next_sync_after(host: &FakeHost, w: &mut Worker, before: usize, limit_ms: u64) -> Option<u64> {
    (1..=limit_ms / 10).find_map(|step| {
        host.advance_ms(10);
        w.on_tick(host);
        (syncs(host).len() > before).then_some(step * 10)
    })
}

#[test]
fn a_watch_answered_with_sync_now_brings_a_sync_at_once_and_reopens() {
    let host = FakeHost::at(T0);
    let mut w = pushing(&host);
    w.on_tick(&host);
    let first_sync = *syncs(&host).last().expect("a first sync");
    w.on_sync_reply(&host, first_sync, reply(Some(304), None, None));
    let watch = watches(&host)[0];
    host.advance_ms(300);
    // Fleet room was freed: sync now, not at the 1 s interval.
    let news = sync_now();
    w.on_sync_reply(&host, watch, news);
    let before = syncs(&host).len();
    let after = next_sync_after(&host, &mut w, before, 1_000).expect("a sync");
    assert!(
        after <= PUSH_TICK.as_millis() + 10,
        "synced {after} ms after"
    );
    assert_eq!(watches(&host).len(), 2, "the watch reopened at once");

    // A plain 304 (the hold ended) brings no early sync.
    let synced = *syncs(&host).last().unwrap();
    w.on_sync_reply(&host, synced, reply(Some(304), None, None));
    let watch = *watches(&host).last().unwrap();
    w.on_sync_reply(&host, watch, reply(Some(304), None, None));
    let before = syncs(&host).len();
    let after = next_sync_after(&host, &mut w, before, 2_000).expect("a sync");
    assert!(after >= 900, "synced {after} ms after a plain 304");
}

#[test]
fn a_share_cut_by_a_tenth_or_more_is_told_to_the_admin_at_once() {
    const GLOBAL: &str = r#"{"version": 1, "policies": [
        {"name": "llm", "match": {"host": "api.llm.example"}, "scope": "global",
         "rate": {"requests": 300, "period": "1s", "burst": 30}}]}"#;
    let share = |rate: u32, id: u32| {
        format!(
            r#"{{"llm": {{"rate": {rate}, "in_flight": 0, "lease_ms": 3000, "instances": 3, "id": {id}}}}}"#
        )
    };
    let host = FakeHost::at(T0);
    let mut w = worker(&host, GLOBAL);
    w.set_sync(Some(sync_settings()));
    w.on_tick(&host);
    let answer = |w: &mut Worker, header: &str| {
        let token = *syncs(&host).last().expect("a sync");
        w.on_sync_reply(
            &host,
            token,
            reply(Some(304), Some(header.as_bytes()), None),
        );
    };
    answer(&mut w, &share(200, 1));
    // Grown, or cut by less than a tenth: the next sync at the interval.
    let before = syncs(&host).len();
    assert!(next_sync_after(&host, &mut w, before, 2_000).expect("a sync") >= 900);
    answer(&mut w, &share(190, 2));
    let before = syncs(&host).len();
    assert!(next_sync_after(&host, &mut w, before, 2_000).expect("a sync") >= 900);
    // Cut from 190/s to 60/s: the admin keeps the old share reserved until
    // this Envoy says it holds the new one, so it says so now.
    answer(&mut w, &share(60, 3));
    let before = syncs(&host).len();
    let after = next_sync_after(&host, &mut w, before, 2_000).expect("a sync");
    assert!(after <= 110, "told after {after} ms");
    let calls = host.calls.borrow().clone();
    let report: sluice_wire::sync::SyncReport =
        serde_json::from_slice(&calls.last().expect("a sync").2).expect("a report");
    assert_eq!(report.shares.get("llm"), Some(&3));
    // Cut again at once, in the answer to that sync: told at once too,
    // not 100 ms after the last (the room moves a step a round trip).
    answer(&mut w, &share(20, 4));
    let before = syncs(&host).len();
    let again = next_sync_after(&host, &mut w, before, 2_000).expect("a sync");
    assert!(again <= 10, "told after {again} ms");
}

fn sync_now() -> crate::sync::SyncReply<'static> {
    reply_with(
        Some(304),
        &[(sluice_wire::sync::SYNC_NOW_HEADER, Some(b"1"))],
        None,
    )
}

/// Two words to sync now 40 ms apart (two Envoys freeing fleet room one
/// after the other): the first brings a sync at once, the second one as
/// soon as 100 ms have passed since the first, not at the next interval.
#[test]
fn news_within_100_ms_of_the_last_hurry_brings_a_sync_when_they_have_passed() {
    let host = FakeHost::at(T0);
    let mut w = pushing(&host);
    w.on_tick(&host);
    let first_sync = syncs(&host)[0];
    host.advance_ms(10);
    w.on_sync_reply(&host, first_sync, reply(Some(304), None, None));
    host.advance_ms(200);
    let watch = *watches(&host).last().unwrap();
    w.on_sync_reply(&host, watch, sync_now());
    w.on_tick(&host);
    let hurried = syncs(&host);
    assert_eq!(hurried.len(), 2, "the first news syncs at once");
    w.on_sync_reply(&host, hurried[1], reply(Some(304), None, None));
    host.advance_ms(40);
    let watch = *watches(&host).last().unwrap();
    w.on_sync_reply(&host, watch, sync_now());
    w.on_tick(&host);
    assert_eq!(syncs(&host).len(), 2, "at most one hurry in 100 ms");
    host.advance_ms(30);
    w.on_tick(&host);
    assert_eq!(syncs(&host).len(), 2);
    host.advance_ms(40);
    w.on_tick(&host);
    assert_eq!(
        syncs(&host).len(),
        3,
        "owed news syncs 110 ms after the first, not after 1 s"
    );
    // Once: no further sync until the interval.
    for _ in 0..8 {
        host.advance_ms(100);
        w.on_tick(&host);
    }
    assert_eq!(syncs(&host).len(), 3);
}
