//! Fleet mode in the filter: the shares of global policies the admin grants
//! at each sync, kept in Envoy shared data for every worker, and the limits
//! each worker applies for them.
//!
//! - `sluice/fleet/grants`: a sequence number (8 bytes) and the grants as
//!   JSON, written by the VM whose sync brought them. Workers compare the
//!   sequence on their tick and decode only when it moved.
//!
//! A grant's expiry is counted from when the report was sent, not when the
//! answer came: the admin's lease started later, so ours ends first.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sluice_shared::fleet::{Amount, Grant};
use sluice_shared::limiter::Nanos;
use sluice_shared::sync::GrantsMessage;

use crate::host::Host;
use crate::store::{update_bytes, StoreError, StoreStats};
use crate::sync::read_u64;

pub const GRANTS_KEY: &str = "sluice/fleet/grants";
/// Larger headers are ignored (a well-behaved admin sends a few hundred
/// bytes per global policy).
pub const MAX_GRANTS_HEADER: usize = 64 * 1024;

/// A grant as this Envoy holds it: the share and when it lapses, on this
/// Envoy's clock.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct HeldGrant {
    pub share: Amount,
    pub expires_at_ns: Nanos,
    pub instances: u32,
    pub id: u64,
}

impl HeldGrant {
    /// The form the pure core reasons about, in milliseconds.
    pub fn as_grant(&self) -> Grant {
        Grant {
            share: self.share,
            expires_at_ms: self.expires_at_ns / 1_000_000,
            instances: self.instances,
        }
    }
}

pub type HeldGrants = BTreeMap<String, HeldGrant>;

/// The grants in the admin's answer header; None if it is not one. Shares
/// that are not finite or negative are refused with the whole header.
pub fn parse_header(value: &[u8], sent_at: Nanos) -> Option<HeldGrants> {
    if value.len() > MAX_GRANTS_HEADER {
        return None;
    }
    let message: GrantsMessage = serde_json::from_slice(value).ok()?;
    let mut out = BTreeMap::new();
    for (policy, m) in message {
        if !m.rate.is_finite() || m.rate < 0.0 {
            return None;
        }
        out.insert(
            policy,
            HeldGrant {
                share: Amount {
                    rate: m.rate,
                    in_flight: m.in_flight,
                },
                expires_at_ns: sent_at.saturating_add(m.lease_ms.saturating_mul(1_000_000)),
                instances: m.instances,
                id: m.id,
            },
        );
    }
    Some(out)
}

fn decode(bytes: Option<&[u8]>) -> (u64, HeldGrants) {
    match (read_u64(bytes), bytes.and_then(|b| b.get(8..))) {
        (Some(seq), Some(json)) => (seq, serde_json::from_slice(json).unwrap_or_default()),
        _ => (0, BTreeMap::new()),
    }
}

/// The sequence number of the published grants (0: none yet).
pub fn published_seq<H: Host + ?Sized>(host: &H) -> u64 {
    read_u64(host.shared_get(GRANTS_KEY).0.as_deref()).unwrap_or(0)
}

pub fn published<H: Host + ?Sized>(host: &H) -> (u64, HeldGrants) {
    decode(host.shared_get(GRANTS_KEY).0.as_deref())
}

/// Stores the grants of one answer for every worker: they replace the
/// policies' earlier grants; grants of policies the answer does not name
/// are dropped (those policies are no longer global).
pub fn publish<H: Host + ?Sized>(
    host: &H,
    stats: &mut StoreStats,
    grants: &HeldGrants,
) -> Result<(), StoreError> {
    let json = serde_json::to_vec(grants).unwrap_or_default();
    update_bytes(host, GRANTS_KEY, stats, |cur| {
        let (seq, _) = decode(cur);
        let mut value = seq.wrapping_add(1).max(1).to_le_bytes().to_vec();
        value.extend_from_slice(&json);
        ((), Some(value))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::FakeHost;

    #[test]
    fn header_grants_expire_a_lease_after_the_report_was_sent() {
        let header = br#"{"llm": {"rate": 120.5, "in_flight": 7, "lease_ms": 3000, "instances": 3, "id": 42}}"#;
        let grants = parse_header(header, 10_000_000_000).unwrap();
        let llm = grants["llm"];
        assert_eq!(llm.share.in_flight, 7);
        assert_eq!(llm.expires_at_ns, 13_000_000_000);
        assert_eq!((llm.instances, llm.id), (3, 42));
        for bad in [
            &b"garbage"[..],
            br#"{"llm": {"rate": -1, "in_flight": 7, "lease_ms": 3000, "instances": 3, "id": 1}}"#,
            br#"{"llm": {"rate": 1}}"#,
            &[0xff, 0xfe][..],
        ] {
            assert_eq!(parse_header(bad, 0), None, "{bad:?}");
        }
    }

    #[test]
    fn published_grants_carry_a_moving_sequence() {
        let host = FakeHost::at(0);
        let mut stats = StoreStats::default();
        assert_eq!(published_seq(&host), 0);
        let grants = parse_header(
            br#"{"llm": {"rate": 1, "in_flight": 2, "lease_ms": 3000, "instances": 1, "id": 9}}"#,
            0,
        )
        .unwrap();
        publish(&host, &mut stats, &grants).unwrap();
        publish(&host, &mut stats, &grants).unwrap();
        assert_eq!(published_seq(&host), 2);
        assert_eq!(published(&host), (2, grants));
    }
}
