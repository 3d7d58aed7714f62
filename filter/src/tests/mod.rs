//! The worker against the in-memory host: several workers share one host,
//! as Envoy's worker VMs share one process's shared data. The tests of
//! the request path and the helpers every test file here uses.

use proptest::prelude::*;
use sluice_filter_core::bucket::BucketState;
use sluice_filter_core::matcher::CompiledPolicySet;

use sluice_shared::time::{Instant, Span};

use crate::host::Host;
use crate::store::{Store, MAX_CAS_ATTEMPTS};
use crate::sync::{ReplyBody, SyncReply};
use crate::testing::FakeHost;
use crate::worker::{StreamAction, Verdict, Worker};
use sluice_wire::sync::{BUDGETS_HEADER, SHARES_HEADER};
use sluice_wire::sync_answer::ReceivedHeaders;

// One file per feature, through the worker as Envoy drives it; the
// helpers they share are below.
mod access_log;
mod attempts;
mod budgets;
mod downgrade;
mod fair;
mod fair_slots;
mod fleet_limits;
mod keyed_limits;
mod mcp;
mod mcp_batches;
mod pool;
mod pool_budgets;
mod provider;
mod provider_relay;
mod push;
mod queue_limits;
mod queue_rung;
mod security;
mod slot_limits;
mod spend;
mod telling;
mod usage;

pub(crate) const T0: Instant = Instant::from_nanos(1_800_000_000_000_000_000);

pub(crate) fn worker(host: &FakeHost, policies: &str) -> Worker {
    let mut w = Worker::new(host);
    let set = CompiledPolicySet::from_json(policies).unwrap_or_else(|e| panic!("{e}"));
    w.install(host, set);
    w
}

pub(crate) fn req<'a>(
    authority: &'a [u8],
    extra: &'a [(&'a str, &'a [u8])],
) -> Vec<(&'a str, &'a [u8])> {
    let mut h = vec![
        (":authority", authority),
        (":path", b"/".as_slice()),
        (":method", b"GET".as_slice()),
    ];
    h.extend_from_slice(extra);
    h
}

/// Time passes as it does in Envoy: the worker ticks every 100 ms
/// meanwhile (its clock takes a gap of more than a second between
/// readings for a step of the wall clock).
pub(crate) fn pass(host: &FakeHost, w: &mut Worker, ms: u64) {
    let mut left = ms;
    while left > 0 {
        let step = left.min(100);
        host.advance_ms(step);
        w.on_tick(host);
        left -= step;
    }
}

/// A header of a refusal's reply (None when the call was not refused).
pub(crate) fn header_of<'a>(v: &'a Verdict, name: &str) -> Option<&'a str> {
    match v {
        Verdict::Reply(r) => r
            .headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str()),
        _ => None,
    }
}

pub(crate) fn status(v: &Verdict) -> u32 {
    match v {
        Verdict::Continue => 200,
        Verdict::Pause { .. } | Verdict::ReadBody => 0,
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
    let header = |name: &str| reply.header(name).map(str::to_string);
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
    pass(&host, &mut w, 9_000);
    assert_eq!(status(&w.on_request(&host, 3, r.as_slice())), 429);
    pass(&host, &mut w, 1_001);
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
    pass(&host, &mut fresh, 10_001);
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
        assert!(
            matches!(
                w.on_request(&host, ctx, r.as_slice()),
                Verdict::Pause { .. }
            ),
            "ctx {ctx}"
        );
    }
    assert_eq!(status(&a.on_request(&host, 7, r.as_slice())), 429);
    assert_eq!(host.tick.get(), Span::from_millis(1));
    // Context 3 (on b) leaves: one more fits.
    b.on_stream_end(&host, 3);
    assert!(matches!(
        a.on_request(&host, 8, r.as_slice()),
        Verdict::Pause { .. }
    ));
    let mut order = Vec::new();
    for _ in 0..120 {
        host.advance_ms(1);
        for (name, w) in [("a", &mut a), ("b", &mut b)] {
            for action in w.on_tick(&host) {
                match action {
                    StreamAction::Resume(ctx) => {
                        order.push((host.now() - T0).as_millis() * 10 + u64::from(ctx))
                    }
                    StreamAction::Reply(ctx, _) => panic!("{name}: ctx {ctx} timed out"),
                    StreamAction::SetHeader(..) | StreamAction::LogField(..) => {}
                }
            }
        }
    }
    // (ms, ctx) packed as ms*10+ctx: every 20 ms, in arrival order.
    assert_eq!(order, vec![202, 404, 605, 806, 1008]);
    assert_eq!(a.waiting() + b.waiting(), 0);
    assert_eq!(
        host.tick.get(),
        Span::from_millis(100),
        "back to the idle tick"
    );
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
    assert_eq!(
        w.on_request(&host, 2, r.as_slice()),
        Verdict::Pause { ticket: 0 }
    );
    assert_eq!(
        w.on_request(&host, 3, r.as_slice()),
        Verdict::Pause { ticket: 1 }
    );
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
    let admitted = |w: &mut Worker, key: &[u8], ctx: u32| {
        w.on_request(&host, ctx, req(b"x", &[("x-api-key", key)]).as_slice()) == Verdict::Continue
    };
    let admits = |w: &mut Worker, key: &[u8], ctxs: [u32; 3]| {
        [
            admitted(w, key, ctxs[0]),
            admitted(w, key, ctxs[1]),
            admitted(w, key, ctxs[2]),
        ]
    };
    assert_eq!(admits(&mut w, b"alice", [1, 2, 3]), [true, true, false]);
    assert_eq!(admits(&mut w, b"bob", [4, 5, 6]), [true, true, false]);
    // Both places hold busy keys: new keys share the overflow bucket.
    assert!(admitted(&mut w, b"carol", 7) && admitted(&mut w, b"dave", 8));
    assert!(!admitted(&mut w, b"erin", 9));
    // Once alice's bucket is full again, her place can go to a new key.
    pass(&host, &mut w, 2_001);
    assert_eq!(admits(&mut w, b"erin", [10, 11, 12]), [true, true, false]);
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
    let mut store = Store::default();
    host.shared
        .borrow_mut()
        .insert("sluice/b/x".into(), (vec![9, 9, 9], 5));
    let r = store.update_as::<BucketState, _, _>(&host, "sluice/b/x", |s| (s.owner, true));
    assert_eq!(r, Ok(0));
    let mut metrics = crate::metrics::Metrics::default();
    store.flush_into(&mut metrics);
    assert_eq!(
        metrics.pending_filter(crate::metrics::FilterCounter::StateDecodeErrors),
        1
    );
    assert!(host.shared_get("sluice/b/x").0.is_some_and(|v| v.len() > 3));
}

