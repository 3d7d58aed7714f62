use super::*;
use sluice_shared::limiter::TokenBucket;
use std::collections::BTreeMap;

const SEC: Span = Span::from_secs(1);
const T0: Instant = Instant::from_nanos(1_800_000_000 * 1_000_000_000);

fn ms(n: u64) -> Span {
    Span::from_millis(n)
}

fn rate_queue(per_sec: u64, max_wait: Span) -> BucketLimits {
    BucketLimits {
        rate: Some(RateLimiter::TokenBucket(TokenBucket::new(
            per_sec, SEC, 1, None,
        ))),
        concurrency: None,
        queue: Some(QueueLimits {
            max_wait,
            max_queue: 1000,
        }),
    }
}

fn slots(max: u32, reserved: u32, queue: Option<QueueLimits>) -> BucketLimits {
    BucketLimits {
        rate: None,
        concurrency: Some(ConcurrencyLimit {
            max_in_flight: max,
            reserved_for_high: reserved,
            lease_ttl: SEC.saturating_mul(60),
        }),
        queue,
    }
}

/// Polls every millisecond for `ms`; the keys of the calls that left,
/// in order (`keys` maps ticket to key).
fn drain_fairly(
    b: &mut BucketState,
    limits: &BucketLimits,
    keys: &BTreeMap<u64, u64>,
    ms_total: u64,
) -> Vec<u64> {
    let mut left = Vec::new();
    for t in 1..=ms_total {
        for ticket in b.poll(limits, 1, T0 + ms(t - 1), T0 + ms(t)) {
            left.push(keys[&ticket]);
        }
    }
    left
}

/// A fair call of `key` at `weight` (thousandths), nothing reserved.
fn weighted(key: u64, weight: u64) -> FairCall {
    FairCall {
        who: FairClaimant {
            key,
            weight,
            reserved: 0,
        },
        reserving: None,
        rate: 0,
    }
}

/// A fair call of `key` at `weight` arriving at `at`; its ticket noted
/// in `keys` when it waits.
fn arrive_fairly(
    b: &mut BucketState,
    limits: &BucketLimits,
    keys: &mut BTreeMap<u64, u64>,
    at: Instant,
    (key, weight): (u64, u64),
) -> Admission {
    let a = b.admit_call(
        limits,
        1,
        at,
        BucketCall {
            cost: 1,
            priority: Priority::Normal,
            fair: Some(weighted(key, weight)),
        },
        false,
    );
    if let Admission::Queued { ticket, .. } = a {
        keys.insert(ticket, key);
    }
    a
}

#[test]
fn greedy_keys_of_a_fair_queue_keep_their_weights_and_none_runs_out_of_time() {
    let limits = rate_queue(50, SEC);
    let mut b = BucketState::new(0);
    let mut keys = BTreeMap::new();
    let mut served = BTreeMap::new();
    let mut left = 0u64;
    let call = |key: u64, weight: u64| FairCall {
        rate: 50 * fair::UNIT,
        ..weighted(key, weight)
    };
    // Keys 7 (weight 1) and 8 (weight 3) each offer 500 a second, ten
    // times the rate, for 4 s.
    for t in 0..4_000u64 {
        let now = T0 + ms(t);
        if t % 2 == 0 {
            for (key, weight) in [(7, 1_000), (8, 3_000)] {
                let a = b.admit_call(
                    &limits,
                    1,
                    now,
                    BucketCall {
                        cost: 1,
                        priority: Priority::Normal,
                        fair: Some(call(key, weight)),
                    },
                    false,
                );
                if let Admission::Queued { ticket, .. } = a {
                    keys.insert(ticket, key);
                }
            }
        }
        for ticket in b.poll(&limits, 1, now, now + ms(1)) {
            left += 1;
            if t >= 1_000 {
                *served.entry(keys[&ticket]).or_insert(0u64) += 1;
            }
        }
    }
    // A call that would wait past `max_wait` was refused when it came,
    // not queued to run out of time: every call queued was served or
    // still waits.
    let expired = keys.len() as u64 - left - b.waiters.len() as u64;
    assert!(expired <= 2, "{expired} ran out of time");
    let (seven, eight) = (served[&7], served[&8]);
    assert!(seven + eight >= 145, "the rate over 3 s: {served:?}");
    let part = seven as f64 / (seven + eight) as f64;
    assert!((part - 0.25).abs() <= 0.03, "weight 1 of 4: {served:?}");
}

