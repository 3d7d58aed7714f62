//! Budgets in money through a real Envoy (`--concurrency 4`) in front of
//! the mock LLM: a price table per model, limits whose cost is `price`
//! (estimated before the call at the model's prices, charged after it
//! from the usage the answer reports), per team and for everyone.

use anyhow::Context;
use sluice_demo::llm::{LlmLimits, MockLlm, MockPrice};
use sluice_e2e::envoy::Envoy;
use sluice_e2e::load::client;

const WORKERS: u32 = 4;

/// What the mock provider bills: the same prices, per million tokens in
/// micro-units, counted its own way.
fn provider_prices() -> Vec<MockPrice> {
    let price = |model: &str, input, cached_input, output| MockPrice {
        model: model.into(),
        input,
        cached_input,
        output,
    };
    vec![
        price("gpt-4o", 2_500_000, 1_250_000, 10_000_000),
        price("gpt-4o-mini*", 150_000, 75_000, 600_000),
    ]
}

const PRICES: &str = r#"{"currency": "USD", "models": {
    "gpt-4o": {"input": "2.50", "output": "10.00", "cached_input": "1.25"},
    "gpt-4o-mini*": {"input": 0.15, "output": 0.6, "cached_input": 0.075}}}"#;

/// Each team 0.01 USD a day; everyone together 0.025.
const TEAM_BUDGET: u64 = 10_000;
const COMPANY_BUDGET: u64 = 25_000;

async fn llm_behind_envoy(policies: &str) -> anyhow::Result<(MockLlm, Envoy)> {
    let llm = MockLlm::start("127.0.0.1:0".parse()?, LlmLimits::default()).await?;
    let config = format!(
        r#"{{"instance": "e2e-money", "fallback": {{"version": 1, "prices": {PRICES}, "policies": {policies}}}}}"#
    );
    let envoy = Envoy::start(&config, llm.addr.port(), WORKERS)?;
    llm.reset();
    llm.set_prices(provider_prices());
    Ok((llm, envoy))
}

struct Answer {
    status: u16,
    reason: Option<String>,
    limit: Option<String>,
    /// What a budget's refusal says: spent, budget, renews in, currency.
    told: [Option<String>; 4],
    /// `x-sluice-warn`, on a call that left a limit past a warning line.
    warn: Option<String>,
    body: String,
}

async fn chat(
    http: &reqwest::Client,
    url: &str,
    (team, model, max_tokens): (&str, &str, u64),
    stream: bool,
    prompt: &str,
) -> anyhow::Result<Answer> {
    let body = serde_json::json!({"model": model, "max_tokens": max_tokens, "stream": stream,
        "messages": [{"role": "user", "content": prompt}]});
    let response = http
        .post(url)
        .header("host", "api.llm.example")
        .header("authorization", format!("Bearer {team}"))
        .header("x-team", team)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await?;
    let header = |name: &str| sluice_e2e::load::header_text(&response, name);
    let (reason, limit) = (header("x-sluice-reason"), header("x-sluice-limit"));
    let told = [
        "x-sluice-spent",
        "x-sluice-budget",
        "x-sluice-renews-in",
        "x-sluice-currency",
    ]
    .map(header);
    let warn = header("x-sluice-warn");
    let status = response.status().as_u16();
    Ok(Answer {
        status,
        reason,
        limit,
        told,
        warn,
        body: response.text().await?,
    })
}

