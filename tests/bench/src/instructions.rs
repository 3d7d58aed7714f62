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
use sluice_shared::bucket::PREFETCH_TTL;
use sluice_shared::plugin::MIN_TIME_SCALE;

const HOST: &str = "api.bench.example";
/// Sluice's added instructions over Envoy at most this many times the
/// no-op filter reading `:authority` (h) adds, far from the limit.
pub const TARGET: f64 = 1.15;

/// A rate this high never refuses; a burst of 3 leaves less than
/// `PREFETCH_SLACK` (4) times one call's worth, so nothing is prefetched
/// and every call is decided in shared data, as near a limit.
const NEAR: &str = r#""rate": {"requests": 100000000, "period": "1s", "burst": 3}"#;
const FAR: &str = r#""rate": {"requests": 100000000, "period": "1s", "burst": 1000000}"#;

/// One count, and for Sluice how its clock was slowed to match full speed.
struct Measured {
    per_request: f64,
    /// Requests a second under callgrind.
    per_second: f64,
    /// (requests a second at full speed, the filter's `time_scale`).
    slowed: Option<(f64, f64)>,
}

impl Measured {
    /// For Sluice: how far the calls a second of its clock were from full
    /// speed's, as a fraction of full speed.
    fn pace_error(&self) -> Option<f64> {
        let (full, scale) = self.slowed?;
        Some((self.per_second / scale / full - 1.0).abs())
    }
}

struct Counted {
    key: &'static str,
    label: &'static str,
    far: Measured,
    /// None where far and near are the same (no limit in the filter).
    near: Option<Measured>,
}

/// Seconds of the full-speed run that sets a variant's clock scale.
const FULL_SPEED_RUN: Duration = Duration::from_secs(3);

/// How far (as a fraction) the calls a second a Sluice variant's clock saw
/// under callgrind may be from its full-speed pace for the count to stand
/// for full speed: at 2 800 instead of 4 200 a second a worker's clock
/// readings are no longer reused and its prefetches serve fewer calls,
/// some 1 300 instructions a call more (docs/PERFORMANCE.md).
const PACE_TOLERANCE: f64 = 0.05;
/// Counts made again, each on the pace the last one showed.
const PACE_RECOUNTS: usize = 3;

