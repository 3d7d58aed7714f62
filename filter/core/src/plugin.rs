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
    #[serde(default)]
    instance: Option<String>,
    #[serde(default)]
    instance_env: Option<String>,
    #[serde(default)]
    admin_cluster: Option<String>,
    #[serde(default = "default_admin_authority")]
    admin_authority: String,
    #[serde(default = "default_sync_interval")]
    sync_interval: DurationMs,
    #[serde(default)]
    sync_token: Option<String>,
    #[serde(default)]
    sync_token_env: Option<String>,
    #[serde(default)]
    fallback: Option<Value>,
    #[serde(default)]
    queue_ticket_header: bool,
    #[serde(default = "default_sync_push")]
    sync_push: bool,
    #[serde(default = "default_time_scale")]
    time_scale: f64,
    #[serde(default = "default_true")]
    hold_headers_for_body: bool,
    #[serde(default)]
    failure_mode: FailureMode,
    #[serde(default)]
    panic_on_header: Option<String>,
    #[serde(default)]
    route_headers: Vec<String>,
    #[serde(default = "default_true")]
    log_decisions: bool,
    #[serde(default)]
    role: Role,
}

/// Where in Envoy this filter runs, and so what it does there.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// In the listener's HTTP filters: it decides each call.
    #[default]
    Decide,
    /// In the upstream HTTP filters of a pool's member clusters: it
    /// decides nothing, and hears each attempt's answer (Envoy runs those
    /// filters once per attempt, retries included), so that a member's
    /// refusal and its wait are heard even when Envoy retried the call on
    /// another member and the deciding filter sees only that one's answer.
    Attempts,
}

/// What happens to a call when the filter fails on it (a panic in the
/// native build; in the wasm build a trapped VM, which Envoy's
/// `failure_policy` answers: FAIL_RELOAD or FAIL_CLOSED fail closed,
/// FAIL_OPEN fails open).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureMode {
    /// The call is answered 503 by Sluice (`x-sluice-reason:
    /// filter-failure`): nothing unlimited reaches the provider.
    #[default]
    Closed,
    /// The call goes on as if the filter were not there.
    Open,
}

fn default_time_scale() -> f64 {
    1.0
}

fn default_sync_push() -> bool {
    true
}

fn default_true() -> bool {
    true
}

const DEFAULT_INSTANCE: &str = "envoy";

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
    /// A call a policy decides on its body holds its headers until it is
    /// decided, so nothing of a refused call reaches the upstream (on by
    /// default). The wasm filter needs Envoy's
    /// `allow_on_headers_stop_iteration: true` for it, which Istio's
    /// WasmPlugin and Envoy Gateway do not set: without it such calls are
    /// answered 408 after 10 s. Off, their headers go upstream first and a
    /// call refused on its body is reset there (the upstream saw it begin).
    pub hold_headers_for_body: bool,
    /// Each call's decision (policy, verdict, limit, reason, queue wait,
    /// costs, pool member) is set on its stream for Envoy's access log
    /// (on by default): a host call per field set, two for a call
    /// admitted at once.
    pub log_decisions: bool,
    /// A call the filter fails on is refused (`closed`, the default) or
    /// let through (`open`). The native build's; the wasm build's is
    /// Envoy's `failure_policy` (it logs a warning when this says open).
    pub failure_mode: FailureMode,
    /// For tests of `failure_mode` only: a call carrying this request
    /// header makes the filter panic. Never set in production: whoever
    /// sends the header fails the call.
    pub panic_on_header: Option<String>,
    /// Headers this Envoy's routes match that only Sluice may set (a
    /// pool's `route_header`, `x-sluice-member` by default): a caller's
    /// own value is removed from every request from the first call, before
    /// any policy set names them (the route headers of every set the
    /// filter installs are removed too). Lowercase; at most
    /// [`MAX_ROUTE_HEADERS`]. Without pools in Envoy's routes, leave it
    /// empty: no call pays for a header nothing routes by.
    pub route_headers: Vec<String>,
    /// What this filter does where it runs (`decide`, the default, or
    /// `attempts` as an upstream filter of pool members).
    pub role: Role,
}

/// The most headers `route_headers` may name.
pub const MAX_ROUTE_HEADERS: usize = 16;

/// The slowest clock `time_scale` allows.
pub const MIN_TIME_SCALE: f64 = 0.0001;

/// The longest environment variable name `instance_env` or
/// `sync_token_env` may give.
pub const MAX_ENV_NAME_LEN: usize = 128;

