//! Pools through real Envoy (`--concurrency 4`, `envoy/pool.yaml`): two
//! mock deployments of one API, each allowing 50 calls per calendar second
//! and counting which credential each call brought (Envoy sets it per
//! deployment). Sluice sends each call to the member with room, routes
//! around one whose quota drops to 0, and Envoy retries a refused call on
//! the other member once, counted there too.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;

use sluice_demo::mock::{MockApi, MockLimits};
use sluice_e2e::envoy::{workspace_root, Envoy};
use sluice_e2e::load::{self, Outcome};

const WORKERS: u32 = 4;
const PROVIDER_PER_SECOND: u64 = 50;
/// Each member's limit in Sluice: within its provider's calendar seconds.
const MEMBER_PER_SECOND: u64 = 48;
/// With a burst of 2, 48 a second never passes the provider's 50 in a
/// calendar second.
const MEMBER_BURST: u64 = 2;

fn member(name: &str, burst: u64) -> String {
    format!(
        r#"{{"name": "{name}", "cluster": "llm-{name}",
            "limits": [{{"name": "{name}-rps", "rate": {{"requests": {MEMBER_PER_SECOND}, "period": "1s", "burst": {burst}}},
                         "provider": {{"max_pause": "60s"}}}}]}}"#
    )
}

/// A stalled test process sends the calls it owes at once: a burst of 10
/// keeps such a bunch on a sticky conversation's member.
const STICKY_MEMBER_BURST: u64 = 10;

fn pool_policy() -> String {
    pool_policy_of("", MEMBER_BURST)
}

/// The pool's policy: `sticky` (empty, or its field and a comma) and each
/// member's burst.
fn pool_policy_of(sticky: &str, burst: u64) -> String {
    format!(
        r#"{{"name": "llm", "match": {{"host": "api.llm.example"}},
            "rate": {{"requests": 1000, "period": "1s"}},
            "pool": {{{sticky}"members": [{}, {}]}}}}"#,
        member("east", burst),
        member("west", burst)
    )
}

/// The two mock deployments, and `envoy/pool.yaml` sending to them.
async fn deployments() -> anyhow::Result<(MockApi, MockApi, String)> {
    let limits = MockLimits {
        max_per_second: PROVIDER_PER_SECOND,
        max_in_flight: 0,
    };
    let east = MockApi::start("127.0.0.1:0".parse()?, limits).await?;
    let west = MockApi::start("127.0.0.1:0".parse()?, limits).await?;
    let template = std::fs::read_to_string(workspace_root().join("envoy/pool.yaml"))?
        .replace("{{EAST_PORT}}", &east.addr.port().to_string())
        .replace("{{WEST_PORT}}", &west.addr.port().to_string());
    Ok((east, west, template))
}

async fn setup(policy: &str) -> anyhow::Result<(MockApi, MockApi, Envoy)> {
    let (east, west, template) = deployments().await?;
    let config = format!(
        r#"{{"instance": "e2e-pool", "fallback": {{"version": 1, "policies": [{policy}]}}}}"#
    );
    let envoy = Envoy::start_from(&template, &config, 9, 9, WORKERS)?;
    east.reset();
    west.reset();
    Ok((east, west, envoy))
}

/// A provider's refusal that reached the caller (Sluice's own carry
/// `x-sluice-reason` or name their limit).
fn provider_refused(o: &Outcome) -> bool {
    o.status == 429
        && !o.headers.contains_key("x-sluice-limit")
        && !o.headers.contains_key("x-sluice-reason")
}

/// Calls a mock served (200) per credential.
fn served_by_key(mock: &MockApi, total: u64) -> BTreeMap<String, u64> {
    let mut by = BTreeMap::new();
    for a in mock
        .arrivals()
        .iter()
        .take(usize::try_from(total).unwrap_or(usize::MAX))
    {
        *by.entry(a.key.clone().unwrap_or_default()).or_default() += 1;
    }
    by
}

