//! Shares the admin issued, told from shares an Envoy makes up. Each
//! share the admin leases carries a tag: a MAC of what it grants (to
//! which instance, of which limit, until when, how much), under a secret
//! only the admin's replicas know (kept in their store). An Envoy echoes
//! the tag with the share it holds; a share its ledger no longer knows
//! (lost with Redis, or the admin's memory) is believed back only when
//! its tag checks out, so a sync token's holder cannot claim shares it
//! was never given.

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

use super::ledger::Share;

/// The secret's length, in bytes.
pub const SECRET_LEN: usize = 16;

/// Tags shares with the admin's secret.
#[derive(Clone)]
pub struct ShareTags {
    secret: [u8; SECRET_LEN],
}

impl std::fmt::Debug for ShareTags {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ShareTags(..)")
    }
}

impl ShareTags {
    pub fn new(secret: [u8; SECRET_LEN]) -> Self {
        Self { secret }
    }

    /// The tag of `share` of `limit` leased to `instance`: never 0 (what
    /// an Envoy that sends none reports).
    pub fn tag(&self, instance: &str, limit: &str, share: &Share) -> u64 {
        let Ok(mut mac) = <Hmac<Sha256> as KeyInit>::new_from_slice(&self.secret) else {
            return 1;
        };
        mac.update(b"sluice share v1\0");
        mac.update(instance.as_bytes());
        mac.update(b"\0");
        mac.update(limit.as_bytes());
        mac.update(b"\0");
        mac.update(&share.id().to_le_bytes());
        mac.update(&share.amount.rate.to_bits().to_le_bytes());
        mac.update(&share.amount.in_flight.to_le_bytes());
        mac.update(&share.instances.to_le_bytes());
        let digest = mac.finalize().into_bytes();
        let mut first = [0u8; 8];
        first.copy_from_slice(&digest[..8]);
        u64::from_le_bytes(first).max(1)
    }

    /// Whether `tag` is the one this admin gave `share`.
    pub fn vouches(&self, instance: &str, limit: &str, share: &Share, tag: u64) -> bool {
        // Compared whole: a tag is no secret once given, and 64 bits are
        // not found by trying (each try is a sync, and logged).
        tag != 0 && self.tag(instance, limit, share) == tag
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::Amount;
    use crate::time::Instant;

    fn share(rate: f64) -> Share {
        Share {
            amount: Amount { rate, in_flight: 3 },
            expires_at: Instant::from_millis(1_800_000_000_123),
            instances: 2,
        }
    }

    #[test]
    fn a_tag_vouches_for_its_share_only_and_under_its_secret_only() {
        let tags = ShareTags::new([7; SECRET_LEN]);
        let tag = tags.tag("egress-a", "llm", &share(45.5));
        assert!(tags.vouches("egress-a", "llm", &share(45.5), tag));
        assert!(!tags.vouches("egress-b", "llm", &share(45.5), tag));
        assert!(!tags.vouches("egress-a", "bank", &share(45.5), tag));
        assert!(!tags.vouches("egress-a", "llm", &share(90.0), tag));
        assert!(!tags.vouches("egress-a", "llm", &share(45.5), 0));
        let other = ShareTags::new([8; SECRET_LEN]);
        assert!(!other.vouches("egress-a", "llm", &share(45.5), tag));
    }
}
