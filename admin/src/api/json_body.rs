//! A request's JSON body as the type a handler takes, or a 422 that names
//! the field serde stopped at.

use serde::de::DeserializeOwned;
use serde_json::Value;
use sluice_shared::{FieldError, ValidationErrors};

use crate::error::ApiError;

/// A JSON body as `T`, or 422 naming the field serde stopped at.
pub(super) fn parse<T: DeserializeOwned>(body: Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(body).map_err(|e| {
        let path = e.path().to_string();
        ApiError::InvalidRequest(ValidationErrors {
            errors: vec![FieldError {
                path: if path == "." { String::new() } else { path },
                message: e.inner().to_string(),
            }],
        })
    })
}
