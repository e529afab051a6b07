//! The float32 engine's kernel: one call's constants, buffers' shapes and work split
//! ([`Kernel`], built by [`Kernel::new`]), and the split of the targets into blocks
//! ([`TargetBlocks`]). Its passes are in sibling files: the forward step (`forward.rs`), the
//! spike delivery (`delivery.rs`), the backward step (`backward.rs`) and the whole passes
//! (`passes.rs`).

#![allow(clippy::needless_range_loop)] // index loops over parallel arrays read clearer here

use rayon::prelude::*;

use crate::network::Csr;
use crate::scalar::Surrogate;
use crate::simulation::model::InitialState;
use crate::training::cpu_f32::consts::{
    group32, Group32, DELIVERY_BLOCK, NEURON_CHUNK, PREFETCH_MIN_TARGETS, SPMV_PASS,
};
use crate::training::cpu_f32::scatter::ScatterSpmv;
use crate::training::cpu_f32::simd::{exact_div, prefetch, LineAligned};
use crate::training::cpu_f32::workspace::{mu_ring_len, uses_scatter, State};
use crate::training::problem::Problem;

/// A split of the target neurons into contiguous blocks, with each CSR segment's slots per
/// block.
pub(super) struct TargetBlocks {
    /// `[n_blocks + 1]` first target neuron of each block (last: the neuron count).
    pub(super) starts: Vec<usize>,
    /// `[segment, n_blocks + 1]`: row `g` holds, for each block `k`, the first slot of CSR
    /// segment `g` whose target lies in block `k` or later (last: the segment's end).
    /// Targets ascend within a segment, so block `k`'s edges of segment `g` are the slots
    /// `slots[g][k] .. slots[g][k + 1]`. Segment-major: a source's segments are adjacent,
    /// so the rows of one source share a cache line or two.
    pub(super) slots: Vec<u32>,
}

impl TargetBlocks {
    /// `n` neurons in `n_blocks` blocks of equal size (within one) over the segments of `csr`.
    pub(super) fn new(csr: &Csr, np: usize, n: usize, n_blocks: usize) -> Self {
        let n_blocks = n_blocks.clamp(1, n.max(1));
        let starts: Vec<usize> = (0..=n_blocks).map(|k| n * k / n_blocks).collect();
        let mut slots = Vec::with_capacity(csr.segments.len() * (n_blocks + 1));
        for seg in &csr.segments {
            let mut e = seg.start as usize;
            for k in 0..n_blocks {
                let first = (starts[k] * np) as u64;
                while e < seg.end as usize && (csr.target_off[e] as u64) < first {
                    e += 1;
                }
                slots.push(e as u32);
            }
            slots.push(seg.end);
        }
        TargetBlocks { starts, slots }
    }

    pub(super) fn len(&self) -> usize {
        self.starts.len() - 1
    }

    /// The CSR slots of segment `g` whose targets lie in blocks `k0..k1`.
    #[inline]
    pub(super) fn range(&self, g: usize, k0: usize, k1: usize) -> (usize, usize) {
        let row = g * self.starts.len();
        (self.slots[row + k0] as usize, self.slots[row + k1] as usize)
    }

    /// Asks the cache for the rows of segments `g0..g1` (a source's, read soon).
    #[inline(always)]
    pub(super) fn prefetch_rows(&self, g0: usize, g1: usize) {
        let w = self.starts.len();
        for i in (g0 * w..g1 * w)
            .step_by(16)
            .chain((g1 > g0).then(|| g1 * w - 1))
        {
            prefetch(&self.slots, i);
        }
    }
}

pub(super) struct Kernel<'a> {
    /// The model.
    pub(super) m: Problem<'a>,
    pub(super) groups: Vec<Group32>,
    /// Samples (lanes).
    pub(super) nb: usize,
    pub(super) n: usize,
    pub(super) np: usize,
    pub(super) na: usize,
    pub(super) rl: usize,
    /// Steps the adjoint ring keeps: `rl`, or in the scatter form `GRAD_WINDOW + max_delay`
    /// (the windowed weight gradient reads the steps of a whole window).
    pub(super) rl_mu: usize,
    pub(super) t_len: usize,
    pub(super) w_rec: &'a [f32],
    pub(super) w_in: Vec<f32>,
    pub(super) samples: Vec<u64>,
    pub(super) parallel: bool,
    pub(super) sg: Surrogate,
    /// `[max_delay + 1]` recurrent edges per delay (steps).
    pub(super) edges_by_delay: Vec<u64>,
    /// Whether the delivery prefetches (networks whose edges do not fit in cache).
    pub(super) prefetch_delivery: bool,
    /// `target_off / n_ports` as `(target_off >> shift) * inv` (exact: `target_off` is a
    /// multiple of `n_ports`; `inv` is the inverse of its odd part modulo 2^32).
    pub(super) port_div: (u32, u32),
    /// `[n_chunks, n_ports]` whether some group of the neuron chunk receives on the port
    /// (no edge writes the other ports' ring entries, so the neuron update skips them).
    pub(super) chunk_ports: Vec<bool>,
    /// Target blocks of the delivery over the recurrent CSR ([`DELIVERY_BLOCK`]).
    pub(super) rec_delivery: TargetBlocks,
    /// The same blocks over the input CSR.
    pub(super) in_delivery: TargetBlocks,
    /// Target blocks of the adjoint SpMV's passes ([`SPMV_PASS`]).
    pub(super) spmv_passes: TargetBlocks,
    /// The edges in the scatter form's order when the adjoint SpMV takes that form.
    pub(super) scatter: Option<ScatterSpmv>,
}

