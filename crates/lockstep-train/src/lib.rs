//! The sample-parallel training engine of lockstep.
//!
//! Every replica holds a complete [`Model`]; each optimizer update splits a global batch of
//! samples into equal, contiguous, disjoint slices (rank r gets samples `[r*B, (r+1)*B)`),
//! each replica computes the mean loss gradient of its slice, one all-reduce turns the local
//! gradients into the global mean, and every replica applies the same optimizer update. The
//! engine knows nothing about neurons: a model is flat f32 parameter buffers plus a
//! loss-and-gradient function; a [`BatchSource`] produces global batches on the chief.
//!
//! # Guarantees
//!
//! The ten invariants of `docs/design.md` ("Invariants of sample-parallel training"):
//! [`config::plan`] (1-3: opt-in, batch sizes, launcher and config agree), [`engine::train`]
//! (4-9: contiguous slices, drawn by the chief and scattered or, from a source keyed by
//! sample, drawn by each replica itself; noise keyed by sample, one gradient
//! reduction per update, identical replicas, chief-owned outputs, the same control flow on
//! every rank) and [`checkpoint`] (10: complete, portable, verified checkpoints). Also:
//!
//! - Everything is validated before any output is created, replaced or deleted: the config
//!   ([`EngineConfig`]), the launch ([`plan`]), the memory the run needs on this machine
//!   ([`Model::memory_estimate`] times the replicas that share it, [`job::run_job`]), the
//!   checkpoint to resume from, and the output directory (only empty or lockstep-written
//!   directories are ever replaced, [`lockstep_core::output_dir::check_replaceable`]).
//! - The logged loss of an update (`callbacks/losses.csv`, the log line, `early_stop_loss`)
//!   is the mean of each term over every sample of the global batch, whatever the replica
//!   count and `gradient_updates_per_optimizer_step`.
//! - A failure on any rank ends every rank: chief-only steps share their verdict, thread
//!   replicas poison their group, MPI jobs abort; validation errors that every rank sees end
//!   the job through [`TrainError::is_agreed`] errors instead.
//!
//! # Errors
//!
//! The engine returns [`TrainError`]. [`Model`] and [`BatchSource`] methods return
//! [`anyhow::Result`]: models live in other crates with their own error types, and the engine
//! only wraps what they return (as [`TrainError::Model`] with the update, or
//! [`TrainError::Build`]) and never turns it into text, so the model's whole cause chain
//! reaches the user once.
//!
//! The `reference` model, failure injection (`testing::Fault`) and the `lockstep-train-check`
//! binary serve this crate's tests and installation checks; the `lockstep` command never
//! injects a fault. They are compiled into every build (no Cargo feature), so that
//! `cargo test` reuses the library `cargo build` compiled.

pub mod checkpoint;
pub mod config;
pub mod device_state;
pub mod engine;
mod error;
pub mod grad_scaler;
pub mod job;
pub mod optim;
pub mod reference;
pub mod rundir;
pub mod testing;

pub use config::{plan, EngineConfig, LogStyle, Plan, Strategy};
pub use device_state::{DeviceRule, DeviceState, DeviceUpdate};
pub use engine::{train, CommandNames, EngineOptions, TrainSummary};
pub use error::TrainError;
pub use grad_scaler::{GradScaler, GradScalerConfig};
pub use optim::{Optimizer, OptimizerConfig};

use lockstep_comm::{CommError, CommExt, Communicator, ReduceOp};
use lockstep_core::memory::MemoryEstimate;
use std::path::{Path, PathBuf};

/// The replicas of a run as a model's own pass sees them (`docs/design.md`, "Models that
/// communicate inside the forward pass"): the rank, the replica count and an all-reduce of
/// f64 sums. Handed to [`Model::loss_and_grad_in`] with every local batch; a model that uses
/// it must make the same calls, in the same order and with the same lengths, on every
/// replica (invariant 9), e.g. SyncBatchNorm's per-channel sums, one per layer in the forward
/// pass and one in the backward pass.
pub struct ReplicaContext<'a> {
    comm: &'a dyn Communicator,
}

impl<'a> ReplicaContext<'a> {
    /// The context of the replica that talks through `comm`.
    pub fn new(comm: &'a dyn Communicator) -> Self {
        ReplicaContext { comm }
    }

    /// This replica's rank, `0..replicas()`.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// The number of replicas.
    pub fn replicas(&self) -> usize {
        self.comm.size()
    }

    /// Sums `values` element by element over all replicas, in place; every replica ends with
    /// bitwise the same values.
    ///
    /// Errors: a failed peer or a length mismatch ([`CommError`]).
    pub fn all_reduce_sum(&self, values: &mut [f64]) -> Result<(), CommError> {
        self.comm.all_reduce(values, ReduceOp::Sum)
    }
}

