//! Launch detection (how was this process started?), device binding (which device does
//! this rank compute on?), and starting child MPI jobs under a time limit.
//!
//! Detection and binding are pure functions of the environment so they can be unit-tested;
//! [`detect_launch`] reads the real process environment.
//!
//! A child job that outlives its limit ([`run_with_limit`]) is killed with its whole process
//! group (mpirun and every rank) and reported as timed out: a timeout is a failure, never a
//! pass.

use std::fmt;
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use thiserror::Error;

/// Who started this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// Started directly (no launcher variables): one rank.
    Serial,
    /// Open MPI's `mpirun`/`mpiexec` (`OMPI_COMM_WORLD_RANK`, `..._SIZE`, `..._LOCAL_RANK`).
    OpenMpi,
    /// MPICH / Intel MPI Hydra `mpiexec` (`PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID`).
    MpichHydra,
    /// A Slurm job step started by `srun` (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`).
    Slurm,
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Launcher::Serial => "serial (no launcher)",
            Launcher::OpenMpi => "Open MPI (mpirun)",
            Launcher::MpichHydra => "MPICH/Hydra (mpiexec)",
            Launcher::Slurm => "Slurm (srun)",
        })
    }
}

/// The launch environment of this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// Who started the process.
    pub launcher: Launcher,
    /// This process's rank among all processes of the launch, `0..size`.
    pub rank: usize,
    /// Number of processes the launcher started.
    pub size: usize,
    /// Rank among the processes of this launch on this node, `0..local_size` (device
    /// binding: node-local rank r gets the r-th GPU of the node).
    pub local_rank: usize,
    /// Processes of this launch on this node (the memory check multiplies a rank's need by
    /// it). From the launcher ([`detect_launch_from`]); when the launcher does not say,
    /// `size`: every rank is assumed to share this node, the safe side for a memory check.
    pub local_size: usize,
    /// The Slurm job id, when inside a Slurm allocation (also for `mpirun` inside one).
    pub slurm_job_id: Option<String>,
}

impl LaunchEnv {
    /// A serial launch: rank 0 of 1.
    pub fn serial() -> Self {
        LaunchEnv {
            launcher: Launcher::Serial,
            rank: 0,
            size: 1,
            local_rank: 0,
            local_size: 1,
            slurm_job_id: None,
        }
    }

    /// True when a launcher that provides MPI started this process (`mpirun`, `mpiexec` or
    /// `srun`), whatever the process count.
    pub fn is_mpi_launch(&self) -> bool {
        self.launcher != Launcher::Serial
    }
}

impl fmt::Display for LaunchEnv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}, rank {} of {}, node-local rank {} of {}",
            self.launcher, self.rank, self.size, self.local_rank, self.local_size
        )?;
        if let Some(job) = &self.slurm_job_id {
            write!(f, ", Slurm job {job}")?;
        }
        Ok(())
    }
}

/// A malformed launcher variable.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum LaunchError {
    /// The variable is set but not a non-negative integer, or is inconsistent.
    #[error("launcher variable {var}={value:?} is invalid: {why}")]
    BadVariable {
        /// The environment variable.
        var: String,
        /// Its value.
        value: String,
        /// What is wrong.
        why: String,
    },
}

fn parse(get: &dyn Fn(&str) -> Option<String>, var: &str) -> Result<Option<usize>, LaunchError> {
    match get(var) {
        None => Ok(None),
        Some(v) => v
            .trim()
            .parse::<usize>()
            .map(Some)
            .map_err(|_| LaunchError::BadVariable {
                var: var.into(),
                value: v.clone(),
                why: "expected a non-negative integer".into(),
            }),
    }
}

/// The per-launcher variables: rank, size, node-local rank (first set wins) and node-local
/// size (first set wins).
struct LauncherVars {
    launcher: Launcher,
    rank: &'static str,
    size: &'static str,
    local_rank: &'static [&'static str],
    local_size: &'static [&'static str],
}

