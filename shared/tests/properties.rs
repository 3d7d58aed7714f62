//! Property tests of the limiter algorithms: bounds that must hold for any
//! arrival sequence, checked against an independent oracle built from the
//! log of what was admitted.

use proptest::prelude::*;
use sluice_shared::limiter::*;
use sluice_shared::policy::Priority;
use sluice_shared::time::{Instant, Span};

const T0: u64 = 1_800_000_000_000_000_000;
const MS: u64 = 1_000_000;

/// The oracles below reason in plain nanoseconds; these cross into the
/// core's time types.
fn at(ns: u64) -> Instant {
    Instant::from_nanos(ns)
}

fn span(ns: u64) -> Span {
    Span::from_nanos(ns)
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    requests: u64,
    period_ns: u64,
    burst: u64,
}

fn bucket() -> impl Strategy<Value = Bucket> {
    (1u64..=50, 1u64..=2000, 1u64..=40).prop_map(|(requests, period_ms, burst)| Bucket {
        requests,
        period_ns: period_ms * MS,
        burst,
    })
}

/// Sorted arrival offsets (ns after T0), each with a cost.
fn arrivals(max_cost: u64) -> impl Strategy<Value = Vec<(u64, u64)>> {
    prop::collection::vec((0u64..3_000 * MS, 1u64..=max_cost), 1..250).prop_map(|mut v| {
        v.sort_by_key(|(t, _)| *t);
        v
    })
}

