//! `lockstep nbody CONFIG`: the JSON run configuration and its runner.
//!
//! ```json
//! {
//!   "units": {"mass_in_msol": 1e10},
//!   "initial_conditions": {"kind": "plummer", "n": 20000, "total_mass": 1.0,
//!                          "scale_radius": 1.0, "seed": 42},
//!   "capacity_factor": 1.25,
//!   "forces": {"method": "fmm", "softening": 0.01, "order": 4, "theta": 0.6, "leaf_size": 32},
//!   "integrator": "dkd",
//!   "time": {"t_start": 0.0, "t_end": 0.05, "steps": 500},
//!   "output": {"dir": "out", "every": 50, "npz": true, "hdf5": true}
//! }
//! ```
//!
//! `time` is either `{"t_start", "t_end", "steps"}` or `{"ts": [...]}` (times in
//! kpc/(km/s)). Unknown keys are errors that suggest the nearest known key. Relative paths
//! (the output directory, a GADGET input file) are resolved against the config file's
//! directory.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use lockstep_comm::{CommExt, Communicator, ReduceOp};
use lockstep_core::config::{self, ConfigError};
use lockstep_core::memory::MemoryEstimate;

use crate::integrate::{
    Diagnostics, ForceSettings, Gravity, Integrator, Method, NbodySimulateOptions,
};
use crate::output::DEFAULT_DIR;
use crate::shard::simulate_sharded;
use crate::snapshot::{write_hdf5, write_npz, SnapshotHeader};
use crate::{InitialConditions, NbodyError, Particles, Units};

/// Time axis: `t_start`/`t_end`/`steps` or an explicit array `ts`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TimeConfig {
    /// Start time, kpc/(km/s).
    #[serde(default)]
    pub t_start: Option<f64>,
    /// End time, kpc/(km/s).
    #[serde(default)]
    pub t_end: Option<f64>,
    /// Number of equal steps from `t_start` to `t_end`.
    #[serde(default)]
    pub steps: Option<usize>,
    /// Explicit increasing times (instead of the three keys above).
    #[serde(default)]
    pub ts: Option<Vec<f64>>,
}

impl TimeConfig {
    /// The time array.
    pub fn times(&self) -> Result<Vec<f64>, NbodyError> {
        match (&self.ts, self.t_start, self.t_end, self.steps) {
            (Some(ts), None, None, None) => {
                crate::integrate::validate_times(ts)?;
                Ok(ts.clone())
            }
            (None, Some(t0), Some(t1), Some(steps)) => {
                if steps == 0 {
                    return Err(NbodyError::param(
                        "time.steps",
                        steps,
                        "use at least one step",
                    ));
                }
                let ts: Vec<f64> = (0..=steps)
                    .map(|k| t0 + (t1 - t0) * k as f64 / steps as f64)
                    .collect();
                crate::integrate::validate_times(&ts)?;
                Ok(ts)
            }
            _ => Err(NbodyError::param(
                "time",
                format!("{self:?}"),
                "give either {\"t_start\", \"t_end\", \"steps\"} or {\"ts\": [...]}, not a mix",
            )),
        }
    }
}

/// Snapshot output settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputConfig {
    /// Output folder (created by the chief; relative paths are relative to the config file).
    /// Absent: [`crate::output::DEFAULT_DIR`] in the current working directory.
    #[serde(default)]
    pub dir: Option<PathBuf>,
    /// Replace an earlier `lockstep nbody` output in `dir` (only the files it wrote; see
    /// [`crate::output`]). Default false: an existing non-empty folder is refused.
    #[serde(default)]
    pub overwrite_output_dir: bool,
    /// Write an output every `every` steps (and always at the start and the end).
    #[serde(default = "default_every")]
    pub every: usize,
    /// Write `snapshot_{index:04}_rank_{rank:04}.npz` files.
    #[serde(default = "yes")]
    pub npz: bool,
    /// Write GADGET-style `snap_{index:03}.{rank}.hdf5` files.
    #[serde(default = "yes")]
    pub hdf5: bool,
    /// `BoxSize` recorded in HDF5 headers (0: open boundaries), kpc.
    #[serde(default)]
    pub box_size: f64,
}

