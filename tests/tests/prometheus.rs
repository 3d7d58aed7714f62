//! The shipped `deploy/prometheus` config and alert rules and the
//! `deploy/grafana` dashboard, against a real Prometheus (Debian's, from
//! `make setup`) scraping a real Envoy and the real admin under load.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::{json, Value};
use sluice_demo::provider::{MockProvider, Signals};
use sluice_e2e::admin::{AdminServer, SYNC_TOKEN};
use sluice_e2e::envoy::{free_port, workspace_root, Envoy};
use sluice_e2e::load;

fn deploy(path: &str) -> PathBuf {
    workspace_root().join("deploy").join(path)
}

fn promtool(args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new("promtool")
        .args(args)
        .output()
        .context("running promtool (make setup installs Debian's prometheus)")?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        bail!("promtool {args:?} failed: {text}");
    }
    Ok(text)
}

#[test]
fn the_shipped_config_and_rules_pass_promtool() -> anyhow::Result<()> {
    let config = promtool(&[
        "check",
        "config",
        deploy("prometheus/prometheus.yml")
            .to_str()
            .unwrap_or_default(),
    ])?;
    let rules = promtool(&[
        "check",
        "rules",
        deploy("prometheus/alerts.yml").to_str().unwrap_or_default(),
    ])?;
    let tests = promtool(&[
        "test",
        "rules",
        deploy("prometheus/alerts_test.yml")
            .to_str()
            .unwrap_or_default(),
    ])?;
    assert!(rules.contains("SUCCESS: 4 rules found"), "{rules}");
    assert!(tests.contains("SUCCESS"), "{tests}");
    println!(
        "promtool: {} | {} | {}",
        config.trim().replace('\n', " "),
        rules.trim().replace('\n', " "),
        tests.trim().replace('\n', " ")
    );
    Ok(())
}

