//! The five scenarios of docs/BENCHMARKS.md.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::json;
use sluice_demo::mock::{Arrival, MockApi, MockLimits};
use sluice_e2e::envoy::{filter_vms, free_port};
use sluice_wire::sync::{PolicyReport, SyncReport};

use crate::configs;
use crate::judge::{cpu_ratio, throughput_share, verdict, Added};
use crate::plot;
use crate::procs::{self, cpu_time, rss_mib, BenchEnvoy};
use crate::wrk::{Wrk, WrkResult};
use crate::Args;

const HOST: &str = "api.bench.example";
const PROXY_WORKERS: u32 = 2;
const ACCURACY_WORKERS: u32 = 4;

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

pub struct Report {
    sections: Vec<String>,
    machine: String,
    /// When, at which commit and by which command this run measured: each
    /// section it writes says so, and keeps saying so in later runs that
    /// leave it as it was.
    stamp: String,
    footprint: BTreeMap<&'static str, String>,
}

impl Report {
    pub fn new(args: &Args) -> anyhow::Result<Self> {
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .unwrap_or_default()
            .lines()
            .find_map(|l| {
                l.strip_prefix("model name")
                    .map(|m| m.trim_start_matches([' ', '\t', ':']).to_string())
            })
            .unwrap_or_else(|| "unknown CPU".into());
        let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
        let mem_gib = std::fs::read_to_string("/proc/meminfo")
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
            .map_or(0.0, |kb| kb / 1024.0 / 1024.0);
        let envoy = std::process::Command::new(sluice_e2e::envoy::envoy_binary()?)
            .arg("--version")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default();
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let wrk = std::process::Command::new("wrk")
            .arg("-v")
            .output()
            .map(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .next()
                    .unwrap_or_default()
                    .to_string()
            })
            .unwrap_or_default();
        let machine = format!(
            "- CPU: {cpu}, {cores} cores; {mem_gib:.0} GiB; Linux {}\n- Envoy: {}\n- Load: {} on 127.0.0.1; runs of {} s, each measured {} times, the median reported\n",
            kernel.trim(),
            envoy.lines().last().unwrap_or_default().trim(),
            wrk.trim(),
            args.seconds,
            args.reps
        );
        Ok(Self {
            sections: Vec::new(),
            machine,
            stamp: run_stamp(),
            footprint: BTreeMap::new(),
        })
    }

    pub fn add(&mut self, section: String) {
        let section = stamped(&section, &self.stamp);
        println!("{section}");
        self.sections.push(section);
    }

    pub fn markdown(&self) -> String {
        let mut out = String::from(
            "# Benchmarks\n\nProduced by `make bench` (which runs `target/release/sluice-bench`; the\n\
             exact load commands are in each section). Everything runs on this one\n\
             machine at once — load generator, Envoy, upstream — so absolute\n\
             throughput is bounded by the cores they share; CPU time per request is\n\
             read from `/proc/<envoy>/stat` (utime + stime) over each run. How the hot path was\n\
             profiled, and what changed it (before/after), is in [PERFORMANCE.md](PERFORMANCE.md).\n\n\
             Each section says under its heading when, at which commit and by which\n\
             command its figures were measured: a run of some sections (`BENCH_ARGS=\"--only N\"`)\n\
             leaves the others as they were, with their own line. For the sections\n\
             measured before that line existed, the commit is the one that recorded\n\
             their figures. A commit marked \"with changes not committed\" is the one\n\
             the measured code was built on.\n\n## Machine\n\n",
        );
        out.push_str(&self.machine);
        for s in &self.sections {
            out.push('\n');
            out.push_str(s);
        }
        out
    }

    /// The report written over `existing` (the file as it was): the
    /// sections this run made replace those of the same heading, in their
    /// place; the others stay as they were (a run of some scenarios, or
    /// sections the e2e suites measured); new ones go at the end.
    pub fn merged_into(&self, existing: &str) -> String {
        let fresh = split_sections(&self.markdown());
        let mut used = vec![false; fresh.len()];
        let kept = split_sections(existing);
        let mut out = String::new();
        for (heading, text) in &kept {
            let replacement = fresh
                .iter()
                .position(|(h, _)| h == heading)
                .filter(|&i| !used[i]);
            match replacement {
                Some(i) => {
                    used[i] = true;
                    out.push_str(&fresh[i].1);
                    // The last of a run ends without the blank line the
                    // next heading wants.
                    if text.ends_with("\n\n") && !fresh[i].1.ends_with("\n\n") {
                        out.push('\n');
                    }
                }
                None => out.push_str(text),
            }
        }
        for (i, (_, text)) in fresh.iter().enumerate() {
            if !used[i] {
                if !out.is_empty() && !out.ends_with("\n\n") {
                    out.push('\n');
                }
                out.push_str(text);
            }
        }
        out
    }
}

/// The line under each heading a run writes: the day (UTC), the commit
/// (marked when the tree had changes not committed) and the command.
fn run_stamp() -> String {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let commit = git(&["rev-parse", "--short", "HEAD"]).unwrap_or_else(|| "unknown".into());
    let changed =
        git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    let day = jiff::Timestamp::now().strftime("%Y-%m-%d").to_string();
    // `--out` says where, not what: left out of the command.
    let mut args = std::env::args().skip(1);
    let mut shown = Vec::new();
    while let Some(arg) = args.next() {
        if arg == "--out" {
            args.next();
        } else if !arg.starts_with("--out=") {
            shown.push(arg);
        }
    }
    let command = match shown.join(" ") {
        all if all.is_empty() => "make bench".to_string(),
        some => format!("make bench BENCH_ARGS=\"{some}\""),
    };
    format!(
        "{STAMP_PREFIX}{day}, commit {commit}{}, by `{command}`.*",
        if changed {
            " with changes not committed"
        } else {
            ""
        }
    )
}