fn default_every() -> usize {
    1
}
fn yes() -> bool {
    true
}
fn default_capacity() -> f64 {
    1.25
}

/// The `lockstep nbody` configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NbodyConfig {
    /// Unit system.
    #[serde(default)]
    pub units: Units,
    /// Initial conditions.
    pub initial_conditions: InitialConditions,
    /// Padding of the per-rank arrays (capacity = factor x local count).
    #[serde(default = "default_capacity")]
    pub capacity_factor: f64,
    /// Gravity.
    #[serde(default)]
    pub forces: ForceSettings,
    /// `"dkd"` (default) or `"kdk"`.
    #[serde(default)]
    pub integrator: Integrator,
    /// Time axis.
    pub time: TimeConfig,
    /// Snapshots (none when absent).
    #[serde(default)]
    pub output: Option<OutputConfig>,
}

/// Options of [`run_nbody_config`] that do not belong in the config file.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunOptions {
    /// Show a progress bar on stderr.
    pub progress: bool,
    /// Print nothing (no tables, no summary).
    pub quiet: bool,
    /// Replace `output.dir` of the config.
    pub output_dir: Option<PathBuf>,
    /// Set `output.overwrite_output_dir` to true.
    pub overwrite: bool,
    /// Quick-try override of `initial_conditions.n` (generated initial conditions only).
    pub n: Option<u64>,
    /// Quick-try override: run only the first `steps` steps of the time array (the same step
    /// sizes, an earlier end; the last step is an output).
    pub steps: Option<usize>,
}

/// Result of a run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    /// Particles (all ranks).
    pub num_total: u64,
    /// Steps taken.
    pub steps: usize,
    /// Diagnostics at each output (start and end included).
    pub diagnostics: Vec<Diagnostics>,
    /// `E_end / E_start - 1`, or the absolute `E_end - E_start` when `E_start = 0`.
    pub energy_drift: f64,
    /// Largest `|E / E_start - 1|` over outputs (absolute `|E - E_start|` when `E_start = 0`).
    pub max_energy_drift: f64,
    /// `|P_end - P_start| / sum m |v|` at the start, or the absolute `|P_end - P_start|`
    /// when nothing moves at the start (`sum m |v| = 0`).
    pub momentum_drift: f64,
    /// Whether the drifts are absolute: `(energy, momentum)`, true where the initial scale
    /// is zero.
    pub drift_is_absolute: (bool, bool),
    /// Snapshot files written by this rank.
    pub files: Vec<PathBuf>,
    /// The output folder (None when the config writes no outputs).
    pub output_dir: Option<PathBuf>,
    /// Wall-clock seconds.
    pub wall_seconds: f64,
}

