//! A request's body as a decision reads it: parsed once (as
//! `sluice_shared::request_json` reads it) for the match, the keys and the
//! costs together; or why it could not be.

use sluice_shared::request_json::{parse_request_json, RequestJsonError};

/// A request's body as a decision reads it: parsed once, for the match,
/// the keys and the costs together.
#[derive(Debug, Clone, PartialEq)]
pub enum BodyJson {
    /// A body follows, not read yet: a policy that reads it asks for it
    /// (`Classified::NeedsBody` in the matcher).
    Coming,
    /// None came (or it was not read): costs from it are their default, a
    /// key from it is missing, a match on it does not hold.
    Absent,
    /// Too large to read: costs from it are their `max`.
    TooLarge,
    /// Read, and not JSON (as [`parse_request_json`] reads it): costs from
    /// it are their `max`.
    Invalid,
    /// Read, and naming this key twice in one object: refused, since the
    /// provider may read it the other way.
    Duplicate(String),
    Json(serde_json::Value),
}

impl BodyJson {
    pub fn parse(body: &[u8]) -> Self {
        match parse_request_json(body) {
            Ok(v) => Self::Json(v),
            Err(RequestJsonError::DuplicateKey(key)) => Self::Duplicate(key),
            Err(RequestJsonError::NotJson(_)) => Self::Invalid,
        }
    }

    pub fn json(&self) -> Option<&serde_json::Value> {
        match self {
            Self::Json(v) => Some(v),
            Self::Coming | Self::Absent | Self::TooLarge | Self::Invalid | Self::Duplicate(_) => {
                None
            }
        }
    }

    /// A body came that cannot be read (too large, not JSON): what it asks
    /// for is not known, though the provider may know it.
    pub fn unreadable(&self) -> bool {
        matches!(self, Self::TooLarge | Self::Invalid | Self::Duplicate(_))
    }
}

/// A request as far as it was read: its headers and its JSON body (if
/// any policy read it), handed on together.
#[derive(Debug)]
pub struct RequestAtHand<'a, R: ?Sized> {
    pub headers: &'a R,
    pub body: &'a BodyJson,
}

impl<'a, R: ?Sized> RequestAtHand<'a, R> {
    pub fn new(headers: &'a R, body: &'a BodyJson) -> Self {
        Self { headers, body }
    }
}

impl<R: ?Sized> Clone for RequestAtHand<'_, R> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<R: ?Sized> Copy for RequestAtHand<'_, R> {}
