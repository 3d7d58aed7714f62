//! What an answer says a call cost (`usage`): headers, JSON paths, SSE
//! events, and what an unread answer is charged, and their checks.

use serde::{Deserialize, Serialize};

use super::bounds;
use super::check::{check_header_name, check_json_path, Report};

#[cfg(feature = "schema")]
use schemars::JsonSchema;
/// Where a call's real cost comes from once its response is known: a
/// response header, or whole numbers in its JSON body (summed). The call
/// is admitted against its `cost` (the estimate); when the response ends
/// the difference is refunded or charged to the calls that follow. A
/// response that ends early, carries no usage, or whose usage cannot be
/// read is charged `unread`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct UsageSpec {
    /// A response header holding the cost (`x-usage-tokens`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// Dotted paths into a JSON response whose whole numbers are summed:
    /// `["usage.total_tokens"]`, or `["usage.input_tokens",
    /// "usage.output_tokens"]`; or weighed, a path to its weight:
    /// `{"usage.prompt_tokens": 1, "usage.completion_tokens": 4,
    /// "usage.prompt_tokens_details.cached_tokens": -1}`.
    #[serde(default, skip_serializing_if = "UsagePaths::is_empty")]
    pub json: UsagePaths,
    /// The paths for a streamed (`text/event-stream`) answer, where the
    /// last value of each across its events counts; default: `json`.
    #[serde(default, skip_serializing_if = "UsagePaths::is_empty")]
    pub events: UsagePaths,
    /// The most of a JSON body (or of one event) read for its usage;
    /// default 256 KiB. A larger one is charged `unread` and counted
    /// (`usage_too_large`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_body_bytes: Option<u32>,
    /// What a call is charged when its usage could not be read (an answer
    /// cut short, without usage, too large to read): `"max"` (the default:
    /// the most its `cost` can be, not the caller's own estimate), a
    /// number of tokens, or `"estimate"` (what it was admitted against).
    /// Never less than the estimate.
    #[serde(default, skip_serializing_if = "UnreadCharge::is_default")]
    pub unread: UnreadCharge,
    /// For OpenAI-style streams: a streamed request that does not ask for
    /// its usage is sent asking (`"stream_options": {"include_usage":
    /// true}`), and what the provider adds for it is taken out of the
    /// answer, which the caller gets as it would have without. So a
    /// stream's usage is read, not charged `unread`. Such calls go
    /// upstream without `content-length` (their body may grow).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ask_stream_usage: bool,
}

/// See [`UsageSpec::unread`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(
    untagged,
    expecting = "\"max\", \"estimate\" or a whole number of tokens"
)]
pub enum UnreadCharge {
    Named(UnreadName),
    Tokens(u64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum UnreadName {
    /// The most the limit's `cost` can be.
    Max,
    /// What the call was admitted against.
    Estimate,
}

impl Default for UnreadCharge {
    fn default() -> Self {
        UnreadCharge::Named(UnreadName::Max)
    }
}

impl UnreadCharge {
    pub fn is_default(&self) -> bool {
        *self == Self::default()
    }
}

impl UsageSpec {
    pub const DEFAULT_MAX_BODY_BYTES: u32 = 256 * 1024;

    pub fn max_body_bytes(&self) -> u32 {
        self.max_body_bytes.unwrap_or(Self::DEFAULT_MAX_BODY_BYTES)
    }

    /// The paths read from a streamed answer.
    pub fn event_paths(&self) -> &UsagePaths {
        if self.events.is_empty() {
            &self.json
        } else {
            &self.events
        }
    }
}

/// Paths into a JSON answer whose whole numbers are summed, each times its
/// weight: a list (every weight 1) or a map of path to weight. A path of a
/// positive weight must be in the answer (or its usage is missing); one of
/// a negative weight (a discount, such as cached prompt tokens) counts 0
/// when absent. The sum is never below 0.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct UsagePaths(pub Vec<(String, i64)>);

impl UsagePaths {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Each path with its weight.
    pub fn iter(&self) -> impl Iterator<Item = (&str, i64)> {
        self.0.iter().map(|(path, weight)| (path.as_str(), *weight))
    }
}

impl<S: Into<String>> FromIterator<S> for UsagePaths {
    /// Paths of weight 1.
    fn from_iter<I: IntoIterator<Item = S>>(paths: I) -> Self {
        Self(paths.into_iter().map(|p| (p.into(), 1)).collect())
    }
}

impl Serialize for UsagePaths {
    /// A list while every weight is 1, as most policies write it.
    fn serialize<Ser: serde::Serializer>(&self, serializer: Ser) -> Result<Ser::Ok, Ser::Error> {
        use serde::ser::{SerializeMap, SerializeSeq};
        if self.0.iter().all(|(_, weight)| *weight == 1) {
            let mut seq = serializer.serialize_seq(Some(self.0.len()))?;
            for (path, _) in &self.0 {
                seq.serialize_element(path)?;
            }
            seq.end()
        } else {
            let mut map = serializer.serialize_map(Some(self.0.len()))?;
            for (path, weight) in &self.0 {
                map.serialize_entry(path, weight)?;
            }
            map.end()
        }
    }
}

impl<'de> Deserialize<'de> for UsagePaths {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(
            untagged,
            expecting = "a list of paths, or a map of path to a whole-number weight"
        )]
        enum Written {
            List(Vec<String>),
            Weighted(std::collections::BTreeMap<String, i64>),
        }
        Ok(match Written::deserialize(deserializer)? {
            Written::List(paths) => paths.into_iter().collect(),
            Written::Weighted(weights) => Self(weights.into_iter().collect()),
        })
    }
}

