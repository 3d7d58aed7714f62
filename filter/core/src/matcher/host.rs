//! Which hosts a policy's `match.host` takes: exact, `*.` wildcards, any;
//! with or without the port a request carries.

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum HostPattern {
    Any,
    Exact(String),
    /// `*.example.com` stored as `.example.com`.
    Suffix(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HostMatcher {
    pub(crate) pattern: HostPattern,
    /// When the pattern names a port, the request's port must equal it.
    pub(crate) port: Option<String>,
}

impl HostMatcher {
    pub(crate) fn new(host: &str) -> Self {
        if host == "*" {
            return Self {
                pattern: HostPattern::Any,
                port: None,
            };
        }
        let (name, port) = split_port(host.as_bytes());
        let name = String::from_utf8_lossy(name).to_ascii_lowercase();
        let port = port.map(|p| String::from_utf8_lossy(p).into_owned());
        let pattern = match name.strip_prefix('*') {
            Some(suffix) => HostPattern::Suffix(suffix.to_string()),
            None => HostPattern::Exact(name),
        };
        Self { pattern, port }
    }

    /// Whether `authority` is this host. A pattern naming a port matches
    /// that port, or no port at all: an Envoy that strips ports before
    /// filters run (`strip_any_host_port`) hides it, and a limit that
    /// stopped applying then would fail open. It matches by the name
    /// alone then (see [`Self::port_hidden`]).
    pub(crate) fn matches(&self, authority: &[u8]) -> bool {
        // Most authorities come exactly as configured.
        if let (HostPattern::Exact(host), None) = (&self.pattern, &self.port) {
            if authority == host.as_bytes() {
                return true;
            }
        }
        let (name, port) = split_port(authority);
        let name = name.strip_suffix(b".").unwrap_or(name);
        if let (Some(want), Some(port)) = (&self.port, port) {
            if port != want.as_bytes() {
                return false;
            }
        }
        match &self.pattern {
            HostPattern::Any => true,
            HostPattern::Exact(host) => name.eq_ignore_ascii_case(host.as_bytes()),
            HostPattern::Suffix(suffix) => {
                name.len() > suffix.len()
                    && name[name.len() - suffix.len()..].eq_ignore_ascii_case(suffix.as_bytes())
            }
        }
    }
}

impl HostMatcher {
    /// The pattern names a port the request's authority does not carry:
    /// matched by the name alone.
    pub(crate) fn port_hidden(&self, authority: Option<&[u8]>) -> bool {
        self.port.is_some() && authority.is_some_and(|a| split_port(a).1.is_none())
    }
}

/// Splits `host:port` / `[v6]:port`; a trailing part that is not all digits
/// is not a port.
fn split_port(authority: &[u8]) -> (&[u8], Option<&[u8]>) {
    if authority.first() == Some(&b'[') {
        if let Some(close) = authority.iter().position(|&b| b == b']') {
            let rest = &authority[close + 1..];
            return match rest.strip_prefix(b":") {
                Some(port) if !port.is_empty() => (&authority[..=close], Some(port)),
                _ => (&authority[..=close], None),
            };
        }
        return (authority, None);
    }
    match authority.iter().rposition(|&b| b == b':') {
        Some(i) if i + 1 < authority.len() && authority[i + 1..].iter().all(u8::is_ascii_digit) => {
            (&authority[..i], Some(&authority[i + 1..]))
        }
        _ => (authority, None),
    }
}
