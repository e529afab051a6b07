//! `lockstep simulate CONFIG`: from a BMTK-style simulation config to a run of the forward
//! kernel ([`crate::forward`]), its spike files, membrane reports and rate table.
//!
//! Config keys (after `$VARIABLE` resolution by `lockstep-sonata`); every other key is an
//! error naming the nearest known key:
//! * top level: `manifest`, `target_simulator`, `run`, `inputs`, `output`, `reports`,
//!   `network`, `networks`, `components`, `node_sets`, `node_sets_file`;
//! * `run.tstop` (alias `duration`), `run.dt` (ms; required), `run.seed` (Poisson inputs,
//!   default 0) ([`SimulationRun`]);
//! * `inputs.<name>`: `{"input_type": "spikes", "module": "sonata" | "h5" | "hdf5",
//!   "input_file": ..., "node_set": <virtual population>}` or
//!   `{"input_type": "poisson", "rate": Hz, "node_set": <virtual population>, "seed": n}`;
//! * `output.output_dir` (required), `output.spikes_file` (default `spikes.h5`),
//!   `output.spikes_file_csv`, `output.log_file`, `output.overwrite_output_dir` (default
//!   false), `output.quiet_simulator` (no progress bar) ([`SimulationOutput`]);
//! * `reports.<name>`: SONATA membrane reports of `V_m` (see
//!   [`lockstep_sonata::membrane_reports`]); `start_time`, `end_time` and `dt` must lie on
//!   the run's time grid. A report records `V_m` at the multiples of its `dt` in
//!   `(start_time, end_time]` (defaults 0, `run.tstop`, `run.dt`): the state at the end of
//!   the step that ends at that time, as NEST's `multimeter` samples it (NEST itself loses
//!   the samples of its last `min_delay` slice; lockstep keeps them).
//!
//! Everything is read and validated, and the memory the run needs is checked against the
//! memory available, before anything is written; the outputs are written into a temporary
//! folder beside `output_dir`, which then replaces it, so a rejected or failed run leaves the
//! previous output untouched and no partial output behind.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use lockstep_core::config::{self as idiom, ConfigError};
use lockstep_core::memory::MemoryEstimate;
use lockstep_sonata::{
    Circuit, PopulationSpikes, Report, ReportDtype, ReportPopulation, SonataConfig, SpikeSorting,
    SpikeTrains, CIRCUIT_KEYS,
};
use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::Value;

use crate::config::{cfg_err, inputs_from_config, InputSection};
use crate::error::{Result, SnnError};
use crate::network::Network;
use crate::simulation::forward::{simulate_with, SimExtras, SimOptions, SimOutput, VmRecorder};
use crate::simulation::model::InitialState;
use crate::simulation::nest::TICS_PER_MS;
use crate::simulation::reports::{plan_reports, PlannedReport};
use crate::sonata::network_spec_from_circuit;

/// The sections of a simulation config lockstep simulate reads (with
/// [`lockstep_sonata::CIRCUIT_KEYS`], every top-level key a simulation config may have).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SimulationConfig {
    /// `run`.
    #[serde(default)]
    pub run: SimulationRun,
    /// `output`.
    #[serde(default)]
    pub output: SimulationOutput,
    /// `inputs.<name>`.
    #[serde(default)]
    pub inputs: BTreeMap<String, InputSection>,
    /// `reports.<name>`, read by [`lockstep_sonata::membrane_reports`].
    #[serde(default)]
    pub reports: Option<IgnoredAny>,
}

/// The `run` section of a simulation config (lockstep simulate owns all of it).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimulationRun {
    /// Simulated time (ms); BMTK also reads it as `duration`.
    #[serde(default, alias = "duration")]
    pub tstop: Option<f64>,
    /// Time step (ms).
    #[serde(default)]
    pub dt: Option<f64>,
    /// Seed of Poisson inputs without their own seed.
    #[serde(default)]
    pub seed: Option<u64>,
}

