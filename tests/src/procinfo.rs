//! What /proc says about a process the tests started.

use anyhow::Context;

/// Resident memory in MiB.
pub fn rss_mib(pid: u32) -> anyhow::Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .context("no VmRSS")?;
    Ok(kb / 1024.0)
}
