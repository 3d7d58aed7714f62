//! The admin's HTTP(S) server: axum's router behind the limits a service
//! reachable by every Envoy (and maybe more) needs. At most
//! `max_connections` connections are open at once (the next is accepted
//! when one closes). A connection with no request in flight is closed
//! after `header_read_timeout`, whatever it is doing meanwhile: sending
//! nothing, half an HTTP/2 preface, half its headers, or idling between
//! requests over HTTP/1.1 keep-alive or HTTP/2. A request's body must
//! arrive within the same time, and a TLS handshake within
//! `handshake_timeout`; so slow or idle clients cannot hold the server's
//! connections. TLS (rustls) when a certificate is configured.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::{pin, Pin};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::ConnectInfo;
use axum::http::Request;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tower::ServiceExt;

/// Requests one HTTP/2 connection may have open at once: a browser's
/// page (the live stream and a few API calls) or an Envoy's sync and
/// watch need far fewer.
pub const MAX_STREAMS_PER_CONNECTION: u32 = 32;
/// How often an HTTP/2 connection with requests in flight is pinged, and
/// how long the answer may take: a peer that vanished (no FIN, no RST)
/// gives its requests up.
const H2_PING_EVERY: Duration = Duration::from_secs(20);
const H2_PING_TIMEOUT: Duration = Duration::from_secs(10);
/// After an idle connection is asked to close (HTTP/2: GOAWAY), how long
/// the close may take before the connection is dropped outright.
const IDLE_CLOSE_GRACE: Duration = Duration::from_millis(250);

/// Marks a request that came over TLS (the session cookie is then
/// `Secure`).
#[derive(Debug, Clone, Copy)]
pub struct OverTls;

/// What to do when the peer closes a connection, set by a handler that
/// learnt who is at its other end (an Envoy's sync names its instance).
/// Every request carries its connection's. Run only when the peer closed
/// or broke the connection, never when the server closed it (idle,
/// shutdown) nor on a timeout: a SIGKILLed process's kernel closes its
/// connections, whether a request was in flight on them or not.
#[derive(Clone, Default)]
pub struct OnPeerClose(Arc<std::sync::Mutex<Option<PeerCloseAction>>>);

type PeerCloseAction = Box<dyn FnOnce() + Send>;

impl OnPeerClose {
    /// Replaces what the connection's close will do.
    pub fn set(&self, action: impl FnOnce() + Send + 'static) {
        *self.slot() = Some(Box::new(action));
    }

    fn run(&self) {
        // Taken out first: the action runs without the lock held.
        let action = self.slot().take();
        if let Some(action) = action {
            action();
        }
    }

