//! The budget ladder's downgrade rung through a real Envoy
//! (`--concurrency 4`) in front of the mock LLM, which answers with the
//! model it was asked for and bills each call at its prices: one team's
//! calls of `gpt-4o` go as they are until their take reaches 80 % of the
//! team's day, then the provider sees only `gpt-4o-mini`, each answer
//! saying so, until the budget refuses; what the provider billed never
//! passes the budget. And a pool whose members have budgets passes over a
//! member whose budget is spent (`envoy/pool.yaml`). A queue rung paces
//! the rest of a window past its line.

use sluice_demo::llm::{LlmLimits, MockLlm, MockPrice};
use sluice_e2e::envoy::{workspace_root, Envoy};
use sluice_e2e::load::client;

const WORKERS: u32 = 4;

/// 0.05 USD a day per team.
const TEAM_BUDGET: u64 = 50_000;

const PRICES: &str = r#"{"currency": "USD", "models": {
    "gpt-4o": {"input": "2.50", "output": "10.00"},
    "gpt-4o-mini": {"input": "0.15", "output": "0.60"}}}"#;

fn policies() -> String {
    format!(
        r#"[{{"name": "llm", "match": {{"host": "api.llm.example"}}, "rate": {{"requests": 1000, "period": "1s"}},
        "limits": [
          {{"name": "team-daily", "key": {{"header": "x-team"}},
            "rate": {{"requests": {TEAM_BUDGET}, "period": "1d", "algorithm": "fixed_window"}},
            "cost": "price", "warn_at": [0.8],
            "downgrade": {{"at": 0.8, "models": {{"gpt-4o": "gpt-4o-mini"}}}}}}]}}]"#
    )
}

struct Answer {
    status: u16,
    /// The model the provider answered for (the one it was asked for).
    model: Option<String>,
    downgraded: Option<String>,
    limit: Option<String>,
    body: String,
}

