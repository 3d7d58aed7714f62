//! What the live view shows of a pool (`pool`): per member, its calls a
//! second and its share of the pool's, what is left of its tightest limit
//! now, whether its provider paused it (and for how long), and the calls
//! Envoy retried onto it. Read from the members' own limits in the live
//! frame; pure, so that it is tested natively.

use std::collections::BTreeMap;

use sluice_api::LimitUse;
use sluice_shared::Policy;
use sluice_wire::stats::LimitCounter;

/// One member, now.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MemberNow {
    pub name: String,
    pub cluster: String,
    /// Calls a second it took (its limits count each call it took).
    pub calls_per_s: f64,
    /// Its part of the pool's calls (0 to 1; 0 while none went).
    pub share: f64,
    /// What is left of its tightest limit, as a part of it (None: no
    /// limit of it reported what it holds).
    pub room: Option<f64>,
    /// Seconds its pause has left, when paused.
    pub paused_for_s: Option<f64>,
    /// Calls a second Envoy retried onto it after another member refused.
    pub retried_here_per_s: f64,
}

/// The pools of `policies`, each member as `limits` (the live frame's)
/// shows it: (policy name, members in the pool's order).
pub fn pools_now(
    policies: &[Policy],
    limits: &BTreeMap<String, LimitUse>,
) -> Vec<(String, Vec<MemberNow>)> {
    policies
        .iter()
        .filter_map(|p| Some((p.name.clone(), p.pool.as_ref()?)))
        .map(|(name, pool)| {
            let mut members: Vec<MemberNow> = pool
                .members
                .iter()
                .map(|m| {
                    let reported: Vec<&LimitUse> = m
                        .limits
                        .iter()
                        .filter_map(|l| limits.get(&l.name))
                        .collect();
                    // Every limit of a member counts each call it took: the
                    // busiest one's count is the member's.
                    let calls_per_s = reported
                        .iter()
                        .map(|u| u.counts.per_s(LimitCounter::Admitted))
                        .fold(0.0, f64::max);
                    let room = reported
                        .iter()
                        .filter(|u| u.requests > 0)
                        .filter_map(|u| {
                            let left = match u.in_flight {
                                Some(held) => u.requests.saturating_sub(held),
                                None => u.available?,
                            };
                            Some((left as f64 / u.requests as f64).clamp(0.0, 1.0))
                        })
                        .reduce(f64::min);
                    let paused_for_s = reported
                        .iter()
                        .filter_map(|u| u.provider.as_ref()?.pause)
                        .map(|p| p.left_ms as f64 / 1000.0)
                        .reduce(f64::max);
                    let retried_here_per_s = reported
                        .iter()
                        .map(|u| u.counts.per_s(LimitCounter::PoolRetried))
                        .fold(0.0, f64::max);
                    MemberNow {
                        name: m.name.clone(),
                        cluster: m.cluster.clone(),
                        calls_per_s,
                        share: 0.0,
                        room,
                        paused_for_s,
                        retried_here_per_s,
                    }
                })
                .collect();
            let total: f64 = members.iter().map(|m| m.calls_per_s).sum();
            if total > 0.0 {
                for m in &mut members {
                    m.share = m.calls_per_s / total;
                }
            }
            (name, members)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limit(json: serde_json::Value) -> LimitUse {
        serde_json::from_value(json).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn members_show_their_calls_share_room_and_pause() {
        let set = sluice_shared::parse_policy_set(
            r#"{"version": 1, "policies": [
              {"name": "bank", "match": {"host": "b"}, "rate": {"requests": 1, "period": "1s"}},
              {"name": "llm", "match": {"host": "l"}, "rate": {"requests": 100, "period": "1s"},
               "pool": {"members": [
                 {"name": "east", "cluster": "llm-east", "limits": [
                   {"name": "east-rps", "rate": {"requests": 30, "period": "1s"}, "provider": {}},
                   {"name": "east-slots", "concurrency": {"max_in_flight": 10}}]},
                 {"name": "west", "cluster": "llm-west", "limits": [
                   {"name": "west-rps", "rate": {"requests": 30, "period": "1s"}, "provider": {}}]}]}}]}"#,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let mut limits = BTreeMap::new();
        limits.insert(
            "east-rps".to_string(),
            limit(serde_json::json!({"admitted_per_s": 10.0, "requests": 30, "period_ms": 1000,
                "available": 15, "provider": {"pause": {"ran_ms": 2000, "left_ms": 18000, "status": 429}}})),
        );
        limits.insert(
            "east-slots".to_string(),
            limit(
                serde_json::json!({"admitted_per_s": 10.0, "requests": 10, "period_ms": 0,
                "available": 2, "in_flight": 8}),
            ),
        );
        limits.insert(
            "west-rps".to_string(),
            limit(
                serde_json::json!({"admitted_per_s": 30.0, "pool_retried_per_s": 1.5,
                "requests": 30, "period_ms": 1000, "available": 0}),
            ),
        );
        let pools = pools_now(&set.policies, &limits);
        assert_eq!(pools.len(), 1, "bank has no pool");
        let (name, members) = &pools[0];
        assert_eq!(name, "llm");
        let east = &members[0];
        assert_eq!(
            (east.name.as_str(), east.cluster.as_str()),
            ("east", "llm-east")
        );
        assert_eq!(east.calls_per_s, 10.0);
        assert_eq!(east.share, 0.25);
        assert_eq!(east.room, Some(0.2), "its slots are its tightest limit");
        assert_eq!(east.paused_for_s, Some(18.0));
        let west = &members[1];
        assert_eq!(west.share, 0.75);
        assert_eq!(west.room, Some(0.0));
        assert_eq!(west.paused_for_s, None);
        assert_eq!(west.retried_here_per_s, 1.5);
        // Before any report: members listed, nothing known.
        let none = pools_now(&set.policies, &BTreeMap::new());
        assert_eq!(none[0].1[0].room, None);
        assert_eq!(none[0].1[1].share, 0.0);
    }
}
