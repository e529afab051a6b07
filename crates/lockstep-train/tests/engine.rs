//! In-process tests of the engine's invariants (docs/design.md, "Invariants of sample-parallel
//! training") with the reference linear model, serial and with ThreadComm replicas.

use lockstep_comm::{
    run_replicas, CommError, Communicator, ReduceBuf, ReduceOp, ThreadComm, World,
};
use lockstep_train::job::run_job;
use lockstep_train::reference::{DeviceCounts, LinearRegression, RegressionData};
use lockstep_train::{
    checkpoint, plan, train, Batch, BatchSource, EngineConfig, EngineOptions, Model, TrainError,
    TrainSummary,
};
use serde_json::{json, Value};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

const DIM: usize = 8;

fn config(
    dir: &Path,
    name: &str,
    batch: usize,
    dist: Value,
    updates: u64,
    extra_training: Value,
) -> Value {
    let mut training = json!({
        "optimizer": {"name": "adam", "learning_rate": 0.05},
        "optimizer_updates": updates,
        "checksum_every": 1,
    });
    for (k, v) in extra_training.as_object().unwrap() {
        training[k] = v.clone();
    }
    let mut run = json!({"batch_size": batch, "seed": 11});
    if !dist.is_null() {
        run["distribution"] = dist;
    }
    json!({
        "run": run,
        "training": training,
        "output": {"output_dir": dir.join(name).to_string_lossy(), "overwrite_output_dir": true},
    })
}

fn run(
    config: &Value,
    resume: Option<&Path>,
    init_by_rank: bool,
    diverge: Option<(u64, usize)>,
) -> Result<TrainSummary, TrainError> {
    run_claiming(config, resume, init_by_rank, diverge, None, false)
}

/// [`run`] with a model that emulates a half-precision pass with loss scaling
/// (`LinearRegression::with_loss_scaling`).
fn run_scaled(config: &Value, resume: Option<&Path>) -> Result<TrainSummary, TrainError> {
    run_claiming(config, resume, false, None, None, true)
}

/// [`run`] with a model that claims `memory_per_sample` bytes per sample in its estimate and,
/// with `scaled`, emulates half precision with loss scaling.
fn run_claiming(
    config: &Value,
    resume: Option<&Path>,
    init_by_rank: bool,
    diverge: Option<(u64, usize)>,
    memory_per_sample: Option<u64>,
    scaled: bool,
) -> Result<TrainSummary, TrainError> {
    let world = World::init(lockstep_comm::launch::ComputeKind::Cpu, true).unwrap();
    let cfg = EngineConfig::from_json(config, Path::new("/")).unwrap();
    let opts = EngineOptions {
        resolved_config: config.clone(),
        resume: resume.map(Path::to_path_buf),
        quiet: false,
        ..Default::default()
    };
    let seed = cfg.seed;
    let built = AtomicUsize::new(0);
    run_job(&world, &cfg, &opts, |rank| {
        // Garbage start: every build gets other initial parameters when asked.
        let n = built.fetch_add(1, Ordering::SeqCst) as u64;
        let init = if init_by_rank { 1000 + n } else { 0 };
        let mut model = LinearRegression::new(DIM, seed, rank, init, diverge);
        if let Some(bytes) = memory_per_sample {
            model = model.with_memory_per_sample(bytes);
        }
        if scaled {
            model = model.with_loss_scaling();
        }
        Ok((
            model,
            RegressionData {
                dim: DIM,
                seed,
                dataset: None,
            },
        ))
    })
}

fn rel_l2(a: &[f64], b: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den).sqrt()
}

fn weights(dir: &Path) -> Vec<f64> {
    let v: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("weights.json")).unwrap()).unwrap();
    v["w"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

/// Invariants 4 and 5: 2 replicas x B equals 1 replica x 2B (inputs, noise, updates).
#[test]
fn two_thread_replicas_match_one_replica_with_twice_the_batch() {
    let dir = tempfile::tempdir().unwrap();
    let serial = config(dir.path(), "serial", 16, Value::Null, 3, json!({}));
    let threads = config(
        dir.path(),
        "threads",
        8,
        json!({"strategy": "threads", "global_batch_size": 16}),
        3,
        json!({}),
    );
    let a = run(&serial, None, false, None).unwrap();
    let b = run(&threads, None, false, None).unwrap();
    let wa = weights(&dir.path().join("serial"));
    let wb = weights(&dir.path().join("threads"));
    assert!(rel_l2(&wb, &wa) <= 1e-6, "{wa:?} vs {wb:?}");
    for (la, lb) in a.loss_history.iter().zip(&b.loss_history) {
        for (x, y) in la.iter().zip(lb) {
            assert_eq!(format!("{x:.5e}"), format!("{y:.5e}"), "loss logs differ");
        }
    }
    // A different local batch split is a different training run: the oracle is not trivial.
    let other = config(dir.path(), "other", 8, Value::Null, 3, json!({}));
    run(&other, None, false, None).unwrap();
    assert!(rel_l2(&weights(&dir.path().join("other")), &wa) > 1e-4);
}

/// Invariant 7: replicas built differently are made identical by the startup broadcast.
#[test]
fn startup_broadcast_makes_replicas_identical() {
    let dir = tempfile::tempdir().unwrap();
    let c = config(
        dir.path(),
        "t",
        4,
        json!({"strategy": "threads", "devices": ["cpu:0", "cpu:1"]}),
        4,
        json!({}),
    );
    let s = run(&c, None, true, None).unwrap();
    assert_eq!(s.updates, 4);
}

/// Invariant 7: a replica that drifts is caught by the checksum, naming the update.
#[test]
fn divergence_is_an_error_naming_the_update() {
    let dir = tempfile::tempdir().unwrap();
    let c = config(
        dir.path(),
        "t",
        4,
        json!({"strategy": "threads", "global_batch_size": 8}),
        6,
        json!({"checksum_every": 2}),
    );
    let e = run(&c, None, false, Some((3, 1))).unwrap_err().to_string();
    assert!(e.contains("diverged at update 4"), "{e}");
}

/// Counts the collectives a replica issues.
struct Counting<'a> {
    inner: &'a ThreadComm,
    reductions: Mutex<Vec<usize>>,
}

impl Communicator for Counting<'_> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn backend(&self) -> &'static str {
        "counting"
    }
    fn barrier(&self) -> Result<(), CommError> {
        self.inner.barrier()
    }
    fn broadcast_bytes(&self, buf: &mut [u8], root: usize) -> Result<(), CommError> {
        self.inner.broadcast_bytes(buf, root)
    }
    fn all_reduce_buf(&self, buf: ReduceBuf<'_>, op: ReduceOp) -> Result<(), CommError> {
        self.reductions.lock().unwrap().push(buf.len());
        self.inner.all_reduce_buf(buf, op)
    }
    fn gather_bytes(&self, s: &[u8], r: &mut [u8], root: usize) -> Result<(), CommError> {
        self.inner.gather_bytes(s, r, root)
    }
    fn scatter_bytes(&self, s: &[u8], r: &mut [u8], root: usize) -> Result<(), CommError> {
        self.inner.scatter_bytes(s, r, root)
    }
    fn all_gather_bytes(&self, s: &[u8], r: &mut [u8]) -> Result<(), CommError> {
        self.inner.all_gather_bytes(s, r)
    }
    fn all_to_all_v_bytes(
        &self,
        s: &[u8],
        c: &[usize],
        r: &mut Vec<u8>,
    ) -> Result<Vec<usize>, CommError> {
        self.inner.all_to_all_v_bytes(s, c, r)
    }
    fn abort(&self, code: i32) -> ! {
        self.inner.abort(code)
    }
}

