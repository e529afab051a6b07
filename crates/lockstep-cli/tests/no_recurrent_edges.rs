//! A network without recurrent edges, trained on its recurrent weights only, is refused with
//! the engine's message (serially and under `mpirun -n 2`), never a panic.

use lockstep_comm::launch::{mpirun_command, run_with_limit};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const LOCKSTEP: &str = env!("CARGO_BIN_EXE_lockstep");

fn example() -> PathBuf {
    std::fs::canonicalize(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/glif_all2all"
    ))
    .unwrap()
}

/// The bundled 300-cell network with its input edges only; `distribution` as given.
fn write_config(dir: &Path, distribution: Option<serde_json::Value>) -> PathBuf {
    let ex = example();
    let net = ex.join("network");
    let mut run = serde_json::json!({"dt": 1.0, "seq_len": 20, "batch_size": 2, "seed": 1});
    if let Some(d) = distribution {
        run["distribution"] = d;
    }
    let cfg = serde_json::json!({
        "components": {
            "point_neuron_models_dir": ex.join("../point_components/cell_models"),
            "synaptic_models_dir": ex.join("../point_components/synaptic_models")
        },
        "networks": {
            "nodes": [
                {"nodes_file": net.join("v1_nodes.h5"), "node_types_file": net.join("v1_node_types.csv")},
                {"nodes_file": net.join("lgn_nodes.h5"), "node_types_file": net.join("lgn_node_types.csv")}
            ],
            "edges": [
                {"edges_file": net.join("lgn_v1_edges.h5"), "edge_types_file": net.join("lgn_v1_edge_types.csv")}
            ]
        },
        "inputs": {"lgn": {"input_type": "poisson", "rate": 20.0, "node_set": "lgn"}},
        "run": run,
        "training": {
            "optimizer": {"name": "adam", "learning_rate": 0.01},
            "optimizer_updates": 1,
            "losses": [{"name": "TargetFiringRate", "firing_rate": 10.0}]
        },
        "output": {"output_dir": dir.join("run")}
    });
    let path = dir.join("config.json");
    std::fs::write(&path, serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
    path
}

const MESSAGE: &str = "the model has no trainable parameters";

#[test]
fn serial_training_without_recurrent_edges_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write_config(tmp.path(), None);
    let out = Command::new(LOCKSTEP)
        .arg("train")
        .arg(&cfg)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains(MESSAGE), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn mpi_training_without_recurrent_edges_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write_config(
        tmp.path(),
        Some(serde_json::json!({"strategy": "mpi", "global_batch_size": 4})),
    );
    let mut cmd = mpirun_command(2);
    cmd.arg(LOCKSTEP).arg("train").arg(&cfg);
    let out = run_with_limit(cmd, Duration::from_secs(30)).unwrap();
    assert!(!out.success(), "{}", out.all_output());
    let all = out.all_output();
    // Every rank finds it at validation: one rank reports it, no rank aborts the MPI job.
    assert_eq!(all.matches(MESSAGE).count(), 1, "{all}");
    assert!(
        !all.contains("panicked") && !all.contains("MPI_ABORT"),
        "{all}"
    );
}
