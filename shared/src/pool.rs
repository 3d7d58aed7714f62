//! A pool's choice of member (issue step 5, the pure part): in which order
//! a call tries a policy's members, from what each can take now. The
//! filter tells it each member's room and pause; it answers the members to
//! try, best first, so that a member whose limits refuse the call after
//! all (another worker took the room first) is passed over for the next.
//!
//! - `most_room` (the default): the member with the most of its limit
//!   left, as a part of that limit, first: calls spread so that members
//!   fill alike, not the first until it answers 429.
//! - `weighted`: at random by weight (a weighted order without
//!   replacement, drawn from `draw`), as traffic is split between regions.
//! - `priority`: in the order written: the primary until it is full or
//!   paused, then the next (spill over).
//!
//! A sticky key (a conversation's id) goes to its own member first while
//! that member can take it, whatever the rule, so that a provider's prompt
//! cache keeps working; its member is chosen by rendezvous hashing over the
//! members' names, so adding or removing a member moves only the keys of
//! that member.

/// Rooms this close (1/64 of a limit) are taken as alike by `most_room`.
const ROOM_STEPS: f64 = 64.0;

/// How a pool orders its members for a call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Rule {
    #[default]
    MostRoom,
    Weighted,
    Priority,
}

/// One member as the filter sees it now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemberNow {
    /// Its name's hash: where sticky keys land.
    pub id: u64,
    /// What is left of its tightest limit, as a part of that limit (0 to
    /// 1; anything else, NaN included, is taken as 0 or 1).
    pub room: f64,
    /// Its provider paused it (a 429 or 503 and its `Retry-After`).
    pub paused: bool,
    /// Its weight for [`Rule::Weighted`] (not above 0: never drawn first
    /// while another can be).
    pub weight: f64,
}

impl MemberNow {
    fn can_take(&self) -> bool {
        !self.paused && self.room() > 0.0
    }

    fn room(&self) -> f64 {
        if self.room.is_nan() {
            0.0
        } else {
            self.room.clamp(0.0, 1.0)
        }
    }
}

/// The members a call tries, best first: those not paused and with room,
/// by `rule`, the sticky key's own member first when it is among them.
/// Empty: every member is paused or full.
pub fn order(rule: Rule, members: &[MemberNow], sticky: Option<u64>, draw: u64) -> Vec<usize> {
    let mut open: Vec<usize> = (0..members.len())
        .filter(|&i| members[i].can_take())
        .collect();
    match rule {
        Rule::Priority => {}
        Rule::MostRoom => {
            // Rooms within 1/64 of each other are alike (at low load every
            // member is full): among them the call's draw decides, so that
            // calls spread instead of all going to the first.
            let used = |i: usize| ((1.0 - members[i].room()) * ROOM_STEPS).floor() as i64;
            open.sort_by(|&a, &b| {
                used(a)
                    .cmp(&used(b))
                    .then(mix(draw ^ members[b].id).cmp(&mix(draw ^ members[a].id)))
                    .then(a.cmp(&b))
            });
        }
        Rule::Weighted => {
            // Efraimidis and Spirakis: each member draws u^(1/w), the
            // largest first, which orders them at random by weight.
            let rank = |i: usize| {
                let weight = members[i].weight;
                if weight.is_nan() || weight <= 0.0 {
                    return -1.0;
                }
                let u = unit(mix(draw ^ members[i].id));
                u.powf(1.0 / weight.min(1e9))
            };
            let mut ranked: Vec<(f64, usize)> = open.iter().map(|&i| (rank(i), i)).collect();
            ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            open = ranked.into_iter().map(|(_, i)| i).collect();
        }
    }
    if let Some(own) = sticky.and_then(|key| sticky_member(members, key)) {
        if let Some(at) = open.iter().position(|&i| i == own) {
            open.remove(at);
            open.insert(0, own);
        }
    }
    open
}