/// Two teams call two priced models, JSON and streamed (the streams not
/// asking for usage: the limit asks for them), until their daily budgets
/// refuse: each call is charged exactly what its answer's usage costs at
/// its model's prices, each team stops at its own budget, and a model
/// missing from the table is refused, never free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn money_budgets_charge_each_call_its_usage_at_its_models_prices() -> anyhow::Result<()> {
    let policies = format!(
        r#"[{{"name": "llm", "match": {{"host": "api.llm.example"}}, "rate": {{"requests": 1000, "period": "1s"}},
        "limits": [
          {{"name": "team-daily", "key": {{"header": "x-team"}},
            "rate": {{"requests": {TEAM_BUDGET}, "period": "1d", "algorithm": "fixed_window"}},
            "cost": "price", "usage": {{"ask_stream_usage": true}}, "warn_at": [0.8, 0.95]}},
          {{"name": "company-daily",
            "rate": {{"requests": {COMPANY_BUDGET}, "period": "1d", "algorithm": "fixed_window"}},
            "cost": {{"price": {{"default_output": 500}}}}, "usage": {{"ask_stream_usage": true}}}}]}}]"#
    );
    let (llm, envoy) = llm_behind_envoy(&policies).await?;
    let url = envoy.url("/v1/chat/completions");
    let http = client();
    let mut calls = std::collections::BTreeMap::<&str, u64>::new();
    let mut refused_at = std::collections::BTreeMap::<&str, usize>::new();
    let mut told = std::collections::BTreeMap::<&str, ([Option<String>; 4], String)>::new();
    // Per team, each admitted call: (what the provider had billed the
    // team before it, its warning).
    let mut warned = std::collections::BTreeMap::<&str, Vec<(u64, Option<String>)>>::new();
    for i in 0..400usize {
        if refused_at.len() == 2 {
            break;
        }
        let (team, model, max_tokens) = if i % 2 == 0 {
            ("team-a", "gpt-4o", 40)
        } else {
            ("team-b", "gpt-4o-mini-2024-07-18", 1000)
        };
        if refused_at.contains_key(team) {
            continue;
        }
        let prompt = format!("Question {i}: how do rivers form? ").repeat(1 + i % 4);
        let billed_before = llm.stats().spent.get(team).copied().unwrap_or(0);
        let answer = chat(&http, &url, (team, model, max_tokens), i % 3 == 0, &prompt).await?;
        match answer.status {
            200 => {
                *calls.entry(team).or_default() += 1;
                warned
                    .entry(team)
                    .or_default()
                    .push((billed_before, answer.warn.clone()));
            }
            429 => {
                anyhow::ensure!(
                    answer.limit.as_deref() == Some("team-daily") && answer.reason.is_none(),
                    "call {i}: refused by {:?} ({:?}): {}",
                    answer.limit,
                    answer.reason,
                    answer.body
                );
                refused_at.insert(team, i);
                told.insert(team, (answer.told, answer.body));
            }
            other => anyhow::bail!("call {i}: {other} {}", answer.body),
        }
    }
    // Settled once each answer ended: wait for the last usage read.
    let billed = llm.stats().spent;
    let total: u64 = billed.values().sum();
    sluice_e2e::load::wait_for(
        "company-daily charged",
        std::time::Duration::from_secs(10),
        || envoy.limit_stat("company-daily", "tokens").unwrap_or(0.0) >= total as f64,
    )
    .await?;
    let company = envoy.limit_stat("company-daily", "tokens")?;
    let per_team = envoy.limit_stat("team-daily", "tokens")?;
    let unpriced = chat(&http, &url, ("team-c", "claude-3-opus", 10), false, "hi").await?;
    println!(
        "money budgets: {calls:?} calls, the provider billed {billed:?} micro-USD (budget {TEAM_BUDGET} each), refused at calls {refused_at:?}; \
         sluice charged the teams {per_team} and the company {company}; an unpriced model: {} {:?} {:?}",
        unpriced.status, unpriced.reason, unpriced.limit
    );
    assert_eq!(
        per_team, total as f64,
        "each call its usage at its model's prices"
    );
    assert_eq!(company, total as f64);
    assert_eq!(refused_at.len(), 2, "both teams reached their budget");
    for spent in billed.values() {
        assert!(*spent <= TEAM_BUDGET, "{spent} within the budget");
    }
    // Each refusal said what the team spent (all the provider billed it),
    // the budget, and when it renews (by the next UTC midnight).
    let micros = |text: &str| -> u64 {
        let (whole, fraction) = text.split_once('.').unwrap_or((text, ""));
        whole.parse::<u64>().unwrap_or(0) * 1_000_000
            + format!("{fraction:0<6}").parse::<u64>().unwrap_or(0)
    };
    for (team, (headers, body)) in &told {
        println!(
            "money budgets: {team} refused with {headers:?}: {}",
            body.trim_end()
        );
        let [spent, budget, renews, currency] = headers;
        assert_eq!(currency.as_deref(), Some("USD"));
        assert_eq!(budget.as_deref(), Some("0.01"));
        assert_eq!(
            spent.as_deref().map(micros),
            billed.get(*team).copied(),
            "{team}"
        );
        let renews: u64 = renews.as_deref().and_then(|r| r.parse().ok()).unwrap_or(0);
        assert!((1..=86_400).contains(&renews), "{renews}");
        assert!(body.contains("of a budget of 0.01 USD"), "{body}");
    }
    // The warning: no call before 80 % of the budget, every call after
    // the first warned one, and that one within one call of 80 %: what
    // was billed before it plus its estimate (at most one call's: 500
    // micro-USD here) reached the line.
    for (team, seen) in &warned {
        let first = seen.iter().position(|(_, w)| w.is_some());
        let first = first.with_context(|| format!("{team} was never warned: {seen:?}"))?;
        let (billed, header) = &seen[first];
        println!("money budgets: {team} first warned at call {first} of {}, {billed} micro-USD billed before it: {header:?}", seen.len());
        assert!(*billed < TEAM_BUDGET * 8 / 10, "{team}: {seen:?}");
        assert!(*billed + 600 >= TEAM_BUDGET * 8 / 10, "{team}: {seen:?}");
        assert!(
            seen[first..].iter().all(|(_, w)| w.is_some()),
            "{team}: {seen:?}"
        );
        assert!(
            header
                .as_deref()
                .is_some_and(|h| h.starts_with("\"team-daily\";used=0.")),
            "{header:?}"
        );
    }
    assert_eq!(
        envoy.limit_stat("team-daily", "warn_crossed")?,
        4.0,
        "two lines, two teams"
    );
    assert_eq!(unpriced.status, 429);
    assert_eq!(unpriced.reason.as_deref(), Some("model-unpriced"));
    assert!(unpriced.limit.is_some());
    assert_eq!(envoy.limit_stat("team-daily", "usage_missing")?, 0.0);
    Ok(())
}

