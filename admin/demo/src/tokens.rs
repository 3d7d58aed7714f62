//! How the mock LLM counts a prompt's tokens: as OpenAI bills a chat
//! completion, with OpenAI's own `cl100k_base` tokenizer (the one of
//! GPT-4 and GPT-3.5; `tiktoken-rs` carries it, no download). Each
//! message costs its strings' tokens and 3 more for its framing, and
//! the reply's priming 3 more; `prompt` and `input` (completions and
//! responses-style bodies) cost their strings' tokens. A body with none
//! of these counts a token per 4 of its bytes, as the mock always did.

use std::sync::OnceLock;

use serde_json::Value;
use tiktoken_rs::CoreBPE;

/// Framing tokens of each message, and of the reply's priming (OpenAI's
/// published count for its chat models).
const PER_MESSAGE: u64 = 3;
const REPLY_PRIMING: u64 = 3;

fn tokenizer() -> Option<&'static CoreBPE> {
    static BPE: OnceLock<Option<CoreBPE>> = OnceLock::new();
    BPE.get_or_init(|| tiktoken_rs::cl100k_base().ok()).as_ref()
}

/// Tokens of `text` in `cl100k_base` (a token per 4 bytes should the
/// tokenizer not load).
pub fn text_tokens(text: &str) -> u64 {
    match tokenizer() {
        Some(bpe) => bpe.encode_ordinary(text).len() as u64,
        None => text.len().div_ceil(4) as u64,
    }
}

/// The prompt's tokens in a request body of `raw_len` bytes.
pub fn prompt_tokens(body: &Value, raw_len: usize) -> u64 {
    let messages = body.get("messages").and_then(Value::as_array);
    let others = ["prompt", "input"].map(|k| body.get(k));
    if messages.is_none() && others.iter().all(Option::is_none) {
        return (raw_len as u64 / 4).max(1);
    }
    let framing = messages.map_or(0, |m| PER_MESSAGE * m.len() as u64 + REPLY_PRIMING);
    let text: u64 = messages
        .into_iter()
        .flatten()
        .chain(others.into_iter().flatten())
        .map(strings_tokens)
        .sum();
    (framing + text).max(1)
}

/// Tokens of every string in `value` (object keys are framing).
fn strings_tokens(value: &Value) -> u64 {
    match value {
        Value::String(s) => text_tokens(s),
        Value::Array(items) => items.iter().map(strings_tokens).sum(),
        Value::Object(map) => map.values().map(strings_tokens).sum(),
        Value::Null | Value::Bool(_) | Value::Number(_) => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_as_openai_bills_a_chat() {
        // "Hello world" is 2 tokens, "user" 1: 3 + 3 framing.
        let body = serde_json::json!({"messages": [{"role": "user", "content": "Hello world"}]});
        assert_eq!(prompt_tokens(&body, 0), 2 + 1 + 3 + 3);
        assert_eq!(
            prompt_tokens(&serde_json::json!({"prompt": "Hello world"}), 0),
            2
        );
        // No prompt at all: a token per 4 bytes, as before.
        assert_eq!(prompt_tokens(&serde_json::json!({"max_tokens": 5}), 40), 10);
    }
}
