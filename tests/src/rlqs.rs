//! A minimal server of Envoy's Rate Limit Quota Service (RLQS,
//! `envoy.service.rate_limit_quota.v3`), for the gate of issue 53: does a
//! stock Envoy's `rate_limit_quota` filter report, take an assignment and
//! enforce it? It assigns every bucket it hears of one token bucket (so
//! many calls a second), answers each report with it, and pushes a new
//! one to every stream when told ([`RlqsServer::assign`]). Types and
//! service from `envoy-types` (prost and tonic, from crates.io).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use envoy_types::pb::envoy::r#type::v3::{rate_limit_strategy, RateLimitStrategy, TokenBucket};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    self, QuotaAssignmentAction,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::{
    RateLimitQuotaService, RateLimitQuotaServiceServer,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::google::protobuf::{Duration, UInt32Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

/// One bucket's usage, as an Envoy reported it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    pub bucket: HashMap<String, String>,
    pub allowed: u64,
    pub denied: u64,
}

type Answers = mpsc::Sender<Result<RateLimitQuotaResponse, Status>>;

#[derive(Default)]
struct State {
    /// Calls a second each bucket is assigned.
    rate: AtomicU32,
    /// Assignments sent, on any stream.
    sent: AtomicU64,
    reports: Mutex<Vec<Report>>,
    /// Each open stream, and the buckets it reported.
    streams: Mutex<Vec<(Answers, Vec<BucketId>)>>,
}

impl State {
    fn answer(&self, buckets: &[BucketId]) -> RateLimitQuotaResponse {
        let rate = self.rate.load(Ordering::Relaxed);
        let action = bucket_action::BucketAction::QuotaAssignmentAction(QuotaAssignmentAction {
            assignment_time_to_live: Some(Duration {
                seconds: 60,
                nanos: 0,
            }),
            rate_limit_strategy: Some(RateLimitStrategy {
                strategy: Some(rate_limit_strategy::Strategy::TokenBucket(TokenBucket {
                    max_tokens: rate,
                    tokens_per_fill: Some(UInt32Value { value: rate }),
                    fill_interval: Some(Duration {
                        seconds: 1,
                        nanos: 0,
                    }),
                })),
            }),
        });
        RateLimitQuotaResponse {
            bucket_action: buckets
                .iter()
                .map(|bucket| BucketAction {
                    bucket_id: Some(bucket.clone()),
                    bucket_action: Some(action),
                })
                .collect(),
        }
    }

    fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
        mutex
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

struct Service(Arc<State>);

#[tonic::async_trait]
impl RateLimitQuotaService for Service {
    type StreamRateLimitQuotasStream =
        Pin<Box<dyn Stream<Item = Result<RateLimitQuotaResponse, Status>> + Send>>;

