//! Calendar periods in a time zone: the window of a day, a week (from
//! Monday), a month, a quarter or a year, as the clock on the wall of
//! `time_zone` counts it, so a budget renews at local midnight or on the
//! 1st, across daylight-saving changes (23- and 25-hour days) and months
//! of 28 to 31 days. A rate's `period` names the unit
//! ([`crate::policy::period::Period`]); the fixed window counts in these
//! windows ([`crate::limiter::window`]).
//!
//! Windows are computed from civil dates with jiff (pure Rust, well kept):
//! a window starts at the first instant of its first local day (midnight,
//! or the end of a gap where midnight does not exist). The zones' rules
//! are jiff's bundled IANA database, in the filter too: measured for the
//! filter's wasm (`opt-level = "s"`, LTO, a probe computing a month's
//! start), jiff's logic is 30 KB, with its bundled database 336 KB, and
//! chrono-tz (every zone compiled in) 943 KB. Bundled rather than read
//! from the host (which a wasm VM cannot) or sent by the admin (which an
//! Envoy without one would lack): every build from one `Cargo.lock` holds
//! the same release, so every Envoy renews at the same instant.

use std::sync::Mutex;

use jiff::civil::Date;
use jiff::tz::TimeZone;
use jiff::Timestamp;

use crate::time::Instant;

/// A calendar unit a window lasts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CalendarUnit {
    Day,
    /// Monday to Sunday (ISO 8601).
    Week,
    Month,
    /// January, April, July, October.
    Quarter,
    Year,
}

impl CalendarUnit {
    pub const ALL: [Self; 5] = [
        Self::Day,
        Self::Week,
        Self::Month,
        Self::Quarter,
        Self::Year,
    ];

    /// Its name as a policy's `period`.
    pub const fn period_name(self) -> &'static str {
        match self {
            Self::Day => "calendar_day",
            Self::Week => "calendar_week",
            Self::Month => "calendar_month",
            Self::Quarter => "calendar_quarter",
            Self::Year => "calendar_year",
        }
    }

    pub fn from_period_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|u| u.period_name() == name)
    }

    /// Its longest window, in seconds: the most days it has, and the hour
    /// a clock turned back adds (no zone's change is longer).
    pub const fn longest_secs(self) -> u64 {
        let days = match self {
            Self::Day => 1,
            Self::Week => 7,
            Self::Month => 31,
            Self::Quarter => 92,
            Self::Year => 366,
        };
        days * 86_400 + 3_600
    }
}

/// The longest zone name taken (the IANA database's longest is 32).
const MAX_ZONE_NAME: usize = 64;

/// The zone a rate's `time_zone` names (`None`: UTC).
pub fn zone(name: &str) -> Result<TimeZone, CalendarError> {
    if name.len() > MAX_ZONE_NAME {
        return Err(CalendarError::UnknownZone(format!(
            "{}...",
            name.chars().take(MAX_ZONE_NAME).collect::<String>()
        )));
    }
    TimeZone::get(name).map_err(|_| CalendarError::UnknownZone(name.to_owned()))
}

/// Why a calendar window cannot be told.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CalendarError {
    #[error(
        "{0:?} is no IANA time zone; write e.g. \"Europe/Berlin\", \"America/New_York\" or \"UTC\""
    )]
    UnknownZone(String),
    #[error("{0} is outside the years a calendar window can be told for")]
    OutOfRange(String),
}

/// Windows of `unit` in `zone`.
#[derive(Debug)]
pub struct Calendar {
    unit: CalendarUnit,
    zone: TimeZone,
    /// The window last told: nearly every call of a day or a month falls
    /// in it, and telling one from the zone's rules costs some 2 500
    /// instructions a call (filter/examples/hot_path.rs, `calendar-day`).
    /// Taken only when free: a worker that finds it held computes.
    last: Mutex<Option<Window>>,
}

