//! Building a network in memory (as the network builder does), writing it and reading it
//! back: per-edge values override the edge types, several groups, virtual populations by
//! config, writer validation.

use std::path::Path;
use std::sync::Arc;

use lockstep_sonata::{
    write_edges, write_nodes, Circuit, Column, ColumnData, ComponentStore, Components, EdgeParts,
    EdgePopulation, EdgeTypes, EdgesView, NodeParts, NodePopulation, NodeTypes, NodesView,
    PopulationGroup, SonataErrorKind, TypeTable,
};

fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

fn node_table() -> TypeTable {
    TypeTable::new(
        "node_type_id",
        s(&[
            "node_type_id",
            "model_type",
            "model_template",
            "dynamics_params",
            "pop_name",
        ]),
        vec![
            s(&[
                "1",
                "point_neuron",
                "nest:iaf_psc_alpha",
                "cell.json",
                "exc cells",
            ]),
            s(&["2", "point_neuron", "nest:iaf_psc_alpha", "NULL", "inh"]),
            s(&["9", "point_neuron", "NULL", "NULL", "input"]),
        ],
    )
    .unwrap()
}

fn edge_table() -> TypeTable {
    TypeTable::new(
        "edge_type_id",
        s(&[
            "edge_type_id",
            "syn_weight",
            "delay",
            "dynamics_params",
            "nsyns",
        ]),
        vec![
            s(&["10", "1.5", "1.0", "syn.json", "2"]),
            s(&["11", "-2.0", "3.0", "NULL", "NULL"]),
        ],
    )
    .unwrap()
}

