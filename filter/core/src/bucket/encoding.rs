//! The bucket's state as bytes in shared data.

use super::*;

pub(super) struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn too_short(&self, wanted: usize) -> DecodeError {
        DecodeError::Length {
            expected: self.at.saturating_add(wanted),
            found: self.bytes.len(),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self.at.checked_add(n).ok_or_else(|| self.too_short(n))?;
        let slice = self
            .bytes
            .get(self.at..end)
            .ok_or_else(|| self.too_short(n))?;
        self.at = end;
        Ok(slice)
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64, DecodeError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
}

impl BucketState {
    pub fn encode(&self) -> Vec<u8> {
        let rate = self.rate.map(|r| r.encode()).unwrap_or_default();
        let leases = self.leases.encode();
        let mut out = Vec::with_capacity(
            1 + 16 + 1 + rate.len() + leases.len() + 4 + self.waiters.len() * Self::WAITER_LEN,
        );
        let fair = self.virtual_now != 0
            || !self.finishes.is_empty()
            || self.waiters.iter().any(|w| w.fair.is_some());
        out.push(if fair {
            Self::FAIR_VERSION
        } else {
            Self::VERSION
        });
        out.extend_from_slice(&self.owner.to_le_bytes());
        out.extend_from_slice(&self.next_ticket.to_le_bytes());
        out.push(u8::try_from(rate.len()).unwrap_or(0));
        out.extend_from_slice(&rate);
        out.extend_from_slice(&leases);
        out.extend_from_slice(&u32::try_from(self.waiters.len()).unwrap_or(0).to_le_bytes());
        for w in &self.waiters {
            out.extend_from_slice(&w.holder.to_le_bytes());
            out.extend_from_slice(&w.ticket.to_le_bytes());
            out.extend_from_slice(&w.cost.to_le_bytes());
            out.extend_from_slice(&w.deadline.as_nanos().to_le_bytes());
            out.push(match w.priority {
                Priority::Normal => 0,
                Priority::High => 1,
            });
        }
        if fair {
            out.extend_from_slice(&self.virtual_now.to_le_bytes());
            for w in &self.waiters {
                // Key 0 stands for none (fair tables take key 0 for 1).
                let tag = w.fair.unwrap_or(FairTag {
                    key: 0,
                    start: 0,
                    end: 0,
                    weight: 0,
                    reserved: 0,
                });
                for v in [tag.key, tag.start, tag.end, tag.weight, tag.reserved] {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
            out.extend_from_slice(
                &u32::try_from(self.finishes.len())
                    .unwrap_or(0)
                    .to_le_bytes(),
            );
            for (key, end) in &self.finishes {
                out.extend_from_slice(&key.to_le_bytes());
                out.extend_from_slice(&end.to_le_bytes());
            }
        }
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        let mut r = Reader { bytes, at: 0 };
        let version = r.u8()?;
        if ![Self::VERSION, Self::FAIR_VERSION_3, Self::FAIR_VERSION].contains(&version) {
            return Err(DecodeError::UnknownTag(version));
        }
        let owner = r.u64()?;
        let next_ticket = r.u64()?;
        let rate_len = usize::from(r.u8()?);
        let rate = if rate_len == 0 {
            None
        } else {
            Some(RateState::decode(r.take(rate_len)?)?)
        };
        let lease_count = r.u32()? as usize;
        if lease_count > LeaseTable::MAX_HOLDERS {
            return Err(r.too_short(lease_count * LeaseTable::LEASE_LEN));
        }
        let mut lease_bytes = (lease_count as u32).to_le_bytes().to_vec();
        lease_bytes.extend_from_slice(r.take(lease_count * LeaseTable::LEASE_LEN)?);
        let leases = LeaseTable::decode(&lease_bytes)?;
        let waiter_count = r.u32()? as usize;
        if waiter_count > Self::MAX_WAITERS {
            return Err(r.too_short(waiter_count * Self::WAITER_LEN));
        }
        let mut waiters = Vec::with_capacity(waiter_count);
        for _ in 0..waiter_count {
            waiters.push(Waiter {
                holder: r.u64()?,
                ticket: r.u64()?,
                cost: r.u64()?,
                deadline: Instant::from_nanos(r.u64()?),
                priority: if r.u8()? == 1 {
                    Priority::High
                } else {
                    Priority::Normal
                },
                fair: None,
            });
        }
        let mut virtual_now = 0;
        let mut finishes = Vec::new();
        if version != Self::VERSION {
            let with_shares = version == Self::FAIR_VERSION;
            let len = if with_shares {
                Self::FAIR_WAITER_LEN
            } else {
                Self::FAIR_WAITER_LEN_3
            };
            virtual_now = r.u64()?;
            if bytes.len().saturating_sub(r.at) < waiter_count * len {
                return Err(r.too_short(waiter_count * len));
            }
            for w in &mut waiters {
                let (key, start, end) = (r.u64()?, r.u64()?, r.u64()?);
                // Version 3 knew weights only: a weight of 1, nothing
                // reserved.
                let (weight, reserved) = if with_shares {
                    (r.u64()?, r.u64()?)
                } else {
                    (fair::WEIGHT_SCALE, 0)
                };
                w.fair = (key != 0).then_some(FairTag {
                    key,
                    start,
                    end,
                    weight,
                    reserved,
                });
            }
            if with_shares {
                let count = r.u32()? as usize;
                if count > Self::MAX_FINISHES {
                    return Err(r.too_short(count * 16));
                }
                for _ in 0..count {
                    finishes.push((r.u64()?, r.u64()?));
                }
            }
        }
        if r.at != bytes.len() {
            return Err(DecodeError::Length {
                expected: r.at,
                found: bytes.len(),
            });
        }
        Ok(Self {
            owner,
            next_ticket,
            rate,
            leases,
            waiters,
            virtual_now,
            finishes,
        })
    }
}