/// How a section's stamp line begins (`shared/tests/docs.rs` looks for it).
const STAMP_PREFIX: &str = "*Measured ";

/// `section` with `stamp` under its heading.
fn stamped(section: &str, stamp: &str) -> String {
    match section.split_once('\n') {
        Some((heading, rest)) if heading.starts_with("## ") => {
            let body = rest.trim_start_matches('\n');
            format!("{heading}\n\n{stamp}\n\n{body}")
        }
        _ => section.to_string(),
    }
}

/// A report's parts, each from its heading (`# ` or `## `, the heading's
/// number and name as its key) to the next; text before the first heading
/// is a part of its own, keyed "".
fn split_sections(text: &str) -> Vec<(String, String)> {
    let mut parts: Vec<(String, String)> = Vec::new();
    for line in text.split_inclusive('\n') {
        let heading = line
            .strip_prefix("## ")
            .or_else(|| line.strip_prefix("# "))
            .map(|h| section_key(h.trim()));
        match (heading, parts.last_mut()) {
            (Some(key), _) => parts.push((key, line.to_string())),
            (None, Some((_, body))) => body.push_str(line),
            (None, None) => parts.push((String::new(), line.to_string())),
        }
    }
    parts
}

/// A heading's key: its number when it has one ("6" for "6.
/// Instructions per request ..."), else the heading itself.
fn section_key(heading: &str) -> String {
    match heading.split_once(". ") {
        Some((number, _)) if number.chars().all(|c| c.is_ascii_digit()) => number.to_string(),
        _ => heading.to_string(),
    }
}

struct Variant {
    key: &'static str,
    label: &'static str,
    filters: Option<String>,
    script: Option<PathBuf>,
    /// The path wrk asks for (the upstream answers `/json` and `/sse` as
    /// an LLM would).
    path: &'static str,
}

#[derive(Default, Clone)]
struct Run {
    wrk: WrkResult,
    cpu_us_per_request: f64,
    rss_mib: f64,
}

