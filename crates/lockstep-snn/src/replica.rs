//! The GLIF network as a replica of the sample-parallel trainer: [`SnnReplica`] implements
//! `lockstep_train::Model` and [`PoissonTrials`] its `BatchSource`.
//!
//! A sample is one trial: the network starts at rest and is driven for `run.seq_len` steps by
//! its inputs, whose Poisson draws are keyed by `(run.seed, global sample index, node, step)`.
//! A batch therefore carries no data, only the global index of its first sample: replicas
//! draw exactly the inputs that one replica with the whole global batch would draw.

use crate::config::{loss_names, model_from_config_on_device, SnnTrainConfig, TrainingSpikes};
use crate::simulation::config::to_spike_trains;
use crate::sonata::export_trained_weights;
use crate::trained_simulation::write_trained_simulation_config;
use crate::training::SnnModel;
use anyhow::Context;
use lockstep_core::memory::MemoryEstimate;
use lockstep_sonata::Circuit;
use lockstep_train::{Batch, BatchSource, DeviceState, DeviceUpdate, Model};
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
    /// `output.training_spikes`.
    training_spikes: Option<TrainingSpikes>,
    /// The spikes of the first sample kept for [`Model::write_sample_record`]: (global
    /// sample index, `(step, neuron)` pairs).
    kept: Option<(u64, Vec<(u32, u32)>)>,
    /// Whether this process has written a training trial's spikes yet.
    wrote_spikes: bool,
    /// Whether the training state is on the GPU ([`DeviceState::upload`] until
    /// [`DeviceState::release`]): `params` is then stale between read-backs.
    on_device: bool,
}

impl SnnReplica {
    /// Builds the replica of a training config (see [`model_from_config`](crate::model_from_config)). `parallel`: run
    /// the trials of a local batch on rayon (serial runs); replicas that share the machine's
    /// cores use `false` so each computes on one core.
    ///
    /// Errors: every configuration, network and input error of [`model_from_config`](crate::model_from_config).
    pub fn from_config(config: &Path, parallel: bool) -> crate::Result<SnnReplica> {
        Self::from_config_on(config, parallel, 0)
    }

    /// [`SnnReplica::from_config`] for the replica in GPU slot `gpu_slot` (its node-local
    /// rank under MPI, its index among thread replicas). On a GPU (`run.device`) the device
    /// is prepared for `run.batch_size` samples here, before any output: every buffer is
    /// checked against the adapter's limits and allocated, the kernels compiled.
    ///
    /// Errors: those of [`SnnReplica::from_config`]; no adapter, or a GPU buffer over the
    /// adapter's limits (named, with its size and the keys that shrink it).
    pub fn from_config_on(
        config: &Path,
        parallel: bool,
        gpu_slot: usize,
    ) -> crate::Result<SnnReplica> {
        Self::from_config_on_device(config, parallel, gpu_slot, None)
    }

