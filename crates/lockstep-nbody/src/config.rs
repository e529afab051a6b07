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

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use lockstep_comm::{CommExt, Communicator, ReduceOp};
use lockstep_core::config::{self, ConfigError};

use crate::integrate::{Diagnostics, ForceSettings, Gravity, Integrator, SimulateOptions};
use crate::shard::simulate_sharded;
use crate::snapshot::{write_hdf5, write_npz, SnapshotHeader};
use crate::{InitialConditions, NbodyError, Units};

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
    /// Output directory (created by the chief).
    pub dir: PathBuf,
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
    /// `E_end / E_start - 1`.
    pub energy_drift: f64,
    /// Largest `|E / E_start - 1|` over outputs.
    pub max_energy_drift: f64,
    /// `|P_end - P_start| / sum m |v|` at the start.
    pub momentum_drift: f64,
    /// Snapshot files written.
    pub files: Vec<PathBuf>,
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
        if let Some(o) = &mut cfg.output {
            o.dir = config::resolve_path(&base, &o.dir);
        }
        Ok(cfg)
    }

    /// Checks every value that can be checked before the run starts.
    pub fn validate(&self, path: &Path) -> Result<(), NbodyError> {
        let wrap = |e: NbodyError| e.in_config(path);
        self.units.validate().map_err(wrap)?;
        self.forces.fmm_params().validate().map_err(wrap)?;
        self.time.times().map_err(wrap)?;
        crate::ic::padded_capacity(1, self.capacity_factor).map_err(wrap)?;
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

/// Runs the simulation of the config file `path` on one rank: initial conditions, leapfrog
/// through the time array, snapshots every `output.every` steps, a progress bar, a table of
/// the diagnostics at each output and a summary of the energy drift (printed unless
/// `opts.quiet`). Also writes `diagnostics.csv` into the output directory.
pub fn run_nbody_config(path: &Path, opts: &RunOptions) -> Result<Summary, NbodyError> {
    run_nbody_config_on(&lockstep_comm::SelfComm::new(), path, opts)
}

/// [`run_nbody_config`] on every rank of `comm` (SelfComm, ThreadComm or MpiComm; the
/// same config for any number of ranks). Each rank generates its share of the initial
/// conditions, the particles are redistributed along the Morton order, forces are globally
/// correct (locally essential tree), diagnostics are summed over ranks, and every rank
/// writes its own snapshot files (`NumFilesPerSnapshot` = ranks). Only the chief creates the
/// output directory, prints, shows the progress bar and writes `diagnostics.csv`.
pub fn run_nbody_config_on<C: Communicator + ?Sized>(
    comm: &C,
    path: &Path,
    opts: &RunOptions,
) -> Result<Summary, NbodyError> {
    let start = Instant::now();
    let mut cfg = NbodyConfig::load(path)?;
    if let Some(dir) = &opts.output_dir {
        match &mut cfg.output {
            Some(o) => o.dir = dir.clone(),
            None => {
                cfg.output = Some(OutputConfig {
                    dir: dir.clone(),
                    every: 1,
                    npz: true,
                    hdf5: true,
                    box_size: 0.0,
                })
            }
        }
    }
    cfg.validate(path)?;
    let (rank, size) = (comm.rank(), comm.size());
    let chief = comm.is_chief();
    let opts = &RunOptions {
        quiet: opts.quiet || !chief,
        progress: opts.progress && chief,
        ..opts.clone()
    };
    let g = cfg.units.g();
    let ts = cfg.time.times()?;
    let mut particles = cfg
        .initial_conditions
        .generate(g, rank, size, cfg.capacity_factor)?;
    // Validates the force settings on every rank before anything is written.
    Gravity::new(cfg.forces, g)?;
    let steps = ts.len() - 1;
    let every = cfg.output.as_ref().map(|o| o.every).unwrap_or(steps.max(1));
    let mut outputs: Vec<usize> = (0..=steps).filter(|k| k % every == 0).collect();
    if outputs.last() != Some(&steps) {
        outputs.push(steps);
    }
    if let Some(o) = &cfg.output {
        let mut ok = [1u64];
        if chief {
            if let Err(e) = std::fs::create_dir_all(&o.dir) {
                ok[0] = 0;
                comm.all_reduce(&mut ok, ReduceOp::Min)?;
                return Err(NbodyError::io(&o.dir, e));
            }
        }
        comm.all_reduce(&mut ok, ReduceOp::Min)?;
        if ok[0] == 0 {
            return Err(NbodyError::io(
                &o.dir,
                std::io::Error::other("the chief could not create the output directory"),
            ));
        }
    }
    if !opts.quiet {
        println!(
            "lockstep nbody: {} particles, {} steps, {:?} with {:?}, softening {} kpc, G = {:e}",
            particles.num_total, steps, cfg.integrator, cfg.forces.method, cfg.forces.softening, g
        );
        println!(
            "{:>6} {:>12} {:>14} {:>14} {:>14} {:>11} {:>11}",
            "output", "time", "K", "W", "E", "dE/E0", "|dP|/P"
        );
    }
    let bar = if opts.progress && !opts.quiet {
        indicatif::ProgressBar::new(steps as u64)
    } else {
        indicatif::ProgressBar::hidden()
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {pos}/{len} steps {elapsed_precise} eta {eta}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut files = Vec::new();
    let mut first: Option<Diagnostics> = None;
    let mut out_index = 0usize;
    let output = cfg.output.clone();
    let quiet = opts.quiet;
    let units = cfg.units;
    let sim_opts = SimulateOptions {
        integrator: cfg.integrator,
        outputs: outputs.clone(),
    };
    let diags = simulate_sharded(
        comm,
        &mut particles,
        &ts,
        &cfg.forces,
        g,
        &sim_opts,
        |_k, p, d| {
            let d0 = *first.get_or_insert(*d);
            if !quiet {
                let dp = ((0..3)
                    .map(|c| (d.momentum[c] - d0.momentum[c]).powi(2))
                    .sum::<f64>())
                .sqrt()
                    / d0.momentum_scale.max(f64::MIN_POSITIVE);
                bar.suspend(|| {
                    println!(
                        "{:>6} {:>12.6e} {:>14.7e} {:>14.7e} {:>14.7e} {:>11.3e} {:>11.3e}",
                        out_index,
                        d.time,
                        d.kinetic,
                        d.potential,
                        d.energy(),
                        d.energy() / d0.energy() - 1.0,
                        dp
                    )
                });
            }
            if let Some(o) = &output {
                if o.npz {
                    files.push(write_npz(&o.dir, out_index, rank, p)?);
                }
                if o.hdf5 {
                    let h = SnapshotHeader {
                        time: d.time,
                        num_files: size,
                        box_size: o.box_size,
                        units,
                    };
                    files.push(write_hdf5(&o.dir, out_index, rank, p, &h)?);
                }
            }
            out_index += 1;
            Ok(())
        },
        |_| bar.inc(1),
    )?;
    bar.finish_and_clear();
    let d0 = diags[0];
    let dl = diags[diags.len() - 1];
    let e0 = d0.energy();
    let rel = |d: &Diagnostics| {
        if e0 != 0.0 {
            d.energy() / e0 - 1.0
        } else {
            d.energy() - e0
        }
    };
    let max_energy_drift = diags.iter().map(|d| rel(d).abs()).fold(0.0, f64::max);
    let momentum_drift = ((0..3)
        .map(|c| (dl.momentum[c] - d0.momentum[c]).powi(2))
        .sum::<f64>())
    .sqrt()
        / d0.momentum_scale.max(f64::MIN_POSITIVE);
    if let (Some(o), true) = (&cfg.output, chief) {
        let csv = o.dir.join("diagnostics.csv");
        let mut text = String::from("time,kinetic,potential,energy,px,py,pz,lx,ly,lz\n");
        for d in &diags {
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
        std::fs::File::create(&csv)
            .and_then(|mut f| f.write_all(text.as_bytes()))
            .map_err(|e| NbodyError::io(&csv, e))?;
    }
    let summary = Summary {
        num_total: particles.num_total,
        steps,
        diagnostics: diags,
        energy_drift: rel(&dl),
        max_energy_drift,
        momentum_drift,
        files,
        wall_seconds: start.elapsed().as_secs_f64(),
    };
    if !opts.quiet {
        println!(
            "summary: {} steps in {:.2} s ({:.3} s/step); energy drift E_end/E_0 - 1 = {:.3e} (max |dE/E0| = {:.3e}); momentum drift |dP|/sum m|v| = {:.3e}; {} snapshot files",
            steps,
            summary.wall_seconds,
            summary.wall_seconds / steps.max(1) as f64,
            summary.energy_drift,
            summary.max_energy_drift,
            summary.momentum_drift,
            summary.files.len()
        );
    }
    Ok(summary)
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
        assert!(cfg.output.unwrap().dir.ends_with("configs/plummer_out"));
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