const MPI_LAUNCHERS: [LauncherVars; 2] = [
    LauncherVars {
        launcher: Launcher::OpenMpi,
        rank: "OMPI_COMM_WORLD_RANK",
        size: "OMPI_COMM_WORLD_SIZE",
        local_rank: &["OMPI_COMM_WORLD_LOCAL_RANK"],
        local_size: &["OMPI_COMM_WORLD_LOCAL_SIZE"],
    },
    LauncherVars {
        launcher: Launcher::MpichHydra,
        rank: "PMI_RANK",
        size: "PMI_SIZE",
        local_rank: &["MPI_LOCALRANKID", "PMI_LOCAL_RANK"],
        local_size: &["MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"],
    },
];

/// The first of `vars` that is set, parsed.
fn first_set(
    get: &dyn Fn(&str) -> Option<String>,
    vars: &[&'static str],
) -> Result<Option<(usize, &'static str)>, LaunchError> {
    for v in vars {
        if let Some(x) = parse(get, v)? {
            return Ok(Some((x, v)));
        }
    }
    Ok(None)
}

/// Slurm's task count per node, `"2(x3),1"` expanded to `[2, 2, 2, 1]`; `None` when a part
/// is not of the form `N` or `N(xM)`.
fn expand_tasks_per_node(list: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in list.split(',').map(str::trim) {
        match part.split_once("(x") {
            None => out.push(part.parse().ok()?),
            Some((n, times)) => {
                let n: usize = n.trim().parse().ok()?;
                let times: usize = times.strip_suffix(')')?.trim().parse().ok()?;
                out.extend(std::iter::repeat_n(n, times));
            }
        }
    }
    Some(out)
}

/// The tasks of a Slurm job step on this node: this node's entry (`SLURM_NODEID`) of
/// `SLURM_STEP_TASKS_PER_NODE` (else `SLURM_TASKS_PER_NODE`), else `SLURM_NTASKS_PER_NODE`,
/// else the largest entry of the list; `None` when none of them is set.
fn slurm_tasks_on_this_node(
    get: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<usize>, LaunchError> {
    let list = get("SLURM_STEP_TASKS_PER_NODE")
        .or_else(|| get("SLURM_TASKS_PER_NODE"))
        .and_then(|l| expand_tasks_per_node(&l));
    if let (Some(list), Some(node)) = (&list, parse(get, "SLURM_NODEID")?) {
        if let Some(&n) = list.get(node) {
            return Ok(Some(n));
        }
    }
    if let Some(n) = parse(get, "SLURM_NTASKS_PER_NODE")? {
        return Ok(Some(n));
    }
    Ok(list.and_then(|l| l.into_iter().max()))
}

/// Detects the launch from environment variables read through `get`.
///
/// Precedence: Open MPI, then MPICH/Hydra, then a Slurm job *step* (`SLURM_STEP_ID` set and
/// not the batch script's own step), else serial. A Slurm batch script that runs lockstep
/// without `srun` is serial.
///
/// The node-local rank and size come from the launcher: Open MPI's
/// `OMPI_COMM_WORLD_LOCAL_RANK` / `OMPI_COMM_WORLD_LOCAL_SIZE`, Hydra's `MPI_LOCALRANKID` /
/// `MPI_LOCALNRANKS` (or `PMI_LOCAL_RANK` / `PMI_LOCAL_SIZE`), Slurm's `SLURM_LOCALID` and
/// this node's entry (`SLURM_NODEID`) of `SLURM_STEP_TASKS_PER_NODE` (else
/// `SLURM_TASKS_PER_NODE`; else `SLURM_NTASKS_PER_NODE`; else the list's largest entry).
/// A launcher that does not say gets the safe side: node-local rank = rank (one GPU per
/// rank) and node-local size = size (every rank on this node, for the memory check).
///
/// Errors: [`LaunchError::BadVariable`] when a variable is not an integer, the rank is not
/// below the size, or the node-local rank is not below the node-local size.
pub fn detect_launch_from(get: &dyn Fn(&str) -> Option<String>) -> Result<LaunchEnv, LaunchError> {
    let slurm_job_id = get("SLURM_JOB_ID").or_else(|| get("SLURM_JOBID"));
    // (launcher, rank, size, node-local rank and its variable, node-local size, rank variable)
    type Found = (
        Launcher,
        usize,
        usize,
        Option<(usize, &'static str)>,
        Option<usize>,
        &'static str,
    );
    let mut found: Option<Found> = None;
    for l in &MPI_LAUNCHERS {
        if let (Some(rank), Some(size)) = (parse(get, l.rank)?, parse(get, l.size)?) {
            let local_rank = first_set(get, l.local_rank)?;
            let local_size = first_set(get, l.local_size)?.map(|(n, _)| n);
            found = Some((l.launcher, rank, size, local_rank, local_size, l.rank));
            break;
        }
    }
    if found.is_none() {
        let step = get("SLURM_STEP_ID").or_else(|| get("SLURM_STEPID"));
        let is_step = step.is_some_and(|s| s != "batch" && s != "4294967294" && s != "extern");
        if is_step {
            if let (Some(rank), Some(size)) =
                (parse(get, "SLURM_PROCID")?, parse(get, "SLURM_NTASKS")?)
            {
                let local_rank = first_set(get, &["SLURM_LOCALID"])?;
                let local_size = slurm_tasks_on_this_node(get)?;
                found = Some((
                    Launcher::Slurm,
                    rank,
                    size,
                    local_rank,
                    local_size,
                    "SLURM_PROCID",
                ));
            }
        }
    }
    let Some((launcher, rank, size, local_rank, local_size, rank_var)) = found else {
        return Ok(LaunchEnv {
            slurm_job_id,
            ..LaunchEnv::serial()
        });
    };
    if size == 0 || rank >= size {
        return Err(LaunchError::BadVariable {
            var: rank_var.into(),
            value: rank.to_string(),
            why: format!("rank must be below the process count {size}"),
        });
    }
    let (local_rank, local_var) = local_rank.unwrap_or((rank, rank_var));
    let local_size = local_size.unwrap_or(size).min(size);
    if local_rank >= local_size {
        return Err(LaunchError::BadVariable {
            var: local_var.into(),
            value: local_rank.to_string(),
            why: format!("the node-local rank must be below the ranks on this node ({local_size})"),
        });
    }
    Ok(LaunchEnv {
        launcher,
        rank,
        size,
        local_rank,
        local_size,
        slurm_job_id,
    })
}

/// [`detect_launch_from`] on the process environment.
pub fn detect_launch() -> Result<LaunchEnv, LaunchError> {
    detect_launch_from(&|k| std::env::var(k).ok())
}

/// Where a rank computes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Device {
    /// CPU cores (the only compute device of this build).
    Cpu,
    /// A CUDA GPU, named by its token in the inherited `CUDA_VISIBLE_DEVICES` list, kept
    /// exactly as given (an id such as `3` or a UUID such as `GPU-5f1e...`).
    Cuda {
        /// The `CUDA_VISIBLE_DEVICES` token bound to this rank.
        visible_token: String,
    },
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda { visible_token } => {
                write!(f, "cuda (CUDA_VISIBLE_DEVICES token {visible_token})")
            }
        }
    }
}

