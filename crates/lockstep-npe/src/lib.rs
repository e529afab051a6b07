//! Neural posterior estimation (NPE), Dingo style, trained by lockstep's sample-parallel engine.
//!
//! What this crate guarantees:
//! - a conditional normalizing flow `q(θ | x)` ([`flow::NpeNetwork`]): per step a random
//!   permutation, an LU-factorized linear map and a rational-quadratic spline coupling
//!   transform ([`spline`], Durkan et al. 2019, as nflows/glasflow/Dingo), conditioned on the
//!   output of a residual embedding network ([`layers::DenseResidualNet`]) with LayerNorm,
//!   BatchNorm or no normalization; `log_prob(θ, x)` and `sample(x, n)` over a standard
//!   normal base;
//! - all trainable values live in one flat f32 buffer in a fixed, named order
//!   ([`params::Layout`]), so [`model::NpeModel`] is a lockstep-train [`lockstep_train::Model`]
//!   whose gradients go through one packed all-reduce, and replicas stay bitwise identical;
//! - SBI tasks ([`tasks`]: `gaussian_linear`, `two_moons`, `slcp`) simulate `(θ, x)` keyed by
//!   (seed, global sample index), so the data never depends on the replica count; and the
//!   gravitational-wave chirp task ([`gw`]: TaylorF2 on two detectors, whitened, with noise);
//! - Dingo-shaped YAML settings ([`settings`]) with unknown keys refused by their nearest key
//!   and keys of features not implemented yet refused by name; a trained run loads back
//!   from its checkpoint ([`trained`]); the P-P calibration test ([`calibration`]);
//! - Dingo's reduced-basis first embedding layer, initialized from an SVD of training
//!   inputs computed from keyed simulations, identical on every replica ([`svd`]);
//! - training stages that freeze named blocks under replicas ([`model::NpeModel::freeze`],
//!   [`settings::NpeSettings::stages`]), run one after the other by the engine as
//!   `lockstep npe train` does ([`stages::train_stages`]), and HTCondor / Slurm submission
//!   files ([`submit`]);
//! - errors as [`NpeError`], naming the file and key as the user wrote them
//!   (`FILE: KEY: PROBLEM`), the offending value and the fix.
//!
//! - BatchNorm makes the loss depend on the whole batch: under replicas its layers run as
//!   SyncBatchNorm ([`sync_batch_norm`]: batch statistics and their backward sums over all
//!   replicas), so N replicas train like one with the whole batch; its running statistics
//!   are the model's frozen buffer, identical on every replica, checkpointed and restored
//!   exactly.
//!
//! Tensors and autodiff come from burn: the ndarray backend on the CPU, the wgpu backend on
//! any Vulkan/Metal/DX12 GPU (on the device lockstep-gpu opened), and with the `cuda` feature
//! `CudaAutodiff` and `cuda_model`, which load CUDA at run time; `local.device` picks one per
//! run ([`device`], [`device_model::DeviceModel`]); on the GPU backends the coupling spline
//! runs as two kernels of this crate ([`spline_kernel`]). burn's ndarray backends share
//! one CPU device whose float type is fixed by its first use in a process: use one precision
//! per process.
//!
//! Mixed precision (`automatic_mixed_precision`, GPU backends only): the training passes'
//! linear layers and activations in float16 ([`fused_ops::Precision`]) with the engine's
//! dynamic loss scaling (`lockstep_train::grad_scaler`).

pub mod activation_kernel;
pub mod backend;
pub mod c2st;
pub mod calibration;
pub mod coupling_kernel;
pub mod device;
pub mod device_model;
pub mod error;
pub mod export;
pub mod flow;
pub mod fused_ops;
#[cfg(feature = "fusion")]
pub mod fusion_backend;
pub mod gw;
pub mod kernel_check;
pub mod layer_kernel;
pub mod layers;
pub mod linear_half_kernel;
pub mod lu_kernel;
pub mod model;
pub mod optim_kernel;
pub mod params;
pub mod resident;
pub mod sampling;
pub mod sbibm;
pub mod settings;
pub mod spline;
pub mod spline_kernel;
pub mod stages;
pub mod step_phases;
pub mod submit;
pub mod svd;
pub mod sync_batch_norm;
pub mod task;
pub mod tasks;
pub mod trained;

pub use device::{DeviceKind, Placement, WgpuAutodiff, WgpuBackend};
pub use device_model::DeviceModel;
pub use error::NpeError;
pub use flow::{EmbeddingConfig, FlowConfig, NetworkConfig, NpeNetwork, Standardization};
pub use layers::Norm;
pub use model::{NpeModel, StepTimes};
pub use settings::NpeSettings;
pub use task::Task;
pub use tasks::{GaussianLinear, Slcp, TaskSource, TaskSpec, TwoMoons};

/// The CPU backend (burn's ndarray backend, f32).
pub type CpuBackend = burn::backend::NdArray<f32>;
/// The CPU backend with reverse-mode autodiff (what training uses).
pub type CpuAutodiff = burn::backend::Autodiff<CpuBackend>;
/// The CUDA backend with autodiff (feature `cuda`; CUDA is loaded at run time).
#[cfg(feature = "cuda")]
pub type CudaAutodiff = burn::backend::Autodiff<burn::backend::Cuda>;

/// The NPE model on CUDA device `index` (feature `cuda`; the CUDA driver and NVRTC are loaded
/// when the first kernel runs, so building needs no CUDA toolkit).
#[cfg(feature = "cuda")]
pub fn cuda_model(network: NpeNetwork, seed: u64, index: usize) -> NpeModel<CudaAutodiff> {
    NpeModel::new(network, seed, burn::backend::cuda::CudaDevice::new(index))
}
