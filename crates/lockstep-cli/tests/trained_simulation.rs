//! A training run leaves `config.simulate.json` beside its trained weights: the trained network
//! simulates with one command, from anywhere, and reads the trained edges.

use std::path::PathBuf;
use std::process::Command;

const LOCKSTEP: &str = env!("CARGO_BIN_EXE_lockstep");

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn a_trained_network_simulates_with_one_command() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let out = Command::new(LOCKSTEP)
        .current_dir(repo())
        .args([
            "train",
            "examples/glif_all2all/config.train.json",
            "--updates",
            "1",
        ])
        .arg("--output-dir")
        .arg(&run)
        .arg("--overwrite")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cfg_path = run.join("config.simulate.json");
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    // 500 steps of 1 ms, the training seed and inputs, the trained edges relative to the run.
    assert_eq!(cfg["run"]["tstop"], 500.0);
    assert_eq!(cfg["run"]["dt"], 1.0);
    assert_eq!(cfg["run"]["seed"], 3000);
    assert_eq!(cfg["inputs"]["lgn_poisson"]["rate"], 20.0);
    let edges: Vec<&str> = cfg["networks"]["edges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["edges_file"].as_str().unwrap())
        .collect();
    assert_eq!(edges, ["network/v1_v1_edges.h5", "network/lgn_v1_edges.h5"]);
    for e in &edges {
        assert!(run.join(e).is_file(), "{e} was not exported");
    }

    // Run it from another working directory: every path resolves.
    let out = Command::new(LOCKSTEP)
        .current_dir(tmp.path())
        .arg("simulate")
        .arg(&cfg_path)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("simulated 300 neurons for 500 ms"), "{text}");
    assert!(run.join("simulation/spikes.h5").is_file());
    assert!(run.join("simulation/spikes.csv").is_file());
}