/// Writes the components and returns their `Components`.
fn components(dir: &Path) -> Components {
    let cells = dir.join("cells");
    let syns = dir.join("syns");
    std::fs::create_dir_all(&cells).unwrap();
    std::fs::create_dir_all(&syns).unwrap();
    std::fs::write(cells.join("cell.json"), r#"{"tau_m": 10.0, "C_m": 250.0}"#).unwrap();
    std::fs::write(syns.join("syn.json"), r#"{"receptor_type": 2}"#).unwrap();
    Components {
        point_neuron_models_dir: Some(cells.clone()),
        synaptic_models_dir: Some(syns.clone()),
        dirs: [
            ("point_neuron_models_dir".to_string(), cells),
            ("synaptic_models_dir".to_string(), syns),
        ]
        .into(),
    }
}

fn cortex() -> NodeParts {
    NodeParts {
        name: "cortex".into(),
        node_id: vec![0, 1, 2, 3],
        node_type_id: vec![1, 1, 2, 2],
        node_group_id: vec![0, 0, 1, 1],
        node_group_index: vec![0, 1, 0, 1],
        groups: vec![
            PopulationGroup {
                id: 0,
                columns: vec![
                    Column::new("x", ColumnData::F32(vec![1.0, 2.0])),
                    Column::new("label", ColumnData::Str(s(&["a b", "c"]))),
                    Column {
                        name: "positions".into(),
                        width: 3,
                        data: ColumnData::F64(vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]),
                    },
                ],
                dynamics_params: vec![Column::new("tau_m", ColumnData::F64(vec![11.0, 12.0]))],
            },
            PopulationGroup {
                id: 1,
                columns: vec![Column::new("x", ColumnData::I16(vec![-3, 4]))],
                dynamics_params: vec![],
            },
        ],
    }
}

fn input() -> NodeParts {
    NodeParts {
        name: "input".into(),
        node_id: vec![0, 1],
        node_type_id: vec![9, 9],
        node_group_id: vec![0, 0],
        node_group_index: vec![0, 1],
        groups: vec![PopulationGroup {
            id: 0,
            ..Default::default()
        }],
    }
}

fn recurrent() -> EdgeParts {
    EdgeParts {
        name: "cortex_to_cortex".into(),
        source_population: "cortex".into(),
        target_population: "cortex".into(),
        source_node_id: vec![3, 0, 2, 1, 3],
        target_node_id: vec![0, 0, 1, 3, 3],
        edge_type_id: vec![10, 11, 10, 11, 10],
        edge_group_id: vec![0, 1, 0, 1, 1],
        edge_group_index: vec![0, 0, 1, 1, 2],
        groups: vec![
            // group 0: per-edge syn_weight and delay (win over the CSV)
            PopulationGroup {
                id: 0,
                columns: vec![
                    Column::new("syn_weight", ColumnData::F32(vec![0.25, 0.5])),
                    Column::new("delay", ColumnData::F64(vec![0.7, 0.9])),
                ],
                dynamics_params: vec![],
            },
            // group 1: only nsyns per edge; weight and delay from the CSV
            PopulationGroup {
                id: 1,
                columns: vec![Column::new("nsyns", ColumnData::U32(vec![4, 5, 6]))],
                dynamics_params: vec![],
            },
        ],
    }
}

#[test]
fn build_write_read_back() {
    let dir = tempfile::tempdir().unwrap();
    let comps = components(dir.path());
    let mut store = ComponentStore::new();
    let ntypes = Arc::new(NodeTypes::new(node_table(), &comps, &mut store).unwrap());
    let etypes = Arc::new(EdgeTypes::new(edge_table(), &comps, &mut store).unwrap());
    let file = dir.path().join("mem");
    let cx = NodePopulation::from_parts(cortex(), ntypes.clone(), &file, false).unwrap();
    assert!(!cx.is_virtual);
    assert_eq!(
        cx.property_f64("x"),
        vec![Some(1.0), Some(2.0), Some(-3.0), Some(4.0)]
    );
    assert_eq!(cx.dynamics_params(0).unwrap()["tau_m"], 10.0);
    assert!(cx.dynamics_params(2).is_none());
    let e = EdgePopulation::from_parts(recurrent(), etypes.clone(), &file).unwrap();
    assert_eq!(e.syn_weight, [0.25, -2.0, 0.5, -2.0, 1.5]);
    assert_eq!(e.delay, [0.7, 3.0, 0.9, 3.0, 1.0]);
    // nsyns: edge 0 and 2 from the CSV (type 10: 2), 1/3/4 from group 1
    assert_eq!(e.nsyns.as_deref(), Some(&[2, 4, 2, 5, 6][..]));
    assert_eq!(e.weights(), [0.5, -8.0, 1.0, -10.0, 9.0]);
    assert_eq!(e.synapse(0).receptor_type(), Some(2));
    assert_eq!(e.synapse(1).receptor_type(), None);
    assert_eq!(e.synapse(1).name, None);

    let net = dir.path().join("net");
    std::fs::create_dir_all(&net).unwrap();
    write_nodes(
        net.join("nodes.h5"),
        &[NodesView::from(&cx), NodesView::from(&input())],
    )
    .unwrap();
    node_table().write(&net.join("node_types.csv")).unwrap();
    write_edges(net.join("edges.h5"), &[EdgesView::from(&e)]).unwrap();
    edge_table().write(&net.join("edge_types.csv")).unwrap();
    let cfg = serde_json::json!({
        "manifest": {"$NET": "./net", "$C": "."},
        "components": {"point_neuron_models_dir": "$C/cells", "synaptic_models_dir": "$C/syns"},
        "networks": {
            "nodes": [{"nodes_file": "$NET/nodes.h5", "node_types_file": "$NET/node_types.csv",
                       "populations": {"input": {"type": "virtual"}}}],
            "edges": [{"edges_file": "$NET/edges.h5", "edge_types_file": "$NET/edge_types.csv"}]
        },
        "run": {"tstop": 100.0, "dt": 0.1}
    });
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    let c = Circuit::from_config(dir.path().join("config.json")).unwrap();
    let back = c.node_population("cortex").unwrap();
    assert_eq!(back.parts(), cx.parts());
    assert!(
        c.node_population("input").unwrap().is_virtual,
        "virtual via populations.type"
    );
    let eb = c.edge_population("cortex_to_cortex").unwrap();
    assert_eq!(eb.parts(), e.parts());
    assert_eq!(eb.weights(), e.weights());
    assert_eq!(eb.delay, e.delay);
    assert_eq!(back.types.table.get_by_id(1, "pop_name"), Some("exc cells"));
    assert_eq!(c.config.dt(), Some(0.1));
}

#[test]
fn writers_reject_inconsistent_data() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("x.h5");
    let mut bad = cortex();
    bad.node_type_id.pop();
    let e = write_nodes(&p, &[NodesView::from(&bad)]).unwrap_err();
    assert!(matches!(e.kind(), SonataErrorKind::InvalidData { .. }));
    assert!(
        e.to_string()
            .contains("node_type_id has 3 rows, expected 4"),
        "{e}"
    );
    assert!(
        !p.exists(),
        "nothing is written when the data is inconsistent"
    );

    let mut bad = cortex();
    bad.node_group_index[3] = 2;
    let e = write_nodes(&p, &[NodesView::from(&bad)])
        .unwrap_err()
        .to_string();
    assert!(e.contains("row 3 has index 2 into group 1"), "{e}");

    let c = cortex();
    let e = write_nodes(&p, &[NodesView::from(&c), NodesView::from(&c)])
        .unwrap_err()
        .to_string();
    assert!(e.contains("'cortex' is listed twice"), "{e}");

    let mut bad = recurrent();
    bad.edge_type_id[2] = 1 << 40;
    let e = write_edges(&p, &[EdgesView::from(&bad)])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("edge_type_id[2] = 1099511627776 does not fit the uint32"),
        "{e}"
    );

    let mut bad = recurrent();
    bad.groups[1].columns[0].data = ColumnData::U32(vec![1, 2]);
    let e = write_edges(&p, &[EdgesView::from(&bad)])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("index 2 into group 1, which has only 2 rows"),
        "{e}"
    );

    let mut bad = recurrent();
    bad.target_population = String::new();
    let e = write_edges(&p, &[EdgesView::from(&bad)])
        .unwrap_err()
        .to_string();
    assert!(e.contains("node population name '' is empty"), "{e}");
}

