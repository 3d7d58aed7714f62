//! The per-key view of a keyed policy: which keys are busiest, how many
//! are active, how many found no place. Raw keys (API keys, tenant ids)
//! never leave Envoy: a key is named by a label, a keyed hash under a
//! secret derived from the fleet's sync token, so the admin can find a key
//! typed into it (it knows the token) while someone reading reports,
//! metrics or the browser cannot turn a label back into its key.
//!
//! Memory is bounded whatever the keys: the busiest keys are counted with
//! the Space-Saving algorithm (Metwally, Agrawal, El Abbadi 2005) in a fixed
//! number of counters, and distinct keys with linear counting (Whang,
//! Vander-Zanden, Taylor 1990) in a fixed bitmap. Both merge: summaries of
//! workers and of Envoys add up to a summary of them all.

use hmac::{Hmac, KeyInit, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use crate::key_hash::KeySecret;
use crate::policy::key::KeyLabel;

/// Counters a worker keeps per keyed policy between two flushes.
pub const WORKER_TOP_KEYS: usize = 32;
/// Counters an Envoy keeps per keyed policy between two syncs.
pub const ENVOY_TOP_KEYS: usize = 64;
/// Keys the live view lists per policy.
pub const SHOWN_TOP_KEYS: usize = 20;
/// The longest raw value shown when a policy opts into `label: value`.
pub const MAX_VALUE_LABEL: usize = 64;

/// The secret labels are hashed with, from the fleet's sync token (HMAC,
/// so that labels say nothing of the token either). Without a token (a
/// development setup) the secret is public and a short key, such as a
/// tenant id, could be guessed from its label.
pub fn label_secret(sync_token: Option<&str>) -> KeySecret {
    let mut mac =
        <Hmac<Sha256> as KeyInit>::new_from_slice(sync_token.unwrap_or_default().as_bytes())
            .unwrap_or_else(|_| unreachable_hmac());
    mac.update(b"sluice key labels v1");
    let digest = mac.finalize().into_bytes();
    let mut bytes = [0; KeySecret::LEN];
    bytes.copy_from_slice(&digest[..KeySecret::LEN]);
    KeySecret::from_bytes(bytes)
}

/// HMAC takes a key of any length; this is never reached.
fn unreachable_hmac() -> Hmac<Sha256> {
    <Hmac<Sha256> as KeyInit>::new_from_slice(b"sluice").unwrap_or_else(|_| unreachable!())
}

/// A key as the view knows it: its hash (which also places it in the
/// distinct-key bitmaps) and the text shown for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyName {
    pub hash: u64,
    pub label: String,
}

/// What joins the two parts of a key read from a header and a body field
/// (`key` with `header` and `json`): a line feed, which no header value
/// holds (Envoy refuses CR, LF and NUL in them), so no two pairs join
/// into the same key.
pub const KEY_PARTS_JOIN: u8 = b'\n';

/// Names `value`, the key of a request under `policy`. Requests without
/// the key header share one bucket and one name.
pub fn name_key(secret: &KeySecret, policy: &str, value: &[u8], mode: KeyLabel) -> KeyName {
    let hash = secret.hash(policy, value);
    let label = if value.is_empty() {
        NO_KEY_LABEL.to_string()
    } else {
        match mode {
            KeyLabel::Value => value_label(value).unwrap_or_else(|| hash_label(hash)),
            KeyLabel::Field => field_label(value).unwrap_or_else(|| hash_label(hash)),
            KeyLabel::Hash => hash_label(hash),
        }
    };
    KeyName { hash, label }
}

/// The name of the requests without the key header.
pub const NO_KEY_LABEL: &str = "(no key)";

/// 48 bits: labels of a policy's busiest keys do not collide in practice,
/// and the text stays short.
pub fn hash_label(hash: u64) -> String {
    format!("#{:012x}", hash >> 16)
}

/// A pair's body field, shown as itself (see [`value_label`]).
fn field_label(value: &[u8]) -> Option<String> {
    value_label(split_pair(value)?.1)
}

