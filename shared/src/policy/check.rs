//! How a policy's checks report: each error with its field's path, and
//! the checks every concept shares (names, header names, JSON paths).

use std::fmt;

use serde::{Deserialize, Serialize};

use super::bounds;
use crate::duration::DurationMs;
use crate::json_path::JsonPath;

/// One problem with one field.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FieldError {
    /// `policies[2].rate.burst`; empty for the document as a whole.
    pub path: String,
    pub message: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

/// Every problem found, in document order.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ValidationErrors {
    pub errors: Vec<FieldError>,
}

impl fmt::Display for ValidationErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.errors.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl ValidationErrors {
    pub(crate) fn single(path: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            errors: vec![FieldError {
                path: path.into(),
                message: message.into(),
            }],
        }
    }

    pub(crate) fn from_vec(errors: Vec<FieldError>) -> Result<(), Self> {
        if errors.is_empty() {
            Ok(())
        } else {
            Err(Self { errors })
        }
    }
}

/// Collects errors under a path prefix.
pub(crate) struct Report<'a> {
    pub(crate) errors: &'a mut Vec<FieldError>,
    pub(crate) prefix: String,
}

impl<'a> Report<'a> {
    pub(crate) fn new(errors: &'a mut Vec<FieldError>, prefix: &str) -> Self {
        Self {
            errors,
            prefix: prefix.to_string(),
        }
    }

    pub(crate) fn at(&mut self, field: &str, message: impl Into<String>) {
        self.errors.push(FieldError {
            path: join_path(&self.prefix, field),
            message: message.into(),
        });
    }

    pub(crate) fn range_ms(&mut self, field: &str, value: DurationMs, min_ms: u64, max_ms: u64) {
        if value.as_millis() < min_ms {
            self.at(
                field,
                format!("must be at least {}", DurationMs::from_millis(min_ms)),
            );
        } else if value.as_millis() > max_ms {
            self.at(
                field,
                format!("must be at most {}", DurationMs::from_millis(max_ms)),
            );
        }
    }

    pub(crate) fn range_u64(&mut self, field: &str, value: u64, min: u64, max: u64) {
        if value < min {
            self.at(field, format!("must be >= {min}"));
        } else if value > max {
            self.at(field, format!("must be <= {max}"));
        }
    }
}

pub(crate) fn join_path(prefix: &str, field: &str) -> String {
    match (prefix.is_empty(), field.is_empty()) {
        (true, _) => field.to_string(),
        (false, true) => prefix.to_string(),
        (false, false) if field.starts_with('[') => format!("{prefix}{field}"),
        (false, false) => format!("{prefix}.{field}"),
    }
}

pub(crate) fn check_name(r: &mut Report, name: &str) {
    if name.is_empty() {
        r.at("name", "must not be empty");
    } else if name.len() > bounds::MAX_NAME_LEN {
        r.at(
            "name",
            format!("at most {} characters", bounds::MAX_NAME_LEN),
        );
    } else if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        r.at("name", "only letters, digits, '-', '_' and '.' are allowed");
    }
}

/// An HTTP header name (RFC 9110 token), matched case-insensitively.
pub(crate) fn check_header_name(r: &mut Report, field: &str, name: &str) {
    if name.is_empty() {
        r.at(field, "must not be empty");
    } else if name.len() > 256 {
        r.at(field, "at most 256 characters");
    } else if !name.bytes().all(is_token_byte) {
        r.at(field, format!("{name:?} is not a valid header name"));
    }
}

pub(crate) fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

pub(crate) fn check_json_path(r: &mut Report, field: &str, path: &str) {
    if path.len() > bounds::MAX_JSON_PATH_LEN {
        r.at(
            field,
            format!("at most {} characters", bounds::MAX_JSON_PATH_LEN),
        );
    } else if JsonPath::parse(path).is_none() {
        r.at(
            field,
            format!("{path:?} is not a path: names or indexes joined by '.', none empty (usage.total_tokens)"),
        );
    } else if path.split('.').count() > bounds::MAX_JSON_PATH_STEPS {
        r.at(
            field,
            format!(
                "at most {} names or indexes deep",
                bounds::MAX_JSON_PATH_STEPS
            ),
        );
    }
}
