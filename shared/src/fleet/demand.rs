//! What an instance wants and what it uses, read off the counters it
//! reports at each sync.

use serde::{Deserialize, Serialize};

use super::Amount;
use crate::time::{millis, Instant, Span};

/// What an instance would use if nothing held it back: the calls it was
/// asked to make per second (admitted and refused), the calls it wanted in
/// flight, and its queue.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Demand {
    pub rate: f64,
    pub in_flight: u32,
    pub queued: u32,
    /// It cannot hold its calls in flight to a count (a stock Envoy
    /// through RLQS: a token bucket only): it is given none of the
    /// limit's slots, which stay with those that can.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub holds_no_slots: bool,
}

/// Time constant of a member's smoothed demand rate. A rate counted over
/// one sync interval is noisy (10 calls ± 1 at 50/s and 200 ms); every
/// wobble would move the shares, and room is handed over only once the old
/// share is superseded, so jittery shares leave part of the limit unused.
/// A measurement over `span` weighs `1 - e^(-span/τ)`: 0.3 for a 200 ms
/// sync, little for two syncs 20 ms apart, whose count says little.
const DEMAND_TIME_CONSTANT: Span = Span::from_millis(560);

/// A measured rate this many standard deviations of its count's noise
/// away from the smoothed one is a change of demand, not a wobble: the
/// smoothed rate jumps to it. Load that moves from one Envoy to another
/// then moves the shares within a sync instead of over a second or two,
/// while wobbles (3 sigma is 47/s at 50/s over 200 ms) stay smoothed.
const JUMP_SIGMAS: f64 = 3.0;
/// Only a count over this long may jump: a sync hurried right after
/// another counts a few calls, and Envoy's workers add theirs to the
/// report every 20 ms, so a short count can read far off the real rate.
const JUMP_MIN_SPAN: Span = Span::from_millis(100);

/// Smooths the rate only: in flight is a count of calls held now, and a
/// blend of small counts rounds back to where it was. True when the rate
/// jumped: the count that jumped may have seen the change for part of its
/// span only (load moved 50 ms into a 200 ms count reads 118/s for 50/s),
/// so the next whole count is taken as it is ([`settle`]).
pub(super) fn smooth(previous: Demand, measured: Demand, span: Span) -> (Demand, bool) {
    let seconds = span.as_secs_f64();
    let weight = 1.0 - (-seconds / DEMAND_TIME_CONSTANT.as_secs_f64()).exp();
    // Calls arriving at random: the count over `span` has a standard
    // deviation of its square root (at least one call's worth), taken at
    // the lower of the two rates: a load that fell from 120/s to 50/s is
    // told from a wobble of 50/s, not of 120/s.
    let noise = if seconds > 0.0 {
        (previous.rate.min(measured.rate) * seconds).sqrt().max(1.0) / seconds
    } else {
        f64::INFINITY
    };
    let change = measured.rate - previous.rate;
    let jumped = span >= JUMP_MIN_SPAN && change.abs() > JUMP_SIGMAS * noise;
    let rate = if jumped {
        measured.rate
    } else {
        previous.rate + weight * change
    };
    (Demand { rate, ..measured }, jumped)
}

/// The first count after a jump: taken as it is when it is a whole one
/// (else smoothed as usual). Returns the demand and whether it is still
/// settling (a count too short to settle on, or another jump).
pub(super) fn settle(previous: Demand, measured: Demand, span: Span) -> (Demand, bool) {
    if span >= JUMP_MIN_SPAN {
        return (measured, false);
    }
    let (demand, _) = smooth(previous, measured, span);
    (demand, true)
}

/// An instance's counters for one policy at one sync, as it reports them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Usage {
    /// Requests that matched the policy so far (admitted and refused).
    pub asked: u64,
    pub admitted: u64,
    pub in_flight: u32,
    pub waiting: u32,
    /// When it was counted, by the instance's clock.
    #[serde(rename = "at_ms", with = "millis")]
    pub at: Instant,
    /// See [`Demand::holds_no_slots`].
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub holds_no_slots: bool,
}