/// 80 calls a second for 12 s; east's quota drops to 0 (429, `Retry-After:
/// 30`) after 4 s. Before: both serve. After the first 429: under 0.5 % of
/// the callers' calls get a provider's 429, and west keeps serving (90 %
/// of its limit over the whole seconds after the drop, 75 % in each: the
/// figures to the call, 95 % and each second, are the simulator's
/// `pool_routing::a_member_that_drops_to_zero_is_routed_around`, over a thousand
/// seeds; here a loaded machine's stalled callers would move them). Each
/// retry Envoy made from east to west is counted at west once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_drops_to_zero_is_routed_around() -> anyhow::Result<()> {
    let (east, west, envoy) = setup(&pool_policy()).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let load = load::paced(
        envoy.url("/v1/complete"),
        "api.llm.example",
        "caller",
        80,
        stop.clone(),
    );
    tokio::time::sleep(Duration::from_secs(4)).await;
    let dropped_at = started.elapsed();
    east.go_down(30);
    tokio::time::sleep(Duration::from_secs(8)).await;
    stop.store(true, Ordering::SeqCst);
    let calls = load.await?;

    let before: Vec<&Outcome> = calls.iter().filter(|o| o.started < dropped_at).collect();
    let after: Vec<&Outcome> = calls.iter().filter(|o| o.started >= dropped_at).collect();
    let provider_429_after = after.iter().filter(|o| provider_refused(o)).count();
    let share_after = provider_429_after as f64 / after.len().max(1) as f64;
    // West's whole seconds after the drop, from the next second on.
    let west_arrivals = west.arrivals();
    let first_second = west_arrivals
        .iter()
        .find(|a| a.at >= dropped_at)
        .map_or(0, |a| a.second)
        + 1;
    let mut west_seconds: BTreeMap<u64, u64> = BTreeMap::new();
    for a in west_arrivals.iter().filter(|a| a.second >= first_second) {
        *west_seconds.entry(a.second).or_default() += 1;
    }
    let last = west_seconds.keys().next_back().copied().unwrap_or(0);
    west_seconds.remove(&last);
    let served: Vec<u64> = west_seconds.values().copied().collect();
    let worst = served.iter().copied().min().unwrap_or(0);
    let total: u64 = served.iter().sum();
    let east_keys = served_by_key(&east, u64::MAX);
    let west_keys = served_by_key(&west, u64::MAX);
    let retries = envoy_stat(&envoy, "cluster.llm-east.upstream_rq_retry")?;
    let counted_at_west = envoy.limit_stat("west-rps", "pool_retried").unwrap_or(0.0);
    let east_paused = envoy.limit_stat_total("east-rps", "paused")?;
    let before_ok = before.iter().filter(|o| o.status == 200).count();
    println!(
        "pool, a member drops to 0: {} calls before the drop ({before_ok} answered 200), {} after; provider 429s \
         the callers saw after the drop {provider_429_after} ({:.2} %); west served per whole second after it \
         {served:?} (limit {MEMBER_PER_SECOND}, worst {:.1} %); credentials east saw {east_keys:?}, west saw \
         {west_keys:?}; Envoy retried {retries} calls from east to west, counted at west {counted_at_west}; \
         east paused {east_paused} time(s); east refused {}, west refused {}",
        before.len(),
        after.len(),
        100.0 * share_after,
        100.0 * worst as f64 / MEMBER_PER_SECOND as f64,
        east.rejected_by_mock(),
        west.rejected_by_mock(),
    );
    anyhow::ensure!(
        east_keys.keys().all(|k| k == "east-key") && west_keys.keys().all(|k| k == "west-key"),
        "each deployment got its own credential"
    );
    anyhow::ensure!(
        before_ok as f64 >= 0.95 * before.len() as f64,
        "before the drop both members served the 80 a second"
    );
    anyhow::ensure!(share_after < 0.005, "provider 429s after the drop");
    anyhow::ensure!(
        served.len() >= 5,
        "whole seconds after the drop: {served:?}"
    );
    anyhow::ensure!(
        total as f64 >= 0.90 * (MEMBER_PER_SECOND * served.len() as u64) as f64
            && worst as f64 >= 0.75 * MEMBER_PER_SECOND as f64,
        "west delivered {served:?}"
    );
    anyhow::ensure!(retries >= 1.0, "a call in flight to east was retried");
    anyhow::ensure!(
        (counted_at_west - retries).abs() < 0.5,
        "each retried call is counted at west once"
    );
    anyhow::ensure!(east_paused >= 1.0, "east paused");
    Ok(())
}