#[test]
fn a_fair_queue_lets_a_quiet_key_past_a_noisy_keys_backlog() {
    let limits = rate_queue(50, SEC.saturating_mul(10));
    let mut b = BucketState::new(0);
    let mut keys = BTreeMap::new();
    // The noisy key (7) queues 100 calls: two seconds of the rate.
    for _ in 0..100 {
        arrive_fairly(&mut b, &limits, &mut keys, T0, (7, 1_000));
    }
    // After 200 ms the quiet key (9) comes: it is next but one.
    let early = drain_fairly(&mut b, &limits, &keys, 200);
    assert!(early.iter().all(|k| *k == 7));
    let at = T0 + ms(200);
    assert!(matches!(
        arrive_fairly(&mut b, &limits, &mut keys, at, (9, 1_000)),
        Admission::Queued { .. }
    ));
    let mut next = Vec::new();
    for t in 201..=260u64 {
        for ticket in b.poll(&limits, 1, T0 + ms(t - 1), T0 + ms(t)) {
            next.push(keys[&ticket]);
        }
    }
    assert!(next.iter().take(2).any(|k| *k == 9), "{next:?}");
    // Without fairness it waits behind the whole backlog.
    let mut fifo = BucketState::new(0);
    for _ in 0..100 {
        fifo.admit(&limits, 1, T0, 1, Priority::Normal);
    }
    assert!(matches!(
        fifo.admit(&limits, 1, at, 1, Priority::Normal),
        Admission::Queued { ticket: 99, .. }
    ));
    // The state, fair tags and all, survives its bytes; a state
    // without a fair queue keeps the older layout.
    assert_eq!(BucketState::decode(&b.encode()), Ok(b.clone()));
    assert_eq!(fifo.encode()[0], 2);
    assert_eq!(b.encode()[0], 4);
    // Version 3 (tags without weights) still reads: weight 1, nothing
    // reserved.
    let v4 = b.encode();
    let tags_len = b.waiters.len() * BucketState::FAIR_WAITER_LEN;
    let fair_at = v4.len() - 8 - tags_len - 4 - b.finishes.len() * 16;
    let mut v3 = v4[..fair_at + 8].to_vec();
    v3[0] = 3;
    for tag in v4[fair_at + 8..fair_at + 8 + tags_len].chunks(BucketState::FAIR_WAITER_LEN) {
        v3.extend_from_slice(&tag[..BucketState::FAIR_WAITER_LEN_3]);
    }
    let read = BucketState::decode(&v3).expect("version 3");
    assert_eq!(read.waiters.len(), b.waiters.len());
    assert!(read.waiters.iter().zip(&b.waiters).all(|(r, w)| r
        .fair
        .map(|f| (f.key, f.start, f.end, f.weight, f.reserved))
        == w.fair.map(|f| (f.key, f.start, f.end, 1_000, 0))));
}

