//! `fair` on slots: a concurrency limit (a policy's own or a further one)
//! shared between tenants by weight, across the workers of an Envoy,
//! through the worker against the in-memory host.

use std::collections::VecDeque;

use sluice_shared::fair::FairSlots;

use crate::entries::Entry;
use crate::host::Host;
use crate::testing::FakeHost;
use crate::tests::{header_of, pass, req, worker, T0};
use crate::worker::{Verdict, Worker};

const LLM: &[u8] = b"api.llm.example";

/// The policy's own 10 slots shared fairly (`extra` goes into `fair`).
fn own(extra: &str) -> String {
    format!(
        r#"{{"version": 1, "policies": [
        {{"name": "llm", "match": {{"host": "api.llm.example"}},
         "concurrency": {{"max_in_flight": 10, "lease_ttl": "10s"}},
         "fair": {{"key": {{"header": "x-tenant"}}, "weights": {{"gold": 3}}{extra}}}}}]}}"#
    )
}

/// A further concurrency limit of 10 slots shared fairly, under a policy
/// whose own rate never refuses.
const FURTHER: &str = r#"{"version": 1, "policies": [
    {"name": "llm", "match": {"host": "api.llm.example"}, "rate": {"requests": 100000, "period": "1s"},
     "limits": [{"name": "in-flight", "concurrency": {"max_in_flight": 10, "lease_ttl": "10s"},
                 "fair": {"key": {"header": "x-tenant"}, "weights": {"gold": 3}}}]}]}"#;

/// Opens a call of `tenant` (not ended): admitted, or the refusal's reason.
fn open(host: &FakeHost, w: &mut Worker, id: u32, tenant: &str) -> Result<(), String> {
    let mut headers = req(LLM, &[]);
    headers.push(("x-tenant", tenant.as_bytes()));
    let verdict = w.on_request(host, id, headers.as_slice());
    match verdict {
        Verdict::Continue => Ok(()),
        Verdict::Reply(_) => {
            // The limit itself says no reason.
            let reason = header_of(&verdict, "x-sluice-reason").unwrap_or("limit");
            w.on_stream_end(host, id);
            Err(reason.to_string())
        }
        other => Err(format!("{other:?}")),
    }
}

/// Slots held in the fair slots table at `key`.
fn held(host: &FakeHost, key: &str) -> u64 {
    let table = host
        .shared_get(key)
        .0
        .and_then(|b| <FairSlots as Entry>::decode(&b))
        .unwrap_or_default();
    table.in_flight()
}

/// Every tenant keeps `callers` callers busy through one of two workers:
/// each call lasts `hold_ms`, a refused caller tries again 1 ms later.
/// Returns how many calls each tenant had in flight, on average, over the
/// last `measured_ms`, and the reasons of the refusals.
fn closed_loop(
    host: &FakeHost,
    workers: &mut [Worker; 2],
    tenants: &[(&str, usize)],
    (run_ms, measured_ms, hold_ms): (u64, u64, u64),
) -> (Vec<f64>, Vec<String>) {
    let mut in_flight: Vec<VecDeque<(u64, u32, usize)>> = vec![VecDeque::new(); tenants.len()];
    let mut sum = vec![0u64; tenants.len()];
    let mut reasons = Vec::new();
    let mut id = 0u32;
    for ms in 0..run_ms {
        host.advance_ms(1);
        for (t, queue) in in_flight.iter_mut().enumerate() {
            while queue.front().is_some_and(|(ends, _, _)| *ends <= ms) {
                let Some((_, ended, worker)) = queue.pop_front() else {
                    break;
                };
                workers[worker].on_stream_end(host, ended);
            }
            let (tenant, callers) = tenants[t];
            while queue.len() < callers {
                id += 1;
                let worker = id as usize % 2;
                match open(host, &mut workers[worker], id, tenant) {
                    Ok(()) => queue.push_back((ms + hold_ms, id, worker)),
                    Err(why) => {
                        reasons.push(why);
                        break;
                    }
                }
            }
            if ms >= run_ms - measured_ms {
                sum[t] += queue.len() as u64;
            }
        }
        if ms % 100 == 0 {
            for w in workers.iter_mut() {
                w.on_tick(host);
            }
        }
    }
    for (_, ended, worker) in in_flight.into_iter().flatten() {
        workers[worker].on_stream_end(host, ended);
    }
    let mean = sum.iter().map(|s| *s as f64 / measured_ms as f64).collect();
    (mean, reasons)
}