/// Issue 53, item 5: 40 calls a second; after 3 s east's quota drops to
/// 0 with `Retry-After: 30`. Envoy retries east's refusals on west, so the
/// deciding filter sees west's answers only; the attempts filter (an
/// upstream filter of the member clusters, `envoy/pool.yaml`) hears east's
/// own. East then gets no call from 1 s after its first refusal (the calls
/// already on their way) until 29 s after it (its pause began when Envoy
/// heard it, at most a second later: margins no stalled machine breaks),
/// while west serves them; once its 30 s are over, east serves again.
/// (Before the attempts were heard, east was probed 8 times in those 19 s:
/// a pause of a second, restarted at each retried refusal.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_refusing_with_retry_after_30_gets_no_call_for_30_s() -> anyhow::Result<()> {
    let (east, west, envoy) = setup(&pool_policy()).await?;
    let reset = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let load = load::paced(
        envoy.url("/v1/complete"),
        "api.llm.example",
        "caller",
        40,
        stop.clone(),
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    let down_at = reset.elapsed();
    east.go_down(30);
    tokio::time::sleep(Duration::from_secs(36)).await;
    stop.store(true, Ordering::SeqCst);
    let calls = load.await?;

    let arrivals: Vec<Duration> = east
        .arrivals()
        .iter()
        .map(|a| a.at)
        .filter(|at| *at >= down_at)
        .collect();
    let first = *arrivals
        .first()
        .context("east saw no call after its drop")?;
    let since = |at: &Duration| at.saturating_sub(first).as_secs_f64();
    let during: Vec<f64> = arrivals
        .iter()
        .map(since)
        .filter(|s| (1.0..29.0).contains(s))
        .collect();
    let back = arrivals.iter().map(since).filter(|s| *s >= 29.0).count();
    let after: Vec<&Outcome> = calls.iter().filter(|o| o.started >= down_at).collect();
    let ok_after = after.iter().filter(|o| o.status == 200).count();
    let refused_by_provider = after.iter().filter(|o| provider_refused(o)).count();
    let east_refused = envoy.limit_stat_total("east-rps", "provider_refused")?;
    let east_paused = envoy.limit_stat_total("east-rps", "paused")?;
    println!(
        "pool, east refuses with Retry-After: 30: east saw {} calls after its drop, the first {:.2} s \
         after it; {} of them 1 to 29 s after that first one {during:?}; {back} from 29 s on; the callers' \
         {} calls after the drop: {ok_after} answered 200, {refused_by_provider} with a provider's 429; \
         east-rps heard {east_refused} refusals, paused {east_paused} time(s); west served {} calls",
        arrivals.len(),
        first.saturating_sub(down_at).as_secs_f64(),
        during.len(),
        after.len(),
        west.arrivals().len(),
    );
    anyhow::ensure!(
        during.is_empty(),
        "east was called {} time(s) during its Retry-After: 30, at {during:?} s",
        during.len()
    );
    anyhow::ensure!(back >= 1, "east got no call once its 30 s were over");
    anyhow::ensure!(
        ok_after as f64 >= 0.95 * after.len() as f64,
        "west did not carry the calls: {ok_after} of {} answered 200",
        after.len()
    );
    anyhow::ensure!(
        east_paused >= 1.0 && east_refused >= 1.0,
        "east's refusal unheard"
    );
    Ok(())
}

/// 40 conversations, five calls each, at 40 calls a second (both members
/// have room): each conversation's calls stay on one member, and the
/// conversations spread over both. With bursts of 2, a stalled test
/// process's bunch found neither member with room (CI on 91d9aec: 3 of 200
/// refused, 197 seen by the mocks): [`STICKY_MEMBER_BURST`] keeps the test
/// on stickiness, not the machine's stalls (a member without room passed
/// over: `a_member_that_drops_to_zero_is_routed_around`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sticky_conversations_stay_on_their_member() -> anyhow::Result<()> {
    let sticky = r#""sticky": {"header": "x-conversation"}, "#;
    let (east, west, envoy) = setup(&pool_policy_of(sticky, STICKY_MEMBER_BURST)).await?;
    let http = load::client();
    let url = envoy.url("/v1/complete");
    let mut sent = Vec::new();
    let mut next = tokio::time::Instant::now();
    for round in 0..5u64 {
        for conversation in 0..40u64 {
            next += Duration::from_millis(25);
            tokio::time::sleep_until(next).await;
            let request = http
                .get(&url)
                .header("host", "api.llm.example")
                .header("x-conversation", format!("c{conversation}"))
                .header("x-seq", (round * 1000 + conversation).to_string());
            sent.push(tokio::spawn(async move {
                request
                    .send()
                    .await
                    .map(|r| r.status().as_u16())
                    .unwrap_or(0)
            }));
        }
    }
    let mut statuses = Vec::new();
    for s in sent {
        statuses.push(s.await?);
    }
    let mut members: BTreeMap<u64, BTreeMap<&str, u64>> = BTreeMap::new();
    for (mock, name) in [(&east, "east"), (&west, "west")] {
        for a in mock.arrivals() {
            if let Some(seq) = a.seq {
                *members
                    .entry(seq % 1000)
                    .or_default()
                    .entry(name)
                    .or_default() += 1;
            }
        }
    }
    let calls: u64 = members.values().flat_map(|m| m.values()).sum();
    let on_home: u64 = members
        .values()
        .map(|m| m.values().copied().max().unwrap_or(0))
        .sum();
    let homes_east = members
        .values()
        .filter(|m| m.get("east").copied().unwrap_or(0) > m.get("west").copied().unwrap_or(0))
        .count();
    let ok = statuses.iter().filter(|s| **s == 200).count();
    println!(
        "pool, sticky: {} calls of 40 conversations, {ok} answered 200; {on_home} of {calls} ({:.1} %) on their \
         conversation's member; conversations at home on east {homes_east}, on west {}",
        statuses.len(),
        100.0 * on_home as f64 / calls.max(1) as f64,
        members.len() - homes_east
    );
    let mut by_status = BTreeMap::<u16, u32>::new();
    for status in &statuses {
        *by_status.entry(*status).or_default() += 1;
    }
    anyhow::ensure!(
        ok == statuses.len(),
        "every call answered 200 (by status, 0 for no answer: {by_status:?})"
    );
    anyhow::ensure!(calls == 200, "the mocks saw every call: {calls}");
    anyhow::ensure!(on_home as f64 >= 0.99 * calls as f64, "sticky");
    anyhow::ensure!(
        (8..=32).contains(&homes_east),
        "conversations spread over both members: {homes_east} of 40 on east"
    );
    Ok(())
}

