//! What a limit of an hour or longer (a daily token budget, a monthly
//! money budget) has spent, as the live view shows it: in all, and for a
//! keyed one per key, its top spenders. An Envoy reports its own top; the
//! admin adds up the Envoys' (a key's spend on two Envoys is one key's),
//! so a key that is below every Envoy's top is missing from the fleet's.
//!
//! Bounded whatever a report says: at most [`SHOWN_TOP_KEYS`] keys, labels
//! no longer than the key view's.

use serde::{Deserialize, Serialize};

use crate::key_view::{MAX_VALUE_LABEL, SHOWN_TOP_KEYS};

/// One key of a keyed limit: what it spent of its own `size` this period.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeySpend {
    pub label: String,
    pub hash: u64,
    pub spent: u64,
    pub size: u64,
    /// The hash of the key its calls carried in the limit's parent budget
    /// ([`crate::budget_tree`]); 0 when it has none or none is known.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub parent: u64,
}

/// A limit's spend as one Envoy (or, added up, the fleet) holds it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpendReport {
    /// Spent this period: an unkeyed limit's, or the sum of its keys'.
    pub spent: u64,
    /// What it allows per period (summed over the Envoys reporting it; a
    /// keyed limit: per key).
    pub size: u64,
    /// Until the period renews (a keyed limit: the soonest of its spending
    /// keys; over Envoys: the soonest); 0 when nothing is spent.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub renews_in_ms: u64,
    /// A keyed limit's top spenders, most first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub keys: Vec<KeySpend>,
    /// A keyed limit: keys that spent anything this period (per Envoy,
    /// added up).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub spending_keys: u64,
    /// The calls it refused last: per key (0: an unkeyed limit's), the
    /// newest, at most [`SHOWN_TOP_KEYS`], newest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub refused: Vec<RefusedCall>,
}

/// The last call a limit (a key of it) refused, and why.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RefusedCall {
    /// When, by the Envoy's clock (ms since the epoch).
    pub at_ms: u64,
    /// The key's hash, as [`KeySpend::hash`]; 0 for an unkeyed limit.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub key: u64,
    /// Why, as `x-sluice-reason` says it (`spent`: what is left did not
    /// hold the call's cost).
    pub reason: String,
    /// Where the limit (its key) stood: spent of size, when its own count
    /// refused.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub spent: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub size: u64,
}

/// The longest reason a refusal names.
pub const MAX_REASON: usize = 32;

/// Adds `new` refusals to `kept`: per key the newest, at most
/// [`SHOWN_TOP_KEYS`], newest first.
pub fn keep_last_refusals(kept: &mut Vec<RefusedCall>, new: &[RefusedCall]) {
    for call in new {
        match kept.iter_mut().find(|k| k.key == call.key) {
            Some(mine) if mine.at_ms >= call.at_ms => {}
            Some(mine) => *mine = call.clone(),
            None => kept.push(call.clone()),
        }
    }
    kept.sort_by(|a, b| b.at_ms.cmp(&a.at_ms).then(a.key.cmp(&b.key)));
    kept.truncate(SHOWN_TOP_KEYS);
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Why a report's spend is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpendError {
    #[error("at most {SHOWN_TOP_KEYS} keys")]
    TooManyKeys,
    #[error("a label is too long")]
    LabelTooLong,
    #[error("at most {SHOWN_TOP_KEYS} refused calls, each reason at most {MAX_REASON} bytes")]
    RefusalsTooMany,
}

impl SpendReport {
    /// Checks the bounds a well-behaved filter never crosses.
    pub fn check(&self) -> Result<(), SpendError> {
        if self.keys.len() > SHOWN_TOP_KEYS {
            return Err(SpendError::TooManyKeys);
        }
        // A value label is cut at MAX_VALUE_LABEL characters, plus "…".
        if self
            .keys
            .iter()
            .any(|k| k.label.len() > MAX_VALUE_LABEL + 3)
        {
            return Err(SpendError::LabelTooLong);
        }
        if self.refused.len() > SHOWN_TOP_KEYS
            || self.refused.iter().any(|r| r.reason.len() > MAX_REASON)
        {
            return Err(SpendError::RefusalsTooMany);
        }
        Ok(())
    }

    /// Adds another Envoy's spend of the same limit; every key is kept
    /// until [`Self::keep_top`], so that no key drops out for having been
    /// second on each Envoy.
    pub fn merge(&mut self, other: &SpendReport) {
        self.spent = self.spent.saturating_add(other.spent);
        self.size = self.size.saturating_add(other.size);
        self.renews_in_ms = match (self.renews_in_ms, other.renews_in_ms) {
            (0, b) => b,
            (a, 0) => a,
            (a, b) => a.min(b),
        };
        self.spending_keys = self.spending_keys.saturating_add(other.spending_keys);
        let mut keys = std::mem::take(&mut self.keys);
        for key in &other.keys {
            match keys.iter_mut().find(|k| k.hash == key.hash) {
                Some(mine) => {
                    mine.spent = mine.spent.saturating_add(key.spent);
                    mine.size = mine.size.saturating_add(key.size);
                    if mine.parent == 0 {
                        mine.parent = key.parent;
                    }
                }
                None => keys.push(key.clone()),
            }
        }
        self.keys = keys;
        keep_last_refusals(&mut self.refused, &other.refused);
    }

    /// Keeps the top spenders only, most first.
    pub fn keep_top(&mut self) {
        self.keys = top_spenders(std::mem::take(&mut self.keys));
    }
}

