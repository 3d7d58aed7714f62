//! deploy/kubernetes, rendered and checked offline, as a cluster would
//! take it (no cluster here):
//! - every kustomization renders with `kubectl kustomize` (Debian's
//!   kubectl 1.20, which `make setup-kubernetes` unpacks; its kustomize
//!   2.0 knows directories only as `bases` and patches only as
//!   `patchesStrategicMerge`, so a copy is translated to those first);
//!   with a kubectl of 1.21 or later on the PATH, the files as shipped
//!   render to the same objects;
//! - every core object (Namespace, Secret, ConfigMap, Service, Deployment)
//!   passes `kubernetes-validate --strict` against Kubernetes 1.35's
//!   schemas (PyPI; 1.35 is the first with image volumes on by default);
//! - the Istio and Envoy Gateway resources are checked against the fields
//!   their API references document (listed below, with their sources),
//!   their pod parts as a Pod against the core schemas;
//! - every plugin configuration parses as the filter parses it, with the
//!   environment its pod gives it; every Envoy configuration (the plain
//!   gateway's, Envoy Gateway's bootstrap addition) passes the real
//!   Envoy's `--mode validate`; the admin's policies load as
//!   `--managed-dir` loads them; its flags and Secret keys are ones the
//!   real admin binary takes.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, ensure, Context};
use serde_json::{json, Value};
use sluice_e2e::admin::AdminProcess;
use sluice_e2e::envoy::{
    envoy_binary, filter_wasm, native_log_format, test_admin_tls_dir, validate_config,
    workspace_root,
};

fn tool(var: &str, default: &str) -> PathBuf {
    std::env::var_os(var)
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(default))
}

/// The kubectl `make setup-kubernetes` unpacks (Debian's 1.20).
fn pinned_kubectl() -> PathBuf {
    tool(
        "SLUICE_KUBECTL",
        "target/tools/kubernetes-client/usr/bin/kubectl",
    )
}

fn kubernetes_validate() -> PathBuf {
    tool(
        "SLUICE_KUBERNETES_VALIDATE",
        ".venv/bin/kubernetes-validate",
    )
}

fn run(command: &mut Command) -> anyhow::Result<String> {
    let out = command
        .output()
        .with_context(|| format!("running {command:?}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    ensure!(
        out.status.success(),
        "{command:?} failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    Ok(stdout)
}

fn yaml_documents(text: &str) -> anyhow::Result<Vec<Value>> {
    let docs: Vec<Value> = serde_saphyr::from_multiple(text).context("not YAML")?;
    Ok(docs.into_iter().filter(|d| !d.is_null()).collect())
}

const KUSTOMIZATIONS: [&str; 4] = [
    "base",
    "overlays/istio",
    "overlays/envoy-gateway",
    "overlays/envoy-gateway-native",
];

/// deploy/kubernetes copied into `to`, each kustomization written as
/// kustomize 2.0 reads it: directories from `resources` under `bases`,
/// `patches` (paths) under `patchesStrategicMerge`. JSON is YAML.
fn translated_for_kustomize_2(to: &Path) -> anyhow::Result<()> {
    let from = workspace_root().join("deploy/kubernetes");
    for dir in KUSTOMIZATIONS.iter().chain(&["base/admin", "base/egress"]) {
        let source = from.join(dir);
        let target = to.join(dir);
        std::fs::create_dir_all(&target)?;
        for entry in std::fs::read_dir(&source)? {
            let path = entry?.path();
            if path.is_file() {
                std::fs::copy(&path, target.join(path.file_name().context("a name")?))?;
            }
        }
        let file = target.join("kustomization.yaml");
        let text = std::fs::read_to_string(&file)?;
        let mut k: Value =
            serde_saphyr::from_str(&text).with_context(|| format!("{dir}/kustomization.yaml"))?;
        let resources: Vec<Value> = k["resources"].as_array().cloned().unwrap_or_default();
        let (dirs, files): (Vec<Value>, Vec<Value>) = resources
            .into_iter()
            .partition(|r| r.as_str().is_some_and(|r| source.join(r).is_dir()));
        k["resources"] = Value::Array(files);
        if !dirs.is_empty() {
            k["bases"] = Value::Array(dirs);
        }
        if let Some(patches) = k.as_object_mut().and_then(|o| o.remove("patches")) {
            let paths: Vec<Value> = patches
                .as_array()
                .context("patches is a list")?
                .iter()
                .map(|p| p["path"].clone())
                .collect();
            ensure!(
                paths.iter().all(Value::is_string),
                "{dir}: a patch without a path"
            );
            k["patchesStrategicMerge"] = Value::Array(paths);
        }
        std::fs::write(&file, serde_json::to_string_pretty(&k)?)?;
    }
    Ok(())
}

/// `name` without the hash suffix kustomize gives generated objects
/// (each kustomize release hashes differently).
fn unhashed(name: &str) -> String {
    match name.rsplit_once('-') {
        Some((stem, hash))
            if hash.len() == 10 && hash.chars().all(|c| c.is_ascii_alphanumeric()) =>
        {
            stem.to_string()
        }
        _ => name.to_string(),
    }
}

fn normalized(docs: &[Value]) -> BTreeSet<String> {
    docs.iter()
        .map(|d| {
            let text = d.to_string();
            // Generated names, wherever they are referenced.
            let mut out = text.clone();
            for generated in ["sluice-policies", "sluice-egress-envoy"] {
                while let Some(at) = out.find(&format!("{generated}-")) {
                    let end = at + generated.len() + 11;
                    if end > out.len() || unhashed(&out[at..end]) != generated {
                        break;
                    }
                    out.replace_range(at..end, generated);
                }
            }
            out
        })
        .collect()
}

/// Every kustomization rendered by the pinned kubectl (from the translated
/// copy), by name.
fn rendered() -> anyhow::Result<Vec<(&'static str, Vec<Value>)>> {
    let copy = tempfile::tempdir()?;
    translated_for_kustomize_2(copy.path())?;
    let kubectl = pinned_kubectl();
    let mut out = Vec::new();
    for k in KUSTOMIZATIONS {
        let text = run(Command::new(&kubectl)
            .arg("kustomize")
            .arg(copy.path().join(k)))
        .with_context(|| format!("rendering {k} (make setup-kubernetes installs kubectl)"))?;
        out.push((k, yaml_documents(&text)?));
    }
    Ok(out)
}

/// The object of `kind` named `name` (a generated one whatever its hash).
fn named<'a>(docs: &'a [Value], kind: &str, name: &str) -> anyhow::Result<&'a Value> {
    docs.iter()
        .find(|d| {
            d["kind"] == kind
                && d["metadata"]["name"]
                    .as_str()
                    .is_some_and(|n| unhashed(n) == name)
        })
        .with_context(|| format!("no {kind} {name}"))
}

fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

fn one_of_kind<'a>(docs: &'a [Value], kind: &str) -> anyhow::Result<&'a Value> {
    match of_kind(docs, kind).as_slice() {
        [one] => Ok(one),
        other => bail!("{} objects of kind {kind}", other.len()),
    }
}

fn is_core(doc: &Value) -> bool {
    matches!(
        doc["apiVersion"].as_str(),
        Some("v1" | "apps/v1" | "networking.k8s.io/v1")
    )
}

/// `kubernetes-validate --strict` on `docs`; its report.
fn validate_core(docs: &[&Value]) -> anyhow::Result<String> {
    let dir = tempfile::tempdir()?;
    let mut files = Vec::new();
    for (i, doc) in docs.iter().enumerate() {
        let path = dir.path().join(format!("{i}.json"));
        std::fs::write(&path, doc.to_string())?;
        files.push(path);
    }
    run(Command::new(kubernetes_validate())
        .args(["--strict", "-k", "1.35.0"])
        .args(&files))
    .context("kubernetes-validate (make setup-kubernetes installs it)")
}

/// The keys of `object` not in `documented`.
fn undocumented(object: &Value, documented: &[&str]) -> Vec<String> {
    object
        .as_object()
        .map(|o| {
            o.keys()
                .filter(|k| !documented.contains(&k.as_str()))
                .cloned()
                .collect()
        })
        .unwrap_or_else(|| vec![format!("(not an object: {object})")])
}

fn ensure_documented(what: &str, object: &Value, documented: &[&str]) -> anyhow::Result<()> {
    let extra = undocumented(object, documented);
    ensure!(
        extra.is_empty(),
        "{what}: fields its API reference does not list: {extra:?}"
    );
    Ok(())
}

/// A plugin configuration as the filter parses it, the variables it
/// names set (by the pod), and nothing else.
fn plugin_config_parses(what: &str, config: &str, env: &[&str]) -> anyhow::Result<()> {
    let lookup = |name: &str| env.contains(&name).then(|| format!("{name}-value"));
    let parsed =
        sluice_filter_core::plugin::parse_plugin_config_with_env(config.as_bytes(), &lookup)
            .map_err(|e| anyhow::anyhow!("{what}: the filter refuses its configuration: {e}"))?;
    ensure!(
        parsed.sync_token.is_some(),
        "{what}: the filter would sync without a token"
    );
    ensure!(
        !parsed.fallback.policies.is_empty(),
        "{what}: no fallback policies: calls go unlimited until the first sync"
    );
    Ok(())
}

/// `envoy --mode validate` of `config`, with `env` in Envoy's environment.
fn envoy_validates(what: &str, config: &str, env: &[(&str, &str)]) -> anyhow::Result<()> {
    let (ok, text) = validate_config(config, env)?;
    ensure!(ok, "{what} does not validate:\n{text}");
    Ok(())
}

#[test]
fn every_kustomization_renders_and_every_core_object_passes_its_schema() -> anyhow::Result<()> {
    let all = rendered()?;
    for (name, docs) in &all {
        let core: Vec<&Value> = docs.iter().filter(|d| is_core(d)).collect();
        let report = validate_core(&core)?;
        let kinds: Vec<&str> = docs.iter().filter_map(|d| d["kind"].as_str()).collect();
        println!(
            "{name}: {} objects {kinds:?}; {} core ones valid against Kubernetes 1.35 (strict)",
            docs.len(),
            core.len()
        );
        ensure!(
            report.matches("passed for resource").count() == core.len(),
            "{name}: kubernetes-validate said:\n{report}"
        );
    }
    // Everything the chapter promises is there.
    let base = &all[0].1;
    for kind in ["Namespace", "Secret", "ConfigMap", "Service", "Deployment"] {
        ensure!(!of_kind(base, kind).is_empty(), "base has no {kind}");
    }
    let admin = named(base, "Deployment", "sluice-admin")?;
    let container = &admin["spec"]["template"]["spec"]["containers"][0];
    for probe in ["startupProbe", "readinessProbe"] {
        ensure!(
            container[probe]["httpGet"]["path"] == "/healthz",
            "the admin's {probe} is not on /healthz"
        );
    }
    ensure!(
        container["resources"]["requests"].is_object(),
        "the admin requests no resources"
    );
    Ok(())
}

