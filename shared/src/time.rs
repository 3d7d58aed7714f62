//! Time as the core sees it: an [`Instant`] (nanoseconds since the Unix
//! epoch, by whichever clock the caller reads) and a [`Span`] (a length of
//! time in nanoseconds). They are different types so that an instant is
//! never passed where a span is meant; every unit conversion (to and from
//! milliseconds, seconds, `std::time::Duration`) lives here.
//!
//! Arithmetic saturates: time read from a host can jump or be garbage, and
//! the core must neither panic nor wrap on it. `Instant - Instant` is the
//! span between them, 0 when the first is earlier.

use std::ops::{Add, AddAssign, Sub};

use serde::{Deserialize, Serialize};

pub const NANOS_PER_MILLI: u64 = 1_000_000;
pub const NANOS_PER_SEC: u64 = 1_000_000_000;

/// A point in time: nanoseconds since the Unix epoch (serialized as such;
/// use [`millis`] for milliseconds).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Instant(u64);

/// A length of time, in nanoseconds (serialized as such).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Span(u64);

impl Instant {
    /// The epoch: "never" for states that were not touched yet.
    pub const EPOCH: Instant = Instant(0);
    pub const MAX: Instant = Instant(u64::MAX);

    pub const fn from_nanos(ns: u64) -> Self {
        Self(ns)
    }

    pub const fn from_millis(ms: u64) -> Self {
        Self(ms.saturating_mul(NANOS_PER_MILLI))
    }

    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// Whole milliseconds since the epoch, rounded down.
    pub const fn as_millis(self) -> u64 {
        self.0 / NANOS_PER_MILLI
    }

    /// The span from `earlier` to `self`; 0 if `earlier` is not earlier.
    pub const fn since(self, earlier: Instant) -> Span {
        Span(self.0.saturating_sub(earlier.0))
    }

    /// From a `SystemTime` reading (the caller owns the clock).
    pub fn from_system(time: std::time::SystemTime) -> Self {
        time.duration_since(std::time::UNIX_EPOCH)
            .map_or(Self::EPOCH, |d| {
                Self(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
            })
    }
}

impl Span {
    pub const ZERO: Span = Span(0);
    pub const MAX: Span = Span(u64::MAX);

    pub const fn from_nanos(ns: u64) -> Self {
        Self(ns)
    }

    pub const fn from_millis(ms: u64) -> Self {
        Self(ms.saturating_mul(NANOS_PER_MILLI))
    }

    pub const fn from_secs(secs: u64) -> Self {
        Self(secs.saturating_mul(NANOS_PER_SEC))
    }

    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// Whole milliseconds, rounded down.
    pub const fn as_millis(self) -> u64 {
        self.0 / NANOS_PER_MILLI
    }

    /// Whole seconds, rounded down.
    pub const fn as_secs(self) -> u64 {
        self.0 / NANOS_PER_SEC
    }

    /// Whole seconds, rounded up: waiting this long is never too early.
    pub const fn as_secs_ceil(self) -> u64 {
        self.0.div_ceil(NANOS_PER_SEC)
    }

    /// Whole seconds, when the span is a whole number of them.
    pub const fn as_whole_secs(self) -> Option<u64> {
        if self.0 % NANOS_PER_SEC == 0 {
            Some(self.0 / NANOS_PER_SEC)
        } else {
            None
        }
    }

    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 / NANOS_PER_SEC as f64
    }

    pub const fn is_zero(self) -> bool {
        self.0 == 0
    }

    pub const fn saturating_mul(self, n: u64) -> Span {
        Span(self.0.saturating_mul(n))
    }

    /// `self / n`, rounded down; `self` for `n` of 0.
    pub const fn div(self, n: u64) -> Span {
        match self.0.checked_div(n) {
            Some(q) => Span(q),
            None => self,
        }
    }

    pub fn as_duration(self) -> std::time::Duration {
        std::time::Duration::from_nanos(self.0)
    }

