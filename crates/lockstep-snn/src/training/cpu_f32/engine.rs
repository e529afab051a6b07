//! The float32 CPU engine's entry ([`CpuF32Engine`]): one call's kernel, forward pass, loss
//! terms, backward pass and gradient, the buffers kept between calls, and the memory the
//! engine needs (for the memory check).

#![allow(clippy::needless_range_loop)] // index loops over parallel arrays read clearer here

use lockstep_core::memory::MemoryEstimate;

use crate::error::{Result, SnnError};
use crate::training::cpu_f32::consts::{NEURON_CHUNK, WORKER_CALL_MAX_NEURONS};
use crate::training::cpu_f32::kernel::Kernel;
use crate::training::cpu_f32::scatter::ScatterSpmv;
use crate::training::cpu_f32::workspace::{batch_bytes, uses_scatter, WorkspaceCache};
use crate::training::options::{LossAndGrad, StepTiming};
use crate::training::problem::Problem;

/// The batch-innermost float32 kernels on CPU cores (`run.dtype: float32`, `run.device:
/// cpu`). It keeps its tapes, chunk boundaries and adjoint state from one call to the next
/// (a clone starts with none).
#[derive(Debug, Clone, Default)]
pub(crate) struct CpuF32Engine {
    workspace: WorkspaceCache,
}

impl CpuF32Engine {
    /// Frees the buffers kept from one call to the next (the next call allocates them again).
    pub fn release_workspace(&self) {
        self.workspace.release();
    }

    /// Loss and mean gradient over the local batch of global samples `first_sample ..
    /// first_sample + batch`, with the split of the call's time: the forward pass
    /// ([`Kernel::forward_pass`]), the loss terms and their direct derivatives, the backward
    /// pass ([`Kernel::backward_pass`]).
    ///
    /// Errors: `batch == 0`, or `params.len() != n_params()`.
    pub fn loss_and_grad(
        &self,
        p: &Problem,
        params: &[f32],
        first_sample: u64,
        batch: usize,
    ) -> Result<(LossAndGrad, StepTiming)> {
        if batch == 0 {
            return Err(SnnError::Shape("batch must be at least 1".into()));
        }
        p.check_params(params)?;
        let run = || {
            let mut ws = self.workspace.take();
            let k = Kernel::new(*p, params, first_sample, batch, ws.scatter.take());
            let mut timing = StepTiming::default();
            let clock = std::time::Instant::now();
            let mut fwd = k.forward_pass(&mut ws);
            timing.forward_s = clock.elapsed().as_secs_f64();
            let unsegmented = fwd.full_tape.is_some();
            let n_chunks = k.n.div_ceil(NEURON_CHUNK);
            let vsum: Vec<f64> = (0..batch)
                .map(|b| (0..n_chunks).map(|c| fwd.acc.vreg[c * batch + b]).sum())
                .collect();
            let (terms, n_spikes, gz_rate) = p.batch_loss_terms(&fwd.acc.counts, &vsum, batch);
            let vreg_coef = p.vreg_cost / (batch as f64 * k.n as f64 * k.t_len as f64);
            let grad = k.backward_pass(&mut fwd, &mut ws, &gz_rate, vreg_coef, &mut timing);
            let grad = k.gradient_f32(&grad);
            // The scatter order stays for the next call as the adjoint state does: in
            // unsegmented calls only (segmented BPTT is the mode that saves memory).
            ws.scatter = k.scatter.filter(|_| unsegmented);
            self.workspace.put(ws);
            let mut r = p.finish(terms, grad, n_spikes, batch);
            r.first_spikes = fwd.acc.first.take();
            (r, timing)
        };
        // Thousands of fork-joins per call (a few per step): started from a rayon worker,
        // each costs a few microseconds, from an outside thread (which must hand every one
        // to the pool and sleep until it is done) tens. On small networks, whose steps last
        // tens of microseconds, the whole call therefore runs on a worker. Larger ones stay
        // on the calling thread: there the fork-joins do not matter, and a worker's allocator
        // arena measured 0.17 GiB more peak memory (tenth and full V1).
        let small = p.net.n_neurons() <= WORKER_CALL_MAX_NEURONS;
        if p.opts.parallel && small && rayon::current_thread_index().is_none() {
            Ok(rayon::join(run, || ()).0)
        } else {
            Ok(run())
        }
    }

    /// Bytes of stored forward state per sample, `(unsegmented, segmented)`: the compact
    /// float32 tape of every step (after-spike currents every 25 steps), or one chunk's tape
    /// plus the state at every chunk boundary.
    pub fn tape_bytes_per_sample(p: &Problem) -> (usize, usize) {
        let t = p.opts.seq_len;
        let bb = batch_bytes(p, 1);
        let full = bb.tape(t as u64, true) as usize;
        let seg = match p.opts.gradient_checkpointing {
            Some(k) => {
                bb.tape(k.min(t) as u64, false) as usize + t.div_ceil(k) * bb.boundary as usize
            }
            None => full,
        };
        (full, seg)
    }

    /// The memory one call needs for a local batch of `local_batch` samples, from sizes
    /// alone: the whole local batch is alive at once in the batched kernels' layout (the
    /// forward state, one per chunk boundary when segmented, the tape of all steps or of one
    /// chunk, the adjoint state, the `f64` gradient accumulator and the returned `f32`
    /// gradient, the input weights in `f32`, the network's weights and per-edge index arrays,
    /// and in the scatter form the edges in its order).
    pub fn memory_estimate(p: &Problem, local_batch: usize) -> MemoryEstimate {
        let b = local_batch.max(1);
        let bb = batch_bytes(p, b);
        let t = p.opts.seq_len as u64;
        let (tape, boundaries) = match p.opts.gradient_checkpointing {
            Some(k) => (
                bb.tape((k as u64).min(t), false),
                bb.boundary.saturating_mul(t.div_ceil(k as u64)),
            ),
            None => (bb.tape(t, true), 0),
        };
        let params = p.n_params() as u64;
        let weights = 8 * (p.net.weights_rec.len() + p.net.weights_in.len()) as u64;
        let mut e = MemoryEstimate::new();
        e.add(
            format!(
                "stored forward state ({} steps x {b} samples, float32 tape)",
                p.opts.seq_len
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
            12 * params + 4 * p.net.weights_in.len() as u64,
        )
        .add("weights (f64)", weights)
        .add(
            "compiled network (per edge: target offset, edge id, sign)",
            p.network_bytes(),
        );
        if uses_scatter(p) {
            let threads = if p.opts.parallel {
                rayon::current_num_threads()
            } else {
                1
            };
            e.add(
                "adjoint SpMV in scatter order (per edge: source, weight)",
                ScatterSpmv::bytes(&p.net.recurrent, p.net.n_neurons(), threads),
            );
        }
        e.driven_by("run.seq_len")
            .driven_by("run.batch_size")
            .driven_by("training.gradient_checkpointing");
        e
    }
}
