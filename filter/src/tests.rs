//! The worker against the in-memory host: several workers share one host,
//! as Envoy's worker VMs share one process's shared data.

use proptest::prelude::*;
use sluice_shared::matcher::CompiledPolicySet;

use crate::host::Host;
use crate::store::{allocate_holder, update, StoreStats, MAX_CAS_ATTEMPTS};
use crate::testing::FakeHost;
use crate::worker::{StreamAction, Verdict, Worker};

const T0: u64 = 1_800_000_000_000_000_000;

fn worker(host: &FakeHost, policies: &str) -> Worker {
    let mut w = Worker::new(allocate_holder(host));
    let set = CompiledPolicySet::from_json(policies).unwrap_or_else(|e| panic!("{e}"));
    w.install(host, set);
    w
}

fn req<'a>(authority: &'a [u8], extra: &'a [(&'a str, &'a [u8])]) -> Vec<(&'a str, &'a [u8])> {
    let mut h = vec![
        (":authority", authority),
        (":path", b"/".as_slice()),
        (":method", b"GET".as_slice()),
    ];
    h.extend_from_slice(extra);
    h
}

fn status(v: &Verdict) -> u32 {
    match v {
        Verdict::Continue => 200,
        Verdict::Pause => 0,
        Verdict::Reply(r) => r.status,
    }
}

const RATE: &str = r#"{"version": 1, "policies": [
    {"name": "bank", "match": {"host": "api.bank.example"}, "rate": {"requests": 10, "period": "1s", "burst": 5}}]}"#;

#[test]
fn rate_limit_is_shared_by_all_workers_and_replies_with_headers() {
    let host = FakeHost::at(T0);
    let mut a = worker(&host, RATE);
    let mut b = worker(&host, RATE);
    assert_ne!(a.holder(), b.holder());
    let r = req(b"api.bank.example", &[]);
    let mut passed = 0;
    for i in 0..10u32 {
        let w = if i % 2 == 0 { &mut a } else { &mut b };
        if w.on_request(&host, i, r.as_slice()) == Verdict::Continue {
            passed += 1;
        }
    }
    assert_eq!(passed, 5);
    let Verdict::Reply(reply) = a.on_request(&host, 99, r.as_slice()) else {
        panic!("expected a reply");
    };
    assert_eq!(reply.status, 429);
    let header = |n: &str| {
        reply
            .headers
            .iter()
            .find(|(k, _)| *k == n)
            .map(|(_, v)| v.clone())
    };
    assert_eq!(header("retry-after").as_deref(), Some("1"));
    assert_eq!(
        header("ratelimit-policy").as_deref(),
        Some("\"bank\";q=10;w=1")
    );
    assert_eq!(header("ratelimit").as_deref(), Some("\"bank\";r=0;t=1"));
    assert_eq!(header("x-sluice-policy").as_deref(), Some("bank"));
    a.on_tick(&host);
    b.on_tick(&host);
    assert_eq!(host.metric("sluice.policy.bank.admitted"), 5);
    assert_eq!(host.metric("sluice.policy.bank.rejected"), 6);
    // Unmatched traffic passes untouched.
    assert_eq!(
        a.on_request(&host, 100, req(b"other.example", &[]).as_slice()),
        Verdict::Continue
    );
}

const SLOTS: &str = r#"{"version": 1, "policies": [
    {"name": "llm", "match": {"host": "*"}, "concurrency": {"max_in_flight": 2, "lease_ttl": "10s"}}]}"#;

#[test]
fn a_slot_is_released_exactly_once() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, SLOTS);
    let r = req(b"x", &[]);
    assert_eq!(w.on_request(&host, 1, r.as_slice()), Verdict::Continue);
    assert_eq!(w.on_request(&host, 2, r.as_slice()), Verdict::Continue);
    assert_eq!(status(&w.on_request(&host, 3, r.as_slice())), 429);
    w.on_stream_end(&host, 1);
    w.on_stream_end(&host, 1);
    w.on_stream_end(&host, 3);
    assert_eq!(w.on_request(&host, 4, r.as_slice()), Verdict::Continue);
    assert_eq!(
        status(&w.on_request(&host, 5, r.as_slice())),
        429,
        "a double release must not free a slot"
    );
    w.on_stream_end(&host, 2);
    w.on_stream_end(&host, 4);
    w.on_tick(&host);
    assert_eq!(host.metric("sluice.policy.llm.in_flight"), 0);
    assert_eq!(w.in_flight(), 0);
}

