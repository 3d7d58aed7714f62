//! The shipped `deploy/prometheus` config and alert rules and the
//! `deploy/grafana` dashboard, against a real Prometheus (Debian's, from
//! `make setup`) scraping a real Envoy and the real admin under load.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use futures_util::StreamExt;
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
    // Every alert the file holds is a rule promtool found.
    let shipped = std::fs::read_to_string(deploy("prometheus/alerts.yml"))?;
    let alerts = shipped
        .lines()
        .filter(|l| l.trim_start().starts_with("- alert:"))
        .count();
    assert!(alerts >= 6, "{alerts} alerts in alerts.yml");
    assert!(
        rules.contains(&format!("SUCCESS: {alerts} rules found")),
        "{rules}"
    );
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

    /// Waits until Prometheus says it is ready: until then its API answers
    /// 503 in plain text (on a busy machine, for seconds after it starts).
    async fn ready(&mut self) -> anyhow::Result<()> {
        let url = format!("http://127.0.0.1:{}/-/ready", self.port);
        load::until_healthy(&mut self.child, &url, Duration::from_secs(30))
            .await
            .context("prometheus not ready")
    }

    async fn get(&self, path: &str, query: &[(&str, &str)]) -> anyhow::Result<Value> {
        let resp = reqwest::Client::new()
            .get(format!("http://127.0.0.1:{}{path}", self.port))
            .query(query)
            .send()
            .await?;
        let status = resp.status();
        let text = resp.text().await?;
        serde_json::from_str::<Value>(&text).with_context(|| {
            format!(
                "{path}: {status}: {}",
                text.chars().take(200).collect::<String>()
            )
        })
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
    let mut prometheus = Prometheus::start(
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
    prometheus.ready().await?;

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

/// Hostile sync reports through the real admin binary: 100 instance ids,
/// each report naming 1 000 policies, limits, keyed policies and budgets
/// the set does not have, for 25 s (at 10 s every id is known; each
/// report after it names 1 000 new names). Only the set's names become
/// series (and live entries, stored records): `/metrics` has one series
/// per policy in the set, passes `promtool check metrics`, and the
/// admin's memory stays flat. Instance ids that could break a scrape are
/// refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_reports_shape_neither_the_metrics_nor_the_admins_memory() -> anyhow::Result<()> {
    use sluice_wire::sync::{BudgetReport, LimitReport, PolicyReport, SyncReport};
    const INSTANCES: usize = 100;
    // 25 s, not a minute: a name kept per report would add about 5 000 000
    // names (hundreds of MiB) after the 10 s mark, far past the 20 MiB allowed.
    const RUN: Duration = Duration::from_secs(25);
    let dir = tempfile::tempdir()?;
    let admin = sluice_e2e::admin::AdminProcess::start_in(dir.path(), &[]).await?;
    let operator = admin.login().await?;
    let set = [
        json!({"name": "bank", "match": {"host": "api.bank.example"}, "rate": {"requests": 100, "period": "1s"},
               "limits": [{"name": "bank-daily", "rate": {"requests": 100000, "period": "1d"}}]}),
        json!({"name": "maps", "match": {"host": "api.maps.example"}, "key": {"header": "x-api-key"},
               "rate": {"requests": 10, "period": "1s"}}),
        json!({"name": "llm", "match": {"host": "api.llm.example"}, "concurrency": {"max_in_flight": 8}}),
    ];
    for policy in set {
        operator.create(policy).await?;
    }
    let report = |i: usize, n: u64| {
        let mut r = SyncReport {
            instance: format!("hostile-{i}"),
            policy_version: 3,
            at_ms: 1_800_000_000_000 + n * 1_000,
            ..SyncReport::default()
        };
        let mut counts = PolicyReport::default();
        counts
            .counts
            .set(sluice_wire::stats::PolicyCounter::Admitted, n * 10);
        for name in ["bank", "maps", "llm"] {
            r.policies.insert(name.into(), counts);
        }
        r.limits.insert("bank-daily".into(), LimitReport::default());
        for j in 0..480 {
            r.policies.insert(format!("made-up-{i}-{n}-{j}"), counts);
            r.limits
                .insert(format!("made-up-limit-{i}-{n}-{j}"), LimitReport::default());
        }
        for j in 0..20 {
            r.keys
                .insert(format!("made-up-keyed-{i}-{n}-{j}"), Default::default());
            r.budgets
                .insert(format!("made-up-budget-{j}"), BudgetReport::default());
        }
        r
    };
    let http = reqwest::Client::new();
    let url = format!("{}/api/v1/sync", admin.base());
    let send = |body: String| {
        http.post(&url)
            .header("authorization", format!("Bearer {SYNC_TOKEN}"))
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    // Ids that would break a scrape or a log line: refused.
    let mut refused = 0;
    for bad in ["a\"} 1\n", "a b", "évian", "x/../y", ""] {
        let mut r = report(0, 0);
        r.instance = bad.into();
        if send(serde_json::to_string(&r)?).await?.status() == 400 {
            refused += 1;
        }
    }
    let started = Instant::now();
    let mut rss = Vec::new();
    let (mut sent, mut accepted, mut n) = (0u64, 0u64, 0u64);
    while started.elapsed() < RUN {
        let bodies: Vec<String> = (0..INSTANCES)
            .map(|i| serde_json::to_string(&report(i, n)))
            .collect::<Result<_, _>>()?;
        let mut answers =
            futures_util::stream::iter(bodies.into_iter().map(&send)).buffer_unordered(4);
        while let Some(answer) = answers.next().await {
            sent += 1;
            accepted +=
                u64::from(answer.is_ok_and(|a| a.status().is_success() || a.status() == 304));
        }
        n += 1;
        rss.push((
            started.elapsed(),
            sluice_e2e::procinfo::rss_mib(admin.pid())?,
        ));
    }
    let metrics = http
        .get(format!("{}/metrics", admin.base()))
        .send()
        .await?
        .text()
        .await?;
    let path = dir.path().join("metrics.txt");
    std::fs::write(&path, &metrics)?;
    let check = Command::new("sh")
        .arg("-c")
        .arg(format!("promtool check metrics < {}", path.display()))
        .output()?;
    let labels = |label: &str| -> std::collections::BTreeSet<String> {
        metrics
            .lines()
            .filter(|l| l.starts_with("sluice_admin_"))
            .filter_map(|l| {
                l.split(&format!("{label}=\""))
                    .nth(1)?
                    .split('"')
                    .next()
                    .map(String::from)
            })
            .collect()
    };
    let (policies, limits, instances) = (labels("policy"), labels("limit"), labels("instance"));
    let series = metrics
        .lines()
        .filter(|l| l.starts_with("sluice_admin_"))
        .count();
    // Memory after the first 10 s (warm: every instance known) and at the end.
    let warm = rss
        .iter()
        .find(|(at, _)| *at >= Duration::from_secs(10))
        .map_or(0.0, |(_, m)| *m);
    let end = rss.last().map_or(0.0, |(_, m)| *m);
    let peak = rss.iter().map(|(_, m)| *m).fold(0.0, f64::max);
    println!(
        "hostile reports: {refused} of 5 bad instance ids refused; {sent} reports ({accepted} answered) from {INSTANCES} ids \
         in {:.0?}, 1 000 made-up names each; /metrics: {series} series, policy labels {policies:?}, limit labels {limits:?}, \
         {} instance labels, promtool check metrics: {}; admin RSS {warm:.1} MiB at 10 s, {end:.1} MiB at the end, peak {peak:.1} MiB",
        started.elapsed(),
        instances.len(),
        if check.status.success() { "ok".to_string() } else { String::from_utf8_lossy(&check.stderr).to_string() },
    );
    assert_eq!(refused, 5);
    assert!(check.status.success(), "promtool check metrics failed");
    let names = |v: &[&str]| {
        v.iter()
            .map(|s| s.to_string())
            .collect::<std::collections::BTreeSet<_>>()
    };
    assert_eq!(
        policies,
        names(&["bank", "llm", "maps"]),
        "one series per policy in the set"
    );
    assert!(limits.is_subset(&names(&["bank-daily"])), "{limits:?}");
    assert!(instances.len() <= INSTANCES, "{}", instances.len());
    assert!(accepted > 0);
    assert!(
        end < warm + 20.0,
        "admin memory grew from {warm:.1} to {end:.1} MiB"
    );
    Ok(())
}
