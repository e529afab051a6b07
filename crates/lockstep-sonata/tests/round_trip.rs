//! Round trips: read the real network, write it with this crate, read it back; compare with
//! the BMTK originals (also through h5py, which these tests require).

use std::path::{Path, PathBuf};

use lockstep_sonata::{
    build_edge_index, read_edge_parts, read_edges, read_node_parts, read_spikes,
    rewrite_syn_weights, write_edges, write_nodes, write_spikes, Circuit, ComponentStore,
    EdgesView, NodesView, PopulationSpikes, SonataConfig, SpikeSorting, SpikeTrains,
    LEGACY_POPULATION,
};
use lockstep_testkit::python;

/// The tests of this file run one at a time: a python3 child spawned by one test would
/// inherit the descriptor (and the HDF5 file lock) of a file another thread is writing.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The repository's `examples/` folder: BMTK's `point_450glifs` network and `point_components`,
/// and NEST 3.10's reference output in `point_450glifs/reference/`.
fn examples() -> PathBuf {
    std::fs::canonicalize(concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples")).unwrap()
}

fn net_dir() -> PathBuf {
    examples().join("point_450glifs")
}

fn circuit() -> Circuit {
    Circuit::from_config(net_dir().join("config.simulation.json")).unwrap()
}

/// Writes every population of `c` (nodes, edges and types CSVs) into `dir` plus a circuit
/// config using the shared components; returns the config path.
fn write_copy(c: &Circuit, dir: &Path) -> PathBuf {
    let net = dir.join("network");
    std::fs::create_dir_all(&net).unwrap();
    let mut nodes_json = Vec::new();
    for (file, pops) in [("v1", vec!["v1"]), ("lgn", vec!["lgn"])] {
        let views: Vec<NodesView> = pops
            .iter()
            .map(|p| c.node_population(p).unwrap().into())
            .collect();
        write_nodes(net.join(format!("{file}_nodes.h5")), &views).unwrap();
        c.node_population(pops[0])
            .unwrap()
            .types
            .table
            .write(&net.join(format!("{file}_node_types.csv")))
            .unwrap();
        nodes_json.push(serde_json::json!({
            "nodes_file": format!("$NET/{file}_nodes.h5"),
            "node_types_file": format!("$NET/{file}_node_types.csv"),
        }));
    }
    let mut edges_json = Vec::new();
    for (file, pop) in [("v1_v1", "v1_to_v1"), ("lgn_v1", "lgn_to_v1")] {
        let e = c.edge_population(pop).unwrap();
        write_edges(net.join(format!("{file}_edges.h5")), &[EdgesView::from(e)]).unwrap();
        e.types
            .table
            .write(&net.join(format!("{file}_edge_types.csv")))
            .unwrap();
        edges_json.push(serde_json::json!({
            "edges_file": format!("$NET/{file}_edges.h5"),
            "edge_types_file": format!("$NET/{file}_edge_types.csv"),
        }));
    }
    let comps = examples().join("point_components");
    let cfg = serde_json::json!({
        "manifest": {"$BASE": "${configdir}", "$NET": "$BASE/network", "$COMP": comps.to_str().unwrap()},
        "components": {
            "point_neuron_models_dir": "$COMP/cell_models",
            "synaptic_models_dir": "$COMP/synaptic_models"
        },
        "networks": {"nodes": nodes_json, "edges": edges_json}
    });
    let path = dir.join("config.circuit.json");
    std::fs::write(&path, serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
    path
}

#[test]
fn read_write_read_gives_identical_columns() {
    let _serial = serial();
    let a = circuit();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_copy(&a, dir.path());
    let b = Circuit::from_config(&cfg).unwrap();
    assert_eq!(a.nodes.len(), b.nodes.len());
    for (x, y) in a.nodes.iter().zip(&b.nodes) {
        assert_eq!(x.name, y.name);
        assert_eq!(x.is_virtual, y.is_virtual);
        assert_eq!(x.parts(), y.parts(), "population {}", x.name);
        assert_eq!(x.types.table.columns, y.types.table.columns);
        assert_eq!(x.types.table.rows, y.types.table.rows);
        assert_eq!(x.type_row, y.type_row);
        for i in 0..x.len() {
            assert_eq!(x.dynamics_params(i), y.dynamics_params(i));
        }
    }
    assert_eq!(a.edges.len(), b.edges.len());
    for (x, y) in a.edges.iter().zip(&b.edges) {
        assert_eq!(x.parts(), y.parts(), "population {}", x.name);
        assert_eq!(x.syn_weight, y.syn_weight);
        assert_eq!(x.nsyns, y.nsyns);
        assert_eq!(x.delay, y.delay);
        assert_eq!(x.synapse_index, y.synapse_index);
        assert_eq!(x.types.synapses, y.types.synapses);
        assert_eq!(x.types.table.rows, y.types.table.rows);
    }
}

/// The edge rows node `n` owns according to a BMTK index (`node_id_to_range`,
/// `range_to_edge_id`, flattened `[rows * 2]`), sorted.
fn edges_of(n2r: &[u64], r2e: &[u64], n: usize) -> Vec<u64> {
    let mut out = Vec::new();
    if 2 * n + 1 < n2r.len() {
        for r in n2r[2 * n]..n2r[2 * n + 1] {
            out.extend(r2e[2 * r as usize]..r2e[2 * r as usize + 1]);
        }
    }
    out.sort_unstable();
    out
}

#[test]
fn written_index_equals_bmtk_index() {
    let _serial = serial();
    for (file, pop) in [
        ("v1_v1_edges.h5", "v1_to_v1"),
        ("lgn_v1_edges.h5", "lgn_to_v1"),
    ] {
        let path = net_dir().join("network").join(file);
        let parts = read_edge_parts(&path).unwrap();
        let p = &parts[0];
        let f = hdf5::File::open(&path).unwrap();
        for (name, ids) in [
            ("source_to_target", &p.source_node_id),
            ("target_to_source", &p.target_node_id),
        ] {
            let g = f.group(&format!("/edges/{pop}/indices/{name}")).unwrap();
            let n2r: Vec<u64> = g.dataset("node_id_to_range").unwrap().read_raw().unwrap();
            let r2e: Vec<u64> = g.dataset("range_to_edge_id").unwrap().read_raw().unwrap();
            let (my_n2r, my_r2e) = build_edge_index(ids);
            assert_eq!(
                my_n2r.len(),
                n2r.len(),
                "{file} {name} node_id_to_range rows"
            );
            assert_eq!(
                my_r2e.len(),
                r2e.len(),
                "{file} {name} range_to_edge_id rows"
            );
            // every node owns exactly the same edges (BMTK's order of a node's ranges depends
            // on the order the builder created the edges in, which the file does not record)
            for n in 0..n2r.len() / 2 {
                let theirs = edges_of(&n2r, &r2e, n);
                assert_eq!(
                    edges_of(&my_n2r, &my_r2e, n),
                    theirs,
                    "{file} {name} node {n}"
                );
                assert!(theirs.iter().all(|&e| ids[e as usize] == n as u64));
            }
            // the edges are sorted by target, so that index is reproduced bit for bit
            if name == "target_to_source" {
                assert_eq!(my_n2r, n2r, "{file} {name}");
                assert_eq!(my_r2e, r2e, "{file} {name}");
            }
        }
    }
}

#[test]
fn spikes_round_trip_and_legacy_layout() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let input = read_spikes(net_dir().join("inputs/lgn_spikes.h5")).unwrap();
    let mut sorted = input.populations[0].clone();
    sorted.sort_by_time();
    assert!(sorted.timestamps.windows(2).all(|w| w[0] <= w[1]));
    let trains = SpikeTrains {
        populations: vec![
            input.populations[0].clone(),
            PopulationSpikes {
                population: "v1".into(),
                node_ids: vec![3, 1, 449],
                timestamps: vec![0.1, 0.2, 999.9],
                sorting: SpikeSorting::ByTime,
            },
        ],
    };
    let p = dir.path().join("spikes.h5");
    write_spikes(&p, &trains).unwrap();
    let back = read_spikes(&p).unwrap();
    let mut expect = trains.clone();
    expect
        .populations
        .sort_by(|a, b| a.population.cmp(&b.population));
    assert_eq!(back, expect);
    assert_eq!(back.total(), 3044 + 3);

    // the older single-population layout: /spikes/gids + /spikes/timestamps
    let legacy = dir.path().join("legacy.h5");
    {
        let f = hdf5::File::create(&legacy).unwrap();
        let g = f.create_group("spikes").unwrap();
        let sorting: hdf5::types::VarLenUnicode = "by_id".parse().unwrap();
        g.new_attr::<hdf5::types::VarLenUnicode>()
            .create("sorting")
            .unwrap()
            .write_scalar(&sorting)
            .unwrap();
        g.new_dataset_builder()
            .with_data(&[1u32, 1, 2][..])
            .create("gids")
            .unwrap();
        g.new_dataset_builder()
            .with_data(&[5.0f64, 7.5, 1.0][..])
            .create("timestamps")
            .unwrap();
    }
    let l = read_spikes(&legacy).unwrap();
    assert_eq!(l.populations.len(), 1);
    let only = l.get("anything").unwrap();
    assert_eq!(only.population, LEGACY_POPULATION);
    assert_eq!(only.node_ids, [1, 1, 2]);
    assert_eq!(only.timestamps, [5.0, 7.5, 1.0]);
    assert_eq!(only.sorting, SpikeSorting::ById);
}

/// Python that prints one line per object: path, kind, dtype, shape, maxshape, chunks,
/// attributes (name, value, dtype, string-type details) — the layout fingerprint of a file.
const FINGERPRINT: &str = r#"
import h5py, sys
def attrs(o):
    out = []
    for k in sorted(o.attrs):
        a = o.attrs.get_id(k); t = a.get_type()
        kind = ('vlen-str' if t.is_variable_str() else 'str%d' % t.get_size()) if isinstance(t, h5py.h5t.TypeStringID) else str(a.dtype)
        cset = t.get_cset() if isinstance(t, h5py.h5t.TypeStringID) else ''
        v = o.attrs[k]
        out.append((k, kind, cset, a.shape, v.tolist() if hasattr(v, 'tolist') else v))
    return out
def fp(path):
    f = h5py.File(path, 'r')
    lines = ['/ ' + repr(attrs(f))]
    def visit(name, o):
        if isinstance(o, h5py.Dataset):
            lines.append('%s D %s %s %s %s %s %s' % (name, o.dtype, o.shape, o.maxshape, o.chunks, o.compression, attrs(o)))
        else:
            lines.append('%s G %s' % (name, attrs(o)))
    f.visititems(visit)
    return lines
"#;

#[test]
fn written_files_have_bmtk_layout_in_h5py() {
    let _serial = serial();
    let a = circuit();
    let dir = tempfile::tempdir().unwrap();
    write_copy(&a, dir.path());
    let net = net_dir().join("network");
    for f in [
        "v1_nodes.h5",
        "lgn_nodes.h5",
        "v1_v1_edges.h5",
        "lgn_v1_edges.h5",
    ] {
        let script = format!(
            "{FINGERPRINT}\na = fp({:?}); b = fp({:?})\nimport difflib\nd = list(difflib.unified_diff(a, b, lineterm=''))\nprint('\\n'.join(d))\nprint('LINES', len(a))",
            net.join(f).to_str().unwrap(),
            dir.path().join("network").join(f).to_str().unwrap()
        );
        let out = python(&script, &[]);
        let diff: Vec<&str> = out.lines().filter(|l| !l.starts_with("LINES")).collect();
        assert!(
            diff.iter().all(|l| l.trim().is_empty()),
            "{f}: layout differs from BMTK's:\n{out}"
        );
        assert!(out.contains("LINES"), "{out}");
    }
}

#[test]
fn rewritten_syn_weights_open_in_h5py_with_ids_unchanged() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let src = net_dir().join("network/v1_v1_edges.h5");
    let dst = dir.path().join("trained_v1_v1_edges.h5");
    let c = circuit();
    let rec = c.edge_population("v1_to_v1").unwrap();
    // "trained" weights: a deterministic perturbation, sign kept
    let new: Vec<f64> = rec
        .syn_weight
        .iter()
        .enumerate()
        .map(|(i, w)| w * (1.0 + (i % 7) as f64 * 0.01))
        .collect();
    rewrite_syn_weights(&src, &dst, "v1_to_v1", &new).unwrap();

    // read back with this crate: syn_weight now comes from the h5 group and wins over the CSV
    let comps = lockstep_sonata::SonataConfig::from_file(net_dir().join("config.circuit.json"))
        .unwrap()
        .components;
    let mut store = ComponentStore::new();
    let back = read_edges(
        &dst,
        &net_dir().join("network/v1_v1_edge_types.csv"),
        &comps,
        &mut store,
    )
    .unwrap();
    assert_eq!(back[0].syn_weight, new);
    assert_eq!(back[0].parts().source_node_id, rec.source_node_id);
    assert_eq!(back[0].nsyns, rec.nsyns);
    assert_eq!(back[0].edge_type_id, rec.edge_type_id);
    // the original is untouched
    assert_eq!(read_edge_parts(&src).unwrap()[0].groups[0].columns.len(), 1);

    let script = format!(
        r#"
import h5py, numpy as np
a = h5py.File({src:?}, 'r')['/edges/v1_to_v1']
b = h5py.File({dst:?}, 'r')['/edges/v1_to_v1']
for k in ['source_node_id', 'target_node_id', 'edge_type_id', 'edge_group_id', 'edge_group_index', '0/nsyns',
          'indices/source_to_target/node_id_to_range', 'indices/source_to_target/range_to_edge_id',
          'indices/target_to_source/node_id_to_range', 'indices/target_to_source/range_to_edge_id']:
    assert a[k].dtype == b[k].dtype, k
    assert np.array_equal(a[k][:], b[k][:]), k
for k in ['source_node_id', 'target_node_id']:
    assert b[k].attrs['node_population'] == a[k].attrs['node_population'], k
w = b['0/syn_weight'][:]
print('N', len(w), 'DTYPE', w.dtype, 'W0', repr(float(w[0])), 'W6', repr(float(w[6])), 'W28554', repr(float(w[28554])))
"#,
        src = src.to_str().unwrap(),
        dst = dst.to_str().unwrap()
    );
    let out = python(&script, &[]);
    let expect = format!(
        "N 28555 DTYPE float64 W0 {:?} W6 {:?} W28554 {:?}",
        new[0], new[6], new[28554]
    );
    assert_eq!(out.trim(), expect);

    // rewriting again in place overwrites the dataset created the first time
    let again: Vec<f64> = new.iter().map(|w| w * 0.5).collect();
    rewrite_syn_weights(&dst, &dst, "v1_to_v1", &again).unwrap();
    let back = read_edge_parts(&dst).unwrap();
    let col = back[0].groups[0].column("syn_weight").unwrap();
    assert_eq!(col.data.to_f64().unwrap(), again);
}

#[test]
fn config_from_value_matches_file() {
    let _serial = serial();
    let path = net_dir().join("config.circuit.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let a = SonataConfig::from_value(v, &path).unwrap();
    let b = SonataConfig::from_file(&path).unwrap();
    assert_eq!(a, b);
    let parts = read_node_parts(&net_dir().join("network/v1_nodes.h5")).unwrap();
    assert_eq!(parts[0].node_id.len(), 450);
}