    async fn stream_rate_limit_quotas(
        &self,
        request: Request<Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<Response<Self::StreamRateLimitQuotasStream>, Status> {
        let mut reports = request.into_inner();
        let (tx, rx) = mpsc::channel(16);
        let state = Arc::clone(&self.0);
        let at = {
            let mut streams = State::lock(&state.streams);
            streams.push((tx.clone(), Vec::new()));
            streams.len() - 1
        };
        tokio::spawn(async move {
            while let Some(Ok(report)) = reports.next().await {
                let buckets: Vec<BucketId> = report
                    .bucket_quota_usages
                    .iter()
                    .filter_map(|usage| usage.bucket_id.clone())
                    .collect();
                State::lock(&state.reports).extend(report.bucket_quota_usages.iter().map(|u| {
                    Report {
                        bucket: u.bucket_id.clone().map(|b| b.bucket).unwrap_or_default(),
                        allowed: u.num_requests_allowed,
                        denied: u.num_requests_denied,
                    }
                }));
                if let Some((_, known)) = State::lock(&state.streams).get_mut(at) {
                    for bucket in &buckets {
                        if !known.contains(bucket) {
                            known.push(bucket.clone());
                        }
                    }
                }
                if tx.send(Ok(state.answer(&buckets))).await.is_err() {
                    break;
                }
                state.sent.fetch_add(1, Ordering::Relaxed);
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// The server, on a port of 127.0.0.1; stopped when dropped.
pub struct RlqsServer {
    pub addr: SocketAddr,
    state: Arc<State>,
    task: tokio::task::JoinHandle<()>,
}

impl RlqsServer {
    /// Serves over HTTP/2 without TLS, assigning `rate` calls a second.
    pub async fn start(rate: u32) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(State::default());
        state.rate.store(rate, Ordering::Relaxed);
        let service = RateLimitQuotaServiceServer::new(Service(Arc::clone(&state)));
        let task = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(TcpListenerStream::new(listener))
                .await;
        });
        Ok(Self { addr, state, task })
    }

    /// Assigns `rate` calls a second from now on, pushed at once to every
    /// stream for every bucket it reported.
    pub async fn assign(&self, rate: u32) {
        self.state.rate.store(rate, Ordering::Relaxed);
        let streams: Vec<(Answers, Vec<BucketId>)> = State::lock(&self.state.streams).clone();
        for (answers, buckets) in streams {
            if answers.send(Ok(self.state.answer(&buckets))).await.is_ok() {
                self.state.sent.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Assignments sent so far.
    pub fn sent(&self) -> u64 {
        self.state.sent.load(Ordering::Relaxed)
    }

    /// Every bucket's usage reported so far, in order.
    pub fn reports(&self) -> Vec<Report> {
        State::lock(&self.state.reports).clone()
    }
}

impl Drop for RlqsServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `envoy/stock-rlqs.yaml` as the harness runs it: a stock Envoy named
/// `name` (`x-sluice-instance`) whose `rate_limit_quota` filter streams to
/// the Sluice admin's TLS listener on `admin_tls_port` (its certificate
/// `ca`) with the sync token, in front of the upstream on `mock_port`.
pub fn stock_envoy(
    name: &str,
    mock_port: u16,
    admin_tls_port: u16,
    ca: &std::path::Path,
) -> anyhow::Result<crate::envoy::Envoy> {
    let shipped =
        std::fs::read_to_string(crate::envoy::workspace_root().join("envoy/stock-rlqs.yaml"))?;
    let named = "- { key: x-sluice-instance, value: stock-envoy }";
    anyhow::ensure!(
        shipped.contains(named) && shipped.contains("\"var/tls/ca.pem\""),
        "stock-rlqs.yaml changed shape"
    );
    let mut template = shipped
        .replace(
            named,
            &format!(
                "- {{ key: x-sluice-instance, value: {name} }}\n                - {{ key: authorization, value: \"Bearer {}\" }}",
                crate::admin::SYNC_TOKEN
            ),
        )
        .replace("\"var/tls/ca.pem\"", &format!("\"{}\"", ca.display()));
    for (port, placeholder) in [
        (9902, "ADMIN_PORT"),
        (10001, "LISTENER_PORT"),
        (9090, "MOCK_PORT"),
        (8443, "ADMIN_API_PORT"),
    ] {
        let fixed = format!("port_value: {port} ");
        anyhow::ensure!(template.contains(&fixed), "stock-rlqs.yaml: no port {port}");
        template = template.replace(&fixed, &format!("port_value: {{{{{placeholder}}}}} "));
    }
    crate::envoy::Envoy::start_from(&template, "", mock_port, admin_tls_port, 1)
}

/// A client of the admin's RLQS service on `port` (plain HTTP/2), named
/// `name`, that reports one call in each of `buckets` once; the stream
/// stays open while the returned halves live.
pub async fn report_once(
    port: u16,
    name: &str,
    buckets: &[&[(&str, &str)]],
) -> anyhow::Result<(
    mpsc::Sender<RateLimitQuotaUsageReports>,
    Streaming<RateLimitQuotaResponse>,
)> {
    use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
    use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
    let mut client =
        RateLimitQuotaServiceClient::connect(format!("http://127.0.0.1:{port}")).await?;
    let (reports, rx) = mpsc::channel(4);
    let mut request = Request::new(ReceiverStream::new(rx));
    request.metadata_mut().insert(
        "authorization",
        format!("Bearer {}", crate::admin::SYNC_TOKEN).parse()?,
    );
    request
        .metadata_mut()
        .insert("x-sluice-instance", name.parse()?);
    let answers = client.stream_rate_limit_quotas(request).await?.into_inner();
    let usages = buckets
        .iter()
        .map(|pairs| BucketQuotaUsage {
            bucket_id: Some(BucketId {
                bucket: pairs
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            }),
            time_elapsed: None,
            num_requests_allowed: 1,
            num_requests_denied: 0,
        })
        .collect();
    reports
        .send(RateLimitQuotaUsageReports {
            domain: "ui-test".into(),
            bucket_quota_usages: usages,
        })
        .await?;
    Ok((reports, answers))
}
