//! The sample-parallel training engine of lockstep.
//!
//! Every replica holds a complete [`Model`]; each optimizer update splits a global batch of
//! samples into equal, contiguous, disjoint slices (rank r gets samples `[r*B, (r+1)*B)`),
//! each replica computes the mean loss gradient of its slice, one all-reduce turns the local
//! gradients into the global mean, and every replica applies the same optimizer update. The
//! engine knows nothing about neurons: a model is flat f32 parameter buffers plus a
//! loss-and-gradient function; a [`BatchSource`] produces global batches on the chief.
//!
//! The ten invariants of `../shared/DESIGN.md` ("Invariants of sample-parallel training") are
//! implemented here: [`config::plan`] (1-3), [`engine::train`] (4-9) and [`checkpoint`] (10).

pub mod checkpoint;
pub mod config;
pub mod engine;
mod error;
pub mod job;
pub mod optim;
pub mod reference;
pub mod rundir;

pub use config::{plan, EngineConfig, Plan, Strategy};
pub use engine::{train, TrainOptions, TrainSummary};
pub use error::TrainError;
pub use optim::{Optimizer, OptimizerConfig};

use std::path::{Path, PathBuf};

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
/// would (invariant 4). Only the chief calls [`BatchSource::global_batch`].
pub trait BatchSource {
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
}

/// A model replica: flat f32 parameter buffers and the loss gradient of a local batch.
///
/// Every replica must compute deterministically from (parameters, batch): any randomness is
/// keyed by `(seed, global sample index, time step)`, never by rank (invariant 5).
pub trait Model {
    /// Trainable parameters, flat.
    fn trainable(&self) -> &[f32];
    /// Trainable parameters, mutable (the engine applies updates and broadcasts here).
    fn trainable_mut(&mut self) -> &mut [f32];
    /// Frozen parameters (broadcast at startup and checkpointed, never updated). Default: none.
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
    /// The loss terms (each a mean over the batch's samples) and, written into `grad`
    /// (zeroed by the caller, length `trainable().len()`), the gradient of their sum.
    fn loss_and_grad(&mut self, batch: &Batch, grad: &mut [f32]) -> anyhow::Result<Vec<f64>>;
    /// Applies constraints after each update (e.g. sign constraints). Default: none.
    fn after_update(&mut self) {}
    /// Writes the trained parameters in the model's native format into `dir` (chief only);
    /// returns the files written. Default: nothing.
    fn export(&self, _dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
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