#[test]
fn a_key_served_one_call_at_a_time_keeps_to_its_weight() {
    let limits = rate_queue(100, SEC.saturating_mul(10));
    let mut b = BucketState::new(0);
    let mut keys = BTreeMap::new();
    for _ in 0..300 {
        arrive_fairly(&mut b, &limits, &mut keys, T0, (1, 1_000));
    }
    // Key 2 (weight 0.1) sends its next call as soon as its last left.
    let mut light = 0;
    for t in 1..=2_000u64 {
        let at = T0 + ms(t);
        if !b.waiters.iter().any(|w| w.fair.is_some_and(|f| f.key == 2)) {
            arrive_fairly(&mut b, &limits, &mut keys, at, (2, 100));
        }
        for ticket in b.poll(&limits, 1, T0 + ms(t - 1), at) {
            light += u32::from(keys[&ticket] == 2);
        }
    }
    // A tenth of key 1's pace: about 18 of 200, not every other call.
    assert!((10..=25).contains(&light), "{light} of 200");
    assert!(!b.finishes.is_empty());
    assert_eq!(BucketState::decode(&b.encode()), Ok(b.clone()));
}

#[test]
fn a_fair_queue_keeps_a_reservation_for_a_backlogged_key() {
    let limits = rate_queue(100, SEC.saturating_mul(10));
    let capacity = 100 * fair::UNIT;
    let call = |key: u64, reserved: u64| FairCall {
        who: FairClaimant {
            key,
            weight: 1_000,
            reserved: reserved * fair::UNIT,
        },
        reserving: Some(capacity),
        rate: capacity,
    };
    let run = |a_reserved: u64| {
        let mut b = BucketState::new(0);
        let mut keys = BTreeMap::new();
        // Three greedy keys of weight 1, each with 300 calls waiting;
        // key 1 has 60 a second of the 100 reserved.
        for _ in 0..300 {
            for (key, reserved) in [(1, a_reserved), (2, 0), (3, 0)] {
                let a = b.admit_call(
                    &limits,
                    1,
                    T0,
                    BucketCall {
                        cost: 1,
                        priority: Priority::Normal,
                        fair: Some(call(key, reserved)),
                    },
                    false,
                );
                if let Admission::Queued { ticket, .. } = a {
                    keys.insert(ticket, key);
                }
            }
        }
        let left = drain_fairly(&mut b, &limits, &keys, 2_000);
        let of = |k: u64| left.iter().filter(|l| **l == k).count();
        (of(1), of(2), of(3))
    };
    // Over 2 s (200 calls): its 60 a second, and a third of the other
    // 40 beside (as `fair::shares` divides a rate): 73/13/13.
    let (a, b, c) = run(60);
    assert!((140..=160).contains(&a), "{a}/{b}/{c}");
    assert!(
        (20..=32).contains(&b) && (20..=32).contains(&c),
        "{a}/{b}/{c}"
    );
    // Without the reservation, a third each.
    let (a, b, c) = run(0);
    assert!((63..=70).contains(&a), "{a}/{b}/{c}");
}

#[test]
fn backlogged_keys_leave_a_fair_queue_by_weight_and_in_order_within_a_key() {
    let limits = rate_queue(100, SEC.saturating_mul(10));
    let mut b = BucketState::new(0);
    let mut keys = BTreeMap::new();
    for _ in 0..300 {
        arrive_fairly(&mut b, &limits, &mut keys, T0, (1, 1_000));
        arrive_fairly(&mut b, &limits, &mut keys, T0, (2, 2_000));
    }
    let mut order = Vec::new();
    for t in 1..=3_000u64 {
        for ticket in b.poll(&limits, 1, T0 + ms(t - 1), T0 + ms(t)) {
            order.push(ticket);
        }
    }
    let twos = order.iter().take(300).filter(|t| keys[*t] == 2).count();
    assert!(
        (195..=205).contains(&twos),
        "{twos} of the first 300 to weight 2"
    );
    for key in [1, 2] {
        let mine: Vec<u64> = order.iter().copied().filter(|t| keys[t] == key).collect();
        assert!(
            mine.windows(2).all(|w| w[0] < w[1]),
            "first come first served within key {key}"
        );
    }
    // Everyone gone: the virtual time starts afresh.
    let rest = drain_fairly(&mut b, &limits, &keys, 20_000);
    assert!(
        b.waiters.is_empty(),
        "{} left over, {} drained",
        b.waiters.len(),
        rest.len()
    );
    assert_eq!(b.virtual_now, 0);
}

