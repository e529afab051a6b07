//! The scatter form of the float32 kernels' adjoint SpMV, for networks whose adjoint rows do
//! not fit in a core's cache (V1 scale).
//!
//! At every backward step the adjoint of each source's spike is
//! `gz[s] = sum_e w_e mu[target_e](t + d_e)` over the source's recurrent edges, with
//! `mu [ring_len, neuron, port, B]` the adjoint of the arrivals (a 16-sample row is one cache
//! line). The gather form (`kernel.rs`, `backward.rs`) walks the edges per source and reads one
//! random row of `mu` per edge; on full V1 those reads miss the core's caches and bound the
//! pass. The scatter form walks the same edges per target instead: the sources are split
//! into blocks whose `gz` rows (`[source, B]`, 32 KB per 512 sources at batch 16) stay in the
//! core's L2 cache, and a block's task reads each row of `mu` once, in order, and adds
//! `w_e mu[row]` into the `gz` rows of the row's edges from the block's sources. The random
//! accesses then hit L2 instead of the last-level cache or memory.
//!
//! Order of the sums: a source's `gz` sums its edges by (delay, port) class, then by target,
//! then by CSR slot, one term at a time in float32 (the gather form sums in CSR order with
//! four partial sums, as the per-sample reference does; the two differ by rounding). The
//! order does not depend on the blocks, so the results are bitwise the same for any thread
//! count.
//!
//! The recurrent weight gradient, `dL/dw_e = sum_t sum_{samples l where source_e fired at t}
//! mu[target_e](t + d_e)[l]`, is taken per window of [`GRAD_WINDOW`] steps
//! ([`ScatterSpmv::window_gradient`]): the backward pass records the window's spikes per
//! source ([`SpikeWindow`]) and, when it reaches the window's first step, walks the edges
//! per target: a target's adjoint rows of the window's steps are read once and stay in L1,
//! and every edge into it adds the values at its source's spikes. The adjoint ring keeps
//! `GRAD_WINDOW + max_delay` steps for that. Per edge and window the sum is in float32, in
//! the order of the source's spikes (steps, then samples), and is added to an f64
//! accumulator in this module's edge order ([`ScatterSpmv::to_csr_order`] puts it in the
//! parameters' order at the end); the windows start at multiples of `GRAD_WINDOW`, so the
//! sums do not depend on the thread count or on the segments of segmented BPTT. Gathering
//! per fired source at every step (the gather form's way) reads one random adjoint row per
//! edge and spike instead: on full V1 about 5 million per step, where the windows read one
//! random 32-byte spike record per edge and window (1.5 million per step).
//!
//! Memory: per recurrent edge a 2-byte source (within its block) and a copy of its float32
//! weight (refreshed at every call), and 4 bytes per (block, class, target) of row pointers;
//! the longer adjoint ring (full V1 at batch 16: 18 steps of 17 MB instead of 3) and the
//! window's spikes ([`SpikeWindow::bytes`]).

use crate::network::Csr;
use crate::training::cpu_f32::simd::{has_avx2, prefetch, Shared};
use rayon::prelude::*;

/// Sources per block at most: their `gz` rows (64 bytes each at batch 16, 256 KB per block)
/// stay in the 512 KB L2 cache of a Zen 3 core beside the streamed edges and rows. On full
/// V1 at `seq_len` 50, the SpMV took 3.2-3.9 s with 4,096, 4.2 s with 3,072, 4.4-4.8 s with
/// 2,048 (each block re-reads every row of `mu`), 4.5-4.9 s with 8,192 and 4.6-4.7 s with
/// 16,384, against about 6 s for the gather form. Results do not depend on it.
pub const SCATTER_BLOCK: usize = 4096;

/// Blocks of sources for `n` neurons and `threads` threads: at most [`SCATTER_BLOCK`]
/// sources each, a multiple of the thread count (so that the threads get equal shares).
fn n_blocks(n: usize, threads: usize) -> usize {
    let threads = threads.max(1);
    n.div_ceil(SCATTER_BLOCK)
        .div_ceil(threads)
        .saturating_mul(threads)
        .clamp(1, n.max(1))
}

