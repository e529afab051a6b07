//! Reads the real BMTK `point_450glifs` network and checks it against values read from the
//! files by hand (h5py / the CSVs / the component JSONs).

use std::path::PathBuf;
use std::time::Instant;

use lockstep_sonata::{read_spikes, Circuit, SonataConfig, SpikeSorting};

/// The repository's `examples/` folder: BMTK's `point_450glifs` network and `point_components`,
/// and NEST 3.10's reference output in `point_450glifs/reference/`.
fn examples() -> PathBuf {
    std::fs::canonicalize(concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples")).unwrap()
}

fn net_dir() -> PathBuf {
    examples().join("point_450glifs")
}

fn circuit() -> Circuit {
    Circuit::from_config(net_dir().join("config.simulation.json")).expect("read point_450glifs")
}

#[test]
fn simulation_config_resolves_manifest_and_circuit() {
    let cfg = SonataConfig::from_file(net_dir().join("config.simulation.json")).unwrap();
    let dir = net_dir();
    assert_eq!(cfg.nodes.len(), 2);
    assert_eq!(cfg.edges.len(), 2);
    assert_eq!(cfg.nodes[0].nodes_file, dir.join("network/v1_nodes.h5"));
    assert_eq!(
        cfg.nodes[1].node_types_file,
        dir.join("network/lgn_node_types.csv")
    );
    assert_eq!(cfg.edges[1].edges_file, dir.join("network/lgn_v1_edges.h5"));
    let comps = examples().join("point_components");
    assert_eq!(
        cfg.components.point_neuron_models_dir,
        Some(comps.join("cell_models"))
    );
    assert_eq!(
        cfg.components.synaptic_models_dir,
        Some(comps.join("synaptic_models"))
    );
    // The bundled copy runs BMTK's config at the NEST reference settings (see its README).
    assert_eq!(cfg.tstop(), Some(1000.0));
    assert_eq!(cfg.dt(), Some(0.1));
    assert_eq!(
        cfg.json["inputs"]["LGN_spikes"]["input_file"]
            .as_str()
            .map(PathBuf::from),
        Some(dir.join("inputs/lgn_spikes.h5"))
    );
    assert_eq!(cfg.json["inputs"]["LGN_spikes"]["node_set"], "lgn");
    assert_eq!(
        cfg.json["output"]["output_dir"].as_str().map(PathBuf::from),
        Some(dir.join("output"))
    );
    assert_eq!(cfg.json["output"]["spikes_file"], "spikes.h5");
    assert_eq!(cfg.json["target_simulator"], "NEST");
}

#[test]
fn populations_and_counts() {
    let t0 = Instant::now();
    let c = circuit();
    println!(
        "reading point_450glifs (config + nodes + edges + components) took {:?}",
        t0.elapsed()
    );
    let names: Vec<&str> = c.nodes.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names, ["v1", "lgn"]);
    let v1 = c.node_population("v1").unwrap();
    let lgn = c.node_population("lgn").unwrap();
    assert!(!v1.is_virtual);
    assert!(lgn.is_virtual);
    assert_eq!(v1.len(), 450);
    assert_eq!(lgn.len(), 100);
    assert_eq!(
        v1.count_by_type(),
        vec![
            (100, 80),
            (101, 80),
            (102, 80),
            (103, 30),
            (104, 30),
            (105, 75),
            (106, 75)
        ]
    );
    assert_eq!(lgn.count_by_type(), vec![(100, 100)]);
    // groups: 300 GLIF cells in group 0 (x, y, z, rotations), 150 LIF cells in group 1 (x, y, z)
    assert_eq!(v1.groups.len(), 2);
    assert_eq!(v1.groups[0].rows(), Some(300));
    assert_eq!(v1.groups[1].rows(), Some(150));
    assert!(v1.groups[0].column("rotation_angle_yaxis").is_some());
    assert!(v1.groups[1].column("rotation_angle_yaxis").is_none());
    assert_eq!(v1.node_group_index[300], 0);
    assert_eq!(v1.node_group_id[300], 1);
    assert!(v1.property_f64("x").iter().all(Option::is_some));

    let rec = c.edge_population("v1_to_v1").unwrap();
    let inp = c.edge_population("lgn_to_v1").unwrap();
    assert_eq!(c.edges.len(), 2);
    assert_eq!(rec.len(), 28_555);
    assert_eq!(inp.len(), 36_035);
    assert_eq!(
        (
            rec.source_population.as_str(),
            rec.target_population.as_str()
        ),
        ("v1", "v1")
    );
    assert_eq!(
        (
            inp.source_population.as_str(),
            inp.target_population.as_str()
        ),
        ("lgn", "v1")
    );
    assert_eq!(
        rec.count_by_type(),
        vec![
            (100, 15149),
            (101, 1860),
            (102, 3224),
            (103, 1584),
            (104, 4709),
            (105, 2029)
        ]
    );
    assert_eq!(
        inp.count_by_type(),
        vec![(100, 19202), (101, 4834), (102, 11999)]
    );
    let nsyns_sum = |e: &lockstep_sonata::EdgePopulation| -> u64 {
        e.nsyns.as_ref().unwrap().iter().map(|&k| k as u64).sum()
    };
    assert_eq!(nsyns_sum(rec), 71_572);
    assert_eq!(nsyns_sum(inp), 90_106);
    assert_eq!(c.edges_into("v1").count(), 2);
    // every delay is 2.0 ms (edge-types CSV)
    assert!(rec.delay.iter().chain(&inp.delay).all(|&d| d == 2.0));
    // all component files loaded once: 7 cell models + 7 distinct synapse models
    // (v1_v1: e2e, e2i, i2e, i2i, instantaneousExc, instantaneousInh; lgn: LGN_to_GLIF, instantaneousExc)
    assert_eq!(c.components.len(), 7 + 7);
}