proptest::proptest! {
    /// Whatever the arrivals (keys, weights, costs, times): nothing
    /// panics, the state survives its bytes, calls of one key leave in
    /// the order they came, and the rate holds.
    #[test]
    fn a_fair_queue_keeps_order_within_a_key_and_the_rate(
        calls in proptest::collection::vec((0u64..5, 1u64..3_000_000, 1u64..4, 0u64..30), 1..150),
    ) {
        let limits = rate_queue(100, SEC.saturating_mul(5));
        let mut b = BucketState::new(0);
        let mut keys = BTreeMap::new();
        let mut now = T0;
        let mut left: Vec<u64> = Vec::new();
        let mut admitted_cost = 0;
        for (key, weight, cost, step) in calls {
            let previous = now;
            now += ms(step);
            for ticket in b.poll(&limits, 1, previous, now) {
                left.push(ticket);
            }
            let call = BucketCall { cost, priority: Priority::Normal, fair: Some(weighted(key + 1, weight)) };
            let a = b.admit_call(&limits, 1, now, call, false);
            match a {
                Admission::Queued { ticket, .. } => { keys.insert(ticket, (key, cost)); }
                Admission::Admitted { .. } => admitted_cost += cost,
                Admission::Rejected { .. } => {}
            }
            proptest::prop_assert_eq!(BucketState::decode(&b.encode()), Ok(b.clone()));
        }
        let end = now + SEC.saturating_mul(6);
        for ticket in b.poll(&limits, 1, now, end) {
            left.push(ticket);
        }
        for key in 0..5 {
            let mine: Vec<u64> = left.iter().copied().filter(|t| keys[t].0 == key).collect();
            proptest::prop_assert!(mine.windows(2).all(|w| w[0] < w[1]), "key {} out of order: {:?}", key, mine);
        }
        let total: u64 = admitted_cost + left.iter().map(|t| keys[t].1).sum::<u64>();
        let seconds = (end - T0).as_secs_f64();
        proptest::prop_assert!(total as f64 <= 1.0 + 100.0 * seconds, "{} in {} s", total, seconds);
    }
}

#[test]
fn broken_fair_bytes_are_refused() {
    let limits = rate_queue(10, SEC);
    let mut b = BucketState::new(0);
    for k in 1..4 {
        b.admit_call(
            &limits,
            1,
            T0,
            BucketCall {
                cost: 1,
                priority: Priority::Normal,
                fair: Some(weighted(k, 500)),
            },
            false,
        );
    }
    let bytes = b.encode();
    for cut in [1, 8, 24, 25] {
        assert!(
            BucketState::decode(&bytes[..bytes.len() - cut]).is_err(),
            "cut {cut}"
        );
    }
    let mut longer = bytes.clone();
    longer.push(0);
    assert!(BucketState::decode(&longer).is_err());
}

#[test]
fn queue_admits_in_arrival_order_at_the_rate() {
    let limits = rate_queue(50, SEC.saturating_mul(2));
    let mut b = BucketState::new(0);
    let mut outcomes = Vec::new();
    for i in 0..150u64 {
        outcomes.push(b.admit(&limits, 1 + i % 4, T0, 1, Priority::Normal));
    }
    let admitted_now = outcomes
        .iter()
        .filter(|o| matches!(o, Admission::Admitted { .. }))
        .count();
    let queued = outcomes
        .iter()
        .filter(|o| matches!(o, Admission::Queued { .. }))
        .count();
    let rejected = outcomes
        .iter()
        .filter(|o| matches!(o, Admission::Rejected { .. }))
        .count();
    assert_eq!((admitted_now, queued, rejected), (1, 100, 49));
    // Each worker polls every millisecond; turns come every 20 ms, in ticket order.
    let mut released = Vec::new();
    for t in 0..=2000u64 {
        for holder in 1..=4 {
            for ticket in b.poll(&limits, holder, T0 + ms(t.saturating_sub(1)), T0 + ms(t)) {
                released.push((t, ticket));
            }
        }
    }
    assert_eq!(released.len(), 100);
    for (i, (t, ticket)) in released.iter().enumerate() {
        assert_eq!(*ticket, i as u64);
        assert_eq!(*t, 20 * (i as u64 + 1));
    }
}

