//! `lockstep simulate CONFIG`: run a BMTK-style simulation config and write the spikes, and
//! `lockstep bench simulate`: throughput on the reference network.
//!
//! Config keys used (after `$VARIABLE` resolution by `lockstep-sonata`):
//! * `run.tstop`, `run.dt` (ms; required), `run.seed` (Poisson inputs, default 0);
//! * `inputs.<name>`: `{"input_type": "spikes", "module": "sonata" | "h5" | "hdf5",
//!   "input_file": ..., "node_set": <virtual population>}` or
//!   `{"input_type": "poisson", "rate": Hz, "node_set": <virtual population>, "seed": n}`;
//! * `output.output_dir` (required), `output.spikes_file` (default `spikes.h5`),
//!   `output.spikes_file_csv` (optional), `output.log_file` (optional),
//!   `output.overwrite_output_dir` (default false).
//!
//! Everything is read and validated before anything is written; the outputs are written
//! into a temporary folder beside `output_dir`, which then replaces it, so a rejected or
//! failed run leaves no partial output behind.

use std::path::{Path, PathBuf};
use std::time::Instant;

use lockstep_sonata::{Circuit, PopulationSpikes, SonataConfig, SpikeSorting, SpikeTrains};
use serde_json::Value;

use crate::error::{Result, SnnError};
use crate::input::{InputSpec, PoissonSpec};
use crate::nest::TICS_PER_MS;
use crate::network::{Network, NetworkSpec};
use crate::sim::{simulate, InitialState, SimOptions, SimOutput};
use crate::sonata::{network_spec_from_circuit, spike_trains_for_virtual_nodes};

/// Options of [`simulate_config`] beyond the config file.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimulateOptions {
    /// Initial state (default: as NEST starts the cells).
    pub initial: InitialState,
    /// Number of independent trials (default 1; spikes of trial 0 are written).
    pub batch: usize,
    /// Run trials in parallel with rayon.
    pub parallel: bool,
}

impl Default for SimulateOptions {
    fn default() -> Self {
        SimulateOptions {
            initial: InitialState::Nest,
            batch: 1,
            parallel: true,
        }
    }
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
    /// Seconds to read and build the network and inputs.
    pub build_s: f64,
    /// Seconds of simulation.
    pub simulate_s: f64,
}

/// A fully validated simulation, ready to run.
#[derive(Debug)]
pub struct PreparedSimulation {
    /// The resolved config.
    pub config: SonataConfig,
    /// The network description.
    pub spec: NetworkSpec,
    /// The compiled network.
    pub network: Network,
    /// The compiled inputs.
    pub inputs: crate::input::Inputs,
    /// Steps to run.
    pub n_steps: usize,
    /// `run.tstop` (ms).
    pub tstop: f64,
}

fn cfg_err(path: &Path, key: &str, problem: impl Into<String>) -> SnnError {
    SnnError::Config {
        path: path.to_path_buf(),
        key: key.into(),
        problem: problem.into(),
    }
}

fn get_f64(cfg: &SonataConfig, ptr: &str, key: &str) -> Result<Option<f64>> {
    match cfg.json.pointer(ptr) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| cfg_err(&cfg.path, key, format!("must be a number, found {v}"))),
    }
}

fn get_str<'a>(cfg: &'a SonataConfig, v: &'a Value, key: &str) -> Result<Option<&'a str>> {
    match v {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(s)),
        other => Err(cfg_err(
            &cfg.path,
            key,
            format!("must be a string, found {other}"),
        )),
    }
}

