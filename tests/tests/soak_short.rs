//! The soak harness itself, for seconds instead of `make soak`'s 30
//! minutes: it passes its checks (in flight, queue, aborts, policy changes,
//! memory) on a healthy run, and fails, naming the check, on a run that
//! leaves a call in flight.

use std::process::{Command, Output};

fn soak(args: &[&str]) -> anyhow::Result<Output> {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice-soak"))
        .args(args)
        .output()?;
    println!("{}", String::from_utf8_lossy(&out.stdout));
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    Ok(out)
}

#[test]
fn a_short_soak_passes_its_checks() -> anyhow::Result<()> {
    let out = soak(&["--duration", "25s"])?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "the short soak failed");
    assert!(stdout.contains("soak: passed"));
    Ok(())
}

#[test]
fn a_soak_that_leaves_a_call_in_flight_fails() -> anyhow::Result<()> {
    let out = soak(&["--duration", "10s", "--leave-a-call-open"])?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "the soak must fail");
    assert!(
        stderr.contains("soak: FAILED") && stderr.contains("calls left in flight"),
        "the failure names the check: {stderr}"
    );
    Ok(())
}
