//! `fair`: one policy's rate shared between tenants by weight, across the
//! workers of an Envoy, through the worker against the in-memory host.

use crate::host::Host;
use crate::testing::FakeHost;
use crate::tests::{header_of, req, worker, T0};
use crate::worker::{Verdict, Worker};

const LLM: &[u8] = b"api.llm.example";

fn policy(extra: &str) -> String {
    format!(
        r#"{{"version": 1, "policies": [
        {{"name": "llm", "match": {{"host": "api.llm.example"}},
         "rate": {{"requests": 100, "period": "1s", "burst": 5}},
         "fair": {{"key": {{"header": "x-tenant"}}, "weights": {{"gold": 2}}{extra}}}}}]}}"#
    )
}

/// The call's answer: admitted, or the refusal's reason.
fn call(host: &FakeHost, w: &mut Worker, id: u32, tenant: &str) -> Result<(), String> {
    let mut headers = req(LLM, &[]);
    headers.push(("x-tenant", tenant.as_bytes()));
    let verdict = w.on_request(host, id, headers.as_slice());
    w.on_stream_end(host, id);
    match verdict {
        Verdict::Continue => Ok(()),
        Verdict::Reply(_) => Err(header_of(&verdict, "x-sluice-reason")
            .unwrap_or("the rate")
            .to_string()),
        other => Err(format!("{other:?}")),
    }
}

/// Every tenant calls every `every_ms` through one of two workers, for
/// `seconds`; what each had admitted over the last `measured` seconds.
/// Only the fair table refuses, unless it starts broken (it then starts
/// full while the bucket may not be).
fn greedy(
    host: &FakeHost,
    workers: &mut [Worker; 2],
    tenants: &[(&str, u64)],
    (seconds, measured): (u64, u64),
) -> Vec<u64> {
    let strict = host
        .shared_get("sluice/f/llm")
        .0
        .is_none_or(|b| b.len() >= 29);
    let mut admitted = vec![0; tenants.len()];
    let mut id = 0;
    for ms in 0..seconds * 1000 {
        host.advance_ms(1);
        for (i, (tenant, every_ms)) in tenants.iter().enumerate() {
            if ms % every_ms != 0 {
                continue;
            }
            id += 1;
            let w = &mut workers[id as usize % 2];
            match call(host, w, id, tenant) {
                Ok(()) if ms >= (seconds - measured) * 1000 => admitted[i] += 1,
                Ok(()) => {}
                Err(why) => assert!(
                    why == "fair-share" || !strict,
                    "the bucket refused what the fair table admitted: {why}"
                ),
            }
        }
        if ms % 100 == 0 {
            for w in workers.iter_mut() {
                w.on_tick(host);
            }
        }
    }
    admitted
}

#[test]
fn greedy_tenants_share_the_rate_by_weight_across_workers() {
    let host = FakeHost::at(T0);
    let set = policy("");
    let mut workers = [worker(&host, &set), worker(&host, &set)];
    // 500 calls a second each, 5 times the rate.
    let got = greedy(
        &host,
        &mut workers,
        &[("a", 2), ("b", 2), ("gold", 2)],
        (6, 5),
    );
    for (got, want) in got.iter().zip([125, 125, 250]) {
        assert!(
            got.abs_diff(want) * 100 <= want * 5,
            "{got} of {want}: {:?}",
            got
        );
    }
    assert!(
        got.iter().sum::<u64>() <= 505,
        "never past the rate: {got:?}"
    );
    assert!(host.metric("sluice.policy.llm.fair_refused") > 1_000);
}

#[test]
fn a_quiet_tenant_gets_all_it_asks_beside_a_noisy_one() {
    let host = FakeHost::at(T0);
    let set = policy("");
    let mut workers = [worker(&host, &set), worker(&host, &set)];
    // Noisy: 1 000 a second; quiet: 20 a second.
    let got = greedy(&host, &mut workers, &[("noisy", 1), ("quiet", 50)], (6, 5));
    assert_eq!(got[1], 100, "the quiet tenant's every call: {got:?}");
    assert!(
        (390..=405).contains(&got[0]),
        "the noisy one the rest: {got:?}"
    );
}

