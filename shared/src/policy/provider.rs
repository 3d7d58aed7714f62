//! Listening to the provider (`provider`): which answers pause a limit,
//! which headers tell its room, and their checks.

use serde::{Deserialize, Serialize};

use super::bounds;
use super::check::{check_header_name, Report};
use crate::duration::DurationMs;

#[cfg(feature = "schema")]
use schemars::JsonSchema;
/// What a rate limit takes from the provider's answers (opt-in).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ProviderSpec {
    /// Answers whose `Retry-After` (or OpenAI's `retry-after-ms`) pauses
    /// the limit: every call it governs waits (queue) or is refused with
    /// the time left (reject) until the provider said to come back.
    #[serde(default = "ProviderSpec::default_pause_on")]
    pub pause_on: Vec<u16>,
    /// The longest a provider may pause the limit; a longer `Retry-After`
    /// pauses this long (and is counted). Default 5 minutes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_pause: Option<DurationMs>,
    /// Follow the provider's own count of what is left, read from its
    /// answers: a preset (`ietf`, `openai-requests`, `openai-tokens`,
    /// `anthropic-requests`, `anthropic-tokens`, `anthropic-input-tokens`,
    /// `anthropic-output-tokens`, `github`), `{"ietf": "<item name>"}`, or
    /// your own headers. When the provider has fewer left than Sluice
    /// believes, no more than that goes until its reset; Sluice never goes
    /// above its own limit for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub headers: Option<ProviderHeaders>,
    /// For a provider that says only "429": every refusal (a status in
    /// `pause_on`) cuts this limit's rate to 0.7 of what went, once per
    /// overload, and the rate climbs back to the limit's own along a
    /// cubic curve (as AWS SDKs' adaptive mode), learned by every worker
    /// at once.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub adaptive: bool,
}

/// Where a provider says how much of its limit is left.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(
    untagged,
    expecting = "a preset (\"ietf\", \"openai-requests\", \"openai-tokens\", \"anthropic-requests\", \"anthropic-tokens\", \"anthropic-input-tokens\", \"anthropic-output-tokens\", \"github\"), {\"ietf\": \"<item name>\"} or {\"remaining\": ..., \"reset\": ..., \"reset_format\": ...}"
)]
pub enum ProviderHeaders {
    Preset(HeaderPreset),
    Ietf(IetfItem),
    Custom(CustomHeaders),
}

/// The headers of a provider Sluice knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "kebab-case")]
pub enum HeaderPreset {
    /// `RateLimit: "<this limit's name>";r=..;t=..` (or its only item), or
    /// the older `RateLimit-Remaining` / `RateLimit-Reset`.
    Ietf,
    /// `x-ratelimit-remaining-requests`, reset as `1m30.5s`.
    OpenaiRequests,
    /// `x-ratelimit-remaining-tokens`, reset as `12ms`.
    OpenaiTokens,
    /// `anthropic-ratelimit-requests-remaining`, reset as an RFC 3339 time.
    AnthropicRequests,
    AnthropicTokens,
    AnthropicInputTokens,
    AnthropicOutputTokens,
    /// `x-ratelimit-remaining`, reset in epoch seconds.
    Github,
}

/// The IETF `RateLimit` item to follow, by name.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct IetfItem {
    pub ietf: String,
}

/// A provider's own headers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct CustomHeaders {
    /// The header with the provider's limit (its quota per window), if it
    /// sends one: after its reset, Sluice expects that much again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<String>,
    /// The header with what is left (a whole number).
    pub remaining: String,
    /// The header saying when the count is full again; without it, the
    /// limit's own period.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reset: Option<String>,
    #[serde(default)]
    pub reset_format: ResetFormat,
}

/// How a reset header is written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum ResetFormat {
    /// Seconds from now.
    #[default]
    Seconds,
    /// Seconds since 1970 (GitHub).
    EpochSeconds,
    /// `12ms`, `6m0s`, `1m30.5s` (OpenAI).
    Duration,
    /// `2026-11-24T12:00:05Z` (Anthropic).
    Rfc3339,
}

impl ProviderSpec {
    pub const DEFAULT_PAUSE_ON: [u16; 2] = [429, 503];
    pub const DEFAULT_MAX_PAUSE: DurationMs = DurationMs::from_secs(300);
    /// The most `max_pause` may be: a provider's hourly window.
    pub const MAX_PAUSE_LIMIT: DurationMs = DurationMs::from_secs(24 * 3600);

    fn default_pause_on() -> Vec<u16> {
        Self::DEFAULT_PAUSE_ON.to_vec()
    }

    pub fn max_pause(&self) -> DurationMs {
        self.max_pause.unwrap_or(Self::DEFAULT_MAX_PAUSE)
    }
}

impl Default for ProviderSpec {
    fn default() -> Self {
        Self {
            pause_on: Self::default_pause_on(),
            max_pause: None,
            headers: None,
            adaptive: false,
        }
    }
}

pub(crate) fn check_provider(lr: &mut Report, provider: &ProviderSpec) {
    if provider.pause_on.len() > bounds::MAX_PAUSE_ON {
        lr.at(
            "provider.pause_on",
            format!("at most {} statuses", bounds::MAX_PAUSE_ON),
        );
    }
    for (i, status) in provider.pause_on.iter().enumerate() {
        if !(400..=599).contains(status) {
            lr.at(
                &format!("provider.pause_on[{i}]"),
                "must be an error status (400 to 599): only a refusal pauses a limit",
            );
        }
        if provider.pause_on[..i].contains(status) {
            lr.at(&format!("provider.pause_on[{i}]"), "listed twice");
        }
    }
    match &provider.headers {
        Some(ProviderHeaders::Ietf(item)) => {
            if item.ietf.is_empty() || item.ietf.len() > bounds::MAX_NAME_LEN {
                lr.at(
                    "provider.headers.ietf",
                    format!(
                        "the name of an item of the provider's `RateLimit` field: 1 to {} characters",
                        bounds::MAX_NAME_LEN
                    ),
                );
            }
        }
        Some(ProviderHeaders::Custom(custom)) => {
            check_header_name(lr, "provider.headers.remaining", &custom.remaining);
            if let Some(limit) = &custom.limit {
                check_header_name(lr, "provider.headers.limit", limit);
            }
            if let Some(reset) = &custom.reset {
                check_header_name(lr, "provider.headers.reset", reset);
            }
        }
        Some(ProviderHeaders::Preset(_)) | None => {}
    }
    if let Some(max_pause) = provider.max_pause {
        lr.range_ms(
            "provider.max_pause",
            max_pause,
            bounds::MIN_MAX_PAUSE_MS,
            ProviderSpec::MAX_PAUSE_LIMIT.as_millis(),
        );
    }
}