impl Clone for Calendar {
    fn clone(&self) -> Self {
        Self::new(self.unit, self.zone.clone())
    }
}

impl PartialEq for Calendar {
    fn eq(&self, other: &Self) -> bool {
        self.unit == other.unit && self.zone == other.zone
    }
}

impl Eq for Calendar {}

/// One window: from `start` (included) to `end` (excluded).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub start: Instant,
    pub end: Instant,
}

impl Window {
    fn holds(&self, at: Instant) -> bool {
        self.start <= at && at < self.end
    }
}

impl Calendar {
    pub fn new(unit: CalendarUnit, zone: TimeZone) -> Self {
        Self {
            unit,
            zone,
            last: Mutex::new(None),
        }
    }

    /// The window `now` is in.
    pub fn window(&self, now: Instant) -> Result<Window, CalendarError> {
        if let Some(last) = self.last_window().filter(|w| w.holds(now)) {
            return Ok(last);
        }
        let first = self.first_day(self.local_date(now)?);
        let window = Window {
            start: self.start_of(first)?,
            end: self.start_of(self.days_after(first, 1)?)?,
        };
        if let Ok(mut last) = self.last.try_lock() {
            *last = Some(window);
        }
        Ok(window)
    }

    /// The start of the window `n` windows after the one starting at
    /// `start` (a window's start, as [`Self::window`] gave it).
    pub fn nth_after(&self, start: Instant, n: u32) -> Result<Instant, CalendarError> {
        if let Some(last) = self.last_window().filter(|w| w.start == start) {
            match n {
                0 => return Ok(last.start),
                1 => return Ok(last.end),
                _ => {}
            }
        }
        let first = self.first_day(self.local_date(start)?);
        self.start_of(self.days_after(first, n)?)
    }

    fn last_window(&self) -> Option<Window> {
        self.last.try_lock().ok().and_then(|last| *last)
    }