#[test]
fn a_policys_slots_go_to_the_tenant_below_its_share_as_calls_end() {
    // Its slots alone, and beside a rate shared too (a refusal by the
    // slots gives the rate's tokens back to the key).
    let with_rate = own("").replace(
        r#""concurrency""#,
        r#""rate": {"requests": 1000, "period": "1s", "burst": 100}, "concurrency""#,
    );
    for set in [own(""), with_rate] {
        let host = FakeHost::at(T0);
        let mut a = worker(&host, &set);
        let mut b = worker(&host, &set);
        for id in 1..=10 {
            assert_eq!(open(&host, &mut a, id, "noisy"), Ok(()));
        }
        // Full: refused as the limit refuses.
        assert_eq!(open(&host, &mut b, 100, "quiet"), Err("limit".into()));
        let mut quiet = 0;
        for id in 1..=5 {
            a.on_stream_end(&host, id);
            assert_eq!(
                open(&host, &mut a, 200 + id, "noisy"),
                Err("fair-share".into()),
                "the noisy tenant is at its share while the quiet one wants a slot"
            );
            if open(&host, &mut b, 300 + id, "quiet").is_ok() {
                quiet += 1;
            }
            // The quiet tenant asks again: no slot is free now.
            assert!(open(&host, &mut b, 400 + id, "quiet").is_err());
        }
        assert_eq!(quiet, 5);
        pass(&host, &mut a, 200);
        assert_eq!(host.metric("sluice.policy.llm.fair_refused"), 5);
        for id in (6..=10).chain(301..=305) {
            let w = if id > 300 { &mut b } else { &mut a };
            w.on_stream_end(&host, id);
        }
        assert_eq!(held(&host, "sluice/fs/llm"), 0, "every slot came back");
        assert_eq!(a.in_flight() + b.in_flight(), 0);
    }
}

#[test]
fn busy_tenants_hold_the_slots_by_weight_of_a_policy_and_of_a_further_limit() {
    for set in [own(""), FURTHER.to_string()] {
        let host = FakeHost::at(T0);
        let mut workers = [worker(&host, &set), worker(&host, &set)];
        // Each keeps 20 callers busy with 50 ms calls: twice the limit
        // each.
        let (mean, reasons) = closed_loop(
            &host,
            &mut workers,
            &[("a", 20), ("gold", 20)],
            (3_000, 2_000, 50),
        );
        assert!((2.0..=3.0).contains(&mean[0]), "weight 1 of 4: {mean:?}");
        assert!((7.0..=8.0).contains(&mean[1]), "weight 3 of 4: {mean:?}");
        assert!(mean.iter().sum::<f64>() <= 10.0);
        assert!(reasons.iter().any(|r| r == "fair-share"), "{reasons:?}");
        // Gold left: a slot is kept for it while it is remembered as
        // wanting one (`WANT_MEMORY`), then the other tenant takes every
        // slot.
        let (lone, _) = closed_loop(&host, &mut workers, &[("a", 20)], (3_000, 500, 50));
        assert!(lone[0] >= 9.5, "alone, a tenant takes every slot: {lone:?}");
    }
}

#[test]
fn a_reservation_of_slots_is_kept_for_its_tenant() {
    let host = FakeHost::at(T0);
    let set = own(r#", "min": {"steady": 6}"#);
    let mut workers = [worker(&host, &set), worker(&host, &set)];
    // Gold weighs 3, steady 1 but has 6 slots reserved: 6 + 1 of the 4
    // left.
    let (mean, _) = closed_loop(
        &host,
        &mut workers,
        &[("gold", 20), ("steady", 20)],
        (3_000, 2_000, 50),
    );
    assert!((6.0..=7.2).contains(&mean[1]), "{mean:?}");
}

#[test]
fn a_dead_workers_slots_come_back_to_every_tenant_after_the_ttl() {
    let host = FakeHost::at(T0);
    let set = own("");
    let mut dead = worker(&host, &set);
    for id in 1..=10 {
        assert_eq!(open(&host, &mut dead, id, "noisy"), Ok(()));
    }
    drop(dead);
    let mut alive = worker(&host, &set);
    assert!(open(&host, &mut alive, 100, "quiet").is_err());
    pass(&host, &mut alive, 10_001);
    for id in 0..10 {
        assert_eq!(open(&host, &mut alive, 200 + id, "quiet"), Ok(()));
    }
}

#[test]
fn a_broken_fair_slots_table_never_lets_more_than_the_limit_through() {
    let host = FakeHost::at(T0);
    let set = own("");
    let mut w = worker(&host, &set);
    for id in 1..=6 {
        assert_eq!(open(&host, &mut w, id, "a"), Ok(()));
    }
    host.shared
        .borrow_mut()
        .insert("sluice/fs/llm".into(), (vec![1, 255, 255, 255, 255], 99));
    let admitted = (0..10)
        .filter(|id| open(&host, &mut w, 100 + id, "b").is_ok())
        .count();
    assert_eq!(admitted, 4, "the limit's own slots still bound the total");
    pass(&host, &mut w, 200);
    assert!(host.metric("sluice.state_decode_errors") >= 1);
}

#[test]
fn shadow_mode_counts_a_fair_refusal_and_lets_the_call_pass() {
    let host = FakeHost::at(T0);
    let set = own("").replace(r#""name": "llm","#, r#""name": "llm", "mode": "shadow","#);
    let mut w = worker(&host, &set);
    for id in 1..=10 {
        assert_eq!(open(&host, &mut w, id, "noisy"), Ok(()));
    }
    assert_eq!(
        open(&host, &mut w, 50, "quiet"),
        Ok(()),
        "shadow lets it pass"
    );
    w.on_stream_end(&host, 1);
    assert_eq!(open(&host, &mut w, 60, "noisy"), Ok(()));
    pass(&host, &mut w, 200);
    assert!(host.metric("sluice.policy.llm.shadow_limited") >= 2);
    assert_eq!(host.metric("sluice.policy.llm.fair_refused"), 0);
}
