//! `envoy/docker-compose.yml` run for real, with Debian's podman and
//! podman-compose (PyPI), by `make compose-test` (not part of `make test`:
//! it builds the images first, about a quarter of an hour on two cores).
//! Images a registry would give are stand-ins built here under the same
//! names (`tests/compose/standins.sh`). Checked through the published
//! ports, as a user would: the admin answers and serves its UI, Envoy syncs
//! with it over TLS pinning the certificate the admin generated, a call
//! through the egress listener is limited, an edit made in the admin
//! reaches Envoy, Envoy holds the limits while the admin's container is
//! killed and syncs again once it is started, and `down` leaves nothing
//! running.

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use serde_json::{json, Value};
use sluice_e2e::envoy::workspace_root;

/// The compose project's name (`name:` in the file).
const PROJECT: &str = "sluice";
const ADMIN: &str = "http://127.0.0.1:8080";
const EGRESS: &str = "http://127.0.0.1:10000";
const ENVOY_ADMIN: &str = "http://127.0.0.1:9901";
const DEMO_API: &str = "http://127.0.0.1:9090";

fn podman_compose() -> anyhow::Result<PathBuf> {
    let path = std::env::var_os("SLUICE_PODMAN_COMPOSE")
        .map(PathBuf::from)
        .context("SLUICE_PODMAN_COMPOSE is not set: run `make compose-test`")?;
    ensure!(path.exists(), "{} is not there", path.display());
    Ok(path)
}

fn run(program: &std::path::Path, args: &[&str]) -> anyhow::Result<Output> {
    let output = Command::new(program)
        .args(args)
        .current_dir(workspace_root())
        .output()
        .with_context(|| format!("running {} {args:?}", program.display()))?;
    Ok(output)
}

