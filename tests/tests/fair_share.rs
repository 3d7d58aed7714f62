//! `fair`: one provider quota shared between tenants by weight, through a
//! real Envoy (`--concurrency 4`), in front of a mock provider that allows
//! 100 calls per calendar second and counts every tenant's calls (the
//! tenant is the `x-api-key` each call carries). The policy allows 95 a
//! second with a burst of 5, so no calendar second can hold more than 100.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sluice_demo::mock::{MockApi, MockLimits};
use sluice_e2e::envoy::Envoy;
use sluice_e2e::load::{self, Outcome};

const WORKERS: u32 = 4;
const PROVIDER_PER_SECOND: u64 = 100;

fn policy(fair: &str) -> String {
    format!(
        r#"{{"name": "llm", "match": {{"host": "api.llm.example"}},
            "rate": {{"requests": 95, "period": "1s", "burst": 5}}, "fair": {fair}}}"#
    )
}

async fn setup(fair: &str) -> anyhow::Result<(MockApi, Envoy)> {
    let limits = MockLimits {
        max_per_second: PROVIDER_PER_SECOND,
        max_in_flight: 0,
    };
    let mock = MockApi::start("127.0.0.1:0".parse()?, limits).await?;
    let config = format!(
        r#"{{"instance": "e2e-fair", "fallback": {{"version": 1, "policies": [{}]}}}}"#,
        policy(fair)
    );
    let envoy = Envoy::start(&config, mock.addr.port(), WORKERS)?;
    mock.reset();
    Ok((mock, envoy))
}

/// One tenant's paced load, stopped on its own.
struct Tenant {
    stop: Arc<AtomicBool>,
    calls: tokio::task::JoinHandle<Vec<Outcome>>,
}

fn start(envoy: &Envoy, tag: &'static str, per_second: u64) -> Tenant {
    let stop = Arc::new(AtomicBool::new(false));
    let calls = load::paced(
        envoy.url("/v1/complete"),
        "api.llm.example",
        tag,
        per_second,
        stop.clone(),
    );
    Tenant { stop, calls }
}

impl Tenant {
    async fn finish(self) -> Vec<Outcome> {
        self.stop.store(true, Ordering::SeqCst);
        self.calls.await.unwrap_or_default()
    }
}

/// Per calendar second the provider saw, each tenant's calls, over the
/// whole seconds from `from` to `to` (seconds of the mock's clock).
fn per_second(
    mock: &MockApi,
    from: Duration,
    to: Duration,
) -> BTreeMap<u64, BTreeMap<String, u64>> {
    let arrivals = mock.arrivals();
    let mut seconds: BTreeMap<u64, BTreeMap<String, u64>> = BTreeMap::new();
    for a in arrivals.iter().filter(|a| a.at >= from && a.at < to) {
        *seconds
            .entry(a.second)
            .or_default()
            .entry(a.key.clone().unwrap_or_default())
            .or_default() += 1;
    }
    // The first and last calendar seconds are partly outside.
    let keys: Vec<u64> = seconds.keys().copied().collect();
    if keys.len() > 2 {
        seconds.remove(&keys[0]);
        seconds.remove(&keys[keys.len() - 1]);
    }
    seconds
}

/// Each tenant's part of what the provider saw, per second: (worst
/// deviation from `want` as a fraction of it, mean part).
fn parts(seconds: &BTreeMap<u64, BTreeMap<String, u64>>, tenant: &str, want: f64) -> (f64, f64) {
    let parts: Vec<f64> = seconds
        .values()
        .map(|by| {
            let total: u64 = by.values().sum();
            by.get(tenant).copied().unwrap_or(0) as f64 / total.max(1) as f64
        })
        .collect();
    let worst = parts
        .iter()
        .map(|p| (p - want).abs() / want)
        .fold(0.0, f64::max);
    (worst, parts.iter().sum::<f64>() / parts.len().max(1) as f64)
}

fn most_in_a_second(seconds: &BTreeMap<u64, BTreeMap<String, u64>>) -> u64 {
    seconds
        .values()
        .map(|by| by.values().sum())
        .max()
        .unwrap_or(0)
}

