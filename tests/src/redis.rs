//! A real Redis server (Debian's `redis-server`, which `make setup`
//! installs) on a free port, with nothing persisted; killed on drop. Plain,
//! or TLS only (Debian builds Redis with TLS).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::envoy::free_port;

pub struct RedisServer {
    child: Child,
    pub port: u16,
    /// The CA certificate a TLS server's certificate chains to.
    tls_ca: Option<PathBuf>,
    args: Vec<String>,
}

fn binary() -> String {
    std::env::var("REDIS_SERVER_BIN").unwrap_or_else(|_| "redis-server".into())
}

impl RedisServer {
    pub fn start() -> anyhow::Result<Self> {
        let port = free_port()?;
        let args = vec!["--port".to_string(), port.to_string()];
        Self::launch(port, args, None)
    }

    /// Serves TLS only, with `cert`/`key` (PEM) whose chain ends at `ca`.
    pub fn start_tls(cert: &Path, key: &Path, ca: &Path) -> anyhow::Result<Self> {
        let port = free_port()?;
        let path = |p: &Path| p.display().to_string();
        let args = vec![
            "--port".to_string(),
            "0".into(),
            "--tls-port".into(),
            port.to_string(),
            "--tls-cert-file".into(),
            path(cert),
            "--tls-key-file".into(),
            path(key),
            "--tls-ca-cert-file".into(),
            path(ca),
            "--tls-auth-clients".into(),
            "no".into(),
        ];
        Self::launch(port, args, Some(ca.to_path_buf()))
    }

    /// Starts redis-server with `args`, local only and keeping nothing on
    /// disk.
    fn launch(port: u16, mut args: Vec<String>, tls_ca: Option<PathBuf>) -> anyhow::Result<Self> {
        for arg in ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"] {
            args.push(arg.to_string());
        }
        let child = spawn(&args)?;
        let mut server = Self {
            child,
            port,
            tls_ca,
            args,
        };
        server.wait_ready()?;
        Ok(server)
    }

    fn wait_ready(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.ping() {
            if let Some(status) = self.child.try_wait()? {
                bail!("redis-server exited ({status})");
            }
            if Instant::now() > deadline {
                bail!("redis-server did not answer PING on port {}", self.port);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// Kills the server (every connection dropped, every key lost, as a
    /// crashed Redis without persistence) and starts it again on the same
    /// port.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.child = spawn(&self.args)?;
        self.wait_ready()
    }

    pub fn url(&self) -> String {
        let scheme = if self.tls_ca.is_some() {
            "rediss"
        } else {
            "redis"
        };
        format!("{scheme}://127.0.0.1:{}/", self.port)
    }

    /// The numbers of `INFO stats` (`total_commands_processed`,
    /// `total_net_input_bytes`, ...), by name, through redis-cli (a plain
    /// server), in one call.
    pub fn info_stats(&self) -> anyhow::Result<BTreeMap<String, u64>> {
        let out = Command::new("redis-cli")
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "INFO",
                "stats",
            ])
            .output()
            .context("running redis-cli")?;
        if !out.status.success() {
            bail!(
                "redis-cli INFO stats: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| {
                let (name, value) = l.split_once(':')?;
                Some((name.to_string(), value.trim().parse().ok()?))
            })
            .collect())
    }

    fn ping(&self) -> bool {
        match &self.tls_ca {
            // Through redis-cli, which speaks TLS (redis-tools, a
            // dependency of redis-server).
            Some(ca) => Command::new("redis-cli")
                .args([
                    "-h",
                    "127.0.0.1",
                    "-p",
                    &self.port.to_string(),
                    "--tls",
                    "--cacert",
                ])
                .arg(ca)
                .arg("PING")
                .output()
                .is_ok_and(|o| o.status.success() && o.stdout.starts_with(b"PONG")),
            None => {
                let Ok(mut s) = TcpStream::connect(("127.0.0.1", self.port)) else {
                    return false;
                };
                let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
                let mut answer = [0u8; 7];
                s.write_all(b"PING\r\n").is_ok()
                    && s.read_exact(&mut answer).is_ok()
                    && &answer == b"+PONG\r\n"
            }
        }
    }
}

fn spawn(args: &[String]) -> anyhow::Result<Child> {
    Command::new(binary())
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {} (make setup installs redis-server)", binary()))
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
