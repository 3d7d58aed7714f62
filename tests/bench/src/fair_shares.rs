//! Scenario 9: one quota shared fairly between tenants (`fair`), against a
//! provider counting per calendar second and per tenant, and a fair queue
//! against FIFO (the runs of `tests/tests/fair_share.rs`, printed against
//! the targets of issue 34).

use std::fmt::Write as _;
use std::time::Duration;

use sluice_e2e::fair::{self, mean, parts, GREEDY, PROVIDER_PER_SECOND, WORKERS};

use crate::judge::verdict;
use crate::scenarios::Report;

pub async fn fair_shares(report: &mut Report) -> anyhow::Result<()> {
    let weighted = fair::weighted(GREEDY).await?;
    let noisy_quiet = fair::noisy_quiet().await?;
    let reserved = fair::reserved(false).await?;
    let reserved_queue = fair::reserved(true).await?;
    let queued = fair::queue_waits(true).await?;
    let fifo = fair::queue_waits(false).await?;
    let fleet = fair::across_fleet(Duration::from_secs(20), false).await?;
    let further = fair::further_limit().await?;
    let slots = [
        fair::shared_slots(false).await?,
        fair::shared_slots(true).await?,
    ];
    let mut s = format!(
        "## 9. Fair shares of one quota\n\n\
         One Envoy (`--concurrency {WORKERS}`) with a policy of 95 calls a second (burst 5) shared by the \
         `x-api-key` header, in front of a mock provider that allows {PROVIDER_PER_SECOND} calls per calendar \
         second and counts every tenant's calls. Greedy tenants offer 300 calls a second each. The runs of \
         `tests/tests/fair_share.rs` (`sluice_e2e::fair`). Command: `make bench BENCH_ARGS=\"--only 9\"` (this \
         section; the others are unchanged since their runs).\n\n\
         | figure | measured | target |\n|---|---|---|\n"
    );
    let steady: Vec<(f64, f64)> = [("a", 0.25), ("b", 0.25), ("gold", 0.5)]
        .iter()
        .map(|(who, want)| parts(&weighted.steady, who, *want))
        .collect();
    let worst = steady.iter().map(|(w, _)| *w).fold(0.0, f64::max);
    let _ = writeln!(
        s,
        "| weights 1, 1, 2, all greedy for {} s: each second's parts at the provider | mean {:.3} / {:.3} / {:.3}; worst second **{:.1} %** off | within 5 % of 25/25/50: {} |",
        GREEDY.as_secs(),
        steady[0].1,
        steady[1].1,
        steady[2].1,
        100.0 * worst,
        verdict(worst <= 0.05)
    );
    let resting = parts(&weighted.resting, "a", 0.5)
        .0
        .max(parts(&weighted.resting, "b", 0.5).0);
    let back = parts(&weighted.back, "gold", 0.5);
    let _ = writeln!(
        s,
        "| the weight-2 tenant rests: the others' parts from 2 s on | worst second **{:.1} %** off 50/50 | within 5 %, within 2 s: {} |",
        100.0 * resting,
        verdict(resting <= 0.05)
    );
    let _ = writeln!(
        s,
        "| it comes back: its part from 2 s on | mean {:.3}; worst second **{:.1} %** off | half again within 2 s: {} |",
        back.1,
        100.0 * back.0,
        verdict(back.0 <= 0.05)
    );
    let _ = writeln!(
        s,
        "| calls the provider refused | **{}** (most in a calendar second {}; {} calls, {} refused by Sluice, {} `fair-share`) | 0: {} |",
        weighted.refused_by_provider,
        weighted.most_in_a_second,
        weighted.calls,
        weighted.refused,
        if weighted.refused == weighted.fair_refusals {
            "all"
        } else {
            "NOT all"
        },
        verdict(weighted.refused_by_provider == 0)
    );
    let (noisy, quiet) = (
        mean(&noisy_quiet.seconds, "noisy"),
        mean(&noisy_quiet.seconds, "quiet"),
    );
    let _ = writeln!(
        s,
        "| reject mode, noisy tenant at 1 000/s beside a quiet one at 20/s | quiet **{quiet:.1}/s** ({} of {} refused, {} after its first call), noisy **{noisy:.1}/s** | quiet all its 20/s, noisy the rest: {} |",
        noisy_quiet.quiet_refused,
        noisy_quiet.quiet_calls,
        noisy_quiet.quiet_refused_later,
        verdict(noisy_quiet.quiet_refused_later == 0 && quiet >= 19.0 && noisy >= 73.0)
    );
    let _ = writeln!(
        s,
        "| queue mode (`max_wait` 2 s), noisy at 950/s with a backlog, quiet at 20/s: the quiet calls' wait | fair: p50 {:.1} ms, **p99 {:.1} ms**, worst {:.1} ms, {} refused, quiet {:.1}/s at the provider | p99 under 100 ms: {} |",
        ms(queued.p50),
        ms(queued.p99),
        ms(queued.worst),
        queued.refused,
        queued.quiet_rate,
        verdict(queued.p99 < Duration::from_millis(100) && queued.refused == 0)
    );
    let _ = writeln!(
        s,
        "| the same with FIFO (no `fair`) | p50 {:.0} ms, **p99 {:.0} ms**, {} refused, quiet {:.1}/s at the provider | (seconds, for comparison) |",
        ms(fifo.p50),
        ms(fifo.p99),
        fifo.refused,
        fifo.quiet_rate,
    );
    for (run, mode) in [
        (&reserved, "reject mode"),
        (&reserved_queue, "queue mode, `max_wait` 2 s"),
    ] {
        let (a, b) = (mean(&run.seconds, "a"), mean(&run.seconds, "b"));
        let _ = writeln!(
            s,
            "| reservations 60 + 35 (all of the 95), three greedy tenants, {mode} | a **{a:.1}/s**, b **{b:.1}/s**, c {:.1}/s; most in a calendar second {}; the provider refused **{}** | reservations kept, 0 refused: {} |",
            mean(&run.seconds, "c"),
            run.most_in_a_second,
            run.refused_by_provider,
            verdict(a >= 57.0 && b >= 33.0 && run.refused_by_provider == 0)
        );
    }
    let (a_off, a_part) = parts(&further.seconds, "a", 1.0 / 3.0);
    let (gold_off, gold_part) = parts(&further.seconds, "gold", 2.0 / 3.0);
    let _ = writeln!(
        s,
        "| a further limit of 95/s (`limits[].fair`, beside the policy's 1 000/s), a and gold (weight 2) greedy | mean parts **{a_part:.3} / {gold_part:.3}** (worst second {:.1} % / {:.1} % off); {} of {} refusals name `tps` and `fair-share`; the provider refused **{}** | a third and two thirds, 0 refused: {} |",
        100.0 * a_off,
        100.0 * gold_off,
        further.fair_refusals,
        further.refused,
        further.refused_by_provider,
        verdict(
            (a_part - 1.0 / 3.0).abs() <= 0.05 / 3.0
                && further.refused == further.fair_refusals
                && further.refused_by_provider == 0
        )
    );
    let fleet_parts: Vec<f64> = [("a", 0.25), ("b", 0.25), ("gold", 0.5)]
        .iter()
        .map(|(who, want)| parts(&fleet.steady, who, *want).1)
        .collect();
    let fleet_off = fleet_parts
        .iter()
        .zip([0.25, 0.25, 0.5])
        .map(|(part, want)| (part - want).abs() / want)
        .fold(0.0, f64::max);
    let _ = writeln!(
        s,
        "| two Envoys (`--concurrency {WORKERS}` each, an in-process admin), a `global` fair limit of {}/s: a through one Envoy, b and gold (weight 2) through the other, all greedy; from 5 s to 20 s | mean parts **{:.3} / {:.3} / {:.3}** (at most {:.1} % off); the admin's shares {}; most in a calendar second {}; the provider refused **{}** | within 10 % of the weights, 0 refused: {} |",
        fair::FLEET_RATE,
        fleet_parts[0],
        fleet_parts[1],
        fleet_parts[2],
        100.0 * fleet_off,
        fleet
            .shares
            .iter()
            .map(|(who, rate)| format!("{who} {rate:.1}/s"))
            .collect::<Vec<_>>()
            .join(", "),
        fleet.most_in_a_second,
        fleet.refused_by_provider,
        verdict(fleet_off <= 0.1 && fleet.refused_by_provider == 0)
    );
    for (run, whose) in slots.iter().zip([
        "the policy's own `concurrency`",
        "a further concurrency limit",
    ]) {
        let served = |who: &str| run.served.get(who).copied().unwrap_or(0);
        let (a, gold) = (served("a"), served("gold"));
        let part = a as f64 / (a + gold).max(1) as f64;
        let _ = writeln!(
            s,
            "| {} slots shared fairly ({whose}), a and gold (weight 4) with 20 callers each, calls held 100 ms, a refused caller back after 20 ms; a provider allowing {} in flight; from 2 s to 6.9 s | a's part of the calls served **{part:.3}** ({a} and {gold}); refused {} by the fair share, {} with no slot free; at most {} in flight at the provider, which refused **{}** | a fifth within 10 %, 0 refused: {} |",
            fair::SLOTS,
            fair::SLOTS,
            run.fair_refusals,
            run.full_refusals,
            run.most_in_flight,
            run.refused_by_provider,
            verdict((part - 0.2).abs() <= 0.02 && run.refused_by_provider == 0)
        );
    }
    report.add(s);
    Ok(())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
