//! The V1-scale example (`examples/v1_scale`): its tenth-scale recipe builds a network with the
//! published statistics of the Allen V1 model, scaled to a tenth of the cells (the variant
//! tests and CI use; the full recipe differs only in counts and connection probabilities).

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;

const LOCKSTEP: &str = env!("CARGO_BIN_EXE_lockstep");

fn example() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/v1_scale")
}

#[test]
fn tenth_scale_recipe_has_v1_statistics() {
    let out_dir = tempfile::tempdir().unwrap();
    let out = Command::new(LOCKSTEP)
        .arg("build-network")
        .arg(example().join("network_recipe.tenth.json"))
        .arg("--output")
        .arg(out_dir.path())
        .arg("--overwrite")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let circuit =
        lockstep_sonata::Circuit::from_config(out_dir.path().join("config.circuit.json")).unwrap();
    let v1 = circuit.node_population("v1").unwrap();
    let lgn = circuit.node_population("lgn").unwrap();
    assert!(lgn.is_virtual);
    // 66,658 / 10 cells (rounded per type) and 17,400 / 10 LGN nodes.
    assert_eq!(v1.len(), 6667);
    assert_eq!(lgn.len(), 1740);
    let exc = v1.node_type_id.iter().filter(|&&t| t <= 102).count();
    let frac_exc = exc as f64 / v1.len() as f64;
    assert!(
        (frac_exc - 0.85).abs() < 0.005,
        "excitatory fraction {frac_exc}"
    );
    let mut types: Vec<u64> = v1.node_type_id.clone();
    types.sort_unstable();
    types.dedup();
    assert_eq!(
        types,
        [100, 101, 102, 103, 104],
        "three excitatory, two inhibitory types"
    );

    let rec = circuit.edge_population("v1_to_v1").unwrap();
    let input = circuit.edge_population("lgn_to_v1").unwrap();
    // V1: about 367 recurrent and 30 LGN inputs per cell.
    let in_degree = rec.len() as f64 / v1.len() as f64;
    assert!(
        (in_degree - 367.0).abs() < 5.0,
        "recurrent in-degree {in_degree}"
    );
    let lgn_in = input.len() as f64 / v1.len() as f64;
    assert!((lgn_in - 30.0).abs() < 1.0, "LGN inputs per cell {lgn_in}");
    assert!(rec
        .source_node_id
        .iter()
        .zip(&rec.target_node_id)
        .all(|(s, t)| s != t));

    // Receptor ports of glif_psc (1-based into tau_syn) and delays as in BMTK's V1 examples.
    let expected: HashMap<u64, (u64, f64)> = [
        (100, (1, 2.0)), // e -> e
        (101, (3, 1.5)), // e -> i
        (102, (2, 1.0)), // i -> e
        (103, (4, 1.0)), // i -> i
    ]
    .into_iter()
    .collect();
    for i in (0..rec.len()).step_by(997) {
        let (port, delay) = expected[&rec.edge_type_id[i]];
        assert_eq!(rec.synapse(i).receptor_type(), Some(port), "edge {i}");
        assert_eq!(rec.delay[i], delay, "edge {i}");
        let w = rec.syn_weight[i];
        assert_eq!(w > 0.0, rec.edge_type_id[i] <= 101, "sign of edge {i}: {w}");
    }

    // Per-type target rates for TargetFiringRate.
    let rates = std::fs::read_to_string(out_dir.path().join("target_rates.csv")).unwrap();
    assert!(
        rates.starts_with("node_id,population,firing_rate"),
        "{rates}"
    );
    assert_eq!(rates.lines().count(), 1 + 6667);
}
