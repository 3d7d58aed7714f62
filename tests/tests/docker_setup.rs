//! `envoy/docker-compose.yml` and `admin/Dockerfile`, tested without a Docker
//! engine: the compose file parsed and cross-checked against the Dockerfile
//! and the Envoy config it mounts, that config validated by the real Envoy
//! with its container paths mapped. The Dockerfile itself is built, and its
//! images run as the compose file says, by `make compose-test`
//! (`tests/tests/compose.rs`), which `.ci/run` runs after `make test` when
//! both fit in CI's time.

use std::collections::BTreeMap;

use anyhow::{ensure, Context};
use serde_json::Value;
use sluice_e2e::envoy::{filter_wasm, workspace_root};

fn compose() -> anyhow::Result<Value> {
    let text = std::fs::read_to_string(workspace_root().join("envoy/docker-compose.yml"))?;
    serde_saphyr::from_str(&text).context("envoy/docker-compose.yml is not valid YAML")
}

fn dockerfile() -> anyhow::Result<String> {
    Ok(std::fs::read_to_string(
        workspace_root().join("admin/Dockerfile"),
    )?)
}

/// Stage name -> its instructions (continuation lines joined).
fn stages(dockerfile: &str) -> BTreeMap<String, Vec<String>> {
    let joined = dockerfile.replace("\\\n", " ");
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut current = None;
    for line in joined.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(from) = line.strip_prefix("FROM ") {
            let name = from
                .split_once(" AS ")
                .map(|(_, n)| n.trim().to_string())
                .unwrap_or_default();
            out.entry(name.clone()).or_default();
            current = Some(name);
        } else if let Some(name) = &current {
            out.entry(name.clone()).or_default().push(line.to_string());
        }
    }
    out
}

fn makefile_envoy_version() -> anyhow::Result<String> {
    let makefile = std::fs::read_to_string(workspace_root().join("Makefile"))?;
    makefile
        .lines()
        .find_map(|l| l.strip_prefix("ENVOY_VERSION :="))
        .map(|v| v.trim().to_string())
        .context("no ENVOY_VERSION in the Makefile")
}

