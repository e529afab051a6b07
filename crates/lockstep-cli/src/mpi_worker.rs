//! The benches' own MPI jobs: `mpirun -n N lockstep bench ... --mpi-worker`, whose chief
//! prints its measurements as one JSON line.

use anyhow::{bail, Context, Result};
use lockstep_comm::launch::{mpirun_command, run_with_limit};
use std::ffi::OsStr;
use std::time::Duration;

/// Runs this executable with `args` under `mpirun -n ranks`, killed after `limit`, and
/// parses the last line of its standard output that is a JSON object or array.
///
/// Errors: the executable cannot be located or started, the job fails or times out (with its
/// output), or it prints no JSON line of type `T`.
pub fn run_mpi_worker<T, I, S>(ranks: usize, args: I, limit: Duration) -> Result<T>
where
    T: serde::de::DeserializeOwned,
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let exe = std::env::current_exe().context("cannot locate the lockstep executable")?;
    let mut cmd = mpirun_command(ranks);
    cmd.arg(exe).args(args);
    let out = run_with_limit(cmd, limit)?;
    if !out.success() {
        bail!("the MPI measurement failed:\n{}", out.all_output());
    }
    let line = out
        .stdout
        .lines()
        .rfind(|l| l.starts_with('{') || l.starts_with('['))
        .context("the MPI measurement printed no result")?;
    serde_json::from_str(line).context("the MPI measurement's result line is not what was expected")
}
