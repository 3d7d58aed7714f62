//! Stats, batched per worker: requests only bump local counters, and the
//! tick flushes the deltas to Envoy, so the hot path makes no metric calls.
//!
//! Names: `sluice.policy.<policy>.<stat>` per policy and `sluice.<stat>` for
//! the filter as a whole. Envoy shows them under `wasmcustom.` in `/stats`;
//! the tag extractor in our Envoy configs turns the policy into a label in
//! `/stats/prometheus` (`sluice_policy_admitted{sluice_policy="bank"}`).

use std::collections::BTreeMap;

use rustc_hash::FxHashMap;

use crate::counters::{DeltaCounters, LimitCounters};
use crate::host::Host;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PolicyStat {
    Admitted,
    Rejected,
    Queued,
    QueueTimeouts,
    QueueAbandoned,
    ShadowLimited,
    InFlight,
    LeasesExpired,
    KeyEvictions,
    KeyOverflow,
    /// Calls matched by their host alone: the policy names a port the
    /// request did not carry (Envoy may strip ports before filters run).
    PortHidden,
}

impl PolicyStat {
    const ALL: [PolicyStat; 11] = [
        PolicyStat::Admitted,
        PolicyStat::Rejected,
        PolicyStat::Queued,
        PolicyStat::QueueTimeouts,
        PolicyStat::QueueAbandoned,
        PolicyStat::ShadowLimited,
        PolicyStat::InFlight,
        PolicyStat::LeasesExpired,
        PolicyStat::KeyEvictions,
        PolicyStat::KeyOverflow,
        PolicyStat::PortHidden,
    ];

    fn name(self) -> &'static str {
        match self {
            PolicyStat::Admitted => "admitted",
            PolicyStat::Rejected => "rejected",
            PolicyStat::Queued => "queued",
            PolicyStat::QueueTimeouts => "queue_timeouts",
            PolicyStat::QueueAbandoned => "queue_abandoned",
            PolicyStat::ShadowLimited => "shadow_limited",
            PolicyStat::InFlight => "in_flight",
            PolicyStat::LeasesExpired => "leases_expired",
            PolicyStat::KeyEvictions => "key_evictions",
            PolicyStat::KeyOverflow => "key_overflow",
            PolicyStat::PortHidden => "port_hidden",
        }
    }

    fn is_gauge(self) -> bool {
        self == PolicyStat::InFlight
    }

    /// Its place in `ALL`, which lists the variants in declaration order
    /// (a test checks it): a count per request looks it up.
    fn index(self) -> usize {
        self as usize
    }
}

/// Stats of a further limit (`limits`), over every policy naming it:
/// `sluice.limit.<limit>.<stat>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LimitStat {
    /// Calls this limit let through (every limit of the policy did).
    Admitted,
    /// Calls this limit refused first.
    Refused,
    /// Calls that queued (queue mode) because this limit had no room yet.
    Queued,
    /// Tokens the admitted calls took from it (with `usage`: what each
    /// was charged in the end, counted when its response ended).
    Tokens,
    /// Responses whose usage was read and reconciled with the estimate.
    UsageRead,
    /// Responses larger than `max_body_bytes`, or beyond what the worker
    /// holds of all responses at once: charged the unread charge.
    UsageTooLarge,
    /// Responses whose usage was not a whole number (not JSON, a bad
    /// header): charged the unread charge.
    UsageMalformed,
    /// Calls that ended before their response did (aborted, reset):
    /// charged the unread charge.
    UsageAborted,
    /// Responses that carried no usage (an OpenAI stream that did not
    /// ask for it, a missing header or path): charged the unread charge.
    UsageMissing,
    /// Calls refused because this budget's spending before a restart is
    /// not known yet (the admin has not answered since).
    BudgetUnknown,
    /// Answers the provider refused with a status in `pause_on`.
    ProviderRefused,
    /// Pauses this worker began on the provider's `Retry-After`.
    Paused,
    /// Of those, pauses cut to `max_pause` (the provider asked for more).
    PauseCapped,
    /// Provider signals that did not parse: ignored.
    SignalMalformed,
    /// Answers whose count of what is left was read and followed.
    CountRead,
    /// Cuts of an adaptive limit's rate on the provider's refusals.
    RateCut,
}

impl LimitStat {
    const ALL: [LimitStat; 16] = [
        LimitStat::Admitted,
        LimitStat::Refused,
        LimitStat::Queued,
        LimitStat::Tokens,
        LimitStat::UsageRead,
        LimitStat::UsageTooLarge,
        LimitStat::UsageMalformed,
        LimitStat::UsageAborted,
        LimitStat::UsageMissing,
        LimitStat::BudgetUnknown,
        LimitStat::ProviderRefused,
        LimitStat::Paused,
        LimitStat::PauseCapped,
        LimitStat::SignalMalformed,
        LimitStat::CountRead,
        LimitStat::RateCut,
    ];

