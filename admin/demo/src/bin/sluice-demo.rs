//! `sluice-demo`, what `make run` starts: the admin (SQLite in `var/`,
//! seeded with the demo policies), a demo "third-party API", Envoy with the
//! filter on the egress listener, and a load generator calling the API
//! through Envoy. Ctrl-C stops everything it started, by PID.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Parser;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use sluice_demo::llm::{LlmLimits, MockPrice};
use sluice_demo::load::{self as demo_load, LoadStats};
use sluice_demo::mcp::MockMcp;
use sluice_demo::mock::{MockApi, MockLimits};

/// The ports `envoy/egress.yaml` names; the demo uses them as they are, so
/// the URLs in the README work as written.
const ADMIN_PORT: u16 = 8080;
/// The admin over TLS: what the filter syncs with.
const ADMIN_TLS_PORT: u16 = 8443;
/// Where the shipped config expects the admin's certificate.
const SHIPPED_CA: &str = "var/tls/ca.pem";
const ENVOY_ADMIN_PORT: u16 = 9901;
const EGRESS_PORT: u16 = 10000;
const DEMO_API_PORT: u16 = 9090;
/// The demo pool's two deployments.
const POOL_EAST_PORT: u16 = 9091;
const POOL_WEST_PORT: u16 = 9092;
/// The demo's MCP server (agents' tools).
const MCP_PORT: u16 = 9093;
/// When the east deployment's quota first drops to 0, for how long, and
/// how often again.
const POOL_DROP_AFTER: Duration = Duration::from_secs(40);
const POOL_DROP_SECS: u64 = 20;
const POOL_DROP_EVERY: Duration = Duration::from_secs(180);

#[derive(Parser)]
#[command(about = "Run the Sluice demo: admin + Envoy with the filter + a demo API + load")]
struct Args {
    /// Where the admin's SQLite file and the logs go.
    #[arg(long, default_value = "var")]
    var_dir: PathBuf,
    #[arg(long, default_value = "envoy/egress.yaml")]
    envoy_config: PathBuf,
    /// Policies the admin starts with (only into a new database).
    #[arg(long, default_value = "envoy/demo-policies.json")]
    seed: PathBuf,
    #[arg(long, default_value = ".venv/bin/envoy")]
    envoy_bin: PathBuf,
    #[arg(long, default_value = "target/debug/sluice-admin")]
    admin_bin: PathBuf,
    #[arg(long, default_value = "target/ui")]
    ui_dir: PathBuf,
    /// Envoy worker threads.
    #[arg(long, default_value_t = 2)]
    concurrency: u32,
    /// Start everything but the load generator.
    #[arg(long)]
    no_load: bool,
}

/// A process the demo started; stopped by its PID.
struct Started {
    name: &'static str,
    child: Child,
    log: PathBuf,
}

impl Started {
    fn exited(&mut self) -> Option<String> {
        match self.child.try_wait() {
            Ok(Some(status)) => Some(status.to_string()),
            Ok(None) => None,
            Err(e) => Some(e.to_string()),
        }
    }

