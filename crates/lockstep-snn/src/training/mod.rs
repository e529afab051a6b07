//! Training: backpropagation through time with surrogate gradients (`docs/neuron-models.md`,
//! "Training"), one model type ([`SnnModel`]) and its engines.
//!
//! Files, bottom up: `options.rs` (the options and results every engine shares),
//! `problem.rs` (what an engine reads of a model, and the loss terms), the engines
//! `reference.rs` (per-sample BPTT in float64, and in float32 as the oracle of the float32
//! engines) and `cpu_f32/` (the batch-innermost float32 kernels on CPU cores) and `gpu/` (the float32
//! kernels on a GPU through wgpu), and
//! `model.rs` ([`SnnModel`], which chooses its engine once, at construction).

mod cpu_f32;
mod gpu;
mod model;
mod options;
mod problem;
mod reference;

pub use cpu_f32::SCATTER_BLOCK;
pub use model::SnnModel;
pub use options::{
    BpttOptions, DeviceCounts, DeviceRequest, Dtype, LossAndGrad, SpmvForm, StepTiming,
};