#[test]
fn a_stream_that_never_ends_gives_its_slot_back_after_the_ttl() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, SLOTS);
    let r = req(b"x", &[]);
    assert_eq!(w.on_request(&host, 1, r.as_slice()), Verdict::Continue);
    assert_eq!(w.on_request(&host, 2, r.as_slice()), Verdict::Continue);
    host.advance_ms(9_000);
    w.on_tick(&host);
    assert_eq!(status(&w.on_request(&host, 3, r.as_slice())), 429);
    host.advance_ms(1_001);
    w.on_tick(&host);
    assert_eq!(w.on_request(&host, 4, r.as_slice()), Verdict::Continue);
    w.on_tick(&host);
    assert_eq!(host.metric("sluice.policy.llm.leases_expired"), 2);
}

#[test]
fn a_crashed_workers_slots_return_after_the_ttl() {
    let host = FakeHost::at(T0);
    let mut crashed = worker(&host, SLOTS);
    let r = req(b"x", &[]);
    assert_eq!(
        crashed.on_request(&host, 1, r.as_slice()),
        Verdict::Continue
    );
    assert_eq!(
        crashed.on_request(&host, 2, r.as_slice()),
        Verdict::Continue
    );
    drop(crashed);
    let mut fresh = worker(&host, SLOTS);
    assert_eq!(status(&fresh.on_request(&host, 1, r.as_slice())), 429);
    host.advance_ms(10_001);
    assert_eq!(fresh.on_request(&host, 2, r.as_slice()), Verdict::Continue);
}

#[test]
fn queued_requests_resume_in_order_and_leavers_free_their_place() {
    let policies = r#"{"version": 1, "policies": [
        {"name": "q", "match": {"host": "*"}, "rate": {"requests": 50, "period": "1s", "burst": 1},
         "on_limit": {"action": "queue", "max_wait": "100ms"}}]}"#;
    let host = FakeHost::at(T0);
    let mut a = worker(&host, policies);
    let mut b = worker(&host, policies);
    let r = req(b"x", &[]);
    assert_eq!(a.on_request(&host, 1, r.as_slice()), Verdict::Continue);
    // Turns at 20, 40, 60, 80, 100 ms; the sixth would wait 120 ms.
    for ctx in 2..=6 {
        let w = if ctx % 2 == 0 { &mut a } else { &mut b };
        assert_eq!(
            w.on_request(&host, ctx, r.as_slice()),
            Verdict::Pause,
            "ctx {ctx}"
        );
    }
    assert_eq!(status(&a.on_request(&host, 7, r.as_slice())), 429);
    assert_eq!(host.tick_ms.get(), 1);
    // Context 3 (on b) leaves: one more fits.
    b.on_stream_end(&host, 3);
    assert_eq!(a.on_request(&host, 8, r.as_slice()), Verdict::Pause);
    let mut order = Vec::new();
    for _ in 0..120 {
        host.advance_ms(1);
        for (name, w) in [("a", &mut a), ("b", &mut b)] {
            for action in w.on_tick(&host) {
                match action {
                    StreamAction::Resume(ctx) => {
                        order.push((host.now() - T0) / 1_000_000 * 10 + u64::from(ctx))
                    }
                    StreamAction::Reply(ctx, _) => panic!("{name}: ctx {ctx} timed out"),
                }
            }
        }
    }
    // (ms, ctx) packed as ms*10+ctx: every 20 ms, in arrival order.
    assert_eq!(order, vec![202, 404, 605, 806, 1008]);
    assert_eq!(a.waiting() + b.waiting(), 0);
    assert_eq!(host.tick_ms.get(), 100, "back to the idle tick");
}