impl<'a> Kernel<'a> {
    /// The kernel of `batch` samples from `first_sample` with parameters `params` (checked
    /// by the caller: `m.n_params()` of them), in `reuse`'s scatter order when given (the
    /// one a previous call on `m` with the same thread count built).
    pub(super) fn new(
        m: Problem<'a>,
        params: &'a [f32],
        first_sample: u64,
        batch: usize,
        reuse: Option<ScatterSpmv>,
    ) -> Self {
        let net = &m.net;
        let n_rec = net.weights_rec.len();
        let nb = batch;
        let w_in: Vec<f32> = if m.opts.train_input_weights {
            params[n_rec..].to_vec()
        } else {
            net.weights_in.iter().map(|&w| w as f32).collect()
        };
        let n = net.n_neurons();
        let threads = if m.opts.parallel {
            rayon::current_num_threads()
        } else {
            1
        };
        let n_delivery = n.div_ceil(DELIVERY_BLOCK);
        let (rec, w_rec) = (&net.recurrent, &params[..n_rec]);
        let scatter = uses_scatter(&m).then(|| match reuse {
            Some(mut sc) if sc.fits(rec, n, net.n_ports, threads) => {
                sc.set_weights(rec, w_rec);
                sc
            }
            _ => ScatterSpmv::new(rec, n, net.n_ports, threads, w_rec),
        });
        Kernel {
            m,
            groups: net
                .groups
                .iter()
                .zip(m.live_ports)
                .map(|(g, live)| group32(g, live))
                .collect(),
            nb,
            n,
            np: net.n_ports,
            na: net.n_asc,
            rl: net.ring_len(),
            rl_mu: mu_ring_len(&m),
            t_len: m.opts.seq_len,
            w_rec: &params[..n_rec],
            w_in,
            samples: (0..nb as u64).map(|b| first_sample + b).collect(),
            parallel: m.opts.parallel,
            sg: m.opts.surrogate,
            edges_by_delay: {
                let mut c = vec![0u64; net.max_delay + 1];
                for seg in &net.recurrent.segments {
                    c[seg.delay as usize] += (seg.end - seg.start) as u64;
                }
                c
            },
            prefetch_delivery: n > PREFETCH_MIN_TARGETS,
            port_div: exact_div(net.n_ports),
            chunk_ports: {
                let np = net.n_ports;
                let mut live = vec![false; n.div_ceil(NEURON_CHUNK) * np];
                for (g, ports) in net.groups.iter().zip(m.live_ports) {
                    let chunks = g.start / NEURON_CHUNK..g.end.div_ceil(NEURON_CHUNK);
                    for c in chunks.filter(|_| g.start < g.end) {
                        for &k in ports {
                            live[c * np + k] = true;
                        }
                    }
                }
                live
            },
            rec_delivery: TargetBlocks::new(&net.recurrent, net.n_ports, n, n_delivery),
            in_delivery: TargetBlocks::new(&net.input, net.n_ports, n, n_delivery),
            // Unused by the scatter form: one pass then (its table costs no walk of the edges).
            spmv_passes: TargetBlocks::new(
                &net.recurrent,
                net.n_ports,
                n,
                match scatter {
                    Some(_) => 1,
                    None => n.div_ceil(m.opts.spmv_pass_targets.unwrap_or(SPMV_PASS).max(1)),
                },
            ),
            scatter,
        }
    }

    /// Runs `f` for every task `0..n_tasks`, on rayon when the call is parallel.
    pub(super) fn tasks(&self, n_tasks: usize, f: impl Fn(usize) + Sync + Send) {
        if self.parallel {
            (0..n_tasks).into_par_iter().for_each(f);
        } else {
            (0..n_tasks).for_each(f);
        }
    }

    /// The initial forward state of the batch (at rest, or NEST's initial values).
    pub(super) fn new_state(&self) -> State {
        let (n, b, np, na) = (self.n, self.nb, self.np, self.na);
        let mut u = vec![0.0f32; n * b];
        let mut asc = vec![0.0f32; n * na * b];
        if self.m.opts.initial == InitialState::Nest {
            for g in &self.m.net.groups {
                for i in g.start..g.end {
                    u[i * b..(i + 1) * b].fill(g.consts.u0 as f32);
                    for (a, ac) in g.consts.asc.iter().enumerate() {
                        asc[(i * na + a) * b..(i * na + a + 1) * b].fill(ac.init as f32);
                    }
                }
            }
        }
        State {
            u,
            asc,
            y1: vec![0.0; n * np * b],
            y2: vec![0.0; n * np * b],
            refr: vec![0; n * b],
            ring: LineAligned::zeros(self.rl * n * np * b),
        }
    }

    /// The gradient of [`Kernel::backward_pass`] in float32 and parameter order (the
    /// scatter form accumulates the recurrent weights' gradient in its own edge order).
    pub(super) fn gradient_f32(&self, grad: &[f64]) -> Vec<f32> {
        match &self.scatter {
            Some(sc) => {
                let n_rec = self.w_rec.len();
                let mut out = vec![0.0f32; grad.len()];
                sc.to_csr_order(&self.m.net.recurrent, &grad[..n_rec], &mut out[..n_rec]);
                for (o, &g) in out[n_rec..].iter_mut().zip(&grad[n_rec..]) {
                    *o = g as f32;
                }
                out
            }
            None => grad.iter().map(|&x| x as f32).collect(),
        }
    }
}
