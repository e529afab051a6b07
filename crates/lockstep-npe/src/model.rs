//! [`NpeModel`]: the network as the engine's [`Model`].
//!
//! The flat trainable buffer is the source of truth: every `loss_and_grad` turns it into one
//! gradient-tracking tensor per parameter (in the [`crate::params::Layout`] order), computes the
//! mean negative log-probability `-mean_i log q(θ_i | x_i)` of the local batch, and writes the
//! gradients back in the same order, so the engine packs them in one all-reduce. A training
//! stage may freeze named blocks ([`NpeModel::freeze`]): the trainable buffer then holds only
//! the other parameters (so the all-reduce covers exactly them), and the frozen parameters
//! move to the frozen buffer, ahead of the BatchNorm running statistics; both are broadcast
//! and checkpointed by the engine. The BatchNorm running statistics are always frozen values;
//! with BatchNorm the loss is not sample-separable, so under replicas the BatchNorm layers run
//! as SyncBatchNorm ([`crate::sync_batch_norm`]).

use crate::backend::TrainBackend;
use crate::error::NpeError;
use crate::flow::NpeNetwork;
use crate::fused_ops::Precision;
use crate::layers::Pass;
use crate::params::{read_together, to_vec, Params, Partition};
use crate::resident::Resident;
use crate::sync_batch_norm::{with_stats_reducer, StatsReducer};
use lockstep_train::{checkpoint, Batch, DeviceState, DeviceUpdate, Model, ReplicaContext};
use safetensors::tensor::{Dtype, TensorView};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The mean negative log-probability `-mean_i lp_i` of per-sample `lp` (f64 sum).
fn mean_nll(lp: &[f32]) -> f64 {
    -lp.iter().map(|&v| v as f64).sum::<f64>() / lp.len().max(1) as f64
}

/// File name of the exported network in a run directory.
pub const EXPORT_FILE: &str = "posterior.safetensors";

/// The NPE network with its parameters, on an autodiff backend `B`.
pub struct NpeModel<B: TrainBackend> {
    /// The network structure.
    pub network: NpeNetwork,
    /// Which parameters train.
    partition: Partition,
    /// The trainable parameters, packed in layout order.
    params: Vec<f32>,
    /// The frozen parameters (packed in layout order), then the BatchNorm running statistics.
    fixed: Vec<f32>,
    device: B::Device,
    /// The precision of the training passes' linear layers and activations
    /// ([`NpeModel::set_mixed_precision`]).
    precision: Precision,
    /// The factor the training loss is multiplied by before the backward pass (dynamic loss
    /// scaling, [`Model::set_loss_scale`]); 1 without mixed precision.
    loss_scale: f32,
    /// The host's times in the last training pass.
    last_step: StepTimes,
    /// The training state on the device while the engine has it there
    /// ([`Model::device_state`]); the host's `params` are stale meanwhile.
    resident: Option<Resident<B::InnerBackend>>,
}

/// Where the host's time in one training pass went ([`NpeModel::last_step_times`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTimes {
    /// From the pass's start to the end of the backward pass's recording: uploading the
    /// parameters, building the autodiff graph and (on a device) queuing every kernel of the
    /// forward and the backward pass. On a device the kernels run meanwhile; with CubeCL's
    /// default of a submission every 32 tasks the host waits only if the device's queue
    /// pushes back.
    pub recording: std::time::Duration,
    /// Reading the gradient and the log-probabilities back (on a device: waiting for the
    /// queued kernels to finish, then the copy; on the CPU backends the copy alone).
    pub reading: std::time::Duration,
}

impl<B: TrainBackend> NpeModel<B> {
    /// The network with parameters initialized from `seed` on `device`.
    pub fn new(network: NpeNetwork, seed: u64, device: B::Device) -> Self {
        let (params, state) = network.initial_values(seed);
        NpeModel {
            partition: Partition::all_trainable(network.layout()),
            network,
            params,
            fixed: state,
            device,
            precision: Precision::F32,
            loss_scale: 1.0,
            last_step: StepTimes::default(),
            resident: None,
        }
    }