/// Invariant 6: one gradient all-reduce per update (also with gradient accumulation), plus
/// one small metric reduction; the gradient is divided by replicas x micro-batches.
#[test]
fn one_gradient_reduction_per_update() {
    let dir = tempfile::tempdir().unwrap();
    let c = config(
        dir.path(),
        "t",
        4,
        json!({"strategy": "threads", "global_batch_size": 8}),
        3,
        json!({"gradient_updates_per_optimizer_step": 2, "checksum_every": 0}),
    );
    let cfg = EngineConfig::from_json(&c, Path::new("/")).unwrap();
    let p = plan(&cfg, &lockstep_comm::launch::LaunchEnv::serial(), 2, true).unwrap();
    let counts = run_replicas(2, |comm: ThreadComm| -> Result<Vec<usize>, TrainError> {
        let counting = Counting {
            inner: &comm,
            reductions: Mutex::new(Vec::new()),
        };
        let mut m = LinearRegression::new(DIM, 11, comm.rank(), 0, None);
        let mut s = RegressionData {
            dim: DIM,
            seed: 11,
            dataset: None,
        };
        let opts = EngineOptions {
            resolved_config: c.clone(),
            resume: None,
            quiet: false,
            ..Default::default()
        };
        train(&counting, &cfg, &p, &mut m, &mut s, &opts)?;
        Ok(counting.reductions.into_inner().unwrap())
    })
    .unwrap();
    let grads = counts[0].iter().filter(|&&n| n == DIM).count();
    assert_eq!(grads, 3, "gradient reductions: {:?}", counts[0]);
    // Per update: gradient, metrics (loss terms + samples), timings (MAX).
    let per_update: Vec<usize> = counts[0]
        .iter()
        .copied()
        .filter(|&n| n != 5 && n != 1)
        .collect();
    assert!(per_update.len() <= 3 * 3 + 1, "{:?}", counts[0]);
    // Single values: the startup checks (the replicas' sizes agree; every source is keyed
    // by sample; every model keeps its state on a device, or none does) and, since each
    // replica draws its own slice of the keyed reference data, one flag per micro-batch
    // saying whether any draw failed (3 updates x 2).
    let flags = counts[0].iter().filter(|&&n| n == 1).count();
    assert_eq!(flags, 3 + 3 * 2, "{:?}", counts[0]);

    // Accumulating 2 micro-batches of 4 per replica equals one batch of 16 serially.
    let acc = weights(&dir.path().join("t"));
    let serial = config(dir.path(), "s", 16, Value::Null, 3, json!({}));
    run(&serial, None, false, None).unwrap();
    assert!(rel_l2(&acc, &weights(&dir.path().join("s"))) <= 1e-6);
}

/// Invariant 8: the chief alone writes; one header and one row per update.
#[test]
fn chief_writes_each_row_once() {
    let dir = tempfile::tempdir().unwrap();
    let c = config(
        dir.path(),
        "t",
        4,
        json!({"strategy": "threads", "global_batch_size": 12}),
        5,
        json!({}),
    );
    run(&c, None, false, None).unwrap();
    let csv = std::fs::read_to_string(dir.path().join("t/callbacks/losses.csv")).unwrap();
    assert_eq!(csv.lines().count(), 6, "{csv}");
    let log = std::fs::read_to_string(dir.path().join("t/run.log")).unwrap();
    assert_eq!(log.matches("Completed 5 optimizer updates.").count(), 1);
    assert!(dir.path().join("t/config.json").exists());
    assert!(dir
        .path()
        .join("t/checkpoints/update_000005.safetensors")
        .exists());
}

/// Invariant 9: early stopping is decided from the reduced loss, so all replicas stop at the
/// same update (a per-rank decision would leave the collectives mismatched).
#[test]
fn early_stop_is_the_same_on_all_replicas() {
    let dir = tempfile::tempdir().unwrap();
    let c = config(
        dir.path(),
        "t",
        4,
        json!({"strategy": "threads", "global_batch_size": 12}),
        200,
        json!({"early_stop_loss": 0.3, "optimizer": {"name": "adam", "learning_rate": 0.1}}),
    );
    let cfg = EngineConfig::from_json(&c, Path::new("/")).unwrap();
    let p = plan(&cfg, &lockstep_comm::launch::LaunchEnv::serial(), 2, true).unwrap();
    let updates = run_replicas(3, |comm: ThreadComm| -> Result<u64, TrainError> {
        let mut m = LinearRegression::new(DIM, 11, comm.rank(), 0, None);
        let mut s = RegressionData {
            dim: DIM,
            seed: 11,
            dataset: None,
        };
        let opts = EngineOptions {
            resolved_config: c.clone(),
            resume: None,
            quiet: false,
            ..Default::default()
        };
        Ok(train(&comm, &cfg, &p, &mut m, &mut s, &opts)?.updates)
    })
    .unwrap();
    assert!(updates[0] < 200, "early stop never triggered");
    assert!(updates.iter().all(|&u| u == updates[0]), "{updates:?}");
}

/// Records which samples a finite source is asked for, and on which thread.
struct Recording {
    inner: RegressionData,
    asked: Vec<(u64, usize)>,
    threads: Vec<std::thread::ThreadId>,
}

impl BatchSource for Recording {
    fn input_width(&self) -> usize {
        self.inner.input_width()
    }
    fn target_width(&self) -> usize {
        1
    }
    fn num_samples(&self) -> Option<u64> {
        self.inner.num_samples()
    }
    fn global_batch(&mut self, first: u64, count: usize) -> anyhow::Result<Batch> {
        self.asked.push((first, count));
        self.threads.push(std::thread::current().id());
        self.inner.global_batch(first, count)
    }
}

/// Invariant 2: the partial final batch of a finite data set is dropped, never padded.
#[test]
fn partial_final_batches_are_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let c = config(
        dir.path(),
        "t",
        8,
        Value::Null,
        4,
        json!({"checksum_every": 0}),
    );
    let cfg = EngineConfig::from_json(&c, Path::new("/")).unwrap();
    let p = plan(&cfg, &lockstep_comm::launch::LaunchEnv::serial(), 2, true).unwrap();
    let mut m = LinearRegression::new(DIM, 11, 0, 0, None);
    let mut s = Recording {
        inner: RegressionData {
            dim: DIM,
            seed: 11,
            dataset: Some(20),
        },
        asked: Vec::new(),
        threads: Vec::new(),
    };
    let opts = EngineOptions {
        resolved_config: c.clone(),
        resume: None,
        quiet: false,
        ..Default::default()
    };
    train(&lockstep_comm::SelfComm, &cfg, &p, &mut m, &mut s, &opts).unwrap();
    // 20 samples, 8 per update: 2 updates per epoch, samples 16..19 dropped.
    assert_eq!(s.asked, vec![(0, 8), (8, 8), (20, 8), (28, 8)]);
    let here = std::thread::current().id();
    assert!(s.threads.iter().all(|t| *t == here));
    // With training.prefetch the same batches are drawn in the same order, each after the
    // first on the loader thread while the previous one trains.
    let mut c = c;
    c["training"]["prefetch"] = json!(true);
    let cfg = EngineConfig::from_json(&c, Path::new("/")).unwrap();
    let mut m = LinearRegression::new(DIM, 11, 0, 0, None);
    let inner = RegressionData {
        dim: DIM,
        seed: 11,
        dataset: Some(20),
    };
    let mut s = Recording {
        inner,
        asked: Vec::new(),
        threads: Vec::new(),
    };
    let opts = EngineOptions {
        resolved_config: c.clone(),
        ..Default::default()
    };
    train(&lockstep_comm::SelfComm, &cfg, &p, &mut m, &mut s, &opts).unwrap();
    assert_eq!(s.asked, vec![(0, 8), (8, 8), (20, 8), (28, 8)]);
    assert_eq!(s.threads[0], here);
    assert!(s.threads[1..].iter().all(|t| *t != here), "{:?}", s.threads);
}

