//! Stats, batched per worker: requests only bump local counters, and the
//! tick flushes the deltas to Envoy, so the hot path makes no metric calls.
//!
//! Names: `sluice.policy.<policy>.<stat>` per policy and `sluice.<stat>` for
//! the filter as a whole. Envoy shows them under `wasmcustom.` in `/stats`;
//! the tag extractor in our Envoy configs turns the policy into a label in
//! `/stats/prometheus` (`sluice_policy_admitted{sluice_policy="bank"}`).

use std::collections::BTreeMap;

use rustc_hash::FxHashMap;
use sluice_shared::spend::{keep_last_refusals, RefusedCall};
use sluice_wire::counts::{Counter, Counts, Kind};
pub use sluice_wire::stats::{FilterCounter, LimitCounter, PolicyCounter};

use crate::counters::{DeltaCounters, LimitCounters};
use crate::host::Host;

/// One series of stats of one family (a policy's, a limit's, the
/// filter's): their ids in Envoy and the deltas not sent yet.
#[derive(Debug)]
struct Series<C: Counter> {
    ids: Vec<Option<u32>>,
    pending: Counts<C, i64>,
    /// A policy's deltas kept until they go into the shared sync report
    /// (in the same entry: one lookup per count on the request path).
    unreported: Counts<C, i64>,
}

impl<C: Counter> Default for Series<C> {
    fn default() -> Self {
        Self {
            ids: Vec::new(),
            pending: Counts::default(),
            unreported: Counts::default(),
        }
    }
}

impl<C: Counter> Series<C> {
    /// Defines the family's stats under `prefix` once.
    fn define<H: Host + ?Sized>(&mut self, host: &H, prefix: impl FnOnce() -> String) {
        if !self.ids.is_empty() {
            return;
        }
        let prefix = prefix();
        self.ids = C::ALL
            .iter()
            .map(|c| {
                let name = format!("{prefix}{}", c.name());
                if c.kind() == Kind::Gauge {
                    host.define_gauge(&name)
                } else {
                    host.define_counter(&name)
                }
            })
            .collect();
    }

    /// Sends the pending deltas to the stats they were defined as.
    fn send<H: Host + ?Sized>(&mut self, host: &H) {
        for (c, delta) in self.pending.iter() {
            if delta != 0 {
                if let Some(Some(id)) = self.ids.get(c.index()) {
                    host.increment_metric(*id, delta);
                }
            }
        }
        self.pending = Counts::default();
    }
}

#[derive(Debug, Default)]
pub struct Metrics {
    /// Where each policy's series is in `policies`.
    policy_series: FxHashMap<String, PolicySeries>,
    /// Never shrinks: a series outlives its policy set, as Envoy's stats do.
    policies: Vec<(String, Series<PolicyCounter>)>,
    /// By limit name.
    limits: FxHashMap<String, Series<LimitCounter>>,
    filter: Series<FilterCounter>,
    /// A further limit's deltas, kept until they go into the shared sync
    /// report.
    unreported_limits: BTreeMap<String, LimitCounters>,
    /// The last calls each further limit refused since the last report.
    refused: BTreeMap<String, Vec<RefusedCall>>,
    /// Nothing counted since the last flush, which defined every series:
    /// a worker with a queue ticks each millisecond, mostly with nothing
    /// to send, and walking every series' stats then was 6 % of a queued
    /// run in the simulator.
    flushed: bool,
}

/// Where the filter's own stats are named: `sluice.<stat>`.
const FILTER_PREFIX: &str = "sluice.";
const POLICY_FAMILY: &str = "policy";
const LIMIT_FAMILY: &str = "limit";

/// Where a policy's stats are named: `sluice.policy.<policy>.<stat>`.
fn policy_prefix(policy: &str) -> String {
    format!("{FILTER_PREFIX}{POLICY_FAMILY}.{policy}.")
}

/// Where a further limit's stats are named: `sluice.limit.<limit>.<stat>`.
fn limit_prefix(limit: &str) -> String {
    format!("{FILTER_PREFIX}{LIMIT_FAMILY}.{limit}.")
}

/// Which family a stat's full name is of, for a host that must declare
/// its stats before the names of policies are known (Envoy's dynamic
/// modules freeze their stats once the filter is configured): a family's
/// stat is then one stat per [`family_stats`] entry, labelled by the
/// policy or limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatFamily<'a> {
    /// `sluice.<family>.<owner>.<stat>`.
    Labelled {
        family: &'static str,
        owner: &'a str,
        stat: &'a str,
    },
    /// One of the filter's own stats ([`filter_stats`]).
    Filter,
}

