//! The float32 CPU engine: batch-innermost BPTT kernels (`run.dtype: float32`, the default).
//!
//! The equations are those of the reference engine (`training/reference.rs`; forward: `simulation::step::step_neuron` on
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
//!   reaches ([`Network::live_ports`](crate::Network::live_ports); excitatory V1 cells receive on 2 of
//!   their 4) are neither updated nor differentiated: their PSCs stay zero and no edge reads
//!   their adjoints. The tape of a whole unsegmented pass keeps the after-spike currents
//!   only every 25 steps and the backward pass rebuilds them from the flags (`5` bytes per
//!   step, see `workspace.rs`); the tapes and chunk boundaries are kept from one call to the next
//!   (`workspace.rs`);
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
//!   32,768 neurons the SpMV takes the scatter form instead (`scatter.rs`: per
//!   row of adjoints into blocks of sources whose adjoints stay in L2; full V1 at
//!   `seq_len` 50: 3.2-3.9 s against about 6 s), with the weight gradient taken per window
//!   of 16 steps and per target (`scatter.rs`; the
//!   adjoint ring then keeps `16 + max_delay` steps) instead of per fired source at every
//!   step ([`SpmvForm`](crate::SpmvForm)).
//!
//! Against the per-sample float32 implementation
//! ([`SnnModel::loss_and_grad_reference`](crate::SnnModel::loss_and_grad_reference) with
//! [`Dtype::Float32`](crate::Dtype::Float32)) the forward pass is
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
//!
//! Files, bottom up (no file imports one above it): `simd.rs` (raw shared buffers, prefetch,
//! the AVX2 segment gather, exact division), `consts.rs` (fixed sizes, flag bits, float32 cell
//! constants), `scatter.rs` (the scatter form of the adjoint SpMV), `workspace.rs` (state,
//! tapes, boundaries, adjoint, their sizes), `kernel.rs` (one call's kernel), `delivery.rs`,
//! `forward.rs`, `backward.rs` (the steps), `passes.rs` (the whole passes) and `engine.rs`
//! (the entry the model calls).

mod backward;
mod consts;
mod delivery;
mod engine;
mod forward;
mod kernel;
mod passes;
mod scatter;
mod simd;
mod workspace;

pub(crate) use engine::CpuF32Engine;
pub use scatter::SCATTER_BLOCK;
