//! Backpropagation through time of the exact forward recursion (`docs/neuron-models.md`, "Training").
//!
//! The forward pass is [`crate::forward::TrialState::step`] on `f64`; the backward pass is its
//! hand-written adjoint, step by step in reverse:
//!
//! * spike: `dz/dU_n = pseudo_derivative(v) / (V_th - E_L)`, `v = U_n / (V_th - E_L)` (surrogate,
//!   see [`crate::scalar::Surrogate`]);
//! * reset: hard forward, soft derivative `dU'/dU_n = 1`, `dU'/dz = -(V_th - V_reset)`;
//! * after-spike currents: `A'' = A' + z (amp + A' r - A')`, differentiated in `A'` and `z`;
//! * refractory steps pass the adjoints of `U` and `A` unchanged, `z` has no derivative;
//! * delays: the adjoint of the arrivals at a port, `mu(t) = (e / tau_syn) * dL/dy1'(t)`, is
//!   kept in a ring of `max_delay + 1` steps; a source's spike adjoint at step `t` gathers
//!   `w * mu(t + d)` over its out-edges, and the weight gradient of an edge is
//!   `sum_t z_src(t) * mu_tgt(t + d)`.
//!
//! Segmented BPTT (`gradient_checkpointing`) keeps only the full trial state at chunk
//! boundaries and recomputes each chunk forward before its backward pass; the recomputed
//! values and the order of every floating-point operation are those of the unsegmented
//! pass, so the gradients are bitwise identical.
//!
//! Trials are independent; with `parallel` they run on rayon, and per-trial gradients are
//! summed in trial order, so results do not depend on the thread count.
//!
//! [`SnnModel::loss_directional_dual`] is the gradient oracle: the same forward code on
//! `num_dual::Dual64` weights gives the directional derivative of the loss.

#![allow(clippy::needless_range_loop)] // index loops over parallel arrays read clearer here

use lockstep_core::memory::MemoryEstimate;
use num_dual::Dual64;
use rayon::prelude::*;

use crate::bptt_batch::StepTiming;
use crate::error::{Result, SnnError};
use crate::forward::{InitialState, TrialState};
use crate::input::{InputSpec, Inputs};
use crate::loss::{vreg_r, vreg_r_generic, Loss, RateUnits};
use crate::model::ModelKind;
use crate::network::{Network, NetworkSpec};
use crate::scalar::{Scalar, Surrogate};
use crate::step::membrane_update;

/// A floating-point type the per-sample BPTT runs on (`f64`, or `f32` as the reference of
/// the batched float32 kernels).
pub(crate) trait Real: Scalar + PartialOrd {
    /// `dz/dU` of the surrogate at the pre-reset potential `u` (mV rel. `E_L`) and threshold
    /// `th` (mV rel. `E_L`), in this precision.
    fn dz_du(sg: &Surrogate, u: Self, th: f64) -> Self;
}

impl Real for f64 {
    #[inline]
    fn dz_du(sg: &Surrogate, u: f64, th: f64) -> f64 {
        sg.dz_du(u, th)
    }
}

impl Real for f32 {
    #[inline]
    fn dz_du(sg: &Surrogate, u: f32, th: f64) -> f32 {
        crate::bptt_batch::dz_du_f32(sg, u, th as f32)
    }
}

/// Options of a trainable model.
#[derive(Debug, Clone, PartialEq)]
pub struct BpttOptions {
    /// Steps per sample.
    pub seq_len: usize,
    /// Pseudo-derivative of the spike.
    pub surrogate: Surrogate,
    /// Also train the input (virtual -> neuron) edge weights.
    pub train_input_weights: bool,
    /// Segmented BPTT chunk size in steps (`None`: store every step).
    pub gradient_checkpointing: Option<usize>,
    /// Loss terms (summed).
    pub losses: Vec<Loss>,
    /// Initial state of every sample (default: rest).
    pub initial: InitialState,
    /// Run the samples of a batch on rayon.
    pub parallel: bool,
    /// Precision of the training computation (`run.dtype`).
    pub dtype: Dtype,
    /// Keep the spikes of the batch's first sample in [`LossAndGrad::first_spikes`], as the
    /// forward pass computes them (no extra simulation; `output.training_spikes`).
    pub record_first_sample: bool,
    /// Float32 kernels: target neurons per pass of the adjoint SpMV (`None`: 32,768). The
    /// SpMV reads only the adjoint rows of one pass's targets at a time so that they stay
    /// in cache; a source's sum is the sum of its passes' partial sums, so the pass size
    /// changes results by float rounding only. A tuning and testing knob, not a config key.
    pub spmv_pass_targets: Option<usize>,
    /// Float32 kernels: the form of the adjoint's transposed SpMV ([`SpmvForm`]). A tuning
    /// and testing knob, not a config key.
    pub adjoint_spmv: SpmvForm,
}

/// The form of the float32 kernels' adjoint SpMV, `gz[s] = sum_e w_e mu[target_e]`: both
/// give the same weight gradients and the same spike adjoints up to float32 rounding (the
/// order of each source's sum differs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SpmvForm {
    /// Scatter on networks too large for the gather form's rows to stay in cache (above
    /// 32,768 neurons), gather otherwise.
    #[default]
    Auto,
    /// Per source, gathering one adjoint row per edge (in passes of
    /// [`BpttOptions::spmv_pass_targets`] targets); with one pass its sums are bitwise those
    /// of the per-sample reference.
    Gather,
    /// Per target row, scattering into the adjoints of blocks of sources that stay in L2.
    Scatter,
}