/// The recurrent edges ordered by source block, (delay, port) class, target and CSR slot.
#[derive(Debug)]
pub(crate) struct ScatterSpmv {
    /// `[n_blocks + 1]` first source of each block (last: the neuron count).
    pub src_starts: Vec<usize>,
    /// `(delay in steps, port)` of each class, ascending.
    pub classes: Vec<(usize, usize)>,
    /// `[n_blocks, n_classes, n + 1]`: edges of block `b`, class `c` and target `j` are
    /// `row_ptr[r + j] .. row_ptr[r + j + 1]` with `r = (b * n_classes + c) * (n + 1)`.
    pub row_ptr: Vec<u32>,
    /// `[edge]` source minus its block's first source.
    pub src: Vec<u16>,
    /// `[edge]` weight (a copy of the recurrent parameters in this order).
    pub w: Vec<f32>,
    /// Neurons (sources and targets).
    n: usize,
    /// Receptor ports per neuron (`Csr::target_off` is `target * n_ports`).
    n_ports: usize,
    /// `[max_delay + 1, n_ports]` class of each (delay, port), `u8::MAX` where none.
    class_of: Vec<u8>,
    /// `[n_classes, n]` whether the target has edges of the class (from any block).
    live: Vec<bool>,
    /// Whether the per-block passes of construction and reordering run on rayon.
    parallel: bool,
}

impl ScatterSpmv {
    /// The scatter order of `csr` (`n` neurons, `n_ports` ports) in blocks of sources for
    /// `threads` threads, with the weights `w_rec` (`[edge]`, CSR order).
    ///
    /// # Panics
    /// If the network has more than 255 (delay, port) classes or `u32::MAX` edges (the
    /// caller uses the gather form then).
    pub fn new(csr: &Csr, n: usize, n_ports: usize, threads: usize, w_rec: &[f32]) -> Self {
        let max_delay = csr
            .segments
            .iter()
            .map(|s| s.delay as usize)
            .max()
            .unwrap_or(0);
        let mut class_of = vec![u8::MAX; (max_delay + 1) * n_ports];
        for seg in &csr.segments {
            class_of[seg.delay as usize * n_ports + seg.port as usize] = 0;
        }
        let mut classes = Vec::new();
        for (k, c) in class_of.iter_mut().enumerate() {
            if *c == 0 {
                assert!(classes.len() < u8::MAX as usize, "too many classes");
                *c = classes.len() as u8;
                classes.push((k / n_ports, k % n_ports));
            }
        }
        assert!(csr.len() < u32::MAX as usize, "too many edges");
        let n_blocks = n_blocks(n, threads);
        let src_starts: Vec<usize> = (0..=n_blocks).map(|k| n * k / n_blocks).collect();
        let mut s = ScatterSpmv {
            src_starts,
            row_ptr: vec![0; n_blocks * classes.len() * (n + 1)],
            classes,
            src: vec![0; csr.len()],
            w: vec![0.0; csr.len()],
            n,
            n_ports,
            class_of,
            live: Vec::new(),
            parallel: threads > 1,
        };
        // A block's sources are contiguous, so its edges are the CSR slots of its sources,
        // in another order: each block fills its own row pointers and slots.
        let (mut row_ptr, mut src, mut w) = (
            std::mem::take(&mut s.row_ptr),
            std::mem::take(&mut s.src),
            std::mem::take(&mut s.w),
        );
        let parts: Vec<_> = (s.block_rows_of(&mut row_ptr).into_iter())
            .zip(s.block_slots(csr, &mut src))
            .zip(s.block_slots(csr, &mut w))
            .collect();
        s.for_blocks(parts, |b, ((rows, src), w)| {
            let (r0, base) = (s.block_rows(b).start, csr.edge_start(s.src_starts[b]));
            for_each_key_in_block(&s, csr, b, |key, _, _| rows[key - r0 + 1] += 1);
            let mut sum = base as u32;
            for p in rows.iter_mut() {
                sum += *p;
                *p = sum;
            }
            let mut pos = rows.to_vec();
            for_each_key_in_block(&s, csr, b, |key, e, local| {
                let k = pos[key - r0] as usize - base;
                pos[key - r0] += 1;
                src[k] = local;
                w[k] = w_rec[e];
            });
        });
        s.row_ptr = row_ptr;
        s.src = src;
        s.w = w;
        let nc = s.classes.len();
        let mut live = vec![false; nc * n];
        for b in 0..s.n_blocks() {
            for (c, lc) in live.chunks_exact_mut(n.max(1)).enumerate().take(nc) {
                let rows = s.rows(b, c);
                for (j, l) in lc.iter_mut().enumerate() {
                    *l |= rows[j + 1] > rows[j];
                }
            }
        }
        s.live = live;
        s
    }

