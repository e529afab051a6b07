//! The training loop: one optimizer update per global batch, identical on every replica.
//!
//! Per update (invariants of `docs/design.md`):
//! 1. for each of the `k` micro-batches, the chief draws the global batch of `B x replicas`
//!    samples and scatters contiguous slices, inputs and targets together (4); a source
//!    keyed by sample ([`BatchSource::keyed_by_sample`]) instead lets every replica draw
//!    its own slice `[r*B, (r+1)*B)`, the same values, in parallel;
//! 2. each replica adds the mean gradient of its slice into one flat buffer;
//! 3. that one buffer is all-reduced once and divided by `replicas x k` (6);
//! 4. every replica applies the same optimizer update (7), then the constraints;
//! 5. loss terms are reduced with one small sum, timings with one MAX (6); every decision
//!    that changes the number of collectives (non-finite loss, early stop) is taken from
//!    these reduced values, so all ranks take the same path (9);
//! 6. every `checksum_every` updates the parameter checksums are compared (7);
//! 7. the chief alone writes the log, CSV callbacks, checkpoints and exported weights (8, 10).

use crate::checkpoint::{self, TrainState};
use crate::config::{EngineConfig, LogStyle, Plan};
use crate::grad_scaler::{GradScaler, ScalerVerdict};
use crate::optim::Optimizer;
use crate::rundir::RunDir;
use crate::{checksum, Batch, BatchSource, DeviceUpdate, Model, TrainError};
use lockstep_comm::{CommExt, Communicator, ReduceOp};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Per-run options that are not part of the config.
#[derive(Debug, Clone, Default)]
pub struct EngineOptions {
    /// The resolved config, copied into the run directory and hashed into checkpoints.
    pub resolved_config: Value,
    /// Restore this checkpoint before training (`--resume PATH`): a checkpoint file, the
    /// `checkpoints/latest` pointer, or a run directory (its latest checkpoint); see
    /// [`checkpoint::resolve`].
    pub resume: Option<PathBuf>,
    /// Write log lines to the log file only, not to stdout (benchmarks).
    pub quiet: bool,
    /// A config hash a resumed checkpoint may carry in place of this config's own: the
    /// caller compared the checkpoint's config with this one itself and found only keys
    /// that may change on resume differing (`lockstep npe train`'s mixed-precision keys).
    pub accept_config_hash: Option<String>,
    /// How the log names the command and its output settings (default: `lockstep train`'s).
    pub names: CommandNames,
    /// A failure to inject (the failure tests and `lockstep-train-check` only; `None` in
    /// every run of the `lockstep` command).
    pub fault: Option<crate::testing::Fault>,
}

/// How the engine's log lines name the command that runs it and the setting that lets it
/// replace an earlier run, so that each command's messages name its own keys and flags.
#[derive(Debug, Clone)]
pub struct CommandNames {
    /// The command, as the log header names it (`lockstep train`).
    pub command: String,
    /// The setting that replaces an earlier run (`output.overwrite_output_dir is true`).
    pub overwrite: String,
}

impl Default for CommandNames {
    fn default() -> Self {
        CommandNames {
            command: "lockstep train".into(),
            overwrite: "output.overwrite_output_dir is true".into(),
        }
    }
}

impl EngineOptions {
    /// An error when the injected fault `point` is set for this rank and update (`fault` is
    /// `None` outside the failure tests, and then this is `Ok`).
    fn injected(
        &self,
        point: crate::testing::FaultPoint,
        rank: usize,
        update: u64,
    ) -> Result<(), TrainError> {
        match &self.fault {
            Some(f) if f.fires(point, rank, update) => Err(TrainError::Injected {
                what: f.to_string(),
                rank,
            }),
            _ => Ok(()),
        }
    }
}

use crate::testing::FaultPoint;

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

