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

/// Copies a folder of the repository, without the outputs of earlier runs.
fn copy(src: &std::path::Path, dst: &std::path::Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap();
        if p.is_dir() && !["output", "output_trained", "runs"].contains(&name.to_str().unwrap()) {
            copy(&p, &dst.join(name));
        } else if p.is_file() {
            std::fs::copy(&p, dst.join(name)).unwrap();
        }
    }
}

/// `examples/glif_all2all/config.simulation.trained.json` simulates the weights a training run
/// left in `runs/mpi/network` (issue 18, item 4), and says which file is missing before.
#[test]
fn the_bundled_trained_simulation_config_reads_the_demo_runs_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let examples = tmp.path().join("examples");
    for ex in ["glif_all2all", "point_components"] {
        copy(&repo().join("examples").join(ex), &examples.join(ex));
    }
    let ex = examples.join("glif_all2all");
    let simulate = || {
        Command::new(LOCKSTEP)
            .arg("simulate")
            .arg(ex.join("config.simulation.trained.json"))
            .output()
            .unwrap()
    };
    let before = simulate();
    let err = String::from_utf8_lossy(&before.stderr);
    assert!(!before.status.success());
    assert!(err.contains("runs/mpi/network/v1_v1_edges.h5"), "{err}");

    let out = Command::new(LOCKSTEP)
        .arg("train")
        .arg(ex.join("config.train.json"))
        .args(["--updates", "1", "--output-dir"])
        .arg(ex.join("runs/mpi"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let after = simulate();
    let text = String::from_utf8_lossy(&after.stdout);
    assert!(
        after.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&after.stderr)
    );
    assert!(text.contains("simulated 300 neurons for 1000 ms"), "{text}");
    assert!(ex.join("output_trained/spikes.h5").is_file());
}