impl NbodyConfig {
    /// Parses a config from JSON text; `path` names the file in errors.
    ///
    /// Errors: [`NbodyError::Config`] naming `path`, the dotted key and the problem (unknown
    /// keys and values suggest the nearest known one).
    pub fn from_json(text: &str, path: &Path) -> Result<Self, NbodyError> {
        let value: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| ConfigError::new("", format!("not valid JSON: {e}")).in_file(path))?;
        Ok(config::from_value(&value, "").map_err(|e| e.in_file(path))?)
    }

    /// Reads and parses a config file, resolving relative paths (the output directory, a
    /// GADGET input file) against its directory ([`config::resolve_path`]).
    ///
    /// Errors: the file cannot be read or parsed ([`NbodyError::Config`]).
    pub fn load(path: &Path) -> Result<Self, NbodyError> {
        let mut cfg: Self = config::from_json_file(path)?;
        let base = config::config_dir(path);
        if let InitialConditions::GadgetHdf5 { path: p } = &mut cfg.initial_conditions {
            *p = config::resolve_path(&base, &*p);
        }
        if let Some(dir) = cfg.output.as_mut().and_then(|o| o.dir.as_mut()) {
            *dir = config::resolve_path(&base, &*dir);
        }
        Ok(cfg)
    }

    /// Checks every value that can be checked before the run starts.
    pub fn validate(&self, path: &Path) -> Result<(), NbodyError> {
        let wrap = |e: NbodyError| e.in_config(path);
        self.units.validate().map_err(wrap)?;
        self.forces.fmm_params().validate().map_err(wrap)?;
        self.time.times().map_err(wrap)?;
        crate::particles::padded_capacity(1, self.capacity_factor).map_err(wrap)?;
        if let Some(o) = &self.output {
            if o.every == 0 {
                return Err(wrap(NbodyError::param(
                    "output.every",
                    0,
                    "write an output every >= 1 steps",
                )));
            }
            if !(o.box_size.is_finite() && o.box_size >= 0.0) {
                return Err(wrap(NbodyError::param(
                    "output.box_size",
                    o.box_size,
                    "must be finite and >= 0",
                )));
            }
        }
        Ok(())
    }
}

/// `value` relative to `reference` (`value / reference - 1`), or the absolute difference
/// when the reference is zero (a system at rest, zero total energy): never NaN or inf for
/// finite inputs. Returns `(drift, absolute)`.
pub fn relative_or_absolute(value: f64, reference: f64) -> (f64, bool) {
    if reference != 0.0 {
        (value / reference - 1.0, false)
    } else {
        (value - reference, true)
    }
}

/// Momentum drift `|P - P0| / sum m |v|` at the start, or the absolute `|P - P0|` when
/// nothing moves at the start. Returns `(drift, absolute)`.
pub fn momentum_drift(d: &Diagnostics, d0: &Diagnostics) -> (f64, bool) {
    let dp = (0..3)
        .map(|c| (d.momentum[c] - d0.momentum[c]).powi(2))
        .sum::<f64>()
        .sqrt();
    if d0.momentum_scale > 0.0 {
        (dp / d0.momentum_scale, false)
    } else {
        (dp, true)
    }
}

/// Memory one rank of a run needs, from the config alone: `num_total` particles over `ranks`
/// ranks (bytes per particle of the padded shard, forces, the tree and its expansions, the
/// redistribution and tree-exchange buffers, the snapshot copies; direct summation gathers
/// every particle on every rank). `count_key` names the key that sets `num_total`.
pub fn memory_estimate(
    cfg: &NbodyConfig,
    num_total: u64,
    ranks: usize,
    count_key: &str,
) -> MemoryEstimate {
    let share = num_total.div_ceil(ranks.max(1) as u64);
    let cap = (share as f64 * cfg.capacity_factor.max(1.0)).ceil() as u64;
    let nterms = crate::fmm::expansion::nterms(cfg.forces.order) as u64;
    let nodes = 2 * share / cfg.forces.leaf_size.max(1) as u64 + 1;
    let mut e = MemoryEstimate::new();
    e.add("particle shard (64 B per slot)", cap.saturating_mul(64))
        .add("forces (2 x 32 B per particle)", share.saturating_mul(64))
        .add(
            "redistribution buffers (232 B per particle)",
            share.saturating_mul(232),
        )
        .add(
            "snapshot copies (56 B per particle)",
            share.saturating_mul(56),
        );
    match cfg.forces.method {
        Method::Fmm => {
            e.add(
                "tree (sorted copies, keys, permutation: 56 B per particle)",
                share.saturating_mul(56),
            )
            .add(
                "tree nodes and expansions",
                nodes.saturating_mul(96 + 16 * nterms),
            )
            .add(
                "imported particles and cells (64 B per particle)",
                share.saturating_mul(64),
            );
            e.driven_by("forces.order").driven_by("forces.leaf_size");
        }
        Method::Direct => {
            e.add(
                "all particles gathered for direct summation (96 B each)",
                num_total.saturating_mul(96),
            );
            e.driven_by("forces.method");
        }
    }
    e.driven_by(count_key).driven_by("capacity_factor");
    e
}