fn envoy_stat(envoy: &Envoy, name: &str) -> anyhow::Result<f64> {
    let text = sluice_e2e::envoy::http_get(envoy.admin_port, "/stats")?;
    let want = format!("{name}: ");
    Ok(text
        .lines()
        .find_map(|l| l.strip_prefix(&want))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0))
}

/// A caller's own `x-sluice-member` chooses nothing: on the pool's host
/// Sluice overwrites it with the member it chose, and the routes match
/// only the members' values, so no other cluster of the Envoy (its admin
/// cluster) can be named. A provider's own `x-sluice-member-answered` is
/// replaced by the route's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callers_route_header_names_no_cluster() -> anyhow::Result<()> {
    let (east, west, envoy) = setup(&pool_policy()).await?;
    let http = load::client();
    let url = envoy.url("/v1/complete");
    let mut answered = BTreeMap::<String, u32>::new();
    for target in ["sluice_admin", "east", "llm-east", "llm-west"] {
        for _ in 0..4 {
            // Paced within the members' limits (48/s each, burst 2).
            tokio::time::sleep(Duration::from_millis(50)).await;
            let resp = http
                .get(&url)
                .header("host", "api.llm.example")
                .header("x-sluice-member", target)
                .send()
                .await?;
            let by = resp
                .headers()
                .get("x-sluice-member-answered")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("none")
                .to_string();
            *answered
                .entry(format!("{} {by}", resp.status().as_u16()))
                .or_default() += 1;
        }
    }
    // No policy on this host: the routes know no such member.
    let stray = http
        .get(&url)
        .header("host", "other.example")
        .header("x-sluice-member", "sluice_admin")
        .send()
        .await?
        .status()
        .as_u16();
    let served = east.arrivals().len() + west.arrivals().len();
    println!(
        "pool, a caller's own route header: 16 calls naming sluice_admin, east, llm-east and llm-west answered {answered:?} \
         (the deployments saw {served}); on a host without a pool, naming sluice_admin -> {stray}"
    );
    anyhow::ensure!(
        answered.keys().all(|k| k == "200 east" || k == "200 west"),
        "every call went to a member Sluice chose: {answered:?}"
    );
    anyhow::ensure!(served == 16, "{served}");
    anyhow::ensure!(stray == 404, "no route for a stray member name: {stray}");
    Ok(())
}

/// What the shipped `envoy/pool.yaml` adds so that Envoy itself keeps a
/// caller's route header from routing: the test takes them out to show
/// the filter does it alone.
const EARLY_REMOVAL: &str = "          early_header_mutation_extensions:
          - name: envoy.http.early_header_mutation.header_mutation
            typed_config:
              \"@type\": type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation
              mutations:
              - remove: x-sluice-member
";
const SCOPED_DOMAINS: &str = r#"domains: ["api.llm.example", "api.llm.example:*"]"#;

