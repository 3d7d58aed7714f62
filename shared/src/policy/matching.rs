//! Which calls a policy takes (`match`): host, path, method, headers and
//! the JSON body, and their checks.

use serde::{Deserialize, Serialize};

use super::bounds;
use super::check::{check_header_name, check_json_path, Report};
use super::mcp::{check_mcp, McpMatch};

#[cfg(feature = "schema")]
use schemars::JsonSchema;
/// Which requests a policy applies to. Every given condition must hold.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct MatchSpec {
    /// Destination host (the request's `:authority`): `api.bank.example`,
    /// `api.bank.example:8443`, `*.bank.example` (any subdomain) or `*` (any).
    pub host: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path_prefix: Option<String>,
    /// Empty means any method.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub methods: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<HeaderEquals>,
    /// Fields of the request's JSON body (`model` is `gpt-4o`). Only a
    /// policy with such conditions reads the body (up to 1 MiB). A body
    /// that lacks the field, or holds another value, does not match, and
    /// the request goes on to the next policy; one that cannot be read
    /// (not JSON, over 1 MiB) falls under this policy, unless
    /// `unreadable` says `next`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub json: Vec<JsonMatch>,
    /// MCP tool calls: the JSON-RPC messages (by method and tool) this
    /// policy counts. The policy reads the body.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mcp: Option<McpMatch>,
    /// Where a call whose headers match goes when its body cannot be read
    /// (not JSON, over 1 MiB, cut by trailers Sluice could not read):
    /// `match` (the default) decides it under this policy, its costs at
    /// their most; `next` passes it on to the next policy, which must then
    /// be as strict, since the provider may read the body all the same.
    #[serde(default, skip_serializing_if = "Unreadable::is_match")]
    pub unreadable: Unreadable,
}

/// See [`MatchSpec::unreadable`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Unreadable {
    /// The call falls under this policy (fail closed).
    #[default]
    Match,
    /// The call goes on to the next policy.
    Next,
}

impl Unreadable {
    fn is_match(&self) -> bool {
        *self == Self::Match
    }
}

impl MatchSpec {
    /// Whether matching a request takes its body.
    pub fn reads_request_body(&self) -> bool {
        !self.json.is_empty() || self.mcp.is_some()
    }
}

/// A condition on one field of the request's JSON body: exactly one of
/// `equals`, `prefix` and `one_of`. A string field is compared as it is; a
/// number or `true`/`false` as its JSON text (`3`, `true`); anything else
/// (an object, a list, `null`) matches nothing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct JsonMatch {
    /// A dotted path into the body: `model`, `metadata.team`, `input.0.role`.
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub equals: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub one_of: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct HeaderEquals {
    pub name: String,
    pub equals: String,
}

const KNOWN_METHODS: &[&str] = &[
    "GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "CONNECT", "TRACE",
];

pub(crate) fn check_match(r: &mut Report, m: &MatchSpec) {
    check_host(r, &m.host);
    check_json_matches(r, &m.json);
    if let Some(mcp) = &m.mcp {
        check_mcp(r, mcp);
    }
    if m.unreadable == Unreadable::Next && !m.reads_request_body() {
        r.at(
            "match.unreadable",
            "applies only with `match.json` or `match.mcp`: without conditions on the body a policy matches by its headers alone",
        );
    }
    if let Some(prefix) = &m.path_prefix {
        if !prefix.starts_with('/') {
            r.at("match.path_prefix", "must start with '/'");
        } else if prefix.len() > bounds::MAX_PATH_PREFIX_LEN {
            r.at(
                "match.path_prefix",
                format!("at most {} characters", bounds::MAX_PATH_PREFIX_LEN),
            );
        } else if prefix.bytes().any(|b| b <= b' ' || b == 0x7f) {
            r.at(
                "match.path_prefix",
                "must not contain spaces or control characters",
            );
        }
    }
    for (i, method) in m.methods.iter().enumerate() {
        if !KNOWN_METHODS.iter().any(|k| k.eq_ignore_ascii_case(method)) {
            r.at(
                &format!("match.methods[{i}]"),
                format!(
                    "unknown method {method:?}, expected one of {}",
                    KNOWN_METHODS.join(", ")
                ),
            );
        }
    }
    if m.headers.len() > bounds::MAX_HEADER_MATCHES {
        r.at(
            "match.headers",
            format!("at most {} header conditions", bounds::MAX_HEADER_MATCHES),
        );
    }
    for (i, h) in m.headers.iter().enumerate() {
        check_header_name(r, &format!("match.headers[{i}].name"), &h.name);
        if h.equals.len() > bounds::MAX_HEADER_VALUE_LEN {
            r.at(
                &format!("match.headers[{i}].equals"),
                format!("at most {} characters", bounds::MAX_HEADER_VALUE_LEN),
            );
        } else if h.equals.chars().any(|c| c.is_control()) {
            r.at(
                &format!("match.headers[{i}].equals"),
                "must not contain control characters",
            );
        }
    }
}