    /// Mixed precision for the training passes (Dingo's `automatic_mixed_precision`): with
    /// `on`, their linear layers and activations compute in float16
    /// ([`Precision::Half`]) on the float32 parameters, and the engine's loss scaler sets the
    /// loss scale ([`Model::set_loss_scale`]); evaluation passes stay float32. Only GPU
    /// backends compute in float16: the settings refuse it on the CPU.
    pub fn set_mixed_precision(&mut self, on: bool) {
        self.precision = if on { Precision::Half } else { Precision::F32 };
        if !on {
            self.loss_scale = 1.0;
        }
    }

    /// The device the passes compute on.
    pub fn device(&self) -> &B::Device {
        &self.device
    }

    /// A copy of this model (network, frozen blocks, parameters, running statistics) on
    /// another backend's `device`: the values are host buffers, so the copy computes the same
    /// function.
    pub fn on<C: TrainBackend>(&self, device: C::Device) -> NpeModel<C> {
        NpeModel {
            network: self.network.clone(),
            partition: self.partition.clone(),
            params: self.params.clone(),
            fixed: self.fixed.clone(),
            device,
            precision: self.precision,
            loss_scale: self.loss_scale,
            last_step: StepTimes::default(),
            resident: None,
        }
    }

    /// Freezes the parameters named by `blocks` (dotted prefixes such as
    /// `embedding_net.layers_rb` or `embedding_net.blocks.0`) and unfreezes every other one,
    /// keeping all values: afterwards [`Model::trainable`] holds only the trainable
    /// parameters and [`Model::frozen`] the frozen ones followed by the running statistics.
    /// Returns the number of values frozen.
    ///
    /// Errors: a prefix that names no parameter (with the network's block names).
    pub fn freeze(&mut self, blocks: &[String]) -> Result<usize, NpeError> {
        let partition = self.network.freezing(blocks)?;
        let layout = self.network.layout();
        let values = self.parameters();
        let state = self.state().to_vec();
        let (params, mut fixed) = partition.split(layout, &values);
        fixed.extend_from_slice(&state);
        self.partition = partition;
        self.params = params;
        self.fixed = fixed;
        self.resident = None;
        Ok(self.partition.frozen_len())
    }

    /// Every parameter value in the layout's order (`[network.layout().len()]`), trainable
    /// and frozen.
    pub fn parameters(&self) -> Vec<f32> {
        let frozen = &self.fixed[..self.partition.frozen_len()];
        self.partition
            .join(self.network.layout(), &self.params, frozen)
    }

    /// Sets every parameter value from the layout-ordered `values`
    /// (`[network.layout().len()]`), whichever are frozen.
    ///
    /// Errors: `values` has the wrong length.
    pub fn set_parameters(&mut self, values: &[f32]) -> Result<(), NpeError> {
        let layout = self.network.layout();
        if values.len() != layout.len() {
            return Err(NpeError::Invalid(format!(
                "{} parameter values for a network of {}",
                values.len(),
                layout.len()
            )));
        }
        let (params, frozen) = self.partition.split(layout, values);
        let n = frozen.len();
        self.params = params;
        self.fixed[..n].copy_from_slice(&frozen);
        Ok(())
    }

    /// The BatchNorm running statistics (`[network.state_layout().len()]`).
    pub fn state(&self) -> &[f32] {
        &self.fixed[self.partition.frozen_len()..]
    }

    /// Sets the BatchNorm running statistics.
    ///
    /// Errors: `values` has the wrong length.
    pub fn set_state(&mut self, values: &[f32]) -> Result<(), NpeError> {
        let n = self.partition.frozen_len();
        if values.len() != self.fixed.len() - n {
            return Err(NpeError::Invalid(format!(
                "{} running statistics for a network of {}",
                values.len(),
                self.fixed.len() - n
            )));
        }
        self.fixed[n..].copy_from_slice(values);
        Ok(())
    }

    /// `log q(θ | x)` per sample in evaluation mode (no gradients; BatchNorm uses its running
    /// statistics). `theta: [n * theta_dim]`, `x: [n * x_dim]` row-major; returns `[n]`.
    pub fn log_prob(&self, theta: &[f32], x: &[f32], n: usize) -> Vec<f32> {
        let p = self.evaluation_params();
        let mut state = self.state().to_vec();
        let mut pass = Pass::evaluation(&p, &mut state, self.network.state_layout());
        to_vec(self.network.log_prob(&mut pass, theta, x, n))
    }