    /// Whether this is the scatter order [`ScatterSpmv::new`] builds for `csr` (`n` neurons,
    /// `n_ports` ports) and `threads` threads (the same network: same shape and edge count).
    pub fn fits(&self, csr: &Csr, n: usize, n_ports: usize, threads: usize) -> bool {
        self.n == n
            && self.n_ports == n_ports
            && self.src.len() == csr.len()
            && self.n_blocks() == n_blocks(n, threads)
            && self.parallel == (threads > 1)
    }

    /// Copies the weights `w_rec` (`[edge]`, CSR order) into the scatter order, per block
    /// of sources (on rayon when built for several threads).
    pub fn set_weights(&mut self, csr: &Csr, w_rec: &[f32]) {
        let mut w = std::mem::take(&mut self.w);
        self.for_each_slot(csr, &mut w, |w, base, k, e| w[k - base] = w_rec[e]);
        self.w = w;
    }

    /// Calls `f(part, base, k, e)` for every edge, with `k` its slot in the scatter order,
    /// `e` its CSR slot, and `part` its block's slots `base..` of `v` (an edge array in
    /// either order: a block's edges take the same slots in both), per block of sources
    /// (on rayon when built for several threads).
    fn for_each_slot<T: Send>(
        &self,
        csr: &Csr,
        v: &mut [T],
        f: impl Fn(&mut [T], usize, usize, usize) + Sync + Send,
    ) {
        let mut row_ptr = self.row_ptr.clone();
        let parts: Vec<_> = (self.block_rows_of(&mut row_ptr).into_iter())
            .zip(self.block_slots(csr, v))
            .collect();
        self.for_blocks(parts, |b, (pos, v)| {
            let (r0, base) = (self.block_rows(b).start, csr.edge_start(self.src_starts[b]));
            for_each_key_in_block(self, csr, b, |key, e, _| {
                let k = pos[key - r0] as usize;
                pos[key - r0] += 1;
                f(v, base, k, e);
            });
        });
    }

    /// Row-pointer entries of block `b` (`[n_classes, n + 1]` of them).
    fn block_rows(&self, b: usize) -> std::ops::Range<usize> {
        let len = self.classes.len() * (self.n + 1);
        b * len..(b + 1) * len
    }