/// A Prometheus of our own on a free port, stopped (by PID) on drop.
struct Prometheus {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    /// Scraping `targets` (job, address, path) every second, with the
    /// shipped rules whose `for:` is `rule_for` (the shipped 5 m would
    /// outlast the test).
    fn start(targets: &[(&str, String, &str)], rule_for: &str) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let rules = std::fs::read_to_string(deploy("prometheus/alerts.yml"))?;
        let rules = rules
            .replace("for: 5m", &format!("for: {rule_for}"))
            .replace("for: 1m", &format!("for: {rule_for}"));
        std::fs::write(dir.path().join("alerts.yml"), rules)?;
        let shipped = std::fs::read_to_string(deploy("prometheus/prometheus.yml"))?;
        anyhow::ensure!(
            shipped.contains("rule_files:\n  - alerts.yml"),
            "the shipped config names alerts.yml"
        );
        let scrapes: String = targets
            .iter()
            .map(|(job, addr, path)| {
                format!("  - job_name: {job}\n    metrics_path: {path}\n    static_configs:\n      - targets: [\"{addr}\"]\n")
            })
            .collect();
        let config = format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - alerts.yml\nscrape_configs:\n{scrapes}"
        );
        std::fs::write(dir.path().join("prometheus.yml"), config)?;
        promtool(&[
            "check",
            "config",
            dir.path()
                .join("prometheus.yml")
                .to_str()
                .unwrap_or_default(),
        ])?;
        let port = free_port()?;
        let log = std::fs::File::create(dir.path().join("prometheus.log"))?;
        let child = Command::new("prometheus")
            .arg(format!(
                "--config.file={}",
                dir.path().join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting prometheus (make setup installs it)")?;
        Ok(Self {
            child,
            port,
            _dir: dir,
        })
    }

    async fn get(&self, path: &str, query: &[(&str, &str)]) -> anyhow::Result<Value> {
        let resp = reqwest::Client::new()
            .get(format!("http://127.0.0.1:{}{path}", self.port))
            .query(query)
            .send()
            .await?;
        let text = resp.text().await?;
        Ok(serde_json::from_str::<Value>(&text)?)
    }

    /// An instant query's result vector.
    async fn query(&self, expr: &str) -> anyhow::Result<Vec<Value>> {
        let answer = self.get("/api/v1/query", &[("query", expr)]).await?;
        if answer["status"] != "success" {
            bail!("{expr}: {answer}");
        }
        Ok(answer["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default())
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn dashboard_queries(path: &Path) -> anyhow::Result<Vec<(String, String)>> {
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(path)?)?;
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().context("no panels")? {
        for target in panel["targets"]
            .as_array()
            .context("a panel without targets")?
        {
            queries.push((
                panel["title"].as_str().unwrap_or_default().to_string(),
                target["expr"]
                    .as_str()
                    .context("a target without expr")?
                    .to_string(),
            ));
        }
    }
    Ok(queries)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_load_every_dashboard_query_returns_data_and_the_saturation_alert_fires(
) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let admin = AdminServer::start(dir.path().join("sluice.db"), 0).await?;
    let op = admin.login().await?;
    // A limit the load saturates, listening to its provider; a queue whose
    // calls wait out their max_wait; a concurrency limit.
    op.create(
        json!({"name": "bank", "match": {"host": "api.bank.example"},
        "rate": {"requests": 20, "period": "1s"},
        "limits": [{"name": "bank-provider", "rate": {"requests": 1000, "period": "1s"},
                    "provider": {"headers": "openai-requests", "max_pause": "2s"}}]}),
    )
    .await?;
    op.create(json!({"name": "llm", "match": {"host": "api.llm.example"},
        "rate": {"requests": 5, "period": "1s"}, "concurrency": {"max_in_flight": 2},
        "on_limit": {"action": "queue", "max_wait": "200ms"}}))
        .await?;
    let provider = MockProvider::start(1000, Signals::OpenAi, Duration::from_millis(5)).await?;
    let config = json!({"instance": "prometheus-envoy", "admin_cluster": "sluice_admin",
        "sync_interval": "250ms", "sync_token": SYNC_TOKEN, "fallback": {"version": 1, "policies": []}})
    .to_string();
    let envoy = Envoy::start_with_admin(&config, provider.addr.port(), admin.port, 2)?;
    let prometheus = Prometheus::start(
        &[
            (
                "envoy",
                format!("127.0.0.1:{}", envoy.admin_port),
                "/stats/prometheus",
            ),
            (
                "sluice-admin",
                format!("127.0.0.1:{}", admin.port),
                "/metrics",
            ),
        ],
        "5s",
    )?;

    let run = Duration::from_secs(25);
    let bank = envoy.url("/v1/orders");
    let llm = envoy.url("/v1/chat");
    let bank_load = tokio::spawn(load::closed_loop(4, run, move |c, _| {
        c.get(&bank).header("host", "api.bank.example")
    }));
    let llm_load = tokio::spawn(load::closed_loop(6, run, move |c, _| {
        c.get(&llm).header("host", "api.llm.example")
    }));

    // Every query of the dashboard returns data once the load has run a
    // while (rates over [1m] need two scrapes).
    let queries = dashboard_queries(&deploy("grafana/sluice.json"))?;
    assert_eq!(queries.len(), 17, "the dashboard's queries");
    let started = Instant::now();
    let mut empty: Vec<String> = queries.iter().map(|(_, q)| q.clone()).collect();
    let mut sample = Vec::new();
    while !empty.is_empty() && started.elapsed() < Duration::from_secs(20) {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let mut still = Vec::new();
        for expr in empty {
            let result = prometheus.query(&expr).await?;
            if result.is_empty() {
                still.push(expr);
            } else if sample.len() < 4 {
                sample.push(format!("{expr} = {}", result[0]["value"][1]));
            }
        }
        empty = still;
    }
    assert!(
        empty.is_empty(),
        "dashboard queries without data after {:?}: {empty:?}",
        started.elapsed()
    );
    let all_data = started.elapsed();

    // The saturation alert fires (its `for` shortened to 5 s).
    let mut firing = Vec::new();
    while started.elapsed() < Duration::from_secs(24) {
        let alerts = prometheus.get("/api/v1/alerts", &[]).await?;
        firing = alerts["data"]["alerts"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .filter(|a| a["state"] == "firing")
            .map(|a| {
                format!(
                    "{}{{{}}}",
                    a["labels"]["alertname"].as_str().unwrap_or(""),
                    a["labels"]["policy"]
                        .as_str()
                        .or(a["labels"]["sluice_policy"].as_str())
                        .unwrap_or("")
                )
            })
            .collect();
        if firing.iter().any(|a| a == "SluiceLimitSaturated{bank}") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let fired_after = started.elapsed();
    let saturation = prometheus
        .query("sluice_admin_policy_rejected_per_second{policy=\"bank\"}")
        .await?;
    let (bank_outcomes, llm_outcomes) = (bank_load.await?, llm_load.await?);
    println!(
        "prometheus: all {} dashboard queries returned data {all_data:?} into the load (e.g. {}); firing after {fired_after:?}: {firing:?}; bank refused {}/s then; clients: bank {} calls, llm {} calls",
        queries.len(),
        sample.join("; "),
        saturation.first().map(|r| r["value"][1].to_string()).unwrap_or_default(),
        bank_outcomes.len(),
        llm_outcomes.len(),
    );
    assert!(
        firing.iter().any(|a| a == "SluiceLimitSaturated{bank}"),
        "the saturation alert did not fire: {firing:?}"
    );
    assert!(
        !firing
            .iter()
            .any(|a| a.starts_with("SluiceInstanceNotSyncing")),
        "a syncing Envoy reported as not syncing: {firing:?}"
    );
    Ok(())
}
