//! The nflows/Dingo export (`lockstep_npe::export`) against a stored reference made with
//! nflows itself (`tests/data/nflows_export/reference.json`, written by
//! `scripts/peers/nflows_export_check.py --write-reference`; provenance inside): a small flow
//! with a reduced-basis layer, an odd θ width, a non-trivial standardization and parameters
//! far from their initial values exports the state dict names, shapes and dtypes nflows'
//! modules expect, and lockstep's log-probabilities equal nflows' for the stored pairs (to
//! 1e-5); the same flow with BatchNorm (Dingo's default, eps 1e-3) against its own
//! reference (`reference_batch_norm.json`), running statistics far from their initial
//! values and `num_batches_tracked` included. Settings nflows has no counterpart for are
//! refused naming the key. The
//! permutations `posterior.safetensors` stores rebuild the flow (sampling gives the same
//! draws); files without them draw them from the seed as before.
//!
//! To remake the references: `LOCKSTEP_NFLOWS_EXPORT_DIR=DIR cargo test --release
//! --workspace --test npe_library -- nflows_export::` writes the exports into `DIR/none` and
//! `DIR/batch_norm`, then `python scripts/peers/nflows_export_check.py DIR/none
//! --write-reference crates/lockstep-npe/tests/data/nflows_export/reference.json` (and
//! `DIR/batch_norm` into `reference_batch_norm.json`; torch + nflows installed).

use lockstep_core::rng::SplitMix64;
use lockstep_npe::export::{check_settings, nflows_export, CheckPairs, NflowsExport};
use lockstep_npe::flow::ProjectionConfig;
use lockstep_npe::task::BasisLayout;
use lockstep_npe::trained::{restore_permutations, stored_permutations};
use lockstep_npe::{
    DeviceModel, EmbeddingConfig, FlowConfig, NetworkConfig, Norm, NpeNetwork, NpeSettings,
    Placement, Standardization,
};
use lockstep_train::Model;
use safetensors::SafeTensors;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

const THETA: usize = 3;
const BLOCKS: usize = 2;
const BINS: usize = 5;
const X: usize = BLOCKS * 2 * BINS;
const PAIRS: usize = 12;

