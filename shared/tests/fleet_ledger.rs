//! Fleet leases in rounds of syncs with lost requests, lost answers,
//! changing demand, instances dying, the admin losing its record (Redis
//! restarted empty) and the admin stopping: what the live instances enforce
//! never sums past the limit, and when every answer arrives the shares
//! settle on the targets.
//!
//! The one assumption (stated in the module docs): while the admin serves
//! the others, a live instance reaches it at least once every one and a
//! half lease periods. Longer than that is a partition, where the admin
//! gives a silent instance's share away. An outage of the admin itself
//! (nobody reaches it) is no partition, and is among the rounds.

use proptest::prelude::*;
use sluice_shared::fleet::{allocate, share_in_force, Amount, Demand, FleetTerms, Ledger, Share};
use sluice_shared::time::{Instant, Span};

const N: usize = 3;
const TERMS: FleetTerms = FleetTerms {
    limit: Amount {
        rate: 1000.0,
        in_flight: 100,
    },
    lease: Span::from_secs(2),
    floor_fraction: 0.05,
};

/// The slots handed out among `demands`: all of the limit's, unless none
/// of them holds slots.
fn slots_handed_out(demands: &[Demand]) -> u32 {
    if demands.iter().all(|d| d.holds_no_slots) {
        0
    } else {
        TERMS.limit.in_flight
    }
}

/// Some instances hold no slots (stock Envoys through RLQS).
fn demand() -> impl Strategy<Value = Demand> {
    (
        0.0f64..3_000.0,
        0u32..300,
        0u32..50,
        prop::bool::weighted(0.2),
    )
        .prop_map(|(rate, in_flight, queued, holds_no_slots)| Demand {
            rate,
            in_flight: if holds_no_slots { 0 } else { in_flight },
            queued: if holds_no_slots { 0 } else { queued },
            holds_no_slots,
        })
}

/// What one instance does in a round.
#[derive(Debug, Clone)]
struct Turn {
    /// Its sync reached the admin.
    reached: bool,
    /// The answer reached it back.
    answered: bool,
    demand: Demand,
}

#[derive(Debug, Clone)]
struct Round {
    wait_ms: u64,
    turns: Vec<Turn>,
    dies: Option<usize>,
    /// The ledger is lost before this round's syncs.
    ledger_lost: bool,
    /// The admin is out of reach for this long before this round (its
    /// database down): no sync reaches it.
    outage_ms: Option<u64>,
}

fn rounds() -> impl Strategy<Value = Vec<Round>> {
    let turn = (
        prop::bool::weighted(0.8),
        prop::bool::weighted(0.8),
        demand(),
    )
        .prop_map(|(reached, answered, demand)| Turn {
            reached,
            answered,
            demand,
        });
    let round = (
        50u64..1_000,
        prop::collection::vec(turn, N),
        prop::option::weighted(0.03, 0..N),
        prop::bool::weighted(0.05),
        prop::option::weighted(0.05, 2_000u64..10_000),
    )
        .prop_map(|(wait_ms, turns, dies, ledger_lost, outage_ms)| Round {
            wait_ms,
            turns,
            dies,
            ledger_lost,
            outage_ms,
        });
    prop::collection::vec(round, 1..80)
}

struct Instance {
    name: &'static str,
    alive: bool,
    newest: Option<Share>,
    last_reached_ms: u64,
}

/// The admin's clock reads nanoseconds; `now` is in milliseconds.
fn at(now_ms: u64) -> Instant {
    Instant::from_nanos(now_ms * 1_000_000 + 654_321)
}

/// A share as an Envoy reports it back: its id is whole milliseconds.
fn as_reported(share: Share) -> Share {
    Share {
        expires_at: Instant::from_millis(share.id()),
        ..share
    }
}

fn enforced(instances: &[Instance], now: u64) -> Amount {
    instances
        .iter()
        .filter(|i| i.alive)
        .map(|i| share_in_force(i.newest, TERMS.limit, at(now)))
        .fold(Amount::default(), |acc, s| Amount {
            rate: acc.rate + s.rate,
            in_flight: acc.in_flight + s.in_flight,
        })
}

