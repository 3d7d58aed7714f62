//! Envoy's shared-data semantics, in process memory: what a host without
//! proxy-wasm's shared data (the native module) keeps its state in, and
//! the rule the unit tests' host applies. A missing key is inserted
//! whatever CAS token is passed, a token of 0 overwrites unconditionally,
//! and any other token must match the entry's.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::Mutex;

use rustc_hash::FxHashMap;

use crate::host::SetError;

/// One entry: its bytes and the CAS token of its last write.
pub type Entry = (Vec<u8>, u32);

/// Writes `value` under `key` if `cas` allows it, giving the entry the
/// token `next` (never 0).
pub fn apply_set<S: BuildHasher>(
    map: &mut HashMap<String, Entry, S>,
    key: &str,
    value: &[u8],
    cas: Option<u32>,
    next: u32,
) -> Result<(), SetError> {
    let token = cas.unwrap_or(0);
    match map.get_mut(key) {
        Some((_, current)) if token != 0 && token != *current => Err(SetError::CasMismatch),
        Some(entry) => {
            entry.0.clear();
            entry.0.extend_from_slice(value);
            entry.1 = next.max(1);
            Ok(())
        }
        None => {
            map.insert(key.to_string(), (value.to_vec(), next.max(1)));
            Ok(())
        }
    }
}

/// Shared data for every worker thread of one process.
#[derive(Debug, Default)]
pub struct SharedMemory {
    inner: Mutex<Entries>,
}

#[derive(Debug, Default)]
struct Entries {
    map: FxHashMap<String, Entry>,
    next_cas: u32,
}

impl SharedMemory {
    /// The value and its CAS token; (None, None) when the key is missing.
    pub fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        let Ok(entries) = self.inner.lock() else {
            return (None, None);
        };
        match entries.map.get(key) {
            Some((value, cas)) => (Some(value.clone()), Some(*cas)),
            None => (None, None),
        }
    }

    pub fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        let Ok(mut entries) = self.inner.lock() else {
            return Err(SetError::Failed);
        };
        // Tokens wrap past u32::MAX back to 1: a stale token would have to
        // survive four billion writes to match again.
        let next = entries.next_cas.checked_add(1).unwrap_or(1);
        apply_set(&mut entries.map, key, value, cas, next)?;
        entries.next_cas = next;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_key_is_written_whatever_token_comes() {
        let memory = SharedMemory::default();
        assert_eq!(memory.get("k"), (None, None));
        assert!(memory.set("k", b"a", Some(77)).is_ok());
        let (value, cas) = memory.get("k");
        assert_eq!(value.as_deref(), Some(&b"a"[..]));
        assert!(cas.is_some_and(|c| c != 0));
    }

    #[test]
    fn a_stale_token_is_refused_and_the_value_kept() {
        let memory = SharedMemory::default();
        memory.set("k", b"a", None).unwrap();
        let (_, first) = memory.get("k");
        memory.set("k", b"b", first).unwrap();
        assert_eq!(memory.set("k", b"c", first), Err(SetError::CasMismatch));
        assert_eq!(memory.get("k").0.as_deref(), Some(&b"b"[..]));
        // Token 0 (None) overwrites whatever is there.
        memory.set("k", b"d", None).unwrap();
        assert_eq!(memory.get("k").0.as_deref(), Some(&b"d"[..]));
    }

    #[test]
    fn racing_writers_lose_no_increment() {
        let memory = std::sync::Arc::new(SharedMemory::default());
        // Two first writes of a missing key both succeed, as in Envoy: the
        // store creates its entries before counting on them.
        memory.set("n", &0u64.to_le_bytes(), None).unwrap();
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let memory = std::sync::Arc::clone(&memory);
                std::thread::spawn(move || {
                    for _ in 0..1_000 {
                        loop {
                            let (value, cas) = memory.get("n");
                            let n = value.map_or(0u64, |v| {
                                u64::from_le_bytes(v.try_into().unwrap_or([0; 8]))
                            });
                            if memory.set("n", &(n + 1).to_le_bytes(), cas).is_ok() {
                                break;
                            }
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let (value, _) = memory.get("n");
        let n = u64::from_le_bytes(value.unwrap().try_into().unwrap());
        assert_eq!(n, 4_000);
    }
}
