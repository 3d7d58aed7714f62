//! `sluice-admin`: the admin service binary.

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::sync::Arc;

use std::io::Write;

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use sluice_admin::auth::Credentials;
use sluice_admin::kv::RedisConnection;
use sluice_admin::store::Store;
use sluice_admin::AppState;

#[derive(Parser)]
#[command(about = "Sluice admin: edit egress limits live, watch utilization")]
struct Args {
    /// Without a command: serve the admin.
    #[command(subcommand)]
    command: Option<Command>,
    /// Address to listen on.
    #[arg(long, env = "SLUICE_LISTEN", default_value = "127.0.0.1:8080")]
    listen: std::net::SocketAddr,
    /// SQLite database file (created if missing).
    #[arg(long, env = "SLUICE_DB", default_value = "./sluice.db", global = true)]
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
    #[arg(
        long,
        env = "SLUICE_DATABASE_URL",
        hide_env_values = true,
        global = true
    )]
    database_url: Option<String>,
    /// A CA certificate (PEM) PostgreSQL's certificate is checked against,
    /// besides the system's, when the URL says `sslmode=require`.
    #[arg(long, env = "SLUICE_DATABASE_CA", global = true)]
    database_ca: Option<PathBuf>,
    /// A CA certificate (PEM) Redis's certificate is checked against,
    /// besides the system's, for a `rediss://` URL.
    #[arg(long, env = "SLUICE_REDIS_CA")]
    redis_ca: Option<PathBuf>,
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
    /// Believe this header (e.g. x-forwarded-user) as the logged-in user's
    /// name, from `--user-header-proxy` addresses only; the user must
    /// exist here (`sluice-admin user add`), and gets their stored role.
    /// Off by default.
    #[arg(long, env = "SLUICE_USER_HEADER")]
    user_header: Option<String>,
    /// The authenticating reverse proxy (address or CIDR) whose
    /// `--user-header` is believed; repeat for several.
    #[arg(
        long = "user-header-proxy",
        env = "SLUICE_USER_HEADER_PROXIES",
        value_delimiter = ','
    )]
    user_header_proxies: Vec<ipnet::IpNet>,
    /// Policies as code: the policy set is this directory's YAML and JSON
    /// files (read at start and on every change; a bad change is refused
    /// whole and shown); nobody edits policies in the UI or the API.
    #[arg(long, env = "SLUICE_MANAGED_DIR")]
    managed_dir: Option<PathBuf>,
    /// The header a trusted proxy names the client in (e.g. x-forwarded-for).
    #[arg(long, env = "SLUICE_CLIENT_IP_HEADER")]
    client_ip_header: Option<String>,
    /// Also serve HTTPS here (the address Envoys sync with, their CA
    /// pinned): with `--tls-cert`/`--tls-key`, or `--tls-self-signed`.
    #[arg(long, env = "SLUICE_TLS_LISTEN")]
    tls_listen: Option<std::net::SocketAddr>,
    /// The certificate chain (PEM) for `--tls-listen`.
    #[arg(long, env = "SLUICE_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// Its private key (PEM).
    #[arg(long, env = "SLUICE_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Or a self-signed certificate kept in this directory (generated the
    /// first time; Envoys pin its ca.pem).
    #[arg(long, env = "SLUICE_TLS_SELF_SIGNED", conflicts_with = "tls_cert")]
    tls_self_signed: Option<PathBuf>,
    /// Connections open at once, at most (more wait to be accepted).
    /// Each Envoy holds two over HTTP/1.1 (its watch and its sync); the
    /// open-files limit is raised to fit, as far as its hard limit allows.
    #[arg(long, env = "SLUICE_MAX_CONNECTIONS", default_value_t = sluice_admin::server::DEFAULT_MAX_CONNECTIONS)]
    max_connections: usize,
    /// Syncs answered at once, at most: one more is answered 503 with
    /// Retry-After at once (its Envoy keeps its set and shares and syncs
    /// again after its backoff) rather than wait behind the others.
    #[arg(long, env = "SLUICE_MAX_SYNCS_IN_FLIGHT", default_value_t = sluice_admin::DEFAULT_MAX_SYNCS_IN_FLIGHT as u64, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    max_syncs_in_flight: u64,
    /// How long a client has to send its request headers (slow clients
    /// cannot hold connections), e.g. 10s.
    #[arg(long, env = "SLUICE_HEADER_READ_TIMEOUT", default_value = "10s", value_parser = parse_span)]
    header_read_timeout: sluice_shared::Span,
    /// `/metrics` asks for this bearer token (it lists policy names); open
    /// without it, as Prometheus expects by default.
    #[arg(long, env = "SLUICE_METRICS_TOKEN", hide_env_values = true)]
    metrics_token: Option<String>,
    /// With `--insecure-dev`: a Host name requests may carry besides
    /// localhost (e.g. the name Envoys call the admin by); repeat for
    /// several. Anything else is refused (DNS rebinding).
    #[arg(
        long = "allowed-host",
        env = "SLUICE_ALLOWED_HOSTS",
        value_delimiter = ','
    )]
    allowed_hosts: Vec<String>,
    /// With `--insecure-dev`, listen on an address other than loopback
    /// (in a container whose port is published on the host's loopback).
    #[arg(long)]
    insecure_dev_any_address: bool,
    /// An Envoy that stopped syncing is forgotten after this long (the
    /// live view and the instances list), e.g. 10m, 1h.
    #[arg(long, env = "SLUICE_INSTANCE_TTL", default_value = "1h", value_parser = parse_span)]
    instance_ttl: sluice_shared::Span,
    /// The audit log's rows of what budgets' rungs did (warning lines
    /// crossed, calls downgraded, routed, paced or refused: one per limit per rung per
    /// minute) are deleted after this long, e.g. 30d; the people's
    /// changes are kept.
    #[arg(long, env = "SLUICE_WARN_RETENTION", default_value = "30d", value_parser = parse_span)]
    warn_retention: sluice_shared::Span,
}

