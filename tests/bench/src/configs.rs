//! The Envoy configurations compared, all one shape: a listener, the
//! filters under test, the router, one upstream cluster.

use std::path::Path;

/// A fast upstream: Envoy answering 200 itself (direct_response).
pub fn upstream() -> String {
    r#"admin: { address: { socket_address: { address: 127.0.0.1, port_value: {{ADMIN_PORT}} } } }
static_resources:
  listeners:
  - name: upstream
    address: { socket_address: { address: 127.0.0.1, port_value: {{PORT}} } }
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: upstream
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              # An LLM-like answer, whole or streamed, for response-cost limits.
              - match: { prefix: "/json" }
                direct_response: { status: 200, body: { inline_string: '{"id":"x","choices":[{"index":0,"message":{"content":"ok"}}],"usage":{"prompt_tokens":12,"completion_tokens":30,"total_tokens":42}}' } }
                response_headers_to_add: [{ header: { key: content-type, value: application/json }, append_action: OVERWRITE_IF_EXISTS_OR_ADD }]
              - match: { prefix: "/sse" }
                direct_response: { status: 200, body: { inline_string: "data: {\"choices\":[{\"delta\":{\"content\":\"ok\"}}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":30,\"total_tokens\":42}}\n\ndata: [DONE]\n\n" } }
                response_headers_to_add: [{ header: { key: content-type, value: text/event-stream }, append_action: OVERWRITE_IF_EXISTS_OR_ADD }]
              # A provider that says what is left of its limit (OpenAI's headers).
              - match: { prefix: "/headers" }
                direct_response: { status: 200, body: { inline_string: "ok" } }
                response_headers_to_add:
                - { header: { key: x-ratelimit-limit-requests, value: "1000000000" }, append_action: OVERWRITE_IF_EXISTS_OR_ADD }
                - { header: { key: x-ratelimit-remaining-requests, value: "999999999" }, append_action: OVERWRITE_IF_EXISTS_OR_ADD }
                - { header: { key: x-ratelimit-reset-requests, value: "60s" }, append_action: OVERWRITE_IF_EXISTS_OR_ADD }
              - match: { prefix: "/" }
                direct_response: { status: 200, body: { inline_string: "ok" } }
          http_filters:
          - name: envoy.filters.http.router
            typed_config: { "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router }
"#
    .to_string()
}

/// The proxy under test, sending to 127.0.0.1:`upstream_port`.
pub fn proxy(filters: &str, upstream_port: u16) -> String {
    format!(
        r#"admin: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {{{{ADMIN_PORT}}}} }} }} }}
stats_config:
  stats_tags:
  - tag_name: sluice_policy
    regex: '^wasmcustom\.sluice\.policy\.((.+?)\.)\w+$'
static_resources:
  listeners:
  - name: proxy
    address: {{ socket_address: {{ address: 127.0.0.1, port_value: {{{{PORT}}}} }} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: proxy
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes: [{{ match: {{ prefix: "/" }}, route: {{ cluster: upstream }} }}]
          http_filters:
{filters}          - name: envoy.filters.http.router
            typed_config: {{ "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router }}
  clusters:
  - name: upstream
    type: STATIC
    connect_timeout: 1s
    circuit_breakers: {{ thresholds: [{{ max_connections: 100000, max_pending_requests: 100000, max_requests: 100000 }}] }}
    load_assignment:
      cluster_name: upstream
      endpoints: [{{ lb_endpoints: [{{ endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {upstream_port} }} }} }} }}] }}]
"#
    )
}

/// Envoy's native local rate limit: one token bucket shared by all
/// connections and workers.
pub fn local_ratelimit(max_tokens: u64, tokens_per_fill: u64, fill_ms: u64) -> String {
    let fill_s = fill_ms as f64 / 1000.0;
    format!(
        r#"          - name: envoy.filters.http.local_ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit
              stat_prefix: native
              token_bucket: {{ max_tokens: {max_tokens}, tokens_per_fill: {tokens_per_fill}, fill_interval: {fill_s}s }}
              filter_enabled: {{ runtime_key: native_enabled, default_value: {{ numerator: 100, denominator: HUNDRED }} }}
              filter_enforced: {{ runtime_key: native_enforced, default_value: {{ numerator: 100, denominator: HUNDRED }} }}
"#
    )
}

/// A wasm filter (Sluice or the no-op) with its JSON configuration.
pub fn wasm(file: &Path, configuration: &str) -> String {
    let value = configuration.replace('\n', " ").replace('\'', "''");
    format!(
        r#"          - name: wasm
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: bench
                root_id: sluice
                allow_on_headers_stop_iteration: true
                vm_config:
                  vm_id: bench
                  runtime: envoy.wasm.runtime.v8
                  code: {{ local: {{ filename: "{}" }} }}
                configuration:
                  "@type": type.googleapis.com/google.protobuf.StringValue
                  value: '{value}'
"#,
        file.display()
    )
}

/// Sluice's native build (a dynamic module) with its JSON configuration.
pub fn native(module: &Path, configuration: &str) -> String {
    let value = configuration.replace('\n', " ").replace('\'', "''");
    format!(
        r#"          - name: sluice
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter
              dynamic_module_config: {{ module: {{ local: {{ filename: "{}" }} }} }}
              filter_name: sluice
              filter_config:
                "@type": type.googleapis.com/google.protobuf.StringValue
                value: '{value}'
"#,
        module.display()
    )
}

/// Sluice's plugin configuration with one policy set.
pub fn sluice(policies: &str, extra: &str) -> String {
    format!(
        r#"{{"instance": "bench"{extra}, "fallback": {{"version": 1, "policies": [{policies}]}}}}"#
    )
}

/// API keys the per-key variants spread their calls over.
pub const BENCH_KEYS: u32 = 10_000;

/// A wrk script sending one of [`BENCH_KEYS`] API keys at random per
/// request (the per-key variants), written into `dir`.
pub fn keys_script(dir: &Path) -> std::io::Result<std::path::PathBuf> {
    let script = dir.join("keys.lua");
    std::fs::write(
        &script,
        format!(
            "request = function()\n  wrk.headers[\"x-api-key\"] = \"key-\" .. math.random(1, {BENCH_KEYS})\n  return wrk.format(nil)\nend\n"
        ),
    )?;
    Ok(script)
}
