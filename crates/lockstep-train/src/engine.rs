//! The training loop: one optimizer update per global batch, identical on every replica.
//!
//! Per update (invariants of `../shared/DESIGN.md`):
//! 1. for each of the `k` micro-batches, the chief draws the global batch of `B x replicas`
//!    samples and scatters contiguous slices, inputs and targets together (4);
//! 2. each replica adds the mean gradient of its slice into one flat buffer;
//! 3. that one buffer is all-reduced once and divided by `replicas x k` (6);
//! 4. every replica applies the same optimizer update (7), then the constraints;
//! 5. loss terms are reduced with one small sum, timings with one MAX (6); every decision
//!    that changes the number of collectives (non-finite loss, early stop) is taken from
//!    these reduced values, so all ranks take the same path (9);
//! 6. every `checksum_every` updates the parameter checksums are compared (7);
//! 7. the chief alone writes the log, CSV callbacks, checkpoints and exported weights (8, 10).

use crate::checkpoint::{self, TrainState};
use crate::config::{EngineConfig, Plan};
use crate::optim::Optimizer;
use crate::rundir::RunDir;
use crate::{checksum, Batch, BatchSource, Model, TrainError};
use lockstep_comm::{CommExt, Communicator, ReduceOp};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Per-run options that are not part of the config.
#[derive(Debug, Clone, Default)]
pub struct TrainOptions {
    /// The resolved config, copied into the run directory and hashed into checkpoints.
    pub resolved_config: Value,
    /// Restore this checkpoint before training (`--resume PATH`).
    pub resume: Option<PathBuf>,
    /// Write log lines to the log file only, not to stdout (benchmarks).
    pub quiet: bool,
}

/// What a finished run reports (identical on every rank).
#[derive(Debug, Clone, PartialEq)]
pub struct TrainSummary {
    /// Optimizer updates completed in total (including those before a resume).
    pub updates: u64,
    /// Reduced loss terms of the last update.
    pub final_losses: Vec<f64>,
    /// Reduced loss terms of every update run by this invocation, in order.
    pub loss_history: Vec<Vec<f64>>,
    /// Per update of this invocation: seconds of data (batch generation and scatter),
    /// compute (loss and gradient), communication (gradient all-reduce) and the whole update,
    /// each the slowest rank's (MAX).
    pub update_times: Vec<[f64; 4]>,
    /// Checksum of the final trainable and frozen parameters.
    pub params_checksum: u64,
    /// The run directory.
    pub output_dir: PathBuf,
    /// Files written by the model's export hook (chief only; empty elsewhere).
    pub exported: Vec<PathBuf>,
}

/// The test-only failure switch: `LOCKSTEP_TEST_INJECT_FAILURE` = `validation`,
/// `output_setup`, `update:K:RANK` or `callback:K`. Used by the failure tests to check that
/// an error at each point ends the whole job; never set it in real runs.
pub fn injected(point: &str, rank: usize, update: Option<u64>) -> bool {
    let Ok(spec) = std::env::var("LOCKSTEP_TEST_INJECT_FAILURE") else {
        return false;
    };
    let parts: Vec<&str> = spec.split(':').collect();
    match (parts.as_slice(), point) {
        (["validation"], "validation") | (["output_setup"], "output_setup") => true,
        (["update", k, r], "update") => {
            k.parse().ok() == update && r.parse::<usize>().ok() == Some(rank)
        }
        (["callback", k], "callback") => k.parse().ok() == update,
        _ => false,
    }
}

