//! The GLIF network as a replica of the sample-parallel trainer: [`SnnReplica`] implements
//! `lockstep_train::Model` and [`PoissonTrials`] its `BatchSource`.
//!
//! A sample is one trial: the network starts at rest and is driven for `run.seq_len` steps by
//! its inputs, whose Poisson draws are keyed by `(run.seed, global sample index, node, step)`.
//! A batch therefore carries no data, only the global index of its first sample: replicas
//! draw exactly the inputs that one replica with the whole global batch would draw.

use crate::bptt::SnnModel;
use crate::config::{loss_names, model_from_config};
use crate::sonata::export_trained_weights;
use crate::trained_simulation::write_trained_simulation_config;
use lockstep_core::memory::MemoryEstimate;
use lockstep_sonata::Circuit;
use lockstep_train::{Batch, BatchSource, Model};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// One replica: the compiled network, its trainable weights (flat f32, pA) and the circuit
/// they are exported to.
#[derive(Debug, Clone)]
pub struct SnnReplica {
    model: SnnModel,
    params: Vec<f32>,
    names: Vec<String>,
    circuit: Arc<Circuit>,
}

impl SnnReplica {
    /// Builds the replica of a training config (see [`model_from_config`]). `parallel`: run
    /// the trials of a local batch on rayon (serial runs); replicas that share the machine's
    /// cores use `false` so each computes on one core.
    ///
    /// Errors: every configuration, network and input error of [`model_from_config`].
    pub fn from_config(config: &Path, parallel: bool) -> crate::Result<SnnReplica> {
        let (circuit, mut model) = model_from_config(config)?;
        model.opts.parallel = parallel;
        let params = model.initial_params();
        Ok(SnnReplica {
            names: loss_names(&model),
            model,
            params,
            circuit: Arc::new(circuit),
        })
    }

    /// The underlying model.
    pub fn model(&self) -> &SnnModel {
        &self.model
    }

    /// The current trainable weights (pA), recurrent then input (if trained), CSR order.
    pub fn params(&self) -> &[f32] {
        &self.params
    }
}

impl Model for SnnReplica {
    fn trainable(&self) -> &[f32] {
        &self.params
    }

    fn trainable_mut(&mut self) -> &mut [f32] {
        &mut self.params
    }

    fn loss_names(&self) -> Vec<String> {
        self.names.clone()
    }

    fn sample_separable(&self) -> bool {
        self.model.losses_sample_separable()
    }

    fn loss_and_grad(&mut self, batch: &Batch, grad: &mut [f32]) -> anyhow::Result<Vec<f64>> {
        let r = self
            .model
            .loss_and_grad(&self.params, batch.first_sample, batch.samples)?;
        for (g, d) in grad.iter_mut().zip(&r.grad) {
            *g += *d;
        }
        Ok(r.terms.iter().map(|(_, v)| *v).collect())
    }

    /// [`SnnModel::memory_estimate`] of the local batch.
    fn memory_estimate(&self, local_batch: usize) -> MemoryEstimate {
        self.model.memory_estimate(local_batch)
    }

    fn after_update(&mut self) {
        self.model.constrain(&mut self.params);
    }

    /// Writes the trained weights as SONATA edges files (`syn_weight = w / nsyns`, all else
    /// unchanged) into `dir/network/`, and `dir/config.simulate.json` that simulates them
    /// (see [`write_trained_simulation_config`]).
    fn export(&self, dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
        let (rec, input) = self.model.weights_in_spec_order(&self.params)?;
        let out = dir.join("network");
        std::fs::create_dir_all(&out)?;
        let mut files = export_trained_weights(&self.circuit, &rec, &input, &out)?;
        files.push(write_trained_simulation_config(&self.circuit, dir)?);
        Ok(files)
    }
}

/// The batch source of Poisson trials: a batch is the global indices of its samples.
#[derive(Debug, Clone, Copy, Default)]
pub struct PoissonTrials;

impl BatchSource for PoissonTrials {
    fn input_width(&self) -> usize {
        0
    }

    fn target_width(&self) -> usize {
        0
    }

    fn global_batch(&mut self, first_sample: u64, count: usize) -> anyhow::Result<Batch> {
        Ok(Batch {
            first_sample,
            samples: count,
            inputs: Vec::new(),
            targets: Vec::new(),
        })
    }
}
