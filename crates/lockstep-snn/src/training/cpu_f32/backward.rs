//! The float32 engine's backward step over a range of steps ([`Kernel::backward_steps`]):
//! the adjoint of each step's arrivals, the transposed SpMV with the recurrent weight
//! gradient (gather form here, scatter form in `scatter.rs`), the input weight gradient, and
//! the local backward of every neuron.

#![allow(clippy::needless_range_loop)] // index loops over parallel arrays read clearer here

use crate::loss::vreg_r;
use crate::training::cpu_f32::consts::{
    ACTIVE, FIRED, NEURON_CHUNK, PREFETCH_MIN_TARGETS, PREFETCH_SOURCES, SOURCE_CHUNK,
    WINDOW_TARGETS,
};
use crate::training::cpu_f32::kernel::Kernel;
use crate::training::cpu_f32::scatter::GRAD_WINDOW;
use crate::training::cpu_f32::simd::{
    has_avx2, prefetch_edges, segment_dot, segment_dot_avx2, Gather, Shared,
};
use crate::training::cpu_f32::workspace::Adjoint;
use crate::training::options::StepTiming;

/// The stored forward values of one or more consecutive steps (global neuron index): `x`
/// `[step, neuron, B]`, `asc` `[step, neuron, n_asc, B]`, `flags` `[step, neuron, B]` (see
/// [`Tape`]).
#[derive(Clone, Copy)]
pub(super) struct StepTape<'a> {
    pub(super) x: &'a [f32],
    pub(super) asc: &'a [f32],
    pub(super) flags: &'a [u8],
}

impl Kernel<'_> {
    /// Reverse pass over steps `t0 .. t0 + len`, whose stored values `tape` holds (`len`
    /// steps of each array, from step `t0`). Per step: the adjoint
    /// of the step's arrivals ([`Kernel::arrivals_adjoint`]), the transposed SpMV with the
    /// recurrent weight gradient, the input weight gradient, and the local backward of every
    /// neuron ([`Kernel::local_backward`]). The last and the first phase touch only each
    /// neuron's own state, so one task per neuron chunk runs the local backward of step `t`
    /// and then the arrivals' adjoint of step `t - 1`: one fork-join per step fewer, the same
    /// operations in the same order.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn backward_steps(
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
                    let (e0, e1) = (rec.edge_start(s0), rec.edge_start(s1));
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
    pub(super) fn arrivals_adjoint(
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
    pub(super) fn local_backward(
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
                        self.sg.dz_du_f32(un, g.th32)
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