#[test]
fn compose_file_is_consistent() -> anyhow::Result<()> {
    let compose = compose()?;
    let services = compose["services"]
        .as_object()
        .context("no services in the compose file")?;
    let names: Vec<&str> = services.keys().map(String::as_str).collect();
    for want in ["envoy", "admin", "demo-api", "filter"] {
        ensure!(names.contains(&want), "no {want} service: {names:?}");
    }
    // Envoy: the official image, pinned, the version the tests run.
    let image = compose["services"]["envoy"]["image"]
        .as_str()
        .context("envoy has no image")?;
    let tag = image
        .strip_prefix("envoyproxy/envoy:v")
        .context("envoy image is not the official one")?;
    let minor: u32 = tag
        .split('.')
        .nth(1)
        .and_then(|m| m.parse().ok())
        .context("envoy image tag is not vX.Y.Z")?;
    ensure!(
        tag.split('.').count() == 3 && minor >= 30,
        "pinned 1.3x+: {image}"
    );
    ensure!(
        tag == makefile_envoy_version()?,
        "compose runs Envoy {tag}, the tests validate with {}",
        makefile_envoy_version()?
    );
    // Built services point at existing Dockerfile stages.
    let stages = stages(&dockerfile()?);
    for name in ["admin", "demo-api", "filter"] {
        let build = &compose["services"][name]["build"];
        ensure!(
            build["context"].as_str() == Some(".."),
            "{name}: context is the repository root"
        );
        ensure!(build["dockerfile"].as_str() == Some("admin/Dockerfile"));
        let target = build["target"].as_str().context("build target")?;
        ensure!(
            stages.contains_key(target),
            "no stage {target} in admin/Dockerfile"
        );
    }
    // Envoy's mounts: its config file exists, and the filter volume holds
    // the path the config loads the .wasm from.
    let mounts: Vec<&str> = compose["services"]["envoy"]["volumes"]
        .as_array()
        .context("envoy mounts")?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let config_mount = mounts
        .iter()
        .find(|m| m.ends_with(":/etc/envoy/envoy.yaml:ro"))
        .context("envoy config mount")?;
    let config_file = config_mount.split(':').next().unwrap_or_default();
    let config_path = workspace_root().join("envoy").join(config_file);
    ensure!(config_path.exists(), "{} missing", config_path.display());
    let config = std::fs::read_to_string(&config_path)?;
    ensure!(mounts.contains(&"filter:/etc/sluice:ro"));
    ensure!(config.contains(r#"filename: "/etc/sluice/sluice_filter.wasm""#));
    let filter_cmd = &compose["services"]["filter"]["volumes"][0];
    ensure!(filter_cmd.as_str() == Some("filter:/out"));
    ensure!(stages["filter"]
        .iter()
        .any(|l| l.contains("/out/sluice_filter.wasm")));
    // The clusters reach the other services by their compose names; the
    // sync goes to the admin's TLS port.
    ensure!(config.contains("address: demo-api, port_value: 9090"));
    ensure!(config.contains("address: admin, port_value: 8443"));
    // Envoy pins the certificate the admin generates: one volume, mounted
    // where the admin writes it and where Envoy reads it.
    let admin_command: Vec<&str> = compose["services"]["admin"]["command"]
        .as_array()
        .context("admin command")?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let flag = |name: &str| {
        admin_command
            .iter()
            .position(|a| *a == name)
            .and_then(|i| admin_command.get(i + 1).copied())
    };
    ensure!(flag("--tls-listen") == Some("0.0.0.0:8443"));
    let cert_dir = flag("--tls-self-signed").context("the admin generates no certificate")?;
    let admin_mounts: Vec<&str> = compose["services"]["admin"]["volumes"]
        .as_array()
        .context("admin mounts")?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let tls_volume = admin_mounts
        .iter()
        .find_map(|m| m.strip_suffix(&format!(":{cert_dir}")))
        .context("the certificate directory is not a volume")?;
    let pinned_dir = mounts
        .iter()
        .find_map(|m| {
            m.strip_prefix(&format!("{tls_volume}:"))?
                .strip_suffix(":ro")
        })
        .context("Envoy does not mount the certificate volume")?;
    ensure!(
        config.contains(&format!(
            r#"trusted_ca: {{ filename: "{pinned_dir}/ca.pem" }}"#
        )),
        "Envoy pins a CA outside the certificate volume ({pinned_dir})"
    );
    ensure!(
        !pinned_dir.starts_with("/etc/sluice/"),
        "a volume inside the read-only filter volume"
    );
    // Published on the host's loopback only (the admin runs --insecure-dev).
    for service in ["admin", "envoy", "demo-api"] {
        for port in compose["services"][service]["ports"]
            .as_array()
            .context("ports")?
        {
            let port = port.as_str().unwrap_or_default();
            ensure!(
                port.starts_with("127.0.0.1:"),
                "{service} publishes {port} beyond loopback"
            );
        }
    }
    // The seed the admin is told to load is the one the image carries.
    let command: Vec<&str> = compose["services"]["admin"]["command"]
        .as_array()
        .context("admin command")?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    ensure!(command.contains(&"/etc/sluice/demo-policies.json"));
    ensure!(stages["admin"]
        .iter()
        .any(|l| l.contains("envoy/demo-policies.json /etc/sluice/demo-policies.json")));
    println!(
        "compose: services {names:?}, Envoy {image}, Dockerfile stages {:?}",
        stages.keys().collect::<Vec<_>>()
    );
    Ok(())
}

#[test]
fn compose_envoy_config_validates_with_paths_mapped() -> anyhow::Result<()> {
    let config = std::fs::read_to_string(workspace_root().join("envoy/compose-envoy.yaml"))?;
    let mapped = sluice_e2e::envoy::with_test_ca(&config.replace(
        "/etc/sluice/sluice_filter.wasm",
        &filter_wasm()?.display().to_string(),
    ))?;
    ensure!(mapped != config, "the wasm path was not mapped");
    let (ok, text) = sluice_e2e::envoy::validate_config(&mapped, &[])?;
    println!("compose Envoy config: {}", text.trim());
    ensure!(ok, "does not validate:\n{text}");
    Ok(())
}
