//! `make bench`: Sluice measured beside the references a user would weigh it
//! against (Envoy with no filter, a no-op wasm filter, Envoy's native
//! local_ratelimit), in one run on this machine. Writes docs/BENCHMARKS.md
//! and the charts next to it.

#![forbid(unsafe_code)]

mod callgrind;
mod configs;
mod fair_shares;
mod fleet_scale;
mod fleet_use;
mod instructions;
mod judge;
mod money;
mod paced;
mod plot;
mod procs;
mod scenarios;
mod wrk;

use std::path::PathBuf;

use clap::Parser;

#[derive(Parser)]
#[command(about = "Benchmarks Sluice against Envoy without it and Envoy's native limiter")]
pub struct Args {
    /// The report; charts go beside it in img/.
    #[arg(long, default_value = "docs/BENCHMARKS.md")]
    out: PathBuf,
    /// Length of each load run.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Repetitions of each measurement (the report gives the median).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    #[arg(
        long,
        default_value = "target/wasm32-wasip1/release-wasm/sluice_filter.wasm"
    )]
    sluice_wasm: PathBuf,
    #[arg(
        long,
        default_value = "target/wasm32-wasip1/release-wasm/sluice_noop_filter.wasm"
    )]
    noop_wasm: PathBuf,
    #[arg(long, default_value = "target/release/libsluice_native.so")]
    sluice_native: PathBuf,
    #[arg(long, default_value = "target/release/libsluice_noop_module.so")]
    noop_module: PathBuf,
    #[arg(long, default_value = "target/release/sluice-admin")]
    admin_bin: PathBuf,
    /// Only these scenarios (1 to 9, 12); all by default.
    #[arg(long, value_delimiter = ',')]
    only: Vec<u32>,
    /// Scenario 6: count only these variants (b, c, f, h, m, g, d, e, n); all by
    /// default. For weighing one change: `--only 6 --variants b,h,d`.
    #[arg(long, value_delimiter = ',')]
    variants: Vec<String>,
    /// Scenario 6: count Sluice far from its limits only, not near them.
    #[arg(long)]
    far_only: bool,
    /// Scenario 12: the fleet sizes, in simulated Envoys.
    #[arg(long, value_delimiter = ',', default_values_t = [100, 1000, 5000])]
    fleet_sizes: Vec<usize>,
}

impl Args {
    fn runs(&self, scenario: u32) -> bool {
        self.only.is_empty() || self.only.contains(&scenario)
    }

    fn counts_variant(&self, key: &str) -> bool {
        self.variants.is_empty() || self.variants.iter().any(|v| v == key)
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    plot::register_fonts()?;
    let img = args
        .out
        .parent()
        .map(|p| p.join("img"))
        .unwrap_or_else(|| PathBuf::from("img"));
    std::fs::create_dir_all(&img)?;
    let mut report = scenarios::Report::new(&args)?;
    if args.runs(1) {
        scenarios::overhead(&args, &mut report).await?;
    }
    if args.runs(2) {
        scenarios::accuracy(&args, &img, &mut report).await?;
    }
    if args.runs(3) {
        scenarios::queue_precision(&args, &img, &mut report).await?;
    }
    if args.runs(4) {
        scenarios::control_plane(&args, &mut report).await?;
    }
    if args.runs(5) {
        scenarios::footprint(&args, &mut report)?;
    }
    if args.runs(6) {
        instructions::instructions(&args, &mut report).await?;
    }
    if args.runs(7) {
        fleet_use::fleet_use(&mut report).await?;
    }
    if args.runs(8) {
        money::money(&mut report).await?;
    }
    if args.runs(9) {
        fair_shares::fair_shares(&mut report).await?;
    }
    if args.runs(12) {
        fleet_scale::fleet_scale(&args, &mut report).await?;
    }
    // Sections this run did not make (other scenarios, the e2e suites'
    // measurements) stay as they were.
    let existing = std::fs::read_to_string(&args.out).unwrap_or_default();
    std::fs::write(&args.out, report.merged_into(&existing))?;
    println!("wrote {}", args.out.display());
    Ok(())
}
