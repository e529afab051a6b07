//! What lockstep-sonata writes, libsonata (the SONATA reference reader, `make setup` installs
//! its wheel) reads: spike files with the spec's `sorting` enum, every spike; edge files whose
//! index queries (`afferent_edges`, `efferent_edges`, `connecting_edges`) give the edges the
//! ids say, written by [`write_edges`] and exported by [`rewrite_syn_weights`] from a file
//! that has BMTK's index name only. lockstep reads either index name and both forms of
//! `sorting`. A missing libsonata fails these tests (it never skips them).

use std::path::Path;

use lockstep_sonata::{
    read_edge_index, read_spikes, rewrite_syn_weights, write_edges, write_spikes, Column,
    ColumnData, EdgeIndexDirection, EdgesView, PopulationGroup, PopulationSpikes, SpikeSorting,
    SpikeTrains,
};
use lockstep_testkit::{python, require_libsonata};

/// Runs `script` with `sys.argv[1]` = `dir`, libsonata, h5py and numpy imported; returns its
/// output.
fn libsonata(dir: &Path, script: &str) -> String {
    require_libsonata();
    python(
        &format!("import sys, json, libsonata, h5py, numpy as np\nd = sys.argv[1]\n{script}"),
        &[dir.as_os_str()],
    )
}

#[test]
fn libsonata_reads_every_spike_and_the_sorting_enum() {
    let dir = tempfile::tempdir().unwrap();
    let pop = |name: &str, ids: &[u64], t: &[f64]| PopulationSpikes {
        population: name.into(),
        node_ids: ids.to_vec(),
        timestamps: t.to_vec(),
        sorting: SpikeSorting::None,
    };
    let mut by_time = pop("v1", &[3, 0, 3, 1, 2], &[4.5, 0.1, 1.25, 7.0, 0.1]);
    by_time.sort_by_time();
    let mut by_id = pop("lgn", &[5, 1, 5, 0], &[2.0, 3.0, 1.0, 9.5]);
    by_id.sort_by_id();
    let none = pop("other", &[2, 0, 1], &[9.0, 1.0, 5.0]);
    let empty = PopulationSpikes {
        sorting: SpikeSorting::ByTime,
        ..pop("silent", &[], &[])
    };
    let trains = SpikeTrains {
        populations: vec![by_time, by_id, none, empty],
    };
    write_spikes(dir.path().join("spikes.h5"), &trains).unwrap();
    // lockstep reads its enum back (populations in HDF5's name order).
    let mut back = read_spikes(dir.path().join("spikes.h5")).unwrap();
    back.populations
        .sort_by(|a, b| a.population.cmp(&b.population));
    let mut want = trains.clone();
    want.populations
        .sort_by(|a, b| a.population.cmp(&b.population));
    assert_eq!(back, want);

    let expect: serde_json::Value = trains
        .populations
        .iter()
        .map(|p| {
            (
                p.population.clone(),
                serde_json::json!({"sorting": p.sorting.as_str(),
                    "spikes": p.node_ids.iter().zip(&p.timestamps).collect::<Vec<_>>()}),
            )
        })
        .collect::<serde_json::Map<_, _>>()
        .into();
    std::fs::write(dir.path().join("expect.json"), expect.to_string()).unwrap();
    let out = libsonata(
        dir.path(),
        r#"
e = json.load(open(d + "/expect.json"))
r = libsonata.SpikeReader(d + "/spikes.h5")
assert sorted(r.get_population_names()) == sorted(e), r.get_population_names()
for name, want in e.items():
    p = r[name]
    assert p.sorting == want["sorting"], (name, p.sorting)
    assert p.time_units == "ms", p.time_units
    got = [(int(i), float(t)) for i, t in p.get()]
    assert got == [(i, t) for i, t in want["spikes"]], (name, got)
with h5py.File(d + "/spikes.h5", "r") as f:
    a = f["spikes/v1"].attrs.get_id("sorting")
    assert a.get_type().get_class() == h5py.h5t.ENUM and a.get_type().get_size() == 1
    assert h5py.check_enum_dtype(a.dtype) == {"none": 0, "by_id": 1, "by_time": 2}, a.dtype
# Other writers' forms: an int8-based enum (libsonata's own type), a plain uint8, a string.
for name, value, dtype in [
    ("enum_i8", 1, h5py.enum_dtype({"by_time": 2, "none": 0, "by_id": 1}, basetype="i1")),
    ("plain_u8", 2, np.uint8),
    ("string", "by_id", None),
]:
    with h5py.File(d + "/" + name + ".h5", "w") as f:
        g = f.create_group("spikes/v1")
        g.attrs.create("sorting", value, dtype=dtype)
        g["node_ids"] = np.array([0, 1], dtype=np.uint64)
        g["timestamps"] = np.array([1.0, 2.0])
print("ok")
"#,
    );
    assert_eq!(out.trim(), "ok");
    for (name, sorting) in [
        ("enum_i8", SpikeSorting::ById),
        ("plain_u8", SpikeSorting::ByTime),
        ("string", SpikeSorting::ById),
    ] {
        let s = read_spikes(dir.path().join(format!("{name}.h5"))).unwrap();
        assert_eq!(s.populations[0].sorting, sorting, "{name}");
    }
}

