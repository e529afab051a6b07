//! The memory check of a training run (issue 13, item 4): the spiking model's estimate grows
//! with `run.seq_len` and the batch, shrinks with `gradient_checkpointing`, and a run that
//! cannot fit (`run.seq_len` = 1e8) is refused with a message naming the keys that drive it.

use std::path::{Path, PathBuf};

use lockstep_snn::SnnReplica;
use lockstep_train::Model;
use serde_json::json;

/// A training config for the bundled 300-cell network with the given `run.seq_len` and
/// `training.gradient_checkpointing`.
fn config(dir: &Path, seq_len: u64, checkpointing: serde_json::Value) -> PathBuf {
    let example = std::fs::canonicalize(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/glif_all2all"
    ))
    .unwrap();
    let cfg = json!({
        "network": example.join("config.circuit.json").to_str().unwrap(),
        "inputs": {"lgn": {"input_type": "poisson", "rate": 20.0, "node_set": "lgn"}},
        "run": {"dt": 1.0, "seq_len": seq_len, "batch_size": 16, "seed": 1},
        "training": {
            "optimizer": {"name": "adam", "learning_rate": 0.01},
            "optimizer_updates": 1,
            "losses": [{"name": "TargetFiringRate", "firing_rate": 10.0}],
            "gradient_checkpointing": checkpointing
        },
        "output": {"output_dir": dir.join("out").to_str().unwrap()}
    });
    let path = dir.join(format!("config_{seq_len}.json"));
    std::fs::write(&path, cfg.to_string()).unwrap();
    path
}

fn estimate(dir: &Path, seq_len: u64, checkpointing: serde_json::Value, batch: usize) -> u64 {
    let replica = SnnReplica::from_config(&config(dir, seq_len, checkpointing), false).unwrap();
    replica.memory_estimate(batch).total()
}

#[test]
fn estimate_follows_seq_len_and_checkpointing() {
    let dir = tempfile::tempdir().unwrap();
    let short = estimate(dir.path(), 500, json!(false), 16);
    let long = estimate(dir.path(), 5000, json!(false), 16);
    let segmented = estimate(dir.path(), 5000, json!(25), 16);
    // The float32 kernels (the default dtype) store per step and sample-neuron the potential
    // (4 bytes) and the flags (1 byte); the after-spike currents only every 25 steps: 4500
    // more steps of 300 cells x 16 samples take at least 108 MB more.
    assert!(long - short >= 4500 * 300 * 16 * 5, "{short} -> {long}");
    // Segmented: one 25-step chunk of the tape and 200 chunk boundaries (50 bytes per
    // sample-neuron each), against 5000 steps of 5 bytes.
    assert!(
        segmented * 2 < long,
        "segmented {segmented} vs stored {long}"
    );
}

#[test]
fn a_run_that_cannot_fit_is_refused_naming_the_keys() {
    let dir = tempfile::tempdir().unwrap();
    // Building the model must not allocate per step (this would take ~26 GB per sample).
    let replica =
        SnnReplica::from_config(&config(dir.path(), 100_000_000, json!(false)), false).unwrap();
    let e = replica.memory_estimate(16);
    let available = lockstep_core::memory::available_bytes()
        .expect("this test needs /proc/meminfo or a cgroup memory limit");
    let err = e
        .check(Some(available), "this training run")
        .expect_err("2.6e12 bytes of tape must not fit")
        .to_string();
    for key in [
        "run.seq_len",
        "run.batch_size",
        "training.gradient_checkpointing",
    ] {
        assert!(err.contains(key), "{key} missing from: {err}");
    }
    assert!(!dir.path().join("out").exists());
}