/// 100 calls at once to `host`, each naming member `llm-east` in its own
/// `x-sluice-member`: their statuses, and how many reached a deployment.
async fn stray_calls(
    envoy: &Envoy,
    host: &str,
    east: &MockApi,
    west: &MockApi,
) -> anyhow::Result<(BTreeMap<u16, u32>, usize)> {
    east.reset();
    west.reset();
    let http = load::client();
    let mut calls = Vec::new();
    for _ in 0..100 {
        let request = http
            .get(envoy.url("/v1/complete"))
            .header("host", host)
            .header("x-sluice-member", "llm-east");
        calls.push(tokio::spawn(async move {
            request
                .send()
                .await
                .map(|r| r.status().as_u16())
                .unwrap_or(0)
        }));
    }
    let mut statuses = BTreeMap::new();
    for call in calls {
        *statuses.entry(call.await?).or_default() += 1;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    Ok((statuses, east.arrivals().len() + west.arrivals().len()))
}

/// Third security review, item 1: a caller's own `x-sluice-member` never
/// routes a call. With Envoy's own defences taken out of the shipped
/// config (the early removal, the member routes scoped to the pool's
/// host), 100 calls at once to another host naming `llm-east` reach no
/// deployment, with the pool's set and before any set with a pool (an
/// empty fallback, `route_headers` naming it); with the shipped config, the same. On the pool's own
/// host, a caller naming the other member pauses neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callers_route_header_reaches_no_member() -> anyhow::Result<()> {
    let (east, west, shipped) = deployments().await?;
    anyhow::ensure!(
        shipped.contains(EARLY_REMOVAL) && shipped.contains(SCOPED_DOMAINS),
        "pool.yaml removes x-sluice-member early and scopes its member routes"
    );
    let bare = shipped
        .replace(EARLY_REMOVAL, "")
        .replace(SCOPED_DOMAINS, r#"domains: ["*"]"#);
    let with_pool = format!(
        r#"{{"instance": "e2e-pool", "fallback": {{"version": 1, "policies": [{}]}}}}"#,
        pool_policy()
    );
    // Before any set names a pool, the headers the configuration names
    // (`route_headers`, as the book asks of a config with member routes).
    let no_pool = r#"{"instance": "e2e-pool", "route_headers": ["x-sluice-member"],
                      "fallback": {"version": 1, "policies": []}}"#;
    let mut results = Vec::new();
    for (name, template, config) in [
        (
            "the filter alone, the pool's set",
            &bare,
            with_pool.as_str(),
        ),
        ("the filter alone, no pool yet", &bare, no_pool),
        ("the shipped config", &shipped, with_pool.as_str()),
    ] {
        let envoy = Envoy::start_from(template, config, 9, 9, WORKERS)?;
        let (statuses, arrived) = stray_calls(&envoy, "other.example", &east, &west).await?;
        let stripped = envoy.filter_stat("route_header_stripped").unwrap_or(-1.0);
        println!(
            "pool, a caller's x-sluice-member: llm-east to other.example, {name}: answers {statuses:?}, \
             reached a deployment {arrived}, removed by the filter {stripped}"
        );
        results.push((name, statuses, arrived));
    }
    // On the pool's host, naming the other member: Sluice's choice stands,
    // and no member is taken for one Envoy retried away from.
    let envoy = Envoy::start_from(&bare, &with_pool, 9, 9, WORKERS)?;
    east.reset();
    west.reset();
    let http = load::client();
    let mut answered = BTreeMap::<String, u32>::new();
    for i in 0..20 {
        tokio::time::sleep(Duration::from_millis(30)).await;
        let named = if i % 2 == 0 { "llm-east" } else { "llm-west" };
        let resp = http
            .get(envoy.url("/v1/complete"))
            .header("host", "api.llm.example")
            .header("x-sluice-member", named)
            .send()
            .await?;
        let by = resp
            .headers()
            .get("x-sluice-member-answered")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("none")
            .to_string();
        *answered
            .entry(format!("{} {by}", resp.status().as_u16()))
            .or_default() += 1;
    }
    let paused = envoy.limit_stat_total("east-rps", "paused")?
        + envoy.limit_stat_total("west-rps", "paused")?;
    let retried = envoy.limit_stat("east-rps", "pool_retried").unwrap_or(0.0)
        + envoy.limit_stat("west-rps", "pool_retried").unwrap_or(0.0);
    println!(
        "pool, callers naming a member on the pool's host: answers {answered:?}; members paused {paused}, retried-away counts {retried}"
    );
    for (name, statuses, arrived) in &results {
        anyhow::ensure!(*arrived == 0, "{name}: {arrived} reached a deployment");
        anyhow::ensure!(statuses.keys().all(|s| *s == 404), "{name}: {statuses:?}");
    }
    anyhow::ensure!(
        answered.keys().all(|k| k == "200 east" || k == "200 west"),
        "{answered:?}"
    );
    anyhow::ensure!(
        paused == 0.0 && retried == 0.0,
        "paused {paused}, retried {retried}"
    );
    Ok(())
}