const EVERYTHING: &str = r#"{"version": 1, "policies": [
    {"name": "a", "match": {"host": "*.example", "path_prefix": "/v1", "methods": ["POST"], "headers": [{"name": "x-t", "equals": "1"}]},
     "key": {"header": "x-api-key", "max_keys": 3}, "cost": {"header": "x-cost", "max": 3},
     "rate": {"requests": 5, "period": "1s", "burst": 3}, "concurrency": {"max_in_flight": 2, "reserved_for_high": 1},
     "priority": {"header": "x-priority"}, "on_limit": {"action": "queue", "max_wait": "20ms", "max_queue": 3},
     "limits": [{"name": "units-per-key", "key": {"header": "x-api-key", "max_keys": 2},
                 "rate": {"requests": 4, "period": "10ms"}, "cost": {"header": "x-cost", "max": 3},
                 "provider": {"headers": "ietf", "adaptive": true, "max_pause": "50ms"}},
                {"name": "fleet", "scope": "global", "rate": {"requests": 10, "period": "1s"}},
                {"name": "daily", "rate": {"requests": 40, "period": "1d", "algorithm": "fixed_window"}},
                {"name": "in-flight", "concurrency": {"max_in_flight": 2, "lease_ttl": "1s"}}]},
    {"name": "b", "match": {"host": "*"}, "key": {"header": "x-api-key", "max_keys": 1, "overflow": "reject"},
     "ratelimit_headers": "always",
     "rate": {"algorithm": "sliding_window", "requests": 3, "period": "100ms"},
     "limits": [{"name": "b-provider", "rate": {"requests": 5, "period": "1s"},
                 "provider": {"headers": "openai-requests", "max_pause": "50ms"}}]}]}"#;

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
        Just(":status"),
        Just("retry-after"),
        Just("ratelimit"),
        Just("x-ratelimit-remaining-requests"),
        Just("x-ratelimit-reset-requests"),
    ]
}

/// The fuzz budget: a tenth of `SLUICE_FUZZ_CASES` (each case is up to 60
/// requests), 1 000 by default.
fn request_path_cases() -> u32 {
    std::env::var("SLUICE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
        .map_or(1_000, |n| (n / 10).max(1))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: request_path_cases(), ..ProptestConfig::default() })]

    /// Any header bytes, any sizes, any sequence of requests, answers
    /// (any status, `Retry-After`, `RateLimit`), ends, ticks, wall-clock
    /// jumps and a monotonic clock reading anything: no panic, every
    /// request gets a defined verdict, and in the end nothing is left in
    /// flight or waiting.
    #[test]
    fn the_request_path_never_panics(
        steps in prop::collection::vec(
            (prop::collection::vec((header_name(), prop::collection::vec(any::<u8>(), 0..300)), 0..8), 0u8..5, 0u64..40),
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
                Verdict::Continue | Verdict::Pause { .. } | Verdict::ReadBody => open.push(ctx),
                Verdict::Reply(r) => prop_assert!((400..600).contains(&r.status)),
            }
            match action {
                0 => { if let Some(c) = open.pop() { w.on_stream_end(&host, c); } }
                1 => { host.advance_ms(ms); let _ = w.on_tick(&host); }
                2 => host.now.set(host.now.get() - Span::from_millis(ms)),
                // The same headers as an answer: any status, wait, count.
                3 => { if let Some(&c) = open.last() {
                    let told = w.on_answer_headers(&host, c, h.as_slice(), false).set;
                    prop_assert!(told.iter().all(|(_, v)| v.is_ascii() && !v.contains('\n')));
                } }
                // A host whose monotonic clock reads anything.
                _ => host.monotonic.set(Instant::from_nanos(ms.wrapping_mul(0x9E37_79B9_7F4A_7C15))),
            }
        }
        for c in open {
            w.on_stream_end(&host, c);
        }
        prop_assert_eq!(w.in_flight(), 0);
        prop_assert_eq!(w.waiting(), 0);
        // Every slot of the further concurrency limit came back.
        let slots = host.shared_get("sluice/l/in-flight").0.map(|b| {
            sluice_shared::limiter::LeaseTable::decode(&b).map(|t| t.in_flight())
        });
        prop_assert!(matches!(slots, None | Some(Ok(0))), "{:?}", slots);
    }
}

pub(crate) fn reply<'a>(
    status: Option<u16>,
    shares_header: Option<&'a [u8]>,
    body: Option<&'a [u8]>,
) -> SyncReply<'a> {
    reply_with(status, &[(SHARES_HEADER, shares_header)], body)
}

/// An answer of `status` with `headers` (name, value) as a shell reads it.
pub(crate) fn reply_with<'a>(
    status: Option<u16>,
    headers: &[(&str, Option<&[u8]>)],
    body: Option<&'a [u8]>,
) -> SyncReply<'a> {
    let status = status.map(|s| s.to_string());
    SyncReply {
        headers: ReceivedHeaders::read(|name| match name {
            ":status" => status.as_deref().map(str::as_bytes),
            name => headers
                .iter()
                .find(|(n, _)| *n == name)
                .and_then(|(_, v)| *v),
        }),
        body: ReplyBody::Read(body),
    }
}

/// The report the worker sends on its next sync turn (backed off or not),
/// and the call's token.
pub(crate) fn next_report(host: &FakeHost, w: &mut Worker) -> (sluice_wire::sync::SyncReport, u32) {
    let before = host.calls.borrow().len();
    for _ in 0..10 {
        host.advance_ms(1000);
        w.on_tick(host);
        let calls = host.calls.borrow();
        if calls.len() > before {
            let body = &calls.last().expect("a sync call").2;
            let token = u32::try_from(calls.len()).expect("few calls");
            return (serde_json::from_slice(body).expect("a report"), token);
        }
    }
    panic!("no sync call in 10 s");
}

pub(crate) fn answer(
    host: &FakeHost,
    w: &mut Worker,
    token: u32,
    status: u16,
    budgets: Option<&[u8]>,
) {
    let r = reply_with(Some(status), &[(BUDGETS_HEADER, budgets)], None);
    w.on_sync_reply(host, token, r);
}

pub(crate) fn sync_settings() -> crate::sync::SyncSettings {
    crate::sync::SyncSettings {
        instance: "unit".into(),
        cluster: "sluice_admin".into(),
        authority: "sluice-admin".into(),
        interval: Span::from_secs(1),
        token: Some("t0ken".into()),
        push: false,
    }
}

const TWO: &str = r#"{"version": 7, "policies": [
    {"name": "bank", "match": {"host": "api.bank.example"}, "rate": {"requests": 10, "period": "1s", "burst": 5}},
    {"name": "maps", "match": {"host": "api.maps.example"}, "rate": {"requests": 1, "period": "1s", "burst": 1}}]}"#;