#[test]
fn the_refusal_says_fair_share_and_when_to_come_back() {
    let host = FakeHost::at(T0);
    let set = policy("");
    let mut workers = [worker(&host, &set), worker(&host, &set)];
    greedy(&host, &mut workers, &[("a", 2), ("b", 2)], (1, 1));
    let mut headers = req(LLM, &[]);
    headers.push(("x-tenant", b"a".as_slice()));
    let refused = (0..50)
        .map(|id| workers[0].on_request(&host, 10_000 + id, headers.as_slice()))
        .find(|v| matches!(v, Verdict::Reply(_)))
        .expect("a greedy tenant is refused");
    let Verdict::Reply(reply) = &refused else {
        unreachable!("found as a reply")
    };
    assert_eq!(reply.status, 429);
    assert_eq!(header_of(&refused, "x-sluice-reason"), Some("fair-share"));
    assert_eq!(header_of(&refused, "retry-after"), Some("1"));
    assert!(String::from_utf8_lossy(&reply.body).contains("fair share"));
}

#[test]
fn reservations_are_kept_for_a_tenant_that_wants_them() {
    let host = FakeHost::at(T0);
    let set = policy(r#", "min": {"batch": 60}"#);
    let mut workers = [worker(&host, &set), worker(&host, &set)];
    let got = greedy(&host, &mut workers, &[("a", 2), ("batch", 2)], (6, 5));
    // batch: its 60 and half of the other 40.
    assert!(
        got[1].abs_diff(400) <= 20 && got[0].abs_diff(100) <= 10,
        "{got:?}"
    );
}

#[test]
fn shadow_mode_counts_what_fairness_would_refuse_and_lets_it_pass() {
    let host = FakeHost::at(T0);
    let set = policy("").replace(r#""fair""#, r#""mode": "shadow", "fair""#);
    let mut workers = [worker(&host, &set), worker(&host, &set)];
    let got = greedy(&host, &mut workers, &[("a", 2), ("b", 2)], (2, 1));
    assert_eq!(got, [500, 500]);
    assert_eq!(host.metric("sluice.policy.llm.fair_refused"), 0);
    assert!(host.metric("sluice.policy.llm.shadow_limited") > 500);
}

#[test]
fn a_broken_fair_table_starts_afresh_and_the_rate_still_holds() {
    let host = FakeHost::at(T0);
    let set = policy("");
    let mut workers = [worker(&host, &set), worker(&host, &set)];
    for garbage in [&b""[..], &[1u8; 3], &[1, 255, 255, 255, 255, 0, 0]] {
        host.shared_set("sluice/f/llm", garbage, None).unwrap();
        let got = greedy(&host, &mut workers, &[("a", 2), ("b", 2)], (2, 1));
        assert!(got.iter().sum::<u64>() <= 105, "{got:?}");
        assert!(got[0].abs_diff(got[1]) <= 10, "{got:?}");
    }
    // Hostile tenant values: long, binary, absent.
    let long = "x".repeat(100_000);
    for tenant in [long.as_str(), "\u{0}\u{1}", ""] {
        let _ = call(&host, &mut workers[0], 99_999, tenant);
    }
}

/// Queue mode: a noisy tenant's 200 waiting calls (4 s of the rate) and
/// then a quiet tenant's call: the quiet call leaves within two turns of
/// the rate, not behind the backlog; without `fair` it waits its 4 s.
#[test]
fn a_fair_queue_lets_a_quiet_tenant_past_a_noisy_backlog() {
    let queued = |fair: &str| {
        format!(
            r#"{{"version": 1, "policies": [
            {{"name": "llm", "match": {{"host": "api.llm.example"}},
             "rate": {{"requests": 50, "period": "1s", "burst": 1}},
             "on_limit": {{"action": "queue", "max_wait": "10s", "max_queue": 1000}}{fair}}}]}}"#
        )
    };
    let waited = |set: &str| {
        let host = FakeHost::at(T0);
        let mut w = worker(&host, set);
        let arrive = |w: &mut Worker, id: u32, tenant: &str| {
            let mut headers = req(LLM, &[]);
            headers.push(("x-tenant", tenant.as_bytes()));
            w.on_request(&host, id, headers.as_slice())
        };
        for id in 1..=200 {
            arrive(&mut w, id, "noisy");
        }
        assert!(matches!(
            arrive(&mut w, 999, "quiet"),
            Verdict::Pause { .. }
        ));
        for ms in 1..=10_000u64 {
            host.advance_ms(1);
            for action in w.on_tick(&host) {
                if action == crate::worker::StreamAction::Resume(999) {
                    return ms;
                }
            }
        }
        panic!("the quiet call never left");
    };
    let fair = waited(&queued(r#", "fair": {"key": {"header": "x-tenant"}}"#));
    let fifo = waited(&queued(""));
    assert!(fair <= 45, "fair: the quiet call waited {fair} ms");
    assert!(fifo >= 3_900, "FIFO: the quiet call waited {fifo} ms");
}

/// The tenant read from the request's JSON body (`fair.key.json`): the
/// call waits for its body, tenants share by weight, and a body that is
/// no JSON is the tenant without a key.
#[test]
fn tenants_from_the_json_body_share_by_weight() {
    use crate::worker::RequestBody;
    let host = FakeHost::at(T0);
    let set = r#"{"version": 1, "policies": [
        {"name": "llm", "match": {"host": "api.llm.example"},
         "rate": {"requests": 100, "period": "1s", "burst": 5},
         "fair": {"key": {"json": "metadata.team"}, "weights": {"gold": 3}}}]}"#;
    let mut w = worker(&host, set);
    let headers = req(LLM, &[]);
    let tenants: [(&str, &[u8]); 3] = [
        ("gold", br#"{"metadata": {"team": "gold"}}"#),
        ("blue", br#"{"metadata": {"team": "blue"}}"#),
        ("none", b"not json"),
    ];
    let mut admitted = std::collections::BTreeMap::new();
    let mut id = 0;
    for ms in 0..3_000u64 {
        host.advance_ms(1);
        for (name, body) in tenants {
            id += 1;
            assert_eq!(
                w.on_request_with(&host, id, headers.as_slice(), RequestBody::Coming),
                Verdict::ReadBody
            );
            let v = w.on_request_with(&host, id, headers.as_slice(), RequestBody::Read(Some(body)));
            w.on_stream_end(&host, id);
            if v == Verdict::Continue && ms >= 1_000 {
                *admitted.entry(name).or_insert(0u32) += 1;
            }
        }
        if ms % 100 == 0 {
            w.on_tick(&host);
        }
    }
    // Over the last 2 s (200 calls): gold 3 parts of 5, the others 1 each.
    assert!(admitted["gold"].abs_diff(120) <= 6, "{admitted:?}");
    assert!(admitted["blue"].abs_diff(40) <= 3, "{admitted:?}");
    assert!(admitted["none"].abs_diff(40) <= 3, "{admitted:?}");
}

/// A global policy shared fairly: this Envoy's table shares the share the
/// admin leased it, by weight, and its report tells the admin each key's
/// weight and demand, hashed under the fleet's label secret (alike on
/// every Envoy, so the admin can weigh a key across them).
#[test]
fn a_global_limit_shares_this_envoys_share_and_reports_its_keys() {
    use crate::tests::{reply, sync_settings};
    use sluice_shared::key_view::label_secret;
    let host = FakeHost::at(T0);
    let set = r#"{"version": 1, "policies": [
        {"name": "llm", "match": {"host": "api.llm.example"}, "scope": "global",
         "rate": {"requests": 100, "period": "1s", "burst": 10},
         "fair": {"key": {"header": "x-tenant"}, "weights": {"gold": 2}}}]}"#;
    let mut w = worker(&host, set);
    w.set_sync(Some(sync_settings()));
    w.on_tick(&host);
    // A share of 30/s of the 100/s (a burst of 3).
    let header =
        br#"{"llm": {"rate": 30, "in_flight": 0, "lease_ms": 60000, "instances": 2, "id": 5}}"#;
    w.on_sync_reply(&host, 1, reply(Some(304), Some(header), None));
    let (mut gold, mut other, mut id) = (0, 0, 1_000);
    for ms in 0..3_000 {
        host.advance_ms(1);
        for (tenant, admitted) in [("gold", &mut gold), ("other", &mut other)] {
            id += 1;
            // Both greedy: a call every 2 ms (500/s) each.
            if ms % 2 == 0 && call(&host, &mut w, id, tenant).is_ok() && ms >= 1_000 {
                *admitted += 1;
            }
        }
    }
    // Over the last 2 s: 20/s and 10/s of the share's 30/s.
    assert!((36..=44).contains(&gold), "gold {gold}, other {other}");
    assert!((16..=24).contains(&other), "gold {gold}, other {other}");
    assert!(gold + other <= 60 + 3, "gold {gold}, other {other}");

    // The next sync, as the calls go on.
    host.advance_ms(1);
    w.on_tick(&host);
    let calls = host.calls.borrow().clone();
    let report: sluice_wire::sync::SyncReport =
        serde_json::from_slice(&calls.last().expect("a sync").2).expect("a report");
    let keys = &report.fair["llm"];
    let secret = label_secret(Some("t0ken"));
    let gold_key = keys
        .iter()
        .find(|k| k.key == secret.hash("llm", b"gold"))
        .unwrap_or_else(|| panic!("gold under the label secret: {keys:?}"));
    assert_eq!(gold_key.weight, 2_000);
    assert!(gold_key.demand > gold_key.share, "{gold_key:?}");
    assert!(
        keys.iter()
            .any(|k| k.key == secret.hash("llm", b"other") && k.weight == 1_000),
        "{keys:?}"
    );
}

