//! A dotted path into a JSON body (`usage.total_tokens`, `choices.0.usage`):
//! parsed once, where a policy reads a usage, a cost, a match or a key.

use serde_json::Value;

/// A dotted path into a JSON value: `usage.total_tokens`; array items by
/// index (`choices.0.usage`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonPath {
    text: String,
    steps: Vec<String>,
}

impl JsonPath {
    /// None for an empty path or an empty step (`usage..tokens`).
    pub fn parse(text: &str) -> Option<Self> {
        let steps: Vec<String> = text.split('.').map(str::to_string).collect();
        if text.is_empty() || steps.iter().any(String::is_empty) {
            return None;
        }
        Some(Self {
            text: text.to_string(),
            steps,
        })
    }

    /// The path as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The whole number at this path in `value`.
    pub fn find(&self, value: &Value) -> Option<u64> {
        self.value_in(value)?.as_u64()
    }

    /// The whole number at this path, its first step's value found by
    /// `field` (the body's top-level field of that name).
    pub(crate) fn find_in_field(&self, field: impl Fn(&str) -> Option<Value>) -> Option<u64> {
        let (first, rest) = self.steps.split_first()?;
        let mut at = field(first)?;
        for step in rest {
            at = match at {
                Value::Object(mut map) => map.remove(step)?,
                Value::Array(mut items) => {
                    let index = step.parse::<usize>().ok()?;
                    (index < items.len()).then(|| items.swap_remove(index))?
                }
                _ => return None,
            };
        }
        at.as_u64()
    }

    /// Whatever is at this path in `value`.
    pub fn value_in<'v>(&self, value: &'v Value) -> Option<&'v Value> {
        let mut at = value;
        for step in &self.steps {
            at = match at {
                Value::Object(map) => map.get(step)?,
                Value::Array(items) => items.get(step.parse::<usize>().ok()?)?,
                _ => return None,
            };
        }
        Some(at)
    }

    /// Whatever is at this path in `value`, to be changed (a downgrade's
    /// model).
    pub fn value_in_mut<'v>(&self, value: &'v mut Value) -> Option<&'v mut Value> {
        let mut at = value;
        for step in &self.steps {
            at = match at {
                Value::Object(map) => map.get_mut(step)?,
                Value::Array(items) => items.get_mut(step.parse::<usize>().ok()?)?,
                _ => return None,
            };
        }
        Some(at)
    }

    /// The text at this path in `value`, for a match or a key: a string as
    /// it is, a number or `true`/`false` as its JSON text; None for
    /// anything else (an object, a list, `null`) or nothing there.
    pub fn text_in<'v>(&self, value: &'v Value) -> Option<std::borrow::Cow<'v, str>> {
        match self.value_in(value)? {
            Value::String(s) => Some(std::borrow::Cow::Borrowed(s)),
            Value::Number(n) => Some(std::borrow::Cow::Owned(n.to_string())),
            Value::Bool(b) => Some(std::borrow::Cow::Borrowed(if *b {
                "true"
            } else {
                "false"
            })),
            Value::Null | Value::Array(_) | Value::Object(_) => None,
        }
    }
}