#[test]
fn one_worker_syncs_all_install_and_unchanged_policies_keep_their_state() {
    let host = FakeHost::at(T0);
    let mut a = worker(&host, RATE);
    let mut b = worker(&host, RATE);
    a.set_sync(Some(sync_settings()));
    b.set_sync(Some(sync_settings()));
    // Use up bank's burst before the change.
    let r = req(b"api.bank.example", &[]);
    for i in 0..5 {
        assert_eq!(a.on_request(&host, i, r.as_slice()), Verdict::Continue);
    }
    a.on_tick(&host);
    b.on_tick(&host);
    let calls = host.calls.borrow().clone();
    assert_eq!(calls.len(), 1, "one sync per interval for the whole Envoy");
    let (cluster, headers, body) = &calls[0];
    assert_eq!(cluster, "sluice_admin");
    assert!(headers.contains(&("authorization".into(), "Bearer t0ken".into())));
    let report: sluice_wire::sync::SyncReport = serde_json::from_slice(body).unwrap();
    assert_eq!(report.policy_version, 0, "still on the fallback");
    assert_eq!(
        report.policies["bank"].counts[crate::metrics::PolicyCounter::Admitted],
        5
    );
    assert_eq!(report.policies["bank"].tokens, Some(0));

    // Garbage from the admin: nothing changes, the failure is counted.
    a.on_sync_reply(&host, 1, reply(Some(200), None, Some(b"<html>oops</html>")));
    assert_eq!(a.admin_version(), 0);
    assert_eq!(a.policies().policies.len(), 1);
    // A real answer, on the next turn: one failure waits the interval.
    host.advance_ms(999);
    a.on_tick(&host);
    assert_eq!(host.calls.borrow().len(), 1, "not before the interval");
    host.advance_ms(1);
    a.on_tick(&host);
    b.on_tick(&host);
    assert_eq!(host.calls.borrow().len(), 2);
    a.on_sync_reply(&host, 2, reply(Some(200), None, Some(TWO.as_bytes())));
    b.on_tick(&host);
    assert_eq!((a.admin_version(), b.admin_version()), (7, 7));
    assert_eq!(b.policies().policies.len(), 2);
    let m = req(b"api.maps.example", &[]);
    assert_eq!(b.on_request(&host, 50, m.as_slice()), Verdict::Continue);
    assert!(matches!(
        b.on_request(&host, 51, m.as_slice()),
        Verdict::Reply(_)
    ));
    a.on_tick(&host);
    assert_eq!(host.metric("sluice.sync_failures"), 1);
    assert_eq!(host.metric("sluice.sync_ok"), 1);
    assert_eq!(
        host.metric("sluice.sync_sets"),
        1,
        "one set, brought by a sync"
    );
    assert_eq!(
        host.metric("sluice.policy_sets_installed"),
        2,
        "each worker installed it once"
    );
}

#[test]
fn an_unchanged_policy_keeps_its_spent_tokens_across_a_new_set() {
    let host = FakeHost::at(T0);
    let mut a = worker(&host, TWO);
    let r = req(b"api.bank.example", &[]);
    for i in 0..5 {
        assert_eq!(a.on_request(&host, i, r.as_slice()), Verdict::Continue);
    }
    // Only maps changes.
    let edited = TWO.replace(r#""version": 7"#, r#""version": 8"#).replace(
        r#""requests": 1, "period": "1s", "burst": 1"#,
        r#""requests": 5, "period": "1s", "burst": 5"#,
    );
    let mut store = Store::default();
    let set = sluice_shared::parse_policy_set(&edited).unwrap();
    let id = crate::sync::SetId {
        epoch: 0,
        version: set.version,
    };
    assert_eq!(
        crate::sync::publish(&host, &mut store, id, &set).unwrap(),
        crate::sync::Published::Stored
    );
    a.on_tick(&host);
    assert_eq!(a.admin_version(), 8);
    assert!(
        matches!(a.on_request(&host, 9, r.as_slice()), Verdict::Reply(_)),
        "bank's burst is still spent"
    );
}

/// Shared-data writes so far (each write bumps its key's CAS token).
fn shared_writes(host: &FakeHost) -> u64 {
    host.shared
        .borrow()
        .values()
        .map(|(_, cas)| u64::from(*cas))
        .sum()
}

/// Slots in use in the bucket of policy `policy` (None: no bucket yet).
fn bucket_in_flight(host: &FakeHost, policy: &str) -> Option<u32> {
    host.shared
        .borrow()
        .iter()
        .find(|(k, _)| k.contains(policy))
        .map(|(_, (v, _))| {
            BucketState::decode(v)
                .unwrap_or_default()
                .leases
                .in_flight()
        })
}

#[test]
fn far_from_its_limit_a_busy_worker_spends_prefetched_tokens_without_shared_data() {
    let policies = r#"{"version": 1, "policies": [
        {"name": "busy", "match": {"host": "*"}, "rate": {"requests": 1000000, "period": "1s", "burst": 10000}}]}"#;
    let host = FakeHost::at(T0);
    let mut w = worker(&host, policies);
    let r = req(b"api.example", &[]);
    let before = shared_writes(&host);
    for ctx in 0..1000 {
        assert_eq!(w.on_request(&host, ctx, r.as_slice()), Verdict::Continue);
        host.now.set(host.now.get() + Span::from_nanos(2_000)); // 500 000 requests/s
    }
    let writes = shared_writes(&host) - before;
    w.on_tick(&host);
    assert_eq!(host.metric("sluice.policy.busy.admitted"), 1000);
    assert!(
        writes <= 40,
        "1000 requests took {writes} shared-data writes"
    );
}

/// 1000 requests 10 ms apart with the worker's clock at `scale` of real
/// time: the shared-data writes they took, and the tick period the worker
/// last asked Envoy for (while it held prefetched slots, if it did).
fn writes_and_tick_at_scale(scale: f64) -> (u64, Span) {
    let policies = r#"{"version": 1, "policies": [
        {"name": "busy", "match": {"host": "*"}, "rate": {"requests": 1000000, "period": "1s", "burst": 10000},
         "concurrency": {"max_in_flight": 100000}}]}"#;
    let host = FakeHost::at(T0);
    let mut w = worker(&host, policies);
    w.set_time_scale(scale);
    let r = req(b"api.example", &[]);
    let before = shared_writes(&host);
    for ctx in 0..1000 {
        assert_eq!(w.on_request(&host, ctx, r.as_slice()), Verdict::Continue);
        w.on_stream_end(&host, ctx);
        host.now.set(host.now.get() + Span::from_millis(10));
    }
    (shared_writes(&host) - before, host.tick.get())
}

#[test]
fn a_slowed_clock_makes_a_slow_envoy_take_prefetches_as_a_fast_one_does() {
    // 100 requests/s: a prefetch lives 5 ms, so every call finds it lapsed.
    let (real_writes, _) = writes_and_tick_at_scale(1.0);
    // Slowed 50 times, the worker sees 5 000 requests/s.
    let (slowed_writes, slowed_tick) = writes_and_tick_at_scale(0.02);
    assert!(
        real_writes >= 900 && slowed_writes * 10 <= real_writes,
        "real time: {real_writes} writes, slowed: {slowed_writes}"
    );
    assert_eq!(
        slowed_tick,
        Span::from_millis(crate::worker::PREFETCH_TICK.as_millis() * 50),
        "the tick is stretched too"
    );
}

#[test]
fn far_from_its_limits_densely_coming_requests_read_the_clock_once_in_four() {
    let policies = r#"{"version": 1, "policies": [
        {"name": "busy", "match": {"host": "*"}, "rate": {"requests": 100000000, "period": "1s", "burst": 1000000},
         "concurrency": {"max_in_flight": 100000}}]}"#;
    let host = FakeHost::at(T0);
    let mut w = worker(&host, policies);
    let r = req(b"api.example", &[]);
    let mut next = 0u32;
    let mut call = |w: &mut Worker| {
        assert_eq!(w.on_request(&host, next, r.as_slice()), Verdict::Continue);
        w.on_stream_end(&host, next);
        next += 1;
        // 20 000 requests/s, 4 at a time: a prefetch covers 20.
        host.now.set(host.now.get() + Span::from_nanos(50_000));
    };
    for _ in 0..100 {
        call(&mut w);
    }
    host.host_calls.borrow_mut().clear();
    for _ in 0..1000 {
        call(&mut w);
    }
    let calls = host.host_calls.borrow().clone();
    let of = |call| calls.get(call).copied().unwrap_or(0);
    // A clock read per MAX_REUSES + 1 requests spending a prefetch (none at
    // their end), and one before each round to shared data (one per
    // prefetch, 1 ms, 20 requests, its spare slots given back in the same
    // write); nothing else.
    let reads_for_prefetches = 1000 / u64::from(crate::clock::MAX_REUSES + 1);
    assert!(
        of("now") <= reads_for_prefetches + of("shared_set"),
        "{calls:?}"
    );
    assert!(
        of("shared_get") <= 55 && of("shared_set") <= 55,
        "{calls:?}"
    );
    assert_eq!(
        host.host_calls_made(),
        of("now") + of("shared_get") + of("shared_set"),
        "{calls:?}"
    );
}