fn reference(file: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/nflows_export")
        .join(file);
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

/// The reference's flow: a complex reduced-basis layer (2 blocks of 5 bins, 3 elements),
/// an embedding with an identity and a linear resize, 3 coupling steps of 4 bins.
fn network(norm: Norm) -> NpeNetwork {
    let config = NetworkConfig {
        embedding: EmbeddingConfig {
            hidden_dims: vec![8, 8, 6],
            output_dim: 5,
            norm,
            projection: Some(ProjectionConfig {
                size: 3,
                layout: BasisLayout::Complex {
                    blocks: BLOCKS,
                    bins: BINS,
                },
            }),
        },
        flow: FlowConfig {
            num_flow_steps: 3,
            hidden_dim: 8,
            num_transform_blocks: 2,
            num_bins: 4,
            tail_bound: 2.0,
            norm,
        },
        batch_norm_eps: lockstep_npe::layers::DINGO_BATCH_NORM_EPS,
    };
    let standardization = Standardization {
        theta_mean: vec![0.5, -1.0, 2.0],
        theta_std: vec![1.5, 0.5, 2.0],
        x_mean: (0..X).map(|i| 0.1 * i as f64).collect(),
        x_std: (0..X).map(|i| 0.5 + 0.05 * i as f64).collect(),
    };
    NpeNetwork::new(config, THETA, X, standardization, 11).unwrap()
}

/// Initial values plus N(0, 0.3²) noise: LU, splines and gates far from the identity.
fn parameters(net: &NpeNetwork) -> Vec<f32> {
    let (mut p, _) = net.initial_values(3);
    let mut rng = SplitMix64::new(17);
    p.iter_mut().for_each(|v| *v += (0.3 * rng.normal()) as f32);
    p
}

/// Running statistics far from their initial values: means N(0, 0.5²), variances in
/// [0.3, 1.8] (empty without BatchNorm).
fn running_statistics(net: &NpeNetwork) -> Vec<f32> {
    let layout = net.state_layout();
    let mut state = vec![0.0f32; layout.len()];
    let mut rng = SplitMix64::new(29);
    for (i, spec) in layout.specs().iter().enumerate() {
        let var = spec.name.ends_with("running_var");
        for v in layout.slice_mut(&mut state, i) {
            *v = if var {
                (0.3 + 1.5 * rng.uniform()) as f32
            } else {
                (0.5 * rng.normal()) as f32
            };
        }
    }
    state
}

fn model(net: &NpeNetwork, params: &[f32]) -> DeviceModel {
    let mut m = DeviceModel::new(net.clone(), 0, &Placement::Cpu).unwrap();
    m.set_parameters(params).unwrap();
    m.set_state(&running_statistics(net)).unwrap();
    m
}

/// Pairs with θ spread over 2.5 standard deviations, so some standardized components lie
/// beyond the tail bound 2 (the linear tails).
fn pairs(net: &NpeNetwork) -> (Vec<f32>, Vec<f32>) {
    let s = &net.standardization;
    let mut rng = SplitMix64::new(23);
    let theta = (0..PAIRS * THETA)
        .map(|i| (s.theta_mean[i % THETA] + 2.5 * s.theta_std[i % THETA] * rng.normal()) as f32)
        .collect();
    let x = (0..PAIRS * X)
        .map(|i| (s.x_mean[i % X] + s.x_std[i % X] * rng.normal()) as f32)
        .collect();
    (theta, x)
}

fn export(net: &NpeNetwork, params: &[f32]) -> NflowsExport {
    let (theta, x) = pairs(net);
    let log_prob = model(net, params).log_prob(&theta, &x, PAIRS);
    let names = vec!["a".to_string(), "b".to_string(), "c".to_string()];
    let checks = CheckPairs { theta, x, log_prob };
    let state = running_statistics(net);
    nflows_export(net, params, &state, 41, &checks, &names).unwrap()
}

fn floats(v: &Value) -> Vec<f32> {
    let mut out = Vec::new();
    let mut push = |v: &Value| out.push(v.as_f64().unwrap() as f32);
    for row in v.as_array().unwrap() {
        match row.as_array() {
            Some(r) => r.iter().for_each(&mut push),
            None => push(row),
        }
    }
    out
}

#[test]
fn export_matches_the_stored_nflows_reference() {
    let ex = matches_reference(Norm::None, "none", "reference.json");
    assert!(!ex.tensors.iter().any(|t| t.name.contains("batch_norm")));
}

#[test]
fn batch_norm_export_matches_the_stored_nflows_reference() {
    let ex = matches_reference(Norm::BatchNorm, "batch_norm", "reference_batch_norm.json");
    let named = |suffix: &str| {
        ex.tensors
            .iter()
            .filter(|t| t.name.ends_with(suffix))
            .count()
    };
    // Two BatchNorm1d per residual block: 3 embedding blocks, 3 steps of 2 conditioner blocks.
    for buffer in [
        "running_mean",
        "running_var",
        "weight",
        "num_batches_tracked",
    ] {
        let n = ex
            .tensors
            .iter()
            .filter(|t| t.name.contains(".batch_norm_layers.") && t.name.ends_with(buffer))
            .count();
        assert_eq!(n, 2 * (3 + 3 * 2), "{buffer}");
    }
    assert!(named(".norm_layers.0.weight") == 0);
    let tracked = ex
        .tensors
        .iter()
        .find(|t| t.name.ends_with("num_batches_tracked"))
        .unwrap();
    assert_eq!(tracked.values, lockstep_npe::export::Values::I64(vec![41]));
    assert!(tracked.shape.is_empty());
    let bk = &ex.settings["posterior_kwargs"]["base_transform_kwargs"];
    assert_eq!(bk["batch_norm"], true);
    assert_eq!(ex.settings["embedding_kwargs"]["batch_norm"], true);
    assert_eq!(ex.settings["batch_norm"]["eps"], 1e-3);
}

/// The export of the reference's flow with `norm` equals the stored nflows reference
/// `file`: names, shapes, dtypes and log-probabilities (written into
/// `$LOCKSTEP_NFLOWS_EXPORT_DIR/folder` when set, to remake the reference).
fn matches_reference(norm: Norm, folder: &str, file: &str) -> NflowsExport {
    let net = network(norm);
    let params = parameters(&net);
    let ex = export(&net, &params);
    if let Ok(dir) = std::env::var("LOCKSTEP_NFLOWS_EXPORT_DIR") {
        let dir = Path::new(&dir).join(folder);
        std::fs::create_dir_all(&dir).unwrap();
        ex.write(&dir).unwrap();
    }
    let reference = reference(file);

    // The names, shapes and dtypes of the written state dict are those nflows expects.
    let bytes = ex.state_dict_bytes().unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let written: BTreeMap<String, (Vec<usize>, String)> = file
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let dtype = match view.dtype() {
                safetensors::Dtype::F32 => "torch.float32",
                safetensors::Dtype::I64 => "torch.int64",
                other => panic!("{name}: dtype {other:?}"),
            };
            (name, (view.shape().to_vec(), dtype.to_string()))
        })
        .collect();
    let expected: BTreeMap<String, (Vec<usize>, String)> = reference["state_dict"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let shape = e[1]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as usize)
                .collect();
            (
                e[0].as_str().unwrap().to_string(),
                (shape, e[2].as_str().unwrap().to_string()),
            )
        })
        .collect();
    for (name, entry) in &expected {
        assert_eq!(written.get(name), Some(entry), "{name}");
    }
    assert_eq!(written, expected);
    assert!(written.contains_key("embedding_net.0.layers_rb.1.weight"));
    assert!(written
        .contains_key("flow._transform._transforms.3._transforms.1.unconstrained_upper_diag"));

    // lockstep's log-probabilities are nflows' at the stored pairs.
    let theta = floats(&reference["theta"]);
    let x = floats(&reference["x"]);
    let nflows = floats(&reference["log_prob"]);
    assert_eq!(nflows.len(), PAIRS);
    let (our_theta, our_x) = pairs(&net);
    assert_eq!((theta.clone(), x.clone()), (our_theta, our_x), "the pairs");
    let ours = model(&net, &params).log_prob(&theta, &x, PAIRS);
    for (i, (a, b)) in ours.iter().zip(&nflows).enumerate() {
        assert!((a - b).abs() <= 1e-5, "pair {i}: lockstep {a}, nflows {b}");
    }
    // The pairs reach the linear tails and the spline's interior.
    let s = &net.standardization;
    let z: Vec<f64> = theta
        .iter()
        .enumerate()
        .map(|(i, &t)| ((t as f64 - s.theta_mean[i % THETA]) / s.theta_std[i % THETA]).abs())
        .collect();
    assert!(z.iter().any(|&v| v > 2.0) && z.iter().any(|&v| v < 2.0));
    assert_eq!(
        ex.settings["permutations"],
        serde_json::to_value(net.permutations()).unwrap()
    );
    ex
}

