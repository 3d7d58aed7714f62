//! Durations in policies: `"250ms"`, `"1s"`, `"1m"`, `"1h"`, `"1h 30m"`, or a
//! bare JSON integer meaning milliseconds. Stored as whole milliseconds so a
//! policy round-trips exactly.

use std::fmt;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::time::{Span, NANOS_PER_MILLI};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DurationMs(u64);

impl DurationMs {
    pub const fn from_millis(ms: u64) -> Self {
        Self(ms)
    }

    pub const fn from_secs(secs: u64) -> Self {
        Self(secs.saturating_mul(1000))
    }

    pub const fn as_millis(self) -> u64 {
        self.0
    }

    pub const fn as_span(self) -> Span {
        Span::from_millis(self.0)
    }

    /// Parses the string form. Anything finer than a millisecond is refused
    /// rather than silently rounded, so what the operator wrote is what runs.
    pub fn parse(text: &str) -> Result<Self, String> {
        let trimmed = text.trim();
        if trimmed.is_empty() {
            return Err("empty duration; write e.g. \"250ms\", \"1s\", \"1m\"".into());
        }
        let parsed = humantime::parse_duration(trimmed).map_err(|e| {
            format!("invalid duration {trimmed:?}: {e}; write e.g. \"250ms\", \"1s\", \"1m\"")
        })?;
        if u64::from(parsed.subsec_nanos()) % NANOS_PER_MILLI != 0 {
            return Err(format!(
                "duration {trimmed:?} is finer than a millisecond; the smallest unit is 1ms"
            ));
        }
        let ms = u64::try_from(parsed.as_millis())
            .map_err(|_| format!("duration {trimmed:?} is too large"))?;
        Ok(Self(ms))
    }
}

impl fmt::Display for DurationMs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0 == 0 {
            return f.write_str("0ms");
        }
        // Days at most, never humantime's months of 30.44 days: a 31-day
        // period reads "31d", not "1month 13h 26m 24s".
        const UNITS: [(u64, &str); 5] = [
            (86_400_000, "d"),
            (3_600_000, "h"),
            (60_000, "m"),
            (1_000, "s"),
            (1, "ms"),
        ];
        let mut left = self.0;
        let mut first = true;
        for (size, unit) in UNITS {
            let n = left / size;
            if n > 0 {
                if !first {
                    f.write_str(" ")?;
                }
                write!(f, "{n}{unit}")?;
                first = false;
                left %= size;
            }
        }
        Ok(())
    }
}

impl Serialize for DurationMs {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for DurationMs {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct DurationVisitor;

        impl Visitor<'_> for DurationVisitor {
            type Value = DurationMs;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a duration such as \"250ms\", \"1s\", \"1m\", \"1h\" or an integer number of milliseconds")
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<DurationMs, E> {
                Ok(DurationMs(v))
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<DurationMs, E> {
                u64::try_from(v)
                    .map(DurationMs)
                    .map_err(|_| E::custom("a duration cannot be negative"))
            }

            fn visit_f64<E: de::Error>(self, _: f64) -> Result<DurationMs, E> {
                Err(E::custom(
                    "a numeric duration is whole milliseconds; write \"1.5s\" as \"1500ms\"",
                ))
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<DurationMs, E> {
                DurationMs::parse(v).map_err(E::custom)
            }
        }

        deserializer.deserialize_any(DurationVisitor)
    }
}

#[cfg(feature = "schema")]
impl schemars::JsonSchema for DurationMs {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Duration".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "description": "A duration: \"250ms\", \"1s\", \"1m\", \"1h\", \"1h 30m\", or an integer number of milliseconds.",
            "oneOf": [
                { "type": "string", "pattern": "^\\s*\\d+\\s*[a-zA-Z]+(\\s*\\d+\\s*[a-zA-Z]+)*\\s*$" },
                { "type": "integer", "minimum": 0 }
            ]
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_forms() {
        assert_eq!(DurationMs::parse("250ms").unwrap().as_millis(), 250);
        assert_eq!(DurationMs::parse("1s").unwrap().as_millis(), 1000);
        assert_eq!(DurationMs::parse("1m").unwrap().as_millis(), 60_000);
        assert_eq!(DurationMs::parse("1h").unwrap().as_millis(), 3_600_000);
        assert_eq!(DurationMs::parse("1h 30m").unwrap().as_millis(), 5_400_000);
        let from_int: DurationMs = serde_json::from_str("1500").unwrap();
        assert_eq!(from_int.as_millis(), 1500);
    }

    #[test]
    fn refuses_nonsense_and_sub_millisecond() {
        assert!(DurationMs::parse("").is_err());
        assert!(DurationMs::parse("fast").is_err());
        assert!(DurationMs::parse("10us")
            .unwrap_err()
            .contains("finer than a millisecond"));
        assert!(serde_json::from_str::<DurationMs>("-5").is_err());
        assert!(serde_json::from_str::<DurationMs>("1.5").is_err());
    }

    #[test]
    fn display_round_trips() {
        for ms in [0, 1, 250, 1000, 60_000, 5_400_000, 86_400_000] {
            let d = DurationMs::from_millis(ms);
            assert_eq!(DurationMs::parse(&d.to_string()).unwrap(), d, "{d}");
        }
    }
}
