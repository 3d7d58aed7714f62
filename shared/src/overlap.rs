//! Whether two policies' matches on a request's headers can both hold for
//! one request: the host, the path, the method and the header conditions
//! (not the body's, which the question is asked to do without). When it
//! cannot be told, they overlap: validation refuses on an overlap, and a
//! refusal it need not make is safer than a hole it misses.

use crate::policy::matching::MatchSpec;

/// A host pattern as `match.host` reads: any, one name, or the names
/// under a domain; the port when it names one. A pattern naming a port
/// also matches a request without one (see the filter's host matcher).
#[derive(Debug, PartialEq, Eq)]
enum Host {
    Any,
    Exact(String, Option<String>),
    /// `*.example.com`, as `.example.com`.
    Under(String, Option<String>),
}

impl Host {
    fn of(pattern: &str) -> Self {
        if pattern == "*" {
            return Self::Any;
        }
        let lower = pattern.to_ascii_lowercase();
        let (name, port) = split_port(&lower);
        match name.strip_prefix('*') {
            Some(domain) => Self::Under(domain.to_string(), port),
            None => Self::Exact(name.to_string(), port),
        }
    }

    fn overlaps(&self, other: &Self) -> bool {
        let ports = |a: &Option<String>, b: &Option<String>| match (a, b) {
            (Some(a), Some(b)) => a == b,
            _ => true,
        };
        match (self, other) {
            (Self::Any, _) | (_, Self::Any) => true,
            (Self::Exact(a, pa), Self::Exact(b, pb)) => a == b && ports(pa, pb),
            (Self::Exact(name, pe), Self::Under(domain, pu))
            | (Self::Under(domain, pu), Self::Exact(name, pe)) => {
                name.len() > domain.len() && name.ends_with(domain.as_str()) && ports(pe, pu)
            }
            (Self::Under(a, pa), Self::Under(b, pb)) => {
                (a.ends_with(b.as_str()) || b.ends_with(a.as_str())) && ports(pa, pb)
            }
        }
    }
}

/// `name:port` or `[v6]:port`; a tail that is not all digits is no port.
fn split_port(host: &str) -> (&str, Option<String>) {
    if host.starts_with('[') {
        if let Some(close) = host.find(']') {
            let port = host[close + 1..].strip_prefix(':').map(str::to_string);
            return (&host[..=close], port.filter(|p| !p.is_empty()));
        }
        return (host, None);
    }
    match host.rsplit_once(':') {
        Some((name, port)) if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => {
            (name, Some(port.to_string()))
        }
        _ => (host, None),
    }
}

/// Whether one request can meet both `a`'s and `b`'s conditions on its
/// headers.
pub fn headers_overlap(a: &MatchSpec, b: &MatchSpec) -> bool {
    if !Host::of(&a.host).overlaps(&Host::of(&b.host)) {
        return false;
    }
    if let (Some(pa), Some(pb)) = (&a.path_prefix, &b.path_prefix) {
        if !pa.starts_with(pb.as_str()) && !pb.starts_with(pa.as_str()) {
            return false;
        }
    }
    if !a.methods.is_empty()
        && !b.methods.is_empty()
        && !a
            .methods
            .iter()
            .any(|m| b.methods.iter().any(|n| m.eq_ignore_ascii_case(n)))
    {
        return false;
    }
    // A header both name, with other values, cannot hold for both.
    !a.headers.iter().any(|ha| {
        b.headers
            .iter()
            .any(|hb| ha.name.eq_ignore_ascii_case(&hb.name) && ha.equals != hb.equals)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::matching::HeaderEquals;

    fn spec(
        host: &str,
        path: Option<&str>,
        methods: &[&str],
        headers: &[(&str, &str)],
    ) -> MatchSpec {
        MatchSpec {
            host: host.into(),
            path_prefix: path.map(str::to_string),
            methods: methods.iter().map(|m| m.to_string()).collect(),
            headers: headers
                .iter()
                .map(|(n, v)| HeaderEquals {
                    name: n.to_string(),
                    equals: v.to_string(),
                })
                .collect(),
            json: Vec::new(),
            mcp: None,
            unreadable: Default::default(),
        }
    }

    fn both_ways(a: &MatchSpec, b: &MatchSpec) -> bool {
        let (ab, ba) = (headers_overlap(a, b), headers_overlap(b, a));
        assert_eq!(ab, ba, "{a:?} {b:?}");
        ab
    }

    #[test]
    fn hosts_overlap_when_one_request_can_name_both() {
        let host = |h| spec(h, None, &[], &[]);
        assert!(both_ways(&host("*"), &host("api.llm.example")));
        assert!(both_ways(
            &host("API.llm.example"),
            &host("api.llm.example")
        ));
        assert!(both_ways(&host("*.llm.example"), &host("api.llm.example")));
        assert!(both_ways(&host("*.example"), &host("*.llm.example")));
        assert!(both_ways(
            &host("api.llm.example:443"),
            &host("api.llm.example")
        ));
        assert!(!both_ways(
            &host("api.llm.example:443"),
            &host("api.llm.example:8443")
        ));
        assert!(!both_ways(
            &host("api.bank.example"),
            &host("api.llm.example")
        ));
        assert!(!both_ways(&host("*.llm.example"), &host("llm.example")));
        assert!(!both_ways(&host("*.bank.example"), &host("*.llm.example")));
    }

    #[test]
    fn paths_methods_and_headers_must_all_allow_one_request() {
        let base = |path, methods: &[&str], headers: &[(&str, &str)]| {
            spec("api.llm.example", path, methods, headers)
        };
        assert!(both_ways(
            &base(Some("/v1"), &[], &[]),
            &base(Some("/v1/chat"), &[], &[])
        ));
        assert!(both_ways(
            &base(None, &[], &[]),
            &base(Some("/v1/chat"), &[], &[])
        ));
        assert!(!both_ways(
            &base(Some("/v1/chat"), &[], &[]),
            &base(Some("/v1/embed"), &[], &[])
        ));
        assert!(both_ways(
            &base(None, &["post"], &[]),
            &base(None, &["GET", "POST"], &[])
        ));
        assert!(!both_ways(
            &base(None, &["GET"], &[]),
            &base(None, &["POST"], &[])
        ));
        assert!(both_ways(&base(None, &["GET"], &[]), &base(None, &[], &[])));
        assert!(both_ways(
            &base(None, &[], &[("x-team", "a")]),
            &base(None, &[], &[("x-env", "prod")])
        ));
        assert!(!both_ways(
            &base(None, &[], &[("x-team", "a")]),
            &base(None, &[], &[("X-Team", "b")])
        ));
    }
}