/// Three greedy tenants (300 calls a second each, weights 1, 1 and 2) for
/// 30 s: every second the provider sees them 25/25/50. Then the weight-2
/// tenant rests for 6 s (the other two share 50/50 from 2 s on) and comes
/// back (its half again from 2 s on). The provider refuses nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_tenants_share_the_quota_by_weight_and_idle_shares_are_lent() -> anyhow::Result<()> {
    let (mock, envoy) =
        setup(r#"{"key": {"header": "x-api-key"}, "weights": {"gold": 2}}"#).await?;
    let clock = std::time::Instant::now();
    let since = |d: Duration| clock.elapsed().saturating_sub(d);
    let (a, b) = (start(&envoy, "a", 300), start(&envoy, "b", 300));
    let gold = start(&envoy, "gold", 300);
    tokio::time::sleep(Duration::from_secs(31)).await;
    let steady = per_second(&mock, Duration::from_secs(1), since(Duration::ZERO));
    let gold_calls = gold.finish().await;
    let rested_at = clock.elapsed();
    tokio::time::sleep(Duration::from_secs(6)).await;
    let resting = per_second(
        &mock,
        rested_at + Duration::from_secs(2),
        since(Duration::ZERO),
    );
    let back_at = clock.elapsed();
    let gold = start(&envoy, "gold", 300);
    tokio::time::sleep(Duration::from_secs(6)).await;
    let back = per_second(
        &mock,
        back_at + Duration::from_secs(2),
        since(Duration::ZERO),
    );
    let mut calls = gold_calls;
    for t in [a, b, gold] {
        calls.extend(t.finish().await);
    }
    let fair_refusals = calls
        .iter()
        .filter(|o| o.status == 429)
        .filter(|o| {
            o.headers
                .get("x-sluice-reason")
                .is_some_and(|v| v == "fair-share")
        })
        .count();
    let refused = load::count(&calls, 429);
    let (a_worst, a_mean) = parts(&steady, "a", 0.25);
    let (b_worst, b_mean) = parts(&steady, "b", 0.25);
    let (gold_worst, gold_mean) = parts(&steady, "gold", 0.5);
    let (rest_a, rest_a_mean) = parts(&resting, "a", 0.5);
    let (rest_b, _) = parts(&resting, "b", 0.5);
    let (back_gold, back_gold_mean) = parts(&back, "gold", 0.5);
    let per_second_total: Vec<u64> = steady.values().map(|by| by.values().sum()).collect();
    println!(
        "fair 1/1/2: {} seconds; mean parts a {:.3} b {:.3} gold {:.3}; worst second off by a {:.1} % b {:.1} % gold {:.1} %; \
         calls per second {per_second_total:?}; gold resting: a {:.3} (worst {:.1} %, b worst {:.1} %); gold back: {:.3} (worst {:.1} %); \
         {} calls, {refused} refused ({fair_refusals} fair-share); most in a calendar second {}; provider refused {}",
        steady.len(),
        a_mean,
        b_mean,
        gold_mean,
        100.0 * a_worst,
        100.0 * b_worst,
        100.0 * gold_worst,
        rest_a_mean,
        100.0 * rest_a,
        100.0 * rest_b,
        back_gold_mean,
        100.0 * back_gold,
        calls.len(),
        most_in_a_second(&per_second(&mock, Duration::ZERO, since(Duration::ZERO))),
        mock.rejected_by_mock(),
    );
    assert!(steady.len() >= 28, "{} whole seconds", steady.len());
    for (who, worst) in [("a", a_worst), ("b", b_worst), ("gold", gold_worst)] {
        assert!(
            worst <= 0.05,
            "{who}'s part was {:.1} % off in its worst second",
            100.0 * worst
        );
    }
    assert!(rest_a <= 0.05 && rest_b <= 0.05, "50/50 while gold rests");
    assert!(back_gold <= 0.05, "gold's half back within 2 s");
    assert_eq!(mock.rejected_by_mock(), 0, "the provider refused calls");
    assert_eq!(refused, fair_refusals, "every refusal names the fair share");
    // Stats reach Envoy on the filter's tick.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let fair_refused = envoy.policy_stat("fair_refused", "llm")?;
    assert!(
        (fair_refused - fair_refusals as f64).abs() <= 1.0,
        "stat {fair_refused} vs {fair_refusals}"
    );
    Ok(())
}