    /// From a `std::time::Duration` (saturating at [`Span::MAX`]).
    pub fn from_duration(d: std::time::Duration) -> Self {
        Self(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
    }
}

impl Add<Span> for Instant {
    type Output = Instant;
    fn add(self, span: Span) -> Instant {
        Instant(self.0.saturating_add(span.0))
    }
}

impl AddAssign<Span> for Instant {
    fn add_assign(&mut self, span: Span) {
        *self = *self + span;
    }
}

impl Sub<Span> for Instant {
    type Output = Instant;
    fn sub(self, span: Span) -> Instant {
        Instant(self.0.saturating_sub(span.0))
    }
}

impl Sub<Instant> for Instant {
    type Output = Span;
    fn sub(self, earlier: Instant) -> Span {
        self.since(earlier)
    }
}

impl Add for Span {
    type Output = Span;
    fn add(self, other: Span) -> Span {
        Span(self.0.saturating_add(other.0))
    }
}

impl Sub for Span {
    type Output = Span;
    fn sub(self, other: Span) -> Span {
        Span(self.0.saturating_sub(other.0))
    }
}

/// `#[serde(with = "millis")]`: an [`Instant`] or a [`Span`] on the wire (and
/// in stored ledgers) as whole milliseconds, as the fleet protocol and the
/// admin's API have always written them.
pub mod millis {
    use serde::{Deserialize, Deserializer, Serializer};

    /// Both time types convert to and from milliseconds.
    pub trait Millis: Sized {
        fn to_millis(&self) -> u64;
        fn from_millis(ms: u64) -> Self;
    }

    impl Millis for super::Instant {
        fn to_millis(&self) -> u64 {
            self.as_millis()
        }
        fn from_millis(ms: u64) -> Self {
            super::Instant::from_millis(ms)
        }
    }

    impl Millis for super::Span {
        fn to_millis(&self) -> u64 {
            self.as_millis()
        }
        fn from_millis(ms: u64) -> Self {
            super::Span::from_millis(ms)
        }
    }

    pub fn serialize<T: Millis, S: Serializer>(value: &T, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(value.to_millis())
    }

    pub fn deserialize<'de, T: Millis, D: Deserializer<'de>>(d: D) -> Result<T, D::Error> {
        u64::deserialize(d).map(T::from_millis)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_saturates_instead_of_wrapping() {
        let t = Instant::from_nanos(10);
        assert_eq!(t - Span::from_nanos(20), Instant::EPOCH);
        assert_eq!(Instant::MAX + Span::from_secs(1), Instant::MAX);
        assert_eq!(
            t - Instant::from_nanos(30),
            Span::ZERO,
            "earlier minus later"
        );
        assert_eq!(Instant::from_nanos(30) - t, Span::from_nanos(20));
        assert_eq!(Span::MAX + Span::from_nanos(1), Span::MAX);
        assert_eq!(Span::from_millis(u64::MAX), Span::MAX);
    }

    #[test]
    fn conversions_round_as_documented() {
        assert_eq!(Span::from_nanos(1).as_secs_ceil(), 1);
        assert_eq!(Span::from_secs(2).as_secs_ceil(), 2);
        assert_eq!(Span::from_nanos(1_999_999).as_millis(), 1);
        assert_eq!(Instant::from_millis(1_500).as_nanos(), 1_500_000_000);
        assert_eq!(Span::from_secs(3).div(0), Span::from_secs(3));
        assert_eq!(
            Instant::from_system(std::time::UNIX_EPOCH + std::time::Duration::from_millis(7)),
            Instant::from_millis(7)
        );
    }

    #[test]
    fn millis_on_the_wire() {
        #[derive(serde::Serialize, serde::Deserialize, PartialEq, Debug)]
        struct T {
            #[serde(with = "millis")]
            at: Instant,
            #[serde(with = "millis")]
            lease: Span,
        }
        let t = T {
            at: Instant::from_millis(12),
            lease: Span::from_secs(3),
        };
        let json = serde_json::to_string(&t).unwrap();
        assert_eq!(json, r#"{"at":12,"lease":3000}"#);
        assert_eq!(serde_json::from_str::<T>(&json).unwrap(), t);
    }
}