/// Scenario 1: what each filter adds per request.
pub async fn overhead(args: &Args, report: &mut Report) -> anyhow::Result<()> {
    let sluice = args
        .sluice_wasm
        .canonicalize()
        .context("the Sluice filter (make wasm)")?;
    let noop = args.noop_wasm.canonicalize().context("the no-op filter")?;
    let dir = tempfile::tempdir()?;
    let script = configs::keys_script(dir.path())?;
    let rate_and_concurrency = configs::sluice(
        r#"{"name": "bench", "match": {"host": "api.bench.example"}, "rate": {"requests": 100000000, "period": "1s", "burst": 1000000},
            "concurrency": {"max_in_flight": 100000}}"#,
        "",
    );
    let rate_only = configs::sluice(
        r#"{"name": "bench", "match": {"host": "api.bench.example"}, "rate": {"requests": 100000000, "period": "1s", "burst": 1000000}}"#,
        "",
    );
    // An LLM call: POST with a JSON body whose max_tokens is the estimate.
    let llm_script = dir.path().join("llm.lua");
    std::fs::write(
        &llm_script,
        "wrk.method = \"POST\"\nwrk.body = '{\"model\":\"m\",\"max_tokens\":100,\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}'\nwrk.headers[\"Content-Type\"] = \"application/json\"\n",
    )?;
    let never = r#""rate": {"requests": 1000000000, "period": "1s", "burst": 1000000000}"#;
    let stacked = |n: usize| {
        let limits: Vec<String> = (1..n)
            .map(|i| format!(r#"{{"name": "extra-{i}", {never}}}"#))
            .collect();
        configs::sluice(
            &format!(
                r#"{{"name": "bench", "match": {{"host": "api.bench.example"}}, {never}, "limits": [{}]}}"#,
                limits.join(", ")
            ),
            "",
        )
    };
    let response_cost = configs::sluice(
        &format!(
            r#"{{"name": "bench", "match": {{"host": "api.bench.example"}}, {never},
                "limits": [{{"name": "tokens", {never},
                  "cost": {{"json": "max_tokens", "plus": 50, "default": 1000, "max": 100000}},
                  "usage": {{"json": ["usage.total_tokens"]}}}}]}}"#
        ),
        "",
    );
    // (i) again, its further limit following the provider's headers.
    let following = configs::sluice(
        &format!(
            r#"{{"name": "bench", "match": {{"host": "api.bench.example"}}, {never},
                "limits": [{{"name": "provider", {never}, "provider": {{"headers": "openai-requests"}}}}]}}"#
        ),
        "",
    );
    let per_key = configs::sluice(
        r#"{"name": "perkey", "match": {"host": "api.bench.example"}, "key": {"header": "x-api-key", "max_keys": 10000},
            "rate": {"requests": 1000000, "period": "1s", "burst": 100000}}"#,
        "",
    );
    let variants = vec![
        Variant {
            key: "a",
            label: "upstream direct (no Envoy in between)",
            filters: None,
            script: None,
            path: "/",
        },
        Variant {
            key: "b",
            label: "Envoy, no filter",
            filters: Some(String::new()),
            script: None,
            path: "/",
        },
        Variant {
            key: "c",
            label: "Envoy + native local_ratelimit (shared bucket, never refuses)",
            filters: Some(configs::local_ratelimit(1_000_000_000, 1_000_000_000, 1000)),
            script: None,
            path: "/",
        },
        Variant {
            key: "f",
            label: "Envoy + no-op proxy-wasm filter",
            filters: Some(configs::wasm(&noop, "{}")),
            script: None,
            path: "/",
        },
        Variant {
            key: "h",
            label: "Envoy + no-op proxy-wasm filter that reads `:authority`",
            filters: Some(configs::wasm(&noop, ":authority")),
            script: None,
            path: "/",
        },
        Variant {
            key: "d",
            label: "Envoy + Sluice (rate + concurrency, never refuses)",
            filters: Some(configs::wasm(&sluice, &rate_and_concurrency)),
            script: None,
            path: "/",
        },
        Variant {
            key: "g",
            label: "Envoy + Sluice, rate only",
            filters: Some(configs::wasm(&sluice, &rate_only)),
            script: None,
            path: "/",
        },
        Variant {
            key: "e",
            label: "Envoy + Sluice, per-key policy over 10 000 keys",
            filters: Some(configs::wasm(&sluice, &per_key)),
            script: Some(script.clone()),
            path: "/",
        },
        Variant {
            key: "i",
            label: "Envoy + Sluice, 2 stacked rate limits (`rate` + 1 of `limits`)",
            filters: Some(configs::wasm(&sluice, &stacked(2))),
            script: None,
            path: "/",
        },
        Variant {
            key: "j",
            label: "Envoy + Sluice, 4 stacked rate limits (`rate` + 3 of `limits`)",
            filters: Some(configs::wasm(&sluice, &stacked(4))),
            script: None,
            path: "/",
        },
        Variant {
            key: "n",
            label: "Envoy + Sluice, (i) with its further limit following the provider's headers (OpenAI's, on every answer)",
            filters: Some(configs::wasm(&sluice, &following)),
            script: None,
            path: "/headers",
        },
        Variant {
            key: "k",
            label:
                "Envoy + Sluice, response-cost limit, JSON answer (POST, estimate from the body)",
            filters: Some(configs::wasm(&sluice, &response_cost)),
            script: Some(llm_script.clone()),
            path: "/json",
        },
        Variant {
            key: "l",
            label: "Envoy + Sluice, response-cost limit, streamed (SSE) answer",
            filters: Some(configs::wasm(&sluice, &response_cost)),
            script: Some(llm_script.clone()),
            path: "/sse",
        },
        Variant {
            key: "m",
            label: "Envoy, no filter, the same POST and JSON answer as (k)",
            filters: Some(String::new()),
            script: Some(llm_script.clone()),
            path: "/json",
        },
    ];
    // On two cores or more: the proxy under test alone on the last core,
    // the upstream and wrk on the others.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let proxy_cpus = (cores >= 2).then(|| (cores - 1).to_string());
    let other_cpus = (cores >= 2).then(|| format!("0-{}", cores.saturating_sub(2)));
    let upstream = BenchEnvoy::start_on(&configs::upstream(), 1, other_cpus.as_deref())?;
    let mut runs: BTreeMap<&str, Vec<Run>> = BTreeMap::new();
    let mut command = String::new();
    // Interleaved, so drift in the machine's speed spreads over all variants.
    for rep in 0..args.reps {
        for v in &variants {
            let proxy = match &v.filters {
                Some(f) => Some(BenchEnvoy::start_on(
                    &configs::proxy(f, upstream.port),
                    PROXY_WORKERS,
                    proxy_cpus.as_deref(),
                )?),
                None => None,
            };
            let port = proxy.as_ref().map_or(upstream.port, |p| p.port);
            let mut wrk = Wrk {
                url: format!("http://127.0.0.1:{port}{}", v.path),
                host: HOST,
                connections: 50,
                threads: 1,
                duration: Duration::from_secs(2),
                script: v.script.as_deref(),
                cpus: other_cpus.as_deref(),
            };
            wrk.run()?; // warm-up: connections, VMs, keys
            wrk.duration = Duration::from_secs(args.seconds);
            if rep == 0 && v.key == "b" {
                command = wrk.command_line();
            }
            let measured = proxy.as_ref().map(|p| p.proc.pid());
            let cpu_before = measured.map(cpu_time).transpose()?;
            let result = wrk.run()?;
            let cpu = match (measured, cpu_before) {
                (Some(pid), Some(before)) => {
                    (cpu_time(pid)? - before).as_secs_f64() * 1e6 / result.requests as f64
                }
                _ => f64::NAN,
            };
            let rss = measured.map(rss_mib).transpose()?.unwrap_or(f64::NAN);
            if result.non_2xx > 0 {
                bail!(
                    "variant {}: {} non-2xx answers; limits were meant never to refuse (Envoy: {})",
                    v.key,
                    result.non_2xx,
                    proxy
                        .as_ref()
                        .map(BenchEnvoy::answer_stats)
                        .unwrap_or_default()
                );
            }
            println!(
                "overhead rep {rep} ({}) {}: {:.0} req/s, p50 {:.3} ms, p99 {:.3} ms, {cpu:.1} µs CPU/request",
                v.key, v.label, result.per_second, result.p50_ms, result.p99_ms
            );
            runs.entry(v.key).or_default().push(Run {
                wrk: result,
                cpu_us_per_request: cpu,
                rss_mib: rss,
            });
        }
    }
    let med = |key: &str, f: fn(&Run) -> f64| {
        median(
            runs.get(key)
                .map(|r| r.iter().map(f).collect())
                .unwrap_or_default(),
        )
    };
    let cpu = |key: &str| med(key, |r| r.cpu_us_per_request);
    let added = |key: &str| cpu(key) - cpu("b");
    // The response-cost variants POST and get a JSON answer: their
    // baseline is Envoy without a filter doing the same (m).
    let added_over_baseline = |key: &str| match key {
        "k" | "l" => cpu(key) - cpu("m"),
        _ => added(key),
    };
    let mut s = String::from(
        "## 1. Overhead\n\nRequests/s, latency and Envoy CPU per request with the limits set too high to refuse.\n\
         Envoy `--concurrency 2`, pinned to one core of its own (`taskset`); the upstream, a second Envoy answering \
         200 itself (`direct_response`), and wrk share the other core(s).\n\n",
    );
    let _ = writeln!(s, "Command (per variant, after a 2 s warm-up): `{command}`; (e) adds `-s keys.lua` (a random `x-api-key` of 10 000 per request).\n");
    s.push_str("| variant | requests/s | p50 ms | p99 ms | Envoy CPU µs/request | added CPU µs/request over (b); (k), (l) over (m) |\n|---|---|---|---|---|---|\n");
    for v in &variants {
        let added_text = if matches!(v.key, "a" | "b") {
            "—".to_string()
        } else {
            format!("{:+.1}", added_over_baseline(v.key))
        };
        let cpu_text = if v.key == "a" {
            "—".to_string()
        } else {
            format!("{:.1}", cpu(v.key))
        };
        let _ = writeln!(
            s,
            "| ({}) {} | {:.0} | {:.3} | {:.3} | {cpu_text} | {added_text} |",
            v.key,
            v.label,
            med(v.key, |r| r.wrk.per_second),
            med(v.key, |r| r.wrk.p50_ms),
            med(v.key, |r| r.wrk.p99_ms),
        );
    }
    // Per repetition, each variant against (b) of the same repetition.
    let added_per_rep = |key: &'static str| Added {
        variant: key,
        per_rep: runs
            .get(key)
            .zip(runs.get("b"))
            .map(|(v, b)| {
                v.iter()
                    .zip(b)
                    .map(|(v, b)| v.cpu_us_per_request - b.cpu_us_per_request)
                    .collect()
            })
            .unwrap_or_default(),
    };
    let (ratio, ratio_verdict) = cpu_ratio(&added_per_rep("d"), &added_per_rep("f"), 1.30);
    let (ratio_over_header, _) = cpu_ratio(&added_per_rep("d"), &added_per_rep("h"), 1.30);
    let per_second = |key: &str| -> Vec<f64> {
        runs.get(key)
            .map(|v| v.iter().map(|r| r.wrk.per_second).collect())
            .unwrap_or_default()
    };
    let (throughput, throughput_verdict) =
        throughput_share(&per_second("d"), &per_second("b"), 0.85);
    let _ = writeln!(s, "\nadded-cost ratio vs no-op wasm (CPU time): {ratio:.2}");
    let _ = writeln!(
        s,
        "\nadded-cost ratio vs a no-op wasm filter that reads one header (h) (CPU time): {ratio_over_header:.2} \
         (judged on instructions in section 6)"
    );
    let _ = writeln!(
        s,
        "\n(d) runs at {:.1} % of (b)'s throughput (target ≥ 85 %: {}); the added-cost ratio is added(d) / added(f) \
         (target ≤ 1.30: the limiter itself costs at most 30 % of what entering wasm costs: {ratio_verdict}). \
         A run where an added cost comes out negative, or where the repetitions of one are further apart than \
         the cost itself, is marked INVALID RUN: its CPU figures are noise and judge nothing. The throughput \
         is judged only when (d)'s share of (b) in every pairing of their repetitions falls on one side of \
         85 %; otherwise it is an INVALID RUN too.",
        throughput * 100.0,
        throughput_verdict,
    );
    let _ = writeln!(
        s,
        "\nWhere the time goes: entering wasm at all (f) adds {:.1} µs, and reading one request header \
         through the proxy-wasm ABI (h) {:.1} µs more — a filter that limits by destination must read at least \
         `:authority`; the rate check (g) adds {:.1} µs over (f) \
         (the `:authority` read, the clock, and a shared-data read and compare-and-swap write of the bucket \
         once per prefetch of up to 64 requests while the bucket is far from its limit); concurrency (d) adds \
         {:.1} µs over rate only (slots are prefetched with the tokens and come back to the worker's prefetch; \
         the end-of-stream bookkeeping remains); \
         per key (e) costs {:+.1} µs against (d) without its concurrency limit (a hash of the key and a probe).",
        added("f"),
        added("h") - added("f"),
        added("g") - added("f"),
        added("d") - added("g"),
        added("e") - added("g"),
    );
    let _ = writeln!(
        s,
        "\nSeveral limits and response costs, next to (d) at {:+.1} µs: 2 stacked rate limits (i) {:+.1} µs, \
         4 (j) {:+.1} µs (each further limit is a shared-data read and compare-and-swap per call: they are not \
         prefetched); a response-cost limit reading a JSON answer (k) {:+.1} µs and a streamed one (l) {:+.1} µs \
         over the same POST without a filter (m) (the request body read and parsed for `max_tokens`, the answer \
         parsed for its usage, and the limit settled).",
        added("d"),
        added("i"),
        added("j"),
        added_over_baseline("k"),
        added_over_baseline("l"),
    );
    let _ = writeln!(
        s,
        "\nListening to the provider: (i) with its further limit following OpenAI's `x-ratelimit-*-requests` \
         headers (n) {:+.1} µs over (b), {:+.1} µs over (i) (the answer's headers read and parsed, and the \
         provider row's compare-and-swap on admission and on the answer).",
        added("n"),
        added("n") - added("i"),
    );
    report
        .footprint
        .insert("envoy_rss_b", format!("{:.1}", med("b", |r| r.rss_mib)));
    report
        .footprint
        .insert("envoy_rss_f", format!("{:.1}", med("f", |r| r.rss_mib)));
    report
        .footprint
        .insert("envoy_rss_d", format!("{:.1}", med("d", |r| r.rss_mib)));
    report
        .footprint
        .insert("envoy_rss_e", format!("{:.1}", med("e", |r| r.rss_mib)));
    report.add(s);
    Ok(())
}