    /// `n` posterior samples `[n * theta_dim]` for the observation `x` (`[x_dim]`), base
    /// draws from SplitMix64(`seed`), evaluation mode.
    pub fn sample(&self, x: &[f32], n: usize, seed: u64) -> Vec<f32> {
        let p = self.evaluation_params();
        let mut state = self.state().to_vec();
        let mut pass = Pass::evaluation(&p, &mut state, self.network.state_layout());
        self.network.sample(&mut pass, x, n, seed)
    }

    /// Up to `n` posterior samples for the observation `x` drawn `chunk` rows at a time, each
    /// chunk (`[rows * theta_dim]`) handed to `write` as soon as it is drawn, so memory stays
    /// bounded by the chunk whatever `n` is; `write` returns whether to go on (a caller that
    /// stops on an error keeps it in its own state). The rows equal those of
    /// [`NpeModel::sample`] with the same seed (one base stream, consumed in order).
    ///
    /// `write` is a `dyn` callback, not a generic one, so that the sampling code (every layer
    /// of the flow on this backend) compiles once, in this crate, and not again in every crate
    /// that draws samples (the CLI and the Python extension took 5 minutes each that way).
    pub fn sample_chunks(
        &self,
        x: &[f32],
        n: u64,
        seed: u64,
        chunk: usize,
        write: &mut dyn FnMut(&[f32]) -> bool,
    ) {
        let p = self.evaluation_params();
        let mut state = self.state().to_vec();
        let mut rng = lockstep_core::rng::SplitMix64::new(seed);
        let mut done = 0u64;
        while done < n {
            let rows = (n - done).min(chunk.max(1) as u64) as usize;
            let mut pass = Pass::evaluation(&p, &mut state, self.network.state_layout());
            let s = self.network.sample_from(&mut pass, x, rows, &mut rng);
            done += rows as u64;
            if !write(&s) {
                break;
            }
        }
    }

    /// The parameters for an evaluation pass: from the device's buffers while the training
    /// state is there (no read-back), else from the host's.
    fn evaluation_params(&self) -> Params<B::InnerBackend> {
        let layout = self.network.layout();
        match &self.resident {
            Some(r) => r.params(
                layout,
                &self.partition,
                &self.fixed[..self.partition.frozen_len()],
                &self.device,
            ),
            None => Params::from_flat(layout, &self.parameters(), &self.device),
        }
    }

    /// The memory one replica needs to train on `local_batch` samples: the flat parameters,
    /// their per-pass tensor copies, the leaf gradients and the flat gradient (4 x P f32), and
    /// the activations the autodiff tape keeps (estimated per sample, times the batch, times 2
    /// for the gradients flowing back through them).
    pub fn memory_estimate(&self, local_batch: usize) -> lockstep_core::memory::MemoryEstimate {
        let mut m = lockstep_core::memory::MemoryEstimate::new();
        let p = self.params.len() as u64 + self.fixed.len() as u64;
        m.add("parameters, their tensors and gradients", 4 * p * 4)
            .driven_by("model.embedding_kwargs")
            .driven_by("model.posterior_kwargs");
        let act = self.network.activation_floats_per_sample() * local_batch as u64 * 4 * 2;
        m.add("activations and autodiff tape", act)
            .driven_by("run.batch_size");
        m
    }

    /// The mean negative log-probability of a batch and its gradient (training mode, updates
    /// the BatchNorm running statistics). `grad` has the length of the trainable buffer;
    /// frozen parameters get no gradient.
    pub fn nll_and_grad(&mut self, theta: &[f32], x: &[f32], n: usize, grad: &mut [f32]) -> f64 {
        let lp = self.pass_with_reducer(theta, x, n, grad, None);
        mean_nll(&lp)
    }

