//! The reference engine: backpropagation through time of the exact forward recursion, one
//! sample at a time (`docs/neuron-models.md`, "Training"), in double precision (`run.dtype:
//! float64`) or, as the oracle of the float32 engines, in single precision.
//!
//! The forward pass is [`TrialState::step`] on `f64`; the backward pass is its
//! hand-written adjoint, step by step in reverse:
//!
//! * spike: `dz/dU_n = pseudo_derivative(v) / (V_th - E_L)`, `v = U_n / (V_th - E_L)` (surrogate,
//!   see [`Surrogate`]);
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
//! [`loss_directional_dual`] is the gradient oracle: the same forward code on
//! `num_dual::Dual64` weights gives the directional derivative of the loss.

#![allow(clippy::needless_range_loop)] // index loops over parallel arrays read clearer here

use lockstep_core::memory::MemoryEstimate;
use num_dual::Dual64;
use rayon::prelude::*;

use crate::error::{Result, SnnError};
use crate::loss::{vreg_r, vreg_r_generic, Loss};
use crate::network::Network;
use crate::scalar::{Scalar, Surrogate};
use crate::simulation::forward::TrialState;
use crate::simulation::model::ModelKind;
use crate::simulation::step::membrane_update;
use crate::training::options::LossAndGrad;
use crate::training::problem::Problem;

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
        sg.dz_du_f32(u, th as f32)
    }
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

/// Bytes of stored forward state per sample of the reference engine, `(unsegmented,
/// segmented)`: the full per-sample state of every step (f64), or one chunk's plus the
/// state at every chunk boundary.
pub(crate) fn tape_bytes_per_sample(p: &Problem) -> (usize, usize) {
    p.tape_bytes_per_sample()
}

/// The memory the reference engine needs for a local batch of `local_batch` samples, from
/// sizes alone (nothing is allocated): the stored forward state of every sample alive at
/// once (the whole tape, or with `gradient_checkpointing` one chunk plus the chunk-boundary
/// states; [`tape_bytes_per_sample`]), its adjoint state and per-sample gradient
/// (`8 * n_params` bytes each), the batch gradient in f64 and f32, the weights in f64 and the
/// compiled network's per-edge index arrays. Samples alive at once: the rayon threads (at
/// most the batch) when `parallel`, else one.
pub(crate) fn memory_estimate(p: &Problem, local_batch: usize) -> MemoryEstimate {
    p.memory_estimate(local_batch)
}

/// Loss and mean gradient over the local batch of global samples `first_sample ..
/// first_sample + batch`, one sample at a time in precision `F` (each sample its own state
/// `[neuron]`, forward by [`TrialState::step`], backward by the hand-written adjoint,
/// per-sample gradients summed in sample order in f64).
///
/// Errors: `batch == 0`, or `params.len() != n_params()`.
pub(crate) fn loss_and_grad<F: Real>(
    p: &Problem,
    params: &[f32],
    first_sample: u64,
    batch: usize,
) -> Result<LossAndGrad> {
    p.per_sample::<F>(params, first_sample, batch)
}

/// Gradient oracle: loss (mean over the batch) and its directional derivative along
/// `direction` (`[n_params]`), computed by running the forward code on `Dual64` weights.
///
/// Errors: `direction.len()` or `params.len()` not `n_params()`.
pub(crate) fn loss_directional_dual(
    p: &Problem,
    params: &[f32],
    direction: &[f64],
    first_sample: u64,
    batch: usize,
) -> Result<(f64, f64)> {
    p.loss_directional_dual(params, direction, first_sample, batch)
}

impl Problem<'_> {
    fn tape_bytes_per_sample(&self) -> (usize, usize) {
        let t = self.opts.seq_len;
        let full = Tape::bytes(self.net, t);
        let seg = match self.opts.gradient_checkpointing {
            Some(k) => {
                let n = self.net.n_neurons();
                let state = 8
                    * n
                    * (1 + self.net.n_asc
                        + 2 * self.net.n_ports
                        + self.net.ring_len() * self.net.n_ports)
                    + 4 * n;
                Tape::bytes(self.net, k.min(t)) + t.div_ceil(k) * state
            }
            None => full,
        };
        (full, seg)
    }

    fn memory_estimate(&self, local_batch: usize) -> MemoryEstimate {
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

    /// The per-sample BPTT of [`loss_and_grad`].
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
                self.net,
                w_rec,
                w_in,
                self.inputs,
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
                    for (&u, &th) in st.u.iter().zip(self.th) {
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
        for (target, scale) in self.rate_losses {
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
    fn loss_directional_dual(
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
            let mut st = TrialState::<Dual64>::new(self.net, self.opts.initial);
            let mut z = vec![Dual64::new(0.0, 0.0); n];
            let mut counts = vec![Dual64::new(0.0, 0.0); n];
            let mut vsum = Dual64::new(0.0, 0.0);
            for t in 0..self.opts.seq_len {
                st.step(
                    self.net,
                    &dw_rec,
                    &dw_in,
                    self.inputs,
                    sample,
                    t,
                    &self.opts.surrogate,
                    &mut z,
                );
                for (c, &zi) in counts.iter_mut().zip(&z) {
                    *c += zi;
                }
                if self.vreg_cost != 0.0 {
                    for (&u, &th) in st.u.iter().zip(self.th) {
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
