//! The mock third-party API as a program (the demo's "third-party API").

#![forbid(unsafe_code)]

use std::net::SocketAddr;

use clap::Parser;
use sluice_demo::llm::LlmLimits;
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
    /// `POST /v1/chat/completions`: answer 429 beyond this many calls per
    /// key and minute (0: no limit).
    #[arg(long, default_value_t = 0)]
    llm_requests_per_minute: u64,
    /// `POST /v1/chat/completions`: answer 429 once a key used this many
    /// tokens in the minute (0: no limit).
    #[arg(long, default_value_t = 0)]
    llm_tokens_per_minute: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let limits = MockLimits {
        max_per_second: args.max_per_second,
        max_in_flight: args.max_in_flight,
    };
    let llm = LlmLimits {
        requests_per_window: args.llm_requests_per_minute,
        tokens_per_window: args.llm_tokens_per_minute,
        ..LlmLimits::default()
    };
    let (api, _llm) = MockApi::start_with_llm(args.listen, limits, llm).await?;
    println!("mock API listening on http://{}", api.addr);
    tokio::signal::ctrl_c().await?;
    Ok(())
}
