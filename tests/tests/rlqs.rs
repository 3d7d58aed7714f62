//! Envoy's own `rate_limit_quota` filter (RLQS) through real Envoys.
//!
//! The gate: a stock Envoy (no Sluice filter) in front of an upstream, its
//! filter pointed at a minimal RLQS server (`sluice_e2e::rlqs`): Envoy
//! reports a bucket's usage, the server assigns it a token bucket, Envoy
//! refuses past it on its own, and a new assignment pushed on the stream
//! changes the rate.
//!
//! Then the Sluice admin as the RLQS server: stock Envoys and an Envoy
//! with the Sluice filter share one global limit from one ledger.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice_demo::mock::MockApi;
use sluice_e2e::admin::AdminProcess;
use sluice_e2e::envoy::Envoy;
use sluice_e2e::fleet::{self, GLOBAL_RPS, LEASE, PROVIDER_RPS, WORKERS};
use sluice_e2e::load::{self, client};
use sluice_e2e::rlqs::{stock_envoy, RlqsServer};

/// The listener's filters: every call with an `:authority` falls in the
/// bucket `{"policy": "stripe"}`; the RLQS server is `{{ADMIN_API_PORT}}`
/// (HTTP/2), the upstream `{{MOCK_PORT}}`.
const TEMPLATE: &str = r#"admin:
  address: { socket_address: { address: 127.0.0.1, port_value: {{ADMIN_PORT}} } }
static_resources:
  listeners:
  - name: egress
    address: { socket_address: { address: 127.0.0.1, port_value: {{LISTENER_PORT}} } }
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: egress
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes: [{ match: { prefix: "/" }, route: { cluster: upstream } }]
          http_filters:
          - name: envoy.filters.http.rate_limit_quota
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaFilterConfig
              rlqs_server: { envoy_grpc: { cluster_name: rlqs } }
              domain: sluice
              bucket_matchers:
                matcher_list:
                  matchers:
                  - predicate:
                      single_predicate:
                        input:
                          name: authority
                          typed_config:
                            "@type": type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput
                            header_name: ":authority"
                        value_match: { safe_regex: { google_re2: {}, regex: ".+" } }
                    on_match:
                      action:
                        name: rate_limit_quota
                        typed_config:
                          "@type": type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaBucketSettings
                          bucket_id_builder:
                            bucket_id_builder:
                              policy: { string_value: stripe }
                          reporting_interval: 1s
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: upstream
    type: STATIC
    load_assignment:
      cluster_name: upstream
      endpoints: [{ lb_endpoints: [{ endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: {{MOCK_PORT}} } } } }] }]
  - name: rlqs
    type: STATIC
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: { http2_protocol_options: {} }
    load_assignment:
      cluster_name: rlqs
      endpoints: [{ lb_endpoints: [{ endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: {{ADMIN_API_PORT}} } } } }] }]
"#;

