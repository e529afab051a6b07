//! [`NpeModel`]: the network as the engine's [`Model`].
//!
//! The flat trainable buffer is the source of truth: every `loss_and_grad` turns it into one
//! gradient-tracking tensor per parameter (in the [`crate::params::Layout`] order), computes the
//! mean negative log-probability `-mean_i log q(θ_i | x_i)` of the local batch, and writes the
//! gradients back in the same order, so the engine packs them in one all-reduce. The BatchNorm
//! running statistics are the model's frozen buffer (broadcast and checkpointed by the engine);
//! with BatchNorm the loss is not sample-separable and the engine refuses replicas (SyncBatchNorm
//! comes with issue 17).

use crate::flow::NpeNetwork;
use crate::layers::Pass;
use crate::params::{to_vec, Params};
use burn::tensor::backend::AutodiffBackend;
use lockstep_train::{Batch, Model};

/// The NPE network with its parameters, on an autodiff backend `B`.
pub struct NpeModel<B: AutodiffBackend> {
    /// The network structure.
    pub network: NpeNetwork,
    params: Vec<f32>,
    state: Vec<f32>,
    device: B::Device,
}

impl<B: AutodiffBackend> NpeModel<B> {
    /// The network with parameters initialized from `seed` on `device`.
    pub fn new(network: NpeNetwork, seed: u64, device: B::Device) -> Self {
        let (params, state) = network.initial_values(seed);
        NpeModel {
            network,
            params,
            state,
            device,
        }
    }

    /// `log q(θ | x)` per sample in evaluation mode (no gradients; BatchNorm uses its running
    /// statistics). `theta: [n * theta_dim]`, `x: [n * x_dim]` row-major; returns `[n]`.
    pub fn log_prob(&self, theta: &[f32], x: &[f32], n: usize) -> Vec<f32> {
        let p =
            Params::<B::InnerBackend>::from_flat(self.network.layout(), &self.params, &self.device);
        let mut state = self.state.clone();
        let mut pass = Pass {
            params: &p,
            state: &mut state,
            state_layout: self.network.state_layout(),
            training: false,
        };
        to_vec(self.network.log_prob(&mut pass, theta, x, n))
    }

    /// `n` posterior samples `[n * theta_dim]` for the observation `x` (`[x_dim]`), base
    /// draws from SplitMix64(`seed`), evaluation mode.
    pub fn sample(&self, x: &[f32], n: usize, seed: u64) -> Vec<f32> {
        let p =
            Params::<B::InnerBackend>::from_flat(self.network.layout(), &self.params, &self.device);
        let mut state = self.state.clone();
        let mut pass = Pass {
            params: &p,
            state: &mut state,
            state_layout: self.network.state_layout(),
            training: false,
        };
        self.network.sample(&mut pass, x, n, seed)
    }

    /// The mean negative log-probability of a batch and its gradient (training mode, updates
    /// the BatchNorm running statistics). `grad` has the length of the trainable buffer.
    pub fn nll_and_grad(&mut self, theta: &[f32], x: &[f32], n: usize, grad: &mut [f32]) -> f64 {
        let layout = self.network.layout();
        let p = Params::<B>::leaves(layout, &self.params, &self.device);
        let mut pass = Pass {
            params: &p,
            state: &mut self.state,
            state_layout: self.network.state_layout(),
            training: true,
        };
        let lp = self.network.log_prob(&mut pass, theta, x, n);
        let loss = lp.mean().neg();
        let value = to_vec(loss.clone().detach())[0] as f64;
        let grads = loss.backward();
        p.write_gradients(layout, &grads, grad);
        value
    }
}

impl<B: AutodiffBackend> Model for NpeModel<B> {
    fn trainable(&self) -> &[f32] {
        &self.params
    }
    fn trainable_mut(&mut self) -> &mut [f32] {
        &mut self.params
    }
    fn frozen(&self) -> &[f32] {
        &self.state
    }
    fn frozen_mut(&mut self) -> &mut [f32] {
        &mut self.state
    }
    fn loss_names(&self) -> Vec<String> {
        vec!["nll".to_string()]
    }
    fn sample_separable(&self) -> bool {
        !self.network.uses_batch_norm()
    }
    fn loss_and_grad(&mut self, batch: &Batch, grad: &mut [f32]) -> anyhow::Result<Vec<f64>> {
        let (td, xd) = (self.network.theta_dim, self.network.x_dim);
        if batch.targets.len() != batch.samples * td || batch.inputs.len() != batch.samples * xd {
            anyhow::bail!(
                "the batch has {} θ and {} x values for {} samples; the network expects θ of {td} and x of {xd} components",
                batch.targets.len(), batch.inputs.len(), batch.samples
            );
        }
        Ok(vec![self.nll_and_grad(
            &batch.targets,
            &batch.inputs,
            batch.samples,
            grad,
        )])
    }
}