#[derive(Subcommand)]
enum Command {
    /// Manage the people who log in (roles: viewer, editor, admin).
    User {
        #[command(subcommand)]
        action: sluice_admin::people_cli::UserAction,
    },
    /// Manage API tokens for scripts and CI (scopes: read, write).
    Token {
        #[command(subcommand)]
        action: sluice_admin::people_cli::TokenAction,
    },
    /// Write every policy, in order, as YAML or JSON (to stdout, or -o).
    Export {
        #[arg(long, value_parser = ["yaml", "json"], default_value = "yaml")]
        format: String,
        #[arg(short, long)]
        output: Option<PathBuf>,
    },
    /// The set's price table.
    Prices {
        #[command(subcommand)]
        action: PricesAction,
    },
    /// Make the policies those of FILE or of the policy files in DIR: shows
    /// what changes (added, changed field by field, removed, order) and
    /// applies it in one transaction, or nothing if any file is refused.
    Apply {
        #[arg(short = 'f', long = "file")]
        path: PathBuf,
        /// Show the changes; apply nothing.
        #[arg(long)]
        dry_run: bool,
    },
}

#[derive(Subcommand)]
enum PricesAction {
    /// Merge a model-price catalog in LiteLLM's format
    /// (`model_prices_and_context_window.json`, prices in USD per token)
    /// into the set's prices: shows each model added, changed and refused,
    /// then applies the rest (unless --dry-run).
    Import {
        file: PathBuf,
        /// Only these models (repeat; a name ending in `*` takes every
        /// model it begins).
        #[arg(long)]
        only: Vec<String>,
        /// Only the models of these providers (`litellm_provider`: openai,
        /// anthropic, ...; repeat).
        #[arg(long)]
        provider: Vec<String>,
        /// Show what would change; apply nothing.
        #[arg(long)]
        dry_run: bool,
    },
}

