//! Batch-innermost float32 BPTT kernels (`run.dtype: float32`).
//!
//! The equations are those of [`crate::bptt`] (forward: [`crate::step::step_neuron`] on
//! `f32`; backward: its hand-written adjoint), but the whole local batch of `B` samples
//! advances together, with the sample index innermost in every array:
//!
//! * state `u [neuron, B]`, `asc [neuron, n_asc, B]`, `y1`/`y2 [neuron, port, B]`,
//!   `refr [neuron, B]`, and the adjoints alike (the adjoint arrival ring
//!   `[ring_len, neuron, port, B]`); one read of an edge's target index and weight serves
//!   all `B` samples, and the innermost loops run over samples (SIMD over samples). The one
//!   exception is the forward arrival ring, `[ring_len, B, port, neuron]`: spikes are sparse
//!   per sample (about 1.4% of neurons per sample and step in V1), so the delivery adds
//!   each sample's spikes on their own, and a sample-major ring keeps one sample's entries
//!   of a block of targets in the core's cache; port-major within a sample, an edge class
//!   (a delay and a port) writes a dense run of entries rather than one in `n_ports` (V1's
//!   cells receive on 2 of their 4 ports); the neuron update transposes its chunk's entries
//!   of the live ports as it reads them;
//! * per recurrent edge nothing is stored but the CSR target offset (`u32`) and the
//!   trainable `f32` weight itself (the parameter buffer, read in place); delay and port are
//!   per CSR segment; the gradient is accumulated per edge in `f64`;
//! * the stored forward state (the tape) per step and sample-neuron is the pre-reset
//!   potential (or the held potential when refractory), one flag byte (not refractory,
//!   spiked) and the decayed after-spike currents: `4 + 1 + 4 n_asc` bytes; the PSC states
//!   are not needed by the adjoint, which is linear in them. Receptor ports that no edge
//!   reaches ([`crate::network::Network::live_ports`]; excitatory V1 cells receive on 2 of
//!   their 4) are neither updated nor differentiated: their PSCs stay zero and no edge reads
//!   their adjoints. The tape of a whole unsegmented pass keeps the after-spike currents
//!   only every 25 steps and the backward pass rebuilds them from the flags (`5` bytes per
//!   step, see [`Tape`]); the tapes and chunk boundaries are kept from one call to the next
//!   ([`Workspace`]);
//! * event sparsity where it is exact: spikes are delivered, and an edge's weight gradient
//!   accumulated, only at steps where its source spiked in some sample of the batch; the
//!   adjoint of each source's spike, `gz[i] = sum_e w_e mu[target_e](t + d_e)`, is a
//!   transposed sparse matrix-vector product over all edges at every step (the surrogate
//!   derivative is nonzero almost everywhere), with the four partial sums of the per-sample
//!   kernel;
//! * parallelism (rayon) over fixed chunks of neurons (neuron updates, local adjoints), of
//!   sources (the adjoint SpMV and the weight gradient: each source owns its edges) and of
//!   (sample, target block) pairs (spike delivery: each task adds one sample's spikes into
//!   its own targets' ring entries, every entry in the serial order). The chunks do not
//!   depend on the thread count and every sum has a fixed order, so the results are bitwise
//!   the same for any thread count;
//! * cache locality at V1 scale: the rings start on a cache line (a 16-sample row of the
//!   adjoint ring is one line); spike delivery works on blocks of targets whose entries of
//!   one sample fit in the core's cache, and asks for the edges of the sources ahead; the
//!   adjoint SpMV gathers from at most 32,768 targets per pass (their rows then stay in
//!   cache) and, on networks too large for the core's cache, asks for
//!   the rows of the edges ahead and for the edges of the sources ahead (prefetch). Above
//!   32,768 neurons the SpMV takes the scatter form instead ([`crate::bptt_scatter`]: per
//!   row of adjoints into blocks of sources whose adjoints stay in L2; full V1 at
//!   `seq_len` 50: 3.2-3.9 s against about 6 s), with the weight gradient taken per window
//!   of 16 steps and per target ([`crate::bptt_scatter::ScatterSpmv::window_gradient`]; the
//!   adjoint ring then keeps `16 + max_delay` steps) instead of per fired source at every
//!   step ([`crate::SpmvForm`]).
//!
//! Against the per-sample float32 implementation
//! ([`SnnModel::loss_and_grad_reference`] with [`crate::Dtype::Float32`]) the forward pass is
//! bitwise identical (same operations in the same order per sample: same spikes, same
//! states), and with one SpMV pass (up to 32,768 neurons) the adjoints too; with several
//! passes a source's adjoint sums its passes' partial sums, and in the scatter form its
//! edges by (delay, port), target and slot one at a time (rounding differs); the
//! reduction of the weight gradient over samples and steps differs (here per edge in f64
//! over steps and samples, there per sample in f32), and the voltage-regularization sum is
//! reduced per chunk of neurons.
//!
//! Segmented BPTT keeps the state at chunk boundaries and recomputes each chunk, as the
//! per-sample path; recomputation repeats the same operations, so the gradient is bitwise
//! that of the unsegmented pass.

#![allow(clippy::needless_range_loop)] // index loops over parallel arrays read clearer here

use rayon::prelude::*;

use crate::bptt::{LossAndGrad, SnnModel, SpmvForm};
use crate::bptt_scatter::{ScatterSpmv, SpikeWindow, GRAD_WINDOW};
use crate::error::{Result, SnnError};
use crate::loss::vreg_r;
use crate::model::ModelKind;
use crate::scalar::{PseudoDerivative, Surrogate};

/// Neurons per task of the elementwise passes (fixed: results do not depend on threads).
const NEURON_CHUNK: usize = 64;
/// Sources per task of the adjoint SpMV.
const SOURCE_CHUNK: usize = 128;
/// Target neurons per block of the spike delivery at most: one task per (sample, block of
/// targets), so no two tasks write the same ring entry, and a task's entries (one sample's
/// targets of the block, 64 KiB per arrival slot and port) stay in the core's cache. Full
/// V1 (66,658 cells) on 2 threads, 50 steps, in two alternating rounds: 3, 4, 5 and 6
/// blocks within the run-to-run spread of each other (forward plus recompute 2.63-2.87 s,
/// 2.64-2.91 s, 2.60-3.17 s, 2.75-2.78 s); with the port-major ring, 2 blocks against 5
/// alternating call by call (five pairs), forward 1.81 against 1.86 s. The blocks split
/// the work, never the order of a sum.
const DELIVERY_BLOCK: usize = 16_384;
/// Target neurons per pass of the adjoint SpMV at most: the SpMV gathers only from the
/// targets of one pass at a time, so that the adjoint rows it reads stay in cache on
/// networks whose rows do not fit (full V1: 8.5 MB of rows per step). Fixed, not derived
/// from the batch or the thread count, so every replica sums in the same order.
const SPMV_PASS: usize = 32_768;

/// Whether the float32 kernels of `m` take the scatter form of the adjoint SpMV.
pub(crate) fn uses_scatter(m: &SnnModel) -> bool {
    match m.opts.adjoint_spmv {
        SpmvForm::Gather => false,
        SpmvForm::Scatter => true,
        SpmvForm::Auto => m.net.n_neurons() > SCATTER_MIN_NEURONS,
    }
}

/// Steps the adjoint ring of model `m`'s float32 kernels keeps: `max_delay + 1`, or in the
/// scatter form, whose weight gradient reads a whole window of steps, `GRAD_WINDOW +
/// max_delay` (the steps of the window after its first and up to `max_delay` later).
pub(crate) fn mu_ring_len(m: &SnnModel) -> usize {
    if uses_scatter(m) {
        GRAD_WINDOW + m.net.max_delay
    } else {
        m.net.ring_len()
    }
}

/// Targets per task of the scatter form's windowed weight gradient (each task owns the
/// edges into its targets; results do not depend on it).
const WINDOW_TARGETS: usize = 2048;

/// Networks above this many neurons take the scatter form of the adjoint SpMV
/// ([`SpmvForm::Auto`]); smaller ones, whose adjoint rows stay in cache, the gather form.
const SCATTER_MIN_NEURONS: usize = SPMV_PASS;

/// Edges ahead of the current one whose adjoint rows the SpMV asks the cache for: the rows
/// are random reads (a target's row per edge), so on networks whose rows do not fit in the
/// core's cache their latency is hidden only by requesting them early.
const PREFETCH_EDGES: usize = 16;

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
const RING_PREFETCH: usize = 16;

/// Spiking sources ahead whose edges the delivery asks the cache for (and twice as far
/// ahead, their segments and slot rows, which locating those edges reads).
const PREFETCH_SOURCES: usize = 4;

/// Targets (per SpMV pass, or in the network for the delivery) above which the kernels
/// prefetch ([`PREFETCH_EDGES`], [`PREFETCH_SOURCES`]); below, the rows stay in cache and
/// the prefetch instructions only cost time.
const PREFETCH_MIN_TARGETS: usize = 2048;

/// Poisson draws per step (nodes x samples) from which the delivery draws them on rayon.
const PARALLEL_DRAWS: usize = 4096;

/// Networks up to this many neurons run a parallel call on a rayon worker (see
/// `loss_and_grad_batched`).
const WORKER_CALL_MAX_NEURONS: usize = 2048;

/// Flag bit: the neuron was not refractory at the start of the step.
const ACTIVE: u8 = 1;
/// Flag bit: the neuron spiked in the step.
const FIRED: u8 = 2;

/// `dz/dU` of the surrogate in float32 (1/mV), at the pre-reset potential `u` and threshold
/// `th` (both mV rel. `E_L`): `pseudo_derivative(u / th) / th` ([`Surrogate::eval`]).
#[inline]
pub(crate) fn dz_du_f32(sg: &Surrogate, u: f32, th: f32) -> f32 {
    let v = u / th;
    let pd = match sg.kind {
        PseudoDerivative::Gauss => {
            let x = (v - 1.0) / sg.width as f32;
            sg.gain as f32 * (-(x * x)).exp()
        }
        PseudoDerivative::Triangle => {
            sg.gain as f32 * (1.0 - (v - 1.0).abs() / sg.width as f32).max(0.0)
        }
    };
    pd / th
}

/// Per-port constants in float32.
#[derive(Debug, Clone, Copy)]
struct Port32 {
    p11: f32,
    p21: f32,
    p22: f32,
    p31: f32,
    p32: f32,
    psc_init: f32,
}

/// Per after-spike-current constants (float32, and the f64 ones of the spike jump).
#[derive(Debug, Clone, Copy)]
struct Asc32 {
    stable: f32,
    decay: f32,
    amp64: f64,
    rd64: f64,
    amp: f32,
    rd: f32,
    /// `1 + (refr_decay - 1)` rounded to f32: `dA''/dA'` at a spike.
    jump_slope: f32,
}

