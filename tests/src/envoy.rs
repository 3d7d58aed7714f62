//! Runs the real Envoy binary (from the project virtualenv) with the
//! tests' egress configuration and the built filter, and reads its stats.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The Envoy binary: `$ENVOY_BIN`, or the one `make setup` put in `.venv`.
pub fn envoy_binary() -> anyhow::Result<PathBuf> {
    let path = std::env::var_os("ENVOY_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(".venv/bin/envoy"));
    if !path.exists() {
        bail!("no Envoy binary at {}: run `make setup`", path.display());
    }
    Ok(path)
}

/// The filter: `$SLUICE_WASM`, or the release build `make test` makes.
pub fn filter_wasm() -> anyhow::Result<PathBuf> {
    let path = std::env::var_os("SLUICE_WASM")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            workspace_root().join("target/wasm32-wasip1/release-wasm/sluice_filter.wasm")
        });
    if !path.exists() {
        bail!("no filter at {}: run `make wasm`", path.display());
    }
    path.canonicalize().context("resolving the filter path")
}

/// Which build of the filter the harness attaches: the wasm filter, or
/// with `SLUICE_FILTER=native` the native dynamic module (`make
/// e2e-native`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FilterBuild {
    Wasm,
    Native,
}

pub fn filter_build() -> FilterBuild {
    match std::env::var("SLUICE_FILTER").as_deref() {
        Ok("native") => FilterBuild::Native,
        _ => FilterBuild::Wasm,
    }
}

/// The native module: `$SLUICE_NATIVE`, or the release build `make
/// native` makes.
pub fn filter_native() -> anyhow::Result<PathBuf> {
    let path = std::env::var_os("SLUICE_NATIVE")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target/release/libsluice_native.so"));
    if !path.exists() {
        bail!("no native module at {}: run `make native`", path.display());
    }
    path.canonicalize()
        .context("resolving the native module path")
}

/// `template` with each wasm filter replaced by the native module at
/// `module`, its plugin configuration (`{{PLUGIN_CONFIG}}`, or another
/// placeholder such as `{{ATTEMPTS_PLUGIN_CONFIG}}`) kept: the same
/// listener, routes and clusters run either build.
pub fn with_native_filter(template: &str, module: &Path) -> anyhow::Result<String> {
    const WASM_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm";
    const PLUGIN_VALUE: &str = "value: '{{";
    let lines: Vec<&str> = template.lines().collect();
    let mut out: Vec<String> = Vec::new();
    let mut at = 0;
    while let Some(found) = lines[at..].iter().position(|l| l.contains(WASM_TYPE)) {
        let start = at + found;
        let end = start
            + lines[start..]
                .iter()
                .position(|l| l.contains(PLUGIN_VALUE))
                .context("a wasm filter has no plugin configuration")?;
        let indent = &lines[start][..lines[start].len() - lines[start].trim_start().len()];
        out.extend(lines[at..start].iter().map(|l| native_log_format(l)));
        let native = [
            "\"@type\": type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter".to_string(),
            "dynamic_module_config:".to_string(),
            format!("  module: {{ local: {{ filename: \"{}\" }} }}", module.display()),
            "filter_name: sluice".to_string(),
            "filter_config:".to_string(),
            "  \"@type\": type.googleapis.com/google.protobuf.StringValue".to_string(),
            format!("  {}", lines[end].trim_start()),
        ];
        out.extend(native.iter().map(|l| format!("{indent}{l}")));
        at = end + 1;
    }
    anyhow::ensure!(at > 0, "the template has no wasm filter");
    out.extend(lines[at..].iter().map(|l| native_log_format(l)));
    Ok(out.join("\n") + "\n")
}

/// `plugin_config` with its role `attempts` (not an object: that role
/// alone, never a second deciding filter).
fn attempts_role(plugin_config: &str) -> anyhow::Result<String> {
    let mut config = match serde_json::from_str::<serde_json::Value>(plugin_config) {
        Ok(serde_json::Value::Object(config)) => config,
        _ => serde_json::Map::new(),
    };
    config.insert("role".into(), "attempts".into());
    Ok(serde_json::to_string(&config)?)
}

