//! The float32 engine's fixed sizes (tasks, blocks, passes, prefetch distances), the flag
//! bits of its tape, and the cell constants in float32 ([`Group32`], built by [`group32`]).
//!
//! The sizes split the work and never the order of a sum: results do not depend on them or
//! on the thread count.

use crate::network::Group;
use crate::simulation::model::ModelKind;

/// Neurons per task of the elementwise passes (fixed: results do not depend on threads).
pub(super) const NEURON_CHUNK: usize = 64;

/// Sources per task of the adjoint SpMV.
pub(super) const SOURCE_CHUNK: usize = 128;

/// Target neurons per block of the spike delivery at most: one task per (sample, block of
/// targets), so no two tasks write the same ring entry, and a task's entries (one sample's
/// targets of the block, 64 KiB per arrival slot and port) stay in the core's cache. Full
/// V1 (66,658 cells) on 2 threads, 50 steps, in two alternating rounds: 3, 4, 5 and 6
/// blocks within the run-to-run spread of each other (forward plus recompute 2.63-2.87 s,
/// 2.64-2.91 s, 2.60-3.17 s, 2.75-2.78 s); with the port-major ring, 2 blocks against 5
/// alternating call by call (five pairs), forward 1.81 against 1.86 s. The blocks split
/// the work, never the order of a sum.
pub(super) const DELIVERY_BLOCK: usize = 16_384;

/// Target neurons per pass of the adjoint SpMV at most: the SpMV gathers only from the
/// targets of one pass at a time, so that the adjoint rows it reads stay in cache on
/// networks whose rows do not fit (full V1: 8.5 MB of rows per step). Fixed, not derived
/// from the batch or the thread count, so every replica sums in the same order.
pub(super) const SPMV_PASS: usize = 32_768;

/// Targets per task of the scatter form's windowed weight gradient (each task owns the
/// edges into its targets; results do not depend on it).
pub(super) const WINDOW_TARGETS: usize = 2048;

/// Networks above this many neurons take the scatter form of the adjoint SpMV
/// ([`SpmvForm::Auto`]); smaller ones, whose adjoint rows stay in cache, the gather form.
pub(super) const SCATTER_MIN_NEURONS: usize = SPMV_PASS;

/// Edges ahead (within a source's segment) whose ring entry the delivery asks the cache
/// for: a block's entries of one sample and two arrival slots (512 KiB at 4 ports when this
/// was measured; in the port-major ring 256 KiB for V1's four classes) do not stay in L2
/// beside the streamed edges, so the adds wait on misses otherwise. Full V1,
/// 50 steps alternating with and without it step by step in one process: the delivery took
/// 0.71-0.82 s against 0.78-0.90 s with 8 edges ahead, 0.64-0.75 s against 0.70-0.83 s
/// with 16; tenth-scale V1 (one block), 500 steps: 1.30-1.42 s against 1.44-1.65 s. With
/// the port-major ring (a block's entries of a class dense, 64 KiB), alternating call by
/// call (four pairs each): forward 1.50 s against 1.65 s without the prefetch, and 32
/// edges ahead even with 16.
pub(super) const RING_PREFETCH: usize = 16;

/// Spiking sources ahead whose edges the delivery asks the cache for (and twice as far
/// ahead, their segments and slot rows, which locating those edges reads).
pub(super) const PREFETCH_SOURCES: usize = 4;

/// Targets (per SpMV pass, or in the network for the delivery) above which the kernels
/// prefetch ([`PREFETCH_EDGES`], [`PREFETCH_SOURCES`]); below, the rows stay in cache and
/// the prefetch instructions only cost time.
pub(super) const PREFETCH_MIN_TARGETS: usize = 2048;

/// Poisson draws per step (nodes x samples) from which the delivery draws them on rayon.
pub(super) const PARALLEL_DRAWS: usize = 4096;

