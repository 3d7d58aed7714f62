//! The mock third-party API as a program (the demo's "third-party API").

use std::net::SocketAddr;

use clap::Parser;
use sluice_demo::mock::{MockApi, MockLimits};

#[derive(Parser)]
#[command(about = "A mock third-party API with limits of its own")]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:9090")]
    listen: SocketAddr,
    /// Answer 429 beyond this many requests per second (0: no limit).
    #[arg(long, default_value_t = 0)]
    max_per_second: u64,
    /// Answer 429 beyond this many requests in flight (0: no limit).
    #[arg(long, default_value_t = 0)]
    max_in_flight: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let limits = MockLimits {
        max_per_second: args.max_per_second,
        max_in_flight: args.max_in_flight,
    };
    let api = MockApi::start(args.listen, limits).await?;
    println!("mock API listening on http://{}", api.addr);
    tokio::signal::ctrl_c().await?;
    Ok(())
}