impl<'a> StatFamily<'a> {
    pub fn of(name: &'a str) -> Option<Self> {
        let rest = name.strip_prefix(FILTER_PREFIX)?;
        for family in [POLICY_FAMILY, LIMIT_FAMILY] {
            if let Some((owner, stat)) = rest
                .strip_prefix(family)
                .and_then(|r| r.strip_prefix('.'))
                .and_then(|r| r.rsplit_once('.'))
            {
                return Some(Self::Labelled {
                    family,
                    owner,
                    stat,
                });
            }
        }
        Some(Self::Filter)
    }
}

/// Every stat of the policy and limit families: (family, stat, whether a
/// gauge).
pub fn family_stats() -> impl Iterator<Item = (&'static str, &'static str, bool)> {
    let policies = PolicyCounter::ALL
        .iter()
        .map(|c| (POLICY_FAMILY, c.name(), c.kind() == Kind::Gauge));
    let limits = LimitCounter::ALL
        .iter()
        .map(|c| (LIMIT_FAMILY, c.name(), c.kind() == Kind::Gauge));
    policies.chain(limits)
}

/// The filter's own stats: each full name, and whether it is a gauge.
pub fn filter_stats() -> impl Iterator<Item = (String, bool)> {
    FilterCounter::ALL.iter().map(|c| {
        (
            format!("{FILTER_PREFIX}{}", c.name()),
            c.kind() == Kind::Gauge,
        )
    })
}

/// A policy's series, found once per policy set: a request then counts
/// by an index rather than by hashing its policy's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PolicySeries(usize);

impl Metrics {
    pub fn add(&mut self, policy: &str, stat: PolicyCounter, delta: i64) {
        let series = self.series_of(policy);
        self.add_to(series, stat, delta);
    }

    /// The series of `policy`, started if it has none yet.
    pub fn series_of(&mut self, policy: &str) -> PolicySeries {
        if let Some(series) = self.policy_series.get(policy) {
            return *series;
        }
        let series = PolicySeries(self.policies.len());
        self.policies.push((policy.to_string(), Series::default()));
        // Defined at the next flush.
        self.flushed = false;
        self.policy_series.insert(policy.to_string(), series);
        series
    }

    pub fn add_to(&mut self, series: PolicySeries, stat: PolicyCounter, delta: i64) {
        let Some((_, series)) = self.policies.get_mut(series.0) else {
            return;
        };
        if stat.kind().is_reported() {
            series.unreported.add(stat, delta);
        }
        series.pending.add(stat, delta);
        self.flushed &= delta == 0;
    }

    pub fn add_limit(&mut self, limit: &str, stat: LimitCounter, delta: i64) {
        let reported = stat.kind().is_reported();
        let provider = stat.provider();
        if reported || provider.is_some() {
            let unreported = match self.unreported_limits.get_mut(limit) {
                Some(d) => d,
                None => self.unreported_limits.entry(limit.to_string()).or_default(),
            };
            let delta = u64::try_from(delta).unwrap_or(0);
            match provider {
                Some(counter) => unreported.provider.add(counter, delta),
                None => unreported.counts.add(stat, delta),
            }
        }
        let series = match self.limits.get_mut(limit) {
            Some(s) => s,
            None => {
                // Defined at the next flush.
                self.flushed = false;
                self.limits.entry(limit.to_string()).or_default()
            }
        };
        series.pending.add(stat, delta);
        self.flushed &= delta == 0;
    }

    pub fn add_filter(&mut self, stat: FilterCounter, delta: i64) {
        self.filter.pending.add(stat, delta);
        self.flushed &= delta == 0;
    }

    /// Defines a policy's stats up front, so they show (at 0) before the
    /// first request.
    pub fn define_policy<H: Host + ?Sized>(&mut self, host: &H, policy: &str) -> PolicySeries {
        let id = self.series_of(policy);
        if let Some((_, series)) = self.policies.get_mut(id.0) {
            series.define(host, || policy_prefix(policy));
        }
        id
    }

    /// Sends every pending delta to Envoy.
    pub fn flush<H: Host + ?Sized>(&mut self, host: &H) {
        if self.flushed {
            return;
        }
        self.flushed = true;
        for (policy, series) in &mut self.policies {
            series.define(host, || policy_prefix(policy));
            series.send(host);
        }
        for (limit, series) in &mut self.limits {
            series.define(host, || limit_prefix(limit));
            series.send(host);
        }
        self.filter.define(host, || FILTER_PREFIX.to_string());
        self.filter.send(host);
    }

