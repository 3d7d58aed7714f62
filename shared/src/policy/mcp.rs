//! Agents' tool calls over MCP (`match.mcp`): which JSON-RPC messages a
//! policy counts, and their checks.

use serde::{Deserialize, Serialize};

use super::check::Report;

#[cfg(feature = "schema")]
use schemars::JsonSchema;

/// The policy takes the JSON-RPC 2.0 messages an MCP client POSTs
/// (Streamable HTTP) whose `method` is one of `methods` and, when `tools`
/// are given, whose `params.name` (the tool) is one of them. A body that
/// is a batch (a JSON array) counts each message it takes: a batch is
/// admitted or refused whole. Other messages (`initialize`, `tools/list`,
/// `ping`, notifications) go on to the next policy unless `methods` names
/// them. A refused request is answered with a JSON-RPC error carrying its
/// `id`; a refused notification with `on_limit.status` and no body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct McpMatch {
    /// JSON-RPC methods counted; default `["tools/call"]`.
    #[serde(default = "McpMatch::default_methods")]
    pub methods: Vec<String>,
    /// Tools counted (`search`; `github_*` for every tool it begins);
    /// empty: every tool.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<String>,
}

impl McpMatch {
    pub const TOOL_CALL: &'static str = "tools/call";
    pub const MAX_METHODS: usize = 32;
    pub const MAX_TOOLS: usize = 256;
    pub const MAX_NAME_LEN: usize = 128;

    fn default_methods() -> Vec<String> {
        vec![Self::TOOL_CALL.to_string()]
    }
}

impl Default for McpMatch {
    /// Every tool call (`"mcp": {}`).
    fn default() -> Self {
        Self {
            methods: Self::default_methods(),
            tools: Vec::new(),
        }
    }
}

pub(crate) fn check_mcp(r: &mut Report, m: &McpMatch) {
    if m.methods.is_empty() {
        r.at(
            "match.mcp.methods",
            "name at least one JSON-RPC method (`tools/call`), or leave it out",
        );
    }
    if m.methods.len() > McpMatch::MAX_METHODS {
        r.at(
            "match.mcp.methods",
            format!("at most {} methods", McpMatch::MAX_METHODS),
        );
    }
    for (i, method) in m.methods.iter().enumerate() {
        if let Some(why) = bad_name(method, false) {
            r.at(&format!("match.mcp.methods[{i}]"), why);
        }
    }
    if m.tools.len() > McpMatch::MAX_TOOLS {
        r.at(
            "match.mcp.tools",
            format!("at most {} tools", McpMatch::MAX_TOOLS),
        );
    }
    for (i, tool) in m.tools.iter().enumerate() {
        if let Some(why) = bad_name(tool, true) {
            r.at(&format!("match.mcp.tools[{i}]"), why);
        }
    }
    if !m.tools.is_empty() && !m.methods.iter().any(|x| x == McpMatch::TOOL_CALL) {
        r.at(
            "match.mcp.tools",
            "tools are named by `tools/call` messages: add it to `methods`",
        );
    }
}

fn bad_name(name: &str, pattern: bool) -> Option<String> {
    let bare = if pattern {
        name.strip_suffix('*').unwrap_or(name)
    } else {
        name
    };
    if bare.is_empty() || name.len() > McpMatch::MAX_NAME_LEN {
        return Some(format!("1 to {} characters", McpMatch::MAX_NAME_LEN));
    }
    if bare.contains('*') {
        return Some("`*` only at its end".into());
    }
    if name.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Some("no spaces or control characters".into());
    }
    None
}
