//! Empty populations, as libsonata reads them (issue 13, item 2 and its kind): an edge
//! population with 0 edges (with or without a group), an edges file without populations, a
//! node type with 0 nodes, a node population with 0 nodes (with or without a group). `simulate`
//! runs each; `train` trains when something is left to train and otherwise stops with the
//! engine's message, once, also under `mpirun -n 2` (no MPI abort). An input that drives a
//! population without nodes is refused with a true statement. Never a panic.
//!
//! The files are written with h5py (`make setup` installs it), from the bundled
//! `examples/glif_all2all` network.

use lockstep_comm::launch::{mpirun_command, run_with_limit};
use lockstep_testkit::python_in;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

const LOCKSTEP: &str = env!("CARGO_BIN_EXE_lockstep");
const NO_PARAMETERS: &str = "the model has no trainable parameters";

fn example() -> PathBuf {
    std::fs::canonicalize(concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples")).unwrap()
}

/// h5py helpers: an edge population with 0 edges, a node population with 0 nodes.
const HELPERS: &str = r#"
def empty_edges(path, pop, src, tgt, group=True):
    with h5py.File(path, "w") as f:
        g = f.create_group("edges/" + pop)
        g.create_dataset("source_node_id", (0,), "u8").attrs["node_population"] = src
        g.create_dataset("target_node_id", (0,), "u8").attrs["node_population"] = tgt
        for ds, t in [("edge_type_id", "u4"), ("edge_group_id", "u2"), ("edge_group_index", "u4")]:
            g.create_dataset(ds, (0,), t)
        if group:
            g.create_dataset("0/syn_weight", (0,), "f8")

def empty_nodes(path, pop, group=True):
    with h5py.File(path, "w") as f:
        g = f.create_group("nodes/" + pop)
        for ds, t in [("node_id", "u8"), ("node_type_id", "u8"), ("node_group_id", "u4"), ("node_group_index", "u8")]:
            g.create_dataset(ds, (0,), t)
        if group:
            g.create_group("0")
"#;

/// A copy of the bundled network in `dir/network`, changed by `script` (run there), and a
/// simulation and a training config; `extra_nodes` adds `extra_nodes.h5` to the networks.
fn network(dir: &Path, script: &str, extra_nodes: bool) -> (PathBuf, PathBuf) {
    let ex = example();
    let net = dir.join("network");
    std::fs::create_dir_all(&net).unwrap();
    for e in std::fs::read_dir(ex.join("glif_all2all/network")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), net.join(e.file_name())).unwrap();
    }
    python_in(&net, &format!("{HELPERS}\n{script}"));
    let mut nodes = vec![
        serde_json::json!({"nodes_file": "network/v1_nodes.h5", "node_types_file": "network/v1_node_types.csv"}),
        serde_json::json!({"nodes_file": "network/lgn_nodes.h5", "node_types_file": "network/lgn_node_types.csv"}),
    ];
    if extra_nodes {
        nodes.push(serde_json::json!({"nodes_file": "network/extra_nodes.h5", "node_types_file": "network/v1_node_types.csv"}));
    }
    let common = serde_json::json!({
        "components": {
            "point_neuron_models_dir": ex.join("point_components/cell_models"),
            "synaptic_models_dir": ex.join("point_components/synaptic_models")
        },
        "networks": {
            "nodes": nodes,
            "edges": [
                {"edges_file": "network/v1_v1_edges.h5", "edge_types_file": "network/v1_v1_edge_types.csv"},
                {"edges_file": "network/lgn_v1_edges.h5", "edge_types_file": "network/lgn_v1_edge_types.csv"}
            ]
        },
        "inputs": {"lgn": {"input_type": "poisson", "rate": 20.0, "node_set": "lgn"}}
    });
    let mut sim = common.clone();
    sim["run"] = serde_json::json!({"tstop": 60.0, "dt": 0.1, "seed": 1});
    sim["output"] = serde_json::json!({"output_dir": "sim", "spikes_file": "spikes.h5"});
    let mut train = common;
    train["run"] = serde_json::json!({"dt": 1.0, "seq_len": 20, "batch_size": 2, "seed": 1});
    train["training"] = serde_json::json!({
        "optimizer": {"name": "adam", "learning_rate": 0.01},
        "optimizer_updates": 1,
        "losses": [{"name": "TargetFiringRate", "firing_rate": 10.0}]
    });
    train["output"] = serde_json::json!({"output_dir": "run"});
    let s = dir.join("config.simulate.json");
    let t = dir.join("config.train.json");
    std::fs::write(&s, sim.to_string()).unwrap();
    std::fs::write(&t, train.to_string()).unwrap();
    (s, t)
}

fn lockstep(args: &[&std::ffi::OsStr]) -> Output {
    Command::new(LOCKSTEP).args(args).output().unwrap()
}

/// Runs `lockstep simulate` and returns its stdout; fails on a non-zero exit.
fn simulate_ok(config: &Path) -> String {
    let out = lockstep(&["simulate".as_ref(), config.as_os_str()]);
    let (o, e) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "simulate failed:\n{o}\n{e}");
    o.into_owned()
}

/// Runs `lockstep train` serially and returns (success, stdout + stderr); never a panic.
fn train(config: &Path) -> (bool, String) {
    let out = lockstep(&["train".as_ref(), config.as_os_str()]);
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!all.contains("panicked"), "{all}");
    (out.status.success(), all)
}

