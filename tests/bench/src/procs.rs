//! The processes a benchmark runs and what /proc says about them.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use sluice_e2e::envoy::{free_port, http_get, spawn_envoy, wait_live};

/// CPU time (user + system) of a process so far.
pub fn cpu_time(pid: u32) -> anyhow::Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = stat.rsplit_once(')').context("odd /proc stat")?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| -> anyhow::Result<u64> {
        Ok(fields.get(i).context("short /proc stat")?.parse()?)
    };
    // utime and stime are fields 14 and 15 of stat(5), 12 and 13 here.
    let total = ticks(11)? + ticks(12)?;
    let hz = clock_ticks_per_second();
    Ok(Duration::from_secs_f64(total as f64 / hz))
}

fn clock_ticks_per_second() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

pub use sluice_e2e::procinfo::rss_mib;

pub struct Proc {
    pub child: Child,
    _dir: Option<tempfile::TempDir>,
}

impl Proc {
    /// A process stopped (killed) when dropped.
    pub fn new(child: Child) -> Self {
        Self { child, _dir: None }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An Envoy's configuration written with free ports in place of
/// {{PORT}} and {{ADMIN_PORT}}, in a directory that also holds its log.
pub struct EnvoyFiles {
    pub dir: tempfile::TempDir,
    pub config: std::path::PathBuf,
    pub log: std::path::PathBuf,
    pub port: u16,
    pub admin_port: u16,
}

impl EnvoyFiles {
    pub fn write(config: &str) -> anyhow::Result<Self> {
        let port = free_port()?;
        let admin_port = free_port()?;
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("envoy.yaml");
        std::fs::write(
            &path,
            config
                .replace("{{PORT}}", &port.to_string())
                .replace("{{ADMIN_PORT}}", &admin_port.to_string()),
        )?;
        let log = dir.path().join("envoy.log");
        Ok(Self {
            dir,
            config: path,
            log,
            port,
            admin_port,
        })
    }
}

pub struct BenchEnvoy {
    pub proc: Proc,
    pub port: u16,
    pub admin_port: u16,
}

impl BenchEnvoy {
    /// Starts Envoy with `config` (placeholders {{PORT}} and {{ADMIN_PORT}}
    /// filled here) and waits until it is ready.
    pub fn start(config: &str, workers: u32) -> anyhow::Result<Self> {
        Self::start_on(config, workers, None)
    }

    /// Like [`start`](Self::start), pinned to the CPUs in `cpus` (a
    /// `taskset` list such as "1"), so what else runs on the machine
    /// disturbs its measurements less.
    pub fn start_on(config: &str, workers: u32, cpus: Option<&str>) -> anyhow::Result<Self> {
        let EnvoyFiles {
            dir,
            config: path,
            log: log_path,
            port,
            admin_port,
        } = EnvoyFiles::write(config)?;
        let child = spawn_envoy(&path, workers, &log_path, cpus)?;
        let mut proc = Proc {
            child,
            _dir: Some(dir),
        };
        wait_live(
            &mut proc.child,
            admin_port,
            &log_path,
            Duration::from_secs(30),
        )?;
        Ok(Self {
            proc,
            port,
            admin_port,
        })
    }

    /// Envoy's counts of answers by class and every non-zero stat of the
    /// wasm filters (refusals, shared-data faults, VM failures): what an
    /// error about unexpected answers needs to say which they were.
    pub fn answer_stats(&self) -> String {
        http_get(self.admin_port, "/stats")
            .unwrap_or_default()
            .lines()
            .filter(|l| {
                let (name, value) = l.split_once(": ").unwrap_or((l, ""));
                let answers = name.starts_with("http.proxy.")
                    && (name.ends_with("downstream_rq_4xx") || name.ends_with("downstream_rq_5xx"));
                let filter = (name.contains("sluice") || name.contains("wasm")) && value != "0";
                answers || filter
            })
            .take(60)
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// A stat from /stats/prometheus (name with labels), 0 when absent.
    pub fn stat(&self, name: &str) -> f64 {
        http_get(self.admin_port, "/stats/prometheus")
            .unwrap_or_default()
            .lines()
            .filter(|l| !l.starts_with('#'))
            .find_map(|l| {
                let (n, v) = l.rsplit_once(' ')?;
                (n == name).then(|| v.parse().ok()).flatten()
            })
            .unwrap_or(0.0)
    }
}

/// The sync token the benchmarks' admins take: the admin refuses one
/// shorter than 32 bytes.
pub const SYNC_TOKEN: &str = "bench-sync-token-5f2c9a7e41d08b36c1e9f0a2";

/// The release admin binary, with a password and [`SYNC_TOKEN`]; an admin
/// that does not come up is reported with what it said.
pub fn start_admin(binary: &Path, port: u16, password: &str) -> anyhow::Result<Proc> {
    start_admin_with(binary, port, password, &[])
}

/// As [`start_admin`], with more arguments (`--database-url`, `--redis-url`).
pub fn start_admin_with(
    binary: &Path,
    port: u16,
    password: &str,
    extra: &[&str],
) -> anyhow::Result<Proc> {
    let dir = tempfile::tempdir()?;
    let log_path = dir.path().join("admin.log");
    let log = std::fs::File::create(&log_path)?;
    let child = Command::new(binary)
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--db")
        .arg(dir.path().join("bench.db"))
        .env("SLUICE_ADMIN_PASSWORD", password)
        .env("SLUICE_SYNC_TOKEN", SYNC_TOKEN)
        .args(extra)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .with_context(|| format!("starting {}", binary.display()))?;
    let mut proc = Proc {
        child,
        _dir: Some(dir),
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while http_get(port, "/healthz").is_err() {
        let exited = proc.child.try_wait().ok().flatten().is_some();
        if exited || Instant::now() > deadline {
            let said = std::fs::read_to_string(&log_path).unwrap_or_default();
            let said: String = said.lines().take(5).collect::<Vec<_>>().join("\n");
            bail!("admin not ready: {said}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(proc)
}
