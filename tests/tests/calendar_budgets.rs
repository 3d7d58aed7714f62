//! Calendar budgets through a real Envoy (`--concurrency 4`) in front of
//! the mock LLM: a team's money per month in Berlin and everyone's calls
//! per day in Kathmandu (UTC+05:45, so its midnight is on no UTC hour).
//! Each is refused when spent, and its refusal says it renews at the next
//! 1st or the next local midnight, in seconds and on the zone's clock,
//! the instant computed here with jiff from the wall clock.
//!
//! The renewal itself (that the limit does open again at that instant,
//! across clock changes and month ends) is proven on the limiter with
//! exact instants (`shared/tests/calendar_budgets.rs`): Envoy's clock
//! cannot be moved to a month's end from outside (libfaketime, preloaded,
//! deadlocks Envoy 1.40 at start inside its allocator's first call).

use jiff::{Timestamp, ToSpan, ZonedDateTime};
use sluice_demo::llm::{LlmLimits, MockLlm, MockPrice};
use sluice_e2e::envoy::Envoy;
use sluice_e2e::load::client;

const WORKERS: u32 = 4;

/// A team's 0.002 USD a month; everyone's 40 calls a day.
const TEAM_BUDGET: u64 = 2_000;
const CALLS_A_DAY: u64 = 40;

fn policies() -> String {
    format!(
        r#"[{{"name": "llm", "match": {{"host": "api.llm.example"}}, "rate": {{"requests": 1000, "period": "1s"}},
        "limits": [
          {{"name": "team-monthly", "key": {{"header": "x-team"}},
            "rate": {{"requests": {TEAM_BUDGET}, "period": "calendar_month", "algorithm": "fixed_window",
                      "time_zone": "Europe/Berlin"}},
            "cost": "price"}},
          {{"name": "calls-daily",
            "rate": {{"requests": {CALLS_A_DAY}, "period": "calendar_day", "algorithm": "fixed_window",
                      "time_zone": "Asia/Kathmandu"}}}}]}}]"#
    )
}

const PRICES: &str = r#"{"currency": "USD", "models": {
    "gpt-4o": {"input": "2.50", "output": "10.00"},
    "gpt-4o-mini": {"input": 0.15, "output": 0.6}}}"#;

struct Refused {
    limit: Option<String>,
    renews_in: Option<u64>,
    renews_at: Option<String>,
    body: String,
}

