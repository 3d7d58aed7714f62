//! Whether a benchmark's figure meets its target, or says nothing.
//!
//! CPU time per request moves by about ±2 µs between runs on small
//! machines, as much as the costs being compared: a run can give a negative
//! added cost, and a ratio of two noisy differences can come out anywhere.
//! Such a run is marked invalid, never "met". Instruction counts under
//! callgrind do not move, so ratios of them are judged as they are.

use std::fmt;

#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    Met,
    NotMet,
    /// The measurement cannot carry the judgement; why.
    Invalid(String),
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Verdict::Met => f.write_str("met"),
            Verdict::NotMet => f.write_str("NOT met"),
            Verdict::Invalid(why) => write!(f, "INVALID RUN ({why})"),
        }
    }
}

/// Added costs of one variant over its baseline, one per repetition.
#[derive(Debug, Clone, PartialEq)]
pub struct Added<'a> {
    pub variant: &'a str,
    pub per_rep: Vec<f64>,
}

impl Added<'_> {
    pub fn median(&self) -> f64 {
        let mut v = self.per_rep.clone();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    }

    /// How far apart the repetitions are.
    pub fn spread(&self) -> f64 {
        let min = self.per_rep.iter().copied().fold(f64::INFINITY, f64::min);
        let max = self
            .per_rep
            .iter()
            .copied()
            .fold(f64::NEG_INFINITY, f64::max);
        max - min
    }

    /// Why this added cost cannot be judged on, if it cannot.
    fn noise(&self) -> Option<String> {
        let median = self.median();
        if self.per_rep.is_empty() || !median.is_finite() {
            return Some(format!("({}) was not measured", self.variant));
        }
        if median <= 0.0 {
            return Some(format!(
                "({}) adds {median:+.1} over its baseline: the baseline is noise",
                self.variant
            ));
        }
        let spread = self.spread();
        if spread > median {
            return Some(format!(
                "({})'s repetitions are {spread:.1} apart, more than the {median:.1} it adds",
                self.variant
            ));
        }
        None
    }
}

/// `numerator / denominator` of two added costs in CPU time, against
/// `at_most`: the ratio, and a verdict that is invalid when either added
/// cost is negative or its repetitions disagree by more than it.
pub fn cpu_ratio(numerator: &Added, denominator: &Added, at_most: f64) -> (f64, Verdict) {
    let ratio = numerator.median() / denominator.median();
    if let Some(why) = numerator.noise().or_else(|| denominator.noise()) {
        return (ratio, Verdict::Invalid(why));
    }
    (ratio, verdict(ratio <= at_most))
}

/// `variant`'s throughput as a share of `base`'s, against `at_least`:
/// the median share, and a verdict given only when every pairing of a
/// repetition of one with a repetition of the other falls on the same side
/// of the target (at the same code, one run's medians once read 82.9 %
/// and another's 93.8 %).
pub fn throughput_share(variant: &[f64], base: &[f64], at_least: f64) -> (f64, Verdict) {
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    let share = median(variant) / median(base);
    let shares: Vec<f64> = variant
        .iter()
        .flat_map(|v| base.iter().map(move |b| v / b))
        .collect();
    if shares.is_empty() || shares.iter().any(|s| !s.is_finite() || *s <= 0.0) {
        return (
            share,
            Verdict::Invalid("a throughput was not measured".into()),
        );
    }
    let low = shares.iter().copied().fold(f64::INFINITY, f64::min);
    let high = shares.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if low >= at_least {
        (share, Verdict::Met)
    } else if high < at_least {
        (share, Verdict::NotMet)
    } else {
        (
            share,
            Verdict::Invalid(format!(
                "pairings of repetitions give {:.1} % to {:.1} %, on both sides of the target",
                low * 100.0,
                high * 100.0
            )),
        )
    }
}