/// The `output` section of a simulation config.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimulationOutput {
    /// The output folder (resolved against the config's folder).
    #[serde(default)]
    pub output_dir: Option<String>,
    /// SONATA spikes file name inside `output_dir` (default `spikes.h5`).
    #[serde(default)]
    pub spikes_file: Option<String>,
    /// BMTK's space-separated spikes CSV inside `output_dir`.
    #[serde(default)]
    pub spikes_file_csv: Option<String>,
    /// A short run log inside `output_dir`.
    #[serde(default)]
    pub log_file: Option<String>,
    /// Replace an existing `output_dir` that lockstep wrote (default false).
    #[serde(default)]
    pub overwrite_output_dir: Option<bool>,
    /// BMTK's switch to silence the simulator: no progress bar.
    #[serde(default)]
    pub quiet_simulator: Option<bool>,
}

/// Receives the progress of a run: [`start`](RunProgress::start) once with the total number
/// of trial steps (`trials x steps`), [`advance`](RunProgress::advance) from the trials'
/// threads as steps complete, [`finish`](RunProgress::finish) once at the end.
pub trait RunProgress: Send + Sync {
    /// The run begins; `total_steps` trial steps will be reported.
    fn start(&self, total_steps: u64);
    /// `steps` more trial steps are done.
    fn advance(&self, steps: u64);
    /// The run is over (before the outputs are written).
    fn finish(&self);
}

/// Options of [`simulate_config`] beyond the config file.
#[derive(Clone)]
pub struct SimulateOptions {
    /// Initial state (default: as NEST starts the cells).
    pub initial: InitialState,
    /// Number of independent trials (default 1; spikes and reports of trial 0 are written).
    pub batch: usize,
    /// Run trials in parallel with rayon.
    pub parallel: bool,
    /// Where to report progress (none by default; `output.quiet_simulator` turns it off).
    pub progress: Option<Arc<dyn RunProgress>>,
}

impl std::fmt::Debug for SimulateOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimulateOptions")
            .field("initial", &self.initial)
            .field("batch", &self.batch)
            .field("parallel", &self.parallel)
            .field("progress", &self.progress.is_some())
            .finish()
    }
}

impl Default for SimulateOptions {
    fn default() -> Self {
        SimulateOptions {
            initial: InitialState::Nest,
            batch: 1,
            parallel: true,
            progress: None,
        }
    }
}

/// What a row of the rate table aggregates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RateGroup {
    /// Every simulated cell.
    All,
    /// One node population.
    Population,
    /// One node type (`node_type_id (model_name)`).
    NodeType,
}

/// One row of the rate table of a run (trial 0).
#[derive(Debug, Clone, PartialEq)]
pub struct RateRow {
    /// What the row aggregates.
    pub group: RateGroup,
    /// `all`, the population name, or the node type label (with its population when the
    /// network has several).
    pub name: String,
    /// Cells in the group.
    pub cells: usize,
    /// Spikes of those cells.
    pub spikes: usize,
    /// Mean firing rate: `spikes / cells / (tstop / 1000)` (Hz; 0 for an empty group).
    pub rate_hz: f64,
}

/// A membrane report written by a run.
#[derive(Debug, Clone, PartialEq)]
pub struct ReportSummary {
    /// The report's name in `reports`.
    pub name: String,
    /// The file written.
    pub file: PathBuf,
    /// Recorded cells.
    pub cells: usize,
    /// Recorded frames.
    pub frames: usize,
    /// `[start, stop, step]` (ms) as written in `mapping/time`.
    pub time: [f64; 3],
}

/// What [`simulate_config`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct SimulationSummary {
    /// The output folder.
    pub output_dir: PathBuf,
    /// The SONATA spikes HDF5 written.
    pub spikes_file: PathBuf,
    /// The spikes CSV written, if configured.
    pub spikes_file_csv: Option<PathBuf>,
    /// The membrane reports written, in config order.
    pub reports: Vec<ReportSummary>,
    /// Simulated (non-virtual) neurons.
    pub n_neurons: usize,
    /// Steps simulated.
    pub n_steps: usize,
    /// Time step (ms).
    pub dt: f64,
    /// Simulated time (ms).
    pub tstop: f64,
    /// Spikes of trial 0.
    pub n_spikes: usize,
    /// Synaptic events delivered in trial 0.
    pub syn_events: u64,
    /// Firing rates of trial 0: all cells, then per population, then per node type.
    pub rates: Vec<RateRow>,
    /// Seconds to read and build the network and inputs.
    pub build_s: f64,
    /// Seconds of simulation.
    pub simulate_s: f64,
    /// Warnings about the config: report keys lockstep honours but BMTK's pointnet would
    /// ignore (so the same config records other frames there), one message each.
    pub warnings: Vec<String>,
}

