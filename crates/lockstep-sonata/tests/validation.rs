//! One test per validation error: each breaks a copy of the real network in a temp dir and
//! checks that reading fails (never panics) with a message naming the culprit.

use std::path::{Path, PathBuf};

use lockstep_sonata::{read_spikes, Circuit, SonataConfig, SonataErrorKind};

/// The repository's `examples/` folder: BMTK's `point_450glifs` network and `point_components`,
/// and NEST 3.10's reference output in `point_450glifs/reference/`.
fn examples() -> PathBuf {
    std::fs::canonicalize(concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples")).unwrap()
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let target = to.join(e.file_name());
        if matches!(e.file_name().to_str(), Some("runs" | "output")) {
            continue; // outputs of local runs of the example, not part of the network
        }
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), &target).unwrap();
        }
    }
}

/// A private copy of `point_450glifs` and `point_components`; returns (tempdir, network dir).
fn copy_network() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let bmtk = examples();
    copy_dir(
        &bmtk.join("point_450glifs"),
        &tmp.path().join("point_450glifs"),
    );
    copy_dir(
        &bmtk.join("point_components"),
        &tmp.path().join("point_components"),
    );
    let net = tmp.path().join("point_450glifs");
    (tmp, net)
}

/// Reads the copy and returns the error message (panics if reading succeeds).
fn read_err(net: &Path) -> (SonataErrorKind, String) {
    match Circuit::from_config(net.join("config.simulation.json")) {
        Ok(_) => panic!("reading the broken network succeeded"),
        Err(e) => {
            let msg = e.to_string();
            println!("error message: {msg}");
            (e.into_kind(), msg)
        }
    }
}

fn assert_names(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "message does not name '{p}':\n{msg}");
    }
}

fn edit_text(path: &Path, f: impl FnOnce(String) -> String) {
    let t = std::fs::read_to_string(path).unwrap();
    std::fs::write(path, f(t)).unwrap();
}

#[test]
fn intact_copy_reads() {
    let (_tmp, net) = copy_network();
    let c = Circuit::from_config(net.join("config.simulation.json")).unwrap();
    assert_eq!(c.nodes.len(), 2);
}

#[test]
fn missing_file() {
    let (_tmp, net) = copy_network();
    std::fs::remove_file(net.join("network/lgn_nodes.h5")).unwrap();
    let (kind, msg) = read_err(&net);
    assert!(matches!(kind, SonataErrorKind::Io { .. }), "{kind:?}");
    assert_names(
        &msg,
        &[
            "lgn_nodes.h5",
            "networks.nodes[1].nodes_file",
            "config.circuit.json",
        ],
    );

    let (_tmp, net) = copy_network();
    std::fs::remove_file(net.join("network/v1_v1_edge_types.csv")).unwrap();
    let (_, msg) = read_err(&net);
    assert_names(
        &msg,
        &["v1_v1_edge_types.csv", "networks.edges[0].edge_types_file"],
    );

    // the circuit config named by "network"
    let (_tmp, net) = copy_network();
    std::fs::remove_file(net.join("config.circuit.json")).unwrap();
    let (_, msg) = read_err(&net);
    assert_names(
        &msg,
        &[
            "config.circuit.json",
            "key 'network'",
            "config.simulation.json",
        ],
    );

    // the same, with a recipe of `lockstep build-network` beside the config: the network
    // has not been built yet, and the message says how to build it
    let (_tmp, net) = copy_network();
    std::fs::remove_file(net.join("config.circuit.json")).unwrap();
    std::fs::write(net.join("network_recipe.json"), "{}").unwrap();
    let (kind, msg) = read_err(&net);
    assert!(
        matches!(kind, SonataErrorKind::NetworkNotBuilt { .. }),
        "{kind:?}"
    );
    assert_names(
        &msg,
        &[
            "config.circuit.json",
            "key 'network'",
            "config.simulation.json",
            "lockstep build-network RECIPE --output",
            "network_recipe.json",
        ],
    );

    // a component JSON file
    let (_tmp, net) = copy_network();
    std::fs::remove_file(net.join("../point_components/synaptic_models/i2e.json")).unwrap();
    let (_, msg) = read_err(&net);
    assert_names(&msg, &["i2e.json", "edge type 102", "v1_v1_edge_types.csv"]);

    // the config itself
    let e = Circuit::from_config(net.join("nope.json"))
        .unwrap_err()
        .to_string();
    assert_names(&e, &["nope.json"]);
    // a spike file
    let e = read_spikes(net.join("inputs/nope.h5"))
        .unwrap_err()
        .to_string();
    assert_names(&e, &["nope.h5"]);
}

