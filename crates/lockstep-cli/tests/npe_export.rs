//! `lockstep npe export RUN --format nflows`: a trained run is written as an nflows/Dingo
//! state dict and settings (the log-probabilities are checked against nflows in
//! lockstep-npe's `tests/npe_library/nflows_export.rs` and `scripts/peers/nflows_export_check.py`);
//! bad input and networks without an nflows counterpart are refused naming the file or key
//! before anything is written. `sample` and a resumed stage rebuild the flow from the
//! permutations `posterior.safetensors` stores, and runs written before they were stored
//! draw them from the seed, giving the same samples as before.

use lockstep_comm::launch::{run_with_limit, JobOutput};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const LOCKSTEP: &str = env!("CARGO_BIN_EXE_lockstep");

/// gaussian_linear in 3 dimensions, `norm` in both networks, `stages` training stages of
/// one epoch each.
fn settings(norm: &str, stages: usize) -> String {
    let stage = |i: usize| {
        format!(
            "  stage_{i}:
    epochs: 1
    batch_size: 50
    optimizer: {{type: adam, lr: 0.01}}
    scheduler: {{type: cosine, T_max: 1}}
"
        )
    };
    let stages: String = (0..stages).map(stage).collect();
    format!(
        "data:
  task: {{name: gaussian_linear, dim: 3}}
  num_samples: 500
  train_fraction: 0.9
  seed: 5
model:
  posterior_model_type: normalizing_flow
  posterior_kwargs:
    num_flow_steps: 3
    base_transform_kwargs:
      hidden_dim: 12
      num_transform_blocks: 1
      norm: {norm}
      num_bins: 6
      tail_bound: 3.0
  embedding_kwargs:
    output_dim: 6
    hidden_dims: [12, 12]
    norm: {norm}
training:
{stages}local:
  device: cpu
"
    )
}

fn lockstep(args: &[&str]) -> JobOutput {
    let mut cmd = Command::new(LOCKSTEP);
    cmd.args(args);
    run_with_limit(cmd, Duration::from_secs(120)).unwrap()
}