/// A fully validated simulation, ready to run.
#[derive(Debug)]
pub(crate) struct PreparedSimulation {
    /// The resolved config.
    pub config: SonataConfig,
    /// The compiled network.
    pub network: Network,
    /// The compiled inputs.
    pub inputs: crate::input::Inputs,
    /// Steps to run.
    pub n_steps: usize,
    /// `run.tstop` (ms).
    pub tstop: f64,
    /// The `output` section.
    pub output: SimulationOutput,
    /// The membrane reports.
    pub reports: Vec<PlannedReport>,
}

/// A [`ConfigError`] of `path` as this crate's error.
fn config_error(path: &Path, e: ConfigError) -> SnnError {
    SnnError::Config(e.in_file(path))
}

/// Refuses unknown top-level keys of the config file itself (the circuit file it includes
/// through `network` is read by `lockstep-sonata`).
fn check_top_level(config: &Path) -> Result<()> {
    let raw = idiom::read_json(config)?;
    let Value::Object(root) = &raw else {
        return Err(cfg_err(config, "<root>", "must be a JSON object"));
    };
    if let Some(k) = root.keys().find(|k| *k == "training") {
        return Err(cfg_err(
            config,
            k,
            "belongs to training configs; run it with `lockstep train`, or simulate with a simulation config (run.tstop, run.dt, output)",
        ));
    }
    let known = [CIRCUIT_KEYS, idiom::field_names::<SimulationConfig>()].concat();
    idiom::check_keys(root, &known, "").map_err(|e| config_error(config, e))
}

/// The memory a run holds beyond the compiled network: per-trial state and spike ring
/// buffers, recorded spikes (bounded by one spike per cell per refractory period), the input
/// schedule and the membrane reports.
pub(crate) fn memory_estimate(
    net: &Network,
    n_steps: usize,
    batch: usize,
    reports: &[PlannedReport],
    csv: bool,
) -> MemoryEstimate {
    let n = net.n_neurons() as u64;
    let (np, na) = (net.n_ports as u64, net.n_asc as u64);
    let trials = batch as u64;
    let mut est = MemoryEstimate::new();
    // U, spikes z, refractory counters, ASCs, y1/y2 per neuron; the ring buffer.
    let state = n * (8 + 1 + 4 + 8 * na + 16 * np);
    let ring = (net.ring_len() as u64)
        .saturating_mul(n)
        .saturating_mul(np)
        .saturating_mul(8);
    est.add(
        format!("trial state ({trials} trial(s))"),
        state.saturating_mul(trials),
    );
    est.add(
        "edge targets of the simulation kernel (4 bytes per edge)",
        crate::simulation::kernel::SimPlan::bytes(net),
    );
    est.add(
        format!(
            "spike ring buffers ({} delay slots, {trials} trial(s))",
            net.ring_len()
        ),
        ring.saturating_mul(trials),
    );
    let steps = n_steps as u64;
    let max_spikes: u64 = net
        .groups
        .iter()
        .map(|g| {
            let per_cell = steps.div_ceil(g.consts.refractory_steps as u64 + 1);
            per_cell.saturating_mul((g.end - g.start) as u64)
        })
        .fold(0, u64::saturating_add);
    // 8 bytes per spike in the kernel (every trial), 16 in the SONATA trains of trial 0,
    // about 32 per CSV line.
    let per_spike = 8 * trials + 16 + if csv { 32 } else { 0 };
    est.add(
        "recorded spikes (at most one per cell per refractory period)",
        max_spikes.saturating_mul(per_spike),
    );
    est.add(
        "input schedule (one index per step)",
        (steps + 1).saturating_mul(4),
    );
    est.driven_by("run.tstop").shrunk_by("run.dt");
    if batch > 1 {
        est.driven_by("--trials");
    }
    for r in reports {
        let extra = if r.dtype == ReportDtype::Float32 {
            3
        } else {
            2
        };
        // The kernel's block, the report's copy, and a float32 copy when asked for.
        est.add(
            format!(
                "report '{}' ({} frames x {} cells)",
                r.name,
                r.recorder.n_frames,
                r.recorder.neurons.len()
            ),
            r.recorder.bytes().saturating_mul(extra) / 2,
        );
        est.driven_by(format!("reports.{}.cells", r.name))
            .shrunk_by(format!("reports.{}.{}", r.name, r.interval_key));
    }
    est
}