/// What a trainer keeps for exporting weights after the network is compiled: the edge
/// count, the file and name, and nsyns; the build-only columns are gone.
#[test]
fn released_edge_populations_keep_what_export_needs() {
    let mut c = circuit();
    let before: Vec<(String, usize, Option<Vec<u32>>)> = c
        .edges
        .iter()
        .map(|e| (e.name.clone(), e.len(), e.nsyns.clone()))
        .collect();
    for e in &mut c.edges {
        e.release_build_columns();
    }
    for (e, (name, len, nsyns)) in c.edges.iter().zip(before) {
        assert_eq!((&e.name, e.len(), &e.nsyns), (&name, len, &nsyns));
        assert!(e.file.exists());
        assert!(e.target_node_id.is_empty() && e.syn_weight.is_empty() && e.delay.is_empty());
        assert!(e.groups.is_empty() && e.type_row.is_empty() && e.synapse_index.is_empty());
    }
}

/// (edge, source, target, edge type, nsyns, syn_weight, receptor_type)
type EdgeCase = (usize, u64, u64, u64, u32, f64, Option<u64>);

#[test]
fn hand_checked_edges() {
    let c = circuit();
    let rec = c.edge_population("v1_to_v1").unwrap();
    let inp = c.edge_population("lgn_to_v1").unwrap();
    let w = rec.weights();
    // (edge, source, target, type, nsyns, syn_weight, receptor)
    let cases: [EdgeCase; 8] = [
        (0, 232, 0, 100, 4, 2.5, Some(1)),
        (4, 408, 0, 102, 1, -6.5, Some(2)),
        (18372, 37, 239, 100, 4, 2.5, Some(1)),
        (21814, 205, 299, 101, 3, 5.0, Some(3)),
        (18371, 424, 239, 102, 4, -6.5, Some(2)),
        (21816, 386, 299, 103, 4, -3.0, Some(4)),
        (28554, 219, 449, 104, 2, 3.0, None),
        (28553, 387, 449, 105, 3, -4.0, None),
    ];
    for (i, s, t, ty, ns, sw, rt) in cases {
        assert_eq!(rec.source_node_id[i], s, "edge {i}");
        assert_eq!(rec.target_node_id[i], t, "edge {i}");
        assert_eq!(rec.edge_type_id[i], ty, "edge {i}");
        assert_eq!(rec.nsyns.as_ref().unwrap()[i], ns, "edge {i}");
        assert_eq!(rec.syn_weight[i], sw, "edge {i}");
        assert_eq!(w[i], sw * ns as f64, "edge {i}");
        assert_eq!(rec.delay[i], 2.0, "edge {i}");
        assert_eq!(rec.synapse(i).receptor_type(), rt, "edge {i}");
    }
    assert_eq!(rec.synapse(0).name.as_deref(), Some("e2e.json"));
    assert_eq!(
        rec.synapse(28553).name.as_deref(),
        Some("instantaneousInh.json")
    );
    let wi = inp.weights();
    let cases: [EdgeCase; 4] = [
        (0, 76, 0, 100, 4, 11.0, Some(1)),
        (19201, 64, 239, 100, 3, 11.0, Some(1)),
        (24035, 31, 299, 101, 3, 14.0, Some(1)),
        (36034, 78, 449, 102, 3, 13.0, None),
    ];
    for (i, s, t, ty, ns, sw, rt) in cases {
        assert_eq!(inp.source_node_id[i], s, "edge {i}");
        assert_eq!(inp.target_node_id[i], t, "edge {i}");
        assert_eq!(inp.edge_type_id[i], ty, "edge {i}");
        assert_eq!(wi[i], sw * ns as f64, "edge {i}");
        assert_eq!(inp.delay[i], 2.0, "edge {i}");
        assert_eq!(inp.synapse(i).receptor_type(), rt, "edge {i}");
    }
}

