//! `sluice-admin`: the admin service binary.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context};
use clap::Parser;
use sluice_admin::auth::Credentials;
use sluice_admin::fleet::Ledgers;
use sluice_admin::store::Store;
use sluice_admin::AppState;

#[derive(Parser)]
#[command(about = "Sluice admin: edit egress limits live, watch utilization")]
struct Args {
    /// Address to listen on.
    #[arg(long, env = "SLUICE_LISTEN", default_value = "127.0.0.1:8080")]
    listen: std::net::SocketAddr,
    /// SQLite database file (created if missing).
    #[arg(long, env = "SLUICE_DB", default_value = "./sluice.db")]
    db: PathBuf,
    /// The admin password (hashed with argon2 at start; never logged).
    #[arg(long, env = "SLUICE_ADMIN_PASSWORD", hide_env_values = true)]
    admin_password: Option<String>,
    /// Or an argon2 PHC hash of it.
    #[arg(long, env = "SLUICE_ADMIN_PASSWORD_HASH", hide_env_values = true)]
    admin_password_hash: Option<String>,
    /// Bearer token the filters send to /api/v1/sync.
    #[arg(long, env = "SLUICE_SYNC_TOKEN", hide_env_values = true)]
    sync_token: Option<String>,
    /// Directory of the built web UI (index.html, pkg/).
    #[arg(long, env = "SLUICE_UI_DIR", default_value = "target/ui")]
    ui_dir: PathBuf,
    /// Mark the session cookie Secure (when served over HTTPS).
    #[arg(long)]
    secure_cookies: bool,
    /// A policy set (JSON) to start with when the store has never held a
    /// policy; ignored afterwards. A set that fails validation stops the start.
    #[arg(long, env = "SLUICE_SEED")]
    seed: Option<PathBuf>,
    /// Keep fleet mode's shares in Redis (`redis://127.0.0.1:6379`), so
    /// that several admin replicas can serve the same Envoys. Without it,
    /// one admin keeps them in memory.
    #[arg(long, env = "SLUICE_REDIS_URL", hide_env_values = true)]
    redis_url: Option<String>,
    /// Keep policies in PostgreSQL (`postgres://user:password@host/db`)
    /// instead of the SQLite file `--db`: for admin replicas on several
    /// hosts. Never logged.
    #[arg(long, env = "SLUICE_DATABASE_URL", hide_env_values = true)]
    database_url: Option<String>,
    /// Run without a password (anyone reaching the port is admin). Local
    /// development only.
    #[arg(long)]
    insecure_dev: bool,
    /// A reverse proxy (address or CIDR) whose `--client-ip-header` is
    /// believed; repeat for several. Login throttles then count the client
    /// the proxy names instead of the proxy.
    #[arg(
        long = "trusted-proxy",
        env = "SLUICE_TRUSTED_PROXIES",
        value_delimiter = ','
    )]
    trusted_proxies: Vec<ipnet::IpNet>,
    /// The header a trusted proxy names the client in (e.g. x-forwarded-for).
    #[arg(long, env = "SLUICE_CLIENT_IP_HEADER")]
    client_ip_header: Option<String>,
    /// An Envoy that stopped syncing is forgotten after this long (the
    /// live view and the instances list), e.g. 10m, 1h.
    #[arg(long, env = "SLUICE_INSTANCE_TTL", default_value = "1h", value_parser = parse_span)]
    instance_ttl: sluice_shared::Span,
}

fn parse_span(text: &str) -> Result<sluice_shared::Span, String> {
    let d = sluice_shared::DurationMs::parse(text)?;
    if d.as_millis() == 0 {
        return Err("must be more than 0".into());
    }
    Ok(d.as_span())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,tower_http=warn".into()),
        )
        .init();
    let args = Args::parse();
    let credentials = match (
        &args.admin_password,
        &args.admin_password_hash,
        args.insecure_dev,
    ) {
        (Some(p), _, _) => Credentials::from_password(p).context("--admin-password")?,
        (None, Some(h), _) => Credentials::from_hash(h).context("--admin-password-hash")?,
        (None, None, true) => {
            tracing::warn!("--insecure-dev: NO LOGIN. Anyone who reaches {} can change limits. Local development only.", args.listen);
            Credentials::InsecureDev
        }
        (None, None, false) => bail!(
            "no admin credentials: set SLUICE_ADMIN_PASSWORD (or SLUICE_ADMIN_PASSWORD_HASH), \
             or pass --insecure-dev for a local trial"
        ),
    };
    if args.sync_token.is_none() && !args.insecure_dev {
        bail!("no sync token: set SLUICE_SYNC_TOKEN (the filters' sync_token), or pass --insecure-dev");
    }
    let seed = match &args.seed {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading the seed policy set {}", path.display()))?;
            let set = sluice_shared::parse_policy_set(&text)
                .map_err(|e| anyhow::anyhow!("seed policy set {} refused: {e}", path.display()))?;
            Some((path.clone(), set))
        }
        None => None,
    };
    let (database_url, db) = (args.database_url.clone(), args.db.clone());
    // Opening PostgreSQL blocks (its client runs a runtime of its own).
    let store = tokio::task::spawn_blocking(move || -> anyhow::Result<Store> {
        let store = match &database_url {
            Some(url) => {
                Store::open_postgres(url).context("connecting to PostgreSQL (--database-url)")?
            }
            None => Store::open(&db).with_context(|| format!("opening {}", db.display()))?,
        };
        if let Some((path, set)) = &seed {
            let added = store
                .blocking()
                .seed(set, "seed")
                .with_context(|| format!("seeding from {}", path.display()))?;
            if added > 0 {
                tracing::info!(seed = %path.display(), policies = added, "seeded an empty store");
            }
        }
        Ok(store)
    })
    .await
    .context("opening the store")??;
    let store_kind = store.kind();
    if args.client_ip_header.is_some() == args.trusted_proxies.is_empty() {
        bail!("--client-ip-header and --trusted-proxy go together: the header is believed only from the proxies");
    }
    let addressing = sluice_admin::login::ClientAddressing {
        trusted_proxies: args.trusted_proxies.clone(),
        header: args.client_ip_header.clone(),
    };
    let mut state = AppState::new(store, credentials, args.sync_token, args.secure_cookies)
        .with_addressing(addressing)
        .with_instance_ttl(args.instance_ttl);
    if let Some(url) = &args.redis_url {
        let ledgers = Ledgers::redis(url)
            .await
            .context("connecting to Redis (--redis-url)")?;
        // The URL may carry a password: it is never logged.
        tracing::info!("fleet shares kept in Redis");
        state = state.with_ledgers(ledgers);
    }
    let state = Arc::new(state);
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("listening on {} (port taken?)", args.listen))?;
    let ui_dir = args
        .ui_dir
        .join("index.html")
        .exists()
        .then_some(args.ui_dir.clone());
    if ui_dir.is_none() {
        tracing::warn!(dir = %args.ui_dir.display(), "no web UI built there (make ui); serving the API only");
    }
    match store_kind {
        "postgres" => {
            tracing::info!(listen = %args.listen, store = "postgres", "sluice-admin ready")
        }
        _ => tracing::info!(listen = %args.listen, db = %args.db.display(), "sluice-admin ready"),
    }
    sluice_admin::serve(listener, state, ui_dir, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await
    .context("serving")?;
    Ok(())
}
