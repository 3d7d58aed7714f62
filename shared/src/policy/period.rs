//! A rate's `period`: a duration (`"1s"`, `"30d"`), or a calendar unit
//! (`"calendar_day"`, `"calendar_week"`, `"calendar_month"`,
//! `"calendar_quarter"`, `"calendar_year"`) counted on the wall clock of
//! the rate's `time_zone`, so a budget renews at local midnight or on the
//! 1st (see [`crate::calendar`]).

use std::fmt;

use serde::de::{self, IntoDeserializer, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::calendar::CalendarUnit;
use crate::duration::DurationMs;
use crate::time::Span;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Period {
    /// Windows (or a refill) of this length.
    Every(DurationMs),
    /// Calendar windows of this unit.
    Calendar(CalendarUnit),
}

impl Period {
    pub const fn from_millis(ms: u64) -> Self {
        Self::Every(DurationMs::from_millis(ms))
    }

    pub const fn from_secs(secs: u64) -> Self {
        Self::Every(DurationMs::from_secs(secs))
    }

    /// The length of a window: for a calendar unit, its longest (a month
    /// of 31 days with the hour a clock change adds), which is what a rate
    /// per second or a bound is judged by.
    pub const fn length(self) -> DurationMs {
        match self {
            Self::Every(d) => d,
            Self::Calendar(unit) => DurationMs::from_secs(unit.longest_secs()),
        }
    }

    pub const fn as_millis(self) -> u64 {
        self.length().as_millis()
    }

    pub const fn as_span(self) -> Span {
        self.length().as_span()
    }

    pub const fn calendar(self) -> Option<CalendarUnit> {
        match self {
            Self::Every(_) => None,
            Self::Calendar(unit) => Some(unit),
        }
    }
}

impl From<DurationMs> for Period {
    fn from(d: DurationMs) -> Self {
        Self::Every(d)
    }
}

impl fmt::Display for Period {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Every(d) => d.fmt(f),
            Self::Calendar(unit) => f.write_str(unit.period_name()),
        }
    }
}

impl Serialize for Period {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Period {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct PeriodVisitor;

        impl Visitor<'_> for PeriodVisitor {
            type Value = Period;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(
                    "a duration such as \"1s\", \"1m\", \"30d\", milliseconds, or a calendar unit (\"calendar_day\", \"calendar_month\", ...)",
                )
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Period, E> {
                DurationMs::deserialize(v.into_deserializer()).map(Period::Every)
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Period, E> {
                DurationMs::deserialize(v.into_deserializer()).map(Period::Every)
            }

            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Period, E> {
                DurationMs::deserialize(v.into_deserializer()).map(Period::Every)
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Period, E> {
                let text = v.trim();
                if let Some(unit) = CalendarUnit::from_period_name(text) {
                    return Ok(Period::Calendar(unit));
                }
                if text.starts_with("calendar") {
                    return Err(E::custom(format!(
                        "{text:?} is no calendar unit; write one of {}",
                        CalendarUnit::ALL
                            .iter()
                            .map(|u| format!("\"{}\"", u.period_name()))
                            .collect::<Vec<_>>()
                            .join(", ")
                    )));
                }
                DurationMs::parse(text)
                    .map(Period::Every)
                    .map_err(E::custom)
            }
        }

        deserializer.deserialize_any(PeriodVisitor)
    }
}

#[cfg(feature = "schema")]
impl schemars::JsonSchema for Period {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Period".into()
    }

    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        let names: Vec<&str> = CalendarUnit::ALL.iter().map(|u| u.period_name()).collect();
        let duration = generator.subschema_for::<DurationMs>();
        schemars::json_schema!({
            "description": "A duration (\"1s\", \"1m\", \"30d\", or milliseconds), or a calendar unit counted on the wall clock of the rate's `time_zone`: renewed at local midnight, on Monday, or on the 1st.",
            "oneOf": [
                duration,
                { "type": "string", "enum": names }
            ]
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_durations_and_calendar_units_and_writes_them_back() {
        for (text, period) in [
            ("\"1s\"", Period::from_secs(1)),
            ("1500", Period::from_millis(1500)),
            ("\"calendar_day\"", Period::Calendar(CalendarUnit::Day)),
            ("\"calendar_month\"", Period::Calendar(CalendarUnit::Month)),
            ("\"calendar_year\"", Period::Calendar(CalendarUnit::Year)),
        ] {
            let read: Period = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(read, period);
            let again: Period =
                serde_json::from_str(&serde_json::to_string(&read).unwrap()).unwrap();
            assert_eq!(again, period);
        }
    }

    #[test]
    fn a_misspelt_unit_names_the_ones_there_are() {
        let e = serde_json::from_str::<Period>("\"calendar_fortnight\"").unwrap_err();
        assert!(
            e.to_string()
                .contains("\"calendar_week\", \"calendar_month\""),
            "{e}"
        );
        assert!(serde_json::from_str::<Period>("\"fast\"").is_err());
        assert!(serde_json::from_str::<Period>("-5").is_err());
        assert!(serde_json::from_str::<Period>("1.5").is_err());
    }

    #[test]
    fn a_calendar_unit_is_judged_by_its_longest_window() {
        let day = Period::Calendar(CalendarUnit::Day).as_millis();
        assert_eq!(day, 25 * 3_600_000);
        let month = Period::Calendar(CalendarUnit::Month).as_millis();
        assert_eq!(month, (31 * 24 + 1) * 3_600_000);
    }
}
