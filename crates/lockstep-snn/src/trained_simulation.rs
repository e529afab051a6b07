//! The simulation config a training run writes beside its trained weights, so the trained
//! network simulates with one command: `lockstep simulate RUN_DIR/config.simulate.json`.

use std::path::{Path, PathBuf};

use lockstep_sonata::{Circuit, PopulationSpikes, SpikeSorting, SpikeTrains, CONFIG_DIR_MANIFEST};
use serde_json::{json, Map, Value};

use crate::config::SnnRun;
use crate::error::{Result, SnnError};
use crate::input::Inputs;
use crate::network::Network;
use crate::simulation::config::stamp_to_ms;
use lockstep_core::config::ConfigError;

/// Folder of the run directory that holds the drawn Poisson inputs as SONATA spike files.
pub const TRAINED_SIMULATION_INPUTS_DIR: &str = "inputs";

/// File name of the generated config inside the run directory.
pub const TRAINED_SIMULATION_CONFIG: &str = "config.simulate.json";

/// Writes `run_dir/config.simulate.json`: a BMTK-style simulation config of the trained
/// network — the training config's nodes, node and edge types, components and `inputs`
/// (absolute paths), the trained edges files in `run_dir/network/` (through the manifest
/// `"$BASE_DIR": "${configdir}"`, so the run directory can move and BMTK, which resolves
/// paths without a manifest against the working directory, finds them from any folder),
/// `run.tstop = run.seq_len x run.dt` (ms) at the training `run.dt` and `run.seed`, and
/// outputs (`spikes.h5`, `spikes.csv`) in `run_dir/simulation/` (`$BASE_DIR/simulation`),
/// which a later simulation replaces. Written atomically (temporary file, rename).
///
/// Inputs are ones BMTK reads: spike-file inputs as the training config has them; each of
/// lockstep's own Poisson inputs (`"input_type": "poisson"`, which BMTK's pointnet does not
/// have) becomes the spike trains it draws for sample 0 with the run's seed over the
/// `inputs.n_steps()` steps of `inputs` (compiled for `net`) — what `lockstep simulate` of the
/// training config draws — written as the SONATA spike file
/// `run_dir/inputs/NAME.h5` (population = the input's `node_set`, sorted by time, a spike of
/// step `s` at the grid time `(s + 1) dt`, several at once repeated) and referenced as
/// `{"input_type": "spikes", "module": "h5", "input_file": "$BASE_DIR/inputs/NAME.h5"}`.
/// So BMTK and lockstep simulate the same input spikes.
///
/// Errors: the training config lacks `run.dt` or `run.seq_len`, or a file cannot be
/// written ([`SnnError::Io`], [`SnnError::Sonata`]).
pub fn write_trained_simulation_config(
    circuit: &Circuit,
    net: &Network,
    inputs: &Inputs,
    run_dir: &Path,
) -> Result<PathBuf> {
    let cfg = &circuit.config;
    let run: SnnRun = cfg.section("run")?;
    let (dt, seq_len) = match (run.dt, run.seq_len) {
        (Some(dt), Some(n)) => (dt, n as f64),
        _ => {
            return Err(ConfigError::new(
                "run.dt, run.seq_len",
                format!("are needed to write {TRAINED_SIMULATION_CONFIG}"),
            )
            .in_file(&cfg.path)
            .into())
        }
    };
    let nodes: Vec<Value> = cfg
        .nodes
        .iter()
        .map(|e| json!({"nodes_file": e.nodes_file, "node_types_file": e.node_types_file}))
        .collect();
    let mut edges = Vec::new();
    for e in &cfg.edges {
        let name = e.edges_file.file_name().ok_or_else(|| {
            ConfigError::new(
                "networks.edges[].edges_file",
                format!("'{}' has no file name", e.edges_file.display()),
            )
            .in_file(&cfg.path)
        })?;
        edges.push(json!({
            "edges_file": format!("$BASE_DIR/network/{}", name.to_string_lossy()),
            "edge_types_file": e.edge_types_file,
        }));
    }
    let mut components = Map::new();
    for (k, v) in &cfg.components.dirs {
        components.insert(k.clone(), json!(v));
    }
    let mut run_out = json!({"tstop": seq_len * dt, "dt": dt});
    if let Some(seed) = run.seed {
        run_out["seed"] = json!(seed);
    }
    let sim = json!({
        "manifest": {"$BASE_DIR": CONFIG_DIR_MANIFEST},
        "run": run_out,
        "inputs": bmtk_inputs(cfg.json.get("inputs"), net, inputs, run_dir)?,
        "components": components,
        "networks": {"nodes": nodes, "edges": edges},
        "output": {
            "output_dir": "$BASE_DIR/simulation",
            "log_file": "log.txt",
            "spikes_file": "spikes.h5",
            "spikes_file_csv": "spikes.csv",
            "overwrite_output_dir": true,
        },
    });
    let path = run_dir.join(TRAINED_SIMULATION_CONFIG);
    let tmp = run_dir.join(format!(".{TRAINED_SIMULATION_CONFIG}.tmp"));
    let io = |source: std::io::Error| SnnError::Io {
        what: "cannot write the trained network's simulation config".into(),
        path: path.clone(),
        cause: source,
    };
    let text = serde_json::to_string_pretty(&sim).map_err(|e| io(e.into()))?;
    std::fs::write(&tmp, text + "\n").map_err(io)?;
    std::fs::rename(&tmp, &path).map_err(io)?;
    Ok(path)
}

