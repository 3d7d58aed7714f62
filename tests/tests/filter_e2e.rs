//! The filter in a real Envoy (`--concurrency 4`) in front of the mock API.
//! Their assertions hold with margins on a busy machine: `make e2e` runs two
//! tests at once (cargo-nextest, `.config/nextest.toml`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice_demo::mock::{MockApi, MockLimits};
use sluice_e2e::envoy::Envoy;
use sluice_e2e::load::{self, closed_loop, count, max_in_window, Outcome};

const WORKERS: u32 = 4;

fn config(policies: &str) -> String {
    format!(
        r#"{{"instance": "e2e", "queue_ticket_header": true,
            "fallback": {{"version": 1, "policies": [{policies}]}}}}"#
    )
}

async fn setup(policies: &str) -> anyhow::Result<(MockApi, Envoy)> {
    let mock = MockApi::start("127.0.0.1:0".parse()?, MockLimits::default()).await?;
    let envoy = Envoy::start(&config(policies), mock.addr.port(), WORKERS)?;
    mock.reset();
    Ok((mock, envoy))
}

/// Stats reach Envoy on the filter's tick (100 ms when idle).
async fn settle() {
    tokio::time::sleep(Duration::from_millis(400)).await;
}

fn arrivals_between(mock: &MockApi, from: Duration, to: Duration, key: Option<&str>) -> usize {
    mock.arrivals()
        .iter()
        .filter(|a| a.at >= from && a.at < to && (key.is_none() || a.key.as_deref() == key))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2e_1_rate_200_per_second_burst_20_with_64_clients() -> anyhow::Result<()> {
    let (mock, envoy) = setup(
        r#"{"name": "bank", "match": {"host": "api.bank.example"}, "rate": {"requests": 200, "period": "1s", "burst": 20}}"#,
    )
    .await?;
    let url = envoy.url("/v1/pay");
    let outcomes = closed_loop(64, Duration::from_secs(10), move |c, _| {
        c.get(&url).header("host", "api.bank.example")
    })
    .await;
    let arrived = mock.arrivals();
    let arrivals: Vec<Duration> = arrived.iter().map(|a| a.at).collect();
    let steady =
        arrivals_between(&mock, Duration::from_secs(1), Duration::from_secs(9), None) as f64 / 8.0;
    let (most_1s, most_100ms) = (
        load::most_surely_within(&arrived, Duration::from_secs(1)).0,
        load::most_surely_within(&arrived, Duration::from_millis(100)).0,
    );
    let (ok, limited) = (count(&outcomes, 200), count(&outcomes, 429));
    println!(
        "e2e 1 rate: {} requests, {ok} passed, {limited} got 429; mock saw {} ({:.1}/s over 10 s), steady rate {steady:.1}/s \
         (error {:+.2} %); sent and arrived within any 1 s: {most_1s} (bound 220), any 100 ms: {most_100ms} (bound 40); \
         arrived within any 1 s: {}, any 100 ms: {} (the trip's jitter included)",
        outcomes.len(),
        arrivals.len(),
        arrivals.len() as f64 / 10.0,
        (steady - 200.0) / 2.0,
        max_in_window(&arrivals, Duration::from_secs(1)),
        max_in_window(&arrivals, Duration::from_millis(100)),
    );
    assert_eq!(ok + limited, outcomes.len(), "only 200 and 429 answers");
    assert_eq!(ok, arrivals.len(), "every 200 reached the mock");
    assert!(
        (steady - 200.0).abs() <= 4.0,
        "steady rate {steady} not within 2 % of 200/s"
    );
    // The limiter let each call through between its send and its arrival,
    // so the calls whose whole trip fits in a window W passed within W:
    // at most the burst and W's refill (a burst twice the policy's would
    // show 20 more). Counting arrivals alone also counted what a stall on
    // a loaded machine bunched on the way (228 in 1 s on CI, 5f41aa2).
    assert!(most_1s <= 220, "{most_1s} in one second");
    assert!(most_100ms <= 40, "{most_100ms} in 100 ms");
    for o in outcomes.iter().filter(|o| o.status == 429) {
        assert_eq!(o.header("x-sluice-policy"), Some("bank"));
        assert_eq!(o.header("ratelimit-policy"), Some("\"bank\";q=200;w=1"));
        assert_eq!(o.header("retry-after"), Some("1"));
        assert!(o
            .header("ratelimit")
            .is_some_and(|v| v.starts_with("\"bank\";r=0;t=")));
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2e_2_concurrency_10_with_100ms_upstream_and_100_clients() -> anyhow::Result<()> {
    let (mock, envoy) =
        setup(r#"{"name": "llm", "match": {"host": "*"}, "concurrency": {"max_in_flight": 10}}"#)
            .await?;
    let url = envoy.url("/v1/chat");
    let outcomes = closed_loop(100, Duration::from_secs(6), move |c, _| {
        c.post(&url)
            .header("host", "api.llm.example")
            .header("x-mock-delay-ms", "100")
    })
    .await;
    let samples = mock.in_flight_samples();
    // The middle of the run, away from ramp-up and drain.
    let middle = &samples[samples.len() / 6..samples.len() * 5 / 6];
    let full = middle.iter().filter(|&&n| n >= 9).count() as f64 / middle.len().max(1) as f64;
    let mean = middle.iter().sum::<u64>() as f64 / middle.len().max(1) as f64;
    println!(
        "e2e 2 concurrency: {} requests, {} passed, {} got 429; mock max in flight {} (limit 10), \
         mean {mean:.2}, {:.1} % of 5 ms samples at 9-10 in flight",
        outcomes.len(),
        count(&outcomes, 200),
        count(&outcomes, 429),
        mock.max_in_flight(),
        full * 100.0
    );
    assert!(
        mock.max_in_flight() <= 10,
        "mock saw {} in flight",
        mock.max_in_flight()
    );
    // The slots are used: a slot freed and handed out late (a leak, a
    // release that waits for a tick) shows as a lower mean. The mean, not
    // the share of samples at 9-10: with 100 clients retrying on two cores
    // each freed slot sits empty for a client's turnaround, which the CPU
    // load stretches (one `make test` run: 76 % of samples at 9-10, mean 9.06).
    assert!(mean >= 8.0, "only {mean:.2} of 10 slots in use on average");
    settle().await;
    assert_eq!(envoy.gauge("llm", "in_flight")?, 0.0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2e_3_queue_50_per_second_max_wait_2s() -> anyhow::Result<()> {
    let (mock, envoy) = setup(
        r#"{"name": "queued", "match": {"host": "*"}, "rate": {"requests": 50, "period": "1s", "burst": 1},
            "on_limit": {"action": "queue", "max_wait": "2s"}}"#,
    )
    .await?;
    let http = load::client();
    let origin = Instant::now();
    const SENT: u64 = 120;
    const LEAVER: u64 = 49;
    let mut tasks = Vec::new();
    for seq in 0..SENT {
        let request = http
            .get(envoy.url("/rates"))
            .header("host", "api.fx.example")
            .header("x-seq", seq.to_string());
        // One client gives up after 300 ms, long before its turn.
        let request = if seq == LEAVER {
            request.timeout(Duration::from_millis(300))
        } else {
            request
        };
        tasks.push(tokio::spawn(load::send(request, origin)));
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.push(t.await?);
    }
    let arrivals = mock.arrivals();
    let seqs: Vec<u64> = arrivals.iter().filter_map(|a| a.seq).collect();
    let tickets: Vec<u64> = arrivals.iter().filter_map(|a| a.queue_ticket).collect();
    let gaps: Vec<f64> = arrivals
        .windows(2)
        .map(|w| (w[1].at - w[0].at).as_secs_f64() * 1000.0)
        .collect();
    // Each queued release against its slot on a 20 ms grid. The grid's
    // phase is fitted to the releases before the leaver's turn (their
    // median offset), not anchored on the first request: that one took
    // the burst token, and a late delivery of it to the mock (one clean CI
    // run: 6 ms, with every later release on time) would make every queued
    // release look early by as much. A hole left by the leaver would push
    // every later release 20 ms off the grid.
    let first_at = arrivals.first().map(|a| a.at).unwrap_or_default();
    let offsets: Vec<f64> = arrivals
        .iter()
        .enumerate()
        .skip(1)
        .map(|(i, a)| (a.at.as_secs_f64() - first_at.as_secs_f64()) * 1000.0 - 20.0 * i as f64)
        .collect();
    let median_of = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or_default()
    };
    let phase = median_of(&offsets[..offsets.len().min(40)]);
    let lateness: Vec<f64> = offsets.iter().map(|o| o - phase).collect();
    let worst = lateness.iter().copied().fold(f64::MIN, f64::max);
    let earliest = lateness.iter().copied().fold(f64::MAX, f64::min);
    let median = median_of(&lateness);
    // The leaver's turn was about 49 turns in; everything released well
    // after it shows whether its place was freed or left as a hole.
    let median_after_leaver = median_of(lateness.get(60..).unwrap_or_default());
    let mut passed: Vec<u64> = (0..SENT)
        .filter(|&s| outcomes[s as usize].status == 200)
        .collect();
    passed.sort();
    let limited: Vec<u64> = (0..SENT)
        .filter(|&s| outcomes[s as usize].status == 429)
        .collect();
    let slowest_429 = limited
        .iter()
        .map(|&s| outcomes[s as usize].latency)
        .max()
        .unwrap_or_default();
    // Requests that reached Envoy out of the order they were sent in (the
    // connections are set up concurrently, across 4 workers).
    let sent_order_swaps = seqs.windows(2).filter(|w| w[0] > w[1]).count();
    // Neighbouring releases that reached the mock in the other order.
    let transit_swaps = tickets.windows(2).filter(|w| w[0] > w[1]).count();
    settle().await;
    println!(
        "e2e 3 queue: {SENT} sent 1 ms apart, {} passed, {} got 429 (slowest answer {:?}), \
         1 left the queue; released {} tickets ({transit_swaps} neighbours swapped in \
         transit), {sent_order_swaps} neighbours swapped against the send order; gaps between \
         releases at the mock: {:.1}..{:.1} ms, \
         queued release minus its 20 ms slot: earliest {earliest:.1} ms, median {median:.1} ms \
         ({median_after_leaver:.1} ms after the leaver's turn), worst {worst:.1} ms; the first \
         (burst) call reached the mock {:+.1} ms from the grid's origin; last release at {:?}",
        passed.len(),
        limited.len(),
        slowest_429,
        tickets.len(),
        gaps.iter().copied().fold(f64::MAX, f64::min),
        gaps.iter().copied().fold(0.0, f64::max),
        -phase,
        arrivals.last().map(|a| a.at).unwrap_or_default(),
    );
    assert_eq!(
        outcomes[LEAVER as usize].status, 0,
        "the leaver timed out on its side"
    );
    assert!(!seqs.contains(&LEAVER), "the leaver never reached the mock");
    assert_eq!(passed.len() + limited.len() + 1, SENT as usize);
    let mut reached: Vec<u64> = seqs.clone();
    reached.sort();
    assert_eq!(reached, passed, "the mock saw exactly the passed requests");
    // The first request found the burst token; every other one was queued.
    assert!(arrivals.first().is_some_and(|a| a.queue_ticket.is_none()));
    assert_eq!(
        tickets.len() + 1,
        arrivals.len(),
        "all but the first were queued"
    );
    // Released in queue order. The mock sees each release after its trip
    // through one of Envoy's workers, and two releases a fraction of a
    // millisecond apart (a late tick lets the next turn go at once) can
    // swap on the way: one CI run saw tickets 58 and 57 arrive 0.4 ms
    // apart. A queue that let a call pass the one ahead of it would set
    // them a turn apart (20 ms); half a turn tells the two apart.
    let queued: Vec<(u64, Duration)> = arrivals
        .iter()
        .filter_map(|a| Some((a.queue_ticket?, a.at)))
        .collect();
    for (i, &(first_ticket, first_at)) in queued.iter().enumerate() {
        for &(then_ticket, then_at) in &queued[i + 1..] {
            let apart = then_at.saturating_sub(first_at);
            assert!(
                first_ticket < then_ticket || apart < Duration::from_millis(10),
                "released out of queue order: ticket {then_ticket} reached the mock {apart:?} \
                 after ticket {first_ticket}, which queued behind it; tickets {tickets:?}"
            );
        }
    }
    // A call queued near the 2 s horizon whose turn a late poll pushed past
    // its deadline is refused when its wait runs out: max_wait is a promise
    // to the caller. One clean CI run: a call's turn came 2 s after it
    // queued, the worker holding the call ahead of it polled late, and the
    // call got a 429 after 2.0015 s. Those, and only those, are refused
    // after a whole max_wait, and only near the horizon.
    let timed_out: Vec<u64> = limited
        .iter()
        .copied()
        .filter(|&s| outcomes[s as usize].latency >= Duration::from_millis(1_900))
        .collect();
    assert_eq!(
        envoy.policy_stat("queue_timeouts", "queued")?,
        timed_out.len() as f64,
        "the calls refused after a whole max_wait ({timed_out:?}) are the queue's timeouts"
    );
    // The tickets released are consecutive but for the leaver's and the
    // timed-out calls', which came past the first 90 turns (1.8 s).
    // (Smallest and largest: neighbours may have swapped in transit.)
    let first_ticket = tickets.iter().copied().min().unwrap_or(0);
    let holes: Vec<u64> = (first_ticket..tickets.iter().max().map_or(0, |t| t + 1))
        .filter(|t| !tickets.contains(t))
        .collect();
    assert_eq!(
        holes.len(),
        1 + timed_out.len(),
        "tickets never released {holes:?}: the leaver's and the timed-out calls' {timed_out:?}"
    );
    assert!(
        holes.iter().filter(|&&t| t - first_ticket < 90).count() <= 1,
        "only the leaver's ticket is missing before the horizon: {holes:?}"
    );
    // Queue order is arrival order at Envoy. The send order may differ by
    // the few ms a connection takes to set up, never by more.
    let ticket_of = |seq: u64| {
        arrivals
            .iter()
            .find(|a| a.seq == Some(seq))
            .and_then(|a| a.queue_ticket)
    };
    for &a in &passed {
        for &b in &passed {
            let (Some(ta), Some(tb)) = (ticket_of(a), ticket_of(b)) else {
                continue;
            };
            let (sa, sb) = (outcomes[a as usize].started, outcomes[b as usize].started);
            assert!(
                !(sa + Duration::from_millis(25) < sb && ta > tb),
                "request {a} was sent {:?} before request {b} and queued behind it",
                sb - sa
            );
        }
    }
    // 2 s at 50/s fits 100 turns after the first request, whatever the
    // spacing of arrivals; past them, whether a turn fits depends on when
    // the request arrived.
    assert!(
        passed.len() >= 100,
        "2 s at 50/s fits 100 turns after the first"
    );
    assert!(
        limited.iter().all(|&l| l > 80),
        "refused only past the 2 s horizon: {limited:?}"
    );
    // Never ahead of the rate: no release a slot early. Delivery to the
    // mock only ever adds delay, so a release looks early only by as much
    // as the grid's phase (the median of forty releases) was delayed; half
    // a slot is far beyond that and far short of the fault, a whole slot.
    assert!(
        earliest >= -10.0,
        "a release came {earliest:.1} ms before its 20 ms slot"
    );
    // No hole where the leaver's turn was: its place was freed. A hole
    // would put every later release a whole 20 ms slot late.
    assert!(
        median_after_leaver <= 10.0,
        "releases after the leaver's turn sit {median_after_leaver:.1} ms (median) off \
         their slots: its turn was left as a hole"
    );
    // The queue keeps up: a lost wake-up would stall releases until the
    // next arrival or the 2 s horizon. A single release delayed by a busy
    // CI machine (one was 27 ms late) is scheduling noise, so the bound
    // only catches stalls; `make bench` measures the precision itself.
    assert!(
        worst <= 100.0,
        "a release came {worst:.1} ms after its slot: the queue stalled"
    );
    for &s in &limited {
        assert!(outcomes[s as usize].header("retry-after").is_some());
    }
    assert_eq!(envoy.policy_stat("queue_abandoned", "queued")?, 1.0);
    // Every call but the first queued: those served, the leaver, and the
    // timed-out ones.
    assert_eq!(
        envoy.policy_stat("queued", "queued")?,
        (passed.len() - 1 + 1 + timed_out.len()) as f64
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2e_4_two_api_keys_each_get_100_per_second() -> anyhow::Result<()> {
    let (mock, envoy) = setup(
        r#"{"name": "per-key", "match": {"host": "*"}, "key": {"header": "x-api-key", "max_keys": 100},
            "rate": {"requests": 100, "period": "1s", "burst": 10}}"#,
    )
    .await?;
    let url = envoy.url("/ship");
    let outcomes = closed_loop(32, Duration::from_secs(6), move |c, i| {
        c.get(&url)
            .header("host", "api.shipping.example")
            .header("x-api-key", if i % 2 == 0 { "key-a" } else { "key-b" })
    })
    .await;
    let a = arrivals_between(
        &mock,
        Duration::from_secs(1),
        Duration::from_secs(5),
        Some("key-a"),
    ) as f64
        / 4.0;
    let b = arrivals_between(
        &mock,
        Duration::from_secs(1),
        Duration::from_secs(5),
        Some("key-b"),
    ) as f64
        / 4.0;
    println!(
        "e2e 4 per-key: {} requests, {} passed; steady rate key-a {a:.1}/s, key-b {b:.1}/s (each limited to 100/s)",
        outcomes.len(),
        count(&outcomes, 200)
    );
    assert!((a - 100.0).abs() <= 3.0, "key-a at {a}/s");
    assert!((b - 100.0).abs() <= 3.0, "key-b at {b}/s");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2e_5_shadow_counts_what_enforce_refuses() -> anyhow::Result<()> {
    let limits = r#""rate": {"requests": 100, "period": "1s", "burst": 10}"#;
    let (mock, envoy) = setup(&format!(
        r#"{{"name": "twin-shadow", "match": {{"host": "shadow.example"}}, {limits}, "mode": "shadow"}},
           {{"name": "twin-enforce", "match": {{"host": "enforce.example"}}, {limits}}}"#
    ))
    .await?;
    // The same paced load on both: 250 requests/s each for 4 s.
    let http = load::client();
    let origin = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..1000u64 {
        for host in ["shadow.example", "enforce.example"] {
            let request = http.get(envoy.url("/")).header("host", host);
            tasks.push((host, tokio::spawn(load::send(request, origin))));
        }
        let next = origin + Duration::from_millis(4 * (i + 1));
        tokio::time::sleep_until(next.into()).await;
    }
    let mut results = Vec::new();
    for (host, t) in tasks {
        results.push((host, t.await?));
    }
    settle().await;
    let shadow: Vec<&Outcome> = results
        .iter()
        .filter(|(h, _)| *h == "shadow.example")
        .map(|(_, o)| o)
        .collect();
    let enforce: Vec<&Outcome> = results
        .iter()
        .filter(|(h, _)| *h == "enforce.example")
        .map(|(_, o)| o)
        .collect();
    let shadow_refused = shadow.iter().filter(|o| o.status != 200).count();
    let enforce_refused = enforce.iter().filter(|o| o.status == 429).count();
    let shadow_limited = envoy.policy_stat("shadow_limited", "twin-shadow")?;
    let enforce_rejected = envoy.policy_stat("rejected", "twin-enforce")?;
    let reached = mock
        .arrivals()
        .iter()
        .filter(|a| a.host.as_deref() == Some("shadow.example"))
        .count();
    println!(
        "e2e 5 shadow: shadow policy refused {shadow_refused} of {} and counted {shadow_limited} as limited; \
         enforce twin refused {enforce_refused} (stat {enforce_rejected}); mock saw {reached} shadow requests",
        shadow.len()
    );
    assert_eq!(shadow_refused, 0);
    assert_eq!(reached, shadow.len());
    assert_eq!(enforce_rejected, enforce_refused as f64);
    let diff = (shadow_limited - enforce_rejected).abs();
    assert!(
        diff <= (enforce_rejected * 0.03).max(10.0),
        "shadow {shadow_limited} vs enforce {enforce_rejected}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2e_6_aborted_clients_leak_no_slot() -> anyhow::Result<()> {
    let (mock, envoy) = setup(
        r#"{"name": "aborts", "match": {"host": "*"}, "concurrency": {"max_in_flight": 20},
            "on_limit": {"action": "queue", "max_wait": "200ms"}}"#,
    )
    .await?;
    const TOTAL: usize = 10_000;
    let sent = Arc::new(AtomicUsize::new(0));
    let url = envoy.url("/slow");
    let mut tasks = Vec::new();
    let origin = Instant::now();
    for _ in 0..64 {
        let sent = sent.clone();
        let url = url.clone();
        let http = load::client();
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            loop {
                let n = sent.fetch_add(1, Ordering::SeqCst);
                if n >= TOTAL {
                    break;
                }
                let mut request = http
                    .get(&url)
                    .header("host", "api.slow.example")
                    .header("x-mock-delay-ms", "10");
                // 30 % of requests are given up mid-request: while queued or
                // while the upstream is still answering.
                if n % 10 < 3 {
                    request = request.timeout(Duration::from_millis(5));
                }
                out.push(load::send(request, origin).await);
            }
            out
        }));
    }
    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.extend(t.await?);
    }
    let elapsed = origin.elapsed();
    settle().await;
    let in_flight = envoy.gauge("aborts", "in_flight")?;
    let mock_in_flight = mock.in_flight();
    // A fresh burst gets the full capacity back.
    let http = load::client();
    let burst_origin = Instant::now();
    let burst: Vec<_> = (0..25)
        .map(|_| {
            let r = http
                .get(envoy.url("/slow"))
                .header("host", "api.slow.example")
                .header("x-mock-delay-ms", "500");
            tokio::spawn(load::send(r, burst_origin))
        })
        .collect();
    let mut burst_outcomes = Vec::new();
    for t in burst {
        burst_outcomes.push(t.await?);
    }
    println!(
        "e2e 6 aborts: {} requests in {elapsed:?}: {} passed, {} got 429, {} aborted by the client; \
         afterwards in flight: {in_flight} (Envoy), {mock_in_flight} (mock); next burst of 25: {} passed, {} got 429",
        outcomes.len(),
        count(&outcomes, 200),
        count(&outcomes, 429),
        count(&outcomes, 0),
        count(&burst_outcomes, 200),
        count(&burst_outcomes, 429),
    );
    assert_eq!(outcomes.len(), TOTAL);
    assert!(
        count(&outcomes, 0) >= TOTAL / 10,
        "too few aborts to mean anything"
    );
    assert_eq!(in_flight, 0.0);
    assert_eq!(
        count(&burst_outcomes, 200),
        20,
        "the whole capacity is back"
    );
    assert_eq!(count(&burst_outcomes, 429), 5);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2e_7_prometheus_stats_match_the_mock() -> anyhow::Result<()> {
    let (mock, envoy) = setup(
        r#"{"name": "counted", "match": {"host": "*"}, "rate": {"requests": 100, "period": "1s", "burst": 10},
            "concurrency": {"max_in_flight": 5}}"#,
    )
    .await?;
    let url = envoy.url("/");
    let outcomes = closed_loop(20, Duration::from_secs(3), move |c, _| {
        c.get(&url)
            .header("host", "api.example")
            .header("x-mock-delay-ms", "5")
    })
    .await;
    settle().await;
    let admitted = envoy.policy_stat("admitted", "counted")?;
    let rejected = envoy.policy_stat("rejected", "counted")?;
    let in_flight = envoy.gauge("counted", "in_flight")?;
    let retries = envoy.filter_stat("cas_retries")?;
    let exhausted = envoy.filter_stat("cas_exhausted")?;
    let seen = mock.arrivals().len();
    println!(
        "e2e 7 stats: admitted {admitted} (mock saw {seen}), rejected {rejected} (clients saw {} 429s), \
         in flight {in_flight}, CAS retries {retries} ({:.2} per 1000 requests), CAS exhausted {exhausted}",
        count(&outcomes, 429),
        retries * 1000.0 / outcomes.len().max(1) as f64,
    );
    assert_eq!(admitted, seen as f64);
    assert_eq!(rejected, count(&outcomes, 429) as f64);
    assert_eq!(in_flight, 0.0);
    assert_eq!(
        count(&outcomes, 200) + count(&outcomes, 429),
        outcomes.len()
    );
    Ok(())
}

/// A queued call must hold every limit of its policy when it is released,
/// not only the one it waited for. A provider that allows 20 calls per
/// calendar second and 5 in flight, a policy just under it (18/s, burst
/// 1, 5 in flight, queued), 50 clients with calls of 50-450 ms: the
/// concurrency limit holds waiters back while their rate turns pass, and
/// when slots come back they must still leave at the rate (issue 16: the
/// provider saw 25-29 calls in one second and refused 8-19 of 400).
///
/// Not exactly 20/s: the filter admits at most 20 in any second, but the
/// provider counts arrivals, and a busy machine delays some calls on
/// their way more than others, so 21 can land in one calendar second (a
/// clean run, 2b92557, saw it once). Two calls of headroom absorb 100 ms
/// of uneven delivery, as a user's margin under a provider's limit does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2e_8_queued_calls_hold_rate_and_concurrency_when_released() -> anyhow::Result<()> {
    let provider = MockLimits {
        max_per_second: 20,
        max_in_flight: 5,
    };
    let mock = MockApi::start("127.0.0.1:0".parse()?, provider).await?;
    let envoy = Envoy::start(
        &config(
            r#"{"name": "llm", "match": {"host": "api.llm.example"},
                "rate": {"requests": 18, "period": "1s", "burst": 1},
                "concurrency": {"max_in_flight": 5},
                "on_limit": {"action": "queue", "max_wait": "20s"}}"#,
        ),
        mock.addr.port(),
        WORKERS,
    )?;
    mock.reset();
    const CLIENTS: u64 = 50;
    const CALLS_EACH: u64 = 4;
    let url = envoy.url("/v1/chat");
    let origin = Instant::now();
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|client| {
            let url = url.clone();
            tokio::spawn(async move {
                let http = load::client();
                let mut out = Vec::new();
                for call in 0..CALLS_EACH {
                    // 50-450 ms, 250 ms on average: 5 slots carry 20/s
                    // only just, so the slots and the rate take turns
                    // holding calls back.
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
    let per_second = load::per_calendar_second(&mock.arrivals());
    let busiest = per_second.iter().copied().max().unwrap_or(0);
    let (ok, limited) = (count(&outcomes, 200), count(&outcomes, 429));
    // The first and last calendar seconds are only partly in the run.
    let full_seconds = per_second
        .get(1..per_second.len().saturating_sub(1))
        .unwrap_or_default();
    let mean = full_seconds.iter().sum::<usize>() as f64 / full_seconds.len().max(1) as f64;
    println!(
        "e2e 8 rate + concurrency, queued: {} calls in {took:.1?}: {ok} × 200, {limited} × 429; \
         the provider saw per calendar second {per_second:?} (most {busiest}, limit 20; \
         {mean:.1}/s over its full seconds, policy 18/s), at most {} in flight (limit 5), and refused {}",
        outcomes.len(),
        mock.max_in_flight(),
        mock.rejected_by_mock(),
    );
    assert_eq!(mock.rejected_by_mock(), 0, "the provider refused calls");
    assert!(busiest <= 20, "{busiest} calls in one second");
    assert!(mock.max_in_flight() <= 5);
    assert_eq!(
        ok,
        (CLIENTS * CALLS_EACH) as usize,
        "every call got through"
    );
    // 5 slots of 250 ms calls carry 20/s at most, the rate 18/s: most of
    // it is used, the queue never stalls.
    assert!(mean >= 12.0, "only {mean:.1}/s used");
    Ok(())
}
