//! Scenario 6: instructions per request under callgrind for the variants
//! the added-cost ratios compare, far from the limit (the worker admits
//! from its prefetch) and near it (every call decided in shared data),
//! and the ratios judged on them.

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::Context;

use crate::callgrind::{self, Load};
use crate::configs;
use crate::judge::instruction_ratio;
use crate::procs::BenchEnvoy;
use crate::scenarios::Report;
use crate::Args;

const HOST: &str = "api.bench.example";
/// Sluice's added instructions over Envoy at most this many times the
/// no-op filter reading `:authority` (h) adds, far from the limit.
pub const TARGET: f64 = 1.15;

/// A rate this high never refuses; a burst of 3 leaves less than
/// `PREFETCH_SLACK` (4) times one call's worth, so nothing is prefetched
/// and every call is decided in shared data, as near a limit.
const NEAR: &str = r#""rate": {"requests": 100000000, "period": "1s", "burst": 3}"#;
const FAR: &str = r#""rate": {"requests": 100000000, "period": "1s", "burst": 1000000}"#;

struct Counted {
    key: &'static str,
    label: &'static str,
    far: f64,
    /// None where far and near are the same (no limit in the filter).
    near: Option<f64>,
}

pub async fn instructions(args: &Args, report: &mut Report) -> anyhow::Result<()> {
    let sluice = args
        .sluice_wasm
        .canonicalize()
        .context("the Sluice filter (make wasm)")?;
    let noop = args.noop_wasm.canonicalize().context("the no-op filter")?;
    let dir = tempfile::tempdir()?;
    let keys = configs::keys_script(dir.path())?;
    let policy = |rate: &str, extra: &str| {
        configs::wasm(
            &sluice,
            &configs::sluice(
                &format!(r#"{{"name": "bench", "match": {{"host": "{HOST}"}}, {rate}{extra}}}"#),
                "",
            ),
        )
    };
    let concurrency = r#", "concurrency": {"max_in_flight": 100000}"#;
    let per_key = r#", "key": {"header": "x-api-key", "max_keys": 10000}"#;
    let upstream = BenchEnvoy::start(&configs::upstream(), 1)?;
    let measure = Duration::from_secs(args.seconds);
    let run = |filters: &str, script: Option<&std::path::Path>| -> anyhow::Result<f64> {
        let load = Load {
            host: HOST,
            path: "/",
            script,
            warm_up: Duration::from_secs(3),
            measure,
        };
        let counted = callgrind::count(&configs::proxy(filters, upstream.port), &load)?;
        Ok(counted.per_request())
    };
    let mut rows = Vec::new();
    let mut both = |key, label, far: (String, Option<&std::path::Path>), near: Option<String>| {
        let far_count = run(&far.0, far.1)?;
        let near_count = near.map(|n| run(&n, far.1)).transpose()?;
        println!(
            "instructions ({key}) {label}: far {far_count:.0}, near {near_count:?} per request"
        );
        rows.push(Counted {
            key,
            label,
            far: far_count,
            near: near_count,
        });
        anyhow::Ok(())
    };
    both("b", "Envoy, no filter", (String::new(), None), None)?;
    both(
        "f",
        "no-op proxy-wasm filter",
        (configs::wasm(&noop, "{}"), None),
        None,
    )?;
    both(
        "h",
        "no-op proxy-wasm filter that reads `:authority`",
        (configs::wasm(&noop, ":authority"), None),
        None,
    )?;
    both(
        "g",
        "Sluice, rate only",
        (policy(FAR, ""), None),
        Some(policy(NEAR, "")),
    )?;
    both(
        "d",
        "Sluice, rate + concurrency",
        (policy(FAR, concurrency), None),
        Some(policy(NEAR, concurrency)),
    )?;
    both(
        "e",
        "Sluice, per key over 10 000 keys",
        (policy(FAR, per_key), Some(&keys)),
        Some(policy(NEAR, per_key)),
    )?;
    report.add(section(&rows, args.seconds));
    Ok(())
}

fn section(rows: &[Counted], seconds: u64) -> String {
    let of = |key: &str| rows.iter().find(|r| r.key == key);
    let base = of("b").map_or(f64::NAN, |r| r.far);
    let added = |key: &str, near: bool| {
        of(key).map_or(f64::NAN, |r| {
            if near {
                r.near.unwrap_or(r.far) - base
            } else {
                r.far - base
            }
        })
    };
    let mut s = format!(
        "## 6. Instructions per request (callgrind)\n\n\
         CPU time per request moves by ±2 µs between runs on small machines; instruction counts do not. \
         Envoy with one worker under `valgrind --tool=callgrind --smc-check=all-non-file`, counters zeroed \
         (`callgrind_control -z`) after a 3 s warm-up, then `wrk -t1 -c4 -d{seconds}s`, counters dumped \
         (`callgrind_control -d`), instructions divided by the requests answered. Far from the limit the \
         worker admits from its prefetch; near it (a burst of 3, below 4 calls' worth) every call is decided \
         in shared data.\n\n\
         | variant | instructions/request, far | added over (b), far | instructions/request, near | added over (b), near |\n\
         |---|---|---|---|---|\n"
    );
    for r in rows {
        let near = r.near.map_or(("same".into(), "same".into()), |n| {
            (format!("{n:.0}"), format!("{:+.0}", n - base))
        });
        let added_far = if r.key == "b" {
            "—".to_string()
        } else {
            format!("{:+.0}", r.far - base)
        };
        let _ = writeln!(
            s,
            "| ({}) {} | {:.0} | {added_far} | {} | {} |",
            r.key, r.label, r.far, near.0, near.1
        );
    }
    let (far_ratio, far_verdict) = instruction_ratio(added("d", false), added("h", false), TARGET);
    let (near_ratio, _) = instruction_ratio(added("d", true), added("h", false), TARGET);
    let (rate_ratio, _) = instruction_ratio(added("g", false), added("h", false), TARGET);
    let _ = writeln!(
        s,
        "\nAdded-instruction ratio (d)/(h), far from the limit: **{far_ratio:.3}** (target ≤ {TARGET}: {far_verdict}). \
         Near the limit: {near_ratio:.3} (stated, no target: every call pays a shared-data read and \
         compare-and-swap). Rate only (g)/(h), far: {rate_ratio:.3}."
    );
    s
}
