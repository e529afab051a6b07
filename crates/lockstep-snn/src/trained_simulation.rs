//! The simulation config a training run writes beside its trained weights, so the trained
//! network simulates with one command: `lockstep simulate RUN_DIR/config.simulate.json`.

use std::path::{Path, PathBuf};

use lockstep_sonata::{Circuit, CONFIG_DIR_MANIFEST};
use serde_json::{json, Map, Value};

use crate::config::SnnRun;
use crate::error::{Result, SnnError};
use lockstep_core::config::ConfigError;

/// File name of the generated config inside the run directory.
pub const TRAINED_SIMULATION_CONFIG: &str = "config.simulate.json";

/// Writes `run_dir/config.simulate.json`: a BMTK-style simulation config of the trained
/// network — the training config's nodes, node and edge types, components and `inputs`
/// (absolute paths), the trained edges files in `run_dir/network/` (through the manifest
/// `"$BASE_DIR": "${configdir}"`, so the run directory can move and BMTK, which resolves
/// paths without a manifest against the working directory, finds them from any folder),
/// `run.tstop = run.seq_len x run.dt` (ms) at the training `run.dt` and `run.seed` (so
/// Poisson inputs draw as sample 0 of a training batch does with that seed), and outputs
/// (`spikes.h5`, `spikes.csv`) in `run_dir/simulation/` (`$BASE_DIR/simulation`), which a
/// later simulation replaces. Written atomically (temporary file, rename).
///
/// Errors: the training config lacks `run.dt` or `run.seq_len`, or the file cannot be
/// written ([`SnnError::Io`]).
pub fn write_trained_simulation_config(circuit: &Circuit, run_dir: &Path) -> Result<PathBuf> {
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
        "inputs": cfg.json.get("inputs").cloned().unwrap_or_else(|| json!({})),
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