#[test]
fn missing_dataset() {
    let (_tmp, net) = copy_network();
    {
        let f = hdf5::File::open_rw(net.join("network/v1_nodes.h5")).unwrap();
        f.group("/nodes/v1")
            .unwrap()
            .unlink("node_type_id")
            .unwrap();
    }
    let (kind, msg) = read_err(&net);
    assert!(
        matches!(kind, SonataErrorKind::MissingDataset { .. }),
        "{kind:?}"
    );
    assert_names(&msg, &["v1_nodes.h5", "/nodes/v1/node_type_id"]);

    let (_tmp, net) = copy_network();
    {
        let f = hdf5::File::open_rw(net.join("network/lgn_v1_edges.h5")).unwrap();
        f.group("/edges/lgn_to_v1")
            .unwrap()
            .unlink("edge_group_index")
            .unwrap();
    }
    let (_, msg) = read_err(&net);
    assert_names(
        &msg,
        &["lgn_v1_edges.h5", "/edges/lgn_to_v1/edge_group_index"],
    );

    // the node_population attribute
    let (_tmp, net) = copy_network();
    {
        let f = hdf5::File::open_rw(net.join("network/v1_v1_edges.h5")).unwrap();
        let ds = f.dataset("/edges/v1_to_v1/source_node_id").unwrap();
        ds.delete_attr("node_population").unwrap();
    }
    let (_, msg) = read_err(&net);
    assert_names(
        &msg,
        &[
            "v1_v1_edges.h5",
            "/edges/v1_to_v1/source_node_id@node_population",
        ],
    );

    // a spike file without timestamps
    let (_tmp, net) = copy_network();
    let spikes = net.join("inputs/lgn_spikes.h5");
    {
        let f = hdf5::File::open_rw(&spikes).unwrap();
        f.group("/spikes/lgn")
            .unwrap()
            .unlink("timestamps")
            .unwrap();
    }
    let e = read_spikes(&spikes).unwrap_err().to_string();
    assert_names(&e, &["lgn_spikes.h5", "/spikes/lgn/timestamps"]);
}

