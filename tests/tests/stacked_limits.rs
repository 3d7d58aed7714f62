//! Several limits on one call, through a real Envoy (`--concurrency 4`):
//! a policy's own rate and its further `limits`, all or nothing.

use std::time::Duration;

use sluice_demo::mock::{MockApi, MockLimits};
use sluice_e2e::envoy::Envoy;
use sluice_e2e::load::{self, closed_loop, count, max_in_window};

const WORKERS: u32 = 4;

async fn setup(policy: &str) -> anyhow::Result<(MockApi, Envoy)> {
    let mock = MockApi::start("127.0.0.1:0".parse()?, MockLimits::default()).await?;
    let config = format!(
        r#"{{"instance": "e2e-stacked", "fallback": {{"version": 1, "policies": [{policy}]}}}}"#
    );
    let envoy = Envoy::start(&config, mock.addr.port(), WORKERS)?;
    mock.reset();
    Ok((mock, envoy))
}

/// Stats reach Envoy on the filter's tick (100 ms when idle).
async fn settle() {
    tokio::time::sleep(Duration::from_millis(400)).await;
}

/// 10 per second (burst 10) and 30 per minute at once, 64 clients for 6 s:
/// the minute's 30 go in the first seconds at no more than the per-second
/// rate, then one call every 2 s; the per-second limit alone would have let
/// about 70 through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_second_and_per_minute_hold_together() -> anyhow::Result<()> {
    let (mock, envoy) = setup(
        r#"{"name": "bank", "match": {"host": "api.bank.example"},
            "rate": {"requests": 10, "period": "1s", "burst": 10},
            "limits": [{"name": "per-minute", "rate": {"requests": 30, "period": "1m"}}]}"#,
    )
    .await?;
    let url = envoy.url("/v1/pay");
    let outcomes = closed_loop(64, Duration::from_secs(6), move |c, _| {
        c.get(&url).header("host", "api.bank.example")
    })
    .await;
    settle().await;
    let arrived = mock.arrivals();
    let arrivals: Vec<Duration> = arrived.iter().map(|a| a.at).collect();
    let most_1s = load::most_surely_within(&arrived, Duration::from_secs(1)).0;
    let by_minute = outcomes
        .iter()
        .filter(|o| {
            o.headers
                .get("x-sluice-limit")
                .is_some_and(|v| v == "per-minute")
        })
        .count();
    let refused = count(&outcomes, 429);
    let tokens = envoy.limit_stat("per-minute", "tokens")?;
    let limit_refused = envoy.limit_stat("per-minute", "refused")?;
    println!(
        "stacked 1s + 1m: {} calls, the API saw {} (most {most_1s} sent and arrived in any 1 s; bounds: 30 + 1 per 2 s, 10 + 10/s), \
         {refused} × 429 of which {by_minute} named per-minute; stats: per-minute tokens {tokens}, refused {limit_refused}, \
         policy rejected {}",
        outcomes.len(),
        arrivals.len(),
        envoy.policy_stat("rejected", "bank")?,
    );
    // 30 at once, then one every 2 s over the 6 s.
    assert!(
        (30..=34).contains(&arrivals.len()),
        "{} reached the API",
        arrivals.len()
    );
    assert!(most_1s <= 20, "{most_1s} in one second");
    assert_eq!(
        tokens as usize,
        arrivals.len(),
        "tokens counted = calls that went"
    );
    assert!(by_minute > 0, "refusals name the per-minute limit");
    assert_eq!(limit_refused as usize, by_minute);
    Ok(())
}