/// The key of a header value and a body field (`key` with both), as the
/// Envoys read it and a lookup must name it; None when the header holds
/// [`KEY_PARTS_JOIN`] (never from Envoy: it could pass for another pair).
pub fn join_pair(header: &[u8], field: &[u8]) -> Option<Vec<u8>> {
    if header.contains(&KEY_PARTS_JOIN) {
        return None;
    }
    let mut pair = Vec::with_capacity(header.len() + 1 + field.len());
    pair.extend_from_slice(header);
    pair.push(KEY_PARTS_JOIN);
    pair.extend_from_slice(field);
    Some(pair)
}

/// A pair key's header value and body field (split at the first
/// [`KEY_PARTS_JOIN`]: a header holding it gives no key); None for a key
/// of one part.
pub fn split_pair(value: &[u8]) -> Option<(&[u8], &[u8])> {
    let at = value.iter().position(|b| *b == KEY_PARTS_JOIN)?;
    Some((&value[..at], &value[at + 1..]))
}

/// A value shown as itself: printable ASCII only, so that no header value
/// can smuggle markup or control characters into the admin; longer ones
/// are cut with a marker.
fn value_label(value: &[u8]) -> Option<String> {
    if let Some((header, field)) = split_pair(value) {
        // A pair: each part shown as itself, or the whole by its hash.
        let part = |part: &[u8]| match part {
            [] => Some("(none)".to_string()),
            part => value_label(part),
        };
        return Some(format!("{} · {}", part(header)?, part(field)?));
    }
    if !value.iter().all(|b| (0x20..0x7f).contains(b)) {
        return None;
    }
    let text = std::str::from_utf8(value).ok()?;
    Some(if text.len() > MAX_VALUE_LABEL {
        format!("{}…", &text[..MAX_VALUE_LABEL])
    } else {
        text.to_string()
    })
}

/// How a keyed request went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyOutcome {
    Admitted,
    Queued,
    Refused,
}

/// One key's counts. `calls` is what Space-Saving ranks by; `error` is how
/// much of `calls` may belong to keys this counter held before (0: exact).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyCount {
    pub label: String,
    pub hash: u64,
    pub calls: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub admitted: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub queued: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub refused: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub error: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The busiest keys in at most `capacity` counters. Every key with more
/// than `total / capacity` calls is in it, and no count is low by more
/// than its `error`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopKeys {
    pub keys: Vec<KeyCount>,
    /// Calls counted, over every key.
    pub total: u64,
}

impl TopKeys {
    pub fn record(&mut self, key: &KeyName, outcome: KeyOutcome, capacity: usize) {
        let mut one = KeyCount {
            label: key.label.clone(),
            hash: key.hash,
            calls: 1,
            ..KeyCount::default()
        };
        match outcome {
            KeyOutcome::Admitted => one.admitted = 1,
            KeyOutcome::Queued => one.queued = 1,
            KeyOutcome::Refused => one.refused = 1,
        }
        self.add_counted(one, capacity);
    }

    /// Adds another summary's counts (a worker's into its Envoy's).
    pub fn merge(&mut self, other: &TopKeys, capacity: usize) {
        for key in &other.keys {
            self.add_counted(key.clone(), capacity);
        }
        // `add_counted` added the listed keys' calls; the rest of the
        // other's total belongs to keys it dropped.
        let listed: u64 = other.keys.iter().fold(0, |s, k| s.saturating_add(k.calls));
        self.total = self
            .total
            .saturating_add(other.total.saturating_sub(listed));
    }