fn ok(out: JobOutput) -> JobOutput {
    assert!(out.success(), "{}", out.all_output());
    out
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn train(d: &Path, name: &str, norm: &str, stages: usize) -> PathBuf {
    let cfg = d.join(format!("{name}.yaml"));
    std::fs::write(&cfg, settings(norm, stages)).unwrap();
    let run = d.join(name);
    ok(lockstep(&["npe", "train", s(&cfg), "--train-dir", s(&run)]));
    run
}

/// The header of a safetensors file.
fn header(path: &Path) -> serde_json::Value {
    let data = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(data[..8].try_into().unwrap()) as usize;
    serde_json::from_slice(&data[8..8 + n]).unwrap()
}

fn stored_permutations(path: &Path) -> Option<Vec<Vec<usize>>> {
    let h = header(path);
    let text = h["__metadata__"].get("permutations")?.as_str()?.to_string();
    Some(serde_json::from_str(&text).unwrap())
}

/// `path` rewritten with metadata `permutations` set to `perms` (`None`: removed), the
/// tensors unchanged.
fn rewrite_permutations(path: &Path, perms: Option<&Vec<Vec<usize>>>) {
    let data = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(data[..8].try_into().unwrap()) as usize;
    let mut h: serde_json::Value = serde_json::from_slice(&data[8..8 + n]).unwrap();
    let meta = h["__metadata__"].as_object_mut().unwrap();
    match perms {
        Some(p) => meta.insert(
            "permutations".into(),
            serde_json::Value::String(serde_json::to_string(p).unwrap()),
        ),
        None => meta.remove("permutations"),
    };
    let mut text = serde_json::to_vec(&h).unwrap();
    while !text.len().is_multiple_of(8) {
        text.push(b' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    out.extend_from_slice(&data[8 + n..]);
    std::fs::write(path, out).unwrap();
}

fn sample(run: &Path, out: &Path) -> String {
    ok(lockstep(&[
        "npe",
        "sample",
        s(run),
        "--observation",
        "0.3,-0.2,0.5",
        "--num-samples",
        "40",
        "--seed",
        "4",
        "--output",
        s(out),
    ]));
    std::fs::read_to_string(out).unwrap()
}

#[test]
fn export_writes_an_nflows_state_dict_and_refuses_what_nflows_lacks() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let run = train(d, "plain", "none", 1);
    let out = d.join("export");
    let o = ok(lockstep(&[
        "npe",
        "export",
        s(&run),
        "--format",
        "dingo",
        "--output-dir",
        s(&out),
    ]));
    assert!(
        o.stdout.contains("posterior.nflows.safetensors"),
        "{}",
        o.stdout
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("posterior.nflows.json")).unwrap())
            .unwrap();
    assert_eq!(json["format"], "lockstep-nflows-export-1");
    assert_eq!(json["check"]["log_prob"].as_array().unwrap().len(), 8);
    assert_eq!(json["posterior_kwargs"]["num_flow_steps"], 3);
    let perms = stored_permutations(&run.join("posterior.safetensors")).unwrap();
    assert_eq!(json["permutations"], serde_json::to_value(&perms).unwrap());
    let h = header(&out.join("posterior.nflows.safetensors"));
    for name in [
        "embedding_net.0.initial_layer.weight",
        "embedding_net.0.resize_layers.1.weight",
        "flow._transform._transforms.0._transforms.0._transforms.0._permutation",
        "flow._transform._transforms.2._transforms.1.transform_net.blocks.0.context_layer.weight",
        "flow._transform._transforms.3._transforms.1.unconstrained_upper_diag",
    ] {
        assert!(h.get(name).is_some(), "{name} missing: {h}");
    }
    assert_eq!(
        h["flow._transform._transforms.1._transforms.0._transforms.0._permutation"]["dtype"],
        "I64"
    );
    // Into the run directory by default.
    ok(lockstep(&["npe", "export", s(&run)]));
    assert!(run.join("posterior.nflows.json").is_file());

    // Bad input: named, nothing written.
    let bad = d.join("bad_out");
    let e = lockstep(&[
        "npe",
        "export",
        s(&run),
        "--format",
        "onnx",
        "--output-dir",
        s(&bad),
    ]);
    assert!(
        !e.success() && e.stderr.contains("--format onnx"),
        "{}",
        e.all_output()
    );
    let missing = d.join("no_such_run");
    let e = lockstep(&["npe", "export", s(&missing), "--output-dir", s(&bad)]);
    assert!(
        !e.success() && e.stderr.contains("no_such_run"),
        "{}",
        e.all_output()
    );
    std::fs::create_dir(d.join("empty")).unwrap();
    let e = lockstep(&[
        "npe",
        "export",
        s(&d.join("empty")),
        "--output-dir",
        s(&bad),
    ]);
    assert!(
        !e.success() && e.stderr.contains("empty"),
        "{}",
        e.all_output()
    );

    // LayerNorm has no nflows counterpart: refused naming the key and the run's config.
    // (BatchNorm exports: batch_norm_runs_use_dingos_eps_export_their_statistics_and_...)
    let ln = train(d, "layer", "layer_norm", 1);
    let e = lockstep(&["npe", "export", s(&ln), "--output-dir", s(&bad)]);
    assert!(!e.success(), "{}", e.all_output());
    assert!(
        e.stderr.contains("model.embedding_kwargs.norm")
            && e.stderr.contains("LayerNorm")
            && e.stderr.contains("config.json"),
        "{}",
        e.stderr
    );
    assert!(!bad.exists());
}

#[test]
fn samples_and_resumed_stages_use_the_stored_permutations() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let run = train(d, "two", "none", 2);
    let last = run.join("stage_1/posterior.safetensors");
    let drawn = stored_permutations(&last).unwrap();
    assert_eq!(
        stored_permutations(&run.join("stage_0/posterior.safetensors")),
        Some(drawn.clone())
    );
    let before = sample(&run, &d.join("a.csv"));

    // A run written before the permutations were stored: drawn from the seed, same samples.
    rewrite_permutations(&last, None);
    assert_eq!(sample(&run, &d.join("b.csv")), before);
    // The stored permutations are the ones used.
    let other: Vec<Vec<usize>> = drawn
        .iter()
        .map(|p| p.iter().rev().copied().collect())
        .collect();
    assert_ne!(other, drawn);
    rewrite_permutations(&last, Some(&other));
    assert_ne!(sample(&run, &d.join("c.csv")), before);

    // Stage 1 resumed from the checkpoint that ends stage 0 rebuilds the flow from stage 0's
    // stored permutations: the same samples as the uninterrupted run.
    let cfg = d.join("two.yaml");
    let end0 = run.join("stage_0/checkpoints/latest");
    let resume = || {
        ok(lockstep(&[
            "npe",
            "train",
            s(&cfg),
            "--train-dir",
            s(&run),
            "--resume",
            s(&end0),
        ]))
    };
    resume();
    assert_eq!(stored_permutations(&last), Some(drawn.clone()));
    assert_eq!(sample(&run, &d.join("d.csv")), before);
    // With other permutations stored in stage 0, stage 1 trains and samples with them.
    rewrite_permutations(&run.join("stage_0/posterior.safetensors"), Some(&other));
    resume();
    assert_eq!(stored_permutations(&last), Some(other));
    assert_ne!(sample(&run, &d.join("e.csv")), before);
}

