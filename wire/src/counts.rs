//! Counters, declared once: a family of counters (a policy's, a further
//! limit's, the filter's own) is one enum written with [`counters!`], each
//! counter a line with its name and its kind, and its doc comment its
//! meaning. Everything else is generic over the family: [`Counts`] holds
//! one value per counter (the filter's batched stats and deltas, the
//! totals summed over workers, the report on the wire), [`LiveCounts`] what
//! the admin shows of them (a rate per second, or the value now).
//!
//! So a new counter is one line plus its meaning: the filter's stat, the
//! sync report, the live view and the Prometheus series follow from it.
//! On the wire a family's counts are a JSON object by name, every reported
//! counter written, unknown names skipped: filters and admins of other
//! releases read what they know and take 0 for the rest.

use std::fmt;
use std::marker::PhantomData;

use serde::de::{DeserializeOwned, IgnoredAny, MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use sluice_shared::Span;

/// The most counters one family may have (checked where it is declared).
pub const MAX_COUNTERS: usize = 24;

/// What a counter is, and so where it goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// An Envoy stat only: not reported to the admin.
    Local,
    /// Reported; shown as a rate per second.
    Rate,
    /// Reported; shown as the total since the Envoys started.
    Total,
    /// Reported; moves both ways (a gauge): shown as its value now.
    Gauge,
}

impl Kind {
    pub fn is_reported(self) -> bool {
        self != Kind::Local
    }
}

/// One family of counters. Write it with [`counters!`], not by hand.
pub trait Counter: Copy + Eq + fmt::Debug + 'static {
    /// Every counter of the family, in declaration order.
    const ALL: &'static [Self];
    /// Its place in [`Self::ALL`].
    fn index(self) -> usize;
    /// Its name: in Envoy's stats, on the wire, in Prometheus.
    fn name(self) -> &'static str;
    /// Its meaning, from its doc comment.
    fn meaning(self) -> &'static str;
    fn kind(self) -> Kind;

    fn by_name(name: &str) -> Option<Self> {
        Self::ALL.iter().copied().find(|c| c.name() == name)
    }
}

/// Declares a family of counters: an enum with the [`Counter`] trait, each
/// variant `Name = "name", Kind;` under its doc comment.
#[macro_export]
macro_rules! counters {
    (
        $(#[$meta:meta])*
        $vis:vis enum $family:ident {
            $(
                $(#[doc = $doc:literal])*
                $variant:ident = $name:literal, $kind:ident;
            )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        $vis enum $family {
            $( $(#[doc = $doc])* $variant, )*
        }

        impl $crate::counts::Counter for $family {
            const ALL: &'static [Self] = &[$($family::$variant),*];

            fn index(self) -> usize {
                self as usize
            }

            fn name(self) -> &'static str {
                match self {
                    $($family::$variant => $name,)*
                }
            }

            fn meaning(self) -> &'static str {
                match self {
                    $($family::$variant => concat!($($doc),*).trim_ascii(),)*
                }
            }

            fn kind(self) -> $crate::counts::Kind {
                match self {
                    $($family::$variant => $crate::counts::Kind::$kind,)*
                }
            }
        }

        const _: () = assert!(
            <$family as $crate::counts::Counter>::ALL.len() <= $crate::counts::MAX_COUNTERS,
            "too many counters in one family"
        );
    };
}

/// What a count can be: totals (`u64`, wrapping), deltas (`i64`), rates.
pub trait Value:
    Copy + Default + PartialEq + fmt::Debug + Serialize + DeserializeOwned + 'static
{
    fn plus(self, other: Self) -> Self;
}

impl Value for u64 {
    fn plus(self, other: Self) -> Self {
        self.wrapping_add(other)
    }
}

impl Value for i64 {
    fn plus(self, other: Self) -> Self {
        self.wrapping_add(other)
    }
}

impl Value for f64 {
    fn plus(self, other: Self) -> Self {
        self + other
    }
}

/// A value per counter of family `C`.
pub struct Counts<C, V = u64> {
    values: [V; MAX_COUNTERS],
    family: PhantomData<fn() -> C>,
}

impl<C, V: Copy> Clone for Counts<C, V> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<C, V: Copy> Copy for Counts<C, V> {}

impl<C, V: Value> Default for Counts<C, V> {
    fn default() -> Self {
        Self {
            values: [V::default(); MAX_COUNTERS],
            family: PhantomData,
        }
    }
}

impl<C, V: PartialEq> PartialEq for Counts<C, V> {
    fn eq(&self, other: &Self) -> bool {
        self.values == other.values
    }
}

impl<C, V: Eq> Eq for Counts<C, V> {}

impl<C: Counter, V: Value> fmt::Debug for Counts<C, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(self.iter().filter(|(_, v)| *v != V::default()))
            .finish()
    }
}

impl<C: Counter, V: Value> Counts<C, V> {
    pub fn get(&self, counter: C) -> V {
        self.values[counter.index()]
    }

    pub fn set(&mut self, counter: C, value: V) {
        self.values[counter.index()] = value;
    }

    /// Adds `value` to `counter` (wrapping for whole numbers).
    pub fn add(&mut self, counter: C, value: V) {
        let slot = &mut self.values[counter.index()];
        *slot = slot.plus(value);
    }

    /// Adds every count of `other`.
    pub fn add_all(&mut self, other: &Self) {
        for (slot, value) in self.values.iter_mut().zip(other.values) {
            *slot = slot.plus(value);
        }
    }

    pub fn is_zero(&self) -> bool {
        self.values.iter().all(|v| *v == V::default())
    }

    /// Every counter of the family with its value.
    pub fn iter(&self) -> impl Iterator<Item = (C, V)> + '_ {
        C::ALL.iter().map(|&c| (c, self.get(c)))
    }
}

