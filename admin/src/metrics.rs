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

use sluice_shared::api::LiveFrame;

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
    pub admitted_per_s: Family<PolicyLabel, Gauge<f64, AtomicU64>>,
    pub rejected_per_s: Family<PolicyLabel, Gauge<f64, AtomicU64>>,
    pub in_flight: Family<PolicyLabel, Gauge>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("sluice_admin");
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
            admitted_per_s: Family::default(),
            rejected_per_s: Family::default(),
            in_flight: Family::default(),
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
            "policy_admitted_per_second",
            "Admitted requests per second, all Envoys",
            m.admitted_per_s.clone(),
        );
        registry.register(
            "policy_rejected_per_second",
            "Rejected requests per second, all Envoys",
            m.rejected_per_s.clone(),
        );
        registry.register(
            "policy_in_flight",
            "Requests in flight, all Envoys",
            m.in_flight.clone(),
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
        self.admitted_per_s.clear();
        self.rejected_per_s.clear();
        self.in_flight.clear();
        for (policy, u) in &frame.policies {
            let label = PolicyLabel {
                policy: policy.clone(),
            };
            self.admitted_per_s
                .get_or_create(&label)
                .set(u.admitted_per_s);
            self.rejected_per_s
                .get_or_create(&label)
                .set(u.rejected_per_s);
            self.in_flight.get_or_create(&label).set(u.in_flight as i64);
        }
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}