    fn slot(&self) -> std::sync::MutexGuard<'_, Option<PeerCloseAction>> {
        // A panic while holding this lock leaves a plain value behind.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Limits on the connections the admin serves.
#[derive(Debug, Clone, Copy)]
pub struct ServerLimits {
    pub max_connections: usize,
    pub header_read_timeout: Duration,
    pub handshake_timeout: Duration,
}

/// Connections open at once by default: every Envoy holds two over
/// HTTP/1.1 (its watch, held, and its sync), one over HTTP/2; at 1 024,
/// a thousand Envoys' watches left their syncs waiting seconds to be
/// accepted (BENCHMARKS.md section 12).
pub const DEFAULT_MAX_CONNECTIONS: usize = 16_384;

/// File descriptors kept for what is not a client's connection: the
/// database, Redis, logs, the listeners.
const OTHER_FILES: u64 = 256;

impl Default for ServerLimits {
    fn default() -> Self {
        Self {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            header_read_timeout: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(10),
        }
    }
}

/// The connections this process can hold at once, at most `wanted`: its
/// open-files limit raised towards the hard limit as far as `wanted`
/// needs; when that is not enough, what the limit leaves (past it,
/// `accept` fails and a connection waits anyway, with a warning each
/// time).
pub fn connections_within_open_files(wanted: usize) -> usize {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let needed = (wanted as u64).saturating_add(OTHER_FILES);
    let limit = getrlimit(Resource::Nofile);
    let soft = limit.current.unwrap_or(u64::MAX);
    let hard = limit.maximum.unwrap_or(u64::MAX);
    let mut available = soft;
    if soft < needed {
        let raised = needed.min(hard);
        let set = setrlimit(
            Resource::Nofile,
            Rlimit {
                current: Some(raised),
                maximum: limit.maximum,
            },
        );
        match set {
            Ok(()) => available = raised,
            Err(e) => tracing::warn!(error = %e, "could not raise the open-files limit"),
        }
    }
    let fits = usize::try_from(available.saturating_sub(OTHER_FILES)).unwrap_or(usize::MAX);
    if fits < wanted {
        tracing::warn!(
            wanted,
            fits,
            open_files = available,
            "the open-files limit (ulimit -n) holds fewer connections than --max-connections: \
             serving at most {fits} at once; each Envoy holds two over HTTP/1.1"
        );
    }
    wanted.min(fits).max(1)
}

/// Serves `app` on `listener` until `shutdown` resolves, then lets the
/// open connections finish (at most 5 s).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    tls: Option<Arc<rustls::ServerConfig>>,
    limits: ServerLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
    // Connections hold a receiver; dropping the sender asks them to close,
    // and they are done when every receiver is gone.
    let (stop_tx, stop_rx) = watch::channel(());
    let mut shutdown = pin!(shutdown);
    loop {
        let slot = tokio::select! {
            slot = Arc::clone(&slots).acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break,
            },
            () = &mut shutdown => break,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors, for one: wait, do not spin.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let app = app.clone();
        let acceptor = acceptor.clone();
        let stop = stop_rx.clone();
        tokio::spawn(async move {
            let _slot = slot;
            match acceptor {
                None => connection(stream, peer, false, app, limits, stop).await,
                Some(acceptor) => {
                    match tokio::time::timeout(limits.handshake_timeout, acceptor.accept(stream))
                        .await
                    {
                        Ok(Ok(tls)) => connection(tls, peer, true, app, limits, stop).await,
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                }
            }
        });
    }
    drop(listener);
    drop(stop_rx);
    stop_tx.send_replace(());
    let finished = stop_tx.closed();
    let _ = tokio::time::timeout(Duration::from_secs(5), finished).await;
    Ok(())
}

async fn connection<I>(
    io: I,
    peer: SocketAddr,
    over_tls: bool,
    app: Router,
    limits: ServerLimits,
    mut stop: watch::Receiver<()>,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let activity = Activity::default();
    let tracked = activity.clone();
    let on_peer_close = OnPeerClose::default();
    let for_requests = on_peer_close.clone();
    let service = tower::service_fn(move |mut req: Request<Incoming>| {
        let in_flight = tracked.begin();
        req.extensions_mut().insert(ConnectInfo(peer));
        req.extensions_mut().insert(for_requests.clone());
        if over_tls {
            req.extensions_mut().insert(OverTls);
        }
        let app = app.clone();
        async move {
            let response = app.oneshot(req.map(Body::new)).await?;
            // In flight until its body is written (the live stream's
            // lasts as long as it is watched).
            Ok::<_, std::convert::Infallible>(response.map(|body| {
                Body::new(Tracked {
                    body,
                    _in_flight: in_flight,
                })
            }))
        }
    });
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
        .keep_alive_interval(H2_PING_EVERY)
        .keep_alive_timeout(H2_PING_TIMEOUT);
    let mut conn =
        pin!(builder
            .serve_connection_with_upgrades(TokioIo::new(io), TowerToHyperService::new(service)));
    // The value was seen at subscription; a change means "stop".
    stop.mark_unchanged();
    tokio::select! {
        result = conn.as_mut() => {
            let timed_out = result.as_ref().is_err_and(|e| {
                e.downcast_ref::<hyper::Error>().is_some_and(hyper::Error::is_timeout)
            });
            if let Err(e) = &result {
                tracing::trace!(%peer, error = %e, "connection ended");
            }
            if !timed_out {
                on_peer_close.run();
            }
        }
        // A new value, or the server gone entirely: either way, close
        // once the request in flight is answered.
        _ = stop.changed() => {
            conn.as_mut().graceful_shutdown();
            let _ = conn.as_mut().await;
        }
        // Nothing in flight for that long, however many bytes trickled
        // in meanwhile (hyper's own header timer does not run while it
        // sniffs the protocol, nor between HTTP/2 requests).
        () = activity.idle_for(limits.header_read_timeout) => {
            conn.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(IDLE_CLOSE_GRACE, conn.as_mut()).await;
            tracing::debug!(%peer, "closed a connection idle for the header read timeout");
        }
    }
}

/// The requests in flight on one connection.
#[derive(Clone)]
struct Activity(Arc<watch::Sender<usize>>);

impl Default for Activity {
    fn default() -> Self {
        Self(Arc::new(watch::channel(0).0))
    }
}

impl Activity {
    fn begin(&self) -> InFlight {
        self.0.send_modify(|n| *n += 1);
        InFlight(self.clone())
    }