/// The [`SHOWN_TOP_KEYS`] keys that spent most, most first (ties by label,
/// so that the view does not reorder them from one second to the next).
pub fn top_spenders(mut keys: Vec<KeySpend>) -> Vec<KeySpend> {
    keys.sort_by(|a, b| b.spent.cmp(&a.spent).then_with(|| a.label.cmp(&b.label)));
    keys.truncate(SHOWN_TOP_KEYS);
    keys
}

/// Days in the month a projection speaks of.
pub const PROJECTION_DAYS: u64 = 30;

/// What a month spends at `per_second` (micro-units or tokens a second).
pub fn month_at(per_second: f64) -> f64 {
    if per_second.is_finite() && per_second > 0.0 {
        per_second * (PROJECTION_DAYS * 86_400) as f64
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(label: &str, hash: u64, spent: u64) -> KeySpend {
        KeySpend {
            label: label.into(),
            hash,
            spent,
            size: 100,
            parent: 0,
        }
    }

    fn refused(key: u64, at_ms: u64) -> RefusedCall {
        RefusedCall {
            at_ms,
            key,
            reason: "spent".into(),
            spent: 100,
            size: 100,
        }
    }

    #[test]
    fn envoys_spend_adds_up_per_key() {
        let mut a = SpendReport {
            spent: 30,
            size: 100,
            renews_in_ms: 5_000,
            keys: vec![key("team-a", 1, 20), key("team-b", 2, 10)],
            spending_keys: 2,
            refused: vec![refused(1, 100), refused(2, 300)],
        };
        let b = SpendReport {
            spent: 25,
            size: 100,
            renews_in_ms: 3_000,
            // Only this Envoy saw which company the team's calls carried.
            keys: vec![KeySpend {
                parent: 9,
                ..key("team-b", 2, 25)
            }],
            spending_keys: 1,
            // Team b's later refusal, team a's earlier one, and a new key's.
            refused: vec![refused(2, 400), refused(1, 50), refused(3, 10)],
        };
        a.merge(&b);
        a.keep_top();
        assert_eq!(
            (a.spent, a.size, a.renews_in_ms, a.spending_keys),
            (55, 200, 3_000, 3)
        );
        assert_eq!(
            a.keys,
            vec![
                KeySpend {
                    size: 200,
                    parent: 9,
                    ..key("team-b", 2, 35)
                },
                key("team-a", 1, 20),
            ]
        );
        // Per key the newest refusal, newest first.
        assert_eq!(
            a.refused,
            vec![refused(2, 400), refused(1, 100), refused(3, 10)]
        );
    }

    #[test]
    fn a_month_is_thirty_days_at_the_pace_and_never_negative() {
        assert_eq!(month_at(1.0), 2_592_000.0);
        assert_eq!(month_at(-3.0), 0.0);
        assert_eq!(month_at(f64::NAN), 0.0);
    }

    #[test]
    fn hostile_reports_are_refused() {
        let many = SpendReport {
            keys: (0..21).map(|i| key("k", i, i)).collect(),
            ..SpendReport::default()
        };
        assert_eq!(many.check(), Err(SpendError::TooManyKeys));
        let long = SpendReport {
            keys: vec![key(&"x".repeat(200), 1, 1)],
            ..SpendReport::default()
        };
        assert_eq!(long.check(), Err(SpendError::LabelTooLong));
        let refusals = SpendReport {
            refused: (0..21).map(|i| refused(i, i)).collect(),
            ..SpendReport::default()
        };
        assert_eq!(refusals.check(), Err(SpendError::RefusalsTooMany));
        let wordy = SpendReport {
            refused: vec![RefusedCall {
                reason: "x".repeat(MAX_REASON + 1),
                ..refused(1, 1)
            }],
            ..SpendReport::default()
        };
        assert_eq!(wordy.check(), Err(SpendError::RefusalsTooMany));
        let fine = SpendReport {
            refused: (0..20).map(|i| refused(i, i)).collect(),
            ..SpendReport::default()
        };
        assert_eq!(fine.check(), Ok(()));
    }

    proptest! {
        /// Merging never loses a top spender: whatever the Envoys report,
        /// the merged list is the top of all keys' summed spend.
        #[test]
        fn merging_keeps_the_top_of_the_sums(
            envoys in prop::collection::vec(
                prop::collection::btree_map(0u64..40, 0u64..1_000_000, 0..20), 1..5),
        ) {
            let mut merged = SpendReport::default();
            let mut sums = std::collections::BTreeMap::<u64, u64>::new();
            for envoy in &envoys {
                let report = SpendReport {
                    spent: envoy.values().sum(),
                    size: 1,
                    keys: envoy.iter().map(|(h, s)| key(&format!("k{h:02}"), *h, *s)).collect(),
                    ..SpendReport::default()
                };
                for (h, s) in envoy {
                    *sums.entry(*h).or_default() += s;
                }
                merged.merge(&report);
            }
            merged.keep_top();
            let want = top_spenders(sums.iter().map(|(h, s)| key(&format!("k{h:02}"), *h, *s)).collect());
            let got: Vec<(u64, u64)> = merged.keys.iter().map(|k| (k.hash, k.spent)).collect();
            let want: Vec<(u64, u64)> = want.iter().map(|k| (k.hash, k.spent)).collect();
            prop_assert_eq!(got, want);
            prop_assert!(merged.check().is_ok());
        }
    }
}