/// Processes of this job on this machine (they share its memory): the node-local size the
/// launcher reports ([`lockstep_comm::launch::LaunchEnv::local_size`]: Open MPI, MPICH/Hydra
/// or Slurm), 1 for a process started without a launcher (thread ranks share one process).
fn ranks_on_this_node() -> u64 {
    lockstep_comm::launch::detect_launch().map_or(1, |l| l.local_size.max(1) as u64)
}

/// A validated run, before anything is generated or written.
struct Plan {
    cfg: NbodyConfig,
    ts: Vec<f64>,
    outputs: Vec<usize>,
    /// The output folder and settings (None: no outputs).
    output: Option<(PathBuf, OutputConfig)>,
}

/// Loads and validates the config, applies the command-line overrides, checks the memory the
/// run needs. Touches nothing.
fn plan_run(path: &Path, opts: &RunOptions, ranks: usize) -> Result<Plan, NbodyError> {
    let mut cfg = NbodyConfig::load(path)?;
    if opts.output_dir.is_some() || opts.overwrite {
        let o = cfg.output.get_or_insert(OutputConfig {
            dir: None,
            overwrite_output_dir: false,
            every: 1,
            npz: true,
            hdf5: true,
            box_size: 0.0,
        });
        if let Some(dir) = &opts.output_dir {
            o.dir = Some(dir.clone());
        }
        o.overwrite_output_dir |= opts.overwrite;
    }
    if let Some(n) = opts.n {
        match &mut cfg.initial_conditions {
            InitialConditions::Plummer { n: count, .. }
            | InitialConditions::Clumps { n: count, .. }
            | InitialConditions::UniformCube { n: count, .. } => *count = n,
            InitialConditions::GadgetHdf5 { .. } => {
                return Err(ConfigError::new(
                    "initial_conditions",
                    "--n sets the particle count of generated initial conditions, but these are read from a GADGET file (its NumPart_Total is the count)",
                )
                .in_file(path)
                .into())
            }
        }
    }
    cfg.validate(path)?;
    let mut ts = cfg.time.times()?;
    if let Some(k) = opts.steps {
        if k == 0 {
            return Err(NbodyError::param("--steps", k, "run at least one step"));
        }
        ts.truncate(k + 1);
    }
    let steps = ts.len() - 1;
    let every = cfg.output.as_ref().map(|o| o.every).unwrap_or(steps.max(1));
    let mut outputs: Vec<usize> = (0..=steps).filter(|k| k % every == 0).collect();
    if outputs.last() != Some(&steps) {
        outputs.push(steps);
    }
    let (num_total, key) = match &cfg.initial_conditions {
        InitialConditions::GadgetHdf5 { path: p } => (
            crate::snapshot::gadget_total(p).map_err(|e| e.in_config(path))?,
            "initial_conditions.path (its NumPart_Total)",
        ),
        ic => (ic.count().unwrap_or(0), "initial_conditions.n"),
    };
    memory_estimate(&cfg, num_total, ranks, key)
        .times(ranks_on_this_node(), "ranks on this machine")
        .check_here("this N-body run")
        .map_err(|e| ConfigError::new("", e.to_string()).in_file(path))?;
    let output = cfg.output.clone().map(|o| {
        let dir = o.dir.clone().unwrap_or_else(|| PathBuf::from(DEFAULT_DIR));
        (dir, o)
    });
    Ok(Plan {
        cfg,
        ts,
        outputs,
        output,
    })
}

