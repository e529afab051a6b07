//! The benches' own worker processes: `mpirun -n N lockstep bench ... --mpi-worker`, whose
//! chief prints its measurements as one JSON line, and N independent processes at once (the
//! machine's bound for N replicas), each printing its own.

use anyhow::{anyhow, bail, Context, Result};
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

/// Runs `n` copies of this executable with `args` at once (processes that never
/// communicate), each killed after `limit`, and parses the last JSON line of each one's
/// standard output, in launch order.
///
/// Errors: the executable cannot be located or started, a copy fails or times out (with its
/// output), or one prints no JSON line of type `T`.
pub fn run_concurrent_workers<T, S>(n: usize, args: &[S], limit: Duration) -> Result<Vec<T>>
where
    T: serde::de::DeserializeOwned + Send,
    S: AsRef<OsStr> + Sync,
{
    let exe = std::env::current_exe().context("cannot locate the lockstep executable")?;
    let results: Vec<Result<T>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n)
            .map(|_| {
                let mut cmd = std::process::Command::new(&exe);
                cmd.args(args);
                scope.spawn(move || -> Result<T> {
                    let out = run_with_limit(cmd, limit)
                        .context("cannot start an independent worker process")?;
                    if !out.success() {
                        bail!(
                            "an independent worker process failed:\n{}",
                            out.all_output()
                        );
                    }
                    let line = out
                        .stdout
                        .lines()
                        .rfind(|l| l.starts_with('{') || l.starts_with('['))
                        .context("an independent worker process printed no result")?;
                    serde_json::from_str(line).context("unexpected result line")
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow!("a worker thread panicked")))
            })
            .collect()
    });
    results.into_iter().collect()
}