impl<C: Counter> Counts<C, u64> {
    /// Adds deltas that may be negative (a gauge going down), wrapping:
    /// a gauge's net total reads right once every delta is in.
    pub fn add_deltas(&mut self, deltas: &Counts<C, i64>) {
        for (slot, delta) in self.values.iter_mut().zip(deltas.values) {
            *slot = slot.wrapping_add_signed(delta);
        }
    }

    /// As reported: a gauge whose net total is below zero can only be a
    /// worker that died mid-count, and reads 0.
    pub fn settled(mut self) -> Self {
        for &c in C::ALL {
            if c.kind() == Kind::Gauge && (self.get(c) as i64) < 0 {
                self.set(c, 0);
            }
        }
        self
    }
}

impl<C: Counter, V: Value> std::ops::Index<C> for Counts<C, V> {
    type Output = V;

    fn index(&self, counter: C) -> &V {
        &self.values[counter.index()]
    }
}

/// Every reported counter by its name (local ones never leave the Envoy).
impl<C: Counter, V: Value> Serialize for Counts<C, V> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let reported = || C::ALL.iter().filter(|c| c.kind().is_reported());
        let mut map = serializer.serialize_map(Some(reported().count()))?;
        for &c in reported() {
            map.serialize_entry(c.name(), &self.get(c))?;
        }
        map.end()
    }
}

impl<'de, C: Counter, V: Value> Deserialize<'de> for Counts<C, V> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(CountsVisitor(PhantomData))
    }
}

struct CountsVisitor<C, V>(PhantomData<fn() -> (C, V)>);

impl<'de, C: Counter, V: Value> Visitor<'de> for CountsVisitor<C, V> {
    type Value = Counts<C, V>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("counts by name")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut counts = Counts::default();
        while let Some(name) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            match C::by_name(&name).filter(|c| c.kind().is_reported()) {
                Some(c) => counts.set(c, map.next_value()?),
                // Another release's counter, or a field beside the counts.
                None => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(counts)
    }
}

/// A counter's rate between two readings `span` apart. A counter that
/// went down means the Envoy restarted: it counted from zero.
pub fn per_second(now: u64, before: u64, span: Span) -> f64 {
    let delta = now.checked_sub(before).unwrap_or(now);
    if span == Span::ZERO {
        return 0.0;
    }
    delta as f64 / span.as_secs_f64()
}

/// What the admin shows of a family's reported counters: rates per second
/// (written `<name>_per_s`) and values now (totals and gauges, by name).
pub struct LiveCounts<C> {
    per_s: Counts<C, f64>,
    now: Counts<C, u64>,
}

impl<C> Clone for LiveCounts<C> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<C> Copy for LiveCounts<C> {}