    /// Per block its row pointers (`row_ptr`, `[n_blocks, n_classes, n + 1]`): disjoint
    /// parts, one per block.
    fn block_rows_of<'x>(&self, row_ptr: &'x mut [u32]) -> Vec<&'x mut [u32]> {
        row_ptr
            .chunks_mut((self.classes.len() * (self.n + 1)).max(1))
            .chain(std::iter::repeat_with(Default::default))
            .take(self.n_blocks())
            .collect()
    }

    /// Per block its edges' slots of `v` (an edge array in scatter or CSR order: a block's
    /// edges take the same slots in both): disjoint parts, one per block.
    fn block_slots<'x, A>(&self, csr: &Csr, mut v: &'x mut [A]) -> Vec<&'x mut [A]> {
        let mut out = Vec::with_capacity(self.n_blocks());
        for k in 0..self.n_blocks() {
            let len = csr.edge_start(self.src_starts[k + 1]) - csr.edge_start(self.src_starts[k]);
            let (v0, v1) = std::mem::take(&mut v).split_at_mut(len);
            v = v1;
            out.push(v0);
        }
        out
    }

    /// Runs `f(block, part)` for every block's part, on rayon when the structure was built
    /// for several threads (the parts are disjoint, so the results do not depend on it).
    fn for_blocks<P: Send>(&self, parts: Vec<P>, f: impl Fn(usize, P) + Sync + Send) {
        if self.parallel {
            parts.into_par_iter().enumerate().for_each(|(b, p)| f(b, p));
        } else {
            parts.into_iter().enumerate().for_each(|(b, p)| f(b, p));
        }
    }

    /// Blocks of sources.
    pub fn n_blocks(&self) -> usize {
        self.src_starts.len() - 1
    }

    /// The edges of block `b`, class `c`: row pointers `[n + 1]` (global edge slots).
    #[inline]
    pub fn rows(&self, b: usize, c: usize) -> &[u32] {
        let r = (b * self.classes.len() + c) * (self.n + 1);
        &self.row_ptr[r..r + self.n + 1]
    }

    /// The adjoint SpMV of one backward step `t` for the sources of block `b`:
    /// `gz[s] = sum_e w_e mu[row_e] + gz_rate[s]` over the edges whose arrival `t + d_e` lies
    /// before `t_len` (scattered per row of `mu`). The weight gradient is not computed here
    /// but per window of steps ([`ScatterSpmv::window_gradient`]).
    ///
    /// `mu` is the adjoint ring `[rl, neuron, port, nb]`; `gz` and `gz_rate` the block's
    /// `[source, nb]` rows.
    #[allow(clippy::too_many_arguments)]
    pub fn block_step(
        &self,
        b: usize,
        t: usize,
        t_len: usize,
        rl: usize,
        nb: usize,
        mu: &[f32],
        gz: &mut [f32],
        gz_rate: &[f32],
    ) {
        let (n, np) = (self.n, self.n_ports);
        gz.fill(0.0);
        let avx2 = has_avx2();
        for (c, &(d, p)) in self.classes.iter().enumerate() {
            if t + d >= t_len {
                continue;
            }
            let args = ScatterRows {
                rows: self.rows(b, c),
                src: &self.src,
                w: &self.w,
                mu,
                base: ((t + d) % rl) * n * np + p,
                np,
                nb,
            };
            if avx2 {
                // SAFETY: the CPU has AVX2 (checked at run time).
                unsafe { scatter_rows_avx2(args, gz) }
            } else {
                scatter_rows(args, gz);
            }
        }
        for (g, r) in gz.iter_mut().zip(gz_rate) {
            *g += r;
        }
    }

    /// The recurrent weight gradient of one window of steps for the edges into targets
    /// `j0..j1`: `gs[k] += sum_{(step, lane) in spikes of source_k} mu[row_k](step + d_k)[lane]`
    /// for every edge `k` (scatter order), the terms whose arrival lies at or after `t_len`
    /// taken as zero: the window's sum in float32 (the source's spikes in
    /// [`SpikeWindow`]'s order, the inline ones in two alternating partial sums, then the
    /// further ones), added to the f64 gradient.
    ///
    /// Per class and chunk of [`WINDOW_TARGET_CHUNK`] targets, the targets' adjoint rows of
    /// the window's steps are copied once into a buffer that stays in L1; then every block
    /// of sources walks its edges into those targets, a contiguous run of the scatter
    /// order, reading each edge's source's spikes of the window from a fixed-size record
    /// (one random read per edge). Gathering per fired source at every step instead reads
    /// one random row per edge and step of a spike (full V1: about 5 million per step).
    ///
    /// `mu` is the adjoint ring `[rl, neuron, port, nb]`, holding the steps after every step
    /// of the window up to `max_delay` later (the caller sizes the ring so); `gs` the
    /// gradient in scatter order, of which this call adds to the edges into `j0..j1` alone.
    ///
    /// # Safety
    /// No other task may access the entries of `gs` of the edges into `j0..j1` at the same
    /// time.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn window_gradient(
        &self,
        j0: usize,
        j1: usize,
        win: &SpikeWindow,
        t_len: usize,
        rl: usize,
        nb: usize,
        mu: &[f32],
        gs: Shared<f64>,
    ) {
        let (n, np) = (self.n, self.n_ports);
        let Some(w0) = win.start else { return };
        // Per target of the chunk, its row's adjoints of the window's steps `[step, lane]`
        // and a zero (the unused inline spikes point to it).
        let per_target = GRAD_WINDOW * nb + 1;
        let mut loc = vec![0.0f32; WINDOW_TARGET_CHUNK * per_target];
        for (c, &(d, p)) in self.classes.iter().enumerate() {
            // The first ring row of each step of the window at delay d (None where the
            // arrival lies at or after t_len).
            let slot_rows: Vec<Option<usize>> = (0..GRAD_WINDOW)
                .map(|rel| (w0 + rel + d < t_len).then(|| ((w0 + rel + d) % rl) * n * np))
                .collect();
            let live = &self.live[c * n..(c + 1) * n];
            for ja in (j0..j1).step_by(WINDOW_TARGET_CHUNK) {
                let je = (ja + WINDOW_TARGET_CHUNK).min(j1);
                if !live[ja..je].iter().any(|&x| x) {
                    continue;
                }
                for j in ja..je {
                    if !live[j] {
                        continue;
                    }
                    let lt = &mut loc[(j - ja) * per_target..][..per_target];
                    for (rel, r) in slot_rows.iter().enumerate() {
                        let dst = &mut lt[rel * nb..(rel + 1) * nb];
                        match r {
                            Some(r) => dst.copy_from_slice(&mu[(r + j * np + p) * nb..][..nb]),
                            None => dst.fill(0.0),
                        }
                    }
                }
                for b in 0..self.n_blocks() {
                    let rows = self.rows(b, c);
                    let s0 = self.src_starts[b];
                    let k_end = rows[je] as usize;
                    for j in ja..je {
                        let lt = &loc[(j - ja) * per_target..][..per_target];
                        for k in rows[j] as usize..rows[j + 1] as usize {
                            // Ask for the spikes of the source of an edge ahead (a random
                            // read of a table that does not fit in L2).
                            if k + SPIKES_PREFETCH < k_end {
                                let ahead = s0 + self.src[k + SPIKES_PREFETCH] as usize;
                                prefetch(&win.inline, ahead * SPIKE_RECORD);
                            }
                            let s = s0 + self.src[k] as usize;
                            let rec = &win.inline[s * SPIKE_RECORD..(s + 1) * SPIKE_RECORD];
                            let (mut a0, mut a1) = (0.0f32, 0.0f32);
                            for q in (0..INLINE_SPIKES - 1).step_by(2) {
                                a0 += lt[rec[q] as usize];
                                a1 += lt[rec[q + 1] as usize];
                            }
                            a0 += lt[rec[INLINE_SPIKES - 1] as usize];
                            let mut acc = a0 + a1;
                            if rec[INLINE_SPIKES] != 0 {
                                for &e in win.spilled(s) {
                                    acc += lt[e as usize];
                                }
                            }
                            // SAFETY: edge k goes into target j, which this task alone
                            // handles (the caller's contract).
                            unsafe { gs.add(k, acc as f64) };
                        }
                    }
                }
            }
        }
    }

    /// The gradient `gs` (scatter order, f64) in CSR order and float32 (`out`, `[edge]`),
    /// per block of sources (on rayon when built for several threads).
    pub fn to_csr_order(&self, csr: &Csr, gs: &[f64], out: &mut [f32]) {
        self.for_each_slot(csr, out, |out, base, k, e| out[e - base] = gs[k] as f32);
    }

    /// Bytes of the scatter order of `csr` (`n` neurons) for `threads` threads: 2 (source) +
    /// 4 (weight) per edge, 4 per row pointer and 1 per (class, target).
    pub fn bytes(csr: &Csr, n: usize, threads: usize) -> u64 {
        let mut seen = std::collections::BTreeSet::new();
        for seg in &csr.segments {
            seen.insert((seg.delay, seg.port));
        }
        6 * csr.len() as u64
            + 4 * (n_blocks(n, threads) * seen.len() * (n + 1)) as u64
            + (seen.len() * n) as u64
    }
}