    /// One training pass over this replica's `n` samples (`theta: [n * theta_dim]`,
    /// `x: [n * x_dim]`): returns `log q(θ_i | x_i)` per sample (`[n]`, training mode) and
    /// writes the gradient of the local mean negative log-probability into `grad` (the
    /// trainable buffer's length; frozen parameters get none). With more than one replica in
    /// `replicas` and BatchNorm layers, they run as SyncBatchNorm: batch statistics and their
    /// backward sums cover all replicas' samples ([`crate::sync_batch_norm`]), so the
    /// replicas' averaged gradient equals one replica's on the whole batch. Updates the
    /// running statistics (identically on every replica).
    ///
    /// Errors: a failed SyncBatchNorm reduction (a failed peer; replicas that disagree on
    /// the network).
    pub fn train_pass(
        &mut self,
        theta: &[f32],
        x: &[f32],
        n: usize,
        grad: &mut [f32],
        replicas: &ReplicaContext<'_>,
    ) -> Result<Vec<f32>, NpeError> {
        if replicas.replicas() == 1 || !self.network.uses_batch_norm() {
            return Ok(self.pass_with_reducer(theta, x, n, grad, None));
        }
        with_stats_reducer(replicas, |reducer| {
            self.pass_with_reducer(theta, x, n, grad, Some(reducer))
        })
    }

    /// The training pass, its BatchNorm layers synchronized through `sync` when given:
    /// per-sample `log q` `[n]`, gradient of the mean NLL into `grad`.
    fn pass_with_reducer(
        &mut self,
        theta: &[f32],
        x: &[f32],
        n: usize,
        grad: &mut [f32],
        sync: Option<&StatsReducer>,
    ) -> Vec<f32> {
        let start = std::time::Instant::now();
        let layout = self.network.layout();
        let part = &self.partition;
        let (frozen, state) = self.fixed.split_at_mut(part.frozen_len());
        // With the training state on the device the trainable leaves are views of its
        // parameter buffer; otherwise, on a device each flat buffer crosses once and the
        // gradient comes back in one transfer; in host memory each parameter is its own slice.
        let p = if let Some(r) = &self.resident {
            let inner = r.params(layout, part, frozen, &self.device);
            let leaves = inner
                .tensors()
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    let t = burn::tensor::Tensor::<B, 1>::from_inner(t.clone());
                    if part.is_trainable(i) {
                        t.require_grad()
                    } else {
                        t
                    }
                })
                .collect();
            let p = Params::<B>::from_tensors(layout, leaves);
            if self.precision == Precision::Half {
                // Mixed precision: the float16 weights from one cast of the whole buffer.
                let halves = r.params_f16().into_iter();
                p.with_halves(
                    halves
                        .map(|h| h.map(burn::tensor::Tensor::from_inner))
                        .collect(),
                )
            } else {
                p
            }
        } else if B::HOST_MEMORY {
            Params::<B>::partitioned_leaves(layout, part, &self.params, frozen, &self.device)
        } else {
            Params::<B>::partitioned_leaves_packed(layout, part, &self.params, frozen, &self.device)
        }
        .with_precision(self.precision);
        let mut pass = Pass {
            params: &p,
            state,
            state_layout: self.network.state_layout(),
            training: true,
            sync,
        };
        let lp = self.network.log_prob(&mut pass, theta, x, n);
        // With loss scaling the gradient is that of the scaled loss (the engine unscales the
        // reduced gradient); the returned log-probabilities are unscaled. The GPU backends
        // start the backward pass from log q with its gradient scaled by -scale / N (the
        // loss's gradient, two launches); the CPU backends keep the composed loss.
        let mut grads = if B::LAYER_KERNELS {
            B::scale_gradient(lp.clone(), -(self.loss_scale as f64) / n as f64).backward()
        } else {
            let loss = lp.clone().mean().neg();
            let loss = if self.loss_scale == 1.0 {
                loss
            } else {
                loss.mul_scalar(self.loss_scale)
            };
            loss.backward()
        };
        // log q stays on the device until here: on a device it is read with the gradients,
        // in one transfer and one wait, after every kernel of the step is queued.
        let lp = lp.inner();
        let recorded = start.elapsed();
        let values = if let Some(r) = &mut self.resident {
            // Each gradient into its place on the device; only log q (and, with loss
            // scaling, the gradient's finiteness flag) comes back, in one transfer.
            let packed = p
                .tensors()
                .iter()
                .enumerate()
                .filter(|(i, _)| part.is_trainable(*i))
                .map(|(i, t)| (i, t.grad_remove(&mut grads)))
                .collect();
            r.add_gradients(packed);
            r.end_pass();
            if self.precision == Precision::Half {
                let mut read = read_together(vec![lp, r.non_finite_flag()]);
                let flag = read.pop().unwrap_or_default();
                r.set_finite(flag.first() == Some(&0.0));
                read.pop().unwrap_or_default()
            } else {
                to_vec(lp)
            }
        } else if B::HOST_MEMORY {
            p.write_partitioned_gradients(layout, part, &mut grads, grad);
            to_vec(lp)
        } else {
            p.read_partitioned_gradients_with(layout, part, &mut grads, grad, vec![lp])
                .pop()
                .unwrap_or_default()
        };
        self.last_step = StepTimes {
            recording: recorded,
            reading: start.elapsed() - recorded,
        };
        values
    }

    /// The host's time in the last training pass ([`NpeModel::train_pass`],
    /// [`NpeModel::nll_and_grad`], the engine's loss): recording it (building the graph,
    /// queuing every forward and backward kernel) and then reading its results back.
    pub fn last_step_times(&self) -> StepTimes {
        self.last_step
    }
}

