//! What a policy reads from a request besides its match: a key (a header
//! or a body field), a test on the JSON body, a cost from a header. Raw
//! bytes: a request may carry anything, and none of it may cause a panic.

use std::borrow::Cow;

use sluice_shared::json_path::JsonPath;
use sluice_shared::key_hash::KeySecret;
use sluice_shared::key_view::join_pair;
use sluice_shared::policy::{CostSpec, JsonMatch, KeySpec};
use sluice_shared::request_headers::RequestHeaders;

use crate::body::BodyJson;
use crate::pricing::UNPRICED;

/// Tokens a request takes under `spec`: a header value that is not a
/// whole number gives the default, one above `max` counts as `max`, 0
/// counts as 1.
pub(crate) fn cost_of<R: RequestHeaders + ?Sized>(
    spec: &CostSpec,
    header: Option<&str>,
    req: &R,
) -> u64 {
    match spec {
        CostSpec::Fixed(n) => (*n).max(1),
        // Without the body (the policy's own cost, refused by validation).
        CostSpec::FromRequestJson(j) => j.default.clamp(1, j.max.max(1)),
        CostSpec::Price(_) => UNPRICED,
        CostSpec::FromHeader(spec) => {
            let parsed = header
                .and_then(|h| req.header(h))
                .and_then(|v| parse_whole_number(&v));
            parsed.unwrap_or(spec.default).clamp(1, spec.max.max(1))
        }
    }
}

pub(crate) fn cost_header_of(cost: &CostSpec) -> Option<String> {
    match cost {
        CostSpec::FromHeader(h) => Some(h.header.to_ascii_lowercase()),
        CostSpec::Fixed(_) | CostSpec::FromRequestJson(_) | CostSpec::Price(_) => None,
    }
}

pub(crate) fn trim_ascii(v: &[u8]) -> &[u8] {
    v.trim_ascii()
}

/// Digits only (surrounding spaces allowed); anything else, or a number past
/// u64, is None.
pub(crate) fn parse_whole_number(v: &[u8]) -> Option<u64> {
    let v = v.trim_ascii();
    if v.is_empty() || v.len() > 20 || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    v.iter().try_fold(0u64, |acc, d| {
        acc.checked_mul(10)?.checked_add(u64::from(d - b'0'))
    })
}

/// Where a key's value comes from: a request header, a field of the
/// request's JSON body, or both (one key per pair of values).
#[derive(Debug, Clone)]
pub(crate) enum KeySource {
    /// Lower case, as Envoy gives header names.
    Header(String),
    Json(JsonPath),
    /// The header's value and the field's, joined
    /// ([`join_pair`]).
    Pair(String, JsonPath),
}

impl KeySource {
    /// From a validated spec (None for one that names no source).
    pub(crate) fn new(spec: &KeySpec) -> Option<Self> {
        match (&spec.header, &spec.json) {
            (Some(header), Some(path)) => {
                JsonPath::parse(path).map(|path| Self::Pair(header.to_ascii_lowercase(), path))
            }
            (Some(header), None) => Some(Self::Header(header.to_ascii_lowercase())),
            (None, Some(path)) => JsonPath::parse(path).map(Self::Json),
            (None, None) => None,
        }
    }

    pub(crate) fn header(&self) -> Option<&str> {
        match self {
            Self::Header(h) | Self::Pair(h, _) => Some(h),
            Self::Json(_) => None,
        }
    }

    /// The key's value (None: absent; such calls share one bucket).
    pub(crate) fn value<'r, R: RequestHeaders + ?Sized>(
        &self,
        req: &'r R,
        body: &'r BodyJson,
    ) -> Option<Cow<'r, [u8]>> {
        match self {
            Self::Header(h) => req.header(h),
            Self::Json(path) => match path.text_in(body.json()?)? {
                Cow::Borrowed(s) => Some(Cow::Borrowed(s.as_bytes())),
                Cow::Owned(s) => Some(Cow::Owned(s.into_bytes())),
            },
            Self::Pair(h, path) => {
                let field = path.text_in(body.json()?)?;
                let header = req.header(h).unwrap_or_default();
                join_pair(&header, field.as_bytes()).map(Cow::Owned)
            }
        }
    }

    /// A body field the body lacks (a missing header is an ordinary key:
    /// the empty one).
    pub(crate) fn unread(&self, body: &BodyJson) -> bool {
        match self {
            Self::Header(_) => false,
            Self::Json(path) | Self::Pair(_, path) => {
                body.json().and_then(|v| path.text_in(v)).is_none()
            }
        }
    }
}

/// One condition of `match.json`, ready to test.
#[derive(Debug, Clone)]
pub(crate) struct BodyMatch {
    path: JsonPath,
    test: BodyTest,
}

#[derive(Debug, Clone)]
pub(crate) enum BodyTest {
    Equals(String),
    Prefix(String),
    OneOf(Vec<String>),
}

impl BodyMatch {
    /// From a validated condition (exactly one test).
    pub(crate) fn new(spec: &JsonMatch) -> Option<Self> {
        let test = match (&spec.equals, &spec.prefix) {
            (Some(v), _) => BodyTest::Equals(v.clone()),
            (None, Some(p)) => BodyTest::Prefix(p.clone()),
            (None, None) => BodyTest::OneOf(spec.one_of.clone()),
        };
        Some(Self {
            path: JsonPath::parse(&spec.path)?,
            test,
        })
    }

    /// None: the body lacks the field (or holds no text there).
    pub(crate) fn holds(&self, json: &serde_json::Value) -> Option<bool> {
        let text = self.path.text_in(json)?;
        Some(match &self.test {
            BodyTest::Equals(want) => *text == **want,
            BodyTest::Prefix(prefix) => text.starts_with(prefix.as_str()),
            BodyTest::OneOf(values) => values.iter().any(|v| *v == *text),
        })
    }
}

/// What a request's keys are hashed with: this Envoy's own secret, and
/// the label secret (the same on every Envoy and after a restart, when an
/// admin is there) for what must hash alike across the fleet: the keys of
/// limits that spend over hours, and fair keys.
#[derive(Debug, Clone, Copy)]
pub struct KeySecrets<'a> {
    pub own: &'a KeySecret,
    pub label: Option<&'a KeySecret>,
}

impl<'a> KeySecrets<'a> {
    pub fn new(own: &'a KeySecret, label: Option<&'a KeySecret>) -> Self {
        Self { own, label }
    }
}
