//! [`DeviceModel`]: an [`NpeModel`] on the backend its [`Placement`] names, chosen at run
//! time (`local.device`, `--device`), as one lockstep-train [`Model`].
//!
//! Every variant keeps the same flat host buffers (parameters, frozen values, running
//! statistics), so checkpoints do not depend on the device: a run trained on a GPU resumes on
//! the CPU and the reverse.

use crate::device::{Placement, WgpuAutodiff};
use crate::error::NpeError;
use crate::flow::NpeNetwork;
use crate::model::NpeModel;
use crate::CpuAutodiff;
use lockstep_train::{Batch, Model, ReplicaContext};
use std::path::{Path, PathBuf};

/// An [`NpeModel`] on the CPU, a wgpu GPU or a CUDA GPU.
// With burn's fusion built in, burn's wgpu model grows past the CPU one by more than
// clippy's limit; one model lives per replica, so the size does not matter.
#[cfg_attr(feature = "fusion", allow(clippy::large_enum_variant))]
pub enum DeviceModel {
    /// burn's ndarray backend.
    Cpu(NpeModel<CpuAutodiff>),
    /// burn's wgpu backend.
    Gpu(NpeModel<WgpuAutodiff>),
    /// burn's CUDA backend (feature `cuda`).
    #[cfg(feature = "cuda")]
    Cuda(NpeModel<crate::CudaAutodiff>),
    /// burn's fusion over its wgpu backend (feature `fusion`, `LOCKSTEP_NPE_FUSION=1`; see
    /// [`crate::fusion_backend`]).
    #[cfg(feature = "fusion")]
    GpuFusion(Box<NpeModel<crate::fusion_backend::WgpuFusionAutodiff>>),
}

/// Whether `LOCKSTEP_NPE_FUSION=1` asks GPU placements for burn's fusion.
///
/// Errors: [`NpeError::Invalid`] when it does in a build without the `fusion` feature.
fn fusion_requested() -> Result<bool, NpeError> {
    let asked = std::env::var("LOCKSTEP_NPE_FUSION").is_ok_and(|v| v == "1");
    if asked && !cfg!(feature = "fusion") {
        return Err(NpeError::Invalid(
            "LOCKSTEP_NPE_FUSION=1 needs a build with burn's fusion (cargo build --release --features lockstep-cli/fusion)".into(),
        ));
    }
    Ok(asked)
}

/// `$body` with `$m` bound to the model of whichever variant `$s` is.
macro_rules! each {
    ($s:expr, $m:ident => $body:expr) => {
        match $s {
            DeviceModel::Cpu($m) => $body,
            DeviceModel::Gpu($m) => $body,
            #[cfg(feature = "cuda")]
            DeviceModel::Cuda($m) => $body,
            #[cfg(feature = "fusion")]
            DeviceModel::GpuFusion($m) => $body,
        }
    };
}

impl DeviceModel {
    /// The network with parameters initialized from `seed`, on `placement`.
    ///
    /// Errors: a CUDA placement in a build without the `cuda` feature.
    pub fn new(network: NpeNetwork, seed: u64, placement: &Placement) -> Result<Self, NpeError> {
        Ok(match placement {
            Placement::Cpu => DeviceModel::Cpu(NpeModel::new(network, seed, Default::default())),
            #[cfg(feature = "fusion")]
            Placement::Gpu { device, .. } if fusion_requested()? => {
                DeviceModel::GpuFusion(Box::new(NpeModel::new(network, seed, device.clone())))
            }
            Placement::Gpu { device, .. } => {
                fusion_requested()?;
                DeviceModel::Gpu(NpeModel::new(network, seed, device.clone()))
            }
            #[cfg(feature = "cuda")]
            Placement::Cuda { index, .. } => DeviceModel::Cuda(NpeModel::new(
                network,
                seed,
                burn::backend::cuda::CudaDevice::new(*index),
            )),
            #[cfg(not(feature = "cuda"))]
            Placement::Cuda { .. } => {
                crate::device::check_cuda()?;
                unreachable!("check_cuda refuses builds without the cuda feature")
            }
        })
    }

