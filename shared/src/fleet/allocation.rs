//! Splitting a global limit among the instances that sync, by demand:
//! an even floor each, then max-min fair shares of the rest.

use super::{Amount, Demand};

/// The part of a global limit kept as floors for idle instances.
pub const FLOOR_FRACTION: f64 = 0.05;

/// An instance is allotted up to this much more rate than it asked for.
/// Its asked rate is smoothed over about half a second (see `smooth`), so
/// it wobbles by a few percent; the bucket's burst (2 calls at least)
/// absorbs a share cut a little below the mean for a sync or two. Headroom
/// a small asker does not use is lost to the big ones (at 10 %, two Envoys
/// asking 50/s left 10/s of a 290/s limit unused), so it is kept small.
pub const RATE_HEADROOM: f64 = 1.02;

/// Splits `limit` among instances by demand: each gets an even part of
/// `floor_fraction` of the limit, then the rest is filled max-min fair:
/// an instance that wants less than an even split of what is left gets all
/// it wants (its rate with [`RATE_HEADROOM`]), and the big askers share the remainder evenly among them. Room
/// nobody asked for goes out in proportion to demand (evenly when nobody
/// wants anything), so a busy instance can grow before its next sync.
/// In-flight shares are whole calls; they never sum past the limit.
pub fn allocate(limit: Amount, floor_fraction: f64, demands: &[Demand]) -> Vec<Amount> {
    let n = demands.len();
    if n == 0 {
        return Vec::new();
    }
    let floor_fraction = floor_fraction.clamp(0.0, 1.0);
    let rates = split(
        limit.rate.max(0.0),
        floor_fraction,
        &demands
            .iter()
            .map(|d| d.rate.max(0.0) * RATE_HEADROOM)
            .collect::<Vec<_>>(),
    );
    let in_flight = if limit.in_flight == 0 {
        // No slots to split (a limit of rate alone): none for anybody, as
        // the split below comes to, without its work.
        vec![0; n]
    } else {
        split_slots(limit.in_flight, floor_fraction, demands)
    };
    rates
        .into_iter()
        .zip(in_flight)
        .map(|(rate, in_flight)| Amount { rate, in_flight })
        .collect()
}

/// The whole calls in flight of `limit` for each of `demands`.
fn split_slots(limit: u32, floor_fraction: f64, demands: &[Demand]) -> Vec<u32> {
    let n = demands.len();
    // The slots go to the instances that hold calls in flight to a count
    // only. Queued calls want a slot as much as running ones.
    let holders: Vec<usize> = (0..n).filter(|&i| !demands[i].holds_no_slots).collect();
    let wanted: Vec<f64> = holders
        .iter()
        .map(|&i| f64::from(demands[i].in_flight) + f64::from(demands[i].queued))
        .collect();
    // A slot each at least, where there are enough: an instance with none
    // refuses every call, and its next report shows no calls in flight to
    // ask more for.
    let m = holders.len();
    let slot_floor = if limit > 0 && m <= limit as usize && m > 0 {
        floor_fraction.max(m as f64 / f64::from(limit))
    } else {
        floor_fraction
    };
    let held = whole_calls(&split(f64::from(limit), slot_floor, &wanted), limit);
    let mut in_flight = vec![0; n];
    for (&i, slots) in holders.iter().zip(held) {
        in_flight[i] = slots;
    }
    in_flight
}

fn split(total: f64, floor_fraction: f64, demands: &[f64]) -> Vec<f64> {
    let n = demands.len();
    if n == 0 {
        return Vec::new();
    }
    let floor = total * floor_fraction / n as f64;
    let rest = (total - floor * n as f64).max(0.0);
    let wanted: Vec<f64> = demands
        .iter()
        .map(|&d| if d.is_finite() { d.max(0.0) } else { 0.0 })
        .collect();
    // What each wants beyond its floor.
    let need: Vec<f64> = wanted.iter().map(|w| (w - floor).max(0.0)).collect();
    let needed: f64 = need.iter().sum();
    let extra = if needed <= rest {
        // Everyone gets all they want; the spare goes by demand.
        let spare = rest - needed;
        let sum: f64 = wanted.iter().sum();
        need.iter()
            .zip(&wanted)
            .map(|(need, w)| {
                let part = if sum > 0.0 { w / sum } else { 1.0 / n as f64 };
                need + spare * part
            })
            .collect()
    } else {
        let level = water_level(&need, rest);
        need.iter()
            .map(|need| need.min(level))
            .collect::<Vec<f64>>()
    };
    extra.into_iter().map(|e| floor + e).collect()
}

/// The level L at which giving each `min(need, L)` hands out exactly
/// `room` (the needs add up to more than `room`).
fn water_level(need: &[f64], room: f64) -> f64 {
    let mut sorted = need.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mut left = room;
    let mut unsatisfied = sorted.len();
    for need in sorted {
        let even = left / unsatisfied as f64;
        if need > even {
            return even;
        }
        left -= need;
        unsatisfied -= 1;
    }
    f64::INFINITY
}

