//! The options and results of a trainable model, shared by every engine (leaf types: this
//! file imports nothing of the crate but the cell models' initial state and the surrogate).

pub use lockstep_gpu::DeviceRequest;

use crate::loss::Loss;
use crate::scalar::Surrogate;
use crate::simulation::model::InitialState;

/// Options of a trainable model.
#[derive(Debug, Clone, PartialEq)]
pub struct BpttOptions {
    /// Steps per sample.
    pub seq_len: usize,
    /// Pseudo-derivative of the spike.
    pub surrogate: Surrogate,
    /// Also train the input (virtual -> neuron) edge weights.
    pub train_input_weights: bool,
    /// Segmented BPTT chunk size in steps (`None`: store every step).
    pub gradient_checkpointing: Option<usize>,
    /// Loss terms (summed).
    pub losses: Vec<Loss>,
    /// Initial state of every sample (default: rest).
    pub initial: InitialState,
    /// Run the samples of a batch on rayon.
    pub parallel: bool,
    /// Precision of the training computation (`run.dtype`).
    pub dtype: Dtype,
    /// Where it computes (`run.device`): CPU cores, or a GPU (float32 only).
    pub device: DeviceRequest,
    /// The GPU slot of this replica when `device` is `gpu` without an index: the node-local
    /// rank of an MPI rank, the index of a thread replica ([`lockstep_gpu::select_adapter`]).
    pub device_slot: usize,
    /// Keep the spikes of the batch's first sample in [`LossAndGrad::first_spikes`], as the
    /// forward pass computes them (no extra simulation; `output.training_spikes`).
    pub record_first_sample: bool,
    /// Float32 kernels: target neurons per pass of the adjoint SpMV (`None`: 32,768). The
    /// SpMV reads only the adjoint rows of one pass's targets at a time so that they stay
    /// in cache; a source's sum is the sum of its passes' partial sums, so the pass size
    /// changes results by float rounding only. A tuning and testing knob, not a config key.
    pub spmv_pass_targets: Option<usize>,
    /// Float32 kernels: the form of the adjoint's transposed SpMV ([`SpmvForm`]). A tuning
    /// and testing knob, not a config key.
    pub adjoint_spmv: SpmvForm,
}

/// The form of the float32 kernels' adjoint SpMV, `gz[s] = sum_e w_e mu[target_e]`: both
/// give the same weight gradients and the same spike adjoints up to float32 rounding (the
/// order of each source's sum differs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SpmvForm {
    /// Scatter on networks too large for the gather form's rows to stay in cache (above
    /// 32,768 neurons), gather otherwise.
    #[default]
    Auto,
    /// Per source, gathering one adjoint row per edge (in passes of
    /// [`BpttOptions::spmv_pass_targets`] targets); with one pass its sums are bitwise those
    /// of the per-sample reference.
    Gather,
    /// Per target row, scattering into the adjoints of blocks of sources that stay in L2.
    Scatter,
}

/// Precision of the BPTT computation (`run.dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// Per-sample BPTT in double precision: the NEST-exact forward pass and its adjoint (the
    /// dual-number oracle checks it); the reference engine.
    Float64,
    /// The batch-innermost float32 kernels ([`SnnModel::loss_and_grad`](crate::SnnModel::loss_and_grad)): the whole local
    /// batch advances together, spike delivery and weight gradients only where a source
    /// spiked, parallel over neurons, sources and target blocks with results independent of the
    /// thread count. The default (`run.dtype` documents it).
    #[default]
    Float32,
}

impl std::fmt::Display for Dtype {
    /// The config's spelling (`run.dtype`): `float64` or `float32`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Dtype::Float64 => "float64",
            Dtype::Float32 => "float32",
        })
    }
}