/// The row of the rate table for `group` `name` (cells, spikes).
fn rate_row(table: &str, group: &str, name: &str) -> Option<(u64, u64)> {
    table.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.len() >= 5 && f[0] == group && f[1] == name).then(|| {
            (
                f[f.len() - 3].parse().unwrap(),
                f[f.len() - 2].parse().unwrap(),
            )
        })
    })
}

#[test]
fn recurrent_edge_population_with_zero_edges() {
    for group in ["True", "False"] {
        let tmp = tempfile::tempdir().unwrap();
        let (sim, cfg) = network(
            tmp.path(),
            &format!("empty_edges('v1_v1_edges.h5', 'v1_to_v1', 'v1', 'v1', group={group})"),
            false,
        );
        let table = simulate_ok(&sim);
        let (cells, spikes) = rate_row(&table, "population", "v1").expect(&table);
        assert_eq!(cells, 300, "{table}");
        assert!(spikes > 0, "the input still drives v1: {table}");
        let (ok, all) = train(&cfg);
        assert!(!ok && all.contains(NO_PARAMETERS), "{all}");
        assert_eq!(all.matches(NO_PARAMETERS).count(), 1, "{all}");
    }
}

#[test]
fn edges_file_without_populations() {
    let tmp = tempfile::tempdir().unwrap();
    let (sim, cfg) = network(
        tmp.path(),
        "h5py.File('v1_v1_edges.h5', 'w').create_group('edges')",
        false,
    );
    let table = simulate_ok(&sim);
    assert_eq!(rate_row(&table, "population", "v1").unwrap().0, 300);
    let (ok, all) = train(&cfg);
    assert!(!ok && all.contains(NO_PARAMETERS), "{all}");
}

#[test]
fn node_type_without_nodes_and_node_populations_without_nodes() {
    // Every v1 cell of type 100 (type 101 has no nodes); an extra population with 0 nodes
    // of a node-types file with rows, with and without a group.
    for group in ["True", "False"] {
        let tmp = tempfile::tempdir().unwrap();
        let (sim, cfg) = network(
            tmp.path(),
            &format!(
                "with h5py.File('v1_nodes.h5', 'a') as f: f['nodes/v1/node_type_id'][...] = 100\n\
                 empty_nodes('extra_nodes.h5', 'extra', group={group})"
            ),
            true,
        );
        let table = simulate_ok(&sim);
        assert!(table.contains("(Scnn1a)"), "{table}");
        assert!(
            !table.contains("(PV1)"),
            "a type without cells has no rate: {table}"
        );
        assert_eq!(rate_row(&table, "population", "v1").unwrap().0, 300);
        let out = tmp.path().join("sim/spikes.h5");
        assert!(out.is_file(), "{table}");
        let (ok, all) = train(&cfg);
        assert!(ok, "the recurrent weights are still there to train: {all}");
        assert!(all.contains("Completed 1 optimizer update"), "{all}");
    }
}

#[test]
fn input_population_without_nodes_is_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let (sim, cfg) = network(
        tmp.path(),
        "empty_nodes('lgn_nodes.h5', 'lgn')\nempty_edges('lgn_v1_edges.h5', 'lgn_to_v1', 'lgn', 'v1')",
        false,
    );
    let out = lockstep(&["simulate".as_ref(), sim.as_os_str()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("inputs.lgn.node_set"), "{err}");
    assert!(err.contains("'lgn' has no virtual nodes"), "{err}");
    assert!(err.contains("the network has none"), "{err}");
    let (ok, all) = train(&cfg);
    assert!(!ok && all.contains("'lgn' has no virtual nodes"), "{all}");
}

#[test]
fn network_without_any_nodes_simulates_and_is_refused_for_training() {
    let tmp = tempfile::tempdir().unwrap();
    let (sim, cfg) = network(
        tmp.path(),
        "empty_nodes('v1_nodes.h5', 'v1')\n\
         empty_edges('v1_v1_edges.h5', 'v1_to_v1', 'v1', 'v1')\n\
         empty_edges('lgn_v1_edges.h5', 'lgn_to_v1', 'lgn', 'v1')",
        false,
    );
    let table = simulate_ok(&sim);
    assert_eq!(rate_row(&table, "all", "all"), Some((0, 0)), "{table}");
    let (ok, all) = train(&cfg);
    assert!(!ok, "{all}");
    assert!(all.contains("no (non-virtual) neurons to train"), "{all}");
}

#[test]
fn mpi_training_with_an_empty_recurrent_population_stops_once_without_abort() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, cfg) = network(
        tmp.path(),
        "empty_edges('v1_v1_edges.h5', 'v1_to_v1', 'v1', 'v1')",
        false,
    );
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    json["run"]["distribution"] = serde_json::json!({"strategy": "mpi", "global_batch_size": 4});
    std::fs::write(&cfg, json.to_string()).unwrap();
    let mut cmd = mpirun_command(2);
    cmd.arg(LOCKSTEP).arg("train").arg(&cfg);
    let out = run_with_limit(cmd, Duration::from_secs(60)).unwrap();
    let all = out.all_output();
    assert!(!out.success(), "{all}");
    assert_eq!(all.matches(NO_PARAMETERS).count(), 1, "{all}");
    assert!(
        !all.contains("MPI_ABORT") && !all.contains("panicked"),
        "{all}"
    );
}
