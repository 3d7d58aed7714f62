//! MCP tool calls in a request's body: which JSON-RPC messages a policy
//! with `match.mcp` counts, and the ids its refusal must answer.

use serde_json::Value;
use sluice_shared::McpMatch;

/// `match.mcp`, prepared: the methods and tools a policy counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct McpMatcher {
    methods: Vec<String>,
    /// Exact names, and prefixes (from names ending in `*`).
    tools: Vec<(String, bool)>,
}

/// Whom a refusal of a JSON-RPC body answers: a request's id, nobody for
/// a notification, each element for a batch.
#[derive(Debug, Clone, PartialEq)]
pub enum RpcCall {
    /// One message: its `id` (None: a notification, answered by nobody).
    Single(Option<Value>),
    /// A batch: each element's `id` (None: a notification), in order, and
    /// whether the policy counted it.
    Batch(Vec<(Option<Value>, bool)>),
}

/// The most messages one batch may hold: a batch is decided as one call,
/// and each of its messages is classified alone first.
pub const MAX_BATCH: usize = 128;

/// Why a batch of MCP messages cannot be decided as one call; unless it
/// can be split into parts decided together, it is refused whole for it,
/// nothing of it counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchProblem {
    /// One of its messages, sent alone, falls under another policy.
    Mixed,
    /// Its policy reads keys or costs from each message.
    ReadsEachMessage,
    /// More than [`MAX_BATCH`] messages.
    TooLarge,
}

impl BatchProblem {
    /// The `x-sluice-reason` of its refusal.
    pub fn reason(self) -> &'static str {
        match self {
            Self::Mixed => "batch-mixed",
            Self::ReadsEachMessage => "batch-keyed",
            Self::TooLarge => "batch-too-large",
        }
    }

    /// What to do instead, for the caller.
    pub fn explain(self) -> String {
        match self {
            Self::Mixed => "its messages fall under different policies, and one of them routes \
                            through a pool, shares fairly, reads the answer's usage or changes \
                            the body, or two hold calls in flight: send them one by one"
                .into(),
            Self::ReadsEachMessage => "the policy keys or prices each message, and routes \
                                       through a pool, shares fairly, reads the answer's usage, \
                                       changes the body or holds calls in flight: send them one \
                                       by one"
                .into(),
            Self::TooLarge => format!("a batch holds at most {MAX_BATCH} messages"),
        }
    }
}

impl McpMatcher {
    pub fn new(spec: &McpMatch) -> Self {
        Self {
            methods: spec.methods.clone(),
            tools: spec
                .tools
                .iter()
                .map(|t| match t.strip_suffix('*') {
                    Some(prefix) => (prefix.to_string(), true),
                    None => (t.clone(), false),
                })
                .collect(),
        }
    }

    /// How many of the body's messages the policy counts (0: it does not
    /// take the call).
    pub fn counted(&self, body: &Value) -> u64 {
        match body {
            Value::Array(batch) => batch.iter().filter(|m| self.counts(m)).count() as u64,
            message => u64::from(self.counts(message)),
        }
    }

    /// The tool each message the policy counts calls (None: a message of
    /// another method it counts), in order.
    pub fn counted_tools<'a>(&'a self, body: &'a Value) -> impl Iterator<Item = Option<&'a str>> {
        let messages = match body {
            Value::Array(batch) => batch.as_slice(),
            message => std::slice::from_ref(message),
        };
        messages.iter().filter(|m| self.counts(m)).map(|m| {
            match m.get("method").and_then(Value::as_str) {
                Some(McpMatch::TOOL_CALL) => tool_of(m),
                _ => None,
            }
        })
    }

    /// Whom a refusal of `body` answers, when it is JSON-RPC.
    pub fn call(&self, body: &Value) -> Option<RpcCall> {
        match body {
            Value::Array(batch) => Some(RpcCall::Batch(
                batch
                    .iter()
                    .map(|m| (request_id(m), self.counts(m)))
                    .collect(),
            )),
            Value::Object(_) => Some(RpcCall::Single(request_id(body))),
            _ => None,
        }
    }

