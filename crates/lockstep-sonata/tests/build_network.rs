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