/// Two deployments that say what is left (OpenAI's request headers), each
/// allowing 40 calls per second of its own; the members follow those
/// headers. 60 calls a second for 8 s; after 3 s east's limit halves to
/// 20. From the second after the halving on, neither deployment refuses
/// a call: east gets what its headers allow (once any pause its refusals
/// at the halving began is over) and west the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_whose_limit_halves_is_followed_without_refusals() -> anyhow::Result<()> {
    use sluice_demo::provider::{MockProvider, Signals};
    let east = MockProvider::start(40, Signals::OpenAi, Duration::from_millis(5)).await?;
    let west = MockProvider::start(40, Signals::OpenAi, Duration::from_millis(5)).await?;
    let following = |name: &str| {
        format!(
            r#"{{"name": "{name}", "cluster": "llm-{name}",
                "limits": [{{"name": "{name}-rps", "rate": {{"requests": 45, "period": "1s", "burst": 5}},
                             "provider": {{"headers": "openai-requests", "max_pause": "10s"}}}}]}}"#
        )
    };
    let policy = format!(
        r#"{{"name": "llm", "match": {{"host": "api.llm.example"}}, "rate": {{"requests": 1000, "period": "1s"}},
            "pool": {{"members": [{}, {}]}}}}"#,
        following("east"),
        following("west")
    );
    let template = std::fs::read_to_string(workspace_root().join("envoy/pool.yaml"))?
        .replace("{{EAST_PORT}}", &east.addr.port().to_string())
        .replace("{{WEST_PORT}}", &west.addr.port().to_string());
    let config = format!(
        r#"{{"instance": "e2e-pool-halves", "fallback": {{"version": 1, "policies": [{policy}]}}}}"#
    );
    let envoy = Envoy::start_from(&template, &config, 9, 9, WORKERS)?;
    let stop = Arc::new(AtomicBool::new(false));
    let load = load::paced(
        envoy.url("/v1/complete"),
        "api.llm.example",
        "caller",
        60,
        stop.clone(),
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    east.set_limit(20);
    let halved_in = east.elapsed().as_secs() as usize;
    let west_then = west.elapsed().as_secs() as usize;
    tokio::time::sleep(Duration::from_secs(5)).await;
    stop.store(true, Ordering::SeqCst);
    let calls = load.await?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let east_windows = east.windows();
    let west_windows = west.windows();
    // East's whole seconds after the one it halved in; west's over the
    // same span of time (each counts calendar seconds from the one it
    // started in, and the two may have started a second apart).
    let after: Vec<_> = east_windows
        .iter()
        .skip(halved_in + 1)
        .take(3)
        .map(|w| (w.accepted, w.refused))
        .collect();
    let west_after: Vec<_> = west_windows
        .iter()
        .skip(west_then + 1)
        .take(3)
        .map(|w| (w.accepted, w.refused))
        .collect();
    let east_refused_before: u64 = east_windows
        .iter()
        .take(halved_in + 1)
        .map(|w| w.refused)
        .sum();
    let ok = calls.iter().filter(|o| o.status == 200).count();
    let provider_429s = calls.iter().filter(|o| provider_refused(o)).count();
    println!(
        "pool, a member's limit halves (40 -> 20 a second) while its headers are followed: east per second after \
         (accepted, refused) {after:?}, west {west_after:?}; east refused {east_refused_before} up to the second it \
         halved in; callers: {ok} of {} answered 200, {provider_429s} provider 429s",
        calls.len()
    );
    anyhow::ensure!(
        after.len() == 3 && west_after.len() == 3,
        "whole seconds measured"
    );
    anyhow::ensure!(
        after
            .iter()
            .chain(&west_after)
            .all(|(_, refused)| *refused == 0),
        "no refusals after the first answer"
    );
    // Calls in flight as it halved may be refused there and retried on
    // west, which passes east over for a few seconds: it is used again
    // within the three.
    anyhow::ensure!(
        after.iter().any(|(accepted, _)| *accepted >= 15),
        "east used again: {after:?}"
    );
    anyhow::ensure!(provider_429s == 0, "callers saw no provider 429");
    Ok(())
}

/// The member a call was answered by (`-` for none).
fn member_answered(o: &Outcome) -> String {
    o.headers
        .get("x-sluice-member-answered")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-")
        .to_string()
}

/// Of `calls` begun in `from..to` (from their load's start) and answered
/// 200: how many east answered, and how many west.
fn east_and_west(calls: &[Outcome], from: Duration, to: Duration) -> (u32, u32) {
    calls
        .iter()
        .filter(|o| o.started >= from && o.started < to && o.status == 200)
        .fold((0, 0), |(e, w), o| match member_answered(o).as_str() {
            "east" => (e + 1, w),
            "west" => (e, w + 1),
            _ => (e, w),
        })
}

