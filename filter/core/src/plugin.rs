//! The filter's plugin configuration (JSON in the Envoy config), validated
//! like policies: a bad configuration names the field and the reason.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use sluice_shared::duration::DurationMs;
use sluice_shared::policy::PolicySet;
use sluice_shared::validate::{policy_set_from_value, FieldError, ValidationErrors};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPluginConfig {
    #[serde(default = "default_instance")]
    instance: String,
    #[serde(default)]
    admin_cluster: Option<String>,
    #[serde(default = "default_admin_authority")]
    admin_authority: String,
    #[serde(default = "default_sync_interval")]
    sync_interval: DurationMs,
    #[serde(default)]
    sync_token: Option<String>,
    #[serde(default)]
    fallback: Option<Value>,
    #[serde(default)]
    queue_ticket_header: bool,
    #[serde(default = "default_sync_push")]
    sync_push: bool,
    #[serde(default = "default_time_scale")]
    time_scale: f64,
}

fn default_time_scale() -> f64 {
    1.0
}

fn default_sync_push() -> bool {
    true
}

fn default_instance() -> String {
    "envoy".into()
}

fn default_admin_authority() -> String {
    "sluice-admin".into()
}

fn default_sync_interval() -> DurationMs {
    DurationMs::from_secs(1)
}

/// What the filter runs with until (and unless) the admin sends policies.
#[derive(Debug, Clone, PartialEq)]
pub struct PluginConfig {
    /// This Envoy's name in the admin's instance list.
    pub instance: String,
    /// The Envoy cluster that reaches the admin; no sync without it.
    pub admin_cluster: Option<String>,
    /// `:authority` of sync requests.
    pub admin_authority: String,
    pub sync_interval: DurationMs,
    /// Bearer token for the admin's sync endpoint.
    pub sync_token: Option<String>,
    /// Policies enforced before any policy set arrives from the admin.
    pub fallback: PolicySet,
    /// Adds `x-sluice-queue-ticket: <n>` to queued requests sent upstream,
    /// so the order in which a queue released them can be checked against
    /// the order it took them in. Off by default: it is for tests and
    /// debugging, not for third parties.
    pub queue_ticket_header: bool,
    /// Keeps a watch call open to the admin, which answers it as soon as
    /// the policy set changes (push); the syncs carry on at the interval.
    /// On by default; off, edits arrive with the next sync.
    pub sync_push: bool,
    /// The filter's clock runs at this fraction of real time (default 1).
    /// Only for measuring the filter inside an instrumented Envoy: under
    /// callgrind Envoy runs some 50 times slower, and with its clock slowed
    /// as much every time-driven decision (a prefetch's lifetime, the
    /// ticks) falls as often per request as at full speed. Limits are then
    /// per slowed second: never for production.
    pub time_scale: f64,
}

/// The slowest clock `time_scale` allows.
pub const MIN_TIME_SCALE: f64 = 0.0001;

pub fn parse_plugin_config(json: &[u8]) -> Result<PluginConfig, ValidationErrors> {
    let one = |path: &str, message: String| ValidationErrors {
        errors: vec![FieldError {
            path: path.into(),
            message,
        }],
    };
    let value: Value = if json.iter().all(u8::is_ascii_whitespace) {
        Value::Object(Default::default())
    } else {
        serde_json::from_slice(json).map_err(|e| one("", format!("not valid JSON: {e}")))?
    };
    let raw: RawPluginConfig = serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        one(
            if path == "." { "" } else { &path },
            e.into_inner().to_string(),
        )
    })?;
    let mut errors = Vec::new();
    if let Err(message) = sluice_shared::instance::check_instance(&raw.instance) {
        errors.push(FieldError {
            path: "instance".into(),
            message,
        });
    }
    let interval = raw.sync_interval.as_millis();
    if !(100..=60_000).contains(&interval) {
        errors.push(FieldError {
            path: "sync_interval".into(),
            message: "must be between 100ms and 1m".into(),
        });
    }
    if raw.admin_cluster.as_deref() == Some("") {
        errors.push(FieldError {
            path: "admin_cluster".into(),
            message: "must not be empty (leave it out to run without an admin)".into(),
        });
    }
    if !(MIN_TIME_SCALE..=1.0).contains(&raw.time_scale) {
        errors.push(FieldError {
            path: "time_scale".into(),
            message: format!("must be between {MIN_TIME_SCALE} and 1 (1: real time)"),
        });
    }
    let fallback = match raw.fallback {
        None => Some(PolicySet {
            version: 0,
            prices: None,
            policies: Vec::new(),
        }),
        Some(v) => match policy_set_from_value(v) {
            Ok(set) => Some(set),
            Err(e) => {
                errors.extend(e.errors.into_iter().map(|f| FieldError {
                    path: if f.path.is_empty() {
                        "fallback".into()
                    } else {
                        format!("fallback.{}", f.path)
                    },
                    message: f.message,
                }));
                None
            }
        },
    };
    match fallback {
        Some(fallback) if errors.is_empty() => Ok(PluginConfig {
            instance: raw.instance,
            admin_cluster: raw.admin_cluster,
            admin_authority: raw.admin_authority,
            sync_interval: raw.sync_interval,
            sync_token: raw.sync_token,
            fallback,
            queue_ticket_header: raw.queue_ticket_header,
            sync_push: raw.sync_push,
            time_scale: raw.time_scale,
        }),
        _ => Err(ValidationErrors { errors }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_configuration_runs_with_no_policies() {
        let c = parse_plugin_config(b"").unwrap();
        assert_eq!(c.instance, "envoy");
        assert!(c.fallback.policies.is_empty());
        assert_eq!(c.sync_interval.as_millis(), 1000);
    }

    #[test]
    fn errors_name_the_field() {
        let e = parse_plugin_config(br#"{"instance": "a", "sync_intervall": "1s"}"#).unwrap_err();
        assert!(
            e.to_string().starts_with("sync_intervall: unknown field"),
            "{e}"
        );
        let e = parse_plugin_config(
            br#"{"fallback": {"version": 1, "policies": [{"name": "x", "match": {"host": "a"}, "rate": {"requests": 0, "period": "1s"}}]}}"#,
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "fallback.policies[0].rate.requests: must be >= 1"
        );
        let e = parse_plugin_config(br#"{"sync_interval": "1ms", "instance": ""}"#).unwrap_err();
        assert_eq!(
            e.to_string(),
            "instance: must be 1 to 128 characters; sync_interval: must be between 100ms and 1m"
        );
        assert!(parse_plugin_config(b"\xff")
            .unwrap_err()
            .to_string()
            .starts_with("not valid JSON"));
    }

    #[test]
    fn time_scale_is_real_time_unless_slowed_within_bounds() {
        assert_eq!(parse_plugin_config(b"{}").unwrap().time_scale, 1.0);
        let c = parse_plugin_config(br#"{"time_scale": 0.02}"#).unwrap();
        assert_eq!(c.time_scale, 0.02);
        for bad in ["0", "-1", "1.5", "0.00001"] {
            let e =
                parse_plugin_config(format!(r#"{{"time_scale": {bad}}}"#).as_bytes()).unwrap_err();
            assert!(
                e.to_string().starts_with("time_scale: must be between"),
                "{bad}: {e}"
            );
        }
        let e = parse_plugin_config(br#"{"time_scale": "fast"}"#).unwrap_err();
        assert!(e.to_string().starts_with("time_scale: invalid type"), "{e}");
    }
}