/// Fingerprint of the config parts that define the model and its training, one short hash
/// per top-level section (`"inputs:1a2b..,run:..,training:.."`), so a mismatch can name the
/// sections that differ. Left out: `run.distribution`, `run.batch_size`, `output`, and the
/// run-length and bookkeeping keys of `training` (a checkpoint resumes on another replica
/// count, with more updates, or into another directory). Absolute paths count by file name
/// only, so a moved project still resumes. SHA-256 of the canonical (sorted-key) JSON.
pub fn config_hash(resolved: &Value) -> String {
    let mut v = resolved.clone();
    if let Some(run) = v.get_mut("run").and_then(Value::as_object_mut) {
        run.remove("distribution");
        run.remove("batch_size");
    }
    if let Some(obj) = v.as_object_mut() {
        obj.remove("output");
        obj.remove("manifest");
    }
    if let Some(t) = v.get_mut("training").and_then(Value::as_object_mut) {
        for k in [
            "optimizer_updates",
            "epochs",
            "checkpoint_every",
            "checksum_every",
            "log_every",
            "early_stop_loss",
        ] {
            t.remove(k);
        }
    }
    fn file_names(v: &mut Value) {
        match v {
            Value::String(s) if s.starts_with('/') => {
                if let Some(name) = Path::new(s.as_str()).file_name() {
                    *s = name.to_string_lossy().into_owned();
                }
            }
            Value::Array(a) => a.iter_mut().for_each(file_names),
            Value::Object(o) => o.values_mut().for_each(file_names),
            _ => {}
        }
    }
    file_names(&mut v);
    let sections: Vec<String> = match v.as_object() {
        Some(obj) => obj
            .iter()
            .map(|(k, sec)| {
                let text = serde_json::to_string(sec).unwrap_or_default();
                let d = Sha256::digest(text.as_bytes());
                let h: String = d.iter().take(4).map(|b| format!("{b:02x}")).collect();
                format!("{k}:{h}")
            })
            .collect(),
        None => Vec::new(),
    };
    sections.join(",")
}

/// The sections whose hashes differ between two [`config_hash`] fingerprints.
fn differing_sections(a: &str, b: &str) -> Vec<String> {
    let parse = |s: &str| -> std::collections::BTreeMap<String, String> {
        s.split(',')
            .filter_map(|p| p.split_once(':'))
            .map(|(k, h)| (k.to_string(), h.to_string()))
            .collect()
    };
    let (a, b) = (parse(a), parse(b));
    let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .filter(|k| a.get(*k) != b.get(*k))
        .cloned()
        .collect()
}

/// Chief-side failure shared with the peers: the chief broadcasts 0 (ok) or 1 (failed) so
/// every rank leaves together instead of waiting in the next collective.
fn agree(
    comm: &dyn Communicator,
    chief_result: Result<(), TrainError>,
    what: &str,
) -> Result<(), TrainError> {
    let mut flag = [u64::from(chief_result.is_err())];
    if comm.is_chief() {
        comm.broadcast(&mut flag, 0)?;
        return chief_result;
    }
    comm.broadcast(&mut flag, 0)?;
    if flag[0] != 0 {
        // The chief returns its error and ends the job (MPI: abort; threads: the group is
        // poisoned), so this barrier returns the chief's own failure at once.
        comm.barrier()?;
        return Err(TrainError::PeerFailed {
            rank: 0,
            message: format!("{what} failed on the chief"),
        });
    }
    Ok(())
}

/// Where update `u`'s first sample lies (finite sources restart at a multiple of their size
/// each epoch and drop the partial remainder).
fn first_sample_of(u: u64, per_update: u64, steps_per_epoch: u64, dataset: Option<u64>) -> u64 {
    match dataset {
        Some(n) => (u / steps_per_epoch) * n + (u % steps_per_epoch) * per_update,
        None => u * per_update,
    }
}