/// Invariant 10: destructive restore. Train 4 updates and checkpoint; start from garbage
/// parameters and a fresh optimizer; restore and train 4 more: bitwise equal to 8 updates in
/// one go (serial), and within 1e-6 when restored on 2 replicas.
#[test]
fn destructive_restore_equals_an_uninterrupted_run() {
    let dir = tempfile::tempdir().unwrap();
    let full = config(dir.path(), "full", 8, Value::Null, 8, json!({}));
    let first = config(dir.path(), "first", 8, Value::Null, 4, json!({}));
    let a = run(&full, None, false, None).unwrap();
    run(&first, None, false, None).unwrap();
    let ckpt = dir
        .path()
        .join("first/checkpoints/update_000004.safetensors");
    // Garbage live state: parameters initialised from another seed (init_by_rank), fresh optimizer.
    let resumed = config(dir.path(), "resumed", 8, Value::Null, 8, json!({}));
    let b = run(&resumed, Some(&ckpt), true, None).unwrap();
    assert_eq!(b.updates, 8);
    assert_eq!(
        a.params_checksum, b.params_checksum,
        "restored run differs bitwise"
    );
    assert_eq!(a.loss_history[4..], b.loss_history[..]);
    // On another replica count.
    let two = config(
        dir.path(),
        "two",
        4,
        json!({"strategy": "threads", "global_batch_size": 8}),
        8,
        json!({}),
    );
    run(&two, Some(&ckpt), true, None).unwrap();
    assert!(
        rel_l2(
            &weights(&dir.path().join("two")),
            &weights(&dir.path().join("full"))
        ) <= 1e-6
    );
    // A flipped byte is refused with a clear error.
    let mut bytes = std::fs::read(&ckpt).unwrap();
    let n = bytes.len();
    bytes[n - 5] ^= 0x40;
    std::fs::write(&ckpt, &bytes).unwrap();
    let e = run(&resumed, Some(&ckpt), false, None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("checksum mismatch") && e.contains("update_000004"),
        "{e}"
    );
    assert!(checkpoint::read(&ckpt).is_err());
}

/// Bad output setup loses nothing: an existing directory with overwrite off is untouched.
#[test]
fn existing_output_dir_is_left_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("t");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("precious.txt"), "keep").unwrap();
    let mut c = config(dir.path(), "t", 4, Value::Null, 2, json!({}));
    c["output"]["overwrite_output_dir"] = json!(false);
    let e = run(&c, None, false, None).unwrap_err().to_string();
    assert!(e.contains("overwrite_output_dir"), "{e}");
    let entries: Vec<_> = std::fs::read_dir(&out).unwrap().collect();
    assert_eq!(entries.len(), 1);
    assert_eq!(
        std::fs::read_to_string(out.join("precious.txt")).unwrap(),
        "keep"
    );
}

/// Refusals before training (the chief's output folder, a finished checkpoint) are agreed
/// errors ([`TrainError::is_agreed`]): under MPI every rank learns them from the chief and
/// the job ends without an abort, the reason told once (2 ranks: `tests/mpi.rs`).
#[test]
fn refusals_before_training_are_agreed_errors() {
    let dir = tempfile::tempdir().unwrap();
    let c = config(dir.path(), "t", 4, Value::Null, 1, json!({}));
    run(&c, None, false, None).unwrap();
    // One update: the summary says so in the singular.
    let log = std::fs::read_to_string(dir.path().join("t/run.log")).unwrap();
    assert!(log.contains("Completed 1 optimizer update."), "{log}");
    let ckpt = dir.path().join("t/checkpoints/latest");
    let e = run(&c, Some(&ckpt), false, None).unwrap_err();
    assert!(e.is_agreed(), "{e:?}");
    assert!(e.to_string().contains("already has 1 update, so"), "{e}");
    let mut c2 = config(dir.path(), "t", 4, Value::Null, 2, json!({}));
    c2["output"]["overwrite_output_dir"] = json!(false);
    let e = run(&c2, None, false, None).unwrap_err();
    assert!(
        e.is_agreed() && e.to_string().contains("overwrite_output_dir"),
        "{e:?}"
    );
}

/// overwrite_output_dir never deletes a directory lockstep did not write.
#[test]
fn overwrite_refuses_foreign_directories() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("t");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("my_notes.txt"), "keep").unwrap();
    let c = config(dir.path(), "t", 4, Value::Null, 2, json!({}));
    let e = run(&c, None, false, None).unwrap_err().to_string();
    assert!(e.contains("was not written by lockstep"), "{e}");
    assert_eq!(
        std::fs::read_to_string(out.join("my_notes.txt")).unwrap(),
        "keep"
    );
    // A lockstep run directory is replaced.
    std::fs::remove_file(out.join("my_notes.txt")).unwrap();
    run(&c, None, false, None).unwrap();
    run(&c, None, false, None).unwrap();
    assert!(out.join(lockstep_core::output_dir::MARKER).is_file());
}

/// Resuming from a checkpoint inside the output directory continues that run in place, even
/// with overwrite on: nothing of the run is lost, later CSV rows are recomputed.
#[test]
fn resume_in_place_keeps_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let full = config(
        dir.path(),
        "full",
        8,
        Value::Null,
        4,
        json!({"checkpoint_every": 2}),
    );
    let a = run(&full, None, false, None).unwrap();
    let ckpt = dir
        .path()
        .join("full/checkpoints/update_000002.safetensors");
    let b = run(&full, Some(&ckpt), false, None).unwrap();
    assert_eq!(a.params_checksum, b.params_checksum);
    assert!(ckpt.exists(), "the checkpoint resumed from was deleted");
    let csv = std::fs::read_to_string(dir.path().join("full/callbacks/losses.csv")).unwrap();
    let steps: Vec<&str> = csv
        .lines()
        .skip(1)
        .map(|l| l.split(',').next().unwrap())
        .collect();
    assert_eq!(steps, vec!["1", "2", "3", "4"], "{csv}");
}

/// Parameters that overflow stop every replica with an error naming the update.
#[test]
fn non_finite_parameters_are_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let c = config(
        dir.path(),
        "t",
        4,
        json!({"strategy": "threads", "global_batch_size": 8}),
        3,
        json!({"optimizer": {"name": "sgd", "learning_rate": 1e38}}),
    );
    let e = run(&c, None, false, None).unwrap_err().to_string();
    assert!(
        e.contains("became NaN after update") || e.contains("became inf after update"),
        "{e}"
    );
}

/// The logged loss of an update is the mean over every sample of the global batch: a plain
/// batch of 8, 2 accumulated micro-batches of 4, and 2 thread replicas x 2 micro-batches of 2
/// log the same losses and stop early at the same update.
#[test]
fn accumulation_and_replicas_log_the_loss_of_the_plain_batch() {
    let dir = tempfile::tempdir().unwrap();
    let training = |k: usize| {
        json!({"gradient_updates_per_optimizer_step": k, "early_stop_loss": 0.02,
               "optimizer": {"name": "adam", "learning_rate": 0.05}})
    };
    let plain = config(dir.path(), "plain", 8, Value::Null, 100, training(1));
    let acc = config(dir.path(), "acc", 4, Value::Null, 100, training(2));
    let threads = config(
        dir.path(),
        "threads",
        2,
        json!({"strategy": "threads", "global_batch_size": 4}),
        100,
        training(2),
    );
    let a = run(&plain, None, false, None).unwrap();
    assert!(a.updates > 3 && a.updates < 100, "stopped at {}", a.updates);
    let csv = |name: &str| -> Vec<Vec<f64>> {
        std::fs::read_to_string(dir.path().join(name).join("callbacks/losses.csv"))
            .unwrap()
            .lines()
            .skip(1)
            .map(|l| l.split(',').skip(2).map(|v| v.parse().unwrap()).collect())
            .collect()
    };
    for other in [&acc, &threads] {
        let name = other["output"]["output_dir"].as_str().unwrap().to_string();
        let b = run(other, None, false, None).unwrap();
        assert_eq!(b.updates, a.updates, "{name}: early stop at another update");
        for (hist_a, hist_b) in [
            (a.loss_history.clone(), b.loss_history.clone()),
            (csv("plain"), csv(&name)),
        ] {
            assert_eq!(hist_a.len(), hist_b.len());
            for (u, (x, y)) in hist_a.iter().zip(&hist_b).enumerate() {
                for (p, q) in x.iter().zip(y) {
                    assert!(
                        (p - q).abs() <= 1e-6 * p.abs().max(1e-12),
                        "{name}: update {} logs {q}, the plain batch {p}",
                        u + 1
                    );
                }
            }
        }
    }
}