fn settings(base_norm: &str, embedding_norm: &str) -> NpeSettings {
    let text = format!(
        "data:
  task: {{name: gaussian_linear, dim: 3}}
  num_samples: 1000
  train_fraction: 0.9
  seed: 5
model:
  posterior_model_type: normalizing_flow
  posterior_kwargs:
    num_flow_steps: 2
    base_transform_kwargs:
      hidden_dim: 16
      num_transform_blocks: 1
      {base_norm}
      num_bins: 8
  embedding_kwargs:
    output_dim: 8
    hidden_dims: [16, 16]
    {embedding_norm}
training:
  stage_0:
    epochs: 1
    batch_size: 100
    optimizer: {{type: adam, lr: 0.003}}
    scheduler: {{type: cosine, T_max: 1}}
local:
  device: cpu
"
    );
    NpeSettings::from_yaml(&text).unwrap().0
}

#[test]
fn settings_without_an_nflows_counterpart_are_refused_naming_the_key() {
    check_settings(&settings("norm: none", "batch_norm: false")).unwrap();
    let e = check_settings(&settings("norm: layer_norm", "norm: none"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("model.posterior_kwargs.base_transform_kwargs.norm") && e.contains("LayerNorm"),
        "{e}"
    );
    // Dingo's default batch norm exports; a settings file without batch_norm_eps gets 1e-3.
    let bn = settings("batch_norm: false", "batch_norm: true");
    assert_eq!(bn.model.batch_norm_eps, Some(1e-3));
    check_settings(&bn).unwrap();
    check_settings(&settings("norm: batch_norm", "norm: none")).unwrap();
    // Another eps (as runs stored before the key, with 1e-5) has no nflows counterpart.
    let mut legacy = settings("norm: batch_norm", "norm: none");
    legacy.model.batch_norm_eps = Some(1e-5);
    let e = check_settings(&legacy).unwrap_err().to_string();
    assert!(
        e.contains("model.batch_norm_eps: is 0.00001") && e.contains("eps 1e-3"),
        "{e}"
    );
    // The library call refuses the network itself too.
    let net = network(Norm::LayerNorm);
    let params = net.initial_values(0).0;
    let checks = CheckPairs {
        theta: vec![],
        x: vec![],
        log_prob: vec![],
    };
    let e = nflows_export(&net, &params, &[], 0, &checks, &[])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("embedding.norm") && e.contains("LayerNorm"),
        "{e}"
    );
}

