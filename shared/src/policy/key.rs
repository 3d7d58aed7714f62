//! Keys (`key`): a request header or JSON body value that splits a limit
//! into one bucket per value, and its checks.

use serde::{Deserialize, Serialize};

use super::bounds;
use super::check::{check_header_name, check_json_path, Report};

#[cfg(feature = "schema")]
use schemars::JsonSchema;
/// One bucket per distinct value of `header` (per API key, per tenant), or
/// of a field of the request's JSON body (`json`: per model, per `user`),
/// or, with both, per pair of them (per API key and model).
///
/// Requests without the header (or whose body is not JSON, or lacks the
/// field) share one bucket; with both, a request lacking the field shares
/// it, one without the header has its own per field value. At most `max_keys` keys are
/// tracked at once; a key whose bucket is idle (full again, nothing in flight)
/// gives its place to a new key. When every place holds a busy key, a new key
/// is handled by `overflow`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct KeySpec {
    /// A request header (`json` too: one key per pair of their values).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// A dotted path into the request's JSON body (`model`, `user`,
    /// `metadata.team`): a string is the key as it is, a number or
    /// `true`/`false` its JSON text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub json: Option<String>,
    #[serde(default = "KeySpec::default_max_keys")]
    pub max_keys: u32,
    #[serde(default)]
    pub overflow: KeyOverflow,
    /// How the live view names keys: a keyed hash (default: raw keys never
    /// leave Envoy) or, for values that are no secret (a tenant id, a
    /// region), the value itself.
    #[serde(default, skip_serializing_if = "KeyLabel::is_hash")]
    pub label: KeyLabel,
}

/// How the live view names a policy's keys.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum KeyLabel {
    /// A keyed hash such as `#3fa2c41b09de`; the admin finds a key you type.
    #[default]
    Hash,
    /// The header's value, when printable and no secret (cut at 64
    /// characters); a pair's both values.
    Value,
    /// A pair's body field only (`key` with `header` and `json`): an API
    /// key's model shown as the model, the key's part left out. Under its
    /// parent in the budgets tree (the API key's budget) it names the
    /// node; elsewhere two keys' same model read alike.
    Field,
}

impl KeyLabel {
    fn is_hash(&self) -> bool {
        *self == KeyLabel::Hash
    }
}

impl KeySpec {
    pub const DEFAULT_MAX_KEYS: u32 = 10_000;

    /// Whether the key is read from the request's body.
    pub fn reads_request_body(&self) -> bool {
        self.json.is_some()
    }

    /// Where the key comes from, for people: `x-api-key`, `json model`,
    /// `x-api-key and json model`.
    pub fn source(&self) -> String {
        match (&self.header, &self.json) {
            (Some(header), Some(path)) => format!("{header} and json {path}"),
            (Some(header), None) => header.clone(),
            (None, Some(path)) => format!("json {path}"),
            (None, None) => String::new(),
        }
    }

    fn default_max_keys() -> u32 {
        Self::DEFAULT_MAX_KEYS
    }
}

/// What happens to a request whose key finds no place among `max_keys`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum KeyOverflow {
    /// All overflowing keys share one extra bucket with the policy's limits:
    /// they are limited together, never let through unlimited.
    #[default]
    Shared,
    /// Overflowing keys are refused with the policy's `on_limit` reply.
    Reject,
}

pub(crate) fn check_key(r: &mut Report, key: &KeySpec) {
    if let Some(header) = &key.header {
        check_header_name(r, "key.header", header);
        if key.label == KeyLabel::Value && crate::header_names::is_credential(header) {
            r.at(
                "key.label",
                format!(
                    "{header:?} carries a credential: its values are never shown, so its keys are labelled by hash (leave `label` out)"
                ),
            );
        }
    }
    if let Some(path) = &key.json {
        check_json_path(r, "key.json", path);
    }
    if key.label == KeyLabel::Field && (key.header.is_none() || key.json.is_none()) {
        r.at(
            "key.label",
            "`field` names a key of `header` and `json` by its body field: give both, or label by `value` or `hash`",
        );
    }
    match (&key.header, &key.json) {
        (Some(_), _) | (_, Some(_)) => {}
        (None, None) => r.at(
            "key",
            "give `header` (a request header) or `json` (a path in the request's JSON body)",
        ),
    }
    r.range_u64(
        "key.max_keys",
        key.max_keys.into(),
        1,
        bounds::MAX_KEYS.into(),
    );
}