async fn chat(http: &reqwest::Client, url: &str, team: &str) -> anyhow::Result<Answer> {
    let body = serde_json::json!({"model": "gpt-4o", "max_tokens": 100,
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
    let (downgraded, limit) = (header("x-sluice-downgraded"), header("x-sluice-limit"));
    let status = response.status().as_u16();
    let text = response.text().await?;
    let model = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| v["model"].as_str().map(str::to_string));
    Ok(Answer {
        status,
        model,
        downgraded,
        limit,
        body: text,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_80_percent_the_provider_sees_only_the_cheaper_model_until_the_budget_refuses(
) -> anyhow::Result<()> {
    let llm = MockLlm::start("127.0.0.1:0".parse()?, LlmLimits::default()).await?;
    let config = format!(
        r#"{{"instance": "e2e-ladder", "fallback": {{"version": 1, "prices": {PRICES}, "policies": {}}}}}"#,
        policies()
    );
    let envoy = Envoy::start(&config, llm.addr.port(), WORKERS)?;
    llm.reset();
    llm.set_prices(vec![
        MockPrice {
            model: "gpt-4o".into(),
            input: 2_500_000,
            cached_input: 2_500_000,
            output: 10_000_000,
        },
        MockPrice {
            model: "gpt-4o-mini".into(),
            input: 150_000,
            cached_input: 150_000,
            output: 600_000,
        },
    ]);
    let url = envoy.url("/v1/chat/completions");
    let http = client();
    // Per admitted call: what the provider had billed before it, the model
    // it answered for, the header.
    let mut admitted: Vec<(u64, Option<String>, Option<String>)> = Vec::new();
    let refused = loop {
        anyhow::ensure!(admitted.len() < 1_000, "never refused");
        let billed_before = llm.stats().spent.get("team-a").copied().unwrap_or(0);
        let answer = chat(&http, &url, "team-a").await?;
        match answer.status {
            200 => admitted.push((billed_before, answer.model, answer.downgraded)),
            429 => break answer,
            other => anyhow::bail!(
                "call {}: {other} {:?} {}",
                admitted.len(),
                answer.downgraded,
                answer.body
            ),
        }
    };
    let billed = llm.stats().spent.get("team-a").copied().unwrap_or(0);
    let first = admitted
        .iter()
        .position(|(_, _, d)| d.is_some())
        .ok_or_else(|| anyhow::anyhow!("never downgraded"))?;
    let cheap = admitted.len() - first;
    println!(
        "ladder: {first} calls of gpt-4o, then {cheap} of gpt-4o-mini (the first at {} micro-USD billed), refused by {:?}; billed {billed} of {TEAM_BUDGET}",
        admitted[first].0, refused.limit
    );
    for (i, (_, model, downgraded)) in admitted.iter().enumerate() {
        if i < first {
            anyhow::ensure!(model.as_deref() == Some("gpt-4o"), "call {i}: {model:?}");
        } else {
            anyhow::ensure!(
                model.as_deref() == Some("gpt-4o-mini"),
                "call {i}: the provider was asked for {model:?}"
            );
            anyhow::ensure!(
                downgraded.as_deref() == Some("gpt-4o -> gpt-4o-mini"),
                "call {i}: {downgraded:?}"
            );
        }
    }
    // The first downgraded call's take reached 80 %: before it, under 80 %
    // was billed; with its estimate (1 000 and its prompt), at least 80 %.
    let line = TEAM_BUDGET * 8 / 10;
    anyhow::ensure!(admitted[first].0 < line, "{}", admitted[first].0);
    anyhow::ensure!(admitted[first].0 + 1_100 >= line, "{}", admitted[first].0);
    anyhow::ensure!(cheap >= 20, "{cheap} cheap calls");
    anyhow::ensure!(refused.limit.as_deref() == Some("team-daily"));
    anyhow::ensure!(billed <= TEAM_BUDGET, "billed {billed}");
    // Stats reach Envoy's admin at the next flush.
    sluice_e2e::load::wait_for(
        "every downgraded call counted",
        std::time::Duration::from_secs(10),
        || envoy.limit_stat("team-daily", "downgraded").unwrap_or(0.0) == cheap as f64,
    )
    .await?;
    Ok(())
}

/// Each deployment's budget for the day: east 6 000 micro-USD, west 4 000.
const EAST_BUDGET: u64 = 6_000;
const WEST_BUDGET: u64 = 4_000;

/// A policy that reads the body for `gpt-4o-mini` comes first (so every
/// other call reaches the pool passed on, once its body is in); then a pool
/// of two deployments (east first), each with its day's budget priced at
/// the model the body names.
fn pool_policies() -> String {
    let member = |name: &str, budget: u64| {
        format!(
            r#"{{"name": "{name}", "cluster": "llm-{name}", "limits": [
                {{"name": "{name}-rps", "rate": {{"requests": 50, "period": "1s"}}, "provider": {{"max_pause": "60s"}}}},
                {{"name": "{name}-daily", "rate": {{"requests": {budget}, "period": "1d", "algorithm": "fixed_window"}},
                  "cost": "price"}}]}}"#
        )
    };
    format!(
        r#"[{{"name": "mini", "match": {{"host": "api.llm.example", "json": [{{"path": "model", "equals": "gpt-4o-mini"}}]}},
            "rate": {{"requests": 1000, "period": "1s"}}}},
           {{"name": "llm", "match": {{"host": "api.llm.example"}}, "rate": {{"requests": 1000, "period": "1s"}},
            "pool": {{"rule": "priority", "members": [{}, {}]}}}}]"#,
        member("east", EAST_BUDGET),
        member("west", WEST_BUDGET)
    )
}

fn gpt_4o_prices() -> Vec<MockPrice> {
    vec![MockPrice {
        model: "gpt-4o".into(),
        input: 2_500_000,
        cached_input: 2_500_000,
        output: 10_000_000,
    }]
}

