//! Load for the end-to-end tests: many concurrent clients on loopback,
//! bounded in time, each result recorded with its status and headers.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::header::HeaderMap;
use sluice_demo::mock::{sent_stamp, Arrival, SENT_HEADER};

#[derive(Debug, Clone)]
pub struct Outcome {
    /// 0 when the request failed or was aborted by the client.
    pub status: u16,
    pub started: Duration,
    pub latency: Duration,
    pub headers: HeaderMap,
}

impl Outcome {
    /// The answer's header `name`, if it is there and readable as text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap_or_else(|_| reqwest::Client::new())
}

/// How long a greedy caller waits after a refusal (429) before it tries
/// again, as a client that honours a refusal does. The callers still ask
/// far more than any limit the suites set (24 callers: 2 400 tries a
/// second), but they no longer spin on Sluice's sub-millisecond refusals:
/// spinning took 10 000 calls a second and both cores, which the
/// suites' claims do not need and the tests beside them paid for.
pub const PAUSE_AFTER_REFUSAL: Duration = Duration::from_millis(10);

/// `clients` tasks each send requests back to back for `duration`, each
/// pausing `PAUSE_AFTER_REFUSAL` after a 429; `build(client_index)` makes
/// each request.
pub async fn closed_loop<F>(clients: usize, duration: Duration, build: F) -> Vec<Outcome>
where
    F: Fn(&reqwest::Client, usize) -> reqwest::RequestBuilder + Send + Sync + 'static,
{
    closed_loop_while(clients, move |ran| ran < duration, build).await
}

/// [`closed_loop`] until `stop` is set: for a test that reads what the
/// load does while it runs, however long its own steps take.
pub async fn closed_loop_until<F>(clients: usize, stop: Arc<AtomicBool>, build: F) -> Vec<Outcome>
where
    F: Fn(&reqwest::Client, usize) -> reqwest::RequestBuilder + Send + Sync + 'static,
{
    closed_loop_while(clients, move |_| !stop.load(Ordering::SeqCst), build).await
}

/// Each client sends while `going(time since the load began)` says so.
async fn closed_loop_while<G, F>(clients: usize, going: G, build: F) -> Vec<Outcome>
where
    G: Fn(Duration) -> bool + Send + Sync + 'static,
    F: Fn(&reqwest::Client, usize) -> reqwest::RequestBuilder + Send + Sync + 'static,
{
    let (going, build) = (Arc::new(going), Arc::new(build));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..clients {
        let (going, build) = (going.clone(), build.clone());
        let http = client();
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            while going(start.elapsed()) {
                let outcome = send(build(&http, i), start).await;
                if outcome.status == 429 {
                    tokio::time::sleep(PAUSE_AFTER_REFUSAL).await;
                }
                out.push(outcome);
            }
            out
        }));
    }
    join_all(tasks).await.into_iter().flatten().collect()
}

/// What each task returned, skipping tasks that panicked.
async fn join_all<T>(tasks: Vec<tokio::task::JoinHandle<T>>) -> Vec<T> {
    let mut out = Vec::with_capacity(tasks.len());
    for t in tasks {
        if let Ok(v) = t.await {
            out.push(v);
        }
    }
    out
}

/// Closed-loop load on `host` until `stop` is set, timed from `origin`; a
/// failed connection (Envoy restarting) waits 20 ms before the next try
/// rather than spin.
pub async fn until_stopped(
    url: String,
    host: &'static str,
    clients: usize,
    origin: Instant,
    stop: Arc<AtomicBool>,
) -> Vec<Outcome> {
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let (url, stop) = (url.clone(), stop.clone());
            tokio::spawn(async move {
                let http = client();
                let mut out = Vec::new();
                while !stop.load(Ordering::SeqCst) {
                    let o = send(http.get(&url).header("host", host), origin).await;
                    if o.status == 0 {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    out.push(o);
                }
                out
            })
        })
        .collect();
    join_all(tasks).await.into_iter().flatten().collect()
}