/// An edge population with several runs per node and a node (4) without edges.
fn edges(dir: &Path) -> std::path::PathBuf {
    let source: Vec<u64> = vec![0, 2, 0, 1, 5, 2, 2, 0, 5];
    let target: Vec<u64> = vec![1, 1, 1, 3, 0, 6, 0, 3, 3];
    let n = source.len();
    let path = dir.join("edges.h5");
    write_edges(
        &path,
        &[EdgesView {
            name: "a_to_b",
            source_population: "a",
            target_population: "b",
            source_node_id: &source,
            target_node_id: &target,
            edge_type_id: &vec![100; n],
            edge_group_id: &vec![0; n],
            edge_group_index: &(0..n as u64).collect::<Vec<_>>(),
            groups: &[PopulationGroup {
                id: 0,
                columns: vec![Column::new("nsyns", ColumnData::U32(vec![1; n]))],
                dynamics_params: vec![],
            }],
        }],
    )
    .unwrap();
    path
}

/// Every index query of libsonata on population `a_to_b` of `file` equals the edges the ids
/// give.
const QUERY_EVERY_NODE: &str = r#"
def check(file):
    with h5py.File(file, "r") as f:
        src = f["edges/a_to_b/source_node_id"][...]
        tgt = f["edges/a_to_b/target_node_id"][...]
    p = libsonata.EdgeStorage(file).open_population("a_to_b")
    for node in range(8):
        aff = sorted(int(e) for e in p.afferent_edges([node]).flatten())
        eff = sorted(int(e) for e in p.efferent_edges([node]).flatten())
        assert aff == [i for i, t in enumerate(tgt) if t == node], (file, node, aff)
        assert eff == [i for i, s in enumerate(src) if s == node], (file, node, eff)
        for other in range(8):
            c = sorted(int(e) for e in p.connecting_edges([node], [other]).flatten())
            assert c == [i for i in range(len(src)) if src[i] == node and tgt[i] == other]
"#;

#[test]
fn libsonata_queries_the_indices_of_written_and_exported_edge_files() {
    let dir = tempfile::tempdir().unwrap();
    let written = edges(dir.path());
    // A BMTK-built original: the index under BMTK's name only; and one without indices.
    let out = libsonata(
        dir.path(),
        r#"
import shutil
for name, drop in [("bmtk.h5", ["node_id_to_ranges"]), ("bare.h5", None)]:
    shutil.copy(d + "/edges.h5", d + "/" + name)
    with h5py.File(d + "/" + name, "r+") as f:
        for g in ["source_to_target", "target_to_source"]:
            idx = f["edges/a_to_b/indices/" + g]
            assert idx["node_id_to_ranges"].id == idx["node_id_to_range"].id  # one dataset
            if drop is None:
                del f["edges/a_to_b/indices"]
                break
            for k in drop:
                del idx[k]
print("ok")
"#,
    );
    assert_eq!(out.trim(), "ok");
    // lockstep reads either name.
    for file in [&written, &dir.path().join("bmtk.h5")] {
        let by_target =
            read_edge_index(file, "a_to_b", EdgeIndexDirection::TargetToSource).unwrap();
        assert_eq!(by_target.edges_of(1), [0, 1, 2]);
        assert_eq!(by_target.edges_of(3), [3, 7, 8]);
        assert_eq!(by_target.edges_of(2), Vec::<u64>::new());
        let by_source =
            read_edge_index(file, "a_to_b", EdgeIndexDirection::SourceToTarget).unwrap();
        assert_eq!(by_source.edges_of(2), [1, 5, 6]);
        assert_eq!(by_source.edges_of(4), Vec::<u64>::new());
        assert_eq!(by_source.edges_of(9), Vec::<u64>::new());
    }
    let e = read_edge_index(
        dir.path().join("bare.h5"),
        "a_to_b",
        EdgeIndexDirection::SourceToTarget,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("bare.h5") && e.contains("/edges/a_to_b/indices/source_to_target"),
        "{e}"
    );
    // Exported (trained weights written into copies): both names, libsonata's queries work.
    let w: Vec<f64> = (0..9).map(|i| i as f64 * 0.5).collect();
    for src in ["bmtk.h5", "bare.h5"] {
        let dst = dir.path().join(format!("exported_{src}"));
        rewrite_syn_weights(dir.path().join(src), &dst, "a_to_b", &w).unwrap();
    }
    let out = libsonata(
        dir.path(),
        &format!(
            r#"{QUERY_EVERY_NODE}
for name in ["edges.h5", "exported_bmtk.h5", "exported_bare.h5"]:
    check(d + "/" + name)
    with h5py.File(d + "/" + name, "r") as f:
        for g in ["source_to_target", "target_to_source"]:
            idx = f["edges/a_to_b/indices/" + g]
            assert np.array_equal(idx["node_id_to_ranges"][...], idx["node_id_to_range"][...])
            assert idx["node_id_to_ranges"].dtype == np.uint64
        if name != "edges.h5":
            assert list(f["edges/a_to_b/0/syn_weight"][...]) == [i * 0.5 for i in range(9)]
print("ok")
"#
        ),
    );
    assert_eq!(out.trim(), "ok");
}