/// A run that does not fit in memory is refused before the output directory is touched,
/// naming the estimate's keys; thread replicas in one process count once each.
#[test]
fn a_run_that_cannot_fit_in_memory_leaves_the_previous_run_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let c = config(dir.path(), "t", 4, Value::Null, 2, json!({}));
    run(&c, None, false, None).unwrap();
    let out = dir.path().join("t");
    let listing = |p: &Path| -> Vec<(String, Vec<u8>)> {
        let mut v: Vec<(String, Vec<u8>)> = walk(p)
            .into_iter()
            .map(|f| (f.display().to_string(), std::fs::read(&f).unwrap()))
            .collect();
        v.sort();
        v
    };
    let before = listing(&out);
    assert!(
        before.len() >= 5,
        "{:?}",
        before.iter().map(|x| &x.0).collect::<Vec<_>>()
    );
    let e = run_claiming(&c, None, false, None, Some(u64::MAX / 16), false)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("this training run needs") && e.contains("run.batch_size"),
        "{e}"
    );
    assert_eq!(listing(&out), before, "the previous run was changed");

    // Per replica 0.6 of the available memory: one replica fits, two threads do not.
    let avail = lockstep_core::memory::available_bytes().expect("Linux reports MemAvailable");
    let per_sample = avail / 10 * 6 / 4;
    run_claiming(&c, None, false, None, Some(per_sample), false).unwrap();
    let two = config(
        dir.path(),
        "t",
        4,
        json!({"strategy": "threads", "global_batch_size": 8}),
        2,
        json!({}),
    );
    let before = listing(&out);
    let e = run_claiming(&two, None, false, None, Some(per_sample), false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("x 2 thread replicas in this process"), "{e}");
    assert_eq!(listing(&out), before);
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            files.extend(walk(&p));
        } else {
            files.push(p);
        }
    }
    files
}

/// `resume` takes a run directory or its `checkpoints/latest` pointer; a checkpoint that
/// already has the updates the run asks for is refused before anything is rewritten.
#[test]
fn resume_from_a_run_directory_or_its_latest_pointer() {
    let dir = tempfile::tempdir().unwrap();
    let first = config(dir.path(), "first", 8, Value::Null, 4, json!({}));
    let full = config(dir.path(), "full", 8, Value::Null, 6, json!({}));
    let a = run(&full, None, false, None).unwrap();
    run(&first, None, false, None).unwrap();
    let run_dir = dir.path().join("first");
    for (name, resume) in [
        ("from_dir", run_dir.clone()),
        ("from_latest", run_dir.join("checkpoints/latest")),
    ] {
        let c = config(dir.path(), name, 8, Value::Null, 6, json!({}));
        let b = run(&c, Some(&resume), false, None).unwrap();
        assert_eq!(
            (b.updates, b.params_checksum),
            (6, a.params_checksum),
            "{name}"
        );
    }
    let config_before = std::fs::read(run_dir.join("config.json")).unwrap();
    let losses_before = std::fs::read(run_dir.join("callbacks/losses.csv")).unwrap();
    let shorter = config(dir.path(), "first", 8, Value::Null, 3, json!({}));
    let e = run(&shorter, Some(&run_dir), false, None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("training.optimizer_updates") && e.contains("already has 4 updates"),
        "{e}"
    );
    assert_eq!(
        std::fs::read(run_dir.join("config.json")).unwrap(),
        config_before
    );
    assert_eq!(
        std::fs::read(run_dir.join("callbacks/losses.csv")).unwrap(),
        losses_before
    );
}

/// A reference model that keeps the first sample of its batch at updates 0 and 2
/// (`Model::record_first_sample`) and writes `records/update_N.txt` with that sample's
/// global index and the rank that kept it.
struct FirstSampleRecorder {
    inner: LinearRegression,
    rank: usize,
    armed: bool,
    kept: Option<u64>,
    asked: std::sync::Arc<Mutex<Vec<(usize, u64)>>>,
}

impl Model for FirstSampleRecorder {
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
    fn loss_and_grad(&mut self, batch: &Batch, grad: &mut [f32]) -> anyhow::Result<Vec<f64>> {
        if std::mem::take(&mut self.armed) {
            self.kept = Some(batch.first_sample);
        }
        self.inner.loss_and_grad(batch, grad)
    }
    fn export(&self, dir: &Path) -> anyhow::Result<Vec<std::path::PathBuf>> {
        self.inner.export(dir)
    }
    fn record_first_sample(&mut self, update: u64) -> bool {
        self.asked.lock().unwrap().push((self.rank, update));
        self.armed = update == 0 || update == 2;
        self.armed
    }
    fn write_sample_record(
        &mut self,
        dir: &Path,
        update: u64,
    ) -> anyhow::Result<Vec<std::path::PathBuf>> {
        let sample = self.kept.take().expect("a record was kept");
        let path = dir.join(format!("records/update_{update}.txt"));
        std::fs::create_dir_all(path.parent().unwrap())?;
        std::fs::write(&path, format!("{sample} {}", self.rank))?;
        Ok(vec![path])
    }
}

/// Only the chief is asked, once per update before its first micro-batch, and what it keeps
/// is the first sample of the global batch (2 replicas x 2 samples x 2 micro-batches: update
/// u begins at sample 8u), written after that update.
#[test]
fn the_chief_keeps_the_first_sample_of_the_global_batch_at_the_updates_the_model_asks() {
    let dir = tempfile::tempdir().unwrap();
    let cfg_json = config(
        dir.path(),
        "rec",
        2,
        json!({"strategy": "threads", "global_batch_size": 4}),
        3,
        json!({"gradient_updates_per_optimizer_step": 2}),
    );
    let world = World::init(lockstep_comm::launch::ComputeKind::Cpu, true).unwrap();
    let cfg = EngineConfig::from_json(&cfg_json, Path::new("/")).unwrap();
    let opts = EngineOptions {
        resolved_config: cfg_json.clone(),
        ..Default::default()
    };
    let asked = std::sync::Arc::new(Mutex::new(Vec::new()));
    let seed = cfg.seed;
    run_job(&world, &cfg, &opts, |rank| {
        let model = FirstSampleRecorder {
            inner: LinearRegression::new(DIM, seed, rank, 0, None),
            rank,
            armed: false,
            kept: None,
            asked: asked.clone(),
        };
        let data = RegressionData {
            dim: DIM,
            seed,
            dataset: None,
        };
        Ok((model, data))
    })
    .unwrap();
    assert_eq!(*asked.lock().unwrap(), vec![(0, 0), (0, 1), (0, 2)]);
    let records = dir.path().join("rec/records");
    let read = |u: u64| std::fs::read_to_string(records.join(format!("update_{u}.txt"))).unwrap();
    assert_eq!(read(0), "0 0");
    assert_eq!(read(2), "16 0");
    assert!(!records.join("update_1.txt").exists());
}

