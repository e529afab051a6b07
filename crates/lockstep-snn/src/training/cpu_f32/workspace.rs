//! The float32 engine's buffers: the forward state of the batch ([`State`]), chunk
//! boundaries ([`Boundary`]), tapes ([`Tape`]), the adjoint state ([`Adjoint`]), the loss
//! sums ([`Acc`]), the buffers kept from one call to the next ([`Workspace`]) and their sizes
//! ([`BatchBytes`], for the memory check). Shapes in the module docs of `cpu_f32`.

#![allow(clippy::needless_range_loop)] // index loops over parallel arrays read clearer here

use crate::training::cpu_f32::consts::SCATTER_MIN_NEURONS;
use crate::training::cpu_f32::scatter::{ScatterSpmv, SpikeWindow, GRAD_WINDOW};
use crate::training::cpu_f32::simd::LineAligned;
use crate::training::options::SpmvForm;
use crate::training::problem::Problem;

/// Whether the float32 kernels of `m` take the scatter form of the adjoint SpMV.
pub(super) fn uses_scatter(m: &Problem) -> bool {
    match m.opts.adjoint_spmv {
        SpmvForm::Gather => false,
        SpmvForm::Scatter => true,
        SpmvForm::Auto => m.net.n_neurons() > SCATTER_MIN_NEURONS,
    }
}

/// Steps the adjoint ring of model `m`'s float32 kernels keeps: `max_delay + 1`, or in the
/// scatter form, whose weight gradient reads a whole window of steps, `GRAD_WINDOW +
/// max_delay` (the steps of the window after its first and up to `max_delay` later).
pub(super) fn mu_ring_len(m: &Problem) -> usize {
    if uses_scatter(m) {
        GRAD_WINDOW + m.net.max_delay
    } else {
        m.net.ring_len()
    }
}

/// Forward state of the batch (shapes in the module docs).
#[derive(Debug)]
pub(super) struct State {
    pub(super) u: Vec<f32>,
    pub(super) asc: Vec<f32>,
    pub(super) y1: Vec<f32>,
    pub(super) y2: Vec<f32>,
    pub(super) refr: Vec<u32>,
    /// `[ring_len, B, port, neuron]` synaptic input arriving per step (pA); sample-major, so
    /// that the delivery of one sample's spikes into a block of targets stays in cache, and
    /// port-major, so that the edges of one (delay, port) class add into a dense run.
    pub(super) ring: LineAligned,
}

/// A chunk boundary of segmented BPTT: the state without its arrival ring, and the spike
/// flags (`[step, neuron, B]`) of the last `min(max_delay, t0)` steps before it.
pub(super) struct Boundary {
    pub(super) u: Vec<f32>,
    pub(super) asc: Vec<f32>,
    pub(super) y1: Vec<f32>,
    pub(super) y2: Vec<f32>,
    pub(super) refr: Vec<u32>,
    pub(super) flags: Vec<u8>,
}