/// Trains `model` on this rank (a collective: call it on every rank of `comm` with the same
/// config, plan and an equally built model).
///
/// Errors: config/plan inconsistencies, output directory problems (chief), checkpoint
/// problems, model errors, divergence, non-finite losses, and any failed collective (a peer's
/// failure arrives as [`TrainError::Comm`] or [`TrainError::PeerFailed`]).
pub fn train(
    comm: &dyn Communicator,
    cfg: &EngineConfig,
    plan: &Plan,
    model: &mut dyn Model,
    source: &mut dyn BatchSource,
    opts: &TrainOptions,
) -> Result<TrainSummary, TrainError> {
    let rank = comm.rank();
    let replicas = comm.size();
    if replicas != plan.replicas {
        return Err(TrainError::config(
            "run.distribution",
            format!(
                "the plan has {} replicas but the communicator has {replicas} ranks",
                plan.replicas
            ),
        ));
    }
    let b = plan.local_batch;
    let g = plan.global_batch;
    let k = cfg.accumulation;
    let per_update = (g * k) as u64;
    let dataset = source.num_samples();
    let mut steps_per_epoch = cfg.steps_per_epoch;
    if let Some(n) = dataset {
        let fit = n / per_update;
        if fit == 0 {
            return Err(TrainError::config(
                "run.batch_size",
                format!("the data set has {n} samples, fewer than one update needs ({g} per micro-batch x {k}); lower run.batch_size"),
            ));
        }
        if cfg.steps_per_epoch > fit && cfg.steps_per_epoch != cfg.updates {
            return Err(TrainError::config(
                "training.steps_per_epoch",
                format!("{} updates of {per_update} samples exceed the data set's {n} samples; at most {fit} fit (partial batches are never padded)", cfg.steps_per_epoch),
            ));
        }
        steps_per_epoch = steps_per_epoch.min(fit);
    }
    let loss_names = model.loss_names();

    if model.trainable().is_empty() {
        return Err(TrainError::config(
            "training",
            "the model has no trainable parameters (an empty network, or no edges to train); check the network files and training.train_input_weights",
        ));
    }
    let hash = config_hash(&opts.resolved_config);
    let ckpt = Checkpointer {
        per_update,
        steps_per_epoch,
        dataset,
        seed: cfg.seed,
        hash: hash.clone(),
    };
    let mut optimizer = Optimizer::new(cfg.optimizer.clone(), model.trainable().len());
    let mut start_update = 0u64;
    // Resume: the chief reads and verifies the checkpoint before anything is written (so an
    // unusable checkpoint loses nothing); the peers get the state in the startup broadcast.
    if let Some(path) = &opts.resume {
        let restored = if comm.is_chief() {
            restore(path, &hash, cfg, model, &mut optimizer).map(|u| {
                start_update = u;
            })
        } else {
            Ok(())
        };
        agree(comm, restored, "checkpoint restore")?;
    }

    // Output setup: the chief alone creates the run directory; the peers wait for its verdict.
    // Resuming from a checkpoint inside the output directory continues that run in place.
    let mut rundir = None;
    let setup = if comm.is_chief() {
        if injected("output_setup", rank, None) {
            Err(TrainError::Injected("output setup".into(), rank))
        } else {
            let in_place = opts.resume.as_ref().is_some_and(|p| {
                is_inside(p, &cfg.output_dir)
                    && cfg.output_dir.join(crate::rundir::MARKER).is_file()
            });
            let dir = if in_place {
                RunDir::reopen(
                    &cfg.output_dir,
                    &cfg.log_file,
                    &opts.resolved_config,
                    &loss_names,
                    start_update,
                )
            } else {
                RunDir::create(
                    &cfg.output_dir,
                    cfg.overwrite_output_dir,
                    &cfg.log_file,
                    &opts.resolved_config,
                    &loss_names,
                )
            };
            dir.map(|mut d| {
                d.set_quiet(opts.quiet);
                rundir = Some(d)
            })
        }
    } else {
        Ok(())
    };
    agree(comm, setup, "output setup")?;

    // Startup broadcast of every piece of state from the chief (invariant 7).
    let sizes = [
        model.trainable().len() as u64,
        model.frozen().len() as u64,
        optimizer.slots.len() as u64,
        source.input_width() as u64,
        source.target_width() as u64,
    ];
    let mut chief_sizes = sizes;
    comm.broadcast(&mut chief_sizes, 0)?;
    let mismatch = comm.all_reduce_scalar(u64::from(chief_sizes != sizes), ReduceOp::Max)?;
    if mismatch != 0 {
        return Err(TrainError::config(
            "networks",
            format!("replicas were built differently: rank {rank} has (trainable, frozen, optimizer slots, input width, target width) = {sizes:?}, the chief {chief_sizes:?}"),
        ));
    }
    comm.broadcast(model.trainable_mut(), 0)?;
    comm.broadcast(model.frozen_mut(), 0)?;
    for slot in optimizer.slots.iter_mut() {
        comm.broadcast(slot, 0)?;
    }
    let mut counters = [start_update, optimizer.step, cfg.seed];
    comm.broadcast(&mut counters, 0)?;
    start_update = counters[0];
    optimizer.step = counters[1];
    if let Some(d) = rundir.as_mut() {
        for w in &plan.warnings {
            d.log(w)?;
        }
        d.log(&format!(
            "lockstep train: {} replica(s) ({}), local batch {b}, global batch {g}{}, {} trainable parameters, updates {}..{}, output {}",
            replicas,
            match plan.strategy {
                None => "serial".to_string(),
                Some(s) => format!("{s:?}").to_lowercase(),
            },
            if k > 1 { format!(" x {k} micro-batches") } else { String::new() },
            model.trainable().len(),
            start_update,
            cfg.updates,
            cfg.output_dir.display()
        ))?;
    }

    if let Some(d) = rundir.as_mut() {
        d.start_progress(start_update, cfg.updates);
    }
    let n = model.trainable().len();
    let mut grad = vec![0.0f32; n];
    let mut micro = vec![0.0f32; n];
    let iw = source.input_width();
    let tw = source.target_width();
    let mut local = Batch {
        first_sample: 0,
        samples: b,
        inputs: vec![0.0; b * iw],
        targets: vec![0.0; b * tw],
    };
    let mut history = Vec::new();
    let mut update_times = Vec::new();
    let mut last = vec![f64::NAN; loss_names.len()];
    let mut update = start_update;
    let run_start = Instant::now();
    while update < cfg.updates {
        let t_update = Instant::now();
        let (mut t_data, mut t_compute) = (0.0f64, 0.0f64);
        let base = first_sample_of(update, per_update, steps_per_epoch, dataset);
        grad.iter_mut().for_each(|x| *x = 0.0);
        let mut terms = vec![0.0f64; loss_names.len()];
        for m in 0..k {
            let t0 = Instant::now();
            let first = base + (m * g) as u64;
            let global = if comm.is_chief() {
                let batch = source
                    .global_batch(first, g)
                    .map_err(|e| TrainError::Model { update, error: e });
                let ok = batch.as_ref().map(|_| ()).map_err(|e| TrainError::Model {
                    update,
                    error: anyhow::anyhow!("{e}"),
                });
                agree(comm, ok, "batch generation")?;
                Some(batch?)
            } else {
                agree(comm, Ok(()), "batch generation")?;
                None
            };
            let empty = Vec::new();
            let (gi, gt) = match &global {
                Some(batch) => (&batch.inputs, &batch.targets),
                None => (&empty, &empty),
            };
            if iw > 0 {
                comm.scatter(gi, &mut local.inputs, 0)?;
            }
            if tw > 0 {
                comm.scatter(gt, &mut local.targets, 0)?;
            }
            local.first_sample = first + (rank * b) as u64;
            t_data += t0.elapsed().as_secs_f64();

            let t0 = Instant::now();
            if injected("update", rank, Some(update)) {
                return Err(TrainError::Injected(format!("update {update}"), rank));
            }
            let target: &mut [f32] = if k == 1 { &mut grad } else { &mut micro };
            if k > 1 {
                target.iter_mut().for_each(|x| *x = 0.0);
            }
            let lt = model
                .loss_and_grad(&local, target)
                .map_err(|e| TrainError::Model { update, error: e })?;
            if lt.len() != terms.len() {
                return Err(TrainError::Model {
                    update,
                    error: anyhow::anyhow!(
                        "the model returned {} loss terms but names {}",
                        lt.len(),
                        terms.len()
                    ),
                });
            }
            if k > 1 {
                grad.iter_mut().zip(&micro).for_each(|(a, b)| *a += *b);
            }
            terms.iter_mut().zip(&lt).for_each(|(a, b)| *a += *b);
            t_compute += t0.elapsed().as_secs_f64();
        }

        // One reduction of all gradients, packed in one buffer (invariant 6).
        let t0 = Instant::now();
        comm.all_reduce(&mut grad, ReduceOp::Sum)?;
        let t_comm = t0.elapsed().as_secs_f64();
        let scale = 1.0 / (replicas * k) as f32;
        grad.iter_mut().for_each(|x| *x *= scale);
        optimizer.update(model.trainable_mut(), &grad);
        model.after_update();
        update += 1;
        // Identical on every replica, so every rank stops here together (invariant 9).
        if let Some((index, value)) = model
            .trainable()
            .iter()
            .enumerate()
            .find(|(_, v)| !v.is_finite())
        {
            return Err(TrainError::NonFiniteParameter {
                update,
                index,
                value: *value,
            });
        }

        // Metrics: loss terms weighted by samples (one small sum), timings by MAX.
        let mut metric: Vec<f64> = terms.iter().map(|t| t * b as f64).collect();
        metric.push((b * k) as f64);
        comm.all_reduce(&mut metric, ReduceOp::Sum)?;
        let total_samples = metric.pop().unwrap_or(1.0);
        let reduced: Vec<f64> = metric
            .iter()
            .map(|t| t * k as f64 / total_samples)
            .collect();
        let mut times = [t_data, t_compute, t_comm, t_update.elapsed().as_secs_f64()];
        comm.all_reduce(&mut times, ReduceOp::Max)?;
        let total: f64 = reduced.iter().sum();
        if !total.is_finite() {
            return Err(TrainError::NonFinite {
                update,
                value: total,
            });
        }
        if cfg.checksum_every > 0 && update % cfg.checksum_every == 0 {
            verify_identical(comm, model, update)?;
        }
        let epoch = (update - 1) / steps_per_epoch;
        if let Some(d) = rundir.as_mut() {
            if injected("callback", rank, Some(update)) {
                return Err(TrainError::Injected(
                    format!("callback at update {update}"),
                    rank,
                ));
            }
            d.losses_row(update, epoch, &reduced)?;
            let samples_per_s = per_update as f64 / times[3].max(1e-12);
            d.performance_row(
                update,
                [times[0], times[1], times[2]],
                times[3],
                samples_per_s,
            )?;
            if d.has_progress() {
                d.progress(
                    update,
                    format!("epoch {epoch} loss {total:.4e} {samples_per_s:.1} samples/s"),
                );
            }
            if update % cfg.log_every == 0 || update == cfg.updates {
                let elapsed = run_start.elapsed().as_secs_f64();
                let done = (update - start_update) as f64;
                let eta = elapsed / done * (cfg.updates - update) as f64;
                let parts: Vec<String> = loss_names
                    .iter()
                    .zip(&reduced)
                    .map(|(n, v)| format!("{n} {v:.4e}"))
                    .collect();
                let line = format!(
                    "update {update}/{} epoch {epoch} loss {total:.6e} ({}) {samples_per_s:.1} samples/s comm {:.0}% ETA {eta:.0} s",
                    cfg.updates,
                    parts.join(", "),
                    100.0 * times[2] / times[3].max(1e-12)
                );
                if d.has_progress() {
                    d.log_quiet(&line)?;
                } else {
                    d.log(&line)?;
                }
            }
            if cfg.checkpoint_every > 0 && update % cfg.checkpoint_every == 0 {
                ckpt.save(d.root(), update, model, &optimizer)?;
            }
        }
        history.push(reduced.clone());
        update_times.push(times);
        last = reduced;
        if let Some(stop) = cfg.early_stop_loss {
            if total < stop {
                if let Some(d) = rundir.as_mut() {
                    d.log(&format!(
                        "early stop: loss {total:.6e} < {stop} at update {update}"
                    ))?;
                }
                break;
            }
        }
    }

    verify_identical(comm, model, update)?;
    let mut exported = Vec::new();
    let finish = match rundir.as_mut() {
        Some(d) => (|| -> Result<(), TrainError> {
            d.finish_progress();
            ckpt.save(d.root(), update, model, &optimizer)?;
            exported = model
                .export(d.root())
                .map_err(|e| TrainError::Model { update, error: e })?;
            for f in &exported {
                d.log(&format!("exported {}", f.display()))?;
            }
            d.log(&format!("Completed {update} optimizer updates."))?;
            d.log(&format!("Outputs in {}", d.root().display()))
        })(),
        None => Ok(()),
    };
    agree(comm, finish, "writing the final outputs")?;
    let mut all = model.trainable().to_vec();
    all.extend_from_slice(model.frozen());
    Ok(TrainSummary {
        updates: update,
        final_losses: last,
        loss_history: history,
        update_times,
        params_checksum: checksum(&all),
        output_dir: cfg.output_dir.clone(),
        exported,
    })
}