/// One cell-type group's constants in float32.
#[derive(Debug, Clone)]
struct Group32 {
    start: usize,
    end: usize,
    glif: bool,
    p33: f32,
    p30: f32,
    expm1: f32,
    i_e: f32,
    /// iaf_psc_alpha: `(0 + I_e) * P30`.
    ie_p30: f32,
    th: f64,
    th32: f32,
    v_reset: f32,
    th_minus_reset: f32,
    lower_bound: f64,
    lb32: f32,
    refractory_steps: u32,
    /// The live ports ([`crate::network::Network::live_ports`]) with their constants: the
    /// kernels update, differentiate and write the adjoint rows of these alone (the others
    /// keep `y1 = y2 = 0` and no edge reads their adjoints).
    ports: Vec<(usize, Port32)>,
    asc: Vec<Asc32>,
}

/// Raw shared access to a buffer whose disjoint ranges are written by different tasks.
#[derive(Clone, Copy)]
pub(crate) struct Shared<T>(*mut T, usize);

// SAFETY: the pointer is only dereferenced through `slice`, whose callers guarantee that
// ranges used at the same time by different tasks are disjoint; T is plain data.
unsafe impl<T: Send> Send for Shared<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for Shared<T> {}

impl<T> Shared<T> {
    fn new(v: &mut [T]) -> Self {
        Shared(v.as_mut_ptr(), v.len())
    }
    /// Adds `v` to element `i`.
    ///
    /// # Safety
    /// No other task may access element `i` at the same time.
    #[inline]
    pub(crate) unsafe fn add(&self, i: usize, v: T)
    where
        T: std::ops::AddAssign,
    {
        assert!(i < self.1, "index {i} outside 0..{}", self.1);
        // SAFETY: in bounds (checked above), exclusive by the caller's contract.
        unsafe { *self.0.add(i) += v }
    }

    /// The elements `a..b`.
    ///
    /// # Safety
    /// No other live reference may overlap `a..b` while the returned slice is used.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, a: usize, b: usize) -> &mut [T] {
        assert!(
            a <= b && b <= self.1,
            "range {a}..{b} outside 0..{}",
            self.1
        );
        // SAFETY: in bounds (checked above), exclusive by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(a), b - a) }
    }
}

/// One 64-byte cache line of `f32`s.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; 16]);

/// A zeroed `f32` buffer that starts on a cache-line boundary, so that the 16-sample rows of
/// the arrival ring, its adjoint and the spikes' adjoint (64 bytes at batch 16) each fill
/// exactly one line instead of straddling two.
struct LineAligned {
    lines: Vec<Line>,
    len: usize,
}

impl LineAligned {
    fn zeros(len: usize) -> Self {
        LineAligned {
            lines: vec![Line([0.0; 16]); len.div_ceil(16)],
            len,
        }
    }
}

impl std::fmt::Debug for LineAligned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LineAligned({} f32)", self.len)
    }
}

impl std::ops::Deref for LineAligned {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        // SAFETY: `lines` holds `16 * lines.len() >= len` initialized f32s, contiguous
        // (`Line` is `repr(C)` over `[f32; 16]`, whose size is a multiple of its alignment).
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<f32>(), self.len) }
    }
}

impl std::ops::DerefMut for LineAligned {
    fn deref_mut(&mut self) -> &mut [f32] {
        // SAFETY: as in `deref`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<f32>(), self.len) }
    }
}

/// Forward state of the batch (shapes in the module docs).
#[derive(Debug)]
struct State {
    u: Vec<f32>,
    asc: Vec<f32>,
    y1: Vec<f32>,
    y2: Vec<f32>,
    refr: Vec<u32>,
    /// `[ring_len, B, port, neuron]` synaptic input arriving per step (pA); sample-major, so
    /// that the delivery of one sample's spikes into a block of targets stays in cache, and
    /// port-major, so that the edges of one (delay, port) class add into a dense run.
    ring: LineAligned,
}

/// A chunk boundary of segmented BPTT: the state without its arrival ring, and the spike
/// flags (`[step, neuron, B]`) of the last `min(max_delay, t0)` steps before it.
struct Boundary {
    u: Vec<f32>,
    asc: Vec<f32>,
    y1: Vec<f32>,
    y2: Vec<f32>,
    refr: Vec<u32>,
    flags: Vec<u8>,
}

impl Boundary {
    /// The boundary of state `st` whose last steps' flags are `hist` (oldest first), in
    /// `reuse`'s buffers when given.
    fn of(st: &State, hist: &[&[u8]], reuse: Option<Boundary>) -> Boundary {
        fn copy<T: Copy>(dst: &mut Vec<T>, src: &[T]) {
            dst.clear();
            dst.extend_from_slice(src);
        }
        let mut b = reuse.unwrap_or(Boundary {
            u: Vec::new(),
            asc: Vec::new(),
            y1: Vec::new(),
            y2: Vec::new(),
            refr: Vec::new(),
            flags: Vec::new(),
        });
        copy(&mut b.u, &st.u);
        copy(&mut b.asc, &st.asc);
        copy(&mut b.y1, &st.y1);
        copy(&mut b.y2, &st.y2);
        copy(&mut b.refr, &st.refr);
        b.flags.clear();
        for h in hist {
            b.flags.extend_from_slice(h);
        }
        b
    }
}

/// Stored forward values of `len` consecutive steps.
///
/// The after-spike currents are kept either for every step (`asc_len == len`: the tape of
/// one chunk of segmented BPTT) or, on the tape of a whole unsegmented pass, only at the
/// start of every stretch of [`ASC_STRETCH`] steps (`asc_marks`): the backward pass rebuilds
/// one stretch's currents at a time from its mark and the stored flags
/// ([`Kernel::rebuild_asc`]; the currents evolve with the spikes alone, so the rebuilt
/// values have the forward pass's bits). That stores 5 instead of `5 + 4 n_asc` bytes per
/// sample-neuron and step (full V1, 500 steps, batch 16: 2.7 instead of 6.9 GB).
struct Tape {
    /// `[len, neuron, B]` pre-reset potential (not refractory) or held potential.
    x: Vec<f32>,
    /// `[len, neuron, B]` flags ([`ACTIVE`], [`FIRED`]).
    flags: Vec<u8>,
    /// `[asc_len, neuron, n_asc, B]` after-spike currents after each step's decay: of every
    /// step, or of the stretch last rebuilt.
    asc: Vec<f32>,
    /// `[len.div_ceil(asc_len), neuron, n_asc, B]` after-spike currents at the start of
    /// every stretch (empty when `asc_len == len`, or when the network has no after-spike
    /// currents).
    asc_marks: Vec<f32>,
    /// Steps whose after-spike currents `asc` holds.
    asc_len: usize,
}

impl Tape {
    /// Whether the after-spike currents are kept only at the stretch starts.
    fn marked(&self) -> bool {
        !self.asc_marks.is_empty()
    }
}

/// Steps per stretch of after-spike currents that the backward pass of an unsegmented tape
/// rebuilds at a time ([`Tape`]): the marks and one stretch together take
/// `(len / ASC_STRETCH + ASC_STRETCH)` steps' currents, near the least at 500 steps.
const ASC_STRETCH: usize = 25;

/// The tapes, chunk boundaries and adjoint state of the last call, kept for the next one:
/// their pages are then already mapped (a fresh 2.7 GB tape costs its first writes about
/// 700,000 page faults, seconds on a VM), and the memory a training step needs stays the
/// same.
#[derive(Default)]
pub(crate) struct Workspace {
    tape: Option<Tape>,
    boundaries: Vec<Boundary>,
    /// The adjoint state of an unsegmented call (its ring is 0.3 GB on full V1 in the
    /// scatter form); segmented calls free theirs.
    adjoint: Option<Adjoint>,
    /// The scatter order of an unsegmented call (0.17 GB on full V1; the next call only
    /// copies its weights in, [`ScatterSpmv::set_weights`]); segmented calls free theirs.
    scatter: Option<ScatterSpmv>,
}

/// A [`Workspace`] shared by the calls on one model (cloning a model starts an empty one).
#[derive(Default)]
pub(crate) struct WorkspaceCache(std::sync::Mutex<Workspace>);

impl WorkspaceCache {
    /// Takes the cached buffers (empty ones if another call holds them).
    fn take(&self) -> Workspace {
        match self.0.try_lock() {
            Ok(mut w) => std::mem::take(&mut *w),
            Err(_) => Workspace::default(),
        }
    }

    /// Frees the cached buffers (the next call allocates them again).
    pub(crate) fn release(&self) {
        drop(self.take());
    }

    /// Keeps `w` for the next call.
    fn put(&self, w: Workspace) {
        if let Ok(mut slot) = self.0.try_lock() {
            *slot = w;
        }
    }
}

impl Clone for WorkspaceCache {
    fn clone(&self) -> Self {
        WorkspaceCache::default()
    }
}

impl std::fmt::Debug for WorkspaceCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WorkspaceCache")
    }
}

/// Forward sums for the loss.
struct Acc {
    /// `[neuron, B]` spike counts.
    counts: Vec<u32>,
    /// `[n_chunks, B]` voltage-regularization sums per neuron chunk.
    vreg: Vec<f64>,
    /// `(step, neuron)` spikes (external index) of sample 0 when they are recorded
    /// ([`crate::BpttOptions::record_first_sample`]).
    first: Option<Vec<(u32, u32)>>,
}

/// Adjoint state of the batch.
struct Adjoint {
    u: Vec<f32>,
    asc: Vec<f32>,
    y1: Vec<f32>,
    y2: Vec<f32>,
    /// `[mu_ring_len, neuron, port, B]` adjoints of the arrivals ([`Kernel::rl_mu`] steps).
    mu: LineAligned,
    /// The spikes of the current window of the scatter form's weight gradient.
    window: Option<SpikeWindow>,
    /// `[neuron, B]` adjoint of this step's spikes (line-aligned: the scatter form adds into
    /// random rows of it).
    gz: LineAligned,
}

/// Bytes of the float32 kernels' memory for a model and a local batch.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BatchBytes {
    /// The live forward state, arrival ring included.
    pub state: u64,
    /// One chunk boundary: the state without the ring, and the spike flags of the last
    /// `max_delay` steps from which the ring is rebuilt.
    pub boundary: u64,
    /// The tape of one step without the after-spike currents (potential and flags).
    pub tape_step: u64,
    /// The after-spike currents of one step on the tape (or of one stretch mark).
    pub asc_step: u64,
    /// The adjoint state (with its arrival ring), the direct loss derivatives and, in the
    /// scatter form, the spikes of one window of the weight gradient.
    pub adjoint: u64,
}

/// [`BatchBytes`] of model `m` for `batch` samples.
pub(crate) fn batch_bytes(m: &SnnModel, batch: usize) -> BatchBytes {
    let n = m.net.n_neurons() as u64;
    let b = batch as u64;
    let np = m.net.n_ports as u64;
    let na = m.net.n_asc as u64;
    let rl = m.net.ring_len() as u64;
    let rl_mu = mu_ring_len(m) as u64;
    let core = 4 * n * b * (1 + na + 2 * np + 1);
    let window = if uses_scatter(m) {
        SpikeWindow::bytes(n as usize, batch)
    } else {
        0
    };
    BatchBytes {
        state: core + 4 * n * b * rl * np,
        boundary: core + n * b * m.net.max_delay as u64,
        tape_step: n * b * (4 + 1),
        asc_step: 4 * n * na * b,
        adjoint: 4 * n * b * (1 + na + 2 * np + rl_mu * np + 1) + 4 * n * b + window,
    }
}