/// The training state on the device (burn's GPU backends in float32; the CPU backends keep
/// the engine's host path): see [`crate::resident`].
impl<B: TrainBackend> DeviceState for NpeModel<B> {
    fn upload(&mut self, slots: &[Vec<f32>]) -> anyhow::Result<()> {
        self.resident = Some(Resident::new(
            self.network.layout(),
            &self.partition,
            &self.params,
            slots,
            &self.device,
        ));
        Ok(())
    }
    fn download(&mut self, slots: &mut [Vec<f32>]) -> anyhow::Result<()> {
        if let Some(r) = &self.resident {
            r.download(&mut self.params, slots);
        }
        Ok(())
    }
    fn release(&mut self) {
        self.resident = None;
    }
    fn read_gradient(&mut self, grad: &mut [f32]) -> anyhow::Result<()> {
        match &self.resident {
            Some(r) => r.read_gradient(grad),
            None => anyhow::bail!("the training state is not on the device"),
        }
        Ok(())
    }
    fn gradient_is_finite(&mut self) -> anyhow::Result<bool> {
        match &mut self.resident {
            Some(r) => Ok(r.gradient_is_finite()),
            None => anyhow::bail!("the training state is not on the device"),
        }
    }
    fn finish_update(
        &mut self,
        update: Option<&DeviceUpdate>,
        reduced: Option<&[f32]>,
    ) -> anyhow::Result<()> {
        match &mut self.resident {
            Some(r) => r.update(update, reduced),
            None => anyhow::bail!("the training state is not on the device"),
        }
        Ok(())
    }
}

