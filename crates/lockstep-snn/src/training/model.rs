//! The trainable model ([`SnnModel`]) and the one place where its engine is chosen.
//!
//! [`SnnModel::new`] compiles the network and picks the engine from the options once
//! (`Engine`): the per-sample float64 reference (`run.dtype: float64`), the batch-innermost
//! float32 CPU kernels (`float32`, the default), or the float32 GPU kernels (`run.device:
//! "gpu"`). Every later call goes to that engine; no other code branches on the precision
//! or the device.

use lockstep_core::memory::MemoryEstimate;

use crate::error::{Result, SnnError};
use crate::input::{InputSpec, Inputs};
use crate::loss::Loss;
use crate::network::{Network, NetworkSpec};
use crate::simulation::model::ModelKind;
use crate::training::cpu_f32::CpuF32Engine;
use crate::training::gpu::GpuEngine;
use crate::training::options::{BpttOptions, DeviceRequest, Dtype, LossAndGrad, StepTiming};
use crate::training::problem::{LossConsts, Problem};
use crate::training::reference;

/// The engine a model computes its loss and gradient with, chosen once by [`SnnModel::new`].
#[derive(Debug, Clone)]
enum Engine {
    /// The per-sample BPTT in double precision (`run.dtype: float64`), NEST-exact forward.
    Reference,
    /// The batch-innermost float32 kernels on CPU cores (`run.dtype: float32`).
    CpuF32(Box<CpuF32Engine>),
    /// The float32 kernels on a GPU (`run.device: "gpu"`).
    Gpu(Box<GpuEngine>),
}

impl Engine {
    /// The engine for `opts`: the GPU's adapter is selected and opened here.
    ///
    /// Errors: float64 on a GPU, no adapter or one that cannot be opened (an adapter
    /// without 64-bit shader types runs the 32-bit kernels).
    fn choose(opts: &BpttOptions) -> Result<Engine> {
        match (opts.dtype, opts.device) {
            (Dtype::Float64, DeviceRequest::Cpu) => Ok(Engine::Reference),
            (Dtype::Float32, DeviceRequest::Cpu) => Ok(Engine::CpuF32(Box::default())),
            (Dtype::Float64, DeviceRequest::Gpu(_)) => {
                Err(SnnError::Config(lockstep_core::config::ConfigError::new(
                    "run.device",
                    "the GPU engine computes in float32; set run.dtype to \"float32\" (or run.device to \"cpu\" for the float64 reference)",
                )))
            }
            (Dtype::Float32, DeviceRequest::Gpu(index)) => {
                let all = lockstep_gpu::process_adapters();
                let cuda = std::env::var("CUDA_VISIBLE_DEVICES").ok();
                let selected =
                    lockstep_gpu::select_adapter(&all, index, opts.device_slot, cuda.as_deref())?;
                Ok(Engine::Gpu(Box::new(GpuEngine::new(selected)?)))
            }
        }
    }
}

/// A point-neuron network with trainable weights as a flat `f32` buffer:
/// `[recurrent weights (CSR order)] ++ [input weights (CSR order), if trained]`, in pA.
#[derive(Debug, Clone)]
pub struct SnnModel {
    /// The compiled network (its weight buffers are the initial values).
    pub net: Network,
    /// Inputs compiled for `seq_len` steps.
    pub inputs: Inputs,
    /// Options. Only `parallel`, `surrogate`, `record_first_sample`, `spmv_pass_targets` and
    /// `adjoint_spmv` may be changed after construction; the others shaped the model
    /// (engine, parameter layout, tapes, loss coefficients).
    pub opts: BpttOptions,
    /// Loss constants derived from the options.
    consts: LossConsts,
    /// `[n_params]` sign constraint: +1, -1, or 0 (free).
    sign: Vec<i8>,
    /// `[group][live port]` the receptor ports some edge reaches per group
    /// ([`Network::live_ports`]).
    live_ports: Vec<Vec<usize>>,
    /// The engine chosen at construction.
    engine: Engine,
}