/// Makes every rank return an error when any rank's `result` is one (so no rank waits in a
/// collective for a rank that has given up), agreed by all ([`NbodyError::is_agreed`]): the
/// lowest failing rank its own as [`NbodyError::Refused`], the others
/// [`NbodyError::RefusedByPeer`] naming it and `what` failed there.
fn agree<T, C: Communicator + ?Sized>(
    comm: &C,
    result: Result<T, NbodyError>,
    what: &str,
) -> Result<T, NbodyError> {
    let size = comm.size() as u64;
    let mine = if result.is_ok() {
        size
    } else {
        comm.rank() as u64
    };
    let first = comm.all_reduce_scalar(mine, ReduceOp::Min)?;
    match result {
        Ok(v) if first == size => Ok(v),
        Err(e) if first == comm.rank() as u64 => Err(if e.is_agreed() {
            e
        } else {
            NbodyError::Refused(Box::new(e))
        }),
        _ => Err(NbodyError::RefusedByPeer {
            rank: first as usize,
            what: what.to_string(),
        }),
    }
}

/// Runs the simulation of the config file `path` on one rank: initial conditions, leapfrog
/// through the time array, snapshots every `output.every` steps, a progress bar, a table of
/// the diagnostics at each output and a summary of the energy drift (printed unless
/// `opts.quiet`). Also writes `diagnostics.csv` into the output folder.
///
/// Errors: [`NbodyError`]; every check (config, memory, initial conditions, output folder)
/// runs before the output folder is touched.
pub fn run_nbody_config(path: &Path, opts: &RunOptions) -> Result<Summary, NbodyError> {
    run_nbody_config_on(&lockstep_comm::SelfComm::new(), path, opts)
}

/// [`run_nbody_config`] on every rank of `comm` (SelfComm, ThreadComm or MpiComm; the
/// same config for any number of ranks). Each rank generates its share of the initial
/// conditions, the particles are redistributed along the Morton order, forces are globally
/// correct (locally essential tree), diagnostics are summed over ranks, and every rank
/// writes its own snapshot files (`NumFilesPerSnapshot` = ranks). Only the chief checks and
/// prepares the output folder (see [`crate::output`]), prints, shows the progress bar and
/// writes `diagnostics.csv`. Ranks may hold no particles.
///
/// Errors: as [`run_nbody_config`]; an error on one rank before the run starts is an error
/// on every rank.
///
/// `comm` is a `dyn Communicator` (not a generic) so that the run compiles once, in this
/// crate, and not again in each program that starts one (the CLI, the Python extension).
pub fn run_nbody_config_on(
    comm: &dyn Communicator,
    path: &Path,
    opts: &RunOptions,
) -> Result<Summary, NbodyError> {
    let start = Instant::now();
    let chief = comm.is_chief();
    let opts = &RunOptions {
        quiet: opts.quiet || !chief,
        progress: opts.progress && chief,
        ..opts.clone()
    };
    let plan = agree(comm, plan_run(path, opts, comm.size()), "validation")?;
    let g = plan.cfg.units.g();
    let particles =
        plan.cfg
            .initial_conditions
            .generate(g, comm.rank(), comm.size(), plan.cfg.capacity_factor);
    let mut particles = agree(comm, particles, "reading the initial conditions")?;
    // Validates the force settings on every rank before anything is written.
    let slot = crate::fmm_gpu::device_slot(comm.rank());
    let gravity = agree(
        comm,
        Gravity::new_in_slot(plan.cfg.forces, g, slot),
        "checking the forces",
    )?;
    // Which GPU computes (the chief; every rank that shares its GPU says so).
    if let Some(d) = gravity.solver().device() {
        let text = d.describe();
        if (chief && !opts.quiet) || text.contains("shared") {
            eprintln!(
                "rank {}: forces on {text}; the particles stay on the GPU between steps",
                comm.rank()
            );
        }
        if let Some(w) = d.software_warning().filter(|_| chief && !opts.quiet) {
            eprintln!("{w}");
        }
    }
    let prepared = match (&plan.output, chief) {
        (Some((dir, o)), true) => crate::output::plan(dir, o.overwrite_output_dir)
            .and_then(|p| crate::output::prepare(dir, &p)),
        _ => Ok(()),
    };
    agree(comm, prepared, "preparing the output folder")?;
    // Every rank writes its snapshot files into the folder the chief prepared: a rank on a
    // host that does not see it (no shared filesystem) says so before any snapshot.
    let visible = match &plan.output {
        Some((dir, _)) if !dir.join(lockstep_core::output_dir::MARKER).is_file() => {
            Err(NbodyError::OutputDir {
                dir: dir.clone(),
                problem: format!(
                    "rank {} (host {}) does not see this folder, which the chief (rank 0) prepared; every rank writes its snapshot files there, so put output.dir (or --output-dir) on a filesystem that every host shares",
                    comm.rank(),
                    lockstep_comm::host_name()
                ),
            })
        }
        _ => Ok(()),
    };
    agree(comm, visible, "checking the output folder")?;
    let (diags, files) = integrate(comm, &plan, &mut particles, opts)?;
    finish(comm, &plan, &particles, diags, files, opts, start)
}