#[test]
fn wrong_dtype() {
    let (_tmp, net) = copy_network();
    {
        let f = hdf5::File::open_rw(net.join("network/v1_v1_edges.h5")).unwrap();
        let g = f.group("/edges/v1_to_v1").unwrap();
        let old: Vec<u32> = g.dataset("edge_type_id").unwrap().read_raw().unwrap();
        g.unlink("edge_type_id").unwrap();
        let as_float: Vec<f64> = old.iter().map(|&x| x as f64).collect();
        g.new_dataset_builder()
            .with_data(&as_float[..])
            .create("edge_type_id")
            .unwrap();
    }
    let (kind, msg) = read_err(&net);
    assert!(
        matches!(kind, SonataErrorKind::WrongDtype { .. }),
        "{kind:?}"
    );
    assert_names(
        &msg,
        &[
            "v1_v1_edges.h5",
            "/edges/v1_to_v1/edge_type_id",
            "float64",
            "integer",
        ],
    );

    // a 2-D id dataset
    let (_tmp, net) = copy_network();
    {
        let f = hdf5::File::open_rw(net.join("network/lgn_nodes.h5")).unwrap();
        let g = f.group("/nodes/lgn").unwrap();
        g.unlink("node_id").unwrap();
        let ds = g
            .new_dataset::<u64>()
            .shape([50, 2])
            .create("node_id")
            .unwrap();
        ds.write_raw(&(0..100u64).collect::<Vec<_>>()).unwrap();
    }
    let (_, msg) = read_err(&net);
    assert_names(&msg, &["lgn_nodes.h5", "/nodes/lgn/node_id", "[50, 2]"]);

    // string timestamps in a spike file
    let (_tmp, net) = copy_network();
    let spikes = net.join("inputs/lgn_spikes.h5");
    {
        let f = hdf5::File::open_rw(&spikes).unwrap();
        let g = f.group("/spikes/lgn").unwrap();
        g.unlink("timestamps").unwrap();
        let s: Vec<hdf5::types::VarLenUnicode> =
            (0..3044).map(|_| "1.0".parse().unwrap()).collect();
        g.new_dataset_builder()
            .with_data(&s[..])
            .create("timestamps")
            .unwrap();
    }
    let e = read_spikes(&spikes).unwrap_err().to_string();
    assert_names(&e, &["lgn_spikes.h5", "/spikes/lgn/timestamps", "string"]);
}

#[test]
fn node_type_id_absent_from_csv() {
    let (_tmp, net) = copy_network();
    edit_text(&net.join("network/v1_node_types.csv"), |t| {
        t.lines()
            .filter(|l| !l.starts_with("106 "))
            .map(|l| format!("{l}\n"))
            .collect()
    });
    let (kind, msg) = read_err(&net);
    assert!(
        matches!(kind, SonataErrorKind::UnknownTypeId { id: 106, .. }),
        "{kind:?}"
    );
    assert_names(
        &msg,
        &[
            "node_type_id 106",
            "v1_node_types.csv",
            "v1_nodes.h5",
            "/nodes/v1/node_type_id",
        ],
    );
}

#[test]
fn edge_type_id_absent_from_csv() {
    let (_tmp, net) = copy_network();
    edit_text(&net.join("network/lgn_v1_edge_types.csv"), |t| {
        t.lines()
            .filter(|l| !l.starts_with("101 "))
            .map(|l| format!("{l}\n"))
            .collect()
    });
    let (kind, msg) = read_err(&net);
    assert!(
        matches!(kind, SonataErrorKind::UnknownTypeId { id: 101, .. }),
        "{kind:?}"
    );
    assert_names(
        &msg,
        &[
            "edge_type_id 101",
            "lgn_v1_edge_types.csv",
            "lgn_v1_edges.h5",
            "/edges/lgn_to_v1/edge_type_id",
        ],
    );
}