/// Sends `n` calls one after another: (admitted, refused with 429, how
/// long they took).
async fn burst(http: &reqwest::Client, url: &str, n: u32) -> anyhow::Result<(u32, u32, Duration)> {
    let started = Instant::now();
    let (mut admitted, mut refused) = (0, 0);
    for _ in 0..n {
        match http.get(url).send().await?.status().as_u16() {
            200 => admitted += 1,
            429 => refused += 1,
            other => anyhow::bail!("status {other}"),
        }
    }
    Ok((admitted, refused, started.elapsed()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoys_rate_limit_quota_filter_enforces_what_an_rlqs_server_assigns() -> anyhow::Result<()>
{
    let upstream = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let upstream_port = upstream.local_addr()?.port();
    tokio::spawn(async move {
        let app = axum::Router::new().fallback(|| async { "ok" });
        let _ = axum::serve(upstream, app).await;
    });
    let rlqs = RlqsServer::start(2).await?;
    let envoy = Envoy::start_from(TEMPLATE, "", upstream_port, rlqs.addr.port(), 1)?;
    let (http, url) = (client(), envoy.url("/"));

    // The first call opens the stream and reports the bucket; until the
    // assignment comes, Envoy lets calls through (its default).
    let deadline = Instant::now() + Duration::from_secs(10);
    while rlqs.sent() == 0 {
        anyhow::ensure!(Instant::now() < deadline, "no report: {}", envoy.log());
        let _ = http.get(&url).send().await?;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Envoy applies the assignment once it reads it: bursts until one is
    // refused past the bucket.
    let deadline = Instant::now() + Duration::from_secs(10);
    while burst(&http, &url, 20).await?.1 == 0 {
        anyhow::ensure!(Instant::now() < deadline, "never refused: {}", envoy.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // 2 a second: the bucket spent, a burst of 20 gets what refills while
    // it runs (and a token of slack), the rest refused by Envoy itself.
    let (admitted, refused, took) = burst(&http, &url, 20).await?;
    let most = 2 * (took.as_secs() as u32 + 1) + 1;
    println!("rlqs: at 2/s, {admitted} admitted, {refused} refused in {took:?}");
    assert!(
        refused > 0 && admitted <= most,
        "{admitted} admitted, at most {most}"
    );

    // A new assignment pushed on the stream: 1000 a second.
    rlqs.assign(1000).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    let took = loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let (admitted, _, took) = burst(&http, &url, 20).await?;
        if admitted == 20 {
            break took;
        }
        anyhow::ensure!(Instant::now() < deadline, "still limited: {admitted} of 20");
    };
    println!("rlqs: at 1000/s, 20 of 20 admitted in {took:?}");

    // Envoy reported what it let through and what it refused.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let reports = rlqs.reports();
        if let Some(report) = reports.iter().find(|r| r.denied > 0) {
            assert_eq!(
                report.bucket.get("policy").map(String::as_str),
                Some("stripe")
            );
            println!("rlqs: reports {reports:?}");
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "no refusal reported: {reports:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

/// Offered calls a second: `a` runs the Sluice filter, `b` and `c` are
/// stock Envoys through RLQS. Together more than the global limit, and
/// still more than it once `c` is killed.
const OFFERED: [(&str, u64); 3] = [("a", 200), ("b", 200), ("c", 60)];

/// Two stock Envoys (Envoy's `rate_limit_quota` filter, the shipped
/// `envoy/stock-rlqs.yaml`) and one Envoy with the Sluice filter share the
/// global limit of 290 calls a second (`fleet::global_policy`) in front of
/// a provider that refuses past 300: one ledger in the admin (over its TLS
/// listener, the sync token as the stream's bearer) leases all three.
/// The limit is used, the provider never refuses, and when the stock
/// Envoy `c` is SIGKILLed its share goes to the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stock_envoys_through_rlqs_and_a_sluice_envoy_share_one_global_limit() -> anyhow::Result<()>
{
    let dir = tempfile::tempdir()?;
    let (admin, tls_port, tls_dir) = AdminProcess::start_tls_in(dir.path()).await?;
    let op = admin.login().await?;
    op.create(fleet::global_policy()).await?;
    let mock = MockApi::start("127.0.0.1:0".parse()?, fleet::provider()).await?;
    let ca = tls_dir.join("ca.pem");
    let a = Envoy::start_with_admin_tls(
        &fleet::plugin_config("a"),
        mock.addr.port(),
        tls_port,
        WORKERS,
        &ca,
    )?;
    let b = stock_envoy("b", mock.addr.port(), tls_port, &ca)?;
    let mut c = stock_envoy("c", mock.addr.port(), tls_port, &ca)?;

    let stop = Arc::new(AtomicBool::new(false));
    mock.reset();
    let origin = Instant::now();
    let load: Vec<_> = [&a, &b, &c]
        .iter()
        .zip(OFFERED)
        .map(|(envoy, (tag, rate))| {
            load::paced(
                envoy.url("/v1/complete"),
                "api.llm.example",
                tag,
                rate,
                stop.clone(),
            )
        })
        .collect();
    // RLQS clients report every 5 s (Envoy 1.40): their demand is known
    // from their second report on; the steady state after two.
    let (from, to) = (Duration::from_secs(12), Duration::from_secs(20));
    tokio::time::sleep(to).await;
    let used = fleet::rate_at_mock(&mock, &[], from, to);
    let per: Vec<f64> = ["a", "b", "c"]
        .iter()
        .map(|i| fleet::rate_at_mock(&mock, &[i], from, to))
        .collect();
    let view = op.get("/api/v1/fleet").await?;
    let members = fleet::shares(&op).await?;
    let clients: Vec<String> = view["rlqs"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|c| c["instance"].as_str().unwrap_or_default().to_string())
        .collect();
    println!(
        "rlqs fleet: offered a (Sluice) 200/s, b and c (stock, RLQS) 200/s and 60/s; global limit {GLOBAL_RPS}/s, \
         provider {PROVIDER_RPS}/s; steady ({from:?}..{to:?}) the provider saw {used:.1}/s ({:.1} %): \
         a {:.1}/s, b {:.1}/s, c {:.1}/s; shares {members:?}; RLQS clients {clients:?}",
        100.0 * used / GLOBAL_RPS,
        per[0],
        per[1],
        per[2],
    );
    if std::env::var_os("RLQS_TRACE").is_some() {
        let log = std::fs::read_to_string(&admin.log_path)?;
        for line in log
            .lines()
            .filter(|l| l.contains("RLQS") || l.contains("rlqs"))
        {
            println!("{line}");
        }
    }
    anyhow::ensure!(
        clients == ["rlqs:b", "rlqs:c"],
        "the Fleet view lists the RLQS clients: {view}"
    );
    assert!(
        per[1] > 50.0 && per[2] > 30.0,
        "the stock Envoys' calls went through on their shares: {per:?}"
    );

    // c dies: its kernel closes the stream, and its share moves to a and b.
    let killed_at = Instant::now();
    let killed_on_mock = origin.elapsed();
    c.kill();
    let moved = fleet::share_moved(&op, 2, killed_at).await?;
    tokio::time::sleep(Duration::from_secs(4)).await;
    let after_from = killed_on_mock + moved + Duration::from_secs(1);
    let used_after = fleet::rate_at_mock(&mock, &[], after_from, origin.elapsed());
    let calls = fleet::finish(&stop, load).await;
    let refused = mock.rejected_by_mock();
    println!(
        "rlqs fleet kill: c SIGKILLed; its share moved to a and b after {moved:?} (lease {LEASE:?}); then the \
         provider saw {used_after:.1}/s ({:.1} %); {calls} calls in all; most in any 1 s at the provider {}; \
         refused by the provider {refused}",
        100.0 * used_after / GLOBAL_RPS,
        fleet::most_in_any_second(&mock),
    );
    assert!(
        used >= 0.95 * GLOBAL_RPS,
        "steady use {used:.1}/s of {GLOBAL_RPS}/s"
    );
    assert!(moved <= LEASE * 2, "moved after {moved:?}");
    assert!(
        used_after >= 0.9 * GLOBAL_RPS,
        "after the kill {used_after:.1}/s"
    );
    assert_eq!(refused, 0, "the provider's limit was exceeded");
    drop((a, b));
    Ok(())
}
