//! Training through lockstep's engine: the gaussian_linear posterior against its closed form,
//! replicas against one replica with the whole batch (invariants 4-7), SyncBatchNorm under
//! replicas and BatchNorm's running statistics across a checkpoint resume.

use lockstep_comm::World;
use lockstep_npe::{
    DeviceModel, EmbeddingConfig, FlowConfig, GaussianLinear, NetworkConfig, Norm, NpeNetwork,
    Placement, Task, TaskSource, TwoMoons,
};
use lockstep_train::job::run_job;
use lockstep_train::{checkpoint, EngineConfig, EngineOptions, Model, TrainError, TrainSummary};
use serde_json::{json, Value};
use std::path::Path;
use std::sync::Arc;

fn network(
    task: &dyn Task,
    norm: Norm,
    hidden: usize,
    steps: usize,
    tail_bound: f64,
) -> NpeNetwork {
    let config = NetworkConfig {
        embedding: EmbeddingConfig {
            hidden_dims: vec![hidden, hidden],
            output_dim: 8,
            norm,
            projection: None,
        },
        flow: FlowConfig {
            num_flow_steps: steps,
            hidden_dim: hidden,
            num_transform_blocks: 1,
            num_bins: 8,
            tail_bound,
            norm,
        },
        batch_norm_eps: lockstep_npe::layers::DINGO_BATCH_NORM_EPS,
    };
    NpeNetwork::new(
        config,
        task.theta_dim(),
        task.x_dim(),
        task.standardization(),
        17,
    )
    .unwrap()
}

fn config(
    dir: &Path,
    name: &str,
    batch: usize,
    dist: Value,
    updates: u64,
    optimizer: Value,
) -> Value {
    let mut run = json!({"batch_size": batch, "seed": 23});
    if !dist.is_null() {
        run["distribution"] = dist;
    }
    json!({
        "run": run,
        "training": {"optimizer": optimizer, "optimizer_updates": updates, "checksum_every": 1, "log_every": 100},
        "output": {"output_dir": dir.join(name).to_string_lossy(), "overwrite_output_dir": true},
    })
}

fn train(
    config: &Value,
    net: &NpeNetwork,
    task: Arc<dyn Task>,
    resume: Option<&Path>,
) -> Result<TrainSummary, TrainError> {
    train_on(
        config,
        net,
        |seed| TaskSource::new(task.clone(), seed),
        resume,
    )
}

/// [`train`] on the source `source(run.seed)`.
fn train_on(
    config: &Value,
    net: &NpeNetwork,
    source: impl Fn(u64) -> TaskSource + Sync,
    resume: Option<&Path>,
) -> Result<TrainSummary, TrainError> {
    let world = World::init(lockstep_comm::launch::ComputeKind::Cpu, true).unwrap();
    let cfg = EngineConfig::from_json(config, Path::new("/")).unwrap();
    // `..Default::default()` fills the fault-injection field that exists when another
    // workspace member enables lockstep-train's `testing` feature.
    #[allow(clippy::needless_update)]
    let opts = EngineOptions {
        resolved_config: config.clone(),
        resume: resume.map(Path::to_path_buf),
        quiet: true,
        ..Default::default()
    };
    let seed = cfg.seed;
    run_job(&world, &cfg, &opts, |_rank| {
        Ok((
            DeviceModel::new(net.clone(), seed, &Placement::Cpu).unwrap(),
            source(seed),
        ))
    })
}