    fn add_counted(&mut self, key: KeyCount, capacity: usize) {
        self.total = self.total.saturating_add(key.calls);
        if let Some(held) = self.keys.iter_mut().find(|k| k.hash == key.hash) {
            held.calls = held.calls.saturating_add(key.calls);
            held.admitted = held.admitted.saturating_add(key.admitted);
            held.queued = held.queued.saturating_add(key.queued);
            held.refused = held.refused.saturating_add(key.refused);
            held.error = held.error.saturating_add(key.error);
            return;
        }
        if self.keys.len() < capacity.max(1) {
            self.keys.push(key);
            return;
        }
        // Full: the least counted key gives its counter to the newcomer,
        // which inherits its calls as possible error (Space-Saving).
        let Some(least) = self.keys.iter_mut().min_by_key(|k| k.calls) else {
            return;
        };
        let inherited = least.calls;
        *least = KeyCount {
            calls: inherited.saturating_add(key.calls),
            error: inherited.saturating_add(key.error),
            ..key
        };
    }

    pub fn is_empty(&self) -> bool {
        self.total == 0
    }
}

/// Bits of a distinct-key bitmap: estimates stay within a few percent up to
/// about 20,000 keys (twice the default `max_keys`).
pub const BITMAP_BITS: usize = 4096;
const WORDS: usize = BITMAP_BITS / 64;

/// Which keys were seen, as one bit per key hash (linear counting).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "Vec<u64>", into = "Vec<u64>")]
pub struct KeyBitmap {
    words: Box<[u64; WORDS]>,
}

impl Default for KeyBitmap {
    fn default() -> Self {
        Self {
            words: Box::new([0; WORDS]),
        }
    }
}

/// A bitmap of another size: from a different release, or broken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a key bitmap has {BITMAP_BITS} bits ({WORDS} words), not {0} words")]
pub struct BitmapSizeError(usize);

impl TryFrom<Vec<u64>> for KeyBitmap {
    type Error = BitmapSizeError;

    fn try_from(words: Vec<u64>) -> Result<Self, Self::Error> {
        let len = words.len();
        let words: Box<[u64; WORDS]> = words
            .into_boxed_slice()
            .try_into()
            .map_err(|_| BitmapSizeError(len))?;
        Ok(Self { words })
    }
}

impl From<KeyBitmap> for Vec<u64> {
    fn from(b: KeyBitmap) -> Self {
        b.words.to_vec()
    }
}

/// How many distinct keys a bitmap holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeyEstimate {
    About(u64),
    /// Every bit is set: more keys than the bitmap can tell apart.
    AtLeast(u64),
}

impl KeyBitmap {
    pub fn insert(&mut self, hash: u64) {
        // The top bits: the label uses them too, and the low bits picked
        // the key's place in the filter.
        let bit = (hash >> 52) as usize % BITMAP_BITS;
        if let Some(word) = self.words.get_mut(bit / 64) {
            *word |= 1 << (bit % 64);
        }
    }

    pub fn union(&mut self, other: &KeyBitmap) {
        for (mine, theirs) in self.words.iter_mut().zip(other.words.iter()) {
            *mine |= theirs;
        }
    }

    pub fn is_empty(&self) -> bool {
        self.words.iter().all(|w| *w == 0)
    }

    pub fn estimate(&self) -> KeyEstimate {
        let set: u32 = self.words.iter().map(|w| w.count_ones()).sum();
        let zeros = BITMAP_BITS as f64 - f64::from(set);
        let bits = BITMAP_BITS as f64;
        if zeros == 0.0 {
            // The estimate for one bit left is the most it can tell.
            return KeyEstimate::AtLeast((bits * bits.ln()).round() as u64);
        }
        KeyEstimate::About((-bits * (zeros / bits).ln()).round() as u64)
    }
}

/// One keyed policy's per-key counts over a span of an Envoy's clock: the
/// busiest keys, which keys were seen and which found no place.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeysReport {
    /// The span began (the Envoy's clock, ms); it ends at the report's
    /// `at_ms`.
    pub since_ms: u64,
    pub top: TopKeys,
    pub seen: KeyBitmap,
    #[serde(default)]
    pub overflowed: KeyBitmap,
}

impl KeysReport {
    pub fn record(
        &mut self,
        key: &KeyName,
        outcome: KeyOutcome,
        overflowed: bool,
        capacity: usize,
    ) {
        self.top.record(key, outcome, capacity);
        self.seen.insert(key.hash);
        if overflowed {
            self.overflowed.insert(key.hash);
        }
    }