async fn chat(
    http: &reqwest::Client,
    url: &str,
    team: &str,
    model: &str,
) -> anyhow::Result<Option<Refused>> {
    let body = serde_json::json!({"model": model, "max_tokens": 40,
        "messages": [{"role": "user", "content": "How do rivers form?"}]});
    let response = http
        .post(url)
        .header("host", "api.llm.example")
        .header("x-team", team)
        .header("authorization", format!("Bearer {team}"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await?;
    let header = |name: &str| sluice_e2e::load::header_text(&response, name);
    match response.status().as_u16() {
        200 => {
            response.bytes().await?;
            Ok(None)
        }
        429 => Ok(Some(Refused {
            limit: header("x-sluice-limit"),
            renews_in: header("x-sluice-renews-in").and_then(|v| v.parse().ok()),
            renews_at: header("x-sluice-renews-at"),
            body: response.text().await?,
        })),
        other => anyhow::bail!("{other}: {}", response.text().await?),
    }
}

/// The start of the next window after `now` in `zone`: the 1st of next
/// month, or tomorrow, at the zone's first instant of that day.
fn next_renewal(now: Timestamp, zone: &str, month: bool) -> anyhow::Result<ZonedDateTime> {
    let local = now.in_tz(zone)?;
    let next_day = if month {
        local.date().first_of_month().checked_add(1.month())?
    } else {
        local.date().tomorrow()?
    };
    Ok(next_day.in_tz(zone)?.start_of_day()?)
}

/// What a refusal said agrees with the renewal jiff tells for the time
/// the call was made (either side of it, should a midnight fall between).
fn says_it_renews_at(
    refused: &Refused,
    (before, after): (Timestamp, Timestamp),
    zone: &str,
    month: bool,
) -> anyhow::Result<()> {
    let expected = [
        next_renewal(before, zone, month)?,
        next_renewal(after, zone, month)?,
    ];
    let told = refused.renews_at.as_deref().unwrap_or("");
    anyhow::ensure!(
        expected.iter().any(|z| z.to_string() == told),
        "renews at {told:?}, expected {}: {}",
        expected[0],
        refused.body
    );
    let renews_in = refused.renews_in.unwrap_or(0) as i64;
    let until = expected[0].timestamp().as_second() - before.as_second();
    anyhow::ensure!(
        (until - 5..=until + 5).contains(&renews_in),
        "renews in {renews_in} s, {until} s to {}",
        expected[0]
    );
    anyhow::ensure!(
        refused.body.trim_end().ends_with(&format!(", at {told}")),
        "{}",
        refused.body
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calendar_budgets_refuse_until_the_next_local_first_and_midnight() -> anyhow::Result<()> {
    let llm = MockLlm::start("127.0.0.1:0".parse()?, LlmLimits::default()).await?;
    let config = format!(
        r#"{{"instance": "e2e-calendar", "fallback": {{"version": 1, "prices": {PRICES}, "policies": {}}}}}"#,
        policies()
    );
    let envoy = Envoy::start(&config, llm.addr.port(), WORKERS)?;
    llm.reset();
    llm.set_prices(vec![
        MockPrice {
            model: "gpt-4o".into(),
            input: 2_500_000,
            cached_input: 0,
            output: 10_000_000,
        },
        MockPrice {
            model: "gpt-4o-mini".into(),
            input: 150_000,
            cached_input: 0,
            output: 600_000,
        },
    ]);
    let url = envoy.url("/v1/chat/completions");
    let http = client();

    // Team a spends its month on the dear model.
    let mut team_a_calls = 0u64;
    let (monthly, monthly_when) = loop {
        let before = Timestamp::now();
        let answer = chat(&http, &url, "team-a", "gpt-4o").await?;
        match answer {
            None => team_a_calls += 1,
            Some(refused) => break (refused, (before, Timestamp::now())),
        }
        anyhow::ensure!(team_a_calls < CALLS_A_DAY, "team a was never refused");
    };
    let billed = llm.stats().spent.get("team-a").copied().unwrap_or(0);
    println!(
        "calendar budgets: team a refused after {team_a_calls} calls, billed {billed} micro-USD of {TEAM_BUDGET}: {:?} {:?} {}",
        monthly.renews_in,
        monthly.renews_at,
        monthly.body.trim_end()
    );
    anyhow::ensure!(monthly.limit.as_deref() == Some("team-monthly"));
    anyhow::ensure!(billed <= TEAM_BUDGET, "billed {billed}");
    says_it_renews_at(&monthly, monthly_when, "Europe/Berlin", true)?;
    anyhow::ensure!(
        monthly
            .renews_at
            .as_deref()
            .is_some_and(|t| t.ends_with("T00:00:00+01:00[Europe/Berlin]")
                || t.ends_with("T00:00:00+02:00[Europe/Berlin]")),
        "{:?}",
        monthly.renews_at
    );

    // Team b calls the cheap model until everyone's day is spent.
    let mut team_b_calls = 0u64;
    let (daily, daily_when) = loop {
        let before = Timestamp::now();
        match chat(&http, &url, "team-b", "gpt-4o-mini").await? {
            None => team_b_calls += 1,
            Some(refused) => break (refused, (before, Timestamp::now())),
        }
        anyhow::ensure!(team_b_calls <= CALLS_A_DAY, "the day was never spent");
    };
    println!(
        "calendar budgets: team b refused after {team_b_calls} calls: {:?} {:?} {}",
        daily.renews_in,
        daily.renews_at,
        daily.body.trim_end()
    );
    anyhow::ensure!(daily.limit.as_deref() == Some("calls-daily"));
    // Admitted calls are the day's count: team a's refused call counted
    // nothing (all or nothing).
    anyhow::ensure!(
        team_a_calls + team_b_calls == CALLS_A_DAY,
        "{team_a_calls} + {team_b_calls} calls in a day of {CALLS_A_DAY}"
    );
    says_it_renews_at(&daily, daily_when, "Asia/Kathmandu", false)?;
    anyhow::ensure!(
        daily
            .renews_at
            .as_deref()
            .is_some_and(|t| t.ends_with("T00:00:00+05:45[Asia/Kathmandu]")),
        "{:?}",
        daily.renews_at
    );
    Ok(())
}