/// Reads the config and everything it names, validates it and compiles network and inputs.
/// Writes nothing.
pub fn prepare_simulation(config: &Path) -> Result<PreparedSimulation> {
    let cfg = SonataConfig::from_file(config)?;
    let circuit = Circuit::from_sonata_config(cfg.clone())?;
    let spec = network_spec_from_circuit(&circuit)?;
    let dt = get_f64(&cfg, "/run/dt", "run.dt")?
        .ok_or_else(|| cfg_err(&cfg.path, "run.dt", "is missing (ms)"))?;
    let tstop = get_f64(&cfg, "/run/tstop", "run.tstop")?
        .ok_or_else(|| cfg_err(&cfg.path, "run.tstop", "is missing (ms)"))?;
    let network = spec.compile(dt)?;
    let n_steps = network.grid.run_steps(tstop)?;
    let (input, names) = inputs_from_config(&cfg, &spec)?;
    let inputs = input.compile(
        &names.join(","),
        spec.virtual_nodes.len(),
        &network.grid,
        n_steps,
    )?;
    Ok(PreparedSimulation {
        config: cfg,
        spec,
        network,
        inputs,
        n_steps,
        tstop,
    })
}

/// Parses the config's `inputs` (and `run.seed` for Poisson inputs) into an [`InputSpec`]
/// for the virtual nodes of `spec`; returns it with the input names. Reads spike files;
/// writes nothing.
pub fn inputs_from_config(
    cfg: &SonataConfig,
    spec: &NetworkSpec,
) -> Result<(InputSpec, Vec<String>)> {
    let run_seed = get_f64(cfg, "/run/seed", "run.seed")?.unwrap_or(0.0) as u64;

    let mut input = InputSpec::default();
    let mut names = Vec::new();
    if let Some(inputs) = cfg.json.get("inputs") {
        let Value::Object(map) = inputs else {
            return Err(cfg_err(
                &cfg.path,
                "inputs",
                format!("must be an object, found {inputs}"),
            ));
        };
        for (name, v) in map {
            let key = |k: &str| format!("inputs.{name}.{k}");
            let Value::Object(entry) = v else {
                return Err(cfg_err(
                    &cfg.path,
                    &format!("inputs.{name}"),
                    "must be an object",
                ));
            };
            // Unknown keys are typos (a misspelled `rate` would otherwise be ignored).
            const KNOWN: &[&str] = &[
                "input_type",
                "module",
                "node_set",
                "input_file",
                "rate",
                "seed",
                "trial",
            ];
            lockstep_train::config::check_keys(entry, KNOWN, &format!("inputs.{name}")).map_err(
                |e| match e {
                    lockstep_train::TrainError::Config { key, message } => {
                        cfg_err(&cfg.path, &key, message)
                    }
                    other => cfg_err(&cfg.path, &format!("inputs.{name}"), other.to_string()),
                },
            )?;
            let input_type =
                get_str(cfg, &v["input_type"], &key("input_type"))?.unwrap_or("spikes");
            let module = get_str(cfg, &v["module"], &key("module"))?.unwrap_or("");
            let node_set = get_str(cfg, &v["node_set"], &key("node_set"))?;
            match (input_type, module) {
                ("spikes", "sonata" | "h5" | "hdf5") => {
                    let file = get_str(cfg, &v["input_file"], &key("input_file"))?
                        .ok_or_else(|| cfg_err(&cfg.path, &key("input_file"), "is missing"))?;
                    let path = cfg.resolve_path(file);
                    if !path.is_file() {
                        return Err(SnnError::InvalidInput {
                            input: format!("inputs.{name}"),
                            reason: format!("input_file '{}' does not exist; check the path and manifest", path.display()),
                        });
                    }
                    let spikes = lockstep_sonata::read_spikes(&path)?;
                    let label = path.display().to_string();
                    let trains = spike_trains_for_virtual_nodes(spec, &spikes, &label, node_set)?;
                    let merged = input.spike_trains.get_or_insert_with(|| vec![Vec::new(); spec.virtual_nodes.len()]);
                    for (m, t) in merged.iter_mut().zip(trains) {
                        m.extend(t);
                        m.sort_by(f64::total_cmp);
                    }
                }
                ("poisson", _) | ("spikes", "poisson") => {
                    let rate = v["rate"]
                        .as_f64()
                        .ok_or_else(|| cfg_err(&cfg.path, &key("rate"), "is missing or not a number (Hz)"))?;
                    let seed = v["seed"].as_u64().unwrap_or(run_seed);
                    let ns = node_set.ok_or_else(|| {
                        cfg_err(&cfg.path, &key("node_set"), "is missing (the virtual population to drive)")
                    })?;
                    if !spec.virtual_nodes.iter().any(|vn| vn.population == ns) {
                        return Err(cfg_err(&cfg.path, &key("node_set"), format!("'{ns}' is not a virtual population")));
                    }
                    let p = input.poisson.get_or_insert_with(|| PoissonSpec {
                        rates_hz: vec![0.0; spec.virtual_nodes.len()],
                        seed,
                    });
                    p.seed = seed;
                    for (r, vn) in p.rates_hz.iter_mut().zip(&spec.virtual_nodes) {
                        if vn.population == ns {
                            *r = rate;
                        }
                    }
                }
                _ => {
                    return Err(cfg_err(
                        &cfg.path,
                        &format!("inputs.{name}"),
                        format!(
                            "input_type '{input_type}' with module '{module}' is not supported; use input_type \"spikes\" with module \"sonata\", or input_type \"poisson\""
                        ),
                    ))
                }
            }
            names.push(name.clone());
        }
    }
    Ok((input, names))
}