/// Calls `f(key, csr_slot, source_in_block)` for every edge of the sources of block `b` of
/// `sc`, in CSR order, with `key` the edge's row-pointer entry (`row_ptr[key]` is the first
/// slot of its row).
fn for_each_key_in_block(
    sc: &ScatterSpmv,
    csr: &Csr,
    b: usize,
    mut f: impl FnMut(usize, usize, u16),
) {
    let (n, np, nc) = (sc.n, sc.n_ports, sc.classes.len());
    for s in sc.src_starts[b]..sc.src_starts[b + 1] {
        let local = (s - sc.src_starts[b]) as u16;
        for seg in csr.segments_of(s) {
            let c = sc.class_of[seg.delay as usize * np + seg.port as usize] as usize;
            let r = (b * nc + c) * (n + 1);
            for e in seg.start as usize..seg.end as usize {
                let j = csr.target_off[e] as usize / np;
                f(r + j, e, local);
            }
        }
    }
}

/// Steps per window of the recurrent weight gradient ([`ScatterSpmv::window_gradient`]):
/// the adjoint ring then keeps `GRAD_WINDOW + max_delay` steps (full V1: 18 of 17 MB each
/// instead of 3).
pub(crate) const GRAD_WINDOW: usize = 16;

/// Spikes of one source in one window kept in its record ([`SpikeWindow`]): the gradient
/// reads this many per edge, unused ones pointing to a zero (branch-free: the per-edge
/// count of a Poisson-like spike train would mispredict at every edge). Full V1 at batch
/// 16: about 3.7 spikes per source and window on average.
const INLINE_SPIKES: usize = 7;