#[test]
fn late_polls_do_not_push_later_turns_back() {
    let limits = rate_queue(50, SEC.saturating_mul(2));
    let mut b = BucketState::new(0);
    let queued = (0..150u64)
        .filter(|_| {
            matches!(
                b.admit(&limits, 1, T0, 1, Priority::Normal),
                Admission::Queued { .. }
            )
        })
        .count();
    assert_eq!(queued, 100);
    // Ticks 7 ms apart: each release is up to 7 ms late, but the turns
    // stay on the 20 ms grid, so every queued request makes its deadline.
    let mut released = Vec::new();
    for t in (0..=2100u64).step_by(7) {
        for _ in b.poll(&limits, 1, T0 + ms(t.saturating_sub(7)), T0 + ms(t)) {
            released.push(t);
        }
    }
    assert_eq!(released.len(), 100);
    for (i, t) in released.iter().enumerate() {
        let turn = 20 * (i as u64 + 1);
        assert!((turn..turn + 7).contains(t), "turn {i} at {t} ms");
    }
}

/// The defect of issue 16: 20/s (burst 1) and 5 in flight, queued.
/// The first 5 calls hold their slots for a second; the waiters' rate
/// turns come and go meanwhile. When the slots come back, the waiters
/// must still leave at the rate, not all at once as of their old turns.
#[test]
fn waiters_held_up_by_slots_still_leave_at_the_rate() {
    let mut limits = rate_queue(20, SEC.saturating_mul(10));
    limits.concurrency = Some(ConcurrencyLimit {
        max_in_flight: 5,
        reserved_for_high: 0,
        lease_ttl: SEC.saturating_mul(60),
    });
    let mut b = BucketState::new(0);
    let mut admitted_at: Vec<u64> = Vec::new();
    let mut ends: Vec<u64> = Vec::new();
    // The first five calls take a second each, the others 10 ms.
    let admit = |admitted_at: &mut Vec<u64>, ends: &mut Vec<u64>, t: u64| {
        let held = if admitted_at.len() < 5 { 1_000 } else { 10 };
        admitted_at.push(t);
        ends.push(t + held);
    };
    for t in 0..=6_000u64 {
        let now = T0 + ms(t);
        while let Some(i) = ends.iter().position(|end| *end == t) {
            ends.swap_remove(i);
            assert!(b.release(1, b.lease_of(1).unwrap()));
        }
        if t < 40 {
            match b.admit(&limits, 1, now, 1, Priority::Normal) {
                Admission::Admitted { .. } => admit(&mut admitted_at, &mut ends, t),
                Admission::Queued { .. } => {}
                Admission::Rejected { .. } => panic!("refused at {t} ms"),
            }
        }
        for _ in b.poll(&limits, 1, T0 + ms(t.saturating_sub(1)), now) {
            admit(&mut admitted_at, &mut ends, t);
        }
    }
    assert_eq!(admitted_at.len(), 40, "every waiter left in time");
    // A rate of 20/s with a burst of 1: releases at least 50 ms apart,
    // but for the poll period (a turn may be noticed 1 ms late).
    let gaps: Vec<u64> = admitted_at.windows(2).map(|w| w[1] - w[0]).collect();
    assert!(gaps.iter().all(|g| *g >= 49), "release gaps {gaps:?} ms");
}