/// A batch of samples: the global batch on the chief, or one replica's contiguous slice.
///
/// `inputs` is `[samples, input_width]` and `targets` is `[samples, target_width]`, row-major
/// f32. Models whose inputs are generated from `(seed, global sample index, time step)` (for
/// example Poisson spike trains) may use widths of 0 and read only `first_sample`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Batch {
    /// Global index of the first sample (sample i of the batch has index `first_sample + i`).
    pub first_sample: u64,
    /// Number of samples.
    pub samples: usize,
    /// `[samples, input_width]` input values.
    pub inputs: Vec<f32>,
    /// `[samples, target_width]` target values.
    pub targets: Vec<f32>,
}

/// Produces global batches on the chief, exactly as a serial run with the global batch size
/// would (invariant 4). Only the chief calls [`BatchSource::global_batch`], possibly on a
/// loader thread (`training.prefetch`), hence `Send`; batches are asked for in order, but
/// the last one asked may go unused when a run ends early.
///
/// Errors are [`anyhow::Error`] with the source's own causes (see the crate docs).
pub trait BatchSource: Send {
    /// f32 values per sample in [`Batch::inputs`].
    fn input_width(&self) -> usize;
    /// f32 values per sample in [`Batch::targets`].
    fn target_width(&self) -> usize;
    /// Samples in the data set, or `None` for an unbounded stream (e.g. Poisson trials).
    /// A finite source gets `floor(n / global batch)` updates per epoch; the partial
    /// remainder is dropped, never padded.
    fn num_samples(&self) -> Option<u64> {
        None
    }
    /// The samples with global indices `first_sample .. first_sample + count`. A finite
    /// source maps indices modulo its size (the engine never asks across an epoch boundary).
    fn global_batch(&mut self, first_sample: u64, count: usize) -> anyhow::Result<Batch>;
    /// True when a sample's inputs and targets depend only on its global index (and the
    /// source's own seed), never on which samples were asked for with it: then every
    /// replica draws its own slice of each global batch with [`BatchSource::global_batch`]
    /// (in parallel, each on its own loader thread with `training.prefetch`) and gets exactly
    /// the values the chief would have scattered. Default false: the chief draws each global
    /// batch and scatters the slices (invariant 4).
    fn keyed_by_sample(&self) -> bool {
        false
    }
    /// Samples in the held-out validation set (default 0: none). A schedule that steps on
    /// the validation loss (reduce-on-plateau) needs some.
    fn validation_samples(&self) -> u64 {
        0
    }
    /// Validation samples `first .. first + count` (`first + count <= validation_samples()`),
    /// the same every time. Asked for by the chief at epoch ends.
    ///
    /// Errors: the source's own; the default has no validation set.
    fn validation_batch(&mut self, first: u64, count: usize) -> anyhow::Result<Batch> {
        let _ = (first, count);
        anyhow::bail!("this data source has no validation set")
    }
}