impl BatchBytes {
    /// Bytes of a tape of `len` steps ([`Tape`]): with the after-spike currents of every
    /// step (`marked` false: one chunk of segmented BPTT), or of one stretch plus the marks
    /// (the whole unsegmented pass).
    pub fn tape(&self, len: u64, marked: bool) -> u64 {
        let asc_len = if marked {
            (ASC_STRETCH as u64).min(len)
        } else {
            len
        };
        let marks = if asc_len < len {
            len.div_ceil(asc_len.max(1))
        } else {
            0
        };
        self.tape_step
            .saturating_mul(len)
            .saturating_add(self.asc_step.saturating_mul(asc_len + marks))
    }
}

/// True when the CPU runs AVX2 (the SpMV then uses 256-bit vectors; same results, IEEE
/// operations in the same order).
pub(crate) fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Where the adjoint gather of one segment reads: `mu` (`[row, nb]`, the adjoint of the
/// arrivals), the row of the segment's delay slot and port (`row_e = base + offs[e]`), and
/// whether to ask the cache for rows ahead ([`PREFETCH_EDGES`]).
#[derive(Clone, Copy)]
struct Gather<'a> {
    mu: &'a [f32],
    base: usize,
    nb: usize,
    prefetch: bool,
}

/// [`segment_dot`] compiled for AVX2.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn segment_dot_avx2(ws: &[f32], offs: &[u32], g: Gather, acc: &mut [f32]) {
    segment_dot(ws, offs, g, acc)
}

/// Stand-in where AVX2 does not exist (never called: [`has_avx2`] is false).
///
/// # Safety
/// None beyond [`segment_dot`]'s.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn segment_dot_avx2(ws: &[f32], offs: &[u32], g: Gather, acc: &mut [f32]) {
    segment_dot(ws, offs, g, acc)
}

/// The adjoint gather of one CSR segment (or of its edges into one SpMV pass) for all `nb`
/// samples: `acc[l] += (p0 + p1) + (p2 + p3) + tail` with
/// `p_k = sum_{e = k mod 4} w_e mu[row_e][l]` over whole groups of four edges and `tail`
/// over the rest, in edge order (the four partial sums of the per-sample kernel). The lanes
/// go in register-sized blocks of 16, 8, 4 and 1.
#[inline(always)]
fn segment_dot(ws: &[f32], offs: &[u32], g: Gather, acc: &mut [f32]) {
    let mut l0 = 0;
    while l0 < g.nb {
        let rem = g.nb - l0;
        l0 += if rem >= 16 {
            segment_dot_lanes::<16>(ws, offs, g, l0, acc)
        } else if rem >= 8 {
            segment_dot_lanes::<8>(ws, offs, g, l0, acc)
        } else if rem >= 4 {
            segment_dot_lanes::<4>(ws, offs, g, l0, acc)
        } else {
            segment_dot_lanes::<1>(ws, offs, g, l0, acc)
        };
    }
}

/// Asks the cache for the line holding `v[i]` (no effect on results; nothing when `i` is
/// out of range).
#[inline(always)]
pub(crate) fn prefetch<T>(v: &[T], i: usize) {
    if let Some(x) = v.get(i) {
        prefetch_ptr(x);
    }
}

/// Asks the cache for the line at `p` (nothing where the target has no prefetch
/// instruction). A hint: nothing is read, so any address is harmless.
#[inline(always)]
fn prefetch_ptr<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `_mm_prefetch` only hints the cache (SSE, in every x86_64 CPU); it never
    // faults and reads nothing.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast::<i8>())
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Asks the cache for every line of the edge slots `a..b` of a CSR (target offsets `offs`
/// and weights `ws`, both indexed by slot): a piece of a source's edges that the kernel
/// reads next. Pieces of different sources lie apart in memory, so the hardware's stream
/// prefetcher does not fetch them; on V1-sized networks their misses would otherwise
/// dominate the delivery.
#[inline(always)]
fn prefetch_edges(offs: &[u32], ws: &[f32], a: usize, b: usize) {
    // 16 slots of 4 bytes per 64-byte line; the last slot covers a piece straddling a line.
    for e in (a..b).step_by(16).chain((b > a).then(|| b - 1)) {
        prefetch(offs, e);
        prefetch(ws, e);
    }
}

/// [`segment_dot`] for lanes `l0 .. l0 + L`; returns `L`.
#[inline(always)]
fn segment_dot_lanes<const L: usize>(
    ws: &[f32],
    offs: &[u32],
    g: Gather,
    l0: usize,
    acc: &mut [f32],
) -> usize {
    let (mu, base, nb) = (g.mu, g.base, g.nb);
    let mut p = [[0.0f32; L]; 4];
    let mut tail = [0.0f32; L];
    let row = |off: u32| -> &[f32; L] {
        let r = (base + off as usize) * nb + l0;
        mu[r..r + L].try_into().expect("L lanes")
    };
    let mut w4 = ws.chunks_exact(4);
    let mut o4 = offs.chunks_exact(4);
    let ahead = if g.prefetch {
        offs.get(PREFETCH_EDGES..).unwrap_or(&[])
    } else {
        &[]
    };
    for (q, (w, o)) in (&mut w4).zip(&mut o4).enumerate() {
        for &off in ahead.get(4 * q..4 * q + 4).unwrap_or(&[]) {
            prefetch(mu, (base + off as usize) * nb + l0);
        }
        for k in 0..4 {
            let m = row(o[k]);
            for l in 0..L {
                p[k][l] += w[k] * m[l];
            }
        }
    }
    for (&w, &o) in w4.remainder().iter().zip(o4.remainder()) {
        let m = row(o);
        for l in 0..L {
            tail[l] += w * m[l];
        }
    }
    let a = &mut acc[l0..l0 + L];
    for l in 0..L {
        a[l] += (p[0][l] + p[1][l]) + (p[2][l] + p[3][l]) + tail[l];
    }
    L
}

/// First CSR slot of source `s` (the number of edges for `s == n_sources`).
pub(crate) fn edge_start(csr: &crate::network::Csr, s: usize) -> usize {
    csr.segments
        .get(csr.seg_ptr[s] as usize)
        .map_or(csr.len(), |seg| seg.start as usize)
}

/// A split of the target neurons into contiguous blocks, with each CSR segment's slots per
/// block.
struct TargetBlocks {
    /// `[n_blocks + 1]` first target neuron of each block (last: the neuron count).
    starts: Vec<usize>,
    /// `[segment, n_blocks + 1]`: row `g` holds, for each block `k`, the first slot of CSR
    /// segment `g` whose target lies in block `k` or later (last: the segment's end).
    /// Targets ascend within a segment, so block `k`'s edges of segment `g` are the slots
    /// `slots[g][k] .. slots[g][k + 1]`. Segment-major: a source's segments are adjacent,
    /// so the rows of one source share a cache line or two.
    slots: Vec<u32>,
}

impl TargetBlocks {
    /// `n` neurons in `n_blocks` blocks of equal size (within one) over the segments of `csr`.
    fn new(csr: &crate::network::Csr, np: usize, n: usize, n_blocks: usize) -> Self {
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

    fn len(&self) -> usize {
        self.starts.len() - 1
    }

    /// The CSR slots of segment `g` whose targets lie in blocks `k0..k1`.
    #[inline]
    fn range(&self, g: usize, k0: usize, k1: usize) -> (usize, usize) {
        let row = g * self.starts.len();
        (self.slots[row + k0] as usize, self.slots[row + k1] as usize)
    }

    /// Asks the cache for the rows of segments `g0..g1` (a source's, read soon).
    #[inline(always)]
    fn prefetch_rows(&self, g0: usize, g1: usize) {
        let w = self.starts.len();
        for i in (g0 * w..g1 * w)
            .step_by(16)
            .chain((g1 > g0).then(|| g1 * w - 1))
        {
            prefetch(&self.slots, i);
        }
    }
}

struct Kernel<'a> {
    m: &'a SnnModel,
    groups: Vec<Group32>,
    /// Samples (lanes).
    nb: usize,
    n: usize,
    np: usize,
    na: usize,
    rl: usize,
    /// Steps the adjoint ring keeps: `rl`, or in the scatter form `GRAD_WINDOW + max_delay`
    /// (the windowed weight gradient reads the steps of a whole window).
    rl_mu: usize,
    t_len: usize,
    w_rec: &'a [f32],
    w_in: Vec<f32>,
    samples: Vec<u64>,
    parallel: bool,
    sg: Surrogate,
    /// `[max_delay + 1]` recurrent edges per delay (steps).
    edges_by_delay: Vec<u64>,
    /// Whether the delivery prefetches (networks whose edges do not fit in cache).
    prefetch_delivery: bool,
    /// `target_off / n_ports` as `(target_off >> shift) * inv` (exact: `target_off` is a
    /// multiple of `n_ports`; `inv` is the inverse of its odd part modulo 2^32).
    port_div: (u32, u32),
    /// `[n_chunks, n_ports]` whether some group of the neuron chunk receives on the port
    /// (no edge writes the other ports' ring entries, so the neuron update skips them).
    chunk_ports: Vec<bool>,
    /// Target blocks of the delivery over the recurrent CSR ([`DELIVERY_BLOCK`]).
    rec_delivery: TargetBlocks,
    /// The same blocks over the input CSR.
    in_delivery: TargetBlocks,
    /// Target blocks of the adjoint SpMV's passes ([`SPMV_PASS`]).
    spmv_passes: TargetBlocks,
    /// The edges in the scatter form's order when the adjoint SpMV takes that form.
    scatter: Option<ScatterSpmv>,
}

/// Where the time of one [`SnnModel::loss_and_grad_timed`] call went (seconds), and the
/// work of the adjoint's transposed SpMV.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTiming {
    /// The forward pass over all steps (with the loss sums).
    pub forward_s: f64,
    /// Recomputation during the backward pass: segmented BPTT, the chunks' forward passes;
    /// unsegmented, rebuilding the after-spike currents of the tape's stretches.
    pub recompute_s: f64,
    /// The backward pass (adjoints and gradients), the SpMV included.
    pub backward_s: f64,
    /// Of which the transposed SpMV over all recurrent edges with its weight gradient.
    pub adjoint_spmv_s: f64,
    /// Of `adjoint_spmv_s`, the scatter form's recurrent weight gradient, taken per window
    /// of 16 steps and per target; 0 in the gather form, whose SpMV adds the weight gradient
    /// edge by edge.
    pub weight_grad_s: f64,
    /// Recurrent edges the SpMV visited (summed over steps).
    pub adjoint_edges: u64,
    /// Bytes of edge arrays the SpMV streamed for those visits: per edge, the 4-byte target
    /// offset and 4-byte weight in the gather form, the 2-byte source and 4-byte weight in
    /// the scatter form.
    pub adjoint_edge_bytes: u64,
    /// Whether the SpMV took the scatter form ([`crate::SpmvForm`]).
    pub adjoint_scatter: bool,
}