/// The measurement of `make bench` (scenario 8), briefly: three models
/// with their own tokens per minute and prices, 30 callers in 3 teams
/// with daily budgets, streamed and not, prompts of mixed sizes, some
/// callers hanging up. The provider refuses no call for a model's tokens
/// per minute; each team's spend, as Sluice counts it, ends at its budget
/// (within 0.5 %), what the provider billed it is never above it by more
/// than one call's estimate; the first warning comes within one call of
/// 80 %.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn teams_spend_their_budgets_and_no_model_goes_over_its_tokens_per_minute(
) -> anyhow::Result<()> {
    use sluice_e2e::llm_budgets::{run, WARN_AT};
    let outcome = run(std::time::Duration::from_secs(30), BRIEF_BUDGET).await?;
    for (name, model) in &outcome.models {
        println!("llm budgets: model {name}: {model:?}");
        assert_eq!(model.refused, 0, "{name}: the provider refused calls");
        assert!(model.tokens > 0, "{name} was used");
    }
    for (name, team) in &outcome.teams {
        let share = |n: u64| n as f64 / team.budget as f64;
        println!(
            "llm budgets: {name}: counted {:.2} % of its budget, billed {:.2} %, first warned at {:?}; {team:?}",
            100.0 * share(team.counted),
            100.0 * share(team.billed),
            team.first_warning
        );
        assert!(team.counted <= team.budget, "{name}: {team:?}");
        assert!(
            share(team.counted) >= 0.995,
            "{name} ends within 0.5 % of its budget: {team:?}"
        );
        assert!(
            team.billed <= team.budget + team.largest_estimate,
            "{name}: {team:?}"
        );
        let first = team.first_warning.unwrap_or(0.0);
        let one_call = share(team.largest_estimate);
        assert!(
            first >= WARN_AT && first <= WARN_AT + one_call + 0.01,
            "{name}: first warned at {first}, one call is {one_call}"
        );
    }
    Ok(())
}

/// Each team's budget for the brief run: spent in about a third of it here
/// (a team spends 0.07 to 0.15 USD a second), so a slower machine reaches it too.
const BRIEF_BUDGET: u64 = 1_000_000;