/// The same for instruction counts, which do not move between runs: only
/// a difference that is not positive (a broken build or count) is invalid.
pub fn instruction_ratio(numerator: f64, denominator: f64, at_most: f64) -> (f64, Verdict) {
    let ratio = numerator / denominator;
    if !(numerator > 0.0 && denominator > 0.0) {
        return (
            ratio,
            Verdict::Invalid(format!(
                "added instructions {numerator:.0} and {denominator:.0}: both must be positive"
            )),
        );
    }
    (ratio, verdict(ratio <= at_most))
}

/// A target that is not a ratio of added costs (throughput, say).
pub fn verdict(met: bool) -> Verdict {
    if met {
        Verdict::Met
    } else {
        Verdict::NotMet
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn added<'a>(variant: &'a str, per_rep: &[f64]) -> Added<'a> {
        Added {
            variant,
            per_rep: per_rep.to_vec(),
        }
    }

    #[test]
    fn steady_added_costs_are_judged() {
        let (ratio, v) = cpu_ratio(
            &added("d", &[9.0, 10.0, 11.0]),
            &added("h", &[8.0, 8.0, 8.5]),
            1.30,
        );
        assert_eq!((ratio, v), (1.25, Verdict::Met));
        let (_, v) = cpu_ratio(&added("d", &[14.0, 14.0]), &added("h", &[8.0, 8.0]), 1.30);
        assert_eq!(v, Verdict::NotMet);
    }

    /// What a user saw: native limiting at -6.6 µs and the no-op filter at
    /// -1.1 µs gave a ratio of -6.89 printed as "target met".
    #[test]
    fn a_negative_added_cost_makes_the_run_invalid_not_met() {
        let (ratio, v) = cpu_ratio(
            &added("d", &[7.6, 7.6, 7.6]),
            &added("f", &[-1.1, -1.0, -1.2]),
            1.30,
        );
        assert!(ratio < 0.0);
        assert!(
            matches!(&v, Verdict::Invalid(why) if why.contains("(f) adds -1.1")),
            "{v}"
        );
        assert!(v.to_string().starts_with("INVALID RUN"));
    }

    #[test]
    fn repetitions_further_apart_than_the_effect_make_the_run_invalid() {
        let (_, v) = cpu_ratio(
            &added("d", &[2.0, 9.0, 3.0]),
            &added("h", &[8.0, 8.1, 8.0]),
            1.30,
        );
        assert!(
            matches!(&v, Verdict::Invalid(why) if why.contains("(d)'s repetitions")),
            "{v}"
        );
        let (_, v) = cpu_ratio(&added("d", &[]), &added("h", &[8.0]), 1.30);
        assert!(matches!(v, Verdict::Invalid(_)));
    }

    #[test]
    fn a_throughput_is_judged_only_when_every_pairing_agrees() {
        let (share, v) = throughput_share(&[90.0, 95.0, 92.0], &[100.0, 101.0, 99.0], 0.85);
        assert!((share - 0.92).abs() < 1e-9);
        assert_eq!(v, Verdict::Met);
        assert_eq!(
            throughput_share(&[70.0, 80.0], &[100.0, 99.0], 0.85).1,
            Verdict::NotMet
        );
        // Run A's 82.9 % and run B's 93.8 %: the pairings straddle 85 %.
        assert!(matches!(
            throughput_share(&[82.9, 93.8], &[100.0, 100.0], 0.85).1,
            Verdict::Invalid(_)
        ));
        assert!(matches!(
            throughput_share(&[], &[100.0], 0.85).1,
            Verdict::Invalid(_)
        ));
    }

    #[test]
    fn instruction_ratios_are_judged_unless_a_count_is_not_positive() {
        assert_eq!(instruction_ratio(11_500.0, 10_000.0, 1.15).1, Verdict::Met);
        assert_eq!(
            instruction_ratio(12_000.0, 10_000.0, 1.15).1,
            Verdict::NotMet
        );
        assert!(matches!(
            instruction_ratio(5.0, -3.0, 1.15).1,
            Verdict::Invalid(_)
        ));
    }
}