/// An access log format line's decision fields as the native build sets
/// them: each `%FILTER_STATE(wasm.sluice.<field>:PLAIN)%` (the wasm
/// build's filter state) as `%DYNAMIC_METADATA(sluice:<field>)%`.
pub fn native_log_format(line: &str) -> String {
    const WASM: (&str, &str) = ("%FILTER_STATE(wasm.sluice.", ":PLAIN)%");
    let mut out = String::new();
    let mut rest = line;
    while let Some(at) = rest.find(WASM.0) {
        let after = &rest[at + WASM.0.len()..];
        let Some(end) = after.find(WASM.1) else {
            break;
        };
        out.push_str(&rest[..at]);
        out.push_str(&format!("%DYNAMIC_METADATA(sluice:{})%", &after[..end]));
        rest = &after[end + WASM.1.len()..];
    }
    out.push_str(rest);
    out
}

/// Starts the Envoy binary on `config` with `workers` worker threads, its
/// log in `log_path`; with `cpus` (a `taskset` list), pinned to those CPUs.
pub fn spawn_envoy(
    config: &Path,
    workers: u32,
    log_path: &Path,
    cpus: Option<&str>,
) -> anyhow::Result<Child> {
    spawn_envoy_with_env(config, workers, log_path, cpus, &[])
}

/// As [`spawn_envoy`], with `env` added to Envoy's environment.
pub fn spawn_envoy_with_env(
    config: &Path,
    workers: u32,
    log_path: &Path,
    cpus: Option<&str>,
    env: &[(&str, &str)],
) -> anyhow::Result<Child> {
    let mut command = match cpus {
        Some(list) => {
            let mut c = Command::new("taskset");
            c.args(["-c", list]).arg(envoy_binary()?);
            c
        }
        None => Command::new(envoy_binary()?),
    };
    command
        .arg("-c")
        .arg(config)
        .args([
            "--concurrency",
            &workers.to_string(),
            "--use-dynamic-base-id",
            "--log-level",
            "warn",
        ])
        // Where a hot restart finds the shared memory region; a short drain
        // so that a hot restart's parent is gone within seconds.
        .arg("--base-id-path")
        .arg(base_id_path(log_path))
        .args(["--drain-time-s", "2", "--parent-shutdown-time-s", "4"])
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log_path)?)
        .spawn()
        .context("starting envoy")
}

fn base_id_path(log_path: &Path) -> PathBuf {
    log_path.with_extension("base-id")
}

/// How long an Envoy may take to come up before a test fails. Each one
/// compiles the wasm filter with V8's optimizing compiler (about 2
/// CPU-seconds): six tests starting their Envoys at once beside two busy
/// loops, on a slow day, left none live within 20 s (make test with two
/// busy loops, 2026-12-03). Waiting longer hides nothing: a test's
/// assertions start once its Envoy is live.
const READY_LIMIT: Duration = Duration::from_secs(90);

/// Waits until Envoy's admin on `admin_port` says LIVE: its listeners and
/// the filter's VMs are up. Fails with the log if Envoy exits first.
pub fn wait_live(
    child: &mut Child,
    admin_port: u16,
    log_path: &Path,
    limit: Duration,
) -> anyhow::Result<()> {
    let log = || std::fs::read_to_string(log_path).unwrap_or_default();
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if let Some(status) = child.try_wait()? {
            bail!("envoy exited ({status}); log:\n{}", log());
        }
        if http_get(admin_port, "/ready").is_ok_and(|body| body.trim() == "LIVE") {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!("envoy not ready after {limit:?}; log:\n{}", log())
}

/// A self-signed admin certificate for this test process (generated once,
/// as `sluice-admin --tls-self-signed` does): its directory holds ca.pem,
/// admin.pem and admin-key.pem.
pub fn test_admin_tls_dir() -> anyhow::Result<PathBuf> {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    if let Some(dir) = DIR.get() {
        return Ok(dir.clone());
    }
    let dir = std::env::temp_dir().join(format!("sluice-e2e-tls-{}", std::process::id()));
    sluice_admin::server::self_signed(&dir)?;
    Ok(DIR.get_or_init(|| dir).clone())
}

/// A shipped config's pinned CA file names turned into this process's test
/// certificate, so that Envoy can load them.
pub fn with_test_ca(config: &str) -> anyhow::Result<String> {
    let ca = test_admin_tls_dir()?.join("ca.pem").display().to_string();
    Ok(config
        .replace("\"var/tls/ca.pem\"", &format!("\"{ca}\""))
        .replace("\"/etc/sluice-tls/ca.pem\"", &format!("\"{ca}\"")))
}

/// `envoy --mode validate` of the configuration `config`, with `env` in
/// Envoy's environment: whether Envoy took it, and what it printed.
pub fn validate_config(config: &str, env: &[(&str, &str)]) -> anyhow::Result<(bool, String)> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("envoy.yaml");
    std::fs::write(&path, config)?;
    let out = Command::new(envoy_binary()?)
        .args(["--mode", "validate", "--log-level", "warn", "-c"])
        .arg(&path)
        .envs(env.iter().copied())
        .output()?;
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    Ok((out.status.success(), text))
}