/// The time integration with its outputs: the table row and the snapshot files of each
/// output, the progress bar. Returns the diagnostics and this rank's files.
fn integrate<C: Communicator + ?Sized>(
    comm: &C,
    plan: &Plan,
    particles: &mut Particles,
    opts: &RunOptions,
) -> Result<(Vec<Diagnostics>, Vec<PathBuf>), NbodyError> {
    let cfg = &plan.cfg;
    let steps = plan.ts.len() - 1;
    if !opts.quiet {
        println!(
            "lockstep nbody: {} particles on {} rank(s), {} steps, {:?} with {:?}, softening {} kpc, G = {:e}",
            particles.num_total,
            comm.size(),
            steps,
            cfg.integrator,
            cfg.forces.method,
            cfg.forces.softening,
            cfg.units.g()
        );
        println!(
            "{:>6} {:>12} {:>14} {:>14} {:>14} {:>11} {:>11}",
            "output", "time", "K", "W", "E", "dE/E0", "|dP|/P"
        );
    }
    // A bar on a terminal; otherwise (a log file, a batch job) a line about every tenth
    // of the run, as the training commands log.
    use std::io::IsTerminal;
    let show = opts.progress && !opts.quiet;
    let terminal = std::io::stderr().is_terminal();
    let bar = if show && terminal {
        indicatif::ProgressBar::new(steps as u64)
    } else {
        indicatif::ProgressBar::hidden()
    };
    let mut lines = ProgressLines::new(show && !terminal, steps);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {pos}/{len} steps {elapsed_precise} eta {eta}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut files = Vec::new();
    let mut first: Option<Diagnostics> = None;
    let mut out_index = 0usize;
    let (rank, size) = (comm.rank(), comm.size());
    let sim_opts = NbodySimulateOptions {
        integrator: cfg.integrator,
        outputs: plan.outputs.clone(),
        keep_on_device: true,
    };
    let diags = simulate_sharded(
        comm,
        particles,
        &plan.ts,
        &cfg.forces,
        cfg.units.g(),
        &sim_opts,
        |_k, p, d| {
            let d0 = *first.get_or_insert(*d);
            if !opts.quiet {
                // Absolute drifts where the initial scale is zero (marked with a *).
                let (de, de_abs) = relative_or_absolute(d.energy(), d0.energy());
                let (dp, dp_abs) = momentum_drift(d, &d0);
                let mark = |abs: bool| if abs { "*" } else { " " };
                bar.suspend(|| {
                    println!(
                        "{:>6} {:>12.6e} {:>14.7e} {:>14.7e} {:>14.7e} {:>10.3e}{} {:>10.3e}{}",
                        out_index,
                        d.time,
                        d.kinetic,
                        d.potential,
                        d.energy(),
                        de,
                        mark(de_abs),
                        dp,
                        mark(dp_abs)
                    )
                });
            }
            if let Some((dir, o)) = &plan.output {
                if o.npz {
                    files.push(write_npz(dir, out_index, rank, p)?);
                }
                if o.hdf5 {
                    let h = SnapshotHeader {
                        time: d.time,
                        num_files: size,
                        box_size: o.box_size,
                        units: cfg.units,
                    };
                    files.push(write_hdf5(dir, out_index, rank, p, &h)?);
                }
            }
            out_index += 1;
            Ok(())
        },
        |_| {
            bar.inc(1);
            lines.step();
        },
    )?;
    bar.finish_and_clear();
    Ok((diags, files))
}