/// The training config's `inputs` table with each Poisson input replaced by the spike file
/// of its draws (see [`write_trained_simulation_config`]); the files are written into
/// `run_dir/inputs/` (each through a temporary file renamed into place). A second Poisson
/// input of the same `node_set` is dropped: its draws are in the first one's file (lockstep
/// draws one train per virtual node).
fn bmtk_inputs(
    table: Option<&Value>,
    net: &Network,
    inputs: &Inputs,
    run_dir: &Path,
) -> Result<Value> {
    let Some(table) = table.and_then(Value::as_object) else {
        return Ok(json!({}));
    };
    let is_poisson = |v: &Value| {
        v.get("input_type").and_then(Value::as_str) == Some("poisson")
            || v.get("module").and_then(Value::as_str) == Some("poisson")
    };
    let mut out = Map::new();
    let mut drawn: Vec<String> = Vec::new();
    for (name, entry) in table {
        if !is_poisson(entry) {
            out.insert(name.clone(), entry.clone());
            continue;
        }
        let Some(node_set) = entry.get("node_set").and_then(Value::as_str) else {
            out.insert(name.clone(), entry.clone());
            continue;
        };
        if drawn.iter().any(|d| d == node_set) {
            continue;
        }
        drawn.push(node_set.to_string());
        let trains = SpikeTrains {
            populations: vec![poisson_draws(net, inputs, node_set)],
        };
        let folder = run_dir.join(TRAINED_SIMULATION_INPUTS_DIR);
        let io = |path: &Path, cause: std::io::Error| SnnError::Io {
            what: format!("cannot write the drawn spikes of input {name}"),
            path: path.to_path_buf(),
            cause,
        };
        std::fs::create_dir_all(&folder).map_err(|e| io(&folder, e))?;
        let file = format!("{name}.h5");
        let (path, tmp) = (folder.join(&file), folder.join(format!(".{file}.tmp")));
        lockstep_sonata::write_spikes(&tmp, &trains)?;
        std::fs::rename(&tmp, &path).map_err(|e| io(&path, e))?;
        out.insert(
            name.clone(),
            json!({
                "input_type": "spikes",
                "module": "h5",
                "input_file": format!("$BASE_DIR/{TRAINED_SIMULATION_INPUTS_DIR}/{file}"),
                "node_set": node_set,
            }),
        );
    }
    Ok(Value::Object(out))
}

/// The Poisson spikes of the virtual nodes of population `node_set` in sample 0 of
/// `inputs`, over its steps: a spike of step `s` at `(s + 1) dt` ms (the grid time whose
/// stamp maps it back to step `s`), sorted by time, ties by node id.
fn poisson_draws(net: &Network, inputs: &Inputs, node_set: &str) -> PopulationSpikes {
    let mut p = PopulationSpikes {
        population: node_set.to_string(),
        sorting: SpikeSorting::ByTime,
        ..Default::default()
    };
    for step in 0..inputs.n_steps() {
        let t = stamp_to_ms(net, step as u64 + 1);
        inputs.poisson_events(0, step, |v, count| {
            let node = &net.virtual_nodes[v as usize];
            if node.population == node_set {
                for _ in 0..count {
                    p.node_ids.push(node.node_id);
                    p.timestamps.push(t);
                }
            }
        });
    }
    p
}
