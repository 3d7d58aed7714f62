//! Fleet mode's arithmetic: one global limit shared by many Envoys through
//! leases the admin grants at each sync, weighted by the demand each Envoy
//! reports. Pure: time is a parameter (`now_ms`).
//!
//! An instance enforces the newest grant it received while it runs; once
//! it lapses (the admin out of reach), the smaller of that grant and an even
//! split of the limit among the instances the admin counted when it made
//! the grant ([`share_in_force`]).
//!
//! The admin gives out only room the others may be using. Per instance it
//! keeps every grant the instance may still apply (a sent answer may have
//! been lost, so until the instance says which it applies, any of them) and
//! reserves the largest: a running grant in full, a lapsed one at its
//! fallback. The reservation of an instance it no longer hears from ends
//! half a lease after its last grant ran out (one and a half lease periods
//! after its last sync, whichever is later): a dead instance's share goes
//! back to the rest within two lease periods of its death. A live instance
//! that misses syncs for that long is taken for dead.
//! An instance cut off from an admin that is still serving others (a
//! partition, not a crash) may then overshoot by its fallback; a stopped
//! admin reallocates nothing, so there the sum holds for good.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::limiter::{ConcurrencyLimit, RateLimiter, TokenBucket};
use crate::policy::Policy;

/// The part of a global limit kept as floors for idle instances.
pub const FLOOR_FRACTION: f64 = 0.05;

/// An instance is allotted up to this much more rate than it asked for: a
/// rate measured over a sync interval wobbles (2 calls ± 1 at 10/s and
/// 200 ms), and a share cut to the measured mean refuses the calls above it.
/// Headroom a small asker does not use is lost to the big ones, so it is
/// kept small.
pub const RATE_HEADROOM: f64 = 1.1;

/// A quantity of a limit: requests per second and calls in flight.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Amount {
    pub rate: f64,
    pub in_flight: u32,
}

impl Amount {
    fn max(self, other: Amount) -> Amount {
        Amount {
            rate: self.rate.max(other.rate),
            in_flight: self.in_flight.max(other.in_flight),
        }
    }

    fn min(self, other: Amount) -> Amount {
        Amount {
            rate: self.rate.min(other.rate),
            in_flight: self.in_flight.min(other.in_flight),
        }
    }

    fn plus(self, other: Amount) -> Amount {
        Amount {
            rate: self.rate + other.rate,
            in_flight: self.in_flight.saturating_add(other.in_flight),
        }
    }

    fn minus(self, other: Amount) -> Amount {
        Amount {
            rate: (self.rate - other.rate).max(0.0),
            in_flight: self.in_flight.saturating_sub(other.in_flight),
        }
    }
}

/// What an instance would use if nothing held it back: the calls it was
/// asked to make per second (admitted and refused), the calls it wanted in
/// flight, and its queue.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Demand {
    pub rate: f64,
    pub in_flight: u32,
    pub queued: u32,
}

/// A share of the global limit, valid until `expires_at_ms`; `instances`
/// is how many the admin counted when it made it (what a lapsed grant
/// falls back to splits the limit that many ways).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Grant {
    pub share: Amount,
    pub expires_at_ms: u64,
    pub instances: u32,
}

/// A global policy's limit and lease terms.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FleetTerms {
    pub limit: Amount,
    pub lease_ms: u64,
    /// The part of the limit kept as floors, split evenly, so that an idle
    /// instance's first calls are not refused.
    pub floor_fraction: f64,
}

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
    // Queued calls want a slot as much as running ones.
    let wanted: Vec<f64> = demands
        .iter()
        .map(|d| f64::from(d.in_flight) + f64::from(d.queued))
        .collect();
    // A slot each at least, where there are enough: an instance with none
    // refuses every call, and its next report shows no calls in flight to
    // ask more for.
    let slot_floor = if limit.in_flight > 0 && n <= limit.in_flight as usize {
        floor_fraction.max(n as f64 / f64::from(limit.in_flight))
    } else {
        floor_fraction
    };
    let in_flight = whole_calls(
        &split(f64::from(limit.in_flight), slot_floor, &wanted),
        limit.in_flight,
    );
    rates
        .into_iter()
        .zip(in_flight)
        .map(|(rate, in_flight)| Amount { rate, in_flight })
        .collect()
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
    let mut left = u64::from(total).saturating_sub(used);
    let mut by_remainder: Vec<usize> = (0..shares.len()).collect();
    by_remainder.sort_by(|&a, &b| {
        let ra = shares[a] - shares[a].floor();
        let rb = shares[b] - shares[b].floor();
        rb.total_cmp(&ra).then(a.cmp(&b))
    });
    for i in by_remainder {
        if left == 0 {
            break;
        }
        whole[i] += 1;
        left -= 1;
    }
    whole
}

