//! A prompt's tokens estimated from its characters (`plus_prompt`), and
//! its checks.

use serde::{Deserialize, Serialize};

use super::bounds;
use super::check::{check_json_path, Report};

#[cfg(feature = "schema")]
use schemars::JsonSchema;
/// A prompt's tokens estimated from its text: the characters of every
/// string under `paths` (`messages`, `input`, `prompt`; a path the body
/// lacks adds nothing; `"*"` is the whole body), divided by
/// `chars_per_token` and rounded up.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct PromptEstimate {
    pub paths: Vec<String>,
    /// Characters a token holds on average: about 4 for English text
    /// and OpenAI's or Anthropic's tokenizers, less for JSON or code
    /// (3.3), less still for other scripts. Default 4.
    #[serde(default = "PromptEstimate::default_chars_per_token")]
    pub chars_per_token: f64,
}

impl PromptEstimate {
    pub const DEFAULT_CHARS_PER_TOKEN: f64 = 4.0;
    /// A path that counts every string of the body.
    pub const EVERY_STRING: &'static str = "*";

    fn default_chars_per_token() -> f64 {
        Self::DEFAULT_CHARS_PER_TOKEN
    }
}

/// Where a prompt's text is and how many characters make a token: a few
/// paths, and a ratio a tokenizer could have (a quarter of a character,
/// as some scripts' characters take several tokens, to 64).
pub(crate) fn check_prompt_estimate(r: &mut Report, field: &str, prompt: &PromptEstimate) {
    if prompt.paths.is_empty() {
        r.at(
            &format!("{field}.paths"),
            "name at least one path (messages)",
        );
    }
    if prompt.paths.len() > bounds::MAX_PROMPT_PATHS {
        r.at(
            &format!("{field}.paths"),
            format!("at most {} paths", bounds::MAX_PROMPT_PATHS),
        );
    }
    for (i, path) in prompt.paths.iter().enumerate() {
        if path != PromptEstimate::EVERY_STRING {
            check_json_path(r, &format!("{field}.paths[{i}]"), path);
        }
    }
    let ratio = prompt.chars_per_token;
    if !(bounds::MIN_CHARS_PER_TOKEN..=bounds::MAX_CHARS_PER_TOKEN).contains(&ratio) {
        r.at(
            &format!("{field}.chars_per_token"),
            format!(
                "must be between {} and {} characters",
                bounds::MIN_CHARS_PER_TOKEN,
                bounds::MAX_CHARS_PER_TOKEN
            ),
        );
    }
}