/// `sluice-admin prices import`: reads the catalog, merges, prints.
fn import_prices(store: &Store, action: &PricesAction, out: &mut impl Write) -> anyhow::Result<()> {
    use sluice_admin::price_catalog::{self, Selection, MAX_CATALOG_BYTES};
    let PricesAction::Import {
        file,
        only,
        provider,
        dry_run,
    } = action;
    let size = std::fs::metadata(file)
        .with_context(|| format!("reading {}", file.display()))?
        .len();
    if size > MAX_CATALOG_BYTES as u64 {
        anyhow::bail!(
            "{}: {size} bytes, more than a catalog's {MAX_CATALOG_BYTES}",
            file.display()
        );
    }
    let text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let selection = Selection {
        only: only.clone(),
        providers: provider.clone(),
    };
    let catalog = price_catalog::read(&text, &selection)
        .map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
    let actor = sluice_admin::people_cli::cli_actor();
    let imported = match store.blocking().import_prices(&catalog, &actor, *dry_run) {
        Ok(imported) => imported,
        Err(sluice_admin::store::StoreError::Invalid(errors)) => {
            let lines: Vec<String> = errors.errors.iter().map(|e| format!("  {e}")).collect();
            anyhow::bail!(
                "nothing imported; the prices would be refused (choose fewer models with --only or --provider):\n{}",
                lines.join("\n")
            );
        }
        Err(e) => return Err(e.into()),
    };
    write!(out, "{}", price_catalog::describe(&imported))?;
    let verdict = match (dry_run, imported.applied) {
        (true, _) => "dry run: nothing applied".to_string(),
        (false, true) => format!("applied: policy set version {}", imported.version),
        (false, false) => format!("nothing to apply: policy set version {}", imported.version),
    };
    writeln!(out, "{verdict}")?;
    Ok(())
}

/// Opens the store the flags name, blocking.
fn open_store(args: &Args) -> anyhow::Result<Store> {
    match &args.database_url {
        Some(url) => Store::open_postgres(url, args.database_ca.as_deref())
            .context("connecting to PostgreSQL (--database-url)"),
        None => Store::open(&args.db).with_context(|| format!("opening {}", args.db.display())),
    }
}

/// `sluice-admin user …` / `token …`, then exit.
fn run_command(args: &Args, command: &Command) -> anyhow::Result<()> {
    let store = open_store(args)?;
    let guard = if args.admin_password.is_some() || args.admin_password_hash.is_some() {
        sluice_admin::store::AdminGuard::None
    } else {
        sluice_admin::store::AdminGuard::KeepOne
    };
    let (mut stdin, mut stdout) = (std::io::stdin().lock(), std::io::stdout().lock());
    match command {
        Command::User { action } => sluice_admin::people_cli::run_user(
            store.blocking(),
            action.clone(),
            guard,
            &mut stdin,
            &mut stdout,
        )?,
        Command::Token { action } => {
            sluice_admin::people_cli::run_token(store.blocking(), action.clone(), &mut stdout)?
        }
        Command::Export { format, output } => {
            let set = store.blocking().policy_set()?;
            let text = sluice_admin::as_code::export(&set, format == "yaml")
                .map_err(|e| anyhow::anyhow!("export: {e}"))?;
            match output {
                Some(path) => std::fs::write(path, text)
                    .with_context(|| format!("writing {}", path.display()))?,
                None => stdout.write_all(text.as_bytes())?,
            }
        }
        Command::Prices { action } => import_prices(&store, action, &mut stdout)?,
        Command::Apply { path, dry_run } => {
            let files = sluice_admin::as_code::read_path(path)?;
            let loaded = sluice_admin::as_code::load(&files).map_err(|errors| {
                let lines: Vec<String> = errors.errors.iter().map(|e| format!("  {e}")).collect();
                anyhow::anyhow!(
                    "nothing applied; {} refused:\n{}",
                    path.display(),
                    lines.join("\n")
                )
            })?;
            let actor = sluice_admin::people_cli::cli_actor();
            let prices = loaded.prices();
            let applied = store.blocking().apply_set(
                &loaded.policies,
                &loaded.sources,
                prices.as_ref(),
                &actor,
                *dry_run,
            )?;
            write!(stdout, "{}", applied.diff)?;
            if applied.prices_changed {
                writeln!(stdout, "~ prices")?;
            }
            let verdict = match (dry_run, applied.applied) {
                (true, _) => "dry run: nothing applied".to_string(),
                (false, true) => format!("applied: policy set version {}", applied.version),
                (false, false) => {
                    format!("nothing to apply: policy set version {}", applied.version)
                }
            };
            writeln!(stdout, "{verdict}")?;
        }
    }
    Ok(())
}