/// A noisy tenant offering 10 times the quota beside a quiet one at 20 a
/// second: every quiet call goes (but perhaps its very first, before its
/// share has brought it a token), the noisy tenant gets the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_tenant_gets_all_it_asks_beside_a_noisy_one() -> anyhow::Result<()> {
    let (mock, envoy) = setup(r#"{"key": {"header": "x-api-key"}}"#).await?;
    let (noisy, quiet) = (start(&envoy, "noisy", 1_000), start(&envoy, "quiet", 20));
    tokio::time::sleep(Duration::from_secs(7)).await;
    let seconds = per_second(&mock, Duration::from_secs(1), Duration::from_secs(7));
    let quiet_calls = quiet.finish().await;
    let noisy_calls = noisy.finish().await;
    let mean = |who: &str| {
        seconds
            .values()
            .map(|by| by.get(who).copied().unwrap_or(0))
            .sum::<u64>() as f64
            / seconds.len().max(1) as f64
    };
    let quiet_refused = load::count(&quiet_calls, 429);
    // A tenant new to the table starts with nothing of its own: its very
    // first call may find every token just taken by the noisy one (its
    // share brings one 20 ms later).
    let first = quiet_calls
        .iter()
        .map(|o| o.started)
        .min()
        .unwrap_or_default();
    let refused_late: Vec<Duration> = quiet_calls
        .iter()
        .filter(|o| o.status == 429 && o.started > first)
        .map(|o| o.started)
        .collect();

    println!(
        "fair noisy/quiet: noisy offered 1000/s, quiet 20/s; the provider saw noisy {:.1}/s, quiet {:.1}/s over {} seconds; \
         quiet refused {quiet_refused} of {} (after its first call: {refused_late:?}); noisy refused {} of {}; provider refused {}",
        mean("noisy"),
        mean("quiet"),
        seconds.len(),
        quiet_calls.len(),
        load::count(&noisy_calls, 429),
        noisy_calls.len(),
        mock.rejected_by_mock(),
    );
    assert!(refused_late.is_empty(), "the quiet tenant lost calls");
    assert!(mean("quiet") >= 19.0, "quiet {:.1}/s", mean("quiet"));
    assert!(
        mean("noisy") >= 73.0,
        "noisy {:.1}/s: the rest goes to it",
        mean("noisy")
    );
    assert_eq!(mock.rejected_by_mock(), 0);
    Ok(())
}

/// Reservations that add up to the whole rate, every tenant greedy: each
/// reserved tenant gets its reservation and the total stays within the
/// provider's limit (a peer's minimums once pushed it past).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reservations_adding_up_to_the_limit_never_push_past_it() -> anyhow::Result<()> {
    let (mock, envoy) =
        setup(r#"{"key": {"header": "x-api-key"}, "min": {"a": 60, "b": 35}}"#).await?;
    let tenants = [
        start(&envoy, "a", 300),
        start(&envoy, "b", 300),
        start(&envoy, "c", 300),
    ];
    tokio::time::sleep(Duration::from_secs(6)).await;
    let seconds = per_second(&mock, Duration::from_secs(2), Duration::from_secs(6));
    let mut calls = Vec::new();
    for t in tenants {
        calls.extend(t.finish().await);
    }
    let mean = |who: &str| {
        seconds
            .values()
            .map(|by| by.get(who).copied().unwrap_or(0))
            .sum::<u64>() as f64
            / seconds.len().max(1) as f64
    };
    let most = most_in_a_second(&per_second(&mock, Duration::ZERO, Duration::from_secs(7)));
    println!(
        "fair reservations 60 + 35 of 95: the provider saw a {:.1}/s, b {:.1}/s, c {:.1}/s; most in a calendar second {most}; \
         {} calls; provider refused {}",
        mean("a"),
        mean("b"),
        mean("c"),
        calls.len(),
        mock.rejected_by_mock(),
    );
    assert!(mean("a") >= 57.0 && mean("b") >= 33.0, "reservations kept");
    assert!(most <= PROVIDER_PER_SECOND, "{most} in one second");
    assert_eq!(mock.rejected_by_mock(), 0);
    Ok(())
}

/// What a client controls cannot break it: tenant values that are long,
/// binary or absent are tenants like any other, and the rate holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_tenant_values_are_tenants_and_the_rate_holds() -> anyhow::Result<()> {
    let (mock, envoy) = setup(r#"{"key": {"header": "x-api-key", "max_keys": 4}}"#).await?;
    let url = envoy.url("/v1/complete");
    let http = load::client();
    let origin = std::time::Instant::now();
    let long = vec![b't'; 8_000];
    let mut statuses = BTreeMap::new();
    for n in 0..600u32 {
        let tenant: Vec<u8> = match n % 4 {
            0 => long.clone(),
            1 => format!("tenant-{n}").into_bytes(),
            2 => b"\xff\xfe\t x".to_vec(),
            _ => Vec::new(),
        };
        let mut request = http.get(&url).header("host", "api.llm.example");
        if !tenant.is_empty() {
            request = request.header(
                "x-api-key",
                reqwest::header::HeaderValue::from_bytes(&tenant)?,
            );
        }
        let outcome = load::send(request, origin).await;
        *statuses.entry(outcome.status).or_insert(0u32) += 1;
    }
    let seconds = origin.elapsed().as_secs_f64();
    let went = mock.arrivals().len();
    println!(
        "fair hostile tenants: 600 calls in {seconds:.1} s (a tenant of 8 000 bytes, 150 new tenants past max_keys 4, \
         bytes past ASCII, none): statuses {statuses:?}; the provider saw {went}"
    );
    assert!(
        statuses.keys().all(|s| [200, 429].contains(s)),
        "{statuses:?}"
    );
    assert!(
        went as f64 <= 5.0 + 95.0 * seconds + 1.0,
        "{went} in {seconds:.1} s"
    );
    assert_eq!(mock.rejected_by_mock(), 0);
    Ok(())
}