/// A port for a process the test starts (see `sluice_test_ports`: never
/// one the kernel or another test may take meanwhile).
pub fn free_port() -> anyhow::Result<u16> {
    Ok(sluice_test_ports::free_port()?)
}

/// How many copies of the filter install each policy set in an Envoy with
/// `workers` worker threads: one VM per worker, and the root context Envoy
/// also runs on its main thread, which configures, ticks and syncs like the
/// others. An install count at `before + filter_vms(workers)` means every
/// worker has the new set; at `before + workers` one worker may still lack it.
pub fn filter_vms(workers: u32) -> f64 {
    f64::from(workers) + 1.0
}

pub struct Envoy {
    child: Child,
    pub admin_port: u16,
    pub listener_port: u16,
    dir: tempfile::TempDir,
    log_path: PathBuf,
    config: PathBuf,
    workers: u32,
    /// The process a hot restart took over from, reaped on drop.
    draining: Option<Child>,
}

impl Envoy {
    /// Starts Envoy with `--concurrency workers`, the filter configured with
    /// `plugin_config` (JSON), proxying to the mock on `mock_port`; waits
    /// until it is ready.
    pub fn start(plugin_config: &str, mock_port: u16, workers: u32) -> anyhow::Result<Self> {
        let template = std::fs::read_to_string(workspace_root().join("envoy/egress-test.yaml"))?;
        Self::start_with(&template, plugin_config, mock_port, workers)
    }

    pub fn start_with(
        template: &str,
        plugin_config: &str,
        mock_port: u16,
        workers: u32,
    ) -> anyhow::Result<Self> {
        // Port 9 (discard): nothing answers there; only tests that sync use it.
        Self::start_from(template, plugin_config, mock_port, 9, workers)
    }

    /// With the `sluice_admin` cluster pointing at `admin_api_port`.
    pub fn start_with_admin(
        plugin_config: &str,
        mock_port: u16,
        admin_api_port: u16,
        workers: u32,
    ) -> anyhow::Result<Self> {
        let template = std::fs::read_to_string(workspace_root().join("envoy/egress-test.yaml"))?;
        Self::start_from(&template, plugin_config, mock_port, admin_api_port, workers)
    }

    /// With the `sluice_admin` cluster spread over several admin replicas,
    /// health-checked every 200 ms so a dead one leaves the rotation.
    pub fn start_with_admins(
        plugin_config: &str,
        mock_port: u16,
        admin_api_ports: &[u16],
        workers: u32,
    ) -> anyhow::Result<Self> {
        let template = std::fs::read_to_string(workspace_root().join("envoy/egress-test.yaml"))?;
        let one = "        - endpoint:\n            address:\n              socket_address: { address: 127.0.0.1, port_value: {{ADMIN_API_PORT}} }\n";
        anyhow::ensure!(
            template.contains(one),
            "egress-test.yaml: the sluice_admin endpoint is not where this expects it"
        );
        let endpoints: String = admin_api_ports
            .iter()
            .map(|p| one.replace("{{ADMIN_API_PORT}}", &p.to_string()))
            .collect();
        let health = "    connect_timeout: 1s\n    health_checks:\n    - timeout: 0.5s\n      interval: 0.2s\n      no_traffic_interval: 0.2s\n      unhealthy_threshold: 1\n      healthy_threshold: 1\n      http_health_check: { path: /healthz }\n    load_assignment:\n      cluster_name: sluice_admin\n";
        let template = template.replace(one, &endpoints).replace(
            "    connect_timeout: 1s\n    load_assignment:\n      cluster_name: sluice_admin\n",
            health,
        );
        anyhow::ensure!(
            template.contains("http_health_check"),
            "egress-test.yaml: no sluice_admin cluster to health-check"
        );
        Self::start_from(&template, plugin_config, mock_port, 9, workers)
    }

