//! The admin's HTTP(S) server: axum's router behind the limits a service
//! reachable by every Envoy (and maybe more) needs. At most
//! `max_connections` connections are open at once (the next is accepted
//! when one closes), a client has `header_read_timeout` to send its
//! request headers and `handshake_timeout` to finish a TLS handshake, so
//! slow or idle clients cannot hold the server's connections; TLS (rustls)
//! when a certificate is configured.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
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

/// Limits on the connections the admin serves.
#[derive(Debug, Clone, Copy)]
pub struct ServerLimits {
    pub max_connections: usize,
    pub header_read_timeout: Duration,
    pub handshake_timeout: Duration,
}

impl Default for ServerLimits {
    fn default() -> Self {
        Self {
            max_connections: 1024,
            header_read_timeout: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(10),
        }
    }
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
                None => connection(stream, peer, app, limits, stop).await,
                Some(acceptor) => {
                    match tokio::time::timeout(limits.handshake_timeout, acceptor.accept(stream))
                        .await
                    {
                        Ok(Ok(tls)) => connection(tls, peer, app, limits, stop).await,
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
    app: Router,
    limits: ServerLimits,
    mut stop: watch::Receiver<()>,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service = app.map_request(move |mut req: Request<Incoming>| {
        req.extensions_mut().insert(ConnectInfo(peer));
        req.map(Body::new)
    });
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    builder.http2().timer(TokioTimer::new());
    let mut conn =
        pin!(builder
            .serve_connection_with_upgrades(TokioIo::new(io), TowerToHyperService::new(service)));
    // The value was seen at subscription; a change means "stop".
    stop.mark_unchanged();
    tokio::select! {
        result = conn.as_mut() => {
            if let Err(e) = result {
                tracing::trace!(%peer, error = %e, "connection ended");
            }
        }
        // A new value, or the server gone entirely: either way, close
        // once the request in flight is answered.
        _ = stop.changed() => {
            conn.as_mut().graceful_shutdown();
            let _ = conn.as_mut().await;
        }
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