fn final_state(dir: &Path, update: u64) -> checkpoint::TrainState {
    checkpoint::read(&dir.join(format!("checkpoints/update_{update:06}.safetensors"))).unwrap()
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// Invariants 4-7 for this model: 2 thread replicas x B train like 1 replica x 2B.
#[test]
fn two_thread_replicas_match_one_replica_with_twice_the_batch() {
    let task: Arc<dyn Task> = Arc::new(GaussianLinear::new(3));
    let adam = json!({"name": "adam", "learning_rate": 1e-3});
    for norm in [Norm::None, Norm::LayerNorm] {
        let net = network(task.as_ref(), norm, 16, 2, 3.0);
        let dir = tempfile::tempdir().unwrap();
        let serial = config(dir.path(), "serial", 32, Value::Null, 10, adam.clone());
        let threads = config(
            dir.path(),
            "threads",
            16,
            json!({"strategy": "threads", "global_batch_size": 32}),
            10,
            adam.clone(),
        );
        let a = train(&serial, &net, task.clone(), None).unwrap();
        let b = train(&threads, &net, task.clone(), None).unwrap();
        assert_eq!((a.updates, b.updates), (10, 10));
        let (pa, pb) = (
            final_state(&dir.path().join("serial"), 10),
            final_state(&dir.path().join("threads"), 10),
        );
        let d = rel_l2(&pb.trainable, &pa.trainable);
        eprintln!("{norm:?}: relative L2 difference {d:e}");
        assert!(
            d <= 1e-5,
            "{norm:?}: relative L2 difference {d:e} after 10 updates"
        );
        for (la, lb) in a.loss_history.iter().zip(&b.loss_history) {
            assert!(
                (la[0] - lb[0]).abs() <= 1e-5 * la[0].abs().max(1.0),
                "{norm:?}: losses {la:?} vs {lb:?}"
            );
        }
        // The oracle is not trivial: another global batch trains to other parameters, and the
        // parameters moved.
        let other = config(dir.path(), "other", 16, Value::Null, 10, adam.clone());
        train(&other, &net, task.clone(), None).unwrap();
        assert!(
            rel_l2(
                &final_state(&dir.path().join("other"), 10).trainable,
                &pa.trainable
            ) > 1e-4
        );
        let (init, _) = net.initial_values(23);
        assert!(rel_l2(&init, &pa.trainable) > 1e-4);
    }
}

/// BatchNorm couples a batch's samples: under 2 thread replicas it runs as SyncBatchNorm and
/// trains like one replica with the whole batch (parameters, losses and running statistics,
/// to 1e-5), and its running statistics survive a checkpoint resume bit for bit.
#[test]
fn sync_batch_norm_replicas_match_one_replica_and_resume_exactly() {
    let task: Arc<dyn Task> = Arc::new(GaussianLinear::new(2));
    let net = network(task.as_ref(), Norm::BatchNorm, 16, 2, 3.0);
    let dir = tempfile::tempdir().unwrap();
    // SGD with momentum: the bias of a linear layer just before a BatchNorm layer has a
    // gradient of 0 up to rounding, which Adam would scale up to steps of ±lr.
    let sgd = json!({"name": "sgd", "learning_rate": 3e-3, "momentum": 0.9});
    let threads = config(
        dir.path(),
        "threads",
        8,
        json!({"strategy": "threads", "global_batch_size": 16}),
        6,
        sgd.clone(),
    );
    let synced = train(&threads, &net, task.clone(), None).unwrap();
    let log = std::fs::read_to_string(dir.path().join("threads/run.log")).unwrap_or_default();
    assert!(
        log.contains("SyncBatchNorm"),
        "the warning is logged: {log}"
    );

    let whole = config(dir.path(), "whole", 16, Value::Null, 6, sgd.clone());
    let whole_run = train(&whole, &net, task.clone(), None).unwrap();
    let first = config(dir.path(), "part", 16, Value::Null, 3, sgd.clone());
    train(&first, &net, task.clone(), None).unwrap();
    let rest = config(dir.path(), "rest", 16, Value::Null, 6, sgd);
    train(
        &rest,
        &net,
        task.clone(),
        Some(
            &dir.path()
                .join("part/checkpoints/update_000003.safetensors"),
        ),
    )
    .unwrap();
    let (a, b) = (
        final_state(&dir.path().join("whole"), 6),
        final_state(&dir.path().join("rest"), 6),
    );
    assert_eq!(a.trainable, b.trainable);
    assert_eq!(a.frozen, b.frozen, "running statistics");
    let t = final_state(&dir.path().join("threads"), 6);
    let d = rel_l2(&t.trainable, &a.trainable);
    eprintln!("SyncBatchNorm vs BatchNorm: parameters differ by {d:e}");
    assert!(
        d <= 1e-5,
        "SyncBatchNorm vs BatchNorm: parameters differ by {d:e}"
    );
    let d = rel_l2(&t.frozen, &a.frozen);
    assert!(d <= 1e-5, "running statistics differ by {d:e}");
    for (la, lb) in synced.loss_history.iter().zip(&whole_run.loss_history) {
        assert!(
            (la[0] - lb[0]).abs() <= 1e-5 * lb[0].abs().max(1.0),
            "losses {la:?} vs {lb:?}"
        );
    }
    let (_, initial_state) = net.initial_values(23);
    assert_ne!(
        a.frozen, initial_state,
        "the running statistics were updated"
    );
}

/// The trained posterior of gaussian_linear (3 dimensions) matches the closed form for several
/// observations: mean within 0.1 posterior standard deviations, covariance within 15%; and it
/// is calibrated: a P-P test over 100 injections gives every parameter a KS p-value > 0.01.
#[test]
fn gaussian_linear_posterior_matches_the_analytic_one() {
    let gl = GaussianLinear::new(3);
    let task: Arc<dyn Task> = Arc::new(gl.clone());
    let net = network(task.as_ref(), Norm::LayerNorm, 32, 3, 4.0);
    let dir = tempfile::tempdir().unwrap();
    let updates = 1500;
    let adam = json!({"name": "adam", "learning_rate": 3e-3,
        "schedule": {"name": "warmup_cosine", "warmup_updates": 50, "min_learning_rate": 1e-5}});
    let c = config(dir.path(), "gl", 256, Value::Null, updates, adam);
    let t0 = std::time::Instant::now();
    train(&c, &net, task.clone(), None).unwrap();
    eprintln!(
        "trained {updates} updates in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    let state = final_state(&dir.path().join("gl"), updates);
    let mut model = DeviceModel::new(net.clone(), 0, &Placement::Cpu).unwrap();
    model.trainable_mut().copy_from_slice(&state.trainable);
    model.frozen_mut().copy_from_slice(&state.frozen);

    let d = 3;
    let n = 4000;
    for (k, x) in [
        [0.0f32, 0.0, 0.0],
        [0.5, -0.3, 0.2],
        [-0.6, 0.4, 0.8],
        [0.3, 0.9, -0.5],
    ]
    .iter()
    .enumerate()
    {
        let x64: Vec<f64> = x.iter().map(|v| *v as f64).collect();
        let (mean, var) = gl.posterior(&x64);
        let s = model.sample(x, n, 1000 + k as u64);
        let m: Vec<f64> = (0..d)
            .map(|j| (0..n).map(|i| s[i * d + j] as f64).sum::<f64>() / n as f64)
            .collect();
        let mut cov = vec![0.0f64; d * d];
        for i in 0..n {
            for a in 0..d {
                for b in 0..d {
                    cov[a * d + b] += (s[i * d + a] as f64 - m[a]) * (s[i * d + b] as f64 - m[b])
                        / (n - 1) as f64;
                }
            }
        }
        let sd = var.sqrt();
        let worst = (0..d)
            .map(|j| (m[j] - mean[j]).abs() / sd)
            .fold(0.0, f64::max);
        for j in 0..d {
            assert!(
                (m[j] - mean[j]).abs() < 0.1 * sd,
                "x {x:?}: posterior mean {m:?} vs analytic {mean:?} (sd {sd})"
            );
        }
        let exact: Vec<f64> = (0..d * d)
            .map(|i| if i % (d + 1) == 0 { var } else { 0.0 })
            .collect();
        let err = cov
            .iter()
            .zip(&exact)
            .map(|(a, b)| (a - b).powi(2))
            .sum::<f64>()
            .sqrt()
            / exact.iter().map(|b| b * b).sum::<f64>().sqrt();
        eprintln!("x {x:?}: mean error {worst:.3} sd, covariance error {err:.3}");
        assert!(
            err < 0.15,
            "x {x:?}: covariance {cov:?} vs {var}·I (relative error {err:.3})"
        );
        // The density agrees with the samples' normalization: log q at the analytic mean is
        // close to the analytic log-density there.
        let lq =
            model.log_prob(&mean.iter().map(|v| *v as f32).collect::<Vec<_>>(), x, 1)[0] as f64;
        let lp = -0.5 * d as f64 * (2.0 * std::f64::consts::PI * var).ln();
        assert!(
            (lq - lp).abs() < 0.15,
            "x {x:?}: log q(mean) {lq} vs analytic {lp}"
        );
    }
    // Calibration over 100 injections from the prior (500 posterior samples each).
    let r = model.pp_test(&gl, 2024, 100, 500).unwrap();
    eprintln!(
        "P-P KS p-values {:?}; first injections {:?}",
        r.p_values,
        &r.percentiles[..3]
    );
    assert_eq!(r.percentiles.len(), 100);
    assert!(
        r.min_p_value() > 0.01,
        "P-P test: KS p-values {:?}",
        r.p_values
    );
    // The test can fail: the posterior of another observation model is not calibrated here.
    let wider = GaussianLinear {
        simulator_scale: 0.4,
        ..gl.clone()
    };
    let bad = model.pp_test(&wider, 2024, 100, 500).unwrap();
    assert!(
        bad.min_p_value() < 0.01,
        "a mismatched task passed the P-P test: {:?}",
        bad.p_values
    );
}

/// The density of a flow trained on two_moons (a bimodal posterior) integrates to 1 ± 1e-2
/// over θ for a fixed observation (midpoint rule on a grid covering the prior and beyond).
#[test]
fn density_of_a_trained_2d_flow_integrates_to_one() {
    let task: Arc<dyn Task> = Arc::new(TwoMoons);
    let net = network(task.as_ref(), Norm::LayerNorm, 32, 3, 3.0);
    let dir = tempfile::tempdir().unwrap();
    let adam = json!({"name": "adam", "learning_rate": 3e-3});
    let c = config(dir.path(), "tm", 256, Value::Null, 300, adam);
    train(&c, &net, task.clone(), None).unwrap();
    let state = final_state(&dir.path().join("tm"), 300);
    let mut model = DeviceModel::new(net.clone(), 0, &Placement::Cpu).unwrap();
    model.trainable_mut().copy_from_slice(&state.trainable);
    let x = [0.0f32, 0.1];
    let (l, g) = (4.0f64, 400usize);
    let h = 2.0 * l / g as f64;
    let mut total = 0.0f64;
    let mut prior_box = 0.0f64;
    for row in 0..g {
        let t0 = -l + (row as f64 + 0.5) * h;
        let theta: Vec<f32> = (0..g)
            .flat_map(|c| [t0 as f32, (-l + (c as f64 + 0.5) * h) as f32])
            .collect();
        let rows: Vec<f32> = (0..g).flat_map(|_| x).collect();
        let lp = model.log_prob(&theta, &rows, g);
        for (c, v) in lp.iter().enumerate() {
            let m = (*v as f64).exp() * h * h;
            total += m;
            let t1 = -l + (c as f64 + 0.5) * h;
            if t0.abs() <= 1.0 && t1.abs() <= 1.0 {
                prior_box += m;
            }
        }
    }
    eprintln!("∫ q = {total}, mass inside the prior's support {prior_box}");
    assert!((total - 1.0).abs() <= 1e-2, "∫ q(θ|x) dθ = {total}");
    // Trained: the mass sits inside the prior's support [-1, 1]².
    assert!(prior_box > 0.9, "mass in the prior box {prior_box}");
}

/// Every epoch logs its mean training loss and the validation loss over the held-out
/// simulations, whatever the schedule (Dingo and sbi users read both each epoch); the last
/// epoch's validation loss is the model's loss on the held-out set.
#[test]
fn every_epoch_logs_its_train_and_validation_loss() {
    let task: Arc<dyn Task> = Arc::new(GaussianLinear::new(2));
    let net = network(task.as_ref(), Norm::None, 16, 2, 3.0);
    let dir = tempfile::tempdir().unwrap();
    let adam = json!({"name": "adam", "learning_rate": 3e-3});
    let c = config(dir.path(), "epochs", 16, Value::Null, 12, adam);
    let source = |seed| TaskSource::dataset(task.clone(), seed, 64).with_validation(64, 40);
    let summary = train_on(&c, &net, source, None).unwrap();
    let log = std::fs::read_to_string(dir.path().join("epochs/run.log")).unwrap();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("validation loss"))
        .collect();
    // 64 training simulations in batches of 16: 4 updates per epoch, 3 epochs.
    assert_eq!(lines.len(), 3, "{log}");
    let number = |l: &str, key: &str| -> f64 {
        let rest = l.split(key).nth(1).unwrap();
        rest.split([',', ';'])
            .next()
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    };
    for (e, l) in lines.iter().enumerate() {
        assert!(l.contains(&format!("epoch {}: train loss", e + 1)), "{l}");
        assert!(number(l, "train loss").is_finite() && number(l, "validation loss").is_finite());
        assert!(l.contains("learning rate 3e-3"), "{l}");
    }
    // The train loss is the mean of the epoch's logged losses.
    let last: f64 = summary.loss_history[8..12]
        .iter()
        .map(|l| l.iter().sum::<f64>())
        .sum::<f64>()
        / 4.0;
    let logged = number(lines[2], "train loss");
    assert!(
        (logged - last).abs() <= 1e-6 * last.abs().max(1.0),
        "{logged} vs {last}"
    );
}

/// `training.optimizer.schedule` reduce_on_plateau steps on the validation loss (the
/// held-out simulations) at each epoch end: with patience 0 and a threshold no later epoch
/// can beat, the rate halves after every epoch but the first; 2 thread replicas take the
/// same decisions (same parameters, 1e-5); resuming from an epoch-end checkpoint restores
/// the schedule's state (bit for bit); a run without a validation set is refused.
#[test]
fn reduce_on_plateau_steps_on_the_validation_loss() {
    let task: Arc<dyn Task> = Arc::new(GaussianLinear::new(2));
    let net = network(task.as_ref(), Norm::LayerNorm, 16, 2, 3.0);
    let dir = tempfile::tempdir().unwrap();
    let sgd = json!({"name": "sgd", "learning_rate": 4e-3, "momentum": 0.9,
        "schedule": {"name": "reduce_on_plateau", "factor": 0.5, "patience": 0, "threshold": 0.9}});
    let run = |name: &str, batch: usize, dist: Value, updates: u64, resume: Option<&Path>| {
        let mut c = config(dir.path(), name, batch, dist, updates, sgd.clone());
        c["training"]["checkpoint_every"] = json!(4);
        let source = |seed| TaskSource::dataset(task.clone(), seed, 64).with_validation(64, 40);
        train_on(&c, &net, source, resume)
    };
    // 64 training simulations in batches of 16: 4 updates per epoch, 4 epochs.
    run("serial", 16, Value::Null, 16, None).unwrap();
    let log = std::fs::read_to_string(dir.path().join("serial/run.log")).unwrap();
    let rates: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("validation loss"))
        .map(|l| l.rsplit("learning rate ").next().unwrap())
        .collect();
    assert_eq!(
        rates,
        [
            "4e-3",
            "2e-3 (reduced on plateau)",
            "1e-3 (reduced on plateau)",
            "5e-4 (reduced on plateau)"
        ],
        "{log}"
    );
    let threads = json!({"strategy": "threads", "global_batch_size": 16});
    run("threads", 8, threads, 16, None).unwrap();
    let (a, b) = (
        final_state(&dir.path().join("serial"), 16),
        final_state(&dir.path().join("threads"), 16),
    );
    let d = rel_l2(&b.trainable, &a.trainable);
    assert!(d <= 1e-5, "threads vs serial: {d:e}");
    let (pa, pb) = (a.plateau.unwrap(), b.plateau.unwrap());
    assert_eq!(
        (pa.learning_rate, pa.bad_epochs, pa.cooldown_left),
        (pb.learning_rate, pb.bad_epochs, pb.cooldown_left)
    );
    assert!(
        (pa.best - pb.best).abs() <= 1e-5 * pa.best.abs(),
        "{pa:?} {pb:?}"
    );
    let mid = dir
        .path()
        .join("serial/checkpoints/update_000008.safetensors");
    run("resumed", 16, Value::Null, 16, Some(&mid)).unwrap();
    let c = final_state(&dir.path().join("resumed"), 16);
    assert_eq!(c.trainable, a.trainable);
    assert_eq!(c.plateau, a.plateau);
    assert_eq!(a.plateau.unwrap().learning_rate, 5e-4);

    // No validation set: refused before training, naming the key.
    let c = config(dir.path(), "none", 16, Value::Null, 4, sgd.clone());
    let e = train(&c, &net, task.clone(), None).unwrap_err().to_string();
    assert!(
        e.contains("training.optimizer.schedule") && e.contains("validation"),
        "{e}"
    );
}

