//! Fleet mode in the filter: the shares of global policies the admin leases
//! out at each sync, kept in Envoy shared data for every worker.
//!
//! - `sluice/fleet/shares`: a sequence number (8 bytes) and the shares as
//!   JSON, written by the VM whose sync brought them. Workers compare the
//!   sequence on their tick and decode only when it moved.
//!
//! A share's expiry is counted from when the report was sent, not when the
//! answer came: the admin's lease started later, so ours ends first.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sluice_shared::fleet::{Amount, Share};
use sluice_shared::time::{Instant, Span};
use sluice_wire::sync::SharesMessage;

use crate::entries::{self, Entry, SHARES_KEY};
use crate::host::Host;
use crate::store::{Store, StoreError};
use crate::sync::read_u64;

/// A share as this Envoy holds it: the amount and when its lease ends, on
/// this Envoy's clock.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct HeldShare {
    pub amount: Amount,
    pub expires_at: Instant,
    pub instances: u32,
    pub id: u64,
    /// The admin's tag of the share, echoed with it.
    #[serde(default)]
    pub tag: u64,
}

impl HeldShare {
    /// The form the pure core reasons about.
    pub fn as_share(&self) -> Share {
        Share {
            amount: self.amount,
            expires_at: self.expires_at,
            instances: self.instances,
        }
    }
}

pub type HeldShares = BTreeMap<String, HeldShare>;

/// The shares the admin's answer gave, held from `sent_at`; None if one
/// is not finite or negative: the whole message is refused then.
pub fn held_shares(message: SharesMessage, sent_at: Instant) -> Option<HeldShares> {
    let mut out = BTreeMap::new();
    for (policy, m) in message {
        if !m.rate.is_finite() || m.rate < 0.0 {
            return None;
        }
        out.insert(
            policy,
            HeldShare {
                amount: Amount {
                    rate: m.rate,
                    in_flight: m.in_flight,
                },
                expires_at: sent_at + Span::from_millis(m.lease_ms),
                instances: m.instances,
                id: m.id,
                tag: m.tag,
            },
        );
    }
    Some(out)
}

/// [`SHARES_KEY`]: a sequence number every worker polls (0: none yet),
/// then the shares as JSON, read only when the number moved.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PublishedShares {
    pub seq: u64,
    pub shares: HeldShares,
}

impl Entry for PublishedShares {
    fn decode(bytes: &[u8]) -> Option<Self> {
        Some(Self {
            seq: published_seq_of(bytes)?,
            // Shares that do not read are none: the policies fall back to
            // their share of the limit split among the instances.
            shares: serde_json::from_slice(bytes.get(8..)?).unwrap_or_default(),
        })
    }

    fn encode(&self) -> Vec<u8> {
        let mut value = self.seq.to_le_bytes().to_vec();
        value.extend_from_slice(&serde_json::to_vec(&self.shares).unwrap_or_default());
        value
    }
}

fn published_seq_of(bytes: &[u8]) -> Option<u64> {
    read_u64(Some(bytes))
}

/// The sequence number of the published shares (0: none yet), without
/// reading the shares.
pub fn published_seq<H: Host + ?Sized>(host: &H) -> u64 {
    host.shared_get(SHARES_KEY)
        .0
        .and_then(|bytes| published_seq_of(&bytes))
        .unwrap_or(0)
}

pub fn published<H: Host + ?Sized>(host: &H) -> (u64, HeldShares) {
    let published: PublishedShares = entries::read_as(host, SHARES_KEY);
    (published.seq, published.shares)
}