fn parse_span(text: &str) -> Result<sluice_shared::Span, String> {
    let d = sluice_shared::DurationMs::parse(text)?;
    if d.as_millis() == 0 {
        return Err("must be more than 0".into());
    }
    Ok(d.as_span())
}

/// Refuses to serve with a secret that is none: a placeholder of the
/// shipped manifests, or a sync token short enough to guess.
fn refuse_placeholder_secrets(args: &Args) -> anyhow::Result<()> {
    use sluice_admin::secrets::{refusal, Given, MIN_SYNC_TOKEN_BYTES};
    let given = [
        (
            "SLUICE_ADMIN_PASSWORD",
            "--admin-password",
            &args.admin_password,
            0,
        ),
        (
            "SLUICE_SYNC_TOKEN",
            "--sync-token",
            &args.sync_token,
            MIN_SYNC_TOKEN_BYTES,
        ),
        (
            "SLUICE_METRICS_TOKEN",
            "--metrics-token",
            &args.metrics_token,
            0,
        ),
    ];
    for (variable, flag, value, min_len) in given {
        let Some(value) = value else {
            continue;
        };
        let given = Given {
            variable,
            flag,
            value,
        };
        if let Some(why) = refusal(&given, min_len) {
            bail!("{why}");
        }
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| "info,tower_http=warn".into());
    if args.command.is_some() {
        // A command's answer is its stdout; what the store logs goes aside.
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .init();
        // PostgreSQL's blocking client runs a runtime of its own.
        let args = std::sync::Arc::new(args);
        let shared = args.clone();
        return tokio::task::spawn_blocking(move || {
            let command = shared.command.as_ref().context("no command")?;
            run_command(&shared, command)
        })
        .await
        .context("running the command")?;
    }
    tracing_subscriber::fmt().with_env_filter(filter).init();
    let credentials = match (
        &args.admin_password,
        &args.admin_password_hash,
        args.insecure_dev,
    ) {
        (Some(_), _, true) | (_, Some(_), true) => bail!(
            "--insecure-dev turns the login off: drop SLUICE_ADMIN_PASSWORD (and its hash), or drop --insecure-dev"
        ),
        (Some(p), _, _) => Credentials::from_password(p).context("--admin-password")?,
        (None, Some(h), _) => Credentials::from_hash(h).context("--admin-password-hash")?,
        (None, None, true) => {
            if args.sync_token.is_some() {
                bail!("--insecure-dev turns the sync token off too: drop SLUICE_SYNC_TOKEN, or drop --insecure-dev");
            }
            if !args.listen.ip().is_loopback() && !args.insecure_dev_any_address {
                bail!(
                    "--insecure-dev listens on loopback only (asked for {}): anyone reaching it could change limits; \
                     pass --insecure-dev-any-address in a container whose port is published on loopback",
                    args.listen
                );
            }
            tracing::warn!("--insecure-dev: NO LOGIN. Anyone who reaches {} can change limits. Local development only.", args.listen);
            Credentials::InsecureDev
        }
        // Decided once the store is open: its users may be the way in.
        (None, None, false) => Credentials::UsersOnly,
    };
    refuse_placeholder_secrets(&args)?;
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
    let database_ca = args.database_ca.clone();
    // Opening PostgreSQL blocks (its client runs a runtime of its own).
    let store = tokio::task::spawn_blocking(move || -> anyhow::Result<Store> {
        let store = match &database_url {
            Some(url) => Store::open_postgres(url, database_ca.as_deref())
                .context("connecting to PostgreSQL (--database-url)")?,
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
    .context("opening the store")??
    .with_warn_retention(args.warn_retention);
    if matches!(credentials, Credentials::UsersOnly) {
        let users = store.users().await.context("reading the users")?;
        if users.is_empty() {
            bail!(
                "no admin credentials: set SLUICE_ADMIN_PASSWORD (or SLUICE_ADMIN_PASSWORD_HASH), \
                 add an admin user (sluice-admin user add NAME --role admin), \
                 or pass --insecure-dev for a local trial"
            );
        }
        if !users.iter().any(|u| u.role.can_administer()) {
            tracing::warn!("no admin password and no admin user: nobody can manage users (sluice-admin user set-role NAME admin)");
        }
    }
    if args.sync_token.is_none() && !args.insecure_dev {
        bail!("no sync token: set SLUICE_SYNC_TOKEN (the filters' sync_token), or pass --insecure-dev");
    }
    if args.user_header.is_some() == args.user_header_proxies.is_empty() {
        bail!("--user-header and --user-header-proxy go together: the header is believed only from the proxy");
    }
    let proxy_users = sluice_admin::access::ProxyUsers {
        header: args.user_header.clone(),
        proxies: args.user_header_proxies.clone(),
    };
    let store_kind = store.kind();
    if args.client_ip_header.is_some() == args.trusted_proxies.is_empty() {
        bail!("--client-ip-header and --trusted-proxy go together: the header is believed only from the proxies");
    }
    let addressing = sluice_admin::login::ClientAddressing {
        trusted_proxies: args.trusted_proxies.clone(),
        header: args.client_ip_header.clone(),
    };
    let tls = match (&args.tls_cert, &args.tls_key, &args.tls_self_signed) {
        (Some(cert), Some(key), _) => Some(
            sluice_admin::server::tls_config(cert, key)
                .context("the TLS certificate (--tls-cert, --tls-key)")?,
        ),
        (_, _, Some(dir)) => {
            let (cert, key) = sluice_admin::server::self_signed(dir)
                .with_context(|| format!("the self-signed certificate in {}", dir.display()))?;
            tracing::info!(ca = %dir.join("ca.pem").display(), "serving TLS with a self-signed certificate; Envoys pin its ca.pem");
            Some(
                sluice_admin::server::tls_config(&cert, &key)
                    .context("the self-signed certificate")?,
            )
        }
        _ => None,
    };
    if tls.is_some() != args.tls_listen.is_some() {
        bail!("--tls-listen goes with a certificate (--tls-cert and --tls-key, or --tls-self-signed), and the other way round");
    }
    let limits = sluice_admin::server::ServerLimits {
        max_connections: sluice_admin::server::connections_within_open_files(args.max_connections),
        header_read_timeout: args.header_read_timeout.as_duration(),
        ..Default::default()
    };
    let mut state = AppState::new(store, credentials, args.sync_token, args.secure_cookies)
        .with_addressing(addressing)
        .with_instance_ttl(args.instance_ttl)
        .with_metrics_token(args.metrics_token.clone())
        .with_allowed_hosts(args.allowed_hosts.clone())
        .with_proxy_users(proxy_users)
        .with_server_limits(limits)
        .with_max_syncs_in_flight(usize::try_from(args.max_syncs_in_flight).unwrap_or(usize::MAX));
    if let Some(url) = &args.redis_url {
        let redis = RedisConnection::open(url, args.redis_ca.as_deref())
            .await
            .context("connecting to Redis (--redis-url)")?;
        // The URL may carry a password: it is never logged.
        tracing::info!("fleet shares kept in Redis");
        state = state.with_redis(&redis);
    }
    if let Some(dir) = &args.managed_dir {
        state = state.with_managed_dir(dir.clone());
    }
    let state = Arc::new(state);
    if let Some(managed) = state.managed.clone() {
        // At start, before the first sync is answered; a refused directory
        // leaves the store's last good set in force (and says so).
        managed.sync_once(&state).await;
        sluice_admin::managed::watch(state.clone());
        tracing::info!(dir = %managed.dir.display(), "policies managed from a directory");
    }
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
    let tls_listener = match (args.tls_listen, tls) {
        (Some(addr), Some(config)) => Some((
            tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("listening on {addr} (port taken?)"))?,
            config,
        )),
        _ => None,
    };
    if let Some(addr) = args.tls_listen {
        tracing::info!(tls_listen = %addr, "serving HTTPS");
    }
    sluice_admin::serve_with_tls(listener, tls_listener, state, ui_dir, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await
    .context("serving")?;
    Ok(())
}
