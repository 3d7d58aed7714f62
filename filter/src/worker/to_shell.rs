//! What the worker asks the shell to do with a stream: answer it
//! ([`LocalReply`]), or, from a tick, act on a paused one
//! ([`StreamAction`]). A leaf: the parts that decide import it, it
//! imports none of them.

/// Header naming why a call was refused when the limit alone does not say.
pub const REASON_HEADER: &str = "x-sluice-reason";

/// Header naming which of a policy's further limits refused a call.
pub const LIMIT_HEADER: &str = "x-sluice-limit";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalReply {
    pub status: u32,
    pub headers: Vec<(&'static str, String)>,
    pub body: Vec<u8>,
}

impl LocalReply {
    /// Its headers as [`crate::host::Host::reply`] takes them.
    pub fn header_pairs(&self) -> Vec<(&str, &str)> {
        self.headers.iter().map(|(n, v)| (*n, v.as_str())).collect()
    }

    /// The value of its header `name`, if it has one.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// What the tick asks the glue to do to a paused stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamAction {
    /// Set a header of the paused request before it resumes (a pool call's
    /// member: Envoy routes by it).
    SetHeader(u32, String, String),
    /// Set a field of the stream's decision for Envoy's access log
    /// ([`super::decision_log`]), before it goes or is answered.
    LogField(u32, &'static str, String),
    Resume(u32),
    Reply(u32, LocalReply),
}
