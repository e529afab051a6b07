//! The V1-scale example (`examples/v1_scale`): its tenth-scale recipe builds a network with the
//! published statistics of the Allen V1 model, scaled to a tenth of the cells (the variant
//! tests and CI use; the full recipe differs only in counts and connection probabilities),
//! and the float32 BPTT kernels agree with the per-sample float32 reference on it.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;

const LOCKSTEP: &str = env!("CARGO_BIN_EXE_lockstep");

fn example() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/v1_scale")
}

/// Builds the tenth-scale network into a temporary folder.
fn build_tenth() -> tempfile::TempDir {
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
    out_dir
}

#[test]
fn tenth_scale_recipe_has_v1_statistics() {
    let out_dir = build_tenth();
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

/// The example's tenth-scale training config (float32 kernels, LGN Poisson input, rate and
/// voltage losses) on a network built into `net`, shortened to `seq_len` steps of a local
/// batch of `batch`.
fn tenth_training_config(net: &std::path::Path, seq_len: u64, batch: u64) -> PathBuf {
    let mut cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(example().join("config.train.tenth.json")).unwrap(),
    )
    .unwrap();
    cfg["network"] = net.join("config.circuit.json").to_str().unwrap().into();
    cfg["training"]["losses"][0]["firing_rate"] =
        net.join("target_rates.csv").to_str().unwrap().into();
    cfg["run"]["seq_len"] = seq_len.into();
    cfg["run"]["batch_size"] = batch.into();
    cfg["training"]["gradient_checkpointing"] = 10.into();
    cfg["output"]["output_dir"] = net.join("out").to_str().unwrap().into();
    let path = net.join("config.train.short.json");
    std::fs::write(&path, cfg.to_string()).unwrap();
    path
}

/// On the tenth-scale network (6,667 cells, 2.44M recurrent edges: several delivery blocks,
/// prefetching, and with 3,334 targets per pass two SpMV passes, or the SpMV in the scatter
/// form that full V1 takes) the float32 kernels give
/// the spikes and losses of the per-sample float32 reference and its gradient to 1e-5
/// relative L2, bitwise the same on 1 and 2 threads.
#[test]
fn tenth_scale_float32_kernels_match_the_reference() {
    let net = build_tenth();
    let config = tenth_training_config(net.path(), 40, 2);
    let (_, mut model) = lockstep_snn::model_from_config(&config).unwrap();
    assert_eq!(model.options().dtype, lockstep_snn::Dtype::Float32);
    let p = model.initial_params();
    let reference = model
        .loss_and_grad_reference(&p, 7, 2, lockstep_snn::Dtype::Float32)
        .unwrap();
    assert!(reference.n_spikes > 500, "{} spikes", reference.n_spikes);
    let rel_l2 = |a: &[f32], b: &[f32]| -> f64 {
        let num: f64 = a
            .iter()
            .zip(b)
            .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
            .sum();
        let den: f64 = b.iter().map(|&y| (y as f64).powi(2)).sum();
        (num / den).sqrt()
    };
    use lockstep_snn::SpmvForm::{Gather, Scatter};
    for (pass, form) in [(None, Gather), (Some(3334), Gather), (None, Scatter)] {
        model.opts.spmv_pass_targets = pass;
        model.opts.adjoint_spmv = form;
        let pass = (pass, form);
        let fast = model.loss_and_grad(&p, 7, 2).unwrap();
        assert_eq!(fast.n_spikes, reference.n_spikes, "passes {pass:?}: spikes");
        assert!(
            (fast.loss - reference.loss).abs() <= 1e-9 * reference.loss.abs(),
            "passes {pass:?}: loss {} vs {}",
            fast.loss,
            reference.loss
        );
        let r = rel_l2(&fast.grad, &reference.grad);
        eprintln!(
            "passes {pass:?}: {} spikes, gradient rel L2 {r:.2e}",
            fast.n_spikes
        );
        assert!(r <= 1e-5, "passes {pass:?}: gradient relative L2 {r}");
        let one_thread = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap()
            .install(|| model.loss_and_grad(&p, 7, 2).unwrap());
        let two_threads = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap()
            .install(|| model.loss_and_grad(&p, 7, 2).unwrap());
        let bits = |g: &[f32]| g.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&one_thread.grad),
            bits(&fast.grad),
            "passes {pass:?}: 1 thread"
        );
        assert_eq!(
            bits(&two_threads.grad),
            bits(&fast.grad),
            "passes {pass:?}: 2 threads"
        );
    }
}

/// `config.train.unsegmented.json` is the full-scale training config without segments: the
/// same run but for `training.gradient_checkpointing` and the output folder (so a change to
/// one config that misses the other is caught).
#[test]
fn unsegmented_full_config_differs_only_in_segments_and_output() {
    let read = |name: &str| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(example().join(name)).unwrap()).unwrap()
    };
    let (mut seg, mut unseg) = (
        read("config.train.json"),
        read("config.train.unsegmented.json"),
    );
    assert_eq!(seg["training"]["gradient_checkpointing"], 25);
    assert_eq!(unseg["training"]["gradient_checkpointing"], false);
    assert_ne!(
        seg["manifest"]["$OUTPUT_DIR"], unseg["manifest"]["$OUTPUT_DIR"],
        "the two configs must not replace each other's runs"
    );
    for c in [&mut seg, &mut unseg] {
        c["training"]
            .as_object_mut()
            .unwrap()
            .remove("gradient_checkpointing");
        c["manifest"].as_object_mut().unwrap().remove("$OUTPUT_DIR");
    }
    assert_eq!(seg, unseg);
}