impl<'a> Kernel<'a> {
    fn tasks(&self, n_tasks: usize, f: impl Fn(usize) + Sync + Send) {
        if self.parallel {
            (0..n_tasks).into_par_iter().for_each(f);
        } else {
            (0..n_tasks).for_each(f);
        }
    }

    fn new_state(&self) -> State {
        let (n, b, np, na) = (self.n, self.nb, self.np, self.na);
        let mut u = vec![0.0f32; n * b];
        let mut asc = vec![0.0f32; n * na * b];
        if self.m.opts.initial == crate::forward::InitialState::Nest {
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

    /// One forward step `t`: neuron updates, then delivery of this step's recurrent and
    /// input spikes. `flags` (`[neuron, B]`) and `any` (`[neuron]`) receive the step's
    /// flags; `tape` (x, and asc where the tape keeps every step's) receives the stored
    /// values when given.
    ///
    /// Kept as one function (a kernel over 120 lines): its phases share a dozen per-step
    /// buffers and loop indices, and splitting it would only pass them between helpers.
    fn forward_step(
        &self,
        st: &mut State,
        t: usize,
        flags: &mut [u8],
        any: &mut [u8],
        tape: Option<(&mut [f32], Option<&mut [f32]>)>,
        acc: Option<&mut Acc>,
    ) {
        let (n, nb, np, na) = (self.n, self.nb, self.np, self.na);
        let slot = t % self.rl;
        let stride = n * np * nb;
        let vreg_on = acc.is_some() && self.m.vreg_cost != 0.0;
        let n_chunks = n.div_ceil(NEURON_CHUNK);
        {
            let u = Shared::new(&mut st.u);
            let asc = Shared::new(&mut st.asc);
            let y1 = Shared::new(&mut st.y1);
            let y2 = Shared::new(&mut st.y2);
            let refr = Shared::new(&mut st.refr);
            let ring = Shared::new(&mut st.ring[slot * stride..(slot + 1) * stride]);
            let fl = Shared::new(flags);
            let anyp = Shared::new(any);
            let (mut tx_v, mut ta_v) = (Vec::new(), Vec::new());
            let (tx, ta) = match tape {
                Some((x, Some(a))) => (Shared::new(x), Shared::new(a)),
                Some((x, None)) => (Shared::new(x), Shared::new(&mut ta_v)),
                None => (Shared::new(&mut tx_v), Shared::new(&mut ta_v)),
            };
            let (has_tape, has_asc_tape) = (tx.1 > 0, ta.1 > 0);
            let (mut c_v, mut v_v) = (Vec::new(), Vec::new());
            let (counts, vreg) = match acc {
                Some(a) => (Shared::new(&mut a.counts), Shared::new(&mut a.vreg)),
                None => (Shared::new(&mut c_v), Shared::new(&mut v_v)),
            };
            let has_acc = counts.1 > 0;
            self.tasks(n_chunks, |c| {
                let (i0, i1) = (c * NEURON_CHUNK, ((c + 1) * NEURON_CHUNK).min(n));
                let mut un = vec![0.0f32; nb];
                let mut sum = vec![0.0f32; nb];
                let mut adec = vec![0.0f32; na.max(1) * nb];
                // This step's arrivals at neurons i0..i1 as `[neuron, port, B]`, taken from
                // the sample- and port-major ring slot, which is cleared for the arrivals of
                // t + ring_len.
                let mut arrivals = vec![0.0f32; (i1 - i0) * np * nb];
                let live = &self.chunk_ports[c * np..(c + 1) * np];
                for b in 0..nb {
                    for k in (0..np).filter(|&k| live[k]) {
                        let r = (b * np + k) * n;
                        // SAFETY: lane b's entries of neurons i0..i1, owned by this task alone.
                        let src = unsafe { ring.slice(r + i0, r + i1) };
                        for (j, x) in src.iter_mut().enumerate() {
                            arrivals[(j * np + k) * nb + b] = *x;
                            *x = 0.0;
                        }
                    }
                }
                // SAFETY: the ranges are those of neurons i0..i1 (or chunk c), owned by this
                // task alone (the same holds for every `slice` call of this task).
                let (u, asc, y1, y2, refr, arr, fl, anyv) = unsafe {
                    (
                        u.slice(i0 * nb, i1 * nb),
                        asc.slice(i0 * na * nb, i1 * na * nb),
                        y1.slice(i0 * np * nb, i1 * np * nb),
                        y2.slice(i0 * np * nb, i1 * np * nb),
                        refr.slice(i0 * nb, i1 * nb),
                        &mut arrivals[..],
                        fl.slice(i0 * nb, i1 * nb),
                        anyp.slice(i0, i1),
                    )
                };
                // SAFETY: as above.
                let mut tx = has_tape.then(|| unsafe { tx.slice(i0 * nb, i1 * nb) });
                // SAFETY: as above.
                let mut ta = has_asc_tape.then(|| unsafe { ta.slice(i0 * na * nb, i1 * na * nb) });
                let (mut cnt, mut vr) = if has_acc {
                    // SAFETY: as above.
                    unsafe {
                        (
                            Some(counts.slice(i0 * nb, i1 * nb)),
                            Some(vreg.slice(c * nb, (c + 1) * nb)),
                        )
                    }
                } else {
                    (None, None)
                };
                for g in &self.groups {
                    let (a0, a1) = (g.start.max(i0), g.end.min(i1));
                    for i in a0..a1 {
                        let l = i - i0;
                        let u = &mut u[l * nb..(l + 1) * nb];
                        let refr = &mut refr[l * nb..(l + 1) * nb];
                        let asc = &mut asc[l * na * nb..(l + 1) * na * nb];
                        let y1 = &mut y1[l * np * nb..(l + 1) * np * nb];
                        let y2 = &mut y2[l * np * nb..(l + 1) * np * nb];
                        let x = &arr[l * np * nb..(l + 1) * np * nb];
                        let fl = &mut fl[l * nb..(l + 1) * nb];
                        // Membrane (NEST's operation order, as step::membrane_update).
                        if g.glif {
                            sum.fill(0.0);
                            for (a, ac) in g.asc.iter().enumerate() {
                                let av = &asc[a * nb..(a + 1) * nb];
                                let ad = &mut adec[a * nb..(a + 1) * nb];
                                for b in 0..nb {
                                    sum[b] += av[b] * ac.stable;
                                    ad[b] = av[b] * ac.decay;
                                }
                            }
                            for b in 0..nb {
                                un[b] = u[b] * g.p33 + (g.i_e + sum[b]) * g.p30;
                            }
                            for &(k, ref pc) in &g.ports {
                                let (a, bb) =
                                    (&y1[k * nb..(k + 1) * nb], &y2[k * nb..(k + 1) * nb]);
                                for b in 0..nb {
                                    un[b] += a[b] * pc.p31 + bb[b] * pc.p32;
                                }
                            }
                        } else {
                            un.fill(g.ie_p30);
                            for &(k, ref pc) in &g.ports {
                                let (a, bb) =
                                    (&y1[k * nb..(k + 1) * nb], &y2[k * nb..(k + 1) * nb]);
                                for b in 0..nb {
                                    un[b] += a[b] * pc.p31;
                                    un[b] += bb[b] * pc.p32;
                                }
                            }
                            for b in 0..nb {
                                let v = un[b] + u[b] * g.expm1 + u[b];
                                un[b] = if (v as f64) < g.lower_bound {
                                    g.lb32
                                } else {
                                    v
                                };
                            }
                        }
                        // Spike, reset, refractory counter.
                        let mut any_fired = 0u8;
                        for b in 0..nb {
                            let active = refr[b] == 0;
                            let v = un[b] as f64;
                            let fired = active && if g.glif { v > g.th } else { v >= g.th };
                            let f = active as u8 | ((fired as u8) << 1);
                            fl[b] = f;
                            any_fired |= f;
                            let held = u[b];
                            u[b] = if fired {
                                g.v_reset
                            } else if active {
                                un[b]
                            } else {
                                held
                            };
                            if let Some(tx) = tx.as_deref_mut() {
                                tx[l * nb + b] = if active { un[b] } else { held };
                            }
                            refr[b] = if fired {
                                g.refractory_steps
                            } else if active {
                                0
                            } else {
                                refr[b] - 1
                            };
                        }
                        anyv[l] = any_fired & FIRED;
                        for (a, ac) in g.asc.iter().enumerate() {
                            let av = &mut asc[a * nb..(a + 1) * nb];
                            let ad = &adec[a * nb..(a + 1) * nb];
                            if let Some(ta) = ta.as_deref_mut() {
                                ta[(l * na + a) * nb..(l * na + a + 1) * nb].copy_from_slice(ad);
                            }
                            for b in 0..nb {
                                let f = fl[b];
                                av[b] = if f & FIRED != 0 {
                                    (ac.amp64 + ad[b] as f64 * ac.rd64) as f32
                                } else if f & ACTIVE != 0 {
                                    ad[b]
                                } else {
                                    av[b]
                                };
                            }
                        }
                        // Alpha PSCs, then this step's arrivals.
                        for &(k, ref pc) in &g.ports {
                            let r = k * nb..(k + 1) * nb;
                            let (a, bb, xv) = (&mut y1[r.clone()], &mut y2[r.clone()], &x[r]);
                            for b in 0..nb {
                                let y1v = a[b];
                                bb[b] = y1v * pc.p21 + bb[b] * pc.p22;
                                a[b] = y1v * pc.p11 + xv[b] * pc.psc_init;
                            }
                        }
                        if let Some(cnt) = cnt.as_deref_mut() {
                            for b in 0..nb {
                                cnt[l * nb + b] += (fl[b] >> 1) as u32;
                            }
                        }
                        if vreg_on {
                            let vr = vr.as_deref_mut().expect("accumulator");
                            let th = g.th;
                            for b in 0..nb {
                                let (r, _) = vreg_r(u[b] as f64 / th);
                                vr[b] += r * r;
                            }
                        }
                    }
                }
            });
        }
        self.deliver(st, t, flags, any, 0);
    }

    /// The state at chunk boundary `t0` from a boundary record: the arrival ring is rebuilt
    /// by replaying the deliveries of the steps before `t0` (their spike flags are in
    /// `b.flags`, the input draws are keyed by step) that arrive at `t0` or later, in the
    /// order of the forward pass, so every ring entry has the same bits as in the forward.
    ///
    /// The state is written into `st` (a state of this kernel's shape, whose buffers are
    /// reused).
    fn restore(&self, b: &Boundary, t0: usize, st: &mut State) {
        let (n, nb) = (self.n, self.nb);
        st.u.copy_from_slice(&b.u);
        st.asc.copy_from_slice(&b.asc);
        st.y1.copy_from_slice(&b.y1);
        st.y2.copy_from_slice(&b.y2);
        st.refr.copy_from_slice(&b.refr);
        st.ring.fill(0.0);
        let m = b.flags.len() / (n * nb).max(1);
        let mut any = vec![0u8; n];
        for j in 0..m {
            let s = t0 - m + j;
            let fl = &b.flags[j * n * nb..(j + 1) * n * nb];
            for (a, f) in any.iter_mut().zip(fl.chunks_exact(nb)) {
                *a = f.iter().fold(0, |x, &y| x | y) & FIRED;
            }
            self.deliver(st, s, fl, &any, t0);
        }
    }

    /// Delivers the spikes of step `t` (recurrent, then inputs) into the ring, every ring
    /// entry receiving its additions in the serial order (sources ascending, then the
    /// sample's input events in order).
    ///
    /// Only arrivals at steps `>= min_arrival` are delivered (0: all; the ring rebuild at a
    /// chunk boundary replays the last `max_delay` steps with `min_arrival` = the boundary).
    ///
    /// One task per (sample, target block) ([`DELIVERY_BLOCK`]): each walks the sources that
    /// fired in its sample and that sample's input events, and adds, for every edge into its
    /// block, the weight to the sample's ring entry. The ring is sample- and port-major, so a
    /// task's entries (a block's targets and ports of one sample) stay in the core's cache,
    /// an edge class's entries densely (full V1: 64 KB per class and block of 16,384
    /// targets, where one port of `[neuron, port]` entries spread over 256 KB). The tasks
    /// split the work, never the order of a sum.
    fn deliver(&self, st: &mut State, t: usize, flags: &[u8], any: &[u8], min_arrival: usize) {
        let (n, nb, np, rl) = (self.n, self.nb, self.np, self.rl);
        let net = &self.m.net;
        // Each lane's sources that fired (ascending).
        let mut fired: Vec<Vec<u32>> = vec![Vec::new(); nb];
        for i in 0..n {
            if any[i] == 0 {
                continue;
            }
            let fl = &flags[i * nb..(i + 1) * nb];
            for (l, &f) in fl.iter().enumerate() {
                if f & FIRED != 0 {
                    fired[l].push(i as u32);
                }
            }
        }
        // Each lane's input events of step t (node, count), in the order of `for_each`.
        let mut events: Vec<Vec<(u32, u32)>> = vec![Vec::new(); nb];
        let draw = |l: usize, ev: &mut Vec<(u32, u32)>| {
            self.m
                .inputs
                .for_each(self.samples[l], t, |v, count| ev.push((v, count)));
        };
        // On rayon only when the draws outweigh a fork-join (tenth-scale V1: 27,840 per step).
        if self.parallel && self.m.inputs.n_poisson() * nb >= PARALLEL_DRAWS {
            events
                .par_iter_mut()
                .enumerate()
                .for_each(|(l, ev)| draw(l, ev));
        } else {
            events
                .iter_mut()
                .enumerate()
                .for_each(|(l, ev)| draw(l, ev));
        }
        let ring = Shared::new(&mut st.ring);
        let w_rec = self.w_rec;
        let w_in = &self.w_in;
        let n_blocks = self.rec_delivery.len();
        // First entry of the (arrival step, lane, port) plane; an edge's target is its
        // `target_off / np`, divided exactly as `(off >> sh) * inv` ([`exact_div`]).
        let plane =
            |arrival: usize, l: usize, port: usize| ((arrival % rl * nb + l) * np + port) * n;
        self.tasks(nb * n_blocks, |task| {
            // Copies of the ring's pointer and length and of the divisor in this task: the
            // compiler keeps them in registers instead of reloading them after every add.
            let (ring, (sh, inv)) = (ring, self.port_div);
            // The ring entry of a plane's target offset `off` (its target: `off / np`).
            let entry = |base: usize, off: u32| base + (off >> sh).wrapping_mul(inv) as usize;
            let (l, k) = (task / n_blocks, task % n_blocks);
            let rec = &net.recurrent;
            let src = &fired[l];
            for (f, &i) in src.iter().enumerate() {
                // Ask for the edges of a source a few ahead (random sources: the lines of
                // their pieces would otherwise miss).
                if self.prefetch_delivery {
                    // Two stages: the segments and slot rows of a source further ahead, so
                    // that reading them for the edges' prefetch below does not miss.
                    if let Some(&ib) = src.get(f + 2 * PREFETCH_SOURCES) {
                        let (g0, g1) = (rec.seg_ptr[ib as usize], rec.seg_ptr[ib as usize + 1]);
                        prefetch(&rec.segments, g0 as usize);
                        self.rec_delivery.prefetch_rows(g0 as usize, g1 as usize);
                    }
                    if let Some(&ia) = src.get(f + PREFETCH_SOURCES) {
                        for g in rec.seg_ptr[ia as usize]..rec.seg_ptr[ia as usize + 1] {
                            let (a, b) = self.rec_delivery.range(g as usize, k, k + 1);
                            prefetch_edges(&rec.target_off, w_rec, a, b);
                        }
                    }
                }
                let g0 = rec.seg_ptr[i as usize] as usize;
                for (j, seg) in rec.segments_of(i as usize).iter().enumerate() {
                    let d = seg.delay as usize;
                    if t + d < min_arrival {
                        continue;
                    }
                    let base = plane(t + d, l, seg.port as usize);
                    let at = |off: u32| entry(base, off);
                    let (a, b) = self.rec_delivery.range(g0 + j, k, k + 1);
                    let offs = &rec.target_off[a..b];
                    if self.prefetch_delivery {
                        for &off in offs.iter().take(RING_PREFETCH) {
                            prefetch_ptr(ring.0.wrapping_add(at(off)));
                        }
                    }
                    for (i, (&off, &w)) in offs.iter().zip(&w_rec[a..b]).enumerate() {
                        // Ask for the ring entry of an edge ahead (random within the block).
                        if self.prefetch_delivery {
                            if let Some(&o) = offs.get(i + RING_PREFETCH) {
                                prefetch_ptr(ring.0.wrapping_add(at(o)));
                            }
                        }
                        // SAFETY: the entry's target lies in this task's block k, its lane is l.
                        unsafe { ring.add(at(off), w) };
                    }
                }
            }
            let inp = &net.input;
            for &(v, count) in &events[l] {
                let cnt = count as f32;
                let g0 = inp.seg_ptr[v as usize] as usize;
                for (j, seg) in inp.segments_of(v as usize).iter().enumerate() {
                    let d = seg.delay as usize;
                    if t + d < min_arrival {
                        continue;
                    }
                    let base = plane(t + d, l, seg.port as usize);
                    let (a, b) = self.in_delivery.range(g0 + j, k, k + 1);
                    for (&off, &w) in inp.target_off[a..b].iter().zip(&w_in[a..b]) {
                        // SAFETY: the entry's target lies in this task's block k, its lane is l.
                        unsafe { ring.add(entry(base, off), w * cnt) };
                    }
                }
            }
        });
    }

    /// Forward steps `t0..t1`, optionally recording the tape and the loss sums.
    ///
    /// `history` (`[max_delay, neuron, B]`), when given, keeps the flags of the last
    /// `max_delay` steps (step `t` in row `t % max_delay`).
    #[allow(clippy::too_many_arguments)]
    fn forward_steps(
        &self,
        st: &mut State,
        t0: usize,
        t1: usize,
        mut tape: Option<&mut Tape>,
        mut acc: Option<&mut Acc>,
        flags_scratch: &mut [u8],
        any: &mut [u8],
        mut history: Option<&mut [u8]>,
    ) {
        let (n, nb, na) = (self.n, self.nb, self.na);
        let md = self.m.net.max_delay;
        for t in t0..t1 {
            let l = t - t0;
            let fl: &[u8] = match tape.as_deref_mut() {
                Some(tp) => {
                    let asc_step = n * na * nb;
                    let a = if tp.marked() {
                        if l.is_multiple_of(tp.asc_len) {
                            let k = l / tp.asc_len;
                            tp.asc_marks[k * asc_step..(k + 1) * asc_step].copy_from_slice(&st.asc);
                        }
                        None
                    } else {
                        Some(&mut tp.asc[l * asc_step..(l + 1) * asc_step])
                    };
                    let x = &mut tp.x[l * n * nb..(l + 1) * n * nb];
                    let f = &mut tp.flags[l * n * nb..(l + 1) * n * nb];
                    self.forward_step(st, t, f, any, Some((x, a)), acc.as_deref_mut());
                    f
                }
                None => {
                    self.forward_step(st, t, flags_scratch, any, None, acc.as_deref_mut());
                    if let Some(h) = history.as_deref_mut() {
                        h[(t % md) * n * nb..(t % md + 1) * n * nb].copy_from_slice(flags_scratch);
                    }
                    flags_scratch
                }
            };
            if let Some(rec) = acc.as_deref_mut().and_then(|a| a.first.as_mut()) {
                // Sample 0 is lane 0 of every neuron's flags.
                let from = rec.len();
                let order = &self.m.net.order;
                rec.extend(
                    (0..n)
                        .filter(|&i| any[i] != 0 && fl[i * nb] & FIRED != 0)
                        .map(|i| (t as u32, order[i])),
                );
                rec[from..].sort_unstable();
            }
        }
    }

    /// A tape of `len` steps that keeps the after-spike currents of every step
    /// (`marked` false) or only at the start of every [`ASC_STRETCH`] steps; `reuse`'s
    /// buffers when it has the same shape.
    fn new_tape(&self, len: usize, marked: bool, reuse: Option<Tape>) -> Tape {
        let (n, nb, na) = (self.n, self.nb, self.na);
        let asc_len = if marked { ASC_STRETCH.min(len) } else { len };
        let n_marks = if asc_len < len {
            len.div_ceil(asc_len)
        } else {
            0
        };
        if let Some(t) = reuse {
            if t.x.len() == len * n * nb
                && t.asc_len == asc_len
                && t.asc.len() == asc_len * n * na * nb
                && t.asc_marks.len() == n_marks * n * na * nb
            {
                return t;
            }
        }
        Tape {
            x: vec![0.0; len * n * nb],
            flags: vec![0; len * n * nb],
            asc: vec![0.0; asc_len * n * na * nb],
            asc_marks: vec![0.0; n_marks * n * na * nb],
            asc_len,
        }
    }

    /// Fills `tape.asc` with the after-spike currents after the decay of the `len` steps of
    /// stretch `k` of a marked tape ([`Tape`]), from the stretch's mark and flags: the
    /// forward pass's operations on the same values, so the same bits.
    fn rebuild_asc(&self, tape: &mut Tape, k: usize, len: usize) {
        let (n, nb, na) = (self.n, self.nb, self.na);
        let asc_step = n * na * nb;
        let l0 = k * tape.asc_len;
        let mark = &tape.asc_marks[k * asc_step..(k + 1) * asc_step];
        let flags = &tape.flags[l0 * n * nb..(l0 + len) * n * nb];
        let out = Shared::new(&mut tape.asc[..len * asc_step]);
        self.tasks(n.div_ceil(NEURON_CHUNK), |c| {
            let (i0, i1) = (c * NEURON_CHUNK, ((c + 1) * NEURON_CHUNK).min(n));
            let mut cur = mark[i0 * na * nb..i1 * na * nb].to_vec();
            for l in 0..len {
                // SAFETY: step l's entries of neurons i0..i1 belong to this task alone.
                let o =
                    unsafe { out.slice(l * asc_step + i0 * na * nb, l * asc_step + i1 * na * nb) };
                let fl = &flags[l * n * nb..(l + 1) * n * nb];
                for g in &self.groups {
                    for i in g.start.max(i0)..g.end.min(i1) {
                        let li = i - i0;
                        for (a, ac) in g.asc.iter().enumerate() {
                            let r = (li * na + a) * nb..(li * na + a + 1) * nb;
                            let (av, od) = (&mut cur[r.clone()], &mut o[r]);
                            for b in 0..nb {
                                let ad = av[b] * ac.decay;
                                od[b] = ad;
                                let f = fl[i * nb + b];
                                if f & FIRED != 0 {
                                    av[b] = (ac.amp64 + ad as f64 * ac.rd64) as f32;
                                } else if f & ACTIVE != 0 {
                                    av[b] = ad;
                                }
                            }
                        }
                    }
                }
            }
        });
    }

    /// Reverse pass over steps `t0 .. t0 + len`, whose stored values `tape` holds (`len`
    /// steps of each array, from step `t0`). Per step: the adjoint
    /// of the step's arrivals ([`Kernel::arrivals_adjoint`]), the transposed SpMV with the
    /// recurrent weight gradient, the input weight gradient, and the local backward of every
    /// neuron ([`Kernel::local_backward`]). The last and the first phase touch only each
    /// neuron's own state, so one task per neuron chunk runs the local backward of step `t`
    /// and then the arrivals' adjoint of step `t - 1`: one fork-join per step fewer, the same
    /// operations in the same order.
    #[allow(clippy::too_many_arguments)]
    fn backward_steps(
        &self,
        tape: StepTape,
        t0: usize,
        len: usize,
        gz_rate: &[f32],
        vreg_coef: f64,
        adj: &mut Adjoint,
        grad: &mut [f64],
        timing: &mut StepTiming,
    ) {
        // Indices into the adjoint ring, whose length is rl_mu.
        let (n, nb, np, na, rl) = (self.n, self.nb, self.np, self.na, self.rl_mu);
        let net = &self.m.net;
        let stride = n * np * nb;
        let n_rec = net.weights_rec.len();
        let n_chunks = n.div_ceil(NEURON_CHUNK);
        let n_src_chunks = n.div_ceil(SOURCE_CHUNK);
        let step_of = |l: usize| StepTape {
            x: &tape.x[l * n * nb..(l + 1) * n * nb],
            asc: &tape.asc[l * n * na * nb..(l + 1) * n * na * nb],
            flags: &tape.flags[l * n * nb..(l + 1) * n * nb],
        };
        debug_assert!(tape.x.len() >= len * n * nb && tape.asc.len() >= len * n * na * nb);
        if len == 0 {
            return;
        }
        // The arrivals' adjoint of the last step; the loop computes each earlier step's.
        {
            let st = step_of(len - 1);
            let slot = (t0 + len - 1) % rl;
            let au = Shared::new(&mut adj.u);
            let mu = Shared::new(&mut adj.mu[slot * stride..(slot + 1) * stride]);
            let a1 = &adj.y1;
            self.tasks(n_chunks, |c| {
                let (i0, i1) = (c * NEURON_CHUNK, ((c + 1) * NEURON_CHUNK).min(n));
                // SAFETY: neurons i0..i1 belong to this task alone.
                let (au, mu) = unsafe {
                    (
                        au.slice(i0 * nb, i1 * nb),
                        mu.slice(i0 * np * nb, i1 * np * nb),
                    )
                };
                let y1 = &a1[i0 * np * nb..i1 * np * nb];
                self.arrivals_adjoint(i0, i1, &st, vreg_coef, au, mu, y1);
            });
        }
        for l in (0..len).rev() {
            let t = t0 + l;
            let flags = step_of(l).flags;
            // 3. Spike adjoints (transposed SpMV over all edges) and recurrent weight gradients,
            // in passes over the targets (SPMV_PASS): each source's sum is the sum of its
            // passes' partial sums, in pass order.
            let spmv_start = std::time::Instant::now();
            let n_passes = if self.scatter.is_some() {
                0
            } else {
                self.spmv_passes.len()
            };
            if let Some(sc) = &self.scatter {
                let gz = Shared::new(&mut adj.gz);
                let mu = &adj.mu;
                self.tasks(sc.n_blocks(), |b| {
                    let (s0, s1) = (sc.src_starts[b], sc.src_starts[b + 1]);
                    // SAFETY: the sources of block b belong to this task alone.
                    let gz = unsafe { gz.slice(s0 * nb, s1 * nb) };
                    sc.block_step(b, t, self.t_len, rl, nb, mu, gz, &gz_rate[s0 * nb..s1 * nb]);
                });
                // The weight gradient, per window of steps: the window's adjoint rows are
                // all in the ring when the backward pass reaches its first step.
                let win = adj
                    .window
                    .as_mut()
                    .expect("a spike window in the scatter form");
                win.record(t, flags, FIRED);
                if t.is_multiple_of(GRAD_WINDOW) {
                    let grad_start = std::time::Instant::now();
                    win.group();
                    let win = &*win;
                    let gs = Shared::new(&mut grad[..n_rec]);
                    let n_ranges = n.div_ceil(WINDOW_TARGETS);
                    self.tasks(n_ranges, |r| {
                        let (j0, j1) = (r * WINDOW_TARGETS, ((r + 1) * WINDOW_TARGETS).min(n));
                        // SAFETY: the edges into targets j0..j1 belong to this task alone.
                        unsafe { sc.window_gradient(j0, j1, win, self.t_len, rl, nb, mu, gs) };
                    });
                    adj.window.as_mut().expect("the window").clear();
                    timing.weight_grad_s += grad_start.elapsed().as_secs_f64();
                }
            }
            for pass in 0..n_passes {
                let last = pass + 1 == n_passes;
                let pass_targets =
                    self.spmv_passes.starts[pass + 1] - self.spmv_passes.starts[pass];
                let prefetch = pass_targets > PREFETCH_MIN_TARGETS;
                let gz = Shared::new(&mut adj.gz);
                let gr = Shared::new(&mut grad[..n_rec]);
                let mu = &adj.mu;
                let rec = &net.recurrent;
                let t_len = self.t_len;
                self.tasks(n_src_chunks, |c| {
                    let (s0, s1) = (c * SOURCE_CHUNK, ((c + 1) * SOURCE_CHUNK).min(n));
                    let (e0, e1) = (edge_start(rec, s0), edge_start(rec, s1));
                    // SAFETY: sources s0..s1 and their CSR edges e0..e1 belong to this task.
                    let (gz, gr) = unsafe { (gz.slice(s0 * nb, s1 * nb), gr.slice(e0, e1)) };
                    let mut lanes: Vec<usize> = Vec::with_capacity(nb);
                    let avx2 = has_avx2();
                    for i in s0..s1 {
                        let li = i - s0;
                        // Ask for this pass's edges of a source ahead: with several passes a
                        // source's edges come in pieces, which the hardware's stream
                        // prefetcher does not follow across.
                        if prefetch && n_passes > 1 && i + PREFETCH_SOURCES < s1 {
                            let ia = i + PREFETCH_SOURCES;
                            for g in rec.seg_ptr[ia] as usize..rec.seg_ptr[ia + 1] as usize {
                                let (a, b) = self.spmv_passes.range(g, pass, pass + 1);
                                prefetch_edges(&rec.target_off, self.w_rec, a, b);
                            }
                        }
                        let acc = &mut gz[li * nb..(li + 1) * nb];
                        if pass == 0 {
                            acc.fill(0.0);
                        }
                        let fl = &flags[i * nb..(i + 1) * nb];
                        lanes.clear();
                        lanes.extend((0..nb).filter(|&l| fl[l] & FIRED != 0));
                        let spiked = !lanes.is_empty();
                        let g0 = rec.seg_ptr[i] as usize;
                        for (j, seg) in rec.segments_of(i).iter().enumerate() {
                            let d = seg.delay as usize;
                            if t + d >= t_len {
                                continue;
                            }
                            let base = ((t + d) % rl) * n * np + seg.port as usize;
                            let (a, b) = self.spmv_passes.range(g0 + j, pass, pass + 1);
                            if a == b {
                                continue;
                            }
                            let offs = &rec.target_off[a..b];
                            let ws = &self.w_rec[a..b];
                            let gather = Gather {
                                mu,
                                base,
                                nb,
                                prefetch,
                            };
                            if avx2 {
                                // SAFETY: the CPU has AVX2 (checked at run time).
                                unsafe { segment_dot_avx2(ws, offs, gather, acc) }
                            } else {
                                segment_dot(ws, offs, gather, acc);
                            }
                            if spiked {
                                for (k, &off) in offs.iter().enumerate() {
                                    let m = &mu[(base + off as usize) * nb..][..nb];
                                    let mut s = 0.0f64;
                                    for &l in &lanes {
                                        s += m[l] as f64;
                                    }
                                    gr[a + k - e0] += s;
                                }
                            }
                        }
                        if last {
                            for l in 0..nb {
                                acc[l] += gz_rate[i * nb + l];
                            }
                        }
                    }
                });
            }
            timing.adjoint_spmv_s += spmv_start.elapsed().as_secs_f64();
            let visits = self
                .edges_by_delay
                .iter()
                .enumerate()
                .filter(|&(d, _)| t + d < self.t_len)
                .map(|(_, &c)| c)
                .sum::<u64>();
            timing.adjoint_edges += visits;
            timing.adjoint_edge_bytes += visits * if self.scatter.is_some() { 6 } else { 8 };
            timing.adjoint_scatter = self.scatter.is_some();
            // 4. Input weight gradients.
            if self.m.opts.train_input_weights {
                let gin = &mut grad[n_rec..];
                let mu = &adj.mu;
                for l in 0..nb {
                    self.m.inputs.for_each(self.samples[l], t, |v, count| {
                        let cnt = count as f32;
                        for seg in net.input.segments_of(v as usize) {
                            let d = seg.delay as usize;
                            if t + d >= self.t_len {
                                continue;
                            }
                            let base = ((t + d) % rl) * n * np + seg.port as usize;
                            for e in seg.start as usize..seg.end as usize {
                                let off = net.input.target_off[e] as usize;
                                gin[e] += (mu[(base + off) * nb + l] * cnt) as f64;
                            }
                        }
                    });
                }
            }
            // 5. Local backward of every neuron through step t, then 1-2 of step t - 1:
            // voltage regularization on U after it and the adjoint of its arrivals.
            {
                let st = step_of(l);
                let before = (l > 0).then(|| step_of(l - 1));
                let slot_before = (t + rl - 1) % rl;
                let au = Shared::new(&mut adj.u);
                let aa = Shared::new(&mut adj.asc);
                let a1 = Shared::new(&mut adj.y1);
                let a2 = Shared::new(&mut adj.y2);
                let mu = Shared::new(&mut adj.mu[slot_before * stride..(slot_before + 1) * stride]);
                let gz = &adj.gz;
                self.tasks(n_chunks, |c| {
                    let (i0, i1) = (c * NEURON_CHUNK, ((c + 1) * NEURON_CHUNK).min(n));
                    // SAFETY: neurons i0..i1 belong to this task alone.
                    let (au, aa, a1, a2) = unsafe {
                        (
                            au.slice(i0 * nb, i1 * nb),
                            aa.slice(i0 * na * nb, i1 * na * nb),
                            a1.slice(i0 * np * nb, i1 * np * nb),
                            a2.slice(i0 * np * nb, i1 * np * nb),
                        )
                    };
                    self.local_backward(i0, i1, &st, gz, au, aa, a1, a2);
                    if let Some(sb) = &before {
                        // SAFETY: as above.
                        let mu = unsafe { mu.slice(i0 * np * nb, i1 * np * nb) };
                        self.arrivals_adjoint(i0, i1, sb, vreg_coef, au, mu, a1);
                    }
                });
            }
        }
    }

    /// Steps 1-2 of the backward pass for neurons `i0..i1` at one step `st`: the
    /// voltage-regularization derivative on U after the step (added to `au`), and the adjoint
    /// of the step's arrivals, `mu = psc_init * y1` (`mu`, `au` and `y1` are the chunk's rows).
    #[allow(clippy::too_many_arguments)]
    #[inline]
    fn arrivals_adjoint(
        &self,
        i0: usize,
        i1: usize,
        st: &StepTape,
        vreg_coef: f64,
        au: &mut [f32],
        mu: &mut [f32],
        y1: &[f32],
    ) {
        let (nb, np) = (self.nb, self.np);
        // The rows of the live ports alone: no edge reads the others' (they keep their zeros).
        for g in &self.groups {
            for i in g.start.max(i0)..g.end.min(i1) {
                let li = i - i0;
                if vreg_coef != 0.0 {
                    for b in 0..nb {
                        let f = st.flags[i * nb + b];
                        let u_post = if f & (ACTIVE | FIRED) == ACTIVE | FIRED {
                            g.v_reset
                        } else {
                            st.x[i * nb + b]
                        };
                        let (r, dr) = vreg_r(u_post as f64 / g.th);
                        if r != 0.0 {
                            au[li * nb + b] += (vreg_coef * 2.0 * r * dr / g.th) as f32;
                        }
                    }
                }
                for &(k, ref pc) in &g.ports {
                    let src = &y1[(li * np + k) * nb..(li * np + k + 1) * nb];
                    let dst = &mut mu[(li * np + k) * nb..(li * np + k + 1) * nb];
                    for b in 0..nb {
                        dst[b] = src[b] * pc.psc_init;
                    }
                }
            }
        }
    }

    /// Step 5 of the backward pass for neurons `i0..i1`: the adjoint of every neuron's state
    /// through step `st` from the spike adjoints `gz` (`[neuron, B]`, all neurons); `au`,
    /// `aa`, `a1`, `a2` are the chunk's rows.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    fn local_backward(
        &self,
        i0: usize,
        i1: usize,
        st: &StepTape,
        gz: &[f32],
        au: &mut [f32],
        aa: &mut [f32],
        a1: &mut [f32],
        a2: &mut [f32],
    ) {
        let (nb, np, na) = (self.nb, self.np, self.na);
        let mut p1 = vec![0.0f32; np * nb];
        let mut p2 = vec![0.0f32; np * nb];
        let mut sigma = vec![0.0f32; nb];
        let mut lz = vec![0.0f32; nb];
        let mut lun = vec![0.0f32; nb];
        for g in &self.groups {
            for i in g.start.max(i0)..g.end.min(i1) {
                let li = i - i0;
                let u = &mut au[li * nb..(li + 1) * nb];
                let lasc = &mut aa[li * na * nb..(li + 1) * na * nb];
                let ly1 = &mut a1[li * np * nb..(li + 1) * np * nb];
                let ly2 = &mut a2[li * np * nb..(li + 1) * np * nb];
                let fl = &st.flags[i * nb..(i + 1) * nb];
                let xv = &st.x[i * nb..(i + 1) * nb];
                for &(k, ref pc) in &g.ports {
                    for b in 0..nb {
                        let j = k * nb + b;
                        p1[j] = ly2[j] * pc.p21 + ly1[j] * pc.p11;
                        p2[j] = ly2[j] * pc.p22;
                    }
                }
                let gzi = &gz[i * nb..(i + 1) * nb];
                for b in 0..nb {
                    let un = xv[b];
                    let clamped = !g.glif && un == g.lb32;
                    sigma[b] = if clamped {
                        0.0
                    } else {
                        dz_du_f32(&self.sg, un, g.th32)
                    };
                    lz[b] = gzi[b] - u[b] * g.th_minus_reset;
                }
                for (a, ac) in g.asc.iter().enumerate() {
                    let ap = &st.asc[(i * na + a) * nb..(i * na + a + 1) * nb];
                    let la = &lasc[a * nb..(a + 1) * nb];
                    for b in 0..nb {
                        lz[b] += la[b] * (ac.amp + ap[b] * ac.rd - ap[b]);
                    }
                }
                for b in 0..nb {
                    let clamped = !g.glif && xv[b] == g.lb32;
                    lun[b] = if clamped {
                        0.0
                    } else {
                        u[b] + lz[b] * sigma[b]
                    };
                }
                for (a, ac) in g.asc.iter().enumerate() {
                    let la = &mut lasc[a * nb..(a + 1) * nb];
                    for b in 0..nb {
                        let f = fl[b];
                        if f & ACTIVE != 0 {
                            let s = if f & FIRED != 0 { ac.jump_slope } else { 1.0 };
                            let lap = la[b] * s;
                            la[b] = lap * ac.decay + lun[b] * g.p30 * ac.stable;
                        }
                    }
                }
                for b in 0..nb {
                    if fl[b] & ACTIVE != 0 {
                        u[b] = if g.glif {
                            lun[b] * g.p33
                        } else {
                            lun[b] * g.expm1 + lun[b]
                        };
                    }
                }
                for &(k, ref pc) in &g.ports {
                    for b in 0..nb {
                        let j = k * nb + b;
                        if fl[b] & ACTIVE != 0 {
                            p1[j] += lun[b] * pc.p31;
                            p2[j] += lun[b] * pc.p32;
                        }
                    }
                }
                for &(k, _) in &g.ports {
                    let r = k * nb..(k + 1) * nb;
                    ly1[r.clone()].copy_from_slice(&p1[r.clone()]);
                    ly2[r.clone()].copy_from_slice(&p2[r]);
                }
            }
        }
    }
}

/// The stored forward values of one or more consecutive steps (global neuron index): `x`
/// `[step, neuron, B]`, `asc` `[step, neuron, n_asc, B]`, `flags` `[step, neuron, B]` (see
/// [`Tape`]).
#[derive(Clone, Copy)]
struct StepTape<'a> {
    x: &'a [f32],
    asc: &'a [f32],
    flags: &'a [u8],
}