/// NEST's millisecond value of a spike stamped at step `stamp` (`Time::step(s).get_ms()`).
pub fn stamp_to_ms(net: &Network, stamp: u64) -> f64 {
    (stamp as i64 * net.grid.tics_per_step) as f64 * (1.0 / TICS_PER_MS)
}

/// Spikes of one trial as SONATA spike trains: one population per non-virtual population,
/// sorted by time, ties by node id (as the reference files).
pub fn to_spike_trains(net: &Network, spikes: &[(u32, u32)]) -> SpikeTrains {
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
        source,
    }
}

/// Writes spikes as BMTK's CSV (`timestamps population node_ids`, space separated).
pub fn write_spikes_csv(path: &Path, trains: &SpikeTrains) -> Result<()> {
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

/// Runs `lockstep simulate CONFIG`: validates everything, simulates, writes
/// `output_dir/spikes_file` (SONATA HDF5) and `spikes_file_csv` of all non-virtual nodes.
///
/// Refuses an existing `output_dir` unless `output.overwrite_output_dir` is true. On any
/// error nothing is written.
pub fn simulate_config(config: &Path, opts: &SimulateOptions) -> Result<SimulationSummary> {
    let t0 = Instant::now();
    let prep = prepare_simulation(config)?;
    let cfg = &prep.config;
    let out = cfg.json.get("output").cloned().unwrap_or(Value::Null);
    let out_dir_s = get_str(cfg, &out["output_dir"], "output.output_dir")?
        .ok_or_else(|| cfg_err(&cfg.path, "output.output_dir", "is missing"))?;
    let output_dir = cfg.resolve_path(out_dir_s);
    let overwrite = match &out["overwrite_output_dir"] {
        Value::Null => false,
        Value::Bool(b) => *b,
        other => {
            return Err(cfg_err(
                &cfg.path,
                "output.overwrite_output_dir",
                format!("must be true or false, found {other}"),
            ))
        }
    };
    let spikes_name = get_str(cfg, &out["spikes_file"], "output.spikes_file")?
        .unwrap_or("spikes.h5")
        .to_string();
    let csv_name =
        get_str(cfg, &out["spikes_file_csv"], "output.spikes_file_csv")?.map(str::to_string);
    let log_name = get_str(cfg, &out["log_file"], "output.log_file")?.map(str::to_string);
    for (k, n) in [
        ("output.spikes_file", Some(&spikes_name)),
        ("output.spikes_file_csv", csv_name.as_ref()),
        ("output.log_file", log_name.as_ref()),
    ] {
        if let Some(n) = n {
            let p = Path::new(n);
            if p.is_absolute() || p.components().count() != 1 {
                return Err(cfg_err(
                    &cfg.path,
                    k,
                    format!("'{n}' must be a plain file name inside output_dir"),
                ));
            }
        }
    }
    if output_dir.exists() && !overwrite {
        return Err(SnnError::OutputExists { path: output_dir });
    }
    if output_dir.exists() {
        // Never delete a folder lockstep did not write (a project or data folder).
        let mut own: Vec<&str> = vec![spikes_name.as_str()];
        own.extend(csv_name.as_deref());
        own.extend(log_name.as_deref());
        lockstep_train::rundir::check_replaceable(&output_dir, &own)
            .map_err(|m| cfg_err(&cfg.path, "output.output_dir", m))?;
    }
    if opts.batch == 0 {
        return Err(cfg_err(&cfg.path, "batch", "must be at least 1"));
    }
    let build_s = t0.elapsed().as_secs_f64();

    let t1 = Instant::now();
    let sim_opts = SimOptions {
        initial: opts.initial,
        parallel: opts.parallel,
        ..Default::default()
    };
    let result: SimOutput = simulate(
        &prep.network,
        &prep.inputs,
        prep.n_steps,
        opts.batch,
        0,
        &sim_opts,
    );
    let simulate_s = t1.elapsed().as_secs_f64();
    let trial = &result.trials[0];
    let trains = to_spike_trains(&prep.network, &trial.spikes);

    // Write into a temporary sibling folder, then move it into place.
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
    let marker = tmp.path().join(lockstep_train::rundir::MARKER);
    std::fs::write(
        &marker,
        "written by lockstep simulate; overwrite_output_dir may replace this directory\n",
    )
    .map_err(|e| io_err("cannot write", &marker, e))?;
    lockstep_sonata::write_spikes(tmp.path().join(&spikes_name), &trains)?;
    if let Some(c) = &csv_name {
        write_spikes_csv(&tmp.path().join(c), &trains)?;
    }
    if let Some(l) = &log_name {
        let text = format!(
            "lockstep simulate {}\nneurons {}\nvirtual nodes {}\nrecurrent edges {}\ninput edges {}\ndt {} ms\ntstop {} ms\nsteps {}\nspikes {}\nsynaptic events {}\nbuild {:.3} s\nsimulate {:.3} s\n",
            cfg.path.display(),
            prep.network.n_neurons(),
            prep.network.n_virtual(),
            prep.network.recurrent.len(),
            prep.network.input.len(),
            prep.network.grid.dt,
            prep.tstop,
            prep.n_steps,
            trial.spikes.len(),
            trial.syn_events,
            build_s,
            simulate_s
        );
        let p = tmp.path().join(l);
        std::fs::write(&p, text).map_err(|e| io_err("cannot write log", &p, e))?;
    }
    if output_dir.exists() {
        std::fs::remove_dir_all(&output_dir)
            .map_err(|e| io_err("cannot remove the old output_dir", &output_dir, e))?;
    }
    let kept = tmp.keep();
    std::fs::rename(&kept, &output_dir).map_err(|e| {
        let _ = std::fs::remove_dir_all(&kept);
        io_err(
            "cannot move the finished output into place at",
            &output_dir,
            e,
        )
    })?;
    Ok(SimulationSummary {
        spikes_file: output_dir.join(&spikes_name),
        spikes_file_csv: csv_name.map(|c| output_dir.join(c)),
        output_dir,
        n_neurons: prep.network.n_neurons(),
        n_steps: prep.n_steps,
        dt: prep.network.grid.dt,
        tstop: prep.tstop,
        n_spikes: trial.spikes.len(),
        syn_events: trial.syn_events,
        build_s,
        simulate_s,
    })
}

/// Options of [`bench_simulate`].
#[derive(Debug, Clone, PartialEq)]
pub struct BenchOptions {
    /// The `shared/` folder (holds `data/bmtk/point_450glifs` and `data/reference`).
    pub shared_dir: PathBuf,
    /// Timed repetitions (the best is reported).
    pub repeats: usize,
    /// Trials per run (batched, parallel over trials when `parallel`).
    pub batch: usize,
    /// Use rayon over trials.
    pub parallel: bool,
}

/// Throughput of the forward simulation on `point_450glifs` with the reference input, dt and
/// duration, and its ratio to NEST's recorded wall time.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct BenchReport {
    /// Neurons simulated.
    pub n_neurons: usize,
    /// Steps per trial.
    pub n_steps: usize,
    /// Trials per run.
    pub batch: usize,
    /// Seconds to read and compile network and inputs.
    pub build_s: f64,
    /// Best seconds of one batched simulation.
    pub simulate_s: f64,
    /// `batch * neurons * steps / simulate_s`.
    pub neuron_steps_per_s: f64,
    /// Synaptic events (all trials) per second.
    pub syn_events_per_s: f64,
    /// Spikes in trial 0 (19,263 for NEST).
    pub n_spikes: usize,
    /// NEST's `wall_s` (build + simulate) from the reference JSON.
    pub nest_wall_s: f64,
    /// NEST's `wall_s_simulate`.
    pub nest_simulate_s: f64,
    /// `nest_wall_s / (build_s + simulate_s / batch)`: > 1 means faster than NEST per trial.
    pub speedup_vs_nest_wall: f64,
    /// `nest_simulate_s / (simulate_s / batch)`.
    pub speedup_vs_nest_simulate: f64,
}