    /// A copy of `model` (parameters, frozen blocks, running statistics) on `placement`.
    ///
    /// Errors: as [`DeviceModel::new`].
    pub fn from_model(
        model: &NpeModel<CpuAutodiff>,
        placement: &Placement,
    ) -> Result<Self, NpeError> {
        Ok(match placement {
            Placement::Cpu => DeviceModel::Cpu(model.on(Default::default())),
            #[cfg(feature = "fusion")]
            Placement::Gpu { device, .. } if fusion_requested()? => {
                DeviceModel::GpuFusion(Box::new(model.on(device.clone())))
            }
            Placement::Gpu { device, .. } => {
                fusion_requested()?;
                DeviceModel::Gpu(model.on(device.clone()))
            }
            #[cfg(feature = "cuda")]
            Placement::Cuda { index, .. } => {
                DeviceModel::Cuda(model.on(burn::backend::cuda::CudaDevice::new(*index)))
            }
            #[cfg(not(feature = "cuda"))]
            Placement::Cuda { .. } => {
                crate::device::check_cuda()?;
                unreachable!("check_cuda refuses builds without the cuda feature")
            }
        })
    }

    /// A copy of `model` on the GPU of `placement` under burn's fusion (feature `fusion`;
    /// what `LOCKSTEP_NPE_FUSION=1` makes of a GPU placement).
    ///
    /// Errors: [`NpeError::Invalid`] for a placement that is not `gpu`.
    #[cfg(feature = "fusion")]
    pub fn with_fusion(
        model: &NpeModel<CpuAutodiff>,
        placement: &Placement,
    ) -> Result<Self, NpeError> {
        match placement {
            Placement::Gpu { device, .. } => {
                Ok(DeviceModel::GpuFusion(Box::new(model.on(device.clone()))))
            }
            other => Err(NpeError::Invalid(format!(
                "burn's fusion runs on a gpu placement, not {}",
                other.describe()
            ))),
        }
    }

    /// Mixed precision for the training passes ([`NpeModel::set_mixed_precision`]).
    pub fn set_mixed_precision(&mut self, on: bool) {
        each!(self, m => m.set_mixed_precision(on))
    }

    /// The network.
    pub fn network(&self) -> &NpeNetwork {
        each!(self, m => &m.network)
    }

    /// See [`NpeModel::freeze`].
    ///
    /// Errors: a prefix that names no parameter.
    pub fn freeze(&mut self, blocks: &[String]) -> Result<usize, NpeError> {
        each!(self, m => m.freeze(blocks))
    }

    /// See [`NpeModel::parameters`].
    pub fn parameters(&self) -> Vec<f32> {
        each!(self, m => m.parameters())
    }

    /// See [`NpeModel::set_parameters`].
    ///
    /// Errors: `values` has the wrong length.
    pub fn set_parameters(&mut self, values: &[f32]) -> Result<(), NpeError> {
        each!(self, m => m.set_parameters(values))
    }

    /// See [`NpeModel::state`].
    pub fn state(&self) -> &[f32] {
        each!(self, m => m.state())
    }

    /// See [`NpeModel::set_state`].
    ///
    /// Errors: `values` has the wrong length.
    pub fn set_state(&mut self, values: &[f32]) -> Result<(), NpeError> {
        each!(self, m => m.set_state(values))
    }

    /// See [`NpeModel::log_prob`].
    pub fn log_prob(&self, theta: &[f32], x: &[f32], n: usize) -> Vec<f32> {
        each!(self, m => m.log_prob(theta, x, n))
    }

    /// See [`NpeModel::sample`].
    pub fn sample(&self, x: &[f32], n: usize, seed: u64) -> Vec<f32> {
        each!(self, m => m.sample(x, n, seed))
    }

    /// See [`NpeModel::nll_and_grad`].
    pub fn nll_and_grad(&mut self, theta: &[f32], x: &[f32], n: usize, grad: &mut [f32]) -> f64 {
        each!(self, m => m.nll_and_grad(theta, x, n, grad))
    }

    /// See [`NpeModel::train_pass`].
    ///
    /// Errors: those of [`NpeModel::train_pass`].
    pub fn train_pass(
        &mut self,
        theta: &[f32],
        x: &[f32],
        n: usize,
        grad: &mut [f32],
        replicas: &ReplicaContext<'_>,
    ) -> Result<Vec<f32>, NpeError> {
        each!(self, m => m.train_pass(theta, x, n, grad, replicas))
    }

    /// See [`NpeModel::last_step_times`].
    pub fn last_step_times(&self) -> crate::model::StepTimes {
        each!(self, m => m.last_step_times())
    }

