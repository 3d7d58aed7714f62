//! A further limit with `scope: global` beside a per-key policy: this
//! Envoy applies the share the admin leases it, as a global policy does.

use crate::testing::FakeHost;
use crate::tests::{reply, req, status, sync_settings, worker, T0};
use crate::worker::{Verdict, Worker};

const PER_KEY_AND_FLEET: &str = r#"{"version": 1, "policies": [
    {"name": "llm", "match": {"host": "api.llm.example"},
     "key": {"header": "x-api-key"}, "rate": {"requests": 100, "period": "1s", "burst": 100},
     "limits": [{"name": "fleet-wide", "scope": "global",
                 "rate": {"requests": 300, "period": "1s", "burst": 30}}]}]}"#;

fn admitted(host: &FakeHost, w: &mut Worker, from: u32, n: u32) -> u32 {
    let r = req(b"api.llm.example", &[("x-api-key", b"team-a")]);
    (from..from + n)
        .filter(|&id| w.on_request(host, id, r.as_slice()) == Verdict::Continue)
        .count() as u32
}

#[test]
fn a_global_limit_is_the_whole_limit_alone_nothing_before_its_share_then_the_share() {
    let host = FakeHost::at(T0);
    let mut w = worker(&host, PER_KEY_AND_FLEET);
    // No admin: nothing to share with, the whole limit (its burst of 30).
    assert_eq!(admitted(&host, &mut w, 1, 50), 30);

    let host = FakeHost::at(T0);
    let mut w = worker(&host, PER_KEY_AND_FLEET);
    w.set_sync(Some(sync_settings()));
    w.on_tick(&host);
    // Syncing, no share yet: the global limit refuses, naming itself.
    let r = req(b"api.llm.example", &[("x-api-key", b"team-a")]);
    let refused = w.on_request(&host, 100, r.as_slice());
    assert_eq!(status(&refused), 429);
    let Verdict::Reply(reply_of) = &refused else {
        panic!("{refused:?}")
    };
    assert!(reply_of
        .headers
        .iter()
        .any(|(n, v)| *n == "x-sluice-limit" && v == "fleet-wide"));
    // A share of 100/s of the 300/s: a burst of 10 of the 30.
    let header = br#"{"limits/fleet-wide": {"rate": 100, "in_flight": 0, "lease_ms": 3000, "instances": 3, "id": 5}}"#;
    w.on_sync_reply(&host, 1, reply(Some(304), Some(header), None));
    assert_eq!(admitted(&host, &mut w, 200, 50), 10);
    // The report names the share it applies, for an admin that lost it.
    host.advance_ms(1000);
    w.on_tick(&host);
    let calls = host.calls.borrow().clone();
    let report: sluice_wire::sync::SyncReport =
        serde_json::from_slice(&calls.last().expect("a sync").2).expect("a report");
    assert_eq!(report.shares.get("limits/fleet-wide"), Some(&5));
    assert_eq!(
        report.limits["fleet-wide"].counts[crate::metrics::LimitCounter::Admitted],
        10
    );
}

/// Requests and tokens for the whole fleet: a global policy (its own
/// share) with a global further limit (a share of its own).
const FLEET_REQUESTS_AND_TOKENS: &str = r#"{"version": 1, "policies": [
    {"name": "llm", "match": {"host": "api.llm.example"}, "scope": "global",
     "rate": {"requests": 100, "period": "1s", "burst": 40},
     "limits": [{"name": "fleet-tokens", "scope": "global",
                 "rate": {"requests": 3000, "period": "1s", "burst": 3000},
                 "cost": {"header": "x-tokens", "default": 100, "max": 1000}}]}]}"#;

#[test]
fn a_global_policy_and_its_global_limit_each_apply_their_own_share() {
    // Half the requests (a burst of 20 of 40) but a tenth of the tokens
    // (300 of 3000).
    let header = br#"{"llm": {"rate": 50, "in_flight": 0, "lease_ms": 3000, "instances": 2, "id": 7},
        "limits/fleet-tokens": {"rate": 300, "in_flight": 0, "lease_ms": 3000, "instances": 10, "id": 8}}"#;
    let shared = |host: &FakeHost| {
        let mut w = worker(host, FLEET_REQUESTS_AND_TOKENS);
        w.set_sync(Some(sync_settings()));
        w.on_tick(host);
        let r = req(b"api.llm.example", &[]);
        assert_eq!(
            status(&w.on_request(host, 1, r.as_slice())),
            429,
            "no share yet"
        );
        w.on_sync_reply(host, 1, reply(Some(304), Some(header), None));
        w
    };
    // Calls of 100 tokens: the tokens' share holds 3.
    let host = FakeHost::at(T0);
    let mut w = shared(&host);
    let costly = req(b"api.llm.example", &[]);
    let admitted = (10..60)
        .filter(|&id| w.on_request(&host, id, costly.as_slice()) == Verdict::Continue)
        .count();
    assert_eq!(admitted, 3);
    // Calls of 1 token: the requests' share holds 20.
    let host = FakeHost::at(T0);
    let mut w = shared(&host);
    let cheap = req(b"api.llm.example", &[("x-tokens", b"1")]);
    let admitted = (10..60)
        .filter(|&id| w.on_request(&host, id, cheap.as_slice()) == Verdict::Continue)
        .count();
    assert_eq!(admitted, 20);
}