/// Reads the config and everything it names, validates it, checks the memory the run
/// needs and compiles network and inputs. `batch` is the number of trials. Writes nothing.
pub(crate) fn prepare_simulation(config: &Path, batch: usize) -> Result<PreparedSimulation> {
    check_top_level(config)?;
    let cfg = SonataConfig::from_file(config)?;
    let SimulationConfig {
        run,
        output,
        inputs,
        ..
    } = idiom::from_value(&cfg.json, "").map_err(|e| config_error(&cfg.path, e))?;
    let dt = run
        .dt
        .ok_or_else(|| cfg_err(&cfg.path, "run.dt", "is missing (ms)"))?;
    let tstop = run
        .tstop
        .ok_or_else(|| cfg_err(&cfg.path, "run.tstop", "is missing (ms)"))?;
    let output_dir = cfg.resolve_path(
        output
            .output_dir
            .as_deref()
            .ok_or_else(|| cfg_err(&cfg.path, "output.output_dir", "is missing"))?,
    );
    if batch == 0 {
        return Err(cfg_err(
            &cfg.path,
            "--trials",
            "must be at least 1 (the trials run together; trial 0 is written)",
        ));
    }
    let circuit = Circuit::from_sonata_config(cfg.clone())?;
    let spec = network_spec_from_circuit(&circuit)?;
    let network = spec.compile(dt)?;
    let n_steps = network.grid.run_steps(tstop)?;
    let reports = plan_reports(&cfg, &network, n_steps, &output_dir)?;
    let (input, names) = inputs_from_config(&cfg, &inputs, run.seed.unwrap_or(0), &spec)?;
    memory_estimate(
        &network,
        n_steps,
        batch,
        &reports,
        output.spikes_file_csv.is_some(),
    )
    .check_here("this simulation")?;
    let inputs = input.compile(
        &names.join(","),
        spec.virtual_nodes.len(),
        &network.grid,
        n_steps,
    )?;
    Ok(PreparedSimulation {
        config: cfg,
        network,
        inputs,
        n_steps,
        tstop,
        output,
        reports,
    })
}

/// Firing rates of one trial: all cells, then each population, then each node type (in the
/// network's order). `spikes` are `(step, neuron)` pairs (external neuron index); `tstop` in
/// ms.
pub fn firing_rates(net: &Network, spikes: &[(u32, u32)], tstop: f64) -> Vec<RateRow> {
    let mut per_neuron = vec![0usize; net.n_neurons()];
    for &(_, e) in spikes {
        per_neuron[e as usize] += 1;
    }
    let seconds = tstop / 1000.0;
    let row = |group, name: String, cells: usize, spikes: usize| RateRow {
        group,
        name,
        cells,
        spikes,
        rate_hz: if cells == 0 || seconds <= 0.0 {
            0.0
        } else {
            spikes as f64 / cells as f64 / seconds
        },
    };
    let mut rows = vec![row(
        RateGroup::All,
        "all".into(),
        net.n_neurons(),
        spikes.len(),
    )];
    let mut pops: Vec<(&str, usize, usize)> = Vec::new();
    let mut types: Vec<(usize, &str, usize, usize)> = Vec::new();
    for (e, nr) in net.neurons.iter().enumerate() {
        match pops.iter_mut().find(|p| p.0 == nr.population) {
            Some(p) => {
                p.1 += 1;
                p.2 += per_neuron[e];
            }
            None => pops.push((&nr.population, 1, per_neuron[e])),
        }
        match types.iter_mut().find(|t| t.0 == nr.cell_type) {
            Some(t) => {
                t.2 += 1;
                t.3 += per_neuron[e];
            }
            None => types.push((nr.cell_type, &nr.population, 1, per_neuron[e])),
        }
    }
    let several = pops.len() > 1;
    rows.extend(
        pops.iter()
            .map(|&(p, c, s)| row(RateGroup::Population, p.to_string(), c, s)),
    );
    rows.extend(types.iter().map(|&(ct, p, c, s)| {
        let label = &net.cell_types[ct].name;
        let name = if several {
            format!("{label} ({p})")
        } else {
            label.clone()
        };
        row(RateGroup::NodeType, name, c, s)
    }));
    rows
}

