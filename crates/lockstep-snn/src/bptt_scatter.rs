//! The scatter form of the float32 kernels' adjoint SpMV, for networks whose adjoint rows do
//! not fit in a core's cache (V1 scale).
//!
//! At every backward step the adjoint of each source's spike is
//! `gz[s] = sum_e w_e mu[target_e](t + d_e)` over the source's recurrent edges, with
//! `mu [ring_len, neuron, port, B]` the adjoint of the arrivals (a 16-sample row is one cache
//! line). The gather form ([`crate::bptt_batch`]) walks the edges per source and reads one
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
//! count. The weight gradient of an edge is the same f64 sum over the fired samples as in
//! the gather form, gathered per fired source in CSR order (the parameters' order).
//!
//! Memory: per recurrent edge a 2-byte source (within its block) and a copy of its float32
//! weight (refreshed at every call), and 4 bytes per (block, class, target) of row pointers.

use crate::bptt_batch::{has_avx2, prefetch};
use crate::network::Csr;

/// Sources per block at most: their `gz` rows (64 bytes each at batch 16, 256 KB per block)
/// stay in the 512 KB L2 cache of a Zen 3 core beside the streamed edges and rows. On full
/// V1 at `seq_len` 50, the SpMV took 3.2-3.9 s with 4,096, 4.2 s with 3,072, 4.4-4.8 s with
/// 2,048 (each block re-reads every row of `mu`), 4.5-4.9 s with 8,192 and 4.6-4.7 s with
/// 16,384, against about 6 s for the gather form. Results do not depend on it.
const SCATTER_BLOCK: usize = 4096;

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
        };
        let mut counts = vec![0u32; s.row_ptr.len()];
        s.for_each_key(csr, |key, _, _| counts[key + 1] += 1);
        let mut sum = 0u32;
        for (p, c) in s.row_ptr.iter_mut().zip(&counts) {
            sum += c;
            *p = sum;
        }
        drop(counts);
        let mut pos = s.row_ptr.clone();
        let (mut src, mut w) = (std::mem::take(&mut s.src), std::mem::take(&mut s.w));
        s.for_each_key(csr, |key, e, local| {
            let k = pos[key] as usize;
            pos[key] += 1;
            src[k] = local;
            w[k] = w_rec[e];
        });
        s.src = src;
        s.w = w;
        s
    }

    /// Calls `f(key, csr_slot, source_in_block)` for every edge in CSR order, with `key` the
    /// edge's row-pointer entry (`row_ptr[key]` is the first slot of its row).
    fn for_each_key(&self, csr: &Csr, mut f: impl FnMut(usize, usize, u16)) {
        let (n, np, nc) = (self.n, self.n_ports, self.classes.len());
        for b in 0..self.src_starts.len() - 1 {
            for s in self.src_starts[b]..self.src_starts[b + 1] {
                let local = (s - self.src_starts[b]) as u16;
                for seg in csr.segments_of(s) {
                    let c = self.class_of[seg.delay as usize * np + seg.port as usize] as usize;
                    let r = (b * nc + c) * (n + 1);
                    for e in seg.start as usize..seg.end as usize {
                        let j = csr.target_off[e] as usize / np;
                        f(r + j, e, local);
                    }
                }
            }
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

    /// The adjoint SpMV of one backward step `t` for the sources of block `b`, with their
    /// weight gradients:
    /// `gz[s] = sum_e w_e mu[row_e] + gz_rate[s]` over the edges whose arrival `t + d_e` lies
    /// before `t_len` (scattered per row of `mu`), and, for each source that fired in some
    /// sample, `gr[e] += sum_{l fired} mu[row_e][l]` (f64, samples in order) over its edges in
    /// CSR order (the gather form's sum, on the gather form's random row reads, but for the
    /// fired sources only: walking all edges in this module's order would touch nearly every
    /// line of the gradient at every step).
    ///
    /// `mu` is the adjoint ring `[rl, neuron, port, nb]`; `flags` the step's `[neuron, nb]`
    /// flags (bit `fired`); `gz` and `gz_rate` the block's `[source, nb]` rows; `gr` the
    /// gradient of the block's CSR edges (from the block's first source's first edge).
    #[allow(clippy::too_many_arguments)]
    pub fn block_step(
        &self,
        csr: &Csr,
        b: usize,
        t: usize,
        t_len: usize,
        rl: usize,
        nb: usize,
        mu: &[f32],
        flags: &[u8],
        fired: u8,
        gz: &mut [f32],
        gz_rate: &[f32],
        gr: &mut [f64],
    ) {
        let (n, np) = (self.n, self.n_ports);
        let (s0, s1) = (self.src_starts[b], self.src_starts[b + 1]);
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
        let e0 = csr
            .segments
            .get(csr.seg_ptr[s0] as usize)
            .map_or(csr.len(), |seg| seg.start as usize);
        let mut lanes: Vec<usize> = Vec::with_capacity(nb);
        for s in s0..s1 {
            let f = &flags[s * nb..(s + 1) * nb];
            lanes.clear();
            lanes.extend((0..nb).filter(|&l| f[l] & fired != 0));
            if lanes.is_empty() {
                continue;
            }
            for seg in csr.segments_of(s) {
                let d = seg.delay as usize;
                if t + d >= t_len {
                    continue;
                }
                let base = ((t + d) % rl) * n * np + seg.port as usize;
                let (a, e) = (seg.start as usize, seg.end as usize);
                let offs = &csr.target_off[a..e];
                for (k, &off) in offs.iter().enumerate() {
                    if let Some(&ahead) = offs.get(k + ROW_PREFETCH) {
                        prefetch(mu, (base + ahead as usize) * nb);
                    }
                    let row = &mu[(base + off as usize) * nb..][..nb];
                    let mut acc = 0.0f64;
                    for &l in &lanes {
                        acc += row[l] as f64;
                    }
                    gr[a + k - e0] += acc;
                }
            }
        }
    }

    /// Bytes of the scatter order of `csr` (`n` neurons) for `threads` threads: 2 (source) + 4 (weight) per edge and 4 per row pointer.
    pub fn bytes(csr: &Csr, n: usize, threads: usize) -> u64 {
        let mut seen = std::collections::BTreeSet::new();
        for seg in &csr.segments {
            seen.insert((seg.delay, seg.port));
        }
        6 * csr.len() as u64 + 4 * (n_blocks(n, threads) * seen.len() * (n + 1)) as u64
    }
}

/// Edges ahead whose adjoint rows the weight gradient asks the cache for (random reads).
const ROW_PREFETCH: usize = 16;

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
