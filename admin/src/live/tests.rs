use super::*;
use sluice_wire::counts::Counter;

fn counts<C: Counter>(values: &[(C, u64)]) -> Counts<C> {
    let mut counts = Counts::default();
    for &(c, v) in values {
        counts.set(c, v);
    }
    counts
}

fn report(at_ms: u64, admitted: u64, in_flight: u64) -> SyncReport {
    let mut policies = BTreeMap::new();
    policies.insert(
        "bank".to_string(),
        PolicyReport {
            counts: counts(&[
                (PolicyCounter::Admitted, admitted),
                (PolicyCounter::Rejected, admitted / 2),
                (PolicyCounter::InFlight, in_flight),
            ]),
            max_in_flight: 10,
            tokens: Some(3),
            ..PolicyReport::default()
        },
    );
    SyncReport {
        instance: "e1".into(),
        policy_version: 1,
        at_ms,
        policies,
        ..SyncReport::default()
    }
}

#[test]
fn rates_come_from_counter_deltas_over_the_envoy_clock() {
    let live = Live::default();
    live.ingest(&report(10_000, 100, 4), 50_000);
    live.ingest(&report(12_000, 300, 7), 50_100);
    let frame = live.frame(50_200);
    let bank = frame.policies["bank"];
    assert_eq!(bank.counts.per_s(PolicyCounter::Admitted), 100.0);
    assert_eq!(bank.counts.per_s(PolicyCounter::Rejected), 50.0);
    assert_eq!(bank.counts.now(PolicyCounter::InFlight), 7);
    assert_eq!(bank.tokens, Some(3));
    // A silent instance drops out of the live figures.
    assert!(live.frame(50_100 + STALE_AFTER_MS + 1).policies.is_empty());
}

#[test]
fn a_further_limits_use_is_summed_over_envoys_against_its_size() {
    let live = Live::default();
    let with_limit = |instance: &str, at_ms: u64, tokens: u64, available: u64| {
        let mut r = report(at_ms, 0, 0);
        r.instance = instance.into();
        r.limits.insert(
            "tpm".into(),
            LimitReport {
                counts: counts(&[
                    (LimitCounter::Admitted, tokens / 100),
                    (LimitCounter::Refused, 1),
                    (LimitCounter::Tokens, tokens),
                ]),
                requests: 30_000,
                period_ms: 60_000,
                available: Some(available),
                in_flight: None,
                provider: None,
                spend: None,
            },
        );
        r
    };
    live.ingest(&with_limit("e1", 10_000, 1_000, 500), 1);
    live.ingest(&with_limit("e1", 12_000, 1_600, 400), 2);
    live.ingest(&with_limit("e2", 5_000, 0, 900), 3);
    live.ingest(&with_limit("e2", 6_000, 100, 800), 4);
    let tpm = live.frame(5).limits["tpm"].clone();
    // 300/s from e1 and 100/s from e2.
    assert_eq!(tpm.counts.per_s(LimitCounter::Tokens), 400.0);
    assert_eq!(tpm.used_per_period(), 24_000.0);
    assert_eq!((tpm.requests, tpm.period_ms), (30_000, 60_000));
    assert_eq!(tpm.available, Some(1_200));
}

#[test]
fn a_budgets_spend_is_summed_over_envoys_and_its_keys_by_hash() {
    use sluice_shared::spend::{KeySpend, SpendReport};
    let live = Live::default();
    let key = |label: &str, hash: u64, spent: u64| KeySpend {
        label: label.into(),
        hash,
        spent,
        size: 1_000,
        parent: 0,
    };
    let with_spend = |instance: &str, keys: Vec<KeySpend>| {
        let mut r = report(10_000, 0, 0);
        r.instance = instance.into();
        r.limits.insert(
            "team-daily".into(),
            LimitReport {
                requests: 1_000,
                period_ms: 86_400_000,
                spend: Some(SpendReport {
                    spent: keys.iter().map(|k| k.spent).sum(),
                    size: 1_000,
                    spending_keys: keys.len() as u64,
                    keys,
                    ..SpendReport::default()
                }),
                ..LimitReport::default()
            },
        );
        r
    };
    live.ingest(
        &with_spend("e1", vec![key("team-a", 1, 300), key("team-b", 2, 200)]),
        1,
    );
    live.ingest(&with_spend("e2", vec![key("team-b", 2, 250)]), 2);
    let spend = live.frame(3).limits["team-daily"]
        .spend
        .clone()
        .expect("spend");
    assert_eq!((spend.spent, spend.spending_keys), (750, 3));
    let keys: Vec<(&str, u64, u64)> = spend
        .keys
        .iter()
        .map(|k| (k.label.as_str(), k.spent, k.size))
        .collect();
    assert_eq!(keys, [("team-b", 450, 2_000), ("team-a", 300, 1_000)]);
}