/// Progress as plain lines on stderr where no terminal shows a bar: `step K/N (P%), elapsed
/// E s, eta R s` after about every tenth of the steps.
struct ProgressLines {
    on: bool,
    steps: usize,
    done: usize,
    every: usize,
    start: Instant,
}

impl ProgressLines {
    fn new(on: bool, steps: usize) -> Self {
        ProgressLines {
            on,
            steps,
            done: 0,
            every: steps.div_ceil(10).max(1),
            start: Instant::now(),
        }
    }

    /// One step done; prints a line every `every` steps (not after the last: the table
    /// and summary follow).
    fn step(&mut self) {
        self.done += 1;
        if !self.on || self.done >= self.steps || !self.done.is_multiple_of(self.every) {
            return;
        }
        let elapsed = self.start.elapsed().as_secs_f64();
        let eta = elapsed / self.done as f64 * (self.steps - self.done) as f64;
        eprintln!(
            "lockstep nbody: step {}/{} ({:.0}%), elapsed {elapsed:.1} s, eta {eta:.1} s",
            self.done,
            self.steps,
            100.0 * self.done as f64 / self.steps as f64
        );
    }
}

/// The end of a run: `diagnostics.csv` (chief), the summary, and where the outputs are.
fn finish<C: Communicator + ?Sized>(
    comm: &C,
    plan: &Plan,
    particles: &Particles,
    diags: Vec<Diagnostics>,
    files: Vec<PathBuf>,
    opts: &RunOptions,
    start: Instant,
) -> Result<Summary, NbodyError> {
    let steps = plan.ts.len() - 1;
    let d0 = diags[0];
    let dl = diags[diags.len() - 1];
    let (energy_drift, e_abs) = relative_or_absolute(dl.energy(), d0.energy());
    let max_energy_drift = diags
        .iter()
        .map(|d| relative_or_absolute(d.energy(), d0.energy()).0.abs())
        .fold(0.0, f64::max);
    let (momentum_drift, p_abs) = momentum_drift(&dl, &d0);
    if let (Some((dir, _)), true) = (&plan.output, comm.is_chief()) {
        write_diagnostics_csv(&dir.join("diagnostics.csv"), &diags)?;
    }
    let all_files = comm.all_reduce_scalar(files.len() as u64, ReduceOp::Sum)?;
    let summary = Summary {
        num_total: particles.num_total,
        steps,
        diagnostics: diags,
        energy_drift,
        max_energy_drift,
        momentum_drift,
        drift_is_absolute: (e_abs, p_abs),
        files,
        output_dir: plan.output.as_ref().map(|(d, _)| d.clone()),
        wall_seconds: start.elapsed().as_secs_f64(),
    };
    if !opts.quiet {
        let kind = |abs: bool| {
            if abs {
                "absolute, initial value 0"
            } else {
                "relative"
            }
        };
        println!(
            "summary: {} steps in {:.2} s ({:.3} s/step); energy drift {:.3e} ({}; max {:.3e}); momentum drift {:.3e} ({})",
            steps,
            summary.wall_seconds,
            summary.wall_seconds / steps.max(1) as f64,
            summary.energy_drift,
            kind(e_abs),
            summary.max_energy_drift,
            summary.momentum_drift,
            kind(p_abs),
        );
        match &summary.output_dir {
            Some(dir) => println!(
                "Outputs in {} ({all_files} snapshot files from {} rank(s), diagnostics.csv)",
                std::path::absolute(dir).unwrap_or_else(|_| dir.clone()).display(),
                comm.size()
            ),
            None => println!("No outputs written (the config has no `output` section; pass --output-dir to write snapshots)"),
        }
    }
    Ok(summary)
}