    /// Notes the call `limit` refused (per key the newest is kept).
    pub fn note_refused(&mut self, limit: &str, call: RefusedCall) {
        let calls = match self.refused.get_mut(limit) {
            Some(calls) => calls,
            None => self.refused.entry(limit.to_string()).or_default(),
        };
        keep_last_refusals(calls, std::slice::from_ref(&call));
    }

    /// The refusals noted since the last call.
    pub fn take_refused(&mut self) -> BTreeMap<String, Vec<RefusedCall>> {
        std::mem::take(&mut self.refused)
    }

    /// The further limits' deltas since the last call.
    pub fn take_unreported_limits(&mut self) -> BTreeMap<String, LimitCounters> {
        std::mem::take(&mut self.unreported_limits)
    }

    /// The deltas since the last call, for the shared sync report.
    pub fn take_unreported(&mut self) -> BTreeMap<String, DeltaCounters> {
        self.policies
            .iter_mut()
            .map(|(name, series)| (&*name, std::mem::take(&mut series.unreported)))
            .filter(|(_, d)| !d.is_zero())
            .map(|(name, d)| (name.clone(), d))
            .collect()
    }

    /// A pending filter-wide delta, for tests.
    pub fn pending_filter(&self, stat: FilterCounter) -> i64 {
        self.filter.pending[stat]
    }

    /// A pending delta, for tests.
    pub fn pending(&self, policy: &str, stat: PolicyCounter) -> i64 {
        self.policy_series
            .get(policy)
            .and_then(|id| self.policies.get(id.0))
            .map_or(0, |(_, s)| s.pending[stat])
    }
}

#[cfg(test)]
mod family_tests {
    use super::*;

    #[test]
    fn every_stat_name_falls_in_one_family() {
        assert_eq!(
            StatFamily::of("sluice.policy.bank.v2.admitted"),
            Some(StatFamily::Labelled {
                family: "policy",
                owner: "bank.v2",
                stat: "admitted"
            })
        );
        assert_eq!(
            StatFamily::of("sluice.limit.tpm.refused"),
            Some(StatFamily::Labelled {
                family: "limit",
                owner: "tpm",
                stat: "refused"
            })
        );
        assert_eq!(
            StatFamily::of("sluice.store_conflicts"),
            Some(StatFamily::Filter)
        );
        // A policy named like a family is still a policy.
        assert_eq!(
            StatFamily::of("sluice.policy.limit.x"),
            Some(StatFamily::Labelled {
                family: "policy",
                owner: "limit",
                stat: "x"
            })
        );
        assert_eq!(StatFamily::of("other.x"), None);
        assert!(filter_stats().all(|(name, _)| StatFamily::of(&name) == Some(StatFamily::Filter)));
    }
}

#[cfg(test)]
mod flush_tests {
    use super::*;
    use crate::testing::FakeHost;
    use sluice_shared::time::Instant;

    /// A flush with nothing counted since the last skips the series (and
    /// makes no host call); a count, a new policy's series or a new
    /// limit's after it still reaches Envoy at the next flush.
    #[test]
    fn what_is_counted_after_a_quiet_flush_is_still_sent() {
        let host = FakeHost::at(Instant::from_millis(1_000));
        let mut metrics = Metrics::default();
        metrics.flush(&host);
        let defined = host.host_calls_made();
        assert!(defined > 0, "the first flush defines the filter's stats");
        metrics.add_filter(FilterCounter::CasRetries, 0);
        metrics.flush(&host);
        assert_eq!(host.host_calls_made(), defined, "nothing new: no host call");

        metrics.add("bank", PolicyCounter::Admitted, 2);
        metrics.flush(&host);
        assert_eq!(host.metric("sluice.policy.bank.admitted"), 2);
        let defines = || host.host_calls_of("define_counter");
        let before = defines();
        let series = metrics.series_of("fx");
        metrics.flush(&host);
        assert!(
            defines() > before,
            "a new policy's series, defined at the next flush"
        );
        let before = host.host_calls_made();
        metrics.flush(&host);
        assert_eq!(host.host_calls_made(), before);
        metrics.add_to(series, PolicyCounter::Admitted, 1);
        metrics.flush(&host);
        assert_eq!(host.metric("sluice.policy.fx.admitted"), 1);
        let before = defines();
        metrics.add_limit("rpm", LimitCounter::Admitted, 0);
        metrics.flush(&host);
        assert!(
            defines() > before,
            "a new limit's series, defined at the next flush"
        );
    }
}