/// The members a call passed over for want of room, when `taken_by` took
/// it (None: every member refused it): those not paused that had none
/// (`full`: read full, or refused the call when tried), under `priority`
/// only those written before the one that took it, and the sticky key's
/// own member whatever the rule. The call was demand they could not take:
/// fleet mode sizes each Envoy's share of a member's global limit by its
/// demand, and an Envoy whose calls all went elsewhere would otherwise look
/// idle there and be left only the floor.
pub fn passed_over(
    rule: Rule,
    members: &[MemberNow],
    full: &[bool],
    taken_by: Option<usize>,
    sticky: Option<u64>,
) -> Vec<usize> {
    let own = sticky.and_then(|key| sticky_member(members, key));
    (0..members.len())
        .filter(|&i| Some(i) != taken_by && !members[i].paused)
        .filter(|&i| full.get(i).copied().unwrap_or(false) || members[i].room() <= 0.0)
        .filter(|&i| match (rule, taken_by) {
            (Rule::Priority, Some(taken)) => i < taken || Some(i) == own,
            _ => true,
        })
        .collect()
}

/// The member a sticky key belongs to, whether or not it can take a call
/// now (rendezvous hashing: the member whose name mixes highest with the
/// key). None for a pool without members.
pub fn sticky_member(members: &[MemberNow], key: u64) -> Option<usize> {
    (0..members.len()).max_by_key(|&i| (mix(key ^ members[i].id), std::cmp::Reverse(i)))
}

