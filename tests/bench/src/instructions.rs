//! Scenario 6: instructions per request under callgrind for the variants
//! the added-cost ratios compare, far from the limit (the worker admits
//! from its prefetch) and near it (every call decided in shared data),
//! and the ratios judged on them.

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::Context;

use crate::callgrind::{self, Load};
use crate::configs;
use crate::judge::{instruction_ratio, Verdict};
use crate::procs::BenchEnvoy;
use crate::scenarios::Report;
use crate::wrk::Wrk;
use crate::Args;
use sluice_filter_core::bucket::PREFETCH_TTL;
use sluice_filter_core::plugin::MIN_TIME_SCALE;

const HOST: &str = "api.bench.example";
/// Sluice's added instructions over Envoy at most this many times the
/// no-op filter reading `:authority` (h) adds, far from the limit, with
/// each call's decision set on its stream for the access log (on by
/// default).
pub const TARGET: f64 = 1.15;

/// A rate this high never refuses; a burst of 3 leaves less than
/// `PREFETCH_SLACK` (4) times one call's worth, so nothing is prefetched
/// and every call is decided in shared data, as near a limit.
const NEAR: &str = r#""rate": {"requests": 100000000, "period": "1s", "burst": 3}"#;
const FAR: &str = r#""rate": {"requests": 100000000, "period": "1s", "burst": 1000000}"#;

/// One count, and for Sluice how fast the variant ran at full speed.
struct Measured {
    per_request: f64,
    /// Requests a second under callgrind.
    per_second: f64,
    /// Requests a second at full speed (its clock is slowed by
    /// [`CLOCK_SCALE`]).
    full_speed: Option<f64>,
}

/// How far a count's pace was from [`PACED`], as a fraction of it.
fn pace_error(per_second: f64) -> f64 {
    (per_second / PACED - 1.0).abs()
}

/// Why the counts of `keys` cannot be judged on, if one was made off pace.
fn off_pace(rows: &[Counted], keys: &[&str]) -> Option<String> {
    rows.iter()
        .filter(|r| keys.contains(&r.key))
        .find(|r| pace_error(r.far.per_second) > PACE_TOLERANCE)
        .map(|r| {
            format!(
                "({}) was counted at {:.1} calls/s, not the {PACED} sent: Envoy fell behind under callgrind",
                r.key, r.far.per_second
            )
        })
}

struct Counted {
    key: &'static str,
    label: &'static str,
    far: Measured,
    /// None where far and near are the same (no limit in the filter).
    near: Option<Measured>,
}

/// Seconds of the full-speed run whose pace is shown beside a variant's count.
const FULL_SPEED_RUN: Duration = Duration::from_secs(3);

/// Calls a second in every count: below what the slowest variant answers
/// under callgrind on a 2-core machine (some 70 a second, (e) near its
/// limits), so each is counted at the same pace whatever CPU valgrind got.
pub const PACED: f64 = 40.0;

/// Calls a second a Sluice variant's worker sees by its clock in every
/// count: about what one worker answers at full speed on the 2-core
/// machines Sluice is built on (3 700 to 5 400 with Sluice between runs
/// there). Fixed, not taken from each run's full-speed pace: that moved by
/// a third between runs, and (d)'s count by 700 instructions with it.
pub const WORKER_PACE: f64 = 4_000.0;

/// A Sluice variant's `time_scale`: its clock sees [`PACED`] calls a
/// second as [`WORKER_PACE`].
const CLOCK_SCALE: f64 = PACED / WORKER_PACE;
const _: () = assert!(CLOCK_SCALE >= MIN_TIME_SCALE && CLOCK_SCALE <= 1.0);

/// How far (as a fraction) the pace a count was made at may be from
/// [`PACED`]: further, Envoy fell behind the calls, and a Sluice variant's
/// clock saw fewer calls a second than at full speed (at 2 800 instead of
/// 4 200 a worker's clock readings are no longer reused and its prefetches
/// serve fewer calls, some 1 300 instructions a call more:
/// docs/PERFORMANCE.md).
const PACE_TOLERANCE: f64 = 0.05;