/// A rate no test comes near: every call after the first few spends a
/// prefetch.
const FAR_RATE: &str = r#"{"version": 1, "policies": [
    {"name": "busy", "match": {"host": "*"}, "rate": {"requests": 100000000, "period": "1s", "burst": 1000000}}]}"#;

#[test]
fn after_a_pause_a_lapsed_prefetch_serves_at_most_the_calls_that_reuse_a_reading() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, FAR_RATE);
    let r = req(b"api.example", &[]);
    // Dense calls, 50 µs apart, until a prefetch of 64 is in hand.
    let mut ctx = 0u32;
    for _ in 0..300 {
        assert_eq!(w.on_request(&host, ctx, r.as_slice()), Verdict::Continue);
        ctx += 1;
        host.now.set(host.now.get() + Span::from_nanos(50_000));
    }
    // Whatever the state of reuse, at most MAX_REUSES more calls go by
    // the last reading; the prefetch then has tokens to spare.
    host.advance_ms(1000);
    let calls_before_shared_data = (0..10)
        .take_while(|_| {
            let before = shared_writes(&host);
            assert_eq!(w.on_request(&host, ctx, r.as_slice()), Verdict::Continue);
            ctx += 1;
            shared_writes(&host) == before
        })
        .count();
    assert!(
        calls_before_shared_data <= crate::clock::MAX_REUSES as usize,
        "{calls_before_shared_data} calls spent a prefetch that lapsed a second ago"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Workers deciding some calls on a reused reading of their clock stay
    /// within `burst + rate·(T + PREFETCH_TTL)` over any interval T, plus
    /// at most MAX_REUSES calls per worker spending a prefetch that lapsed
    /// since the reading: whether calls come densely, sparsely or pause.
    #[test]
    fn calls_on_a_reused_reading_stay_within_the_bound_plus_the_reuses(
        requests in 1_000u64..=5_000,
        burst in 100u64..=400,
        calls in prop::collection::vec(
            (
                prop_oneof![20 => 1_000u64..100_000, 1 => 5_000_000u64..40_000_000],
                prop_oneof![1 => Just(0usize), 4 => 1usize..3],
            ),
            1..600,
        ),
    ) {
        use sluice_filter_core::bucket::PREFETCH_TTL;
        const WORKERS: usize = 3;
        let policies = format!(r#"{{"version": 1, "policies": [
            {{"name": "busy", "match": {{"host": "*"}}, "rate": {{"requests": {requests}, "period": "1s", "burst": {burst}}}}}]}}"#);
        let host = FakeHost::at(T0);
        let mut workers: Vec<Worker> = (0..WORKERS).map(|_| worker(&host, &policies)).collect();
        let mut last_tick = [T0; WORKERS];
        let r = req(b"api.example", &[]);
        let mut admitted: Vec<u64> = Vec::new();
        for (ctx, (gap, at)) in calls.into_iter().enumerate() {
            host.now.set(host.now.get() + Span::from_nanos(gap));
            let now = host.now.get();
            if now - last_tick[at] >= Span::from_millis(100) {
                workers[at].on_tick(&host);
                last_tick[at] = now;
            }
            if workers[at].on_request(&host, ctx as u32, r.as_slice()) == Verdict::Continue {
                admitted.push((now - T0).as_nanos());
            }
        }
        let extra = (WORKERS as u64) * u64::from(crate::clock::MAX_REUSES);
        let slack = u128::from(PREFETCH_TTL.as_nanos());
        for i in 0..admitted.len() {
            for j in i..admitted.len() {
                let n = (j - i + 1) as u128;
                let dt = u128::from(admitted[j] - admitted[i]) + slack;
                let bound_ns = u128::from(burst + extra) * 1_000_000_000 + u128::from(requests) * dt;
                prop_assert!(
                    n * 1_000_000_000 <= bound_ns,
                    "{n} calls in {dt} ns: bound {burst} + {extra} + {requests}/s"
                );
            }
        }
    }
}

#[test]
fn calls_coming_sparsely_read_the_clock_each_even_while_a_prefetch_serves_them() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, FAR_RATE);
    let r = req(b"api.example", &[]);
    // 2 ms apart: a prefetch (5 ms) serves some calls, each on a fresh reading.
    for ctx in 0..100 {
        assert_eq!(w.on_request(&host, ctx, r.as_slice()), Verdict::Continue);
        host.advance_ms(2);
    }
    let calls = host.host_calls.borrow().clone();
    let of = |call| calls.get(call).copied().unwrap_or(0);
    assert!(of("shared_set") < 90, "prefetches served some: {calls:?}");
    assert!(of("now") >= 100, "{calls:?}");
}

#[test]
fn near_its_limit_every_request_is_decided_in_shared_data() {
    let host = FakeHost::at(T0);
    let mut a = worker(&host, RATE);
    let mut b = worker(&host, RATE);
    let r = req(b"api.bank.example", &[]);
    // Burst 5: a bucket of 5 never holds 4 times a prefetch of 2, so each of
    // the 5 is a shared-data write, and the sixth is refused.
    for ctx in 1..=5 {
        let w = if ctx % 2 == 0 { &mut a } else { &mut b };
        assert_eq!(w.on_request(&host, ctx, r.as_slice()), Verdict::Continue);
    }
    assert_eq!(status(&a.on_request(&host, 6, r.as_slice())), 429);
    assert_eq!(status(&b.on_request(&host, 7, r.as_slice())), 429);
}

#[test]
fn far_from_its_limits_a_worker_reuses_prefetched_slots_and_gives_spares_back() {
    let policies = r#"{"version": 1, "policies": [
        {"name": "busy", "match": {"host": "*"}, "rate": {"requests": 1000000, "period": "1s", "burst": 10000},
         "concurrency": {"max_in_flight": 1000}}]}"#;
    let host = FakeHost::at(T0);
    let mut a = worker(&host, policies);
    let mut b = worker(&host, policies);
    let r = req(b"api.example", &[]);
    let before = shared_writes(&host);
    // Each worker: requests of 10 µs, 5 in flight at a time.
    for ctx in 0..2000u32 {
        let w = if ctx % 2 == 0 { &mut a } else { &mut b };
        assert_eq!(w.on_request(&host, ctx, r.as_slice()), Verdict::Continue);
        if ctx >= 10 {
            w.on_stream_end(&host, ctx - 10);
        }
        host.now.set(host.now.get() + Span::from_nanos(1_000));
    }
    let writes = shared_writes(&host) - before;
    for ctx in 1990..2000u32 {
        let w = if ctx % 2 == 0 { &mut a } else { &mut b };
        w.on_stream_end(&host, ctx);
    }
    assert!(
        writes <= 200,
        "2000 requests took {writes} shared-data writes"
    );
    // Spares lapse and go back on the next tick: nothing stays held.
    host.advance_ms(20);
    a.on_tick(&host);
    b.on_tick(&host);
    assert_eq!(bucket_in_flight(&host, "busy"), Some(0));
    assert_eq!(host.metric("sluice.policy.busy.admitted"), 2000);
    assert_eq!(host.metric("sluice.policy.busy.in_flight"), 0);
}