/// One call per key per hour (the policy's own rate), and 100 per day for
/// the company (a further limit; neither refills noticeably during the
/// test). 64 clients hammer 8 keys: the keys'
/// buckets refuse thousands of calls, and every one of them gives its
/// company token back, so the company limit has spent exactly the 8 calls
/// that went; 92 new keys then pass and the 101st call is refused by the
/// company limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_refused_by_its_key_takes_nothing_from_the_company_limit() -> anyhow::Result<()> {
    let (mock, envoy) = setup(
        r#"{"name": "llm", "match": {"host": "api.llm.example"}, "key": {"header": "x-api-key"},
            "rate": {"requests": 1, "period": "1h"},
            "limits": [{"name": "company", "rate": {"requests": 100, "period": "1d"}}]}"#,
    )
    .await?;
    let url = envoy.url("/v1/chat");
    let storm_url = url.clone();
    let storm = closed_loop(64, Duration::from_secs(3), move |c, i| {
        c.get(&storm_url)
            .header("host", "api.llm.example")
            .header("x-api-key", format!("team-{}", i % 8))
    })
    .await;
    settle().await;
    let company_tokens = envoy.limit_stat("company", "tokens")?;
    let passed = count(&storm, 200);
    let by_company = storm
        .iter()
        .filter(|o| o.headers.get("x-sluice-limit").is_some())
        .count();
    let http = load::client();
    let mut fresh = Vec::new();
    for k in 0..92 {
        let r = http
            .get(&url)
            .header("host", "api.llm.example")
            .header("x-api-key", format!("new-{k}"))
            .send()
            .await?;
        fresh.push(r.status().as_u16());
    }
    let last = http
        .get(&url)
        .header("host", "api.llm.example")
        .header("x-api-key", "one-more")
        .send()
        .await?;
    let last_status = last.status().as_u16();
    let last_limit = last
        .headers()
        .get("x-sluice-limit")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    println!(
        "per key + company: storm of {} calls on 8 keys: {passed} passed, {} refused by their key, {by_company} by the company; \
         company tokens spent {company_tokens}; then 92 new keys: {} passed; one more: {last_status} (limit {last_limit:?}); \
         the API saw {}",
        storm.len(),
        count(&storm, 429) - by_company,
        fresh.iter().filter(|s| **s == 200).count(),
        mock.arrivals().len(),
    );
    assert_eq!(passed, 8, "one call per key");
    assert_eq!(
        by_company, 0,
        "the company limit refused nothing in the storm"
    );
    assert_eq!(
        company_tokens, 8.0,
        "refused calls gave their company tokens back"
    );
    assert!(
        fresh.iter().all(|s| *s == 200),
        "92 new keys fit the company's 100"
    );
    assert_eq!(last_status, 429);
    assert_eq!(last_limit.as_deref(), Some("company"));
    assert_eq!(mock.arrivals().len(), 100);
    Ok(())
}

/// Stripe-style: each endpoint its own rate, the account one limit that
/// every endpoint's policy names. Per day, so nothing refills meanwhile:
/// 5 per endpoint, 8 for the account.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_named_by_two_policies_is_one_limit() -> anyhow::Result<()> {
    let account = r#"{"name": "account", "rate": {"requests": 8, "period": "1d"}}"#;
    let (mock, envoy) = setup(&format!(
        r#"{{"name": "charges", "match": {{"host": "api.stripe.example", "path_prefix": "/v1/charges"}},
             "rate": {{"requests": 5, "period": "1d"}}, "limits": [{account}]}},
           {{"name": "refunds", "match": {{"host": "api.stripe.example", "path_prefix": "/v1/refunds"}},
             "rate": {{"requests": 5, "period": "1d"}}, "limits": [{account}]}}"#
    ))
    .await?;
    let http = load::client();
    let mut outcomes = Vec::new();
    for path in ["/v1/charges", "/v1/refunds"] {
        for _ in 0..10 {
            let r = http
                .post(envoy.url(path))
                .header("host", "api.stripe.example")
                .send()
                .await?;
            let limit = r
                .headers()
                .get("x-sluice-limit")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("-")
                .to_string();
            outcomes.push((path, r.status().as_u16(), limit));
        }
    }
    let passed = |p: &str| {
        outcomes
            .iter()
            .filter(|(path, s, _)| *path == p && *s == 200)
            .count()
    };
    let by_account = outcomes.iter().filter(|(_, _, l)| l == "account").count();
    settle().await;
    println!(
        "shared account limit: charges {} of 10 passed (endpoint 5), refunds {} of 10 (account 8 in all), \
         {by_account} refused naming account; account tokens {}; the API saw {}",
        passed("/v1/charges"),
        passed("/v1/refunds"),
        envoy.limit_stat("account", "tokens")?,
        mock.arrivals().len()
    );
    assert_eq!(passed("/v1/charges"), 5);
    assert_eq!(passed("/v1/refunds"), 3);
    assert_eq!(by_account, 7);
    assert_eq!(envoy.limit_stat("account", "tokens")?, 8.0);
    assert_eq!(mock.arrivals().len(), 8);
    Ok(())
}