/// A pool in priority order (east first), each member's limit one for the
/// fleet (`scope: global`), seen by two Envoys syncing with one admin: a
/// (4 workers) and b (2). The route does not retry, so a refusal reaches
/// Sluice.
async fn fleet_pool() -> anyhow::Result<(
    sluice_e2e::admin::AdminProcess,
    (tempfile::TempDir, MockApi, MockApi),
    Envoy,
    Envoy,
)> {
    use sluice_e2e::admin::{AdminProcess, SYNC_TOKEN};

    let dir = tempfile::tempdir()?;
    // The admin as its own process, as an operator runs it, not in the
    // test's runtime beside the load (where a loaded machine delayed its
    // answers by seconds: provider_signals' fleet pause).
    let admin = AdminProcess::start_in(dir.path(), &[]).await?;
    let op = admin.login().await?;
    let global = |name: &str| {
        serde_json::json!({"name": name, "cluster": format!("llm-{name}"),
            "limits": [{"name": format!("{name}-rps"), "scope": "global",
                        "rate": {"requests": MEMBER_PER_SECOND, "period": "1s"},
                        "provider": {"max_pause": "60s"}}]})
    };
    op.create(serde_json::json!({
        "name": "llm", "match": {"host": "api.llm.example"},
        "rate": {"requests": 1000, "period": "1s"},
        "pool": {"rule": "priority", "members": [global("east"), global("west")]}}))
        .await?;
    let (east, west, template) = deployments().await?;
    anyhow::ensure!(
        template.contains("num_retries: 1"),
        "pool.yaml retries elsewhere"
    );
    let template = template.replace("num_retries: 1", "num_retries: 0");
    let config = |instance: &str| {
        serde_json::json!({"instance": instance, "admin_cluster": "sluice_admin",
            "sync_interval": "200ms", "sync_token": SYNC_TOKEN,
            "fallback": {"version": 1, "policies": []}})
        .to_string()
    };
    let a = Envoy::start_from(&template, &config("pool-a"), 9, admin.port, WORKERS)?;
    let b = Envoy::start_from(&template, &config("pool-b"), 9, admin.port, 2)?;
    op.wait_for_shares(&["pool-a", "pool-b"]).await?;
    Ok((admin, (dir, east, west), a, b))
}