    /// Waits until the device has run every queued kernel (nothing to wait for on the CPU).
    ///
    /// Errors: [`NpeError::Invalid`] naming the device's failure.
    pub fn sync(&self) -> Result<(), NpeError> {
        use burn::tensor::backend::Backend;
        fn on<B: Backend>(device: &B::Device) -> Result<(), NpeError> {
            B::sync(device).map_err(|e| NpeError::Invalid(format!("the device failed: {e:?}")))
        }
        match self {
            DeviceModel::Cpu(m) => on::<CpuAutodiff>(m.device()),
            DeviceModel::Gpu(m) => on::<WgpuAutodiff>(m.device()),
            #[cfg(feature = "cuda")]
            DeviceModel::Cuda(m) => on::<crate::CudaAutodiff>(m.device()),
            #[cfg(feature = "fusion")]
            DeviceModel::GpuFusion(m) => {
                on::<crate::fusion_backend::WgpuFusionAutodiff>(m.device())
            }
        }
    }

    /// See [`NpeModel::sample_chunks`].
    pub fn sample_chunks(
        &self,
        x: &[f32],
        n: u64,
        seed: u64,
        chunk: usize,
        write: &mut dyn FnMut(&[f32]) -> bool,
    ) {
        each!(self, m => m.sample_chunks(x, n, seed, chunk, write))
    }

    /// The P-P test of this model ([`crate::calibration::pp_test`]).
    ///
    /// Errors: those of [`crate::calibration::pp_test`].
    pub fn pp_test(
        &self,
        task: &dyn crate::Task,
        seed: u64,
        injections: usize,
        samples: usize,
    ) -> Result<crate::calibration::PpResult, crate::NpeError> {
        each!(self, m => crate::calibration::pp_test(m, task, seed, injections, samples))
    }

    /// [`DeviceModel::pp_test`], calling `progress(done)` after each injection
    /// ([`crate::calibration::pp_test_with_progress`]).
    ///
    /// Errors: those of [`crate::calibration::pp_test`].
    pub fn pp_test_with_progress(
        &self,
        task: &dyn crate::Task,
        seed: u64,
        injections: usize,
        samples: usize,
        progress: &mut dyn FnMut(usize),
    ) -> Result<crate::calibration::PpResult, crate::NpeError> {
        each!(self, m => crate::calibration::pp_test_with_progress(m, task, seed, injections, samples, progress))
    }
}

impl Model for DeviceModel {
    fn trainable(&self) -> &[f32] {
        each!(self, m => m.trainable())
    }
    fn trainable_mut(&mut self) -> &mut [f32] {
        each!(self, m => m.trainable_mut())
    }
    fn frozen(&self) -> &[f32] {
        each!(self, m => m.frozen())
    }
    fn frozen_mut(&mut self) -> &mut [f32] {
        each!(self, m => m.frozen_mut())
    }
    fn set_loss_scale(&mut self, scale: f32) -> bool {
        each!(self, m => m.set_loss_scale(scale))
    }
    fn loss_names(&self) -> Vec<String> {
        each!(self, m => m.loss_names())
    }
    fn sample_separable(&self) -> bool {
        each!(self, m => m.sample_separable())
    }
    fn synchronizes_batch_statistics(&self) -> bool {
        each!(self, m => m.synchronizes_batch_statistics())
    }
    fn loss_and_grad(&mut self, batch: &Batch, grad: &mut [f32]) -> anyhow::Result<Vec<f64>> {
        each!(self, m => m.loss_and_grad(batch, grad))
    }
    fn loss_and_grad_in(
        &mut self,
        batch: &Batch,
        grad: &mut [f32],
        replicas: &ReplicaContext<'_>,
    ) -> anyhow::Result<Vec<f64>> {
        each!(self, m => m.loss_and_grad_in(batch, grad, replicas))
    }
    fn memory_estimate(&self, local_batch: usize) -> lockstep_core::memory::MemoryEstimate {
        fn estimate<B: crate::backend::TrainBackend>(
            m: &NpeModel<B>,
            local_batch: usize,
        ) -> lockstep_core::memory::MemoryEstimate {
            Model::memory_estimate(m, local_batch)
        }
        each!(self, m => estimate(m, local_batch))
    }
    fn validation_loss(&mut self, batch: &Batch) -> anyhow::Result<Vec<f64>> {
        each!(self, m => m.validation_loss(batch))
    }
    fn after_update(&mut self) {
        each!(self, m => m.after_update())
    }
    fn device_state(&mut self) -> Option<&mut dyn lockstep_train::DeviceState> {
        each!(self, m => m.device_state())
    }
    fn export(&self, dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
        each!(self, m => m.export(dir))
    }
    fn record_first_sample(&mut self, update: u64) -> bool {
        each!(self, m => m.record_first_sample(update))
    }
    fn write_sample_record(&mut self, dir: &Path, update: u64) -> anyhow::Result<Vec<PathBuf>> {
        each!(self, m => m.write_sample_record(dir, update))
    }
}
