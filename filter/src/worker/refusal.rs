//! The one place a refused call's reply is written: admission says why
//! ([`Refusal`]), [`render`] says it to the caller, as headers (the IETF
//! `RateLimit` fields, `Retry-After`, Sluice's own) and a body, unless the
//! policy has a body of its own.

use sluice_filter_core::headers::{
    ratelimit_item, ratelimit_policy_value, ratelimit_value, retry_after_value, LimitKind,
    RATELIMIT, RATELIMIT_POLICY, RETRY_AFTER, SLUICE_POLICY,
};
use sluice_filter_core::matcher::CompiledPolicy;
use sluice_filter_core::mcp::BatchProblem;
use sluice_shared::time::Span;

use sluice_shared::limiter::Standing;
use sluice_shared::price::Money;
use sluice_shared::NamedLimit;

use super::limits::Why;

use super::to_shell::{LocalReply, LIMIT_HEADER, REASON_HEADER};

/// Why a call is refused: all its reply says besides the policy and the
/// time to wait.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Refusal {
    /// The policy's own limit (`kind`: its rate or its concurrency), a
    /// fleet share that allows nothing, or a store that could not decide.
    Policy { kind: LimitKind },
    /// One of the policy's further limits, by its own count (`standing`:
    /// where it stood) or by what its provider said.
    Limit {
        limit: String,
        why: Why,
        standing: Option<Standing>,
    },
    /// A budget whose spending before this Envoy started is not known yet
    /// (it clears once the admin answers).
    BudgetUnknown { limit: String },
    /// The call costs more than this Envoy's share of a global policy can
    /// ever hold: retrying the same call here fails until the share grows.
    AboveShareBurst { cost: u64, burst: u64 },
    /// The policy's rate is shared fairly (`fair`) and the call's key is
    /// past its share while others want theirs.
    FairShare,
}

impl Refusal {
    /// The further limit the refusal names, if any.
    fn limit(&self) -> Option<&str> {
        match self {
            Refusal::Limit { limit, .. } | Refusal::BudgetUnknown { limit } => Some(limit),
            Refusal::Policy { .. } | Refusal::AboveShareBurst { .. } | Refusal::FairShare => None,
        }
    }