/// `u32`s per source record: the inline spikes and a flag "more spikes in the spill list"
/// (32 bytes: two records per cache line).
const SPIKE_RECORD: usize = INLINE_SPIKES + 1;

/// Edges ahead (in scatter order) whose source's spikes the windowed gradient asks for.
const SPIKES_PREFETCH: usize = 8;

/// Targets whose adjoint rows of a window [`ScatterSpmv::window_gradient`] keeps at once
/// (1 KB each at batch 16, so 16 KB, in L1).
const WINDOW_TARGET_CHUNK: usize = 16;

/// The spikes of the steps of one window (`GRAD_WINDOW` steps from a multiple of it), as
/// the backward pass meets them (from the last step down), grouped per source for
/// [`ScatterSpmv::window_gradient`]. A spike is stored as its offset `rel * nb + lane` into
/// the window's `[step, lane]` adjoint values of one target row.
#[derive(Debug, Default)]
pub(crate) struct SpikeWindow {
    /// First step of the window (`None` while nothing is recorded).
    start: Option<usize>,
    /// Neurons.
    n: usize,
    /// Lanes (samples).
    nb: usize,
    /// 64-bit words per (neuron, step) of lane bits.
    words: usize,
    /// `[neuron, GRAD_WINDOW, words]` lanes that fired, per step of the window.
    bits: Vec<u64>,
    /// `[neuron, SPIKE_RECORD]` per source its first `INLINE_SPIKES` spikes (steps
    /// ascending, then lanes ascending; `GRAD_WINDOW * nb`, a zero, where there are fewer),
    /// then 1 if it has more (in `spill`), else 0.
    inline: Vec<u32>,
    /// `[neuron + 1]` first of each source's further spikes in `spill`.
    spill_ptr: Vec<u32>,
    /// The spikes after the first `INLINE_SPIKES` of each source.
    spill: Vec<u32>,
}

impl SpikeWindow {
    /// An empty window for `n` neurons and `nb` lanes.
    ///
    /// # Panics
    /// If `GRAD_WINDOW * nb` does not fit in a `u32`.
    pub fn new(n: usize, nb: usize) -> Self {
        assert!(
            GRAD_WINDOW * nb < u32::MAX as usize,
            "batch {nb} too large for the windowed gradient"
        );
        let words = nb.div_ceil(64);
        SpikeWindow {
            start: None,
            n,
            nb,
            words,
            bits: vec![0; n * GRAD_WINDOW * words],
            inline: vec![0; n * SPIKE_RECORD],
            spill_ptr: vec![0; n + 1],
            spill: Vec::new(),
        }
    }

    /// Bytes of a window for `n` neurons and `nb` lanes: the bits, the inline spikes and
    /// the further spikes if every lane of every neuron fired at every step of the window.
    pub fn bytes(n: usize, nb: usize) -> u64 {
        let (n, nb, w) = (n as u64, nb as u64, GRAD_WINDOW as u64);
        8 * n * w * nb.div_ceil(64) + 4 * n * SPIKE_RECORD as u64 + 4 * (n + 1) + 4 * n * nb * w
    }

    /// Records the lanes whose `flags` (`[neuron, nb]`) have bit `fired` at step `t`, which
    /// lies in the window being recorded (if any).
    pub fn record(&mut self, t: usize, flags: &[u8], fired: u8) {
        let w0 = t - t % GRAD_WINDOW;
        debug_assert!(
            self.start.is_none_or(|s| s == w0),
            "step {t} outside the window"
        );
        self.start = Some(w0);
        let rel = t - w0;
        for (i, f) in flags.chunks_exact(self.nb).enumerate().take(self.n) {
            let row = &mut self.bits[(i * GRAD_WINDOW + rel) * self.words..][..self.words];
            for (l, &x) in f.iter().enumerate() {
                if x & fired != 0 {
                    row[l / 64] |= 1 << (l % 64);
                }
            }
        }
    }