/// With a kubectl of 1.21 or later on the PATH (kustomize 4 and 5 read
/// the files as shipped), they render the same objects as the pinned one.
#[test]
fn the_files_as_shipped_render_the_same_with_a_current_kubectl() -> anyhow::Result<()> {
    let version = Command::new("kubectl")
        .args(["version", "--client", "-o", "json"])
        .output();
    let minor = version
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| serde_json::from_slice::<Value>(&o.stdout).ok())
        .and_then(|v| {
            v["clientVersion"]["minor"]
                .as_str()
                .and_then(|m| m.trim_end_matches('+').parse::<u32>().ok())
        });
    let Some(minor) = minor.filter(|m| *m >= 21) else {
        println!("no kubectl 1.21+ on the PATH: only the pinned 1.20 rendered (the other test)");
        return Ok(());
    };
    let pinned = rendered()?;
    for (name, docs) in pinned {
        let path = workspace_root().join("deploy/kubernetes").join(name);
        let output = Command::new("kubectl")
            .arg("kustomize")
            .arg(&path)
            .output()?;
        let stderr = String::from_utf8_lossy(&output.stderr);
        ensure!(
            output.status.success(),
            "kubectl 1.{minor} kustomize {name}: {stderr}"
        );
        ensure!(
            !stderr.contains("deprecated"),
            "kubectl 1.{minor} warns about {name}: {stderr}"
        );
        let current = yaml_documents(&String::from_utf8_lossy(&output.stdout))?;
        ensure!(
            normalized(&current) == normalized(&docs),
            "{name}: kubectl 1.{minor} renders other objects than 1.20"
        );
        println!(
            "{name}: kubectl 1.{minor} renders the same {} objects, no warning",
            docs.len()
        );
    }
    Ok(())
}

#[test]
fn the_plain_gateway_runs_the_filter_as_its_pod_configures_it() -> anyhow::Result<()> {
    let all = rendered()?;
    let base = &all[0].1;
    let gateway = named(base, "Deployment", "sluice-egress")?;
    let pod = &gateway["spec"]["template"]["spec"];
    let env: Vec<&str> = pod["containers"][0]["env"]
        .as_array()
        .context("the gateway has no env")?
        .iter()
        .filter_map(|e| e["name"].as_str())
        .collect();
    let config_map = named(base, "ConfigMap", "sluice-egress-envoy")?;
    let mounted = pod["volumes"]
        .as_array()
        .and_then(|v| v.iter().find(|v| v["name"] == "config"))
        .context("no config volume")?;
    ensure!(
        mounted["configMap"]["name"] == config_map["metadata"]["name"],
        "the gateway mounts another ConfigMap than the generated one"
    );
    let envoy_yaml = config_map["data"]["envoy.yaml"]
        .as_str()
        .context("no envoy.yaml")?;
    // The filter's configuration, with what the pod gives its VM.
    let bootstrap: Value = serde_saphyr::from_str(envoy_yaml)?;
    let wasm = &bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"]["http_filters"][0]["typed_config"]["config"];
    let keys: Vec<&str> = wasm["vm_config"]["environment_variables"]["host_env_keys"]
        .as_array()
        .context("no host_env_keys")?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    ensure!(
        keys.iter().all(|k| env.contains(k)),
        "the VM is given {keys:?}, the pod sets {env:?}"
    );
    let plugin = wasm["configuration"]["value"]
        .as_str()
        .context("no plugin configuration")?;
    plugin_config_parses("the plain gateway", plugin, &keys)?;
    // The real Envoy takes it, the container's paths mapped to this
    // machine's, the pod's variables set.
    let ca = test_admin_tls_dir()?.join("ca.pem");
    let mapped = envoy_yaml
        .replace(
            "/etc/sluice/filter/plugin.wasm",
            &filter_wasm()?.display().to_string(),
        )
        .replace("/etc/sluice/tls/ca.crt", &ca.display().to_string());
    ensure!(mapped != envoy_yaml, "no container path was mapped");
    envoy_validates(
        "the plain gateway's envoy.yaml",
        &mapped,
        &[
            ("POD_NAME", "sluice-egress-7c9f4-x2lq"),
            ("SLUICE_SYNC_TOKEN", "token"),
        ],
    )?;
    // The filter's image is mounted where the config reads it.
    let filter = pod["volumes"]
        .as_array()
        .and_then(|v| v.iter().find(|v| v["name"] == "filter"))
        .context("no filter volume")?;
    ensure!(
        filter["image"]["reference"]
            .as_str()
            .is_some_and(|r| r.contains("sluice/filter:")),
        "the filter volume is not the filter's image: {filter}"
    );
    println!(
        "plain gateway: envoy.yaml validates with Envoy {}, the VM given {keys:?}",
        envoy_binary()?.display()
    );
    Ok(())
}

#[test]
fn the_admin_takes_its_flags_secret_and_policies() -> anyhow::Result<()> {
    let all = rendered()?;
    let help = run(Command::new(AdminProcess::binary()).arg("--help"))?;
    for (name, docs) in &all {
        let admin = named(docs, "Deployment", "sluice-admin").context(*name)?;
        let container = &admin["spec"]["template"]["spec"]["containers"][0];
        for arg in container["args"].as_array().context("no args")? {
            let flag = arg.as_str().unwrap_or_default();
            let flag = flag.split('=').next().unwrap_or_default();
            let known = help
                .split_whitespace()
                .any(|word| word.trim_end_matches(',') == flag);
            ensure!(
                flag.starts_with("--") && known,
                "{name}: the admin has no flag {flag}"
            );
        }
        let secret = named(docs, "Secret", "sluice-admin").context(*name)?;
        for key in secret["stringData"]
            .as_object()
            .context("no stringData")?
            .keys()
        {
            ensure!(
                help.contains(&format!("[env: {key}")),
                "{name}: the Secret sets {key}, which the admin does not read"
            );
        }
        let policies = named(docs, "ConfigMap", "sluice-policies").context(*name)?;
        let text = policies["data"]["policies.yaml"]
            .as_str()
            .context("no policies.yaml")?;
        let loaded = sluice_admin::as_code::load(&[sluice_admin::as_code::SourceFile {
            path: "policies.yaml".into(),
            text: text.into(),
        }])
        .map_err(|e| anyhow::anyhow!("{name}: the policies are refused: {e}"))?;
        ensure!(!loaded.policies.is_empty(), "{name}: no policies");
    }
    Ok(())
}