/// Issue 47: gaussian_linear with prior and noise variances of 1e-42 (strain-like units)
/// trains the posterior of the right width: the same as with variances 0.1, relative to the
/// analytic width (the standardization follows the data's own scale; an absolute variance
/// floor of 1e-24 made it 1e8 times too wide).
#[test]
fn a_posterior_on_a_tiny_absolute_scale_has_the_right_width() {
    let dir = tempfile::tempdir().unwrap();
    let mut ratios = Vec::new();
    for (name, variance) in [("unit", 0.1), ("tiny", 1e-42)] {
        let gl = GaussianLinear {
            dim: 2,
            prior_scale: variance,
            simulator_scale: variance,
        };
        let task: Arc<dyn Task> = Arc::new(gl.clone());
        let net = network(task.as_ref(), Norm::None, 16, 2, 4.0);
        let updates = 300;
        let adam = json!({"name": "adam", "learning_rate": 3e-3});
        let c = config(dir.path(), name, 128, Value::Null, updates, adam);
        train(&c, &net, task.clone(), None).unwrap();
        let state = final_state(&dir.path().join(name), updates);
        let mut model = DeviceModel::new(net.clone(), 0, &Placement::Cpu).unwrap();
        model.trainable_mut().copy_from_slice(&state.trainable);
        model.frozen_mut().copy_from_slice(&state.frozen);
        let sd = variance.sqrt();
        let x = [0.3 * sd, -0.5 * sd];
        let (mean, var) = gl.posterior(&x);
        let n = 4000;
        let s = model.sample(&x.map(|v| v as f32), n, 7);
        let m0 = (0..n).map(|i| s[2 * i] as f64).sum::<f64>() / n as f64;
        let v0 = (0..n).map(|i| (s[2 * i] as f64 - m0).powi(2)).sum::<f64>() / n as f64;
        let ratio = v0.sqrt() / var.sqrt();
        eprintln!(
            "{name}: posterior sd {:e} vs analytic {:e} (ratio {ratio:.3}), mean {m0:e} vs {:e}",
            v0.sqrt(),
            var.sqrt(),
            mean[0]
        );
        assert!(
            (0.7..1.4).contains(&ratio),
            "{name}: sd ratio {ratio} to the analytic posterior"
        );
        assert!(
            (m0 - mean[0]).abs() < 0.3 * var.sqrt(),
            "{name}: mean {m0:e}"
        );
        ratios.push(ratio);
    }
    assert!(
        (ratios[0] - ratios[1]).abs() < 0.02 * ratios[0],
        "the tiny scale trains unlike the unit scale: {ratios:?}"
    );
}