impl SnnModel {
    /// [`SnnModel::loss_and_grad`] with the batch-innermost float32 kernels (module docs):
    /// the forward pass ([`Kernel::forward_pass`]), the loss terms and their direct
    /// derivatives ([`SnnModel::batch_loss_terms`]), the backward pass
    /// ([`Kernel::backward_pass`]).
    pub(crate) fn loss_and_grad_batched(
        &self,
        params: &[f32],
        first_sample: u64,
        batch: usize,
    ) -> Result<(LossAndGrad, StepTiming)> {
        if batch == 0 {
            return Err(SnnError::Shape("batch must be at least 1".into()));
        }
        if params.len() != self.n_params() {
            return Err(SnnError::Shape(format!(
                "{} parameters given, the model has {}",
                params.len(),
                self.n_params()
            )));
        }
        let run = || {
            let mut ws = self.workspace.take();
            let k = Kernel::new(self, params, first_sample, batch, ws.scatter.take());
            let mut timing = StepTiming::default();
            let clock = std::time::Instant::now();
            let mut fwd = k.forward_pass(&mut ws);
            timing.forward_s = clock.elapsed().as_secs_f64();
            let unsegmented = fwd.full_tape.is_some();
            let (terms, n_spikes, gz_rate) = self.batch_loss_terms(&fwd.acc, k.n, batch);
            let vreg_coef = self.vreg_cost / (batch as f64 * k.n as f64 * k.t_len as f64);
            let grad = k.backward_pass(&mut fwd, &mut ws, &gz_rate, vreg_coef, &mut timing);
            let grad = k.gradient_f32(&grad);
            // The scatter order stays for the next call as the adjoint state does: in
            // unsegmented calls only (segmented BPTT is the mode that saves memory).
            ws.scatter = k.scatter.filter(|_| unsegmented);
            self.workspace.put(ws);
            let mut r = self.finish(terms, grad, n_spikes, batch);
            r.first_spikes = fwd.acc.first.take();
            (r, timing)
        };
        // Thousands of fork-joins per call (a few per step): started from a rayon worker,
        // each costs a few microseconds, from an outside thread (which must hand every one
        // to the pool and sleep until it is done) tens. On small networks, whose steps last
        // tens of microseconds, the whole call therefore runs on a worker. Larger ones stay
        // on the calling thread: there the fork-joins do not matter, and a worker's allocator
        // arena measured 0.17 GiB more peak memory (tenth and full V1).
        let small = self.net.n_neurons() <= WORKER_CALL_MAX_NEURONS;
        if self.opts.parallel && small && rayon::current_thread_index().is_none() {
            Ok(rayon::join(run, || ()).0)
        } else {
            Ok(run())
        }
    }