/// Runs `config` counted in epochs (its `training.optimizer_updates` removed) through
/// [`run_job`]: replica `r` is `adapt(LinearRegression, r)` on regression data of `dataset`
/// samples (`None`: unbounded).
fn run_epochs(
    mut config: Value,
    dataset: Option<u64>,
    adapt: impl Fn(LinearRegression, usize) -> LinearRegression + Sync,
) -> TrainSummary {
    config["training"]
        .as_object_mut()
        .unwrap()
        .remove("optimizer_updates");
    let world = World::init(lockstep_comm::launch::ComputeKind::Cpu, true).unwrap();
    let cfg = EngineConfig::from_json(&config, Path::new("/")).unwrap();
    let opts = EngineOptions {
        resolved_config: config.clone(),
        ..Default::default()
    };
    let seed = cfg.seed;
    run_job(&world, &cfg, &opts, |rank| {
        let m = LinearRegression::new(DIM, seed, rank, 0, None);
        let data = RegressionData {
            dim: DIM,
            seed,
            dataset,
        };
        Ok((adapt(m, rank), data))
    })
    .unwrap()
}

/// The numbers of one Dingo log line: `(epoch, done, total, [loss, mean, data, mean,
/// network, mean, (aggregation, mean)])`.
fn parse_dingo(line: &str) -> (u64, u64, u64, Vec<f64>) {
    let rest = line.strip_prefix("Train Epoch: ").unwrap();
    let (epoch, rest) = rest.split_once(" [").unwrap();
    let (done, rest) = rest.split_once('/').unwrap();
    let (total, rest) = rest.split_once(" (").unwrap();
    let numbers = rest
        .split(|c: char| c.is_whitespace() || c == '(' || c == ')')
        .filter_map(|t| t.parse::<f64>().ok())
        .collect();
    (
        epoch.parse().unwrap(),
        done.parse().unwrap(),
        total.parse().unwrap(),
        numbers,
    )
}

/// Dingo's log line (`training.log_style: dingo`) on a 2-replica run whose rank 1 is made
/// 40 ms slower per micro-batch: `Time Network` is the slowest replica's (the chief alone
/// would report far less), a `Time Loss Aggregation` column appears, the loss is the
/// global batch's (as in losses.csv) with the epoch's running mean, and epochs restart the
/// sample count and the means. A serial run has no aggregation column.
#[test]
fn dingo_log_line_reports_the_slowest_replica_and_epoch_means() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let delay = std::time::Duration::from_millis(40);
    for replicas in [2usize, 1] {
        let dist = if replicas > 1 {
            json!({"strategy": "threads", "global_batch_size": 16})
        } else {
            Value::Null
        };
        let cfg_json = config(
            d,
            &format!("dingo{replicas}"),
            16 / replicas,
            dist,
            6,
            json!({"log_style": "dingo", "steps_per_epoch": 3, "epochs": 2}),
        );
        let summary = run_epochs(cfg_json, None, |m, rank| {
            if rank == 1 {
                m.with_delay(delay)
            } else {
                m
            }
        });
        let log = std::fs::read_to_string(summary.output_dir.join("run.log")).unwrap();
        let lines: Vec<&str> = log
            .lines()
            .filter(|l| l.starts_with("Train Epoch"))
            .collect();
        assert_eq!(lines.len(), 6, "{log}");
        let csv = std::fs::read_to_string(summary.output_dir.join("callbacks/losses.csv")).unwrap();
        let totals: Vec<f64> = csv
            .lines()
            .skip(1)
            .map(|l| l.rsplit(',').next().unwrap().parse().unwrap())
            .collect();
        for (u, line) in lines.iter().enumerate() {
            let (epoch, done, total, v) = parse_dingo(line);
            assert_eq!(epoch, u as u64 / 3 + 1, "{line}");
            assert_eq!(done, (u as u64 % 3 + 1) * 16, "{line}");
            assert_eq!(total, 48, "{line}");
            let first = u - u % 3;
            let mean = totals[first..=u].iter().sum::<f64>() / (u - first + 1) as f64;
            assert!((v[0] - totals[u]).abs() < 6e-4, "{line} vs {}", totals[u]);
            assert!((v[1] - mean).abs() < 6e-4, "{line} vs mean {mean}");
            if replicas == 2 {
                assert!(line.contains("Time Loss Aggregation: "), "{line}");
                assert_eq!(v.len(), 8, "{line}");
                assert!(
                    v[4] >= 0.04 && v[5] >= 0.04,
                    "network time is rank 1's: {line}"
                );
            } else {
                assert!(!line.contains("Aggregation"), "{line}");
                assert_eq!(v.len(), 6, "{line}");
                assert!(v[4] < 0.04, "{line}");
            }
        }
    }
}

/// `training.prefetch`: the chief's loader thread draws the next micro-batch during the
/// current one; the batches and so the updates are the same as without it, across epoch
/// boundaries of a finite data set, with accumulation and 2 thread replicas.
#[test]
fn prefetching_batches_changes_nothing_but_the_timing() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut results = Vec::new();
    for prefetch in [false, true] {
        let cfg_json = config(
            d,
            &format!("prefetch_{prefetch}"),
            4,
            json!({"strategy": "threads", "global_batch_size": 8}),
            12,
            json!({"prefetch": prefetch, "gradient_updates_per_optimizer_step": 2,
                   "steps_per_epoch": 3, "epochs": 4}),
        );
        let summary = run_epochs(cfg_json, Some(50), |m, _| m);
        assert_eq!(summary.updates, 12);
        results.push((summary.params_checksum, summary.loss_history));
    }
    assert_eq!(results[0], results[1]);
}

/// A reference source that says whether it is keyed by sample and records what each rank
/// asked for: `(rank, first sample, count)`.
struct Asked<'a> {
    inner: RegressionData,
    keyed: bool,
    rank: usize,
    log: &'a Mutex<Vec<(usize, u64, usize)>>,
}

impl BatchSource for Asked<'_> {
    fn input_width(&self) -> usize {
        self.inner.input_width()
    }
    fn target_width(&self) -> usize {
        1
    }
    fn keyed_by_sample(&self) -> bool {
        self.keyed
    }
    fn global_batch(&mut self, first: u64, count: usize) -> anyhow::Result<Batch> {
        self.log.lock().unwrap().push((self.rank, first, count));
        self.inner.global_batch(first, count)
    }
}