/// SplitMix64's finaliser: a well-spread 64-bit mix.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A number in (0, 1] from 64 random bits.
fn unit(bits: u64) -> f64 {
    ((bits >> 11) as f64 + 1.0) / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn member(id: u64, room: f64, paused: bool, weight: f64) -> MemberNow {
        MemberNow {
            id,
            room,
            paused,
            weight,
        }
    }

    #[test]
    fn most_room_first_and_paused_or_full_members_never() {
        let members = [
            member(1, 0.2, false, 1.0),
            member(2, 0.9, true, 1.0),
            member(3, 0.5, false, 1.0),
            member(4, 0.0, false, 1.0),
        ];
        assert_eq!(order(Rule::MostRoom, &members, None, 0), [2, 0]);
        assert_eq!(order(Rule::Priority, &members, None, 0), [0, 2]);
        let none = [member(1, 0.0, false, 1.0), member(2, 1.0, true, 1.0)];
        assert!(order(Rule::MostRoom, &none, None, 0).is_empty());
    }

    #[test]
    fn members_with_alike_room_are_drawn_alike() {
        let members = [member(11, 1.0, false, 1.0), member(22, 0.995, false, 1.0)];
        let firsts = (0..10_000u64)
            .filter(|&d| order(Rule::MostRoom, &members, None, mix(d))[0] == 1)
            .count();
        let part = firsts as f64 / 10_000.0;
        assert!((part - 0.5).abs() < 0.03, "the second first {part}");
        // Room apart by more than a step: the roomier first, always.
        let apart = [member(11, 0.5, false, 1.0), member(22, 0.9, false, 1.0)];
        assert!((0..1_000u64).all(|d| order(Rule::MostRoom, &apart, None, mix(d))[0] == 1));
    }

    #[test]
    fn weighted_draws_follow_the_weights() {
        let members = [member(11, 1.0, false, 1.0), member(22, 1.0, false, 3.0)];
        let firsts = (0..20_000u64)
            .filter(|&d| order(Rule::Weighted, &members, None, mix(d))[0] == 1)
            .count();
        let part = firsts as f64 / 20_000.0;
        assert!(
            (part - 0.75).abs() < 0.02,
            "weight 3 of 4 drawn first {part}"
        );
    }

    #[test]
    fn a_sticky_key_keeps_its_member_while_it_has_room_and_comes_back() {
        let mut members = [
            member(101, 0.3, false, 1.0),
            member(202, 0.9, false, 1.0),
            member(303, 0.6, false, 1.0),
        ];
        let key = 0xfeed;
        let own = sticky_member(&members, key).unwrap_or(usize::MAX);
        assert_eq!(order(Rule::MostRoom, &members, Some(key), 0)[0], own);
        members[own].paused = true;
        let away = order(Rule::MostRoom, &members, Some(key), 0);
        assert!(!away.contains(&own), "a paused member is passed over");
        members[own].paused = false;
        assert_eq!(order(Rule::Priority, &members, Some(key), 0)[0], own);
    }

    #[test]
    fn a_call_passes_over_the_full_members_it_would_have_gone_to() {
        let members = [
            member(1, 0.0, false, 1.0),
            member(2, 0.0, true, 1.0),
            member(3, 0.8, false, 1.0),
            member(4, 0.0, false, 1.0),
        ];
        let none = [false; 4];
        // Priority: the full primary, not the paused one (its provider
        // wants no calls), and not the full spill-over behind the taker.
        assert_eq!(
            passed_over(Rule::Priority, &members, &none, Some(2), None),
            [0]
        );
        // Any member would have done under the other rules.
        assert_eq!(
            passed_over(Rule::MostRoom, &members, &none, Some(2), None),
            [0, 3]
        );
        // Read with room, but refused when tried (another worker took it).
        let refused = [false, false, false, true];
        assert_eq!(
            passed_over(Rule::Weighted, &members, &refused, Some(2), None),
            [0, 3]
        );
        // Refused everywhere: every member not paused.
        assert_eq!(
            passed_over(
                Rule::Priority,
                &members,
                &[false, false, true, false],
                None,
                None
            ),
            [0, 2, 3]
        );
        // The sticky key's own member, wherever it is written.
        let key = (0..u64::MAX)
            .find(|&k| sticky_member(&members, k) == Some(3))
            .unwrap_or(0);
        assert_eq!(
            passed_over(Rule::Priority, &members, &none, Some(2), Some(key)),
            [0, 3]
        );
    }

    proptest! {
        /// Whatever the members: the order names each member that can take
        /// a call exactly once and none that cannot, and a sticky key's
        /// member, when it can, first.
        #[test]
        fn the_order_is_the_open_members_once_each(
            rooms in prop::collection::vec((any::<u64>(), -1.0f64..2.0, any::<bool>(), -1.0f64..5.0), 0..8),
            rule in 0u8..3,
            sticky in proptest::option::of(any::<u64>()),
            draw in any::<u64>(),
        ) {
            let members: Vec<MemberNow> = rooms
                .iter()
                .map(|&(id, room, paused, weight)| member(id, room, paused, weight))
                .collect();
            let rule = [Rule::MostRoom, Rule::Weighted, Rule::Priority][rule as usize];
            let got = order(rule, &members, sticky, draw);
            let mut sorted = got.clone();
            sorted.sort_unstable();
            let open: Vec<usize> = (0..members.len()).filter(|&i| members[i].can_take()).collect();
            prop_assert_eq!(sorted, open);
            if let Some(own) = sticky.and_then(|k| sticky_member(&members, k)) {
                if members[own].can_take() {
                    prop_assert_eq!(got.first().copied(), Some(own));
                }
            }
        }

        /// Rendezvous: removing a member moves only the keys that were on it.
        #[test]
        fn removing_a_member_moves_only_its_keys(
            ids in prop::collection::btree_set(any::<u64>(), 2..6),
            keys in prop::collection::vec(any::<u64>(), 1..50),
            gone in any::<prop::sample::Index>(),
        ) {
            let all: Vec<MemberNow> = ids.iter().map(|&id| member(id, 1.0, false, 1.0)).collect();
            let gone = gone.index(all.len());
            let rest: Vec<MemberNow> = all.iter().enumerate().filter(|(i, _)| *i != gone).map(|(_, m)| *m).collect();
            for key in keys {
                let before = all[sticky_member(&all, key).unwrap_or(0)].id;
                let after = rest[sticky_member(&rest, key).unwrap_or(0)].id;
                if before != all[gone].id {
                    prop_assert_eq!(before, after);
                }
            }
        }
    }
}
