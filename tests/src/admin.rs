//! The real admin service (in this process, on a real port, with a real
//! SQLite file), and an operator session against its API.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::{json, Value};
use sluice_admin::auth::Credentials;
use sluice_admin::store::Store;
use sluice_admin::AppState;
use tokio::sync::oneshot;

pub const PASSWORD: &str = "e2e-password";
pub const SYNC_TOKEN: &str = "e2e-sync-token-0123456789abcdef-0123456789";

/// The admin served from the test's own tokio runtime: quick to start,
/// for tests that put no load beside it. A test whose load shares that
/// runtime, and whose figures depend on the admin answering in time,
/// runs [`AdminProcess`] instead (on a loaded machine the load's busy
/// connections delayed this one's sync answers by over a second).
pub struct AdminServer {
    pub port: u16,
    pub db: PathBuf,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
}

impl AdminServer {
    /// Starts on `port` (0: any free port) with the database at `db`.
    pub async fn start(db: PathBuf, port: u16) -> anyhow::Result<Self> {
        Self::start_with_ui(db, port, None).await
    }

    /// Also serving the built web UI from `ui_dir`.
    pub async fn start_with_ui(
        db: PathBuf,
        port: u16,
        ui_dir: Option<PathBuf>,
    ) -> anyhow::Result<Self> {
        let store = Store::open(&db).context("opening the admin store")?;
        let state = Arc::new(AppState::new(
            store,
            Credentials::from_password(PASSWORD)?,
            Some(SYNC_TOKEN.into()),
            false,
        ));
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
        let port = listener.local_addr()?.port();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(sluice_admin::serve(listener, state, ui_dir, async move {
            let _ = stopped.await;
        }));
        Ok(Self {
            port,
            db,
            stop: Some(stop),
            task: Some(task),
        })
    }

    /// Stops serving (as if the admin went away).
    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            t.abort();
            let _ = t.await;
        }
    }

    pub fn base(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub async fn login(&self) -> anyhow::Result<Operator> {
        Operator::login(&self.base(), PASSWORD).await
    }
}

/// The admin binary as its own process (what an operator runs), for tests
/// that kill it. Its log (at debug level) goes to a file the test can read.
pub struct AdminProcess {
    child: Child,
    pub port: u16,
    pub db: PathBuf,
    pub log_path: PathBuf,
}

