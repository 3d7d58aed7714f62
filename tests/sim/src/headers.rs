//! Headers as the simulation holds them: a request's or an answer's.

use std::borrow::Cow;

use sluice_shared::request_headers::RequestHeaders;
use sluice_shared::time::Span;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Headers(pub Vec<(String, Vec<u8>)>);

impl Headers {
    pub fn of(pairs: &[(&str, &str)]) -> Self {
        Self(
            pairs
                .iter()
                .map(|(n, v)| (n.to_ascii_lowercase(), v.as_bytes().to_vec()))
                .collect(),
        )
    }

    pub fn set(&mut self, name: &str, value: &str) {
        self.remove(name);
        self.0
            .push((name.to_ascii_lowercase(), value.as_bytes().to_vec()));
    }

    pub fn remove(&mut self, name: &str) {
        self.0.retain(|(n, _)| !n.eq_ignore_ascii_case(name));
    }

    /// The wait a `Retry-After` of whole seconds asks for.
    pub fn retry_after(&self) -> Option<Span> {
        let value = self.header("retry-after")?;
        let seconds: u64 = std::str::from_utf8(&value).ok()?.trim().parse().ok()?;
        Some(Span::from_secs(seconds))
    }

    pub fn text(&self, name: &str) -> Option<String> {
        self.header(name)
            .map(|v| String::from_utf8_lossy(&v).into_owned())
    }
}

impl RequestHeaders for Headers {
    fn header(&self, name: &str) -> Option<Cow<'_, [u8]>> {
        self.0
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| Cow::Borrowed(v.as_slice()))
    }
}