#[test]
fn a_waiter_that_leaves_frees_its_place() {
    let limits = rate_queue(10, SEC);
    let mut b = BucketState::new(0);
    assert!(matches!(
        b.admit(&limits, 1, T0, 1, Priority::Normal),
        Admission::Admitted { .. }
    ));
    let mut tickets = Vec::new();
    for _ in 0..10 {
        match b.admit(&limits, 1, T0, 1, Priority::Normal) {
            Admission::Queued { ticket, .. } => tickets.push(ticket),
            other => panic!("{other:?}"),
        }
    }
    assert!(matches!(
        b.admit(&limits, 2, T0, 1, Priority::Normal),
        Admission::Rejected { .. }
    ));
    assert!(b.cancel(1, tickets[3]));
    assert!(matches!(
        b.admit(&limits, 2, T0, 1, Priority::Normal),
        Admission::Queued { .. }
    ));
}

#[test]
fn slots_go_to_high_priority_first_then_fifo() {
    let q = QueueLimits {
        max_wait: SEC.saturating_mul(10),
        max_queue: 10,
    };
    // Three slots, one of them only for high priority.
    let limits = slots(3, 1, Some(q));
    let mut b = BucketState::new(0);
    let admitted = |a: Admission| matches!(a, Admission::Admitted { .. });
    assert!(admitted(b.admit(&limits, 1, T0, 1, Priority::Normal)));
    assert!(admitted(b.admit(&limits, 1, T0, 1, Priority::Normal)));
    assert!(matches!(
        b.admit(&limits, 1, T0, 1, Priority::Normal),
        Admission::Queued { ticket: 0, .. }
    ));
    assert!(matches!(
        b.admit(&limits, 2, T0, 1, Priority::Normal),
        Admission::Queued { ticket: 1, .. }
    ));
    // No high request waits: a high one takes the reserved slot at once...
    assert!(admitted(b.admit(&limits, 2, T0, 1, Priority::High)));
    // ...and the next high one queues ahead of the normal ones.
    assert!(matches!(
        b.admit(&limits, 2, T0, 1, Priority::High),
        Admission::Queued { ticket: 2, .. }
    ));
    assert_eq!(
        b.poll(&limits, 1, T0, T0),
        Vec::<u64>::new(),
        "head is holder 2's"
    );
    assert!(b.release(1, b.lease_of(1).unwrap()));
    assert_eq!(b.poll(&limits, 2, T0, T0), vec![2]);
    assert_eq!(
        b.poll(&limits, 2, T0, T0),
        Vec::<u64>::new(),
        "ticket 0 is next, and it is holder 1's"
    );
    assert_eq!(
        b.poll(&limits, 1, T0, T0),
        Vec::<u64>::new(),
        "normal requests stop one short of 3"
    );
    assert!(b.release(2, b.lease_of(2).unwrap()));
    assert_eq!(
        b.poll(&limits, 1, T0, T0),
        Vec::<u64>::new(),
        "2 in flight is still the normal ceiling"
    );
    assert!(b.release(2, b.lease_of(2).unwrap()));
    assert_eq!(b.poll(&limits, 1, T0, T0), vec![0]);
    assert_eq!(b.leases.in_flight(), 2);
}

#[test]
fn a_crashed_workers_waiters_expire() {
    let q = QueueLimits {
        max_wait: SEC,
        max_queue: 10,
    };
    let limits = slots(1, 0, Some(q));
    let mut b = BucketState::new(0);
    assert!(matches!(
        b.admit(&limits, 9, T0, 1, Priority::Normal),
        Admission::Admitted { .. }
    ));
    assert!(matches!(
        b.admit(&limits, 9, T0, 1, Priority::Normal),
        Admission::Queued { .. }
    ));
    assert!(b.release(9, b.lease_of(9).unwrap()));
    // Holder 9 died: its waiter blocks the head until its deadline.
    assert!(matches!(
        b.admit(&limits, 2, T0 + Span::from_nanos(10), 1, Priority::Normal),
        Admission::Queued { .. }
    ));
    assert_eq!(
        b.poll(&limits, 2, T0, T0 + Span::from_nanos(10)),
        Vec::<u64>::new()
    );
    assert_eq!(
        b.poll(&limits, 2, T0, T0 + SEC + Span::from_nanos(1)),
        vec![1]
    );
}