/// Fingerprint of the config parts that define the model and its training, one short hash
/// per top-level section (`"inputs:1a2b..,run:..,training:.."`), so a mismatch can name the
/// sections that differ. Left out: `run.distribution`, `run.batch_size`, `run.device`,
/// `output`, and the run-length and bookkeeping keys of `training` (a checkpoint resumes on
/// another replica count, on CPU cores or a GPU, with or without mixed precision's
/// `grad_scaler`, with more updates, or into another directory). Absolute paths count by file name
/// only, so a moved project still resumes. SHA-256 of the canonical (sorted-key) JSON.
pub fn config_hash(resolved: &Value) -> String {
    let mut v = resolved.clone();
    if let Some(run) = v.get_mut("run").and_then(Value::as_object_mut) {
        run.remove("distribution");
        run.remove("batch_size");
        run.remove("device");
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
            "log_style",
            "prefetch",
            "early_stop_loss",
            "grad_scaler",
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

/// The error for a model without trainable parameters (an empty network, or one whose
/// trained edge populations are empty or absent): every replica finds it at validation.
pub(crate) fn no_trainable_parameters() -> TrainError {
    TrainError::config(
        "training",
        "the model has no trainable parameters (an empty network, or no edges to train); check the network files and training.train_input_weights",
    )
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

/// Shares the outcome of a chief-only step with the peers: the chief passes `Some(result)`,
/// the peers `None`; the chief broadcasts 0 (ok) or 1 (failed) so every rank leaves together
/// instead of waiting in the next collective. Returns the chief's value on the chief and
/// `None` on the peers.
///
/// Errors: the chief's own error on the chief; [`TrainError::PeerFailed`] naming `what` on
/// the peers.
fn agree_with_chief<T>(
    comm: &dyn Communicator,
    chief: Option<Result<T, TrainError>>,
    what: &str,
) -> Result<Option<T>, TrainError> {
    let mut flag = [u64::from(matches!(chief, Some(Err(_))))];
    comm.broadcast(&mut flag, 0)?;
    match chief {
        Some(result) => result.map(Some),
        None if flag[0] != 0 => {
            // The chief returns its error and ends the job (MPI: abort; threads: the group
            // is poisoned), so this barrier returns the chief's own failure at once.
            comm.barrier()?;
            Err(TrainError::PeerFailed {
                rank: 0,
                message: format!("{what} failed on the chief"),
            })
        }
        None => Ok(None),
    }
}

/// [`agree_with_chief`] for a chief-only step before any training (restoring the
/// checkpoint, setting up the outputs): every rank learns from the broadcast that the chief
/// refused the run, so the failure is agreed ([`TrainError::is_agreed`]) and the job ends
/// without an abort, the chief's reason printed once: the chief returns its error as
/// [`TrainError::Refused`], the peers [`TrainError::RefusedByPeer`].
///
/// Errors: as described; failed collectives.
fn chief_may_refuse<T>(
    comm: &dyn Communicator,
    chief: Option<Result<T, TrainError>>,
) -> Result<Option<T>, TrainError> {
    let mut flag = [u64::from(matches!(chief, Some(Err(_))))];
    comm.broadcast(&mut flag, 0)?;
    match chief {
        Some(Ok(v)) => Ok(Some(v)),
        Some(Err(e)) if e.is_agreed() => Err(e),
        Some(Err(e)) => Err(TrainError::Refused(Box::new(e))),
        None if flag[0] != 0 => Err(TrainError::RefusedByPeer { rank: 0 }),
        None => Ok(None),
    }
}

/// `1 optimizer update`, `N optimizer updates`.
fn optimizer_updates(n: u64) -> String {
    plural(n, "optimizer update")
}

/// `1 thing`, `N things`.
fn plural(n: u64, thing: &str) -> String {
    format!("{n} {thing}{}", if n == 1 { "" } else { "s" })
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
/// Phases (the methods of a private `Trainer`): validate, restore a checkpoint, set up the
/// outputs (chief), broadcast the state, then per update run it, reduce its metrics and run
/// the callbacks, and finally finish (last checksum, checkpoint, export).
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
    opts: &EngineOptions,
) -> Result<TrainSummary, TrainError> {
    let mut t = Trainer::new(comm, cfg, plan, model, source, opts)?;
    let result = run(&mut t);
    // The model computes from its host buffers again (after an error they hold what the
    // last read-back read).
    if t.device {
        if let Some(d) = t.model.device_state() {
            d.release();
        }
    }
    result
}

/// The phases of [`train`] after validation.
fn run(t: &mut Trainer<'_>) -> Result<TrainSummary, TrainError> {
    t.restore_checkpoint()?;
    t.set_up_outputs()?;
    t.broadcast_state()?;
    t.announce()?;
    while t.update < t.cfg.updates {
        let step = t.run_update()?;
        let metrics = t.reduce_metrics(step)?;
        t.end_of_epoch(&metrics)?;
        t.callbacks(&metrics)?;
        if metrics.interrupted {
            return Err(t.stop_interrupted());
        }
        if t.early_stop(&metrics)? {
            break;
        }
    }
    t.finish()
}

/// What one update measured on this rank, before reduction.
struct UpdateStep {
    /// Sum over this rank's micro-batches of each loss term (each a mean over its samples).
    terms: Vec<f64>,
    /// Seconds of data, compute and communication on this rank.
    times: [f64; 3],
    /// When the update began.
    start: Instant,
}

/// What one update measured across all ranks.
struct Metrics {
    /// Each loss term as the mean over every sample of the global batch (all micro-batches,
    /// all replicas).
    losses: Vec<f64>,
    /// The sum of `losses`.
    total: f64,
    /// Seconds of data, compute, communication and the whole update, the slowest rank's.
    times: [f64; 4],
    /// Some rank was asked to stop ([`lockstep_core::interrupt`]) by the end of the update.
    interrupted: bool,
}

/// One rank's training run: the state shared by the phases of [`train`].
struct Trainer<'a> {
    comm: &'a dyn Communicator,
    cfg: &'a EngineConfig,
    plan: &'a Plan,
    model: &'a mut dyn Model,
    source: &'a mut dyn BatchSource,
    opts: &'a EngineOptions,
    loss_names: Vec<String>,
    checkpointer: Checkpointer,
    optimizer: Optimizer,
    /// Dynamic loss scaling (`training.grad_scaler`), identical on every replica.
    scaler: Option<GradScaler>,
    /// Updates of this run applied and skipped (loss scaling), and skipped in a row.
    applied: u64,
    skipped: u64,
    skipped_in_a_row: u64,
    rundir: Option<RunDir>,
    start_update: u64,
    update: u64,
    grad: Vec<f32>,
    micro: Vec<f32>,
    local: Batch,
    history: Vec<Vec<f64>>,
    update_times: Vec<[f64; 4]>,
    last: Vec<f64>,
    run_start: Instant,
    /// The update whose first sample the chief's model keeps a record of
    /// ([`Model::record_first_sample`]), until the callbacks write it.
    sample_record: Option<u64>,
    /// The next batch this rank draws (its first sample and the draw), drawn by the loader
    /// thread during the previous micro-batch (`training.prefetch`): the chief's next global
    /// micro-batch, or with [`Trainer::own_slices`] this rank's own slice of it.
    prefetched: Option<(u64, anyhow::Result<Batch>)>,
    /// Every replica draws its own slice `[r*B, (r+1)*B)` of each global micro-batch instead
    /// of receiving it from the chief: the source is keyed by sample
    /// ([`BatchSource::keyed_by_sample`]) on every rank and there is more than one replica.
    /// The slices hold exactly what the chief would have scattered (invariant 4), and the
    /// replicas simulate in parallel (issue 17: per-replica loaders).
    own_slices: bool,
    /// The model keeps its parameters, gradient and optimizer slots on its device
    /// ([`Model::device_state`], on every replica): the host's copies are stale between
    /// read-backs ([`Trainer::read_back_state`]).
    device: bool,
}

impl<'a> Trainer<'a> {
    /// Validates the plan against the communicator and the data set and allocates the
    /// buffers (nothing is written).
    ///
    /// Errors: [`TrainError::Config`] for a plan that does not match the communicator, a data
    /// set smaller than one update, or a model without trainable parameters.
    fn new(
        comm: &'a dyn Communicator,
        cfg: &'a EngineConfig,
        plan: &'a Plan,
        model: &'a mut dyn Model,
        source: &'a mut dyn BatchSource,
        opts: &'a EngineOptions,
    ) -> Result<Self, TrainError> {
        if comm.size() != plan.replicas {
            return Err(TrainError::config(
                "run.distribution",
                format!(
                    "the plan has {} replicas but the communicator has {} ranks",
                    plan.replicas,
                    comm.size()
                ),
            ));
        }
        let (g, k) = (plan.global_batch, cfg.accumulation);
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
        let n = model.trainable().len();
        if n == 0 {
            return Err(no_trainable_parameters());
        }
        let optimizer = Optimizer::new(cfg.optimizer.clone(), n);
        if optimizer.steps_on_validation() && source.validation_samples() == 0 {
            return Err(TrainError::config(
                "training.optimizer.schedule",
                "reduce_on_plateau steps on the validation loss at each epoch end, but this run has no validation set (lockstep npe: set data.train_fraction below 1); use another schedule",
            ));
        }
        let b = plan.local_batch;
        let local = Batch {
            first_sample: 0,
            samples: b,
            inputs: vec![0.0; b * source.input_width()],
            targets: vec![0.0; b * source.target_width()],
        };
        let scaler = cfg.grad_scaler.map(GradScaler::new);
        if let Some(s) = &scaler {
            if !model.set_loss_scale(s.scale()) {
                return Err(TrainError::config(
                    "training.grad_scaler",
                    "is set, but this model computes in float32 and does not scale its loss; remove training.grad_scaler",
                ));
            }
        }
        let loss_names = model.loss_names();
        Ok(Trainer {
            scaler,
            applied: 0,
            skipped: 0,
            skipped_in_a_row: 0,
            comm,
            cfg,
            plan,
            checkpointer: Checkpointer {
                per_update,
                steps_per_epoch,
                dataset,
                seed: cfg.seed,
                hash: config_hash(&opts.resolved_config),
            },
            optimizer,
            model,
            source,
            opts,
            last: vec![f64::NAN; loss_names.len()],
            loss_names,
            rundir: None,
            start_update: 0,
            update: 0,
            grad: vec![0.0; n],
            micro: if k > 1 { vec![0.0; n] } else { Vec::new() },
            local,
            history: Vec::new(),
            update_times: Vec::new(),
            run_start: Instant::now(),
            sample_record: None,
            prefetched: None,
            own_slices: false,
            device: false,
        })
    }

    /// Resume: the chief reads and verifies the checkpoint before anything is written (so an
    /// unusable checkpoint loses nothing); the peers get the state in the startup broadcast.
    ///
    /// Errors: [`TrainError::Checkpoint`] (chief) or [`TrainError::PeerFailed`] (peers).
    fn restore_checkpoint(&mut self) -> Result<(), TrainError> {
        let Some(path) = &self.opts.resume else {
            return Ok(());
        };
        let restored = self.comm.is_chief().then(|| {
            let hash = &self.checkpointer.hash;
            restore(
                path,
                (hash, self.opts.accept_config_hash.as_deref()),
                self.cfg,
                &mut *self.model,
                &mut self.optimizer,
                self.scaler.as_mut(),
            )
        });
        if let Some(update) = chief_may_refuse(self.comm, restored)? {
            self.start_update = update;
        }
        Ok(())
    }

    /// The chief alone creates the run directory (or continues it in place when resuming
    /// from one of its checkpoints); the peers wait for its verdict.
    ///
    /// Errors: [`TrainError::OutputDir`] / [`TrainError::Io`] (chief) or
    /// [`TrainError::PeerFailed`] (peers).
    fn set_up_outputs(&mut self) -> Result<(), TrainError> {
        let chief = self.comm.is_chief().then(|| self.open_run_dir());
        self.rundir = chief_may_refuse(self.comm, chief)?;
        Ok(())
    }

    fn open_run_dir(&self) -> Result<RunDir, TrainError> {
        let (cfg, opts) = (self.cfg, self.opts);
        opts.injected(FaultPoint::OutputSetup, self.comm.rank(), 0)?;
        let resumed = opts
            .resume
            .as_deref()
            .map(checkpoint::resolve)
            .transpose()?;
        let in_place = resumed.is_some_and(|p| {
            is_inside(&p, &cfg.output_dir) && lockstep_core::output_dir::is_marked(&cfg.output_dir)
        });
        let mut dir = if in_place {
            RunDir::reopen(
                &cfg.output_dir,
                &cfg.log_file,
                &opts.resolved_config,
                &self.loss_names,
                self.start_update,
            )?
        } else {
            RunDir::create(
                &cfg.output_dir,
                cfg.overwrite_output_dir,
                &cfg.log_file,
                &opts.resolved_config,
                &self.loss_names,
            )?
        };
        dir.set_quiet(opts.quiet);
        if dir.replaced_earlier_run() {
            dir.log(&format!(
                "Replaced the earlier lockstep run in {} ({})",
                cfg.output_dir.display(),
                opts.names.overwrite
            ))?;
        }
        Ok(dir)
    }

    /// Startup broadcast of every piece of state from the chief (invariant 7): parameters,
    /// frozen parameters, optimizer state and counters.
    ///
    /// Errors: [`TrainError::Config`] when the replicas were built with different sizes.
    fn broadcast_state(&mut self) -> Result<(), TrainError> {
        let comm = self.comm;
        let sizes = [
            self.model.trainable().len() as u64,
            self.model.frozen().len() as u64,
            self.optimizer.slots.len() as u64,
            self.source.input_width() as u64,
            self.source.target_width() as u64,
        ];
        let mut chief_sizes = sizes;
        comm.broadcast(&mut chief_sizes, 0)?;
        let mismatch = comm.all_reduce_scalar(u64::from(chief_sizes != sizes), ReduceOp::Max)?;
        if mismatch != 0 {
            return Err(TrainError::config(
                "networks",
                format!("replicas were built differently: rank {} has (trainable, frozen, optimizer slots, input width, target width) = {sizes:?}, the chief {chief_sizes:?}", comm.rank()),
            ));
        }
        // Every rank must take the same data path (the chief's scatter is a collective).
        let keyed = u64::from(self.source.keyed_by_sample());
        self.own_slices = comm.size() > 1 && comm.all_reduce_scalar(keyed, ReduceOp::Min)? == 1;
        comm.broadcast(self.model.trainable_mut(), 0)?;
        comm.broadcast(self.model.frozen_mut(), 0)?;
        for slot in self.optimizer.slots.iter_mut() {
            comm.broadcast(slot, 0)?;
        }
        let p = &mut self.optimizer.plateau;
        let mut counters = [
            self.start_update,
            self.optimizer.step,
            self.cfg.seed,
            p.bad_epochs,
            p.cooldown_left,
        ];
        comm.broadcast(&mut counters, 0)?;
        let mut rates = [p.learning_rate, p.best];
        comm.broadcast(&mut rates, 0)?;
        [p.learning_rate, p.best] = rates;
        [p.bad_epochs, p.cooldown_left] = [counters[3], counters[4]];
        self.start_update = counters[0];
        self.update = counters[0];
        self.optimizer.step = counters[1];
        if let Some(s) = &mut self.scaler {
            let g = &mut s.state;
            let mut words = [u64::from(g.scale.to_bits()), g.growth_tracker, g.skipped];
            comm.broadcast(&mut words, 0)?;
            g.scale = f32::from_bits(words[0] as u32);
            [g.growth_tracker, g.skipped] = [words[1], words[2]];
        }
        // The training state moves to the devices when every replica's model keeps it
        // there (the same path on every rank, invariant 9).
        let offers = u64::from(self.model.device_state().is_some());
        self.device = comm.all_reduce_scalar(offers, ReduceOp::Min)? == 1;
        if self.device {
            // The model adds each micro-batch's gradient on the device itself.
            self.micro = Vec::new();
            let update = self.update;
            if let Some(d) = self.model.device_state() {
                d.upload(&self.optimizer.slots)
                    .map_err(|error| TrainError::Model { update, error })?;
            }
        }
        Ok(())
    }

    /// With the training state on the device: reads the parameters and optimizer slots back
    /// into the model's host buffer and the optimizer (for a checkpoint, the export, the
    /// replicas' checksums or the run's end); nothing otherwise.
    ///
    /// Errors: the model's ([`TrainError::Model`]).
    fn read_back_state(&mut self) -> Result<(), TrainError> {
        if !self.device {
            return Ok(());
        }
        let update = self.update;
        match self.model.device_state() {
            Some(d) => d
                .download(&mut self.optimizer.slots)
                .map_err(|error| TrainError::Model { update, error }),
            None => Ok(()),
        }
    }

    /// The chief logs the plan's warnings, the run's shape and whether the training state
    /// is on the device, and starts the progress bar.
    fn announce(&mut self) -> Result<(), TrainError> {
        let (cfg, plan) = (self.cfg, self.plan);
        let trainable = self.model.trainable().len();
        let Some(d) = self.rundir.as_mut() else {
            return Ok(());
        };
        for w in &plan.warnings {
            d.log(w)?;
        }
        let k = cfg.accumulation;
        d.log(&format!(
            "{}: {} replica(s) ({}), local batch {}, global batch {}{}, {trainable} trainable parameters, updates {}..{}, output {}",
            self.opts.names.command,
            plan.replicas,
            match plan.strategy {
                None => "serial".to_string(),
                Some(s) => format!("{s:?}").to_lowercase(),
            },
            plan.local_batch,
            plan.global_batch,
            if k > 1 { format!(" x {k} micro-batches") } else { String::new() },
            self.start_update,
            cfg.updates,
            cfg.output_dir.display()
        ))?;
        if self.device {
            d.log(&format!(
                "training state on the device: parameters, gradient and optimizer slots stay there between updates{}",
                if plan.replicas > 1 || cfg.clip_max_norm.is_some() {
                    " (the gradient is read back once per update, float32, to be reduced)"
                } else {
                    " (nothing of the gradient is read back)"
                }
            ))?;
        }
        d.start_progress(self.start_update, cfg.updates);
        self.run_start = Instant::now();
        Ok(())
    }

    /// One optimizer update: `k` micro-batches (the chief draws each global batch and
    /// scatters contiguous slices), one all-reduce of the packed gradient (invariant 6),
    /// the same optimizer step on every replica, then the constraints.
    ///
    /// Errors: model and batch errors, failed collectives, non-finite parameters.
    fn run_update(&mut self) -> Result<UpdateStep, TrainError> {
        let start = Instant::now();
        let base = self.checkpointer.first_sample(self.update);
        self.grad.iter_mut().for_each(|x| *x = 0.0);
        // The scale of this update's passes (restored or broadcast at startup, or set by the
        // previous update's verdict).
        if let Some(s) = &self.scaler {
            self.model.set_loss_scale(s.scale());
        }
        let mut terms = vec![0.0f64; self.loss_names.len()];
        let (mut t_data, mut t_compute) = (0.0, 0.0);
        // The chief's first local sample is the global batch's first (contiguous slices).
        if self.rundir.is_some() && self.model.record_first_sample(self.update) {
            self.sample_record = Some(self.update);
        }
        let (k, g) = (self.cfg.accumulation, self.plan.global_batch as u64);
        for m in 0..k {
            let t0 = Instant::now();
            self.scatter_micro_batch(base + m as u64 * g)?;
            t_data += t0.elapsed().as_secs_f64();
            // The micro-batch after this one: the next in this update, else the next
            // update's first (none after the last update).
            let next = if m + 1 < k {
                Some(base + (m as u64 + 1) * g)
            } else {
                (self.update + 1 < self.cfg.updates)
                    .then(|| self.checkpointer.first_sample(self.update + 1))
            };
            let (compute, wait) = self.compute_and_prefetch(&mut terms, next)?;
            t_compute += compute;
            t_data += wait;
        }

        let scale = 1.0 / (self.plan.replicas * self.cfg.accumulation) as f32;
        // On a device the gradient stays there unless the host must reduce or clip it.
        let on_host = !self.device || self.plan.replicas > 1 || self.cfg.clip_max_norm.is_some();
        if !on_host {
            return self.finish_update_on_device(scale, terms, start, [t_data, t_compute]);
        }
        if self.device {
            let update = self.update;
            if let Some(d) = self.model.device_state() {
                d.read_gradient(&mut self.grad)
                    .map_err(|error| TrainError::Model { update, error })?;
            }
        }
        let t0 = Instant::now();
        self.comm.all_reduce(&mut self.grad, ReduceOp::Sum)?;
        let t_comm = t0.elapsed().as_secs_f64();
        self.grad.iter_mut().for_each(|x| *x *= scale);
        // With loss scaling, the reduced gradient (the same on every replica) decides: an
        // overflow skips the update on every replica alike (invariant 9).
        let verdict = self
            .scaler
            .as_mut()
            .map(|s| s.unscale_and_step(&mut self.grad));
        if let Some(ScalerVerdict::Skip { scale, lowered }) = verdict {
            self.skip_update(scale, lowered)?;
        } else {
            self.applied += 1;
            self.skipped_in_a_row = 0;
            // Clipped after unscaling (PyTorch's order: unscale, then clip), on the reduced
            // gradient every replica holds alike (the global norm, as DDP + clip_grad_norm_).
            let clipped = self
                .cfg
                .clip_max_norm
                .and_then(|max| crate::optim::clip_grad_norm(&mut self.grad, max));
            if let (Some(norm), Some(d)) = (clipped, &mut self.rundir) {
                d.log_quiet(&format!(
                    "update {}: gradient norm {norm:.6e} clipped to clip_max_norm {}",
                    self.update + 1,
                    self.cfg.clip_max_norm.unwrap_or_default()
                ))?;
            }
            if self.device {
                // The reduced (unscaled, clipped) gradient goes up once with the update.
                let step = self.optimizer.device_update(1.0, 1.0);
                self.apply_on_device(Some(&step), true)?;
            } else {
                self.optimizer
                    .update(self.model.trainable_mut(), &self.grad);
            }
            self.model.after_update();
            self.log_growth(verdict)?;
        }
        if self.device {
            if matches!(verdict, Some(ScalerVerdict::Skip { .. })) {
                self.apply_on_device(None, false)?;
            }
            self.update += 1;
            return Ok(UpdateStep {
                terms,
                times: [t_data, t_compute, t_comm],
                start,
            });
        }
        self.update += 1;
        // Identical on every replica, so every rank stops here together (invariant 9).
        if let Some((index, value)) = self
            .model
            .trainable()
            .iter()
            .enumerate()
            .find(|(_, v)| !v.is_finite())
        {
            return Err(TrainError::NonFiniteParameter {
                update: self.update,
                index,
                value: *value,
            });
        }
        Ok(UpdateStep {
            terms,
            times: [t_data, t_compute, t_comm],
            start,
        })
    }

    /// The end of an update whose gradient stays on the device (one replica, no clipping):
    /// the loss scaler decides from the device's finiteness test, and the update runs on the
    /// device with the host's scalars (the gradient's mean factor `scale`, the unscale
    /// factor, the learning rate, Adam's corrections). Nothing of the gradient is read back.
    ///
    /// Errors: the model's; as the host path for skipped updates.
    fn finish_update_on_device(
        &mut self,
        scale: f32,
        terms: Vec<f64>,
        start: Instant,
        [t_data, t_compute]: [f64; 2],
    ) -> Result<UpdateStep, TrainError> {
        let update = self.update;
        let verdict = match self.scaler.as_mut() {
            Some(s) => {
                let finite = match self.model.device_state() {
                    Some(d) => d
                        .gradient_is_finite()
                        .map_err(|error| TrainError::Model { update, error })?,
                    None => true,
                };
                let unscale = s.unscale_factor();
                Some((s.step(finite), unscale))
            }
            None => None,
        };
        match verdict {
            Some((ScalerVerdict::Skip { scale, lowered }, _)) => {
                self.skip_update(scale, lowered)?;
                self.apply_on_device(None, false)?;
            }
            _ => {
                self.applied += 1;
                self.skipped_in_a_row = 0;
                let unscale = verdict.map_or(1.0, |(_, u)| u);
                let step = self.optimizer.device_update(scale, unscale);
                self.apply_on_device(Some(&step), false)?;
                self.model.after_update();
                self.log_growth(verdict.map(|(v, _)| v))?;
            }
        }
        self.update += 1;
        Ok(UpdateStep {
            terms,
            times: [t_data, t_compute, 0.0],
            start,
        })
    }

    /// Ends the update on the device: applies `step` (to the host's reduced gradient in
    /// `self.grad` when `reduced`), or skips it (`None`).
    ///
    /// Errors: the model's ([`TrainError::Model`]).
    fn apply_on_device(
        &mut self,
        step: Option<&DeviceUpdate>,
        reduced: bool,
    ) -> Result<(), TrainError> {
        let update = self.update;
        let grad = reduced.then_some(&self.grad[..]);
        match self.model.device_state() {
            Some(d) => d
                .finish_update(step, grad)
                .map_err(|error| TrainError::Model { update, error }),
            None => Ok(()),
        }
    }

    /// The loss scaler skipped this update (the gradient overflowed at `scale`; the scale is
    /// now `lowered`): logs it and counts it.
    ///
    /// Errors: [`TrainError::UpdatesSkipped`] after too many skips in a row or at the
    /// scale's floor; a failed log write.
    fn skip_update(&mut self, scale: f32, lowered: f32) -> Result<(), TrainError> {
        if let Some(d) = &mut self.rundir {
            d.log_quiet(&format!(
                "update {}: the gradient overflowed at loss scale {scale}; update skipped, loss scale lowered to {lowered}",
                self.update + 1
            ))?;
        }
        self.skipped += 1;
        self.skipped_in_a_row += 1;
        let at_floor = scale <= f32::MIN_POSITIVE;
        if at_floor || self.skipped_in_a_row >= crate::grad_scaler::MAX_CONSECUTIVE_SKIPS {
            return Err(TrainError::UpdatesSkipped {
                update: self.update + 1,
                skipped: self.skipped_in_a_row,
                scale: lowered,
                at_floor,
                whole_run: false,
            });
        }
        Ok(())
    }

    /// Logs a raised loss scale (the chief's run log).
    fn log_growth(&mut self, verdict: Option<ScalerVerdict>) -> Result<(), TrainError> {
        if let (Some(ScalerVerdict::Apply { grown: Some(g) }), Some(d)) =
            (verdict, &mut self.rundir)
        {
            d.log_quiet(&format!(
                "update {}: loss scale raised to {g}",
                self.update + 1
            ))?;
        }
        Ok(())
    }

    /// The chief draws the global micro-batch starting at sample `first` and scatters the
    /// replicas' contiguous slices into `self.local` (invariant 4); with
    /// [`Trainer::own_slices`] every rank draws its own slice instead.
    fn scatter_micro_batch(&mut self, first: u64) -> Result<(), TrainError> {
        if self.own_slices {
            return self.draw_own_slice(first);
        }
        let (comm, update) = (self.comm, self.update);
        let drawn = comm.is_chief().then(|| {
            match self.prefetched.take() {
                Some((f, drawn)) if f == first => drawn,
                _ => self.source.global_batch(first, self.plan.global_batch),
            }
            .map_err(|error| TrainError::Model { update, error })
        });
        let global = agree_with_chief(comm, drawn, "batch generation")?;
        let empty = Vec::new();
        let (gi, gt) = match &global {
            Some(batch) => (&batch.inputs, &batch.targets),
            None => (&empty, &empty),
        };
        if !self.local.inputs.is_empty() {
            comm.scatter(gi, &mut self.local.inputs, 0)?;
        }
        if !self.local.targets.is_empty() {
            comm.scatter(gt, &mut self.local.targets, 0)?;
        }
        self.local.first_sample = first + (comm.rank() * self.plan.local_batch) as u64;
        Ok(())
    }

    /// This rank draws its own slice of the global micro-batch starting at sample `first`
    /// (the samples `first + r*B .. first + (r+1)*B`, exactly the slice the chief would have
    /// scattered) into `self.local`. Every rank then learns whether any draw failed (one
    /// small all-reduce where the chief's path has its scatter), so all leave together.
    ///
    /// Errors: this rank's draw ([`TrainError::Model`]), a batch of the wrong shape
    /// ([`TrainError::Model`]), another rank's failed draw ([`TrainError::PeerFailed`]).
    fn draw_own_slice(&mut self, first: u64) -> Result<(), TrainError> {
        let (comm, update, b) = (self.comm, self.update, self.plan.local_batch);
        let mine = first + (comm.rank() * b) as u64;
        let drawn = match self.prefetched.take() {
            Some((f, drawn)) if f == mine => drawn,
            _ => self.source.global_batch(mine, b),
        }
        .and_then(|batch| {
            let (ni, nt) = (self.local.inputs.len(), self.local.targets.len());
            if batch.inputs.len() != ni || batch.targets.len() != nt {
                anyhow::bail!(
                    "the data source gave {} input and {} target values for samples {mine}..{}, expected {ni} and {nt}",
                    batch.inputs.len(),
                    batch.targets.len(),
                    mine + b as u64
                );
            }
            Ok(batch)
        });
        // The lowest rank whose draw failed (u64::MAX: none).
        let mark = if drawn.is_err() {
            comm.rank() as u64
        } else {
            u64::MAX
        };
        let failing = comm.all_reduce_scalar(mark, ReduceOp::Min)?;
        match drawn {
            Err(error) => Err(TrainError::Model { update, error }),
            Ok(_) if failing != u64::MAX => Err(TrainError::PeerFailed {
                rank: failing as usize,
                message: "batch generation failed".into(),
            }),
            Ok(batch) => {
                self.local.inputs.copy_from_slice(&batch.inputs);
                self.local.targets.copy_from_slice(&batch.targets);
                self.local.first_sample = mine;
                Ok(())
            }
        }
    }

    /// Computes the local slice's loss and gradient ([`Trainer::accumulate_gradient`]); with
    /// `training.prefetch`, the chief meanwhile draws the global micro-batch starting at
    /// `next` on a loader thread. Returns the seconds of compute and of waiting for the
    /// loader after the compute ended (the data time left over).
    ///
    /// Errors: as [`Trainer::accumulate_gradient`]; a draw's error surfaces when that batch
    /// is scattered.
    fn compute_and_prefetch(
        &mut self,
        terms: &mut [f64],
        next: Option<u64>,
    ) -> Result<(f64, f64), TrainError> {
        // The chief prefetches the next global micro-batch; with own slices, every rank
        // prefetches its own slice of it.
        let (own, rank, b) = (self.own_slices, self.comm.rank(), self.plan.local_batch);
        let first = next
            .filter(|_| self.cfg.prefetch && (own || self.comm.is_chief()))
            .map(|f| if own { f + (rank * b) as u64 } else { f });
        let t0 = Instant::now();
        let Some(first) = first else {
            self.accumulate_gradient(terms)?;
            return Ok((t0.elapsed().as_secs_f64(), 0.0));
        };
        let count = if own { b } else { self.plan.global_batch };
        let Trainer {
            source,
            model,
            local,
            micro,
            grad,
            opts,
            comm,
            cfg,
            update,
            ..
        } = self;
        let (computed, drawn, compute, wait) = std::thread::scope(|scope| {
            let loader = scope.spawn(|| source.global_batch(first, count));
            let computed = accumulate(
                &mut **model,
                local,
                micro,
                grad,
                opts,
                *comm,
                cfg.accumulation,
                *update,
                terms,
            );
            let compute = t0.elapsed().as_secs_f64();
            let t1 = Instant::now();
            let drawn = loader
                .join()
                .unwrap_or_else(|_| Err(anyhow::anyhow!("the batch loader thread panicked")));
            (computed, drawn, compute, t1.elapsed().as_secs_f64())
        });
        self.prefetched = Some((first, drawn));
        computed.map(|()| (compute, wait))
    }

    /// Adds the local slice's loss terms into `terms` and its mean gradient into the
    /// update's gradient.
    fn accumulate_gradient(&mut self, terms: &mut [f64]) -> Result<(), TrainError> {
        accumulate(
            &mut *self.model,
            &self.local,
            &mut self.micro,
            &mut self.grad,
            self.opts,
            self.comm,
            self.cfg.accumulation,
            self.update,
            terms,
        )
    }

    /// Reduces the update's loss terms (one small sum, weighted by samples) and timings (MAX).
    /// Each reported term is the mean over all `replicas x k x local batch` samples of the
    /// update, whatever the replica count and the accumulation `k`. Every decision that
    /// changes the number of collectives is taken from these reduced values (invariant 9).
    ///
    /// Errors: failed collectives, [`TrainError::NonFinite`].
    fn reduce_metrics(&mut self, step: UpdateStep) -> Result<Metrics, TrainError> {
        let b = self.plan.local_batch as f64;
        let mut sums: Vec<f64> = step.terms.iter().map(|t| t * b).collect();
        sums.push(b * self.cfg.accumulation as f64);
        self.comm.all_reduce(&mut sums, ReduceOp::Sum)?;
        let samples = sums.pop().unwrap_or(1.0);
        let losses: Vec<f64> = sums.iter().map(|t| t / samples).collect();
        let [d, c, m] = step.times;
        // The fifth value is this rank's interrupt flag: the maximum tells every replica
        // whether any was asked to stop, at no extra collective.
        let stop = f64::from(u8::from(lockstep_core::interrupt::requested()));
        let mut reduced = [d, c, m, step.start.elapsed().as_secs_f64(), stop];
        self.comm.all_reduce(&mut reduced, ReduceOp::Max)?;
        let [d, c, m, u, stop] = reduced;
        let times = [d, c, m, u];
        let total: f64 = losses.iter().sum();
        if !total.is_finite() {
            return Err(TrainError::NonFinite {
                update: self.update,
                value: total,
            });
        }
        Ok(Metrics {
            losses,
            total,
            times,
            interrupted: stop > 0.0,
        })
    }

    /// After each update: the replicas' checksums every `checksum_every` updates (all
    /// ranks); the chief's CSV rows, progress, log line and checkpoint.
    ///
    /// Errors: [`TrainError::Diverged`], write errors on the chief.
    fn callbacks(&mut self, metrics: &Metrics) -> Result<(), TrainError> {
        let (cfg, update) = (self.cfg, self.update);
        if cfg.checksum_every > 0 && update % cfg.checksum_every == 0 {
            // One replica has nothing to compare with: its state stays on the device.
            if self.comm.size() > 1 {
                self.read_back_state()?;
            }
            verify_identical(self.comm, &*self.model, update)?;
        }
        self.history.push(metrics.losses.clone());
        self.update_times.push(metrics.times);
        self.last.clone_from(&metrics.losses);
        if self.rundir.is_none() {
            return Ok(());
        }
        self.opts
            .injected(FaultPoint::Callback, self.comm.rank(), update)?;
        self.write_rows(metrics)?;
        if let (Some(recorded), Some(d)) = (self.sample_record.take(), self.rundir.as_mut()) {
            let files = self
                .model
                .write_sample_record(d.root(), recorded)
                .map_err(|error| TrainError::Model { update, error })?;
            for f in &files {
                d.log_quiet(&format!("update {recorded}: wrote {}", f.display()))?;
            }
        }
        if cfg.checkpoint_every > 0 && update % cfg.checkpoint_every == 0 {
            self.read_back_state()?;
            if let Some(d) = &self.rundir {
                self.checkpointer.save(
                    d.root(),
                    update,
                    &*self.model,
                    &self.optimizer,
                    self.scaler.as_ref(),
                )?;
            }
        }
        Ok(())
    }

    /// At the end of an epoch, when the source has a validation set (lockstep npe: the
    /// held-out simulations) or the schedule needs one (reduce-on-plateau): the chief computes
    /// the validation loss ([`BatchSource::validation_batch`] in chunks of 1024,
    /// [`Model::validation_loss`], the sample-weighted mean of the summed terms) and
    /// broadcasts it; with reduce-on-plateau every replica steps the schedule with it, so the
    /// learning rates stay identical. The chief logs `epoch N: train loss T, validation loss
    /// V; learning rate R` (T: the mean reduced loss of the epoch's updates of this run, the
    /// current one's `metrics` included), as Dingo and sbi report every epoch. Runs before the
    /// update's checkpoint, which therefore holds the stepped state.
    ///
    /// Errors: the chief's source or model errors ([`TrainError::Model`]; the peers get
    /// [`TrainError::PeerFailed`]), a non-finite validation loss, failed collectives.
    fn end_of_epoch(&mut self, metrics: &Metrics) -> Result<(), TrainError> {
        let spe = self.checkpointer.steps_per_epoch.max(1);
        let plateau = self.optimizer.steps_on_validation();
        let validates = plateau || self.source.validation_samples() > 0;
        if !validates || !self.update.is_multiple_of(spe) {
            return Ok(());
        }
        let update = self.update;
        let chief = self.comm.is_chief().then(|| {
            validation_loss(&mut *self.model, &mut *self.source)
                .map_err(|error| TrainError::Model { update, error })
        });
        let mut loss = [match &chief {
            Some(Ok(v)) => *v,
            _ => f64::NAN,
        }];
        agree_with_chief(
            self.comm,
            chief.map(|r| r.map(|_| ())),
            "the validation loss",
        )?;
        self.comm.broadcast(&mut loss, 0)?;
        let loss = loss[0];
        if !loss.is_finite() {
            return Err(TrainError::NonFinite {
                update,
                value: loss,
            });
        }
        let reduced = if plateau {
            self.optimizer.end_epoch(loss)
        } else {
            None
        };
        // This epoch's updates in this run: the earlier ones are in the history, the current
        // one is `metrics` (the callbacks record it after this).
        let in_epoch = (update - self.start_update).min(spe) as usize;
        let earlier = in_epoch.saturating_sub(1).min(self.history.len());
        let train = (self.history[self.history.len() - earlier..]
            .iter()
            .map(|l| l.iter().sum::<f64>())
            .sum::<f64>()
            + metrics.total)
            / (earlier + 1) as f64;
        let rate = self.optimizer.learning_rate(update);
        if let Some(d) = self.rundir.as_mut() {
            let epoch = update / spe;
            d.log(&format!(
                "epoch {epoch}: train loss {train:.6}, validation loss {loss:.6}; learning rate {rate:e}{}",
                if reduced.is_some() {
                    " (reduced on plateau)"
                } else {
                    ""
                }
            ))?;
        }
        Ok(())
    }

    /// The chief's rows of `losses.csv` and `performance.csv`, the progress bar and the
    /// periodic log line.
    fn write_rows(&mut self, metrics: &Metrics) -> Result<(), TrainError> {
        let (cfg, update) = (self.cfg, self.update);
        let epoch = (update - 1) / self.checkpointer.steps_per_epoch;
        let elapsed = self.run_start.elapsed().as_secs_f64();
        let done = (update - self.start_update) as f64;
        let Some(d) = self.rundir.as_mut() else {
            return Ok(());
        };
        let (times, total) = (metrics.times, metrics.total);
        d.losses_row(update, epoch, &metrics.losses)?;
        let samples_per_s = self.checkpointer.per_update as f64 / times[3].max(1e-12);
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
        if (update % cfg.log_every == 0 || update == cfg.updates)
            && cfg.log_style == LogStyle::Dingo
        {
            let line = self.dingo_line(metrics);
            let Some(d) = self.rundir.as_mut() else {
                return Ok(());
            };
            if d.has_progress() {
                d.log_quiet(&line)?;
            } else {
                d.log(&line)?;
            }
        } else if update % cfg.log_every == 0 || update == cfg.updates {
            let eta = elapsed / done * (cfg.updates - update) as f64;
            let parts: Vec<String> = self
                .loss_names
                .iter()
                .zip(&metrics.losses)
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
        Ok(())
    }

    /// Dingo's log line for this update ([`LogStyle::Dingo`]): epoch (1-based), samples of
    /// the epoch done, the loss and the data, network and (with replicas) all-reduce times,
    /// each with its running mean over this epoch's updates so far.
    fn dingo_line(&self, metrics: &Metrics) -> String {
        let spe = self.checkpointer.steps_per_epoch;
        let per_update = self.checkpointer.per_update;
        let epoch = (self.update - 1) / spe;
        let in_epoch = (self.update - 1) % spe + 1;
        let epoch_samples = self.checkpointer.dataset.unwrap_or(spe * per_update);
        // This run's updates of the current epoch (a resumed run starts mid-epoch).
        let seen = (in_epoch as usize).min(self.history.len()).max(1);
        let recent = self.history.len() - seen;
        let mean = |f: &dyn Fn(usize) -> f64| {
            (recent..self.history.len()).map(f).sum::<f64>() / seen as f64
        };
        let loss_mean = mean(&|i| self.history[i].iter().sum::<f64>());
        let time = |k: usize| {
            format!(
                "{:.3} ({:.3})",
                metrics.times[k],
                mean(&|i| self.update_times[i][k])
            )
        };
        let mut line = format!(
            "Train Epoch: {} [{}/{} ({:.0}%)]   Loss: {:.3} ({:.3})   Time Dataloader: {}   Time Network: {}",
            epoch + 1,
            in_epoch * per_update,
            epoch_samples,
            100.0 * in_epoch as f64 / spe as f64,
            metrics.total,
            loss_mean,
            time(0),
            time(1)
        );
        if self.plan.replicas > 1 {
            line.push_str(&format!("   Time Loss Aggregation: {}", time(2)));
        }
        line
    }

    /// True when the reduced total loss fell below `training.early_stop_loss` (the same
    /// decision on every replica, invariant 9).
    ///
    /// Errors: a failed log write on the chief.
    fn early_stop(&mut self, metrics: &Metrics) -> Result<bool, TrainError> {
        let total = metrics.total;
        match self.cfg.early_stop_loss {
            Some(stop) if total < stop => {
                if let Some(d) = self.rundir.as_mut() {
                    d.log(&format!(
                        "early stop: loss {total:.6e} < {stop} at update {}",
                        self.update
                    ))?;
                }
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// After an update at whose end some rank was asked to stop (every rank takes this
    /// path after the same update): the chief writes a checkpoint of the update (unless the
    /// update's own checkpoint was just written) and logs the stop; nothing is exported.
    /// Returns [`TrainError::Interrupted`] on every rank, or the failure of writing it.
    fn stop_interrupted(&mut self) -> TrainError {
        let update = self.update;
        if self.rundir.is_some() {
            if let Err(e) = self.read_back_state() {
                return e;
            }
        }
        let saved = self.rundir.as_mut().map(|d| {
            d.finish_progress();
            let path = d
                .root()
                .join(format!("checkpoints/update_{update:06}.safetensors"));
            let every = self.cfg.checkpoint_every;
            if every == 0 || !update.is_multiple_of(every) {
                self.checkpointer.save(
                    d.root(),
                    update,
                    &*self.model,
                    &self.optimizer,
                    self.scaler.as_ref(),
                )?;
            }
            d.log(&format!(
                "Interrupted (Ctrl-C) after {}; checkpoint {}; resume with --resume {}",
                optimizer_updates(update),
                path.display(),
                d.root().display()
            ))?;
            Ok(path)
        });
        match agree_with_chief(
            self.comm,
            saved,
            "writing the checkpoint of the interrupted run",
        ) {
            Ok(checkpoint) => TrainError::Interrupted { update, checkpoint },
            Err(e) => e,
        }
    }

    /// Compares the replicas once more, then the chief writes the final checkpoint and the
    /// model's exported weights; every rank returns the same summary.
    ///
    /// Errors: [`TrainError::Diverged`], write or export errors (chief) /
    /// [`TrainError::PeerFailed`] (peers).
    fn finish(&mut self) -> Result<TrainSummary, TrainError> {
        let update = self.update;
        // A run whose every update loss scaling skipped trained nothing: it ends with an
        // error before its final outputs (the same decision on every replica).
        if let (Some(s), 0, 1..) = (&self.scaler, self.applied, self.skipped) {
            return Err(TrainError::UpdatesSkipped {
                update,
                skipped: self.skipped,
                scale: s.scale(),
                at_floor: false,
                whole_run: true,
            });
        }
        // Every rank: the final checksums, and the chief's checkpoint and export.
        self.read_back_state()?;
        verify_identical(self.comm, &*self.model, update)?;
        let finished = self.rundir.as_mut().map(|d| {
            d.finish_progress();
            self.checkpointer.save(
                d.root(),
                update,
                &*self.model,
                &self.optimizer,
                self.scaler.as_ref(),
            )?;
            let exported = self
                .model
                .export(d.root())
                .map_err(|error| TrainError::Model { update, error })?;
            for f in &exported {
                d.log(&format!("exported {}", f.display()))?;
            }
            if self.scaler.is_some() {
                d.log(&format!(
                    "Completed {}; this run applied {} and skipped {} (the gradient overflowed at the loss scale).",
                    optimizer_updates(update),
                    self.applied,
                    self.skipped
                ))?;
            } else {
                d.log(&format!("Completed {}.", optimizer_updates(update)))?;
            }
            d.log(&format!("Outputs in {}", d.root().display()))?;
            Ok(exported)
        });
        let exported = agree_with_chief(self.comm, finished, "writing the final outputs")?;
        let mut all = self.model.trainable().to_vec();
        all.extend_from_slice(self.model.frozen());
        Ok(TrainSummary {
            updates: update,
            final_losses: std::mem::take(&mut self.last),
            loss_history: std::mem::take(&mut self.history),
            update_times: std::mem::take(&mut self.update_times),
            params_checksum: checksum(&all),
            output_dir: self.cfg.output_dir.clone(),
            exported: exported.unwrap_or_default(),
        })
    }
}

/// Adds the loss terms of `model` on the local slice `local` into `terms` and its mean
/// gradient into `grad` (through `micro` when `accumulation > 1`); the model may talk to the
/// other replicas through `comm` inside its pass ([`Model::loss_and_grad_in`]).
///
/// Errors: [`TrainError::Model`] for a model error or a wrong number of loss terms.
#[allow(clippy::too_many_arguments)]
fn accumulate(
    model: &mut dyn Model,
    local: &Batch,
    micro: &mut [f32],
    grad: &mut [f32],
    opts: &EngineOptions,
    comm: &dyn Communicator,
    accumulation: usize,
    update: u64,
    terms: &mut [f64],
) -> Result<(), TrainError> {
    opts.injected(FaultPoint::Update, comm.rank(), update)?;
    let accumulate = accumulation > 1;
    let target: &mut [f32] = if accumulate {
        micro.iter_mut().for_each(|x| *x = 0.0);
        micro
    } else {
        grad
    };
    let lt = model
        .loss_and_grad_in(local, target, &crate::ReplicaContext::new(comm))
        .map_err(|error| TrainError::Model { update, error })?;
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
    if accumulate {
        grad.iter_mut()
            .zip(micro.iter())
            .for_each(|(a, b)| *a += *b);
    }
    terms.iter_mut().zip(&lt).for_each(|(a, b)| *a += *b);
    Ok(())
}

/// The mean over the source's validation set of the model's summed loss terms in
/// evaluation mode, in chunks of at most 1024 samples.
///
/// Errors: the source's or the model's.
fn validation_loss(model: &mut dyn Model, source: &mut dyn BatchSource) -> anyhow::Result<f64> {
    let total = source.validation_samples();
    let (mut sum, mut first) = (0.0, 0u64);
    while first < total {
        let count = (total - first).min(1024) as usize;
        let batch = source.validation_batch(first, count)?;
        let terms = model.validation_loss(&batch)?;
        sum += terms.iter().sum::<f64>() * count as f64;
        first += count as u64;
    }
    Ok(sum / total.max(1) as f64)
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
    /// The global index of update `u`'s first sample.
    fn first_sample(&self, u: u64) -> u64 {
        first_sample_of(u, self.per_update, self.steps_per_epoch, self.dataset)
    }

    /// Writes `checkpoints/update_NNNNNN.safetensors` and points `checkpoints/latest` at it.
    fn save(
        &self,
        root: &Path,
        update: u64,
        model: &dyn Model,
        optimizer: &Optimizer,
        scaler: Option<&GradScaler>,
    ) -> Result<(), TrainError> {
        let mut state = TrainState {
            grad_scaler: scaler.map(|s| s.state),
            update,
            next_sample: self.first_sample(update),
            seed: self.seed,
            trainable: model.trainable().to_vec(),
            frozen: model.frozen().to_vec(),
            optimizer_step: 0,
            optimizer_slots: Vec::new(),
            config_hash: self.hash.clone(),
            plateau: None,
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

/// Loads a checkpoint (any form [`checkpoint::resolve`] accepts) into the chief's model and
/// optimizer; returns the update to continue from.
///
/// Errors: [`TrainError::Checkpoint`] for an unusable checkpoint; [`TrainError::Config`] when
/// it already has as many updates as the run asks for.
fn restore(
    path: &Path,
    (hash, also): (&str, Option<&str>),
    cfg: &EngineConfig,
    model: &mut dyn Model,
    optimizer: &mut Optimizer,
    scaler: Option<&mut GradScaler>,
) -> Result<u64, TrainError> {
    let path = &checkpoint::resolve(path)?;
    let state = checkpoint::read(path)?;
    let bad = |m: String| TrainError::Checkpoint {
        path: path.to_path_buf(),
        message: m,
    };
    if state.update >= cfg.updates {
        return Err(TrainError::config(
            "training.optimizer_updates",
            format!(
                "is {} but the checkpoint {} already has {}, so there is nothing to train; ask for more than {} in total (lockstep train --updates N) to continue it",
                cfg.updates,
                path.display(),
                plural(state.update, "update"),
                plural(state.update, "update")
            ),
        ));
    }
    if state.config_hash != hash && Some(state.config_hash.as_str()) != also {
        return Err(bad(format!(
            "it was written for another configuration: the config sections {} differ (only run.batch_size, run.distribution, run.device, output and the run length may change on resume)",
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
    if let Some(p) = state.plateau {
        optimizer.plateau = p;
    }
    // A mixed-precision run continues with the stored scale; a checkpoint of a float32 run
    // starts the scaler afresh (and a float32 run ignores a stored scale).
    if let (Some(s), Some(g)) = (scaler, state.grad_scaler) {
        s.state = g;
    }
    Ok(state.update)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn config_hash_ignores_distribution_output_and_length() {
        let a = json!({"run": {"batch_size": 4, "distribution": {"strategy": "mpi"}}, "training": {"optimizer_updates": 3}, "output": {"output_dir": "a"}});
        let b = json!({"run": {"batch_size": 4, "device": "gpu"}, "training": {"optimizer_updates": 8}, "output": {"output_dir": "b"}});
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
