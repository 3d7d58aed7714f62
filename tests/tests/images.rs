//! The OCI images `make images` builds (target/images/), read back with
//! skopeo as a registry or a cluster would take them:
//! - the filter's: one layer holding `plugin.wasm` and nothing else, byte
//!   for byte the filter `make wasm` built (the layout Istio's
//!   WasmPlugin, Envoy Gateway and an image volume pull);
//! - the native module's: one layer holding `libsluice_native.so` and
//!   nothing else, byte for byte the module it was given (what an image
//!   volume mounts into Envoy Gateway's Envoys);
//! - the admin's: `FROM scratch`, a static binary (no dynamic loader) as
//!   its entrypoint, run as user 10001, with its UI and CA certificates;
//!   unpacked, its binary starts as the image's entrypoint and environment
//!   say and serves `/healthz` and the UI.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use serde_json::Value;
use sluice_e2e::envoy::{filter_native, filter_wasm, free_port, http_get, workspace_root};

fn archive(name: &str) -> PathBuf {
    workspace_root().join(format!("target/images/{name}.tar"))
}

fn run(command: &mut Command) -> anyhow::Result<Vec<u8>> {
    let out = command
        .output()
        .with_context(|| format!("running {command:?}"))?;
    ensure!(
        out.status.success(),
        "{command:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(out.stdout)
}

fn skopeo_json(args: &[&str], image: &Path) -> anyhow::Result<Value> {
    let out = run(Command::new("skopeo")
        .args(args)
        .arg(format!("oci-archive:{}", image.display())))
    .context("skopeo (make images installs it)")?;
    Ok(serde_json::from_slice(&out)?)
}

/// The image's layers unpacked in order into `root`; the names each held.
fn unpack(image: &Path, root: &Path) -> anyhow::Result<Vec<Vec<String>>> {
    let blobs = tempfile::tempdir()?;
    run(Command::new("skopeo")
        .arg("copy")
        .arg(format!("oci-archive:{}", image.display()))
        .arg(format!("dir:{}", blobs.path().display())))?;
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(blobs.path().join("manifest.json"))?)?;
    let mut names = Vec::new();
    for layer in manifest["layers"].as_array().context("no layers")? {
        let digest = layer["digest"].as_str().context("a layer without digest")?;
        let blob = blobs
            .path()
            .join(digest.strip_prefix("sha256:").unwrap_or(digest));
        let listing = run(Command::new("tar").arg("-tf").arg(&blob))?;
        names.push(
            String::from_utf8_lossy(&listing)
                .lines()
                .map(|l| l.trim_start_matches("./").to_string())
                .filter(|l| !l.is_empty())
                .collect(),
        );
        run(Command::new("tar")
            .arg("-xf")
            .arg(&blob)
            .arg("-C")
            .arg(root)
            .arg("--no-same-owner"))?;
    }
    Ok(names)
}

#[test]
fn the_filter_image_is_one_layer_holding_plugin_wasm() -> anyhow::Result<()> {
    let image = archive("sluice-filter");
    let inspected = skopeo_json(&["inspect"], &image)?;
    let manifest = skopeo_json(&["inspect", "--raw"], &image)?;
    ensure!(
        manifest["mediaType"] == "application/vnd.oci.image.manifest.v1+json",
        "not an OCI manifest: {manifest}"
    );
    let layers = manifest["layers"].as_array().context("no layers")?;
    ensure!(layers.len() == 1, "{} layers, not one", layers.len());
    let root = tempfile::tempdir()?;
    let names = unpack(&image, root.path())?;
    ensure!(
        names == [vec!["plugin.wasm".to_string()]],
        "the layer holds {names:?}, not plugin.wasm alone"
    );
    let packed = std::fs::read(root.path().join("plugin.wasm"))?;
    let built = std::fs::read(filter_wasm()?)?;
    ensure!(
        packed == built,
        "plugin.wasm is not the filter make wasm built"
    );
    ensure!(packed.starts_with(b"\0asm"), "plugin.wasm is not wasm");
    println!(
        "filter image: {} ({}), one layer ({} bytes) holding plugin.wasm, {} bytes, the built filter",
        inspected["Labels"]["org.opencontainers.image.title"],
        inspected["Labels"]["org.opencontainers.image.version"],
        layers[0]["size"],
        packed.len()
    );
    Ok(())
}