/// NEST's millisecond value of a spike stamped at step `stamp` (`Time::step(s).get_ms()`).
pub(crate) fn stamp_to_ms(net: &Network, stamp: u64) -> f64 {
    (stamp as i64 * net.grid.tics_per_step) as f64 * (1.0 / TICS_PER_MS)
}

/// Spikes of one trial as SONATA spike trains: one population per non-virtual population,
/// sorted by time, ties by node id (as the reference files).
pub(crate) fn to_spike_trains(net: &Network, spikes: &[(u32, u32)]) -> SpikeTrains {
    let mut pops: Vec<PopulationSpikes> = Vec::new();
    for nr in &net.neurons {
        if !pops.iter().any(|p| p.population == nr.population) {
            pops.push(PopulationSpikes {
                population: nr.population.clone(),
                sorting: SpikeSorting::ByTime,
                ..Default::default()
            });
        }
    }
    let mut sorted: Vec<(u32, u64, usize)> = spikes
        .iter()
        .map(|&(s, e)| {
            let nr = &net.neurons[e as usize];
            (
                s,
                nr.node_id,
                pops.iter()
                    .position(|p| p.population == nr.population)
                    .unwrap_or(0),
            )
        })
        .collect();
    sorted.sort_unstable();
    for (s, id, p) in sorted {
        pops[p].node_ids.push(id);
        pops[p].timestamps.push(stamp_to_ms(net, s as u64 + 1));
    }
    SpikeTrains { populations: pops }
}

fn io_err(what: &str, path: &Path, source: std::io::Error) -> SnnError {
    SnnError::Io {
        what: what.into(),
        path: path.to_path_buf(),
        cause: source,
    }
}

/// Writes spikes as BMTK's CSV (`timestamps population node_ids`, space separated).
pub(crate) fn write_spikes_csv(path: &Path, trains: &SpikeTrains) -> Result<()> {
    let mut rows: Vec<(f64, &str, u64)> = Vec::new();
    for p in &trains.populations {
        for (&id, &t) in p.node_ids.iter().zip(&p.timestamps) {
            rows.push((t, p.population.as_str(), id));
        }
    }
    rows.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(b.1)).then(a.2.cmp(&b.2)));
    let mut text = String::with_capacity(rows.len() * 16 + 32);
    text.push_str("timestamps population node_ids\n");
    for (t, p, id) in rows {
        text.push_str(&format!("{t} {p} {id}\n"));
    }
    std::fs::write(path, text).map_err(|e| io_err("cannot write spikes CSV", path, e))
}

/// Runs `lockstep simulate CONFIG`: validates everything, checks the memory the run needs,
/// simulates, writes `output_dir/spikes_file` (SONATA HDF5) and `spikes_file_csv` of all
/// non-virtual nodes, and each membrane report of trial 0.
///
/// Refuses an existing `output_dir` unless `output.overwrite_output_dir` is true (and then
/// only replaces a folder lockstep wrote). On any error, including a run that cannot fit in
/// memory ([`SnnError::Memory`]), the previous output is left untouched and nothing is
/// written.
pub fn simulate_config(config: &Path, opts: &SimulateOptions) -> Result<SimulationSummary> {
    let t0 = Instant::now();
    let prep = prepare_simulation(config, opts.batch)?;
    let files = output_files(&prep)?;
    let build_s = t0.elapsed().as_secs_f64();

    let t1 = Instant::now();
    let result = run_trials(&prep, opts);
    if lockstep_core::interrupt::requested() {
        return Err(SnnError::Interrupted);
    }
    let simulate_s = t1.elapsed().as_secs_f64();
    let trial = &result.trials[0];
    let trains = to_spike_trains(&prep.network, &trial.spikes);
    let rates = firing_rates(&prep.network, &trial.spikes, prep.tstop);
    let log = files.log.as_ref().map(|_| {
        run_log(
            &prep,
            trial.spikes.len(),
            trial.syn_events,
            &rates,
            [build_s, simulate_s],
        )
    });
    let reports = write_outputs(&prep, &files, &trains, result.vm, log)?;
    Ok(SimulationSummary {
        spikes_file: files.dir.join(&files.spikes),
        spikes_file_csv: files.csv.map(|c| files.dir.join(c)),
        reports,
        output_dir: files.dir,
        n_neurons: prep.network.n_neurons(),
        n_steps: prep.n_steps,
        dt: prep.network.grid.dt,
        tstop: prep.tstop,
        n_spikes: trial.spikes.len(),
        syn_events: trial.syn_events,
        rates,
        build_s,
        simulate_s,
        warnings: prep
            .reports
            .iter()
            .flat_map(|r| r.warnings.iter().cloned())
            .collect(),
    })
}

