//! The seam through which a model keeps its trainable parameters and the optimizer's state
//! on its device (`docs/design.md`, "Training state on a device").
//!
//! By default the engine owns the training state in host memory: the model's flat
//! [`crate::Model::trainable`] buffer, the [`crate::Optimizer`]'s slots, and the packed
//! gradient every `loss_and_grad` writes. A model that computes on a GPU may instead answer
//! [`crate::Model::device_state`] with a [`DeviceState`]: the engine then hands it the
//! parameters and slots once, at the start of a run (after a restore and the start-up
//! broadcast), and from then on
//!
//! - each `loss_and_grad` adds the micro-batch's mean gradient into a gradient the model
//!   keeps on the device (the engine's `grad` argument is left alone);
//! - the host still computes every scalar of an update: the learning rate of the schedule
//!   (reduce-on-plateau included), Adam's bias corrections, the gradient's mean factor and
//!   the loss scaler's unscale factor ([`DeviceUpdate`], passed as data per update), and
//!   the loss scaler's verdict ([`DeviceState::gradient_is_finite`]);
//! - with one replica and no gradient clipping nothing of the gradient crosses the bus:
//!   the update is a kernel over the device's packed buffers;
//! - with several replicas (or `training.clip_max_norm`, whose norm the host computes) the
//!   gradient is read back once, packed float32 ([`DeviceState::read_gradient`]), reduced
//!   and clipped on the host as before, and uploaded once with the update
//!   ([`DeviceState::finish_update`]);
//! - the parameters and slots come back ([`DeviceState::download`]) only where the host
//!   needs them: a checkpoint, the export and the end of the run (chief), and the replicas'
//!   checksum comparison when there is more than one replica.
//!
//! The update's arithmetic is the host optimizer's, term by term in the same order
//! ([`DeviceUpdate`]), so a device that rounds like the host (lavapipe) trains bit for bit
//! like the host path.

/// The update rule of one optimizer update with the scalars the host computed for it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DeviceRule {
    /// Adam / AdamW ([`crate::optim::OptimizerKind::Adam`]); per value, with `g` the
    /// gradient after [`DeviceUpdate::grad_factor`] and [`DeviceUpdate::unscale`]:
    /// `p = p * keep; m = beta1 * m + one_minus_beta1 * g;
    /// v = beta2 * v + one_minus_beta2 * g * g; p = p - lr * (m / c1) / (sqrt(v / c2) + epsilon)`
    /// (products left to right, float32 throughout).
    Adam {
        /// First-moment decay.
        beta1: f32,
        /// `1 - beta1`, as the host rounds it.
        one_minus_beta1: f32,
        /// Second-moment decay.
        beta2: f32,
        /// `1 - beta2`, as the host rounds it.
        one_minus_beta2: f32,
        /// Added to `sqrt(v_hat)`.
        epsilon: f32,
        /// AdamW's decoupled decay factor `1 - lr * weight_decay` (exactly 1 for Adam).
        keep: f32,
        /// Bias correction `1 - beta1^t` of this update's `t`.
        c1: f32,
        /// Bias correction `1 - beta2^t`.
        c2: f32,
    },
    /// SGD with momentum ([`crate::optim::OptimizerKind::Sgd`]): per value
    /// `vel = momentum * vel + g; p = p - lr * vel`.
    Sgd {
        /// Momentum factor (0: plain SGD).
        momentum: f32,
    },
}

/// One optimizer update as a device applies it: the rule and every scalar, computed on the
/// host ([`crate::Optimizer::device_update`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceUpdate {
    /// The learning rate of this update (the schedule's, rounded to float32 as the host
    /// optimizer does).
    pub learning_rate: f32,
    /// Multiplies the device's gradient first: `1 / (replicas x micro-batches)` for the
    /// gradient the device accumulated, 1 for a gradient the host reduced and uploaded.
    pub grad_factor: f32,
    /// Multiplies it second: `1 / loss scale` with loss scaling on the device's gradient,
    /// else 1 (multiplying by 1 changes no bit).
    pub unscale: f32,
    /// Adam's `t` after this update (1 for the first update).
    pub step: u64,
    /// The rule and its scalars.
    pub rule: DeviceRule,
}

/// Parameters, gradient and optimizer slots a model keeps on its device (see the
/// [module docs](self)). Every method that reads from the device is one host
/// synchronisation; errors are the model's own ([`anyhow::Error`]).
pub trait DeviceState {
    /// Takes the model's trainable parameters ([`crate::Model::trainable`]) and the
    /// optimizer's `slots` (each as long as the parameters: Adam `[m, v]`, SGD
    /// `[velocity]`) onto the device. From here until [`DeviceState::release`] the device's
    /// copies are the truth and the host's go stale; the next `loss_and_grad` starts a new
    /// gradient.
    ///
    /// Errors: the device's (allocation, transfer).
    fn upload(&mut self, slots: &[Vec<f32>]) -> anyhow::Result<()>;

    /// Reads the parameters back into the model's host buffer ([`crate::Model::trainable`])
    /// and the slots into `slots` (lengths as uploaded); the device keeps them. One
    /// read-back.
    ///
    /// Errors: the device's.
    fn download(&mut self, slots: &mut [Vec<f32>]) -> anyhow::Result<()>;

    /// Ends the device's ownership: the host buffers hold what the last
    /// [`DeviceState::download`] read (the engine downloads at the end of a run), and the
    /// model computes from them again. Does nothing when nothing is uploaded.
    fn release(&mut self);

    /// Reads this update's gradient back into `grad` (`[trainable len]`, packed float32):
    /// the sum over the update's micro-batches of their mean gradients, unscaled by
    /// nothing. One read-back.
    ///
    /// Errors: the device's.
    fn read_gradient(&mut self, grad: &mut [f32]) -> anyhow::Result<()>;

    /// Whether every value of this update's gradient is finite (the loss scaler's test).
    /// The engine asks it once per update, after the last micro-batch, and only with loss
    /// scaling; a model may answer from a flag it read together with the loss (no extra
    /// read-back).
    ///
    /// Errors: the device's.
    fn gradient_is_finite(&mut self) -> anyhow::Result<bool>;

    /// Ends the update: `Some(update)` applies it to the parameters and slots, with
    /// `reduced` (the host's reduced gradient, `[trainable len]`, uploaded once) as the
    /// gradient when given, else the device's own; `None` skips the update (the loss
    /// scaler's verdict) and drops the gradient. The next `loss_and_grad` starts a new
    /// gradient either way.
    ///
    /// Errors: the device's; `reduced` of the wrong length.
    fn finish_update(
        &mut self,
        update: Option<&DeviceUpdate>,
        reduced: Option<&[f32]>,
    ) -> anyhow::Result<()>;
}