#[test]
fn near_its_rate_limit_with_slots_to_spare_a_call_is_one_round_to_shared_data() {
    // Every call is decided in shared data (burst 3); its slot, of 1 000,
    // goes back with the next call's write, not in a write of its own.
    let policies = r#"{"version": 1, "policies": [
        {"name": "busy", "match": {"host": "*"}, "rate": {"requests": 100000000, "period": "1s", "burst": 3},
         "concurrency": {"max_in_flight": 1000}}]}"#;
    let host = FakeHost::at(T0);
    let mut a = worker(&host, policies);
    let mut b = worker(&host, policies);
    let r = req(b"api.example", &[]);
    let (before, reads_before) = (shared_writes(&host), host.host_calls_of("shared_get"));
    for ctx in 0..1000u32 {
        let w = if ctx % 2 == 0 { &mut a } else { &mut b };
        assert_eq!(w.on_request(&host, ctx, r.as_slice()), Verdict::Continue);
        w.on_stream_end(&host, ctx);
        host.now.set(host.now.get() + Span::from_nanos(100_000));
    }
    let writes = shared_writes(&host) - before;
    let reads = host.host_calls_of("shared_get") - reads_before;
    assert!(
        writes <= 1010 && reads <= 1010,
        "1000 calls took {writes} writes and {reads} reads"
    );
    let in_flight = || bucket_in_flight(&host, "busy");
    assert!(
        in_flight().is_some_and(|n| n <= 2),
        "at most each worker's last slot is kept: {:?}",
        in_flight()
    );
    // Kept slots lapse with their prefetch and go back on the next tick.
    host.advance_ms(20);
    a.on_tick(&host);
    b.on_tick(&host);
    assert_eq!(in_flight(), Some(0));
    assert_eq!(host.metric("sluice.policy.busy.in_flight"), 0);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]
    /// Slots kept aside by workers (prefetched, or a finished call's kept
    /// for the next write) never let more calls run at once than the
    /// limit, near or far from the rate limit, and every slot is back in
    /// the bucket after the calls end and a tick passes.
    #[test]
    fn workers_keeping_slots_never_run_more_calls_than_the_limit(
        max_in_flight in 1u32..=12,
        burst in prop_oneof![Just(3u64), Just(1_000_000)],
        steps in prop::collection::vec((0usize..3, 0u8..10, 1u64..400_000), 1..400),
    ) {
        let policies = format!(r#"{{"version": 1, "policies": [
            {{"name": "busy", "match": {{"host": "*"}}, "rate": {{"requests": 100000000, "period": "1s", "burst": {burst}}},
             "concurrency": {{"max_in_flight": {max_in_flight}}}}}]}}"#);
        let host = FakeHost::at(T0);
        let mut workers: Vec<Worker> = (0..3).map(|_| worker(&host, &policies)).collect();
        let mut running: Vec<Vec<u32>> = vec![Vec::new(); 3];
        let r = req(b"api.example", &[]);
        for (ctx, (at, op, gap)) in steps.into_iter().enumerate() {
            host.now.set(host.now.get() + Span::from_nanos(gap));
            let w = &mut workers[at];
            match op {
                0..=4 => {
                    if w.on_request(&host, ctx as u32, r.as_slice()) == Verdict::Continue {
                        running[at].push(ctx as u32);
                    }
                }
                5..=8 => {
                    if !running[at].is_empty() {
                        let i = usize::from(op) % running[at].len();
                        let ended = running[at].swap_remove(i);
                        w.on_stream_end(&host, ended);
                    }
                }
                _ => {
                    w.on_tick(&host);
                }
            }
            let now_running: usize = running.iter().map(Vec::len).sum();
            prop_assert!(now_running <= max_in_flight as usize, "{now_running} running, limit {max_in_flight}");
        }
        for (at, w) in workers.iter_mut().enumerate() {
            for ended in running[at].drain(..) {
                w.on_stream_end(&host, ended);
            }
        }
        host.advance_ms(25);
        for w in &mut workers {
            w.on_tick(&host);
        }
        let in_flight = bucket_in_flight(&host, "busy");
        prop_assert!(in_flight.unwrap_or(0) == 0, "{in_flight:?} still held");
    }
}

#[test]
fn near_its_concurrency_limit_no_slot_is_kept_aside() {
    let policies = r#"{"version": 1, "policies": [
        {"name": "c", "match": {"host": "*"}, "concurrency": {"max_in_flight": 4}}]}"#;
    let host = FakeHost::at(T0);
    let mut a = worker(&host, policies);
    let mut b = worker(&host, policies);
    let r = req(b"x", &[]);
    // 4 slots between two workers: each request takes exactly one.
    for ctx in 1..=4 {
        let w = if ctx % 2 == 0 { &mut a } else { &mut b };
        assert_eq!(
            w.on_request(&host, ctx, r.as_slice()),
            Verdict::Continue,
            "ctx {ctx}"
        );
    }
    assert_eq!(status(&a.on_request(&host, 5, r.as_slice())), 429);
}

#[test]
fn slots_of_requests_decided_in_shared_data_always_go_back() {
    // Near its limit nothing is prefetched; slots that end while this worker
    // remembers using the bucket must still reach the bucket.
    let policies = r#"{"version": 1, "policies": [
        {"name": "c", "match": {"host": "*"}, "concurrency": {"max_in_flight": 4}}]}"#;
    let host = FakeHost::at(T0);
    let mut a = worker(&host, policies);
    let r = req(b"x", &[]);
    for round in 0..3u32 {
        for ctx in 0..4 {
            assert_eq!(
                a.on_request(&host, round * 10 + ctx, r.as_slice()),
                Verdict::Continue,
                "round {round}"
            );
        }
        assert_eq!(
            status(&a.on_request(&host, round * 10 + 9, r.as_slice())),
            429
        );
        for ctx in 0..4 {
            a.on_stream_end(&host, round * 10 + ctx);
        }
        host.advance_ms(20);
        a.on_tick(&host);
    }
}

const GLOBAL: &str = r#"{"version": 1, "policies": [
    {"name": "llm", "match": {"host": "api.llm.example"}, "scope": "global", "share_lease": "2s",
     "rate": {"requests": 300, "period": "1s", "burst": 30}, "concurrency": {"max_in_flight": 30}}]}"#;