pub(crate) fn check_host(r: &mut Report, host: &str) {
    if host.is_empty() {
        r.at(
            "match.host",
            "must not be empty; use \"*\" to match any host",
        );
        return;
    }
    if host == "*" {
        return;
    }
    if host.len() > bounds::MAX_HOST_LEN {
        r.at(
            "match.host",
            format!("at most {} characters", bounds::MAX_HOST_LEN),
        );
        return;
    }
    let exact = host.strip_prefix("*.").unwrap_or(host);
    if exact.is_empty() {
        r.at(
            "match.host",
            "\"*.\" needs a domain after it, e.g. \"*.example.com\"",
        );
    } else if exact.contains('*') {
        r.at(
            "match.host",
            "'*' is allowed only as \"*\" or as a leading \"*.\" (e.g. \"*.example.com\")",
        );
    } else if !exact
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b':' | b'[' | b']'))
    {
        r.at(
            "match.host",
            "only letters, digits, '-', '.', and an optional \":port\" are allowed",
        );
    } else if let Some(port) = port_of(exact) {
        if port.parse::<u16>().map_or(true, |p| p == 0) {
            r.at("match.host", format!("invalid port {port:?}"));
        }
    }
}

/// The port part of `host:port` or `[v6]:port`, if any.
pub(crate) fn port_of(host: &str) -> Option<&str> {
    if let Some(rest) = host.strip_prefix('[') {
        let close = rest.find(']')?;
        return rest[close + 1..].strip_prefix(':');
    }
    host.rsplit_once(':').map(|(_, port)| port)
}

/// Conditions on the request's JSON body: a path each, and exactly one of
/// `equals`, `prefix` and `one_of`, with values as bounded as a header's.
pub(crate) fn check_json_matches(r: &mut Report, matches: &[JsonMatch]) {
    if matches.len() > bounds::MAX_JSON_MATCHES {
        r.at(
            "match.json",
            format!("at most {} body conditions", bounds::MAX_JSON_MATCHES),
        );
    }
    for (i, m) in matches.iter().enumerate() {
        let at = |field: &str| format!("match.json[{i}]{field}");
        check_json_path(r, &at(".path"), &m.path);
        let given = usize::from(m.equals.is_some())
            + usize::from(m.prefix.is_some())
            + usize::from(!m.one_of.is_empty());
        if given != 1 {
            r.at(
                &at(""),
                "give exactly one of `equals`, `prefix` and `one_of`",
            );
        }
        if m.one_of.len() > bounds::MAX_JSON_ONE_OF {
            r.at(
                &at(".one_of"),
                format!("at most {} values", bounds::MAX_JSON_ONE_OF),
            );
        }
        let values = m
            .equals
            .iter()
            .map(|v| (at(".equals"), v))
            .chain(m.prefix.iter().map(|v| (at(".prefix"), v)))
            .chain(
                m.one_of
                    .iter()
                    .enumerate()
                    .map(|(j, v)| (at(&format!(".one_of[{j}]")), v)),
            );
        for (field, value) in values {
            if value.len() > bounds::MAX_HEADER_VALUE_LEN {
                r.at(
                    &field,
                    format!("at most {} characters", bounds::MAX_HEADER_VALUE_LEN),
                );
            }
        }
    }
}