/// A device binding that cannot be satisfied.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum BindError {
    /// Fewer visible GPUs than ranks on this node.
    #[error("node-local rank {local_rank} needs GPU number {local_rank} but CUDA_VISIBLE_DEVICES={list:?} lists only {count}; start at most {count} ranks per node, list more GPUs, or pass --cpu")]
    TooFewDevices {
        /// The node-local rank.
        local_rank: usize,
        /// The inherited list.
        list: String,
        /// Its token count.
        count: usize,
    },
    /// The same GPU listed twice.
    #[error("CUDA_VISIBLE_DEVICES={list:?} lists device {token:?} twice; list each GPU once")]
    Duplicate {
        /// The inherited list.
        list: String,
        /// The repeated token.
        token: String,
    },
    /// An empty entry such as `0,,1`.
    #[error("CUDA_VISIBLE_DEVICES={list:?} has an empty entry; remove the extra comma")]
    EmptyToken {
        /// The inherited list.
        list: String,
    },
}

/// What a model computes on; decides whether its ranks need GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ComputeKind {
    /// CPU cores (the spiking network model, the N-body code): no GPU is bound or required,
    /// whatever `CUDA_VISIBLE_DEVICES` says.
    Cpu,
    /// CUDA GPUs: each node-local rank binds one `CUDA_VISIBLE_DEVICES` token.
    Gpu,
}

