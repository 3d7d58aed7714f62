//! A fair table's bytes in shared data: a header (version, window start,
//! last refill, pool, reserve, key count) and ten words per key.

use crate::time::Instant;

use super::table::{FairKey, FairTable, MAX_KEYS};

/// Why bytes are no table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FairDecodeError {
    #[error("fair table: version {0} unknown")]
    Version(u8),
    #[error("fair table: {0} bytes, too short")]
    Short(usize),
    #[error("fair table: {0} keys, more than {MAX_KEYS} and the overflow")]
    TooManyKeys(usize),
}

/// 3: the reserve for newcomers. 2 (each key keeps what
/// it asked two windows back) is read with an empty reserve.
const VERSION: u8 = 3;
const HEADER_LEN: usize = 1 + 8 + 8 + 8 + 8 + 4;
const HEADER_LEN_2: usize = HEADER_LEN - 8;
const KEY_LEN: usize = 8 * 10;

impl FairTable {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_LEN + self.keys.len() * KEY_LEN);
        out.push(VERSION);
        out.extend_from_slice(&self.window_start.as_nanos().to_le_bytes());
        out.extend_from_slice(&self.refilled_at.as_nanos().to_le_bytes());
        out.extend_from_slice(&self.pool.to_le_bytes());
        out.extend_from_slice(&self.reserve.to_le_bytes());
        out.extend_from_slice(&u32::try_from(self.keys.len()).unwrap_or(0).to_le_bytes());
        for k in &self.keys {
            for v in [k.key, k.weight, k.reserved, k.share] {
                out.extend_from_slice(&v.to_le_bytes());
            }
            out.extend_from_slice(&k.tokens.to_le_bytes());
            for v in [
                k.asked,
                k.asked_before,
                k.asked_earlier,
                k.used,
                k.used_before,
            ] {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, FairDecodeError> {
        let word = |at: usize| -> Result<[u8; 8], FairDecodeError> {
            bytes
                .get(at..at + 8)
                .and_then(|b| b.try_into().ok())
                .ok_or(FairDecodeError::Short(bytes.len()))
        };
        let header = match bytes.first() {
            Some(&VERSION) => HEADER_LEN,
            Some(2) => HEADER_LEN_2,
            Some(&other) => return Err(FairDecodeError::Version(other)),
            None => return Err(FairDecodeError::Short(0)),
        };
        let count = bytes
            .get(header - 4..header)
            .and_then(|b| <[u8; 4]>::try_from(b).ok())
            .map(u32::from_le_bytes)
            .ok_or(FairDecodeError::Short(bytes.len()))? as usize;
        if count > MAX_KEYS + 1 {
            return Err(FairDecodeError::TooManyKeys(count));
        }
        if bytes.len() != header + count * KEY_LEN {
            return Err(FairDecodeError::Short(bytes.len()));
        }
        let mut keys = Vec::with_capacity(count);
        for n in 0..count {
            let at = header + n * KEY_LEN;
            let u = |i: usize| word(at + 8 * i).map(u64::from_le_bytes);
            keys.push(FairKey {
                key: u(0)?,
                weight: u(1)?,
                reserved: u(2)?,
                share: u(3)?,
                tokens: i64::from_le_bytes(word(at + 32)?),
                asked: u(5)?,
                asked_before: u(6)?,
                asked_earlier: u(7)?,
                used: u(8)?,
                used_before: u(9)?,
            });
        }
        Ok(Self {
            window_start: Instant::from_nanos(u64::from_le_bytes(word(1)?)),
            refilled_at: Instant::from_nanos(u64::from_le_bytes(word(9)?)),
            pool: i64::from_le_bytes(word(17)?),
            reserve: if header == HEADER_LEN {
                i64::from_le_bytes(word(25)?)
            } else {
                0
            },
            keys,
        })
    }
}