/// Two mock deployments priced as OpenAI's gpt-4o, and `envoy/pool.yaml`
/// in front of them with `policies`.
async fn two_deployments(policies: &str) -> anyhow::Result<(MockLlm, MockLlm, Envoy)> {
    let east = MockLlm::start("127.0.0.1:0".parse()?, LlmLimits::default()).await?;
    let west = MockLlm::start("127.0.0.1:0".parse()?, LlmLimits::default()).await?;
    let template = std::fs::read_to_string(workspace_root().join("envoy/pool.yaml"))?
        .replace("{{EAST_PORT}}", &east.addr.port().to_string())
        .replace("{{WEST_PORT}}", &west.addr.port().to_string());
    let config = format!(
        r#"{{"instance": "e2e-pool-budgets", "fallback": {{"version": 1, "prices": {PRICES}, "policies": {policies}}}}}"#
    );
    let envoy = Envoy::start_from(&template, &config, 9, 9, WORKERS)?;
    for mock in [&east, &west] {
        mock.reset();
        mock.set_prices(gpt_4o_prices());
    }
    Ok((east, west, envoy))
}

/// A chat call for `model` to the pool's host, of `team` when given.
fn chat_as(
    http: &reqwest::Client,
    url: &str,
    model: &str,
    team: Option<&str>,
) -> impl std::future::Future<Output = reqwest::Result<reqwest::Response>> {
    let body = serde_json::json!({"model": model, "max_tokens": 100,
        "messages": [{"role": "user", "content": "How do rivers form?"}]});
    let mut request = http
        .post(url)
        .header("host", "api.llm.example")
        .header("content-type", "application/json");
    if let Some(team) = team {
        // The mock bills by the caller's bearer key before the
        // deployment's own.
        request = request
            .header("x-team", team)
            .header("authorization", format!("Bearer {team}"));
    }
    request.body(body.to_string()).send()
}

/// A pool whose members price calls by the model in the body decides once
/// the body is in, and Envoy routes by the member chosen then (both
/// builds): calls go to east until its budget cannot take another, then
/// to west only, then the budgets refuse; neither deployment is billed
/// past its budget. A `gpt-4o-mini` call falls under the body-reading
/// policy before the pool and is routed to no member (Envoy's own 404).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_member_whose_budget_is_spent_is_passed_over_until_both_refuse() -> anyhow::Result<()>
{
    let (east, west, envoy) = two_deployments(&pool_policies()).await?;
    let http = client();
    let url = envoy.url("/v1/chat/completions");
    let send = |model: &'static str| chat_as(&http, &url, model, None);
    let mut answered_by: Vec<String> = Vec::new();
    let refused = loop {
        anyhow::ensure!(answered_by.len() < 100, "never refused");
        let response = send("gpt-4o").await?;
        let header = |name: &str| sluice_e2e::load::header_text(&response, name);
        match response.status().as_u16() {
            200 => answered_by.push(header("x-sluice-member-answered").unwrap_or_default()),
            429 => break (header("x-sluice-limit"), header("x-sluice-renews-at")),
            other => anyhow::bail!(
                "call {}: {other} {}",
                answered_by.len(),
                response.text().await?
            ),
        }
    };
    let billed = |mock: &MockLlm| mock.stats().spent.values().sum::<u64>();
    let (east_billed, west_billed) = (billed(&east), billed(&west));
    let to_east = answered_by.iter().take_while(|m| *m == "east").count();
    println!(
        "pool budgets: {to_east} calls to east (billed {east_billed} of {EAST_BUDGET}), then {} to west \
         (billed {west_billed} of {WEST_BUDGET}); refused by {:?}, renewing {:?}",
        answered_by.len() - to_east,
        refused.0,
        refused.1
    );
    anyhow::ensure!(to_east >= 3, "east first: {answered_by:?}");
    anyhow::ensure!(
        answered_by[to_east..].iter().all(|m| m == "west") && answered_by.len() > to_east + 1,
        "then west only: {answered_by:?}"
    );
    anyhow::ensure!(east_billed <= EAST_BUDGET && west_billed <= WEST_BUDGET);
    // Within one call's estimate (1 000 and its prompt) of each budget.
    anyhow::ensure!(east_billed + 1_100 >= EAST_BUDGET - 1_100, "{east_billed}");
    anyhow::ensure!(
        matches!(refused.0.as_deref(), Some("east-daily" | "west-daily")),
        "a budget refused: {:?}",
        refused.0
    );
    anyhow::ensure!(refused.1.is_some(), "the refusal says when it renews");
    let mini = send("gpt-4o-mini").await?;
    anyhow::ensure!(
        mini.status().as_u16() == 404,
        "a call the policy before the pool takes is routed to no member: {}",
        mini.status()
    );
    anyhow::ensure!(east.stats().completed + west.stats().completed == answered_by.len() as u64);
    Ok(())
}