/// Istio's WasmPlugin (extensions.istio.io/v1alpha1), the fields of its
/// reference, istio.io/latest/docs/reference/config/proxy_extensions/wasm-plugin/.
const WASM_PLUGIN_SPEC: &[&str] = &[
    "selector",
    "targetRef",
    "targetRefs",
    "url",
    "sha256",
    "imagePullPolicy",
    "imagePullSecret",
    "pluginConfig",
    "pluginName",
    "phase",
    "priority",
    "failStrategy",
    "vmConfig",
    "match",
    "type",
];

#[test]
fn istio_gets_a_wasm_plugin_it_documents_with_a_configuration_the_filter_takes(
) -> anyhow::Result<()> {
    let all = rendered()?;
    let docs = &all[1].1;
    let plugin = one_of_kind(docs, "WasmPlugin")?;
    ensure!(plugin["apiVersion"] == "extensions.istio.io/v1alpha1");
    let spec = &plugin["spec"];
    ensure_documented("WasmPlugin.spec", spec, WASM_PLUGIN_SPEC)?;
    ensure!(
        ["UNSPECIFIED_PHASE", "AUTHN", "AUTHZ", "STATS"]
            .contains(&spec["phase"].as_str().unwrap_or("")),
        "phase {}",
        spec["phase"]
    );
    ensure!(
        ["FAIL_CLOSE", "FAIL_OPEN", "FAIL_RELOAD"]
            .contains(&spec["failStrategy"].as_str().unwrap_or("")),
        "failStrategy {}",
        spec["failStrategy"]
    );
    ensure!(
        ["IfNotPresent", "Always"].contains(&spec["imagePullPolicy"].as_str().unwrap_or("")),
        "imagePullPolicy {}",
        spec["imagePullPolicy"]
    );
    ensure!(
        spec["url"]
            .as_str()
            .is_some_and(|u| u.starts_with("oci://")),
        "the plugin is not pulled from an OCI image: {}",
        spec["url"]
    );
    ensure!(
        spec["pluginName"] == "sluice",
        "pluginName is the filter's root id"
    );
    ensure_documented(
        "WasmPlugin.spec.selector",
        &spec["selector"],
        &["matchLabels"],
    )?;
    ensure_documented("WasmPlugin.spec.vmConfig", &spec["vmConfig"], &["env"])?;
    let mut from_host = Vec::new();
    for var in spec["vmConfig"]["env"]
        .as_array()
        .context("no vmConfig.env")?
    {
        ensure_documented("vmConfig.env[]", var, &["name", "valueFrom", "value"])?;
        ensure!(
            ["INLINE", "HOST"].contains(&var["valueFrom"].as_str().unwrap_or("INLINE")),
            "valueFrom {}",
            var["valueFrom"]
        );
        if var["valueFrom"] == "HOST" {
            from_host.push(var["name"].as_str().unwrap_or_default());
        }
    }
    // Istio hands pluginConfig to the filter as JSON.
    let config = spec["pluginConfig"].to_string();
    plugin_config_parses("the WasmPlugin", &config, &from_host)?;
    ensure!(
        spec["pluginConfig"]["admin_cluster"]
            .as_str()
            .is_some_and(|c| c.starts_with("outbound|8080||sluice-admin.sluice.svc")),
        "the filter does not sync through Istio's cluster for the admin's http port"
    );
    ensure!(
        !config.contains("\"sync_token\""),
        "a sync token written into the WasmPlugin"
    );
    // In the mesh, the admin drops its own TLS.
    let admin = docs
        .iter()
        .find(|d| d["kind"] == "Deployment")
        .context("no admin")?;
    ensure!(!admin.to_string().contains("--tls-listen"));
    // Third review, item 9: injected by revision, mutual TLS required.
    let namespace = one_of_kind(docs, "Namespace")?;
    let labels = &namespace["metadata"]["labels"];
    ensure!(
        labels["istio.io/rev"].is_string() && labels["istio-injection"].is_null(),
        "the namespace is injected by revision, not by istio-injection: {labels}"
    );
    let peer = one_of_kind(docs, "PeerAuthentication")?;
    ensure!(peer["apiVersion"] == "security.istio.io/v1");
    ensure_documented(
        "PeerAuthentication.spec",
        &peer["spec"],
        &["selector", "mtls", "portLevelMtls"],
    )?;
    ensure!(peer["spec"]["mtls"]["mode"] == "STRICT", "{peer}");
    ensure!(
        peer["spec"]["selector"]["matchLabels"] == admin["spec"]["selector"]["matchLabels"],
        "the PeerAuthentication selects the admin's pods: {peer}"
    );
    let rule = one_of_kind(docs, "DestinationRule")?;
    ensure!(rule["apiVersion"] == "networking.istio.io/v1");
    ensure_documented(
        "DestinationRule.spec",
        &rule["spec"],
        &[
            "host",
            "trafficPolicy",
            "subsets",
            "exportTo",
            "workloadSelector",
        ],
    )?;
    ensure!(rule["spec"]["host"] == "sluice-admin.sluice.svc.cluster.local");
    ensure!(
        rule["spec"]["trafficPolicy"]["tls"]["mode"] == "ISTIO_MUTUAL",
        "{rule}"
    );
    println!(
        "istio: WasmPlugin fields all documented; its pluginConfig parses with {from_host:?} from the proxy; \
         namespace injected by revision {}, admin under STRICT mutual TLS, called with ISTIO_MUTUAL",
        labels["istio.io/rev"]
    );
    Ok(())
}

