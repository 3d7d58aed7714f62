//! Issue 36's gate: the real Envoy 1.40 loads Sluice's native build (a
//! dynamic module), says its ABI version matched, and refuses a bad
//! plugin configuration with the field and the reason. What the module
//! decides is proven by the decision suites, run against it with
//! `SLUICE_FILTER=native` (`make e2e-native`).

use std::process::Command;

use sluice_e2e::envoy::{envoy_binary, filter_native, workspace_root};

/// `envoy --mode validate` at info level on `envoy/native.yaml`, its
/// plugin configuration changed by `edit`: (succeeded, the log).
fn validate_native(edit: impl Fn(&str) -> String) -> anyhow::Result<(bool, String)> {
    let shipped = std::fs::read_to_string(workspace_root().join("envoy/native.yaml"))?;
    let module = filter_native()?;
    let config = edit(&shipped.replace(
        "target/release/libsluice_native.so",
        &module.display().to_string(),
    ));
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("native.yaml");
    std::fs::write(&path, config)?;
    let out = Command::new(envoy_binary()?)
        .args(["--mode", "validate", "--log-level", "info", "-c"])
        .arg(&path)
        .output()?;
    let log =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    Ok((out.status.success(), log))
}

#[test]
fn envoy_loads_the_native_module_and_says_its_abi_version_matched() -> anyhow::Result<()> {
    let (ok, log) = validate_native(str::to_string)?;
    let matched = log
        .lines()
        .find(|l| l.contains("Dynamic module ABI version"))
        .unwrap_or("(no ABI line)");
    println!("native module: {}", matched.trim());
    anyhow::ensure!(ok, "envoy/native.yaml does not validate:\n{log}");
    anyhow::ensure!(
        matched.contains("Dynamic module ABI version v0.2.0 matched."),
        "Envoy did not take the module's ABI version as its own:\n{log}"
    );
    anyhow::ensure!(
        log.contains("sluice: instance egress-native (native module)"),
        "the module did not start its workers:\n{log}"
    );
    Ok(())
}

#[test]
fn a_bad_plugin_configuration_is_refused_with_its_field() -> anyhow::Result<()> {
    let (ok, log) = validate_native(|c| c.replace(r#""period": "1s""#, r#""period": "soon""#))?;
    anyhow::ensure!(!ok, "a policy with a bad period was taken:\n{log}");
    anyhow::ensure!(
        log.contains("sluice: invalid plugin configuration: fallback.policies[0].rate.period"),
        "the refusal does not name the field:\n{log}"
    );
    let (ok, log) = validate_native(|c| c.replace(r#"{"instance""#, r#"not json {"instance""#))?;
    anyhow::ensure!(
        !ok,
        "a plugin configuration that is not JSON was taken:\n{log}"
    );
    anyhow::ensure!(
        log.contains("sluice: invalid plugin configuration"),
        "{log}"
    );
    Ok(())
}

#[test]
fn the_books_native_snippet_is_what_envoy_takes() -> anyhow::Result<()> {
    // The book's chapter on attaching the filter shows it.
    let readme = std::fs::read_to_string(workspace_root().join("docs/book/src/attaching.md"))?;
    let snippet = readme
        .split("```yaml")
        .skip(1)
        .filter_map(|b| b.split_once("```").map(|(yaml, _)| yaml))
        .find(|yaml| yaml.contains("DynamicModuleFilter"))
        .ok_or_else(|| anyhow::anyhow!("the book shows no native filter"))?;
    let module = filter_native()?.display().to_string();
    let (ok, log) = validate_native(|shipped| {
        // The shipped listener's filters replaced by the book's.
        let start = shipped
            .find("          http_filters:")
            .unwrap_or(shipped.len());
        let end = shipped.find("  clusters:").unwrap_or(shipped.len());
        let filters: String = snippet
            .trim_matches('\n')
            .replace("/etc/envoy/libsluice_native.so", &module)
            .lines()
            .map(|l| format!("          {l}\n"))
            .collect();
        format!("{}{filters}{}", &shipped[..start], &shipped[end..])
    })?;
    anyhow::ensure!(ok, "the book's native filter does not validate:\n{log}");
    anyhow::ensure!(
        log.contains("sluice: instance egress-1 (native module)"),
        "{log}"
    );
    Ok(())
}