/// Compares the parameter checksums of all ranks (invariant 7).
fn verify_identical(
    comm: &dyn Communicator,
    model: &dyn Model,
    update: u64,
) -> Result<(), TrainError> {
    let mine = [checksum(model.trainable()) ^ checksum(model.frozen()).rotate_left(1)];
    let all = comm.all_gather_vec(&mine)?;
    if all.iter().any(|&c| c != all[0]) {
        let list: Vec<String> = all
            .iter()
            .enumerate()
            .map(|(r, c)| format!("rank {r}: {c:016x}"))
            .collect();
        return Err(TrainError::Diverged {
            update,
            checksums: list.join(", "),
        });
    }
    Ok(())
}

/// True when `path` lies inside `dir` (both resolved to absolute, symlinks followed where
/// they exist).
fn is_inside(path: &Path, dir: &Path) -> bool {
    let abs = |p: &Path| std::fs::canonicalize(p).or_else(|_| std::path::absolute(p));
    match (abs(path), abs(dir)) {
        (Ok(p), Ok(d)) => p.starts_with(d),
        _ => false,
    }
}

/// Writes checkpoints of this run (chief only).
struct Checkpointer {
    per_update: u64,
    steps_per_epoch: u64,
    dataset: Option<u64>,
    seed: u64,
    hash: String,
}