/// The GPU tokens of a `CUDA_VISIBLE_DEVICES` value as CUDA enumerates them: trimmed,
/// stopping at the first negative entry or Slurm's `NoDevFiles`. `None` or empty: no token.
fn visible_tokens(cuda_visible_devices: Option<&str>) -> (&str, Vec<&str>) {
    let list = match cuda_visible_devices.map(str::trim) {
        None | Some("") => return ("", Vec::new()),
        Some(l) => l,
    };
    let mut tokens: Vec<&str> = list.split(',').map(str::trim).collect();
    // CUDA stops enumerating at the first invalid entry: "-1" (or any negative index) hides
    // every GPU after it, and Slurm's "NoDevFiles" means no GPU was allocated.
    if let Some(stop) = tokens
        .iter()
        .position(|t| t.starts_with('-') || t.eq_ignore_ascii_case("NoDevFiles"))
    {
        tokens.truncate(stop);
    }
    (list, tokens)
}

/// Binds a device to node-local rank `local_rank` for a model that computes on `kind`.
///
/// - [`ComputeKind::Cpu`] or `force_cpu` (`--cpu`): always [`Device::Cpu`]; the list is not
///   read, so a CPU model runs with any number of ranks per node on a GPU node.
/// - [`ComputeKind::Gpu`] with `cuda_visible_devices` unset or empty, `-1` or `NoDevFiles`:
///   [`Device::Cpu`] (as CUDA, entries from the first negative one on are ignored).
/// - otherwise rank r gets the r-th comma-separated token, kept as given (`2,3` gives ranks
///   0 and 1 the tokens `2` and `3`, never renumbered).
///
/// Errors (GPU models only): [`BindError`] when there are fewer tokens than
/// `local_rank + 1`, a token repeats, or a token is empty; each names the list.
pub fn bind_device(
    local_rank: usize,
    cuda_visible_devices: Option<&str>,
    kind: ComputeKind,
    force_cpu: bool,
) -> Result<Device, BindError> {
    if force_cpu || kind == ComputeKind::Cpu {
        return Ok(Device::Cpu);
    }
    let (list, tokens) = visible_tokens(cuda_visible_devices);
    if tokens.is_empty() {
        return Ok(Device::Cpu);
    }
    if tokens.iter().any(|t| t.is_empty()) {
        return Err(BindError::EmptyToken { list: list.into() });
    }
    for (i, t) in tokens.iter().enumerate() {
        if tokens[..i].contains(t) {
            return Err(BindError::Duplicate {
                list: list.into(),
                token: (*t).into(),
            });
        }
    }
    match tokens.get(local_rank) {
        Some(t) => Ok(Device::Cuda {
            visible_token: (*t).into(),
        }),
        None => Err(BindError::TooFewDevices {
            local_rank,
            list: list.into(),
            count: tokens.len(),
        }),
    }
}

/// The warning for GPUs made visible (`CUDA_VISIBLE_DEVICES`) to a model that computes on
/// CPU cores and cannot use them; `None` for a GPU model or when no GPU is listed.
pub fn unused_gpus_warning(
    cuda_visible_devices: Option<&str>,
    kind: ComputeKind,
) -> Option<String> {
    let (list, tokens) = visible_tokens(cuda_visible_devices);
    if kind != ComputeKind::Cpu || tokens.iter().all(|t| t.is_empty()) {
        return None;
    }
    Some(format!(
        "CUDA_VISIBLE_DEVICES={list:?} makes GPUs visible, but this model computes on CPU cores and leaves them unused (pass --cpu to silence this warning)"
    ))
}

