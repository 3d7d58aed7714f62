//! How the live view words a budget's spend (limits of an hour or longer,
//! [`sluice_shared::spend`]): amounts in money or tokens, shares against
//! the size and the warning lines, when the period renews, and a month at
//! the recent pace. Pure, so that it is tested natively.

use std::collections::BTreeMap;

use sluice_shared::calendar::{clock_text, Calendar};
use sluice_shared::policy::CostSpec;
use sluice_shared::price::{Money, PriceTable};
use sluice_shared::spend::month_at;
use sluice_shared::spend::RefusedCall;
use sluice_shared::time::{Instant, Span};
use sluice_shared::Policy;

/// What the live view needs of a budget's definition.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BudgetSpec {
    /// A money limit: the price table's currency (amounts in micro-units).
    pub currency: Option<String>,
    /// Its warning lines, as ratios of its size.
    pub warn_at: Vec<f64>,
    /// A calendar period's windows (`calendar_month` in `Europe/Berlin`).
    pub calendar: Option<Calendar>,
}

/// Every limit of the policies, by name, as the live view words it.
pub fn budget_specs(
    policies: &[Policy],
    prices: Option<&PriceTable>,
) -> BTreeMap<String, BudgetSpec> {
    let currency = prices.map(|p| p.currency.clone());
    policies
        .iter()
        .flat_map(sluice_shared::Policy::every_limit)
        .filter(|l| l.spends_over_hours())
        .map(|l| {
            let money = matches!(l.cost, CostSpec::Price(_));
            let spec = BudgetSpec {
                currency: if money {
                    Some(
                        currency
                            .clone()
                            .unwrap_or_else(|| "(no price table)".into()),
                    )
                } else {
                    None
                },
                warn_at: l.warn_at.clone(),
                calendar: l.rate.as_ref().and_then(|r| r.calendar()),
            };
            (l.name.clone(), spec)
        })
        .collect()
}

impl BudgetSpec {
    /// `n` in the limit's unit: money to the cent (`0.83 USD`, `< 0.01 USD`
    /// for a sliver), tokens as they are.
    pub fn amount(&self, n: u64) -> String {
        let Some(currency) = &self.currency else {
            return n.to_string();
        };
        let cent = Money::ONE / 100;
        if n > 0 && n < cent {
            return format!("< 0.01 {currency}");
        }
        format!("{}.{:02} {currency}", n / Money::ONE, n % Money::ONE / cent)
    }

    /// `amount` for a figure that is a pace, not a count.
    pub fn amount_f(&self, n: f64) -> String {
        if !n.is_finite() || n <= 0.0 {
            return self.amount(0);
        }
        self.amount(n.min(u64::MAX as f64) as u64)
    }

    /// When a calendar budget renews, on its zone's clock
    /// (`2027-01-01T00:00:00+01:00[Europe/Berlin]`), from a frame's time
    /// and the renewal an Envoy reported (a sync or two old): the window
    /// edge nearest it. None for a budget of another period.
    pub fn renews_at(&self, at_ms: u64, renews_in_ms: u64) -> Option<String> {
        let calendar = self.calendar.as_ref()?;
        if renews_in_ms == 0 {
            return None;
        }
        // A report is seconds old: half a minute either way is the edge.
        let reported = Instant::from_millis(at_ms.saturating_add(renews_in_ms));
        let edge = calendar.window(reported + Span::from_secs(30)).ok()?.start;
        Some(clock_text(Some(calendar), edge))
    }

    /// The warning lines `used` (a ratio) is past.
    pub fn past_lines(&self, used: f64) -> usize {
        self.warn_at.iter().filter(|line| used >= **line).count()
    }
}

/// `spent` of `size` as a ratio (0 for a size of 0).
pub fn used(spent: u64, size: u64) -> f64 {
    if size == 0 {
        0.0
    } else {
        spent as f64 / size as f64
    }
}

/// A percentage to show: `81 %`; a tenth under 1 % (`0.5 %`), so that a
/// small warning line does not read as 0.
pub fn percent(ratio: f64) -> String {
    let p = (ratio * 100.0).max(0.0);
    if p > 0.0 && p < 1.0 {
        format!("{p:.1} %")
    } else {
        format!("{p:.0} %")
    }
}

/// How long until a period renews: `15 h 58 min`, `3 d 4 h`, `42 s`.
pub fn renews_in(ms: u64) -> String {
    let s = ms / 1000;
    let (d, h, m) = (s / 86_400, s % 86_400 / 3600, s % 3600 / 60);
    match (d, h, m) {
        (0, 0, 0) => format!("{s} s"),
        (0, 0, m) => format!("{m} min"),
        (0, h, m) => format!("{h} h {m} min"),
        (d, h, _) => format!("{d} d {h} h"),
    }
}

/// Why a budget last refused a call, `at_ms` (the frame's time) from its
/// refusal: `2 min ago: 0.50 USD of 0.50 USD spent`, or the refusal's
/// reason (`5 s ago: model-unpriced`).
pub fn refused_text(refused: &RefusedCall, spec: &BudgetSpec, at_ms: u64) -> String {
    let ago = renews_in(at_ms.saturating_sub(refused.at_ms));
    if refused.reason == "spent" && refused.size > 0 {
        format!(
            "{ago} ago: {} of {} spent",
            spec.amount(refused.spent),
            spec.amount(refused.size)
        )
    } else if refused.reason == "paced" {
        // A queue rung's refusal: the budget is not spent, only past its
        // line and ahead of the pace that releases the rest.
        format!("{ago} ago: paced, past its queue line")
    } else {
        format!("{ago} ago: {}", refused.reason)
    }
}