#[test]
fn resolved_cell_parameters_per_node_type() {
    let c = circuit();
    let v1 = c.node_population("v1").unwrap();
    // node type -> (first node, model_template, V_th, C_m, t_ref)
    let cases = [
        (
            100,
            "nest:glif_psc",
            -46.40370561385434,
            58.60769058316611,
            2.6000000000000005,
        ),
        (
            101,
            "nest:glif_psc",
            -37.57837016608795,
            52.353697808027725,
            3.2,
        ),
        (
            102,
            "nest:glif_psc",
            -40.8824438029048,
            68.14035162092856,
            2.4000000000000004,
        ),
        (
            103,
            "nest:glif_psc",
            -44.23152364988978,
            81.21058405283176,
            1.5,
        ),
        (
            104,
            "nest:glif_psc",
            -45.793386052222445,
            64.02349624649017,
            1.4,
        ),
        (105, "nest:iaf_psc_alpha", -37.0, 120.0, 3.0),
        (106, "nest:iaf_psc_alpha", -36.0, 50.0, 3.0),
    ];
    for (ty, template, vth, cm, tref) in cases {
        let nodes: Vec<usize> = (0..v1.len())
            .filter(|&i| v1.node_type_id[i] == ty)
            .collect();
        assert!(!nodes.is_empty());
        for &i in &nodes {
            assert_eq!(v1.model_template(i), Some(template), "type {ty}");
            let p = v1.dynamics_params(i).unwrap();
            assert_eq!(p["V_th"].as_f64(), Some(vth), "type {ty}");
            assert_eq!(p["C_m"].as_f64(), Some(cm), "type {ty}");
            assert_eq!(p["t_ref"].as_f64(), Some(tref), "type {ty}");
            if template == "nest:glif_psc" {
                let tau: Vec<f64> = p["tau_syn"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap())
                    .collect();
                assert_eq!(tau, [5.5, 8.5, 2.8, 5.8]);
            }
        }
        // shared, not copied: every node of the type points at the same JSON
        let first = v1.dynamics_params(nodes[0]).unwrap();
        assert!(nodes
            .iter()
            .all(|&i| std::sync::Arc::ptr_eq(v1.dynamics_params(i).unwrap(), first)));
    }
    let p = v1.dynamics_params(0).unwrap();
    assert_eq!(p["asc_amps"][1].as_f64(), Some(-65.30848816));
    assert_eq!(
        v1.dynamics_params(449).unwrap()["tau_m"].as_f64(),
        Some(7.0)
    );
    let lgn = c.node_population("lgn").unwrap();
    assert!(lgn.dynamics_params(0).is_none());
    assert_eq!(lgn.types.model_type(0), Some("virtual"));
}

#[test]
fn input_and_reference_spikes() {
    let s = read_spikes(net_dir().join("inputs/lgn_spikes.h5")).unwrap();
    assert_eq!(s.populations.len(), 1);
    let lgn = s.get("lgn").unwrap();
    assert_eq!(lgn.len(), 3044);
    assert_eq!(lgn.sorting, SpikeSorting::None);
    assert_eq!(lgn.node_ids[100], 3);
    assert_eq!(lgn.timestamps[100], 1384.346);
    assert_eq!(lgn.timestamps[0], 445.539);
    let mut ids = lgn.node_ids.clone();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 100);
    assert_eq!(*ids.last().unwrap(), 99);

    let r = read_spikes(
        examples().join("point_450glifs/reference/nest_point450_dt0.1_t1000.spikes.h5"),
    )
    .unwrap();
    let v1 = r.get("v1").unwrap();
    assert_eq!(v1.len(), 19_263);
    assert_eq!(v1.sorting, SpikeSorting::ByTime);
    assert!(v1.timestamps.windows(2).all(|w| w[0] <= w[1]));
}