/// What compose-test packs is `make test`'s module (SLUICE_NATIVE);
/// `make images` alone packs the release build.
#[test]
fn the_native_image_is_one_layer_holding_the_module() -> anyhow::Result<()> {
    let image = archive("sluice-native");
    let inspected = skopeo_json(&["inspect"], &image)?;
    let manifest = skopeo_json(&["inspect", "--raw"], &image)?;
    let layers = manifest["layers"].as_array().context("no layers")?;
    ensure!(layers.len() == 1, "{} layers, not one", layers.len());
    let root = tempfile::tempdir()?;
    let names = unpack(&image, root.path())?;
    ensure!(
        names == [vec!["libsluice_native.so".to_string()]],
        "the layer holds {names:?}, not libsluice_native.so alone"
    );
    let packed = std::fs::read(root.path().join("libsluice_native.so"))?;
    ensure!(
        packed == std::fs::read(filter_native()?)?,
        "libsluice_native.so is not the module it was given"
    );
    ensure!(packed.starts_with(b"\x7fELF"), "not an ELF object");
    let entry = b"envoy_dynamic_module_on_program_init";
    ensure!(
        packed.windows(entry.len()).any(|w| w == entry),
        "the module exports no envoy_dynamic_module_on_program_init"
    );
    ensure!(
        inspected["Labels"]["org.opencontainers.image.title"] == "sluice-native",
        "labels: {}",
        inspected["Labels"]
    );
    // The glibc it asks for: at most Debian 12's (Envoy's distroless
    // images), as the book says.
    let glibc = highest_glibc_version(&packed).context("the module names no GLIBC version")?;
    ensure!(
        glibc <= (2, 36),
        "the module needs glibc {}.{}, newer than Envoy's distroless images' 2.36",
        glibc.0,
        glibc.1
    );
    println!(
        "native image: sluice-native ({}), one layer ({} bytes) holding libsluice_native.so, {} bytes, the given module, \
         needing glibc {}.{}",
        inspected["Labels"]["org.opencontainers.image.version"],
        layers[0]["size"],
        packed.len(),
        glibc.0,
        glibc.1
    );
    Ok(())
}

/// The highest `GLIBC_<major>.<minor>` symbol version an ELF object
/// names (its version needs are plain strings in it).
fn highest_glibc_version(object: &[u8]) -> Option<(u32, u32)> {
    const MARK: &[u8] = b"GLIBC_";
    let mut highest = None;
    for at in 0..object.len().saturating_sub(MARK.len()) {
        if &object[at..at + MARK.len()] != MARK {
            continue;
        }
        let rest = &object[at + MARK.len()..];
        let end = rest
            .iter()
            .position(|b| !(b.is_ascii_digit() || *b == b'.'))
            .unwrap_or(rest.len());
        let text = std::str::from_utf8(&rest[..end]).ok()?;
        let mut parts = text.split('.').map(str::parse::<u32>);
        if let (Some(Ok(major)), Some(Ok(minor))) = (parts.next(), parts.next()) {
            highest = highest.max(Some((major, minor)));
        }
    }
    highest
}

#[test]
fn the_admin_image_is_static_and_starts_as_its_config_says() -> anyhow::Result<()> {
    let image = archive("sluice-admin");
    let config = skopeo_json(&["inspect", "--config"], &image)?;
    let run_config = &config["config"];
    ensure!(config["os"] == "linux" && config["architecture"] == "amd64");
    ensure!(
        run_config["User"] == "10001:10001",
        "runs as {}",
        run_config["User"]
    );
    ensure!(
        run_config["Entrypoint"] == serde_json::json!(["/sluice-admin"]),
        "entrypoint {}",
        run_config["Entrypoint"]
    );
    let env: Vec<(String, String)> = run_config["Env"]
        .as_array()
        .context("no Env")?
        .iter()
        .filter_map(|e| e.as_str()?.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let root = tempfile::tempdir()?;
    let names: Vec<String> = unpack(&image, root.path())?.concat();
    for needed in [
        "sluice-admin",
        "srv/sluice-ui/index.html",
        "etc/ssl/certs/ca-certificates.crt",
    ] {
        ensure!(
            names.iter().any(|n| n == needed),
            "the image has no {needed}: {names:?}"
        );
    }
    // FROM scratch: nothing but what was put there.
    ensure!(
        !names
            .iter()
            .any(|n| n.starts_with("bin/") || n.starts_with("lib")),
        "the image holds a system: {names:?}"
    );
    let binary = root.path().join("sluice-admin");
    let bytes = std::fs::read(&binary)?;
    ensure!(
        !bytes.windows(11).any(|w| w == b"/lib64/ld-l")
            && !bytes.windows(8).any(|w| w == b"ld-linux"),
        "the admin binary names a dynamic loader: not static"
    );
    // Started as the image would start it: its environment, with the UI
    // directory where the image holds it (here, unpacked).
    let port = free_port()?;
    let data = tempfile::tempdir()?;
    let mut child = Command::new(&binary)
        .env_clear()
        .envs(env.iter().map(|(k, v)| {
            let v = match k.as_str() {
                "SLUICE_UI_DIR" => root
                    .path()
                    .join(v.trim_start_matches('/'))
                    .display()
                    .to_string(),
                "SLUICE_DB" => data.path().join("sluice.db").display().to_string(),
                "SLUICE_LISTEN" => format!("127.0.0.1:{port}"),
                _ => v.clone(),
            };
            (k.clone(), v)
        }))
        .arg("--insecure-dev")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let deadline = Instant::now() + Duration::from_secs(20);
    let health = loop {
        if let Ok(body) = http_get(port, "/healthz") {
            break body;
        }
        if Instant::now() > deadline || child.try_wait()?.is_some() {
            let _ = child.kill();
            let out = child.wait_with_output()?;
            anyhow::bail!(
                "the image's admin did not start: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let page = http_get(port, "/");
    let _ = child.kill();
    let _ = child.wait();
    ensure!(health.contains("\"ok\""), "/healthz said {health}");
    let page = page?;
    ensure!(
        page.contains("<html") || page.contains("<!DOCTYPE"),
        "no UI at /: {page}"
    );
    println!(
        "admin image: static binary ({} bytes), user 10001, env {:?}; started as configured: /healthz {}",
        bytes.len(),
        env.iter().map(|(k, _)| k).collect::<Vec<_>>(),
        health.trim()
    );
    Ok(())
}
