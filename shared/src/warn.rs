//! Warning lines of a limit (`warn_at`: 0.8, 0.95): a call whose take
//! leaves the limit past a line is warned (`x-sluice-warn`), and a take
//! that crosses a line says which (takes are serial on the limit's state,
//! so one take crosses it, however many workers share the limit). Usage
//! read after the call may give back some of its estimate and bring the
//! limit below the line again: the filter counts a line once per period
//! ([`period_mark`]).

use crate::limiter::Standing;
use crate::policy::bounds;
use crate::policy::check::Report;

/// A limit's lines, in thousandths of its size, ascending.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct WarnLines(Vec<u64>);

/// What one call's take did against the lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Warning {
    /// Lines this take crossed (from below to at or above): bit `i` for
    /// the `i`-th line, lowest first.
    pub crossed: u8,
    /// Thousandths of the limit used after the take, when past a line.
    pub past: Option<u64>,
}

impl WarnLines {
    /// From validated ratios (each in (0, 1)).
    pub fn new(ratios: &[f64]) -> Self {
        let mut lines: Vec<u64> = ratios
            .iter()
            .map(|r| (r * 1000.0).round().clamp(1.0, 999.0) as u64)
            .collect();
        lines.sort_unstable();
        lines.dedup();
        lines.truncate(8);
        Self(lines)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// A take of `taken` left the limit at `after`.
    pub fn check(&self, after: &Standing, taken: u64) -> Warning {
        if self.0.is_empty() || after.size == 0 {
            return Warning::default();
        }
        let permille = |spent: u64| {
            let used = u128::from(spent) * 1000 / u128::from(after.size);
            u64::try_from(used).unwrap_or(u64::MAX)
        };
        let now = permille(after.spent);
        let before = permille(after.spent.saturating_sub(taken));
        let crossed = self
            .0
            .iter()
            .enumerate()
            .filter(|(_, &line)| before < line && line <= now)
            .fold(0u8, |mask, (i, _)| mask | (1 << i));
        Warning {
            crossed,
            past: self.0.first().is_some_and(|&l| now >= l).then_some(now),
        }
    }
}

/// What a line's crossing is remembered by, so that it counts once a
/// period: the period's number (`now` over the limit's period) and who
/// holds the limit's place (a keyed place another key takes over counts
/// afresh). Never 0, what a place that never crossed holds.
pub fn period_mark(now_nanos: u64, period_nanos: u64, owner: u64) -> u64 {
    let period = now_nanos / period_nanos.max(1);
    let mark = (period + 1) ^ owner.rotate_left(17);
    mark.max(1)
}

/// `"team-a-monthly";used=0.81`: the limit past its line, and the share
/// of it used, to the hundredth, rounded down (an RFC 8941 list member);
/// without the share for a limit that keeps it to itself (None).
pub fn warn_item(limit: &str, used_permille: Option<u64>) -> String {
    let Some(used_permille) = used_permille else {
        return format!("\"{limit}\"");
    };
    let hundredths = used_permille.min(9999) / 10;
    format!(
        "\"{limit}\";used={}.{:02}",
        hundredths / 100,
        hundredths % 100
    )
}

/// Warning lines: a few shares of the limit, each between 0 and 1,
/// ascending.
pub(crate) fn check_warn_at(r: &mut Report, lines: &[f64]) {
    if lines.len() > bounds::MAX_WARN_LINES {
        r.at(
            "warn_at",
            format!("at most {} lines", bounds::MAX_WARN_LINES),
        );
    }
    for (i, line) in lines.iter().enumerate() {
        if !(*line > 0.0 && *line < 1.0) {
            r.at(
                &format!("warn_at[{i}]"),
                "a share of the limit, between 0 and 1 (0.8 warns at 80 %)",
            );
        } else if i > 0 && lines[i - 1] >= *line {
            r.at(
                &format!("warn_at[{i}]"),
                "lines go up: each above the one before",
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::time::Span;

    fn at(spent: u64) -> Standing {
        Standing {
            spent,
            size: 1000,
            until_reset: Span::ZERO,
            renews_at: crate::time::Instant::EPOCH,
        }
    }

    #[test]
    fn the_take_that_crosses_a_line_counts_it_and_every_take_past_it_warns() {
        let lines = WarnLines::new(&[0.95, 0.8]);
        assert_eq!(lines.check(&at(700), 100), Warning::default());
        assert_eq!(
            lines.check(&at(810), 110),
            Warning {
                crossed: 1,
                past: Some(810)
            }
        );
        assert_eq!(
            lines.check(&at(820), 10),
            Warning {
                crossed: 0,
                past: Some(820)
            }
        );
        assert_eq!(
            lines.check(&at(990), 500),
            Warning {
                crossed: 0b11,
                past: Some(990)
            }
        );
        assert_eq!(lines.check(&at(960), 20).crossed, 0b10);
        // Debt past the size: still past, nothing more to cross.
        assert_eq!(lines.check(&at(1500), 10).past, Some(1500));
        assert_eq!(
            WarnLines::default().check(&at(999), 999),
            Warning::default()
        );
        assert_eq!(
            warn_item("team-a-monthly", Some(812)),
            "\"team-a-monthly\";used=0.81"
        );
        assert_eq!(warn_item("t", Some(1500)), "\"t\";used=1.50");
        assert_eq!(warn_item("t", None), "\"t\"");
    }

    proptest! {
        /// Taking a limit from empty to full a call at a time crosses each
        /// line exactly once, whatever the calls' sizes.
        #[test]
        fn each_line_is_crossed_once_on_the_way_up(takes in prop::collection::vec(1u64..300, 1..100)) {
            let lines = WarnLines::new(&[0.5, 0.8, 0.95]);
            let (mut spent, mut crossed) = (0u64, 0u32);
            for taken in takes {
                spent += taken;
                crossed += lines.check(&at(spent), taken).crossed.count_ones();
            }
            let expected = [500u64, 800, 950].iter().filter(|&&l| spent * 1000 / 1000 >= l).count();
            prop_assert_eq!(crossed as usize, expected);
        }
    }
}