    /// [`SnnReplica::from_config_on`] with `device` in place of the config's `run.device`
    /// when given (`lockstep bench bptt --device`).
    ///
    /// Errors: those of [`SnnReplica::from_config_on`].
    pub fn from_config_on_device(
        config: &Path,
        parallel: bool,
        gpu_slot: usize,
        device: Option<crate::DeviceRequest>,
    ) -> crate::Result<SnnReplica> {
        let (mut circuit, mut model) = model_from_config_on_device(config, gpu_slot, device)?;
        // The circuit stays for exporting trained weights, which needs only each edge
        // population's identity, edge count and nsyns: the compiled network holds the rest.
        for ep in &mut circuit.edges {
            ep.release_build_columns();
        }
        model.opts.parallel = parallel;
        let params = model.initial_params();
        let sections = SnnTrainConfig::from_config(&circuit.config)?;
        if model.opts.device != crate::DeviceRequest::Cpu {
            let batch = circuit.config.json["run"]["batch_size"]
                .as_u64()
                .unwrap_or(1);
            // The device's refusals (a buffer over the adapter's limits, a tape step over a
            // binding, an array beyond 32-bit indices) name the config and its run.device.
            let on_device = |message: String| {
                crate::SnnError::Config(
                    lockstep_core::config::ConfigError::new("run.device", message).in_file(config),
                )
            };
            model.prepare_device(batch as usize).map_err(|e| match e {
                crate::SnnError::Gpu(g) => on_device(g.to_string()),
                crate::SnnError::Shape(s) => on_device(s),
                e => e,
            })?;
        }
        Ok(SnnReplica {
            names: loss_names(&model),
            model,
            params,
            circuit: Arc::new(circuit),
            training_spikes: sections.output.training_spikes,
            kept: None,
            wrote_spikes: false,
            on_device: false,
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

    /// The local batch's loss terms; its mean gradient is added into `grad`, or, with the
    /// training state on the GPU, into the device's gradient (`grad` left alone).
    fn loss_and_grad(&mut self, batch: &Batch, grad: &mut [f32]) -> anyhow::Result<Vec<f64>> {
        let mut r = if self.on_device {
            self.model
                .loss_and_grad_on_device_timed(batch.first_sample, batch.samples)?
                .0
        } else {
            self.model
                .loss_and_grad(&self.params, batch.first_sample, batch.samples)?
        };
        if self.model.opts.record_first_sample {
            // Kept for this one call: the first sample of the update's first micro-batch.
            self.model.opts.record_first_sample = false;
            let spikes = r.first_spikes.take().unwrap_or_default();
            self.kept = Some((batch.first_sample, spikes));
        }
        for (g, d) in grad.iter_mut().zip(&r.grad) {
            *g += *d;
        }
        Ok(r.terms.iter().map(|(_, v)| *v).collect())
    }

    /// [`SnnModel::memory_estimate`] of the local batch, with this replica's trainable
    /// weights (f32) and what it keeps of the circuit for export (per edge: the source node
    /// id and `nsyns`).
    fn memory_estimate(&self, local_batch: usize) -> MemoryEstimate {
        let mut e = self.model.memory_estimate(local_batch);
        let edges: u64 = self.circuit.edges.iter().map(|ep| ep.len() as u64).sum();
        e.add(
            "trainable weights (f32) and the circuit kept for export",
            4 * self.params.len() as u64 + 12 * edges,
        );
        e
    }

    /// The sign constraint ([`SnnModel::constrain`]); on the GPU the update's kernel applied
    /// it already.
    fn after_update(&mut self) {
        if !self.on_device {
            self.model.constrain(&mut self.params);
        }
    }

    /// On a GPU (`run.device`), the replica keeps its weights, gradient and optimizer slots
    /// there: one read-back per update (the loss sums) with one replica, and the packed
    /// float32 gradient read back and uploaded once with several.
    fn device_state(&mut self) -> Option<&mut dyn DeviceState> {
        if self.model.keeps_training_state_on_device() {
            Some(self)
        } else {
            None
        }
    }

    /// Writes the trained weights as SONATA edges files (`syn_weight = w / nsyns`, all else
    /// unchanged) into `dir/network/`, and `dir/config.simulate.json` that simulates them
    /// (see [`write_trained_simulation_config`]).
    fn export(&self, dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
        // Training is over: the kernels' tape would only add to the peak of the export.
        self.model.release_workspace();
        let (rec, input) = self.model.weights_in_spec_order(&self.params)?;
        let out = dir.join("network");
        std::fs::create_dir_all(&out)?;
        let mut files = export_trained_weights(&self.circuit, &rec, &input, &out)?;
        files.push(write_trained_simulation_config(
            &self.circuit,
            &self.model.net,
            &self.model.inputs,
            dir,
        )?);
        Ok(files)
    }

    /// True at the updates `output.training_spikes` names; the next batch's first sample's
    /// spikes are then kept from its forward pass.
    fn record_first_sample(&mut self, update: u64) -> bool {
        let on = self
            .training_spikes
            .as_ref()
            .is_some_and(|t| t.records(update));
        self.model.opts.record_first_sample = on;
        on
    }

    /// Writes the kept spikes as `dir/spikes/update_NNNNNN.h5` (SONATA, as `lockstep
    /// simulate` writes them; through a temporary file renamed into place). The first write
    /// of a process first removes the files of this and later updates that an earlier run in
    /// the same folder left (a run resumed in place repeats those updates).
    fn write_sample_record(&mut self, dir: &Path, update: u64) -> anyhow::Result<Vec<PathBuf>> {
        let (sample, spikes) = self
            .kept
            .take()
            .ok_or_else(|| anyhow::anyhow!("no training trial was recorded for update {update}"))?;
        let folder = dir.join(crate::config::TRAINING_SPIKES_DIR);
        std::fs::create_dir_all(&folder)
            .with_context(|| format!("cannot create {}", folder.display()))?;
        if !self.wrote_spikes {
            remove_records_from(&folder, update)?;
            self.wrote_spikes = true;
        }
        let path = dir.join(TrainingSpikes::file_of(update));
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        let tmp = folder.join(format!(".{name}.tmp"));
        let trains = to_spike_trains(&self.model.net, &spikes);
        lockstep_sonata::write_spikes(&tmp, &trains).with_context(|| {
            format!("cannot write the spikes of training sample {sample} (update {update})")
        })?;
        std::fs::rename(&tmp, &path)
            .with_context(|| format!("cannot move {} to {}", tmp.display(), path.display()))?;
        Ok(vec![path])
    }
}

/// The training state on the GPU ([`SnnModel::upload_training_state`] and the methods after
/// it).
impl DeviceState for SnnReplica {
    fn upload(&mut self, slots: &[Vec<f32>]) -> anyhow::Result<()> {
        self.model.upload_training_state(&self.params, slots)?;
        self.on_device = true;
        Ok(())
    }

    fn download(&mut self, slots: &mut [Vec<f32>]) -> anyhow::Result<()> {
        Ok(self
            .model
            .download_training_state(&mut self.params, slots)?)
    }

    fn release(&mut self) {
        if self.on_device {
            self.model.release_training_state();
            self.on_device = false;
        }
    }

    fn read_gradient(&mut self, grad: &mut [f32]) -> anyhow::Result<()> {
        Ok(self.model.read_device_gradient(grad)?)
    }

    /// One read-back of the gradient (the spiking network computes in float32 and takes no
    /// loss scaling, so the engine does not ask).
    fn gradient_is_finite(&mut self) -> anyhow::Result<bool> {
        let mut g = vec![0.0f32; self.params.len()];
        self.model.read_device_gradient(&mut g)?;
        Ok(g.iter().all(|x| x.is_finite()))
    }

    fn finish_update(
        &mut self,
        update: Option<&DeviceUpdate>,
        reduced: Option<&[f32]>,
    ) -> anyhow::Result<()> {
        self.model.finish_device_update(update, reduced)?;
        Ok(())
    }
}

/// Removes `update_NNNNNN.h5` files of updates `>= first` from the training spikes folder.
fn remove_records_from(folder: &Path, first: u64) -> anyhow::Result<()> {
    let entries =
        std::fs::read_dir(folder).with_context(|| format!("cannot read {}", folder.display()))?;
    for e in entries {
        let path = e?.path();
        let update = TrainingSpikes::update_of(&path);
        if update.is_some_and(|u| u >= first) {
            std::fs::remove_file(&path)
                .with_context(|| format!("cannot remove {}", path.display()))?;
        }
    }
    Ok(())
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

    /// A batch is only its sample indices (the model keys its Poisson draws by them).
    fn keyed_by_sample(&self) -> bool {
        true
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