/// A `mpirun -n N` command for Open MPI on one host: `--oversubscribe` (more ranks than cores
/// is fine for tests), `--bind-to none` (in oversubscribed mode Open MPI's default placement
/// slowed each rank's compute by a third on the 2-core development machine; unbound, the
/// kernel spreads the ranks), and the allow-run-as-root variables when running as root.
pub fn mpirun_command(ranks: usize) -> Command {
    let mut cmd = Command::new("mpirun");
    cmd.arg("-n")
        .arg(ranks.to_string())
        .args(["--oversubscribe", "--bind-to", "none"]);
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    }
    cmd
}

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
/// Open MPI 4.1's `mpirun` sometimes fails to start when several start at once: it races
/// another job for the shared session directory (`/tmp/ompi.<host>.<uid>`: "unable to
/// create the desired directory ... File exists", then `orte_session_dir failed`) before any
/// rank runs. Such a launch is retried, up to 3 attempts, each with its own `limit`; the
/// output of the last attempt is returned.
///
/// Errors: the command cannot be started (the message names the program), or waiting for it
/// fails.
pub fn run_with_limit(mut cmd: Command, limit: Duration) -> std::io::Result<JobOutput> {
    let mut attempt = 1;
    loop {
        let out = run_once(&mut cmd, limit)?;
        if attempt == 3
            || out.code == Some(0)
            || !out.all_output().contains("orte_session_dir failed")
        {
            return Ok(out);
        }
        attempt += 1;
        std::thread::sleep(Duration::from_millis(200 * attempt));
    }
}