/// Sends `request` stamped with when it left ([`SENT_HEADER`]), so the
/// mock knows the span in which the limiter let it through
/// ([`most_surely_within`]).
pub async fn send(request: reqwest::RequestBuilder, origin: Instant) -> Outcome {
    let started = origin.elapsed();
    let t = Instant::now();
    match request.header(SENT_HEADER, sent_stamp()).send().await {
        Ok(resp) => {
            let status = resp.status().as_u16();
            let headers = resp.headers().clone();
            let _ = resp.bytes().await;
            Outcome {
                status,
                started,
                latency: t.elapsed(),
                headers,
            }
        }
        Err(_) => Outcome {
            status: 0,
            started,
            latency: t.elapsed(),
            headers: HeaderMap::new(),
        },
    }
}

pub fn count(outcomes: &[Outcome], status: u16) -> usize {
    outcomes.iter().filter(|o| o.status == status).count()
}

/// What a provider that counts calendar seconds of its own clock saw: its
/// calls in each wall-clock second from the first call's to the last's.
/// (The seconds since the mock's reset are not the provider's: a limit of
/// 20 per calendar second can be broken in a wall-clock second that no
/// relative second holds whole.)
pub fn per_calendar_second(arrivals: &[Arrival]) -> Vec<usize> {
    let (Some(first), Some(last)) = (
        arrivals.iter().map(|a| a.second).min(),
        arrivals.iter().map(|a| a.second).max(),
    ) else {
        return Vec::new();
    };
    let mut counts = vec![0; (last - first + 1) as usize];
    for a in arrivals {
        counts[(a.second - first) as usize] += 1;
    }
    counts
}

/// The most events in any window of `window` over sorted instants.
pub fn max_in_window(sorted: &[Duration], window: Duration) -> usize {
    busiest_window(sorted, window).0
}

/// The most of `sorted` in any `window`, and when the first such window
/// began.
pub fn busiest_window(sorted: &[Duration], window: Duration) -> (usize, Duration) {
    let mut best = (0, Duration::ZERO);
    let mut lo = 0;
    for hi in 0..sorted.len() {
        while sorted[hi] - sorted[lo] >= window {
            lo += 1;
        }
        if hi - lo + 1 > best.0 {
            best = (hi - lo + 1, sorted[lo]);
        }
    }
    best
}

/// The most calls the limiter surely let through within any `window`, and
/// when the first such window began: the calls both sent and arrived
/// inside it. Each call passed the limiter somewhere between its caller's
/// stamp and its arrival at the mock, so a limit of N per `window` holds
/// this to N however long a loaded machine makes the trip. A count of
/// arrivals alone ([`max_in_window`]) also counts what a stall bunched up
/// on the way. A call with no stamp counts from its arrival.
pub fn most_surely_within(arrivals: &[Arrival], window: Duration) -> (usize, Duration) {
    let mut spans: Vec<(Duration, Duration)> = arrivals.iter().map(|a| (sent(a), a.at)).collect();
    spans.sort_unstable();
    let mut best = (0, Duration::ZERO);
    // A window holding some calls whole can slide forward to the earliest
    // of their stamps and still hold them: only those starts need trying.
    for (i, &(from, _)) in spans.iter().enumerate() {
        if i > 0 && spans[i - 1].0 == from {
            continue;
        }
        let inside = spans[i..]
            .iter()
            .take_while(|&&(sent, _)| sent < from + window)
            .filter(|&&span| whole_within(span, from, window))
            .count();
        if inside > best.0 {
            best = (inside, from);
        }
    }
    best
}

/// When `call` was sent, or its arrival if it was not stamped.
pub fn sent(call: &Arrival) -> Duration {
    call.sent.map_or(call.at, |s| s.min(call.at))
}

