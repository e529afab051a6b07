//! Helpers for tests of multi-process jobs (Cargo feature `testing`).

use std::process::{Command, Stdio};

/// True when an `mpirun` is on the PATH.
pub fn have_mpirun() -> bool {
    Command::new("mpirun")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}