#[test]
fn from_parts_validates() {
    let dir = tempfile::tempdir().unwrap();
    let comps = components(dir.path());
    let mut store = ComponentStore::new();
    let ntypes = Arc::new(NodeTypes::new(node_table(), &comps, &mut store).unwrap());
    let file = dir.path().join("mem.h5");
    let mut dup = cortex();
    dup.node_id[2] = 0;
    let e = NodePopulation::from_parts(dup, ntypes.clone(), &file, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("node id 0 appears twice (rows 0 and 2)"), "{e}");
    // a missing component file names the type row
    let mut t = node_table();
    t.rows[1][3] = "missing.json".into();
    let e = NodeTypes::new(t, &comps, &mut store)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("missing.json") && e.contains("node type 2"),
        "{e}"
    );
    // no components dir configured
    let e = EdgeTypes::new(edge_table(), &Components::default(), &mut store)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("components.synaptic_models_dir is not set"),
        "{e}"
    );
}

#[test]
fn per_node_dynamics_params_override_the_type() {
    let dir = tempfile::tempdir().unwrap();
    let comps = components(dir.path());
    let mut store = ComponentStore::new();
    let ntypes = Arc::new(NodeTypes::new(node_table(), &comps, &mut store).unwrap());
    let cx = NodePopulation::from_parts(cortex(), ntypes, &dir.path().join("m.h5"), false).unwrap();
    // node 1: type 1 JSON {tau_m: 10, C_m: 250}, group 0 row 1 overrides tau_m = 12
    let p = cx.cell_params(1).unwrap();
    assert!(matches!(p, std::borrow::Cow::Owned(_)));
    assert_eq!(p["tau_m"], 12.0);
    assert_eq!(p["C_m"], 250.0);
    // the shared type JSON is untouched
    assert_eq!(cx.dynamics_params(1).unwrap()["tau_m"], 10.0);
    // node 2: type 2 has no JSON and group 1 no overrides
    assert!(cx.cell_params(2).is_none());
}

#[test]
fn non_numeric_per_edge_values_are_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let comps = components(dir.path());
    let mut store = ComponentStore::new();
    let etypes = Arc::new(EdgeTypes::new(edge_table(), &comps, &mut store).unwrap());
    let mut bad = recurrent();
    bad.groups[0].columns[0] = Column::new("syn_weight", ColumnData::Str(s(&["1", "2"])));
    let e = EdgePopulation::from_parts(bad, etypes, &dir.path().join("e.h5"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("/edges/cortex_to_cortex/0/syn_weight") && e.contains("str"),
        "{e}"
    );
}