    fn counts(&self, message: &Value) -> bool {
        let Some(method) = message.get("method").and_then(Value::as_str) else {
            return false;
        };
        if !self.methods.iter().any(|m| m == method) {
            return false;
        }
        if self.tools.is_empty() {
            return true;
        }
        if method != McpMatch::TOOL_CALL {
            // Tools name only what `tools/call` calls; another method the
            // policy names counts whatever its parameters.
            return true;
        }
        let Some(tool) = tool_of(message) else {
            return false;
        };
        self.tools.iter().any(|(name, prefix)| {
            if *prefix {
                tool.starts_with(name.as_str())
            } else {
                tool == name
            }
        })
    }
}

/// Each element's `id` of a batch (None: a notification), in order; None
/// for a body that is no batch.
pub fn batch_ids(body: &Value) -> Option<Vec<Option<Value>>> {
    match body {
        Value::Array(batch) => Some(batch.iter().map(request_id).collect()),
        _ => None,
    }
}

/// The tool a `tools/call` message calls (`params.name`).
fn tool_of(message: &Value) -> Option<&str> {
    message
        .get("params")
        .and_then(|p| p.get("name"))
        .and_then(Value::as_str)
}

/// A message's `id`, when it is a request (JSON-RPC: a string, a number,
/// or null); None for a notification (no `id`).
fn request_id(message: &Value) -> Option<Value> {
    message.get("id").cloned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn matcher(methods: &[&str], tools: &[&str]) -> McpMatcher {
        McpMatcher::new(&McpMatch {
            methods: methods.iter().map(|m| m.to_string()).collect(),
            tools: tools.iter().map(|t| t.to_string()).collect(),
        })
    }

    fn call(id: Value, tool: &str) -> Value {
        json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {"name": tool, "arguments": {}}})
    }

    #[test]
    fn only_the_methods_and_tools_named_are_counted() {
        let m = matcher(&["tools/call"], &["search", "github_*"]);
        assert_eq!(m.counted(&call(json!(1), "search")), 1);
        assert_eq!(m.counted(&call(json!(1), "github_issue")), 1);
        assert_eq!(m.counted(&call(json!(1), "fetch")), 0);
        assert_eq!(m.counted(&call(json!(1), "searching")), 0);
        for other in [
            json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}),
            json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}}),
            json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
            json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call"}),
            json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": 3}}),
            json!({"jsonrpc": "2.0", "id": 1, "method": 7}),
            json!({"model": "gpt-4o"}),
            json!("tools/call"),
            json!(null),
        ] {
            assert_eq!(m.counted(&other), 0, "{other}");
        }
        let any_tool = matcher(&["tools/call", "ping"], &[]);
        assert_eq!(any_tool.counted(&call(json!("a"), "fetch")), 1);
        assert_eq!(
            any_tool.counted(&json!({"jsonrpc": "2.0", "id": 2, "method": "ping"})),
            1
        );
    }

    #[test]
    fn a_batch_counts_each_message_it_takes_and_answers_each_element() {
        let m = matcher(&["tools/call"], &["search"]);
        let batch = json!([
            call(json!(1), "search"),
            {"jsonrpc": "2.0", "id": "two", "method": "tools/list"},
            call(json!(3), "search"),
            {"jsonrpc": "2.0", "method": "tools/call", "params": {"name": "search"}},
            7
        ]);
        assert_eq!(m.counted(&batch), 3);
        assert_eq!(
            m.call(&batch),
            Some(RpcCall::Batch(vec![
                (Some(json!(1)), true),
                (Some(json!("two")), false),
                (Some(json!(3)), true),
                (None, true),
                (None, false),
            ]))
        );
        assert_eq!(m.counted(&json!([])), 0);
    }

    #[test]
    fn a_refusal_answers_a_requests_id_and_nobody_for_a_notification() {
        let m = matcher(&["tools/call"], &[]);
        assert_eq!(
            m.call(&call(json!({"odd": "but kept"}), "x")),
            Some(RpcCall::Single(Some(json!({"odd": "but kept"}))))
        );
        assert_eq!(
            m.call(&json!({"jsonrpc": "2.0", "id": null, "method": "tools/call"})),
            Some(RpcCall::Single(Some(Value::Null)))
        );
        assert_eq!(
            m.call(&json!({"jsonrpc": "2.0", "method": "tools/call"})),
            Some(RpcCall::Single(None))
        );
        assert_eq!(m.call(&json!(3)), None);
    }
}