/// Envoy Gateway's resources (gateway.envoyproxy.io/v1alpha1), the fields
/// of its API reference, gateway.envoyproxy.io/docs/api/extension_types/
/// (EnvoyExtensionPolicySpec, Wasm, WasmCodeSource, ImageWasmCodeSource,
/// WasmEnv, EnvoyProxySpec, ProxyBootstrap, EnvoyProxyProvider,
/// EnvoyProxyKubernetesProvider, KubernetesDeploymentSpec,
/// KubernetesPodSpec, KubernetesContainerSpec), and the Gateway API's
/// Gateway (gateway.networking.k8s.io/v1, gateway-api.sigs.k8s.io/reference/spec/).
const EXTENSION_POLICY_SPEC: &[&str] = &[
    "targetRef",
    "targetRefs",
    "targetSelectors",
    "wasm",
    "extProc",
    "lua",
    "dynamicModule",
];
const WASM: &[&str] = &["name", "rootID", "code", "config", "failOpen", "env"];
const WASM_CODE: &[&str] = &["type", "http", "image", "configMap", "sha256", "pullPolicy"];
const WASM_IMAGE: &[&str] = &["url", "sha256", "pullSecretRef"];
const ENVOY_PROXY_SPEC: &[&str] = &[
    "provider",
    "bootstrap",
    "logging",
    "telemetry",
    "concurrency",
    "shutdown",
    "extraArgs",
    "mergeGateways",
    "routingType",
    "ipFamily",
    "filterOrder",
    "backendTLS",
    "dynamicModules",
];
/// EnvoyProxySpec.dynamicModules[] (DynamicModuleEntry, DynamicModuleSource,
/// LocalDynamicModuleSource) and EnvoyExtensionPolicySpec.dynamicModule[]
/// (DynamicModule), from Envoy Gateway's api/v1alpha1/dynamic_module_types.go.
const DYNAMIC_MODULE_ENTRY: &[&str] = &["name", "source", "doNotClose", "loadGlobally"];
const DYNAMIC_MODULE_SOURCE: &[&str] = &["type", "local", "remote"];
const DYNAMIC_MODULE: &[&str] = &["name", "filterName", "config", "terminalFilter"];
const DEPLOYMENT_SPEC: &[&str] = &[
    "patch",
    "replicas",
    "strategy",
    "pod",
    "container",
    "initContainers",
    "name",
];
const POD_SPEC: &[&str] = &[
    "annotations",
    "labels",
    "securityContext",
    "affinity",
    "tolerations",
    "volumes",
    "imagePullSecrets",
    "nodeSelector",
    "topologySpreadConstraints",
];
const CONTAINER_SPEC: &[&str] = &[
    "env",
    "resources",
    "securityContext",
    "image",
    "volumeMounts",
];
const GATEWAY_SPEC: &[&str] = &[
    "gatewayClassName",
    "listeners",
    "addresses",
    "infrastructure",
    "backendTLS",
    "allowedListeners",
];

/// The pod parts of an EnvoyProxy's `envoyDeployment` (its fields as
/// documented; its container's env and mounts and its volumes as a Pod
/// that passes Kubernetes 1.35's schema); the names of its env.
fn envoy_pod_validates(deployment: &Value) -> anyhow::Result<Vec<&str>> {
    ensure_documented("envoyDeployment", deployment, DEPLOYMENT_SPEC)?;
    ensure_documented("envoyDeployment.pod", &deployment["pod"], POD_SPEC)?;
    ensure_documented(
        "envoyDeployment.container",
        &deployment["container"],
        CONTAINER_SPEC,
    )?;
    let container = &deployment["container"];
    let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "envoy"},
        "spec": {"containers": [{"name": "envoy", "image": "envoyproxy/envoy:v1.40.0",
                                  "env": container["env"], "volumeMounts": container["volumeMounts"]}],
                 "volumes": deployment["pod"]["volumes"]}});
    let report = validate_core(&[&pod])?;
    ensure!(report.contains("passed for resource"), "{report}");
    Ok(container["env"]
        .as_array()
        .context("no env")?
        .iter()
        .filter_map(|e| e["name"].as_str())
        .collect())
}

