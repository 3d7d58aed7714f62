//! Scenario 8: budgets in money and tokens per minute per model, for 3
//! minutes (the run of `tests/tests/money_budgets.rs`, longer), printed
//! against the targets of issue 33.

use std::fmt::Write as _;
use std::time::Duration;

use sluice_e2e::llm_budgets::{self, CALLERS, MODELS, TPM_SHARE, WARN_AT};

use crate::judge::verdict;
use crate::scenarios::Report;

/// 3 minutes, and a budget each team spends in about two of them (the
/// models' tokens per minute bind first: a team spends about 4 USD a minute).
const DURATION: Duration = Duration::from_secs(180);
const TEAM_BUDGET: u64 = 8_000_000;

pub async fn money(report: &mut Report) -> anyhow::Result<()> {
    let outcome = llm_budgets::run(DURATION, TEAM_BUDGET).await?;
    let mut s = format!(
        "## 8. Budgets in money, tokens per minute per model\n\n\
         One Envoy (`--concurrency {workers}`) in front of the mock LLM, which limits each model's tokens per \
         minute and bills its answers at the policy set's prices with its own table. Three models \
         ({models}); {CALLERS} callers in 3 teams, each with a daily budget of {budget} USD; calls streamed \
         and not (the streams not asking for their usage: the limits ask), prompts of 10 to 3 000 words, \
         answers of 50 to 800 tokens, every 11th stream left after its first piece; for {secs} s. Each \
         model's policy allows {share:.0} % of the provider's tokens per minute; the budgets warn at \
         {warn:.0} %. The run of `tests/tests/money_budgets.rs`, longer.\n\n\
         | figure | measured | target |\n|---|---|---|\n",
        workers = llm_budgets::WORKERS,
        models = MODELS
            .iter()
            .map(|m| format!("{} at {} tokens a minute", m.name, m.provider_tpm))
            .collect::<Vec<_>>()
            .join(", "),
        budget = sluice_shared::price::Money(TEAM_BUDGET),
        secs = DURATION.as_secs(),
        share = 100.0 * TPM_SHARE,
        warn = 100.0 * WARN_AT,
    );
    for (name, model) in &outcome.models {
        let limit = MODELS
            .iter()
            .find(|m| m.name == name)
            .map_or(0, |m| m.provider_tpm);
        let _ = writeln!(
            s,
            "| {name}: calls the provider refused for tokens per minute | **{}** (busiest minute {} of {limit} tokens, {} in all) | 0: {} |",
            model.refused,
            model.busiest_minute,
            model.tokens,
            verdict(model.refused == 0)
        );
    }
    for (name, team) in &outcome.teams {
        let share = |n: u64| 100.0 * n as f64 / team.budget as f64;
        let ends = team.counted <= team.budget && share(team.counted) >= 99.5;
        let _ = writeln!(
            s,
            "| {name}: spend as Sluice counts it, of its budget | **{:.2} %** ({} answered, {} refused, {} hung up) | within 0.5 %: {} |",
            share(team.counted),
            team.answered,
            team.refused,
            team.hung_up,
            verdict(ends)
        );
        let _ = writeln!(
            s,
            "| {name}: billed by the provider, of its budget | **{:.2} %** (one call's largest estimate: {:.2} %) | at most one call's estimate over: {} |",
            share(team.billed),
            share(team.largest_estimate),
            verdict(team.billed <= team.budget + team.largest_estimate)
        );
        let first = team.first_warning.unwrap_or(0.0);
        let one_call = team.largest_estimate as f64 / team.budget as f64;
        let _ = writeln!(
            s,
            "| {name}: the first `x-sluice-warn` said used | **{first:.2}** | within one call of {WARN_AT}: {} |",
            verdict(first >= WARN_AT && first <= WARN_AT + one_call + 0.01)
        );
    }
    println!("money: {outcome:?}");
    report.add(s);
    Ok(())
}
