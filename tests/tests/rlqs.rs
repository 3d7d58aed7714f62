//! Issue 53's gate: does the PyPI Envoy's own `rate_limit_quota` filter
//! (RLQS) work end to end? A stock Envoy (no Sluice filter) in front of
//! an upstream, its filter pointed at a minimal RLQS server
//! (`sluice_e2e::rlqs`): Envoy reports a bucket's usage, the server
//! assigns it a token bucket, Envoy refuses past it on its own, and a new
//! assignment pushed on the stream changes the rate.

use std::time::{Duration, Instant};

use sluice_e2e::envoy::Envoy;
use sluice_e2e::load::client;
use sluice_e2e::rlqs::RlqsServer;

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