#[test]
fn a_concurrency_limits_calls_in_flight_are_summed_over_envoys() {
    let live = Live::default();
    let with_slots = |instance: &str, at_ms: u64, in_flight: u64| {
        let mut r = report(at_ms, 0, 0);
        r.instance = instance.into();
        r.limits.insert(
            "account-in-flight".into(),
            LimitReport {
                counts: counts(&[(LimitCounter::Admitted, 10), (LimitCounter::Tokens, 10)]),
                requests: 20,
                period_ms: 0,
                available: Some(20 - in_flight),
                in_flight: Some(in_flight),
                provider: None,
                spend: None,
            },
        );
        r
    };
    live.ingest(&with_slots("e1", 5_000, 6), 1);
    live.ingest(&with_slots("e2", 5_000, 9), 2);
    let slots = live.frame(3).limits["account-in-flight"].clone();
    assert!(slots.is_concurrency());
    assert_eq!(slots.in_flight, Some(15));
    assert_eq!(slots.requests, 20);
}

#[test]
fn a_restarted_envoy_does_not_give_negative_rates() {
    let live = Live::default();
    live.ingest(&report(10_000, 1000, 0), 1);
    live.ingest(&report(11_000, 20, 0), 2);
    let bank = live.frame(3).policies["bank"];
    assert_eq!(bank.counts.per_s(PolicyCounter::Admitted), 20.0);
}

#[test]
fn history_is_bounded() {
    let live = Live::default();
    for t in 0..(HISTORY_FRAMES as u64 + 10) {
        live.tick(t);
    }
    assert_eq!(live.history().len(), HISTORY_FRAMES);
}

#[test]
fn huge_and_hostile_values_never_panic_or_poison() {
    let live = Live::default();
    let mut huge = report(u64::MAX, u64::MAX, u64::MAX);
    huge.instance = "e2".into();
    live.ingest(&report(0, 0, 0), 1);
    live.ingest(&huge, 2);
    live.ingest(&report(u64::MAX - 5, u64::MAX, u64::MAX), 3);
    live.ingest(&huge, 4);
    // Two instances at u64::MAX in flight each: the sum saturates.
    let bank = live.frame(5).policies["bank"];
    assert_eq!(bank.counts.now(PolicyCounter::InFlight), u64::MAX);
    live.tick(6);
    assert_eq!(live.history().len(), 1);
}

#[test]
fn instances_are_bounded_and_forgotten_when_silent() {
    let live = Live::new(Span::from_secs(60));
    for i in 0..(MAX_INSTANCES + 50) {
        let mut r = report(1_000, 10, 0);
        r.instance = format!("e{i}");
        live.ingest(&r, i as u64);
    }
    assert_eq!(live.tracked(), MAX_INSTANCES);
    live.tick(200_000);
    assert_eq!(live.tracked(), 0, "silent past the TTL");
}

#[test]
fn fair_keys_are_summed_over_envoys_by_hash_and_shown_by_demand() {
    let live = Live::default();
    let key = |key: u64, share: f64, demand: f64| FairKeyView {
        key,
        weight: 2 * WEIGHT_SCALE,
        share,
        used: share,
        demand,
        slots: false,
    };
    let mut a = report(1_000, 0, 0);
    a.instance = "a".into();
    a.fair.insert(
        "llm".into(),
        vec![key(7, 20.0, 100.0), key(OVERFLOW_KEY, 5.0, 5.0)],
    );
    let mut b = report(1_000, 0, 0);
    b.instance = "b".into();
    b.fair
        .insert("llm".into(), vec![key(7, 10.0, 50.0), key(9, 30.0, 40.0)]);
    live.ingest(&a, 1);
    live.ingest(&b, 2);
    let frame = live.tick(3);
    let shown: Vec<(&str, f64, f64, f64)> = frame.fair["llm"]
        .iter()
        .map(|k| (k.label.as_str(), k.weight, k.share_per_s, k.demand_per_s))
        .collect();
    let (seven, nine) = (hash_label(7), hash_label(9));
    assert_eq!(
        shown,
        [
            (seven.as_str(), 2.0, 30.0, 150.0),
            (nine.as_str(), 2.0, 30.0, 40.0),
            (FAIR_OVERFLOW_LABEL, 2.0, 5.0, 5.0)
        ]
    );
    // Per key, in the newest frame only.
    assert!(live.history()[0].fair.is_empty());
    // At most the top 20 of many keys.
    let mut many = report(1_000, 0, 0);
    many.fair.insert(
        "llm".into(),
        (1..=64).map(|k| key(k, 1.0, k as f64)).collect(),
    );
    live.ingest(&many, 4);
    let frame = live.frame(5);
    assert_eq!(frame.fair["llm"].len(), SHOWN_TOP_KEYS);
    assert_eq!(frame.fair["llm"][0].label, hash_label(64));
}