    /// Syncing with an admin's `--tls-listen` on `admin_tls_port` over TLS,
    /// pinning the certificate `ca` (and the name sluice-admin).
    pub fn start_with_admin_tls(
        plugin_config: &str,
        mock_port: u16,
        admin_tls_port: u16,
        workers: u32,
        ca: &Path,
    ) -> anyhow::Result<Self> {
        let template = std::fs::read_to_string(workspace_root().join("envoy/egress-test.yaml"))?;
        let cluster = "  - name: sluice_admin\n    type: STATIC\n";
        anyhow::ensure!(
            template.contains(cluster),
            "egress-test.yaml: no sluice_admin cluster where this expects it"
        );
        let tls = format!(
            "{cluster}    transport_socket:\n      name: envoy.transport_sockets.tls\n      typed_config:\n        \"@type\": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext\n        sni: sluice-admin\n        common_tls_context:\n          validation_context:\n            trusted_ca: {{ filename: \"{}\" }}\n            match_typed_subject_alt_names:\n            - san_type: DNS\n              matcher: {{ exact: sluice-admin }}\n",
            ca.display()
        );
        Self::start_from(
            &template.replace(cluster, &tls),
            plugin_config,
            mock_port,
            admin_tls_port,
            workers,
        )
    }

    /// From `template` (as `envoy/egress-test.yaml`, changed by the
    /// test), the `sluice_admin` cluster pointing at `admin_api_port`.
    pub fn start_from(
        template: &str,
        plugin_config: &str,
        mock_port: u16,
        admin_api_port: u16,
        workers: u32,
    ) -> anyhow::Result<Self> {
        Self::start_from_env(
            template,
            plugin_config,
            mock_port,
            admin_api_port,
            workers,
            &[],
        )
    }

    /// As [`Self::start_from`], with `env` added to Envoy's environment
    /// (the wasm VM sees only what the template's `vm_config` lists).
    pub fn start_from_env(
        template: &str,
        plugin_config: &str,
        mock_port: u16,
        admin_api_port: u16,
        workers: u32,
        env: &[(&str, &str)],
    ) -> anyhow::Result<Self> {
        let admin_port = free_port()?;
        let listener_port = free_port()?;
        let native;
        let (template, wasm) = match filter_build() {
            // A stock Envoy's (no Sluice filter): either build's pass.
            _ if !template.contains("{{WASM}}") => (template, PathBuf::new()),
            FilterBuild::Wasm => (template, filter_wasm()?),
            FilterBuild::Native => {
                let module = filter_native()?;
                native = with_native_filter(template, &module)?;
                (native.as_str(), module)
            }
        };
        // The attempts filter's (an upstream filter of pool members):
        // the same configuration, its role `attempts`.
        let attempts_config = attempts_role(plugin_config)?;
        // The configuration is a single-quoted YAML scalar.
        let quoted = |config: &str| config.replace('\n', " ").replace('\'', "''");
        let (plugin_config, attempts_config) = (quoted(plugin_config), quoted(&attempts_config));
        let dir = tempfile::tempdir()?;
        let access_log = dir.path().join("access.log");
        let yaml = template
            .replace("{{ADMIN_PORT}}", &admin_port.to_string())
            .replace("{{LISTENER_PORT}}", &listener_port.to_string())
            .replace("{{MOCK_PORT}}", &mock_port.to_string())
            .replace("{{ADMIN_API_PORT}}", &admin_api_port.to_string())
            .replace("{{ACCESS_LOG}}", &access_log.display().to_string())
            .replace("{{WASM}}", &wasm.display().to_string())
            .replace("{{PLUGIN_CONFIG}}", &plugin_config)
            .replace("{{ATTEMPTS_PLUGIN_CONFIG}}", &attempts_config);
        let config = dir.path().join("envoy.yaml");
        std::fs::write(&config, yaml)?;
        let log_path = dir.path().join("envoy.log");
        let child = spawn_envoy_with_env(&config, workers, &log_path, None, env)?;
        let mut envoy = Self {
            child,
            admin_port,
            listener_port,
            dir,
            log_path,
            config,
            workers,
            draining: None,
        };
        envoy.wait_ready()?;
        Ok(envoy)
    }