/// Queue mode across limits: the provider allows 20 calls per calendar
/// second and 5 in flight; the policy says so with a further limit (18/s,
/// burst 1: headroom for uneven delivery, as in `filter_e2e`'s e2e 8) and
/// its own concurrency limit, queued, beside a looser own rate and a
/// per-minute limit. 50 clients with calls of 50-450 ms: every call waits
/// its turn on every limit and takes them all when it leaves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_calls_wait_for_every_limit_and_leave_holding_all_of_them() -> anyhow::Result<()> {
    let provider = MockLimits {
        max_per_second: 20,
        max_in_flight: 5,
    };
    let mock = MockApi::start("127.0.0.1:0".parse()?, provider).await?;
    let config = r#"{"instance": "e2e-stacked-queue", "fallback": {"version": 1, "policies": [
        {"name": "llm", "match": {"host": "api.llm.example"},
         "rate": {"requests": 100, "period": "1s", "burst": 10},
         "concurrency": {"max_in_flight": 5},
         "on_limit": {"action": "queue", "max_wait": "30s", "max_queue": 100},
         "limits": [{"name": "provider-rate", "rate": {"requests": 18, "period": "1s", "burst": 1}},
                    {"name": "provider-minute", "rate": {"requests": 1000, "period": "1m"}}]}]}}"#;
    let envoy = Envoy::start(config, mock.addr.port(), WORKERS)?;
    mock.reset();
    const CLIENTS: u64 = 50;
    const CALLS_EACH: u64 = 4;
    let url = envoy.url("/v1/chat");
    let origin = std::time::Instant::now();
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|client| {
            let url = url.clone();
            tokio::spawn(async move {
                let http = load::client();
                let mut out = Vec::new();
                for call in 0..CALLS_EACH {
                    let delay = 50 + (client * 37 + call * 101) % 401;
                    let request = http
                        .get(&url)
                        .header("host", "api.llm.example")
                        .header("x-mock-delay-ms", delay.to_string());
                    out.push(load::send(request, origin).await);
                }
                out
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.extend(t.await?);
    }
    let took = origin.elapsed();
    settle().await;
    let arrived = mock.arrivals();
    let arrivals: Vec<Duration> = arrived.iter().map(|a| a.at).collect();
    let most_1s = max_in_window(&arrivals, Duration::from_secs(1));
    let busiest = load::per_calendar_second(&arrived)
        .into_iter()
        .max()
        .unwrap_or(0);
    let (ok, limited) = (count(&outcomes, 200), count(&outcomes, 429));
    let stat = |limit: &str, s: &str| envoy.limit_stat(limit, s).unwrap_or(-1.0);
    let (queued, admitted, refused) = (
        stat("provider-rate", "queued"),
        stat("provider-rate", "admitted"),
        stat("provider-rate", "refused"),
    );
    let rate = arrivals.len() as f64 / took.as_secs_f64();
    println!(
        "queue across limits: {} calls in {took:.1?} ({rate:.1}/s): {ok} × 200, {limited} × 429; the provider saw \
         at most {busiest} in a calendar second (limit 20; {most_1s} in any 1 s) and {} in flight (limit 5), refused {}; provider-rate: \
         queued {queued}, admitted {admitted}, refused {refused}; provider-minute admitted {}",
        outcomes.len(),
        mock.max_in_flight(),
        mock.rejected_by_mock(),
        stat("provider-minute", "admitted"),
    );
    assert_eq!(mock.rejected_by_mock(), 0, "the provider refused calls");
    assert!(busiest <= 20, "{busiest} calls in one second");
    assert!(mock.max_in_flight() <= 5);
    assert_eq!(
        ok,
        (CLIENTS * CALLS_EACH) as usize,
        "every call got through"
    );
    assert_eq!(admitted, (CLIENTS * CALLS_EACH) as f64);
    assert_eq!(stat("provider-minute", "admitted"), admitted);
    assert!(queued > 0.0, "the further limit held calls back");
    assert_eq!(refused, 0.0);
    Ok(())
}

/// A queued call whose wait runs out behind a further limit is refused in
/// that limit's name: one slot held by a 6 s call, three calls queued
/// for it with a `max_wait` of 1 s, each refused naming the slot's limit
/// once its second is up (5 s before the slot frees: no load breaks it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_call_whose_wait_runs_out_names_the_limit_that_held_it() -> anyhow::Result<()> {
    let (mock, envoy) = setup(
        r#"{"name": "pay", "match": {"host": "api.pay.example"},
         "rate": {"requests": 1000, "period": "1s"},
         "on_limit": {"action": "queue", "max_wait": "1s", "max_queue": 100},
         "limits": [{"name": "one-at-a-time", "concurrency": {"max_in_flight": 1, "lease_ttl": "30s"}}]}"#,
    )
    .await?;
    let url = envoy.url("/v1/charges");
    let long = tokio::spawn({
        let url = url.clone();
        async move { pay_call(&load::client(), &url, 6_000).await }
    });
    // The long call holds the slot before the others come.
    let held = std::time::Instant::now() + Duration::from_secs(5);
    while mock.arrivals().is_empty() && std::time::Instant::now() < held {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(mock.arrivals().len(), 1, "the long call reached the API");
    let waiters: Vec<_> = (0..3)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { pay_call(&load::client(), &url, 0).await })
        })
        .collect();
    let mut refused = Vec::new();
    for waiter in waiters {
        refused.push(waiter.await?);
    }
    let (long_status, _) = long.await?;
    settle().await;
    println!(
        "queue timeouts: {refused:?}; the long call {long_status}; queue_timeouts stat {}",
        envoy.policy_stat("queue_timeouts", "pay")?
    );
    for (status, limit) in &refused {
        assert_eq!((*status, limit.as_str()), (429, "one-at-a-time"));
    }
    assert_eq!(long_status, 200);
    assert_eq!(mock.arrivals().len(), 1, "no waiter reached the API");
    assert_eq!(envoy.policy_stat("queue_timeouts", "pay")?, 3.0);
    Ok(())
}