#[test]
fn a_global_policy_applies_its_share_then_falls_back_when_the_lease_lapses() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, GLOBAL);
    let r = req(b"api.llm.example", &[]);
    // No admin configured: nothing to share with, the whole limit applies.
    assert_eq!(w.on_request(&host, 1, r.as_slice()), Verdict::Continue);
    w.on_stream_end(&host, 1);
    w.set_sync(Some(sync_settings()));
    w.on_tick(&host);
    // Syncing, but no share leased yet: refused without touching a bucket.
    assert_eq!(status(&w.on_request(&host, 2, r.as_slice())), 429);
    // The admin leases 3 slots (and 100/s, a burst of 10) for 2 s.
    let header =
        br#"{"llm": {"rate": 100, "in_flight": 3, "lease_ms": 2000, "instances": 10, "id": 77}}"#;
    w.on_sync_reply(&host, 1, reply(Some(304), Some(header), None));
    let admitted = (10..20)
        .filter(|&i| w.on_request(&host, i, r.as_slice()) == Verdict::Continue)
        .count();
    assert_eq!(admitted, 3, "three slots");
    for i in 10..20 {
        w.on_stream_end(&host, i);
    }
    // The report names the share it applies.
    host.advance_ms(1000);
    w.on_tick(&host);
    let calls = host.calls.borrow().clone();
    let report: sluice_wire::sync::SyncReport =
        serde_json::from_slice(&calls.last().unwrap().2).unwrap();
    assert_eq!(report.shares.get("llm"), Some(&77));
    // And describes it, for an admin that lost its record of it.
    let held = report.held.get("llm").copied();
    assert_eq!(
        held.map(|h| (h.rate, h.in_flight, h.instances)),
        Some((100.0, 3, 10))
    );
    // The admin is gone; 2 s after the report was sent the lease lapses and
    // the share falls back to min(share, limit / 10): 3 slots still, 30/s.
    pass(&host, &mut w, 1500);
    let p = &w.policies().policies[0];
    assert_eq!(p.concurrency.map(|c| c.max_in_flight), Some(3));
    assert!(!p.fleet_closed);
    // A header that does not parse changes nothing and is counted.
    w.on_sync_reply(&host, 2, reply(Some(304), Some(b"garbage"), None));
    assert_eq!(
        w.policies().policies[0]
            .concurrency
            .map(|c| c.max_in_flight),
        Some(3)
    );
}

/// Found by the simulator (fleet_shares::a_paused_envoy_never_costs_the_limit,
/// seed 773): an Envoy stopped for 5.6 s came back to its fallback, 145/s,
/// while the admin, taking it for dead, had given the other Envoy the whole
/// 290/s; the provider refused 3 calls before its next sync answered.
#[test]
fn a_share_that_lapses_while_the_worker_is_stalled_gives_nothing_until_the_next_share() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, GLOBAL);
    let r = req(b"api.llm.example", &[]);
    w.set_sync(Some(sync_settings()));
    w.on_tick(&host);
    let share = |id: u32| {
        format!(
            r#"{{"llm": {{"rate": 100, "in_flight": 3, "lease_ms": 2000, "instances": 10, "id": {id}}}}}"#
        )
    };
    w.on_sync_reply(&host, 1, reply(Some(304), Some(share(77).as_bytes()), None));
    assert_eq!(w.on_request(&host, 10, r.as_slice()), Verdict::Continue);
    w.on_stream_end(&host, 10);
    // Stopped for 5 s (no tick): the lease lapsed unseen.
    host.advance_ms(5_000);
    w.on_tick(&host);
    assert!(
        w.policies().policies[0].fleet_closed,
        "nothing of a share that lapsed asleep"
    );
    assert_eq!(status(&w.on_request(&host, 11, r.as_slice())), 429);
    // Still nothing a tick later: not a fallback once the stall is over.
    host.advance_ms(100);
    w.on_tick(&host);
    assert_eq!(status(&w.on_request(&host, 12, r.as_slice())), 429);
    // The sync the waking tick sent brings a share: it applies.
    let token = host.calls.borrow().len() as u32;
    w.on_sync_reply(
        &host,
        token,
        reply(Some(304), Some(share(78).as_bytes()), None),
    );
    let p = &w.policies().policies[0];
    assert!(!p.fleet_closed);
    assert_eq!(p.concurrency.map(|c| c.max_in_flight), Some(3));
    assert_eq!(w.on_request(&host, 13, r.as_slice()), Verdict::Continue);
}

#[test]
fn a_share_that_moves_a_little_each_sync_admits_what_it_allows() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, GLOBAL);
    w.set_sync(Some(crate::sync::SyncSettings {
        interval: Span::from_millis(200),
        ..sync_settings()
    }));
    let r = req(b"api.llm.example", &[]);
    let mut admitted = 0;
    let mut stream = 100;
    // 10 s of calls every 100 ms (10/s) against a share that moves between
    // 9.7/s and 10.3/s at every 200 ms sync.
    for step in 0..100u32 {
        if step % 2 == 0 {
            w.on_tick(&host);
            let token = host.calls.borrow().len() as u32;
            let rate = if step % 4 == 0 { 9.7 } else { 10.3 };
            let header = format!(
                r#"{{"llm": {{"rate": {rate}, "in_flight": 5, "lease_ms": 2000, "instances": 2, "id": {}}}}}"#,
                1000 + step
            );
            w.on_sync_reply(
                &host,
                token,
                reply(Some(304), Some(header.as_bytes()), None),
            );
        }
        stream += 1;
        if w.on_request(&host, stream, r.as_slice()) == Verdict::Continue {
            admitted += 1;
        }
        w.on_stream_end(&host, stream);
        host.advance_ms(100);
    }
    assert!(
        admitted >= 95,
        "admitted {admitted} of 100 within a ~10/s share"
    );
}

#[test]
fn a_cost_above_the_shares_burst_is_refused_even_from_a_full_bucket() {
    let policies = r#"{"version": 1, "policies": [
        {"name": "llm", "match": {"host": "api.llm.example"}, "scope": "global", "share_lease": "2s",
         "rate": {"requests": 300, "period": "1s", "burst": 30}, "cost": {"header": "x-cost", "max": 10}}]}"#;
    let host = FakeHost::at(T0);
    let mut w = worker(&host, policies);
    w.set_sync(Some(sync_settings()));
    w.on_tick(&host);
    // A share of 10/s: its burst is 30 × 10/300 = 1, lifted to 2.
    let header =
        br#"{"llm": {"rate": 10, "in_flight": 0, "lease_ms": 2000, "instances": 30, "id": 5}}"#;
    w.on_sync_reply(&host, 1, reply(Some(304), Some(header), None));
    assert_eq!(w.policies().policies[0].share_burst(), Some(2));
    let costly = req(b"api.llm.example", &[("x-cost", b"5")]);
    let Verdict::Reply(refused) = w.on_request(&host, 1, costly.as_slice()) else {
        panic!("cost 5 never fits a burst of 2");
    };
    assert_eq!(refused.status, 429);
    assert!(refused
        .headers
        .contains(&("x-sluice-reason", "cost-above-share-burst".to_string())));
    let body = String::from_utf8_lossy(&refused.body);
    assert!(
        body.contains("costs 5") && body.contains("holds (2)"),
        "{body}"
    );
    let cheap = req(b"api.llm.example", &[("x-cost", b"2")]);
    assert_eq!(w.on_request(&host, 2, cheap.as_slice()), Verdict::Continue);
}