/// Stores the shares of one answer for every worker: they replace the
/// policies' earlier shares; shares of policies the answer does not name
/// are dropped (those policies are no longer global).
pub fn publish<H: Host + ?Sized>(
    host: &H,
    store: &mut Store,
    shares: &HeldShares,
) -> Result<(), StoreError> {
    store.update_as::<PublishedShares, _, _>(host, SHARES_KEY, |published| {
        published.seq = published.seq.wrapping_add(1).max(1);
        // Each VM's sync has a connection of its own, and an answer can
        // come after the answer to a later sync: a share older than the
        // one published (ids grow with issue) is not taken back. Taken, the
        // Envoy reported a share the admin had since retired, which read
        // as a claim of a share it lost and froze every share for a lease
        // and a half (the simulator's fleet, seed 201).
        let mut next = shares.clone();
        for (policy, share) in &mut next {
            if let Some(newer) = published.shares.get(policy).filter(|p| p.id > share.id) {
                *share = *newer;
            }
        }
        published.shares = next;
        ((), true)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::FakeHost;
    use sluice_wire::sync::SHARES_HEADER;
    use sluice_wire::sync_answer::ReceivedHeaders;

    /// The shares of an answer whose shares header is `value`, read as a
    /// shell reads it.
    fn parse_header(value: &[u8], sent_at: Instant) -> Option<HeldShares> {
        let read = ReceivedHeaders::read(|name| (name == SHARES_HEADER).then_some(value));
        held_shares(read.shares?.ok()?, sent_at)
    }

    #[test]
    fn header_shares_expire_a_lease_after_the_report_was_sent() {
        let header = br#"{"llm": {"rate": 120.5, "in_flight": 7, "lease_ms": 3000, "instances": 3, "id": 42}}"#;
        let shares = parse_header(header, Instant::from_millis(10_000)).unwrap();
        let llm = shares["llm"];
        assert_eq!(llm.amount.in_flight, 7);
        assert_eq!(llm.expires_at, Instant::from_millis(13_000));
        assert_eq!((llm.instances, llm.id), (3, 42));
        for bad in [
            &b"garbage"[..],
            br#"{"llm": {"rate": -1, "in_flight": 7, "lease_ms": 3000, "instances": 3, "id": 1}}"#,
            br#"{"llm": {"rate": 1}}"#,
            &[0xff, 0xfe][..],
        ] {
            assert_eq!(parse_header(bad, Instant::EPOCH), None, "{bad:?}");
        }
    }

    #[test]
    fn published_shares_carry_a_moving_sequence() {
        let host = FakeHost::at(Instant::EPOCH);
        let mut store = Store::default();
        assert_eq!(published_seq(&host), 0);
        let shares = parse_header(
            br#"{"llm": {"rate": 1, "in_flight": 2, "lease_ms": 3000, "instances": 1, "id": 9}}"#,
            Instant::EPOCH,
        )
        .unwrap();
        publish(&host, &mut store, &shares).unwrap();
        publish(&host, &mut store, &shares).unwrap();
        assert_eq!(published_seq(&host), 2);
        assert_eq!(published(&host), (2, shares));
    }

    /// Two VMs' syncs crossed: the answer to the earlier one came second.
    /// Its share (an older id) does not replace the newer one published.
    #[test]
    fn an_answer_older_than_the_share_published_does_not_replace_it() {
        let host = FakeHost::at(Instant::EPOCH);
        let mut store = Store::default();
        let share = |id: u64, rate: u32| {
            let header = format!(
                r#"{{"llm": {{"rate": {rate}, "in_flight": 0, "lease_ms": 3000, "instances": 2, "id": {id}}},
                    "other": {{"rate": 1, "in_flight": 0, "lease_ms": 3000, "instances": 2, "id": {id}}}}}"#
            );
            parse_header(header.as_bytes(), Instant::EPOCH).unwrap()
        };
        publish(&host, &mut store, &share(4_154, 70)).unwrap();
        let mut late = share(4_148, 71);
        late.remove("other");
        publish(&host, &mut store, &late).unwrap();
        let (_, held) = published(&host);
        assert_eq!(held["llm"].id, 4_154);
        assert_eq!(held["llm"].amount.rate, 70.0);
        // A policy the late answer no longer names is gone, as before.
        assert!(!held.contains_key("other"));
        publish(&host, &mut store, &share(4_220, 72)).unwrap();
        assert_eq!(published(&host).1["llm"].id, 4_220);
    }
}