    fn name(self) -> &'static str {
        match self {
            LimitStat::Admitted => "admitted",
            LimitStat::Refused => "refused",
            LimitStat::Queued => "queued",
            LimitStat::Tokens => "tokens",
            LimitStat::UsageRead => "usage_read",
            LimitStat::UsageTooLarge => "usage_too_large",
            LimitStat::UsageMalformed => "usage_malformed",
            LimitStat::UsageAborted => "usage_aborted",
            LimitStat::UsageMissing => "usage_missing",
            LimitStat::BudgetUnknown => "budget_unknown",
            LimitStat::ProviderRefused => "provider_refused",
            LimitStat::Paused => "paused",
            LimitStat::PauseCapped => "pause_capped",
            LimitStat::SignalMalformed => "signal_malformed",
            LimitStat::CountRead => "count_read",
            LimitStat::RateCut => "rate_cut",
        }
    }

    /// Its place in `ALL`, which lists the variants in declaration order
    /// (a test checks it): a count per request looks it up.
    fn index(self) -> usize {
        self as usize
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FilterStat {
    CasRetries,
    CasExhausted,
    StateDecodeErrors,
    HostErrors,
    SyncOk,
    SyncFailures,
    SyncStale,
    PolicySetsInstalled,
    /// Requests whose body was too large to read an estimate from.
    RequestBodyTooLarge,
    /// Admin answers whose budgets header was not one (too large, not
    /// JSON): budgets stayed unknown.
    BudgetsMalformed,
    /// Admin answers whose provider news header was not one: nothing
    /// relayed was taken from it.
    ProviderNewsMalformed,
    /// Policy sets the admin pushed (answers to the watch call).
    PushSets,
    /// Watch calls that failed (the admin away, a timeout, a bad answer).
    PushFailures,
    /// Answers not read for their usage because the worker held its most
    /// of response bodies already (charged the unread charge).
    UsageBufferFull,
}

impl FilterStat {
    const ALL: [FilterStat; 14] = [
        FilterStat::CasRetries,
        FilterStat::CasExhausted,
        FilterStat::StateDecodeErrors,
        FilterStat::HostErrors,
        FilterStat::SyncOk,
        FilterStat::SyncFailures,
        FilterStat::SyncStale,
        FilterStat::PolicySetsInstalled,
        FilterStat::RequestBodyTooLarge,
        FilterStat::BudgetsMalformed,
        FilterStat::ProviderNewsMalformed,
        FilterStat::PushSets,
        FilterStat::PushFailures,
        FilterStat::UsageBufferFull,
    ];

    pub fn name(self) -> &'static str {
        match self {
            FilterStat::CasRetries => "cas_retries",
            FilterStat::CasExhausted => "cas_exhausted",
            FilterStat::StateDecodeErrors => "state_decode_errors",
            FilterStat::HostErrors => "host_errors",
            FilterStat::SyncOk => "sync_ok",
            FilterStat::SyncFailures => "sync_failures",
            FilterStat::SyncStale => "sync_stale",
            FilterStat::PolicySetsInstalled => "policy_sets_installed",
            FilterStat::RequestBodyTooLarge => "request_body_too_large",
            FilterStat::BudgetsMalformed => "budgets_malformed",
            FilterStat::ProviderNewsMalformed => "provider_news_malformed",
            FilterStat::PushSets => "push_sets",
            FilterStat::PushFailures => "push_failures",
            FilterStat::UsageBufferFull => "usage_buffer_full",
        }
    }

    /// Its place in `ALL`, which lists the variants in declaration order
    /// (a test checks it): a count per request looks it up.
    fn index(self) -> usize {
        self as usize
    }
}

#[derive(Debug, Default)]
struct Series {
    ids: Vec<Option<u32>>,
    pending: Vec<i64>,
    /// A policy's deltas kept until they go into the shared sync report
    /// (in the same entry: one lookup per count on the request path).
    unreported: DeltaCounters,
}

impl Series {
    /// Sends the pending deltas to the stats they were defined as.
    fn send<H: Host + ?Sized>(&mut self, host: &H) {
        for (i, delta) in self.pending.iter_mut().enumerate() {
            if *delta != 0 {
                if let Some(Some(id)) = self.ids.get(i) {
                    host.increment_metric(*id, *delta);
                }
                *delta = 0;
            }
        }
    }
}

#[derive(Debug, Default)]
pub struct Metrics {
    /// Where each policy's series is in `policies`.
    policy_series: FxHashMap<String, PolicySeries>,
    /// Never shrinks: a series outlives its policy set, as Envoy's stats do.
    policies: Vec<(String, Series)>,
    /// By limit name.
    limits: FxHashMap<String, Series>,
    filter: Series,
    /// A further limit's deltas, kept until they go into the shared sync
    /// report.
    unreported_limits: BTreeMap<String, LimitCounters>,
}

/// A policy's series, found once per policy set: a request then counts
/// by an index rather than by hashing its policy's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PolicySeries(usize);

impl Metrics {
    pub fn add(&mut self, policy: &str, stat: PolicyStat, delta: i64) {
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
        self.policy_series.insert(policy.to_string(), series);
        series
    }