/// A month's spend at the mean of `per_second` (the recent frames' pace;
/// frames without the limit left out).
pub fn month_projection(per_second: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = per_second
        .filter(|v| v.is_finite())
        .fold((0.0, 0u32), |(sum, n), v| (sum + v, n + 1));
    if n == 0 {
        0.0
    } else {
        month_at(sum / f64::from(n))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_refusal_says_how_long_ago_and_where_the_budget_stood() {
        let usd = BudgetSpec {
            currency: Some("USD".into()),
            ..BudgetSpec::default()
        };
        let spent = RefusedCall {
            at_ms: 1_000,
            key: 7,
            reason: "spent".into(),
            spent: 500_000,
            size: 500_000,
        };
        assert_eq!(
            refused_text(&spent, &usd, 121_000),
            "2 min ago: 0.50 USD of 0.50 USD spent"
        );
        let unpriced = RefusedCall {
            reason: "model-unpriced".into(),
            ..RefusedCall::default()
        };
        assert_eq!(
            refused_text(&unpriced, &usd, 5_000),
            "5 s ago: model-unpriced"
        );
        let paced = RefusedCall {
            reason: "paced".into(),
            ..RefusedCall::default()
        };
        assert_eq!(
            refused_text(&paced, &usd, 5_000),
            "5 s ago: paced, past its queue line"
        );
        // An Envoy's clock ahead of the admin's: "0 s", not an underflow.
        assert_eq!(
            refused_text(&spent, &BudgetSpec::default(), 0),
            "0 s ago: 500000 of 500000 spent"
        );
    }

    use super::*;

    fn money() -> BudgetSpec {
        BudgetSpec {
            currency: Some("USD".into()),
            warn_at: vec![0.8, 0.95],
            calendar: None,
        }
    }

    #[test]
    fn money_shows_to_the_cent_and_tokens_as_they_are() {
        assert_eq!(money().amount(830_000), "0.83 USD");
        assert_eq!(money().amount(2_000_000), "2.00 USD");
        assert_eq!(money().amount(1_239_999), "1.23 USD");
        assert_eq!(money().amount(3), "< 0.01 USD");
        assert_eq!(money().amount(0), "0.00 USD");
        assert_eq!(BudgetSpec::default().amount(12_345), "12345");
        assert_eq!(money().amount_f(f64::NAN), "0.00 USD");
        assert_eq!(money().amount_f(-5.0), "0.00 USD");
    }

    #[test]
    fn warning_lines_passed_and_shares() {
        assert_eq!(money().past_lines(used(79, 100)), 0);
        assert_eq!(money().past_lines(used(80, 100)), 1);
        assert_eq!(money().past_lines(used(100, 100)), 2);
        assert_eq!(used(5, 0), 0.0);
        assert_eq!(percent(used(81, 100)), "81 %");
        assert_eq!(percent(0.001), "0.1 %");
        assert_eq!(percent(0.0), "0 %");
    }

    #[test]
    fn renewal_and_a_month_at_the_pace() {
        assert_eq!(renews_in(42_000), "42 s");
        assert_eq!(renews_in(57_540_000), "15 h 59 min");
        assert_eq!(renews_in(3 * 86_400_000 + 4 * 3_600_000), "3 d 4 h");
        // 1 micro-unit a second on average: 2.59 units in 30 days.
        let month = month_projection([0.5, 1.5, f64::NAN].into_iter());
        assert_eq!(money().amount_f(month), "2.59 USD");
        assert_eq!(month_projection(std::iter::empty()), 0.0);
    }

    #[test]
    fn only_limits_of_an_hour_or_longer_are_budgets_and_money_has_a_currency() {
        let set: sluice_shared::PolicySet = serde_json::from_str(
            r#"{"version": 1, "policies": [{"name": "llm", "match": {"host": "a.example"},
               "limits": [{"name": "daily", "rate": {"requests": 5000000, "period": "1d", "algorithm": "fixed_window"},
                           "cost": "price", "warn_at": [0.8]},
                          {"name": "tpm", "rate": {"requests": 1000, "period": "1m"}}]}]}"#,
        )
        .expect("a set");
        let specs = budget_specs(&set.policies, None);
        assert_eq!(specs.keys().collect::<Vec<_>>(), ["daily"]);
        assert_eq!(specs["daily"].warn_at, [0.8]);
        assert_eq!(specs["daily"].currency.as_deref(), Some("(no price table)"));
    }

    #[test]
    fn a_calendar_budget_renews_at_its_window_edge_on_its_zones_clock() {
        let set: sluice_shared::PolicySet = serde_json::from_str(
            r#"{"version": 1, "policies": [{"name": "llm", "match": {"host": "a.example"},
               "limits": [{"name": "monthly", "rate": {"requests": 5000000, "period": "calendar_month",
                           "algorithm": "fixed_window", "time_zone": "Europe/Berlin"}, "cost": "price"},
                          {"name": "daily", "rate": {"requests": 5000000, "period": "1d", "algorithm": "fixed_window"}}]}]}"#,
        )
        .expect("a set");
        let specs = budget_specs(&set.policies, None);
        // 2026-12-04T16:00:00Z; December ends at 2026-12-31T23:00:00Z.
        let at_ms = 1_796_400_000_000;
        let exact = 1_798_758_000_000 - at_ms;
        for reported in [exact - 4_000, exact, exact + 2_000] {
            assert_eq!(
                specs["monthly"].renews_at(at_ms, reported).as_deref(),
                Some("2027-01-01T00:00:00+01:00[Europe/Berlin]"),
                "{reported}"
            );
        }
        assert_eq!(specs["monthly"].renews_at(at_ms, 0), None, "nothing spent");
        assert_eq!(specs["daily"].renews_at(at_ms, exact), None);
    }
}