#[test]
fn a_step_back_of_the_wall_clock_does_not_stop_rate_limited_calls() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, RATE);
    let r = req(b"api.bank.example", &[]);
    for ctx in 0..5 {
        assert_eq!(w.on_request(&host, ctx, r.as_slice()), Verdict::Continue);
    }
    // The wall clock steps back an hour; calls keep coming at 10/s.
    host.now.set(host.now.get() - Span::from_secs(3600));
    let mut passed = 0;
    for ctx in 10..40u32 {
        host.advance_ms(100);
        if w.on_request(&host, ctx, r.as_slice()) == Verdict::Continue {
            passed += 1;
        }
        if ctx % 5 == 0 {
            w.on_tick(&host);
        }
    }
    // 3 s at 10/s (slewing back at a tenth: about 2.7 s of it).
    assert!(passed >= 25, "{passed} of 30 passed after the step back");
}

#[test]
fn a_step_forward_does_not_take_slots_from_calls_in_flight() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, SLOTS);
    let r = req(b"x", &[]);
    assert_eq!(w.on_request(&host, 1, r.as_slice()), Verdict::Continue);
    assert_eq!(w.on_request(&host, 2, r.as_slice()), Verdict::Continue);
    // An hour ahead at once: the leases (10 s) are not reclaimed, the
    // streams are not taken for stuck.
    host.now.set(host.now.get() + Span::from_secs(3600));
    w.on_tick(&host);
    assert_eq!(status(&w.on_request(&host, 3, r.as_slice())), 429);
    assert_eq!(w.in_flight(), 2);
    assert_eq!(host.metric("sluice.policy.llm.leases_expired"), 0);
}

#[test]
fn a_late_release_never_frees_a_newer_lease_of_the_same_worker() {
    let host = FakeHost::at(T0);
    let mut a = worker(&host, SLOTS);
    let mut b = worker(&host, SLOTS);
    let r = req(b"x", &[]);
    assert_eq!(a.on_request(&host, 1, r.as_slice()), Verdict::Continue);
    // Another worker reclaims a's lease (it lapsed while a stalled).
    let key = "sluice/b/llm";
    let mut state = BucketState::decode(&host.shared.borrow()[key].0).unwrap();
    state.leases = Default::default();
    host.shared
        .borrow_mut()
        .insert(key.into(), (state.encode(), 999_999));
    // a takes a new lease for a new request; then the first one ends.
    host.advance_ms(1);
    assert_eq!(a.on_request(&host, 2, r.as_slice()), Verdict::Continue);
    a.on_stream_end(&host, 1);
    // Request 2 still holds its slot: b gets one, not two.
    assert_eq!(b.on_request(&host, 3, r.as_slice()), Verdict::Continue);
    assert_eq!(status(&b.on_request(&host, 4, r.as_slice())), 429);
}

#[test]
fn a_share_does_not_outlive_its_lease_when_the_clock_steps_back() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, GLOBAL);
    w.set_sync(Some(sync_settings()));
    w.on_tick(&host);
    let header =
        br#"{"llm": {"rate": 100, "in_flight": 3, "lease_ms": 2000, "instances": 10, "id": 77}}"#;
    w.on_sync_reply(&host, 1, reply(Some(304), Some(header), None));
    // The wall clock steps back an hour; 3 s pass; the admin is away.
    host.now.set(host.now.get() - Span::from_secs(3600));
    for _ in 0..30 {
        host.advance_ms(100);
        w.on_tick(&host);
    }
    // The 2 s lease ran out on the filter's clock: the fallback holds
    // (min(3, 30 / 10) slots, 30/s), whatever the wall clock says.
    let p = &w.policies().policies[0];
    assert_eq!(p.concurrency.map(|c| c.max_in_flight), Some(3));
    let rate = p.rate.as_ref().map(|r| match r {
        sluice_shared::limiter::RateLimiter::TokenBucket(tb) => tb.burst(),
        _ => 0,
    });
    assert_eq!(
        rate,
        Some(3),
        "the fallback's burst (30/s of 300 × 30), not the share's (10)"
    );
}

const MANY_KEYS: &str = r#"{"version": 1, "policies": [
    {"name": "k", "match": {"host": "*"}, "key": {"header": "x-api-key", "max_keys": 1000},
     "rate": {"requests": 1, "period": "1s", "burst": 5}}]}"#;

/// The places in shared data a host's workers have written a bucket to.
fn key_places(host: &FakeHost) -> Vec<String> {
    let mut places: Vec<String> = host
        .shared
        .borrow()
        .keys()
        .filter(|k| k.starts_with("sluice/b/k/"))
        .cloned()
        .collect();
    places.sort();
    places
}

#[test]
fn every_worker_of_a_process_hashes_keys_with_one_secret_and_a_new_process_draws_another() {
    let host = FakeHost::at(T0);
    let mut a = worker(&host, MANY_KEYS);
    let mut b = worker(&host, MANY_KEYS);
    let alice = req(b"x", &[("x-api-key", b"alice")]);
    assert_eq!(a.on_request(&host, 1, alice.as_slice()), Verdict::Continue);
    let first = key_places(&host);
    assert_eq!(first.len(), 1, "{first:?}");
    assert_eq!(b.on_request(&host, 2, alice.as_slice()), Verdict::Continue);
    assert_eq!(
        key_places(&host),
        first,
        "both workers use alice's one bucket"
    );
    let stored = host.shared.borrow().get("sluice/key-secret").cloned();
    assert_eq!(stored.map(|(bytes, _)| bytes.len()), Some(16));

    let other_process = FakeHost::at(T0);
    other_process.random_state.set(0x5eed);
    let mut c = worker(&other_process, MANY_KEYS);
    assert_eq!(
        c.on_request(&other_process, 1, alice.as_slice()),
        Verdict::Continue
    );
    assert_ne!(
        key_places(&other_process),
        first,
        "a new secret puts alice elsewhere"
    );
}

#[test]
fn a_broken_secret_in_shared_data_is_replaced_not_trusted() {
    let host = FakeHost::at(T0);
    host.shared
        .borrow_mut()
        .insert("sluice/key-secret".into(), (b"short".to_vec(), 1));
    let mut w = worker(&host, MANY_KEYS);
    let alice = req(b"x", &[("x-api-key", b"alice")]);
    assert_eq!(w.on_request(&host, 1, alice.as_slice()), Verdict::Continue);
    let stored = host.shared.borrow().get("sluice/key-secret").cloned();
    assert_eq!(stored.map(|(bytes, _)| bytes.len()), Some(16));
}

#[test]
fn without_a_random_source_keys_still_get_a_secret_and_the_log_says_it_is_weak() {
    let host = FakeHost::at(T0);
    host.random_fails.set(true);
    let mut w = worker(&host, MANY_KEYS);
    let alice = req(b"x", &[("x-api-key", b"alice")]);
    assert_eq!(w.on_request(&host, 1, alice.as_slice()), Verdict::Continue);
    assert!(
        host.logs
            .borrow()
            .iter()
            .any(|l| l.contains("no random bytes")),
        "{:?}",
        host.logs.borrow()
    );
    assert_eq!(key_places(&host).len(), 1);
}