/// 0.02 USD a day per team, on the pool's own limit; past half of it, the
/// team's calls go to west (the cheaper deployment) instead of east.
const ROUTED_TEAM_BUDGET: u64 = 20_000;

fn routed_policies() -> String {
    let member = |name: &str| {
        format!(
            r#"{{"name": "{name}", "cluster": "llm-{name}", "limits": [
                {{"name": "{name}-rps", "rate": {{"requests": 50, "period": "1s"}}, "provider": {{"max_pause": "60s"}}}}]}}"#
        )
    };
    format!(
        r#"[{{"name": "llm", "match": {{"host": "api.llm.example"}}, "rate": {{"requests": 1000, "period": "1s"}},
            "limits": [{{"name": "team-daily", "key": {{"header": "x-team"}},
                         "rate": {{"requests": {ROUTED_TEAM_BUDGET}, "period": "1d", "algorithm": "fixed_window"}},
                         "cost": "price", "route": {{"at": 0.5, "member": "west"}}}}],
            "pool": {{"rule": "priority", "members": [{}, {}]}}}}]"#,
        member("east"),
        member("west")
    )
}

/// The route rung through Envoy (both builds): a team's calls go to east
/// (the pool's first choice) until their take reaches half the team's
/// day, then to west only, each answer saying so, until the budget
/// refuses; another team still goes to east; the deployments together
/// billed no more than the budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_its_route_line_a_teams_calls_go_to_the_cheaper_deployment_until_the_budget_refuses(
) -> anyhow::Result<()> {
    let (east, west, envoy) = two_deployments(&routed_policies()).await?;
    let http = client();
    let url = envoy.url("/v1/chat/completions");
    // Per admitted call: the member that answered, x-sluice-routed.
    let mut admitted: Vec<(String, Option<String>)> = Vec::new();
    let refused_by = loop {
        anyhow::ensure!(admitted.len() < 200, "never refused");
        let response = chat_as(&http, &url, "gpt-4o", Some("team-a")).await?;
        let header = |name: &str| sluice_e2e::load::header_text(&response, name);
        match response.status().as_u16() {
            200 => admitted.push((
                header("x-sluice-member-answered").unwrap_or_default(),
                header("x-sluice-routed"),
            )),
            429 => break header("x-sluice-limit"),
            other => anyhow::bail!(
                "call {}: {other} {}",
                admitted.len(),
                response.text().await?
            ),
        }
    };
    let other_team = chat_as(&http, &url, "gpt-4o", Some("team-b")).await?;
    let other_by = sluice_e2e::load::header_text(&other_team, "x-sluice-member-answered");
    let billed = |mock: &MockLlm| mock.stats().spent.get("team-a").copied().unwrap_or(0);
    let (east_billed, west_billed) = (billed(&east), billed(&west));
    let to_east = admitted.iter().take_while(|(m, _)| m == "east").count();
    println!(
        "route rung: {to_east} calls to east (billed {east_billed}), then {} to west (billed {west_billed}), \
         refused by {refused_by:?}; team a billed {} of {ROUTED_TEAM_BUDGET}; team b answered by {other_by:?}",
        admitted.len() - to_east,
        east_billed + west_billed,
    );
    anyhow::ensure!(to_east >= 3, "east first: {admitted:?}");
    for (i, (member, routed)) in admitted.iter().enumerate().skip(to_east) {
        anyhow::ensure!(member == "west", "call {i} went to {member}");
        anyhow::ensure!(
            routed.as_deref() == Some("west; limit=team-daily"),
            "call {i}: {routed:?}"
        );
    }
    anyhow::ensure!(admitted.len() - to_east >= 3, "{admitted:?}");
    anyhow::ensure!(
        admitted[..to_east]
            .iter()
            .all(|(_, routed)| routed.is_none()),
        "before the line nothing is routed"
    );
    // The first routed call's take reached half the day: east billed
    // under half before it (each call's estimate is some 1 000 above what
    // it is billed, and is what the line judges).
    anyhow::ensure!(east_billed < ROUTED_TEAM_BUDGET / 2, "{east_billed}");
    anyhow::ensure!(
        refused_by.as_deref() == Some("team-daily"),
        "{refused_by:?}"
    );
    anyhow::ensure!(other_by.as_deref() == Some("east"), "team b: {other_by:?}");
    anyhow::ensure!(
        east_billed + west_billed <= ROUTED_TEAM_BUDGET,
        "billed past the budget"
    );
    sluice_e2e::load::wait_for(
        "every routed call counted",
        std::time::Duration::from_secs(10),
        || {
            envoy.limit_stat("team-daily", "routed").unwrap_or(0.0)
                == (admitted.len() - to_east) as f64
        },
    )
    .await?;
    Ok(())
}

