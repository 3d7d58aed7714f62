//! This worker's per-key counts for the live view: for each keyed policy,
//! its busiest keys and which keys it saw since the last flush to the
//! Envoy's report (see [`sluice_shared::key_view`]). Kept only when an admin
//! is there to show them.

use std::collections::BTreeMap;

use sluice_filter_core::matcher::{CompiledPolicy, RequestAtHand};
use sluice_shared::key_hash::KeySecret;
use sluice_shared::key_view::{label_secret, KeyOutcome, KeysReport, WORKER_TOP_KEYS};
use sluice_shared::request_headers::RequestHeaders;
use sluice_shared::time::Instant;

use crate::host::Host;
use crate::report;
use crate::store::Store;

#[derive(Debug, Default)]
pub(super) struct KeyCounts {
    /// What labels are hashed with; None when nobody is told (no admin).
    secret: Option<KeySecret>,
    pending: BTreeMap<String, KeysReport>,
    /// When the oldest pending count was made.
    since: Option<Instant>,
}

impl KeyCounts {
    /// Counts keys for an admin that shares `sync_token`, or (None) stops.
    pub fn configure(&mut self, reporting_with: Option<Option<&str>>) {
        self.secret = reporting_with.map(label_secret);
        if self.secret.is_none() {
            self.pending.clear();
            self.since = None;
        }
    }

    pub fn record<R: RequestHeaders + ?Sized>(
        &mut self,
        policy: &CompiledPolicy,
        request: RequestAtHand<'_, R>,
        outcome: KeyOutcome,
        overflowed: bool,
        now: Instant,
    ) {
        let RequestAtHand { headers: req, body } = request;
        let Some(secret) = &self.secret else {
            return;
        };
        let Some(key) = policy.key_name(req, secret, body) else {
            return;
        };
        self.since.get_or_insert(now);
        // Policy names are few and bounded by the set; the map never grows
        // with keys.
        let keys = match self.pending.get_mut(policy.name()) {
            Some(keys) => keys,
            None => self.pending.entry(policy.name().to_string()).or_default(),
        };
        keys.record(&key, outcome, overflowed, WORKER_TOP_KEYS);
    }

    /// Adds the pending counts to the Envoy's report.
    pub fn flush<H: Host + ?Sized>(&mut self, host: &H, store: &mut Store) {
        let Some(since) = self.since.take() else {
            return;
        };
        let pending = std::mem::take(&mut self.pending);
        // A failure is counted and logged by the store; these counts are
        // then missing from the live view only.
        let _ = report::add_to_keys_report(host, store, since, &pending);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::FakeHost;
    use sluice_filter_core::matcher::{BodyJson, CompiledPolicySet};
    use sluice_shared::Span;

    const KEYED: &str = r#"{"version": 1, "policies": [
        {"name": "llm", "match": {"host": "api.llm.example"},
         "rate": {"requests": 10, "period": "1s"}, "key": {"header": "x-api-key"}},
        {"name": "bank", "match": {"host": "api.bank.example"},
         "rate": {"requests": 10, "period": "1s"}}]}"#;

    #[test]
    fn keyed_requests_are_counted_by_label_and_raw_keys_stay_out() {
        let set = CompiledPolicySet::from_json(KEYED).unwrap();
        let host = FakeHost::at(Instant::EPOCH + Span::from_secs(50));
        let mut store = Store::default();
        let mut counts = KeyCounts::default();
        let llm = &set.policies[0];
        let bank = &set.policies[1];
        let req: &[(&str, &[u8])] = &[("x-api-key", b"sk-secret-1")];
        let request = RequestAtHand {
            headers: req,
            body: &BodyJson::Absent,
        };
        // No admin: nothing is kept.
        counts.record(llm, request, KeyOutcome::Admitted, false, host.now());
        assert!(counts.since.is_none());
        counts.configure(Some(Some("token")));
        for _ in 0..3 {
            counts.record(llm, request, KeyOutcome::Admitted, false, host.now());
        }
        counts.record(llm, request, KeyOutcome::Refused, true, host.now());
        counts.record(bank, request, KeyOutcome::Admitted, false, host.now());
        counts.flush(&host, &mut store);
        let stored = host.shared_get(crate::entries::KEYS_REPORT_KEY).0.unwrap();
        assert!(!String::from_utf8_lossy(&stored).contains("sk-secret"));
        let taken = report::take_keys_report(&host, &mut store, host.now(), |_| true);
        assert_eq!(taken.keys().collect::<Vec<_>>(), ["llm"]);
        let top = &taken["llm"].top.keys;
        assert_eq!((top.len(), top[0].admitted, top[0].refused), (1, 3, 1));
        assert!(!taken["llm"].overflowed.is_empty());
    }
}