/// A source keyed by sample lets each replica draw its own slice (issue 17: per-replica
/// loaders): rank r asks only for the samples `first + r*B .. first + (r+1)*B` of each global
/// micro-batch, and the training is bitwise the same as when the chief draws and scatters.
#[test]
fn replicas_draw_their_own_slices_of_a_keyed_source() {
    let dir = tempfile::tempdir().unwrap();
    for prefetch in [false, true] {
        let mut params = Vec::new();
        for keyed in [false, true] {
            let c = config(
                dir.path(),
                &format!("keyed_{keyed}_{prefetch}"),
                4,
                json!({"strategy": "threads", "global_batch_size": 8}),
                5,
                json!({"prefetch": prefetch, "gradient_updates_per_optimizer_step": 2}),
            );
            let cfg = EngineConfig::from_json(&c, Path::new("/")).unwrap();
            let p = plan(&cfg, &lockstep_comm::launch::LaunchEnv::serial(), 2, true).unwrap();
            let log = Mutex::new(Vec::new());
            let trained = run_replicas(2, |comm: ThreadComm| -> Result<Vec<f32>, TrainError> {
                let mut m = LinearRegression::new(DIM, 11, comm.rank(), 0, None);
                let mut s = Asked {
                    inner: RegressionData {
                        dim: DIM,
                        seed: 11,
                        dataset: None,
                    },
                    keyed,
                    rank: comm.rank(),
                    log: &log,
                };
                let opts = EngineOptions {
                    resolved_config: c.clone(),
                    ..Default::default()
                };
                train(&comm, &cfg, &p, &mut m, &mut s, &opts)?;
                Ok(m.trainable().to_vec())
            })
            .unwrap();
            assert_eq!(trained[0], trained[1], "replicas differ");
            let mut asked = log.into_inner().unwrap();
            asked.sort_unstable();
            // 5 updates x 2 micro-batches of 8 samples.
            let want: Vec<(usize, u64, usize)> = if keyed {
                (0..2)
                    .flat_map(|r| (0..10).map(move |m| (r, m * 8 + r as u64 * 4, 4)))
                    .collect()
            } else {
                (0..10).map(|m| (0, m * 8, 8)).collect()
            };
            assert_eq!(asked, want, "keyed {keyed}, prefetch {prefetch}");
            params.push(trained[0].clone());
        }
        assert_eq!(params[0], params[1], "prefetch {prefetch}");
    }
}

