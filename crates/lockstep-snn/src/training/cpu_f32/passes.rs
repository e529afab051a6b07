//! The float32 engine's whole passes: the forward pass over all steps with the loss sums
//! (the whole tape, or the chunk boundaries of segmented BPTT; [`Kernel::forward_pass`]) and
//! the backward pass from the last step (recomputing each chunk when segmented;
//! [`Kernel::backward_pass`]).

#![allow(clippy::needless_range_loop)] // index loops over parallel arrays read clearer here

use crate::training::cpu_f32::backward::StepTape;
use crate::training::cpu_f32::consts::NEURON_CHUNK;
use crate::training::cpu_f32::kernel::Kernel;
use crate::training::cpu_f32::scatter::SpikeWindow;
use crate::training::cpu_f32::simd::LineAligned;
use crate::training::cpu_f32::workspace::{Acc, Adjoint, Boundary, State, Tape, Workspace};
use crate::training::options::StepTiming;

/// What the forward pass leaves for the loss and the backward pass.
pub(super) struct ForwardPass {
    /// Spike counts, voltage-regularization sums and the recorded spikes of sample 0.
    pub(super) acc: Acc,
    /// `[neuron, B]` spike flags of the last step (scratch of the recomputation).
    pub(super) flags: Vec<u8>,
    /// `[neuron]` "spiked in some sample" of the last step (scratch likewise).
    pub(super) any: Vec<u8>,
    /// The tape of every step (unsegmented BPTT).
    pub(super) full_tape: Option<Tape>,
    /// The chunk boundaries (segmented BPTT), in time order.
    pub(super) boundaries: Vec<Boundary>,
    /// Steps per chunk (`t_len` when unsegmented).
    pub(super) chunk: usize,
    /// The forward state after the last step (its buffers serve the recomputation).
    pub(super) state: Option<State>,
}

impl Kernel<'_> {
    /// The forward pass over all steps with the loss sums: with the whole tape, or (gradient
    /// checkpointing) keeping only the state at each chunk boundary.
    pub(super) fn forward_pass(&self, ws: &mut Workspace) -> ForwardPass {
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
    pub(super) fn backward_pass(
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
