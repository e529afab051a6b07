//! The GPU engine (`run.device: "gpu"`): the float32 BPTT step as WGSL compute kernels run
//! through wgpu (Vulkan, Metal, DX12; Mesa's lavapipe without a GPU), one process or thread
//! replica per GPU.
//!
//! The kernels (`bptt.wgsl`) repeat the float32 CPU engine's operations in its order, with
//! deterministic sums (spike delivery as a pull over each target's in-edges, the spike
//! adjoint as a gather over each source's out-edges, each weight gradient owned by one
//! invocation): the same inputs give the same bits on every run, and on a driver that does
//! not fuse multiply-adds (lavapipe) the forward pass has the CPU engine's bits. The whole
//! time loop runs on the device, one command buffer per pass; the losses and the gradient
//! come back once per call, or, while training keeps its state on the device, only the
//! losses: the parameters, gradient and optimizer slots then stay there between updates.
//! Files: `layout.rs` (the network packed for the device, the kernels' constants),
//! `wide_arith.rs` (float64 and 64-bit integers where the adapter has them, else 32-bit
//! kernels: `with_64bit.wgsl`, `without_64bit.wgsl`),
//! `plan.rs` (one call's dispatches in order), `engine.rs` (buffers, kernels, one call), `training_state.rs` (the training state on the
//! device and the optimizer's kernels, `training_state.wgsl`). Arrays larger than one
//! binding are bound as windows of one buffer (`lockstep_gpu::windows`).

mod engine;
mod layout;
mod plan;
mod training_state;
mod wide_arith;

pub(crate) use engine::GpuEngine;

use crate::error::{Result, SnnError};
use lockstep_train::DeviceUpdate;
use training_state::TrainingState;

/// The training state's side of the engine (lockstep-train's `DeviceState`, through
/// `SnnModel` and `SnnReplica`).
impl GpuEngine {
    /// Takes the training state onto the device: `params` (`[n_params]`, pA), the
    /// optimizer's `slots` (Adam `[m, v]`, SGD `[velocity]`, each `[n_params]`) and the
    /// parameters' sign constraints `signs` (`[n_params]`: +1, -1, 0), with a zero gradient.
    /// Replaces any state uploaded before.
    ///
    /// Errors: lengths that disagree, a buffer over the adapter's limits, a device error.
    pub fn upload_training(&self, params: &[f32], slots: &[Vec<f32>], signs: &[i8]) -> Result<()> {
        let mut t = self.training.lock().unwrap_or_else(|p| p.into_inner());
        *t = None;
        *t = Some(TrainingState::new(
            &self.ctx, params, slots, signs, self.wide,
        )?);
        Ok(())
    }

    /// The training state on the device, or an error saying it is not there.
    fn with_training<T>(&self, f: impl FnOnce(&TrainingState) -> Result<T>) -> Result<T> {
        let t = self.training.lock().unwrap_or_else(|p| p.into_inner());
        match t.as_ref() {
            Some(t) => f(t),
            None => Err(SnnError::Shape(
                "the training state is not on the device (no upload)".into(),
            )),
        }
    }

    /// Reads the device's parameters and optimizer slots into `params` and `slots` (one
    /// read-back; the device keeps them).
    ///
    /// Errors: nothing uploaded, lengths other than uploaded, a device error.
    pub fn download_training(&self, params: &mut [f32], slots: &mut [Vec<f32>]) -> Result<()> {
        self.with_training(|t| t.download(&self.ctx, params, slots))
    }

    /// Device bytes of the training state, or `None` when none is uploaded.
    pub fn training_state_bytes(&self) -> Option<u64> {
        let t = self.training.lock().unwrap_or_else(|p| p.into_inner());
        t.as_ref().map(TrainingState::device_bytes)
    }

    /// Frees the training state on the device (the host's copies are the truth again).
    pub fn release_training(&self) {
        *self.training.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// Reads the update's gradient (the sum of its passes' mean gradients, `[n_params]`
    /// float32) into `grad`: one read-back.
    ///
    /// Errors: nothing uploaded, another length, a device error.
    pub fn read_training_gradient(&self, grad: &mut [f32]) -> Result<()> {
        self.with_training(|t| t.read_gradient(&self.ctx, grad))
    }

    /// Ends the update on the device in one submission the host does not wait for:
    /// `reduced` (`[n_params]`, the host's reduced gradient) replaces the device's when
    /// given, `Some(update)` applies the optimizer and the sign constraint, and the gradient
    /// starts again from zero. Returns the kernel launches (one per window of the
    /// parameters with an update, else 0).
    ///
    /// Errors: nothing uploaded, `reduced` of another length, a rule the uploaded slots do
    /// not fit.
    pub fn finish_training_update(
        &self,
        update: Option<&DeviceUpdate>,
        reduced: Option<&[f32]>,
    ) -> Result<u64> {
        self.with_training(|t| t.finish_update(&self.ctx, update, reduced))
    }
}