    /// The loss terms of a batch of `batch` samples of `n` neurons (means over the samples,
    /// in sample order), its spike count, and the direct derivatives of the rate losses with
    /// respect to each spike, `[neuron, B]`.
    fn batch_loss_terms(&self, acc: &Acc, n: usize, batch: usize) -> (Vec<f64>, f64, Vec<f32>) {
        let nb = batch;
        let n_chunks = n.div_ceil(NEURON_CHUNK);
        let bn = batch as f64 * n as f64;
        let mut terms = vec![0.0f64; self.opts.losses.len()];
        let mut n_spikes = 0.0;
        let mut gz_rate = vec![0.0f32; n * nb];
        let mut counts = vec![0.0f64; n];
        for b in 0..nb {
            for i in 0..n {
                counts[i] = acc.counts[i * nb + b] as f64;
            }
            let vsum: f64 = (0..n_chunks).map(|c| acc.vreg[c * nb + b]).sum();
            for (a, t) in terms.iter_mut().zip(self.trial_terms(&counts, vsum)) {
                *a += t / batch as f64;
            }
            n_spikes += counts.iter().sum::<f64>();
            for i in 0..n {
                let mut g = 0.0;
                for (target, scale) in &self.rate_losses {
                    g += 2.0 * (counts[i] * scale - target[i]) * scale / bn;
                }
                gz_rate[i * nb + b] = g as f32;
            }
        }
        (terms, n_spikes, gz_rate)
    }
}

