//! A prompt's tokens estimated before the call, from the characters of
//! its text ([`crate::policy::prompt::PromptEstimate`]), so that a long prompt is
//! admitted against about what it will cost instead of being "one call
//! late". Characters, not bytes: a token of another script holds fewer
//! bytes' worth of characters, and counting bytes would overcharge it.

use serde_json::Value;

use crate::json_path::JsonPath;
use crate::policy::prompt::PromptEstimate;

/// [`PromptEstimate`], parsed once for every request it estimates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptTokens {
    paths: Vec<JsonPath>,
    /// `"*"` is among the paths: every string of the body counts (once).
    whole: bool,
    /// Thousandths of a character per token, at least 1: integer
    /// arithmetic from here on.
    milli_chars_per_token: u64,
}

impl PromptTokens {
    /// From a validated spec: a path that does not parse is skipped, a
    /// ratio below a thousandth counts as one.
    pub fn new(spec: &PromptEstimate) -> Self {
        let milli = (spec.chars_per_token * 1000.0).round();
        // `as` saturates: NaN gives 0, which `max(1)` lifts.
        let milli_chars_per_token = (milli as u64).max(1);
        let whole = spec.paths.iter().any(|p| p == PromptEstimate::EVERY_STRING);
        Self {
            paths: spec
                .paths
                .iter()
                .filter_map(|p| JsonPath::parse(p))
                .collect(),
            whole,
            milli_chars_per_token,
        }
    }

    /// The prompt's estimated tokens in `body`: 0 when no path holds text.
    pub fn tokens(&self, body: &Value) -> u64 {
        if self.whole {
            return self.tokens_of_chars(chars_of_strings(body));
        }
        let chars: u64 = self
            .paths
            .iter()
            .filter_map(|p| p.value_in(body))
            .map(chars_of_strings)
            .fold(0, u64::saturating_add);
        self.tokens_of_chars(chars)
    }

    /// The estimated tokens of `chars` characters of text.
    pub fn tokens_of_chars(&self, chars: u64) -> u64 {
        chars
            .saturating_mul(1000)
            .div_ceil(self.milli_chars_per_token)
    }
}

/// Characters of every string in `value` (object keys left out: they are
/// the request's framing, `role` and `content`, not its text). A body is
/// at most the filter's request bound, so neither depth nor size is
/// unbounded here; the walk keeps its own stack rather than recursing.
fn chars_of_strings(value: &Value) -> u64 {
    let mut total = 0u64;
    let mut pending = vec![value];
    while let Some(v) = pending.pop() {
        match v {
            Value::String(s) => total = total.saturating_add(s.chars().count() as u64),
            Value::Array(items) => pending.extend(items),
            Value::Object(map) => pending.extend(map.values()),
            Value::Null | Value::Bool(_) | Value::Number(_) => {}
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use serde_json::json;

    use super::*;

    fn estimate(paths: &[&str], chars_per_token: f64) -> PromptTokens {
        PromptTokens::new(&PromptEstimate {
            paths: paths.iter().map(|p| p.to_string()).collect(),
            chars_per_token,
        })
    }

    #[test]
    fn counts_characters_of_every_string_under_the_paths_rounded_up() {
        let body = json!({
            "model": "gpt-4o",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hello there"}]}
            ],
            "max_tokens": 100
        });
        // system(6) + "Be brief."(9) + user(4) + text(4) + "Hello there"(11) = 34.
        assert_eq!(estimate(&["messages"], 4.0).tokens(&body), 9);
        assert_eq!(estimate(&["messages"], 1.0).tokens(&body), 34);
        assert_eq!(estimate(&["messages"], 3.4).tokens(&body), 10);
        // Paths the body lacks add nothing; the model's name is not prompt.
        assert_eq!(estimate(&["input", "prompt"], 4.0).tokens(&body), 0);
        assert_eq!(
            estimate(&["messages", "input", "prompt"], 4.0).tokens(&json!({"prompt": "abcdefgh"})),
            2
        );
    }

    #[test]
    fn characters_not_bytes() {
        // 8 characters, 24 bytes of UTF-8.
        let body = json!({"prompt": "日本語のテキスト"});
        assert_eq!(estimate(&["prompt"], 2.0).tokens(&body), 4);
    }

    #[test]
    fn numbers_and_nulls_are_not_text() {
        let body = json!({"input": [1, 2.5, null, true, {"a": 12345678}]});
        assert_eq!(estimate(&["input"], 1.0).tokens(&body), 0);
    }

    #[test]
    fn a_deep_body_neither_recurses_nor_overflows() {
        let mut v = json!("abcd");
        for _ in 0..1_000 {
            v = Value::Array(vec![v]);
        }
        assert_eq!(
            estimate(&["messages"], 4.0).tokens(&json!({"messages": v})),
            1
        );
    }

    #[test]
    fn a_broken_ratio_never_divides_by_zero() {
        let body = json!({"prompt": "abcd"});
        for ratio in [0.0, -3.0, f64::NAN, 1e-9] {
            assert_eq!(estimate(&["prompt"], ratio).tokens(&body), 4000);
        }
        assert_eq!(estimate(&["prompt"], f64::INFINITY).tokens(&body), 1);
    }

    proptest! {
        #[test]
        fn the_estimate_is_the_rounded_up_ratio(text in "\\PC{0,400}", tenths in 10u32..160) {
            let ratio = f64::from(tenths) / 10.0;
            let body = json!({"messages": [{"content": text.clone()}]});
            let chars = text.chars().count() as u64;
            let tokens = estimate(&["messages"], ratio).tokens(&body);
            let milli = u64::from(tenths) * 100;
            prop_assert_eq!(tokens, (chars * 1000).div_ceil(milli));
        }
    }
}
