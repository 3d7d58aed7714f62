//! Calls sent at a fixed rate, whatever pace Envoy could answer at. Under
//! callgrind every variant is counted at the same rate: Envoy's timed work
//! (timers, stats flushes) then falls on as many calls in each, and a
//! Sluice variant's slowed clock sees exactly the pace it stands for. With
//! wrk's closed loop the rate followed how much CPU valgrind got, which
//! moved by half between counts on a shared machine.

use std::sync::Arc;
use std::time::Duration;

use sluice_e2e::load;
use tokio::sync::Semaphore;
use tokio::time::Instant;

/// Calls in flight at most: Envoy under callgrind answers in a few
/// milliseconds at the rates used, so more than this means it fell behind
/// (the rate achieved then shows it).
const MAX_IN_FLIGHT: usize = 16;

pub struct Paced<'a> {
    pub url: String,
    pub host: &'a str,
    pub per_second: f64,
    pub duration: Duration,
    /// Each call carries `x-api-key: key-<n>`, n drawn from 1..=keys.
    pub keys: Option<u32>,
}

#[derive(Debug, Clone, Copy, Default)]
pub struct PacedResult {
    /// Calls answered (any status).
    pub requests: u64,
    pub non_2xx: u64,
    /// Calls that got no answer.
    pub failed: u64,
    /// Answers a second, from the first call sent to the last answer.
    pub per_second: f64,
}

impl Paced<'_> {
    /// Blocks this runtime thread for the run (the callgrind count around
    /// it is synchronous).
    pub fn run(&self) -> anyhow::Result<PacedResult> {
        tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(self.send()))
    }

    async fn send(&self) -> anyhow::Result<PacedResult> {
        anyhow::ensure!(self.per_second > 0.0, "a paced load needs a positive rate");
        let client = load::client();
        let calls = (self.per_second * self.duration.as_secs_f64()).round() as u64;
        let gap = Duration::from_secs_f64(1.0 / self.per_second);
        let in_flight = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
        let mut keys = fastrand::Rng::with_seed(7);
        let start = Instant::now();
        let mut sent = Vec::with_capacity(calls as usize);
        for i in 0..calls {
            tokio::time::sleep_until(start + gap.mul_f64(i as f64)).await;
            let permit = Arc::clone(&in_flight).acquire_owned().await?;
            let mut request = client.get(&self.url).header("host", self.host);
            if let Some(n) = self.keys {
                request = request.header("x-api-key", format!("key-{}", keys.u32(1..=n)));
            }
            sent.push(tokio::spawn(async move {
                let answer = match request.send().await {
                    Ok(response) => {
                        let status = response.status();
                        // Read whole, so the connection is kept for the next call.
                        response.bytes().await.ok().map(|_| status)
                    }
                    Err(_) => None,
                };
                drop(permit);
                (answer, Instant::now())
            }));
        }
        let mut result = PacedResult::default();
        let mut last_answer = start;
        for call in sent {
            let (answer, at) = call.await?;
            match answer {
                Some(status) => {
                    result.requests += 1;
                    if !status.is_success() {
                        result.non_2xx += 1;
                    }
                    last_answer = last_answer.max(at);
                }
                None => result.failed += 1,
            }
        }
        let elapsed = (last_answer - start).as_secs_f64();
        result.per_second = if elapsed > 0.0 {
            result.requests as f64 / elapsed
        } else {
            0.0
        };
        Ok(result)
    }
}
