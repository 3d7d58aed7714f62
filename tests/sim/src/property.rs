//! A property over many seeds. A failure names its seed and the command
//! that replays it with its trace; `SLUICE_SIM_SEED` runs that seed alone
//! and prints the trace, `SLUICE_SIM_SEEDS` sets how many seeds run, and
//! `SLUICE_SIM_SCALE` multiplies each property's own count (`make soak`:
//! 100).

use crate::world::Outcome;

/// A seed on which a property does not hold: its run, and why.
pub struct Failure {
    pub outcome: Box<Outcome>,
    pub why: String,
}

impl Failure {
    pub fn new(outcome: Outcome, why: impl Into<String>) -> Self {
        Self {
            outcome: Box::new(outcome),
            why: why.into(),
        }
    }
}

/// A run's outcome, or a failure when its provider refused any call.
pub fn provider_refused_none(outcome: Outcome) -> Result<Outcome, Failure> {
    let refused = outcome.provider.refused();
    if refused > 0 {
        return Err(Failure::new(
            outcome,
            format!("the provider refused {refused}"),
        ));
    }
    Ok(outcome)
}

/// A run's outcome, or the failure `checked` names.
pub fn verdict(outcome: Outcome, checked: Result<(), String>) -> Result<Outcome, Failure> {
    match checked {
        Ok(()) => Ok(outcome),
        Err(why) => Err(Failure::new(outcome, why)),
    }
}

/// `name`'s value, if it is set to a number.
fn env_number(name: &str) -> Option<u64> {
    std::env::var(name).ok()?.parse().ok()
}

/// Seeds run when `SLUICE_SIM_SEEDS` does not say.
pub const DEFAULT_SEEDS: u64 = 1_000;

/// Runs `check` on each seed; panics on the first that fails, naming it.
/// `test` is the test's path (`suite::name`) for the replay command.
pub fn for_seeds(test: &str, check: impl Fn(u64) -> Result<Outcome, Failure> + Sync) {
    for_seeds_by_default(test, DEFAULT_SEEDS, check)
}

/// [`for_seeds`] for a property whose runs are long: `seeds` of them
/// unless `SLUICE_SIM_SEEDS` says (`make soak` runs 100 times more).
pub fn for_seeds_by_default(
    test: &str,
    seeds: u64,
    check: impl Fn(u64) -> Result<Outcome, Failure> + Sync,
) {
    if let Some(seed) = env_number("SLUICE_SIM_SEED") {
        match check(seed) {
            Ok(outcome) => println!("seed {seed}: holds\n{}", outcome.trace.render()),
            Err(Failure { outcome, why }) => {
                panic!("seed {seed}: {why}\n{}", outcome.trace.render())
            }
        }
        return;
    }
    let scale = env_number("SLUICE_SIM_SCALE").unwrap_or(1);
    let seeds = env_number("SLUICE_SIM_SEEDS").unwrap_or(seeds.saturating_mul(scale));
    // Seeds are independent runs: spread over the machine's cores, each
    // thread taking every n-th seed; the smallest failing seed is named.
    let threads = std::thread::available_parallelism().map_or(1, usize::from) as u64;
    let failed = std::sync::Mutex::new(None::<(u64, String)>);
    std::thread::scope(|scope| {
        for first in 0..threads {
            let (check, failed) = (&check, &failed);
            scope.spawn(move || {
                for seed in (first..seeds).step_by(threads as usize) {
                    let known = failed.lock().map_or(None, |f| f.as_ref().map(|(s, _)| *s));
                    if known.is_some_and(|s| s < seed) {
                        return;
                    }
                    if let Err(Failure { why, .. }) = check(seed) {
                        if let Ok(mut f) = failed.lock() {
                            if f.as_ref().is_none_or(|(s, _)| seed < *s) {
                                *f = Some((seed, why));
                            }
                        }
                        return;
                    }
                }
            });
        }
    });
    if let Some((seed, why)) = failed.into_inner().ok().flatten() {
        let (suite, name) = test.split_once("::").unwrap_or((test, test));
        panic!(
            "seed {seed}: {why}\nreplay with its trace: SLUICE_SIM_SEED={seed} cargo test -p sluice-sim \
             --test {suite} -- --exact {name} --nocapture"
        );
    }
    println!("{test}: {seeds} seeds hold");
}