/// One attempt of [`run_with_limit`].
fn run_once(cmd: &mut Command, limit: Duration) -> std::io::Result<JobOutput> {
    let program = format!("{:?}", cmd.get_program());
    cmd.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .stdin(Stdio::null())
        .process_group(0);
    let start = Instant::now();
    let mut child = cmd
        .spawn()
        .map_err(|e| std::io::Error::new(e.kind(), format!("cannot start {program}: {e}")))?;
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
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if start.elapsed() > limit {
            timed_out = true;
            // SAFETY: signalling the process group we created for the child.
            unsafe { libc::kill(-pid, libc::SIGKILL) };
            break child.wait()?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn serial_without_variables() {
        assert_eq!(detect_launch_from(&env(&[])).unwrap(), LaunchEnv::serial());
    }

    #[test]
    fn open_mpi() {
        let e = detect_launch_from(&env(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ]))
        .unwrap();
        assert_eq!(e.launcher, Launcher::OpenMpi);
        assert_eq!((e.rank, e.size, e.local_rank), (3, 4, 1));
        assert!(e.is_mpi_launch());
    }

    #[test]
    fn mpich_hydra() {
        let e = detect_launch_from(&env(&[
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "2"),
            ("MPI_LOCALRANKID", "1"),
        ]))
        .unwrap();
        assert_eq!(e.launcher, Launcher::MpichHydra);
        assert_eq!((e.rank, e.size, e.local_rank), (1, 2, 1));
    }

    #[test]
    fn slurm_step_but_not_batch_script() {
        let step = detect_launch_from(&env(&[
            ("SLURM_JOB_ID", "77"),
            ("SLURM_STEP_ID", "0"),
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
        ]))
        .unwrap();
        assert_eq!(step.launcher, Launcher::Slurm);
        assert_eq!((step.rank, step.size, step.local_rank), (5, 8, 1));
        assert_eq!(step.slurm_job_id.as_deref(), Some("77"));
        let batch = detect_launch_from(&env(&[
            ("SLURM_JOB_ID", "77"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "8"),
        ]))
        .unwrap();
        assert_eq!(batch.launcher, Launcher::Serial);
        assert_eq!(batch.slurm_job_id.as_deref(), Some("77"));
    }

    #[test]
    fn open_mpi_wins_over_slurm_and_bad_values_are_named() {
        let e = detect_launch_from(&env(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("SLURM_STEP_ID", "0"),
            ("SLURM_PROCID", "9"),
            ("SLURM_NTASKS", "16"),
        ]))
        .unwrap();
        assert_eq!(e.launcher, Launcher::OpenMpi);
        let err = detect_launch_from(&env(&[
            ("OMPI_COMM_WORLD_RANK", "x"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
        ]))
        .unwrap_err();
        assert!(err.to_string().contains("OMPI_COMM_WORLD_RANK"));
        let err = detect_launch_from(&env(&[("PMI_RANK", "2"), ("PMI_SIZE", "2")])).unwrap_err();
        assert!(err.to_string().contains("below the process count 2"));
    }

    /// Two hosts x two ranks: each rank's node-local rank and size come from the launcher,
    /// never from the global rank and size.
    #[test]
    fn node_local_rank_and_size_from_each_launcher() {
        let e = detect_launch_from(&env(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ]))
        .unwrap();
        assert_eq!((e.rank, e.size, e.local_rank, e.local_size), (3, 4, 1, 2));
        assert!(e.to_string().contains("node-local rank 1 of 2"), "{e}");
        let e = detect_launch_from(&env(&[
            ("PMI_RANK", "2"),
            ("PMI_SIZE", "4"),
            ("MPI_LOCALRANKID", "0"),
            ("MPI_LOCALNRANKS", "2"),
        ]))
        .unwrap();
        assert_eq!((e.local_rank, e.local_size), (0, 2));
        // Slurm: this node's entry of the step's task list (node 2 of "2(x2),3" has 3).
        let slurm = |extra: &[(&str, &str)]| {
            let mut v = vec![
                ("SLURM_STEP_ID", "0"),
                ("SLURM_PROCID", "6"),
                ("SLURM_NTASKS", "7"),
                ("SLURM_LOCALID", "2"),
            ];
            v.extend_from_slice(extra);
            detect_launch_from(&env(&v))
        };
        let e = slurm(&[
            ("SLURM_STEP_TASKS_PER_NODE", "2(x2),3"),
            ("SLURM_TASKS_PER_NODE", "4,3"),
            ("SLURM_NODEID", "2"),
        ])
        .unwrap();
        assert_eq!(
            (e.launcher, e.local_rank, e.local_size),
            (Launcher::Slurm, 2, 3)
        );
        let e = slurm(&[("SLURM_TASKS_PER_NODE", "3,4"), ("SLURM_NODEID", "1")]).unwrap();
        assert_eq!(e.local_size, 4);
        let e = slurm(&[("SLURM_NTASKS_PER_NODE", "3")]).unwrap();
        assert_eq!(e.local_size, 3);
        let e = slurm(&[("SLURM_TASKS_PER_NODE", "2,3(x2)")]).unwrap();
        assert_eq!(e.local_size, 3, "no SLURM_NODEID: the largest entry");
        // A launcher that does not say: every rank on this node (the memory check's safe
        // side), the rank as node-local rank.
        let e = detect_launch_from(&env(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
        ]))
        .unwrap();
        assert_eq!((e.local_rank, e.local_size), (3, 4));
        // Inconsistent variables are named.
        let err = detect_launch_from(&env(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "2"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ]))
        .unwrap_err();
        assert!(
            err.to_string().contains("OMPI_COMM_WORLD_LOCAL_RANK")
                && err.to_string().contains("ranks on this node (2)"),
            "{err}"
        );
        assert_eq!(expand_tasks_per_node("2(x3),1"), Some(vec![2, 2, 2, 1]));
        assert_eq!(expand_tasks_per_node("2(3)"), None);
    }

    use ComputeKind::{Cpu, Gpu};

    #[test]
    fn binding_keeps_tokens_as_given() {
        let bind_device = |r, l, f| super::bind_device(r, l, Gpu, f);
        assert_eq!(bind_device(0, None, false).unwrap(), Device::Cpu);
        assert_eq!(bind_device(0, Some(""), false).unwrap(), Device::Cpu);
        assert_eq!(
            bind_device(0, Some("2,3"), false).unwrap(),
            Device::Cuda {
                visible_token: "2".into()
            }
        );
        assert_eq!(
            bind_device(1, Some("2,3"), false).unwrap(),
            Device::Cuda {
                visible_token: "3".into()
            }
        );
        assert_eq!(
            bind_device(1, Some("GPU-aa, GPU-bb"), false).unwrap(),
            Device::Cuda {
                visible_token: "GPU-bb".into()
            }
        );
        assert_eq!(bind_device(5, Some("2,3"), true).unwrap(), Device::Cpu);
        assert_eq!(bind_device(0, Some("-1"), false).unwrap(), Device::Cpu);
        assert_eq!(
            bind_device(0, Some("NoDevFiles"), false).unwrap(),
            Device::Cpu
        );
        assert!(bind_device(1, Some("0,-1,1"), false).is_err());
    }

    #[test]
    fn binding_errors_name_the_list() {
        let bind_device = |r, l, f| super::bind_device(r, l, Gpu, f);
        let e = bind_device(2, Some("2,3"), false).unwrap_err();
        assert!(matches!(e, BindError::TooFewDevices { count: 2, .. }));
        assert!(e.to_string().contains("\"2,3\""), "{e}");
        let e = bind_device(0, Some("1,0,1"), false).unwrap_err();
        assert!(e.to_string().contains("\"1,0,1\"") && e.to_string().contains("twice"));
        let e = bind_device(0, Some("0,,1"), false).unwrap_err();
        assert!(matches!(e, BindError::EmptyToken { .. }));
    }

    #[test]
    fn cpu_models_need_no_gpu_tokens() {
        // One GPU token, two ranks on the node: a CPU model binds CPU on both ranks ...
        for rank in 0..4 {
            assert_eq!(
                bind_device(rank, Some("0"), Cpu, false).unwrap(),
                Device::Cpu
            );
        }
        // ... and ignores even a malformed list, which only a GPU model would read.
        assert_eq!(
            bind_device(0, Some("1,1"), Cpu, false).unwrap(),
            Device::Cpu
        );
        assert_eq!(
            bind_device(0, Some("0,,1"), Cpu, false).unwrap(),
            Device::Cpu
        );
        // A GPU model on the same node needs a token per node-local rank.
        assert_eq!(
            bind_device(0, Some("0"), Gpu, false).unwrap(),
            Device::Cuda {
                visible_token: "0".into()
            }
        );
        let e = bind_device(1, Some("0"), Gpu, false).unwrap_err();
        assert!(
            matches!(e, BindError::TooFewDevices { count: 1, .. }),
            "{e}"
        );
        assert!(e.to_string().contains("lists only 1"), "{e}");
        assert_eq!(bind_device(1, Some("0"), Gpu, true).unwrap(), Device::Cpu);
    }

    #[test]
    fn cpu_models_warn_about_visible_gpus_only() {
        let w = unused_gpus_warning(Some("0"), Cpu).unwrap();
        assert!(
            w.contains("CUDA_VISIBLE_DEVICES=\"0\"") && w.contains("CPU"),
            "{w}"
        );
        assert!(unused_gpus_warning(Some("2,3"), Cpu).is_some());
        assert_eq!(unused_gpus_warning(Some("0"), Gpu), None);
        assert_eq!(unused_gpus_warning(None, Cpu), None);
        assert_eq!(unused_gpus_warning(Some(" "), Cpu), None);
        assert_eq!(unused_gpus_warning(Some("-1"), Cpu), None);
        assert_eq!(unused_gpus_warning(Some("NoDevFiles"), Cpu), None);
    }
}