impl<B: TrainBackend> Model for NpeModel<B> {
    /// On burn's GPU backends in float32 the parameters, gradient and optimizer slots stay
    /// on the device while the engine trains ([`crate::resident`]).
    fn device_state(&mut self) -> Option<&mut dyn DeviceState> {
        use crate::fused_ops::FusedOps;
        if !B::HOST_MEMORY && <B::InnerBackend as FusedOps>::device_optimizer() {
            Some(self)
        } else {
            None
        }
    }
    fn trainable(&self) -> &[f32] {
        &self.params
    }
    fn trainable_mut(&mut self) -> &mut [f32] {
        &mut self.params
    }
    fn frozen(&self) -> &[f32] {
        &self.fixed
    }
    fn frozen_mut(&mut self) -> &mut [f32] {
        &mut self.fixed
    }
    fn loss_names(&self) -> Vec<String> {
        vec!["nll".to_string()]
    }
    /// Applies the scale only in mixed precision ([`NpeModel::set_mixed_precision`]).
    fn set_loss_scale(&mut self, scale: f32) -> bool {
        if self.precision == Precision::Half {
            self.loss_scale = scale;
            true
        } else {
            false
        }
    }
    fn memory_estimate(&self, local_batch: usize) -> lockstep_core::memory::MemoryEstimate {
        NpeModel::memory_estimate(self, local_batch)
    }
    fn sample_separable(&self) -> bool {
        !self.network.uses_batch_norm()
    }
    /// BatchNorm runs as SyncBatchNorm under replicas ([`NpeModel::train_pass`]).
    fn synchronizes_batch_statistics(&self) -> bool {
        true
    }
    /// Writes `posterior.safetensors`: every parameter and running statistic under its
    /// PyTorch-style name and shape (e.g. `flow.steps.0.coupling.transform_net.final_layer.weight`
    /// `[out, in]`), with the network config, standardization, widths and the flow steps'
    /// permutations (`permutations`, a JSON list per step: step `i` maps `z` to
    /// `z[:, perm[i]]`) as JSON metadata, so the network is rebuilt from the file alone.
    fn export(&self, dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
        let path = dir.join(EXPORT_FILE);
        let mut named: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
        let params = self.parameters();
        for (layout, values) in [
            (self.network.layout(), &params[..]),
            (self.network.state_layout(), self.state()),
        ] {
            for (i, spec) in layout.specs().iter().enumerate() {
                let bytes = layout
                    .slice(values, i)
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect();
                named.push((spec.name.clone(), spec.shape.clone(), bytes));
            }
        }
        let views = named
            .iter()
            .map(|(name, shape, bytes)| {
                Ok((
                    name.clone(),
                    TensorView::new(Dtype::F32, shape.clone(), bytes)?,
                ))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let meta: HashMap<String, String> = [
            ("format", "lockstep-npe".to_string()),
            ("network", serde_json::to_string(&self.network.config)?),
            (
                "standardization",
                serde_json::to_string(&self.network.standardization)?,
            ),
            ("theta_dim", self.network.theta_dim.to_string()),
            ("structure_seed", self.network.structure_seed.to_string()),
            ("x_dim", self.network.x_dim.to_string()),
            (
                "permutations",
                serde_json::to_string(&self.network.permutations())?,
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let data = safetensors::serialize(views, Some(meta))?;
        checkpoint::write_atomic(&path, &data)?;
        Ok(vec![path])
    }

    fn loss_and_grad(&mut self, batch: &Batch, grad: &mut [f32]) -> anyhow::Result<Vec<f64>> {
        Ok(self.batch_loss(batch, grad, None)?)
    }

    /// `[mean -log q(θ | x)]` of `batch` in evaluation mode (running statistics).
    fn validation_loss(&mut self, batch: &Batch) -> anyhow::Result<Vec<f64>> {
        let n = batch.samples;
        let lp = self.log_prob(&batch.targets, &batch.inputs, n);
        Ok(vec![mean_nll(&lp)])
    }

    fn loss_and_grad_in(
        &mut self,
        batch: &Batch,
        grad: &mut [f32],
        replicas: &ReplicaContext<'_>,
    ) -> anyhow::Result<Vec<f64>> {
        Ok(self.batch_loss(batch, grad, Some(replicas))?)
    }
}

impl<B: TrainBackend> NpeModel<B> {
    /// The engine's loss: `[mean NLL]` of the local batch and its gradient, synchronized over
    /// `replicas` where BatchNorm needs it.
    ///
    /// Errors: a batch whose widths do not match the network; a failed reduction.
    fn batch_loss(
        &mut self,
        batch: &Batch,
        grad: &mut [f32],
        replicas: Option<&ReplicaContext<'_>>,
    ) -> Result<Vec<f64>, NpeError> {
        let (td, xd) = (self.network.theta_dim, self.network.x_dim);
        if batch.targets.len() != batch.samples * td || batch.inputs.len() != batch.samples * xd {
            return Err(NpeError::Invalid(format!("the batch has {} θ and {} x values for {} samples; the network expects θ of {td} and x of {xd} components",
                batch.targets.len(), batch.inputs.len(), batch.samples)));
        }
        let n = batch.samples;
        let lp = match replicas {
            Some(r) => self.train_pass(&batch.targets, &batch.inputs, n, grad, r)?,
            None => self.pass_with_reducer(&batch.targets, &batch.inputs, n, grad, None),
        };
        Ok(vec![mean_nll(&lp)])
    }
}