pub async fn instructions(args: &Args, report: &mut Report) -> anyhow::Result<()> {
    let sluice = args
        .sluice_wasm
        .canonicalize()
        .context("the Sluice filter (make wasm)")?;
    let noop = args.noop_wasm.canonicalize().context("the no-op filter")?;
    let dir = tempfile::tempdir()?;
    let keys = configs::keys_script(dir.path())?;
    let policy = |rate: &str, extra: &str, scale: f64| {
        configs::wasm(
            &sluice,
            &configs::sluice(
                &format!(r#"{{"name": "bench", "match": {{"host": "{HOST}"}}, {rate}{extra}}}"#),
                &format!(r#", "time_scale": {scale}"#),
            ),
        )
    };
    let concurrency = r#", "concurrency": {"max_in_flight": 100000}"#;
    let per_key = r#", "key": {"header": "x-api-key", "max_keys": 10000}"#;
    let upstream = BenchEnvoy::start(&configs::upstream(), 1)?;
    let measure = Duration::from_secs(args.seconds);
    let count = |filters: &str, script: Option<&std::path::Path>| -> anyhow::Result<Measured> {
        let load = Load {
            host: HOST,
            path: "/",
            script,
            warm_up: Duration::from_secs(3),
            measure,
        };
        let counted = callgrind::count(&configs::proxy(filters, upstream.port), &load)?;
        Ok(Measured {
            per_request: counted.per_request(),
            per_second: counted.per_second,
            slowed: None,
        })
    };
    let mut rows = Vec::new();
    let mut plain = |key, label, filters: String| -> anyhow::Result<f64> {
        if !args.counts_variant(key) {
            return Ok(f64::NAN);
        }
        let far = count(&filters, None)?;
        println!(
            "instructions ({key}) {label}: {:.0} per request, {:.0}/s under callgrind",
            far.per_request, far.per_second
        );
        let rate = far.per_second;
        rows.push(Counted {
            key,
            label,
            far,
            near: None,
        });
        Ok(rate)
    };
    plain("b", "Envoy, no filter", String::new())?;
    plain("f", "no-op proxy-wasm filter", configs::wasm(&noop, "{}"))?;
    let slow_rate = plain(
        "h",
        "no-op proxy-wasm filter that reads `:authority`",
        configs::wasm(&noop, ":authority"),
    )?;
    anyhow::ensure!(
        slow_rate.is_finite() || !["g", "d", "e"].iter().any(|k| args.counts_variant(k)),
        "Sluice's variants are slowed by how fast (h) runs under callgrind: count (h) with them"
    );
    // Under callgrind Envoy answers some 50 times fewer calls a second, and
    // a prefetch that lives 5 ms would cover a call or none: every call
    // would pay for shared data, far from the limit or not. Each Sluice
    // variant's clock is slowed so that it sees as many calls a second of
    // its clock as the variant answers at full speed: its prefetches, ticks
    // and clock readings then fall per request as they do at full speed.
    // The first guess is how much slower (h) ran under callgrind; the
    // variant runs slower still, by an amount that moves with the machine,
    // so the count is made again on the pace it showed until its clock saw
    // within `PACE_TOLERANCE` of full speed.
    let sluice_count = |rate: &str, extra: &str, script| -> anyhow::Result<Measured> {
        let full = BenchEnvoy::start(&configs::proxy(&policy(rate, extra, 1.0), upstream.port), 1)?;
        let run = Wrk {
            url: format!("http://127.0.0.1:{}/", full.port),
            host: HOST,
            connections: 4,
            threads: 1,
            duration: FULL_SPEED_RUN,
            script,
            cpus: None,
        };
        run.run()?;
        let full_speed = run.run()?.per_second;
        drop(full);
        let scale_for = |slow: f64| (slow / full_speed.max(1.0)).clamp(MIN_TIME_SCALE, 1.0);
        let mut scale = scale_for(slow_rate);
        let mut measured = count(&policy(rate, extra, scale), script)?;
        measured.slowed = Some((full_speed, scale));
        for _ in 0..PACE_RECOUNTS {
            if measured.pace_error().is_none_or(|e| e <= PACE_TOLERANCE) {
                break;
            }
            println!(
                "instructions: the filter's clock saw {:.0} calls/s, not the {full_speed:.0} of full speed: counting again",
                measured.per_second / scale
            );
            scale = scale_for(measured.per_second);
            measured = count(&policy(rate, extra, scale), script)?;
            measured.slowed = Some((full_speed, scale));
        }
        Ok(measured)
    };
    let mut sluice_row = |key, label, extra: &str, script| -> anyhow::Result<()> {
        if !args.counts_variant(key) {
            return Ok(());
        }
        let far = sluice_count(FAR, extra, script)?;
        let near = if args.far_only {
            None
        } else {
            Some(sluice_count(NEAR, extra, script)?)
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
    sluice_row("g", "Sluice, rate only", "", None)?;
    sluice_row("d", "Sluice, rate + concurrency", concurrency, None)?;
    sluice_row(
        "e",
        "Sluice, per key over 10 000 keys",
        per_key,
        Some(&keys),
    )?;
    report.add(section(&rows, args.seconds));
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
                (true, None) if r.far.slowed.is_none() => Some(&r.far),
                (true, None) => None,
            };
            m.map_or(f64::NAN, |m| m.per_request - base)
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
        let near = match (&r.near, r.far.slowed) {
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
    if let Some(error) = of("d").and_then(|d| d.far.pace_error()) {
        if error > PACE_TOLERANCE {
            far_verdict = Verdict::Invalid(format!(
                "(d)'s clock saw calls {:.0} % off its full-speed pace, over the {:.0} % a count stands for full speed within",
                error * 100.0,
                PACE_TOLERANCE * 100.0
            ));
        }
    }
    let (near_ratio, _) = instruction_ratio(added("d", true), added("h", false), TARGET);
    let (rate_ratio, _) = instruction_ratio(added("g", false), added("h", false), TARGET);
    let _ = writeln!(
        s,
        "\nAdded-instruction ratio (d)/(h), far from the limit: **{far_ratio:.3}** (target ≤ {TARGET}: {far_verdict}). \
         Near the limit: {near_ratio:.3} (stated, no target: every call pays a shared-data read and \
         compare-and-swap). Rate only (g)/(h), far: {rate_ratio:.3}."
    );
    let _ = write!(
        s,
        "\nUnder callgrind Envoy answers some 50 times fewer calls a second. A prefetch lives {} ms of the \
         filter's clock and a worker holding one ticks every 20 ms, so at that pace every call would find \
         its prefetch lapsed and a tick would fall every few calls: the count would be of a filter near its \
         limit all the time, and of ticks a full-speed Envoy spreads over hundreds of calls. Each Sluice \
         run therefore slows the filter's clock (plugin field `time_scale`) so that it sees as many calls \
         per second of its clock as the variant answers at full speed (one worker, the same load, 3 s). \
         The first count slows it by how much slower (h) runs under callgrind; the variant runs slower \
         still, by an amount that moves with the machine, so a count whose clock saw calls more than {:.0} % \
         off that pace is made again on the pace it showed (at most {PACE_RECOUNTS} times; a far count of (d) \
         still off makes the ratio an invalid run). The last count is the one given.\n\n\
         | variant | calls/s at full speed | calls/s under callgrind, far / near | `time_scale` | calls per second of the filter's clock, far / near |\n\
         |---|---|---|---|---|\n",
        PREFETCH_TTL.as_millis(),
        PACE_TOLERANCE * 100.0,
    );
    for r in rows {
        let Some((full, scale)) = r.far.slowed else {
            continue;
        };
        let (near_per_second, near_clocked) =
            r.near.as_ref().map_or(("—".into(), "—".into()), |n| {
                (
                    format!("{:.0}", n.per_second),
                    format!("{:.0}", n.per_second / n.slowed.map_or(1.0, |(_, s)| s)),
                )
            });
        let _ = writeln!(
            s,
            "| ({}) {} | {full:.0} | {:.0} / {near_per_second} | {scale:.5} | {:.0} / {near_clocked} |",
            r.key,
            r.label,
            r.far.per_second,
            r.far.per_second / scale,
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn measured(per_second: f64, slowed: Option<(f64, f64)>) -> Measured {
        Measured {
            per_second,
            per_request: 180_000.0,
            slowed,
        }
    }

    #[test]
    fn a_count_is_off_pace_by_how_far_its_clock_saw_calls_from_full_speed() {
        // 100 calls a second under callgrind on a clock slowed 40 times:
        // 4 000 a second of the filter's clock.
        let on_pace = measured(100.0, Some((4_000.0, 0.025)));
        assert!(on_pace.pace_error().is_some_and(|e| e < 1e-9));
        let sparse = measured(70.0, Some((4_000.0, 0.025)));
        assert!(sparse.pace_error().is_some_and(|e| (e - 0.3).abs() < 1e-9));
        let dense = measured(110.0, Some((4_000.0, 0.025)));
        assert!(dense.pace_error().is_some_and(|e| e > PACE_TOLERANCE));
        // Envoy without Sluice has no clock to pace.
        assert_eq!(measured(100.0, None).pace_error(), None);
    }
}
