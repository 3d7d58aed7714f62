//! Scenario 7: how much of a global limit three Envoys deliver to the
//! provider, under uneven load and under load that moves between them, and
//! how soon a SIGKILLed Envoy's share moves (the runs of
//! `tests/tests/fleet.rs`, printed against their targets).

use std::fmt::Write as _;

use sluice_e2e::fleet::{
    self, Fleet, GLOBAL_RPS, LEASE, MOVE_EVERY, MOVING_TARGET, PROVIDER_RPS, UNEVEN_TARGET,
};

use crate::judge::verdict;
use crate::scenarios::Report;

pub async fn fleet_use(report: &mut Report) -> anyhow::Result<()> {
    let mut uneven_fleet = Fleet::start().await?;
    let uneven = fleet::uneven_then_kill(&mut uneven_fleet, fleet::UNEVEN_BENCH).await?;
    drop(uneven_fleet);
    let moving_fleet = Fleet::start().await?;
    let moving = fleet::moving(&moving_fleet, false, MOVE_EVERY).await?;
    drop(moving_fleet);
    let share = |used: f64| used / GLOBAL_RPS;
    let refused = uneven.refused_by_provider + moving.refused_by_provider;
    println!(
        "fleet: uneven {:.1} %, moving {:.1} %, a killed Envoy's share moved after {:?}, refused by the provider {refused}",
        100.0 * share(uneven.used),
        100.0 * share(moving.used),
        uneven.moved
    );
    let mut s = format!(
        "## 7. Fleet quotas\n\n\
         Three real Envoys (`--concurrency 2`) share one global policy of {GLOBAL_RPS}/s (burst 6) through an \
         in-process admin (sync every 200 ms, lease {LEASE:?}), in front of a mock provider that refuses past \
         {PROVIDER_RPS} calls a second. Uneven load: a 400/s, b 50/s, c 50/s for 12 s, measured from 4 s; then c \
         is SIGKILLed. Moving load: 400/s moves a → b → c every {MOVE_EVERY:?}, the other two at 50/s, measured \
         from just before the first move for 15.5 s. The same runs as `tests/tests/fleet.rs`.\n\n\
         | figure | measured | target |\n|---|---|---|\n"
    );
    let _ = writeln!(
        s,
        "| uneven load: of the global limit at the provider | {:.1}/s, **{:.1} %** (a {:.1}, b {:.1}, c {:.1}) | ≥ {:.0} %: {} |",
        uneven.used,
        100.0 * share(uneven.used),
        uneven.per[0],
        uneven.per[1],
        uneven.per[2],
        100.0 * UNEVEN_TARGET,
        verdict(share(uneven.used) >= UNEVEN_TARGET)
    );
    let _ = writeln!(
        s,
        "| moving load: of the global limit at the provider | {:.1}/s, **{:.1} %** (per 5 s after each move {:.1?}) | ≥ {:.0} %: {} |",
        moving.used,
        100.0 * share(moving.used),
        moving.per_period,
        100.0 * MOVING_TARGET,
        verdict(share(moving.used) >= MOVING_TARGET)
    );
    let _ = writeln!(
        s,
        "| a SIGKILLed Envoy's share moved to the others | after **{:.2} s**; then {:.1}/s | within a lease ({LEASE:?}): {} |",
        uneven.moved.as_secs_f64(),
        uneven.used_after,
        verdict(uneven.moved <= LEASE)
    );
    let _ = writeln!(
        s,
        "| calls the provider refused | **{refused}** (most in any 1 s: {} and {}) | 0: {} |",
        uneven.most_in_a_second,
        moving.most_in_a_second,
        verdict(refused == 0)
    );
    report.add(s);
    Ok(())
}