impl<C> Default for LiveCounts<C> {
    fn default() -> Self {
        Self {
            per_s: Counts::default(),
            now: Counts::default(),
        }
    }
}

impl<C> PartialEq for LiveCounts<C> {
    fn eq(&self, other: &Self) -> bool {
        self.per_s == other.per_s && self.now == other.now
    }
}

impl<C: Counter> fmt::Debug for LiveCounts<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LiveCounts")
            .field("per_s", &self.per_s)
            .field("now", &self.now)
            .finish()
    }
}

impl<C: Counter> LiveCounts<C> {
    /// From one Envoy's totals `cur`, and `prev` read `span` before (none:
    /// its first report, no rates yet).
    pub fn between(prev: Option<&Counts<C>>, cur: &Counts<C>, span: Span) -> Self {
        let mut live = Self::default();
        for &c in C::ALL {
            match c.kind() {
                Kind::Local => {}
                Kind::Rate => {
                    if let Some(prev) = prev {
                        live.per_s.set(c, per_second(cur[c], prev[c], span));
                    }
                }
                Kind::Total | Kind::Gauge => live.now.set(c, cur[c]),
            }
        }
        live
    }

    /// A rate counter's calls per second.
    pub fn per_s(&self, counter: C) -> f64 {
        self.per_s[counter]
    }

    /// A total's or a gauge's value now.
    pub fn now(&self, counter: C) -> u64 {
        self.now[counter]
    }

    /// What it shows, by counter: a rate or a value now.
    pub fn shown(&self) -> impl Iterator<Item = (C, f64)> + '_ {
        C::ALL.iter().filter_map(|&c| match c.kind() {
            Kind::Local => None,
            Kind::Rate => Some((c, self.per_s[c])),
            Kind::Total | Kind::Gauge => Some((c, self.now[c] as f64)),
        })
    }

    /// Adds another Envoy's figures.
    pub fn add(&mut self, other: &Self) {
        self.per_s.add_all(&other.per_s);
        for &c in C::ALL {
            self.now.set(c, self.now[c].saturating_add(other.now[c]));
        }
    }
}

/// The name a counter is shown by: `<name>_per_s` for a rate.
pub fn shown_name<C: Counter>(counter: C) -> String {
    match counter.kind() {
        Kind::Rate => format!("{}_per_s", counter.name()),
        _ => counter.name().to_string(),
    }
}

impl<C: Counter> Serialize for LiveCounts<C> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(None)?;
        for &c in C::ALL {
            match c.kind() {
                Kind::Local => {}
                Kind::Rate => map.serialize_entry(&shown_name(c), &self.per_s[c])?,
                Kind::Total | Kind::Gauge => map.serialize_entry(c.name(), &self.now[c])?,
            }
        }
        map.end()
    }
}

impl<'de, C: Counter> Deserialize<'de> for LiveCounts<C> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(LiveVisitor(PhantomData))
    }
}

struct LiveVisitor<C>(PhantomData<fn() -> C>);