#[test]
fn concurrency_queue_times_out_with_a_reply() {
    let policies = r#"{"version": 1, "policies": [
        {"name": "c", "match": {"host": "*"}, "concurrency": {"max_in_flight": 1},
         "on_limit": {"action": "queue", "max_wait": "50ms", "status": 503}}]}"#;
    let host = FakeHost::at(T0);
    let mut w = worker(&host, policies);
    let r = req(b"x", &[]);
    assert_eq!(w.on_request(&host, 1, r.as_slice()), Verdict::Continue);
    assert_eq!(w.on_request(&host, 2, r.as_slice()), Verdict::Pause);
    assert_eq!(w.on_request(&host, 3, r.as_slice()), Verdict::Pause);
    host.advance_ms(10);
    w.on_stream_end(&host, 1);
    assert_eq!(w.on_tick(&host), vec![StreamAction::Resume(2)]);
    host.advance_ms(41);
    let actions = w.on_tick(&host);
    assert!(
        matches!(actions.as_slice(), [StreamAction::Reply(3, reply)] if reply.status == 503),
        "{actions:?}"
    );
    w.on_tick(&host);
    assert_eq!(host.metric("sluice.policy.c.queue_timeouts"), 1);
    assert_eq!(host.metric("sluice.policy.c.queue_abandoned"), 0);
}

const PER_KEY: &str = r#"{"version": 1, "policies": [
    {"name": "k", "match": {"host": "*"}, "key": {"header": "x-api-key", "max_keys": 2},
     "rate": {"requests": 1, "period": "1s", "burst": 2}}]}"#;

#[test]
fn each_key_gets_its_own_bucket_and_overflow_is_shared() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, PER_KEY);
    let mut pass = |key: &[u8], ctx: u32| {
        w.on_request(&host, ctx, req(b"x", &[("x-api-key", key)]).as_slice()) == Verdict::Continue
    };
    assert!(pass(b"alice", 1) && pass(b"alice", 2) && !pass(b"alice", 3));
    assert!(pass(b"bob", 4) && pass(b"bob", 5) && !pass(b"bob", 6));
    // Both places hold busy keys: new keys share the overflow bucket.
    assert!(pass(b"carol", 7) && pass(b"dave", 8) && !pass(b"erin", 9));
    // Once alice's bucket is full again, her place can go to a new key.
    host.advance_ms(2_001);
    assert!(pass(b"erin", 10) && pass(b"erin", 11) && !pass(b"erin", 12));
    w.on_tick(&host);
    assert!(host.metric("sluice.policy.k.key_overflow") >= 3);
    assert!(host.metric("sluice.policy.k.key_evictions") >= 1);
    // Raw keys never reach shared data.
    assert!(host.shared.borrow().keys().all(|k| !k.contains("alice")));
}

#[test]
fn shadow_mode_counts_what_enforce_would_refuse_and_limits_nothing() {
    let shadow = RATE.replace("\"burst\": 5}", "\"burst\": 5}, \"mode\": \"shadow\"");
    let host = FakeHost::at(T0);
    let mut w = worker(&host, &shadow);
    let r = req(b"api.bank.example", &[]);
    for ctx in 0..20 {
        assert_eq!(w.on_request(&host, ctx, r.as_slice()), Verdict::Continue);
    }
    w.on_tick(&host);
    assert_eq!(host.metric("sluice.policy.bank.shadow_limited"), 15);
    assert_eq!(host.metric("sluice.policy.bank.admitted"), 5);
}

#[test]
fn a_concurrent_first_insert_is_not_overwritten() {
    let host = FakeHost::at(T0);
    let mut a = worker(&host, SLOTS);
    let mut b = worker(&host, SLOTS);
    let r = req(b"x", &[]);
    // b admits while a is between reading the missing key and writing it.
    let snapshot = {
        let other = FakeHost::at(T0);
        let mut tmp = worker(&other, SLOTS);
        assert_eq!(tmp.on_request(&other, 1, r.as_slice()), Verdict::Continue);
        let value = other.shared.borrow().get("sluice/b/llm").cloned();
        value.expect("tmp wrote its bucket")
    };
    *host.before_next_set.borrow_mut() = Some(Box::new(move |map, counter| {
        map.insert("sluice/b/llm".into(), (snapshot.0, *counter));
        *counter += 1;
    }));
    assert_eq!(a.on_request(&host, 1, r.as_slice()), Verdict::Continue);
    // Two slots are taken now; a third request is refused.
    assert_eq!(status(&b.on_request(&host, 2, r.as_slice())), 429);
}

