//! The benches' own worker processes: `mpirun -n N lockstep bench ... --mpi-worker`, whose
//! chief prints its measurements as one JSON line, and N independent processes at once (the
//! machine's bound for N replicas), each printing its own.

use anyhow::{anyhow, bail, Context, Result};
use lockstep_comm::launch::{mpirun_command, run_with_limit, JobOutput};
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
    result_line(&run_with_limit(cmd, limit)?, "the MPI measurement")
}

/// The last line of a finished worker's standard output that is a JSON object or array,
/// parsed as `T`.
///
/// Errors: the worker (`what`) failed (with its output), printed no such line, or the line
/// is not a `T`.
fn result_line<T: serde::de::DeserializeOwned>(out: &JobOutput, what: &str) -> Result<T> {
    if !out.success() {
        bail!("{what} failed:\n{}", out.all_output());
    }
    let line = out
        .stdout
        .lines()
        .rfind(|l| l.starts_with('{') || l.starts_with('['))
        .with_context(|| format!("{what} printed no result"))?;
    serde_json::from_str(line)
        .with_context(|| format!("the result line of {what} is not what was expected"))
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
                    result_line(&out, "an independent worker process")
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
