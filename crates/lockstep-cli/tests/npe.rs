//! `lockstep npe` end to end: Dingo-shaped YAML settings train a posterior through the engine
//! (run.log, losses CSV, checkpoints, PyTorch-named export), `sample` writes CSV and HDF5,
//! `pp` writes the P-P plot and KS p-values; bad settings are refused naming the file and
//! key before anything is written; 2 thread replicas and 2 MPI ranks with local batch B
//! train like 1 replica with 2B.

use lockstep_comm::launch::{mpirun_command, run_with_limit, JobOutput};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const LOCKSTEP: &str = env!("CARGO_BIN_EXE_lockstep");

/// Settings for gaussian_linear in `dim` dimensions; `extra_local` is appended to `local`.
fn settings(
    dim: usize,
    norm: &str,
    num_samples: u64,
    epochs: u64,
    batch: usize,
    local: &str,
) -> String {
    format!(
        "data:
  task: {{name: gaussian_linear, dim: {dim}}}
  num_samples: {num_samples}
  train_fraction: 0.9
  seed: 5
model:
  posterior_model_type: normalizing_flow
  posterior_kwargs:
    num_flow_steps: 2
    base_transform_kwargs:
      hidden_dim: 16
      num_transform_blocks: 1
      activation: elu
      dropout_probability: 0.0
      norm: {norm}
      num_bins: 8
      base_transform_type: rq-coupling
      tail_bound: 3.0
  embedding_kwargs:
    output_dim: 8
    hidden_dims: [16, 16]
    activation: elu
    dropout: 0.0
    norm: {norm}
training:
  stage_0:
    epochs: {epochs}
    batch_size: {batch}
    optimizer:
      type: adam
      lr: 0.003
    scheduler:
      type: cosine
      T_max: {epochs}
local:
  device: cpu
{local}"
    )
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
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

/// The names in a safetensors file's header.
fn safetensors_names(path: &Path) -> Vec<String> {
    let data = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(data[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&data[8..8 + n]).unwrap();
    header
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| *k != "__metadata__")
        .cloned()
        .collect()
}

#[test]
fn train_sample_and_pp_from_dingo_settings() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cfg = write(
        d,
        "gl.yaml",
        &settings(
            2,
            "layer_norm",
            4000,
            3,
            128,
            "  replicas: 2\n  checkpoint_epochs: 1\n",
        ),
    );
    let run = d.join("run");
    let out = ok(lockstep(&["npe", "train", s(&cfg), "--train-dir", s(&run)]));
    // 3600 training simulations / 128 = 28 updates per epoch, 3 epochs.
    assert!(
        out.stdout.contains("Completed 84 optimizer updates."),
        "{}",
        out.stdout
    );
    assert!(out.stdout.contains("test loss"), "{}", out.stdout);
    let log = std::fs::read_to_string(run.join("run.log")).unwrap();
    assert!(
        log.contains("test loss (mean negative log-probability over 400 held-out simulations)"),
        "{log}"
    );
    let losses = std::fs::read_to_string(run.join("callbacks/losses.csv")).unwrap();
    assert_eq!(losses.lines().next(), Some("step,epoch,nll,total"));
    assert_eq!(losses.lines().count(), 85);
    for u in [28, 56, 84] {
        assert!(run
            .join(format!("checkpoints/update_{u:06}.safetensors"))
            .is_file());
    }
    let names = safetensors_names(&run.join("posterior.safetensors"));
    for n in [
        "embedding_net.initial_layer.weight",
        "flow.steps.0.lu_linear.lower_entries",
        "flow.steps.1.coupling.transform_net.final_layer.bias",
    ] {
        assert!(names.iter().any(|x| x == n), "{n} not in {names:?}");
    }
    // The loss went down: the mean of the last epoch is below the first epoch's.
    let rows: Vec<f64> = losses
        .lines()
        .skip(1)
        .map(|l| l.rsplit(',').next().unwrap().parse().unwrap())
        .collect();
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    assert!(mean(&rows[56..]) < mean(&rows[..28]) - 0.2, "{rows:?}");

    // sample: CSV and HDF5.
    let csv = d.join("samples.csv");
    ok(lockstep(&[
        "npe",
        "sample",
        s(&run),
        "--observation",
        "0.3,-0.2",
        "--num-samples",
        "2000",
        "--output",
        s(&csv),
    ]));
    let text = std::fs::read_to_string(&csv).unwrap();
    assert_eq!(text.lines().next(), Some("theta_0,theta_1"));
    assert_eq!(text.lines().count(), 2001);
    // The posterior mean is near the analytic 0.5 x = (0.15, -0.1) (posterior sd 0.22).
    let m: Vec<f64> = (0..2)
        .map(|j| {
            text.lines()
                .skip(1)
                .map(|l| l.split(',').nth(j).unwrap().parse::<f64>().unwrap())
                .sum::<f64>()
                / 2000.0
        })
        .collect();
    assert!(
        (m[0] - 0.15).abs() < 0.1 && (m[1] + 0.1).abs() < 0.1,
        "{m:?}"
    );
    let h5 = d.join("samples.h5");
    ok(lockstep(&[
        "npe",
        "sample",
        s(&run.join("checkpoints/update_000056.safetensors")),
        "--injection",
        "4",
        "--num-samples",
        "100",
        "--output",
        s(&h5),
    ]));
    let f = hdf5::File::open(&h5).unwrap();
    assert_eq!(f.dataset("samples").unwrap().shape(), vec![100, 2]);
    assert_eq!(f.dataset("injection_parameters").unwrap().shape(), vec![2]);
    assert_eq!(f.dataset("observation").unwrap().shape(), vec![2]);
    // A wrong observation width is refused naming both numbers.
    let bad = lockstep(&[
        "npe",
        "sample",
        s(&run),
        "--observation",
        "1,2,3",
        "--output",
        s(&d.join("x.csv")),
    ]);
    assert!(
        !bad.success() && bad.stderr.contains("3 values") && bad.stderr.contains("expects 2"),
        "{}",
        bad.all_output()
    );
    assert!(!d.join("x.csv").exists());

    // pp: plot, percentiles, KS p-values.
    let pp = ok(lockstep(&[
        "npe",
        "pp",
        s(&run),
        "--injections",
        "50",
        "--num-samples",
        "200",
    ]));
    assert!(pp.stdout.contains("theta_1: KS p-value"), "{}", pp.stdout);
    let png = std::fs::read(run.join("pp/pp.png")).unwrap();
    assert_eq!(&png[..4], b"\x89PNG");
    let ks = std::fs::read_to_string(run.join("pp/ks.csv")).unwrap();
    assert_eq!(ks.lines().count(), 3);
    let pct = std::fs::read_to_string(run.join("pp/pp.csv")).unwrap();
    assert_eq!(pct.lines().count(), 51);
}