/// The quiet tenant's waits in queue mode beside a noisy tenant offering
/// ten times the quota: (p50, p99, worst) of its admitted calls, and how
/// many it had refused.
async fn quiet_waits_in_queue(
    fair: bool,
) -> anyhow::Result<(Duration, Duration, Duration, usize, f64)> {
    let queue = r#""on_limit": {"action": "queue", "max_wait": "2s", "max_queue": 5000}"#;
    let fair_spec = if fair {
        r#", "fair": {"key": {"header": "x-api-key"}}"#
    } else {
        ""
    };
    let policy = format!(
        r#"{{"name": "llm", "match": {{"host": "api.llm.example"}},
            "rate": {{"requests": 95, "period": "1s", "burst": 5}}, {queue}{fair_spec}}}"#
    );
    let limits = MockLimits {
        max_per_second: PROVIDER_PER_SECOND,
        max_in_flight: 0,
    };
    let mock = MockApi::start("127.0.0.1:0".parse()?, limits).await?;
    let config = format!(
        r#"{{"instance": "e2e-fair-queue", "fallback": {{"version": 1, "policies": [{policy}]}}}}"#
    );
    let envoy = Envoy::start(&config, mock.addr.port(), WORKERS)?;
    mock.reset();
    let noisy = start(&envoy, "noisy", 950);
    // The noisy backlog builds first.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let quiet = start(&envoy, "quiet", 20);
    tokio::time::sleep(Duration::from_secs(6)).await;
    let quiet_calls = quiet.finish().await;
    noisy.finish().await;
    let mut waits: Vec<Duration> = quiet_calls
        .iter()
        .filter(|o| o.status == 200)
        .map(|o| o.latency)
        .collect();
    waits.sort();
    let at = |q: f64| {
        waits
            .get(((waits.len() as f64 * q).ceil() as usize).saturating_sub(1))
            .copied()
            .unwrap_or_default()
    };
    let seconds = per_second(&mock, Duration::from_secs(2), Duration::from_secs(7));
    let quiet_rate = seconds
        .values()
        .map(|by| by.get("quiet").copied().unwrap_or(0))
        .sum::<u64>() as f64
        / seconds.len().max(1) as f64;
    assert_eq!(mock.rejected_by_mock(), 0, "the provider refused calls");
    Ok((
        at(0.5),
        at(0.99),
        at(1.0),
        load::count(&quiet_calls, 429),
        quiet_rate,
    ))
}

/// Queue mode: the quiet tenant's calls wait for their share, not behind
/// the noisy tenant's backlog (p99 under 100 ms), against FIFO, where
/// they wait about the whole `max_wait` (2 s) or are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fair_queue_keeps_a_quiet_tenants_wait_short_beside_a_noisy_backlog() -> anyhow::Result<()>
{
    let (p50, p99, worst, refused, rate) = quiet_waits_in_queue(true).await?;
    let (fifo_p50, fifo_p99, fifo_worst, fifo_refused, fifo_rate) =
        quiet_waits_in_queue(false).await?;
    println!(
        "fair queue: noisy offers 950/s, quiet 20/s, max_wait 2 s; quiet waits with fair: p50 {p50:?}, p99 {p99:?}, \
         worst {worst:?}, {refused} refused, the provider saw quiet {rate:.1}/s; FIFO: p50 {fifo_p50:?}, p99 {fifo_p99:?}, \
         worst {fifo_worst:?}, {fifo_refused} refused, the provider saw quiet {fifo_rate:.1}/s"
    );
    assert!(p99 < Duration::from_millis(100), "fair p99 {p99:?}");
    assert_eq!(refused, 0);
    assert!(rate >= 19.0, "quiet {rate:.1}/s");
    assert!(
        fifo_p50 > Duration::from_millis(1_000) || fifo_refused > 60,
        "FIFO was not slow"
    );
    Ok(())
}
