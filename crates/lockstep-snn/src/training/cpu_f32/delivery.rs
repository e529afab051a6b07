//! The float32 engine's spike delivery ([`Kernel::deliver`]): each step's recurrent and
//! input spikes added into the arrival ring, every ring entry in the serial order.

#![allow(clippy::needless_range_loop)] // index loops over parallel arrays read clearer here

use rayon::prelude::*;

use crate::training::cpu_f32::consts::{FIRED, PARALLEL_DRAWS, PREFETCH_SOURCES, RING_PREFETCH};
use crate::training::cpu_f32::kernel::Kernel;
use crate::training::cpu_f32::simd::{prefetch, prefetch_edges, prefetch_ptr, Shared};
use crate::training::cpu_f32::workspace::State;

impl Kernel<'_> {
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
    pub(super) fn deliver(
        &self,
        st: &mut State,
        t: usize,
        flags: &[u8],
        any: &[u8],
        min_arrival: usize,
    ) {
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
}