/// Σ cost over any admitted run [i..=j] ≤ burst + rate·(t_j − t_i + slack),
/// exactly: Σ·P ≤ burst·P + requests·(Δt + slack). Admissions happen at the
/// given instants (slack 0); reserved turns are reported rounded up to the
/// next whole nanosecond (slack 1).
fn assert_rate_bound(
    b: Bucket,
    admitted: &[(u64, u64)],
    slack_ns: u64,
) -> Result<(), TestCaseError> {
    for i in 0..admitted.len() {
        let mut sum = 0u128;
        for j in i..admitted.len() {
            sum += u128::from(admitted[j].1);
            let dt = u128::from(admitted[j].0 - admitted[i].0 + slack_ns);
            let lhs = sum * u128::from(b.period_ns);
            let rhs = u128::from(b.burst) * u128::from(b.period_ns) + u128::from(b.requests) * dt;
            prop_assert!(
                lhs <= rhs,
                "{} tokens in {} ns, bound {} + {}/{}ns",
                sum,
                dt,
                b.burst,
                b.requests,
                b.period_ns
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn token_bucket_never_exceeds_burst_plus_rate(b in bucket(), seq in arrivals(40)) {
        let tb = TokenBucket::new(b.requests, span(b.period_ns), b.burst, None);
        let mut state = TokenBucketState::default();
        let mut admitted = Vec::new();
        for (t, cost) in seq {
            let cost = cost.min(b.burst);
            if tb.try_acquire(&mut state, at(T0 + t), cost).is_admit() {
                admitted.push((t, cost));
            }
        }
        assert_rate_bound(b, &admitted, 0)?;
    }

    #[test]
    fn warmup_only_ever_tightens_the_bound(
        b in bucket(), seq in arrivals(40), warm_ms in 1u64..5000, cold in 2u32..=10,
    ) {
        let w = Warmup { period: span(warm_ms * MS), cold_factor: cold };
        let tb = TokenBucket::new(b.requests, span(b.period_ns), b.burst, Some(w));
        let mut state = TokenBucketState::default();
        let mut admitted = Vec::new();
        for (t, cost) in seq {
            let cost = cost.min(b.burst);
            if tb.try_acquire(&mut state, at(T0 + t), cost).is_admit() {
                admitted.push((t, cost));
            }
        }
        assert_rate_bound(b, &admitted, 0)?;
    }

    #[test]
    fn token_bucket_admits_when_tokens_are_there(b in bucket(), gap_ms in 0u64..5000) {
        // Not a limiter that refuses everything: after a full refill the
        // whole burst goes through at once.
        let tb = TokenBucket::new(b.requests, span(b.period_ns), b.burst, None);
        let mut state = TokenBucketState::default();
        let _ = tb.try_acquire(&mut state, at(T0), b.burst);
        let refill = b.burst * b.period_ns / b.requests + 1;
        let later = T0 + refill + gap_ms * MS;
        prop_assert!(tb.try_acquire(&mut state, at(later), b.burst).is_admit());
    }

    #[test]
    fn reservations_are_fifo_bounded_and_respect_the_rate(
        b in bucket(), seq in arrivals(40), max_wait_ms in 0u64..3000,
    ) {
        let tb = TokenBucket::new(b.requests, span(b.period_ns), b.burst, None);
        let mut state = TokenBucketState::default();
        let max_wait = max_wait_ms * MS;
        let mut turns: Vec<(u64, u64)> = Vec::new();
        for (t, cost) in seq {
            let cost = cost.min(b.burst);
            if let Reservation::At { instant } = tb.reserve(&mut state, at(T0 + t), cost, span(max_wait)) {
                let instant = instant.as_nanos() - T0;
                prop_assert!(instant >= t, "turn before arrival");
                prop_assert!(instant - t <= max_wait, "turn {} ns ahead, max {}", instant - t, max_wait);
                if let Some((last, _)) = turns.last() {
                    prop_assert!(instant >= *last, "turn {} before earlier turn {}", instant, last);
                }
                turns.push((instant, cost));
            }
        }
        // The turns themselves are a schedule the bucket allows.
        assert_rate_bound(b, &turns, 1)?;
    }

    #[test]
    fn fixed_window_never_exceeds_limit_per_window(
        limit in 1u64..30, period_ms in 1u64..1000, seq in arrivals(30), reserve_some in any::<bool>(),
    ) {
        let period = period_ms * MS;
        let fw = FixedWindow::new(limit, span(period));
        let mut state = FixedWindowState::default();
        let mut admitted: Vec<(u64, u64)> = Vec::new();
        for (i, (t, cost)) in seq.into_iter().enumerate() {
            let cost = cost.min(limit);
            let now = T0 + t;
            if reserve_some && i % 3 == 0 {
                if let Reservation::At { instant } = fw.reserve(&mut state, at(now), cost, span(2 * period)) {
                    admitted.push((instant.as_nanos(), cost));
                }
            } else if fw.try_acquire(&mut state, at(now), cost).is_admit() {
                admitted.push((now, cost));
            }
        }
        let mut per_window = std::collections::BTreeMap::<u64, u64>::new();
        for (t, c) in &admitted {
            *per_window.entry(t / period).or_default() += c;
        }
        for (w, n) in per_window {
            prop_assert!(n <= limit, "window {} got {} > {}", w, n, limit);
        }
    }

    #[test]
    fn sliding_window_estimate_never_exceeds_limit(
        limit in 1u64..30, period_ms in 1u64..1000, seq in arrivals(30), reserve_some in any::<bool>(),
    ) {
        let period = period_ms * MS;
        let sw = SlidingWindow::new(limit, span(period));
        let mut state = SlidingWindowState::default();
        let mut admitted: Vec<(u64, u64)> = Vec::new();
        for (i, (t, cost)) in seq.into_iter().enumerate() {
            let cost = cost.min(limit);
            let now = T0 + t;
            if reserve_some && i % 3 == 0 {
                if let Reservation::At { instant } = sw.reserve(&mut state, at(now), cost, span(2 * period)) {
                    admitted.push((instant.as_nanos(), cost));
                }
            } else if sw.try_acquire(&mut state, at(now), cost).is_admit() {
                admitted.push((now, cost));
            }
        }
        // Oracle: at every admitted instant, previous window's total weighted
        // by its overlap with the last period, plus the current window's
        // total up to and including that instant, stays within the limit.
        for &(t, _) in &admitted {
            let w = t / period;
            let offset = u128::from(t % period);
            let prev: u64 = admitted.iter().filter(|(u, _)| u / period + 1 == w).map(|(_, c)| c).sum();
            let cur: u64 = admitted.iter().filter(|(u, _)| u / period == w && *u <= t).map(|(_, c)| c).sum();
            let lhs = u128::from(prev) * (u128::from(period) - offset) + u128::from(cur) * u128::from(period);
            prop_assert!(lhs <= u128::from(limit) * u128::from(period),
                "at {}: prev {} cur {} limit {}", t, prev, cur, limit);
            prop_assert!(cur <= limit);
        }
    }

    #[test]
    fn time_going_backwards_never_admits_extra(b in bucket(), times in prop::collection::vec(0u64..3_000 * MS, 1..200)) {
        let tb = TokenBucket::new(b.requests, span(b.period_ns), b.burst, None);
        let fw = FixedWindow::new(b.burst, span(b.period_ns));
        let sw = SlidingWindow::new(b.burst, span(b.period_ns));
        let (mut st, mut sf, mut ss) = (TokenBucketState::default(), FixedWindowState::default(), SlidingWindowState::default());
        let (mut nt, mut nf, mut ns) = (0u64, 0u64, 0u64);
        for &t in &times {
            nt += u64::from(tb.try_acquire(&mut st, at(T0 + t), 1).is_admit());
            nf += u64::from(fw.try_acquire(&mut sf, at(T0 + t), 1).is_admit());
            ns += u64::from(sw.try_acquire(&mut ss, at(T0 + t), 1).is_admit());
        }
        let lo = *times.iter().min().unwrap_or(&0);
        let hi = *times.iter().max().unwrap_or(&0);
        let span = u128::from(hi - lo);
        prop_assert!(u128::from(nt) * u128::from(b.period_ns)
            <= u128::from(b.burst) * u128::from(b.period_ns) + u128::from(b.requests) * span);
        let windows = (T0 + hi) / b.period_ns - (T0 + lo) / b.period_ns + 1;
        prop_assert!(nf <= b.burst * windows, "fixed: {} in {} windows", nf, windows);
        prop_assert!(ns <= b.burst * windows, "sliding: {} in {} windows", ns, windows);
    }

    #[test]
    fn states_round_trip(tat in any::<u64>(), frac in any::<u32>(), ramp in any::<u64>(), a in any::<u64>(), c in any::<u64>(), d in any::<u64>()) {
        let tb = RateState::TokenBucket(TokenBucketState { tat_ns: tat, tat_frac: frac, ramp_start_ns: ramp, token_ps: d, burst: frac });
        prop_assert_eq!(RateState::decode(&tb.encode()), Ok(tb));
        let fw = RateState::FixedWindow(FixedWindowState { window_start: at(a), count: c });
        prop_assert_eq!(RateState::decode(&fw.encode()), Ok(fw));
        let sw = RateState::SlidingWindow(SlidingWindowState { window_start: at(a), current: c, previous: d });
        prop_assert_eq!(RateState::decode(&sw.encode()), Ok(sw));
    }

    #[test]
    fn lease_table_round_trips(leases in prop::collection::vec((any::<u64>(), 1u32..1000, any::<u64>()), 0..40)) {
        let limit = ConcurrencyLimit { max_in_flight: u32::MAX, reserved_for_high: 0, lease_ttl: Span::ZERO };
        let mut table = LeaseTable::default();
        for (holder, count, when) in leases {
            for _ in 0..count.min(3) {
                let _ = table.acquire(&limit, holder, Instant::from_nanos(when / 2), Priority::Normal);
            }
        }
        prop_assert_eq!(LeaseTable::decode(&table.encode()), Ok(table));
    }

    #[test]
    fn decoders_never_panic_on_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        let _ = RateState::decode(&bytes);
        let _ = LeaseTable::decode(&bytes);
        let _ = TokenBucketState::decode(&bytes);
    }
}

#[derive(Debug, Clone)]
enum Op {
    Acquire { holder: usize, high: bool },
    Release { holder: usize },
    Tick { ms: u64 },
    Crash { holder: usize },
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(
        prop_oneof![
            4 => (0usize..4, any::<bool>()).prop_map(|(holder, high)| Op::Acquire { holder, high }),
            3 => (0usize..4).prop_map(|holder| Op::Release { holder }),
            2 => (1u64..400).prop_map(|ms| Op::Tick { ms }),
            1 => (0usize..4).prop_map(|holder| Op::Crash { holder }),
        ],
        1..300,
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    /// A model of four workers: live ones renew on every tick and release
    /// what they took; a crashed one is replaced by a new holder id and its
    /// slots are lost until the lease expires. Live requests never exceed
    /// the limit, normal ones stay out of the reserved lane, and every live
    /// holder's lease count equals what it really has in flight.
    #[test]
    fn concurrency_never_admits_more_than_max_in_flight(
        max in 1u32..8, reserved in 0u32..3, ttl_ms in 400u64..1000, ops in ops(),
    ) {
        let limit = ConcurrencyLimit {
            max_in_flight: max,
            reserved_for_high: reserved.min(max - 1),
            lease_ttl: span(ttl_ms * MS),
        };
        let mut table = LeaseTable::default();
        let mut now = T0;
        let mut holder_ids = [1u64, 2, 3, 4];
        let mut next_id = 5u64;
        let mut in_flight = [0u32; 4];
        // Slots of crashed holders, with the instant their lease runs out.
        let mut orphaned: Vec<(u32, u64)> = Vec::new();
        let mut lease_end = [0u64; 4];
        for op in ops {
            match op {
                Op::Acquire { holder, high } => {
                    let priority = if high { Priority::High } else { Priority::Normal };
                    if table.acquire(&limit, holder_ids[holder], at(now), priority).is_admit() {
                        in_flight[holder] += 1;
                        lease_end[holder] = lease_end[holder].max(now + limit.lease_ttl.as_nanos());
                        let live: u32 = in_flight.iter().sum();
                        let orphans: u32 = orphaned.iter().filter(|(_, end)| *end >= now).map(|(n, _)| n).sum();
                        let ceiling = if high { max } else { max - limit.reserved_for_high };
                        prop_assert!(live + orphans <= ceiling, "{} live + {} orphaned > {}", live, orphans, ceiling);
                    }
                }
                Op::Release { holder } => {
                    if in_flight[holder] > 0 {
                        let lease = table.lease_of(holder_ids[holder]);
                        prop_assert!(lease.is_some_and(|l| table.release(holder_ids[holder], l)));
                        in_flight[holder] -= 1;
                    }
                }
                Op::Tick { ms } => {
                    now += ms * MS;
                    // Live workers renew on every tick, and ticks come well
                    // within the TTL (as in the filter).
                    for (h, id) in holder_ids.iter().enumerate() {
                        if in_flight[h] > 0 {
                            prop_assert!(table.renew(*id, at(now), limit.lease_ttl), "live lease lost");
                            lease_end[h] = now + limit.lease_ttl.as_nanos();
                        }
                    }
                }
                Op::Crash { holder } => {
                    orphaned.push((in_flight[holder], lease_end[holder]));
                    in_flight[holder] = 0;
                    lease_end[holder] = 0;
                    holder_ids[holder] = next_id;
                    next_id += 1;
                }
            }
            for (h, id) in holder_ids.iter().enumerate() {
                prop_assert_eq!(table.held_by(*id), in_flight[h], "holder {}", h);
            }
        }
        // Live workers finish their requests: what is left is exactly the
        // crashed workers' unexpired slots, and after the TTL nothing.
        for (h, id) in holder_ids.iter().enumerate() {
            for _ in 0..in_flight[h] {
                let lease = table.lease_of(*id);
                prop_assert!(lease.is_some_and(|l| table.release(*id, l)));
            }
        }
        table.reclaim_expired(at(now));
        let orphans: u32 = orphaned.iter().filter(|(_, end)| *end >= now).map(|(n, _)| n).sum();
        prop_assert_eq!(table.in_flight(), orphans);
        table.reclaim_expired(at(now + limit.lease_ttl.as_nanos() + 1));
        prop_assert_eq!(table.in_flight(), 0);
    }
}

/// Workers spending tokens prefetched by `BucketState::prefetch` stay
/// within burst + rate·(T + PREFETCH_TTL) over any interval T, however
/// requests spread over the workers.
mod prefetches {
    use super::*;
    use sluice_filter_core::bucket::{Admission, BucketLimits, BucketState, PREFETCH_TTL};

    fn busy_bucket() -> impl Strategy<Value = Bucket> {
        (1u64..=5000, 1u64..=1000, 1u64..=400).prop_map(|(requests, period_ms, burst)| Bucket {
            requests,
            period_ns: period_ms * MS,
            burst,
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn prefetched_tokens_stay_within_the_bound_plus_one_prefetch_lifetime(
            b in busy_bucket(),
            seq in prop::collection::vec((0u64..300 * MS, 1u64..=3, 0usize..4), 1..400)
                .prop_map(|mut v| { v.sort_by_key(|x| x.0); v }),
        ) {
            let limits = BucketLimits {
                rate: Some(RateLimiter::TokenBucket(TokenBucket::new(b.requests, span(b.period_ns), b.burst, None))),
                concurrency: None,
                queue: None,
            };
            let mut shared = BucketState::new(0);
            // Per worker: (tokens, until, last prefetch).
            let mut local = [(0u64, 0u64, 0u64); 4];
            let mut admitted = Vec::new();
            for (offset, cost, worker) in seq {
                // Validation refuses a cost above the burst.
                let cost = cost.min(b.burst);
                let now = T0 + offset;
                let (tokens, until, last) = &mut local[worker];
                if now < *until && *tokens >= cost {
                    *tokens -= cost;
                    admitted.push((now, cost));
                    continue;
                }
                let wanted = ((*last).max(1) * 2).min(64);
                if let Admission::Admitted { .. } = shared.admit(&limits, 1, at(now), cost, Priority::Normal) {
                    admitted.push((now, cost));
                    let prefetched = shared.prefetch(&limits, 1, at(now), wanted).tokens;
                    *tokens = prefetched;
                    *until = now + PREFETCH_TTL.as_nanos();
                    *last = prefetched;
                }
            }
            assert_rate_bound(b, &admitted, PREFETCH_TTL.as_nanos())?;
        }
    }
}
