//! The admin as a Rate Limit Quota Service (RLQS,
//! `envoy.service.rate_limit_quota.v3`): a stock Envoy's
//! `rate_limit_quota` filter opens one stream, reports its buckets' use,
//! and is assigned a token bucket per bucket from the same fleet ledgers
//! Sluice's Envoys sync with (`crate::fleet`). So Envoys with the Sluice
//! filter (wasm or native) and stock Envoys share one `scope: global`
//! limit. Served on the admin's own listener (`/envoy.service...`), with
//! its TLS, and the sync token as the stream's bearer.
//!
//! How buckets map onto limits is `buckets`; what one stream does over
//! its life (reports in, assignments out, pushed as the ledger moves,
//! freed when it closes) is `stream`; who is connected is [`Clients`].

pub mod buckets;
mod stream;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use axum::extract::ConnectInfo;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::{
    RateLimitQuotaService, RateLimitQuotaServiceServer,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use sluice_api::RlqsClient;
use tokio::sync::{mpsc, watch};
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

use crate::AppState;

/// The metadata a client may name itself by (Envoy's `grpc_service`
/// `initial_metadata`): a name that outlives its connection, so a
/// reconnecting Envoy is the same ledger member.
pub const INSTANCE_METADATA: &str = "x-sluice-instance";

/// Ledger members that are RLQS streams are named so: never the same as a
/// Sluice Envoy's instance.
pub const MEMBER_PREFIX: &str = "rlqs:";

/// The largest report a stream may send: 10 000 buckets of a short id
/// fit (and are bounded by `buckets::MAX_BUCKETS` after).
const MAX_REPORT_BYTES: usize = 1 << 20;

/// Answers queued for a stream that is slow to read; past them, an
/// answer waits for the next (each carries every assignment).
const ANSWERS_QUEUED: usize = 4;

/// The one call of the service: Envoy opens it once and keeps it.
pub const STREAM_PATH: &str =
    "/envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas";

/// The RLQS route, to merge into the admin's router.
pub fn routes(state: Arc<AppState>) -> axum::Router {
    let service = RateLimitQuotaServiceServer::new(QuotaService { state })
        .max_decoding_message_size(MAX_REPORT_BYTES);
    axum::Router::new().route_service(STREAM_PATH, service)
}

struct QuotaService {
    state: Arc<AppState>,
}

type Answers = mpsc::Sender<Result<RateLimitQuotaResponse, Status>>;

#[tonic::async_trait]
impl RateLimitQuotaService for QuotaService {
    type StreamRateLimitQuotasStream =
        Pin<Box<dyn Stream<Item = Result<RateLimitQuotaResponse, Status>> + Send>>;

    async fn stream_rate_limit_quotas(
        &self,
        request: Request<Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<Response<Self::StreamRateLimitQuotasStream>, Status> {
        let state = &self.state;
        if let Some(expected) = &state.config.sync_token {
            if !crate::auth::bears(&request.metadata().clone().into_headers(), expected) {
                state.metrics.result("unauthorized");
                return Err(Status::unauthenticated(
                    "the RLQS stream needs the sync token as `authorization: Bearer <token>` \
                     (the rate_limit_quota filter's grpc_service initial_metadata)",
                ));
            }
        }
        let peer = request
            .extensions()
            .get::<ConnectInfo<SocketAddr>>()
            .map(|c| c.0.to_string())
            .unwrap_or_default();
        let instance = member_name(&request, &peer)?;
        let registration = state.rlqs.register(&instance, &peer).ok_or_else(|| {
            Status::resource_exhausted(format!(
                "{} RLQS streams are open already",
                sluice_wire::sync::MAX_INSTANCES
            ))
        })?;
        let (answers, rx) = mpsc::channel(ANSWERS_QUEUED);
        tracing::info!(%instance, %peer, "an RLQS stream opened");
        tokio::spawn(stream::run(
            Arc::clone(state),
            registration,
            request.into_inner(),
            answers,
        ));
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}

/// The stream's member name: `rlqs:` and its `x-sluice-instance`, or its
/// address when it names none.
fn member_name<T>(request: &Request<T>, peer: &str) -> Result<String, Status> {
    let named = request.metadata().get(INSTANCE_METADATA);
    let name = match named {
        Some(value) => value
            .to_str()
            .map_err(|_| Status::invalid_argument(format!("{INSTANCE_METADATA}: not text")))?
            .to_string(),
        None if peer.is_empty() => "unnamed".to_string(),
        None => peer.to_string(),
    };
    let member = format!("{MEMBER_PREFIX}{name}");
    sluice_shared::instance::check_instance(&member)
        .map_err(|e| Status::invalid_argument(format!("{INSTANCE_METADATA}: {e}")))?;
    Ok(member)
}

/// The open RLQS streams, one per member name: a newer stream of the same
/// name ends the older (a reconnecting Envoy whose old connection has not
/// yet timed out).
#[derive(Default)]
pub struct Clients {
    open: Mutex<HashMap<String, Open>>,
    next_ticket: AtomicU64,
}

struct Open {
    ticket: u64,
    replaced: watch::Sender<bool>,
    view: RlqsClient,
}

impl Clients {
    fn register(self: &Arc<Self>, instance: &str, peer: &str) -> Option<Registration> {
        let ticket = self.next_ticket.fetch_add(1, Ordering::Relaxed);
        let (replaced_tx, replaced) = watch::channel(false);
        let mut open = lock(&self.open);
        if !open.contains_key(instance) && open.len() >= sluice_wire::sync::MAX_INSTANCES {
            return None;
        }
        let view = RlqsClient {
            instance: instance.to_string(),
            peer: peer.to_string(),
            connected_ms: crate::store::now_ms(),
            ..RlqsClient::default()
        };
        let entry = Open {
            ticket,
            replaced: replaced_tx,
            view,
        };
        if let Some(older) = open.insert(instance.to_string(), entry) {
            older.replaced.send_replace(true);
        }
        Some(Registration {
            clients: Arc::clone(self),
            instance: instance.to_string(),
            ticket,
            replaced,
        })
    }

    /// Every open stream, for the Fleet page.
    pub fn views(&self) -> Vec<RlqsClient> {
        let mut views: Vec<RlqsClient> =
            lock(&self.open).values().map(|o| o.view.clone()).collect();
        views.sort_by(|a, b| a.instance.cmp(&b.instance));
        views
    }

    /// Streams open now.
    pub fn open(&self) -> usize {
        lock(&self.open).len()
    }
}

/// A stream's place among the open ones; dropped, it frees the place
/// unless a newer stream of its name took it.
pub(crate) struct Registration {
    clients: Arc<Clients>,
    instance: String,
    ticket: u64,
    /// Turns true when a newer stream of the same name replaces this one.
    replaced: watch::Receiver<bool>,
}

impl Registration {
    fn show(&self, change: impl FnOnce(&mut RlqsClient)) {
        if let Some(open) = lock(&self.clients.open)
            .get_mut(&self.instance)
            .filter(|o| o.ticket == self.ticket)
        {
            change(&mut open.view);
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut open = lock(&self.clients.open);
        if open
            .get(&self.instance)
            .is_some_and(|o| o.ticket == self.ticket)
        {
            open.remove(&self.instance);
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