/// The load moved here: a global policy's first refusal after a quiet
/// second brings the sync forward (the admin learns the demand within a
/// tick, not an interval); refusals that go on do not.
#[test]
fn a_first_refusal_of_a_global_policy_after_a_quiet_second_syncs_at_once() {
    let header = br#"{"llm": {"rate": 50, "in_flight": 0, "lease_ms": 30000, "instances": 2, "id": 7},
        "limits/fleet-tokens": {"rate": 3000, "in_flight": 0, "lease_ms": 30000, "instances": 1, "id": 8}}"#;
    let host = FakeHost::at(T0);
    let mut w = worker(&host, FLEET_REQUESTS_AND_TOKENS);
    w.set_sync(Some(sync_settings()));
    w.on_tick(&host);
    w.on_sync_reply(&host, 1, reply(Some(304), Some(header), None));
    let syncs = |host: &FakeHost| {
        host.calls
            .borrow()
            .iter()
            .filter(|(_, h, _)| {
                h.iter()
                    .any(|(k, v)| k == ":path" && v == sluice_wire::sync::SYNC_PATH)
            })
            .count()
    };
    let cheap = req(b"api.llm.example", &[("x-tokens", b"1")]);
    // A quiet second, and the regular sync that comes with it, answered.
    host.advance_ms(1_000);
    w.on_tick(&host);
    let regular = syncs(&host) as u32;
    w.on_sync_reply(&host, regular, reply(Some(304), Some(header), None));
    host.advance_ms(50);
    let before = syncs(&host);
    // The share's burst goes, then refusals begin.
    let refused = (100..140)
        .filter(|&id| w.on_request(&host, id, cheap.as_slice()) != Verdict::Continue)
        .count();
    assert!(refused > 0);
    host.advance_ms(5);
    w.on_tick(&host);
    assert_eq!(syncs(&host), before + 1, "the first refusal brings a sync");
    let token = syncs(&host) as u32;
    w.on_sync_reply(&host, token, reply(Some(304), Some(header), None));
    // Refusing on: no more hurried syncs before the interval (1 s).
    for id in 200..260 {
        host.advance_ms(10);
        let _ = w.on_request(&host, id, cheap.as_slice());
        w.on_tick(&host);
    }
    assert_eq!(syncs(&host), before + 1, "refusals that go on are no news");
}

/// A pool policy with a global further limit: each member takes the call
/// through a copy of the pool's limits, and every copy holds this Envoy's
/// share, not the whole limit.
#[test]
fn a_pools_global_limit_holds_its_share_whichever_member_takes_the_call() {
    const POOL_AND_FLEET: &str = r#"{"version": 1, "policies": [
        {"name": "llm", "match": {"host": "api.llm.example"},
         "rate": {"requests": 1000, "period": "1s", "burst": 1000},
         "limits": [{"name": "fleet-wide", "scope": "global",
                     "rate": {"requests": 300, "period": "1s", "burst": 30}}],
         "pool": {"members": [
           {"name": "east", "cluster": "east", "limits": [{"name": "east-rps",
             "rate": {"requests": 100, "period": "1s", "burst": 100}, "provider": {}}]},
           {"name": "west", "cluster": "west", "limits": [{"name": "west-rps",
             "rate": {"requests": 100, "period": "1s", "burst": 100}, "provider": {}}]}]}}]}"#;
    let host = FakeHost::at(T0);
    let mut w = worker(&host, POOL_AND_FLEET);
    w.set_sync(Some(sync_settings()));
    w.on_tick(&host);
    let header = br#"{"limits/fleet-wide": {"rate": 100, "in_flight": 0, "lease_ms": 3000, "instances": 3, "id": 5}}"#;
    w.on_sync_reply(&host, 1, reply(Some(304), Some(header), None));
    assert_eq!(
        admitted(&host, &mut w, 200, 50),
        10,
        "a burst of 10 of the 30"
    );
    let routed: std::collections::BTreeSet<String> = host
        .set_headers
        .borrow()
        .iter()
        .map(|(_, _, v)| v.clone())
        .collect();
    assert_eq!(routed.len(), 2, "both members took calls: {routed:?}");
}