    /// Groups the recorded spikes per source, ready for the gradient.
    pub fn group(&mut self) {
        let zero = (GRAD_WINDOW * self.nb) as u32;
        self.spill.clear();
        for i in 0..self.n {
            self.spill_ptr[i] = self.spill.len() as u32;
            let rec = &mut self.inline[i * SPIKE_RECORD..(i + 1) * SPIKE_RECORD];
            rec.fill(zero);
            rec[INLINE_SPIKES] = 0;
            let mut k = 0;
            for rel in 0..GRAD_WINDOW {
                let row = &self.bits[(i * GRAD_WINDOW + rel) * self.words..][..self.words];
                for (w, &word) in row.iter().enumerate() {
                    let mut m = word;
                    while m != 0 {
                        let l = w * 64 + m.trailing_zeros() as usize;
                        let off = (rel * self.nb + l) as u32;
                        if k < INLINE_SPIKES {
                            rec[k] = off;
                        } else {
                            rec[INLINE_SPIKES] = 1;
                            self.spill.push(off);
                        }
                        k += 1;
                        m &= m - 1;
                    }
                }
            }
        }
        self.spill_ptr[self.n] = self.spill.len() as u32;
    }

    /// The spikes of source `s` after its first `INLINE_SPIKES`.
    #[inline]
    fn spilled(&self, s: usize) -> &[u32] {
        &self.spill[self.spill_ptr[s] as usize..self.spill_ptr[s + 1] as usize]
    }

    /// `(neurons, lanes)` of the window.
    pub fn shape(&self) -> (usize, usize) {
        (self.n, self.nb)
    }

    /// Starts the next window (clears the recorded spikes).
    pub fn clear(&mut self) {
        self.start = None;
        self.bits.fill(0);
    }
}

/// What [`scatter_rows`] reads: the row pointers of one block and class (`[n + 1]`), the
/// edges' sources and weights, the adjoint ring `mu` and where the class's rows start in it
/// (`row of target j = base + j * np`, `nb` floats each).
#[derive(Clone, Copy)]
struct ScatterRows<'a> {
    rows: &'a [u32],
    src: &'a [u16],
    w: &'a [f32],
    mu: &'a [f32],
    base: usize,
    np: usize,
    nb: usize,
}

/// [`scatter_rows`] compiled for AVX2.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn scatter_rows_avx2(a: ScatterRows, gz: &mut [f32]) {
    scatter_rows(a, gz)
}

/// Stand-in where AVX2 does not exist (never called: [`has_avx2`] is false).
///
/// # Safety
/// None.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn scatter_rows_avx2(a: ScatterRows, gz: &mut [f32]) {
    scatter_rows(a, gz)
}

/// `gz[src_e] += w_e * mu[row]` for every row of one block and class and each of its edges,
/// in row order, then edge order (`gz` holds the block's `[source, nb]` rows). The lanes go
/// in register-sized blocks of 16, 8, 4 and 1.
#[inline(always)]
fn scatter_rows(a: ScatterRows, gz: &mut [f32]) {
    let mut l0 = 0;
    while l0 < a.nb {
        let rem = a.nb - l0;
        l0 += if rem >= 16 {
            scatter_rows_lanes::<16>(a, l0, gz)
        } else if rem >= 8 {
            scatter_rows_lanes::<8>(a, l0, gz)
        } else if rem >= 4 {
            scatter_rows_lanes::<4>(a, l0, gz)
        } else {
            scatter_rows_lanes::<1>(a, l0, gz)
        };
    }
}

/// [`scatter_rows`] for lanes `l0 .. l0 + L`; returns `L`.
#[inline(always)]
fn scatter_rows_lanes<const L: usize>(a: ScatterRows, l0: usize, gz: &mut [f32]) -> usize {
    let nb = a.nb;
    for j in 0..a.rows.len() - 1 {
        let (e0, e1) = (a.rows[j] as usize, a.rows[j + 1] as usize);
        if e0 == e1 {
            continue;
        }
        let r = (a.base + j * a.np) * nb + l0;
        let row: [f32; L] = a.mu[r..r + L].try_into().expect("L lanes");
        for (&s, &w) in a.src[e0..e1].iter().zip(&a.w[e0..e1]) {
            let g: &mut [f32; L] = (&mut gz[s as usize * nb + l0..][..L])
                .try_into()
                .expect("L lanes");
            for l in 0..L {
                g[l] += w * row[l];
            }
        }
    }
    L
}
