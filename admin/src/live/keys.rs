//! The live view's keys: each keyed policy's calls per key from the
//! spans the Envoys report ([`KeyRates`]), and the keys each has seen
//! ([`SeenKeys`]).

use super::*;

/// One Envoy's keys of one policy, a second.
#[derive(Debug, Clone, Default)]
pub(super) struct KeyRates {
    pub(super) top: Vec<KeyUse>,
    pub(super) calls_per_s: f64,
}

/// One report's key counts, over the span `since_ms..at_ms` of the Envoy's
/// clock.
#[derive(Debug, Clone)]
pub(super) struct KeySpan {
    pub(super) since_ms: u64,
    pub(super) at_ms: u64,
    pub(super) top: TopKeys,
}

impl KeyRates {
    /// Rates over the recent spans together: at least a second of them
    /// when there is, as for the policies' rates, so that a key calling a
    /// few times a second does not flicker between 0 and 8 at a 250 ms
    /// sync interval.
    pub(super) fn of(spans: &VecDeque<KeySpan>) -> Option<Self> {
        let first = spans.front()?;
        let last = spans.back()?;
        // A span of nothing (or a clock gone back) gives no rate.
        let ms = last
            .at_ms
            .checked_sub(first.since_ms)
            .filter(|&ms| ms > 0)?;
        let seconds = Span::from_millis(ms).as_secs_f64();
        let mut summed: HashMap<&str, KeyUse> = HashMap::new();
        let mut calls = 0u64;
        for span in spans {
            calls = calls.saturating_add(span.top.total);
            for k in &span.top.keys {
                let sum = summed.entry(&k.label).or_insert_with(|| KeyUse {
                    label: k.label.clone(),
                    ..KeyUse::default()
                });
                sum.admitted_per_s += k.admitted as f64;
                sum.queued_per_s += k.queued as f64;
                sum.refused_per_s += k.refused as f64;
                sum.uncertain_per_s += k.error as f64;
            }
        }
        let top = summed
            .into_values()
            .map(|k| KeyUse {
                admitted_per_s: k.admitted_per_s / seconds,
                queued_per_s: k.queued_per_s / seconds,
                refused_per_s: k.refused_per_s / seconds,
                uncertain_per_s: k.uncertain_per_s / seconds,
                label: k.label,
            })
            .collect();
        Some(KeyRates {
            top,
            calls_per_s: calls as f64 / seconds,
        })
    }
}

/// Adds a report's key counts to an Envoy's recent spans of one policy,
/// keeping about a second of them. A span that does not begin where the
/// last ended (a report lost on the way) starts them over, since the
/// calls of the gap are missing.
pub(super) fn add_span(spans: &mut VecDeque<KeySpan>, report: &KeysReport, at_ms: u64) {
    if spans
        .back()
        .is_some_and(|last| last.at_ms != report.since_ms)
    {
        spans.clear();
    }
    spans.push_back(KeySpan {
        since_ms: report.since_ms,
        at_ms,
        top: report.top.clone(),
    });
    while spans.len() > KEPT_SAMPLES
        || spans
            .get(1)
            .is_some_and(|next| at_ms.saturating_sub(next.since_ms) >= RATE_WINDOW_MS)
    {
        spans.pop_front();
    }
}

/// Which keys of a policy the Envoys saw, per second of the admin's clock
/// over the last [`KEYS_ACTIVE_FOR_MS`]: distinct keys are counted over
/// every Envoy, a key busy on two counting once.
#[derive(Debug, Default)]
pub(super) struct SeenKeys {
    /// (second, keys seen, keys overflowed), oldest first.
    pub(super) seconds: VecDeque<(u64, KeyBitmap, KeyBitmap)>,
}

impl SeenKeys {
    pub(super) fn add(&mut self, now_ms: u64, report: &KeysReport) {
        let second = now_ms / 1000;
        match self.seconds.back_mut() {
            Some((s, seen, overflowed)) if *s == second => {
                seen.union(&report.seen);
                overflowed.union(&report.overflowed);
            }
            _ => self
                .seconds
                .push_back((second, report.seen.clone(), report.overflowed.clone())),
        }
        self.forget_before(now_ms);
    }

    pub(super) fn forget_before(&mut self, now_ms: u64) {
        let oldest = now_ms.saturating_sub(KEYS_ACTIVE_FOR_MS) / 1000;
        while self.seconds.front().is_some_and(|(s, _, _)| *s < oldest) {
            self.seconds.pop_front();
        }
    }

    pub(super) fn union(&self) -> (KeyBitmap, KeyBitmap) {
        let (mut seen, mut overflowed) = (KeyBitmap::default(), KeyBitmap::default());
        for (_, s, o) in &self.seconds {
            seen.union(s);
            overflowed.union(o);
        }
        (seen, overflowed)
    }
}