/// What a [`Probe`]'s replica thread read back: every read-back ([`host_reads`]) and those
/// of a gradient ([`gradient_reads`]), during its passes and its state's calls.
#[derive(Default)]
struct Reads {
    all: std::sync::atomic::AtomicU64,
    gradients: std::sync::atomic::AtomicU64,
    passes: std::sync::atomic::AtomicU64,
}

impl Reads {
    fn get(&self) -> (u64, u64, u64) {
        use std::sync::atomic::Ordering::SeqCst;
        (
            self.all.load(SeqCst),
            self.gradients.load(SeqCst),
            self.passes.load(SeqCst),
        )
    }
}

/// A [`DeviceModel`] on the GPU that counts its thread's read-backs, with its training state
/// on the device (`on_device`) or, hiding [`Model::device_state`], in the engine's host path.
struct Probe {
    inner: DeviceModel,
    on_device: bool,
    reads: Arc<Reads>,
}

impl Probe {
    fn counted<T>(&mut self, f: impl FnOnce(&mut DeviceModel) -> T) -> T {
        use lockstep_npe::device::{gradient_reads, host_reads};
        use std::sync::atomic::Ordering::SeqCst;
        let (a, g) = (host_reads(), gradient_reads());
        let out = f(&mut self.inner);
        self.reads.all.fetch_add(host_reads() - a, SeqCst);
        self.reads.gradients.fetch_add(gradient_reads() - g, SeqCst);
        out
    }
    fn state(m: &mut DeviceModel) -> &mut dyn lockstep_train::DeviceState {
        m.device_state()
            .expect("a GPU model keeps its state on the device")
    }
}