#[test]
fn endless_contention_refuses_instead_of_spinning() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, RATE);
    host.always_mismatch.set(true);
    assert_eq!(
        status(&w.on_request(&host, 1, req(b"api.bank.example", &[]).as_slice())),
        429
    );
    host.always_mismatch.set(false);
    w.on_tick(&host);
    assert_eq!(host.metric("sluice.cas_exhausted"), 1);
    assert_eq!(
        host.metric("sluice.cas_retries"),
        i64::from(MAX_CAS_ATTEMPTS) - 1
    );
}

#[test]
fn garbage_in_shared_data_is_replaced_and_counted() {
    let host = FakeHost::at(T0);
    let mut stats = StoreStats::default();
    host.shared
        .borrow_mut()
        .insert("sluice/b/x".into(), (vec![9, 9, 9], 5));
    let r = update(
        &host,
        "sluice/b/x",
        &mut stats,
        || sluice_shared::bucket::BucketState::new(0),
        |s| (s.owner, true),
    );
    assert_eq!(r, Ok(0));
    assert_eq!(stats.decode_errors, 1);
    assert!(host.shared_get("sluice/b/x").0.is_some_and(|v| v.len() > 3));
}

const EVERYTHING: &str = r#"{"version": 1, "policies": [
    {"name": "a", "match": {"host": "*.example", "path_prefix": "/v1", "methods": ["POST"], "headers": [{"name": "x-t", "equals": "1"}]},
     "key": {"header": "x-api-key", "max_keys": 3}, "cost": {"header": "x-cost", "max": 3},
     "rate": {"requests": 5, "period": "1s", "burst": 3}, "concurrency": {"max_in_flight": 2, "reserved_for_high": 1},
     "priority": {"header": "x-priority"}, "on_limit": {"action": "queue", "max_wait": "20ms", "max_queue": 3}},
    {"name": "b", "match": {"host": "*"}, "key": {"header": "x-api-key", "max_keys": 1, "overflow": "reject"},
     "rate": {"algorithm": "sliding_window", "requests": 3, "period": "100ms"}}]}"#;

fn header_name() -> impl Strategy<Value = &'static str> {
    prop_oneof![
        Just(":authority"),
        Just(":path"),
        Just(":method"),
        Just("x-t"),
        Just("x-api-key"),
        Just("x-cost"),
        Just("x-priority"),
        Just("host"),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    /// Any header bytes, any sizes, any sequence of requests, ends, ticks
    /// and clock jumps: no panic, every request gets a defined verdict, and
    /// in the end nothing is left in flight or waiting.
    #[test]
    fn the_request_path_never_panics(
        steps in prop::collection::vec(
            (prop::collection::vec((header_name(), prop::collection::vec(any::<u8>(), 0..300)), 0..8), 0u8..4, 0u64..40),
            1..60,
        ),
    ) {
        let host = FakeHost::at(T0);
        let mut w = worker(&host, EVERYTHING);
        let mut open = Vec::new();
        for (ctx, (headers, action, ms)) in steps.into_iter().enumerate() {
            let ctx = ctx as u32;
            let h: Vec<(&str, &[u8])> = headers.iter().map(|(n, v)| (*n, v.as_slice())).collect();
            match w.on_request(&host, ctx, h.as_slice()) {
                Verdict::Continue | Verdict::Pause => open.push(ctx),
                Verdict::Reply(r) => prop_assert!((400..600).contains(&r.status)),
            }
            match action {
                0 => { if let Some(c) = open.pop() { w.on_stream_end(&host, c); } }
                1 => { host.advance_ms(ms); let _ = w.on_tick(&host); }
                2 => host.now.set(host.now.get().saturating_sub(ms * 1_000_000)),
                _ => {}
            }
        }
        for c in open {
            w.on_stream_end(&host, c);
        }
        prop_assert_eq!(w.in_flight(), 0);
        prop_assert_eq!(w.waiting(), 0);
    }
}