/// Requests the mock saw per `bucket` since the first one: (seconds, per second).
fn timeline(arrivals: &[Arrival], bucket: Duration) -> Vec<(f64, f64)> {
    let Some(first) = arrivals.first().map(|a| a.at) else {
        return Vec::new();
    };
    let mut counts: BTreeMap<u64, u64> = BTreeMap::new();
    for a in arrivals {
        let i = ((a.at - first).as_secs_f64() / bucket.as_secs_f64()) as u64;
        *counts.entry(i).or_default() += 1;
    }
    let last = counts.keys().next_back().copied().unwrap_or(0);
    (0..=last)
        .map(|i| {
            (
                i as f64 * bucket.as_secs_f64(),
                counts.get(&i).copied().unwrap_or(0) as f64 / bucket.as_secs_f64(),
            )
        })
        .collect()
}

/// Scenario 2: 1 000 requests/s under contention, Sluice and native.
pub async fn accuracy(args: &Args, img: &Path, report: &mut Report) -> anyhow::Result<()> {
    let sluice = args.sluice_wasm.canonicalize()?;
    const TARGET: f64 = 1000.0;
    let limiters = [
        (
            "Sluice",
            configs::wasm(
                &sluice,
                &configs::sluice(
                    r#"{"name": "bench", "match": {"host": "*"}, "rate": {"requests": 1000, "period": "1s", "burst": 100}}"#,
                    "",
                ),
            ),
        ),
        (
            "native local_ratelimit",
            configs::local_ratelimit(100, 100, 100),
        ),
    ];
    let mut rows = Vec::new();
    let mut charts = Vec::new();
    let mut command = String::new();
    for (name, filters) in &limiters {
        let mut errors = Vec::new();
        let mut conflicts = Vec::new();
        let mut rates = Vec::new();
        let mut worst_second = Vec::new();
        for rep in 0..args.reps {
            let mock = MockApi::start("127.0.0.1:0".parse()?, MockLimits::default()).await?;
            let proxy =
                BenchEnvoy::start(&configs::proxy(filters, mock.addr.port()), ACCURACY_WORKERS)?;
            let wrk = Wrk {
                url: format!("http://127.0.0.1:{}/", proxy.port),
                host: HOST,
                connections: 256,
                threads: 2,
                duration: Duration::from_secs(args.seconds),
                script: None,
                cpus: None,
            };
            command = wrk.command_line();
            mock.reset();
            let result = tokio::task::spawn_blocking(move || wrk.run()).await??;
            let arrivals = mock.arrivals();
            let Some(first) = arrivals.first().map(|a| a.at) else {
                bail!("{name}: nothing reached the upstream");
            };
            // The steady state: whole seconds after the first, before the last.
            let secs = args.seconds.saturating_sub(2).max(1);
            let from = first + Duration::from_secs(1);
            let to = from + Duration::from_secs(secs);
            let steady = arrivals
                .iter()
                .filter(|a| a.at >= from && a.at < to)
                .count() as f64
                / secs as f64;
            let per_second = timeline(&arrivals, Duration::from_secs(1));
            let max_second = per_second.iter().map(|p| p.1).fold(0.0, f64::max);
            tokio::time::sleep(Duration::from_millis(300)).await;
            let retries = proxy.stat("sluice_cas_retries{}");
            let per_1000 = if *name == "Sluice" {
                retries / result.requests as f64 * 1000.0
            } else {
                f64::NAN
            };
            println!(
                "accuracy {name} rep {rep}: {} requests, admitted {steady:.1}/s steady ({:+.2} %), busiest second {max_second:.0}, CAS retries {per_1000:.2}/1000",
                result.requests,
                (steady - TARGET) / TARGET * 100.0
            );
            errors.push((steady - TARGET) / TARGET * 100.0);
            rates.push(steady);
            conflicts.push(per_1000);
            worst_second.push(max_second);
            if rep == 0 {
                charts.push((*name, timeline(&arrivals, Duration::from_millis(100))));
            }
        }
        rows.push(format!(
            "| {name} | {:.1} | {:+.2} % | {:.0} | {} |",
            median(rates),
            median(errors),
            median(worst_second),
            if *name == "Sluice" {
                format!("{:.2}", median(conflicts))
            } else {
                "— (one C++ atomic)".into()
            }
        ));
    }
    let chart = img.join("bench-accuracy.png");
    let series: Vec<(&str, Vec<(f64, f64)>)> = charts.into_iter().collect();
    plot::rate_over_time(
        &chart,
        "Admitted per second (100 ms buckets), limit 1 000/s, 256 connections, 4 workers",
        TARGET,
        &series,
    )?;
    let mut s = String::from(
        "## 2. Accuracy under contention\n\nLimit 1 000 requests/s (burst 100), 256 connections, Envoy `--concurrency 4`, \
         upstream the mock API (it timestamps what it admits). Steady rate = what reached the upstream in the whole seconds \
         between the first and the last. Native: `local_ratelimit` with 100 tokens every 100 ms.\n\n",
    );
    let _ = writeln!(s, "Command: `{command}`\n");
    s.push_str("| limiter | admitted/s (steady) | error vs 1 000/s | busiest second | CAS retries per 1 000 requests |\n|---|---|---|---|---|\n");
    for r in rows {
        s.push_str(&r);
        s.push('\n');
    }
    let _ = writeln!(
        s,
        "\n![admitted per second over time](img/bench-accuracy.png)"
    );
    report.add(s);
    Ok(())
}