impl Model for Probe {
    fn trainable(&self) -> &[f32] {
        self.inner.trainable()
    }
    fn trainable_mut(&mut self) -> &mut [f32] {
        self.inner.trainable_mut()
    }
    fn frozen(&self) -> &[f32] {
        self.inner.frozen()
    }
    fn frozen_mut(&mut self) -> &mut [f32] {
        self.inner.frozen_mut()
    }
    fn loss_names(&self) -> Vec<String> {
        self.inner.loss_names()
    }
    fn sample_separable(&self) -> bool {
        self.inner.sample_separable()
    }
    fn synchronizes_batch_statistics(&self) -> bool {
        self.inner.synchronizes_batch_statistics()
    }
    fn set_loss_scale(&mut self, scale: f32) -> bool {
        self.inner.set_loss_scale(scale)
    }
    fn loss_and_grad(
        &mut self,
        batch: &lockstep_train::Batch,
        grad: &mut [f32],
    ) -> anyhow::Result<Vec<f64>> {
        self.reads
            .passes
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.counted(|m| m.loss_and_grad(batch, grad))
    }
    fn loss_and_grad_in(
        &mut self,
        batch: &lockstep_train::Batch,
        grad: &mut [f32],
        replicas: &lockstep_train::ReplicaContext<'_>,
    ) -> anyhow::Result<Vec<f64>> {
        self.reads
            .passes
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.counted(|m| m.loss_and_grad_in(batch, grad, replicas))
    }
    fn device_state(&mut self) -> Option<&mut dyn lockstep_train::DeviceState> {
        if self.on_device {
            Some(self)
        } else {
            None
        }
    }
}