/// Precision of the BPTT computation (`run.dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// Per-sample BPTT in double precision: the NEST-exact forward pass and its adjoint (the
    /// dual-number oracle checks it).
    #[default]
    Float64,
    /// The batch-innermost float32 kernels ([`SnnModel::loss_and_grad`]): the whole local
    /// batch advances together, spike delivery and weight gradients only where a source
    /// spiked, parallel over neurons, sources and target blocks with results independent of the
    /// thread count.
    Float32,
}

impl std::fmt::Display for Dtype {
    /// The config's spelling (`run.dtype`): `float64` or `float32`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Dtype::Float64 => "float64",
            Dtype::Float32 => "float32",
        })
    }
}

impl Default for BpttOptions {
    fn default() -> Self {
        BpttOptions {
            seq_len: 500,
            surrogate: Surrogate::default(),
            train_input_weights: false,
            gradient_checkpointing: None,
            losses: Vec::new(),
            initial: InitialState::Rest,
            parallel: true,
            dtype: Dtype::Float64,
            record_first_sample: false,
            spmv_pass_targets: None,
            adjoint_spmv: SpmvForm::Auto,
        }
    }
}

/// Result of [`SnnModel::loss_and_grad`] for one local batch.
#[derive(Debug, Clone, PartialEq)]
pub struct LossAndGrad {
    /// Total loss (sum of the terms), mean over the batch.
    pub loss: f64,
    /// Each loss term, mean over the batch, in the order of `BpttOptions::losses`.
    pub terms: Vec<(&'static str, f64)>,
    /// `[n_params]` gradient of `loss` (mean over the batch) with respect to the parameters.
    pub grad: Vec<f32>,
    /// Spikes in the batch.
    pub n_spikes: u64,
    /// Mean firing rate over samples and neurons (Hz).
    pub mean_rate_hz: f64,
    /// With [`BpttOptions::record_first_sample`]: the spikes of the batch's first sample
    /// computed by this very forward pass, as `(step, neuron)` pairs (neuron: external index,
    /// i.e. the order of [`NetworkSpec::neurons`](crate::NetworkSpec); the spike of step
    /// `step` has NEST's time stamp `(step + 1) * dt` ms), sorted by step, then neuron, like
    /// [`TrialSpikes::spikes`](crate::TrialSpikes). `None` otherwise.
    pub first_spikes: Option<Vec<(u32, u32)>>,
}

/// A point-neuron network with trainable weights as a flat `f32` buffer:
/// `[recurrent weights (CSR order)] ++ [input weights (CSR order), if trained]`, in pA.
#[derive(Debug, Clone)]
pub struct SnnModel {
    /// The compiled network (its weight buffers are the initial values).
    pub net: Network,
    /// Inputs compiled for `seq_len` steps.
    pub inputs: Inputs,
    /// Options. Only `parallel`, `surrogate` and `spmv_pass_targets` may be changed after
    /// construction; the others shaped the model (parameter layout, tapes, loss
    /// coefficients).
    pub opts: BpttOptions,
    /// `[neuron]` `V_th - E_L` (mV), internal order.
    pub(crate) th: Vec<f64>,
    /// Per rate loss: `[neuron]` target (internal order) and the count -> rate factor.
    pub(crate) rate_losses: Vec<(Vec<f64>, f64)>,
    /// Sum of voltage-regularization costs.
    pub(crate) vreg_cost: f64,
    /// `[n_params]` sign constraint: +1, -1, or 0 (free).
    sign: Vec<i8>,
    /// The float32 kernels' tapes and chunk boundaries, kept from one call to the next.
    pub(crate) workspace: crate::bptt_batch::WorkspaceCache,
    /// `[group][live port]` the receptor ports some edge reaches per group
    /// ([`Network::live_ports`]); the float32 kernels update and differentiate those alone.
    pub(crate) live_ports: Vec<Vec<usize>>,
}

/// Stored forward states of `len` consecutive steps (pre-step states and spikes).
struct Tape<F> {
    len: usize,
    /// `[len + 1, neuron]`: U before each step, and after the last.
    u: Vec<F>,
    /// `[len, neuron, n_asc]`.
    asc: Vec<F>,
    /// `[len, neuron, n_ports]`.
    y1: Vec<F>,
    /// `[len, neuron, n_ports]`.
    y2: Vec<F>,
    /// `[len, neuron]`.
    refr: Vec<u32>,
    /// `[len, neuron]` spikes (0/1).
    z: Vec<u8>,
}

impl<F: Real> Tape<F> {
    fn new(net: &Network, len: usize) -> Self {
        let n = net.n_neurons();
        Tape {
            len,
            u: Vec::with_capacity((len + 1) * n),
            asc: Vec::with_capacity(len * n * net.n_asc),
            y1: Vec::with_capacity(len * n * net.n_ports),
            y2: Vec::with_capacity(len * n * net.n_ports),
            refr: Vec::with_capacity(len * n),
            z: Vec::with_capacity(len * n),
        }
    }
}

impl Tape<f64> {
    fn bytes(net: &Network, len: usize) -> usize {
        let n = net.n_neurons();
        8 * ((len + 1) * n + len * n * (net.n_asc + 2 * net.n_ports)) + 5 * len * n
    }
}

/// What one trial of the per-sample BPTT returns: its gradient, loss terms, spike count and,
/// when recorded, its `(step, neuron)` spikes.
type TrialResult<F> = (Vec<F>, Vec<f64>, f64, Option<Vec<(u32, u32)>>);

/// Per-trial forward summary.
struct TrialForward {
    /// `[neuron]` spike counts, internal order.
    counts: Vec<f64>,
    /// Sum over steps and neurons of `relu(|v-0.5|-0.5)^2`.
    vreg_sum: f64,
    /// `(step, neuron)` spikes (external index) when this trial's spikes are recorded.
    spikes: Option<Vec<(u32, u32)>>,
}

/// Backward adjoint state of one trial.
struct Adjoint<F> {
    u: Vec<F>,
    asc: Vec<F>,
    y1: Vec<F>,
    y2: Vec<F>,
    /// `[ring_len, neuron, n_ports]` adjoints of the arrivals.
    mu: Vec<F>,
    gz: Vec<F>,
}

impl SnnModel {
    /// Builds a trainable model from a network description, a time step (ms) and inputs.
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
        let mut sign: Vec<i8> = net.weights_rec.iter().map(|&w| sign_of(w)).collect();
        if opts.train_input_weights {
            sign.extend(net.weights_in.iter().map(|&w| sign_of(w)));
        }
        // iaf_psc_alpha chose the port by sign: a zero weight sits on the inhibitory port.
        for (csr, off) in [
            (&net.recurrent, 0usize),
            (&net.input, net.weights_rec.len()),
        ] {
            if off > 0 && !opts.train_input_weights {
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
        Ok(SnnModel {
            net,
            inputs,
            opts,
            th,
            rate_losses,
            vreg_cost,
            sign,
            workspace: Default::default(),
            live_ports,
        })
    }

    /// Frees the buffers the float32 kernels keep from one call to the next (the tape and
    /// the chunk boundaries: full V1 unsegmented, about 3 GB). Call it when the model will
    /// not compute gradients for a while, e.g. before exporting the trained weights; the next
    /// call allocates them again.
    pub fn release_workspace(&self) {
        self.workspace.release();
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
        self.net.weights_rec.len()
            + if self.opts.train_input_weights {
                self.net.weights_in.len()
            } else {
                0
            }
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
    pub fn weights_in_spec_order(&self, params: &[f32]) -> Result<(Vec<f64>, Vec<f64>)> {
        let (w_rec, w_in) = self.weights_f64(params)?;
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

    fn weights_f64(&self, params: &[f32]) -> Result<(Vec<f64>, Vec<f64>)> {
        if params.len() != self.n_params() {
            return Err(SnnError::Shape(format!(
                "{} parameters given, the model has {}",
                params.len(),
                self.n_params()
            )));
        }
        let nr = self.net.weights_rec.len();
        let w_rec: Vec<f64> = params[..nr].iter().map(|&w| w as f64).collect();
        let w_in: Vec<f64> = if self.opts.train_input_weights {
            params[nr..].iter().map(|&w| w as f64).collect()
        } else {
            self.net.weights_in.clone()
        };
        Ok((w_rec, w_in))
    }

    /// Bytes of stored forward state per sample: `(unsegmented, segmented)`, in the layout
    /// of `BpttOptions::dtype` (float64: the full per-sample state of every step; float32:
    /// the batched kernels' compact tape, see the private module `bptt_batch`).
    pub fn tape_bytes_per_sample(&self) -> (usize, usize) {
        let t = self.opts.seq_len;
        if self.opts.dtype == Dtype::Float32 {
            let bb = crate::bptt_batch::batch_bytes(self, 1);
            let full = bb.tape(t as u64, true) as usize;
            let seg = match self.opts.gradient_checkpointing {
                Some(k) => {
                    bb.tape(k.min(t) as u64, false) as usize + t.div_ceil(k) * bb.boundary as usize
                }
                None => full,
            };
            return (full, seg);
        }
        let full = Tape::bytes(&self.net, t);
        let seg = match self.opts.gradient_checkpointing {
            Some(k) => {
                let n = self.net.n_neurons();
                let state = 8
                    * n
                    * (1 + self.net.n_asc
                        + 2 * self.net.n_ports
                        + self.net.ring_len() * self.net.n_ports)
                    + 4 * n;
                Tape::bytes(&self.net, k.min(t)) + t.div_ceil(k) * state
            }
            None => full,
        };
        (full, seg)
    }

    /// The memory [`SnnModel::loss_and_grad`] needs for a local batch of `local_batch`
    /// samples, from sizes alone (nothing is allocated): the stored forward state of every
    /// sample alive at once (the whole tape, or with `gradient_checkpointing` one chunk plus
    /// the chunk-boundary states; [`SnnModel::tape_bytes_per_sample`]), its adjoint state and
    /// per-sample gradient (`8 * n_params` bytes each), the batch gradient in f64 and f32,
    /// and the weights in f64. Samples alive at once: the rayon threads (at most the batch)
    /// when `parallel`, else one. Driven by `run.seq_len`, `run.batch_size` and
    /// `training.gradient_checkpointing`.
    ///
    /// With `dtype` float32 the whole local batch is alive at once in the batched kernels'
    /// layout: the forward state (one, plus one per chunk boundary when segmented), the tape
    /// (all steps, or one chunk), the adjoint state, the `f64` gradient accumulator and the
    /// returned `f32` gradient, the input weights in `f32`, and the network's weights.
    /// Both count the compiled network's per-edge index arrays.
    pub fn memory_estimate(&self, local_batch: usize) -> MemoryEstimate {
        if self.opts.dtype == Dtype::Float32 {
            return self.memory_estimate_f32(local_batch);
        }
        let (full, seg) = self.tape_bytes_per_sample();
        let tape = if self.opts.gradient_checkpointing.is_some() {
            seg
        } else {
            full
        } as u64;
        let alive = if self.opts.parallel {
            rayon::current_num_threads().clamp(1, local_batch.max(1))
        } else {
            1
        } as u64;
        let n = self.net.n_neurons() as u64;
        let ports = self.net.n_ports as u64;
        let adjoint = 8
            * n
            * (1 + self.net.n_asc as u64 + 2 * ports + self.net.ring_len() as u64 * ports + 1);
        let params = self.n_params() as u64;
        let weights = 8 * (self.net.weights_rec.len() + self.net.weights_in.len()) as u64;
        let mut e = MemoryEstimate::new();
        e.add(
            format!(
                "stored forward state ({} steps per sample, {alive} sample(s) at once)",
                self.opts.seq_len
            ),
            tape.saturating_add(adjoint).saturating_mul(alive),
        )
        .add(
            "per-sample gradients and the batch gradient",
            (8 * params)
                .saturating_mul(alive + 1)
                .saturating_add(4 * params),
        )
        .add("weights (f64)", weights)
        .add(
            "compiled network (per edge: target offset, edge id, sign)",
            self.network_bytes(),
        )
        .driven_by("run.seq_len")
        .driven_by("run.batch_size")
        .driven_by("training.gradient_checkpointing");
        e
    }

    fn memory_estimate_f32(&self, local_batch: usize) -> MemoryEstimate {
        let b = local_batch.max(1);
        let bb = crate::bptt_batch::batch_bytes(self, b);
        let t = self.opts.seq_len as u64;
        let (tape, boundaries) = match self.opts.gradient_checkpointing {
            Some(k) => (
                bb.tape((k as u64).min(t), false),
                bb.boundary.saturating_mul(t.div_ceil(k as u64)),
            ),
            None => (bb.tape(t, true), 0),
        };
        let params = self.n_params() as u64;
        let weights = 8 * (self.net.weights_rec.len() + self.net.weights_in.len()) as u64;
        let mut e = MemoryEstimate::new();
        e.add(
            format!(
                "stored forward state ({} steps x {b} samples, float32 tape)",
                self.opts.seq_len
            ),
            tape,
        )
        .add("forward state at the chunk boundaries", boundaries)
        .add(
            "forward and adjoint state of the batch",
            bb.state + bb.adjoint,
        )
        .add(
            "gradient (f64 accumulator and f32 result) and f32 input weights",
            12 * params + 4 * self.net.weights_in.len() as u64,
        )
        .add("weights (f64)", weights)
        .add(
            "compiled network (per edge: target offset, edge id, sign)",
            self.network_bytes(),
        );
        if crate::bptt_batch::uses_scatter(self) {
            let threads = if self.opts.parallel {
                rayon::current_num_threads()
            } else {
                1
            };
            e.add(
                "adjoint SpMV in scatter order (per edge: source, weight)",
                crate::bptt_scatter::ScatterSpmv::bytes(
                    &self.net.recurrent,
                    self.net.n_neurons(),
                    threads,
                ),
            );
        }
        e.driven_by("run.seq_len")
            .driven_by("run.batch_size")
            .driven_by("training.gradient_checkpointing");
        e
    }

    /// Bytes of the compiled network's per-edge index arrays (CSR target offset and edge id,
    /// 4 bytes each) and per-parameter sign constraints (1 byte), segments included.
    fn network_bytes(&self) -> u64 {
        let edges = (self.net.recurrent.len() + self.net.input.len()) as u64;
        let segments = (self.net.recurrent.segments.len() + self.net.input.segments.len()) as u64;
        8 * edges + 16 * segments + self.sign.len() as u64
    }

    /// Loss and mean gradient over the local batch of global samples
    /// `first_sample .. first_sample + batch` (inputs and noise keyed by the global index),
    /// in the precision of `BpttOptions::dtype`: `Float64` runs the per-sample f64 BPTT
    /// (NEST-exact forward), `Float32` the batch-innermost float32 kernels
    /// (the private module `bptt_batch`).
    ///
    /// Errors: `batch == 0`, or `params.len() != n_params()`.
    pub fn loss_and_grad(
        &self,
        params: &[f32],
        first_sample: u64,
        batch: usize,
    ) -> Result<LossAndGrad> {
        match self.opts.dtype {
            Dtype::Float64 => {
                self.loss_and_grad_reference(params, first_sample, batch, Dtype::Float64)
            }
            Dtype::Float32 => Ok(self.loss_and_grad_batched(params, first_sample, batch)?.0),
        }
    }

    /// [`SnnModel::loss_and_grad`] with the split of its time ([`StepTiming`]; for
    /// `Float64` the whole call is counted as `backward_s`, the rest is zero).
    ///
    /// Errors: those of [`SnnModel::loss_and_grad`].
    pub fn loss_and_grad_timed(
        &self,
        params: &[f32],
        first_sample: u64,
        batch: usize,
    ) -> Result<(LossAndGrad, StepTiming)> {
        match self.opts.dtype {
            Dtype::Float64 => {
                let clock = std::time::Instant::now();
                let r =
                    self.loss_and_grad_reference(params, first_sample, batch, Dtype::Float64)?;
                let timing = StepTiming {
                    backward_s: clock.elapsed().as_secs_f64(),
                    ..Default::default()
                };
                Ok((r, timing))
            }
            Dtype::Float32 => self.loss_and_grad_batched(params, first_sample, batch),
        }
    }

    /// The straightforward per-sample BPTT in precision `dtype` (each sample its own state
    /// `[neuron]`, forward by [`TrialState::step`], backward by the hand-written adjoint,
    /// per-sample gradients summed in sample order in f64). For `Float64` this is what
    /// [`SnnModel::loss_and_grad`] runs; for `Float32` it is the reference implementation
    /// that the batched float32 kernels must reproduce (same spikes, same equations, same
    /// order of operations per sample except the gradient's reduction).
    ///
    /// Errors: `batch == 0`, or `params.len() != n_params()`.
    pub fn loss_and_grad_reference(
        &self,
        params: &[f32],
        first_sample: u64,
        batch: usize,
        dtype: Dtype,
    ) -> Result<LossAndGrad> {
        match dtype {
            Dtype::Float64 => self.per_sample::<f64>(params, first_sample, batch),
            Dtype::Float32 => self.per_sample::<f32>(params, first_sample, batch),
        }
    }

    fn per_sample<F: Real>(
        &self,
        params: &[f32],
        first_sample: u64,
        batch: usize,
    ) -> Result<LossAndGrad> {
        if batch == 0 {
            return Err(SnnError::Shape("batch must be at least 1".into()));
        }
        let (w_rec, w_in) = self.weights_f64(params)?;
        let w_rec: Vec<F> = w_rec.iter().map(|&w| F::from_f64(w)).collect();
        let w_in: Vec<F> = w_in.iter().map(|&w| F::from_f64(w)).collect();
        let record = self.opts.record_first_sample;
        let work = |b: usize| {
            self.trial_loss_and_grad(
                &w_rec,
                &w_in,
                first_sample + b as u64,
                batch,
                record && b == 0,
            )
        };
        let mut first_spikes = None;
        let mut grad = vec![0.0f64; self.n_params()];
        let mut terms = vec![0.0f64; self.opts.losses.len()];
        let mut n_spikes = 0.0;
        // Samples in groups of one per thread; each group is reduced in sample order, so the
        // sums are bitwise independent of the thread count and at most one per-sample
        // gradient per thread is alive at a time.
        let group = if self.opts.parallel {
            rayon::current_num_threads().max(1)
        } else {
            1
        };
        let mut start = 0;
        while start < batch {
            let end = (start + group).min(batch);
            let per_trial: Vec<TrialResult<F>> = if self.opts.parallel {
                (start..end).into_par_iter().map(work).collect()
            } else {
                (start..end).map(work).collect()
            };
            for (g, t, s, spikes) in per_trial {
                for (a, b) in grad.iter_mut().zip(&g) {
                    *a += b.re();
                }
                for (a, b) in terms.iter_mut().zip(&t) {
                    *a += b / batch as f64;
                }
                n_spikes += s;
                if spikes.is_some() {
                    first_spikes = spikes;
                }
            }
            start = end;
        }
        let mut r = self.finish(
            terms,
            grad.iter().map(|&g| g as f32).collect(),
            n_spikes,
            batch,
        );
        r.first_spikes = first_spikes;
        Ok(r)
    }

    /// The batch's result from its loss terms (means over the batch), f64 gradient and spikes.
    pub(crate) fn finish(
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

    /// Per-trial loss terms from the forward summary.
    pub(crate) fn trial_terms(&self, counts: &[f64], vreg_sum: f64) -> Vec<f64> {
        let n = self.net.n_neurons() as f64;
        let mut ri = 0;
        self.opts
            .losses
            .iter()
            .map(|l| match l {
                Loss::TargetFiringRate { .. } => {
                    let (target, scale) = &self.rate_losses[ri];
                    ri += 1;
                    counts
                        .iter()
                        .zip(target)
                        .map(|(c, t)| (c * scale - t).powi(2))
                        .sum::<f64>()
                        / n
                }
                Loss::VoltageRegularization { cost } => {
                    cost * vreg_sum / (self.opts.seq_len as f64 * n)
                }
            })
            .collect()
    }

    /// Forward steps `t0..t1` of one trial, optionally recording a tape, accumulating
    /// spike counts and the voltage-regularization sum.
    #[allow(clippy::too_many_arguments)]
    fn forward_steps<F: Real>(
        &self,
        st: &mut TrialState<F>,
        w_rec: &[F],
        w_in: &[F],
        sample: u64,
        t0: usize,
        t1: usize,
        mut tape: Option<&mut Tape<F>>,
        mut acc: Option<&mut TrialForward>,
        z: &mut [F],
    ) {
        for t in t0..t1 {
            if let Some(tp) = tape.as_deref_mut() {
                tp.u.extend_from_slice(&st.u);
                tp.asc.extend_from_slice(&st.asc);
                tp.y1.extend_from_slice(&st.y1);
                tp.y2.extend_from_slice(&st.y2);
                tp.refr.extend_from_slice(&st.refr);
            }
            st.step(
                &self.net,
                w_rec,
                w_in,
                &self.inputs,
                sample,
                t,
                &self.opts.surrogate,
                z,
            );
            if let Some(tp) = tape.as_deref_mut() {
                tp.z.extend(z.iter().map(|&v| v.re() as u8));
            }
            if let Some(a) = acc.as_deref_mut() {
                for (c, &v) in a.counts.iter_mut().zip(z.iter()) {
                    *c += v.re();
                }
                if let Some(rec) = a.spikes.as_mut() {
                    let from = rec.len();
                    rec.extend(
                        z.iter()
                            .enumerate()
                            .filter(|(_, v)| v.re() != 0.0)
                            .map(|(i, _)| (t as u32, self.net.order[i])),
                    );
                    rec[from..].sort_unstable();
                }
                if self.vreg_cost != 0.0 {
                    for (&u, &th) in st.u.iter().zip(&self.th) {
                        let (r, _) = vreg_r(u.re() / th);
                        a.vreg_sum += r * r;
                    }
                }
            }
        }
        if let Some(tp) = tape {
            tp.u.extend_from_slice(&st.u);
        }
    }

    /// Forward + backward of one trial; returns (grad, loss terms, spike count, and with
    /// `record` its `(step, neuron)` spikes).
    fn trial_loss_and_grad<F: Real>(
        &self,
        w_rec: &[F],
        w_in: &[F],
        sample: u64,
        batch: usize,
        record: bool,
    ) -> TrialResult<F> {
        let net = &self.net;
        let n = net.n_neurons();
        let t_len = self.opts.seq_len;
        let mut z = vec![F::zero(); n];
        let mut fwd = TrialForward {
            counts: vec![0.0; n],
            vreg_sum: 0.0,
            spikes: record.then(Vec::new),
        };
        let mut st = TrialState::<F>::new(net, self.opts.initial);
        let chunk = self
            .opts
            .gradient_checkpointing
            .unwrap_or(t_len)
            .min(t_len)
            .max(1);
        let segmented = self.opts.gradient_checkpointing.is_some();
        // Pass 1: forward. Unsegmented: one tape of all steps. Segmented: boundary states.
        let mut full_tape = None;
        let mut boundaries: Vec<TrialState<F>> = Vec::new();
        if segmented {
            let mut t0 = 0;
            while t0 < t_len {
                boundaries.push(st.clone());
                let t1 = (t0 + chunk).min(t_len);
                self.forward_steps(
                    &mut st,
                    w_rec,
                    w_in,
                    sample,
                    t0,
                    t1,
                    None,
                    Some(&mut fwd),
                    &mut z,
                );
                t0 = t1;
            }
        } else {
            let mut tape = Tape::new(net, t_len);
            self.forward_steps(
                &mut st,
                w_rec,
                w_in,
                sample,
                0,
                t_len,
                Some(&mut tape),
                Some(&mut fwd),
                &mut z,
            );
            full_tape = Some(tape);
        }
        let terms = self.trial_terms(&fwd.counts, fwd.vreg_sum);
        let n_spikes: f64 = fwd.counts.iter().sum();

        // Coefficients of the direct loss derivatives (mean over the batch included).
        let bn = batch as f64 * n as f64;
        let mut gz_rate64 = vec![0.0; n];
        for (target, scale) in &self.rate_losses {
            for i in 0..n {
                gz_rate64[i] += 2.0 * (fwd.counts[i] * scale - target[i]) * scale / bn;
            }
        }
        let gz_rate: Vec<F> = gz_rate64.iter().map(|&g| F::from_f64(g)).collect();
        let vreg_coef = self.vreg_cost / (bn * t_len as f64);

        let mut grad = vec![F::zero(); self.n_params()];
        let mut adj = Adjoint {
            u: vec![F::zero(); n],
            asc: vec![F::zero(); n * net.n_asc],
            y1: vec![F::zero(); n * net.n_ports],
            y2: vec![F::zero(); n * net.n_ports],
            mu: vec![F::zero(); net.ring_len() * n * net.n_ports],
            gz: vec![F::zero(); n],
        };
        if let Some(tape) = full_tape {
            self.backward_steps(
                &tape, 0, w_rec, sample, &gz_rate, vreg_coef, &mut adj, &mut grad,
            );
        } else {
            for (c, b) in boundaries.iter().enumerate().rev() {
                let t0 = c * chunk;
                let t1 = (t0 + chunk).min(t_len);
                let mut s = b.clone();
                let mut tape = Tape::new(net, t1 - t0);
                self.forward_steps(
                    &mut s,
                    w_rec,
                    w_in,
                    sample,
                    t0,
                    t1,
                    Some(&mut tape),
                    None,
                    &mut z,
                );
                self.backward_steps(
                    &tape, t0, w_rec, sample, &gz_rate, vreg_coef, &mut adj, &mut grad,
                );
            }
        }
        (grad, terms, n_spikes, fwd.spikes)
    }

    /// Reverse pass over the steps of `tape` (starting at step `t0`).
    ///
    /// Kept as one function (a kernel over 120 lines): its phases share a dozen per-step
    /// buffers and loop indices, and splitting it would only pass them between helpers.
    #[allow(clippy::too_many_arguments)]
    fn backward_steps<F: Real>(
        &self,
        tape: &Tape<F>,
        t0: usize,
        w_rec: &[F],
        sample: u64,
        gz_rate: &[F],
        vreg_coef: f64,
        adj: &mut Adjoint<F>,
        grad: &mut [F],
    ) {
        let net = &self.net;
        let n = net.n_neurons();
        let np = net.n_ports;
        let na = net.n_asc;
        let rl = net.ring_len();
        let stride = n * np;
        let t_len = self.opts.seq_len;
        let n_rec = net.weights_rec.len();
        let sg = &self.opts.surrogate;
        let mut asc_tmp = vec![F::zero(); na.max(1)];
        let mut ly1_pre = vec![F::zero(); np];
        let mut ly2_pre = vec![F::zero(); np];
        for l in (0..tape.len).rev() {
            let t = t0 + l;
            // 1. Voltage regularization on U after step t.
            if vreg_coef != 0.0 {
                let u_post = &tape.u[(l + 1) * n..(l + 2) * n];
                for i in 0..n {
                    let th = self.th[i];
                    let (r, dr) = vreg_r(u_post[i].re() / th);
                    if r != 0.0 {
                        adj.u[i] += F::from_f64(vreg_coef * 2.0 * r * dr / th);
                    }
                }
            }
            // 2. Adjoint of this step's arrivals.
            let slot = t % rl;
            {
                let mu = &mut adj.mu[slot * stride..(slot + 1) * stride];
                mu.fill(F::zero());
                for g in &net.groups {
                    for i in g.start..g.end {
                        for (k, pc) in g.consts.ports.iter().enumerate() {
                            mu[i * np + k] = adj.y1[i * np + k].mulc(pc.psc_init);
                        }
                    }
                }
            }
            // 3. Spike adjoints (gather over out-edges) and recurrent weight gradients.
            let zt = &tape.z[l * n..(l + 1) * n];
            for i in 0..n {
                let mut acc = F::zero();
                let spiked = zt[i] != 0;
                for seg in net.recurrent.segments_of(i) {
                    let d = seg.delay as usize;
                    if t + d >= t_len {
                        continue;
                    }
                    let base = ((t + d) % rl) * stride + seg.port as usize;
                    let (a, b) = (seg.start as usize, seg.end as usize);
                    let mu = &adj.mu[base..];
                    let offs = &net.recurrent.target_off[a..b];
                    acc += gather_dot(&w_rec[a..b], offs, mu);
                    if spiked {
                        for (g, &off) in grad[a..b].iter_mut().zip(offs) {
                            *g += mu[off as usize];
                        }
                    }
                }
                adj.gz[i] = acc + gz_rate[i];
            }
            // 4. Input weight gradients.
            if self.opts.train_input_weights {
                let mu = &adj.mu;
                let gin = &mut grad[n_rec..];
                self.inputs.for_each(sample, t, |v, count| {
                    let cnt = count as f64;
                    for seg in net.input.segments_of(v as usize) {
                        let d = seg.delay as usize;
                        if t + d >= t_len {
                            continue;
                        }
                        let base = ((t + d) % rl) * stride + seg.port as usize;
                        for e in seg.start as usize..seg.end as usize {
                            gin[e] += mu[base + net.input.target_off[e] as usize].mulc(cnt);
                        }
                    }
                });
            }
            // 5. Local backward of every neuron through step t.
            for g in &net.groups {
                let c = &g.consts;
                let gp = c.ports.len();
                let ga = c.asc.len();
                for i in g.start..g.end {
                    let pre = l * n + i;
                    let y1 = &tape.y1[pre * np..pre * np + gp];
                    let y2 = &tape.y2[pre * np..pre * np + gp];
                    let ly1 = &mut adj.y1[i * np..i * np + gp];
                    let ly2 = &mut adj.y2[i * np..i * np + gp];
                    // PSC part: y2' = P21 y1 + P22 y2, y1' = P11 y1 + x.
                    for (k, pc) in c.ports.iter().enumerate() {
                        ly1_pre[k] = ly2[k].mulc(pc.p21) + ly1[k].mulc(pc.p11);
                        ly2_pre[k] = ly2[k].mulc(pc.p22);
                    }
                    if tape.refr[pre] == 0 {
                        let asc_pre = &tape.asc[pre * na..pre * na + ga];
                        asc_tmp[..ga].copy_from_slice(asc_pre);
                        let un = membrane_update(c, tape.u[pre], &mut asc_tmp[..ga], y1, y2);
                        let clamped = c.kind == ModelKind::Iaf && un == F::from_f64(c.lower_bound);
                        let zf = zt[i] as f64;
                        let sigma = if clamped {
                            F::zero()
                        } else {
                            F::dz_du(sg, un, c.th)
                        };
                        let lasc = &mut adj.asc[i * na..i * na + ga];
                        let mut lz = adj.gz[i] - adj.u[i].mulc(c.th - c.v_reset);
                        for (a, ac) in c.asc.iter().enumerate() {
                            let ap = asc_tmp[a];
                            lz += lasc[a] * (F::from_f64(ac.amp) + ap.mulc(ac.refr_decay) - ap);
                        }
                        let lun = if clamped {
                            F::zero()
                        } else {
                            adj.u[i] + lz * sigma
                        };
                        for (a, ac) in c.asc.iter().enumerate() {
                            let lap = lasc[a].mulc(1.0 + zf * (ac.refr_decay - 1.0));
                            lasc[a] = lap.mulc(ac.decay) + lun.mulc(c.p30).mulc(ac.stable);
                        }
                        adj.u[i] = match c.kind {
                            ModelKind::Glif => lun.mulc(c.p33),
                            ModelKind::Iaf => lun.mulc(c.expm1_tau_m) + lun,
                        };
                        for (k, pc) in c.ports.iter().enumerate() {
                            ly1_pre[k] += lun.mulc(pc.p31);
                            ly2_pre[k] += lun.mulc(pc.p32);
                        }
                    }
                    ly1.copy_from_slice(&ly1_pre[..gp]);
                    ly2.copy_from_slice(&ly2_pre[..gp]);
                }
            }
        }
    }

    /// Gradient oracle: loss (mean over the batch) and its directional derivative along
    /// `direction` (`[n_params]`), computed by running the forward code on `Dual64` weights.
    pub fn loss_directional_dual(
        &self,
        params: &[f32],
        direction: &[f64],
        first_sample: u64,
        batch: usize,
    ) -> Result<(f64, f64)> {
        if direction.len() != self.n_params() {
            return Err(SnnError::Shape(format!(
                "direction has {} entries, the model {}",
                direction.len(),
                self.n_params()
            )));
        }
        let (w_rec, w_in) = self.weights_f64(params)?;
        let nr = w_rec.len();
        let dw_rec: Vec<Dual64> = w_rec
            .iter()
            .zip(&direction[..nr])
            .map(|(&w, &d)| Dual64::new(w, d))
            .collect();
        let dw_in: Vec<Dual64> = if self.opts.train_input_weights {
            w_in.iter()
                .zip(&direction[nr..])
                .map(|(&w, &d)| Dual64::new(w, d))
                .collect()
        } else {
            w_in.iter().map(|&w| Dual64::new(w, 0.0)).collect()
        };
        let n = self.net.n_neurons();
        let mut total = Dual64::new(0.0, 0.0);
        for b in 0..batch {
            let sample = first_sample + b as u64;
            let mut st = TrialState::<Dual64>::new(&self.net, self.opts.initial);
            let mut z = vec![Dual64::new(0.0, 0.0); n];
            let mut counts = vec![Dual64::new(0.0, 0.0); n];
            let mut vsum = Dual64::new(0.0, 0.0);
            for t in 0..self.opts.seq_len {
                st.step(
                    &self.net,
                    &dw_rec,
                    &dw_in,
                    &self.inputs,
                    sample,
                    t,
                    &self.opts.surrogate,
                    &mut z,
                );
                for (c, &zi) in counts.iter_mut().zip(&z) {
                    *c += zi;
                }
                if self.vreg_cost != 0.0 {
                    for (&u, &th) in st.u.iter().zip(&self.th) {
                        let r = vreg_r_generic(u.mulc(1.0 / th));
                        vsum += r * r;
                    }
                }
            }
            let mut ri = 0;
            for l in &self.opts.losses {
                match l {
                    Loss::TargetFiringRate { .. } => {
                        let (target, scale) = &self.rate_losses[ri];
                        ri += 1;
                        let mut s = Dual64::new(0.0, 0.0);
                        for (c, &tg) in counts.iter().zip(target) {
                            let d = c.mulc(*scale) - Dual64::from_f64(tg);
                            s += d * d;
                        }
                        total += s.mulc(1.0 / n as f64);
                    }
                    Loss::VoltageRegularization { cost } => {
                        total += vsum.mulc(cost / (self.opts.seq_len as f64 * n as f64));
                    }
                }
            }
        }
        let mean = total.mulc(1.0 / batch as f64);
        Ok((mean.re, mean.eps))
    }
}

/// `sum_e w[e] * mu[off[e]]` with four partial sums (breaks the add latency chain).
#[inline]
fn gather_dot<F: Real>(w: &[F], off: &[u32], mu: &[F]) -> F {
    let mut s = [F::zero(); 4];
    let wc = w.chunks_exact(4);
    let tc = off.chunks_exact(4);
    let (wr, tr) = (wc.remainder(), tc.remainder());
    for (w4, t4) in wc.zip(tc) {
        for k in 0..4 {
            s[k] += w4[k] * mu[t4[k] as usize];
        }
    }
    let mut tail = F::zero();
    for (&w1, &t1) in wr.iter().zip(tr) {
        tail += w1 * mu[t1 as usize];
    }
    (s[0] + s[1]) + (s[2] + s[3]) + tail
}

fn sign_of(w: f64) -> i8 {
    if w > 0.0 {
        1
    } else if w < 0.0 {
        -1
    } else {
        0
    }
}
