//! A request's JSON body read as the upstream will read it, or refused
//! where two readers could disagree: Sluice matches, keys and prices on
//! what it reads, and a body it reads one way and the provider another
//! would let a caller choose its own policy. So a leading UTF-8 byte order
//! mark is skipped (providers' parsers skip it), and an object naming one
//! key twice (or two keys that differ only in case, which Go's decoder
//! takes for one) is refused: parsers differ on whether the first or the
//! last wins.

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

/// Why a request body cannot be read as one JSON document.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestJsonError {
    #[error("the request's body is not JSON: {0}")]
    NotJson(String),
    /// The key, as the body spells it the second time.
    #[error("the request's body names {0:?} twice in one object")]
    DuplicateKey(String),
}

/// Marks the message of a duplicate key inside serde's error.
const DUPLICATE: &str = "sluice duplicate key: ";

/// `body` as JSON; see the module docs.
pub fn parse_request_json(body: &[u8]) -> Result<Value, RequestJsonError> {
    let body = body.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(body);
    let mut de = serde_json::Deserializer::from_slice(body);
    let value = Strict.deserialize(&mut de).map_err(classify)?;
    de.end().map_err(classify)?;
    Ok(value)
}

fn classify(e: serde_json::Error) -> RequestJsonError {
    let text = e.to_string();
    match text.strip_prefix(DUPLICATE) {
        Some(rest) => {
            // serde_json appends " at line L column C".
            let key = rest.rsplit_once(" at line ").map_or(rest, |(k, _)| k);
            RequestJsonError::DuplicateKey(key.to_string())
        }
        None => RequestJsonError::NotJson(text),
    }
}

/// A JSON value whose objects name each key once.
struct Strict;

impl<'de> DeserializeSeed<'de> for Strict {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Strict {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(Strict)? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        // Keys folded to lower case: two that differ only in case are
        // one key to a case-insensitive decoder.
        let mut seen = std::collections::HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            if !seen.insert(key.to_ascii_lowercase()) {
                return Err(de::Error::custom(format!("{DUPLICATE}{key}")));
            }
            let value = map.next_value_seed(Strict)?;
            out.insert(key, value);
        }
        Ok(Value::Object(out))
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use serde_json::json;

    use super::*;

    #[test]
    fn reads_what_serde_reads_and_skips_a_byte_order_mark() {
        let body = br#"{"model": "gpt-4o", "n": 2, "x": [1.5, null, true, {"a": -3}]}"#;
        let want: Value = serde_json::from_slice(body).unwrap_or_default();
        assert_eq!(parse_request_json(body), Ok(want.clone()));
        let with_bom = [b"\xEF\xBB\xBF".as_slice(), body].concat();
        assert_eq!(parse_request_json(&with_bom), Ok(want));
    }

    #[test]
    fn a_key_named_twice_anywhere_is_refused_in_either_order_and_any_case() {
        for body in [
            r#"{"model": "gpt-4o-mini", "model": "gpt-4o"}"#,
            r#"{"model": "gpt-4o", "model": "gpt-4o-mini"}"#,
            r#"{"Model": "gpt-4o", "model": "gpt-4o-mini"}"#,
            r#"{"messages": [{"role": "user", "content": "a", "content": "b"}]}"#,
        ] {
            assert!(
                matches!(
                    parse_request_json(body.as_bytes()),
                    Err(RequestJsonError::DuplicateKey(_))
                ),
                "{body}"
            );
        }
        assert_eq!(
            parse_request_json(br#"{"model": "a", "model": "b"}"#),
            Err(RequestJsonError::DuplicateKey("model".into()))
        );
        assert_eq!(
            parse_request_json(br#"{"a": {"b": 1}, "c": {"b": 2}}"#),
            Ok(json!({"a": {"b": 1}, "c": {"b": 2}}))
        );
    }

    #[test]
    fn what_is_not_one_json_document_is_refused() {
        for body in [
            &b""[..],
            b"not json",
            b"{\"a\": 1} trailing",
            b"{\"a\": 1",
            b"\xff\xfe",
        ] {
            assert!(
                matches!(parse_request_json(body), Err(RequestJsonError::NotJson(_))),
                "{body:?}"
            );
        }
    }

    proptest! {
        /// Whatever serde_json reads without a duplicate key reads the
        /// same here; nothing panics.
        #[test]
        fn agrees_with_serde_on_any_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let ours = parse_request_json(&bytes);
            if let Ok(v) = &ours {
                let theirs: Result<Value, _> = serde_json::from_slice(
                    bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(&bytes),
                );
                let theirs = theirs.ok();
                prop_assert_eq!(theirs.as_ref(), Some(v));
            }
        }
    }
}