/// Tokens per second shared fairly between tenants by a further limit,
/// beside the policy's own rate: the limit's table divides its rate by
/// weight across the workers, a refusal names the limit and the fair
/// share, and a call the policy's own rate refuses after the table took
/// gives its tokens back to its tenant.
#[test]
fn a_further_limit_shares_its_rate_by_weight() {
    let host = FakeHost::at(T0);
    let set = r#"{"version": 1, "policies": [
        {"name": "llm", "match": {"host": "api.llm.example"},
         "rate": {"requests": 1000, "period": "1s", "burst": 1000},
         "limits": [{"name": "tps", "rate": {"requests": 100, "period": "1s", "burst": 5},
                     "cost": {"header": "x-tokens", "default": 1, "max": 5},
                     "fair": {"key": {"header": "x-tenant"}, "weights": {"gold": 2}}}]}]}"#;
    let mut workers = [worker(&host, set), worker(&host, set)];
    let got = greedy(&host, &mut workers, &[("a", 2), ("gold", 2)], (6, 5));
    // 500 over the last 5 s: a third and two thirds.
    for (got, want) in got.iter().zip([167, 333]) {
        assert!(got.abs_diff(want) * 100 <= want * 5, "{got:?}");
    }
    assert!(
        got.iter().sum::<u64>() <= 505,
        "never past the limit: {got:?}"
    );
    let mut headers = req(LLM, &[]);
    headers.push(("x-tenant", b"a".as_slice()));
    let refused = (0..50)
        .map(|id| workers[0].on_request(&host, 20_000 + id, headers.as_slice()))
        .find(|v| matches!(v, Verdict::Reply(_)))
        .expect("a greedy tenant is refused");
    assert_eq!(header_of(&refused, "x-sluice-reason"), Some("fair-share"));
    assert_eq!(header_of(&refused, "x-sluice-limit"), Some("tps"));
    assert!(host.metric("sluice.limit.tps.refused") > 1_000);
}