/// Rounds shares down to whole calls, then hands the calls left over to the
/// largest remainders: the sum is exactly `total` (or less, never more).
fn whole_calls(shares: &[f64], total: u32) -> Vec<u32> {
    // The nudge keeps a share of 0.999... (1.0 in floating point) whole.
    let mut whole: Vec<u32> = shares
        .iter()
        .map(|s| (s.max(0.0) + 1e-9).floor() as u32)
        .collect();
    let used: u64 = whole.iter().map(|&w| u64::from(w)).sum();
    let left = usize::try_from(u64::from(total).saturating_sub(used)).unwrap_or(usize::MAX);
    if left == 0 {
        return whole;
    }
    // The `left` largest remainders, ties to the first: a total order, so
    // selecting them is what sorting them all did, in linear time (a
    // thousand Envoys' slots were sorted at each sync).
    let mut by_remainder: Vec<usize> = (0..shares.len()).collect();
    let largest_first = |&a: &usize, &b: &usize| {
        let ra = shares[a] - shares[a].floor();
        let rb = shares[b] - shares[b].floor();
        rb.total_cmp(&ra).then(a.cmp(&b))
    };
    if left < by_remainder.len() {
        by_remainder.select_nth_unstable_by(left - 1, largest_first);
    }
    for &i in by_remainder.iter().take(left) {
        whole[i] += 1;
    }
    whole
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Selecting the largest remainders hands the calls left over to
        /// the same instances as sorting every remainder did.
        #[test]
        fn whole_calls_go_where_sorting_every_remainder_put_them(
            shares in proptest::collection::vec(0.0f64..50.0, 0..300),
            total in 0u32..5_000,
        ) {
            let mut sorted: Vec<u32> = shares.iter().map(|s| (s + 1e-9).floor() as u32).collect();
            let used: u64 = sorted.iter().map(|&w| u64::from(w)).sum();
            let mut order: Vec<usize> = (0..shares.len()).collect();
            order.sort_by(|&a, &b| {
                (shares[b] - shares[b].floor())
                    .total_cmp(&(shares[a] - shares[a].floor()))
                    .then(a.cmp(&b))
            });
            let left = u64::from(total).saturating_sub(used) as usize;
            for &i in order.iter().take(left) {
                sorted[i] += 1;
            }
            prop_assert_eq!(whole_calls(&shares, total), sorted);
        }
    }

    #[test]
    fn a_limit_of_rate_alone_gives_nobody_a_slot() {
        let rate_only = Amount {
            rate: 1000.0,
            in_flight: 0,
        };
        let shares = allocate(rate_only, 0.05, &[wants(300.0, 5), wants(100.0, 0)]);
        assert!(shares.iter().all(|s| s.in_flight == 0), "{shares:?}");
        assert!((shares.iter().map(|s| s.rate).sum::<f64>() - 1000.0).abs() < 1e-6);
    }

    const LIMIT: Amount = Amount {
        rate: 1000.0,
        in_flight: 100,
    };

    fn wants(rate: f64, in_flight: u32) -> Demand {
        Demand {
            rate,
            in_flight,
            queued: 0,
            holds_no_slots: false,
        }
    }

    #[test]
    fn an_instance_that_holds_no_slots_gets_rate_and_leaves_every_slot_to_the_others() {
        let rlqs = Demand {
            holds_no_slots: true,
            ..wants(300.0, 0)
        };
        let shares = allocate(LIMIT, 0.06, &[wants(300.0, 5), rlqs, wants(100.0, 1)]);
        assert_eq!(shares[1].in_flight, 0, "{shares:?}");
        assert_eq!(shares[0].in_flight + shares[2].in_flight, 100, "{shares:?}");
        assert!(shares[1].rate > 290.0, "{shares:?}");
        // Alone, it still gets the rate; the slots go to nobody.
        let alone = allocate(LIMIT, 0.06, &[rlqs]);
        assert_eq!(alone[0].in_flight, 0);
        assert!((alone[0].rate - LIMIT.rate).abs() < 1e-6, "{alone:?}");
    }

    #[test]
    fn shares_follow_demand_above_an_even_floor() {
        let shares = allocate(
            LIMIT,
            0.06,
            &[wants(800.0, 80), wants(100.0, 10), wants(100.0, 10)],
        );
        // Asked 1000/s, with headroom 1020/s: over the limit, the small
        // askers get theirs (102/s), the big one the rest.
        assert!((shares[1].rate - 102.0).abs() < 1e-9, "{shares:?}");
        assert!((shares[0].rate - 796.0).abs() < 1e-9, "{shares:?}");
        assert_eq!(shares.iter().map(|s| s.in_flight).sum::<u32>(), 100);
        assert!(shares[0].in_flight >= 79, "{shares:?}");
        // One asks for far more than the limit: the small askers still get
        // all they want, the big one the rest.
        let shares = allocate(
            LIMIT,
            0.06,
            &[wants(5_000.0, 500), wants(100.0, 10), wants(50.0, 5)],
        );
        assert!((shares[1].rate - 102.0).abs() < 1e-9, "{shares:?}");
        assert!((shares[2].rate - 51.0).abs() < 1e-9, "{shares:?}");
        assert!((shares[0].rate - 847.0).abs() < 1e-9, "{shares:?}");
        assert_eq!(
            shares.iter().map(|s| s.in_flight).collect::<Vec<_>>(),
            [85, 10, 5]
        );
        // Two big askers split what the small one leaves.
        let shares = allocate(
            LIMIT,
            0.0,
            &[wants(5_000.0, 0), wants(3_000.0, 0), wants(100.0, 0)],
        );
        assert!((shares[0].rate - 449.0).abs() < 1e-9, "{shares:?}");
        assert!((shares[1].rate - 449.0).abs() < 1e-9, "{shares:?}");
        // Nobody wants anything: an even split.
        let idle = allocate(LIMIT, 0.06, &[Demand::default(), Demand::default()]);
        assert_eq!(idle[0], idle[1]);
        assert_eq!(idle[0].in_flight + idle[1].in_flight, 100);
    }
}