/// A model replica: flat f32 parameter buffers and the loss gradient of a local batch.
///
/// Every replica must compute deterministically from (parameters, batch): any randomness is
/// keyed by `(seed, global sample index, time step)`, never by rank (invariant 5).
///
/// Errors are [`anyhow::Error`] with the model's own causes (see the crate docs).
pub trait Model {
    /// Trainable parameters, flat.
    fn trainable(&self) -> &[f32];
    /// Trainable parameters, mutable (the engine applies updates and broadcasts here).
    fn trainable_mut(&mut self) -> &mut [f32];
    /// Frozen parameters: broadcast from the chief at startup, saved in and restored from
    /// checkpoints, included in the replicas' checksums, never updated. Default: none.
    fn frozen(&self) -> &[f32] {
        &[]
    }
    /// Frozen parameters, mutable (for the startup broadcast and checkpoint restore).
    fn frozen_mut(&mut self) -> &mut [f32] {
        &mut []
    }
    /// Names of the loss terms returned by [`Model::loss_and_grad`], e.g. `["rate", "voltage"]`.
    fn loss_names(&self) -> Vec<String>;
    /// True when every loss term is a mean over samples, so the mean of the replicas' means is
    /// the global mean. The engine refuses to split a non-separable loss across replicas.
    fn sample_separable(&self) -> bool;
    /// True when the loss couples the samples of a batch only through statistics that the
    /// model itself sums over all replicas inside its pass ([`Model::loss_and_grad_in`],
    /// e.g. SyncBatchNorm), so a split batch trains exactly like the whole one: the engine
    /// then splits it over replicas although [`Model::sample_separable`] is false (with a
    /// warning on the chief). Default: false.
    fn synchronizes_batch_statistics(&self) -> bool {
        false
    }
    /// The loss terms (each a mean over the batch's samples) and, written into `grad`
    /// (zeroed by the caller, length `trainable().len()`), the gradient of their sum.
    fn loss_and_grad(&mut self, batch: &Batch, grad: &mut [f32]) -> anyhow::Result<Vec<f64>>;
    /// [`Model::loss_and_grad`] with the replicas at hand for collectives inside the pass
    /// (see [`ReplicaContext`]); the engine calls this one. Default: ignores the replicas and
    /// calls [`Model::loss_and_grad`].
    fn loss_and_grad_in(
        &mut self,
        batch: &Batch,
        grad: &mut [f32],
        replicas: &ReplicaContext<'_>,
    ) -> anyhow::Result<Vec<f64>> {
        let _ = replicas;
        self.loss_and_grad(batch, grad)
    }
    /// The memory one replica needs to train on `local_batch` samples per micro-batch
    /// (per-sample state, tapes, buffers), with the config keys that drive it. The engine
    /// multiplies it by the replicas that share this machine and refuses a run that does not
    /// fit before any output is touched. Computed from sizes alone, without allocating.
    /// Default: an empty estimate (nothing is checked).
    fn memory_estimate(&self, local_batch: usize) -> MemoryEstimate {
        let _ = local_batch;
        MemoryEstimate::new()
    }
    /// The loss terms of `batch` in evaluation mode (no gradient, no state change; each a
    /// mean over the batch's samples), for the validation loss at epoch ends.
    ///
    /// Errors: the model's own; the default does not evaluate held-out data.
    fn validation_loss(&mut self, batch: &Batch) -> anyhow::Result<Vec<f64>> {
        let _ = batch;
        anyhow::bail!("this model does not compute a validation loss")
    }
    /// Sets the factor the model multiplies its loss by before the backward pass, for
    /// mixed-precision training with dynamic loss scaling (`training.grad_scaler`,
    /// [`crate::grad_scaler`]): the gradient written by [`Model::loss_and_grad`] is then
    /// that of `scale x` the sum of the loss terms, while the returned terms stay unscaled.
    /// The engine calls it at startup and before each update, with the same scale
    /// on every replica. Returns whether the model applies the scale. Default: false (a
    /// model that computes in float32 only; the engine then refuses `training.grad_scaler`).
    fn set_loss_scale(&mut self, scale: f32) -> bool {
        let _ = scale;
        false
    }
    /// The model's training state on its device, when it keeps it there
    /// ([`crate::device_state`]): the engine then uploads the parameters and optimizer slots
    /// once per run, the model's `loss_and_grad` adds each micro-batch's gradient on the
    /// device (leaving the engine's `grad` alone), and the update runs on the device with
    /// the scalars the host computes. Every replica must answer alike (the engine keeps
    /// the host path on every replica when one does not). Default: `None`, the host path.
    fn device_state(&mut self) -> Option<&mut dyn DeviceState> {
        None
    }
    /// Applies constraints after each update (e.g. sign constraints). Default: none. A
    /// model with a [`Model::device_state`] applies them on its device.
    fn after_update(&mut self) {}
    /// Writes the trained parameters in the model's native format into `dir` (chief only);
    /// returns the files written. Default: nothing.
    fn export(&self, _dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
        Ok(Vec::new())
    }
    /// Asks the model whether it keeps a record of the first sample of the global batch at
    /// update `update` (0-based: the pass computed with the parameters after `update`
    /// updates), e.g. a training trial's spikes; if it does, it keeps what its next
    /// [`Model::loss_and_grad`] computes for the first sample of that call's batch, and
    /// returns true. The engine asks only the chief (rank 0, whose slice of an update's first
    /// micro-batch begins with the global batch's first sample), before that micro-batch, and
    /// only when it writes a run directory; it then calls [`Model::write_sample_record`]
    /// after the update. Default: never.
    fn record_first_sample(&mut self, _update: u64) -> bool {
        false
    }
    /// Writes the record kept for update `update` (see [`Model::record_first_sample`]) into
    /// the run directory `dir` (chief only); returns the files written. Default: nothing.
    fn write_sample_record(&mut self, _dir: &Path, _update: u64) -> anyhow::Result<Vec<PathBuf>> {
        Ok(Vec::new())
    }
}

/// FNV-1a over the bit patterns of `values`: the cheap checksum compared across replicas.
pub fn checksum(values: &[f32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for v in values {
        for b in v.to_bits().to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}