/// The share an instance enforces of a global limit, given the newest
/// grant it received: the grant while it runs, then the smaller of it and
/// an even split (never more than either). Nothing before its first grant:
/// the admin has reserved nothing for it yet (the first sync is at start).
pub fn share_in_force(newest: Option<Grant>, limit: Amount, now_ms: u64) -> Amount {
    match newest {
        None => Amount::default(),
        Some(g) if g.expires_at_ms > now_ms => g.share,
        Some(g) => g.share.min(even_split(limit, g.instances)),
    }
}

fn even_split(limit: Amount, instances: u32) -> Amount {
    let n = instances.max(1);
    Amount {
        rate: limit.rate / f64::from(n),
        in_flight: limit.in_flight / n,
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Member {
    demand: Demand,
    last_heard_ms: u64,
    /// The grants it may still apply, oldest first.
    grants: Vec<Grant>,
    /// Its counters at its last sync, to turn the next ones into rates.
    #[serde(default)]
    usage: Option<Usage>,
    /// What it admitted per second over the last whole window of at least
    /// [`USED_WINDOW_MS`], and held in flight at its last sync.
    #[serde(default)]
    used: Amount,
    /// Its counters where the current window began.
    #[serde(default)]
    used_since: Option<Usage>,
}

/// Use is counted over at least this long: syncs are not evenly spaced,
/// and a count over two syncs 20 ms apart says little about a rate.
pub const USED_WINDOW_MS: u64 = 1_000;

impl Member {
    /// The most it may be enforcing now (0 once its reservation ended).
    fn reserved(&self, limit: Amount, lease_ms: u64, now_ms: u64) -> Amount {
        if now_ms >= self.reserved_until(lease_ms) {
            return Amount::default();
        }
        self.grants
            .iter()
            .map(|&g| share_in_force(Some(g), limit, now_ms))
            .fold(Amount::default(), Amount::max)
    }

    fn reserved_until(&self, lease_ms: u64) -> u64 {
        // The fallback after a lapsed grant stays reserved this long: an
        // instance that merely missed a few syncs is not given away.
        let grace = lease_ms / 2;
        let last_grant_ends = self
            .grants
            .iter()
            .map(|g| g.expires_at_ms.saturating_add(grace))
            .max()
            .unwrap_or(0);
        last_grant_ends.max(self.last_heard_ms.saturating_add(lease_ms + grace))
    }
}

/// The admin's record of one global policy's grants. Serializable: with
/// several admin replicas it lives in Redis.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Ledger {
    members: BTreeMap<String, Member>,
}

impl Ledger {
    /// `instance` syncs, wanting `demand`, with the newest grant it has
    /// received expiring at `newest` (None: none yet). Returns its new
    /// grant.
    pub fn sync(
        &mut self,
        terms: &FleetTerms,
        instance: &str,
        demand: Demand,
        newest: Option<u64>,
        now_ms: u64,
    ) -> Grant {
        self.forget_gone(terms, now_ms);
        let member = self.members.entry(instance.to_string()).or_default();
        member.demand = demand;
        member.last_heard_ms = now_ms;
        // Answers arrive in order: grants older than the newest it has are
        // ones it will never apply again.
        if let Some(newest) = newest {
            member.grants.retain(|g| g.expires_at_ms >= newest);
        }
        // Shares go to the instances that are syncing; the silent ones
        // keep only their reservations until those end.
        let active: Vec<(&String, Demand)> = self
            .members
            .iter()
            .filter(|(n, m)| {
                n.as_str() == instance || now_ms.saturating_sub(m.last_heard_ms) < terms.lease_ms
            })
            .map(|(n, m)| (n, m.demand))
            .collect();
        let demands: Vec<Demand> = active.iter().map(|(_, d)| *d).collect();
        let targets = allocate(terms.limit, terms.floor_fraction, &demands);
        let target = active
            .iter()
            .position(|(n, _)| n.as_str() == instance)
            .and_then(|i| targets.get(i).copied())
            .unwrap_or_default();
        let others = self
            .members
            .iter()
            .filter(|(n, _)| n.as_str() != instance)
            .fold(Amount::default(), |acc, (_, m)| {
                acc.plus(m.reserved(terms.limit, terms.lease_ms, now_ms))
            });
        let grant = Grant {
            share: target.min(terms.limit.minus(others)),
            expires_at_ms: now_ms.saturating_add(terms.lease_ms),
            instances: u32::try_from(self.members.len()).unwrap_or(u32::MAX),
        };
        if let Some(member) = self.members.get_mut(instance) {
            member.grants.push(grant);
        }
        grant
    }

    /// [`Ledger::sync`] with the demand read off the instance's counters:
    /// what it was asked per second since its previous sync, and what it
    /// would hold in flight if nothing were refused.
    pub fn sync_usage(
        &mut self,
        terms: &FleetTerms,
        instance: &str,
        usage: Usage,
        newest: Option<u64>,
        now_ms: u64,
    ) -> Grant {
        let member = self.members.get(instance);
        let measured = demand_between(member.and_then(|m| m.usage), usage, terms.limit);
        let demand = match member {
            Some(Member {
                usage: Some(previous),
                demand,
                ..
            }) => smooth(
                *demand,
                measured,
                usage.at_ms.saturating_sub(previous.at_ms),
            ),
            _ => measured,
        };
        let grant = self.sync(terms, instance, demand, newest, now_ms);
        if let Some(member) = self.members.get_mut(instance) {
            member.usage = Some(usage);
            member.used.in_flight = usage.in_flight;
            match member.used_since {
                Some(since)
                    if usage.at_ms >= since.at_ms.saturating_add(USED_WINDOW_MS)
                        && usage.admitted >= since.admitted =>
                {
                    member.used = used_between(Some(since), usage);
                    member.used_since = Some(usage);
                }
                // Counters that went back (a restart): a new window.
                Some(since) if usage.admitted < since.admitted || usage.at_ms < since.at_ms => {
                    member.used_since = Some(usage);
                }
                Some(_) => {}
                None => member.used_since = Some(usage),
            }
        }
        grant
    }

    /// The sum of what every instance may be enforcing now.
    pub fn reserved(&self, terms: &FleetTerms, now_ms: u64) -> Amount {
        self.members
            .values()
            .map(|m| m.reserved(terms.limit, terms.lease_ms, now_ms))
            .fold(Amount::default(), Amount::plus)
    }

    /// Instances still holding a reservation: what each may enforce, uses
    /// and wants, for the UI.
    pub fn members(&self, terms: &FleetTerms, now_ms: u64) -> Vec<MemberState> {
        self.members
            .iter()
            .filter(|(_, m)| now_ms < m.reserved_until(terms.lease_ms))
            .map(|(n, m)| MemberState {
                instance: n.clone(),
                share: share_in_force(m.grants.last().copied(), terms.limit, now_ms),
                reserved: m.reserved(terms.limit, terms.lease_ms, now_ms),
                used: m.used,
                demand: m.demand,
                last_sync_ms: m.last_heard_ms,
            })
            .collect()
    }

    /// An instance whose reservation ended no longer counts; its share
    /// goes to the rest.
    fn forget_gone(&mut self, terms: &FleetTerms, now_ms: u64) {
        self.members
            .retain(|_, m| now_ms < m.reserved_until(terms.lease_ms));
    }
}

/// One instance's part of a global policy as the admin sees it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MemberState {
    pub instance: String,
    /// Its newest grant (or, lapsed, its fallback): what it enforces once
    /// that grant reached it.
    pub share: Amount,
    /// The most it may be enforcing now, counting older grants it may still
    /// apply: what the others cannot be given.
    pub reserved: Amount,
    /// What it admitted per second over the last window of at least
    /// [`USED_WINDOW_MS`], and held in flight at its last sync.
    pub used: Amount,
    pub demand: Demand,
    pub last_sync_ms: u64,
}

