//! The soak harness itself, for 40 s instead of `make soak`'s 30 minutes:
//! proves on every `make test` that the long run can pass and can fail
//! (it checks in-flight, queue, aborts, policy changes and memory).

use std::process::Command;

#[test]
fn a_short_soak_passes_its_checks() -> anyhow::Result<()> {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice-soak"))
        .args(["--duration", "40s"])
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    eprintln!("{stderr}");
    assert!(out.status.success(), "the short soak failed: {stderr}");
    assert!(stdout.contains("soak: passed"));
    Ok(())
}