    /// The `x-sluice-reason` value, when the limit alone does not say why.
    pub(super) fn reason(&self) -> Option<&'static str> {
        match self {
            Refusal::Policy { .. }
            | Refusal::Limit {
                why: Why::Limit, ..
            } => None,
            Refusal::Limit {
                why: Why::ProviderPause,
                ..
            } => Some("provider-pause"),
            Refusal::Limit {
                why: Why::ProviderCount,
                ..
            } => Some("provider-remaining"),
            Refusal::Limit {
                why: Why::Unpriced, ..
            } => Some("model-unpriced"),
            Refusal::Limit {
                why: Why::ToolUnpriced,
                ..
            } => Some("tool-unpriced"),
            Refusal::Limit {
                why: Why::FairShare,
                ..
            } => Some("fair-share"),
            Refusal::Limit {
                why: Why::Paced, ..
            } => Some("paced"),
            Refusal::BudgetUnknown { .. } => Some("budget-unknown"),
            Refusal::AboveShareBurst { .. } => Some("cost-above-share-burst"),
            Refusal::FairShare => Some("fair-share"),
        }
    }

    /// The body, for a policy without one of its own.
    fn explain(&self, policy: &str, retry_after: Span) -> String {
        match self {
            Refusal::Policy { .. } => format!("limited by sluice policy {policy}\n"),
            Refusal::Limit {
                limit,
                why: Why::Limit,
                ..
            } => format!("limited by sluice policy {policy} (limit {limit})\n"),
            Refusal::Limit {
                limit,
                why: Why::Unpriced,
                ..
            } => format!(
                "refused by sluice policy {policy}: the call's model has no price, and the price table no default (limit {limit} counts money)\n"
            ),
            Refusal::Limit {
                limit,
                why: Why::ToolUnpriced,
                ..
            } => format!(
                "refused by sluice policy {policy}: a tool it calls has no price, and the price table no tool_default (limit {limit} counts money)\n"
            ),
            Refusal::Limit {
                limit,
                why: Why::FairShare,
                ..
            } => format!(
                "limited by sluice policy {policy} (limit {limit}): this caller has used its fair share of the limit while others want theirs\n"
            ),
            Refusal::Limit {
                limit,
                why: Why::Paced,
                ..
            } => format!(
                "limited by sluice policy {policy} (limit {limit}): past its queue line, the rest of its window goes at an even pace, and this call's turn is {} ms away\n",
                retry_after.as_millis()
            ),
            Refusal::Limit { limit, why, .. } => {
                let what = if *why == Why::ProviderCount {
                    "the provider has nothing left of this limit until its reset"
                } else {
                    "the provider asked to wait before calling again"
                };
                format!(
                    "refused by sluice policy {policy}: {what} (limit {limit}, {} ms left)\n",
                    retry_after.as_millis()
                )
            }
            Refusal::BudgetUnknown { limit } => format!(
                "refused by sluice policy {policy}: budget {limit} resumes once the admin says what it spent before this Envoy started\n"
            ),
            Refusal::AboveShareBurst { cost, burst } => format!(
                "refused by sluice policy {policy}: this call costs {cost}, more than this Envoy's share of the global limit holds ({burst})\n"
            ),
            Refusal::FairShare => format!(
                "limited by sluice policy {policy}: this caller has used its fair share while others want theirs\n"
            ),
        }
    }
}

/// The local reply refusing a call of `policy`, which may try again after
/// `retry_after`.
/// The answer to a call whose JSON body names `key` twice in one object,
/// under a policy that reads the body: 400, since Sluice and the provider
/// may read such a body differently. Nothing of it was counted.
pub(super) fn duplicate_key(policy: &CompiledPolicy, key: &str) -> LocalReply {
    let key: String = key.chars().take(64).filter(|c| !c.is_control()).collect();
    LocalReply {
        status: 400,
        headers: vec![
            ("x-sluice-policy", policy.name().to_string()),
            ("x-sluice-reason", "body-duplicate-key".to_string()),
            ("content-type", "text/plain".to_string()),
        ],
        body: format!(
            "refused by sluice policy {}: the request's JSON body names {key:?} twice in one object\n",
            policy.name()
        )
        .into_bytes(),
    }
}

/// The answer to a batch of MCP messages its policy cannot decide as one
/// call: 400 (JSON-RPC's invalid request once said as JSON-RPC), nothing
/// of it counted; sent one by one, its messages are decided.
pub(super) fn batch_refused(policy: &CompiledPolicy, problem: BatchProblem) -> LocalReply {
    LocalReply {
        status: 400,
        headers: vec![
            (SLUICE_POLICY, policy.name().to_string()),
            (REASON_HEADER, problem.reason().to_string()),
            ("content-type", "text/plain".to_string()),
        ],
        body: format!(
            "refused by sluice policy {}: a batch of MCP messages: {}\n",
            policy.name(),
            problem.explain()
        )
        .into_bytes(),
    }
}