/// The output folder of a simulation and the names of the files it writes there.
struct OutputFiles {
    /// `output.output_dir`, resolved.
    dir: PathBuf,
    /// `output.spikes_file` (default `spikes.h5`).
    spikes: String,
    /// `output.spikes_file_csv`.
    csv: Option<String>,
    /// `output.log_file`.
    log: Option<String>,
}

/// Checks the output file names (plain, distinct) and that an existing output folder may be
/// replaced (`output.overwrite_output_dir`, and only a folder lockstep wrote). Changes
/// nothing.
fn output_files(prep: &PreparedSimulation) -> Result<OutputFiles> {
    let cfg = &prep.config;
    let out = &prep.output;
    let files = OutputFiles {
        dir: cfg.resolve_path(out.output_dir.as_deref().unwrap_or_default()),
        spikes: out
            .spikes_file
            .clone()
            .unwrap_or_else(|| "spikes.h5".into()),
        csv: out.spikes_file_csv.clone(),
        log: out.log_file.clone(),
    };
    let mut names: Vec<(String, &str)> = vec![("output.spikes_file".into(), files.spikes.as_str())];
    names.extend(
        files
            .csv
            .as_deref()
            .map(|n| ("output.spikes_file_csv".into(), n)),
    );
    names.extend(files.log.as_deref().map(|n| ("output.log_file".into(), n)));
    names.extend(prep.reports.iter().map(|r| {
        (
            format!("reports.{}.file_name", r.name),
            r.file_name.as_str(),
        )
    }));
    for (i, (k, n)) in names.iter().enumerate() {
        let p = Path::new(n);
        if p.is_absolute() || p.components().count() != 1 {
            return Err(cfg_err(
                &cfg.path,
                k,
                format!("'{n}' must be a plain file name inside output_dir"),
            ));
        }
        if let Some((k0, _)) = names[..i].iter().find(|(_, m)| m == n) {
            return Err(cfg_err(
                &cfg.path,
                k,
                format!("'{n}' is also the file of {k0}; give each output its own name"),
            ));
        }
    }
    if files.dir.exists() && !out.overwrite_output_dir.unwrap_or(false) {
        return Err(SnnError::OutputExists { path: files.dir });
    }
    if files.dir.exists() {
        // Never delete a folder lockstep did not write (a project or data folder).
        let own: Vec<&str> = names.iter().map(|(_, n)| *n).collect();
        lockstep_core::output_dir::check_replaceable(&files.dir, &own)
            .map_err(|m| cfg_err(&cfg.path, "output.output_dir", m.to_string()))?;
    }
    Ok(files)
}

/// Runs the prepared trials, recording the membrane reports and reporting progress (unless
/// `output.quiet_simulator`).
fn run_trials(prep: &PreparedSimulation, opts: &SimulateOptions) -> SimOutput {
    let sim_opts = SimOptions {
        initial: opts.initial,
        parallel: opts.parallel,
        ..Default::default()
    };
    let progress = opts
        .progress
        .as_ref()
        .filter(|_| !prep.output.quiet_simulator.unwrap_or(false));
    if let Some(p) = progress {
        p.start((prep.n_steps as u64).saturating_mul(opts.batch as u64));
    }
    let advance = |k: u64| {
        if let Some(p) = progress {
            p.advance(k);
        }
    };
    let recorders: Vec<VmRecorder> = prep.reports.iter().map(|r| r.recorder.clone()).collect();
    let result = simulate_with(
        &prep.network,
        &prep.inputs,
        prep.n_steps,
        opts.batch,
        0,
        &sim_opts,
        &SimExtras {
            record_vm: &recorders,
            progress: progress.map(|_| &advance as &(dyn Fn(u64) + Sync)),
            stop_on_interrupt: true,
        },
    );
    if let Some(p) = progress {
        p.finish();
    }
    result
}