/// Scenario 3: how close a queued request leaves to its reserved instant.
pub async fn queue_precision(args: &Args, img: &Path, report: &mut Report) -> anyhow::Result<()> {
    let sluice = args.sluice_wasm.canonicalize()?;
    const SENT: usize = 500;
    let policy = configs::sluice(
        r#"{"name": "queued", "match": {"host": "*"}, "rate": {"requests": 100, "period": "1s", "burst": 1},
            "on_limit": {"action": "queue", "max_wait": "10s", "max_queue": 1000}}"#,
        r#", "queue_ticket_header": true"#,
    );
    let mut all = Vec::new();
    let mut rows = Vec::new();
    for rep in 0..args.reps {
        let mock = MockApi::start("127.0.0.1:0".parse()?, MockLimits::default()).await?;
        let proxy = BenchEnvoy::start(
            &configs::proxy(&configs::wasm(&sluice, &policy), mock.addr.port()),
            PROXY_WORKERS,
        )?;
        mock.reset();
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(SENT)
            .build()?;
        let tasks: Vec<_> = (0..SENT)
            .map(|_| {
                let r = http
                    .get(format!("http://127.0.0.1:{}/", proxy.port))
                    .header("host", HOST);
                tokio::spawn(
                    async move { r.send().await.map(|x| x.status().as_u16()).unwrap_or(0) },
                )
            })
            .collect();
        let mut ok = 0;
        for t in tasks {
            if t.await? == 200 {
                ok += 1;
            }
        }
        let arrivals = mock.arrivals();
        // Turns are 10 ms apart in ticket order. The grid's origin is the
        // earliest any release allows (a release is never early), so each
        // figure is lateness relative to the most punctual release.
        let offsets: Vec<f64> = arrivals
            .iter()
            .filter_map(|a| Some(a.at.as_secs_f64() * 1000.0 - a.queue_ticket? as f64 * 10.0))
            .collect();
        let origin = offsets.iter().copied().fold(f64::INFINITY, f64::min);
        let mut late: Vec<f64> = offsets.iter().map(|o| o - origin).collect();
        late.sort_by(f64::total_cmp);
        let (p50, p99, max) = (
            percentile(&late, 0.5),
            percentile(&late, 0.99),
            late.last().copied().unwrap_or(f64::NAN),
        );
        println!("queue rep {rep}: {ok}/{SENT} passed, {} queued; release - slot: p50 {p50:.2} ms, p99 {p99:.2} ms, max {max:.2} ms", late.len());
        rows.push((p50, p99, max, ok));
        all.extend(late);
    }
    let chart = img.join("bench-queue.png");
    plot::histogram(
        &chart,
        "Queue: release time minus reserved slot (ms), 500 requests at 100/s",
        "ms after the slot",
        &all,
        0.5,
    )?;
    let mut s = String::from(
        "## 3. Queue precision\n\n100 requests/s queued (burst 1, `max_wait` 10 s), 500 requests sent at once on 500 connections, \
         Envoy `--concurrency 2`. The upstream timestamps each arrival and reads its queue ticket from \
         `x-sluice-queue-ticket` (`queue_ticket_header`); turns are 10 ms apart in ticket order, so release \
         minus slot is the arrival minus ticket × 10 ms, measured from the most punctual release (the grid's \
         origin is not observable outside the filter; this leaves out any lateness common to all releases). \
         The filter's tick is 1 ms while anything waits.\n\n| run | passed | p50 ms | p99 ms | max ms |\n|---|---|---|---|---|\n",
    );
    for (i, (p50, p99, max, ok)) in rows.iter().enumerate() {
        let _ = writeln!(
            s,
            "| {} | {ok} / {SENT} | {p50:.2} | {p99:.2} | {max:.2} |",
            i + 1
        );
    }
    let _ = writeln!(
        s,
        "| median | | {:.2} | {:.2} | {:.2} |",
        median(rows.iter().map(|r| r.0).collect()),
        median(rows.iter().map(|r| r.1).collect()),
        median(rows.iter().map(|r| r.2).collect())
    );
    let _ = writeln!(s, "\n![release error histogram](img/bench-queue.png)");
    report.add(s);
    Ok(())
}

