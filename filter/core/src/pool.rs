//! A policy's pool, ready to route: its members, each called as the pool's
//! policy with the member's own limits after the policy's (so that taking
//! a member is taking that policy's further limits, all or nothing, as
//! any policy's), its cluster, weight and the hash sticky keys land by.
//! Which member a call tries first is `sluice_shared::pool::order`'s.

use std::hash::Hasher;

use sluice_shared::policy::{KeySpec, Policy, PoolRule, PoolSpec};
use sluice_shared::pool::Rule;

use sluice_shared::request_headers::RequestHeaders;

use crate::body::BodyJson;
use crate::matcher::{CompiledLimit, CompiledSlotLimit, KeySource};

/// What a pool needs of the policy a member is called as: its limits, the
/// pool's policy's first, then the member's own.
pub trait MemberPolicy {
    fn limits(&self) -> &[CompiledLimit];
    fn slot_limits(&self) -> &[CompiledSlotLimit];
}

/// A validated `pool`, its members each called as a policy `P`
/// (`matcher::CompiledPool`: as a compiled policy).
#[derive(Debug, Clone)]
pub struct Pool<P> {
    pub rule: Rule,
    sticky: Option<KeySource>,
    /// Lower case: the request header the chosen member's cluster goes in.
    pub route_header: String,
    pub members: Vec<Member<P>>,
}

/// One member of a pool.
#[derive(Debug, Clone)]
pub struct Member<P> {
    pub name: String,
    pub cluster: String,
    pub weight: f64,
    /// Its name's hash: where sticky keys land (rendezvous hashing).
    pub id: u64,
    /// The pool's policy as this member takes calls: the policy's limits,
    /// then the member's (`own_limits` on, in `limits`; `own_slots` on,
    /// in `slot_limits`).
    pub policy: P,
    pub own_limits: usize,
    pub own_slots: usize,
    /// Its policy's number in the set (`CompiledPolicySet::policy`).
    pub index: usize,
}

impl<P: MemberPolicy> Member<P> {
    /// The member's own rate limits (not the policy's).
    pub fn rate_limits(&self) -> &[CompiledLimit] {
        self.policy
            .limits()
            .get(self.own_limits..)
            .unwrap_or_default()
    }

    /// The member's own concurrency limits.
    pub fn slot_limits(&self) -> &[CompiledSlotLimit] {
        self.policy
            .slot_limits()
            .get(self.own_slots..)
            .unwrap_or_default()
    }
}

impl<P> Pool<P> {
    /// From a validated policy's `pool`, each member's policy (the
    /// policy with the member's limits after its own) made by `compile`.
    pub fn new(policy: &Policy, spec: &PoolSpec, compile: impl Fn(Policy) -> P) -> Self {
        let rule = match spec.rule {
            PoolRule::MostRoom => Rule::MostRoom,
            PoolRule::Weighted => Rule::Weighted,
            PoolRule::Priority => Rule::Priority,
        };
        let sticky = spec.sticky.as_ref().and_then(|s| {
            KeySource::new(&KeySpec {
                header: s.header.clone(),
                json: s.json.clone(),
                max_keys: 1,
                overflow: Default::default(),
                label: Default::default(),
            })
        });
        let own_rates = policy.limits.iter().filter(|l| l.rate.is_some()).count();
        let own_slots = policy
            .limits
            .iter()
            .filter(|l| l.concurrency.is_some())
            .count();
        let members = spec
            .members
            .iter()
            .map(|member| {
                let mut as_member = policy.clone();
                as_member.pool = None;
                as_member.limits.extend(member.limits.iter().cloned());
                Member {
                    name: member.name.clone(),
                    cluster: member.cluster.clone(),
                    weight: member.weight,
                    id: stable_hash(member.name.as_bytes()),
                    policy: compile(as_member),
                    own_limits: own_rates,
                    own_slots,
                    index: usize::MAX,
                }
            })
            .collect();
        Self {
            rule,
            sticky,
            route_header: spec.route_header.to_ascii_lowercase(),
            members,
        }
    }

    /// The call's sticky key, hashed (None: the pool has none, or the call
    /// lacks it).
    pub fn sticky_key<R: RequestHeaders + ?Sized>(&self, req: &R, body: &BodyJson) -> Option<u64> {
        let value = self.sticky.as_ref()?.value(req, body)?;
        Some(stable_hash(&value))
    }

    /// Whether the sticky key is read from the request's JSON body.
    pub fn sticky_reads_body(&self) -> bool {
        self.sticky.as_ref().is_some_and(|s| s.header().is_none())
    }

    /// The header the sticky key is read from, if it is one.
    pub fn sticky_header(&self) -> Option<&str> {
        self.sticky.as_ref().and_then(KeySource::header)
    }

    /// The member named `name`.
    pub fn member(&self, name: &[u8]) -> Option<usize> {
        self.members.iter().position(|m| m.name.as_bytes() == name)
    }
}

/// A hash that is the same on every Envoy, build and run (SipHash-2-4
/// with fixed keys): a sticky key lands on the same member everywhere.
/// The length goes in first as 4 bytes, little-endian: what std's
/// `Hash` for a slice wrote in the wasm filter, where `usize` is 4 bytes,
/// so that its placements stay; the native build wrote 8 and placed some
/// keys elsewhere than a wasm Envoy beside it.
fn stable_hash(bytes: &[u8]) -> u64 {
    let mut hasher = siphasher::sip::SipHasher24::new();
    let len = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
    hasher.write(&len.to_le_bytes());
    hasher.write(bytes);
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// What the wasm filter hashed a sticky key as before: std's (since
    /// deprecated) SipHasher over the slice, its length a 4-byte `usize`.
    #[allow(deprecated)]
    fn as_the_wasm_filter_hashed(bytes: &[u8]) -> u64 {
        let mut hasher = std::hash::SipHasher::new();
        hasher.write(&(bytes.len() as u32).to_le_bytes());
        hasher.write(bytes);
        hasher.finish()
    }

    proptest! {
        #[test]
        fn a_sticky_key_hashes_as_the_wasm_filter_hashed_it(
            bytes in proptest::collection::vec(any::<u8>(), 0..300)
        ) {
            prop_assert_eq!(stable_hash(&bytes), as_the_wasm_filter_hashed(&bytes));
        }
    }

    /// The native build hashed the length as 8 bytes, and placed keys
    /// elsewhere than a wasm Envoy beside it; now both hash alike.
    #[cfg(target_pointer_width = "64")]
    #[test]
    fn the_native_build_no_longer_hashes_its_own_way() {
        use std::hash::Hash;
        #[allow(deprecated)]
        let mut native_before = std::hash::SipHasher::new();
        b"alice"[..].hash(&mut native_before);
        assert_ne!(stable_hash(b"alice"), native_before.finish());
        assert_eq!(stable_hash(b"alice"), as_the_wasm_filter_hashed(b"alice"));
    }
}