/// Writes the diagnostics at each output as CSV (time, K, W, E, P, L), atomically.
fn write_diagnostics_csv(csv: &Path, diags: &[Diagnostics]) -> Result<(), NbodyError> {
    let mut text = String::from("time,kinetic,potential,energy,px,py,pz,lx,ly,lz\n");
    for d in diags {
        text += &format!(
            "{:e},{:e},{:e},{:e},{:e},{:e},{:e},{:e},{:e},{:e}\n",
            d.time,
            d.kinetic,
            d.potential,
            d.energy(),
            d.momentum[0],
            d.momentum[1],
            d.momentum[2],
            d.angular_momentum[0],
            d.angular_momentum[1],
            d.angular_momentum[2]
        );
    }
    let tmp = csv.with_extension("csv.partial");
    std::fs::write(&tmp, text)
        .and_then(|_| std::fs::rename(&tmp, csv))
        .map_err(|e| NbodyError::io(csv, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_key_suggests_nearest() {
        let text = r#"{"initial_conditions": {"kind": "plummer", "n": 10}, "time": {"ts": [0, 1]}, "forcs": {}}"#;
        let e = NbodyConfig::from_json(text, Path::new("x.json"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("x.json") && e.contains("forcs") && e.contains("did you mean `forces`"),
            "{e}"
        );
        assert_eq!(
            e,
            "x.json: forcs: unknown key `forcs`; did you mean `forces`?"
        );
        let text = r#"{"initial_conditions": {"kind": "plummer", "n": 10, "sead": 1}, "time": {"ts": [0, 1]}}"#;
        let e = NbodyConfig::from_json(text, Path::new("x.json"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("did you mean `seed`"), "{e}");
        assert!(e.starts_with("x.json: initial_conditions.sead: "), "{e}");
        let text = r#"{"initial_conditions": {"kind": "plumer", "n": 10}, "time": {"ts": [0, 1]}}"#;
        let e = NbodyConfig::from_json(text, Path::new("x.json"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("did you mean `plummer`"), "{e}");
        assert!(e.starts_with("x.json: initial_conditions"), "{e}");
        let text = r#"{"initial_conditions": {"kind": "plummer", "n": 10}, "time": {"ts": [0, 1]}, "forces": {"ordr": 3}}"#;
        let e = NbodyConfig::from_json(text, Path::new("x.json"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("did you mean `order`"), "{e}");
        assert!(e.starts_with("x.json: forces.ordr: "), "{e}");
    }

    #[test]
    fn bundled_example_config_is_valid() {
        let path = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/configs/plummer.json"));
        let cfg = NbodyConfig::load(path).unwrap();
        cfg.validate(path).unwrap();
        assert_eq!(cfg.time.times().unwrap().len(), 101);
        // The bundled config writes to the default folder in the current directory, not
        // into the source tree.
        assert_eq!(cfg.output.unwrap().dir, None);
    }

    #[test]
    fn time_forms() {
        let t = TimeConfig {
            t_start: Some(0.0),
            t_end: Some(1.0),
            steps: Some(4),
            ts: None,
        };
        assert_eq!(t.times().unwrap(), vec![0.0, 0.25, 0.5, 0.75, 1.0]);
        let bad = TimeConfig {
            t_start: Some(0.0),
            t_end: None,
            steps: Some(4),
            ts: Some(vec![0.0, 1.0]),
        };
        assert!(bad.times().unwrap_err().to_string().contains("t_start"));
        let rev = TimeConfig {
            ts: Some(vec![0.0, 1.0, 0.5]),
            ..Default::default()
        };
        assert!(rev.times().unwrap_err().to_string().contains("increasing"));
    }
}
