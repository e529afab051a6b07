//! The float32 engine's forward step ([`Kernel::forward_step`]: neuron updates, then the
//! delivery of the step's spikes), the forward steps over a range with the tape and loss
//! sums, the restore of a chunk boundary, and the tapes.

#![allow(clippy::needless_range_loop)] // index loops over parallel arrays read clearer here

use crate::loss::vreg_r;
use crate::training::cpu_f32::consts::{ACTIVE, FIRED, NEURON_CHUNK};
use crate::training::cpu_f32::kernel::Kernel;
use crate::training::cpu_f32::simd::Shared;
use crate::training::cpu_f32::workspace::{Acc, Boundary, State, Tape, ASC_STRETCH};

impl Kernel<'_> {
    /// One forward step `t`: neuron updates, then delivery of this step's recurrent and
    /// input spikes. `flags` (`[neuron, B]`) and `any` (`[neuron]`) receive the step's
    /// flags; `tape` (x, and asc where the tape keeps every step's) receives the stored
    /// values when given.
    ///
    /// Kept as one function (a kernel over 120 lines): its phases share a dozen per-step
    /// buffers and loop indices, and splitting it would only pass them between helpers.
    pub(super) fn forward_step(
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
    pub(super) fn restore(&self, b: &Boundary, t0: usize, st: &mut State) {
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

    /// Forward steps `t0..t1`, optionally recording the tape and the loss sums.
    ///
    /// `history` (`[max_delay, neuron, B]`), when given, keeps the flags of the last
    /// `max_delay` steps (step `t` in row `t % max_delay`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward_steps(
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
    pub(super) fn new_tape(&self, len: usize, marked: bool, reuse: Option<Tape>) -> Tape {
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
    pub(super) fn rebuild_asc(&self, tape: &mut Tape, k: usize, len: usize) {
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
}