/// Fleet mode: two Envoys share a pool through one admin (syncing every
/// 200 ms, [`fleet_pool`]). Each Envoy sends 16 calls a second, all to
/// east. One call through a gets east's 429 with
/// `Retry-After: 3`: b, whose own calls east still serves, passes east
/// over within a second (it heard it from the admin) and returns to it
/// when the pause ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_paused_at_one_envoy_is_passed_over_by_the_others() -> anyhow::Result<()> {
    let (_admin, _mocks, a, b) = fleet_pool().await?;
    let stop = Arc::new(AtomicBool::new(false));
    let origin = Instant::now();
    let load_a = load::paced(
        a.url("/v1/complete"),
        "api.llm.example",
        "a",
        16,
        stop.clone(),
    );
    let load_b = load::paced(
        b.url("/v1/complete"),
        "api.llm.example",
        "b",
        16,
        stop.clone(),
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    let provoked_at = origin.elapsed();
    let provoked = load::client()
        .get(a.url("/v1/complete"))
        .header("host", "api.llm.example")
        .header("x-mock-status", "429")
        .header("x-mock-retry-after", "3")
        .send()
        .await?;
    let (status, answered) = (
        provoked.status().as_u16(),
        provoked
            .headers()
            .get("x-sluice-member-answered")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("-")
            .to_string(),
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    stop.store(true, Ordering::SeqCst);
    let (calls_a, calls_b) = (load_a.await?, load_b.await?);
    let member = member_answered;
    // Per Envoy, (east, west) answers of calls begun in a stretch after
    // the provoked 429 (ms).
    let tally = |calls: &[Outcome], from_ms: u64, to_ms: u64| {
        east_and_west(
            calls,
            provoked_at + Duration::from_millis(from_ms),
            provoked_at + Duration::from_millis(to_ms),
        )
    };
    let last_east_b = calls_b
        .iter()
        .filter(|o| o.started > provoked_at && o.started < provoked_at + Duration::from_secs(2))
        .filter(|o| member(o) == "east")
        .map(|o| o.started - provoked_at)
        .max()
        .unwrap_or(Duration::ZERO);
    let before_b = calls_b
        .iter()
        .filter(|o| o.started < provoked_at && member(o) == "east")
        .count();
    // Before it, per half second from the start: (east, west).
    let halves = |calls: &[Outcome]| -> Vec<(u32, u32)> {
        (0..6u32)
            .map(|half| {
                let from = Duration::from_millis(500 * u64::from(half));
                east_and_west(calls, from, from + Duration::from_millis(500))
            })
            .collect()
    };
    println!(
        "pool across the fleet, before the 429: (east, west) per half second: a {:?}, b {:?}",
        halves(&calls_a),
        halves(&calls_b)
    );
    let (paused_a, paused_b) = (tally(&calls_a, 100, 2_800), tally(&calls_b, 1_000, 2_800));
    let (after_a, after_b) = (tally(&calls_a, 3_500, 5_000), tally(&calls_b, 3_500, 5_000));
    println!(
        "pool across the fleet: a's call answered {status} by {answered}; b's calls on east before it {before_b}, \
         b's last on east {last_east_b:?} after it; (east, west) while paused: a {paused_a:?}, b {paused_b:?}; \
         after: a {after_a:?}, b {after_b:?}"
    );
    assert_eq!((status, answered.as_str()), (429, "east"));
    assert!(before_b >= 10, "b called east before: {before_b}");
    assert!(
        last_east_b <= Duration::from_millis(1_000),
        "b stopped after {last_east_b:?}"
    );
    for (name, (on_east, on_west)) in [("a", paused_a), ("b", paused_b)] {
        assert_eq!(on_east, 0, "{name} passed east over");
        assert!(on_west >= 20, "{name} sent to west meanwhile: {on_west}");
    }
    for (name, (on_east, _)) in [("a", after_a), ("b", after_b)] {
        assert!(on_east >= 15, "{name} went back to east: {on_east}");
    }
    assert!(b.log().contains("relayed by the admin"));
    Ok(())
}

/// Fleet mode ([`fleet_pool`]): b calls alone first, 16 a second, and is
/// leased nearly all of east's 48. Then a starts, 24 a second: its calls
/// find its share of east full and go to west, but they were asked of
/// east (`passed_over`), so the admin sizes a's share by them and a's
/// calls move to east at once, in a few syncs, and stay (both fit: 40 of
/// 48). Counted as admitted only, a's demand at east would be its small
/// share, grown a little at each sync (a CI run saw a send 19 of 24
/// calls to west 0.5 to 2 s after such a start). Most runs move within
/// the first second; the bound is two (a clean CI run of the native
/// build, lint beside it, moved 1.5 s after a's start).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_envoy_whose_calls_spill_over_is_given_its_share_of_the_member_back(
) -> anyhow::Result<()> {
    let (_admin, _mocks, a, b) = fleet_pool().await?;
    let stop = Arc::new(AtomicBool::new(false));
    let b_began = Instant::now();
    let load_b = load::paced(
        b.url("/v1/complete"),
        "api.llm.example",
        "b",
        16,
        stop.clone(),
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    // Each load's calls are timed from its own start.
    let a_began = b_began.elapsed();
    let load_a = load::paced(
        a.url("/v1/complete"),
        "api.llm.example",
        "a",
        24,
        stop.clone(),
    );
    tokio::time::sleep(Duration::from_secs(4)).await;
    stop.store(true, Ordering::SeqCst);
    let (calls_a, calls_b) = (load_a.await?, load_b.await?);
    // a's answers per half second from its start: (east, west).
    let halves: Vec<(u32, u32)> = (0..8)
        .map(|half| {
            east_and_west(
                &calls_a,
                Duration::from_millis(500 * half),
                Duration::from_millis(500 * (half + 1)),
            )
        })
        .collect();
    // The first half second nearly all on east: the move.
    let moved = halves
        .iter()
        .position(|(on_east, on_west)| *on_east >= 5 * on_west && *on_east > 0)
        .unwrap_or(halves.len());
    let settled = halves.get(moved..).unwrap_or_default();
    let (east, total) = settled.iter().fold((0, 0), |(e, t), (on_east, on_west)| {
        (e + on_east, t + on_east + on_west)
    });
    let b_east_after = calls_b
        .iter()
        .filter(|o| o.started >= a_began + Duration::from_secs(1))
        .filter(|o| o.status == 200 && member_answered(o) == "east")
        .count();
    let b_after = calls_b
        .iter()
        .filter(|o| o.started >= a_began + Duration::from_secs(1))
        .count();
    let on_east = f64::from(east) / f64::from(total.max(1));
    println!(
        "pool across the fleet, a starting beside b: a's (east, west) per half second from its start {halves:?}; \
         moved to east {} ms after its start, then {:.1} % on east; b {b_east_after} of {b_after} on east meanwhile",
        500 * moved,
        100.0 * on_east
    );
    assert!(
        moved <= 3,
        "a moved to east only {} ms after its start",
        500 * moved
    );
    assert!(total >= 24, "a was served after its move: {total}");
    assert!(
        on_east >= 0.95,
        "a stayed on east: {:.1} %",
        100.0 * on_east
    );
    assert!(
        b_east_after + 2 >= b_after,
        "b kept east: {b_east_after} of {b_after}"
    );
    assert!(
        a.limit_stat("east-rps", "passed_over").unwrap_or(0.0) >= 1.0,
        "a counted the calls that passed east over"
    );
    Ok(())
}