    pub fn merge(&mut self, other: &KeysReport, capacity: usize) {
        self.top.merge(&other.top, capacity);
        self.seen.union(&other.seen);
        self.overflowed.union(&other.overflowed);
    }

    pub fn is_empty(&self) -> bool {
        self.top.is_empty() && self.seen.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn named(n: u64) -> KeyName {
        let secret = label_secret(Some("token"));
        name_key(&secret, "p", format!("key-{n}").as_bytes(), KeyLabel::Hash)
    }

    proptest! {
        /// A pair joined splits back into its parts, whatever the field
        /// holds; a header holding the join byte makes no pair.
        #[test]
        fn a_pair_joined_splits_into_its_parts(
            header in proptest::collection::vec(any::<u8>(), 0..16),
            field in proptest::collection::vec(any::<u8>(), 0..16),
        ) {
            match join_pair(&header, &field) {
                Some(pair) => prop_assert_eq!(split_pair(&pair), Some((&header[..], &field[..]))),
                None => prop_assert!(header.contains(&KEY_PARTS_JOIN)),
            }
        }
    }

    #[test]
    fn labels_depend_on_the_token_and_never_show_the_key() {
        let a = name_key(
            &label_secret(Some("t1")),
            "p",
            b"sk-live-123",
            KeyLabel::Hash,
        );
        let b = name_key(
            &label_secret(Some("t2")),
            "p",
            b"sk-live-123",
            KeyLabel::Hash,
        );
        let again = name_key(
            &label_secret(Some("t1")),
            "p",
            b"sk-live-123",
            KeyLabel::Hash,
        );
        assert_eq!(a, again);
        assert_ne!(a.label, b.label);
        assert!(!a.label.contains("sk-live"));
        assert_eq!(a.label.len(), 13, "{}", a.label);
        assert_eq!(
            name_key(&label_secret(None), "p", b"", KeyLabel::Hash).label,
            NO_KEY_LABEL
        );
    }

    /// The filter (wasm32) and the admin (x86_64, aarch64) must name a key
    /// alike: a label is part of the wire format. Seen the same in Envoy
    /// by the browser test of the live view.
    #[test]
    fn a_label_is_the_same_on_every_platform() {
        let secret = label_secret(Some("e2e-sync-token"));
        let named = name_key(&secret, "per-key", b"sk-live-cccc", KeyLabel::Hash);
        assert_eq!(named.label, "#dd0a8b726faa");
    }

    #[test]
    fn value_labels_show_printable_values_only() {
        let secret = label_secret(None);
        let shown = name_key(&secret, "p", b"tenant-42", KeyLabel::Value);
        assert_eq!(shown.label, "tenant-42");
        let hostile = name_key(&secret, "p", b"<script>\x07", KeyLabel::Value);
        assert!(hostile.label.starts_with('#'), "{}", hostile.label);
        let long = name_key(&secret, "p", &[b'a'; 500], KeyLabel::Value);
        assert_eq!(long.label.chars().count(), MAX_VALUE_LABEL + 1);
    }

    #[test]
    fn a_pairs_label_shows_both_values_or_its_hash() {
        let secret = label_secret(None);
        let label = |value: &[u8]| name_key(&secret, "p", value, KeyLabel::Value).label;
        assert_eq!(label(b"team-a\ngpt-4o"), "team-a · gpt-4o");
        assert_eq!(label(b"\ngpt-4o"), "(none) · gpt-4o");
        assert!(label(b"team-a\n<b>\x07").starts_with('#'));
        let field = |value: &[u8]| name_key(&secret, "p", value, KeyLabel::Field).label;
        assert_eq!(field(b"sk-live-secret\ngpt-4o"), "gpt-4o");
        assert!(field(b"sk-live-secret\n\x07").starts_with('#'));
        assert!(field(b"no pair").starts_with('#'));
    }

    #[test]
    fn a_summary_of_few_keys_is_exact() {
        let mut top = TopKeys::default();
        for _ in 0..5 {
            top.record(&named(1), KeyOutcome::Admitted, 4);
        }
        top.record(&named(2), KeyOutcome::Refused, 4);
        top.record(&named(2), KeyOutcome::Queued, 4);
        assert_eq!(top.total, 7);
        let two = top.keys.iter().find(|k| k.hash == named(2).hash).unwrap();
        assert_eq!(
            (two.calls, two.queued, two.refused, two.error),
            (2, 1, 1, 0)
        );
    }

    #[test]
    fn a_bitmap_counts_distinct_keys_within_a_few_percent() {
        for n in [1u64, 10, 100, 1_000, 10_000] {
            let mut seen = KeyBitmap::default();
            for i in 0..n {
                seen.insert(named(i).hash);
                seen.insert(named(i).hash);
            }
            let KeyEstimate::About(est) = seen.estimate() else {
                panic!("saturated at {n}");
            };
            let err = (est as f64 - n as f64).abs() / n as f64;
            assert!(err < 0.05 || est.abs_diff(n) <= 1, "{n} keys: {est}");
        }
        let mut full = KeyBitmap::default();
        for i in 0..200_000 {
            full.insert(named(i).hash);
        }
        assert!(matches!(full.estimate(), KeyEstimate::AtLeast(_)));
    }

    #[test]
    fn a_bitmap_of_the_wrong_size_is_refused() {
        assert!(serde_json::from_str::<KeyBitmap>("[1,2,3]").is_err());
        let round: KeyBitmap =
            serde_json::from_str(&serde_json::to_string(&KeyBitmap::default()).unwrap()).unwrap();
        assert!(round.is_empty());
    }

    proptest! {
        /// Space-Saving's promises: every key above total/capacity is
        /// listed, and each listed count is within its error of the truth.
        #[test]
        fn heavy_keys_are_always_listed(
            calls in prop::collection::vec(0u64..40, 1..600),
            capacity in 4usize..16,
        ) {
            let mut top = TopKeys::default();
            let mut truth = std::collections::HashMap::<u64, u64>::new();
            for k in &calls {
                // Skewed: low numbers come far more often.
                let k = k * k / 40;
                top.record(&named(k), KeyOutcome::Admitted, capacity);
                *truth.entry(named(k).hash).or_default() += 1;
            }
            prop_assert!(top.keys.len() <= capacity);
            prop_assert_eq!(top.total, calls.len() as u64);
            for (hash, n) in &truth {
                let listed = top.keys.iter().find(|c| c.hash == *hash);
                if *n > top.total / capacity as u64 {
                    prop_assert!(listed.is_some(), "a key with {} of {} calls is missing", n, top.total);
                }
                if let Some(c) = listed {
                    prop_assert!(c.calls >= *n && c.calls - c.error <= *n);
                }
            }
        }

        /// Merged summaries keep the promise over the union of their calls.
        #[test]
        fn merged_summaries_list_the_heavy_keys(
            parts in prop::collection::vec(prop::collection::vec(0u64..30, 0..200), 1..5),
        ) {
            let capacity = 8;
            let mut merged = TopKeys::default();
            let mut truth = std::collections::HashMap::<u64, u64>::new();
            for part in &parts {
                let mut top = TopKeys::default();
                for k in part {
                    let k = k * k / 30;
                    top.record(&named(k), KeyOutcome::Admitted, capacity);
                    *truth.entry(named(k).hash).or_default() += 1;
                }
                merged.merge(&top, capacity);
            }
            let total: u64 = truth.values().sum();
            prop_assert_eq!(merged.total, total);
            for (hash, n) in &truth {
                if let Some(c) = merged.keys.iter().find(|c| c.hash == *hash) {
                    prop_assert!(c.calls >= c.error);
                    prop_assert!(c.calls - c.error <= *n);
                }
                // Each part may drop up to total/capacity of a key's calls.
                if *n > total / capacity as u64 * parts.len() as u64 + total / capacity as u64 {
                    prop_assert!(merged.keys.iter().any(|c| c.hash == *hash));
                }
            }
        }
    }
}
