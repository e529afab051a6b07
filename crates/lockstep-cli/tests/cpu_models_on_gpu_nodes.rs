//! CPU models on GPU nodes: the spiking model computes on CPU cores, so GPUs made visible
//! through `CUDA_VISIBLE_DEVICES` (one token, as Slurm sets for one allocated GPU) neither
//! limit the ranks per node nor get bound; the chief warns once that they stay unused.

use lockstep_comm::launch::{mpirun_command, run_with_limit};
use serde_json::json;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

const LOCKSTEP: &str = env!("CARGO_BIN_EXE_lockstep");
const WARNING: &str = "leaves them unused";

fn example() -> PathBuf {
    std::path::absolute(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/glif_all2all"),
    )
    .unwrap()
}

#[test]
fn mpi_training_runs_on_cpu_with_one_visible_gpu() {
    let dir = tempfile::tempdir().unwrap();
    let ex = example();
    let config = json!({
        "network": ex.join("config.circuit.json"),
        "inputs": {"lgn": {"input_type": "poisson", "rate": 20.0, "node_set": "lgn"}},
        "run": {"dt": 1.0, "seq_len": 20, "batch_size": 1, "seed": 5,
                "distribution": {"strategy": "mpi", "global_batch_size": 2}},
        "training": {
            "optimizer": {"name": "adam", "learning_rate": 0.01},
            "optimizer_updates": 1,
            "losses": [{"name": "TargetFiringRate", "firing_rate": ex.join("target_rates.csv")}],
        },
        "output": {"output_dir": dir.path().join("run"), "overwrite_output_dir": true},
    });
    let path = dir.path().join("config.json");
    std::fs::write(&path, serde_json::to_string_pretty(&config).unwrap()).unwrap();
    let mut cmd = mpirun_command(2);
    cmd.arg(LOCKSTEP)
        .arg("train")
        .arg(&path)
        .env("CUDA_VISIBLE_DEVICES", "0");
    let out = run_with_limit(cmd, Duration::from_secs(300)).unwrap();
    assert!(!out.timed_out, "timed out:\n{}", out.all_output());
    assert!(out.success(), "{}", out.all_output());
    assert!(
        out.stdout.contains("Completed 1 optimizer update."),
        "{}",
        out.all_output()
    );
    assert_eq!(
        out.stderr.matches(WARNING).count(),
        1,
        "the chief warns once:\n{}",
        out.all_output()
    );
    assert!(
        out.stderr.contains("CUDA_VISIBLE_DEVICES=\"0\""),
        "{}",
        out.stderr
    );
}

#[test]
fn info_reports_cpu_for_every_rank_and_warns_once() {
    let mut cmd = mpirun_command(2);
    cmd.arg(LOCKSTEP)
        .arg("info")
        .env("CUDA_VISIBLE_DEVICES", "0");
    let out = run_with_limit(cmd, Duration::from_secs(30)).unwrap();
    assert!(out.success(), "{}", out.all_output());
    for rank in 0..2 {
        let want = format!("rank {rank}/2: launch Open MPI (mpirun), rank {rank} of 2, node-local rank {rank} of 2, device cpu,");
        assert!(out.stdout.contains(&want), "{}", out.all_output());
    }
    assert_eq!(
        out.stderr.matches(WARNING).count(),
        1,
        "{}",
        out.all_output()
    );
    // --cpu says the user wants CPU: no warning.
    let out = Command::new(LOCKSTEP)
        .args(["--cpu", "info"])
        .env("CUDA_VISIBLE_DEVICES", "0")
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(!String::from_utf8_lossy(&out.stderr).contains(WARNING));
}
