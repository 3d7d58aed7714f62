//! How the core reads a request's headers, whatever holds them (Envoy's
//! header map in the filter, a plain list in tests and tools).

use std::borrow::Cow;

/// Read access to a request's headers. Names are lowercase; the pseudo
/// headers `:authority`, `:path` and `:method` are headers too (as in Envoy).
pub trait RequestHeaders {
    fn header(&self, name: &str) -> Option<Cow<'_, [u8]>>;

    /// Whether the request carries `name`, for a header asked about once
    /// and never read again (a host may answer it without keeping it).
    fn carries(&self, name: &str) -> bool {
        self.header(name).is_some()
    }
}

/// A plain list of headers, for tests and tools.
impl RequestHeaders for [(&str, &[u8])] {
    fn header(&self, name: &str) -> Option<Cow<'_, [u8]>> {
        self.iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| Cow::Borrowed(*v))
    }
}