impl<'de, C: Counter> Visitor<'de> for LiveVisitor<C> {
    type Value = LiveCounts<C>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("live counts by name")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut live = LiveCounts::default();
        while let Some(name) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            let rate = name.strip_suffix("_per_s").and_then(C::by_name);
            match (rate, C::by_name(&name)) {
                (Some(c), _) if c.kind() == Kind::Rate => live.per_s.set(c, map.next_value()?),
                (_, Some(c)) if matches!(c.kind(), Kind::Total | Kind::Gauge) => {
                    live.now.set(c, map.next_value()?)
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(live)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    counters! {
        /// A family for the tests.
        enum Sample {
            /// Calls let through.
            Admitted = "admitted", Rate;
            /// Calls now, which
            /// moves both ways.
            Now = "now", Gauge;
            /// Since the start.
            Seen = "seen", Total;
            /// Never leaves.
            Mine = "mine", Local;
        }
    }

    #[test]
    fn a_family_says_each_counters_name_kind_and_meaning() {
        assert_eq!(Sample::ALL.len(), 4);
        for (i, c) in Sample::ALL.iter().enumerate() {
            assert_eq!(c.index(), i);
            assert_eq!(Sample::by_name(c.name()), Some(*c));
        }
        assert_eq!(Sample::Now.meaning(), "Calls now, which moves both ways.");
        assert_eq!(Sample::Admitted.meaning(), "Calls let through.");
        assert_eq!(Sample::Mine.kind(), Kind::Local);
        assert_eq!(Sample::by_name("other"), None);
    }

    #[test]
    fn the_wire_carries_reported_counters_by_name_and_skips_the_unknown() {
        let mut counts: Counts<Sample> = Counts::default();
        counts.add(Sample::Admitted, 5);
        counts.add(Sample::Mine, 7);
        let json = serde_json::to_value(counts).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"admitted": 5, "now": 0, "seen": 0}),
            "every reported counter, local ones never"
        );
        let read: Counts<Sample> =
            serde_json::from_str(r#"{"admitted": 5, "newer": 3, "mine": 9, "x": {"y": []}}"#)
                .unwrap();
        assert_eq!(read[Sample::Admitted], 5);
        assert_eq!(read[Sample::Mine], 0, "a local counter is not taken in");
        assert!(serde_json::from_str::<Counts<Sample>>(r#"{"admitted": -1}"#).is_err());
        assert!(serde_json::from_str::<Counts<Sample>>(r#"[1]"#).is_err());
    }

    #[test]
    fn deltas_move_gauges_both_ways_and_a_negative_net_reads_zero() {
        let mut totals: Counts<Sample> = Counts::default();
        let mut delta: Counts<Sample, i64> = Counts::default();
        delta.add(Sample::Now, 3);
        delta.add(Sample::Admitted, 2);
        totals.add_deltas(&delta);
        let mut down: Counts<Sample, i64> = Counts::default();
        down.add(Sample::Now, -1);
        totals.add_deltas(&down);
        assert_eq!((totals[Sample::Now], totals[Sample::Admitted]), (2, 2));
        totals.add_deltas(&down);
        totals.add_deltas(&down);
        totals.add_deltas(&down);
        assert_eq!(totals.settled()[Sample::Now], 0);
    }

    #[test]
    fn live_counts_are_rates_and_values_now_and_read_back() {
        let mut before: Counts<Sample> = Counts::default();
        before.set(Sample::Admitted, 100);
        let mut after = before;
        after.set(Sample::Admitted, 150);
        after.set(Sample::Now, 4);
        after.set(Sample::Seen, 9);
        let live = LiveCounts::between(Some(&before), &after, Span::from_millis(500));
        assert_eq!(live.per_s(Sample::Admitted), 100.0);
        assert_eq!((live.now(Sample::Now), live.now(Sample::Seen)), (4, 9));
        let json = serde_json::to_value(live).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"admitted_per_s": 100.0, "now": 4, "seen": 9})
        );
        let back: LiveCounts<Sample> = serde_json::from_value(json).unwrap();
        assert_eq!(back, live);
        // A first report has no rate; a restarted Envoy counts from zero.
        assert_eq!(
            LiveCounts::between(None, &after, Span::from_secs(1)).per_s(Sample::Admitted),
            0.0
        );
        let restarted = LiveCounts::between(Some(&after), &before, Span::from_secs(1));
        assert_eq!(restarted.per_s(Sample::Admitted), 100.0);
        let mut sum = live;
        sum.add(&live);
        assert_eq!(
            (sum.per_s(Sample::Admitted), sum.now(Sample::Now)),
            (200.0, 8)
        );
    }

    proptest! {
        #[test]
        fn counts_round_trip_through_json(values in proptest::array::uniform3(any::<u64>())) {
            let mut counts: Counts<Sample> = Counts::default();
            counts.set(Sample::Admitted, values[0]);
            counts.set(Sample::Now, values[1]);
            counts.set(Sample::Seen, values[2]);
            let json = serde_json::to_string(&counts).unwrap();
            prop_assert_eq!(serde_json::from_str::<Counts<Sample>>(&json).unwrap(), counts);
        }

        #[test]
        fn any_json_reads_as_counts_or_an_error(raw in ".{0,64}") {
            let _ = serde_json::from_str::<Counts<Sample>>(&raw);
            let _ = serde_json::from_str::<LiveCounts<Sample>>(&raw);
        }
    }
}