/// The float32 constants of one group of neurons whose live ports are `live`.
fn group32(g: &crate::network::Group, live: &[usize]) -> Group32 {
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

/// What the forward pass leaves for the loss and the backward pass.
struct ForwardPass {
    /// Spike counts, voltage-regularization sums and the recorded spikes of sample 0.
    acc: Acc,
    /// `[neuron, B]` spike flags of the last step (scratch of the recomputation).
    flags: Vec<u8>,
    /// `[neuron]` "spiked in some sample" of the last step (scratch likewise).
    any: Vec<u8>,
    /// The tape of every step (unsegmented BPTT).
    full_tape: Option<Tape>,
    /// The chunk boundaries (segmented BPTT), in time order.
    boundaries: Vec<Boundary>,
    /// Steps per chunk (`t_len` when unsegmented).
    chunk: usize,
    /// The forward state after the last step (its buffers serve the recomputation).
    state: Option<State>,
}

impl<'a> Kernel<'a> {
    /// The kernel of `batch` samples from `first_sample` with parameters `params` (checked
    /// by the caller: `m.n_params()` of them), in `reuse`'s scatter order when given (the
    /// one a previous call on `m` with the same thread count built).
    fn new(
        m: &'a SnnModel,
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
        let scatter = uses_scatter(m).then(|| match reuse {
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
                .zip(&m.live_ports)
                .map(|(g, live)| group32(g, live))
                .collect(),
            nb,
            n,
            np: net.n_ports,
            na: net.n_asc,
            rl: net.ring_len(),
            rl_mu: mu_ring_len(m),
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
                for (g, ports) in net.groups.iter().zip(&m.live_ports) {
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

    /// The gradient of [`Kernel::backward_pass`] in float32 and parameter order (the
    /// scatter form accumulates the recurrent weights' gradient in its own edge order).
    fn gradient_f32(&self, grad: &[f64]) -> Vec<f32> {
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

    /// The forward pass over all steps with the loss sums: with the whole tape, or (gradient
    /// checkpointing) keeping only the state at each chunk boundary.
    fn forward_pass(&self, ws: &mut Workspace) -> ForwardPass {
        let (n, nb, t_len) = (self.n, self.nb, self.t_len);
        let m = self.m;
        let mut acc = Acc {
            counts: vec![0; n * nb],
            vreg: vec![0.0; n.div_ceil(NEURON_CHUNK) * nb],
            first: m.opts.record_first_sample.then(Vec::new),
        };
        let mut flags = vec![0u8; n * nb];
        let mut any = vec![0u8; n];
        let mut st = self.new_state();
        let chunk = m
            .opts
            .gradient_checkpointing
            .unwrap_or(t_len)
            .min(t_len)
            .max(1);
        let mut full_tape = None;
        let mut boundaries: Vec<Boundary> = Vec::new();
        // Each mode frees the kept buffers of the other (the options may change between
        // calls) before it allocates its own.
        if m.opts.gradient_checkpointing.is_some() {
            // The chunks' tape (the backward pass's), so that a kept unsegmented tape goes
            // before the boundaries are taken.
            ws.tape = Some(self.new_tape(chunk, false, ws.tape.take()));
            let mut spare = std::mem::take(&mut ws.boundaries).into_iter();
            let md = m.net.max_delay;
            let mut history = vec![0u8; md * n * nb];
            let mut t0 = 0;
            while t0 < t_len {
                let mh = md.min(t0);
                let hist: Vec<&[u8]> = (t0 - mh..t0)
                    .map(|s| &history[(s % md) * n * nb..(s % md + 1) * n * nb])
                    .collect();
                boundaries.push(Boundary::of(&st, &hist, spare.next()));
                let t1 = (t0 + chunk).min(t_len);
                self.forward_steps(
                    &mut st,
                    t0,
                    t1,
                    None,
                    Some(&mut acc),
                    &mut flags,
                    &mut any,
                    Some(&mut history),
                );
                t0 = t1;
            }
        } else {
            ws.boundaries = Vec::new();
            let mut tape = self.new_tape(t_len, true, ws.tape.take());
            self.forward_steps(
                &mut st,
                0,
                t_len,
                Some(&mut tape),
                Some(&mut acc),
                &mut flags,
                &mut any,
                None,
            );
            full_tape = Some(tape);
        }
        ForwardPass {
            acc,
            flags,
            any,
            full_tape,
            boundaries,
            chunk,
            // Only the recomputation of segmented BPTT needs a state.
            state: m.opts.gradient_checkpointing.is_some().then_some(st),
        }
    }

    /// The backward pass from the direct spike derivatives `gz_rate` (`[neuron, B]`) and the
    /// voltage-regularization coefficient: over the whole tape, or chunk by chunk from the
    /// last, recomputing each chunk's tape from its boundary. Returns the gradient (f64,
    /// `[n_params]`; in the scatter form the recurrent weights' part in the scatter order,
    /// see [`Kernel::gradient_f32`]); adds its times to `timing`.
    fn backward_pass(
        &self,
        fwd: &mut ForwardPass,
        ws: &mut Workspace,
        gz_rate: &[f32],
        vreg_coef: f64,
        timing: &mut StepTiming,
    ) -> Vec<f64> {
        let (n, nb, np, na, t_len) = (self.n, self.nb, self.np, self.na, self.t_len);
        let mut grad = vec![0.0f64; self.m.n_params()];
        let mu_len = self.rl_mu * n * np * nb;
        let mut adj = match ws.adjoint.take() {
            // The last call's buffers when the shapes agree, zeroed.
            Some(mut a)
                if a.u.len() == n * nb
                    && a.asc.len() == n * na * nb
                    && a.y1.len() == n * np * nb
                    && a.mu.len() == mu_len
                    && a.window.as_ref().map(|w| w.shape())
                        == self.scatter.as_ref().map(|_| (n, nb)) =>
            {
                a.u.fill(0.0);
                a.asc.fill(0.0);
                a.y1.fill(0.0);
                a.y2.fill(0.0);
                a.mu.fill(0.0);
                a.gz.fill(0.0);
                if let Some(w) = a.window.as_mut() {
                    w.clear();
                }
                a
            }
            _ => Adjoint {
                u: vec![0.0; n * nb],
                asc: vec![0.0; n * na * nb],
                y1: vec![0.0; n * np * nb],
                y2: vec![0.0; n * np * nb],
                mu: LineAligned::zeros(mu_len),
                gz: LineAligned::zeros(n * nb),
                window: self.scatter.as_ref().map(|_| SpikeWindow::new(n, nb)),
            },
        };
        // Unsegmented: the tape of every step, taken in stretches of its after-spike
        // currents (rebuilt one stretch at a time when the tape is marked). Segmented: one
        // chunk's tape at a time, recomputed from its boundary. Either way from the last.
        let unsegmented = fwd.full_tape.is_some();
        let mut tape = match fwd.full_tape.take() {
            Some(t) => t,
            None => self.new_tape(fwd.chunk, false, ws.tape.take()),
        };
        let span = if unsegmented { tape.asc_len } else { fwd.chunk }.max(1);
        let mut s = (!unsegmented).then(|| fwd.state.take().unwrap_or_else(|| self.new_state()));
        let (n_x, n_a) = (n * nb, n * na * nb);
        for k in (0..t_len.div_ceil(span)).rev() {
            let (t0, t1) = (k * span, ((k + 1) * span).min(t_len));
            let clock = std::time::Instant::now();
            // The tape's index of step t0.
            let l0 = if unsegmented {
                if tape.marked() {
                    self.rebuild_asc(&mut tape, k, t1 - t0);
                }
                t0
            } else {
                let s = s.as_mut().expect("a state for the recomputation");
                self.restore(&fwd.boundaries[k], t0, s);
                self.forward_steps(
                    s,
                    t0,
                    t1,
                    Some(&mut tape),
                    None,
                    &mut fwd.flags,
                    &mut fwd.any,
                    None,
                );
                0
            };
            timing.recompute_s += clock.elapsed().as_secs_f64();
            let clock = std::time::Instant::now();
            let l1 = l0 + (t1 - t0);
            let view = StepTape {
                x: &tape.x[l0 * n_x..l1 * n_x],
                asc: &tape.asc[..(t1 - t0) * n_a],
                flags: &tape.flags[l0 * n_x..l1 * n_x],
            };
            self.backward_steps(
                view,
                t0,
                t1 - t0,
                gz_rate,
                vreg_coef,
                &mut adj,
                &mut grad,
                timing,
            );
            timing.backward_s += clock.elapsed().as_secs_f64();
        }
        ws.tape = Some(tape);
        ws.boundaries = std::mem::take(&mut fwd.boundaries);
        // Segmented BPTT is the mode that saves memory: there the adjoint state (0.35 GB on
        // full V1) goes now rather than between calls (it raised the peak of a full-V1
        // training job from 3.69 to 3.97 GiB).
        ws.adjoint = unsegmented.then_some(adj);
        grad
    }
}

/// `(shift, inv)` with `x / d == (x >> shift).wrapping_mul(inv)` for every `u32` multiple `x`
/// of `d` (`d = 2^shift * odd`, `inv * odd == 1` modulo 2^32).
fn exact_div(d: usize) -> (u32, u32) {
    let d = d.max(1) as u32;
    let shift = d.trailing_zeros();
    let odd = d >> shift;
    // Newton's iteration for the inverse modulo 2^32 (each doubles the correct bits).
    let mut inv = odd;
    for _ in 0..5 {
        inv = inv.wrapping_mul(2u32.wrapping_sub(odd.wrapping_mul(inv)));
    }
    (shift, inv)
}

#[cfg(test)]
mod tests {
    use super::exact_div;

    /// The exact division of the delivery gives `x / d` for multiples `x` of `d`, odd and
    /// even port counts alike, up to the largest multiple below 2^32.
    #[test]
    fn exact_div_divides_multiples() {
        for d in 1..=12u32 {
            let (sh, inv) = exact_div(d as usize);
            let top = u32::MAX / d;
            for q in (0..1000)
                .chain(top - 1000..=top)
                .chain((0..top).step_by(9_973))
            {
                assert_eq!(((q * d) >> sh).wrapping_mul(inv), q, "{q} * {d}");
            }
        }
    }
}