/// The downgrade rung on a pool's own budget (both builds): a team's
/// calls of gpt-4o reach a deployment as they are until their take
/// reaches half the team's day, then as gpt-4o-mini only, each answer
/// saying so, until the budget refuses; the deployments together billed
/// no more than the budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pools_budget_sends_its_calls_for_the_cheaper_model_past_its_line() -> anyhow::Result<()>
{
    let policies = routed_policies().replace(
        r#""route": {"at": 0.5, "member": "west"}"#,
        r#""downgrade": {"at": 0.5, "models": {"gpt-4o": "gpt-4o-mini"}}"#,
    );
    anyhow::ensure!(policies.contains("downgrade"), "{policies}");
    let (east, west, envoy) = two_deployments(&policies).await?;
    for mock in [&east, &west] {
        let mut prices = gpt_4o_prices();
        prices.push(MockPrice {
            model: "gpt-4o-mini".into(),
            input: 150_000,
            cached_input: 150_000,
            output: 600_000,
        });
        mock.set_prices(prices);
    }
    let http = client();
    let url = envoy.url("/v1/chat/completions");
    // Per admitted call: the member that answered, the model it answered
    // for, x-sluice-downgraded.
    let mut admitted: Vec<(String, Option<String>, Option<String>)> = Vec::new();
    let refused_by = loop {
        anyhow::ensure!(admitted.len() < 2_000, "never refused");
        let response = chat_as(&http, &url, "gpt-4o", Some("team-a")).await?;
        let header = |name: &str| sluice_e2e::load::header_text(&response, name);
        let (member, downgraded, limit) = (
            header("x-sluice-member-answered").unwrap_or_default(),
            header("x-sluice-downgraded"),
            header("x-sluice-limit"),
        );
        let status = response.status().as_u16();
        let text = response.text().await?;
        match status {
            200 => {
                let model = serde_json::from_str::<serde_json::Value>(&text)
                    .ok()
                    .and_then(|v| v["model"].as_str().map(str::to_string));
                admitted.push((member, model, downgraded));
            }
            // Cheap calls come fast: past both deployments' 50 a second,
            // their rates refuse for a moment.
            429 if limit.as_deref().is_some_and(|l| l.ends_with("-rps")) => {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            429 => break limit,
            other => anyhow::bail!("call {}: {other} {text}", admitted.len()),
        }
    };
    let billed = |mock: &MockLlm| mock.stats().spent.get("team-a").copied().unwrap_or(0);
    let total = billed(&east) + billed(&west);
    let dear = admitted
        .iter()
        .take_while(|(_, _, downgraded)| downgraded.is_none())
        .count();
    let cheap = admitted.len() - dear;
    println!(
        "pool downgrade: {dear} calls as gpt-4o, then {cheap} as gpt-4o-mini, refused by {refused_by:?}; team a billed {total} of {ROUTED_TEAM_BUDGET} (east {}, west {})",
        billed(&east),
        billed(&west)
    );
    for (i, (member, model, downgraded)) in admitted.iter().enumerate() {
        anyhow::ensure!(member == "east" || member == "west", "call {i}: {member:?}");
        let (want, header) = if i < dear {
            ("gpt-4o", None)
        } else {
            ("gpt-4o-mini", Some("gpt-4o -> gpt-4o-mini"))
        };
        anyhow::ensure!(model.as_deref() == Some(want), "call {i}: {model:?}");
        anyhow::ensure!(downgraded.as_deref() == header, "call {i}: {downgraded:?}");
    }
    anyhow::ensure!(dear >= 3 && cheap >= 20, "{dear} dear, {cheap} cheap");
    anyhow::ensure!(
        refused_by.as_deref() == Some("team-daily"),
        "{refused_by:?}"
    );
    anyhow::ensure!(total <= ROUTED_TEAM_BUDGET, "billed {total}");
    sluice_e2e::load::wait_for(
        "every downgraded call counted",
        std::time::Duration::from_secs(10),
        || envoy.limit_stat("team-daily", "downgraded").unwrap_or(0.0) == cheap as f64,
    )
    .await?;
    Ok(())
}

/// Two paced limits (a queue rung at half of each), on two hosts: 20 calls
/// per 1 000 s window (past 10 one per 100 s), calls that would wait more
/// than 5 s refused; 100 per 100 s (past 50 one per 2 s), calls held up to
/// 30 s. Windows are aligned to the epoch: each call's turn is known from
/// the wall clock.
fn paced_policies() -> String {
    let paced = |host: &str, name: &str, requests: u32, period: &str, max_wait: &str| {
        format!(
            r#"{{"name": "{name}", "match": {{"host": "{host}"}}, "rate": {{"requests": 1000, "period": "1s"}},
            "on_limit": {{"action": "queue", "max_wait": "{max_wait}"}},
            "limits": [{{"name": "{name}-window", "queue": {{"at": 0.5}},
              "rate": {{"requests": {requests}, "period": "{period}", "algorithm": "fixed_window"}}}}]}}"#
        )
    };
    format!(
        "[{}, {}]",
        paced("api.slow.example", "slow", 20, "1000s", "5s"),
        paced("api.paced.example", "paced", 100, "100s", "30s")
    )
}