pub(super) fn render(policy: &CompiledPolicy, refusal: &Refusal, retry_after: Span) -> LocalReply {
    let spec = &policy.policy;
    // The RateLimit field speaks of what refused: a further limit, or the
    // policy's own.
    let ratelimit = match (refusal, refusal.limit()) {
        (_, Some(limit)) => ratelimit_item(limit, 0, Some(retry_after)),
        (Refusal::Policy { kind }, None) => ratelimit_value(spec, *kind, 0, retry_after),
        (_, None) => ratelimit_value(spec, LimitKind::Rate, 0, retry_after),
    };
    let mut headers = vec![
        (RETRY_AFTER, retry_after_value(retry_after)),
        (RATELIMIT_POLICY, ratelimit_policy_value(spec)),
        (RATELIMIT, ratelimit),
        (SLUICE_POLICY, spec.name.clone()),
        ("content-type", "text/plain; charset=utf-8".to_string()),
    ];
    if let Some(limit) = refusal.limit() {
        headers.push((LIMIT_HEADER, limit.to_string()));
    }
    if let Some(reason) = refusal.reason() {
        headers.push((REASON_HEADER, reason.to_string()));
    }
    let told = budget_told(policy, refusal);
    if let Some(told) = &told {
        headers.extend(told.headers());
    }
    let body = match (&spec.on_limit.body, &told) {
        (Some(body), _) => body.as_bytes().to_vec(),
        (None, Some(told)) => told.explain(policy.name()).into_bytes(),
        (None, None) => refusal.explain(policy.name(), retry_after).into_bytes(),
    };
    LocalReply {
        status: u32::from(spec.on_limit.status),
        headers,
        body,
    }
}

/// Headers of a budget's refusal: what is spent, the budget, and how long
/// until it renews (whole seconds, rounded up); for money, its currency
/// and amounts as decimals of it.
pub const SPENT_HEADER: &str = "x-sluice-spent";
pub const BUDGET_HEADER: &str = "x-sluice-budget";
pub const RENEWS_HEADER: &str = "x-sluice-renews-in";
/// The instant it renews, on the clock of its windows: a calendar
/// budget's zone (`2026-03-30T00:00:00+02:00[Europe/Berlin]`), else UTC.
pub const RENEWS_AT_HEADER: &str = "x-sluice-renews-at";
pub const CURRENCY_HEADER: &str = "x-sluice-currency";

/// What a refusal by a budget (a limit counting money, or of a period of
/// an hour or more) tells about it.
struct BudgetTold<'a> {
    limit: &'a str,
    standing: Standing,
    /// When it renews, as [`RENEWS_AT_HEADER`] says it.
    renews_at: String,
    currency: Option<&'a str>,
    /// What is spent and the budget's size are told (`tell_spend`); else
    /// only that it is spent and when it renews.
    figures: bool,
}

/// The refusal's budget, when a budget refused by its own count.
fn budget_told<'a>(policy: &'a CompiledPolicy, refusal: &'a Refusal) -> Option<BudgetTold<'a>> {
    let Refusal::Limit {
        limit,
        why: Why::Limit,
        standing: Some(standing),
    } = refusal
    else {
        return None;
    };
    let policy = policy.holder_of(limit)?;
    let compiled = policy.limits.iter().find(|l| l.name == *limit)?;
    let spec = policy.policy.limits.iter().find(|l| l.name == *limit)?;
    let long = spec
        .rate
        .as_ref()
        .is_some_and(|r| r.period.length() >= NamedLimit::BUDGET_MIN_PERIOD);
    let currency = compiled.is_priced().then(|| policy.currency()).flatten();
    (long || currency.is_some()).then(|| BudgetTold {
        limit,
        renews_at: compiled.rate.clock_text(standing.renews_at),
        standing: *standing,
        currency,
        figures: compiled.tells_spend,
    })
}