    pub fn add_to(&mut self, series: PolicySeries, stat: PolicyStat, delta: i64) {
        let Some((_, series)) = self.policies.get_mut(series.0) else {
            return;
        };
        let unreported = &mut series.unreported;
        match stat {
            PolicyStat::Admitted => unreported.admitted += delta,
            PolicyStat::Rejected => unreported.rejected += delta,
            PolicyStat::Queued => unreported.queued += delta,
            PolicyStat::QueueTimeouts => unreported.queue_timeouts += delta,
            PolicyStat::ShadowLimited => unreported.shadow_limited += delta,
            PolicyStat::InFlight => unreported.in_flight += delta,
            PolicyStat::PortHidden => unreported.port_hidden += delta,
            _ => {}
        }
        if series.pending.is_empty() {
            series.pending = vec![0; PolicyStat::ALL.len()];
        }
        series.pending[stat.index()] += delta;
    }

    pub fn add_limit(&mut self, limit: &str, stat: LimitStat, delta: i64) {
        if matches!(
            stat,
            LimitStat::Admitted
                | LimitStat::Refused
                | LimitStat::Tokens
                | LimitStat::ProviderRefused
                | LimitStat::Paused
                | LimitStat::RateCut
        ) {
            let unreported = match self.unreported_limits.get_mut(limit) {
                Some(d) => d,
                None => self.unreported_limits.entry(limit.to_string()).or_default(),
            };
            let delta = u64::try_from(delta).unwrap_or(0);
            match stat {
                LimitStat::Admitted => unreported.admitted += delta,
                LimitStat::Refused => unreported.refused += delta,
                LimitStat::ProviderRefused => unreported.provider_refused += delta,
                LimitStat::Paused => unreported.pauses += delta,
                LimitStat::RateCut => unreported.rate_cuts += delta,
                _ => unreported.tokens += delta,
            }
        }
        let series = match self.limits.get_mut(limit) {
            Some(s) => s,
            None => self.limits.entry(limit.to_string()).or_default(),
        };
        if series.pending.is_empty() {
            series.pending = vec![0; LimitStat::ALL.len()];
        }
        series.pending[stat.index()] += delta;
    }

    pub fn add_filter(&mut self, stat: FilterStat, delta: i64) {
        if self.filter.pending.is_empty() {
            self.filter.pending = vec![0; FilterStat::ALL.len()];
        }
        self.filter.pending[stat.index()] += delta;
    }

    /// Defines a policy's stats up front, so they show (at 0) before the
    /// first request.
    pub fn define_policy<H: Host + ?Sized>(&mut self, host: &H, policy: &str) -> PolicySeries {
        let id = self.series_of(policy);
        let Some((_, series)) = self.policies.get_mut(id.0) else {
            return id;
        };
        if series.ids.is_empty() {
            series.ids = PolicyStat::ALL
                .iter()
                .map(|s| {
                    let name = format!("sluice.policy.{policy}.{}", s.name());
                    if s.is_gauge() {
                        host.define_gauge(&name)
                    } else {
                        host.define_counter(&name)
                    }
                })
                .collect();
        }
        if series.pending.is_empty() {
            series.pending = vec![0; PolicyStat::ALL.len()];
        }
        id
    }

    /// Sends every pending delta to Envoy.
    pub fn flush<H: Host + ?Sized>(&mut self, host: &H) {
        let undefined: Vec<String> = self
            .policies
            .iter()
            .filter(|(_, series)| series.ids.is_empty())
            .map(|(name, _)| name.clone())
            .collect();
        for policy in undefined {
            self.define_policy(host, &policy);
        }
        for (_, series) in &mut self.policies {
            series.send(host);
        }
        for (limit, series) in &mut self.limits {
            if series.ids.is_empty() {
                series.ids = LimitStat::ALL
                    .iter()
                    .map(|s| host.define_counter(&format!("sluice.limit.{limit}.{}", s.name())))
                    .collect();
            }
            series.send(host);
        }
        if self.filter.ids.is_empty() {
            self.filter.ids = FilterStat::ALL
                .iter()
                .map(|s| host.define_counter(&format!("sluice.{}", s.name())))
                .collect();
            self.filter.pending.resize(FilterStat::ALL.len(), 0);
        }
        self.filter.send(host);
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
    pub fn pending_filter(&self, stat: FilterStat) -> i64 {
        self.filter.pending.get(stat.index()).copied().unwrap_or(0)
    }

    /// A pending delta, for tests.
    pub fn pending(&self, policy: &str, stat: PolicyStat) -> i64 {
        self.policy_series
            .get(policy)
            .and_then(|id| self.policies.get(id.0))
            .and_then(|(_, s)| s.pending.get(stat.index()).copied())
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_stat_indexes_its_place_in_all() {
        for (i, stat) in PolicyStat::ALL.iter().enumerate() {
            assert_eq!(stat.index(), i, "{stat:?}");
        }
        for (i, stat) in LimitStat::ALL.iter().enumerate() {
            assert_eq!(stat.index(), i, "{stat:?}");
        }
        for (i, stat) in FilterStat::ALL.iter().enumerate() {
            assert_eq!(stat.index(), i, "{stat:?}");
        }
    }
}
