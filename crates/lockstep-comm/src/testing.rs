//! Running multi-process jobs under an external time limit (for tests and benchmarks).
//!
//! A job that outlives its limit is killed with its whole process group (mpirun and every
//! rank) and reported as timed out: a timeout is a failure, never a pass.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// What a finished (or killed) job did.
#[derive(Debug, Clone)]
pub struct JobOutput {
    /// Exit code; `None` when killed by a signal (including the time limit).
    pub code: Option<i32>,
    /// True when the time limit killed the job.
    pub timed_out: bool,
    /// Wall-clock time until exit or kill.
    pub elapsed: Duration,
    /// Captured standard output.
    pub stdout: String,
    /// Captured standard error.
    pub stderr: String,
}

impl JobOutput {
    /// True when the job exited by itself with status 0.
    pub fn success(&self) -> bool {
        !self.timed_out && self.code == Some(0)
    }

    /// Standard output and error together, for assertions and failure messages.
    pub fn all_output(&self) -> String {
        format!("{}\n{}", self.stdout, self.stderr)
    }
}

/// Runs `cmd` in its own process group, capturing stdout and stderr, and kills the group
/// (SIGKILL) after `limit`.
///
/// Errors: the command cannot be started (message names the program).
pub fn run_with_limit(mut cmd: Command, limit: Duration) -> Result<JobOutput, String> {
    let program = format!("{:?}", cmd.get_program());
    cmd.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .stdin(Stdio::null())
        .process_group(0);
    let start = Instant::now();
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot start {program}: {e}"))?;
    let pid = child.id() as i32;
    let mut out = child.stdout.take().expect("piped stdout");
    let mut err = child.stderr.take().expect("piped stderr");
    let out_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let mut timed_out = false;
    let status = loop {
        if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
            break status;
        }
        if start.elapsed() > limit {
            timed_out = true;
            // SAFETY: signalling the process group we created for the child.
            unsafe { libc::kill(-pid, libc::SIGKILL) };
            break child.wait().map_err(|e| e.to_string())?;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let elapsed = start.elapsed();
    // Kill stragglers of the group (ranks that outlive mpirun) so the pipes close.
    // SAFETY: as above; ESRCH when the group is already gone is fine.
    unsafe { libc::kill(-pid, libc::SIGKILL) };
    Ok(JobOutput {
        code: status.code(),
        timed_out,
        elapsed,
        stdout: out_t.join().unwrap_or_default(),
        stderr: err_t.join().unwrap_or_default(),
    })
}

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