    /// Whole windows from the one `earlier` is in to the one `later` is
    /// in (0 when they are the same, or `later` is not later).
    pub fn windows_between(&self, earlier: Instant, later: Instant) -> Result<u64, CalendarError> {
        if self
            .last_window()
            .is_some_and(|w| w.holds(earlier) && w.holds(later))
        {
            return Ok(0);
        }
        let (a, b) = (
            self.first_day(self.local_date(earlier)?),
            self.first_day(self.local_date(later)?),
        );
        if b <= a {
            return Ok(0);
        }
        let months = |d: Date| i64::from(d.year()) * 12 + i64::from(d.month());
        let days = b.duration_since(a).as_secs() / 86_400;
        let n = match self.unit {
            CalendarUnit::Day => days,
            CalendarUnit::Week => days / 7,
            CalendarUnit::Month => months(b) - months(a),
            CalendarUnit::Quarter => (months(b) - months(a)) / 3,
            CalendarUnit::Year => i64::from(b.year()) - i64::from(a.year()),
        };
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// `at` as the zone's clock shows it (`2026-03-29T00:00:00+01:00[Europe/Berlin]`).
    pub fn local_text(&self, at: Instant) -> Result<String, CalendarError> {
        Ok(timestamp(at)?
            .to_zoned_datetime(self.zone.clone())
            .to_string())
    }

    fn local_date(&self, at: Instant) -> Result<Date, CalendarError> {
        Ok(timestamp(at)?.to_zoned_datetime(self.zone.clone()).date())
    }

    /// The first local day of the window holding `day`.
    fn first_day(&self, day: Date) -> Date {
        let first_month = |month: i8| Date::new(day.year(), month, 1).unwrap_or(day);
        match self.unit {
            CalendarUnit::Day => day,
            CalendarUnit::Week => {
                let back = i64::from(day.weekday().to_monday_zero_offset());
                day.checked_sub(jiff::Span::new().days(back)).unwrap_or(day)
            }
            CalendarUnit::Month => day.first_of_month(),
            CalendarUnit::Quarter => first_month((day.month() - 1) / 3 * 3 + 1),
            CalendarUnit::Year => first_month(1),
        }
    }

    /// The first day of the window `n` windows after the one starting on
    /// `first`.
    fn days_after(&self, first: Date, n: u32) -> Result<Date, CalendarError> {
        let n = i64::from(n);
        let span = match self.unit {
            CalendarUnit::Day => jiff::Span::new().days(n),
            CalendarUnit::Week => jiff::Span::new().weeks(n),
            CalendarUnit::Month => jiff::Span::new().months(n),
            CalendarUnit::Quarter => jiff::Span::new().months(n * 3),
            CalendarUnit::Year => jiff::Span::new().years(n),
        };
        first
            .checked_add(span)
            .map_err(|e| CalendarError::OutOfRange(e.to_string()))
    }

    /// The first instant of local day `day` (midnight, or the end of a
    /// gap that skips it).
    fn start_of(&self, day: Date) -> Result<Instant, CalendarError> {
        let zoned = day
            .to_zoned_datetime(self.zone.clone())
            .and_then(|z| z.start_of_day())
            .map_err(|e| CalendarError::OutOfRange(e.to_string()))?;
        let nanos = zoned.timestamp().as_nanosecond();
        u64::try_from(nanos)
            .map(Instant::from_nanos)
            .map_err(|_| CalendarError::OutOfRange(zoned.to_string()))
    }
}

/// `at` on `calendar`'s wall clock, or in UTC without one.
pub fn clock_text(calendar: Option<&Calendar>, at: Instant) -> String {
    match calendar {
        Some(c) => c.local_text(at),
        None => timestamp(at).map(|t| t.to_string()),
    }
    .unwrap_or_else(|e| e.to_string())
}

fn timestamp(at: Instant) -> Result<Timestamp, CalendarError> {
    Timestamp::from_nanosecond(i128::from(at.as_nanos()))
        .map_err(|e| CalendarError::OutOfRange(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn zone(name: &str) -> TimeZone {
        TimeZone::get(name).unwrap_or_else(|e| panic!("{name}: {e}"))
    }

    /// An instant from RFC 3339 text with its offset.
    fn at(text: &str) -> Instant {
        let ts: Timestamp = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
        Instant::from_nanos(u64::try_from(ts.as_nanosecond()).unwrap_or(0))
    }

    fn window(unit: CalendarUnit, tz: &str, now: &str) -> (Instant, Instant) {
        let w = Calendar::new(unit, zone(tz))
            .window(at(now))
            .unwrap_or_else(|e| panic!("{now}: {e}"));
        (w.start, w.end)
    }

    const HOUR: u64 = 3_600_000_000_000;

    #[test]
    fn a_day_renews_at_local_midnight_across_daylight_saving_in_both_directions() {
        // Berlin springs forward on 2026-03-29 (02:00 -> 03:00): 23 hours.
        let spring = window(
            CalendarUnit::Day,
            "Europe/Berlin",
            "2026-03-29T12:00:00+02:00",
        );
        assert_eq!(
            spring,
            (
                at("2026-03-29T00:00:00+01:00"),
                at("2026-03-30T00:00:00+02:00")
            )
        );
        assert_eq!(spring.1.since(spring.0).as_nanos(), 23 * HOUR);
        // ...and falls back on 2026-10-25 (03:00 -> 02:00): 25 hours.
        let fall = window(
            CalendarUnit::Day,
            "Europe/Berlin",
            "2026-10-25T23:59:59+01:00",
        );
        assert_eq!(
            fall,
            (
                at("2026-10-25T00:00:00+02:00"),
                at("2026-10-26T00:00:00+01:00")
            )
        );
        assert_eq!(fall.1.since(fall.0).as_nanos(), 25 * HOUR);
        // New York: 2026-03-08 and 2026-11-01.
        let ny = window(
            CalendarUnit::Day,
            "America/New_York",
            "2026-03-08T01:30:00-05:00",
        );
        assert_eq!(
            ny,
            (
                at("2026-03-08T00:00:00-05:00"),
                at("2026-03-09T00:00:00-04:00")
            )
        );
        let ny = window(
            CalendarUnit::Day,
            "America/New_York",
            "2026-11-01T01:30:00-05:00",
        );
        assert_eq!(ny.1.since(ny.0).as_nanos(), 25 * HOUR);
        // The last instant of a day is in it; midnight is the next one's.
        let edge = window(
            CalendarUnit::Day,
            "Europe/Berlin",
            "2026-03-30T00:00:00+02:00",
        );
        assert_eq!(edge.0, at("2026-03-30T00:00:00+02:00"));
    }

    /// Where clocks skip midnight itself (Santiago springs forward at
    /// 24:00 on 2026-09-05, to 01:00 of the 6th), the day starts when its
    /// first hour does.
    #[test]
    fn a_day_without_a_midnight_starts_when_its_clock_does() {
        let (start, end) = window(
            CalendarUnit::Day,
            "America/Santiago",
            "2026-09-06T12:00:00-03:00",
        );
        assert_eq!(start, at("2026-09-06T01:00:00-03:00"));
        assert_eq!(end, at("2026-09-07T00:00:00-03:00"));
    }

    #[test]
    fn a_month_renews_on_the_first_whatever_its_length() {
        let tz = "Europe/Berlin";
        for (now, start, end) in [
            // 31 days, across the spring change.
            (
                "2026-03-15T10:00:00+01:00",
                "2026-03-01T00:00:00+01:00",
                "2026-04-01T00:00:00+02:00",
            ),
            // 30 days.
            (
                "2026-04-30T23:59:59+02:00",
                "2026-04-01T00:00:00+02:00",
                "2026-05-01T00:00:00+02:00",
            ),
            // 28 days, and 29 in a leap year.
            (
                "2027-02-28T12:00:00+01:00",
                "2027-02-01T00:00:00+01:00",
                "2027-03-01T00:00:00+01:00",
            ),
            (
                "2028-02-29T12:00:00+01:00",
                "2028-02-01T00:00:00+01:00",
                "2028-03-01T00:00:00+01:00",
            ),
            // Across the year's end.
            (
                "2026-12-31T23:00:00+01:00",
                "2026-12-01T00:00:00+01:00",
                "2027-01-01T00:00:00+01:00",
            ),
        ] {
            assert_eq!(
                window(CalendarUnit::Month, tz, now),
                (at(start), at(end)),
                "{now}"
            );
        }
        // One instant: already February in Tokyo, still January in Berlin.
        let instant = "2026-01-31T16:00:00+00:00";
        assert_eq!(
            window(CalendarUnit::Month, "Asia/Tokyo", instant).0,
            at("2026-02-01T00:00:00+09:00")
        );
        assert_eq!(
            window(CalendarUnit::Month, tz, instant).0,
            at("2026-01-01T00:00:00+01:00")
        );
    }

    #[test]
    fn weeks_start_on_monday_quarters_and_years_on_their_first_day() {
        let tz = "Europe/Berlin";
        // Sunday 2026-03-29 (the 23-hour day) is in the week of Monday the 23rd.
        let week = window(CalendarUnit::Week, tz, "2026-03-29T20:00:00+02:00");
        assert_eq!(
            week,
            (
                at("2026-03-23T00:00:00+01:00"),
                at("2026-03-30T00:00:00+02:00")
            )
        );
        assert_eq!(week.1.since(week.0).as_nanos(), (7 * 24 - 1) * HOUR);
        let quarter = window(CalendarUnit::Quarter, tz, "2026-05-20T12:00:00+02:00");
        assert_eq!(
            quarter,
            (
                at("2026-04-01T00:00:00+02:00"),
                at("2026-07-01T00:00:00+02:00")
            )
        );
        let year = window(CalendarUnit::Year, tz, "2026-07-01T12:00:00+02:00");
        assert_eq!(
            year,
            (
                at("2026-01-01T00:00:00+01:00"),
                at("2027-01-01T00:00:00+01:00")
            )
        );
    }

    #[test]
    fn windows_are_counted_and_stepped_in_calendar_units() {
        let months = Calendar::new(CalendarUnit::Month, zone("Europe/Berlin"));
        let jan = at("2026-01-31T22:00:00+01:00");
        assert_eq!(
            months.windows_between(jan, at("2026-02-01T00:00:00+01:00")),
            Ok(1)
        );
        assert_eq!(
            months.windows_between(jan, at("2027-03-05T00:00:00+01:00")),
            Ok(14)
        );
        assert_eq!(months.windows_between(jan, jan), Ok(0));
        assert_eq!(
            months.windows_between(jan, at("2025-01-01T00:00:00+01:00")),
            Ok(0)
        );
        let start = months.window(jan).map(|w| w.start).unwrap_or_default();
        assert_eq!(
            months.nth_after(start, 2),
            Ok(at("2026-03-01T00:00:00+01:00"))
        );
        assert_eq!(
            months.nth_after(start, 3),
            Ok(at("2026-04-01T00:00:00+02:00"))
        );
        let days = Calendar::new(CalendarUnit::Day, zone("Europe/Berlin"));
        // Across both changes of 2026: 365 days, whatever their hours.
        assert_eq!(
            days.windows_between(
                at("2026-01-01T12:00:00+01:00"),
                at("2027-01-01T00:30:00+01:00")
            ),
            Ok(365)
        );
        let weeks = Calendar::new(CalendarUnit::Week, zone("UTC"));
        assert_eq!(
            weeks.windows_between(at("2026-03-01T12:00:00Z"), at("2026-03-02T00:00:00Z")),
            Ok(1),
            "Sunday to Monday is a new week"
        );
    }

    #[test]
    fn a_renewal_is_shown_on_the_zones_clock() {
        let months = Calendar::new(CalendarUnit::Month, zone("Europe/Berlin"));
        assert_eq!(
            months
                .local_text(at("2026-04-01T00:00:00+02:00"))
                .as_deref(),
            Ok("2026-04-01T00:00:00+02:00[Europe/Berlin]")
        );
    }

    /// A calendar with no window remembered.
    fn fresh(c: &Calendar) -> Calendar {
        Calendar::new(c.unit, c.zone.clone())
    }

    proptest::proptest! {
        /// The remembered window changes no answer: any instants in any
        /// order (near each other, so that they share windows, and far)
        /// get what a calendar that remembers nothing tells.
        #[test]
        fn the_remembered_window_answers_as_a_fresh_calendar_would(
            base in 0u64..16_000_000_000,
            steps in proptest::collection::vec(-200_000i64..200_000, 1..40),
            unit in proptest::sample::select(CalendarUnit::ALL.to_vec()),
            name in proptest::sample::select(vec!["UTC", "Europe/Berlin", "Australia/Lord_Howe", "America/Havana"]),
        ) {
            let calendar = Calendar::new(unit, zone(name));
            let mut secs = base;
            for step in steps {
                secs = secs.saturating_add_signed(step * 60);
                let now = Instant::from_nanos(secs * 1_000_000_000);
                let window = calendar.window(now);
                proptest::prop_assert_eq!(window.clone(), fresh(&calendar).window(now));
                let Ok(w) = window else { continue };
                for n in 0..3 {
                    proptest::prop_assert_eq!(
                        calendar.nth_after(w.start, n),
                        fresh(&calendar).nth_after(w.start, n)
                    );
                }
                let later = now + crate::time::Span::from_secs(3_600);
                proptest::prop_assert_eq!(
                    calendar.windows_between(now, later),
                    fresh(&calendar).windows_between(now, later)
                );
            }
        }
    }
}