#[cfg(feature = "schema")]
impl JsonSchema for UsagePaths {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "UsagePaths".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "description": "Dotted paths into a JSON answer whose whole numbers are summed: a list (each counted once), or a map of path to weight (`{\"usage.prompt_tokens\": 1, \"usage.completion_tokens\": 4, \"usage.prompt_tokens_details.cached_tokens\": -1}`). A negative weight's path counts 0 when absent; the sum is never below 0.",
            "oneOf": [
                { "type": "array", "items": { "type": "string" } },
                { "type": "object", "additionalProperties": { "type": "integer" } }
            ]
        })
    }
}

/// Where a limit's real cost is read from the response: one source, paths
/// that parse, a bounded read.
pub(crate) fn check_usage(r: &mut Report, usage: &UsageSpec) {
    match (&usage.header, usage.json.is_empty()) {
        (Some(_), false) => r.at("usage", "give either `header` or `json`, not both"),
        (None, true) => r.at(
            "usage",
            "give `header` (a response header) or `json` (paths in the response body)",
        ),
        _ => {}
    }
    if let Some(h) = &usage.header {
        check_header_name(r, "usage.header", h);
        if !usage.events.is_empty() {
            r.at("usage.events", "applies only with `json`");
        }
        if usage.ask_stream_usage {
            r.at(
                "usage.ask_stream_usage",
                "applies only with `json`: the usage asked for comes in the stream's events",
            );
        }
    }
    for (field, paths) in [("usage.json", &usage.json), ("usage.events", &usage.events)] {
        if paths.len() > bounds::MAX_USAGE_PATHS {
            r.at(field, format!("at most {} paths", bounds::MAX_USAGE_PATHS));
        }
        for (i, (path, weight)) in paths.iter().enumerate() {
            check_json_path(r, &format!("{field}[{i}]"), path);
            if weight == 0 {
                r.at(
                    &format!("{field}[{i}]"),
                    format!("{path:?} has weight 0: it counts nothing, leave it out"),
                );
            } else if weight.unsigned_abs() > bounds::MAX_USAGE_WEIGHT {
                r.at(
                    &format!("{field}[{i}]"),
                    format!(
                        "{path:?}: a weight between -{max} and {max}",
                        max = bounds::MAX_USAGE_WEIGHT
                    ),
                );
            }
        }
        if !paths.is_empty() && paths.iter().all(|(_, weight)| weight < 0) {
            r.at(
                field,
                "no path counts up: give at least one a positive weight",
            );
        }
    }
    check_usage_bounds(r, usage);
}

/// How much of an answer is read for its usage, and what an unread one is
/// charged: the same for every limit that reads usage.
pub(crate) fn check_usage_bounds(r: &mut Report, usage: &UsageSpec) {
    if let Some(max) = usage.max_body_bytes {
        r.range_u64(
            "usage.max_body_bytes",
            u64::from(max),
            1024,
            u64::from(bounds::MAX_USAGE_BODY_BYTES),
        );
    }
    if let UnreadCharge::Tokens(n) = usage.unread {
        r.range_u64("usage.unread", n, 1, bounds::MAX_REQUESTS);
    }
}

/// A price limit reads its usage as its `price.usage` says: its `usage`
/// may only ask streams for it and bound the read.
pub(crate) fn check_price_usage(r: &mut Report, usage: &UsageSpec) {
    if usage.header.is_some() || !usage.json.is_empty() || !usage.events.is_empty() {
        r.at(
            "usage",
            "a price reads the answer's usage as `cost.price.usage` says (openai or anthropic): give only `ask_stream_usage`, `unread` or `max_body_bytes`",
        );
    }
    check_usage_bounds(r, usage);
}