/// Time constant of a member's smoothed demand rate. A rate counted over
/// one sync interval is noisy (10 calls ± 1 at 50/s and 200 ms); every
/// wobble would move the shares, and room is handed over only once the old
/// grant is superseded, so jittery shares leave part of the limit unused.
/// A measurement over `span` weighs `1 - e^(-span/τ)`: 0.3 for a 200 ms
/// sync, little for two syncs 20 ms apart, whose count says little.
const DEMAND_TIME_CONSTANT_MS: f64 = 560.0;

/// Smooths the rate only: in flight is a count of calls held now, and a
/// blend of small counts rounds back to where it was.
fn smooth(previous: Demand, measured: Demand, span_ms: u64) -> Demand {
    let weight = 1.0 - (-(span_ms as f64) / DEMAND_TIME_CONSTANT_MS).exp();
    Demand {
        rate: previous.rate + weight * (measured.rate - previous.rate),
        ..measured
    }
}

/// An instance's counters for one policy at one sync, as it reports them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Usage {
    /// Requests that matched the policy so far (admitted and refused).
    pub asked: u64,
    pub admitted: u64,
    pub in_flight: u32,
    pub waiting: u32,
    pub at_ms: u64,
}

/// What an instance wanted between two syncs. The rate is what it was asked
/// (refused calls included: they are demand it could not serve). In flight,
/// by Little's law, is what it held scaled by asked over admitted: the
/// calls it would hold if none were refused. A first report, or counters
/// that went back (an Envoy restart), give no rate yet.
pub fn demand_between(previous: Option<Usage>, now: Usage, limit: Amount) -> Demand {
    let span_ms = previous.map_or(0, |p| now.at_ms.saturating_sub(p.at_ms));
    let (asked, admitted) = match previous {
        Some(p) if span_ms > 0 && now.asked >= p.asked && now.admitted >= p.admitted => {
            (now.asked - p.asked, now.admitted - p.admitted)
        }
        _ => (0, 0),
    };
    let seconds = span_ms as f64 / 1000.0;
    let rate = if seconds > 0.0 {
        asked as f64 / seconds
    } else {
        0.0
    };
    let holding = f64::from(now.in_flight) + f64::from(now.waiting);
    let wanted = if asked > admitted {
        if admitted > 0 && now.in_flight > 0 {
            holding * asked as f64 / admitted as f64
        } else {
            holding + 1.0
        }
    } else {
        holding
    };
    Demand {
        rate,
        in_flight: wanted.ceil().min(f64::from(limit.in_flight.max(1))) as u32,
        queued: now.waiting,
    }
}