/// What one call of the account test came to: its status and the limit
/// that refused it ("-" if none said).
async fn pay_call(http: &reqwest::Client, url: &str, delay_ms: u64) -> (u16, String) {
    let sent = http
        .post(url)
        .header("host", "api.pay.example")
        .header("x-mock-delay-ms", delay_ms.to_string())
        .send()
        .await;
    let Ok(response) = sent else {
        return (0, "-".into());
    };
    let limit = response
        .headers()
        .get("x-sluice-limit")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-")
        .to_string();
    let status = response.status().as_u16();
    let _ = response.bytes().await;
    (status, limit)
}

/// Stripe's shape: per-endpoint policies (charges, refunds) over one
/// account that allows 8 calls in flight in all and a number per minute.
/// 40 clients on both endpoints for 5 s: the provider never sees more than
/// 8 in flight and refuses nothing; the thousands of calls refused for a
/// slot take nothing from the account's minute. Then calls whose clients
/// hang up mid-call give their slots back: 8 long calls fit again at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_account_wide_concurrency_limit_holds_over_per_endpoint_policies() -> anyhow::Result<()>
{
    const IN_FLIGHT: u64 = 8;
    const PER_MINUTE: u64 = 2_000;
    let provider = MockLimits {
        max_per_second: 0,
        max_in_flight: IN_FLIGHT,
    };
    let mock = MockApi::start("127.0.0.1:0".parse()?, provider).await?;
    let limits = format!(
        r#"[{{"name": "account-minute", "rate": {{"requests": {PER_MINUTE}, "period": "1m", "algorithm": "fixed_window"}}}},
            {{"name": "account-in-flight", "concurrency": {{"max_in_flight": {IN_FLIGHT}, "lease_ttl": "10s"}}}}]"#
    );
    let config = format!(
        r#"{{"instance": "e2e-stacked-slots", "fallback": {{"version": 1, "policies": [
        {{"name": "charges", "match": {{"host": "api.pay.example", "path_prefix": "/v1/charges"}},
         "rate": {{"requests": 1000, "period": "1s"}}, "limits": {limits}}},
        {{"name": "refunds", "match": {{"host": "api.pay.example", "path_prefix": "/v1/refunds"}},
         "rate": {{"requests": 1000, "period": "1s"}}, "limits": {limits}}}]}}}}"#
    );
    let envoy = Envoy::start(&config, mock.addr.port(), WORKERS)?;
    mock.reset();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let tasks: Vec<_> = (0..40u64)
        .map(|client| {
            let path = if client % 2 == 0 {
                "/v1/charges"
            } else {
                "/v1/refunds"
            };
            let url = envoy.url(path);
            tokio::spawn(async move {
                let http = load::client();
                let mut out = Vec::new();
                let mut n = 0u64;
                while std::time::Instant::now() < deadline {
                    let delay = 20 + (client * 37 + n * 101) % 120;
                    let answer = pay_call(&http, &url, delay).await;
                    if answer.0 == 429 {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    out.push(answer);
                    n += 1;
                }
                out
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.extend(t.await?);
    }
    settle().await;
    let ok = outcomes.iter().filter(|(s, _)| *s == 200).count();
    let by = |limit: &str| {
        outcomes
            .iter()
            .filter(|(s, l)| *s == 429 && l == limit)
            .count()
    };
    let other = outcomes
        .iter()
        .filter(|(s, l)| *s != 200 && !(*s == 429 && l == "account-in-flight"))
        .count();
    let stat = |s: &str| envoy.limit_stat("account-in-flight", s).unwrap_or(-1.0);
    println!(
        "account in flight: {} calls, {ok} × 200, {} × 429 naming account-in-flight, {} naming account-minute, {other} other; \
         the provider saw at most {} in flight (limit {IN_FLIGHT}) and refused {}; stats: admitted {}, refused {}; \
         account-minute admitted {}",
        outcomes.len(),
        by("account-in-flight"),
        by("account-minute"),
        mock.max_in_flight(),
        mock.rejected_by_mock(),
        stat("admitted"),
        stat("refused"),
        envoy.limit_stat("account-minute", "admitted")?,
    );
    assert_eq!(mock.rejected_by_mock(), 0, "the provider refused calls");
    assert!(mock.max_in_flight() <= IN_FLIGHT);
    assert!(
        mock.max_in_flight() >= IN_FLIGHT - 2,
        "the limit was used: {}",
        mock.max_in_flight()
    );
    assert_eq!(other, 0, "every call passed or waited for a slot");
    assert!(
        by("account-in-flight") > 100,
        "the slots were the binding limit"
    );
    assert!(
        (ok as u64) < PER_MINUTE,
        "the test must leave the minute unspent to see a leak"
    );
    assert_eq!(
        by("account-minute"),
        0,
        "refusals for a slot took nothing from the minute"
    );
    assert_eq!(stat("admitted"), ok as f64);
    assert_eq!(stat("refused"), by("account-in-flight") as f64);
    assert_eq!(mock.arrivals().len(), ok);

    // Clients that hang up mid-call: Envoy ends their streams, and their
    // slots come back.
    let url = envoy.url("/v1/charges");
    let hang_ups: Vec<_> = (0..IN_FLIGHT)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move {
                let http = reqwest::Client::builder()
                    .timeout(Duration::from_millis(300))
                    .build()
                    .expect("a client");
                pay_call(&http, &url, 3_000).await
            })
        })
        .collect();
    let mut abandoned = Vec::new();
    for t in hang_ups {
        abandoned.push(t.await?);
    }
    assert!(
        abandoned.iter().all(|(s, _)| *s == 0),
        "every client hung up: {abandoned:?}"
    );
    // The provider finishes its side of the abandoned calls in its own time.
    tokio::time::sleep(Duration::from_millis(3_000)).await;
    mock.reset();
    let url = envoy.url("/v1/refunds");
    let long: Vec<_> = (0..IN_FLIGHT)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { pay_call(&load::client(), &url, 1_000).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let one_more = pay_call(&load::client(), &envoy.url("/v1/charges"), 10).await;
    let mut long_answers = Vec::new();
    for t in long {
        long_answers.push(t.await?);
    }
    println!(
        "account in flight after {IN_FLIGHT} hang-ups: {IN_FLIGHT} long calls {:?}; one more while they run: {one_more:?}",
        long_answers.iter().map(|(s, _)| *s).collect::<Vec<_>>()
    );
    assert!(
        long_answers.iter().all(|(s, _)| *s == 200),
        "{long_answers:?}"
    );
    assert_eq!(one_more, (429, "account-in-flight".to_string()));
    Ok(())
}