/// A failing draw on one rank of a keyed source ends every replica with that rank named.
#[test]
fn a_failed_draw_on_one_replica_ends_all() {
    struct FailsOnRank1(RegressionData, usize);
    impl BatchSource for FailsOnRank1 {
        fn input_width(&self) -> usize {
            self.0.input_width()
        }
        fn target_width(&self) -> usize {
            1
        }
        fn keyed_by_sample(&self) -> bool {
            true
        }
        fn global_batch(&mut self, first: u64, count: usize) -> anyhow::Result<Batch> {
            anyhow::ensure!(self.1 != 1 || first < 20, "no samples beyond 20 here");
            self.0.global_batch(first, count)
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let c = config(
        dir.path(),
        "fails",
        4,
        json!({"strategy": "threads", "global_batch_size": 8}),
        6,
        json!({}),
    );
    let cfg = EngineConfig::from_json(&c, Path::new("/")).unwrap();
    let p = plan(&cfg, &lockstep_comm::launch::LaunchEnv::serial(), 2, true).unwrap();
    let errors = std::sync::Mutex::new(Vec::new());
    let _ = run_replicas(2, |comm: ThreadComm| -> Result<(), TrainError> {
        let mut m = LinearRegression::new(DIM, 11, comm.rank(), 0, None);
        let data = RegressionData {
            dim: DIM,
            seed: 11,
            dataset: None,
        };
        let mut s = FailsOnRank1(data, comm.rank());
        let opts = EngineOptions {
            resolved_config: c.clone(),
            ..Default::default()
        };
        let r = train(&comm, &cfg, &p, &mut m, &mut s, &opts);
        let e = r.expect_err("the run must fail");
        // The error with its causes.
        let mut text = e.to_string();
        let mut cause = std::error::Error::source(&e);
        while let Some(c) = cause {
            text += &format!(": {c}");
            cause = c.source();
        }
        errors.lock().unwrap().push((comm.rank(), text));
        Ok(())
    });
    let mut errors = errors.into_inner().unwrap();
    errors.sort();
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(
        errors[0]
            .1
            .contains("rank 1 failed: batch generation failed"),
        "{errors:?}"
    );
    assert!(
        errors[1].1.contains("no samples beyond 20 here"),
        "{errors:?}"
    );
}

fn checkpoint_at(dir: &Path, update: u64) -> checkpoint::TrainState {
    checkpoint::read(&dir.join(format!("checkpoints/update_{update:06}.safetensors"))).unwrap()
}

/// Dynamic loss scaling (`training.grad_scaler`): an overflowing gradient skips the update on
/// every replica (parameters and optimizer untouched) and halves the scale, clean updates
/// grow it, the scaler's state is checkpointed and restored, and a power-of-two scale that
/// never overflows trains bit for bit like no scaling.
#[test]
fn grad_scaler_skips_overflowing_updates_and_backs_off() {
    let dir = tempfile::tempdir().unwrap();
    // 2^22 times gradients of order 0.1-1 overflow f16 (65504): the first updates skip.
    let scaler = json!({"grad_scaler": {"init_scale": 4194304.0, "growth_interval": 3},
                        "checkpoint_every": 1});
    let c = config(dir.path(), "scaled", 8, Value::Null, 12, scaler.clone());
    run_scaled(&c, None).unwrap();
    let run_dir = dir.path().join("scaled");
    let log = std::fs::read_to_string(run_dir.join("run.log")).unwrap();
    let skipped: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("update skipped"))
        .collect();
    assert!(skipped.len() >= 3 && skipped.len() < 12, "{log}");
    assert!(
        skipped[0].contains("update 1: the gradient overflowed at loss scale 4194304")
            && skipped[0].contains("lowered to 2097152"),
        "{}",
        skipped[0]
    );
    assert!(log.contains("loss scale raised to"), "{log}");
    let mut prev = checkpoint_at(&run_dir, 1);
    assert_eq!(prev.optimizer_step, 0, "the first update was skipped");
    let (mut skips, mut applied) = (1, 0);
    for u in 2..=12 {
        let s = checkpoint_at(&run_dir, u);
        let g = s.grad_scaler.expect("the checkpoint holds the scaler");
        let was_skipped = log.contains(&format!("update {u}: the gradient overflowed"));
        if was_skipped {
            skips += 1;
            assert_eq!(s.trainable, prev.trainable, "update {u} was skipped");
            assert_eq!(s.optimizer_step, prev.optimizer_step);
            assert_eq!(g.scale, prev.grad_scaler.unwrap().scale / 2.0);
        } else {
            applied += 1;
            assert_ne!(s.trainable, prev.trainable, "update {u} was applied");
            assert_eq!(s.optimizer_step, prev.optimizer_step + 1);
        }
        assert_eq!(g.skipped, skips);
        prev = s;
    }
    assert!(applied >= 3, "{log}");
    // Resuming from a checkpoint restores the scale and counters: the same run.
    let first = config(dir.path(), "first", 8, Value::Null, 5, scaler.clone());
    run_scaled(&first, None).unwrap();
    let resumed = config(dir.path(), "resumed", 8, Value::Null, 12, scaler.clone());
    let ckpt = dir
        .path()
        .join("first/checkpoints/update_000005.safetensors");
    run_scaled(&resumed, Some(&ckpt)).unwrap();
    let (a, b) = (
        checkpoint_at(&run_dir, 12),
        checkpoint_at(&dir.path().join("resumed"), 12),
    );
    assert_eq!(a.trainable, b.trainable);
    assert_eq!(a.grad_scaler, b.grad_scaler);
    // Two thread replicas take every decision from the reduced gradient: they skip the
    // same updates and stay identical (checksum_every 1 compares them after each update).
    // Whether an update overflows depends on each replica's half batch, as in f16, so the
    // skipped updates need not be the serial run's.
    let threads = config(
        dir.path(),
        "threads",
        4,
        json!({"strategy": "threads", "global_batch_size": 8}),
        12,
        scaler,
    );
    run_scaled(&threads, None).unwrap();
    let t = checkpoint_at(&dir.path().join("threads"), 12);
    assert!(t.grad_scaler.unwrap().skipped >= 3);
    let tlog = std::fs::read_to_string(dir.path().join("threads/run.log")).unwrap();
    assert!(tlog.contains("update 1: the gradient overflowed"), "{tlog}");
}

/// A loss scale that overflows at every update: a run whose every update was skipped ends
/// with an error naming `training.grad_scaler` before it exports anything (its checkpoints
/// say what happened: optimizer step 0); a long run stops after
/// `MAX_CONSECUTIVE_SKIPS` skipped updates in a row; a run that applied some updates says in
/// its summary how many it applied and skipped.
#[test]
fn a_loss_scaler_that_keeps_skipping_stops_the_run_and_exports_nothing() {
    use lockstep_train::grad_scaler::MAX_CONSECUTIVE_SKIPS;
    let dir = tempfile::tempdir().unwrap();
    let stuck = json!({"grad_scaler": {"init_scale": 3.0e38, "backoff_factor": 0.99},
                       "checkpoint_every": 4});
    let c = config(dir.path(), "all", 8, Value::Null, 12, stuck.clone());
    let e = run_scaled(&c, None).unwrap_err();
    assert!(
        matches!(
            e,
            TrainError::UpdatesSkipped {
                update: 12,
                skipped: 12,
                whole_run: true,
                ..
            }
        ),
        "{e:?}"
    );
    let m = e.to_string();
    assert!(
        m.contains("nothing was trained")
            && m.contains("training.grad_scaler.init_scale")
            && m.contains("mixed precision off"),
        "{m}"
    );
    let run_dir = dir.path().join("all");
    assert!(
        !run_dir.join("weights.json").exists(),
        "an untrained export"
    );
    let log = std::fs::read_to_string(run_dir.join("run.log")).unwrap();
    assert!(!log.contains("Completed"), "{log}");
    assert_eq!(checkpoint_at(&run_dir, 12).optimizer_step, 0);
    // A long run stops after the limit of skipped updates in a row.
    let long = config(
        dir.path(),
        "long",
        8,
        Value::Null,
        MAX_CONSECUTIVE_SKIPS + 50,
        stuck,
    );
    let e = run_scaled(&long, None).unwrap_err();
    assert!(
        matches!(e, TrainError::UpdatesSkipped { update, skipped, whole_run: false, .. }
            if update == MAX_CONSECUTIVE_SKIPS && skipped == MAX_CONSECUTIVE_SKIPS),
        "{e:?}"
    );
    assert!(!dir.path().join("long/weights.json").exists());
    // Some updates skipped, others applied: the summary counts both.
    let some = json!({"grad_scaler": {"init_scale": 4194304.0, "growth_interval": 3}});
    run_scaled(&config(dir.path(), "some", 8, Value::Null, 12, some), None).unwrap();
    let log = std::fs::read_to_string(dir.path().join("some/run.log")).unwrap();
    let skipped = log.lines().filter(|l| l.contains("update skipped")).count();
    assert!(
        log.contains(&format!(
            "Completed 12 optimizer updates; this run applied {} and skipped {skipped}",
            12 - skipped
        )),
        "{log}"
    );
}

/// A power-of-two scale that never overflows changes no bit; a model that cannot scale its
/// loss refuses the key.
#[test]
fn grad_scaler_without_overflow_is_exact_and_needs_a_scaling_model() {
    let dir = tempfile::tempdir().unwrap();
    let plain = config(dir.path(), "plain", 8, Value::Null, 6, json!({}));
    let scaled = config(
        dir.path(),
        "scaled",
        8,
        Value::Null,
        6,
        json!({"grad_scaler": {"init_scale": 1024.0}}),
    );
    let a = run(&plain, None, false, None).unwrap();
    let b = run_scaled(&scaled, None).unwrap();
    assert_eq!(a.params_checksum, b.params_checksum);
    let e = run(&scaled, None, false, None).unwrap_err().to_string();
    assert!(
        e.contains("training.grad_scaler") && e.contains("float32"),
        "{e}"
    );
}

/// `training.clip_max_norm` (sbi's default clipping, PyTorch's `clip_grad_norm_`): the
/// reduced gradient is scaled to the norm before the optimizer step, by hand-computed numbers
/// (SGD: `w1 = w0 - lr * g * max / (|g| + 1e-6)`); 2 thread replicas clip the global
/// gradient as 1 replica does; under loss scaling the unscaled gradient is clipped (a clip of
/// the scaled one would shrink the step another 1024-fold); a gradient within the norm is
/// untouched; each clip is logged; a norm that is not positive is refused naming the key.
#[test]
fn clipping_scales_the_reduced_unscaled_gradient_to_the_norm() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let lr = 0.1;
    let sgd = json!({"optimizer": {"name": "sgd", "learning_rate": lr}});
    run(
        &config(d, "plain", 16, Value::Null, 1, sgd.clone()),
        None,
        false,
        None,
    )
    .unwrap();
    let w0: Vec<f64> = (0..DIM)
        .map(|i| f64::from(0.1 * lockstep_train::reference::uniform(7, i as u64, 0)))
        .collect();
    let w1 = weights(&d.join("plain"));
    let g: Vec<f64> = w0.iter().zip(&w1).map(|(a, b)| (a - b) / lr).collect();
    let norm = g.iter().map(|x| x * x).sum::<f64>().sqrt();
    assert!(norm > 1e-3, "the test needs a gradient: {g:?}");
    let max = norm / 4.0;
    let with = |extra: Value| {
        let mut t = sgd.clone();
        for (k, v) in extra.as_object().unwrap() {
            t[k] = v.clone();
        }
        t
    };
    let clip = with(json!({"clip_max_norm": max}));
    let threads = json!({"strategy": "threads", "global_batch_size": 16});
    run(
        &config(d, "clip", 16, Value::Null, 1, clip.clone()),
        None,
        false,
        None,
    )
    .unwrap();
    run(&config(d, "clip2", 8, threads, 1, clip), None, false, None).unwrap();
    let scaled = with(json!({"clip_max_norm": max, "grad_scaler": {"init_scale": 1024.0}}));
    run_scaled(&config(d, "scaled", 16, Value::Null, 1, scaled), None).unwrap();
    let coef = max / (norm + 1e-6);
    let want: Vec<f64> = w0.iter().zip(&g).map(|(w, g)| w - lr * g * coef).collect();
    let step = |w: &[f64]| -> Vec<f64> { w0.iter().zip(w).map(|(a, b)| a - b).collect() };
    for name in ["clip", "clip2", "scaled"] {
        let w = weights(&d.join(name));
        let r = rel_l2(&step(&w), &step(&want));
        assert!(
            r <= 1e-4,
            "{name}: step {:?}, by hand {:?} ({r:e})",
            step(&w),
            step(&want)
        );
        let log = std::fs::read_to_string(d.join(name).join("run.log")).unwrap();
        assert!(
            log.contains("update 1: gradient norm") && log.contains("clipped to clip_max_norm"),
            "{name}: {log}"
        );
    }
    // A norm above the gradient's leaves the update as it was, and says nothing.
    let loose = with(json!({"clip_max_norm": 2.0 * norm}));
    run(
        &config(d, "loose", 16, Value::Null, 1, loose),
        None,
        false,
        None,
    )
    .unwrap();
    assert_eq!(weights(&d.join("loose")), w1);
    let log = std::fs::read_to_string(d.join("loose").join("run.log")).unwrap();
    assert!(!log.contains("clipped"), "{log}");
    for bad in [json!(0.0), json!(-5.0)] {
        let c = config(
            d,
            "bad",
            16,
            Value::Null,
            1,
            with(json!({"clip_max_norm": bad})),
        );
        let e = EngineConfig::from_json(&c, Path::new("/"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("training.clip_max_norm") && e.contains("positive"),
            "{e}"
        );
    }
}

/// [`run`] with the reference model's emulated device ([`Model::device_state`]) counting
/// into `counts`; `scaled` as in [`run_scaled`].
fn run_on_device(
    config: &Value,
    resume: Option<&Path>,
    counts: &std::sync::Arc<DeviceCounts>,
    scaled: bool,
) -> Result<TrainSummary, TrainError> {
    let world = World::init(lockstep_comm::launch::ComputeKind::Cpu, true).unwrap();
    let cfg = EngineConfig::from_json(config, Path::new("/")).unwrap();
    let opts = EngineOptions {
        resolved_config: config.clone(),
        resume: resume.map(Path::to_path_buf),
        ..Default::default()
    };
    let seed = cfg.seed;
    run_job(&world, &cfg, &opts, |rank| {
        let mut model =
            LinearRegression::new(DIM, seed, rank, 0, None).with_device_state(counts.clone());
        if scaled {
            model = model.with_loss_scaling();
        }
        let data = RegressionData {
            dim: DIM,
            seed,
            dataset: None,
        };
        Ok((model, data))
    })
}

/// The training state on a device (`lockstep_train::device_state`): with the reference
/// model's emulated device, Adam, AdamW and SGD with momentum under schedules and gradient
/// accumulation train bit for bit like the host path; one replica reads no gradient back
/// and the parameters only for checkpoints and the run's end; two thread replicas read the
/// packed gradient once per update and upload it once, like the host path's two replicas;
/// a checkpoint read from the device resumes to the uninterrupted run; the loss scaler's
/// skips are decided from the device's finiteness test; clipping takes the gradient to the
/// host.
#[test]
fn training_state_on_a_device_trains_like_the_host() {
    use std::sync::Arc;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let get = DeviceCounts::get;
    let optimizers = [
        json!({"name": "adam", "learning_rate": 0.05,
               "schedule": {"name": "warmup_cosine", "warmup_updates": 3, "total_updates": 10}}),
        json!({"name": "adamw", "learning_rate": 0.05, "weight_decay": 0.1}),
        json!({"name": "sgd", "learning_rate": 0.1, "momentum": 0.9,
               "schedule": {"name": "step", "step_updates": 4, "gamma": 0.5}}),
    ];
    for (i, opt) in optimizers.iter().enumerate() {
        let extra = json!({"optimizer": opt, "gradient_updates_per_optimizer_step": 2,
                           "checkpoint_every": 5, "checksum_every": 1});
        let host = run(
            &config(d, &format!("host{i}"), 8, Value::Null, 10, extra.clone()),
            None,
            false,
            None,
        )
        .unwrap();
        let counts = Arc::new(DeviceCounts::default());
        let dev = run_on_device(
            &config(d, &format!("dev{i}"), 8, Value::Null, 10, extra.clone()),
            None,
            &counts,
            false,
        )
        .unwrap();
        assert_eq!(host.loss_history, dev.loss_history, "{opt}");
        assert_eq!(host.params_checksum, dev.params_checksum, "{opt}");
        assert_eq!(
            weights(&d.join(format!("host{i}"))),
            weights(&d.join(format!("dev{i}")))
        );
        // One replica: no gradient read-back, no finiteness test without loss scaling; the
        // state read back for the checkpoints of updates 5 and 10 and the run's end.
        assert_eq!(get(&counts.uploads), 1);
        assert_eq!(get(&counts.gradient_reads), 0, "{opt}");
        assert_eq!(get(&counts.finite_tests), 0);
        assert_eq!(get(&counts.applied), 10);
        assert_eq!(get(&counts.uploaded_gradients), 0);
        assert_eq!(get(&counts.downloads), 3, "{opt}");
        let (a, b) = (
            checkpoint_at(&d.join(format!("host{i}")), 5),
            checkpoint_at(&d.join(format!("dev{i}")), 5),
        );
        assert_eq!(a.trainable, b.trainable);
        assert_eq!(a.optimizer_slots, b.optimizer_slots);
        assert_eq!(a.optimizer_step, b.optimizer_step);
        // Two thread replicas: one packed gradient read-back and one upload per update and
        // replica, the host's reduction; the same as the host path's two replicas.
        let threads = json!({"strategy": "threads", "global_batch_size": 8});
        let host2 = run(
            &config(
                d,
                &format!("host2_{i}"),
                4,
                threads.clone(),
                10,
                extra.clone(),
            ),
            None,
            false,
            None,
        )
        .unwrap();
        let counts = Arc::new(DeviceCounts::default());
        let dev2 = run_on_device(
            &config(d, &format!("dev2_{i}"), 4, threads, 10, extra.clone()),
            None,
            &counts,
            false,
        )
        .unwrap();
        assert_eq!(host2.loss_history, dev2.loss_history, "{opt}");
        assert_eq!(host2.params_checksum, dev2.params_checksum);
        assert_eq!(get(&counts.gradient_reads), 20);
        assert_eq!(get(&counts.uploaded_gradients), 20);
        // Checksums after every update (checksum_every 1) read the state back on both
        // replicas, and the run's end once more; the chief's checkpoints read nothing more
        // (the checksum's read-back of that update came first, and reads again).
        assert_eq!(get(&counts.downloads), 2 * 10 + 2 + 2, "{opt}");
    }
    // A checkpoint written from the device resumes to the uninterrupted run's losses.
    let extra = json!({"optimizer": optimizers[0], "checkpoint_every": 4});
    let counts = Arc::new(DeviceCounts::default());
    let full = run_on_device(
        &config(d, "full", 8, Value::Null, 10, extra.clone()),
        None,
        &counts,
        false,
    )
    .unwrap();
    run_on_device(
        &config(d, "first", 8, Value::Null, 4, extra.clone()),
        None,
        &counts,
        false,
    )
    .unwrap();
    let ckpt = d.join("first/checkpoints/update_000004.safetensors");
    let resumed = run_on_device(
        &config(d, "resumed", 8, Value::Null, 10, extra),
        Some(&ckpt),
        &counts,
        false,
    )
    .unwrap();
    assert_eq!(full.loss_history[4..], resumed.loss_history[..]);
    assert_eq!(full.params_checksum, resumed.params_checksum);
    // Loss scaling: the device's finiteness test decides, once per update; the skipped
    // updates and the weights are the host path's.
    let scaler = json!({"grad_scaler": {"init_scale": 4194304.0, "growth_interval": 3}});
    let host = run_scaled(&config(d, "hs", 8, Value::Null, 12, scaler.clone()), None).unwrap();
    let counts = Arc::new(DeviceCounts::default());
    let dev = run_on_device(
        &config(d, "ds", 8, Value::Null, 12, scaler),
        None,
        &counts,
        true,
    )
    .unwrap();
    assert_eq!(host.loss_history, dev.loss_history);
    assert_eq!(host.params_checksum, dev.params_checksum);
    assert_eq!(get(&counts.finite_tests), 12);
    assert!(get(&counts.skipped) >= 3, "the scale overflows at first");
    assert_eq!(get(&counts.skipped) + get(&counts.applied), 12);
    assert_eq!(get(&counts.gradient_reads), 0);
    let log = std::fs::read_to_string(d.join("ds/run.log")).unwrap();
    assert!(
        log.contains("update 1: the gradient overflowed at loss scale 4194304"),
        "{log}"
    );
    // Clipping needs the gradient's norm on the host: one read-back and upload per update.
    let clip = json!({"optimizer": {"name": "sgd", "learning_rate": 0.1}, "clip_max_norm": 0.01});
    let host = run(
        &config(d, "hc", 8, Value::Null, 3, clip.clone()),
        None,
        false,
        None,
    )
    .unwrap();
    let counts = Arc::new(DeviceCounts::default());
    let dev = run_on_device(
        &config(d, "dc", 8, Value::Null, 3, clip),
        None,
        &counts,
        false,
    )
    .unwrap();
    assert_eq!(host.params_checksum, dev.params_checksum);
    assert_eq!(
        (get(&counts.gradient_reads), get(&counts.uploaded_gradients)),
        (3, 3)
    );
}
