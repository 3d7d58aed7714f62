//! Ports for the processes tests start that must be told their port before
//! they bind it (Envoy from a templated config, Redis, PostgreSQL,
//! chromedriver, an admin restarted on the port it had).
//!
//! Binding port 0 to learn a free port and releasing it races: the kernel
//! hands that port to the next socket that asks for any port (an outgoing
//! connection's source port, another test's port 0) before the process
//! started with it binds it, and a clean-clone `make test` lost a test so.
//! Here a port comes from outside the kernel's ephemeral range
//! (`/proc/sys/net/ipv4/ip_local_port_range`), which the kernel never hands
//! out by itself, and stays locked (an exclusive `flock` on a file per port)
//! until the test process that took it exits, so tests running in parallel
//! processes never take the same one. A port some other program listens on
//! fails the bind check and is skipped.

#![forbid(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::io;
use std::net::TcpListener;
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use nix::fcntl::{Flock, FlockArg};

/// The lowest port handed out: above the well-known and most registered
/// services' ports.
const LOWEST: u16 = 20_000;

/// The locks this process holds, one per port it took: released when it
/// exits.
static HELD: Mutex<Vec<Flock<File>>> = Mutex::new(Vec::new());

/// A port on 127.0.0.1 that nothing listens on, that the kernel will not
/// hand out, and that no other test process holds, kept for this process.
pub fn free_port() -> io::Result<u16> {
    let ephemeral = ephemeral_range();
    let mut candidates: Vec<u16> = (LOWEST..=u16::MAX)
        .filter(|p| !ephemeral.contains(p))
        .collect();
    // Processes start their search at different places, so that parallel
    // ones rarely contend for the same locks.
    let start = std::process::id() as usize * 97 % candidates.len().max(1);
    candidates.rotate_left(start);
    take_first_free(&candidates, &lock_dir())
}

/// The first of `candidates` whose lock in `dir` no one holds and that
/// nothing listens on; its lock is kept until this process exits.
fn take_first_free(candidates: &[u16], dir: &Path) -> io::Result<u16> {
    std::fs::create_dir_all(dir)?;
    let mut held = HELD.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    for &port in candidates {
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join(port.to_string()))?;
        // Held by another process, or by this one through another open file.
        let Ok(lock) = Flock::lock(file, FlockArg::LockExclusiveNonblock) else {
            continue;
        };
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            held.push(lock);
            return Ok(port);
        }
    }
    Err(io::Error::other(format!(
        "none of {} ports outside the ephemeral range is free",
        candidates.len()
    )))
}

fn lock_dir() -> PathBuf {
    std::env::temp_dir().join("sluice-test-ports")
}

/// The range the kernel picks ports from for port 0 and outgoing
/// connections; Linux's default when it cannot be read.
fn ephemeral_range() -> RangeInclusive<u16> {
    let default = 32_768..=60_999;
    let Ok(text) = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range") else {
        return default;
    };
    let mut bounds = text.split_whitespace().map(str::parse::<u16>);
    match (bounds.next(), bounds.next()) {
        (Some(Ok(low)), Some(Ok(high))) if low <= high => low..=high,
        _ => default,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_outside_the_ephemeral_range_and_never_handed_out_twice() {
        let ephemeral = ephemeral_range();
        let ports: Vec<u16> = (0..50).map(|_| free_port().expect("a port")).collect();
        let mut unique = ports.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), ports.len(), "{ports:?}");
        assert!(ports.iter().all(|p| !ephemeral.contains(p) && *p >= LOWEST));
    }

    #[test]
    fn a_port_some_program_listens_on_is_skipped() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let (busy, idle) = (free_port().expect("a port"), free_port().expect("a port"));
        let _listening = TcpListener::bind(("127.0.0.1", busy)).expect("bind");
        assert_eq!(take_first_free(&[busy, idle], dir.path()).ok(), Some(idle));
    }

    #[test]
    fn a_port_whose_lock_is_held_is_not_taken_and_stays_taken() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let (first, second) = (free_port().expect("a port"), free_port().expect("a port"));
        let file = File::create(dir.path().join(first.to_string())).expect("a lock file");
        let other = Flock::lock(file, FlockArg::LockExclusiveNonblock).expect("locked");
        assert_eq!(
            take_first_free(&[first, second], dir.path()).ok(),
            Some(second)
        );
        // Taken by this process now: not handed out again, even once the
        // other holder lets go of the first.
        drop(other);
        assert_eq!(
            take_first_free(&[second, first], dir.path()).ok(),
            Some(first)
        );
        assert!(take_first_free(&[second], dir.path()).is_err());
    }
}
