//! The admin's own Prometheus metrics (`GET /metrics`), plus the live
//! per-policy figures the Envoys report, so one scrape of the admin sees
//! the whole fleet.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use sluice_api::LiveFrame;
use sluice_wire::counts::{self, Kind, LiveCounts};
use sluice_wire::stats::{LimitCounter, PolicyCounter, ProviderCounter};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    pub result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActionLabel {
    pub action: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PolicyLabel {
    pub policy: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LimitLabel {
    pub limit: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct InstanceLabel {
    pub instance: String,
}

type FloatGauges<L> = Family<L, Gauge<f64, AtomicU64>>;

/// One gauge family per reported counter of family `C`, named
/// `<prefix>_<name>_per_second` for a rate and `<prefix>_<name>` for a
/// total or a gauge, its help the counter's meaning: a counter added to
/// its family shows here by itself.
struct CounterGauges<C, L> {
    families: Vec<(C, FloatGauges<L>)>,
}

impl<C, L> CounterGauges<C, L>
where
    C: counts::Counter,
    L: Clone + std::hash::Hash + Eq + EncodeLabelSet + std::fmt::Debug + Send + Sync + 'static,
{
    fn register(registry: &mut Registry, prefix: &str, whose: &str) -> Self {
        let families = C::ALL
            .iter()
            .filter(|c| c.kind().is_reported())
            .map(|&c| {
                let family = FloatGauges::<L>::default();
                let meaning = c.meaning().trim_end_matches('.');
                let (name, help) = match c.kind() {
                    Kind::Rate => (
                        format!("{prefix}_{}_per_second", c.name()),
                        format!("{whose}{meaning}, per second, all Envoys"),
                    ),
                    Kind::Total => (
                        format!("{prefix}_{}", c.name()),
                        format!("{whose}{meaning}, since the Envoys started, all Envoys"),
                    ),
                    _ => (
                        format!("{prefix}_{}", c.name()),
                        format!("{whose}{meaning}, all Envoys"),
                    ),
                };
                registry.register(name, help, family.clone());
                (c, family)
            })
            .collect();
        Self { families }
    }

    fn clear(&self) {
        for (_, family) in &self.families {
            family.clear();
        }
    }

    fn set(&self, label: &L, live: &LiveCounts<C>) {
        for (c, value) in live.shown() {
            if let Some((_, family)) = self.families.iter().find(|(f, _)| *f == c) {
                family.get_or_create(label).set(value);
            }
        }
    }
}

pub struct Metrics {
    registry: Registry,
    pub sync_requests: Family<ResultLabel, Counter>,
    pub policy_writes: Family<ActionLabel, Counter>,
    pub login_failures: Counter,
    pub login_throttled: Counter,
    pub password_checks: Counter,
    pub policy_set_version: Gauge,
    /// 1 while the managed directory's last change was refused.
    pub managed_error: Gauge,
    pub live_instances: Gauge,
    /// Stock Envoys' RLQS streams open now.
    pub rlqs_streams: Gauge,
    /// Each reported policy counter, as the live view shows it.
    policy_counts: CounterGauges<PolicyCounter, PolicyLabel>,
    pub max_in_flight: Family<PolicyLabel, Gauge>,
    pub waiting: Family<PolicyLabel, Gauge>,
    pub tokens_left: Family<PolicyLabel, Gauge>,
    /// The policy's rate, per second, per Envoy (from the policy set).
    pub rate_limit_per_s: FloatGauges<PolicyLabel>,
    /// The policy's queue bound (`max_wait`), seconds.
    pub max_wait_seconds: FloatGauges<PolicyLabel>,
    limit_counts: CounterGauges<LimitCounter, LimitLabel>,
    limit_provider_counts: CounterGauges<ProviderCounter, LimitLabel>,
    /// A further limit's size per second (each Envoy's); a concurrency
    /// limit's in-flight bound.
    pub limit_size_per_s: FloatGauges<LimitLabel>,
    pub limit_available: Family<LimitLabel, Gauge>,
    pub instance_last_sync_age: FloatGauges<InstanceLabel>,
    pub instance_sync_failures: Family<InstanceLabel, Gauge>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("sluice_admin");
        let policy_counts = CounterGauges::register(&mut registry, "policy", "");
        let limit_counts = CounterGauges::register(&mut registry, "limit", "");
        let limit_provider_counts =
            CounterGauges::register(&mut registry, "limit_provider", "the provider: ");
        let m = Self {
            registry: Registry::default(),
            sync_requests: Family::default(),
            policy_writes: Family::default(),
            login_failures: Counter::default(),
            login_throttled: Counter::default(),
            password_checks: Counter::default(),
            policy_set_version: Gauge::default(),
            managed_error: Gauge::default(),
            live_instances: Gauge::default(),
            rlqs_streams: Gauge::default(),
            policy_counts,
            max_in_flight: Family::default(),
            waiting: Family::default(),
            tokens_left: Family::default(),
            rate_limit_per_s: Family::default(),
            max_wait_seconds: Family::default(),
            limit_counts,
            limit_provider_counts,
            limit_size_per_s: Family::default(),
            limit_available: Family::default(),
            instance_last_sync_age: Family::default(),
            instance_sync_failures: Family::default(),
        };
        registry.register(
            "sync_requests",
            "Sync requests from filters, by result",
            m.sync_requests.clone(),
        );
        registry.register(
            "policy_writes",
            "Policy writes, by action",
            m.policy_writes.clone(),
        );
        registry.register("login_failures", "Failed logins", m.login_failures.clone());
        registry.register(
            "login_throttled",
            "Logins refused unchecked: too many recent failures, or too many checks queued",
            m.login_throttled.clone(),
        );
        registry.register(
            "password_checks",
            "Passwords checked (argon2 runs)",
            m.password_checks.clone(),
        );
        registry.register(
            "policy_set_version",
            "Current policy set version",
            m.policy_set_version.clone(),
        );
        registry.register(
            "managed_error",
            "1 while the managed directory's last change was refused (the last good set stays)",
            m.managed_error.clone(),
        );
        registry.register(
            "live_instances",
            "Envoys that synced in the last 5 s",
            m.live_instances.clone(),
        );
        registry.register(
            "rlqs_streams",
            "Stock Envoys' RLQS streams (rate_limit_quota) open now",
            m.rlqs_streams.clone(),
        );
        let families: [(&str, &str, &FloatGauges<PolicyLabel>); 2] = [
            (
                "policy_rate_limit_per_second",
                "The policy's rate per Envoy, requests per second (from the policy set)",
                &m.rate_limit_per_s,
            ),
            (
                "policy_max_wait_seconds",
                "The policy's queue bound, max_wait, in seconds",
                &m.max_wait_seconds,
            ),
        ];
        for (name, help, family) in families {
            registry.register(name, help, family.clone());
        }
        registry.register(
            "policy_max_in_flight",
            "The concurrency limit, summed over Envoys",
            m.max_in_flight.clone(),
        );
        registry.register(
            "policy_waiting",
            "Requests waiting in the queue now, all Envoys",
            m.waiting.clone(),
        );
        registry.register(
            "policy_tokens_left",
            "Rate tokens left now, summed over Envoys",
            m.tokens_left.clone(),
        );
        registry.register(
            "limit_size_per_second",
            "A further limit's size per second per Envoy (a concurrency limit: its bound)",
            m.limit_size_per_s.clone(),
        );
        registry.register(
            "limit_available",
            "Tokens a further limit holds now, summed over Envoys",
            m.limit_available.clone(),
        );
        registry.register(
            "instance_last_sync_age_seconds",
            "Seconds since each Envoy's last sync",
            m.instance_last_sync_age.clone(),
        );
        registry.register(
            "instance_sync_failures",
            "Each Envoy's failed syncs, as its filter counts them",
            m.instance_sync_failures.clone(),
        );
        Self { registry, ..m }
    }
}

impl Metrics {
    pub fn result(&self, result: &str) {
        self.sync_requests
            .get_or_create(&ResultLabel {
                result: result.into(),
            })
            .inc();
    }

    pub fn write(&self, action: &str) {
        self.policy_writes
            .get_or_create(&ActionLabel {
                action: action.into(),
            })
            .inc();
    }

    pub fn observe(&self, frame: &LiveFrame) {
        self.live_instances.set(frame.instances.len() as i64);
        self.policy_counts.clear();
        self.max_in_flight.clear();
        self.waiting.clear();
        self.tokens_left.clear();
        for (policy, u) in &frame.policies {
            let label = PolicyLabel {
                policy: policy.clone(),
            };
            self.policy_counts.set(&label, &u.counts);
            self.waiting.get_or_create(&label).set(gauge(u.waiting));
            if u.max_in_flight > 0 {
                self.max_in_flight
                    .get_or_create(&label)
                    .set(gauge(u.max_in_flight));
            }
            if let Some(tokens) = u.tokens {
                self.tokens_left.get_or_create(&label).set(gauge(tokens));
            }
        }
        self.limit_counts.clear();
        self.limit_provider_counts.clear();
        self.limit_size_per_s.clear();
        self.limit_available.clear();
        for (limit, u) in &frame.limits {
            let label = LimitLabel {
                limit: limit.clone(),
            };
            self.limit_counts.set(&label, &u.counts);
            let size = if u.period_ms == 0 {
                u.requests as f64
            } else {
                u.requests as f64 * 1000.0 / u.period_ms as f64
            };
            self.limit_size_per_s.get_or_create(&label).set(size);
            if let Some(available) = u.available.or(u.in_flight) {
                self.limit_available
                    .get_or_create(&label)
                    .set(gauge(available));
            }
            if let Some(provider) = &u.provider {
                self.limit_provider_counts.set(&label, &provider.counts);
            }
        }
    }

    /// Each instance's sync health: seconds since its last sync, failures.
    pub fn observe_instances(&self, health: &[(String, u64, u64)]) {
        self.instance_last_sync_age.clear();
        self.instance_sync_failures.clear();
        for (instance, age_ms, failures) in health {
            let label = InstanceLabel {
                instance: instance.clone(),
            };
            self.instance_last_sync_age
                .get_or_create(&label)
                .set(*age_ms as f64 / 1000.0);
            self.instance_sync_failures
                .get_or_create(&label)
                .set(gauge(*failures));
        }
    }

    /// What the policy set says of each policy's size.
    pub fn observe_policies(&self, set: &sluice_shared::PolicySet) {
        self.rate_limit_per_s.clear();
        self.max_wait_seconds.clear();
        for policy in &set.policies {
            let label = PolicyLabel {
                policy: policy.name.clone(),
            };
            if let Some(rate) = &policy.rate {
                let period_ms = rate.period.as_millis().max(1) as f64;
                self.rate_limit_per_s
                    .get_or_create(&label)
                    .set(rate.requests as f64 * 1000.0 / period_ms);
            }
            if let Some(wait) = policy.on_limit.max_wait {
                self.max_wait_seconds
                    .get_or_create(&label)
                    .set(wait.as_millis() as f64 / 1000.0);
            }
        }
    }

    /// OpenMetrics text, what Prometheus asks for.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }

    /// The same in Prometheus' text format (0.0.4), for a client that does
    /// not ask for OpenMetrics (`curl`, `promtool check metrics`): a
    /// counter's HELP and TYPE name its `_total` series, and there is no
    /// `# EOF` or `# UNIT`.
    pub fn render_text(&self) -> String {
        text_format(&self.render())
    }
}

/// OpenMetrics text as Prometheus' text format (see
/// [`Metrics::render_text`]).
pub fn text_format(open_metrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = open_metrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(open_metrics.len());
    for line in open_metrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let comment = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| Some((p, line.strip_prefix(p)?)));
        match comment {
            Some((prefix, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                let total = if counters.contains(name) {
                    "_total"
                } else {
                    ""
                };
                out.push_str(&format!("{prefix}{name}{total} {tail}"));
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

fn gauge(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_text_format_names_counters_by_their_series() {
        let open = "# HELP a_logins Logins.\n# TYPE a_logins counter\na_logins_total 3\n\
                    # HELP a_up Up.\n# TYPE a_up gauge\n# UNIT a_up seconds\na_up 1\n# EOF\n";
        assert_eq!(
            text_format(open),
            "# HELP a_logins_total Logins.\n# TYPE a_logins_total counter\na_logins_total 3\n\
             # HELP a_up Up.\n# TYPE a_up gauge\na_up 1\n"
        );
    }

    /// Every reported counter of every family has its series, named by
    /// its kind, with its meaning as help.
    #[test]
    fn every_reported_counter_shows_with_its_meaning() {
        use sluice_api::{LimitUse, ProviderUse, Utilization};
        use sluice_wire::counts::Counter;
        let metrics = Metrics::default();
        let mut frame = LiveFrame::default();
        frame.policies.insert("bank".into(), Utilization::default());
        frame.limits.insert(
            "tpm".into(),
            LimitUse {
                provider: Some(ProviderUse::default()),
                ..LimitUse::default()
            },
        );
        metrics.observe(&frame);
        let text = metrics.render_text();
        fn expect<C: Counter>(text: &str, prefix: &str) {
            for c in C::ALL.iter().filter(|c| c.kind().is_reported()) {
                let name = match c.kind() {
                    Kind::Rate => format!("sluice_admin_{prefix}_{}_per_second", c.name()),
                    _ => format!("sluice_admin_{prefix}_{}", c.name()),
                };
                let help = format!("# HELP {name} ");
                let line = text.lines().find(|l| l.starts_with(&help));
                assert!(
                    line.is_some_and(|l| l.contains(c.meaning().trim_end_matches('.'))),
                    "{name} with its meaning in:\n{text}"
                );
                assert!(text.lines().any(|l| l.starts_with(&format!("{name}{{"))));
            }
        }
        expect::<PolicyCounter>(&text, "policy");
        expect::<LimitCounter>(&text, "limit");
        expect::<ProviderCounter>(&text, "limit_provider");
    }
}