/// Parses the configuration, reading the variables `instance_env` and
/// `sync_token_env` name from the process's environment (a wasm VM's is
/// what Envoy gives it: `vm_config.environment_variables`).
pub fn parse_plugin_config(json: &[u8]) -> Result<PluginConfig, ValidationErrors> {
    parse_plugin_config_with_env(json, &|name| std::env::var(name).ok())
}

/// As [`parse_plugin_config`], with `env` answering for the environment.
pub fn parse_plugin_config_with_env(
    json: &[u8],
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<PluginConfig, ValidationErrors> {
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
    let mut refuse = |path: &str, message: String| {
        errors.push(FieldError {
            path: path.into(),
            message,
        })
    };
    let instance = given_or_from_env(
        (raw.instance, raw.instance_env),
        ("instance", "instance_env"),
        env,
        &mut refuse,
    )
    .map(|instance| instance.unwrap_or_else(|| DEFAULT_INSTANCE.into()));
    if let Some(instance) = &instance {
        if let Err(message) = sluice_shared::instance::check_instance(instance) {
            refuse("instance", message);
        }
    }
    // The token's value is never put in a message.
    let sync_token = given_or_from_env(
        (raw.sync_token, raw.sync_token_env.clone()),
        ("sync_token", "sync_token_env"),
        env,
        &mut refuse,
    )
    .flatten()
    .filter(|token| {
        let field = if raw.sync_token_env.is_some() {
            "sync_token_env"
        } else {
            "sync_token"
        };
        header_safe(token, field, &mut refuse)
    });
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
    if raw.route_headers.len() > MAX_ROUTE_HEADERS {
        errors.push(FieldError {
            path: "route_headers".into(),
            message: format!("at most {MAX_ROUTE_HEADERS} headers"),
        });
    }
    for (i, name) in raw.route_headers.iter().enumerate() {
        let message = if !sluice_shared::header_names::is_valid_name(name) {
            Some(format!("{name:?} is not a valid header name"))
        } else {
            sluice_shared::header_names::not_writable(name)
                .map(|why| format!("{name:?}: {why}; no route may be chosen by it"))
        };
        if let Some(message) = message {
            errors.push(FieldError {
                path: format!("route_headers[{i}]"),
                message,
            });
        }
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
    match (fallback, instance) {
        (Some(fallback), Some(instance)) if errors.is_empty() => Ok(PluginConfig {
            instance,
            admin_cluster: raw.admin_cluster,
            admin_authority: raw.admin_authority,
            sync_interval: raw.sync_interval,
            sync_token,
            fallback,
            queue_ticket_header: raw.queue_ticket_header,
            sync_push: raw.sync_push,
            time_scale: raw.time_scale,
            hold_headers_for_body: raw.hold_headers_for_body,
            log_decisions: raw.log_decisions,
            failure_mode: raw.failure_mode,
            panic_on_header: raw.panic_on_header.map(|h| h.to_ascii_lowercase()),
            route_headers: raw
                .route_headers
                .iter()
                .map(|h| h.to_ascii_lowercase())
                .collect(),
            role: raw.role,
        }),
        _ => Err(ValidationErrors { errors }),
    }
}

/// A value given in the configuration (`given.0`, at `fields.0`) or read
/// from the variable `given.1` names (at `fields.1`), not both: `None` when
/// refused, `Some(None)` when neither is given.
fn given_or_from_env(
    given: (Option<String>, Option<String>),
    fields: (&str, &str),
    env: &dyn Fn(&str) -> Option<String>,
    refuse: &mut impl FnMut(&str, String),
) -> Option<Option<String>> {
    match given {
        (Some(_), Some(_)) => {
            let message = format!("give `{}` or `{}`, not both", fields.0, fields.1);
            refuse(fields.1, message);
            None
        }
        (value, None) => Some(value),
        (None, Some(name)) => match from_env(&name, env) {
            Ok(value) => Some(Some(value)),
            Err(message) => {
                refuse(fields.1, message);
                None
            }
        },
    }
}

/// Whether `token` can go in an `Authorization` header as it is; if not,
/// says so at `path` (without the token).
fn header_safe(token: &str, path: &str, refuse: &mut impl FnMut(&str, String)) -> bool {
    let safe = !token.is_empty() && token.bytes().all(|b| b.is_ascii_graphic());
    if !safe {
        refuse(
            path,
            "the token must be printable ASCII without spaces (it is sent in the Authorization header)"
                .into(),
        );
    }
    safe
}

/// The value of the environment variable `name` names, which must be set
/// and not empty.
fn from_env(name: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<String, String> {
    let well_formed = !name.is_empty()
        && name.len() <= MAX_ENV_NAME_LEN
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !well_formed {
        return Err(format!(
            "must be an environment variable's name: 1 to {MAX_ENV_NAME_LEN} letters, digits \
             and '_', not starting with a digit"
        ));
    }
    match env(name) {
        Some(value) if !value.is_empty() => Ok(value),
        _ => Err(format!(
            "{name} is not set in the filter's environment (wasm: list it in \
             vm_config.environment_variables.host_env_keys; Istio: vmConfig.env with \
             valueFrom: HOST)"
        )),
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

    fn env_of(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn instance_and_sync_token_may_come_from_the_environment() {
        let env = env_of(&[("POD_NAME", "egress-7c9f-x2"), ("SYNC", "s3cret-token")]);
        let c = parse_plugin_config_with_env(
            br#"{"instance_env": "POD_NAME", "sync_token_env": "SYNC"}"#,
            &env,
        )
        .unwrap();
        assert_eq!(c.instance, "egress-7c9f-x2");
        assert_eq!(c.sync_token.as_deref(), Some("s3cret-token"));
        // Not named: the defaults, and nothing read.
        let c = parse_plugin_config_with_env(b"{}", &env_of(&[])).unwrap();
        assert_eq!((c.instance.as_str(), c.sync_token), ("envoy", None));
    }

    #[test]
    fn a_variable_missing_empty_badly_named_or_given_twice_is_refused_by_field() {
        let env = env_of(&[("EMPTY", ""), ("BAD_NAME", "has space"), ("T", "tok en")]);
        let refused = |json: &str| {
            parse_plugin_config_with_env(json.as_bytes(), &env)
                .unwrap_err()
                .to_string()
        };
        let e = refused(r#"{"instance_env": "POD_NAME"}"#);
        assert!(
            e.starts_with("instance_env: POD_NAME is not set in the filter's environment"),
            "{e}"
        );
        let e = refused(r#"{"sync_token_env": "EMPTY"}"#);
        assert!(e.starts_with("sync_token_env: EMPTY is not set"), "{e}");
        for bad in ["", "1ST", "A-B", "A B", &"X".repeat(129)] {
            let e = refused(&format!(r#"{{"instance_env": "{bad}"}}"#));
            assert!(
                e.starts_with("instance_env: must be an environment variable's name"),
                "{bad:?}: {e}"
            );
        }
        // The value is checked as an instance name is.
        let e = refused(r#"{"instance_env": "BAD_NAME"}"#);
        assert!(e.starts_with("instance: ' ' is not allowed"), "{e}");
        // A token that cannot go in a header, and never its value.
        let e = refused(r#"{"sync_token_env": "T"}"#);
        assert!(
            e.starts_with("sync_token_env: the token must be printable ASCII"),
            "{e}"
        );
        assert!(!e.contains("tok en"), "{e}");
        let e = refused("{\"sync_token\": \"a\\nb\"}");
        assert!(
            e.starts_with("sync_token: the token must be printable ASCII"),
            "{e}"
        );
        assert_eq!(
            refused(r#"{"instance": "a", "instance_env": "POD_NAME"}"#),
            "instance_env: give `instance` or `instance_env`, not both"
        );
        assert_eq!(
            refused(r#"{"sync_token": "a", "sync_token_env": "T"}"#),
            "sync_token_env: give `sync_token` or `sync_token_env`, not both"
        );
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

    #[test]
    fn route_headers_are_none_unless_named_and_never_a_protected_header() {
        assert!(parse_plugin_config(b"{}").unwrap().route_headers.is_empty());
        let c =
            parse_plugin_config(br#"{"route_headers": ["X-Sluice-Member", "x-route"]}"#).unwrap();
        assert_eq!(c.route_headers, ["x-sluice-member", "x-route"]);
        let e = parse_plugin_config(
            br#"{"route_headers": ["x-ok", "Authorization", "content-length", "bad header", ""]}"#,
        )
        .unwrap_err();
        let text = e.to_string();
        for expected in [
            "route_headers[1]: \"Authorization\": it carries a credential",
            "route_headers[2]: \"content-length\": it frames the message",
            "route_headers[3]: \"bad header\" is not a valid header name",
            "route_headers[4]: \"\" is not a valid header name",
        ] {
            assert!(text.contains(expected), "{expected} in {text}");
        }
        assert!(!text.contains("route_headers[0]"), "{text}");
        let many: Vec<String> = (0..=MAX_ROUTE_HEADERS)
            .map(|i| format!("\"x-r{i}\""))
            .collect();
        let e =
            parse_plugin_config(format!(r#"{{"route_headers": [{}]}}"#, many.join(",")).as_bytes())
                .unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("route_headers: at most {MAX_ROUTE_HEADERS} headers")
        );
    }
}