    /// Resolves once no request has been in flight for `limit` (counted
    /// from the connection's start or its last request's end).
    async fn idle_for(&self, limit: Duration) {
        let mut count = self.0.subscribe();
        loop {
            let busy = *count.borrow_and_update() > 0;
            if busy {
                // The sender lives as long as `self`: changed() cannot fail.
                let _ = count.changed().await;
                continue;
            }
            tokio::select! {
                () = tokio::time::sleep(limit) => return,
                _ = count.changed() => {}
            }
        }
    }
}

/// One request in flight, until dropped.
struct InFlight(Activity);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0 .0.send_modify(|n| *n = n.saturating_sub(1));
    }
}

/// A response body that keeps its request counted in flight.
struct Tracked {
    body: Body,
    _in_flight: InFlight,
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// Bounds the time a request's body may take to arrive: a client that
/// trickles it gives up its connection as one that trickles its headers.
/// None: a stream's body, as long as its client (RLQS).
pub async fn body_deadline(
    deadline: Option<Duration>,
    req: axum::extract::Request,
) -> axum::extract::Request {
    match deadline {
        Some(deadline) => {
            req.map(|body| Body::new(tower_http::timeout::DeadlineBody::new(deadline, body)))
        }
        None => req,
    }
}

/// TLS for the admin from PEM files: the certificate chain and its key.
pub fn tls_config(
    cert: &std::path::Path,
    key: &std::path::Path,
) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .map_err(|e| TlsError::Read(cert.display().to_string(), e.to_string()))?
        .collect::<Result<_, _>>()
        .map_err(|e| TlsError::Read(cert.display().to_string(), e.to_string()))?;
    if chain.is_empty() {
        return Err(TlsError::Read(
            cert.display().to_string(),
            "no certificate in it".into(),
        ));
    }
    let key = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| TlsError::Read(key.display().to_string(), e.to_string()))?;
    let mut config = rustls::ServerConfig::builder()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| TlsError::Config(e.to_string()))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Names a self-signed admin certificate is valid for: how Envoys and
/// browsers reach the admin on one host or in the compose setup.
pub const SELF_SIGNED_NAMES: [&str; 5] = ["sluice-admin", "admin", "localhost", "127.0.0.1", "::1"];