/// Seconds since the epoch, with the fraction.
fn epoch_secs() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

async fn call_host(
    http: &reqwest::Client,
    url: &str,
    host: &str,
) -> anyhow::Result<reqwest::Response> {
    let body = serde_json::json!({"model": "gpt-4o", "max_tokens": 10,
        "messages": [{"role": "user", "content": "Hello?"}]});
    Ok(http
        .post(url)
        .header("host", host)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await?)
}

/// The queue rung through Envoy: past its line a window's rest goes at an
/// even pace. A call whose turn is further than its wait is refused at
/// once, `x-sluice-reason: paced` and `Retry-After` its turn; calls within
/// their wait are held and go at their turns, never ahead of the pace.
/// Bounds only: what a loaded machine can make late, never early.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_its_queue_line_a_window_goes_at_the_pace_of_its_rest() -> anyhow::Result<()> {
    let llm = MockLlm::start("127.0.0.1:0".parse()?, LlmLimits::default()).await?;
    let config = format!(
        r#"{{"instance": "e2e-paced", "fallback": {{"version": 1, "policies": {}}}}}"#,
        paced_policies()
    );
    let envoy = Envoy::start(&config, llm.addr.port(), WORKERS)?;
    let url = envoy.url("/v1/chat/completions");
    let http = client();
    // Start 1 to 70 s into a 100 s window, not in a 1 000 s window's last
    // 100 s: no window renews while the test runs, and no turn of the
    // slow window (every 100 s) falls within the first part.
    loop {
        let phase = epoch_secs() % 1000.0;
        if phase % 100.0 >= 1.0 && phase % 100.0 <= 70.0 && phase < 900.0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }

    // The slow window: 10, and one more per 100 s gone, at once.
    let start = epoch_secs() % 1000.0;
    let mut admitted = 0u64;
    let mut sent;
    let refused = loop {
        anyhow::ensure!(admitted <= 20, "never refused");
        sent = epoch_secs() % 1000.0;
        let answer = call_host(&http, &url, "api.slow.example").await?;
        match answer.status().as_u16() {
            200 => admitted += 1,
            429 => break answer,
            other => anyhow::bail!("slow call {admitted}: {other}"),
        }
    };
    let end = epoch_secs() % 1000.0;
    let at_once = |phase: f64| 10 + (phase / 100.0).floor() as u64;
    anyhow::ensure!(
        admitted == at_once(start) || admitted == at_once(end),
        "{admitted} at once, {start:.1}..{end:.1} s into the window"
    );
    let header = |name: &str| sluice_e2e::load::header_text(&refused, name);
    let retry: f64 = header("retry-after")
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no Retry-After"))?;
    // Its turn, as seen from when it was sent and from its answer: the
    // refusal was made between the two.
    let turn_at = (admitted - 9) as f64 * 100.0;
    let turn = turn_at - end;
    println!(
        "paced: slow window {admitted} at once {start:.1} s in, the next refused: {:?} {:?}, Retry-After {retry} (its turn in {turn:.1} s)",
        header("x-sluice-reason"),
        header("x-sluice-limit")
    );
    anyhow::ensure!(header("x-sluice-reason").as_deref() == Some("paced"));
    anyhow::ensure!(header("x-sluice-limit").as_deref() == Some("slow-window"));
    anyhow::ensure!(
        retry >= turn - 0.01 && retry <= turn_at - sent + 1.01,
        "Retry-After {retry}, turn in {turn:.1} s"
    );

    // The paced window: 50 and one per 2 s gone at once, then three held
    // in turn. By any answer, no more than the pace had released.
    let window_start = epoch_secs() - epoch_secs() % 100.0;
    let released = |at: f64| 50 + ((at - window_start) / 2.0).floor() as u64;
    let mut answers: Vec<(f64, u16)> = Vec::new();
    let mut held = 0;
    while held < 3 {
        anyhow::ensure!(answers.len() < 100, "never held");
        let sent = epoch_secs();
        let answer = call_host(&http, &url, "api.paced.example").await?;
        let back = epoch_secs();
        answers.push((back, answer.status().as_u16()));
        anyhow::ensure!(
            answer.status() == 200,
            "paced call {}: {}",
            answers.len(),
            answer.status()
        );
        let count = answers.len() as u64;
        anyhow::ensure!(
            count <= released(back),
            "{count} admitted by {:.2} s into the window, the pace released {}",
            back - window_start,
            released(back)
        );
        // Past the line, a call whose turn had not come waited for it.
        if count > released(sent) {
            held += 1;
        }
    }
    let first_held = answers.len() - 3;
    let span = answers[answers.len() - 1].0 - answers[first_held - 1].0;
    println!(
        "paced: {} calls in the 100 s window by {:.1} s, the last three held {span:.1} s in all",
        answers.len(),
        answers[answers.len() - 1].0 - window_start
    );
    // Three turns, 2 s apart from the one before them.
    anyhow::ensure!(span >= 4.0, "three held calls within {span:.1} s");
    // Stats reach Envoy's admin at the next flush.
    sluice_e2e::load::wait_for(
        "the calls the pace held counted",
        std::time::Duration::from_secs(10),
        || {
            envoy.limit_stat("slow-window", "paced").unwrap_or(0.0) == 1.0
                && envoy.limit_stat("paced-window", "paced").unwrap_or(0.0) >= 3.0
        },
    )
    .await?;
    Ok(())
}