fn keyed(instance: &str, at_ms: u64, since_ms: u64, calls: &[(&[u8], u64)]) -> SyncReport {
    use sluice_shared::key_view::{label_secret, name_key, KeyOutcome, ENVOY_TOP_KEYS};
    let secret = label_secret(Some("t"));
    let mut keys = KeysReport {
        since_ms,
        ..KeysReport::default()
    };
    for (key, n) in calls {
        let name = name_key(&secret, "llm", key, sluice_shared::KeyLabel::Hash);
        for _ in 0..*n {
            keys.record(&name, KeyOutcome::Admitted, false, ENVOY_TOP_KEYS);
        }
    }
    let mut r = report(at_ms, 0, 0);
    r.instance = instance.into();
    r.keys.insert("llm".into(), keys);
    r
}

#[test]
fn keys_are_summed_over_envoys_and_counted_once_when_on_both() {
    use sluice_shared::key_view::KeyEstimate;
    let live = Live::default();
    // e1: a 20/s, b 5/s over 2 s; e2: b 30/s over 1 s, c 1/s.
    live.ingest(
        &keyed("e1", 12_000, 10_000, &[(b"a", 40), (b"b", 10)]),
        100_000,
    );
    live.ingest(
        &keyed("e2", 6_000, 5_000, &[(b"b", 30), (b"c", 1)]),
        100_200,
    );
    let frame = live.frame(100_300);
    let llm = &frame.keys["llm"];
    let rates: Vec<f64> = llm.top.iter().map(|k| k.admitted_per_s).collect();
    assert_eq!(rates, [35.0, 20.0, 1.0]);
    assert_eq!(llm.calls_per_s, 56.0);
    assert_eq!(llm.active, Some(KeyEstimate::About(3)));
    assert_eq!(llm.overflowed, Some(KeyEstimate::About(0)));
    // Keys live in the newest frame only.
    live.tick(100_400);
    assert!(live.history()[0].keys.is_empty());
    // Ten seconds later the keys are no longer active.
    let later = live.tick(100_300 + KEYS_ACTIVE_FOR_MS + 1_000);
    assert!(later.keys.is_empty(), "{:?}", later.keys);
}

#[test]
fn hostile_key_reports_give_no_rates_and_cannot_grow_the_view() {
    let live = Live::default();
    // A span of nothing or backwards: no rates, no panic.
    live.ingest(&keyed("e1", 5_000, 5_000, &[(b"a", 4)]), 1);
    live.ingest(&keyed("e2", 5_000, u64::MAX, &[(b"a", 4)]), 2);
    let frame = live.frame(3);
    assert!(frame.keys["llm"].top.is_empty());
    for i in 0..(MAX_SEEN_POLICIES + 20) {
        let mut r = keyed("e3", 5_000 + i as u64, 4_000, &[(b"a", 1)]);
        let keys = r.keys.remove("llm").unwrap();
        r.keys.insert(format!("p{i}"), keys);
        live.ingest(&r, 4);
    }
    assert!(lock(&live.seen_keys).len() <= MAX_SEEN_POLICIES);
}

#[test]
fn a_keys_rate_spans_a_second_of_short_reports() {
    let live = Live::default();
    // 250 ms reports of a key calling 4 times a second: 1, 2, 1, 0.
    for (i, n) in [1u64, 2, 1, 0, 1].into_iter().enumerate() {
        let at = 10_000 + 250 * (i as u64 + 1);
        live.ingest(&keyed("e1", at, at - 250, &[(b"a", n)]), at);
    }
    let llm = &live.frame(11_300).keys["llm"];
    // The last second: 2, 1, 0, 1.
    assert_eq!(llm.top[0].admitted_per_s, 4.0);
    // A report that does not follow on (a gap) starts the spans over.
    live.ingest(&keyed("e1", 20_000, 19_500, &[(b"a", 3)]), 11_400);
    assert_eq!(live.frame(11_500).keys["llm"].top[0].admitted_per_s, 6.0);
}