impl Checkpointer {
    /// Writes `checkpoints/update_NNNNNN.safetensors` and points `checkpoints/latest` at it.
    fn save(
        &self,
        root: &Path,
        update: u64,
        model: &dyn Model,
        optimizer: &Optimizer,
    ) -> Result<(), TrainError> {
        let mut state = TrainState {
            update,
            next_sample: first_sample_of(
                update,
                self.per_update,
                self.steps_per_epoch,
                self.dataset,
            ),
            seed: self.seed,
            trainable: model.trainable().to_vec(),
            frozen: model.frozen().to_vec(),
            optimizer_step: 0,
            optimizer_slots: Vec::new(),
            config_hash: self.hash.clone(),
        };
        state.set_optimizer(optimizer);
        let path = root.join(format!("checkpoints/update_{update:06}.safetensors"));
        checkpoint::write(&path, &state)?;
        checkpoint::write_atomic(
            &root.join("checkpoints/latest"),
            path.file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .as_bytes(),
        )
    }
}

/// Loads a checkpoint into the chief's model and optimizer; returns the update to continue from.
fn restore(
    path: &Path,
    hash: &str,
    cfg: &EngineConfig,
    model: &mut dyn Model,
    optimizer: &mut Optimizer,
) -> Result<u64, TrainError> {
    let state = checkpoint::read(path)?;
    let bad = |m: String| TrainError::Checkpoint {
        path: path.to_path_buf(),
        message: m,
    };
    if state.config_hash != hash {
        return Err(bad(format!(
            "it was written for another configuration: the config sections {} differ (only run.batch_size, run.distribution, output and the run length may change on resume)",
            differing_sections(&state.config_hash, hash).join(", ")
        )));
    }
    if state.seed != cfg.seed {
        return Err(bad(format!(
            "it was written with run.seed {} but the config has {}",
            state.seed, cfg.seed
        )));
    }
    if state.trainable.len() != model.trainable().len()
        || state.frozen.len() != model.frozen().len()
    {
        return Err(bad(format!(
            "it holds {} trainable and {} frozen parameters, the model has {} and {}",
            state.trainable.len(),
            state.frozen.len(),
            model.trainable().len(),
            model.frozen().len()
        )));
    }
    if state.optimizer_slots.len() != optimizer.slots.len()
        || state
            .optimizer_slots
            .iter()
            .any(|s| s.len() != model.trainable().len())
    {
        return Err(bad(
            "its optimizer state does not match training.optimizer".into()
        ));
    }
    model.trainable_mut().copy_from_slice(&state.trainable);
    model.frozen_mut().copy_from_slice(&state.frozen);
    optimizer.step = state.optimizer_step;
    optimizer.slots = state.optimizer_slots;
    Ok(state.update)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn config_hash_ignores_distribution_output_and_length() {
        let a = json!({"run": {"batch_size": 4, "distribution": {"strategy": "mpi"}}, "training": {"optimizer_updates": 3}, "output": {"output_dir": "a"}});
        let b = json!({"run": {"batch_size": 4}, "training": {"optimizer_updates": 8}, "output": {"output_dir": "b"}});
        let c = json!({"run": {"batch_size": 4, "seed": 9}, "training": {"optimizer_updates": 8}, "output": {"output_dir": "b"}});
        assert_eq!(config_hash(&a), config_hash(&b));
        assert_ne!(config_hash(&a), config_hash(&c));
        assert_eq!(
            differing_sections(&config_hash(&a), &config_hash(&c)),
            vec!["run".to_string()]
        );
        // A moved project (same file names, other folders) keeps its fingerprint.
        let d = json!({"network": "/home/a/net/config.circuit.json", "run": {"batch_size": 4}});
        let e = json!({"network": "/scratch/b/net/config.circuit.json", "run": {"batch_size": 4}});
        assert_eq!(config_hash(&d), config_hash(&e));
    }

    #[test]
    fn finite_sources_restart_each_epoch() {
        // 10 samples, 3 per update: 3 updates per epoch, the 10th sample dropped.
        assert_eq!(first_sample_of(0, 3, 3, Some(10)), 0);
        assert_eq!(first_sample_of(2, 3, 3, Some(10)), 6);
        assert_eq!(first_sample_of(3, 3, 3, Some(10)), 10);
        assert_eq!(first_sample_of(4, 3, 3, None), 12);
    }
}