/// The files of a self-signed certificate in `dir`: generated the first
/// time (the key readable by its owner only), reused afterwards. Envoys
/// pin `ca.pem`, which is the certificate itself.
pub fn self_signed(
    dir: &std::path::Path,
) -> Result<(std::path::PathBuf, std::path::PathBuf), TlsError> {
    let cert = dir.join("admin.pem");
    let key = dir.join("admin-key.pem");
    let ca = dir.join("ca.pem");
    if cert.exists() && key.exists() && ca.exists() {
        return Ok((cert, key));
    }
    std::fs::create_dir_all(dir)
        .map_err(|e| TlsError::Write(dir.display().to_string(), e.to_string()))?;
    let names: Vec<String> = SELF_SIGNED_NAMES.iter().map(|n| n.to_string()).collect();
    let generated =
        rcgen::generate_simple_self_signed(names).map_err(|e| TlsError::Config(e.to_string()))?;
    let write = |path: &std::path::Path, text: &str, private: bool| -> Result<(), TlsError> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create(true).truncate(true);
        if private {
            options.mode(0o600);
        }
        options
            .open(path)
            .and_then(|mut f| f.write_all(text.as_bytes()))
            .map_err(|e| TlsError::Write(path.display().to_string(), e.to_string()))
    };
    write(&key, &generated.key_pair.serialize_pem(), true)?;
    write(&cert, &generated.cert.pem(), false)?;
    write(&ca, &generated.cert.pem(), false)?;
    Ok((cert, key))
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {0}: {1}")]
    Read(String, String),
    #[error("writing {0}: {1}")]
    Write(String, String),
    #[error("TLS configuration: {0}")]
    Config(String),
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use axum::extract::Extension;
    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    use super::*;

    /// The open-files limit is raised to hold the connections asked for,
    /// within the hard limit; past the hard limit, what fits is served.
    #[test]
    fn the_open_files_limit_is_raised_to_hold_the_connections() {
        use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
        let before = getrlimit(Resource::Nofile);
        let (Some(soft), Some(hard)) = (before.current, before.maximum) else {
            return; // unlimited: nothing to raise
        };
        assert!(
            soft >= 600,
            "a soft limit of {soft} is too low to lower for this test"
        );
        let lowered = soft - 300;
        let lower = Rlimit {
            current: Some(lowered),
            maximum: before.maximum,
        };
        setrlimit(Resource::Nofile, lower).unwrap_or_else(|e| panic!("{e}"));
        let wanted = usize::try_from(soft - OTHER_FILES).unwrap_or(usize::MAX);
        assert_eq!(connections_within_open_files(wanted), wanted);
        assert_eq!(getrlimit(Resource::Nofile).current, Some(soft));
        let too_many = usize::try_from(hard).unwrap_or(usize::MAX);
        let fits = usize::try_from(hard - OTHER_FILES).unwrap_or(usize::MAX);
        assert_eq!(connections_within_open_files(too_many), fits);
        assert_eq!(connections_within_open_files(10), 10);
        setrlimit(Resource::Nofile, before).unwrap_or_else(|e| panic!("{e}"));
    }

    /// A server whose one route asks to count its connection's close by
    /// the peer; idle connections closed after 300 ms.
    async fn counting_server() -> (SocketAddr, Arc<AtomicUsize>) {
        let closes = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&closes);
        let app = Router::new().route(
            "/",
            get(move |Extension(on_close): Extension<OnPeerClose>| {
                let counted = Arc::clone(&counted);
                async move {
                    on_close.set(move || {
                        counted.fetch_add(1, Ordering::SeqCst);
                    });
                    "ok"
                }
            }),
        );
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address");
        let limits = ServerLimits {
            header_read_timeout: Duration::from_millis(300),
            ..ServerLimits::default()
        };
        tokio::spawn(serve(listener, app, None, limits, std::future::pending()));
        (addr, closes)
    }

    /// Sends one keep-alive request and reads its whole answer.
    async fn one_request(addr: SocketAddr) -> TcpStream {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        stream
            .write_all(b"GET / HTTP/1.1\r\nhost: test\r\n\r\n")
            .await
            .expect("write");
        let mut answer = Vec::new();
        while !answer.ends_with(b"ok") {
            let mut chunk = [0; 256];
            let n = stream.read(&mut chunk).await.expect("read");
            assert!(n > 0, "closed before the answer: {answer:?}");
            answer.extend_from_slice(&chunk[..n]);
        }
        stream
    }

    async fn count_after(closes: &AtomicUsize, wait: Duration) -> usize {
        tokio::time::sleep(wait).await;
        closes.load(Ordering::SeqCst)
    }

    #[tokio::test]
    async fn a_peer_closing_an_idle_connection_runs_its_action_once() {
        let (addr, closes) = counting_server().await;
        let stream = one_request(addr).await;
        assert_eq!(count_after(&closes, Duration::from_millis(50)).await, 0);
        drop(stream);
        assert_eq!(count_after(&closes, Duration::from_millis(100)).await, 1);
    }

    #[tokio::test]
    async fn the_server_closing_an_idle_connection_runs_nothing() {
        let (addr, closes) = counting_server().await;
        let mut stream = one_request(addr).await;
        // The server closes it after 300 ms of nothing in flight.
        let mut rest = [0; 16];
        let read = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut rest)).await;
        assert!(matches!(read, Ok(Ok(0))), "{read:?}");
        drop(stream);
        assert_eq!(count_after(&closes, Duration::from_millis(100)).await, 0);
    }

    #[tokio::test]
    async fn a_connection_that_never_learnt_its_peer_runs_nothing() {
        let (addr, closes) = counting_server().await;
        let stream = TcpStream::connect(addr).await.expect("connect");
        drop(stream);
        assert_eq!(count_after(&closes, Duration::from_millis(100)).await, 0);
    }
}