#[test]
fn bad_settings_are_refused_naming_the_file_and_key_before_any_output() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let good = settings(2, "none", 1000, 1, 64, "");
    let run = d.join("run");
    for (from, to, want) in [
        (
            "num_flow_steps",
            "num_flow_stepz",
            "did you mean `num_flow_steps`",
        ),
        (
            "  device: cpu\n",
            "  device: cpu\n  num_workers: 4\n",
            "local.num_workers",
        ),
        (
            "local:",
            "  stage_1:\n    epochs: 1\nlocal:",
            "training.stage_1",
        ),
        (
            "batch_size: 64",
            "batch_size: 5000",
            "training.stage_0.batch_size",
        ),
        (
            "  device: cpu\n",
            "  device: cpu\n  replicas: 3\n",
            "3 replicas",
        ),
    ] {
        let text = good.replace(from, to);
        assert_ne!(text, good, "{from}");
        let cfg = write(d, "bad.yaml", &text);
        let out = lockstep(&["npe", "train", s(&cfg), "--train-dir", s(&run)]);
        assert!(!out.success(), "{to}: {}", out.all_output());
        assert!(
            out.stderr.contains("bad.yaml") && out.stderr.contains(want),
            "{to}: {}",
            out.stderr
        );
        assert!(!run.exists(), "{to}: an output was written");
    }
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// Invariants 4-7 for the NPE model through `lockstep npe train`: the same settings (total
/// batch 32) run serially, as 2 thread replicas and as 2 MPI ranks (local batch 16 each)
/// give the same parameters after 10 updates, with LayerNorm and with no normalization.
#[test]
fn two_thread_and_two_mpi_replicas_train_like_one() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for norm in ["none", "layer_norm"] {
        // 356 simulations x 0.9 = 320 training simulations: 10 updates of 32 in one epoch.
        let one = write(
            d,
            &format!("one_{norm}.yaml"),
            &settings(3, norm, 356, 1, 32, ""),
        );
        let two = write(
            d,
            &format!("two_{norm}.yaml"),
            &settings(3, norm, 356, 1, 32, "  replicas: 2\n"),
        );
        let (r1, r2, rm) = (
            d.join(format!("serial_{norm}")),
            d.join(format!("threads_{norm}")),
            d.join(format!("mpi_{norm}")),
        );
        ok(lockstep(&["npe", "train", s(&one), "--train-dir", s(&r1)]));
        ok(lockstep(&["npe", "train", s(&two), "--train-dir", s(&r2)]));
        let mut cmd = mpirun_command(2);
        cmd.arg(LOCKSTEP)
            .args(["npe", "train", s(&one), "--train-dir", s(&rm)]);
        let m = ok(run_with_limit(cmd, Duration::from_secs(120)).unwrap());
        assert_eq!(
            m.stdout.matches("Completed 10 optimizer updates.").count(),
            1,
            "{}",
            m.stdout
        );
        let read = |r: &Path| {
            lockstep_train::checkpoint::read(&r.join("checkpoints/update_000010.safetensors"))
                .unwrap()
                .trainable
        };
        let (a, b, c) = (read(&r1), read(&r2), read(&rm));
        let (dt, dm) = (rel_l2(&b, &a), rel_l2(&c, &a));
        eprintln!("{norm}: threads {dt:e}, mpi {dm:e}");
        assert!(
            dt <= 1e-5 && dm <= 1e-5,
            "{norm}: threads {dt:e}, mpi {dm:e}"
        );
        // The runs did use 2 replicas with local batch 16, and training moved the loss.
        for r in [&r2, &rm] {
            let log = std::fs::read_to_string(r.join("run.log")).unwrap();
            assert!(
                log.contains("2 replica(s)") && log.contains("local batch 16,"),
                "{log}"
            );
        }
        let first = std::fs::read_to_string(r1.join("callbacks/losses.csv")).unwrap();
        let l: Vec<f64> = first
            .lines()
            .skip(1)
            .map(|x| x.rsplit(',').next().unwrap().parse().unwrap())
            .collect();
        assert!(l[9] < l[0], "{l:?}");
    }
}

