//! Which bucket a key (an API key, a tenant id) lands in.
//!
//! Keys come from requests, so whoever sends requests chooses them. With a
//! public hash they could pick keys that land on another key's places, keep
//! those busy and push that key into the overflow bucket (or have it
//! refused). The hash is therefore keyed (SipHash-1-3, the hash Rust's
//! `HashMap` uses against the same attack) with a secret drawn at random
//! once per Envoy process, and the policy's name is mixed in so that keys
//! colliding in one policy do not collide in another.

use std::hash::Hasher;

use siphasher::sip::SipHasher13;

/// The secret key hashing is keyed with. Not `Default`: a known secret is
/// the attack this type exists to prevent.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct KeySecret {
    k0: u64,
    k1: u64,
}

/// Secrets are never printed.
impl std::fmt::Debug for KeySecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeySecret(..)")
    }
}

impl KeySecret {
    pub const LEN: usize = 16;

    pub const fn from_bytes(bytes: [u8; Self::LEN]) -> Self {
        let (mut k0, mut k1) = ([0; 8], [0; 8]);
        let mut i = 0;
        while i < 8 {
            k0[i] = bytes[i];
            k1[i] = bytes[i + 8];
            i += 1;
        }
        Self {
            k0: u64::from_le_bytes(k0),
            k1: u64::from_le_bytes(k1),
        }
    }

    /// Reads a secret stored by [`KeySecret::to_bytes`]; None unless it is
    /// exactly that long.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        <[u8; Self::LEN]>::try_from(bytes)
            .ok()
            .map(Self::from_bytes)
    }

    pub fn to_bytes(self) -> [u8; Self::LEN] {
        let mut out = [0; Self::LEN];
        out[..8].copy_from_slice(&self.k0.to_le_bytes());
        out[8..].copy_from_slice(&self.k1.to_le_bytes());
        out
    }

    /// The hash of key `value` under `policy`.
    pub fn hash(&self, policy: &str, value: &[u8]) -> u64 {
        let mut h = SipHasher13::new_with_keys(self.k0, self.k1);
        // Length-prefixed, so ("ab", "c") and ("a", "bc") differ; as u64,
        // so that the filter (wasm32) and the admin (64-bit) agree on the
        // live view's key labels.
        h.write_u64(policy.len() as u64);
        h.write(policy.as_bytes());
        h.write(value);
        h.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn secret(n: u8) -> KeySecret {
        KeySecret::from_bytes([n; KeySecret::LEN])
    }

    #[test]
    fn the_policy_name_is_part_of_the_hash() {
        let s = secret(7);
        assert_ne!(s.hash("bank", b"tenant-1"), s.hash("shipping", b"tenant-1"));
        assert_ne!(s.hash("ab", b"c"), s.hash("a", b"bc"));
    }

    #[test]
    fn the_secret_is_never_printed() {
        assert_eq!(format!("{:?}", secret(9)), "KeySecret(..)");
    }

    #[test]
    fn only_a_whole_secret_decodes() {
        assert_eq!(KeySecret::decode(&secret(3).to_bytes()), Some(secret(3)));
        assert_eq!(KeySecret::decode(&[1; 15]), None);
        assert_eq!(KeySecret::decode(&[1; 17]), None);
        assert_eq!(KeySecret::decode(&[]), None);
    }

    /// Keys chosen to share a place under one secret are spread under
    /// another: an attacker who cannot read the secret cannot aim.
    #[test]
    fn keys_aimed_at_one_place_scatter_under_another_secret() {
        const PLACES: u64 = 64;
        let (known, unknown) = (secret(1), secret(2));
        let aimed: Vec<String> = (0..)
            .map(|i| format!("attacker-{i}"))
            .filter(|k| known.hash("p", k.as_bytes()) % PLACES == 0)
            .take(32)
            .collect();
        let mut places: Vec<u64> = aimed
            .iter()
            .map(|k| unknown.hash("p", k.as_bytes()) % PLACES)
            .collect();
        places.sort_unstable();
        places.dedup();
        // 32 keys over 64 places: about 25 distinct; all on one is 64^-31.
        assert!(places.len() > 10, "{places:?}");
    }

    proptest! {
        #[test]
        fn bytes_round_trip(bytes in proptest::array::uniform16(any::<u8>())) {
            let s = KeySecret::from_bytes(bytes);
            prop_assert_eq!(s.to_bytes(), bytes);
        }

        #[test]
        fn hashing_is_a_function_of_secret_policy_and_value(
            bytes in proptest::array::uniform16(any::<u8>()),
            policy in ".{0,20}",
            value in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let s = KeySecret::from_bytes(bytes);
            prop_assert_eq!(s.hash(&policy, &value), s.hash(&policy, &value));
        }
    }
}