/// What an instance wanted between two syncs. The rate is what it was asked
/// (refused calls included: they are demand it could not serve). In flight,
/// by Little's law, is what it held scaled by asked over admitted: the
/// calls it would hold if none were refused. A first report, or counters
/// that went back (an Envoy restart), give no rate yet.
pub fn demand_between(previous: Option<Usage>, now: Usage, limit: Amount) -> Demand {
    let span = previous.map_or(Span::ZERO, |p| now.at - p.at);
    let (asked, admitted) = match previous {
        Some(p) if !span.is_zero() && now.asked >= p.asked && now.admitted >= p.admitted => {
            (now.asked - p.asked, now.admitted - p.admitted)
        }
        _ => (0, 0),
    };
    let seconds = span.as_secs_f64();
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
    if now.holds_no_slots {
        return Demand {
            rate,
            holds_no_slots: true,
            ..Demand::default()
        };
    }
    Demand {
        rate,
        in_flight: wanted.ceil().min(f64::from(limit.in_flight.max(1))) as u32,
        queued: now.waiting,
        holds_no_slots: false,
    }
}

/// What an instance admitted per second between two syncs and holds in
/// flight now (no rate for a first report or counters that went back).
pub fn used_between(previous: Option<Usage>, now: Usage) -> Amount {
    let rate = match previous {
        Some(p) if now.at > p.at && now.admitted >= p.admitted => {
            (now.admitted - p.admitted) as f64 / (now.at - p.at).as_secs_f64()
        }
        _ => 0.0,
    };
    Amount {
        rate,
        in_flight: now.in_flight,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMIT: Amount = Amount {
        rate: 1000.0,
        in_flight: 100,
    };

    fn usage(asked: u64, admitted: u64, in_flight: u32, at_ms: u64) -> Usage {
        Usage {
            holds_no_slots: false,
            asked,
            admitted,
            in_flight,
            waiting: 0,
            at: Instant::from_millis(at_ms),
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

    fn rated(rate: f64) -> Demand {
        Demand {
            rate,
            ..Demand::default()
        }
    }

    #[test]
    fn wobbles_are_smoothed_and_moves_are_followed_at_once() {
        let sync = Span::from_millis(200);
        // 50/s counted as 11 calls in 200 ms: a wobble, weighed 0.3.
        let (d, jumped) = smooth(rated(50.0), rated(55.0), sync);
        assert!(!jumped);
        assert!((d.rate - 51.5).abs() < 0.1, "{d:?}");
        // A fall the first sync after a move only half saw is followed too.
        assert_eq!(smooth(rated(118.0), rated(50.0), sync).0.rate, 50.0);
        // The load moved: 400/s to 50/s and back are followed in one sync.
        assert_eq!(smooth(rated(400.0), rated(50.0), sync).0.rate, 50.0);
        assert_eq!(smooth(rated(50.0), rated(400.0), sync).0.rate, 400.0);
        // Nothing to something: a first call is not yet a rate.
        assert!(smooth(rated(0.0), rated(5.0), sync).0.rate < 5.0);
        // Two syncs 1 ms or 50 ms apart say little, whatever they count.
        let (d, _) = smooth(rated(50.0), rated(1000.0), Span::from_millis(1));
        assert!(d.rate < 60.0, "{d:?}");
        let (d, _) = smooth(rated(400.0), rated(0.0), Span::from_millis(50));
        assert!(d.rate > 300.0, "{d:?}");
        // Garbage spans do not produce NaN.
        assert!(smooth(rated(50.0), rated(60.0), Span::ZERO)
            .0
            .rate
            .is_finite());
    }

    /// Load moved 50 ms into a count: it reads 67/s for 50/s and jumps
    /// there; the next whole count (50/s) is taken as it is, not blended
    /// down over a second (the room it kept was lost to the Envoy the load
    /// moved to).
    #[test]
    fn the_count_after_a_jump_is_taken_as_it_is() {
        let sync = Span::from_millis(200);
        let (partial, jumped) = smooth(rated(400.0), rated(67.0), sync);
        assert!(jumped && partial.rate == 67.0);
        assert_eq!(settle(partial, rated(50.0), sync), (rated(50.0), false));
        // A count too short to settle on is smoothed, and settling goes on.
        let (d, settling) = settle(partial, rated(50.0), Span::from_millis(20));
        assert!(settling && d.rate > 60.0, "{d:?}");
        // Without the jump, the same count is a wobble.
        assert!(smooth(rated(67.0), rated(50.0), sync).0.rate > 60.0);
    }
}