/// An error with its sources, `a: b: c`.
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out = format!("{out}: {s}");
        source = s.source();
    }
    out
}

/// `file` rewritten with metadata `permutations` set to `perms` (`None`: removed).
fn rewrite_permutations(file: &Path, perms: Option<&Vec<Vec<usize>>>) {
    let data = std::fs::read(file).unwrap();
    let (_, meta) = SafeTensors::read_metadata(&data).unwrap();
    let mut meta = meta.metadata().clone().unwrap();
    match perms {
        Some(p) => meta.insert("permutations".into(), serde_json::to_string(p).unwrap()),
        None => meta.remove("permutations"),
    };
    let st = SafeTensors::deserialize(&data).unwrap();
    let out = safetensors::serialize(st.tensors(), Some(meta)).unwrap();
    std::fs::write(file, out).unwrap();
}

#[test]
fn stored_permutations_rebuild_the_flow_and_old_files_draw_them_from_the_seed() {
    let net = network(Norm::None);
    let params = parameters(&net);
    let m = model(&net, &params);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("posterior.safetensors");
    m.export(dir.path()).unwrap();
    assert_eq!(
        stored_permutations(&file).unwrap(),
        Some(net.permutations())
    );
    let x = &pairs(&net).1[..X];
    let before = m.sample(x, 64, 9);

    // Rebuilt from the stored permutations: the same draws as before.
    let mut rebuilt = network(Norm::None);
    assert!(restore_permutations(&mut rebuilt, dir.path()).unwrap());
    assert_eq!(model(&rebuilt, &params).sample(x, 64, 9), before);

    // The stored permutations are the ones used: other ones give other draws.
    let other: Vec<Vec<usize>> = net
        .permutations()
        .iter()
        .map(|p| p.iter().rev().copied().collect())
        .collect();
    assert_ne!(other, net.permutations());
    rewrite_permutations(&file, Some(&other));
    let mut changed = network(Norm::None);
    assert!(restore_permutations(&mut changed, dir.path()).unwrap());
    assert_eq!(changed.permutations(), other);
    assert_ne!(model(&changed, &params).sample(x, 64, 9), before);

    // A file written before the key existed: the permutations drawn from the seed, as then.
    rewrite_permutations(&file, None);
    let mut old = network(Norm::None);
    assert!(!restore_permutations(&mut old, dir.path()).unwrap());
    assert_eq!(model(&old, &params).sample(x, 64, 9), before);
    // No file at all: the same.
    assert!(!restore_permutations(&mut old, &dir.path().join("none")).unwrap());

    // Stored permutations that do not fit are refused, naming the file.
    rewrite_permutations(&file, Some(&vec![vec![0, 0, 1]; 3]));
    let e = chain(&restore_permutations(&mut old, dir.path()).unwrap_err());
    assert!(
        e.contains("posterior.safetensors") && e.contains("not a permutation"),
        "{e}"
    );
}