fn within_limit(sum: Amount) -> bool {
    sum.in_flight <= TERMS.limit.in_flight && sum.rate <= TERMS.limit.rate * (1.0 + 1e-9)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2_000, ..ProptestConfig::default() })]

    #[test]
    fn what_live_instances_enforce_never_exceeds_the_limit(
        rounds in rounds(),
        after_the_admin_stops in prop::collection::vec(0u64..20_000, 1..10),
    ) {
        let mut ledger = Ledger::default();
        let mut instances: Vec<Instance> = ["a", "b", "c"]
            .into_iter()
            .map(|name| Instance { name, alive: true, newest: None, last_reached_ms: 0 })
            .collect();
        let mut now = 0u64;
        for round in rounds {
            if let Some(outage) = round.outage_ms {
                // Nothing reaches the admin; what the instances enforce
                // (their fallbacks, once leases lapse) must hold meanwhile.
                for step in (0..outage).step_by(250) {
                    let sum = enforced(&instances, now + step);
                    prop_assert!(within_limit(sum), "{sum:?} during an outage");
                }
                now += outage;
                for inst in &mut instances {
                    inst.last_reached_ms = now;
                }
            }
            now += round.wait_ms;
            if let Some(d) = round.dies {
                instances[d].alive = false;
            }
            if round.ledger_lost {
                // Redis restarted empty; the admin finds the ledger gone.
                ledger = Ledger::default();
                ledger.lost();
            }
            for (i, turn) in round.turns.iter().enumerate() {
                let inst = &mut instances[i];
                // A live instance reaches the admin at least once every one
                // and a half lease periods (after that, the admin gives its
                // share away).
                let overdue = now.saturating_sub(inst.last_reached_ms) + 1_000 >= TERMS.lease.as_millis() * 3 / 2;
                if !inst.alive || !(turn.reached || overdue) {
                    continue;
                }
                inst.last_reached_ms = now;
                let whole_before = ledger.reserved(&TERMS, at(now));
                let own_before = ledger.reserved_by(&TERMS, inst.name, at(now));
                let share = ledger.sync(
                    &TERMS,
                    inst.name,
                    turn.demand,
                    inst.newest.map(as_reported),
                    at(now),
                );
                // What a sync moves of the whole is what it moves of its
                // own member: the admin weighs that one only to tell the
                // others to sync now (`admin/src/fleet.rs`, `sync_one`).
                let whole_after = ledger.reserved(&TERMS, at(now));
                let own_after = ledger.reserved_by(&TERMS, inst.name, at(now));
                let moved = (whole_before.rate - whole_after.rate) - (own_before.rate - own_after.rate);
                prop_assert!(moved.abs() <= 1e-9 * TERMS.limit.rate, "{moved} at {now}");
                prop_assert_eq!(
                    i64::from(whole_before.in_flight) - i64::from(whole_after.in_flight),
                    i64::from(own_before.in_flight) - i64::from(own_after.in_flight)
                );
                if turn.answered {
                    inst.newest = Some(share);
                }
                let sum = enforced(&instances, now);
                prop_assert!(within_limit(sum), "{sum:?} at {now}");
            }
        }
        // The admin stops: no more shares. Leases run out, instances fall
        // back, and the sum still holds, for good.
        for later in after_the_admin_stops {
            let sum = enforced(&instances, now + later);
            prop_assert!(within_limit(sum), "{sum:?} {later} ms after the admin stopped");
        }
    }

    #[test]
    fn with_every_answer_delivered_shares_settle_on_the_targets(
        demands in prop::collection::vec(demand(), N),
    ) {
        let mut ledger = Ledger::default();
        let mut newest: Vec<Option<Share>> = vec![None; N];
        let mut now = 0;
        // Three rounds, 100 ms apart: the first meets old shares, the second
        // supersedes them, the third takes the freed room.
        for _ in 0..3 {
            for (i, name) in ["a", "b", "c"].iter().enumerate() {
                now += 100;
                newest[i] = Some(ledger.sync(&TERMS, name, demands[i], newest[i].map(as_reported), at(now)));
            }
        }
        let targets = allocate(TERMS.limit, TERMS.floor_fraction, &demands);
        for (i, target) in targets.iter().enumerate() {
            let share = newest[i].map(|s| s.amount).unwrap_or_default();
            prop_assert_eq!(share.in_flight, target.in_flight);
            prop_assert!((share.rate - target.rate).abs() < 1e-6);
        }
        // The whole limit is in use (its slots by those that hold slots).
        let used: u32 = newest.iter().flatten().map(|s| s.amount.in_flight).sum();
        prop_assert_eq!(used, slots_handed_out(&demands));
    }

    #[test]
    fn allocation_keeps_floors_and_never_exceeds_the_limit(
        demands in prop::collection::vec(demand(), 1..20),
        floor in 0.0f64..0.5,
    ) {
        let shares = allocate(TERMS.limit, floor, &demands);
        let rate: f64 = shares.iter().map(|s| s.rate).sum();
        let in_flight: u32 = shares.iter().map(|s| s.in_flight).sum();
        prop_assert!(rate <= TERMS.limit.rate * (1.0 + 1e-9));
        prop_assert_eq!(in_flight, slots_handed_out(&demands));
        let rate_floor = TERMS.limit.rate * floor / demands.len() as f64;
        let even = TERMS.limit.rate / demands.len() as f64;
        for (s, d) in shares.iter().zip(&demands) {
            prop_assert!(s.rate >= rate_floor * (1.0 - 1e-9));
            // Max-min fair: asking for no more than an even split, an
            // instance gets all it asks.
            prop_assert!(s.rate >= d.rate.min(even) * (1.0 - 1e-9), "{s:?} for {d:?}");
        }
        // Those that hold no slots get none; the others a slot each, where
        // there are enough.
        let holders = demands.iter().filter(|d| !d.holds_no_slots).count();
        for (s, d) in shares.iter().zip(&demands) {
            if d.holds_no_slots {
                prop_assert_eq!(s.in_flight, 0, "{:?}", shares);
            } else if holders <= TERMS.limit.in_flight as usize {
                prop_assert!(s.in_flight >= 1, "a slot each: {:?}", shares);
            }
        }
        if demands.iter().map(|d| d.rate).sum::<f64>() >= TERMS.limit.rate {
            prop_assert!(rate >= TERMS.limit.rate * (1.0 - 1e-9), "all of it in use: {rate}");
        }
    }
}