#[test]
fn reject_mode_takes_rate_and_slot_together() {
    let limits = BucketLimits {
        rate: Some(RateLimiter::TokenBucket(TokenBucket::new(1, SEC, 2, None))),
        concurrency: Some(ConcurrencyLimit {
            max_in_flight: 1,
            reserved_for_high: 0,
            lease_ttl: SEC,
        }),
        queue: None,
    };
    let mut b = BucketState::new(0);
    assert!(matches!(
        b.admit(&limits, 1, T0, 1, Priority::Normal),
        Admission::Admitted { .. }
    ));
    let before = b.rate;
    assert!(matches!(
        b.admit(&limits, 1, T0, 1, Priority::Normal),
        Admission::Rejected {
            kind: LimitKind::Concurrency,
            ..
        }
    ));
    assert_eq!(b.rate, before, "a refused request spends no tokens");
}

#[test]
fn a_finished_calls_slot_may_stay_with_its_holder_only_while_slots_are_to_spare() {
    // A rate near its limit (burst 2) hands out nothing ahead; the slots
    // decide whether a finished call's slot may wait for the next write.
    let limits = |max_in_flight| BucketLimits {
        rate: Some(RateLimiter::TokenBucket(TokenBucket::new(
            1_000_000, SEC, 2, None,
        ))),
        concurrency: Some(ConcurrencyLimit {
            max_in_flight,
            reserved_for_high: 0,
            lease_ttl: SEC,
        }),
        queue: None,
    };
    let admitted_then_prefetch = |max_in_flight| {
        let mut b = BucketState::new(0);
        assert!(matches!(
            b.admit(&limits(max_in_flight), 1, T0, 1, Priority::Normal),
            Admission::Admitted { .. }
        ));
        let lease = b.lease_of(1);
        (b.prefetch(&limits(max_in_flight), 1, T0, 2), lease)
    };
    let (spare, lease) = admitted_then_prefetch(1 + PREFETCH_SLACK as u32);
    assert_eq!(spare.requests, 0, "the rate is near its limit");
    assert!(spare.keeps_slots);
    assert_eq!(spare.lease, lease);
    let (scarce, _) = admitted_then_prefetch(PREFETCH_SLACK as u32);
    assert!(!scarce.keeps_slots, "3 free of 4: straight back");
    // Nobody asking ahead (a bucket this holder has not used lately), or
    // a queue: nothing kept.
    let mut b = BucketState::new(0);
    assert!(!b.prefetch(&limits(1000), 1, T0, 0).keeps_slots);
    let mut queued = limits(1000);
    queued.queue = Some(QueueLimits {
        max_wait: SEC,
        max_queue: 10,
    });
    assert!(!b.prefetch(&queued, 1, T0, 2).keeps_slots);
    // Without a concurrency limit there is no slot to keep.
    let mut rate_only = limits(1000);
    rate_only.concurrency = None;
    assert!(!b.prefetch(&rate_only, 1, T0, 2).keeps_slots);
}

#[test]
fn round_trips_and_refuses_garbage() {
    let limits = rate_queue(5, SEC);
    let mut b = BucketState::new(77);
    b.admit(&limits, 1, T0, 1, Priority::Normal);
    b.admit(&limits, 2, T0, 1, Priority::High);
    let mut s = slots(3, 0, None);
    s.rate = limits.rate;
    b.admit(&s, 3, T0, 1, Priority::Normal);
    assert_eq!(BucketState::decode(&b.encode()), Ok(b.clone()));
    let bytes = b.encode();
    for cut in 0..bytes.len() {
        assert!(BucketState::decode(&bytes[..cut]).is_err(), "cut at {cut}");
    }
    assert!(BucketState::decode(&[1, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]).is_err());
}