/// The int64 scalar `name` of a safetensors file.
fn int64_scalar(path: &Path, name: &str) -> i64 {
    let data = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(data[..8].try_into().unwrap()) as usize;
    let h = header(path);
    let e = &h[name];
    assert_eq!(e["dtype"], "I64", "{name}: {e}");
    assert_eq!(e["shape"], serde_json::json!([]), "{name}: {e}");
    let start = 8 + n + e["data_offsets"][0].as_u64().unwrap() as usize;
    i64::from_le_bytes(data[start..start + 8].try_into().unwrap())
}

/// `run`'s config.json with `model.batch_norm_eps` of its `npe` section set to `eps`
/// (`None`: removed, as runs stored before the key).
fn set_stored_eps(run: &Path, eps: Option<f64>) {
    let path = run.join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let model = c["npe"]["model"].as_object_mut().unwrap();
    match eps {
        Some(e) => model.insert("batch_norm_eps".into(), serde_json::json!(e)),
        None => model.remove("batch_norm_eps"),
    };
    std::fs::write(&path, serde_json::to_string_pretty(&c).unwrap()).unwrap();
}

#[test]
fn batch_norm_runs_use_dingos_eps_export_their_statistics_and_old_runs_keep_theirs() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let run = train(d, "bn", "batch_norm", 1);
    // A new run stores the eps it trained with: nflows'/Dingo's 1e-3.
    let c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("config.json")).unwrap()).unwrap();
    assert_eq!(c["npe"]["model"]["batch_norm_eps"], 1e-3);

    let out = d.join("export");
    ok(lockstep(&[
        "npe",
        "export",
        s(&run),
        "--output-dir",
        s(&out),
    ]));
    let state = out.join("posterior.nflows.safetensors");
    let h = header(&state);
    for layer in [
        "embedding_net.0.blocks.1.batch_norm_layers.0",
        "flow._transform._transforms.2._transforms.1.transform_net.blocks.0.batch_norm_layers.1",
    ] {
        for buffer in ["weight", "bias", "running_mean", "running_var"] {
            assert_eq!(
                h[format!("{layer}.{buffer}")]["dtype"],
                "F32",
                "{layer}.{buffer}"
            );
        }
        // 450 training simulations in batches of 50, one epoch: 9 forward passes.
        assert_eq!(
            int64_scalar(&state, &format!("{layer}.num_batches_tracked")),
            9
        );
    }
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("posterior.nflows.json")).unwrap())
            .unwrap();
    assert_eq!(json["embedding_kwargs"]["batch_norm"], true);
    assert_eq!(
        json["posterior_kwargs"]["base_transform_kwargs"]["batch_norm"],
        true
    );
    assert_eq!(json["batch_norm"]["eps"], 1e-3);

    // A run stored before the key was trained with eps 1e-5 and keeps it: its samples are
    // those of the key set to 1e-5, not 1e-3's, and it does not export (nflows has 1e-3).
    let new_samples = sample(&run, &d.join("new.csv"));
    set_stored_eps(&run, None);
    let old_samples = sample(&run, &d.join("old.csv"));
    assert_ne!(old_samples, new_samples);
    set_stored_eps(&run, Some(1e-5));
    assert_eq!(sample(&run, &d.join("legacy.csv")), old_samples);
    set_stored_eps(&run, None);
    let bad = d.join("bad");
    let e = lockstep(&["npe", "export", s(&run), "--output-dir", s(&bad)]);
    assert!(
        !e.success()
            && e.stderr.contains("model.batch_norm_eps")
            && e.stderr.contains("1e-5")
            && e.stderr.contains("config.json"),
        "{}",
        e.all_output()
    );
    assert!(!bad.exists());
    set_stored_eps(&run, Some(1e-3));
    assert_eq!(sample(&run, &d.join("again.csv")), new_samples);
}
