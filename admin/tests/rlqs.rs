//! The admin as an RLQS server, driven by a gRPC client over real HTTP/2
//! with a real SQLite store: the credential, the bucket mapping, and what
//! hostile or broken clients cost (10 000 buckets, counts at their
//! largest, a stream that never reads its answers). Stock Envoys through
//! it are `tests/tests/rlqs.rs`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::Strategy;
use sluice_admin::auth::Credentials;
use sluice_admin::rlqs::buckets::MAX_BUCKETS;
use sluice_admin::store::Store;
use sluice_admin::AppState;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::Streaming;

const SYNC_TOKEN: &str = "sync-secret-0123456789abcdef-0123456789";
/// The global limit the tests' clients share: 100 calls a second.
const LIMIT: f64 = 100.0;

struct Admin {
    addr: SocketAddr,
    state: Arc<AppState>,
    _dir: tempfile::TempDir,
}

/// An admin with the global policy `llm` (100/s and 10 in flight, leased
/// for 2 s) and the instance policy `local`.
async fn start() -> Admin {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("sluice.db");
    let store = Store::open(&db).unwrap();
    for policy in [
        r#"{"name": "llm", "match": {"host": "api.llm.example"}, "scope": "global",
            "share_lease": "2s", "rate": {"requests": 100, "period": "1s", "burst": 10},
            "concurrency": {"max_in_flight": 10}}"#,
        r#"{"name": "local", "match": {"host": "api.local.example"},
            "rate": {"requests": 5, "period": "1s"}}"#,
    ] {
        let policy = sluice_shared::parse_policy(policy).unwrap();
        store.blocking().create(policy, "admin").unwrap();
    }
    let state = Arc::new(AppState::new(
        store,
        Credentials::from_password("test-password-1").unwrap(),
        Some(SYNC_TOKEN.into()),
        false,
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(sluice_admin::serve(
        listener,
        Arc::clone(&state),
        None,
        std::future::pending(),
    ));
    Admin {
        addr,
        state,
        _dir: dir,
    }
}

fn bucket(pairs: &[(&str, &str)]) -> BucketId {
    BucketId {
        bucket: pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    }
}

fn report(buckets: Vec<BucketId>, allowed: u64, denied: u64) -> RateLimitQuotaUsageReports {
    RateLimitQuotaUsageReports {
        domain: "sluice".into(),
        bucket_quota_usages: buckets
            .into_iter()
            .map(|id| BucketQuotaUsage {
                bucket_id: Some(id),
                time_elapsed: None,
                num_requests_allowed: allowed,
                num_requests_denied: denied,
            })
            .collect(),
    }
}

/// A stream named `name` with `token` as its bearer: where to send
/// reports, and its answers (or why it was refused).
async fn open(
    admin: &Admin,
    name: &str,
    token: Option<&str>,
) -> Result<
    (
        mpsc::Sender<RateLimitQuotaUsageReports>,
        Streaming<RateLimitQuotaResponse>,
    ),
    tonic::Status,
> {
    let mut client = RateLimitQuotaServiceClient::connect(format!("http://{}", admin.addr))
        .await
        .unwrap();
    let (reports, rx) = mpsc::channel(16);
    let mut request = tonic::Request::new(ReceiverStream::new(rx));
    if let Some(token) = token {
        request
            .metadata_mut()
            .insert("authorization", format!("Bearer {token}").parse().unwrap());
    }
    request
        .metadata_mut()
        .insert("x-sluice-instance", name.parse().unwrap());
    let answers = client.stream_rate_limit_quotas(request).await?.into_inner();
    Ok((reports, answers))
}

async fn next(answers: &mut Streaming<RateLimitQuotaResponse>) -> RateLimitQuotaResponse {
    tokio::time::timeout(Duration::from_secs(5), answers.next())
        .await
        .expect("an answer within 5 s")
        .expect("the stream still open")
        .expect("an answer, not an error")
}

/// Each assigned bucket's id and calls a second.
fn rates(answer: &RateLimitQuotaResponse) -> Vec<(BucketId, f64)> {
    answer
        .bucket_action
        .iter()
        .map(|a| {
            let Some(Action::QuotaAssignmentAction(q)) = &a.bucket_action else {
                panic!("not an assignment: {a:?}")
            };
            let rate = match &q.rate_limit_strategy.as_ref().unwrap().strategy {
                Some(Strategy::TokenBucket(b)) => {
                    let fill = b.fill_interval.unwrap().seconds as f64;
                    f64::from(b.tokens_per_fill.unwrap().value) / fill
                }
                _ => 0.0,
            };
            (a.bucket_id.clone().unwrap(), rate)
        })
        .collect()
}

fn client_view(admin: &Admin, instance: &str) -> Option<sluice_api::RlqsClient> {
    admin
        .state
        .rlqs
        .views()
        .into_iter()
        .find(|c| c.instance == instance)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_without_the_sync_token_is_refused() {
    let admin = start().await;
    for token in [None, Some("not-the-token")] {
        let Err(refused) = open(&admin, "x", token).await else {
            panic!("opened with {token:?}");
        };
        assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
    }
    let bad_name = open(&admin, "no spaces", Some(SYNC_TOKEN)).await.err();
    assert_eq!(
        bad_name.map(|s| s.code()),
        Some(tonic::Code::InvalidArgument)
    );
    assert_eq!(admin.state.rlqs.open(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buckets_draw_on_the_global_ledger_and_those_that_cannot_are_named_with_why() {
    let admin = start().await;
    let (reports, mut answers) = open(&admin, "b", Some(SYNC_TOKEN)).await.unwrap();
    let llm = bucket(&[("policy", "llm")]);
    reports
        .send(report(
            vec![
                llm.clone(),
                bucket(&[("policy", "local")]),
                bucket(&[("service", "llm")]),
                bucket(&[("policy", "nowhere")]),
            ],
            1,
            0,
        ))
        .await
        .unwrap();
    // A young admin gives nothing for a lease and a half (it cannot know
    // what the ledger held before it started): then a share.
    let answer = granted(&mut answers).await;
    let assigned = rates(&answer);
    assert_eq!(assigned.len(), 1, "{answer:?}");
    assert_eq!(assigned[0].0, llm);
    assert!(
        assigned[0].1 > 0.0 && assigned[0].1 <= LIMIT,
        "{assigned:?}"
    );

    // The Fleet page: the client, its assigned limit, and each refusal's
    // reason.
    let view = client_view(&admin, "rlqs:b").expect("listed");
    assert_eq!(view.domain, "sluice");
    assert_eq!(view.assigned.len(), 1);
    assert_eq!(view.assigned[0].limit, "llm");
    assert_eq!(view.unassigned_count, 3);
    let reasons: Vec<&str> = view.unassigned.iter().map(|u| u.reason.as_str()).collect();
    assert!(
        reasons.iter().any(|r| r.contains("no `policy` key")),
        "{reasons:?}"
    );
    assert!(
        reasons.iter().any(|r| r.contains("\"local\"")),
        "{reasons:?}"
    );
    assert!(
        reasons.iter().any(|r| r.contains("\"nowhere\"")),
        "{reasons:?}"
    );
    assert_eq!(admin.state.rlqs.open(), 1);
    // The ledger holds it as a member, beside any Sluice Envoy.
    let set = admin.state.store.policy_set().await.unwrap();
    let views = admin.state.fleet.views(&set).await.unwrap();
    let member = views[0].members.iter().find(|m| m.instance == "rlqs:b");
    // A token bucket holds no calls in flight: the slots stay with the
    // Sluice Envoys.
    assert_eq!(member.map(|m| m.share.in_flight), Some(0), "{views:?}");

    // Closed, it leaves the list.
    drop((reports, answers));
    wait_until("the client gone", || {
        client_view(&admin, "rlqs:b").is_none()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_buckets_and_counts_at_their_largest_leave_the_others_their_share() {
    let admin = start().await;
    let (calm, mut calm_answers) = calm_client(&admin).await;

    let (hostile, mut hostile_answers) = open(&admin, "hostile", Some(SYNC_TOKEN)).await.unwrap();
    let many: Vec<BucketId> = (0..10_000)
        .map(|i| bucket(&[("policy", "llm"), ("key", &i.to_string())]))
        .collect();
    for _ in 0..3 {
        hostile
            .send(report(many.clone(), u64::MAX, u64::MAX))
            .await
            .unwrap();
        let answer = next(&mut hostile_answers).await;
        assert!(answer.bucket_action.len() <= MAX_BUCKETS);
    }
    let view = client_view(&admin, "rlqs:hostile").expect("listed");
    assert_eq!(view.unassigned_count, 9_000);
    assert!(view.unassigned.len() <= sluice_admin::rlqs::buckets::MAX_UNASSIGNED_SHOWN);

    // The calm client still hears, and the two never hold more than the
    // limit between them.
    calm.send(report(vec![bucket(&[("policy", "llm")])], 10, 0))
        .await
        .unwrap();
    let calm_rate: f64 = rates(&granted(&mut calm_answers).await)
        .iter()
        .map(|r| r.1)
        .sum();
    let set = admin.state.store.policy_set().await.unwrap();
    let views = admin.state.fleet.views(&set).await.unwrap();
    let shared: f64 = views[0].members.iter().map(|m| m.share.rate).sum();
    assert!(calm_rate > 0.0, "the calm client keeps a share");
    assert!(shared <= LIMIT + 1e-6, "shares sum to {shared}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_never_reads_is_given_up_and_its_share_freed() {
    let admin = start().await;
    // Held open to the end: the calm client's stream lives as long.
    let (_calm, mut calm_answers) = calm_client(&admin).await;

    // A thousand buckets: each answer is larger than HTTP/2's window, so
    // answers left unread stop the admin's sending at once.
    let (deaf, _unread) = open(&admin, "deaf", Some(SYNC_TOKEN)).await.unwrap();
    let padding = "x".repeat(200);
    let many: Vec<BucketId> = (0..MAX_BUCKETS)
        .map(|i| bucket(&[("policy", "llm"), ("key", &format!("{i}{padding}"))]))
        .collect();
    deaf.send(report(many, 1, 0)).await.unwrap();
    wait_until("the deaf client listed", || {
        client_view(&admin, "rlqs:deaf").is_some_and(|v| !v.assigned.is_empty())
    })
    .await;

    // Meanwhile the calm client is answered as ever.
    for _ in 0..3 {
        next(&mut calm_answers).await;
    }
    wait_until("the deaf client given up", || {
        client_view(&admin, "rlqs:deaf").is_none()
    })
    .await;
    let set = admin.state.store.policy_set().await.unwrap();
    let mut freed = false;
    for _ in 0..100 {
        let views = admin.state.fleet.views(&set).await.unwrap();
        if !views[0].members.iter().any(|m| m.instance == "rlqs:deaf") {
            freed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(freed, "the deaf client's share is still reserved");
    drop(deaf);
}

/// A client with one bucket of `llm` that reported once and was answered.
async fn calm_client(
    admin: &Admin,
) -> (
    mpsc::Sender<RateLimitQuotaUsageReports>,
    Streaming<RateLimitQuotaResponse>,
) {
    let (calm, mut answers) = open(admin, "calm", Some(SYNC_TOKEN)).await.unwrap();
    calm.send(report(vec![bucket(&[("policy", "llm")])], 1, 0))
        .await
        .unwrap();
    next(&mut answers).await;
    (calm, answers)
}

/// The first answer that grants some rate.
async fn granted(answers: &mut Streaming<RateLimitQuotaResponse>) -> RateLimitQuotaResponse {
    for _ in 0..20 {
        let answer = next(answers).await;
        if rates(&answer).iter().any(|(_, rate)| *rate > 0.0) {
            return answer;
        }
    }
    panic!("no rate granted in 20 answers");
}

async fn wait_until(what: &str, mut check: impl FnMut() -> bool) {
    for _ in 0..600 {
        if check() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{what}: not within 30 s");
}