impl AdminProcess {
    /// The binary `make e2e` builds (`SLUICE_ADMIN_BIN`), else the
    /// workspace's debug build.
    pub fn binary() -> PathBuf {
        std::env::var_os("SLUICE_ADMIN_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| crate::envoy::workspace_root().join("target/debug/sluice-admin"))
    }

    /// Starts it on `port` with the database `db` and the web UI from
    /// `ui_dir`; appends to `log_path`; waits until `/healthz` answers.
    pub async fn start(
        db: &Path,
        port: u16,
        ui_dir: Option<&Path>,
        log_path: &Path,
    ) -> anyhow::Result<Self> {
        Self::start_with_args(db, port, ui_dir, log_path, &[]).await
    }

    /// On a free port with its database and log (`sluice.db`,
    /// `admin.log`) in `dir`, and more command-line arguments.
    pub async fn start_in(dir: &Path, extra: &[&str]) -> anyhow::Result<Self> {
        Self::start_in_env(dir, extra, &[]).await
    }

    /// As `start_in`, also serving TLS (`--tls-listen`) on a port of its
    /// own with a self-signed certificate written to `dir/tls`: the admin,
    /// that port, and that directory (its `ca.pem` for Envoys to pin).
    pub async fn start_tls_in(dir: &Path) -> anyhow::Result<(Self, u16, PathBuf)> {
        let tls_dir = dir.join("tls");
        let tls_port = crate::envoy::free_port()?;
        let admin = Self::start_in(
            dir,
            &[
                "--tls-listen",
                &format!("127.0.0.1:{tls_port}"),
                "--tls-self-signed",
                &tls_dir.display().to_string(),
            ],
        )
        .await?;
        Ok((admin, tls_port, tls_dir))
    }

    /// As `start_in`, with more environment variables for the admin.
    pub async fn start_in_env(
        dir: &Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> anyhow::Result<Self> {
        let port = crate::envoy::free_port()?;
        let (db, log) = (dir.join("sluice.db"), dir.join("admin.log"));
        Self::spawn(&db, port, None, &log, extra, env).await
    }

    /// With more command-line arguments (`--redis-url ...`).
    pub async fn start_with_args(
        db: &Path,
        port: u16,
        ui_dir: Option<&Path>,
        log_path: &Path,
        extra: &[&str],
    ) -> anyhow::Result<Self> {
        Self::spawn(db, port, ui_dir, log_path, extra, &[]).await
    }

    async fn spawn(
        db: &Path,
        port: u16,
        ui_dir: Option<&Path>,
        log_path: &Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> anyhow::Result<Self> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log_path)?;
        let mut command = Command::new(Self::binary());
        command
            .args(["--listen", &format!("127.0.0.1:{port}"), "--db"])
            .arg(db)
            .env("SLUICE_ADMIN_PASSWORD", PASSWORD)
            .env("SLUICE_SYNC_TOKEN", SYNC_TOKEN)
            .env("RUST_LOG", "debug")
            .stdout(log.try_clone()?)
            .stderr(log);
        if let Some(dir) = ui_dir {
            command.arg("--ui-dir").arg(dir);
        }
        command.args(extra).envs(env.iter().copied());
        let child = command.spawn().with_context(|| {
            format!("starting {} (make e2e builds it)", Self::binary().display())
        })?;
        let mut admin = Self {
            child,
            port,
            db: db.to_path_buf(),
            log_path: log_path.to_path_buf(),
        };
        let healthz = format!("{}/healthz", admin.base());
        match crate::load::until_healthy(&mut admin.child, &healthz, Duration::from_secs(20)).await
        {
            Ok(()) => Ok(admin),
            Err(why) => bail!("the admin did not come up ({why}): {}", admin.log()),
        }
    }

    pub fn base(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    pub async fn login(&self) -> anyhow::Result<Operator> {
        Operator::login(&self.base(), PASSWORD).await
    }

    /// SIGKILL (what dropping it does): no shutdown, no flush, as a crash
    /// or the OOM killer would.
    pub fn kill(self) {
        drop(self);
    }
}

impl Drop for AdminProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A logged-in operator.
pub struct Operator {
    base: String,
    http: reqwest::Client,
    cookie: String,
    csrf: String,
}

impl Operator {
    /// Logs in to the admin at `base` (`http://host:port`).
    pub async fn login(base: &str, password: &str) -> anyhow::Result<Self> {
        Self::login_as(base, None, password).await
    }

    /// Logs in as the stored user `user` (None: the admin password's).
    pub async fn login_as(base: &str, user: Option<&str>, password: &str) -> anyhow::Result<Self> {
        let http = reqwest::Client::new();
        let mut body = json!({ "password": password });
        if let Some(user) = user {
            body["user"] = json!(user);
        }
        let resp = http
            .post(format!("{base}/api/v1/login"))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await?;
        if !resp.status().is_success() {
            bail!("login: {}", resp.status());
        }
        let cookie = resp
            .headers()
            .get("set-cookie")
            .and_then(|v| v.to_str().ok())
            .and_then(|c| c.split(';').next())
            .context("no session cookie")?
            .to_string();
        let body: Value = serde_json::from_str(&resp.text().await?)?;
        let csrf = body["csrf_token"]
            .as_str()
            .context("no csrf token")?
            .to_string();
        Ok(Self {
            base: base.to_string(),
            http,
            cookie,
            csrf,
        })
    }

    /// Any call, answered with its status and body (JSON when it is JSON),
    /// for tests that poke at the API directly.
    pub async fn raw(
        &self,
        method: reqwest::Method,
        path: &str,
        if_match: Option<u64>,
        body: Option<Value>,
    ) -> anyhow::Result<(u16, Value)> {
        let mut req = self
            .http
            .request(method, format!("{}{path}", self.base))
            .header("cookie", &self.cookie)
            .header("x-csrf-token", &self.csrf);
        if let Some(v) = if_match {
            req = req.header("if-match", format!("\"{v}\""));
        }
        if let Some(b) = body {
            req = req
                .header("content-type", "application/json")
                .body(b.to_string());
        }
        let resp = req.send().await?;
        let status = resp.status().as_u16();
        let text = resp.text().await?;
        Ok((
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        ))
    }

    pub async fn create(&self, policy: Value) -> anyhow::Result<u64> {
        let (status, body) = self
            .raw(
                reqwest::Method::POST,
                "/api/v1/policies",
                None,
                Some(policy),
            )
            .await?;
        if status != 201 {
            bail!("create: {status} {body}");
        }
        body["version"].as_u64().context("no version")
    }

    /// Replaces a policy, based on its current version.
    pub async fn update(&self, policy: Value) -> anyhow::Result<u64> {
        let name = policy["name"]
            .as_str()
            .context("policy without a name")?
            .to_string();
        let (_, current) = self
            .raw(
                reqwest::Method::GET,
                &format!("/api/v1/policies/{name}"),
                None,
                None,
            )
            .await?;
        let version = current["version"].as_u64().context("no version")?;
        let (status, body) = self
            .raw(
                reqwest::Method::PUT,
                &format!("/api/v1/policies/{name}"),
                Some(version),
                Some(policy),
            )
            .await?;
        if status != 200 {
            bail!("update: {status} {body}");
        }
        body["version"].as_u64().context("no version")
    }

    /// The session cookie's value and the CSRF token, for tests that
    /// look for them where they must not be.
    pub fn secrets(&self) -> (String, String) {
        let value = self.cookie.split_once('=').map_or("", |(_, v)| v);
        (value.to_string(), self.csrf.clone())
    }

    /// The live view's history (the first event of `/api/v1/live`): one
    /// frame a second, oldest first.
    pub async fn live_history(&self) -> anyhow::Result<Value> {
        self.live_event("history").await
    }

    /// The live view's next frame (its per-key tables among it).
    pub async fn live_frame(&self) -> anyhow::Result<Value> {
        self.live_event("frame").await
    }

    /// The first event named `name` of `/api/v1/live`.
    async fn live_event(&self, name: &str) -> anyhow::Result<Value> {
        let event = format!("event: {name}");
        let mut resp = self
            .http
            .get(format!("{}/api/v1/live", self.base))
            .header("cookie", &self.cookie)
            .timeout(std::time::Duration::from_secs(10))
            .send()
            .await?;
        let mut text = String::new();
        while let Some(chunk) = resp.chunk().await? {
            text.push_str(&String::from_utf8_lossy(&chunk));
            let Some(start) = text.find(&event) else {
                continue;
            };
            // The event is whole once the blank line after it came.
            if let Some(len) = text[start..].find("\n\n") {
                let data: String = text[start..start + len]
                    .lines()
                    .filter_map(|l| l.strip_prefix("data:"))
                    .map(str::trim_start)
                    .collect();
                return Ok(serde_json::from_str(&data)?);
            }
        }
        bail!("the live stream ended before its {name}")
    }

    pub async fn get(&self, path: &str) -> anyhow::Result<Value> {
        let (status, body) = self.raw(reqwest::Method::GET, path, None, None).await?;
        if status != 200 {
            bail!("GET {path}: {status} {body}");
        }
        Ok(body)
    }

    /// Waits until the admin leases a share of every global policy and
    /// limit to each of `instances`, then a sync more (200 ms in the
    /// suites) for the shares to reach them. A new admin hands out no share
    /// for its first lease (it recovers: instances may hold shares from
    /// before it started), about 4.5 s from its start; a test that measures
    /// from a fixed wait after starting its Envoys measures part of that
    /// too, and more of it the faster the Envoys start (the native build's).
    pub async fn wait_for_shares(&self, instances: &[&str]) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let fleet = self.get("/api/v1/fleet").await?;
            let limits = fleet["policies"].as_array().cloned().unwrap_or_default();
            let holds = |limit: &Value, instance: &str| {
                limit["members"].as_array().is_some_and(|members| {
                    members.iter().any(|m| {
                        m["instance"] == instance && m["share"]["rate"].as_f64() > Some(0.0)
                    })
                })
            };
            if !limits.is_empty()
                && limits
                    .iter()
                    .all(|limit| instances.iter().all(|i| holds(limit, i)))
            {
                tokio::time::sleep(Duration::from_millis(500)).await;
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("the admin leased no shares to {instances:?} within 20 s: {fleet}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