impl SnnModel {
    /// Builds a trainable model from a network description, a time step (ms) and inputs, and
    /// chooses its engine from `opts.dtype`.
    ///
    /// Errors: `seq_len` 0, a `gradient_checkpointing` chunk of 0 steps, a network without
    /// neurons, and those of compiling the network, the inputs and the losses.
    pub fn new(spec: &NetworkSpec, dt: f64, input: &InputSpec, opts: BpttOptions) -> Result<Self> {
        if opts.seq_len == 0 {
            return Err(SnnError::Shape("seq_len must be at least 1".into()));
        }
        if opts.gradient_checkpointing == Some(0) {
            return Err(SnnError::Shape(
                "gradient_checkpointing chunk size must be at least 1 step".into(),
            ));
        }
        if spec.neurons.is_empty() {
            return Err(SnnError::InvalidNetwork(
                "the network has no (non-virtual) neurons to train".into(),
            ));
        }
        let net = spec.compile(dt)?;
        let inputs = input.compile("training inputs", net.n_virtual(), &net.grid, opts.seq_len)?;
        let consts = LossConsts::new(&net, &opts)?;
        let mut sign: Vec<i8> = net.weights_rec.iter().map(|&w| sign_of(w)).collect();
        if opts.train_input_weights {
            sign.extend(net.weights_in.iter().map(|&w| sign_of(w)));
        }
        // iaf_psc_alpha chose the port by sign: a zero weight sits on the inhibitory port.
        // The input block is constrained only when trained (with no recurrent edges it
        // starts at offset 0 too, so the block, not its offset, decides).
        for (csr, off, trained) in [
            (&net.recurrent, 0usize, true),
            (&net.input, net.weights_rec.len(), opts.train_input_weights),
        ] {
            if !trained {
                continue;
            }
            for seg in &csr.segments {
                for e in seg.start as usize..seg.end as usize {
                    let tgt = csr.target_off[e] as usize / net.n_ports.max(1);
                    if net.consts_of(tgt).kind == ModelKind::Iaf && sign[off + e] == 0 {
                        sign[off + e] = if seg.port == 0 { 1 } else { -1 };
                    }
                }
            }
        }
        let live_ports = net.live_ports();
        let engine = Engine::choose(&opts)?;
        Ok(SnnModel {
            net,
            inputs,
            opts,
            consts,
            sign,
            live_ports,
            engine,
        })
    }