    /// SIGTERM, then SIGKILL if it is still there after `grace`.
    fn stop(&mut self, grace: Duration) {
        let pid = self.child.id();
        if let Some(status) = self.exited() {
            println!("  {} (pid {pid}) had already stopped ({status})", self.name);
            return;
        }
        if let Ok(pid) = i32::try_from(pid) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        }
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if self.exited().is_some() {
                println!("  stopped {} (pid {pid})", self.name);
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        println!("  killed {} (pid {pid}) after {grace:?}", self.name);
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

fn taken_ports() -> Vec<String> {
    [
        (ADMIN_PORT, "the Sluice admin"),
        (ADMIN_TLS_PORT, "the Sluice admin over TLS"),
        (ENVOY_ADMIN_PORT, "the Envoy admin"),
        (EGRESS_PORT, "the egress listener"),
        (DEMO_API_PORT, "the demo API"),
        (POOL_EAST_PORT, "the demo pool's east deployment"),
        (POOL_WEST_PORT, "the demo pool's west deployment"),
        (MCP_PORT, "the demo MCP server"),
    ]
    .into_iter()
    .filter(|(port, _)| std::net::TcpListener::bind(("127.0.0.1", *port)).is_err())
    .map(|(port, what)| format!("127.0.0.1:{port} ({what})"))
    .collect()
}

fn need(path: &Path, what: &str) -> anyhow::Result<()> {
    if !path.exists() {
        bail!(
            "no {what} at {}: run `make run` from the repository root (it builds everything)",
            path.display()
        );
    }
    Ok(())
}

async fn wait_for(url: &str, ok: impl Fn(&str) -> bool, proc: &mut Started) -> anyhow::Result<()> {
    let http = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if let Some(status) = proc.exited() {
            bail!(
                "{} exited ({status}) while starting; {}:\n{}",
                proc.name,
                proc.log.display(),
                proc.log_tail()
            );
        }
        if let Ok(resp) = http.get(url).send().await {
            if resp.status().is_success() && ok(&resp.text().await.unwrap_or_default()) {
                return Ok(());
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!(
        "{} not ready after 30 s; {}:\n{}",
        proc.name,
        proc.log.display(),
        proc.log_tail()
    )
}

/// Whether the admin's set reached every worker of Envoy (and its main
/// thread's VM) within 10 s: the load starts on the demo's policies, not
/// the config's fallback, which has no agents' policies.
async fn pushed_to_every_worker(workers: u32) -> bool {
    let http = reqwest::Client::new();
    let url =
        format!("http://127.0.0.1:{ENVOY_ADMIN_PORT}/stats?filter=sluice.policy_sets_installed");
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let installed = match http.get(&url).send().await {
            Ok(resp) => resp.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        };
        let count = installed
            .rsplit(':')
            .next()
            .and_then(|n| n.trim().parse::<u32>().ok())
            .unwrap_or(0);
        if count > workers {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

fn spawn(name: &'static str, command: &mut Command, log: PathBuf) -> anyhow::Result<Started> {
    let file =
        std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    let child = command
        .stdout(file.try_clone()?)
        .stderr(file)
        .stdin(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {name}"))?;
    Ok(Started { name, child, log })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let taken = taken_ports();
    if !taken.is_empty() {
        eprintln!("make run: these ports are taken:");
        for t in &taken {
            eprintln!("  {t}");
        }
        eprintln!("Is another `make run` still up? Stop it (Ctrl-C in its terminal) or free the ports, then try again.");
        std::process::exit(2);
    }
    need(&args.envoy_bin, "Envoy binary")?;
    need(&args.admin_bin, "admin binary")?;
    need(&args.envoy_config, "Envoy configuration")?;
    need(&args.seed, "demo policy set")?;
    need(&args.ui_dir.join("index.html"), "built web UI")?;
    need(
        Path::new("target/wasm32-wasip1/release-wasm/sluice_filter.wasm"),
        "filter",
    )?;
    std::fs::create_dir_all(&args.var_dir)
        .with_context(|| format!("creating {}", args.var_dir.display()))?;

    let mut started: Vec<Started> = Vec::new();
    let outcome = run(&args, &mut started).await;
    println!("\nStopping what the demo started:");
    for p in started.iter_mut().rev() {
        p.stop(Duration::from_secs(5));
    }
    println!("  stopped the demo API and the load generator");
    outcome
}

async fn run(args: &Args, started: &mut Vec<Started>) -> anyhow::Result<()> {
    // The "third-party API": it refuses beyond 300 calls/s or 20 in flight,
    // as the real ones do; the demo policies keep the calls under that.
    // Its LLM (POST /v1/chat/completions) allows 360 calls and 20 000
    // tokens a minute per key, usage in its answers.
    let (api, llm) = MockApi::start_with_llm(
        SocketAddr::from(([127, 0, 0, 1], DEMO_API_PORT)),
        MockLimits {
            max_per_second: 300,
            max_in_flight: 20,
        },
        LlmLimits {
            requests_per_window: 360,
            tokens_per_window: 20_000,
            step: Duration::from_millis(60),
            ..LlmLimits::default()
        },
    )
    .await
    .context("starting the demo API")?;
    // It bills as the demo policies price (envoy/demo-policies.json).
    llm.set_prices(vec![
        MockPrice {
            model: "gpt-4o".into(),
            input: 2_500_000,
            cached_input: 1_250_000,
            output: 10_000_000,
        },
        MockPrice {
            model: "gpt-4o-mini*".into(),
            input: 150_000,
            cached_input: 75_000,
            output: 600_000,
        },
    ]);

    // The pool's two deployments of one API, 32 calls a second each.
    let deployment = MockLimits {
        max_per_second: 32,
        max_in_flight: 0,
    };
    let east = MockApi::start(
        SocketAddr::from(([127, 0, 0, 1], POOL_EAST_PORT)),
        deployment,
    )
    .await
    .context("starting the pool's east deployment")?;
    let west = MockApi::start(
        SocketAddr::from(([127, 0, 0, 1], POOL_WEST_PORT)),
        deployment,
    )
    .await
    .context("starting the pool's west deployment")?;

    // Agents' MCP server: search, fetch, slow and expensive tools, priced
    // per call by the demo policies.
    let mcp = MockMcp::start(SocketAddr::from(([127, 0, 0, 1], MCP_PORT)))
        .await
        .context("starting the demo MCP server")?;

    eprintln!("WARNING: the admin runs with --insecure-dev: no login, anyone who can reach 127.0.0.1:{ADMIN_PORT} can change limits. For a trial on this machine only.");
    let mut admin = spawn(
        "admin",
        Command::new(&args.admin_bin)
            .arg("--listen")
            .arg(format!("127.0.0.1:{ADMIN_PORT}"))
            .arg("--db")
            .arg(args.var_dir.join("sluice.db"))
            .arg("--ui-dir")
            .arg(&args.ui_dir)
            .arg("--seed")
            .arg(&args.seed)
            .arg("--tls-listen")
            .arg(format!("127.0.0.1:{ADMIN_TLS_PORT}"))
            .arg("--tls-self-signed")
            .arg(args.var_dir.join("tls"))
            // The name the filter calls the admin by.
            .args(["--allowed-host", "sluice-admin"])
            .arg("--insecure-dev"),
        args.var_dir.join("admin.log"),
    )?;
    let admin_ready = wait_for(
        &format!("http://127.0.0.1:{ADMIN_PORT}/healthz"),
        |_| true,
        &mut admin,
    )
    .await;
    started.push(admin);
    admin_ready?;

    // The shipped config pins var/tls/ca.pem; point it at this run's.
    let shipped = std::fs::read_to_string(&args.envoy_config)
        .with_context(|| format!("reading {}", args.envoy_config.display()))?;
    let ca = args.var_dir.join("tls").join("ca.pem");
    let envoy_config = args.var_dir.join("envoy.yaml");
    std::fs::write(
        &envoy_config,
        shipped.replace(SHIPPED_CA, &ca.display().to_string()),
    )
    .with_context(|| format!("writing {}", envoy_config.display()))?;
    let mut envoy = spawn(
        "Envoy",
        Command::new(&args.envoy_bin)
            .arg("-c")
            .arg(&envoy_config)
            .args([
                "--concurrency",
                &args.concurrency.to_string(),
                "--use-dynamic-base-id",
                "--log-level",
                "info",
            ]),
        args.var_dir.join("envoy.log"),
    )?;
    let envoy_ready = wait_for(
        &format!("http://127.0.0.1:{ENVOY_ADMIN_PORT}/ready"),
        |b| b.trim() == "LIVE",
        &mut envoy,
    )
    .await;
    if envoy_ready.is_ok() && !pushed_to_every_worker(args.concurrency).await {
        println!("(Envoy still enforces its config's fallback policies: the admin's set has not reached every worker)");
    }
    started.push(envoy);
    envoy_ready?;

    let load = Arc::new(LoadStats::default());
    let load_task =
        (!args.no_load).then(|| tokio::spawn(demo_load::run(EGRESS_PORT, Arc::clone(&load))));

    println!(
        "\nSluice demo is up.\n\
         \n  Admin UI         http://127.0.0.1:{ADMIN_PORT}/          (live view: http://127.0.0.1:{ADMIN_PORT}/live)\
         \n  Admin over TLS   https://127.0.0.1:{ADMIN_TLS_PORT}/         (Envoy syncs here, pinning {}/tls/ca.pem)\
         \n  Egress listener  http://127.0.0.1:{EGRESS_PORT}/         try: curl -i -H 'host: api.bank.example' http://127.0.0.1:{EGRESS_PORT}/v1/pay\
         \n  Envoy admin      http://127.0.0.1:{ENVOY_ADMIN_PORT}/          stats: http://127.0.0.1:{ENVOY_ADMIN_PORT}/stats?filter=sluice\
         \n  Demo API         http://127.0.0.1:{DEMO_API_PORT}/           (refuses over 300 calls/s or 20 in flight)\
         \n  Demo MCP server  http://127.0.0.1:{MCP_PORT}/mcp        (agents' tools: search, fetch, slow, expensive)\
         \n  Logs             {}/admin.log, {}/envoy.log\
         \n\n{}\
         \nPress Ctrl-C to stop everything.\n",
        args.var_dir.display(),
        args.var_dir.display(),
        args.var_dir.display(),
        if args.no_load {
            "No load generator (--no-load).".to_string()
        } else {
            "A load generator calls api.bank.example (150/s against a 100/s limit), api.llm.example\n\
             (12 callers against 8 in flight, 300 calls and 20 000 tokens a minute, half of them\n\
             streamed), api.fx.example (25/s, queued at 20/s) and api.maps.example (API keys at\n\
             15/s, 8/s and 3/s, each limited to 10/s) through the egress listener; api.pool.example\n\
             (40/s over two deployments of 30/s; east's quota drops to 0 for 20 s after 40 s, and\n\
             every 3 minutes after: calls go west meanwhile); three agents call mcp.tools.example's\n\
             tools (searches past 10 a minute, expensive calls past 2 in flight) and the LLM, 1 USD a run."
                .to_string()
        }
    );

    let llm_tokens = llm.limits().tokens_per_window;
    let mut report = tokio::time::interval(Duration::from_secs(10));
    report.tick().await;
    let mut pool_drop = tokio::time::interval_at(
        tokio::time::Instant::now() + POOL_DROP_AFTER,
        POOL_DROP_EVERY,
    );
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let result = loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break Ok(()),
            _ = sigterm.recv() => break Ok(()),
            _ = report.tick() => {
                if let Some(line) = load.take_report() {
                    let llm = llm.stats();
                    let tools = mcp.stats();
                    println!(
                        "{line}; the demo API refused {} so far, its LLM {} ({} tokens in the last minute of {}); \
                         the pool's deployments refused east {}, west {}; the MCP server answered {} searches, \
                         {} expensive calls (at most {} at once)",
                        api.rejected_by_mock(),
                        llm.refused,
                        llm.latest_window_tokens(),
                        llm_tokens,
                        east.rejected_by_mock(),
                        west.rejected_by_mock(),
                        tools.tool_calls("search"),
                        tools.tool_calls("expensive"),
                        tools.most_in_flight.get("expensive").copied().unwrap_or(0),
                    );
                }
            }
            _ = pool_drop.tick() => {
                east.go_down(POOL_DROP_SECS);
                println!("pool: the east deployment's quota is 0 for {POOL_DROP_SECS} s (429, Retry-After: {POOL_DROP_SECS}); calls go west");
            }
            _ = tokio::time::sleep(Duration::from_millis(500)) => {
                let gone = started.iter_mut().find_map(|p| {
                    let status = p.exited()?;
                    Some(anyhow::anyhow!("{} exited ({status}); {}:\n{}", p.name, p.log.display(), p.log_tail()))
                });
                if let Some(error) = gone {
                    break Err(error);
                }
            }
        }
    };
    if let Some(task) = load_task {
        task.abort();
    }
    result
}