#[test]
fn edge_refers_to_missing_node() {
    let (_tmp, net) = copy_network();
    {
        let f = hdf5::File::open_rw(net.join("network/v1_v1_edges.h5")).unwrap();
        let ds = f.dataset("/edges/v1_to_v1/target_node_id").unwrap();
        let mut v: Vec<u64> = ds.read_raw().unwrap();
        v[7] = 450;
        ds.write_raw(&v).unwrap();
    }
    let (kind, msg) = read_err(&net);
    assert!(
        matches!(
            kind,
            SonataErrorKind::DanglingEdge {
                node_id: 450,
                edge: 7,
                ..
            }
        ),
        "{kind:?}"
    );
    assert_names(
        &msg,
        &[
            "v1_v1_edges.h5",
            "/edges/v1_to_v1/target_node_id",
            "edge 7",
            "node id 450",
            "'v1'",
        ],
    );

    // a source id in a virtual population
    let (_tmp, net) = copy_network();
    {
        let f = hdf5::File::open_rw(net.join("network/lgn_v1_edges.h5")).unwrap();
        let ds = f.dataset("/edges/lgn_to_v1/source_node_id").unwrap();
        let mut v: Vec<u64> = ds.read_raw().unwrap();
        v[36034] = 100;
        ds.write_raw(&v).unwrap();
    }
    let (_, msg) = read_err(&net);
    assert_names(
        &msg,
        &[
            "/edges/lgn_to_v1/source_node_id",
            "edge 36034",
            "node id 100",
            "'lgn'",
        ],
    );

    // a node population that does not exist
    let (_tmp, net) = copy_network();
    {
        let f = hdf5::File::open_rw(net.join("network/lgn_v1_edges.h5")).unwrap();
        let ds = f.dataset("/edges/lgn_to_v1/source_node_id").unwrap();
        ds.delete_attr("node_population").unwrap();
        let v: hdf5::types::VarLenUnicode = "retina".parse().unwrap();
        ds.new_attr::<hdf5::types::VarLenUnicode>()
            .create("node_population")
            .unwrap()
            .write_scalar(&v)
            .unwrap();
    }
    let (kind, msg) = read_err(&net);
    assert!(
        matches!(kind, SonataErrorKind::UnknownNodePopulation { .. }),
        "{kind:?}"
    );
    assert_names(&msg, &["'retina'", "lgn_v1_edges.h5", "v1, lgn"]);
}

#[test]
fn undefined_variable() {
    let (_tmp, net) = copy_network();
    edit_text(&net.join("config.circuit.json"), |t| {
        t.replacen("$NETWORK_DIR/lgn_nodes.h5", "$NETWROK_DIR/lgn_nodes.h5", 1)
    });
    let (kind, msg) = read_err(&net);
    assert!(
        matches!(kind, SonataErrorKind::UndefinedVariable { .. }),
        "{kind:?}"
    );
    assert_names(
        &msg,
        &[
            "$NETWROK_DIR",
            "networks.nodes[1].nodes_file",
            "config.circuit.json",
            "$NETWORK_DIR",
        ],
    );

    // inside the manifest itself, in the simulation config
    let (_tmp, net) = copy_network();
    edit_text(&net.join("config.simulation.json"), |t| {
        t.replacen("\"$BASE_DIR/inputs\"", "\"${BASE}/inputs\"", 1)
    });
    let (_, msg) = read_err(&net);
    assert_names(
        &msg,
        &["$BASE", "manifest.$INPUT_DIR", "config.simulation.json"],
    );
}

#[test]
fn duplicate_populations() {
    // the same nodes file listed twice
    let (_tmp, net) = copy_network();
    edit_text(&net.join("config.circuit.json"), |t| {
        t.replacen("$NETWORK_DIR/lgn_nodes.h5", "$NETWORK_DIR/v1_nodes.h5", 1)
            .replacen(
                "$NETWORK_DIR/lgn_node_types.csv",
                "$NETWORK_DIR/v1_node_types.csv",
                1,
            )
    });
    let (kind, msg) = read_err(&net);
    assert!(
        matches!(kind, SonataErrorKind::DuplicatePopulation { .. }),
        "{kind:?}"
    );
    assert_names(&msg, &["node population 'v1'", "v1_nodes.h5"]);

    // two different edges files with the same population
    let (_tmp, net) = copy_network();
    std::fs::copy(
        net.join("network/v1_v1_edges.h5"),
        net.join("network/v1_v1_edges_copy.h5"),
    )
    .unwrap();
    edit_text(&net.join("config.circuit.json"), |t| {
        t.replacen(
            "$NETWORK_DIR/lgn_v1_edges.h5",
            "$NETWORK_DIR/v1_v1_edges_copy.h5",
            1,
        )
    });
    let (_, msg) = read_err(&net);
    assert_names(
        &msg,
        &[
            "edge population 'v1_to_v1'",
            "v1_v1_edges.h5",
            "v1_v1_edges_copy.h5",
        ],
    );
}

