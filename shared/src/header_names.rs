//! What a request header name means beyond its text: whether it carries
//! a credential, frames the message, or belongs to one hop only. A policy
//! may not write into such a header (a pool's `route_header`) nor show its
//! values to viewers (`key.label: value`).

/// Headers that carry a caller's or an upstream's secret.
const CREDENTIALS: &[&str] = &[
    "authorization",
    "proxy-authorization",
    "cookie",
    "x-api-key",
    "api-key",
];

/// Headers that frame the message or name its destination: Envoy and the
/// upstream read them as the request's shape, not as a value of Sluice's.
const FRAMING: &[&str] = &[
    "host",
    "content-length",
    "content-type",
    "content-encoding",
    "expect",
];

/// Hop-by-hop headers (RFC 9110 7.6.1): Envoy removes or rewrites them
/// between hops.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Whether `name` is a valid header name: 1 to 256 token characters
/// (RFC 9110).
pub fn is_valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 256
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// Whether `name` (any case) carries a credential.
pub fn is_credential(name: &str) -> bool {
    CREDENTIALS.iter().any(|c| c.eq_ignore_ascii_case(name))
}

/// Why Sluice must not write into request header `name` (any case), or
/// None when it may: a pseudo-header, a credential, the message's framing
/// or destination, or a hop-by-hop header.
pub fn not_writable(name: &str) -> Option<&'static str> {
    let is = |list: &[&str]| list.iter().any(|h| h.eq_ignore_ascii_case(name));
    if name.starts_with(':') {
        Some("a pseudo-header names the request itself")
    } else if is_credential(name) {
        Some("it carries a credential")
    } else if is(FRAMING) {
        Some("it frames the message or names its destination")
    } else if is(HOP_BY_HOP) {
        Some("it is a hop-by-hop header, removed or rewritten between hops")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_framing_and_hops_are_not_writable_in_any_case() {
        for name in [
            "Authorization",
            "COOKIE",
            "x-api-key",
            "Host",
            "content-length",
            "Transfer-Encoding",
            "connection",
            ":authority",
        ] {
            assert!(not_writable(name).is_some(), "{name}");
        }
        for name in ["x-sluice-member", "x-route", "x-api-version"] {
            assert_eq!(not_writable(name), None, "{name}");
        }
        assert!(is_credential("Proxy-Authorization"));
        assert!(!is_credential("x-tenant"));
    }
}