/// `examples/npe_gw_chirp/settings.yaml` with its budget cut (simulations, epochs, SVD
/// inputs) trains through the SVD-initialized layer, reports the basis in run.log, exports
/// the layer, and `sample --corner` draws the corner plot.
#[test]
fn the_gw_chirp_example_trains_with_a_tiny_budget() {
    let example =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/npe_gw_chirp/settings.yaml");
    let mut text = std::fs::read_to_string(&example).unwrap();
    for (from, to) in [
        ("num_samples: 100000", "num_samples: 1200"),
        ("epochs: 12", "epochs: 1"),
        ("T_max: 12", "T_max: 1"),
        ("num_training_samples: 2000", "num_training_samples: 200"),
        ("num_validation_samples: 200", "num_validation_samples: 20"),
    ] {
        assert!(text.contains(from), "the example no longer has `{from}`");
        text = text.replace(from, to);
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cfg = write(d, "gw.yaml", &text);
    let run = d.join("run");
    let out = ok(lockstep(&["npe", "train", s(&cfg), "--train-dir", s(&run)]));
    assert!(
        out.stdout.contains("SVD-initialized first embedding layer"),
        "{}",
        out.stdout
    );
    let log = std::fs::read_to_string(run.join("run.log")).unwrap();
    assert!(
        log.contains("2 block(s) x 24 basis elements from 200 inputs")
            && log.contains("validation mismatch over 20 held-out inputs"),
        "{log}"
    );
    let names = safetensors_names(&run.join("posterior.safetensors"));
    for n in [
        "embedding_net.layers_rb.0.weight",
        "embedding_net.layers_rb.1.bias",
        "embedding_net.initial_layer.weight",
    ] {
        assert!(names.iter().any(|x| x == n), "{n} not in {names:?}");
    }
    let corner = d.join("corner.png");
    ok(lockstep(&[
        "npe",
        "sample",
        s(&run),
        "--injection",
        "0",
        "--num-samples",
        "300",
        "--output",
        s(&d.join("samples.h5")),
        "--corner",
        s(&corner),
    ]));
    let png = std::fs::read(&corner).unwrap();
    assert_eq!(&png[..4], b"\x89PNG");
}