/// The access log format of envoy/egress.yaml, the one every shipped
/// Envoy prints.
fn shipped_access_log_format() -> anyhow::Result<String> {
    let egress = std::fs::read_to_string(workspace_root().join("envoy/egress.yaml"))?;
    let egress: Value = serde_saphyr::from_str(&egress)?;
    let manager = &egress["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0];
    manager["typed_config"]["access_log"][0]["typed_config"]["log_format"]["text_format_source"]
        ["inline_string"]
        .as_str()
        .map(str::to_string)
        .context("envoy/egress.yaml has no access log format")
}

/// An EnvoyProxy's one access log setting, its fields as documented,
/// to stdout; its text format.
fn access_log_format(proxy_spec: &Value) -> anyhow::Result<&str> {
    let telemetry = &proxy_spec["telemetry"];
    ensure_documented("telemetry", telemetry, &["accessLog", "tracing", "metrics"])?;
    let access_log = &telemetry["accessLog"];
    ensure_documented("telemetry.accessLog", access_log, &["disable", "settings"])?;
    let [setting] = access_log["settings"]
        .as_array()
        .context("no access log settings")?
        .as_slice()
    else {
        bail!("not one access log setting");
    };
    ensure_documented(
        "accessLog.settings[]",
        setting,
        &["format", "matches", "sinks", "type"],
    )?;
    ensure_documented(
        "accessLog.settings[].format",
        &setting["format"],
        &["type", "text", "json"],
    )?;
    ensure!(setting["format"]["type"] == "Text");
    for sink in setting["sinks"].as_array().context("no sinks")? {
        ensure_documented("sinks[]", sink, &["type", "als", "file", "openTelemetry"])?;
        ensure_documented("sinks[].file", &sink["file"], &["path"])?;
        ensure!(sink["type"] == "File" && sink["file"]["path"] == "/dev/stdout");
    }
    setting["format"]["text"].as_str().context("no text")
}

#[test]
fn envoy_gateway_gets_resources_it_documents_and_a_bootstrap_envoy_takes() -> anyhow::Result<()> {
    let all = rendered()?;
    let docs = &all[2].1;
    let policy = one_of_kind(docs, "EnvoyExtensionPolicy")?;
    let proxy = one_of_kind(docs, "EnvoyProxy")?;
    let gateway = one_of_kind(docs, "Gateway")?;
    ensure!(gateway["apiVersion"] == "gateway.networking.k8s.io/v1");
    for doc in [policy, proxy] {
        ensure!(doc["apiVersion"] == "gateway.envoyproxy.io/v1alpha1");
    }
    // The Gateway, and what it names.
    ensure_documented("Gateway.spec", &gateway["spec"], GATEWAY_SPEC)?;
    for listener in gateway["spec"]["listeners"]
        .as_array()
        .context("no listeners")?
    {
        ensure_documented(
            "Gateway.spec.listeners[]",
            listener,
            &[
                "name",
                "hostname",
                "port",
                "protocol",
                "tls",
                "allowedRoutes",
            ],
        )?;
        ensure!(["HTTP", "HTTPS"].contains(&listener["protocol"].as_str().unwrap_or("")));
    }
    let reference = &gateway["spec"]["infrastructure"]["parametersRef"];
    ensure_documented("parametersRef", reference, &["group", "kind", "name"])?;
    ensure!(
        reference
            == &json!({"group": "gateway.envoyproxy.io", "kind": "EnvoyProxy",
                       "name": proxy["metadata"]["name"]}),
        "the Gateway does not name the EnvoyProxy: {reference}"
    );
    // The EnvoyExtensionPolicy: on that Gateway, the filter from its image.
    let spec = &policy["spec"];
    ensure_documented("EnvoyExtensionPolicy.spec", spec, EXTENSION_POLICY_SPEC)?;
    let targets = spec["targetRefs"].as_array().context("no targetRefs")?;
    ensure!(
        targets.iter().any(|t| t["kind"] == "Gateway"
            && t["name"] == gateway["metadata"]["name"]
            && t["group"] == "gateway.networking.k8s.io"),
        "the policy is not on the Gateway: {targets:?}"
    );
    let [wasm] = spec["wasm"].as_array().context("no wasm")?.as_slice() else {
        bail!("not one wasm extension");
    };
    ensure_documented("wasm[]", wasm, WASM)?;
    ensure!(wasm["rootID"] == "sluice", "rootID is the filter's root id");
    ensure_documented("wasm[].code", &wasm["code"], WASM_CODE)?;
    ensure!(wasm["code"]["type"] == "Image");
    ensure_documented("wasm[].code.image", &wasm["code"]["image"], WASM_IMAGE)?;
    ensure_documented("wasm[].env", &wasm["env"], &["hostKeys"])?;
    let host_keys: Vec<&str> = wasm["env"]["hostKeys"]
        .as_array()
        .context("no hostKeys")?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    plugin_config_parses(
        "the EnvoyExtensionPolicy",
        &wasm["config"].to_string(),
        &host_keys,
    )?;
    // The EnvoyProxy: its documented fields; its pod parts as a Pod.
    let spec = &proxy["spec"];
    ensure_documented("EnvoyProxy.spec", spec, ENVOY_PROXY_SPEC)?;
    ensure_documented(
        "EnvoyProxy.spec.provider",
        &spec["provider"],
        &["type", "kubernetes"],
    )?;
    ensure!(spec["provider"]["type"] == "Kubernetes");
    ensure_documented(
        "EnvoyProxy.spec.provider.kubernetes",
        &spec["provider"]["kubernetes"],
        &[
            "envoyDeployment",
            "envoyDaemonSet",
            "envoyService",
            "envoyHpa",
            "envoyPDB",
            "useListenerPortAsContainerPort",
        ],
    )?;
    let service = &spec["provider"]["kubernetes"]["envoyService"];
    ensure_documented(
        "envoyService",
        service,
        &[
            "annotations",
            "labels",
            "type",
            "loadBalancerClass",
            "allocateLoadBalancerNodePorts",
            "loadBalancerSourceRanges",
            "loadBalancerIP",
            "externalTrafficPolicy",
            "patch",
            "name",
        ],
    )?;
    // Third review, item 6: inside the cluster only.
    ensure!(
        service["type"] == "ClusterIP",
        "the Envoys' Service is exposed: {service}"
    );
    let deployment = &spec["provider"]["kubernetes"]["envoyDeployment"];
    let env = envoy_pod_validates(deployment)?;
    ensure!(
        host_keys.iter().all(|k| env.contains(k)),
        "the VM is given {host_keys:?}, the Envoys set {env:?}"
    );
    // Its access log: each call with Sluice's decision, in the format
    // of envoy/egress.yaml's (the same line, never a second one).
    let format = access_log_format(spec)?;
    let shipped = shipped_access_log_format()?;
    ensure!(
        shipped == format,
        "the gateway's access log format is not envoy/egress.yaml's: {format:?}"
    );
    // Its bootstrap addition: the cluster the filter syncs through, which
    // the real Envoy takes.
    ensure_documented(
        "bootstrap",
        &spec["bootstrap"],
        &["type", "value", "jsonPatches"],
    )?;
    ensure!(spec["bootstrap"]["type"] == "Merge");
    let addition = spec["bootstrap"]["value"].as_str().context("no value")?;
    let parsed: Value = serde_saphyr::from_str(addition)?;
    let cluster = &parsed["static_resources"]["clusters"][0]["name"];
    ensure!(
        cluster == &wasm["config"]["admin_cluster"],
        "the filter syncs through {}, the bootstrap adds {cluster}",
        wasm["config"]["admin_cluster"]
    );
    let ca = test_admin_tls_dir()?.join("ca.pem");
    let mapped = addition.replace("/etc/sluice/tls/ca.crt", &ca.display().to_string());
    ensure!(mapped != addition, "the CA path was not mapped");
    envoy_validates("Envoy Gateway's bootstrap addition", &mapped, &[])?;
    println!(
        "envoy gateway: EnvoyExtensionPolicy, EnvoyProxy and Gateway fields all documented; \
         the filter's config parses with {host_keys:?}; the bootstrap's {cluster} validates"
    );
    Ok(())
}

/// Issue 53, item 4: the native overlay registers the module in the
/// EnvoyProxy's allow-list, mounts it from the sluice-native image, and its
/// EnvoyExtensionPolicy names that module instead of the wasm filter,
/// every field one Envoy Gateway documents. (That an Envoy configured as
/// Envoy Gateway translates these loads the module and limits calls:
/// native_module's `the_module_runs_as_envoy_gateway_configures_it`.)
#[test]
fn envoy_gateway_native_registers_the_module_its_policy_names() -> anyhow::Result<()> {
    let all = rendered()?;
    let (wasm_docs, docs) = (&all[2].1, &all[3].1);
    let policy = one_of_kind(docs, "EnvoyExtensionPolicy")?;
    let proxy = one_of_kind(docs, "EnvoyProxy")?;
    // The policy: the module, no wasm filter, on the same Gateway.
    let spec = &policy["spec"];
    ensure_documented("EnvoyExtensionPolicy.spec", spec, EXTENSION_POLICY_SPEC)?;
    ensure!(spec.get("wasm").is_none(), "the wasm filter is still there");
    ensure!(
        spec["targetRefs"] == one_of_kind(wasm_docs, "EnvoyExtensionPolicy")?["spec"]["targetRefs"],
        "the native policy targets another Gateway than the wasm one"
    );
    let [module] = spec["dynamicModule"]
        .as_array()
        .context("no dynamicModule")?
        .as_slice()
    else {
        bail!("not one dynamic module");
    };
    ensure_documented("dynamicModule[]", module, DYNAMIC_MODULE)?;
    ensure!(
        module["filterName"] == "sluice",
        "the module's filter is `sluice`"
    );
    // The EnvoyProxy: the allow-list holds the module the policy names
    // (Envoy Gateway rejects the policy otherwise), from a path an image
    // volume mounts.
    let spec = &proxy["spec"];
    ensure_documented("EnvoyProxy.spec", spec, ENVOY_PROXY_SPEC)?;
    let entries = spec["dynamicModules"]
        .as_array()
        .context("no dynamicModules")?;
    let entry = entries
        .iter()
        .find(|e| e["name"] == module["name"])
        .with_context(|| format!("the allow-list {entries:?} lacks {}", module["name"]))?;
    ensure_documented("dynamicModules[]", entry, DYNAMIC_MODULE_ENTRY)?;
    ensure_documented(
        "dynamicModules[].source",
        &entry["source"],
        DYNAMIC_MODULE_SOURCE,
    )?;
    ensure_documented("source.local", &entry["source"]["local"], &["path"])?;
    ensure!(entry["source"]["type"] == "Local");
    let path = entry["source"]["local"]["path"]
        .as_str()
        .context("no path")?;
    let deployment = &spec["provider"]["kubernetes"]["envoyDeployment"];
    let env = envoy_pod_validates(deployment)?;
    let mounts = deployment["container"]["volumeMounts"]
        .as_array()
        .context("no volumeMounts")?;
    let mount = mounts
        .iter()
        .find(|m| {
            m["mountPath"]
                .as_str()
                .is_some_and(|at| Path::new(path).parent() == Some(Path::new(at)))
        })
        .with_context(|| format!("nothing is mounted where {path} is"))?;
    let volume = deployment["pod"]["volumes"]
        .as_array()
        .context("no volumes")?
        .iter()
        .find(|v| v["name"] == mount["name"])
        .context("the mount names no volume")?;
    let image = volume["image"]["reference"]
        .as_str()
        .context("the module's volume is not an image volume")?;
    ensure!(
        image.contains("/sluice/native:"),
        "the module comes from {image}, not the sluice-native image"
    );
    // What stayed from the wasm overlay: the CA mount, the environment
    // the module reads its instance and token from.
    let wasm_deployment =
        &one_of_kind(wasm_docs, "EnvoyProxy")?["spec"]["provider"]["kubernetes"]["envoyDeployment"];
    for kept in wasm_deployment["container"]["volumeMounts"]
        .as_array()
        .context("no wasm volumeMounts")?
    {
        ensure!(mounts.contains(kept), "the native overlay lost {kept}");
    }
    let config = module["config"].to_string();
    plugin_config_parses("the native EnvoyExtensionPolicy", &config, &env)?;
    // Its access log: egress.yaml's line with the native build's fields.
    let format = access_log_format(spec)?;
    ensure!(
        format == native_log_format(&shipped_access_log_format()?),
        "the native gateway's access log format is not envoy/egress.yaml's with dynamic metadata: {format:?}"
    );
    ensure!(
        spec["bootstrap"] == one_of_kind(wasm_docs, "EnvoyProxy")?["spec"]["bootstrap"],
        "the native overlay changed the bootstrap"
    );
    println!(
        "envoy gateway native: module `{}` from {path} ({image}), its policy's config parses with {env:?}",
        entry["name"]
    );
    Ok(())
}

/// The ports `policy` lets in, each with where from: `None` for a rule
/// without `from` (anyone).
fn admitted(policy: &Value) -> Vec<(String, Option<Vec<Value>>)> {
    let mut out = Vec::new();
    for rule in policy["spec"]["ingress"].as_array().into_iter().flatten() {
        let from = rule["from"].as_array().cloned();
        for port in rule["ports"].as_array().into_iter().flatten() {
            let port = match &port["port"] {
                Value::String(name) => name.clone(),
                other => other.to_string(),
            };
            out.push((port, from.clone()));
        }
    }
    out
}

/// Third security review, item 6: NetworkPolicies let only labelled
/// application namespaces reach the egress port, and only the gateway's
/// pods reach the admin's sync port, in every kustomization; none lets
/// anyone in on any port.
#[test]
fn network_policies_let_only_applications_reach_the_egress_and_only_gateways_the_sync(
) -> anyhow::Result<()> {
    let all = rendered()?;
    for (name, docs) in &all {
        let policies = of_kind(docs, "NetworkPolicy");
        ensure!(!policies.is_empty(), "{name}: no NetworkPolicy");
        for policy in &policies {
            ensure!(
                policy["spec"]["policyTypes"]
                    .to_string()
                    .contains("Ingress")
                    || policy["spec"]["ingress"].is_array(),
                "{name}: {policy}"
            );
            for (port, from) in admitted(policy) {
                ensure!(
                    from.as_ref().is_some_and(|f| !f.is_empty()),
                    "{name}: {} lets anyone in on {port}",
                    policy["metadata"]["name"]
                );
            }
        }
        let admin = named(docs, "NetworkPolicy", "sluice-admin")?;
        let sync: Vec<_> = admitted(admin)
            .into_iter()
            .filter(|(p, _)| p == "sync")
            .collect();
        for (_, from) in &sync {
            for peer in from.iter().flatten() {
                let pods = peer["podSelector"]["matchLabels"].to_string();
                ensure!(
                    pods.contains("sluice-egress"),
                    "{name}: the sync port lets in more than the gateway's pods: {peer}"
                );
            }
        }
        if *name == "overlays/istio" {
            ensure!(sync.is_empty(), "{name}: no sync port in the mesh");
        } else {
            ensure!(!sync.is_empty(), "{name}: the gateway cannot sync");
        }
        let egress = of_kind(docs, "NetworkPolicy")
            .into_iter()
            .find(|p| p["metadata"]["name"] == "sluice-egress");
        if let Some(egress) = egress {
            for (port, from) in admitted(egress) {
                if port == "egress" || port == "10000" {
                    for peer in from.iter().flatten() {
                        ensure!(
                            peer["namespaceSelector"]["matchLabels"]["sluice-egress"] == "allowed",
                            "{name}: the egress port lets in {peer}"
                        );
                    }
                }
            }
        } else {
            ensure!(
                *name == "overlays/istio",
                "{name}: no NetworkPolicy for the egress gateway"
            );
        }
        println!(
            "{name}: NetworkPolicies {:?}",
            policies
                .iter()
                .map(|p| (
                    p["metadata"]["name"].clone(),
                    admitted(p)
                        .into_iter()
                        .map(|(port, _)| port)
                        .collect::<Vec<_>>()
                ))
                .collect::<Vec<_>>()
        );
    }
    Ok(())
}

/// Third security review, item 14: behind the ingress every login comes
/// from the proxy. With the flags the shipped admin Deployment has
/// (`--trusted-proxy`, `--client-ip-header`), one client's 10 wrong
/// passwords leave another client's right one at 200; without them
/// (before), the other client is refused too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_clients_wrong_logins_do_not_lock_out_another_behind_the_proxy() -> anyhow::Result<()> {
    let all = rendered()?;
    let mut flags_of = Vec::new();
    for (name, docs) in &all {
        let admin = named(docs, "Deployment", "sluice-admin")?;
        let flags: Vec<String> = admin["spec"]["template"]["spec"]["containers"][0]["args"]
            .as_array()
            .context("no args")?
            .iter()
            .filter_map(Value::as_str)
            .filter(|a| a.starts_with("--trusted-proxy=") || a.starts_with("--client-ip-header="))
            .map(str::to_string)
            .collect();
        flags_of.push((*name, flags));
    }
    let mut outcomes = Vec::new();
    let cases: Vec<(String, Vec<String>)> = flags_of
        .iter()
        .map(|(n, f)| (n.to_string(), f.clone()))
        .chain([("without the flags".to_string(), Vec::new())])
        .collect();
    for (name, flags) in &cases {
        let dir = tempfile::tempdir()?;
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let admin = AdminProcess::start_in(dir.path(), &flags).await?;
        let http = reqwest::Client::new();
        let login = |from: &'static str, password: &'static str| {
            let (http, url) = (http.clone(), format!("{}/api/v1/login", admin.base()));
            async move {
                http.post(url)
                    .header("x-forwarded-for", from)
                    .json(&json!({"password": password}))
                    .send()
                    .await
                    .map(|r| r.status().as_u16())
            }
        };
        let mut wrong = Vec::new();
        for _ in 0..10 {
            wrong.push(login("203.0.113.9", "not-the-password").await?);
        }
        let right = login("198.51.100.20", sluice_e2e::admin::PASSWORD).await?;
        println!("admin behind the proxy, {name} {flags:?}: client A's 10 wrong logins {wrong:?}; client B's right one {right}");
        outcomes.push((name.clone(), flags.is_empty(), right));
    }
    for (name, without, right) in outcomes {
        if without {
            ensure!(
                right == 429,
                "{name}: the control should lock B out ({right})"
            );
        } else {
            ensure!(right == 200, "{name}: client B was locked out ({right})");
        }
    }
    Ok(())
}