    /// The engines' view of this model.
    fn problem(&self) -> Problem<'_> {
        Problem {
            net: &self.net,
            inputs: &self.inputs,
            opts: &self.opts,
            th: &self.consts.th,
            rate_losses: &self.consts.rate_losses,
            vreg_cost: self.consts.vreg_cost,
            live_ports: &self.live_ports,
        }
    }

    /// Frees the buffers the engine keeps from one call to the next (the float32 kernels'
    /// tape and chunk boundaries: full V1 unsegmented, about 3 GB). Call it when the model
    /// will not compute gradients for a while, e.g. before exporting the trained weights; the
    /// next call allocates them again.
    pub fn release_workspace(&self) {
        match &self.engine {
            Engine::Reference => {}
            Engine::CpuF32(e) => e.release_workspace(),
            Engine::Gpu(e) => e.release(),
        }
    }

    /// The options the model was built with.
    pub fn options(&self) -> &BpttOptions {
        &self.opts
    }

    /// Run the samples of a batch on rayon (`true`) or one after another. Results are
    /// bitwise the same either way.
    pub fn set_parallel(&mut self, parallel: bool) {
        self.opts.parallel = parallel;
    }

    /// Number of trainable parameters.
    pub fn n_params(&self) -> usize {
        self.problem().n_params()
    }

    /// Number of recurrent weights (the first block of the parameter buffer).
    pub fn n_recurrent_params(&self) -> usize {
        self.net.weights_rec.len()
    }

    /// The initial parameters (pA) as `f32`.
    pub fn initial_params(&self) -> Vec<f32> {
        let mut p: Vec<f32> = self.net.weights_rec.iter().map(|&w| w as f32).collect();
        if self.opts.train_input_weights {
            p.extend(self.net.weights_in.iter().map(|&w| w as f32));
        }
        p
    }

    /// `[n_params]` sign of each parameter (+1, -1, 0 = unconstrained).
    pub fn param_signs(&self) -> &[i8] {
        &self.sign
    }

    /// Sign constraint, applied after every optimizer update: a weight whose update would
    /// cross zero is clipped to zero.
    pub fn constrain(&self, params: &mut [f32]) {
        for (p, &s) in params.iter_mut().zip(&self.sign) {
            if (s > 0 && *p < 0.0) || (s < 0 && *p > 0.0) {
                *p = 0.0;
            }
        }
    }

    /// All losses are sample-separable (means over samples).
    pub fn losses_sample_separable(&self) -> bool {
        self.opts.losses.iter().all(Loss::sample_separable)
    }

    /// Weights per edge of the spec (spec order), for export: `(recurrent, input)` in pA.
    ///
    /// Errors: `params.len() != n_params()`.
    pub fn weights_in_spec_order(&self, params: &[f32]) -> Result<(Vec<f64>, Vec<f64>)> {
        let (w_rec, w_in) = self.problem().weights_f64(params)?;
        let mut rec = vec![0.0; w_rec.len()];
        for (slot, &id) in self.net.recurrent.edge_id.iter().enumerate() {
            rec[id as usize] = w_rec[slot];
        }
        let mut inp = vec![0.0; w_in.len()];
        for (slot, &id) in self.net.input.edge_id.iter().enumerate() {
            inp[id as usize] = w_in[slot];
        }
        Ok((rec, inp))
    }

    /// Bytes of stored forward state per sample: `(unsegmented, segmented)`, in the layout
    /// of the model's engine (float64: the full per-sample state of every step; float32:
    /// the batched kernels' compact tape).
    pub fn tape_bytes_per_sample(&self) -> (usize, usize) {
        let p = self.problem();
        match &self.engine {
            Engine::Reference => reference::tape_bytes_per_sample(&p),
            Engine::CpuF32(_) => CpuF32Engine::tape_bytes_per_sample(&p),
            Engine::Gpu(_) => GpuEngine::tape_bytes_per_sample(&p),
        }
    }

    /// The memory [`SnnModel::loss_and_grad`] needs for a local batch of `local_batch`
    /// samples, from sizes alone (nothing is allocated), in the model's engine: the stored
    /// forward state ([`SnnModel::tape_bytes_per_sample`]; the whole tape, or with
    /// `gradient_checkpointing` one chunk plus the chunk-boundary states), the adjoint
    /// state, the gradients and the compiled network. Driven by `run.seq_len`,
    /// `run.batch_size` and `training.gradient_checkpointing`.
    ///
    /// The float64 reference keeps one sample per rayon thread alive at once (one when not
    /// `parallel`); the float32 kernels keep the whole local batch.
    pub fn memory_estimate(&self, local_batch: usize) -> MemoryEstimate {
        let p = self.problem();
        match &self.engine {
            Engine::Reference => reference::memory_estimate(&p, local_batch),
            Engine::CpuF32(_) => CpuF32Engine::memory_estimate(&p, local_batch),
            Engine::Gpu(_) => GpuEngine::memory_estimate(&p, local_batch),
        }
    }

    /// Loss and mean gradient over the local batch of global samples
    /// `first_sample .. first_sample + batch` (inputs and noise keyed by the global index),
    /// computed by the model's engine: the per-sample float64 BPTT (NEST-exact forward) or
    /// the batch-innermost float32 kernels.
    ///
    /// Errors: `batch == 0`, or `params.len() != n_params()`.
    pub fn loss_and_grad(
        &self,
        params: &[f32],
        first_sample: u64,
        batch: usize,
    ) -> Result<LossAndGrad> {
        Ok(self.loss_and_grad_timed(params, first_sample, batch)?.0)
    }

    /// [`SnnModel::loss_and_grad`] with the split of its time ([`StepTiming`]; for the
    /// float64 reference the whole call is counted as `backward_s`, the rest is zero).
    ///
    /// Errors: those of [`SnnModel::loss_and_grad`].
    pub fn loss_and_grad_timed(
        &self,
        params: &[f32],
        first_sample: u64,
        batch: usize,
    ) -> Result<(LossAndGrad, StepTiming)> {
        let p = self.problem();
        match &self.engine {
            Engine::Reference => {
                let clock = std::time::Instant::now();
                let r = reference::loss_and_grad::<f64>(&p, params, first_sample, batch)?;
                let timing = StepTiming {
                    backward_s: clock.elapsed().as_secs_f64(),
                    ..Default::default()
                };
                Ok((r, timing))
            }
            Engine::CpuF32(e) => e.loss_and_grad(&p, params, first_sample, batch),
            Engine::Gpu(e) => e.loss_and_grad(&p, params, first_sample, batch),
        }
    }

    /// Prepares the engine's device for local batches of `local_batch` samples: on a GPU,
    /// allocates every buffer (each checked against the adapter's limits) and compiles the
    /// kernels, and returns the device bytes; on CPU cores nothing (0).
    ///
    /// Errors: a GPU buffer over the adapter's limits (named, with its size), a device error.
    pub fn prepare_device(&self, local_batch: usize) -> Result<u64> {
        match &self.engine {
            Engine::Gpu(e) => e.prepare(&self.problem(), local_batch.max(1)),
            _ => Ok(0),
        }
    }

    /// Whether the engine can keep the training state on its device (the GPU engine):
    /// lockstep-train's `device_state` seam ([`SnnModel::upload_training_state`] and the
    /// methods after it).
    pub fn keeps_training_state_on_device(&self) -> bool {
        matches!(self.engine, Engine::Gpu(_))
    }

    /// The GPU engine, or an error naming what needed it.
    fn gpu_engine(&self, what: &str) -> Result<&GpuEngine> {
        match &self.engine {
            Engine::Gpu(e) => Ok(e),
            _ => Err(SnnError::Shape(format!(
                "{what} needs the GPU engine (run.device: \"gpu\")"
            ))),
        }
    }

    /// Takes the training state onto the GPU: `params` (`[n_params]`, pA), the optimizer's
    /// `slots` (Adam `[m, v]`, SGD `[velocity]`, each `[n_params]`) and the sign constraints
    /// of [`SnnModel::param_signs`], with a zero gradient. From here the device's copies are
    /// the truth: [`SnnModel::loss_and_grad_on_device_timed`] computes from them and adds
    /// its gradient into the device's, and [`SnnModel::finish_device_update`] applies the
    /// optimizer and [`SnnModel::constrain`] on the device.
    ///
    /// Errors: not on a GPU; lengths other than `n_params`; a buffer over the adapter's
    /// limits; a device error.
    pub fn upload_training_state(&self, params: &[f32], slots: &[Vec<f32>]) -> Result<()> {
        self.problem().check_params(params)?;
        self.gpu_engine("the training state on the device")?
            .upload_training(params, slots, &self.sign)
    }

    /// Reads the device's parameters (`[n_params]`, pA) and optimizer slots back into
    /// `params` and `slots` (one read-back per array; the device keeps them).
    ///
    /// Errors: not on a GPU, nothing uploaded, other lengths, a device error; a parameter
    /// that is infinite or NaN ([`SnnError::NonFiniteParameter`], after the read).
    pub fn download_training_state(
        &self,
        params: &mut [f32],
        slots: &mut [Vec<f32>],
    ) -> Result<()> {
        self.gpu_engine("the training state on the device")?
            .download_training(params, slots)?;
        // What the host path checks after every update, before a checkpoint or the export.
        match params.iter().position(|x| !x.is_finite()) {
            Some(index) => Err(SnnError::NonFiniteParameter {
                index,
                value: params[index],
            }),
            None => Ok(()),
        }
    }

    /// Device bytes of the training state on the GPU (parameters, gradient, optimizer
    /// slots, sign codes), or `None` when none is uploaded.
    pub fn training_state_bytes(&self) -> Option<u64> {
        match &self.engine {
            Engine::Gpu(e) => e.training_state_bytes(),
            _ => None,
        }
    }

    /// Frees the training state on the device (nothing on CPU cores).
    pub fn release_training_state(&self) {
        if let Engine::Gpu(e) = &self.engine {
            e.release_training();
        }
    }

    /// Reads the device's gradient of the update (the sum of its passes' mean gradients,
    /// `[n_params]` float32) into `grad`: one read-back, for a reduction over replicas.
    ///
    /// Errors: not on a GPU, nothing uploaded, another length, a device error.
    pub fn read_device_gradient(&self, grad: &mut [f32]) -> Result<()> {
        self.gpu_engine("the training state on the device")?
            .read_training_gradient(grad)
    }

    /// Ends an update on the device (one submission, not waited for): `reduced`
    /// (`[n_params]`) replaces the device's gradient when given; `Some(update)` applies the
    /// optimizer (lockstep-train's `DeviceUpdate`, term by term as the host optimizer) and
    /// the sign constraint; the gradient then starts again from zero. Returns the kernel
    /// launches (one per window of the parameters with an update, else 0).
    ///
    /// Errors: not on a GPU, nothing uploaded, `reduced` of another length, a rule the
    /// uploaded slots do not fit.
    pub fn finish_device_update(
        &self,
        update: Option<&lockstep_train::DeviceUpdate>,
        reduced: Option<&[f32]>,
    ) -> Result<u64> {
        self.gpu_engine("the training state on the device")?
            .finish_training_update(update, reduced)
    }

    /// [`SnnModel::loss_and_grad_timed`] from the training state on the device
    /// ([`SnnModel::upload_training_state`]): the returned `grad` is empty, the mean
    /// gradient is added into the device's; one host synchronisation.
    ///
    /// Errors: those of [`SnnModel::loss_and_grad`]; not on a GPU; nothing uploaded.
    pub fn loss_and_grad_on_device_timed(
        &self,
        first_sample: u64,
        batch: usize,
    ) -> Result<(LossAndGrad, StepTiming)> {
        self.gpu_engine("the training state on the device")?
            .loss_and_grad_on_device(&self.problem(), first_sample, batch)
    }

    /// On a GPU, the device's copy bandwidth for `bytes` copied device to device (bytes/s,
    /// best of `rounds`; [`lockstep_gpu::GpuContext::copy_bytes_per_s`]): the yardstick of
    /// the kernels' achieved bandwidth. `None` on CPU cores.
    ///
    /// Errors: a device error.
    pub fn device_copy_bytes_per_s(&self, bytes: u64, rounds: usize) -> Result<Option<f64>> {
        match &self.engine {
            Engine::Gpu(e) => Ok(Some(e.context().copy_bytes_per_s(bytes, rounds)?)),
            _ => Ok(None),
        }
    }

    /// Where the model computes, for the log: `cpu`, or the GPU adapter with how it was
    /// chosen, whether other replicas share it and whether its kernels run without 64-bit
    /// types.
    pub fn device_description(&self) -> String {
        match &self.engine {
            Engine::Gpu(e) => {
                let s = e.selected();
                format!(
                    "GPU adapter [{}] {} ({}, {}; {}{}{})",
                    s.adapter.index,
                    s.adapter.name,
                    s.adapter.backend,
                    s.adapter.device_type,
                    s.note,
                    if s.shared {
                        "; shared with other ranks of this node"
                    } else {
                        ""
                    },
                    e.arithmetic_note()
                )
            }
            _ => "cpu".into(),
        }
    }

    /// Whether the GPU engine's kernels use float64 and 64-bit integers (the adapter has
    /// `SHADER_F64` and `SHADER_INT64`) or 32-bit types only (the same spikes; the gradient's
    /// and the loss sums' accumulators in float32); `None` on the CPU engines.
    pub fn gpu_kernels_64bit(&self) -> Option<bool> {
        match &self.engine {
            Engine::Gpu(e) => Some(e.kernels_64bit()),
            _ => None,
        }
    }

    /// The warning a job prints once (chief only) when this replica computes on a software
    /// GPU adapter (lavapipe and the like: far slower than the CPU engine); `None` on the
    /// CPU engines and on hardware adapters.
    pub fn software_adapter_warning(&self) -> Option<String> {
        match &self.engine {
            Engine::Gpu(e) => e.selected().adapter.software_warning("run.device: \"cpu\""),
            _ => None,
        }
    }

    /// The straightforward per-sample BPTT in precision `dtype`, whatever the model's engine
    /// (each sample its own state `[neuron]`, forward by
    /// [`TrialState::step`](crate::TrialState::step), backward by the hand-written adjoint,
    /// per-sample gradients summed in sample order in f64): the oracle the engines are
    /// tested against. For `Float64` this is what the reference engine runs; for `Float32`
    /// it is the implementation that the batched float32 kernels must reproduce (same
    /// spikes, same equations, same order of operations per sample except the gradient's
    /// reduction).
    ///
    /// Errors: `batch == 0`, or `params.len() != n_params()`.
    pub fn loss_and_grad_reference(
        &self,
        params: &[f32],
        first_sample: u64,
        batch: usize,
        dtype: Dtype,
    ) -> Result<LossAndGrad> {
        let p = self.problem();
        match dtype {
            Dtype::Float64 => reference::loss_and_grad::<f64>(&p, params, first_sample, batch),
            Dtype::Float32 => reference::loss_and_grad::<f32>(&p, params, first_sample, batch),
        }
    }

    /// Gradient oracle: loss (mean over the batch) and its directional derivative along
    /// `direction` (`[n_params]`), computed by running the forward code on `Dual64` weights.
    ///
    /// Errors: `direction.len()` or `params.len()` not `n_params()`.
    pub fn loss_directional_dual(
        &self,
        params: &[f32],
        direction: &[f64],
        first_sample: u64,
        batch: usize,
    ) -> Result<(f64, f64)> {
        reference::loss_directional_dual(&self.problem(), params, direction, first_sample, batch)
    }
}

/// The sign of an initial weight: +1, -1, or 0.
fn sign_of(w: f64) -> i8 {
    if w > 0.0 {
        1
    } else if w < 0.0 {
        -1
    } else {
        0
    }
}