#[test]
fn missing_syn_weight_and_bad_csv_values() {
    // neither the h5 group nor the CSV has a delay
    let (_tmp, net) = copy_network();
    edit_text(&net.join("network/lgn_v1_edge_types.csv"), |t| {
        t.lines()
            .map(|l| l.rsplit_once(' ').unwrap().0.to_string() + "\n")
            .collect()
    });
    let (kind, msg) = read_err(&net);
    assert!(
        matches!(kind, SonataErrorKind::MissingValue { .. }),
        "{kind:?}"
    );
    assert_names(
        &msg,
        &[
            "delay",
            "edge type 100",
            "lgn_v1_edge_types.csv",
            "lgn_to_v1",
        ],
    );

    // a syn_weight that is not a number
    let (_tmp, net) = copy_network();
    edit_text(&net.join("network/v1_v1_edge_types.csv"), |t| {
        t.replacen(" -6.5 ", " -6,5 ", 1)
    });
    let (_, msg) = read_err(&net);
    assert_names(&msg, &["syn_weight", "edge type 102", "'-6,5'"]);

    // a row with a missing field
    let (_tmp, net) = copy_network();
    edit_text(&net.join("network/v1_node_types.csv"), |t| {
        t.replacen(" Rorb ", " ", 1)
    });
    let (kind, msg) = read_err(&net);
    assert!(
        matches!(kind, SonataErrorKind::Csv { line: 3, .. }),
        "{kind:?}"
    );
    assert_names(&msg, &["v1_node_types.csv", "line 3", "6 fields"]);
}

#[test]
fn garbage_input_is_an_error_not_a_panic() {
    // a nodes file that is not HDF5
    let (_tmp, net) = copy_network();
    std::fs::write(net.join("network/v1_nodes.h5"), b"not an hdf5 file at all").unwrap();
    let (_, msg) = read_err(&net);
    assert_names(&msg, &["v1_nodes.h5"]);

    // a truncated edges file
    let (_tmp, net) = copy_network();
    let p = net.join("network/v1_v1_edges.h5");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() / 3]).unwrap();
    let (_, msg) = read_err(&net);
    assert_names(&msg, &["v1_v1_edges.h5"]);

    // a config that is not JSON, and one that is JSON of the wrong shape
    let (_tmp, net) = copy_network();
    edit_text(&net.join("config.circuit.json"), |t| t.replacen('}', "", 1));
    let (kind, msg) = read_err(&net);
    assert!(matches!(kind, SonataErrorKind::Json { .. }), "{kind:?}");
    assert_names(&msg, &["config.circuit.json", "line"]);
    let e = SonataConfig::from_value(
        serde_json::json!({"networks": {"nodes": [{"nodes_file": 3}]}}),
        "/x/c.json",
    )
    .unwrap_err()
    .to_string();
    assert_names(
        &e,
        &["networks.nodes[0].nodes_file", "must be a path string", "3"],
    );
    let e = SonataConfig::from_value(
        serde_json::json!({"networks": {"edges": [{}]}}),
        "/x/c.json",
    )
    .unwrap_err()
    .to_string();
    assert_names(&e, &["networks.edges[0].edges_file", "missing"]);

    // a spikes file that is a nodes file
    let e = read_spikes(net.join("network/lgn_nodes.h5"))
        .unwrap_err()
        .to_string();
    assert_names(&e, &["lgn_nodes.h5", "/spikes"]);

    // group index out of range
    let (_tmp, net) = copy_network();
    {
        let f = hdf5::File::open_rw(net.join("network/v1_nodes.h5")).unwrap();
        let ds = f.dataset("/nodes/v1/node_group_index").unwrap();
        let mut v: Vec<u64> = ds.read_raw().unwrap();
        v[449] = 150;
        ds.write_raw(&v).unwrap();
    }
    let (_, msg) = read_err(&net);
    assert_names(
        &msg,
        &[
            "/nodes/v1/node_group_index",
            "row 449",
            "index 150",
            "group 1",
            "150 rows",
        ],
    );
}