/// What an instance admitted per second between two syncs and holds in
/// flight now (no rate for a first report or counters that went back).
pub fn used_between(previous: Option<Usage>, now: Usage) -> Amount {
    let rate = match previous {
        Some(p) if now.at_ms > p.at_ms && now.admitted >= p.admitted => {
            (now.admitted - p.admitted) as f64 * 1000.0 / (now.at_ms - p.at_ms) as f64
        }
        _ => 0.0,
    };
    Amount {
        rate,
        in_flight: now.in_flight,
    }
}

impl Amount {
    /// A policy's limit as a rate per second and calls in flight (0 for
    /// what it does not limit).
    pub fn of_policy(policy: &Policy) -> Amount {
        Amount {
            rate: policy.rate.as_ref().map_or(0.0, |r| {
                r.requests as f64 / (r.period.as_nanos().max(1) as f64 / 1e9)
            }),
            in_flight: policy.concurrency.as_ref().map_or(0, |c| c.max_in_flight),
        }
    }
}

impl FleetTerms {
    pub fn of_policy(policy: &Policy) -> FleetTerms {
        FleetTerms {
            limit: Amount::of_policy(policy),
            lease_ms: policy.share_lease().as_millis(),
            floor_fraction: FLOOR_FRACTION,
        }
    }
}

/// The limits an instance applies for its share of a global policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShareLimits {
    pub rate: Option<RateLimiter>,
    pub concurrency: Option<ConcurrencyLimit>,
    /// The share allows no request at all (before the first grant, or
    /// while the others hold the whole limit).
    pub closed: bool,
}

pub const MIN_SHARE_BURST: u64 = 2;

/// Rates are kept per hour so that a share of a fraction of a request per
/// second still refills.
const SHARE_PERIOD_NS: u64 = 3_600_000_000_000;