/// The calls sent and arrived within `window` from `from`: those the
/// limiter surely let through in it.
pub fn surely_within(arrivals: &[Arrival], from: Duration, window: Duration) -> usize {
    arrivals
        .iter()
        .filter(|a| whole_within((sent(a), a.at), from, window))
        .count()
}

/// Whether a call's trip, `(sent, arrived)`, lies inside `window` from
/// `from`.
fn whole_within((sent, arrived): (Duration, Duration), from: Duration, window: Duration) -> bool {
    sent >= from && arrived < from + window
}

/// A burst of `n` requests to `url` for `host`, each on its own connection,
/// so they spread over Envoy's workers.
pub async fn burst(url: &str, host: &'static str, n: usize) -> Vec<Outcome> {
    let origin = Instant::now();
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let request = client().get(url).header("host", host);
            tokio::spawn(send(request, origin))
        })
        .collect();
    join_all(tasks).await
}

/// Polls `check` every 10 ms until it holds; how long that took, or an
/// error naming `what` after `limit`.
pub async fn wait_for(
    what: &str,
    limit: Duration,
    mut check: impl FnMut() -> bool,
) -> anyhow::Result<Duration> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if check() {
            return Ok(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    anyhow::bail!("{what}: not within {limit:?}")
}

/// A process just started answers `url` with a success within `limit`:
/// polled every 50 ms; an error says whether it exited first or never
/// answered.
pub async fn until_healthy(
    child: &mut std::process::Child,
    url: &str,
    limit: Duration,
) -> anyhow::Result<()> {
    let http = reqwest::Client::new();
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait()? {
            anyhow::bail!("exited ({status})");
        }
        if http
            .get(url)
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            return Ok(());
        }
        if start.elapsed() > limit {
            anyhow::bail!("{url} did not answer with a success within {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Paced LLM calls through several Envoys at once, until `stop`: the i-th
/// Envoy gets the i-th of `offered`, (tag, calls per second).
pub fn paced_through(
    envoys: &[crate::envoy::Envoy],
    offered: &[(&'static str, u64)],
    stop: &Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<Vec<Outcome>>> {
    envoys
        .iter()
        .zip(offered)
        .map(|(envoy, &(tag, rate))| {
            paced(
                envoy.url("/v1/complete"),
                "api.llm.example",
                tag,
                rate,
                stop.clone(),
            )
        })
        .collect()
}

/// Paced LLM calls through several Envoys, the heavy load moving: every
/// `period` the next Envoy in turn is offered `heavy` calls a second and
/// the others `light`, until `stop`. Tags are the ones given, in order.
pub fn moving_through(
    envoys: &[crate::envoy::Envoy],
    tags: &[&'static str],
    (heavy, light): (u64, u64),
    period: Duration,
    stop: &Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<Vec<Outcome>>> {
    let n = envoys.len().max(1) as u128;
    let origin = Instant::now();
    envoys
        .iter()
        .zip(tags)
        .enumerate()
        .map(|(i, (envoy, &tag))| {
            let rate = move |at: Duration| {
                let turn = (at.as_millis() / period.as_millis().max(1)) % n;
                if turn == i as u128 {
                    heavy
                } else {
                    light
                }
            };
            scheduled(
                envoy.url("/v1/complete"),
                "api.llm.example",
                tag,
                (origin, rate),
                stop.clone(),
            )
        })
        .collect()
}

/// Open-loop load whose rate follows `rate(time since origin)`.
fn scheduled(
    url: String,
    host: &'static str,
    tag: &'static str,
    (origin, rate): (Instant, impl Fn(Duration) -> u64 + Send + 'static),
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Vec<Outcome>> {
    tokio::spawn(async move {
        let http = client();
        let mut next = tokio::time::Instant::from_std(origin);
        let mut calls = Vec::new();
        while !stop.load(Ordering::SeqCst) {
            next += Duration::from_nanos(1_000_000_000 / rate(next.into_std() - origin).max(1));
            tokio::time::sleep_until(next).await;
            let request = http.get(&url).header("host", host).header("x-api-key", tag);
            calls.push(tokio::spawn(send(request, origin)));
        }
        let mut out = Vec::with_capacity(calls.len());
        for c in calls {
            if let Ok(o) = c.await {
                out.push(o);
            }
        }
        out
    })
}

/// Open-loop load: `per_second` calls to `url` for `host`, tagged with an
/// `x-api-key` of `tag` (the mock records it), until `stop`.
pub fn paced(
    url: String,
    host: &'static str,
    tag: &'static str,
    per_second: u64,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Vec<Outcome>> {
    scheduled(url, host, tag, (Instant::now(), move |_| per_second), stop)
}

/// A header of `response` as text (None: absent or not visible ASCII).
pub fn header_text(response: &reqwest::Response, name: &str) -> Option<String> {
    response
        .headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

/// The most a token bucket of `burst` refilling at `per_second` can admit
/// over the span these requests were in flight: its burst, what refilled
/// from the first send to the last answer, and one token for rounding.
pub fn admitted_at_most(outcomes: &[Outcome], burst: usize, per_second: f64) -> usize {
    let first = outcomes.iter().map(|o| o.started).min().unwrap_or_default();
    let last = outcomes
        .iter()
        .map(|o| o.started + o.latency)
        .max()
        .unwrap_or_default();
    burst + (last.saturating_sub(first).as_secs_f64() * per_second).floor() as usize + 1
}

/// The fewest a full bucket of `burst` admits from a burst that arrives at
/// once: a worker that prefetched tokens it does not spend within the
/// prefetch's life (`PREFETCH_TTL`) loses them (the book, "Prefetch"; a
/// loaded machine spreads "at once" over more than that). Worst case, each
/// admission that follows takes a prefetch of a PREFETCH_SLACK-th of what
/// is left, and each prefetch lapses.
pub fn burst_less_stranded_prefetches(burst: u64) -> usize {
    let (mut left, mut admitted) = (burst, 0);
    while left > 0 {
        left -= 1;
        admitted += 1;
        left -= left / sluice_filter_core::bucket::PREFETCH_SLACK;
    }
    admitted
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(sent_ms: u64, at_ms: u64) -> Arrival {
        Arrival {
            at: Duration::from_millis(at_ms),
            key: None,
            seq: None,
            host: None,
            queue_ticket: None,
            second: 0,
            sent: Some(Duration::from_millis(sent_ms)),
        }
    }

    #[test]
    fn calls_bunched_on_the_way_count_where_they_were_sent() {
        // One a millisecond for 10 ms, then a stall: the next 15, sent
        // 10-24 ms, all arrive at 30 ms.
        let mut calls: Vec<Arrival> = (0..10).map(|i| call(i, i)).collect();
        calls.extend((10..25).map(|i| call(i, 30)));
        let arrived: Vec<Duration> = calls.iter().map(|a| a.at).collect();
        let window = Duration::from_millis(10);
        assert_eq!(max_in_window(&arrived, window), 15);
        assert_eq!(most_surely_within(&calls, window), (10, Duration::ZERO));
        // Twenty-one sent and arrived within 10 ms are seen whole.
        calls.extend((0..21).map(|i| call(100 + i / 3, 101 + i / 3)));
        assert_eq!(
            most_surely_within(&calls, window),
            (21, Duration::from_millis(100))
        );
    }

    #[test]
    fn a_call_without_a_stamp_counts_from_its_arrival() {
        let mut unstamped = call(0, 9);
        unstamped.sent = None;
        let window = Duration::from_millis(5);
        assert_eq!(
            most_surely_within(&[unstamped], window),
            (1, Duration::from_millis(9))
        );
        assert_eq!(most_surely_within(&[], window), (0, Duration::ZERO));
    }
}
