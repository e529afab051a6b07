//! `simulate_config` (the library side of `lockstep simulate CONFIG`) on the bundled real
//! network: output equals NEST's spikes, output-dir rules, rejected inputs write nothing.

use std::path::{Path, PathBuf};

use lockstep_snn::{simulate_config, SimulateOptions, SnnError};
use serde_json::{json, Value};

/// The repository's `examples/` folder: BMTK's `point_450glifs` network and `point_components`,
/// and NEST 3.10's reference output in `point_450glifs/reference/`.
fn examples() -> PathBuf {
    std::fs::canonicalize(concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples")).unwrap()
}

fn net_dir() -> PathBuf {
    examples().join("point_450glifs")
}

fn components(cells: &Path) -> Value {
    json!({
        "point_neuron_models_dir": cells.to_str().unwrap(),
        "synaptic_models_dir": examples().join("point_components/synaptic_models").to_str().unwrap(),
    })
}

/// A simulation config with inline networks so that single files can be swapped.
fn config(
    dir: &Path,
    cells: &Path,
    v1v1_types: &Path,
    input: &Path,
    tstop: f64,
    overwrite: bool,
) -> PathBuf {
    let nd = net_dir().join("network");
    let s = |p: PathBuf| p.to_str().unwrap().to_string();
    let cfg = json!({
        "manifest": {"$OUT": dir.join("out").to_str().unwrap()},
        "run": {"tstop": tstop, "dt": 0.1},
        "target_simulator": "NEST",
        "components": components(cells),
        "networks": {
            "nodes": [
                {"nodes_file": s(nd.join("v1_nodes.h5")), "node_types_file": s(nd.join("v1_node_types.csv"))},
                {"nodes_file": s(nd.join("lgn_nodes.h5")), "node_types_file": s(nd.join("lgn_node_types.csv"))}
            ],
            "edges": [
                {"edges_file": s(nd.join("v1_v1_edges.h5")), "edge_types_file": v1v1_types.to_str().unwrap()},
                {"edges_file": s(nd.join("lgn_v1_edges.h5")), "edge_types_file": s(nd.join("lgn_v1_edge_types.csv"))}
            ]
        },
        "inputs": {"LGN_spikes": {"input_type": "spikes", "module": "sonata",
                                   "input_file": input.to_str().unwrap(), "node_set": "lgn"}},
        "output": {"log_file": "log.txt", "output_dir": "$OUT", "spikes_file": "spikes.h5",
                   "spikes_file_csv": "spikes.csv", "overwrite_output_dir": overwrite}
    });
    let path = dir.join("config.simulation.json");
    std::fs::write(&path, serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
    path
}

fn orig_cells() -> PathBuf {
    examples().join("point_components/cell_models")
}
fn orig_v1v1_types() -> PathBuf {
    net_dir().join("network/v1_v1_edge_types.csv")
}
fn orig_input() -> PathBuf {
    net_dir().join("inputs/lgn_spikes.h5")
}

fn no_leftovers(dir: &Path) {
    assert!(
        !dir.join("out").exists(),
        "a rejected run must not create output_dir"
    );
    for e in std::fs::read_dir(dir).unwrap() {
        let name = e.unwrap().file_name().to_string_lossy().to_string();
        assert!(
            !name.starts_with(".lockstep-simulate-"),
            "temporary folder {name} left behind"
        );
    }
}

#[test]
fn simulate_writes_nest_identical_spikes_and_respects_overwrite() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(
        tmp.path(),
        &orig_cells(),
        &orig_v1v1_types(),
        &orig_input(),
        200.0,
        false,
    );
    let summary = simulate_config(&cfg, &SimulateOptions::default()).unwrap();
    assert_eq!(summary.n_neurons, 450);
    assert_eq!(summary.n_steps, 2000);
    let ours = lockstep_sonata::read_spikes(&summary.spikes_file).unwrap();
    let ours = ours.get("v1").unwrap();
    let reference = lockstep_sonata::read_spikes(
        examples().join("point_450glifs/reference/nest_point450_dt0.1_t1000.spikes.h5"),
    )
    .unwrap();
    let r = reference.get("v1").unwrap();
    let n = r.timestamps.iter().filter(|&&t| t <= 200.0).count();
    assert!(n > 1000);
    assert_eq!(
        ours.node_ids,
        r.node_ids[..n].to_vec(),
        "node ids in time order"
    );
    assert_eq!(
        ours.timestamps,
        r.timestamps[..n].to_vec(),
        "timestamps bitwise equal to NEST's"
    );
    assert_eq!(summary.n_spikes, n);
    let csv = std::fs::read_to_string(summary.spikes_file_csv.as_ref().unwrap()).unwrap();
    let mut lines = csv.lines();
    assert_eq!(lines.next(), Some("timestamps population node_ids"));
    assert_eq!(lines.count(), n);
    assert!(tmp.path().join("out/log.txt").is_file());

    // Existing output_dir without overwrite: refused, old output untouched.
    let before = std::fs::read(&summary.spikes_file).unwrap();
    let e = simulate_config(&cfg, &SimulateOptions::default()).unwrap_err();
    assert!(matches!(e, SnnError::OutputExists { .. }), "{e}");
    assert!(e.to_string().contains("overwrite_output_dir"));
    assert_eq!(std::fs::read(&summary.spikes_file).unwrap(), before);

    // With overwrite: replaced.
    let cfg = config(
        tmp.path(),
        &orig_cells(),
        &orig_v1v1_types(),
        &orig_input(),
        100.0,
        true,
    );
    let s2 = simulate_config(&cfg, &SimulateOptions::default()).unwrap();
    assert_eq!(s2.n_steps, 1000);
    let again = lockstep_sonata::read_spikes(&s2.spikes_file).unwrap();
    assert!(again
        .get("v1")
        .unwrap()
        .timestamps
        .iter()
        .all(|&t| t <= 100.0));
}

#[test]
fn missing_input_file_is_rejected_and_writes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("no_such_spikes.h5");
    let cfg = config(
        tmp.path(),
        &orig_cells(),
        &orig_v1v1_types(),
        &missing,
        100.0,
        true,
    );
    let e = simulate_config(&cfg, &SimulateOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no_such_spikes.h5") && e.contains("does not exist"),
        "{e}"
    );
    no_leftovers(tmp.path());
}