/// The text of `output.log_file`: the run's sizes, counts of trial 0, times
/// (`[build, simulate]`, s) and rate table.
fn run_log(
    prep: &PreparedSimulation,
    n_spikes: usize,
    syn_events: u64,
    rates: &[RateRow],
    seconds: [f64; 2],
) -> String {
    let mut text = format!(
        "lockstep simulate {}\nneurons {}\nvirtual nodes {}\nrecurrent edges {}\ninput edges {}\ndt {} ms\ntstop {} ms\nsteps {}\nspikes {}\nsynaptic events {}\nbuild {:.3} s\nsimulate {:.3} s\n",
        prep.config.path.display(),
        prep.network.n_neurons(),
        prep.network.n_virtual(),
        prep.network.recurrent.len(),
        prep.network.input.len(),
        prep.network.grid.dt,
        prep.tstop,
        prep.n_steps,
        n_spikes,
        syn_events,
        seconds[0],
        seconds[1]
    );
    for r in rates {
        text.push_str(&format!(
            "rate {} {} cells {} spikes {} Hz {}\n",
            match r.group {
                RateGroup::All => "all",
                RateGroup::Population => "population",
                RateGroup::NodeType => "node_type",
            },
            r.name,
            r.cells,
            r.spikes,
            r.rate_hz
        ));
    }
    text
}

/// Writes the outputs of trial 0 (spikes, spikes CSV, membrane reports `vm`, the `log` text)
/// into a temporary folder beside the output folder, then moves it into place (replacing an
/// older output). Returns the reports written.
fn write_outputs(
    prep: &PreparedSimulation,
    files: &OutputFiles,
    trains: &SpikeTrains,
    vm: Vec<Vec<f64>>,
    log: Option<String>,
) -> Result<Vec<ReportSummary>> {
    let output_dir = &files.dir;
    let parent = output_dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
        .to_path_buf();
    std::fs::create_dir_all(&parent)
        .map_err(|e| io_err("cannot create the parent of output_dir", &parent, e))?;
    let tmp = tempfile::Builder::new()
        .prefix(".lockstep-simulate-")
        .tempdir_in(&parent)
        .map_err(|e| io_err("cannot create a temporary output folder in", &parent, e))?;
    lockstep_core::output_dir::write_marker(
        tmp.path(),
        "written by lockstep simulate; overwrite_output_dir may replace this directory\n",
    )
    .map_err(|e| {
        let marker = tmp.path().join(lockstep_core::output_dir::MARKER);
        io_err("cannot write", &marker, e)
    })?;
    lockstep_sonata::write_spikes(tmp.path().join(&files.spikes), trains)?;
    if let Some(c) = &files.csv {
        write_spikes_csv(&tmp.path().join(c), trains)?;
    }
    let mut reports = Vec::with_capacity(prep.reports.len());
    for (r, data) in prep.reports.iter().zip(vm) {
        let mut pop = ReportPopulation::single_compartment(
            r.population.clone(),
            r.node_ids.clone(),
            r.time[0],
            r.time[2],
            data,
            "mV",
        );
        pop.time = r.time;
        let frames = pop.n_frames();
        let report = Report {
            variable: "V_m".into(),
            populations: vec![pop],
        };
        lockstep_sonata::write_report(tmp.path().join(&r.file_name), &report, r.dtype)?;
        reports.push(ReportSummary {
            name: r.name.clone(),
            file: output_dir.join(&r.file_name),
            cells: r.node_ids.len(),
            frames,
            time: r.time,
        });
    }
    if let (Some(l), Some(text)) = (&files.log, log) {
        let p = tmp.path().join(l);
        std::fs::write(&p, text).map_err(|e| io_err("cannot write log", &p, e))?;
    }
    if output_dir.exists() {
        std::fs::remove_dir_all(output_dir)
            .map_err(|e| io_err("cannot remove the old output_dir", output_dir, e))?;
    }
    let kept = tmp.keep();
    std::fs::rename(&kept, output_dir).map_err(|e| {
        let _ = std::fs::remove_dir_all(&kept);
        io_err(
            "cannot move the finished output into place at",
            output_dir,
            e,
        )
    })?;
    Ok(reports)
}