/// `lockstep bench simulate`: runs the reference network `repeats` times.
pub fn bench_simulate(opts: &BenchOptions) -> Result<BenchReport> {
    let data = opts.shared_dir.join("data");
    let ref_json = data.join("reference/nest_point450_dt0.1_t1000.json");
    let text = std::fs::read_to_string(&ref_json)
        .map_err(|e| io_err("cannot read the NEST reference", &ref_json, e))?;
    let meta: Value = serde_json::from_str(&text)
        .map_err(|e| cfg_err(&ref_json, "<root>", format!("is not valid JSON: {e}")))?;
    let num = |k: &str| {
        meta[k]
            .as_f64()
            .ok_or_else(|| cfg_err(&ref_json, k, "is missing or not a number"))
    };
    let (dt, tstop, nest_wall_s, nest_simulate_s) = (
        num("dt")?,
        num("tstop")?,
        num("wall_s")?,
        num("wall_s_simulate")?,
    );

    let t0 = Instant::now();
    let circuit = Circuit::from_config(data.join("bmtk/point_450glifs/config.circuit.json"))?;
    let spec = network_spec_from_circuit(&circuit)?;
    let lgn_path = data.join("bmtk/point_450glifs/inputs/lgn_spikes.h5");
    let lgn = lockstep_sonata::read_spikes(&lgn_path)?;
    let trains =
        spike_trains_for_virtual_nodes(&spec, &lgn, &lgn_path.display().to_string(), Some("lgn"))?;
    let net = spec.compile(dt)?;
    let n_steps = net.grid.run_steps(tstop)?;
    let inputs = InputSpec {
        spike_trains: Some(trains),
        poisson: None,
    }
    .compile("lgn", net.n_virtual(), &net.grid, n_steps)?;
    let build_s = t0.elapsed().as_secs_f64();

    let batch = opts.batch.max(1);
    let sim_opts = SimOptions {
        parallel: opts.parallel,
        ..Default::default()
    };
    let mut best = f64::INFINITY;
    let mut last = None;
    for _ in 0..opts.repeats.max(1) {
        let t = Instant::now();
        let out = simulate(&net, &inputs, n_steps, batch, 0, &sim_opts);
        best = best.min(t.elapsed().as_secs_f64());
        last = Some(out);
    }
    let out = last.unwrap_or_default();
    let events: u64 = out.trials.iter().map(|t| t.syn_events).sum();
    let per_trial = best / batch as f64;
    Ok(BenchReport {
        n_neurons: net.n_neurons(),
        n_steps,
        batch,
        build_s,
        simulate_s: best,
        neuron_steps_per_s: (batch * net.n_neurons() * n_steps) as f64 / best,
        syn_events_per_s: events as f64 / best,
        n_spikes: out.trials.first().map_or(0, |t| t.spikes.len()),
        nest_wall_s,
        nest_simulate_s,
        speedup_vs_nest_wall: nest_wall_s / (build_s + per_trial),
        speedup_vs_nest_simulate: nest_simulate_s / per_trial,
    })
}
