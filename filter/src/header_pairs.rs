//! A header map read from proxy-wasm in one host call, as the ABI
//! serializes it: the number of pairs (u32, little-endian), each pair's
//! name and value lengths (u32 each), then each name and each value,
//! each followed by a NUL. One call for every header a decision reads
//! (its authority, a key, a caller's own route header) instead of one
//! each: a host call costs far more than a scan of a few headers.

use std::ops::Range;

/// The pairs, over the bytes the host handed back. Nothing here trusts
/// them: lengths past the end make the whole map unreadable.
#[derive(Debug, Default)]
pub struct HeaderPairs {
    raw: Vec<u8>,
    pairs: Vec<(Range<usize>, Range<usize>)>,
}

fn u32_at(raw: &[u8], at: usize) -> Option<usize> {
    let bytes: [u8; 4] = raw.get(at..at.checked_add(4)?)?.try_into().ok()?;
    usize::try_from(u32::from_le_bytes(bytes)).ok()
}

impl HeaderPairs {
    /// The map in `raw` (None: not one; an empty `raw` is an empty map).
    pub fn parse(raw: Vec<u8>) -> Option<Self> {
        if raw.is_empty() {
            return Some(Self::default());
        }
        let count = u32_at(&raw, 0)?;
        // Each pair takes 8 bytes of lengths and 2 NULs at least.
        if count > raw.len() / 10 {
            return None;
        }
        let mut at = 4usize.checked_add(count.checked_mul(8)?)?;
        let mut pairs = Vec::with_capacity(count);
        for i in 0..count {
            let name_len = u32_at(&raw, 4 + i * 8)?;
            let value_len = u32_at(&raw, 8 + i * 8)?;
            let name = at..at.checked_add(name_len)?;
            let value_start = name.end.checked_add(1)?;
            let value = value_start..value_start.checked_add(value_len)?;
            at = value.end.checked_add(1)?;
            if at > raw.len() {
                return None;
            }
            pairs.push((name, value));
        }
        Some(Self { raw, pairs })
    }

    /// The first value of header `name` (any case).
    pub fn get(&self, name: &str) -> Option<&[u8]> {
        self.pairs.iter().find_map(|(n, v)| {
            let found = self.raw.get(n.clone())?;
            found
                .eq_ignore_ascii_case(name.as_bytes())
                .then(|| self.raw.get(v.clone()))
                .flatten()
        })
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn serialize(pairs: &[(&str, &[u8])]) -> Vec<u8> {
        let mut out = (pairs.len() as u32).to_le_bytes().to_vec();
        for (n, v) in pairs {
            out.extend((n.len() as u32).to_le_bytes());
            out.extend((v.len() as u32).to_le_bytes());
        }
        for (n, v) in pairs {
            out.extend(n.as_bytes());
            out.push(0);
            out.extend(*v);
            out.push(0);
        }
        out
    }

    #[test]
    fn reads_what_the_host_serialized_the_first_value_of_a_name() {
        let raw = serialize(&[
            (":authority", b"api.bank.example"),
            ("x-sluice-member", b"llm-east"),
            ("x-sluice-member", b"llm-west"),
            ("empty", b""),
        ]);
        let pairs = HeaderPairs::parse(raw).unwrap_or_default();
        assert_eq!(pairs.get(":authority"), Some(&b"api.bank.example"[..]));
        assert_eq!(pairs.get("X-Sluice-Member"), Some(&b"llm-east"[..]));
        assert_eq!(pairs.get("empty"), Some(&b""[..]));
        assert_eq!(pairs.get("absent"), None);
        assert!(HeaderPairs::parse(Vec::new()).is_some_and(|p| p.get("a").is_none()));
    }

    proptest! {
        /// Any bytes: parsed or refused, never a panic; a map that parses
        /// gives back what was serialized.
        #[test]
        fn any_bytes_are_parsed_or_refused(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = HeaderPairs::parse(bytes);
        }

        #[test]
        fn a_serialized_map_reads_back(names in proptest::collection::vec("[a-z:-]{1,12}", 0..8),
                                       value in proptest::collection::vec(any::<u8>(), 0..40)) {
            let pairs: Vec<(&str, &[u8])> = names.iter().map(|n| (n.as_str(), value.as_slice())).collect();
            let parsed = HeaderPairs::parse(serialize(&pairs));
            prop_assert!(parsed.is_some());
            let parsed = parsed.unwrap_or_default();
            for n in &names {
                prop_assert_eq!(parsed.get(n), Some(value.as_slice()));
            }
        }
    }
}