impl Boundary {
    /// The boundary of state `st` whose last steps' flags are `hist` (oldest first), in
    /// `reuse`'s buffers when given.
    pub(super) fn of(st: &State, hist: &[&[u8]], reuse: Option<Boundary>) -> Boundary {
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
pub(super) struct Tape {
    /// `[len, neuron, B]` pre-reset potential (not refractory) or held potential.
    pub(super) x: Vec<f32>,
    /// `[len, neuron, B]` flags ([`ACTIVE`], [`FIRED`]).
    pub(super) flags: Vec<u8>,
    /// `[asc_len, neuron, n_asc, B]` after-spike currents after each step's decay: of every
    /// step, or of the stretch last rebuilt.
    pub(super) asc: Vec<f32>,
    /// `[len.div_ceil(asc_len), neuron, n_asc, B]` after-spike currents at the start of
    /// every stretch (empty when `asc_len == len`, or when the network has no after-spike
    /// currents).
    pub(super) asc_marks: Vec<f32>,
    /// Steps whose after-spike currents `asc` holds.
    pub(super) asc_len: usize,
}

impl Tape {
    /// Whether the after-spike currents are kept only at the stretch starts.
    pub(super) fn marked(&self) -> bool {
        !self.asc_marks.is_empty()
    }
}

/// Steps per stretch of after-spike currents that the backward pass of an unsegmented tape
/// rebuilds at a time ([`Tape`]): the marks and one stretch together take
/// `(len / ASC_STRETCH + ASC_STRETCH)` steps' currents, near the least at 500 steps.
pub(super) const ASC_STRETCH: usize = 25;

/// The tapes, chunk boundaries and adjoint state of the last call, kept for the next one:
/// their pages are then already mapped (a fresh 2.7 GB tape costs its first writes about
/// 700,000 page faults, seconds on a VM), and the memory a training step needs stays the
/// same.
#[derive(Default)]
pub(super) struct Workspace {
    pub(super) tape: Option<Tape>,
    pub(super) boundaries: Vec<Boundary>,
    /// The adjoint state of an unsegmented call (its ring is 0.3 GB on full V1 in the
    /// scatter form); segmented calls free theirs.
    pub(super) adjoint: Option<Adjoint>,
    /// The scatter order of an unsegmented call (0.17 GB on full V1; the next call only
    /// copies its weights in, [`ScatterSpmv::set_weights`]); segmented calls free theirs.
    pub(super) scatter: Option<ScatterSpmv>,
}

/// A [`Workspace`] shared by the calls on one model (cloning a model starts an empty one).
#[derive(Default)]
pub(super) struct WorkspaceCache(std::sync::Mutex<Workspace>);

impl WorkspaceCache {
    /// Takes the cached buffers (empty ones if another call holds them).
    pub(super) fn take(&self) -> Workspace {
        match self.0.try_lock() {
            Ok(mut w) => std::mem::take(&mut *w),
            Err(_) => Workspace::default(),
        }
    }

    /// Frees the cached buffers (the next call allocates them again).
    pub(super) fn release(&self) {
        drop(self.take());
    }

    /// Keeps `w` for the next call.
    pub(super) fn put(&self, w: Workspace) {
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
pub(super) struct Acc {
    /// `[neuron, B]` spike counts.
    pub(super) counts: Vec<u32>,
    /// `[n_chunks, B]` voltage-regularization sums per neuron chunk.
    pub(super) vreg: Vec<f64>,
    /// `(step, neuron)` spikes (external index) of sample 0 when they are recorded
    /// ([`crate::BpttOptions::record_first_sample`]).
    pub(super) first: Option<Vec<(u32, u32)>>,
}

/// Adjoint state of the batch.
pub(super) struct Adjoint {
    pub(super) u: Vec<f32>,
    pub(super) asc: Vec<f32>,
    pub(super) y1: Vec<f32>,
    pub(super) y2: Vec<f32>,
    /// `[mu_ring_len, neuron, port, B]` adjoints of the arrivals ([`Kernel::rl_mu`] steps).
    pub(super) mu: LineAligned,
    /// The spikes of the current window of the scatter form's weight gradient.
    pub(super) window: Option<SpikeWindow>,
    /// `[neuron, B]` adjoint of this step's spikes (line-aligned: the scatter form adds into
    /// random rows of it).
    pub(super) gz: LineAligned,
}

/// Bytes of the float32 kernels' memory for a model and a local batch.
#[derive(Debug, Clone, Copy)]
pub(super) struct BatchBytes {
    /// The live forward state, arrival ring included.
    pub(super) state: u64,
    /// One chunk boundary: the state without the ring, and the spike flags of the last
    /// `max_delay` steps from which the ring is rebuilt.
    pub(super) boundary: u64,
    /// The tape of one step without the after-spike currents (potential and flags).
    pub(super) tape_step: u64,
    /// The after-spike currents of one step on the tape (or of one stretch mark).
    pub(super) asc_step: u64,
    /// The adjoint state (with its arrival ring), the direct loss derivatives and, in the
    /// scatter form, the spikes of one window of the weight gradient.
    pub(super) adjoint: u64,
}

/// [`BatchBytes`] of model `m` for `batch` samples.
pub(super) fn batch_bytes(m: &Problem, batch: usize) -> BatchBytes {
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
    pub(super) fn tape(&self, len: u64, marked: bool) -> u64 {
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