    fn wait_ready(&mut self) -> anyhow::Result<()> {
        wait_live(
            &mut self.child,
            self.admin_port,
            &self.log_path,
            READY_LIMIT,
        )
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// The access log of a configuration from `envoy/egress-test.yaml`:
    /// a line per call, with Sluice's decision.
    pub fn access_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("access.log")).unwrap_or_default()
    }

    /// Envoy's hot restart: a second process (epoch 1) takes the
    /// listening sockets over from this one, which drains for 2 s and is
    /// told to exit after 4 s. Returns once the new one is live, with the
    /// old one's pid.
    pub fn hot_restart(&mut self) -> anyhow::Result<u32> {
        let base_id = std::fs::read_to_string(base_id_path(&self.log_path))
            .context("reading the base id of the running Envoy")?;
        let new_log = self.log_path.with_extension("epoch1.log");
        let child = Command::new(envoy_binary()?)
            .arg("-c")
            .arg(&self.config)
            .args([
                "--concurrency",
                &self.workers.to_string(),
                "--base-id",
                base_id.trim(),
                "--restart-epoch",
                "1",
                "--log-level",
                "warn",
                "--drain-time-s",
                "2",
                "--parent-shutdown-time-s",
                "4",
            ])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&new_log)?)
            .spawn()
            .context("starting envoy's hot restart")?;
        let parent = std::mem::replace(&mut self.child, child);
        let parent_pid = parent.id();
        self.draining = Some(parent);
        self.log_path = new_log;
        let live = self.wait_ready();
        live.map(|_| parent_pid)
    }

    /// SIGKILL (a crash: no drain, no goodbye), then the same binary on the
    /// same configuration and ports; returns once the new one is live.
    pub fn kill_and_restart(&mut self) -> anyhow::Result<()> {
        self.kill();
        self.restart()
    }

    /// SIGKILL, and waits until the process is gone.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the same Envoy again after `kill`, and waits until it is ready.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        let previous = self.log();
        self.child = spawn_envoy(&self.config, self.workers, &self.log_path, None)?;
        self.wait_ready()
            .with_context(|| format!("restarting; the killed one logged:\n{previous}"))
    }

    /// Stops the process (SIGSTOP) for `span`, then lets it go on
    /// (SIGCONT): an Envoy its machine did not run for a while.
    pub fn pause(&self, span: Duration) -> anyhow::Result<()> {
        let pid = Pid::from_raw(i32::try_from(self.pid())?);
        kill(pid, Signal::SIGSTOP).context("SIGSTOP")?;
        std::thread::sleep(span);
        kill(pid, Signal::SIGCONT).context("SIGCONT")?;
        Ok(())
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.listener_port)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `/stats/prometheus`, parsed into (name with labels, value).
    pub fn prometheus(&self) -> anyhow::Result<Vec<(String, f64)>> {
        let text = http_get(self.admin_port, "/stats/prometheus")?;
        Ok(text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| {
                let (name, value) = l.rsplit_once(' ')?;
                Some((name.to_string(), value.parse().ok()?))
            })
            .collect())
    }

    /// A per-policy stat from `/stats/prometheus`, e.g. `("admitted", "bank")`.
    pub fn policy_stat(&self, stat: &str, policy: &str) -> anyhow::Result<f64> {
        let want = format!(
            "{}sluice_policy_{stat}{{sluice_policy=\"{policy}\"}}",
            prometheus_prefix()
        );
        self.prometheus()?
            .into_iter()
            .find(|(n, _)| *n == want)
            .map(|(_, v)| v)
            .with_context(|| format!("no {want} in /stats/prometheus"))
    }

    /// A per-policy gauge (e.g. `in_flight`): from `/stats/prometheus` if
    /// Envoy lists it there, else from `/stats`.
    pub fn gauge(&self, policy: &str, stat: &str) -> anyhow::Result<f64> {
        if let Ok(v) = self.policy_stat(stat, policy) {
            return Ok(v);
        }
        let want = stats_line("policy", policy, stat);
        let text = http_get(self.admin_port, "/stats")?;
        text.lines()
            .find_map(|l| l.strip_prefix(&want))
            .and_then(|v| v.trim().parse().ok())
            .with_context(|| format!("no {want} in /stats"))
    }

    /// A stat of a further limit, e.g. `("company", "tokens")`, from `/stats`.
    pub fn limit_stat(&self, limit: &str, stat: &str) -> anyhow::Result<f64> {
        let want = stats_line("limit", limit, stat);
        let text = http_get(self.admin_port, "/stats")?;
        text.lines()
            .find_map(|l| l.strip_prefix(&want))
            .and_then(|v| v.trim().parse().ok())
            .with_context(|| format!("no {want} in /stats"))
    }

    /// [`Self::limit_stat`] summed over every scope that has it: the
    /// native build's upstream filters (`role: attempts`) count in their
    /// cluster's scope (`cluster.<name>.dynamicmodulescustom...`), the wasm
    /// build's in the one root scope.
    pub fn limit_stat_total(&self, limit: &str, stat: &str) -> anyhow::Result<f64> {
        let want = stats_line("limit", limit, stat);
        let want = want.trim_end_matches(": ");
        let text = http_get(self.admin_port, "/stats")?;
        Ok(text
            .lines()
            .filter_map(|l| l.split_once(": "))
            .filter(|(name, _)| name.ends_with(want))
            .filter_map(|(_, v)| v.trim().parse::<f64>().ok())
            .sum())
    }

    /// A filter-wide stat, e.g. `cas_retries`.
    pub fn filter_stat(&self, stat: &str) -> anyhow::Result<f64> {
        let want = format!("{}sluice_{stat}{{}}", prometheus_prefix());
        self.prometheus()?
            .into_iter()
            .find(|(n, _)| *n == want)
            .map(|(_, v)| v)
            .with_context(|| format!("no {want} in /stats/prometheus"))
    }
}