/// Issue 36: the native build adds at most this many times what Envoy's
/// local_ratelimit adds over no filter...
const NATIVE_TO_LOCAL: f64 = 3.0;
/// ...and under this share of what Envoy spends with no filter.
const NATIVE_SHARE: f64 = 0.02;
/// Issue 54: per key over 10 000 keys (e) adds at most this many times
/// what (h) adds...
const PER_KEY_TO_NOOP: f64 = 1.5;
/// ...near its limit (d) at most this many times...
const NEAR_TO_NOOP: f64 = 1.8;
/// ...and the native build near its limit at most this many times what
/// Envoy's local_ratelimit adds.
const NATIVE_NEAR_TO_LOCAL: f64 = 2.0;

/// Which build of Sluice a variant runs.
#[derive(Debug, Clone, Copy)]
enum Build {
    Wasm,
    Native,
}

pub async fn instructions(args: &Args, report: &mut Report) -> anyhow::Result<()> {
    let sluice = args
        .sluice_wasm
        .canonicalize()
        .context("the Sluice filter (make wasm)")?;
    let noop = args.noop_wasm.canonicalize().context("the no-op filter")?;
    let dir = tempfile::tempdir()?;
    let key_script = configs::keys_script(dir.path())?;
    let native = args
        .sluice_native
        .canonicalize()
        .context("Sluice's native build (make native)")?;
    let policy = |build: Build, rate: &str, extra: &str, scale: f64| {
        let configuration = configs::sluice(
            &format!(r#"{{"name": "bench", "match": {{"host": "{HOST}"}}, {rate}{extra}}}"#),
            &format!(r#", "time_scale": {scale}"#),
        );
        match build {
            Build::Wasm => configs::wasm(&sluice, &configuration),
            Build::Native => configs::native(&native, &configuration),
        }
    };
    let concurrency = r#", "concurrency": {"max_in_flight": 100000}"#;
    let per_key = r#", "key": {"header": "x-api-key", "max_keys": 10000}"#;
    let upstream = BenchEnvoy::start(&configs::upstream(), 1)?;
    // Twice the other scenarios' runs: at 40 calls a second, 800 calls.
    let measure = Duration::from_secs(args.seconds * 2);
    let count = |filters: &str, keys: Option<u32>| -> anyhow::Result<Measured> {
        let load = Load {
            host: HOST,
            path: "/",
            keys,
            per_second: PACED,
            warm_up: Duration::from_secs(3),
            measure,
        };
        let config = configs::proxy(filters, upstream.port);
        let mut counted = callgrind::count(&config, &load)?;
        if pace_error(counted.per_second) > PACE_TOLERANCE {
            println!(
                "instructions: Envoy answered {:.1} calls/s of the {PACED} sent under callgrind: counting again",
                counted.per_second
            );
            counted = callgrind::count(&config, &load)?;
        }
        Ok(Measured {
            per_request: counted.per_request(),
            per_second: counted.per_second,
            full_speed: None,
        })
    };
    let mut rows = Vec::new();
    let mut plain = |key, label, filters: String| -> anyhow::Result<()> {
        if !args.counts_variant(key) {
            return Ok(());
        }
        let far = count(&filters, None)?;
        println!(
            "instructions ({key}) {label}: {:.0} per request, {:.1}/s under callgrind",
            far.per_request, far.per_second
        );
        rows.push(Counted {
            key,
            label,
            far,
            near: None,
        });
        Ok(())
    };
    plain("b", "Envoy, no filter", String::new())?;
    // As far from its limit as Sluice far from its own: a bucket it never
    // empties at this pace.
    plain(
        "c",
        "Envoy's native local_ratelimit",
        configs::local_ratelimit(1_000_000, 1_000_000, 1000),
    )?;
    plain("f", "no-op proxy-wasm filter", configs::wasm(&noop, "{}"))?;
    plain(
        "h",
        "no-op proxy-wasm filter that reads `:authority`",
        configs::wasm(&noop, ":authority"),
    )?;
    if args.counts_variant("m") {
        let module = args
            .noop_module
            .canonicalize()
            .context("the no-op dynamic module (make bench builds it)")?;
        plain("m", "no-op dynamic module", configs::native(&module, "{}"))?;
    }
    // Under callgrind Envoy answers some 50 times fewer calls a second, and
    // a prefetch that lives 5 ms would cover a call or none: every call
    // would pay for shared data, far from the limit or not. Each Sluice
    // variant's clock is slowed by `PACED` over `WORKER_PACE`, so it sees
    // a full-speed worker's pace: its prefetches, ticks and clock readings
    // fall per call as they do there. The variant's own full-speed pace on
    // this machine is measured beside it, for the reader to weigh that.
    let sluice_count =
        |build: Build, rate: &str, extra: &str, keys: Option<u32>| -> anyhow::Result<Measured> {
            let full = BenchEnvoy::start(
                &configs::proxy(&policy(build, rate, extra, 1.0), upstream.port),
                1,
            )?;
            let run = Wrk {
                url: format!("http://127.0.0.1:{}/", full.port),
                host: HOST,
                connections: 4,
                threads: 1,
                duration: FULL_SPEED_RUN,
                script: keys.map(|_| key_script.as_path()),
                cpus: None,
            };
            run.run()?;
            let full_speed = run.run()?.per_second;
            drop(full);
            let mut measured = count(&policy(build, rate, extra, CLOCK_SCALE), keys)?;
            measured.full_speed = Some(full_speed);
            Ok(measured)
        };
    let mut sluice_row = |key, build: Build, label, extra: &str, keys| -> anyhow::Result<()> {
        if !args.counts_variant(key) {
            return Ok(());
        }
        let far = sluice_count(build, FAR, extra, keys)?;
        let near = if args.far_only {
            None
        } else {
            Some(sluice_count(build, NEAR, extra, keys)?)
        };
        println!(
            "instructions ({key}) {label}: far {:.0}, near {} per request",
            far.per_request,
            near.as_ref()
                .map_or("not counted".into(), |n| format!("{:.0}", n.per_request))
        );
        rows.push(Counted {
            key,
            label,
            far,
            near,
        });
        Ok(())
    };
    sluice_row("g", Build::Wasm, "Sluice, rate only", "", None)?;
    sluice_row(
        "d",
        Build::Wasm,
        "Sluice, rate + concurrency",
        concurrency,
        None,
    )?;
    sluice_row(
        "e",
        Build::Wasm,
        "Sluice, per key over 10 000 keys",
        per_key,
        Some(configs::BENCH_KEYS),
    )?;
    sluice_row(
        "n",
        Build::Native,
        "Sluice native module, rate + concurrency",
        concurrency,
        None,
    )?;
    report.add(section(&rows, measure.as_secs()));
    Ok(())
}

fn section(rows: &[Counted], seconds: u64) -> String {
    let of = |key: &str| rows.iter().find(|r| r.key == key);
    let base = of("b").map_or(f64::NAN, |r| r.far.per_request);
    let added = |key: &str, near: bool| {
        of(key).map_or(f64::NAN, |r| {
            let m = match (near, &r.near) {
                (false, _) => Some(&r.far),
                (true, Some(n)) => Some(n),
                // No limit in the filter: far and near are the same.
                (true, None) if r.far.full_speed.is_none() => Some(&r.far),
                (true, None) => None,
            };
            m.map_or(f64::NAN, |m| m.per_request - base)
        })
    };
    let mut s = format!(
        "## 6. Instructions per request (callgrind)\n\n\
         Command: `make bench BENCH_ARGS=\"--only 6\"`. CPU time per request moves by ±2 µs between runs on small machines; instruction counts do not. \
         Envoy with one worker under `valgrind --tool=callgrind --smc-check=all-non-file`, counters zeroed \
         (`callgrind_control -z`) after a 3 s warm-up, then calls sent at a fixed {PACED} a second for \
         {seconds} s (as a user's traffic comes, not as fast as Envoy answers), counters dumped \
         (`callgrind_control -d`), instructions divided by the calls answered. Far from the limit the \
         worker admits from its prefetch; near it (a burst of 3, below 4 calls' worth) every call is decided \
         in shared data.\n\n\
         | variant | instructions/request, far | added over (b), far | instructions/request, near | added over (b), near |\n\
         |---|---|---|---|---|\n"
    );
    for r in rows {
        let near = match (&r.near, r.far.full_speed) {
            (Some(n), _) => (
                format!("{:.0}", n.per_request),
                format!("{:+.0}", n.per_request - base),
            ),
            (None, None) => ("same".into(), "same".into()),
            (None, Some(_)) => ("not counted".into(), "not counted".into()),
        };
        let added_far = if r.key == "b" {
            "—".to_string()
        } else {
            format!("{:+.0}", r.far.per_request - base)
        };
        let _ = writeln!(
            s,
            "| ({}) {} | {:.0} | {added_far} | {} | {} |",
            r.key, r.label, r.far.per_request, near.0, near.1
        );
    }
    let (far_ratio, mut far_verdict) =
        instruction_ratio(added("d", false), added("h", false), TARGET);
    if let Some(why) = off_pace(rows, &["b", "h", "d"]) {
        far_verdict = Verdict::Invalid(why);
    }
    let (near_ratio, mut near_verdict) =
        instruction_ratio(added("d", true), added("h", false), NEAR_TO_NOOP);
    let (per_key_ratio, mut per_key_verdict) =
        instruction_ratio(added("e", false), added("h", false), PER_KEY_TO_NOOP);
    if let Some(why) = off_pace(rows, &["b", "h", "d"]) {
        near_verdict = Verdict::Invalid(why);
    }
    if let Some(why) = off_pace(rows, &["b", "h", "e"]) {
        per_key_verdict = Verdict::Invalid(why);
    }
    let (rate_ratio, _) = instruction_ratio(added("g", false), added("h", false), TARGET);
    // Seconds between two calls of one key at the pace the filter's clock sees.
    let key_recurs = f64::from(configs::BENCH_KEYS) / WORKER_PACE;
    let _ = writeln!(
        s,
        "\nAdded-instruction ratio (d)/(h), far from the limit: **{far_ratio:.3}** (target ≤ {TARGET}: {far_verdict}). \
         Near the limit: **{near_ratio:.3}** (target ≤ {NEAR_TO_NOOP}: {near_verdict}; every call is one shared-data read and \
         compare-and-swap, its slot going back with the next). Per key over 10 000 keys (e)/(h): **{per_key_ratio:.3}** \
         (target ≤ {PER_KEY_TO_NOOP}: {per_key_verdict}; a key recurs every {key_recurs:.1} s here, far less often than a prefetch lives, \
         so every call is a shared-data read and compare-and-swap of its key's place). Rate only (g)/(h), far: {rate_ratio:.3}."
    );
    // The native build against Envoy's own limiter, and against Envoy.
    let (native_ratio, mut native_verdict) =
        instruction_ratio(added("n", false), added("c", false), NATIVE_TO_LOCAL);
    let (native_share, mut share_verdict) =
        instruction_ratio(added("n", false), base, NATIVE_SHARE);
    let (native_near_ratio, mut native_near_verdict) =
        instruction_ratio(added("n", true), added("c", false), NATIVE_NEAR_TO_LOCAL);
    if let Some(why) = off_pace(rows, &["b", "c", "n"]) {
        native_verdict = Verdict::Invalid(why.clone());
        native_near_verdict = Verdict::Invalid(why.clone());
        share_verdict = Verdict::Invalid(why);
    }
    let _ = writeln!(
        s,
        "\nThe native build (n) against Envoy's native local_ratelimit (c), added instructions far from \
         the limit: **{native_ratio:.2}×** (target ≤ {NATIVE_TO_LOCAL}×: {native_verdict}); (n) adds \
         **{:.2} %** of (b) (target under {:.0} %: {share_verdict}). A dynamic module that does nothing \
         (m) adds {:+.0} ({:.2} % of (b)) by itself: what Envoy spends on any module's hooks, the floor \
         under (n); Sluice's own work in (n) is {:+.0} over it. Near its limit (n) adds {:+.0} \
         (every call decided in the process's shared memory): **{native_near_ratio:.2}×** what (c) adds \
         (target ≤ {NATIVE_NEAR_TO_LOCAL}×: {native_near_verdict}); over the no-op module, {:+.0}, {:.2}× what (c) adds.",
        native_share * 100.0,
        NATIVE_SHARE * 100.0,
        added("m", false),
        added("m", false) / base * 100.0,
        added("n", false) - added("m", false),
        added("n", true),
        added("n", true) - added("m", false),
        (added("n", true) - added("m", false)) / added("c", false),
    );
    let _ = write!(
        s,
        "\nUnder callgrind Envoy answers some 50 times fewer calls a second. A prefetch lives {} ms of the \
         filter's clock and a worker holding one ticks every 20 ms, so at that pace every call would find \
         its prefetch lapsed and a tick would fall every few calls: the count would be of a filter near its \
         limit all the time, and of ticks a full-speed Envoy spreads over hundreds of calls. Each Sluice \
         run therefore slows the filter's clock (plugin field `time_scale`) by {PACED} over {WORKER_PACE}, so \
         that it sees {WORKER_PACE} calls a second, about what one worker answers at full speed on a 2-core \
         machine (the variant's own full-speed pace on this machine, one worker, wrk as above, 3 s, is in \
         the table below; it moved by a third between runs, so it does not set the pace). Every count is \
         made at {PACED} calls a second, not as fast as Envoy answers under callgrind: that pace followed \
         how much CPU valgrind got, which moved by half between counts, and with it how often a worker's \
         clock is read and its prefetches renewed. A count Envoy fell more than {:.0} % \
         behind is made once more; a far count of (b), (h) or (d) still behind makes the ratio an invalid \
         run.\n\n\
         | variant | calls/s at full speed | calls/s under callgrind, far / near | `time_scale` | calls per second of the filter's clock, far / near |\n\
         |---|---|---|---|---|\n",
        PREFETCH_TTL.as_millis(),
        PACE_TOLERANCE * 100.0,
    );
    for r in rows {
        let Some(full) = r.far.full_speed else {
            continue;
        };
        let (near_per_second, near_clocked) =
            r.near.as_ref().map_or(("—".into(), "—".into()), |n| {
                (
                    format!("{:.0}", n.per_second),
                    format!("{:.0}", n.per_second / CLOCK_SCALE),
                )
            });
        let _ = writeln!(
            s,
            "| ({}) {} | {full:.0} | {:.0} / {near_per_second} | {CLOCK_SCALE:.5} | {:.0} / {near_clocked} |",
            r.key,
            r.label,
            r.far.per_second,
            r.far.per_second / CLOCK_SCALE,
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(key: &'static str, per_second: f64) -> Counted {
        Counted {
            key,
            label: "",
            far: Measured {
                per_second,
                per_request: 180_000.0,
                full_speed: None,
            },
            near: None,
        }
    }

    #[test]
    fn a_count_envoy_fell_behind_on_makes_the_ratio_invalid() {
        let on_pace = [row("b", 40.1), row("h", 39.9), row("d", 39.0)];
        assert_eq!(off_pace(&on_pace, &["b", "h", "d"]), None);
        let behind = [row("b", 40.0), row("h", 40.0), row("d", 30.0)];
        let why = off_pace(&behind, &["b", "h", "d"]);
        assert!(why.is_some_and(|w| w.contains("(d) was counted at 30.0 calls/s")));
        // Only the counts the ratio is made of.
        assert_eq!(off_pace(&behind, &["b", "h"]), None);
    }
}
