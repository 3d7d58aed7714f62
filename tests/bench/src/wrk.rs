//! wrk (Debian's package) as the load generator, and its report parsed.

use std::process::Command;
use std::time::Duration;

use anyhow::{ensure, Context};

#[derive(Debug, Clone, Default)]
pub struct WrkResult {
    pub requests: u64,
    pub per_second: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub non_2xx: u64,
}

pub struct Wrk<'a> {
    pub url: String,
    pub host: &'a str,
    pub connections: u32,
    pub threads: u32,
    pub duration: Duration,
    pub script: Option<&'a std::path::Path>,
    /// CPUs to pin wrk to (a `taskset` list).
    pub cpus: Option<&'a str>,
}

impl Wrk<'_> {
    pub fn command_line(&self) -> String {
        let mut s = self
            .cpus
            .map(|c| format!("taskset -c {c} "))
            .unwrap_or_default();
        s += &format!(
            "wrk -t{} -c{} -d{}s --latency -H 'Host: {}'",
            self.threads,
            self.connections,
            self.duration.as_secs(),
            self.host
        );
        if let Some(script) = self.script {
            s.push_str(&format!(" -s {}", script.display()));
        }
        s.push(' ');
        s.push_str(&self.url);
        s
    }

    pub fn run(&self) -> anyhow::Result<WrkResult> {
        let mut cmd = match self.cpus {
            Some(list) => {
                let mut c = Command::new("taskset");
                c.args(["-c", list, "wrk"]);
                c
            }
            None => Command::new("wrk"),
        };
        cmd.arg(format!("-t{}", self.threads))
            .arg(format!("-c{}", self.connections))
            .arg(format!("-d{}s", self.duration.as_secs()))
            .arg("--latency")
            .args(["-H", &format!("Host: {}", self.host)]);
        if let Some(script) = self.script {
            cmd.arg("-s").arg(script);
        }
        let out = cmd
            .arg(&self.url)
            .output()
            .context("running wrk (make bench installs it)")?;
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        ensure!(
            out.status.success(),
            "wrk failed: {}{}",
            text,
            String::from_utf8_lossy(&out.stderr)
        );
        parse(&text).with_context(|| format!("parsing wrk's report:\n{text}"))
    }
}

fn millis(value: &str) -> Option<f64> {
    let (number, unit) = value.split_at(value.find(|c: char| c.is_ascii_alphabetic())?);
    let n: f64 = number.parse().ok()?;
    Some(match unit {
        "us" => n / 1000.0,
        "ms" => n,
        "s" => n * 1000.0,
        "m" => n * 60_000.0,
        _ => return None,
    })
}

pub fn parse(text: &str) -> anyhow::Result<WrkResult> {
    let mut r = WrkResult::default();
    for line in text.lines().map(str::trim) {
        if let Some(v) = line.strip_prefix("Requests/sec:") {
            r.per_second = v.trim().parse()?;
        } else if let Some(v) = line.strip_prefix("Non-2xx or 3xx responses:") {
            r.non_2xx = v.trim().parse()?;
        } else if line.contains(" requests in ") {
            r.requests = line
                .split_whitespace()
                .next()
                .context("requests")?
                .parse()?;
        } else if let Some(v) = line.strip_prefix("50%") {
            r.p50_ms = millis(v.trim()).context("p50")?;
        } else if let Some(v) = line.strip_prefix("99%") {
            r.p99_ms = millis(v.trim()).context("p99")?;
        }
    }
    ensure!(r.requests > 0 && r.per_second > 0.0, "no requests");
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_wrk_report() {
        let report = "Running 10s test @ http://127.0.0.1:1/\n  2 threads and 64 connections\n\
          Thread Stats   Avg      Stdev     Max   +/- Stdev\n    Latency   1.20ms  300.00us   9.00ms   80.00%\n\
          Latency Distribution\n     50%  850.00us\n     75%    1.10ms\n     90%    1.50ms\n     99%    2.50ms\n\
          123456 requests in 10.00s, 10.00MB read\n  Non-2xx or 3xx responses: 12\nRequests/sec:  12345.60\nTransfer/sec:      1.00MB\n";
        let r = parse(report).unwrap();
        assert_eq!(r.requests, 123_456);
        assert_eq!(r.non_2xx, 12);
        assert!((r.per_second - 12345.6).abs() < 1e-9);
        assert!((r.p50_ms - 0.85).abs() < 1e-9);
        assert!((r.p99_ms - 2.5).abs() < 1e-9);
    }
}
