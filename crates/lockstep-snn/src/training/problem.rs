//! What every training engine reads of a model: the compiled network, its inputs, the options
//! and the loss constants derived from them ([`Problem`], a borrowed view), and the
//! engine-independent parts of a result (loss terms, [`LossAndGrad`]).
//!
//! The engines (`reference`, `cpu_f32`, `gpu`) take a [`Problem`] rather than the model
//! itself, so that the model (`model.rs`) may own its engine without the two files importing
//! each other.

use crate::error::{Result, SnnError};
use crate::input::Inputs;
use crate::loss::{Loss, RateUnits};
use crate::network::Network;
use crate::training::options::{BpttOptions, LossAndGrad};

/// The loss constants of a model, derived once from its options and network.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LossConsts {
    /// `[neuron]` `V_th - E_L` (mV), internal order.
    pub th: Vec<f64>,
    /// Per rate loss: `[neuron]` target (internal order) and the count -> rate factor.
    pub rate_losses: Vec<(Vec<f64>, f64)>,
    /// Sum of voltage-regularization costs.
    pub vreg_cost: f64,
}

impl LossConsts {
    /// The constants of `opts.losses` on `net`.
    ///
    /// Errors: a `TargetFiringRate` whose target count is not the neuron count.
    pub fn new(net: &Network, opts: &BpttOptions) -> Result<Self> {
        let n = net.n_neurons();
        let mut th = vec![0.0; n];
        for g in &net.groups {
            th[g.start..g.end].fill(g.consts.th);
        }
        let mut rate_losses = Vec::new();
        let mut vreg_cost = 0.0;
        for l in &opts.losses {
            match l {
                Loss::TargetFiringRate { target, units } => {
                    if target.len() != n {
                        return Err(SnnError::Shape(format!(
                            "TargetFiringRate has {} targets for {n} neurons",
                            target.len()
                        )));
                    }
                    let internal: Vec<f64> =
                        (0..n).map(|i| target[net.order[i] as usize]).collect();
                    let scale = match units {
                        RateUnits::Hz => 1000.0 / (opts.seq_len as f64 * net.grid.dt),
                        RateUnits::SpikesPerStep => 1.0 / opts.seq_len as f64,
                    };
                    rate_losses.push((internal, scale));
                }
                Loss::VoltageRegularization { cost } => vreg_cost += cost,
            }
        }
        Ok(LossConsts {
            th,
            rate_losses,
            vreg_cost,
        })
    }
}

/// A model as the engines see it: everything but the engine itself (borrowed).
#[derive(Clone, Copy)]
pub(crate) struct Problem<'a> {
    /// The compiled network (its weight buffers are the initial values).
    pub net: &'a Network,
    /// Inputs compiled for `seq_len` steps.
    pub inputs: &'a Inputs,
    /// The model's options (read at every call: some may change between calls).
    pub opts: &'a BpttOptions,
    /// `[neuron]` `V_th - E_L` (mV), internal order.
    pub th: &'a [f64],
    /// Per rate loss: `[neuron]` target (internal order) and the count -> rate factor.
    pub rate_losses: &'a [(Vec<f64>, f64)],
    /// Sum of voltage-regularization costs.
    pub vreg_cost: f64,
    /// `[group][live port]` the receptor ports some edge reaches per group
    /// ([`Network::live_ports`]); the float32 engines update and differentiate those alone.
    pub live_ports: &'a [Vec<usize>],
}