/// Scenario 4: edits reaching every worker; the admin's cost of syncs.
/// Edits timed in scenario 4, and the p99 they are held to (push).
const EDITS: u64 = 50;
const EDIT_P99_TARGET_MS: f64 = 100.0;

pub async fn control_plane(args: &Args, report: &mut Report) -> anyhow::Result<()> {
    const PASSWORD: &str = "bench-password";
    const TOKEN: &str = procs::SYNC_TOKEN;
    const WORKERS: u32 = 4;
    let sluice = args.sluice_wasm.canonicalize()?;
    let admin_port = free_port()?;
    let admin = procs::start_admin(&args.admin_bin, admin_port, PASSWORD)?;
    let base = format!("http://127.0.0.1:{admin_port}");
    let op = sluice_e2e::admin::Operator::login(&base, PASSWORD).await?;
    let policy = |n: u64| json!({"name": "cp", "match": {"host": "*"}, "rate": {"requests": n, "period": "1s"}});
    op.create(policy(1000)).await?;
    let plugin = format!(
        r#"{{"instance": "bench", "admin_cluster": "sluice_admin", "sync_interval": "1s", "sync_token": "{TOKEN}",
            "fallback": {{"version": 0, "policies": []}}}}"#
    );
    let config = configs::proxy(&configs::wasm(&sluice, &plugin), 9).replace(
        "  clusters:\n",
        &format!(
            "  clusters:\n  - name: sluice_admin\n    type: STATIC\n    connect_timeout: 1s\n    load_assignment:\n      cluster_name: sluice_admin\n      endpoints: [{{ lb_endpoints: [{{ endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {admin_port} }} }} }} }}] }}]\n"
        ),
    );
    let envoy = BenchEnvoy::start(&config, WORKERS)?;
    let installs = |e: &BenchEnvoy| e.stat("sluice_policy_sets_installed{}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while installs(&envoy) < filter_vms(WORKERS) {
        if Instant::now() > deadline {
            bail!("the first policy set never reached every worker");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut latencies = Vec::new();
    for change in 0..EDITS {
        let before = installs(&envoy);
        let started = Instant::now();
        op.update(policy(if change % 2 == 0 { 2000 } else { 1000 }))
            .await?;
        loop {
            if installs(&envoy) >= before + filter_vms(WORKERS) {
                break;
            }
            if started.elapsed() > Duration::from_secs(10) {
                bail!("change {change} not in every worker after 10 s");
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        latencies.push(started.elapsed().as_secs_f64() * 1000.0);
        // Land the next edit anywhere in the sync cycle.
        tokio::time::sleep(Duration::from_millis(137 * (change % 7))).await;
    }
    drop(envoy);
    latencies.sort_by(f64::total_cmp);
    let (p50, p99) = (percentile(&latencies, 0.5), percentile(&latencies, 0.99));
    println!("control plane: change -> all {WORKERS} workers p50 {p50:.0} ms, p99 {p99:.0} ms");

    // 100 simulated instances syncing once a second, then as fast as they can.
    let version = op.get("/api/v1/policies").await?["version"]
        .as_u64()
        .unwrap_or(0);
    let watches = hold_watches(&base, TOKEN, version, 100);
    let steady = sync_load(
        &base,
        TOKEN,
        version,
        admin.pid(),
        100,
        Some(Duration::from_secs(1)),
        Duration::from_secs(args.seconds),
    )
    .await?;
    for w in watches {
        w.abort();
    }
    let flat_out = sync_load(
        &base,
        TOKEN,
        version,
        admin.pid(),
        100,
        None,
        Duration::from_secs(5),
    )
    .await?;
    let admin_rss = rss_mib(admin.pid())?;
    report
        .footprint
        .insert("admin_rss", format!("{admin_rss:.1}"));
    let mut s = String::from(
        "## 4. Control plane\n\nA policy edited through the admin API until every one of Envoy's 4 workers has installed \
         it (`sluice_policy_sets_installed` grew by 5: the 4 workers and the filter's root context on Envoy's main \
         thread, which installs too), from the API's 2xx, with edits landing at different points of the filter's \
         `sync_interval` of 1 s (the default). The admin pushes: each Envoy holds one watch call open \
         (`POST /api/v1/sync/watch`, held up to 20 s) besides its sync connection, and the admin answers it as soon \
         as the set changes; the other workers take the set from shared data on their next tick (20 ms while push \
         is on). The figure includes the workers' stats being flushed and read over Envoy's admin API.\n\n",
    );
    let _ = writeln!(s, "| edits | p50 | p99 | fastest | slowest |\n|---|---|---|---|---|\n| {EDITS} | {p50:.0} ms | {p99:.0} ms | {:.0} ms | {:.0} ms |\n",
        latencies.first().copied().unwrap_or(f64::NAN), latencies.last().copied().unwrap_or(f64::NAN));
    let _ = writeln!(
        s,
        "p99 from an edit's 2xx to every worker enforcing it: {p99:.0} ms (target < {EDIT_P99_TARGET_MS:.0} ms: {}); \
         before push (step 5, polling every 1 s): p50 719 ms, p99 1 014 ms.\n",
        verdict(p99 < EDIT_P99_TARGET_MS)
    );
    s.push_str("Admin cost of syncs: 100 simulated instances POST `/api/v1/sync` with a report (each 304: no change), \
                once a second each as real filters with `sync_interval: 1s` would, each also holding a watch open as \
                real filters do (connections held: one watch per Envoy), then back to back without watches.\n\n\
                | load | syncs/s | admin CPU | CPU per sync |\n|---|---|---|---|\n");
    for (label, r) in [
        ("100 instances, 1/s each", steady),
        ("100 instances, back to back", flat_out),
    ] {
        let _ = writeln!(
            s,
            "| {label} | {:.0} | {:.1} % of a core | {:.0} µs |",
            r.per_second,
            r.cpu_share * 100.0,
            r.cpu_us_per_sync
        );
    }
    report.add(s);
    Ok(())
}

/// `instances` simulated Envoys each holding a watch open, as filters
/// with push on do: reopened whenever the admin answers it.
fn hold_watches(
    base: &str,
    token: &str,
    version: u64,
    instances: usize,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..instances)
        .map(|i| {
            let http = reqwest::Client::new();
            let url = format!("{base}/api/v1/sync/watch");
            let auth = format!("Bearer {token}");
            let body =
                json!({"instance": format!("sim-{i}"), "policy_version": version}).to_string();
            tokio::spawn(async move {
                loop {
                    let answered = http
                        .post(&url)
                        .header("authorization", &auth)
                        .header("content-type", "application/json")
                        .header("sluice-wait-ms", "20000")
                        .body(body.clone())
                        .send()
                        .await;
                    if answered.is_err() {
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
            })
        })
        .collect()
}

struct SyncLoad {
    per_second: f64,
    cpu_share: f64,
    cpu_us_per_sync: f64,
}

async fn sync_load(
    base: &str,
    token: &str,
    version: u64,
    admin_pid: u32,
    instances: usize,
    every: Option<Duration>,
    duration: Duration,
) -> anyhow::Result<SyncLoad> {
    let done = Arc::new(AtomicU64::new(0));
    let cpu_before = cpu_time(admin_pid)?;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..instances {
        let http = reqwest::Client::new();
        let url = format!("{base}/api/v1/sync");
        let auth = format!("Bearer {token}");
        let done = Arc::clone(&done);
        tasks.push(tokio::spawn(async move {
            let mut counts = sluice_wire::counts::Counts::default();
            counts.set(sluice_wire::stats::PolicyCounter::Admitted, 950);
            counts.set(sluice_wire::stats::PolicyCounter::Rejected, 12);
            let mut policies = BTreeMap::new();
            policies.insert(
                "cp".to_string(),
                PolicyReport {
                    counts,
                    tokens: Some(40),
                    ..Default::default()
                },
            );
            let report = SyncReport {
                instance: format!("sim-{i}"),
                policy_version: version,
                at_ms: 0,
                policies,
                ..SyncReport::default()
            };
            let body = serde_json::to_string(&report).unwrap_or_default();
            // Spread the instances over the interval, as real ones are.
            if let Some(every) = every {
                tokio::time::sleep(every.mul_f64(i as f64 / instances as f64)).await;
            }
            while started.elapsed() < duration {
                let t = Instant::now();
                let answered = http
                    .post(&url)
                    .header("authorization", &auth)
                    .header("content-type", "application/json")
                    .body(body.clone())
                    .send()
                    .await
                    .is_ok_and(|r| r.status().as_u16() == 304 || r.status().is_success());
                if answered {
                    done.fetch_add(1, Ordering::Relaxed);
                }
                if let Some(every) = every {
                    tokio::time::sleep(every.saturating_sub(t.elapsed())).await;
                }
            }
        }));
    }
    for t in tasks {
        t.await?;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let cpu = (cpu_time(admin_pid)? - cpu_before).as_secs_f64();
    let n = done.load(Ordering::Relaxed) as f64;
    let r = SyncLoad {
        per_second: n / elapsed,
        cpu_share: cpu / elapsed,
        cpu_us_per_sync: cpu * 1e6 / n.max(1.0),
    };
    println!(
        "sync load: {:.0} syncs/s, admin CPU {:.1} %, {:.0} µs per sync",
        r.per_second,
        r.cpu_share * 100.0,
        r.cpu_us_per_sync
    );
    Ok(r)
}

/// Scenario 5: sizes and resident memory.
pub fn footprint(args: &Args, report: &mut Report) -> anyhow::Result<()> {
    let size = |p: &Path| {
        std::fs::metadata(p)
            .map(|m| m.len() as f64 / 1024.0)
            .unwrap_or(f64::NAN)
    };
    let get = |k: &str| {
        report
            .footprint
            .get(k)
            .cloned()
            .unwrap_or_else(|| "— (scenario not run)".into())
    };
    let s = format!(
        "## 5. Footprint\n\n| what | size |\n|---|---|\n\
         | Sluice filter `.wasm` (release-wasm profile) | {:.0} KiB |\n\
         | no-op filter `.wasm` | {:.0} KiB |\n\
         | Envoy RSS, no filter (b), after a run | {} MiB |\n\
         | Envoy RSS, no-op wasm (f), after a run | {} MiB |\n\
         | Envoy RSS, Sluice (d), after a run | {} MiB |\n\
         | Envoy RSS, Sluice per-key over 10 000 keys (e), after a run | {} MiB |\n\
         | admin RSS, after scenario 4 | {} MiB |\n",
        size(&args.sluice_wasm),
        size(&args.noop_wasm),
        get("envoy_rss_b"),
        get("envoy_rss_f"),
        get("envoy_rss_d"),
        get("envoy_rss_e"),
        get("admin_rss"),
    );
    report.add(s);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(sections: &[&str]) -> Report {
        Report {
            sections: sections.iter().map(|s| s.to_string()).collect(),
            machine: "- CPU: new\n".into(),
            stamp: format!("{STAMP_PREFIX}today*"),
            footprint: BTreeMap::new(),
        }
    }

    #[test]
    fn a_section_says_when_by_which_command_and_at_which_commit_it_was_measured() {
        let mut r = report(&[]);
        r.add("## 6. Instructions per request\n\nCommand: x\n".into());
        assert_eq!(
            r.sections,
            vec![format!(
                "## 6. Instructions per request\n\n{STAMP_PREFIX}today*\n\nCommand: x\n"
            )]
        );
        let stamp = run_stamp();
        assert!(
            stamp.starts_with(STAMP_PREFIX)
                && stamp.contains(", commit ")
                && stamp.contains("`make bench"),
            "{stamp}"
        );
    }

    #[test]
    fn a_run_of_some_scenarios_replaces_only_their_sections() {
        let existing = "# Benchmarks\n\nold intro\n\n## Machine\n\n- CPU: old\n\n\
            ## 1. Overhead\n\nold one\n\n## 6. Instructions (old name)\n\nold six\n\n\
            ## 10. Pools\n\nmeasured by the e2e suites\n";
        let merged = report(&["## 6. Instructions per request\n\nnew six\n"]).merged_into(existing);
        assert!(merged.contains("old one"), "{merged}");
        assert!(
            merged.contains("new six") && !merged.contains("old six"),
            "{merged}"
        );
        assert!(merged.contains("measured by the e2e suites"), "{merged}");
        assert!(
            merged.contains("- CPU: new") && !merged.contains("- CPU: old"),
            "{merged}"
        );
        // In their places: 1, then 6, then 10.
        let at = |s: &str| merged.find(s).unwrap_or(usize::MAX);
        assert!(
            at("old one") < at("new six") && at("new six") < at("Pools"),
            "{merged}"
        );
    }

    #[test]
    fn new_sections_go_at_the_end_and_an_empty_file_gets_the_whole_report() {
        let existing = "# Benchmarks\n\n## Machine\n\nold\n\n## 1. Overhead\n\none\n";
        let merged = report(&["## 12. New\n\ntwelve\n"]).merged_into(existing);
        assert!(merged.trim_end().ends_with("twelve"), "{merged}");
        assert!(merged.contains("one"));
        let whole = report(&["## 1. Overhead\n\none\n"]);
        assert_eq!(whole.merged_into(""), whole.markdown());
    }
}