/// What a command printed, stdout then stderr.
fn printed(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

fn compose(args: &[&str]) -> anyhow::Result<String> {
    let mut all = vec!["-f", "envoy/docker-compose.yml"];
    all.extend_from_slice(args);
    let output = run(&podman_compose()?, &all)?;
    let text = printed(&output);
    ensure!(
        output.status.success(),
        "podman-compose {args:?} failed:\n{text}"
    );
    Ok(text)
}

fn podman(args: &[&str]) -> anyhow::Result<()> {
    let output = run(std::path::Path::new("podman"), args)?;
    ensure!(
        output.status.success(),
        "podman {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(())
}

/// The project's containers, running or not (name and status).
fn containers() -> anyhow::Result<Vec<String>> {
    let label = format!("label=io.podman.compose.project={PROJECT}");
    let output = run(
        std::path::Path::new("podman"),
        &[
            "ps",
            "--all",
            "--filter",
            &label,
            "--format",
            "{{.Names}} {{.Status}}",
        ],
    )?;
    ensure!(output.status.success(), "podman ps failed");
    Ok(String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(str::to_string)
        .collect())
}

fn logs(service: &str) -> String {
    run(
        std::path::Path::new("podman"),
        &["logs", "--tail", "40", &format!("{PROJECT}_{service}_1")],
    )
    .map(|o| printed(&o))
    .unwrap_or_default()
}

/// Takes the stack down (volumes too) however the test ends.
struct Stack;

impl Drop for Stack {
    fn drop(&mut self) {
        let _ = compose(&["down", "--volumes"]);
    }
}

async fn until<T>(
    what: &str,
    limit: Duration,
    mut check: impl AsyncFnMut() -> Option<T>,
) -> anyhow::Result<(T, Duration)> {
    let started = Instant::now();
    loop {
        if let Some(found) = check().await {
            return Ok((found, started.elapsed()));
        }
        if started.elapsed() > limit {
            bail!("{what}: not within {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Envoy's counters, by name (`/stats`, text).
async fn envoy_stats(http: &reqwest::Client) -> Option<Vec<(String, f64)>> {
    let text = http
        .get(format!("{ENVOY_ADMIN}/stats"))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    Some(
        text.lines()
            .filter_map(|l| l.split_once(": "))
            .filter_map(|(n, v)| Some((n.to_string(), v.trim().parse().ok()?)))
            .collect(),
    )
}

fn stat(stats: &[(String, f64)], name: &str) -> f64 {
    stats
        .iter()
        .find(|(n, _)| n == name)
        .map_or(0.0, |(_, v)| *v)
}

/// What a burst of calls at once through the egress listener met.
#[derive(Debug)]
struct Burst {
    ok: usize,
    refused: usize,
    /// The policies the refusals named (`x-sluice-policy`).
    named: Vec<String>,
    /// The longest `Retry-After` of a refusal, in seconds.
    retry_after: u64,
    took: Duration,
}

/// `calls` calls at once to `host`, with `x-api-key: compose`.
async fn burst(http: &reqwest::Client, host: &str, calls: usize) -> anyhow::Result<Burst> {
    let started = Instant::now();
    let sent = (0..calls).map(|_| {
        http.get(format!("{EGRESS}/v1/pay"))
            .header("host", host)
            .header("x-api-key", "compose")
            .send()
    });
    let answers = futures_util::future::join_all(sent).await;
    let mut met = Burst {
        ok: 0,
        refused: 0,
        named: Vec::new(),
        retry_after: 0,
        took: started.elapsed(),
    };
    for answer in answers {
        let answer = answer.context("a call through the egress listener")?;
        let header = |name: &str| {
            answer
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_string()
        };
        match answer.status().as_u16() {
            200 => met.ok += 1,
            429 => {
                met.refused += 1;
                let policy = header("x-sluice-policy");
                if !met.named.contains(&policy) {
                    met.named.push(policy);
                }
                let wait = header("retry-after").parse().unwrap_or(0);
                met.retry_after = met.retry_after.max(wait);
            }
            other => bail!("{host}: status {other}"),
        }
    }
    Ok(met)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_compose_setup_runs_as_the_readme_says() -> anyhow::Result<()> {
    let leftover = containers()?;
    ensure!(
        leftover.is_empty(),
        "containers of {PROJECT} before the test: {leftover:?}"
    );
    let stack = Stack;
    let started = Instant::now();
    // Built by `make compose-test`; `up` builds nothing then.
    compose(&["up", "--detach", "--no-build"])?;
    let up = started.elapsed();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()?;

    // The admin answers, with its UI and the demo's seeded policies.
    let (_, admin_after) = until(
        "the admin's /healthz",
        Duration::from_secs(60),
        async || {
            let r = http.get(format!("{ADMIN}/healthz")).send().await.ok()?;
            r.status().is_success().then_some(())
        },
    )
    .await
    .with_context(|| logs("admin"))?;
    let index = http.get(format!("{ADMIN}/")).send().await?.text().await?;
    ensure!(
        index.contains("<html") || index.contains("<!DOCTYPE"),
        "no UI: {index}"
    );
    let policies: Value = http
        .get(format!("{ADMIN}/api/v1/policies"))
        .send()
        .await?
        .json()
        .await?;
    let names: Vec<&str> = policies["policies"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|p| p["policy"]["name"].as_str())
                .collect()
        })
        .unwrap_or_default();
    ensure!(
        names.contains(&"bank") && names.contains(&"fx"),
        "{names:?}"
    );

    // Envoy comes up once the admin wrote its certificate (it restarts
    // until then), and syncs over TLS: handshakes on the admin's cluster,
    // the filter's syncs counted, the admin listing the Envoy on its set.
    let (_, envoy_after) = until("Envoy ready", Duration::from_secs(90), async || {
        let r = http.get(format!("{ENVOY_ADMIN}/ready")).send().await.ok()?;
        r.status().is_success().then_some(())
    })
    .await
    .with_context(|| logs("envoy"))?;
    let version = policies["version"].as_u64().context("no set version")?;
    let (stats, synced_after) = until(
        "Envoy syncing over TLS",
        Duration::from_secs(30),
        async || {
            let stats = envoy_stats(&http).await?;
            let synced = stat(&stats, "cluster.sluice_admin.ssl.handshake") > 0.0
                && stats
                    .iter()
                    .any(|(n, v)| n.ends_with("sluice.sync_ok") && *v > 0.0);
            synced.then_some(stats)
        },
    )
    .await
    .with_context(|| logs("envoy"))?;
    let instance = |list: &Value| {
        list["instances"]
            .as_array()
            .and_then(|a| a.iter().find(|i| i["id"] == "compose-envoy").cloned())
    };
    let (listed, _) = until(
        "the admin listing compose-envoy",
        Duration::from_secs(10),
        async || {
            let list: Value = http
                .get(format!("{ADMIN}/api/v1/instances"))
                .send()
                .await
                .ok()?
                .json()
                .await
                .ok()?;
            instance(&list).filter(|i| i["policy_version"].as_u64() >= Some(version))
        },
    )
    .await?;
    ensure!(
        stat(&stats, "cluster.sluice_admin.ssl.fail_verify_error") == 0.0,
        "Envoy refused the admin's certificate"
    );

    // A call through the egress listener is limited: bank allows 100 a
    // second with a burst of 10, and refuses past it. Not all of the
    // burst need pass: a worker's prefetch (a quarter of what the bucket
    // holds, spent within 5 ms or lapsed) can leave tokens unspent, at
    // most 2 of a full bucket of 10 for each of Envoy's two workers (a
    // clean CI run passed 9 of 100, another 11).
    let bank = burst(&http, "api.bank.example", 100).await?;
    let most = 10.0 + 100.0 * bank.took.as_secs_f64() + 1.0;
    ensure!(
        bank.ok >= 6 && bank.refused > 0 && bank.ok as f64 <= most && bank.named == ["bank"],
        "bank: {bank:?} (at most {most:.0} could pass)"
    );
    // The demo API's counts are published too.
    let demo = http.get(format!("{DEMO_API}/__llm/stats")).send().await?;
    ensure!(demo.status().is_success(), "demo API: {}", demo.status());

    // An edit in the admin reaches Envoy: maps (10 a second per key,
    // burst 5) tightened to one call a minute, which a refusal's
    // Retry-After then tells (about 60 s, against under a second before).
    let before = burst(&http, "api.maps.example", 5).await?;
    ensure!(before.ok == 5, "maps before the edit: {before:?}");
    let current: Value = http
        .get(format!("{ADMIN}/api/v1/policies/maps"))
        .send()
        .await?
        .json()
        .await?;
    let policy_version = current["version"].as_u64().context("maps: no version")?;
    let mut tightened = current["policy"].clone();
    tightened["rate"] = json!({"requests": 1, "period": "1m", "burst": 1});
    let edit = http
        .put(format!("{ADMIN}/api/v1/policies/maps"))
        .header("if-match", format!("\"{policy_version}\""))
        .json(&tightened)
        .send()
        .await?;
    ensure!(
        edit.status().is_success(),
        "edit: {} {}",
        edit.status(),
        edit.text().await?
    );
    let (after, reached_after) = until(
        "the edit reaching Envoy",
        Duration::from_secs(10),
        async || {
            let met = burst(&http, "api.maps.example", 3).await.ok()?;
            (met.retry_after >= 10 && met.named == ["maps"]).then_some(met)
        },
    )
    .await?;
    ensure!(after.ok <= 1, "maps after the edit: {after:?}");

    // The admin's container killed: Envoy goes on enforcing the set it
    // has, the edit included; started again, the admin is synced with.
    let syncs = |stats: &[(String, f64)]| {
        stats
            .iter()
            .filter(|(n, _)| n.ends_with("sluice.sync_ok"))
            .map(|(_, v)| *v)
            .sum::<f64>()
    };
    podman(&["kill", &format!("{PROJECT}_admin_1")])?;
    let without_admin = burst(&http, "api.maps.example", 3).await?;
    ensure!(
        without_admin.ok == 0 && without_admin.retry_after >= 10,
        "maps with the admin down: {without_admin:?}"
    );
    let bank_without_admin = burst(&http, "api.bank.example", 100).await?;
    ensure!(
        bank_without_admin.refused > 0 && bank_without_admin.named == ["bank"],
        "bank with the admin down: {bank_without_admin:?}"
    );
    let before_restart = syncs(&envoy_stats(&http).await.context("Envoy's stats")?);
    podman(&["start", &format!("{PROJECT}_admin_1")])?;
    let (_, resynced_after) = until(
        "syncs after the admin's restart",
        Duration::from_secs(30),
        async || {
            let now = syncs(&envoy_stats(&http).await?);
            (now > before_restart).then_some(())
        },
    )
    .await
    .with_context(|| logs("envoy"))?;

    // `down` stops and removes every container of the project, and the
    // ports close.
    let running = containers()?;
    compose(&["down", "--volumes"])?;
    drop(stack);
    let left = containers()?;
    ensure!(left.is_empty(), "left after down: {left:?}");
    for url in [ADMIN, EGRESS, ENVOY_ADMIN, DEMO_API] {
        ensure!(
            http.get(format!("{url}/")).send().await.is_err(),
            "{url} still answers after down"
        );
    }
    println!(
        "compose: up returned after {up:?}; the admin answered after {admin_after:?}, Envoy ready {envoy_after:?}, \
         synced over TLS {synced_after:?} after that ({} handshakes); the admin lists {} at policy version {}; \
         bank, 100 calls at once: {bank:?}; an edit reached Envoy {reached_after:?} after it was made ({after:?}); \
         with the admin's container killed Envoy refused maps and bank as before ({bank_without_admin:?}), and synced \
         again {resynced_after:?} after it was started; running before down: {running:?}; after: none",
        stat(&stats, "cluster.sluice_admin.ssl.handshake"),
        listed["id"],
        listed["policy_version"],
    );
    Ok(())
}