#[test]
fn rewrite_syn_weights_rejects_bad_requests() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("e.h5");
    write_edges(&src, &[EdgesView::from(&recurrent())]).unwrap();
    let dst = dir.path().join("out.h5");
    let e = lockstep_sonata::rewrite_syn_weights(&src, &dst, "nope", &[1.0; 5])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("/edges/nope") && e.contains("cortex_to_cortex"),
        "{e}"
    );
    let e = lockstep_sonata::rewrite_syn_weights(&src, &dst, "cortex_to_cortex", &[1.0; 4])
        .unwrap_err()
        .to_string();
    assert!(e.contains("4 weights given for 5 edges"), "{e}");
    let e = lockstep_sonata::rewrite_syn_weights(
        &src,
        &dst,
        "cortex_to_cortex",
        &[1.0, 2.0, f64::NAN, 0.0, 1.0],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("weight 2 is NaN"), "{e}");
    assert!(!dst.exists());
    // a valid rewrite: group 0 keeps its float32 dtype, group 1 gains a float64 column
    lockstep_sonata::rewrite_syn_weights(
        &src,
        &dst,
        "cortex_to_cortex",
        &[1.0, 2.0, 3.0, 4.0, 5.0],
    )
    .unwrap();
    let parts = lockstep_sonata::read_edge_parts(&dst).unwrap();
    let g0 = parts[0].groups[0].column("syn_weight").unwrap();
    assert_eq!(g0.data, ColumnData::F32(vec![1.0, 3.0]));
    let g1 = parts[0].groups[1].column("syn_weight").unwrap();
    assert_eq!(g1.data, ColumnData::F64(vec![2.0, 4.0, 5.0]));
    assert_eq!(
        parts[0].groups[1].column("nsyns").unwrap().data,
        ColumnData::U32(vec![4, 5, 6])
    );
}

#[test]
fn spike_sorting_is_checked_and_seconds_converted() {
    use lockstep_sonata::{read_spikes, write_spikes, PopulationSpikes, SpikeSorting, SpikeTrains};
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("s.h5");
    let mut pop = PopulationSpikes {
        population: "v1".into(),
        node_ids: vec![2, 1, 0],
        timestamps: vec![3.0, 1.0, 2.0],
        sorting: SpikeSorting::ByTime,
    };
    let e = write_spikes(
        &p,
        &SpikeTrains {
            populations: vec![pop.clone()],
        },
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("sorting = by_time but spike 1 (node 1, 1 ms)"),
        "{e}"
    );
    pop.sort_by_id();
    assert_eq!(pop.node_ids, [0, 1, 2]);
    write_spikes(
        &p,
        &SpikeTrains {
            populations: vec![pop.clone()],
        },
    )
    .unwrap();
    assert_eq!(read_spikes(&p).unwrap().populations, vec![pop]);

    // timestamps in seconds are converted to ms
    let q = dir.path().join("sec.h5");
    {
        let f = hdf5::File::create(&q).unwrap();
        let g = f.create_group("spikes/x").unwrap();
        g.new_dataset_builder()
            .with_data(&[7u64][..])
            .create("node_ids")
            .unwrap();
        let t = g
            .new_dataset_builder()
            .with_data(&[0.25f64][..])
            .create("timestamps")
            .unwrap();
        let unit: hdf5::types::VarLenUnicode = "s".parse().unwrap();
        t.new_attr::<hdf5::types::VarLenUnicode>()
            .create("units")
            .unwrap()
            .write_scalar(&unit)
            .unwrap();
    }
    let r = read_spikes(&q).unwrap();
    assert_eq!(r.get("x").unwrap().timestamps, [250.0]);
    assert_eq!(r.get("x").unwrap().sorting, SpikeSorting::None);
}

#[test]
fn fixed_length_strings_are_read() {
    use hdf5::types::FixedAscii;
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("e.h5");
    write_edges(&p, &[EdgesView::from(&recurrent())]).unwrap();
    {
        let f = hdf5::File::open_rw(&p).unwrap();
        let ds = f.dataset("/edges/cortex_to_cortex/target_node_id").unwrap();
        ds.delete_attr("node_population").unwrap();
        let v = FixedAscii::<6>::from_ascii(b"cortex").unwrap();
        ds.new_attr::<FixedAscii<6>>()
            .create("node_population")
            .unwrap()
            .write_scalar(&v)
            .unwrap();
        let g = f.group("/edges/cortex_to_cortex/0").unwrap();
        let col = [
            FixedAscii::<3>::from_ascii(b"ab").unwrap(),
            FixedAscii::<3>::from_ascii(b"xyz").unwrap(),
        ];
        g.new_dataset_builder()
            .with_data(&col[..])
            .create("tag")
            .unwrap();
    }
    let parts = lockstep_sonata::read_edge_parts(&p).unwrap();
    assert_eq!(parts[0].target_population, "cortex");
    assert_eq!(
        parts[0].groups[0].column("tag").unwrap().data,
        ColumnData::Str(s(&["ab", "xyz"]))
    );
}