/// What Envoy's Prometheus output puts before the filter's series: the
/// wasm filter's custom stats namespace is left out, a dynamic module's is
/// not.
pub fn prometheus_prefix() -> &'static str {
    match filter_build() {
        FilterBuild::Wasm => "",
        FilterBuild::Native => "envoy_dynamicmodulescustom_",
    }
}

/// How `/stats` names a stat of a policy or limit (`family`): the wasm
/// filter's name, or the native module's (one stat per kind, labelled by
/// the policy or limit; Prometheus shows both alike).
fn stats_line(family: &str, owner: &str, stat: &str) -> String {
    match filter_build() {
        FilterBuild::Wasm => format!("wasmcustom.sluice.{family}.{owner}.{stat}: "),
        FilterBuild::Native => {
            format!("dynamicmodulescustom.sluice_{family}_{stat}.sluice_{family}.{owner}: ")
        }
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // A failing assertion: what Envoy said last (with the test config,
        // every answer of 500 or more and why) beside the test's output.
        if std::thread::panicking() {
            let log = self.log();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            eprintln!("--- the end of Envoy's log ({}):", self.log_path.display());
            for line in tail.iter().rev() {
                eprintln!("{line}");
            }
        }
        if let Some(mut parent) = self.draining.take() {
            let _ = parent.kill();
            let _ = parent.wait();
        }
    }
}

/// A blocking GET on 127.0.0.1 (for Envoy's admin port), which the tests
/// call from outside the async runtime's worker tasks.
pub fn http_get(port: u16, path: &str) -> anyhow::Result<String> {
    let url = format!("http://127.0.0.1:{port}{path}");
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(5)))
        .build()
        .into();
    let body = agent
        .get(&url)
        .call()
        .with_context(|| format!("GET {url}"))?
        .body_mut()
        .read_to_string()
        .with_context(|| format!("reading GET {url}"))?;
    Ok(body)
}