impl lockstep_train::DeviceState for Probe {
    fn upload(&mut self, slots: &[Vec<f32>]) -> anyhow::Result<()> {
        self.counted(|m| Probe::state(m).upload(slots))
    }
    fn download(&mut self, slots: &mut [Vec<f32>]) -> anyhow::Result<()> {
        self.counted(|m| Probe::state(m).download(slots))
    }
    fn release(&mut self) {
        Probe::state(&mut self.inner).release()
    }
    fn read_gradient(&mut self, grad: &mut [f32]) -> anyhow::Result<()> {
        self.counted(|m| Probe::state(m).read_gradient(grad))
    }
    fn gradient_is_finite(&mut self) -> anyhow::Result<bool> {
        self.counted(|m| Probe::state(m).gradient_is_finite())
    }
    fn finish_update(
        &mut self,
        update: Option<&lockstep_train::DeviceUpdate>,
        reduced: Option<&[f32]>,
    ) -> anyhow::Result<()> {
        self.counted(|m| Probe::state(m).finish_update(update, reduced))
    }
}

/// [`train`] on the machine's Vulkan adapter (lavapipe), every replica sharing it, through
/// a [`Probe`]; `amp`: mixed precision.
fn train_on_gpu(
    config: &Value,
    net: &NpeNetwork,
    task: Arc<dyn Task>,
    resume: Option<&Path>,
    on_device: bool,
    amp: bool,
) -> (TrainSummary, Arc<Reads>) {
    let world = World::init(lockstep_comm::launch::ComputeKind::Cpu, true).unwrap();
    let cfg = EngineConfig::from_json(config, Path::new("/")).unwrap();
    #[allow(clippy::needless_update)]
    let opts = EngineOptions {
        resolved_config: config.clone(),
        resume: resume.map(Path::to_path_buf),
        quiet: true,
        ..Default::default()
    };
    let seed = cfg.seed;
    let reads = Arc::new(Reads::default());
    let placement =
        Placement::for_slot(lockstep_npe::DeviceKind::Gpu, 0).expect("a Vulkan adapter (lavapipe)");
    let summary = run_job(&world, &cfg, &opts, |_rank| {
        let mut inner = DeviceModel::new(net.clone(), seed, &placement).unwrap();
        inner.set_mixed_precision(amp);
        let probe = Probe {
            inner,
            on_device,
            reads: reads.clone(),
        };
        Ok((probe, TaskSource::new(task.clone(), seed)))
    })
    .unwrap();
    (summary, reads)
}