impl Problem<'_> {
    /// Number of trainable parameters: the recurrent weights, and the input weights when
    /// `train_input_weights`.
    pub fn n_params(&self) -> usize {
        self.net.weights_rec.len()
            + if self.opts.train_input_weights {
                self.net.weights_in.len()
            } else {
                0
            }
    }

    /// Checks the length of `params`.
    ///
    /// Errors: [`SnnError::Shape`] when it is not [`Problem::n_params`].
    pub fn check_params(&self, params: &[f32]) -> Result<()> {
        if params.len() != self.n_params() {
            return Err(SnnError::Shape(format!(
                "{} parameters given, the model has {}",
                params.len(),
                self.n_params()
            )));
        }
        Ok(())
    }

    /// The recurrent and input weights (pA, CSR order) in `f64`: from `params`, and the input
    /// weights from the network when they are not trained.
    ///
    /// Errors: those of [`Problem::check_params`].
    pub fn weights_f64(&self, params: &[f32]) -> Result<(Vec<f64>, Vec<f64>)> {
        self.check_params(params)?;
        let nr = self.net.weights_rec.len();
        let w_rec: Vec<f64> = params[..nr].iter().map(|&w| w as f64).collect();
        let w_in: Vec<f64> = if self.opts.train_input_weights {
            params[nr..].iter().map(|&w| w as f64).collect()
        } else {
            self.net.weights_in.clone()
        };
        Ok((w_rec, w_in))
    }

    /// Bytes of the compiled network's per-edge index arrays (CSR target offset and edge id,
    /// 4 bytes each) and per-parameter sign constraints (1 byte), segments included.
    pub fn network_bytes(&self) -> u64 {
        let edges = (self.net.recurrent.len() + self.net.input.len()) as u64;
        let segments = (self.net.recurrent.segments.len() + self.net.input.segments.len()) as u64;
        8 * edges + 16 * segments + self.n_params() as u64
    }

    /// The batch's result from its loss terms (means over the batch), gradient and spikes.
    pub fn finish(
        &self,
        terms: Vec<f64>,
        grad: Vec<f32>,
        n_spikes: f64,
        batch: usize,
    ) -> LossAndGrad {
        let loss = terms.iter().sum();
        let duration_s = self.opts.seq_len as f64 * self.net.grid.dt / 1000.0;
        LossAndGrad {
            loss,
            terms: self.opts.losses.iter().map(Loss::name).zip(terms).collect(),
            grad,
            n_spikes: n_spikes as u64,
            mean_rate_hz: n_spikes / (batch as f64 * self.net.n_neurons() as f64 * duration_s),
            first_spikes: None,
        }
    }

    /// Per-trial loss terms from the forward summary: `counts` (`[neuron]` spikes, internal
    /// order) and the voltage-regularization sum over steps and neurons.
    pub fn trial_terms(&self, counts: &[f64], vreg_sum: f64) -> Vec<f64> {
        let rate_sums: Vec<f64> = self
            .rate_losses
            .iter()
            .map(|(target, scale)| {
                counts
                    .iter()
                    .zip(target)
                    .map(|(c, t)| (c * scale - t).powi(2))
                    .sum::<f64>()
            })
            .collect();
        self.trial_terms_from_sums(&rate_sums, vreg_sum)
    }

    /// Per-trial loss terms from the sums a device reduced: per rate loss `Σ_i (c_i scale -
    /// target_i)²` over the neurons in order (`rate_sums`, in the order of the rate losses)
    /// and the voltage-regularization sum (as [`Problem::trial_terms`], which computes the
    /// rate sums from the counts).
    pub fn trial_terms_from_sums(&self, rate_sums: &[f64], vreg_sum: f64) -> Vec<f64> {
        let n = self.net.n_neurons() as f64;
        let mut ri = 0;
        self.opts
            .losses
            .iter()
            .map(|l| match l {
                Loss::TargetFiringRate { .. } => {
                    let sum = rate_sums[ri];
                    ri += 1;
                    sum / n
                }
                Loss::VoltageRegularization { cost } => {
                    cost * vreg_sum / (self.opts.seq_len as f64 * n)
                }
            })
            .collect()
    }

    /// The loss terms of a batch of `batch` samples and its spike count from the sums a
    /// device reduced per sample (`sums`: `[rate losses + 2, batch]`: per sample each rate
    /// loss's `Σ_i (c_i scale - target_i)²`, then its voltage-regularization sum, then its
    /// spike count; each a sum over the neurons in order), as [`Problem::batch_loss_terms`]
    /// computes them from the counts (means over the samples, in sample order).
    pub fn batch_terms_from_sums(&self, sums: &[f64], batch: usize) -> (Vec<f64>, f64) {
        let r = self.rate_losses.len();
        let mut terms = vec![0.0f64; self.opts.losses.len()];
        let mut n_spikes = 0.0;
        for b in 0..batch {
            let rate: Vec<f64> = (0..r).map(|k| sums[k * batch + b]).collect();
            let trial = self.trial_terms_from_sums(&rate, sums[r * batch + b]);
            for (a, t) in terms.iter_mut().zip(trial) {
                *a += t / batch as f64;
            }
            n_spikes += sums[(r + 1) * batch + b];
        }
        (terms, n_spikes)
    }

    /// The loss terms of a batch of `batch` samples (means over the samples, in sample
    /// order), its spike count, and the direct derivatives of the rate losses with respect
    /// to each spike, `[neuron, B]`, from the spike counts `counts` (`[neuron, B]`) and the
    /// voltage-regularization sum of each sample `vreg` (`[B]`).
    pub fn batch_loss_terms(
        &self,
        counts: &[u32],
        vreg: &[f64],
        batch: usize,
    ) -> (Vec<f64>, f64, Vec<f32>) {
        let n = self.net.n_neurons();
        let nb = batch;
        let bn = batch as f64 * n as f64;
        let mut terms = vec![0.0f64; self.opts.losses.len()];
        let mut n_spikes = 0.0;
        let mut gz_rate = vec![0.0f32; n * nb];
        let mut c = vec![0.0f64; n];
        for b in 0..nb {
            for (i, ci) in c.iter_mut().enumerate() {
                *ci = counts[i * nb + b] as f64;
            }
            for (a, t) in terms.iter_mut().zip(self.trial_terms(&c, vreg[b])) {
                *a += t / batch as f64;
            }
            n_spikes += c.iter().sum::<f64>();
            for (i, ci) in c.iter().enumerate() {
                let mut g = 0.0;
                for (target, scale) in self.rate_losses {
                    g += 2.0 * (ci * scale - target[i]) * scale / bn;
                }
                gz_rate[i * nb + b] = g as f32;
            }
        }
        (terms, n_spikes, gz_rate)
    }
}