#[test]
fn unsupported_model_is_rejected_and_writes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let cells = tmp.path().join("cells");
    std::fs::create_dir(&cells).unwrap();
    for e in std::fs::read_dir(orig_cells()).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), cells.join(e.file_name())).unwrap();
    }
    let f = cells.join("480124551_glif_lif_asc_psc.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&f).unwrap()).unwrap();
    v["spike_dependent_threshold"] = json!(true);
    std::fs::write(&f, v.to_string()).unwrap();
    let cfg = config(
        tmp.path(),
        &cells,
        &orig_v1v1_types(),
        &orig_input(),
        100.0,
        true,
    );
    let e = simulate_config(&cfg, &SimulateOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("101 (Rorb)")
            && e.contains("nest:glif_psc")
            && e.contains("spike_dependent_threshold"),
        "{e}"
    );
    no_leftovers(tmp.path());
}

#[test]
fn delay_shorter_than_dt_is_rejected_and_writes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(orig_v1v1_types()).unwrap();
    let mut out = String::new();
    for (i, line) in text.lines().enumerate() {
        if i > 0 && line.trim_end().ends_with(" 2.0") && line.contains("i2e.json") {
            out.push_str(&format!(
                "{} 0.05\n",
                line.trim_end().trim_end_matches("2.0").trim_end()
            ));
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    assert!(out.contains("0.05"));
    let types = tmp.path().join("v1_v1_edge_types.csv");
    std::fs::write(&types, out).unwrap();
    let cfg = config(
        tmp.path(),
        &orig_cells(),
        &types,
        &orig_input(),
        100.0,
        true,
    );
    let e = simulate_config(&cfg, &SimulateOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("0.05 ms is shorter than one time step"), "{e}");
    no_leftovers(tmp.path());
}

#[test]
fn poisson_inputs_are_seeded_and_bad_rates_write_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |seed: u64, rate: f64, name: &str| {
        let cfg_path = config(
            tmp.path(),
            &orig_cells(),
            &orig_v1v1_types(),
            &orig_input(),
            50.0,
            true,
        );
        let mut cfg: Value =
            serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
        cfg["run"]["seed"] = json!(seed);
        cfg["inputs"] = json!({"bg": {"input_type": "poisson", "rate": rate, "node_set": "lgn"}});
        cfg["manifest"]["$OUT"] = json!(tmp.path().join(name).to_str().unwrap());
        std::fs::write(&cfg_path, cfg.to_string()).unwrap();
        simulate_config(&cfg_path, &SimulateOptions::default())
    };
    let a = run(1, 40.0, "a").unwrap();
    let b = run(1, 40.0, "b").unwrap();
    let c = run(2, 40.0, "c").unwrap();
    let read =
        |s: &lockstep_snn::SimulationSummary| lockstep_sonata::read_spikes(&s.spikes_file).unwrap();
    assert!(a.n_spikes > 0);
    assert_eq!(read(&a), read(&b), "same seed, same spikes");
    assert_ne!(read(&a), read(&c), "another seed, other spikes");
    let e = run(1, -3.0, "d").unwrap_err().to_string();
    assert!(e.contains("-3"), "{e}");
    assert!(!tmp.path().join("d").exists());
}

#[test]
fn overwrite_never_deletes_a_folder_lockstep_did_not_write() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("analysis.ipynb"), "precious").unwrap();
    let cfg = config(
        dir.path(),
        &orig_cells(),
        &orig_v1v1_types(),
        &orig_input(),
        20.0,
        true,
    );
    let err = simulate_config(&cfg, &SimulateOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("was not written by lockstep"), "{err}");
    assert_eq!(
        std::fs::read_to_string(out.join("analysis.ipynb")).unwrap(),
        "precious"
    );
    // Our own output folder is replaced on the next run.
    std::fs::remove_file(out.join("analysis.ipynb")).unwrap();
    simulate_config(&cfg, &SimulateOptions::default()).unwrap();
    simulate_config(&cfg, &SimulateOptions::default()).unwrap();
    assert!(out.join("spikes.h5").exists());
}