/// The optimizer on the device (lockstep-train's `device_state`, `lockstep_npe::resident`)
/// on lavapipe: Adam with warmup-cosine, AdamW with gradient accumulation and SGD with
/// momentum and a step schedule give the host optimizer's losses and parameters bit for
/// bit; one replica reads no gradient back (one read-back per pass: its log q); a
/// checkpoint read from the device resumes to the uninterrupted run; two thread replicas
/// read the packed gradient once per update each and train like one replica with the whole
/// batch; under mixed precision the loss scaler's overflow skips are the host path's, its
/// finiteness flag read with the loss.
#[test]
fn the_optimizer_on_the_gpu_trains_like_the_host_optimizer() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let task: Arc<dyn Task> = Arc::new(GaussianLinear::new(2));
    let net = network(task.as_ref(), Norm::LayerNorm, 16, 2, 5.0);
    let updates = 6;
    let optimizers = [
        (
            json!({"name": "adam", "learning_rate": 0.01,
                "schedule": {"name": "warmup_cosine", "warmup_updates": 2, "total_updates": 6}}),
            1,
        ),
        (
            json!({"name": "adamw", "learning_rate": 0.01, "weight_decay": 0.1}),
            2,
        ),
        (
            json!({"name": "sgd", "learning_rate": 0.05, "momentum": 0.9,
                "schedule": {"name": "step", "step_updates": 2, "gamma": 0.5}}),
            1,
        ),
    ];
    for (i, (opt, k)) in optimizers.iter().enumerate() {
        let cfg = |name: &str| {
            let mut c = config(d, name, 16, Value::Null, updates, opt.clone());
            c["training"]["gradient_updates_per_optimizer_step"] = json!(k);
            c["training"]["checkpoint_every"] = json!(3);
            c
        };
        let (host, host_reads) = train_on_gpu(
            &cfg(&format!("h{i}")),
            &net,
            task.clone(),
            None,
            false,
            false,
        );
        let (dev, dev_reads) = train_on_gpu(
            &cfg(&format!("d{i}")),
            &net,
            task.clone(),
            None,
            true,
            false,
        );
        assert_eq!(host.loss_history, dev.loss_history, "{opt}");
        assert_eq!(host.params_checksum, dev.params_checksum, "{opt}");
        let (a, b) = (
            final_state(&d.join(format!("h{i}")), 3),
            final_state(&d.join(format!("d{i}")), 3),
        );
        assert_eq!(a.trainable, b.trainable, "{opt}");
        assert_eq!(a.optimizer_slots, b.optimizer_slots, "{opt}");
        let passes = updates * *k as u64;
        // The host path reads each pass's gradient with its log q; the device path only log q
        // per pass, and the state for the checkpoints of updates 3 and 6 and the run's end.
        assert_eq!(host_reads.get(), (passes, passes, passes), "{opt}");
        assert_eq!(dev_reads.get(), (passes + 3, 0, passes), "{opt}");
    }
    // A checkpoint read from the device resumes to the uninterrupted run.
    let (opt, _) = &optimizers[0];
    let cfg = |name: &str, n: u64| {
        let mut c = config(d, name, 16, Value::Null, n, opt.clone());
        c["training"]["checkpoint_every"] = json!(3);
        c
    };
    let (full, _) = train_on_gpu(&cfg("full", 6), &net, task.clone(), None, true, false);
    train_on_gpu(&cfg("first", 3), &net, task.clone(), None, true, false);
    let ckpt = d.join("first/checkpoints/update_000003.safetensors");
    let (resumed, _) = train_on_gpu(
        &cfg("resumed", 6),
        &net,
        task.clone(),
        Some(&ckpt),
        true,
        false,
    );
    assert_eq!(full.loss_history[3..], resumed.loss_history[..]);
    assert_eq!(full.params_checksum, resumed.params_checksum);
    // Two thread replicas x 8 train like one replica x 16, reading the packed gradient once
    // per update and replica.
    let two = config(
        d,
        "two",
        8,
        json!({"strategy": "threads", "global_batch_size": 16}),
        6,
        opt.clone(),
    );
    let (pair, reads) = train_on_gpu(&two, &net, task.clone(), None, true, false);
    let (_, gradients, passes) = reads.get();
    assert_eq!((gradients, passes), (2 * 6, 2 * 6));
    let flat = |h: &[Vec<f64>]| h.iter().flatten().map(|v| *v as f32).collect::<Vec<f32>>();
    let r = rel_l2(&flat(&pair.loss_history), &flat(&full.loss_history));
    assert!(r <= 1e-5, "two replicas vs one: {r:e}");
    // Mixed precision with a loss scale that overflows float16 at first: the skipped
    // updates and the losses are the host path's; no gradient comes back.
    let scaled = |name: &str| {
        let mut c = config(d, name, 16, Value::Null, 12, opt.clone());
        c["training"]["grad_scaler"] =
            json!({"init_scale": 1.0e12, "backoff_factor": 0.001, "growth_interval": 100});
        c
    };
    let (host, _) = train_on_gpu(&scaled("hs"), &net, task.clone(), None, false, true);
    let (dev, reads) = train_on_gpu(&scaled("ds"), &net, task.clone(), None, true, true);
    assert_eq!(host.loss_history, dev.loss_history);
    assert_eq!(host.params_checksum, dev.params_checksum);
    let log = std::fs::read_to_string(d.join("ds/run.log")).unwrap();
    assert!(log.contains("update 1: the gradient overflowed"), "{log}");
    assert!(
        log.lines().filter(|l| l.contains("update skipped")).count() < 12,
        "{log}"
    );
    // One read-back per pass (log q and the flag together), the state at the run's end.
    assert_eq!(reads.get(), (12 + 1, 0, 12));
}
