//! Empty populations are read the way libsonata reads them (issue 13, item 2): a node
//! population with 0 nodes (with or without a group), a node type without nodes, an edge
//! population with 0 edges (with or without a group), an edges file without populations, and
//! an edge population without groups whose values all come from the edge-types CSV. The
//! files are written with h5py (`make setup` installs it).

use lockstep_sonata::Circuit;
use lockstep_testkit::python_in;

const NETWORK: &str = r#"
def nodes(path, pops):
    with h5py.File(path, "w") as f:
        for pop, types, group in pops:
            g = f.create_group("nodes/" + pop)
            n = len(types)
            g.create_dataset("node_id", data=np.arange(n, dtype="u8"))
            g.create_dataset("node_type_id", data=np.array(types, dtype="u8"))
            g.create_dataset("node_group_id", data=np.zeros(n, "u4"))
            g.create_dataset("node_group_index", data=np.arange(n, dtype="u8"))
            if group:
                g.create_group("0")

def edges(path, pops):
    with h5py.File(path, "w") as f:
        f.create_group("edges")
        for pop, src, tgt, group in pops:
            g = f.create_group("edges/" + pop)
            n = len(src)
            g.create_dataset("source_node_id", data=np.array(src, "u8")).attrs["node_population"] = "v1"
            g.create_dataset("target_node_id", data=np.array(tgt, "u8")).attrs["node_population"] = "v1"
            g.create_dataset("edge_type_id", data=np.full(n, 7, "u4"))
            g.create_dataset("edge_group_id", data=np.zeros(n, "u2"))
            g.create_dataset("edge_group_index", data=np.arange(n, dtype="u4"))
            if group:
                g.create_dataset("0/syn_weight", data=np.full(n, 3.0))

nodes("nodes.h5", [("v1", [1, 1, 1], True), ("empty", [], True), ("bare", [], False)])
edges("edges.h5", [("zero", [], [], True), ("zero_bare", [], [], False), ("csv_only", [0, 1], [1, 2], False)])
edges("no_populations.h5", [])
open("node_types.csv", "w").write("node_type_id model_type model_template\n1 point_neuron nest:iaf_psc_alpha\n2 point_neuron nest:iaf_psc_alpha\n")
open("edge_types.csv", "w").write("edge_type_id model_template syn_weight delay\n7 static_synapse 2.5 1.0\n")
open("config.json", "w").write('''{"networks": {
  "nodes": [{"nodes_file": "nodes.h5", "node_types_file": "node_types.csv"}],
  "edges": [{"edges_file": "edges.h5", "edge_types_file": "edge_types.csv"},
            {"edges_file": "no_populations.h5", "edge_types_file": "edge_types.csv"}]}}''')
"#;

#[test]
fn empty_node_and_edge_populations_read_like_libsonata() {
    let dir = tempfile::tempdir().unwrap();
    python_in(dir.path(), NETWORK);
    let c = Circuit::from_config(dir.path().join("config.json")).unwrap();
    let names: Vec<&str> = c.nodes.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(
        names,
        ["bare", "empty", "v1"],
        "file order (HDF5 sorts names)"
    );
    let v1 = c.node_population("v1").unwrap();
    assert_eq!(v1.len(), 3);
    assert_eq!(v1.count_by_type(), [(1, 3)], "type 2 has no nodes");
    for pop in ["empty", "bare"] {
        let p = c.node_population(pop).unwrap();
        assert!(p.is_empty() && p.count_by_type().is_empty());
        assert_eq!(p.index_of(0), None);
    }
    let names: Vec<&str> = c.edges.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(
        names,
        ["csv_only", "zero", "zero_bare"],
        "no population from no_populations.h5"
    );
    for pop in ["zero", "zero_bare"] {
        let e = c.edge_population(pop).unwrap();
        assert!(e.is_empty() && e.weights().is_empty() && e.delay.is_empty());
        assert!(e.count_by_type().is_empty());
    }
    let csv = c.edge_population("csv_only").unwrap();
    assert_eq!(csv.weights(), [2.5, 2.5], "values from the edge-types CSV");
    assert_eq!(csv.delay, [1.0, 1.0]);
    assert_eq!(c.edges_into("v1").count(), 3);
}