/// Scales a global policy's limits down to `share`: the rate to the share's
/// rate and the burst in proportion, the slots to the share's slots and the
/// high-priority lane in proportion.
///
/// The burst is at least [`MIN_SHARE_BURST`] (or the policy's, if smaller):
/// a bucket of one token admits a call only when it is exactly due, and
/// calls that arrive on their own clock then lose up to a third of the
/// share. The fleet's burst is so at most `burst + MIN_SHARE_BURST · n`.
pub fn limits_for_share(policy: &Policy, share: Amount) -> ShareLimits {
    let limit = Amount::of_policy(policy);
    let mut closed = false;
    let rate = policy.rate.as_ref().map(|spec| {
        let per_hour = (share.rate.max(0.0) * 3600.0).floor() as u64;
        closed |= per_hour == 0;
        let fraction = if limit.rate > 0.0 {
            (share.rate / limit.rate).clamp(0.0, 1.0)
        } else {
            0.0
        };
        let policy_burst = spec.effective_burst();
        let burst = ((policy_burst as f64) * fraction).floor() as u64;
        RateLimiter::TokenBucket(TokenBucket::new(
            per_hour.max(1),
            SHARE_PERIOD_NS,
            burst.max(MIN_SHARE_BURST.min(policy_burst)).max(1),
            None,
        ))
    });
    let concurrency = policy.concurrency.as_ref().map(|spec| {
        let slots = share.in_flight.min(spec.max_in_flight);
        let reserved = if spec.max_in_flight > 0 {
            (u64::from(spec.reserved_for_high) * u64::from(slots) / u64::from(spec.max_in_flight))
                as u32
        } else {
            0
        };
        ConcurrencyLimit {
            max_in_flight: slots,
            reserved_for_high: reserved,
            lease_ttl_ns: spec.lease_ttl.as_nanos(),
        }
    });
    ShareLimits {
        rate,
        concurrency,
        closed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMIT: Amount = Amount {
        rate: 1000.0,
        in_flight: 100,
    };
    const TERMS: FleetTerms = FleetTerms {
        limit: LIMIT,
        lease_ms: 2_000,
        floor_fraction: 0.05,
    };

    fn wants(rate: f64, in_flight: u32) -> Demand {
        Demand {
            rate,
            in_flight,
            queued: 0,
        }
    }

    #[test]
    fn shares_follow_demand_above_an_even_floor() {
        let shares = allocate(
            LIMIT,
            0.06,
            &[wants(800.0, 80), wants(100.0, 10), wants(100.0, 10)],
        );
        // Asked 1000/s, with headroom 1100/s: over the limit, the small
        // askers get theirs (110/s), the big one the rest.
        assert!((shares[1].rate - 110.0).abs() < 1e-9, "{shares:?}");
        assert!((shares[0].rate - 780.0).abs() < 1e-9, "{shares:?}");
        assert_eq!(shares.iter().map(|s| s.in_flight).sum::<u32>(), 100);
        assert!(shares[0].in_flight >= 79, "{shares:?}");
        // One asks for far more than the limit: the small askers still get
        // all they want, the big one the rest.
        let shares = allocate(
            LIMIT,
            0.06,
            &[wants(5_000.0, 500), wants(100.0, 10), wants(50.0, 5)],
        );
        assert!((shares[1].rate - 110.0).abs() < 1e-9, "{shares:?}");
        assert!((shares[2].rate - 55.0).abs() < 1e-9, "{shares:?}");
        assert!((shares[0].rate - 835.0).abs() < 1e-9, "{shares:?}");
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
        assert!((shares[0].rate - 445.0).abs() < 1e-9, "{shares:?}");
        assert!((shares[1].rate - 445.0).abs() < 1e-9, "{shares:?}");
        // Nobody wants anything: an even split.
        let idle = allocate(LIMIT, 0.06, &[Demand::default(), Demand::default()]);
        assert_eq!(idle[0], idle[1]);
        assert_eq!(idle[0].in_flight + idle[1].in_flight, 100);
    }

    #[test]
    fn a_shrinking_share_frees_room_only_once_the_old_grant_is_superseded() {
        let mut ledger = Ledger::default();
        let a = ledger.sync(&TERMS, "a", wants(1000.0, 100), None, 0);
        assert!((a.share.rate - 1000.0).abs() < 1e-9, "alone, a gets it all");
        // b arrives: a still holds its grant, so b gets only what is left.
        let b = ledger.sync(&TERMS, "b", wants(1000.0, 100), None, 100);
        assert_eq!(b.share.in_flight, 0);
        // a shrinks to half, but until a says it has the new grant the old
        // one may still be in use.
        let a2 = ledger.sync(&TERMS, "a", wants(1000.0, 100), Some(a.expires_at_ms), 200);
        let b2 = ledger.sync(&TERMS, "b", wants(1000.0, 100), Some(b.expires_at_ms), 300);
        assert_eq!(a2.share.in_flight, 50);
        assert_eq!(
            b2.share.in_flight, 0,
            "a's first grant may still be applied"
        );
        ledger.sync(&TERMS, "a", wants(1000.0, 100), Some(a2.expires_at_ms), 400);
        let b3 = ledger.sync(&TERMS, "b", wants(1000.0, 100), Some(b2.expires_at_ms), 500);
        assert_eq!(b3.share.in_flight, 50);
        assert_eq!(ledger.reserved(&TERMS, 500).in_flight, 100);
    }

    #[test]
    fn a_dead_instance_share_returns_a_lease_and_a_half_after_it_last_synced() {
        let mut ledger = Ledger::default();
        let a1 = ledger.sync(&TERMS, "a", wants(500.0, 50), None, 0);
        let b1 = ledger.sync(&TERMS, "b", wants(500.0, 50), None, 10);
        let a2 = ledger.sync(&TERMS, "a", wants(500.0, 50), Some(a1.expires_at_ms), 20);
        ledger.sync(&TERMS, "a", wants(500.0, 50), Some(a2.expires_at_ms), 30);
        let b2 = ledger.sync(&TERMS, "b", wants(500.0, 50), Some(b1.expires_at_ms), 40);
        assert_eq!(b2.share.in_flight, 50);
        // a dies after its sync at 30 ms. Its grant runs to 2 030 ms; then
        // its fallback (min(50, 100 / 2)) stays reserved until 3 030 ms.
        let b3 = ledger.sync(&TERMS, "b", wants(500.0, 50), Some(b2.expires_at_ms), 1_000);
        assert_eq!(b3.share.in_flight, 50);
        let b4 = ledger.sync(&TERMS, "b", wants(500.0, 50), Some(b3.expires_at_ms), 2_031);
        assert_eq!(b4.share.in_flight, 50);
        assert_eq!(ledger.members(&TERMS, 2_031).len(), 2);
        let b5 = ledger.sync(&TERMS, "b", wants(500.0, 50), Some(b4.expires_at_ms), 3_029);
        assert_eq!(b5.share.in_flight, 50);
        let b6 = ledger.sync(&TERMS, "b", wants(500.0, 50), Some(b5.expires_at_ms), 3_030);
        assert_eq!(b6.share.in_flight, 100);
        assert_eq!(ledger.members(&TERMS, 3_030).len(), 1);
    }

    fn usage(asked: u64, admitted: u64, in_flight: u32, at_ms: u64) -> Usage {
        Usage {
            asked,
            admitted,
            in_flight,
            waiting: 0,
            at_ms,
        }
    }

    #[test]
    fn demand_is_what_was_asked_and_what_would_be_held() {
        // 500 asked over 500 ms, 250 admitted while holding 10: it would
        // hold 20 if nothing were refused.
        let d = demand_between(
            Some(usage(1_000, 800, 4, 1_000)),
            usage(1_500, 1_050, 10, 1_500),
            LIMIT,
        );
        assert!((d.rate - 1_000.0).abs() < 1e-9);
        assert_eq!(d.in_flight, 20);
        // Nothing refused: what it holds.
        let d = demand_between(Some(usage(0, 0, 0, 0)), usage(100, 100, 7, 1_000), LIMIT);
        assert_eq!((d.rate, d.in_flight), (100.0, 7));
        // First report, or counters that went back: no rate yet.
        assert_eq!(
            demand_between(None, usage(100, 100, 3, 1_000), LIMIT).rate,
            0.0
        );
        assert_eq!(
            demand_between(Some(usage(900, 900, 0, 0)), usage(10, 10, 0, 1_000), LIMIT).rate,
            0.0
        );
        // Refused with nothing admitted (a share of 0): one more than held,
        // never more than the limit.
        let d = demand_between(Some(usage(0, 0, 0, 0)), usage(50, 0, 0, 1_000), LIMIT);
        assert_eq!(d.in_flight, 1);
        let d = demand_between(
            Some(usage(0, 0, 0, 0)),
            usage(1_000_000, 1, 100, 1_000),
            LIMIT,
        );
        assert_eq!(d.in_flight, LIMIT.in_flight);
    }

    #[test]
    fn members_show_what_each_instance_admitted_and_holds() {
        let mut ledger = Ledger::default();
        ledger.sync_usage(&TERMS, "a", usage(0, 0, 0, 0), None, 0);
        ledger.sync_usage(&TERMS, "b", usage(50, 50, 1, 0), None, 0);
        // 20 ms later: too short a window to call it a rate.
        ledger.sync_usage(&TERMS, "a", usage(8, 6, 3, 20), None, 20);
        let a = ledger.members(&TERMS, 20)[0].clone();
        assert_eq!((a.used.rate, a.used.in_flight), (0.0, 3), "{a:?}");
        // a: 800 asked, 600 admitted over 1 s, holding 12 at the end.
        ledger.sync_usage(&TERMS, "a", usage(800, 600, 12, 1_000), None, 1_000);
        let members = ledger.members(&TERMS, 1_000);
        let a = members.iter().find(|m| m.instance == "a").unwrap();
        assert!((a.used.rate - 600.0).abs() < 1e-9, "{a:?}");
        assert_eq!(a.used.in_flight, 12);
        assert!(a.demand.rate > 0.0, "{a:?}");
        assert_eq!(a.last_sync_ms, 1_000);
        assert!(a.share.rate > 0.0 && a.share.rate <= LIMIT.rate);
        let b = members.iter().find(|m| m.instance == "b").unwrap();
        assert_eq!((b.used.rate, b.used.in_flight), (0.0, 1), "no rate yet");
        // Counters that went back (a restarted Envoy): no rate.
        assert_eq!(
            used_between(Some(usage(900, 900, 0, 0)), usage(10, 10, 2, 1_000)),
            Amount {
                rate: 0.0,
                in_flight: 2
            }
        );
    }

    #[test]
    fn a_share_scales_rate_burst_and_slots() {
        let policy: Policy = serde_json::from_str(
            r#"{"name": "p", "match": {"host": "a"}, "scope": "global",
                "rate": {"requests": 300, "period": "1s", "burst": 30},
                "concurrency": {"max_in_flight": 40, "reserved_for_high": 10}}"#,
        )
        .unwrap();
        let limits = limits_for_share(
            &policy,
            Amount {
                rate: 100.0,
                in_flight: 20,
            },
        );
        assert!(!limits.closed);
        let Some(RateLimiter::TokenBucket(bucket)) = limits.rate else {
            panic!("{limits:?}")
        };
        assert_eq!(bucket.burst(), 10);
        let c = limits.concurrency.unwrap();
        assert_eq!((c.max_in_flight, c.reserved_for_high), (20, 5));
        assert!(limits_for_share(&policy, Amount::default()).closed);
        let tiny = limits_for_share(
            &policy,
            Amount {
                rate: 0.5,
                in_flight: 1,
            },
        );
        assert!(!tiny.closed, "half a request per second still refills");
    }

    #[test]
    fn a_lapsed_grant_falls_back_to_the_smaller_of_itself_and_an_even_split() {
        let grant = |in_flight: u32| Grant {
            share: Amount {
                rate: f64::from(in_flight) * 10.0,
                in_flight,
            },
            expires_at_ms: 1_000,
            instances: 3,
        };
        assert_eq!(share_in_force(Some(grant(80)), LIMIT, 999), grant(80).share);
        let lapsed = share_in_force(Some(grant(80)), LIMIT, 1_000);
        assert_eq!(lapsed.in_flight, 33);
        assert!((lapsed.rate - 1000.0 / 3.0).abs() < 1e-9);
        assert_eq!(
            share_in_force(Some(grant(10)), LIMIT, 5_000),
            grant(10).share
        );
        assert_eq!(share_in_force(None, LIMIT, 0), Amount::default());
    }
}
