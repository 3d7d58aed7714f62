//! A real PostgreSQL server (Debian's `postgresql`, which `make setup`
//! installs) in a fresh data directory on a free port; stopped on drop.
//!
//! PostgreSQL refuses to run as root, so as root the server runs as the
//! `postgres` system user the package creates.

use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use nix::sys::signal::{kill, Signal};
use nix::unistd::{Pid, Uid, User};

use crate::envoy::free_port;

pub struct PostgresServer {
    child: Child,
    pub port: u16,
    bin: PathBuf,
    user: Option<User>,
    /// `-c name=value` settings (TLS).
    settings: Vec<String>,
    // Removed after the server stops.
    dir: tempfile::TempDir,
}

/// The newest installed server's binaries (`/usr/lib/postgresql/N/bin`),
/// or `PG_BIN`.
fn bin_dir() -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("PG_BIN") {
        return Ok(PathBuf::from(dir));
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .context("no /usr/lib/postgresql (make setup installs postgresql)")?
        .filter_map(Result::ok)
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse::<u32>().ok()?;
            Some((version, e.path().join("bin")))
        })
        .filter(|(_, bin)| bin.join("postgres").exists())
        .collect();
    versions.sort();
    versions
        .pop()
        .map(|(_, bin)| bin)
        .context("no PostgreSQL server under /usr/lib/postgresql (make setup installs postgresql)")
}

/// As root, the `postgres` user to run as (it owns the data directory).
fn run_as() -> anyhow::Result<Option<User>> {
    if !Uid::effective().is_root() {
        return Ok(None);
    }
    User::from_name("postgres")?
        .map(Some)
        .context("running as root and no `postgres` user to run PostgreSQL as")
}

fn command(program: &Path, user: &Option<User>) -> Command {
    let mut command = Command::new(program);
    if let Some(user) = user {
        command.uid(user.uid.as_raw()).gid(user.gid.as_raw());
    }
    command.env_remove("PGDATA").current_dir("/");
    command
}

impl PostgresServer {
    pub fn start() -> anyhow::Result<Self> {
        Self::start_with(None)
    }

    /// Accepts TLS connections only (`hostssl` in pg_hba.conf), with
    /// `cert` and `key` (PEM).
    pub fn start_tls(cert: &Path, key: &Path) -> anyhow::Result<Self> {
        Self::start_with(Some((cert, key)))
    }

    fn start_with(tls: Option<(&Path, &Path)>) -> anyhow::Result<Self> {
        let bin = bin_dir()?;
        let user = run_as()?;
        let dir = tempfile::tempdir()?;
        if let Some(user) = &user {
            std::os::unix::fs::chown(dir.path(), Some(user.uid.as_raw()), Some(user.gid.as_raw()))?;
        }
        let data = dir.path().join("data");
        let initdb = command(&bin.join("initdb"), &user)
            .arg("-D")
            .arg(&data)
            .args(["-U", "sluice", "--auth=trust", "-E", "UTF8", "--no-sync"])
            .output()
            .context("running initdb")?;
        if !initdb.status.success() {
            bail!("initdb failed: {}", String::from_utf8_lossy(&initdb.stderr));
        }
        let settings = match tls {
            Some((cert, key)) => require_tls(&data, cert, key, &user)?,
            None => Vec::new(),
        };
        let port = free_port()?;
        let child = spawn_server(&bin, &user, dir.path(), port, &settings)?;
        let mut server = Self {
            child,
            port,
            bin,
            user,
            settings,
            dir,
        };
        server.wait_ready()?;
        Ok(server)
    }

    fn wait_ready(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!("postgres exited ({status})");
            }
            if self.ready() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("postgres did not come up on port {}", self.port);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Stops the server (fast shutdown: every connection dropped) and
    /// starts it again on the same data and port.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.stop();
        self.start_again()
    }

    /// Stops the server (fast shutdown); [`Self::start_again`] brings it back.
    pub fn stop_for_now(&mut self) {
        self.stop();
    }

    /// Starts a stopped server again on the same data and port.
    pub fn start_again(&mut self) -> anyhow::Result<()> {
        self.child = spawn_server(
            &self.bin,
            &self.user,
            self.dir.path(),
            self.port,
            &self.settings,
        )?;
        self.wait_ready()
    }

    fn stop(&mut self) {
        if let Ok(pid) = i32::try_from(self.child.id()) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGINT);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// A PostgreSQL client tool aimed at this server as `sluice`.
    /// One SQL query's answer through `psql` (unaligned, tuples only).
    pub fn query(&self, database: &str, sql: &str) -> anyhow::Result<String> {
        let out = self
            .client("psql")
            .args(["-d", database, "-tAc", sql])
            .output()
            .context("running psql")?;
        if !out.status.success() {
            bail!("psql: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    }

    fn client(&self, tool: &str) -> Command {
        let mut command = Command::new(self.bin.join(tool));
        command.args([
            "-h",
            "127.0.0.1",
            "-p",
            &self.port.to_string(),
            "-U",
            "sluice",
        ]);
        command
    }

    fn ready(&self) -> bool {
        TcpStream::connect(("127.0.0.1", self.port)).is_ok()
            && self
                .client("pg_isready")
                .args(["-d", "postgres"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
    }

    /// A connection URL for a new, empty database `name`.
    pub fn database(&self, name: &str) -> anyhow::Result<String> {
        let created = self
            .client("createdb")
            .arg(name)
            .output()
            .context("running createdb")?;
        if !created.status.success() {
            bail!(
                "createdb {name}: {}",
                String::from_utf8_lossy(&created.stderr)
            );
        }
        Ok(format!("postgres://sluice@127.0.0.1:{}/{name}", self.port))
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Copies the certificate and key into the data directory (PostgreSQL
/// wants the key owned by the server's user, readable by it only) and
/// lets only TLS connections in. Returns the settings that turn TLS on.
fn require_tls(
    data: &Path,
    cert: &Path,
    key: &Path,
    user: &Option<User>,
) -> anyhow::Result<Vec<String>> {
    use std::os::unix::fs::PermissionsExt;
    let (cert_copy, key_copy) = (data.join("server.crt"), data.join("server.key"));
    std::fs::copy(cert, &cert_copy).context("copying the TLS certificate")?;
    std::fs::copy(key, &key_copy).context("copying the TLS key")?;
    std::fs::set_permissions(&key_copy, std::fs::Permissions::from_mode(0o600))?;
    if let Some(user) = user {
        for file in [&cert_copy, &key_copy] {
            std::os::unix::fs::chown(file, Some(user.uid.as_raw()), Some(user.gid.as_raw()))?;
        }
    }
    std::fs::write(
        data.join("pg_hba.conf"),
        "local all all trust\nhostssl all all 127.0.0.1/32 trust\nhostnossl all all 127.0.0.1/32 reject\n",
    )?;
    Ok(vec![
        "ssl=on".into(),
        format!("ssl_cert_file={}", cert_copy.display()),
        format!("ssl_key_file={}", key_copy.display()),
    ])
}

fn spawn_server(
    bin: &Path,
    user: &Option<User>,
    dir: &Path,
    port: u16,
    settings: &[String],
) -> anyhow::Result<Child> {
    let mut command = command(&bin.join("postgres"), user);
    for setting in settings {
        command.args(["-c", setting]);
    }
    command
        .arg("-D")
        .arg(dir.join("data"))
        .args([
            "-p",
            &port.to_string(),
            "-c",
            "listen_addresses=127.0.0.1",
            "-k",
        ])
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting postgres")
}