/// Networks up to this many neurons run a parallel call on a rayon worker (see
/// `loss_and_grad_batched`).
pub(super) const WORKER_CALL_MAX_NEURONS: usize = 2048;

/// Flag bit: the neuron was not refractory at the start of the step.
pub(super) const ACTIVE: u8 = 1;

/// Flag bit: the neuron spiked in the step.
pub(super) const FIRED: u8 = 2;

/// Per-port constants in float32.
#[derive(Debug, Clone, Copy)]
pub(super) struct Port32 {
    pub(super) p11: f32,
    pub(super) p21: f32,
    pub(super) p22: f32,
    pub(super) p31: f32,
    pub(super) p32: f32,
    pub(super) psc_init: f32,
}

/// Per after-spike-current constants (float32, and the f64 ones of the spike jump).
#[derive(Debug, Clone, Copy)]
pub(super) struct Asc32 {
    pub(super) stable: f32,
    pub(super) decay: f32,
    pub(super) amp64: f64,
    pub(super) rd64: f64,
    pub(super) amp: f32,
    pub(super) rd: f32,
    /// `1 + (refr_decay - 1)` rounded to f32: `dA''/dA'` at a spike.
    pub(super) jump_slope: f32,
}

/// One cell-type group's constants in float32.
#[derive(Debug, Clone)]
pub(super) struct Group32 {
    pub(super) start: usize,
    pub(super) end: usize,
    pub(super) glif: bool,
    pub(super) p33: f32,
    pub(super) p30: f32,
    pub(super) expm1: f32,
    pub(super) i_e: f32,
    /// iaf_psc_alpha: `(0 + I_e) * P30`.
    pub(super) ie_p30: f32,
    pub(super) th: f64,
    pub(super) th32: f32,
    pub(super) v_reset: f32,
    pub(super) th_minus_reset: f32,
    pub(super) lower_bound: f64,
    pub(super) lb32: f32,
    pub(super) refractory_steps: u32,
    /// The live ports ([`crate::network::Network::live_ports`]) with their constants: the
    /// kernels update, differentiate and write the adjoint rows of these alone (the others
    /// keep `y1 = y2 = 0` and no edge reads their adjoints).
    pub(super) ports: Vec<(usize, Port32)>,
    pub(super) asc: Vec<Asc32>,
}

/// The float32 constants of one group of neurons whose live ports are `live`.
pub(super) fn group32(g: &Group, live: &[usize]) -> Group32 {
    let c = &g.consts;
    Group32 {
        start: g.start,
        end: g.end,
        glif: c.kind == ModelKind::Glif,
        p33: c.p33 as f32,
        p30: c.p30 as f32,
        expm1: c.expm1_tau_m as f32,
        i_e: c.i_e as f32,
        ie_p30: (0.0 + c.i_e) as f32 * c.p30 as f32,
        th: c.th,
        th32: c.th as f32,
        v_reset: c.v_reset as f32,
        th_minus_reset: (c.th - c.v_reset) as f32,
        lower_bound: c.lower_bound,
        lb32: c.lower_bound as f32,
        refractory_steps: c.refractory_steps,
        ports: live
            .iter()
            .map(|&k| {
                let p = &c.ports[k];
                let p32 = Port32 {
                    p11: p.p11 as f32,
                    p21: p.p21 as f32,
                    p22: p.p22 as f32,
                    p31: p.p31 as f32,
                    p32: p.p32 as f32,
                    psc_init: p.psc_init as f32,
                };
                (k, p32)
            })
            .collect(),
        asc: c
            .asc
            .iter()
            .map(|a| Asc32 {
                stable: a.stable as f32,
                decay: a.decay as f32,
                amp64: a.amp,
                rd64: a.refr_decay,
                amp: a.amp as f32,
                rd: a.refr_decay as f32,
                jump_slope: (1.0 + (a.refr_decay - 1.0)) as f32,
            })
            .collect(),
    }
}
