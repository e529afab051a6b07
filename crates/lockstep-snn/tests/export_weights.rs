//! Trained weights exported as SONATA edges files read back as the same network weights.

use std::path::PathBuf;

use lockstep_snn::{export_trained_weights, network_spec_from_circuit};
use lockstep_snn::{BpttOptions, InputSpec, Loss, RateUnits, SnnModel};
use serde_json::json;

/// The repository's `examples/` folder: BMTK's `point_450glifs` network and `point_components`,
/// and NEST 3.10's reference output in `point_450glifs/reference/`.
fn examples() -> PathBuf {
    std::fs::canonicalize(concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples")).unwrap()
}

#[test]
fn exported_weights_read_back_identically() {
    let net_dir = examples().join("point_450glifs");
    let circuit =
        lockstep_sonata::Circuit::from_config(net_dir.join("config.circuit.json")).unwrap();
    let spec = network_spec_from_circuit(&circuit).unwrap();
    let n = spec.neurons.len();
    let opts = BpttOptions {
        seq_len: 10,
        train_input_weights: true,
        losses: vec![Loss::TargetFiringRate {
            target: vec![5.0; n],
            units: RateUnits::Hz,
        }],
        ..Default::default()
    };
    let model = SnnModel::new(&spec, 1.0, &InputSpec::default(), opts).unwrap();
    let mut params = model.initial_params();
    for (i, p) in params.iter_mut().enumerate() {
        *p *= 1.0 + (i % 7) as f32 * 0.1;
    }
    let (rec, inp) = model.weights_in_spec_order(&params).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let files = export_trained_weights(&circuit, &rec, &inp, tmp.path()).unwrap();
    assert_eq!(files.len(), 2);

    let nd = net_dir.join("network");
    let s = |p: PathBuf| p.to_str().unwrap().to_string();
    let cfg = json!({
        "components": {
            "point_neuron_models_dir": s(examples().join("point_components/cell_models")),
            "synaptic_models_dir": s(examples().join("point_components/synaptic_models"))
        },
        "networks": {
            "nodes": [
                {"nodes_file": s(nd.join("v1_nodes.h5")), "node_types_file": s(nd.join("v1_node_types.csv"))},
                {"nodes_file": s(nd.join("lgn_nodes.h5")), "node_types_file": s(nd.join("lgn_node_types.csv"))}
            ],
            "edges": [
                {"edges_file": s(tmp.path().join("v1_v1_edges.h5")), "edge_types_file": s(nd.join("v1_v1_edge_types.csv"))},
                {"edges_file": s(tmp.path().join("lgn_v1_edges.h5")), "edge_types_file": s(nd.join("lgn_v1_edge_types.csv"))}
            ]
        }
    });
    let cfg_path = tmp.path().join("circuit.json");
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let back =
        network_spec_from_circuit(&lockstep_sonata::Circuit::from_config(&cfg_path).unwrap())
            .unwrap();
    assert_eq!(back.recurrent_edges.len(), rec.len());
    for (e, &w) in back.recurrent_edges.iter().zip(&rec) {
        assert!(
            (e.weight - w).abs() <= 1e-12 * w.abs(),
            "{} vs {w}",
            e.weight
        );
    }
    for (e, &w) in back.input_edges.iter().zip(&inp) {
        assert!(
            (e.weight - w).abs() <= 1e-12 * w.abs(),
            "{} vs {w}",
            e.weight
        );
    }
    // Structure (sources, targets, receptors, delays) is unchanged.
    for (a, b) in back.recurrent_edges.iter().zip(&spec.recurrent_edges) {
        assert_eq!(
            (a.source, a.target, a.receptor, a.delay_ms),
            (b.source, b.target, b.receptor, b.delay_ms)
        );
    }
}

#[test]
fn model_from_training_config_with_poisson_and_file_inputs() {
    let net_dir = examples().join("point_450glifs");
    let tmp = tempfile::tempdir().unwrap();
    let cfg = json!({
        "network": net_dir.join("config.circuit.json").to_str().unwrap(),
        "run": {"dt": 1.0, "seq_len": 50, "batch_size": 2, "seed": 3},
        "inputs": {
            "LGN_spikes": {"input_type": "spikes", "module": "sonata",
                            "input_file": net_dir.join("inputs/lgn_spikes.h5").to_str().unwrap(), "node_set": "lgn"},
            "background": {"input_type": "poisson", "rate": 30.0, "node_set": "lgn"}
        },
        "training": {
            "losses": [{"name": "TargetFiringRate", "firing_rate": {"v1": 5.0}}, {"name": "VoltageRegularization", "cost": 0.1}],
            "pseudo_derivative": {"name": "triangle", "gain": 0.4},
            "gradient_checkpointing": 10,
            "train_input_weights": true
        }
    });
    let path = tmp.path().join("train.json");
    std::fs::write(&path, cfg.to_string()).unwrap();
    let (_, model) = lockstep_snn::model_from_config(&path).unwrap();
    assert_eq!(model.n_params(), 28555 + 36035);
    assert_eq!(model.options().gradient_checkpointing, Some(10));
    assert_eq!(
        lockstep_snn::loss_names(&model),
        vec!["TargetFiringRate", "VoltageRegularization"]
    );
    let p = model.initial_params();
    let a = model.loss_and_grad(&p, 0, 2).unwrap();
    let b = model.loss_and_grad(&p, 0, 2).unwrap();
    assert_eq!(a, b, "deterministic for the same samples");
    assert!(a.n_spikes > 0 && a.grad.iter().any(|&g| g != 0.0));
    let c = model.loss_and_grad(&p, 2, 2).unwrap();
    assert_ne!(
        a.n_spikes, c.n_spikes,
        "other samples draw other Poisson input"
    );

    // Missing training.losses is a clear config error.
    let mut bad = cfg.clone();
    bad["training"].as_object_mut().unwrap().remove("losses");
    std::fs::write(&path, bad.to_string()).unwrap();
    let e = lockstep_snn::model_from_config(&path)
        .unwrap_err()
        .to_string();
    assert!(e.contains("training.losses"), "{e}");
}