impl Default for BpttOptions {
    fn default() -> Self {
        BpttOptions {
            seq_len: 500,
            surrogate: Surrogate::default(),
            train_input_weights: false,
            gradient_checkpointing: None,
            losses: Vec::new(),
            initial: InitialState::Rest,
            parallel: true,
            dtype: Dtype::default(),
            device: DeviceRequest::Cpu,
            device_slot: 0,
            record_first_sample: false,
            spmv_pass_targets: None,
            adjoint_spmv: SpmvForm::Auto,
        }
    }
}

/// Result of [`SnnModel::loss_and_grad`](crate::SnnModel::loss_and_grad) for one local batch.
#[derive(Debug, Clone, PartialEq)]
pub struct LossAndGrad {
    /// Total loss (sum of the terms), mean over the batch.
    pub loss: f64,
    /// Each loss term, mean over the batch, in the order of `BpttOptions::losses`.
    pub terms: Vec<(&'static str, f64)>,
    /// `[n_params]` gradient of `loss` (mean over the batch) with respect to the parameters.
    pub grad: Vec<f32>,
    /// Spikes in the batch.
    pub n_spikes: u64,
    /// Mean firing rate over samples and neurons (Hz).
    pub mean_rate_hz: f64,
    /// With [`BpttOptions::record_first_sample`]: the spikes of the batch's first sample
    /// computed by this very forward pass, as `(step, neuron)` pairs (neuron: external index,
    /// i.e. the order of [`NetworkSpec::neurons`](crate::NetworkSpec); the spike of step
    /// `step` has NEST's time stamp `(step + 1) * dt` ms), sorted by step, then neuron, like
    /// [`TrialSpikes::spikes`](crate::TrialSpikes). `None` otherwise.
    pub first_spikes: Option<Vec<(u32, u32)>>,
}

/// Where the time of one [`SnnModel::loss_and_grad_timed`](crate::SnnModel::loss_and_grad_timed) call went (seconds), and the
/// work of the adjoint's transposed SpMV.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTiming {
    /// The forward pass over all steps (with the loss sums). On a GPU, where a call is one
    /// submission, the host's recording of it (the device's work is in `backward_s`).
    pub forward_s: f64,
    /// Recomputation during the backward pass: segmented BPTT, the chunks' forward passes;
    /// unsegmented, rebuilding the after-spike currents of the tape's stretches.
    pub recompute_s: f64,
    /// The backward pass (adjoints and gradients), the SpMV included.
    pub backward_s: f64,
    /// Of which the transposed SpMV over all recurrent edges with its weight gradient.
    pub adjoint_spmv_s: f64,
    /// Of `adjoint_spmv_s`, the scatter form's recurrent weight gradient, taken per window
    /// of 16 steps and per target; 0 in the gather form, whose SpMV adds the weight gradient
    /// edge by edge.
    pub weight_grad_s: f64,
    /// Recurrent edges the SpMV visited (summed over steps).
    pub adjoint_edges: u64,
    /// Bytes of edge arrays the SpMV streamed for those visits: per edge, the 4-byte target
    /// offset and 4-byte weight in the gather form, the 2-byte source and 4-byte weight in
    /// the scatter form.
    pub adjoint_edge_bytes: u64,
    /// Whether the SpMV took the scatter form ([`SpmvForm`]).
    pub adjoint_scatter: bool,
    /// On a GPU, the call's kernel launches, host synchronisations and transfers (counted
    /// by the engine as it records them); `None` on CPU cores.
    pub device: Option<DeviceCounts>,
}

/// The device work of one GPU call ([`StepTiming::device`]): the numbers that transfer from
/// lavapipe to any GPU (unlike its wall time).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceCounts {
    /// Compute dispatches (kernel launches).
    pub launches: u64,
    /// Blocking waits of the host for the device.
    pub host_syncs: u64,
    /// Bytes read back to the host (the loss sums per sample, the gradient on the host
    /// path, the first sample's spikes when recorded, the non-finite flag).
    pub bytes_to_host: u64,
    /// Bytes uploaded (the weights on the host path, the surrogate, the regularization
    /// coefficient, the batch's first sample; once per shape the per-step uniforms).
    pub bytes_to_device: u64,
}
