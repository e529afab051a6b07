//! `lockstep simulate CONFIG`: from a BMTK-style simulation config to a run of the forward
//! kernel ([`crate::forward`]) and its spike files.
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

use crate::config::{cfg_err, get_f64, get_str, inputs_from_config};
use crate::error::{Result, SnnError};
use crate::forward::{simulate, InitialState, SimOptions, SimOutput};
use crate::nest::TICS_PER_MS;
use crate::network::Network;
use crate::sonata::network_spec_from_circuit;

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
}

/// Reads the config and everything it names, validates it and compiles network and inputs.
/// Writes nothing.
pub(crate) fn prepare_simulation(config: &Path) -> Result<PreparedSimulation> {
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
        network,
        inputs,
        n_steps,
        tstop,
    })
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
        source,
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
            .map_err(|m| cfg_err(&cfg.path, "output.output_dir", m.to_string()))?;
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