/// Third security review, item 2: two teams with equal budgets of 2 USD
/// at gpt-4o's prices. The honest one asks for 16 answers of up to 1 000
/// tokens and reads each answer whole; the other asks for 128 (`n`) and
/// either leaves its stream after the first event or takes an answer of
/// some 300 KiB, past what is read for usage. A provider bills both as
/// it generated (a stream left early in full). What the dodging team was
/// billed before its refusals is no more than the honest team's plus one
/// call's most (before: its calls were estimated at a 128th of their
/// bill and charged that, and it was billed about 100 times its budget).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_choices_and_streams_left_early_do_not_dodge_a_budget() -> anyhow::Result<()> {
    const BUDGET: u64 = 2_000_000;
    let limits = LlmLimits {
        bill_abandoned: true,
        ..LlmLimits::default()
    };
    let llm = MockLlm::start("127.0.0.1:0".parse()?, limits).await?;
    let policies = format!(
        r#"[{{"name": "llm", "match": {{"host": "api.llm.example"}}, "rate": {{"requests": 1000, "period": "1s"}},
        "limits": [{{"name": "team-daily", "key": {{"header": "x-team"}},
            "rate": {{"requests": {BUDGET}, "period": "1d", "algorithm": "fixed_window"}}, "cost": "price"}}]}}]"#
    );
    let config = format!(
        r#"{{"instance": "e2e-dodge", "fallback": {{"version": 1, "prices": {PRICES}, "policies": {policies}}}}}"#
    );
    let envoy = Envoy::start(&config, llm.addr.port(), WORKERS)?;
    llm.reset();
    llm.set_prices(provider_prices());
    let url = envoy.url("/v1/chat/completions");
    let http = client();
    let call = |team: &'static str, n: u64, stream: bool| {
        let (http, url) = (http.clone(), url.clone());
        async move {
            let body = serde_json::json!({"model": "gpt-4o", "max_tokens": 1000, "n": n, "stream": stream,
                "messages": [{"role": "user", "content": "Write a long essay."}]});
            let mut response = http
                .post(&url)
                .header("host", "api.llm.example")
                .header("authorization", format!("Bearer {team}"))
                .header("x-team", team)
                .header("content-type", "application/json")
                .body(body.to_string())
                .send()
                .await?;
            let status = response.status().as_u16();
            if stream && status == 200 {
                // The first event, then away.
                let _ = response.chunk().await?;
                drop(response);
            } else {
                let _ = response.bytes().await?;
            }
            anyhow::Ok(status)
        }
    };
    let mut admitted = std::collections::BTreeMap::<&str, u32>::new();
    let mut done = std::collections::BTreeSet::<&str>::new();
    for i in 0..400u32 {
        if done.len() == 2 {
            break;
        }
        for team in ["honest", "dodging"] {
            if done.contains(team) {
                continue;
            }
            let status = match team {
                "honest" => call(team, 16, false).await?,
                _ => call(team, 128, i % 2 == 0).await?,
            };
            match status {
                200 => *admitted.entry(team).or_default() += 1,
                429 => {
                    done.insert(team);
                }
                other => anyhow::bail!("{team}: {other}"),
            }
            // Its charge settles as its answer ends.
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let billed = llm.stats().spent;
    let (honest, dodging) = (
        billed.get("honest").copied().unwrap_or(0),
        billed.get("dodging").copied().unwrap_or(0),
    );
    // A call's most: 128 answers of 1 000 tokens at 10 USD a million,
    // and its prompt.
    let one_call = 128 * 1000 * 10 + 1_000;
    println!(
        "money, dodging by choices and streams left early: admitted {admitted:?}; the provider billed the honest team {honest} \
         and the dodging one {dodging} micro-USD (budgets {BUDGET} each, one call at most {one_call}); \
         charged unread {}, too large {}",
        envoy.limit_stat("team-daily", "usage_aborted").unwrap_or(-1.0),
        envoy.limit_stat("team-daily", "usage_too_large").unwrap_or(-1.0),
    );
    anyhow::ensure!(
        done.len() == 2,
        "both teams reached their budget: {admitted:?}"
    );
    anyhow::ensure!(
        dodging <= honest + one_call,
        "the dodging team was billed {dodging}, the honest one {honest}"
    );
    anyhow::ensure!(honest <= BUDGET + 16 * 1000 * 10 + 1_000, "{honest}");
    Ok(())
}

/// Prices imported from a catalog in LiteLLM's format (per token, in US
/// dollars) through the admin's API price a team's budget that Envoys
/// synced with the admin enforce: each call is charged its usage at the
/// imported prices, exactly what the provider bills, and the team is
/// refused at its budget (issue 52, item 5).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prices_imported_from_a_catalog_charge_calls_through_envoy() -> anyhow::Result<()> {
    use sluice_e2e::admin::{AdminServer, SYNC_TOKEN};
    use sluice_e2e::envoy::filter_vms;
    let dir = tempfile::tempdir()?;
    let admin = AdminServer::start(dir.path().join("sluice.db"), 0).await?;
    let op = admin.login().await?;
    let catalog = serde_json::json!({
        "sample_spec": {"input_cost_per_token": 0.0, "output_cost_per_token": 0.0},
        "gpt-4o": {"input_cost_per_token": 2.5e-06, "output_cost_per_token": 1e-05,
                   "cache_read_input_token_cost": 1.25e-06, "litellm_provider": "openai"},
        "tts-1": {"input_cost_per_character": 1.5e-05, "litellm_provider": "openai"}
    });
    let (status, imported) = op
        .raw(
            reqwest::Method::POST,
            "/api/v1/prices/import?provider=openai",
            None,
            Some(catalog),
        )
        .await?;
    anyhow::ensure!(status == 200, "import: {status} {imported}");
    anyhow::ensure!(
        imported["added"][0]["model"] == "gpt-4o" && imported["refused"][0]["model"] == "tts-1",
        "{imported}"
    );
    op.create(
        serde_json::json!({"name": "llm", "match": {"host": "api.llm.example"},
        "rate": {"requests": 1000, "period": "1s"},
        "limits": [{"name": "team-daily", "key": {"header": "x-team"},
            "rate": {"requests": TEAM_BUDGET, "period": "1d", "algorithm": "fixed_window"},
            "cost": "price"}]}),
    )
    .await?;
    let llm = MockLlm::start("127.0.0.1:0".parse()?, LlmLimits::default()).await?;
    let config =
        serde_json::json!({"instance": "e2e-imported-prices", "admin_cluster": "sluice_admin",
        "sync_interval": "200ms", "sync_token": SYNC_TOKEN,
        "fallback": {"version": 0, "policies": []}})
        .to_string();
    let envoy = Envoy::start_with_admin(&config, llm.addr.port(), admin.port, WORKERS)?;
    sluice_e2e::load::wait_for(
        "the admin's set in every worker",
        std::time::Duration::from_secs(10),
        || envoy.filter_stat("policy_sets_installed").unwrap_or(0.0) >= filter_vms(WORKERS),
    )
    .await?;
    llm.reset();
    llm.set_prices(provider_prices());
    let (url, http) = (envoy.url("/v1/chat/completions"), client());
    let mut admitted = 0;
    let mut refusal = None;
    for i in 0..100 {
        let answer = chat(
            &http,
            &url,
            ("team-a", "gpt-4o", 40),
            false,
            "how do rivers form?",
        )
        .await?;
        match answer.status {
            200 => admitted += 1,
            429 => {
                refusal = Some(answer);
                break;
            }
            other => anyhow::bail!("call {i}: {other} {}", answer.body),
        }
    }
    let refusal = refusal.context("the budget never refused")?;
    let billed = llm.stats().spent.get("team-a").copied().unwrap_or(0);
    sluice_e2e::load::wait_for(
        "team-daily charged",
        std::time::Duration::from_secs(10),
        || envoy.limit_stat("team-daily", "tokens").unwrap_or(0.0) >= billed as f64,
    )
    .await?;
    let charged = envoy.limit_stat("team-daily", "tokens")?;
    println!(
        "imported prices: {admitted} calls admitted, the provider billed {billed} micro-USD, sluice charged {charged}; refused by {:?} with {:?}",
        refusal.limit, refusal.told
    );
    assert!(admitted >= 5, "{admitted}");
    assert_eq!(
        charged, billed as f64,
        "each call its usage at the imported prices"
    );
    assert!(billed <= TEAM_BUDGET, "{billed}");
    assert_eq!(refusal.limit.as_deref(), Some("team-daily"));
    assert_eq!(refusal.told[3].as_deref(), Some("USD"));
    Ok(())
}