impl BudgetTold<'_> {
    fn amount(&self, n: u64) -> String {
        match self.currency {
            Some(_) => Money(n).to_string(),
            None => n.to_string(),
        }
    }

    fn renews_in_secs(&self) -> u64 {
        self.standing.until_reset.as_secs_ceil()
    }

    fn headers(&self) -> Vec<(&'static str, String)> {
        let mut headers = vec![
            (RENEWS_HEADER, self.renews_in_secs().to_string()),
            (RENEWS_AT_HEADER, self.renews_at.clone()),
        ];
        if self.figures {
            headers.push((SPENT_HEADER, self.amount(self.standing.spent)));
            headers.push((BUDGET_HEADER, self.amount(self.standing.size)));
        }
        if let Some(currency) = self.currency {
            headers.push((CURRENCY_HEADER, currency.to_string()));
        }
        headers
    }

    fn explain(&self, policy: &str) -> String {
        let unit = match self.currency {
            Some(currency) => format!(" {currency}"),
            None => " tokens".to_string(),
        };
        let secs = self.renews_in_secs();
        if !self.figures {
            return format!(
                "limited by sluice policy {policy} (limit {limit}): its budget is spent; it renews in {h}h {m:02}m {s:02}s, at {at}\n",
                limit = self.limit,
                at = self.renews_at,
                h = secs / 3600,
                m = secs % 3600 / 60,
                s = secs % 60,
            );
        }
        format!(
            "limited by sluice policy {policy} (limit {limit}): spent {spent}{unit} of a budget of {size}{unit}; it renews in {h}h {m:02}m {s:02}s, at {at}\n",
            limit = self.limit,
            at = self.renews_at,
            spent = self.amount(self.standing.spent),
            size = self.amount(self.standing.size),
            h = secs / 3600,
            m = secs % 3600 / 60,
            s = secs % 60,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_shared::time::Instant;
    use sluice_shared::validate::parse_policy;

    fn policy(json: &str) -> CompiledPolicy {
        CompiledPolicy::new(parse_policy(json).unwrap_or_else(|e| panic!("{e}")))
    }

    fn header<'a>(reply: &'a LocalReply, name: &str) -> Option<&'a str> {
        reply
            .headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }

    #[test]
    fn a_refusal_by_the_policy_carries_all_headers() {
        let p = policy(
            r#"{"name": "bank", "match": {"host": "*"}, "rate": {"requests": 100, "period": "1s", "burst": 20}}"#,
        );
        let refusal = Refusal::Policy {
            kind: LimitKind::Rate,
        };
        let reply = render(&p, &refusal, Span::from_millis(10));
        assert_eq!(
            reply.headers,
            vec![
                ("retry-after", "1".to_string()),
                ("ratelimit-policy", "\"bank\";q=100;w=1".to_string()),
                ("ratelimit", "\"bank\";r=0;t=1".to_string()),
                ("x-sluice-policy", "bank".to_string()),
                ("content-type", "text/plain; charset=utf-8".to_string()),
            ]
        );
        assert_eq!(reply.body, b"limited by sluice policy bank\n");
        assert_eq!(reply.status, 429);
    }

    #[test]
    fn a_refusal_by_a_further_limit_names_it_and_says_why() {
        let p = policy(
            r#"{"name": "openai", "match": {"host": "*"}, "rate": {"requests": 500, "period": "1m"},
                "limits": [{"name": "tpm", "rate": {"requests": 30000, "period": "1m"}}]}"#,
        );
        let by = |why| Refusal::Limit {
            limit: "tpm".to_string(),
            why,
            standing: None,
        };
        let reply = render(&p, &by(Why::Limit), Span::from_millis(1500));
        assert_eq!(header(&reply, "retry-after"), Some("2"));
        assert_eq!(header(&reply, "ratelimit"), Some("\"tpm\";r=0;t=2"));
        assert_eq!(header(&reply, LIMIT_HEADER), Some("tpm"));
        assert_eq!(header(&reply, REASON_HEADER), None);
        assert_eq!(reply.body, b"limited by sluice policy openai (limit tpm)\n");
        let paused = render(&p, &by(Why::ProviderPause), Span::from_millis(1500));
        assert_eq!(header(&paused, REASON_HEADER), Some("provider-pause"));
        assert!(String::from_utf8_lossy(&paused.body).contains("1500 ms left"));
        let counted = render(&p, &by(Why::ProviderCount), Span::from_millis(1500));
        assert_eq!(header(&counted, REASON_HEADER), Some("provider-remaining"));
        let unknown = Refusal::BudgetUnknown {
            limit: "tpm".to_string(),
        };
        let reply = render(&p, &unknown, Span::from_secs(1));
        assert_eq!(header(&reply, REASON_HEADER), Some("budget-unknown"));
        assert_eq!(header(&reply, LIMIT_HEADER), Some("tpm"));
    }

    #[test]
    fn a_policys_own_body_and_status_replace_sluices() {
        let p = policy(
            r#"{"name": "fx", "match": {"host": "*"}, "rate": {"requests": 5, "period": "1s"},
                "on_limit": {"status": 503, "body": "{\"busy\": true}"}}"#,
        );
        let refusal = Refusal::AboveShareBurst { cost: 9, burst: 5 };
        let reply = render(&p, &refusal, Span::from_secs(1));
        assert_eq!(
            (reply.status, reply.body.as_slice()),
            (503, &b"{\"busy\": true}"[..])
        );
        assert_eq!(
            header(&reply, REASON_HEADER),
            Some("cost-above-share-burst")
        );
        assert_eq!(header(&reply, "ratelimit"), Some("\"fx\";r=0;t=1"));
    }
    #[test]
    fn a_budget_that_keeps_its_figures_says_only_when_it_renews() {
        // Third review (also): a company-wide budget every caller shares.
        let set = sluice_filter_core::matcher::CompiledPolicySet::from_json(
            r#"{"version": 1, "prices": {"currency": "USD", "models": {"m": {"input": 1, "output": 2}}},
                "policies": [{"name": "llm", "match": {"host": "*"}, "rate": {"requests": 100, "period": "1s"},
                  "limits": [{"name": "company-monthly", "rate": {"requests": 50000000000, "period": "31d", "algorithm": "fixed_window"},
                              "cost": "price", "tell_spend": false},
                             {"name": "team-daily", "key": {"header": "x-team"},
                              "rate": {"requests": 10000, "period": "1d", "algorithm": "fixed_window"}, "cost": "price"}]}]}"#,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let p = &set.policies[0];
        let refused = Refusal::Limit {
            limit: "company-monthly".into(),
            why: Why::Limit,
            standing: Some(Standing {
                spent: 49_999_000_000,
                size: 50_000_000_000,
                until_reset: Span::from_secs(7_200),
                renews_at: Instant::from_millis(1_800_007_200_000),
            }),
        };
        let reply = render(p, &refused, Span::from_secs(10));
        assert_eq!(header(&reply, SPENT_HEADER), None);
        assert_eq!(header(&reply, BUDGET_HEADER), None);
        assert_eq!(header(&reply, RENEWS_HEADER), Some("7200"));
        assert_eq!(
            header(&reply, RENEWS_AT_HEADER),
            Some("2027-01-15T10:00:00Z")
        );
        let body = String::from_utf8_lossy(&reply.body);
        assert_eq!(
            body,
            "limited by sluice policy llm (limit company-monthly): its budget is spent; it renews in 2h 00m 00s, at 2027-01-15T10:00:00Z\n"
        );
        let quota = header(&reply, "ratelimit-policy").unwrap_or_default();
        assert!(!quota.contains("company-monthly"), "{quota}");
        assert!(quota.contains("\"team-daily\";q=10000"), "{quota}");
    }

    #[test]
    fn a_budgets_refusal_says_what_is_spent_of_it_and_when_it_renews() {
        let set = sluice_filter_core::matcher::CompiledPolicySet::from_json(
            r#"{"version": 1, "prices": {"currency": "EUR", "models": {"m": {"input": 1, "output": 2}}},
                "policies": [{"name": "llm", "match": {"host": "*"}, "rate": {"requests": 100, "period": "1s"},
                  "limits": [
                    {"name": "team-daily", "key": {"header": "x-team"},
                     "rate": {"requests": 10000, "period": "1d", "algorithm": "fixed_window"}, "cost": "price"},
                    {"name": "tokens-daily", "rate": {"requests": 500000, "period": "1d", "algorithm": "fixed_window"}},
                    {"name": "tpm", "rate": {"requests": 1000, "period": "1m"}}]}]}"#,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let p = &set.policies[0];
        let standing = Standing {
            spent: 9_576,
            size: 10_000,
            until_reset: Span::from_millis(3_600_500),
            // A second and a half past: told as the next whole second.
            renews_at: Instant::from_millis(1_800_003_600_500),
        };
        let refused = |limit: &str| Refusal::Limit {
            limit: limit.into(),
            why: Why::Limit,
            standing: Some(standing),
        };
        let money = render(p, &refused("team-daily"), Span::from_secs(10));
        assert_eq!(header(&money, SPENT_HEADER), Some("0.009576"));
        assert_eq!(header(&money, BUDGET_HEADER), Some("0.01"));
        assert_eq!(header(&money, RENEWS_HEADER), Some("3601"));
        assert_eq!(header(&money, CURRENCY_HEADER), Some("EUR"));
        assert_eq!(
            String::from_utf8_lossy(&money.body),
            "limited by sluice policy llm (limit team-daily): spent 0.009576 EUR of a budget of 0.01 EUR; it renews in 1h 00m 01s, at 2027-01-15T09:00:01Z\n"
        );
        let tokens = render(p, &refused("tokens-daily"), Span::from_secs(10));
        assert_eq!(header(&tokens, SPENT_HEADER), Some("9576"));
        assert_eq!(header(&tokens, CURRENCY_HEADER), None);
        assert!(String::from_utf8_lossy(&tokens.body)
            .contains("spent 9576 tokens of a budget of 10000 tokens"));
        // A minute's rate is no budget; a provider's pause says its own.
        let rate = render(p, &refused("tpm"), Span::from_secs(10));
        assert_eq!(header(&rate, SPENT_HEADER), None);
        let paused = Refusal::Limit {
            limit: "team-daily".into(),
            why: Why::ProviderPause,
            standing: None,
        };
        assert_eq!(
            header(&render(p, &paused, Span::from_secs(10)), SPENT_HEADER),
            None
        );
    }

    #[test]
    fn a_calendar_budget_says_when_it_renews_on_its_zones_clock() {
        let set = sluice_filter_core::matcher::CompiledPolicySet::from_json(
            r#"{"version": 1, "policies": [{"name": "llm", "match": {"host": "*"}, "rate": {"requests": 100, "period": "1s"},
                  "limits": [{"name": "berlin-monthly",
                    "rate": {"requests": 1000, "period": "calendar_month", "algorithm": "fixed_window",
                             "time_zone": "Europe/Berlin"}}]}]}"#,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let p = &set.policies[0];
        let limit = &p.limits[0].rate;
        let mut state = limit.initial_state();
        // 2026-10-31T20:00:00Z is 21:00 in Berlin, after clocks went back:
        // November begins three hours later, at 23:00 UTC.
        let now = Instant::from_millis(1_793_476_800_000);
        assert!(limit.try_acquire(&mut state, now, 1000).is_admit());
        let refused = Refusal::Limit {
            limit: "berlin-monthly".into(),
            why: Why::Limit,
            standing: Some(Standing::of(limit, &state, now)),
        };
        let reply = render(p, &refused, Span::from_secs(10_800));
        assert_eq!(header(&reply, RENEWS_HEADER), Some("10800"));
        assert_eq!(
            header(&reply, RENEWS_AT_HEADER),
            Some("2026-11-01T00:00:00+01:00[Europe/Berlin]")
        );
        assert!(String::from_utf8_lossy(&reply.body)
            .ends_with("it renews in 3h 00m 00s, at 2026-11-01T00:00:00+01:00[Europe/Berlin]\n"));
    }
}