/// 1 000 keys through a policy of 16 places: shared data holds at most
/// the 16 places and the overflow bucket, idle places are taken over
/// (counted as evictions of that policy), nothing else is left behind.
#[test]
fn many_keys_reuse_the_policys_places_and_leave_nothing_behind() {
    let policies = r#"{"version": 1, "policies": [
        {"name": "k", "match": {"host": "*"}, "key": {"header": "x-api-key", "max_keys": 16},
         "rate": {"requests": 10, "period": "1s", "burst": 1}}]}"#;
    let host = FakeHost::at(T0);
    let mut w = worker(&host, policies);
    let before = host.shared.borrow().len();
    for i in 0..1_000u32 {
        let key = format!("tenant-{i}");
        let extra = [("x-api-key", key.as_bytes())];
        let r = req(b"x", &extra);
        let _ = w.on_request(&host, i, r.as_slice());
        // 10 ms apart: a place is idle again 100 ms after its last call.
        pass(&host, &mut w, 10);
    }
    let places: Vec<String> = host
        .shared
        .borrow()
        .keys()
        .filter(|k| k.starts_with("sluice/b/k"))
        .cloned()
        .collect();
    assert!(places.len() <= 17, "{places:?}");
    assert!(host.shared.borrow().len() <= before + 17);
    let (evicted, overflowed) = (
        host.metric("sluice.policy.k.key_evictions"),
        host.metric("sluice.policy.k.key_overflow"),
    );
    assert!(
        evicted > 500,
        "{evicted} evictions, {overflowed} overflowed"
    );
    assert_eq!(
        evicted + overflowed + 16,
        1_000,
        "every key placed or overflowed"
    );
}

/// Per key 2 per minute (the policy's `rate`) and the company 5 per minute
/// (a further limit): the company limit holds across keys, and a call the
/// per-key bucket refuses gives the company limit its token back.
const PER_KEY_AND_COMPANY: &str = r#"{"version": 1, "policies": [
    {"name": "llm", "match": {"host": "api.llm.example"}, "key": {"header": "x-api-key"},
     "rate": {"requests": 2, "period": "1m"},
     "limits": [{"name": "company", "rate": {"requests": 5, "period": "1m"}}]}]}"#;

#[test]
fn a_company_limit_holds_across_keys_and_refusals_by_the_key_give_its_tokens_back() {
    let host = FakeHost::at(T0);
    let mut a = worker(&host, PER_KEY_AND_COMPANY);
    let mut b = worker(&host, PER_KEY_AND_COMPANY);
    let call = |w: &mut Worker, id: u32, key: &'static [u8]| {
        w.on_request(
            &host,
            id,
            req(b"api.llm.example", &[("x-api-key", key)]).as_slice(),
        )
    };
    // Key k1: 2 pass, then its own bucket refuses 3 times (no company
    // token kept for them).
    for id in 0..5u32 {
        let v = call(&mut a, id, b"k1");
        assert_eq!(status(&v), if id < 2 { 200 } else { 429 }, "call {id}");
        if let Verdict::Reply(r) = &v {
            assert!(
                !r.headers.iter().any(|(k, _)| *k == "x-sluice-limit"),
                "refused by the key's bucket, not the company limit"
            );
        }
    }
    // k2 and k3 on the other worker: 3 more reach the company's 5.
    let statuses: Vec<u32> = [b"k2", b"k2", b"k3", b"k3"]
        .iter()
        .enumerate()
        .map(|(i, k)| status(&call(&mut b, 10 + i as u32, k.as_slice())))
        .collect();
    assert_eq!(statuses, vec![200, 200, 200, 429]);
    let Verdict::Reply(reply) = call(&mut a, 20, b"k4") else {
        panic!("the company limit must refuse");
    };
    let header = |n: &str| {
        reply
            .headers
            .iter()
            .find(|(k, _)| *k == n)
            .map(|(_, v)| v.as_str())
    };
    assert_eq!(header("x-sluice-limit"), Some("company"));
    // One company token every 12 s.
    let retry: u64 = header("retry-after")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    assert!((11..=12).contains(&retry), "retry-after {retry}");
    assert!(String::from_utf8_lossy(&reply.body).contains("limit company"));
    assert_eq!(
        header("ratelimit-policy"),
        Some("\"llm\";q=2;w=60, \"company\";q=5;w=60")
    );
    assert_eq!(
        header("ratelimit"),
        Some(format!("\"company\";r=0;t={retry}").as_str())
    );
    assert_eq!(header("content-type"), Some("text/plain; charset=utf-8"));
    a.on_tick(&host);
    b.on_tick(&host);
    assert_eq!(host.metric("sluice.limit.company.admitted"), 5);
    assert_eq!(host.metric("sluice.limit.company.tokens"), 5);
    assert_eq!(host.metric("sluice.limit.company.refused"), 2);
    assert_eq!(host.metric("sluice.policy.llm.admitted"), 5);
    assert_eq!(host.metric("sluice.policy.llm.rejected"), 5);
}

/// Shared data holding garbage where a further limit's state belongs: the
/// limit starts afresh and the call gets a defined answer.
#[test]
fn garbage_in_a_further_limits_state_starts_it_afresh() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, PER_KEY_AND_COMPANY);
    assert!(host
        .shared_set("sluice/l/company", b"\xff\x00garbage", None)
        .is_ok());
    let v = w.on_request(
        &host,
        1,
        req(b"api.llm.example", &[("x-api-key", b"k1")]).as_slice(),
    );
    assert_eq!(v, Verdict::Continue);
}

/// Counts go to a policy's own stats by an index found at install: a new
/// set that reorders the policies and adds one must not send a stream
/// admitted under the old set, nor a new call, to another policy's stats.
#[test]
fn stats_follow_their_policy_across_a_set_that_reorders_them() {
    let before = r#"{"version": 1, "policies": [
        {"name": "bank", "match": {"host": "api.bank.example"}, "concurrency": {"max_in_flight": 10}},
        {"name": "llm", "match": {"host": "api.llm.example"}, "rate": {"requests": 100, "period": "1s"}}]}"#;
    let after = r#"{"version": 2, "policies": [
        {"name": "llm", "match": {"host": "api.llm.example"}, "rate": {"requests": 100, "period": "1s"}},
        {"name": "bank", "match": {"host": "api.bank.example"}, "concurrency": {"max_in_flight": 10}},
        {"name": "new", "match": {"host": "api.new.example"}, "rate": {"requests": 100, "period": "1s"}}]}"#;
    let host = FakeHost::at(T0);
    let mut w = worker(&host, before);
    let bank = req(b"api.bank.example", &[]);
    let llm = req(b"api.llm.example", &[]);
    assert_eq!(w.on_request(&host, 1, bank.as_slice()), Verdict::Continue);
    assert_eq!(w.on_request(&host, 2, llm.as_slice()), Verdict::Continue);
    w.on_tick(&host);
    assert_eq!(host.metric("sluice.policy.bank.in_flight"), 1);
    let set = CompiledPolicySet::from_json(after).unwrap_or_else(|e| panic!("{e}"));
    w.install(&host, set);
    for context_id in [3, 5] {
        assert_eq!(
            w.on_request(&host, context_id, llm.as_slice()),
            Verdict::Continue
        );
    }
    assert_eq!(w.on_request(&host, 4, bank.as_slice()), Verdict::Continue);
    w.on_stream_end(&host, 1);
    w.on_tick(&host);
    assert_eq!(host.metric("sluice.policy.bank.admitted"), 2);
    assert_eq!(host.metric("sluice.policy.bank.in_flight"), 1);
    assert_eq!(host.metric("sluice.policy.llm.admitted"), 3);
    assert_eq!(host.metric("sluice.policy.llm.in_flight"), 0);
    assert_eq!(host.metric("sluice.policy.new.admitted"), 0);
}
