//! The GPU engine's data layout for one model and batch ([`Layout`]): the network packed
//! into a few arrays (in-edge lists in the order of the CPU's sums, out-edge segments, group
//! constants in float32 with the float64 ones the CPU keeps), the offsets of every array in
//! its buffer, and the constants the kernels are compiled with (`bptt.wgsl`'s header).

use std::fmt::Write;

use crate::error::{Result, SnnError};
use crate::simulation::model::ModelKind;
use crate::training::problem::Problem;
use lockstep_gpu::windows::Windowed;

use super::wide_arith::Wide;

/// Float32 slots per group before the ports (`G_PORTS` in `bptt.wgsl`).
const G_PORTS: usize = 12;
/// The binding (group 0) of the first window of the windowed arrays ([`ArrayWindows`]); the
/// fixed bindings of `bptt.wgsl` (the network's constants) are below it.
pub(super) const FIRST_WINDOW: u32 = 16;

/// The arrays and sizes of one model and batch on the GPU.
pub(super) struct Layout {
    /// Samples per call (lanes).
    pub b: usize,
    /// Steps per call.
    pub t: usize,
    /// Neurons.
    pub n: usize,
    /// After-spike currents per neuron (array width).
    pub na: usize,
    /// 32-lane words per spike mask.
    pub w: usize,
    /// Largest delay (steps).
    pub d: usize,
    /// Recurrent edges (the first parameters).
    pub e_rec: usize,
    /// Input edges.
    pub e_in: usize,
    /// Whether the input weights are parameters.
    pub train_in: bool,
    /// `net_u32` (binding 0).
    pub net_u32: Vec<u32>,
    /// `net_f32` (binding 1), with the surrogate's slots at `o_sg` written per call.
    pub net_f32: Vec<f32>,
    /// `net_f64` (binding 2), with the voltage-regularization coefficient at `o_vcoef`.
    pub net_f64: Vec<f64>,
    /// `edges_u32` (binding 10): recurrent in-edge sources and weight slots, the out-edges'
    /// rows of the adjoint ring (a row per neuron and live port).
    pub edges_u32: Vec<u32>,
    /// The surrogate's three f32 slots in `net_f32` (kind, gain, width).
    pub o_sg: usize,
    /// `net_u32` index of the batch's first global sample (two words, low first), written
    /// per call.
    pub o_s0: usize,
    /// The voltage-regularization coefficient's slot in `net_f64`.
    pub o_vcoef: usize,
    /// f32 elements of `state`: u, asc, y1, y2, arrivals.
    pub state_len: usize,
    /// f32 elements of `state` that a chunk boundary saves (u, asc, y1, y2).
    pub boundary_f32: usize,
    /// u32 elements of `state_u32`: refractory counters, spike counts, Poisson ring.
    pub state_u32_len: usize,
    /// u32 elements of `masks` (fired, then active, then per step the any-sample bitmap of
    /// [`Workgroups::any_words`] words).
    pub masks_len: usize,
    /// f32 elements of `adj`.
    pub adj_len: usize,
    /// Wide elements of `vreg`: the voltage-regularization sums per (neuron, sample), then
    /// the loss sums per sample (`o_loss`).
    pub vreg_len: usize,
    /// Offset in `vreg` of the loss sums `[rate losses + 2, B]` that `loss_sums` writes
    /// ([`crate::training::problem::Problem::batch_terms_from_sums`]).
    pub o_loss: usize,
    /// Loss sums per sample (`rate losses + 2`).
    pub loss_parts: usize,
    /// Steps per tape buffer.
    pub tape_steps: usize,
    /// Workgroups of each kernel and of each part of the fused ones (`*_WG` in the shader).
    pub wg: Workgroups,
    /// The WGSL constants (prepended to `bptt.wgsl`).
    pub header: String,
    /// The windows of the arrays that may exceed one binding (the network's and the
    /// per-sample ones).
    pub windows: ArrayWindows,
    /// The kernels' wide type (of `net_f64` on the device, `vreg` and `grad`).
    pub wide: Wide,
}

/// The float32 number `f` with `(x as f64) > th` exactly when `x > f` for every float32 `x`
/// (the largest float32 at or below `th`).
fn f32_at_or_below(th: f64) -> f32 {
    let f = th as f32;
    if (f as f64) > th {
        f.next_down()
    } else {
        f
    }
}

/// The float32 number `f` with `(x as f64) >= th` exactly when `x >= f`, and `(x as f64) <
/// th` exactly when `x < f` (the smallest float32 at or above `th`).
fn f32_at_or_above(th: f64) -> f32 {
    let f = th as f32;
    if (f as f64) < th {
        f.next_up()
    } else {
        f
    }
}

/// Invocations per workgroup of `update_draw` (`UWG` in `bptt.wgsl`; the other kernels' are
/// 64).
pub(super) const UPDATE_WG: usize = 256;

/// Workgroups (of 64 invocations; `update_draw`'s of [`UPDATE_WG`]) per dispatch of each
/// kernel, and of the parts of the two fused ones, for one model and batch; with the
/// neurons per workgroup of the update and the words of the spike masks' any-sample bitmap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Workgroups {
    /// `deliver`: one invocation per (target, port, sample).
    pub deliver: u32,
    /// The update part of `update_draw`: `npw` whole neurons each (B <= 32) or eight 32-lane
    /// words.
    pub neuron: u32,
    /// `draw` and the draw part of `spmv_in`: one invocation per (Poisson node, sample).
    pub draw: u32,
    /// The draw part of `update_draw` (workgroups of [`UPDATE_WG`]).
    pub draw_update: u32,
    /// Neurons per workgroup of the update (`NPW`; B <= 32: `UPDATE_WG / B`).
    pub npw: usize,
    /// Words of the any-sample bitmap per workgroup of the update (`WPG`: bit r of word k
    /// is whether neuron `32 k + r` of the workgroup fired in some sample; B <= 32 only,
    /// else 0).
    pub wpg: usize,
    /// Words of the any-sample bitmap per step (`ANYW = neuron * wpg`; 0 for B > 32).
    pub any_words: usize,
    /// The SpMV part of `spmv_in`: one invocation per (source, sample).
    pub spmv: u32,
    /// The input-gradient part of `spmv_in`: one invocation per input edge.
    pub input_grad: u32,
    /// `neuron_backward`: one invocation per (neuron, sample).
    pub neuron_backward: u32,
    /// `permute_weights`: one invocation per recurrent edge.
    pub permute: u32,
    /// `loss_sums`: one invocation per (neuron, sample), then one per (loss sum, sample).
    pub loss: u32,
}

impl Workgroups {
    /// The counts for `n` neurons, `np` ports, `b` samples, `n_pois` Poisson nodes, `e_in`
    /// input edges and `e_rec` recurrent edges.
    pub fn new(
        n: usize,
        np: usize,
        b: usize,
        n_pois: usize,
        e_in: usize,
        e_rec: usize,
    ) -> Workgroups {
        let wg = |threads: usize| threads.div_ceil(64) as u32;
        let (npw, wpg) = if b <= 32 {
            let npw = UPDATE_WG / b.max(1);
            (npw, npw.div_ceil(32))
        } else {
            (1, 0)
        };
        let neuron = if b <= 32 {
            n.div_ceil(npw)
        } else {
            (n * b.div_ceil(32)).div_ceil(UPDATE_WG / 32)
        };
        Workgroups {
            deliver: wg(n * np * b),
            neuron: neuron as u32,
            draw: wg(n_pois * b),
            draw_update: (n_pois * b).div_ceil(UPDATE_WG) as u32,
            npw,
            wpg,
            any_words: neuron * wpg,
            spmv: wg(n * b),
            input_grad: wg(e_in),
            neuron_backward: wg(n * b),
            permute: wg(e_rec),
            loss: 0,
        }
    }

    /// `update_draw`'s workgroups.
    pub fn update_draw(&self) -> u32 {
        self.neuron + self.draw_update
    }

    /// `spmv_in`'s workgroups (with the input parts when the input weights are trained).
    pub fn spmv_in(&self, train_in: bool) -> u32 {
        if train_in {
            self.spmv + self.input_grad + self.draw
        } else {
            self.spmv
        }
    }
}

/// The in-edge lists of `csr` per (class `c = target * np + port`, delay slot `q = d -
/// delay`), each in the CSR's own order (sources ascending, slots ascending): the lists'
/// pointers `[n * np * d + 1]` and per in-edge its (source, CSR slot).
fn in_edge_lists(
    csr: &crate::network::Csr,
    n: usize,
    np: usize,
    d: usize,
) -> (Vec<u32>, Vec<(u32, u32)>) {
    let classes = n * np * d.max(1);
    let mut count = vec![0u32; classes + 1];
    let mut items: Vec<(usize, u32, u32)> = Vec::with_capacity(csr.len());
    for s in 0..csr.seg_ptr.len().saturating_sub(1) {
        for seg in csr.segments_of(s) {
            let q = d - seg.delay as usize;
            for e in seg.start..seg.end {
                let j = csr.target_off[e as usize] as usize / np;
                let key = (j * np + seg.port as usize) * d + q;
                count[key + 1] += 1;
                items.push((key, s as u32, e));
            }
        }
    }
    for k in 0..classes {
        count[k + 1] += count[k];
    }
    let mut fill = count.clone();
    let mut out = vec![(0u32, 0u32); items.len()];
    for (key, s, e) in items {
        out[fill[key] as usize] = (s, e);
        fill[key] += 1;
    }
    (count, out)
}

/// The group constants: float32 (`G_*` slots of `bptt.wgsl`, `gf` per group) and float64
/// (the threshold and the after-spike jumps the CPU computes in f64, `gd` per group), for
/// `np` ports and `na` after-spike currents. Returns `(gf, gd, f32 constants, f64 constants)`.
fn group_constants(
    groups: &[crate::network::Group],
    np: usize,
    na: usize,
) -> (usize, usize, Vec<f32>, Vec<f64>) {
    let gf = G_PORTS + 6 * np + 5 * na;
    let gd = 1 + 2 * na;
    let mut net_f32 = vec![0.0f32; gf * groups.len()];
    let mut net_f64 = vec![0.0f64; gd * groups.len()];
    for (gi, g) in groups.iter().enumerate() {
        let c = &g.consts;
        let f = &mut net_f32[gi * gf..(gi + 1) * gf];
        f[0] = c.p33 as f32;
        f[1] = c.p30 as f32;
        f[2] = c.expm1_tau_m as f32;
        f[3] = c.i_e as f32;
        f[4] = (0.0 + c.i_e) as f32 * c.p30 as f32;
        f[5] = f32_at_or_below(c.th);
        f[6] = f32_at_or_above(c.th);
        f[7] = c.th as f32;
        f[8] = c.v_reset as f32;
        f[9] = (c.th - c.v_reset) as f32;
        f[10] = c.lower_bound as f32;
        f[11] = f32_at_or_above(c.lower_bound);
        for (k, pc) in c.ports.iter().enumerate().take(np) {
            let o = G_PORTS + 6 * k;
            f[o] = pc.p11 as f32;
            f[o + 1] = pc.p21 as f32;
            f[o + 2] = pc.p22 as f32;
            f[o + 3] = pc.p31 as f32;
            f[o + 4] = pc.p32 as f32;
            f[o + 5] = pc.psc_init as f32;
        }
        for (a, ac) in c.asc.iter().enumerate() {
            let o = G_PORTS + 6 * np + 5 * a;
            f[o] = ac.stable as f32;
            f[o + 1] = ac.decay as f32;
            f[o + 2] = ac.amp as f32;
            f[o + 3] = ac.refr_decay as f32;
            f[o + 4] = (1.0 + (ac.refr_decay - 1.0)) as f32;
        }
        let d64 = &mut net_f64[gi * gd..(gi + 1) * gd];
        d64[0] = c.th;
        for (a, ac) in c.asc.iter().enumerate() {
            d64[1 + 2 * a] = ac.amp;
            d64[2 + 2 * a] = ac.refr_decay;
        }
    }
    (gf, gd, net_f32, net_f64)
}

/// The kernels index `what` (`len` elements) with 32 bits.
///
/// Errors: [`SnnError::Shape`] when `len` does not fit.
fn fits_u32(what: &str, len: usize) -> Result<()> {
    if len > u32::MAX as usize {
        return Err(SnnError::Shape(format!(
            "the GPU engine indexes {what} with 32 bits, but it has {len} elements; reduce run.batch_size or run.seq_len"
        )));
    }
    Ok(())
}

/// The sizes of one model and batch that the kernels are compiled with.
struct Dims {
    /// Neurons.
    n: usize,
    /// Receptor ports per cell (at least 1).
    np: usize,
    /// After-spike currents per neuron.
    na: usize,
    /// Steps per call.
    t: usize,
    /// 32-lane words per spike mask.
    w: usize,
    /// Samples per call.
    b: usize,
    /// Largest delay (steps).
    d: usize,
    /// Rows of the delay rings (`d + 1`).
    rl: usize,
    /// Virtual (input) nodes.
    nv: usize,
    /// Poisson input nodes.
    n_pois: usize,
    /// Recurrent edges.
    e_rec: usize,
    /// Input edges.
    e_in: usize,
    /// Rate losses (`TargetFiringRate`).
    n_rate: usize,
}

impl Dims {
    /// The sizes of `p` at `b` samples.
    ///
    /// Errors: [`SnnError::Shape`] for more than 32 receptor ports, or masks or edges
    /// beyond 32-bit indices.
    fn of(p: &Problem, b: usize) -> Result<Dims> {
        let net = p.net;
        let dims = Dims {
            n: net.n_neurons(),
            np: net.n_ports.max(1),
            na: net.n_asc,
            t: p.opts.seq_len,
            w: b.div_ceil(32),
            b,
            d: net.max_delay,
            rl: net.max_delay + 1,
            nv: net.n_virtual(),
            n_pois: p.inputs.poisson_nodes().len(),
            e_rec: net.weights_rec.len(),
            e_in: net.weights_in.len(),
            n_rate: p.rate_losses.len(),
        };
        fits_u32("the spike masks", 2 * dims.t * dims.n * dims.w)?;
        fits_u32("the edges", dims.e_rec.max(dims.e_in))?;
        if dims.np > 32 {
            return Err(SnnError::Shape(format!(
                "the GPU engine handles up to 32 receptor ports per cell, the network has {}",
                dims.np
            )));
        }
        Ok(dims)
    }
}

/// The groups' integer constants and the adjoint ring's rows: per neuron, one row per live
/// port of its group (compact port index: the port's rank among the group's live ports).
struct Rows {
    /// Per neuron, its group.
    group_of: Vec<u32>,
    /// Per group: GLIF (1) or LIF, refractory steps, after-spike currents, live-port mask.
    gu: Vec<u32>,
    /// Per group, its live ports as a bit mask.
    live_masks: Vec<u32>,
    /// Per neuron its first ring row, then the row count (`[n + 1]`).
    mu_row: Vec<u32>,
    /// Ring rows per sample and delay slot.
    live_rows: usize,
}

impl Rows {
    /// The rows of `p`'s network.
    ///
    /// Errors: [`SnnError::Shape`] when the ring is beyond 32-bit indices.
    fn of(p: &Problem, dims: &Dims) -> Result<Rows> {
        let groups = &p.net.groups;
        let live_masks: Vec<u32> = p
            .live_ports
            .iter()
            .map(|live| live.iter().fold(0u32, |m, &k| m | (1u32 << k)))
            .collect();
        let mut group_of = vec![0u32; dims.n];
        let mut gu: Vec<u32> = Vec::with_capacity(4 * groups.len());
        for (gi, (g, &mask)) in groups.iter().zip(&live_masks).enumerate() {
            group_of[g.start..g.end].fill(gi as u32);
            gu.extend_from_slice(&[
                (g.consts.kind == ModelKind::Glif) as u32,
                g.consts.refractory_steps,
                g.consts.asc.len() as u32,
                mask,
            ]);
        }
        let mut mu_row = Vec::with_capacity(dims.n + 1);
        let mut rows = 0u64;
        for &g in &group_of {
            mu_row.push(rows);
            rows += live_masks[g as usize].count_ones() as u64;
        }
        mu_row.push(rows);
        let live_rows = rows as usize;
        fits_u32("the adjoint ring", dims.rl * live_rows * dims.b)?;
        Ok(Rows {
            group_of,
            gu,
            live_masks,
            mu_row: mu_row.iter().map(|&r| r as u32).collect(),
            live_rows,
        })
    }

    /// The ring row of an edge into target offset `off` (`target * np`) on `port`.
    fn ring_row(&self, off: u32, port: u32, np: usize) -> u32 {
        let j = (off as usize) / np;
        let m = self.live_masks[self.group_of[j] as usize];
        self.mu_row[j] + (m & ((1u32 << port) - 1)).count_ones()
    }
}

/// `(name, offset)` of the parts of an array, as the kernels name them (`O_*`).
type Named = Vec<(&'static str, usize)>;

/// `net_u32` (binding 0): the network's and the inputs' indices, with each part's offset by
/// name (`O_*` in `bptt.wgsl`).
struct NetworkIndices {
    /// The array.
    data: Vec<u32>,
    /// `(name, offset)` of each part.
    offsets: Named,
    /// The batch's first global sample (two words), written per call.
    o_s0: usize,
    /// Whether the inputs have file events (their counts per step and node are a part).
    has_file: bool,
}

/// Packs `net_u32`: each neuron's group and ring row, the groups' integers, the in-edge
/// lists' pointers (`ptrs`: recurrent, input) and the input in-edges `iin` (node, CSR slot),
/// the recurrent out-edge segments, per input edge (CSR slot) its node, `delay | port << 16`
/// and ring row, the Poisson nodes `pois`, the seed, the batch's first sample, the file
/// events per (step, node), a zero (`O_ZERO`, for `without_64bit.wgsl`'s `opaque`) and, for
/// 32-bit kernels ([`Wide::F32`]), the Poisson nodes' draw thresholds (`O_PTPTR`: per node
/// its first pair, `[n_pois + 1]`; `O_PTHR`: `(threshold low, high, count)` per pair,
/// [`crate::input::poisson_thresholds`]).
///
/// Errors: [`SnnError::Shape`] when the array is beyond 32-bit indices.
fn network_indices(
    p: &Problem,
    dims: &Dims,
    rows: &Rows,
    [rptr, iptr]: [&[u32]; 2],
    iin: &[(u32, u32)],
    pois: &[(u32, f64)],
    wide: Wide,
) -> Result<NetworkIndices> {
    let mut net_u32: Vec<u32> = Vec::new();
    let mut offsets: Named = Vec::new();
    let mut push = |name: &'static str, v: &mut Vec<u32>, data: &[u32]| {
        offsets.push((name, v.len()));
        v.extend_from_slice(data);
    };
    push("O_GROUP_OF", &mut net_u32, &rows.group_of);
    push("O_MUROW", &mut net_u32, &rows.mu_row);
    push("O_GU", &mut net_u32, &rows.gu);
    push("O_RPTR", &mut net_u32, rptr);
    push("O_IPTR", &mut net_u32, iptr);
    let isrc: Vec<u32> = iin.iter().map(|&(v, _)| v).collect();
    let iw: Vec<u32> = iin.iter().map(|&(_, e)| e).collect();
    push("O_ISRC", &mut net_u32, &isrc);
    push("O_IW", &mut net_u32, &iw);
    let rec = &p.net.recurrent;
    push("O_SEGPTR", &mut net_u32, &rec.seg_ptr);
    let seg: Vec<u32> = rec
        .segments
        .iter()
        .flat_map(|s| [s.start, s.end, s.delay, s.port])
        .collect();
    push("O_SEG", &mut net_u32, &seg);
    let inp = &p.net.input;
    let mut inv = vec![0u32; dims.e_in];
    let mut indp = vec![0u32; dims.e_in];
    for v in 0..inp.seg_ptr.len().saturating_sub(1) {
        for seg in inp.segments_of(v) {
            for e in seg.start as usize..seg.end as usize {
                inv[e] = v as u32;
                indp[e] = seg.delay | (seg.port << 16);
            }
        }
    }
    push("O_INV", &mut net_u32, &inv);
    push("O_INDP", &mut net_u32, &indp);
    let inrow: Vec<u32> = (0..dims.e_in)
        .map(|e| rows.ring_row(inp.target_off[e], indp[e] >> 16, dims.np))
        .collect();
    push("O_INOFF", &mut net_u32, &inrow);
    let pnode: Vec<u32> = pois.iter().map(|&(v, _)| v).collect();
    push("O_PNODE", &mut net_u32, &pnode);
    let seed = p.inputs.poisson_seed();
    push("O_SEED", &mut net_u32, &[seed as u32, (seed >> 32) as u32]);
    let o_s0 = net_u32.len();
    push("O_S0", &mut net_u32, &[0, 0]);
    let t_len = dims.t;
    let has_file = (0..t_len).any(|s| p.inputs.file_events(s).next().is_some());
    let mut file = Vec::new();
    if has_file {
        file = vec![0u32; t_len * dims.nv];
        for s in 0..t_len {
            for (v, c) in p.inputs.file_events(s) {
                file[s * dims.nv + v as usize] += c;
            }
        }
    }
    push("O_FILE", &mut net_u32, &file);
    push("O_ZERO", &mut net_u32, &[0]);
    let (mut ptr, mut pairs) = (Vec::new(), Vec::new());
    if wide == Wide::F32 {
        ptr.push(0u32);
        for &(_, mean) in pois {
            for (t, k) in crate::input::poisson_thresholds(mean) {
                pairs.extend_from_slice(&[t as u32, (t >> 32) as u32, k]);
            }
            fits_u32("the Poisson draws' thresholds", pairs.len())?;
            ptr.push((pairs.len() / 3) as u32);
        }
    }
    push("O_PTPTR", &mut net_u32, &ptr);
    push("O_PTHR", &mut net_u32, &pairs);
    fits_u32("the network's index array", net_u32.len())?;
    Ok(NetworkIndices {
        data: net_u32,
        offsets,
        o_s0,
        has_file,
    })
}

/// `edges_u32`: the recurrent in-edges' sources and weight slots (`rin`, in-edge order),
/// then per recurrent edge (CSR order) its target's ring row; with each part's offset by
/// name.
///
/// Errors: [`SnnError::Shape`] when the array is beyond 32-bit indices.
fn edge_indices(
    p: &Problem,
    rin: &[(u32, u32)],
    rows: &Rows,
    np: usize,
) -> Result<(Vec<u32>, Named)> {
    let rec = &p.net.recurrent;
    let e_rec = p.net.weights_rec.len();
    let mut edges_u32 = Vec::with_capacity(3 * e_rec);
    let mut offsets = vec![("O_RSRC", edges_u32.len())];
    edges_u32.extend(rin.iter().map(|&(s, _)| s));
    offsets.push(("O_RW", edges_u32.len()));
    edges_u32.extend(rin.iter().map(|&(_, e)| e));
    offsets.push(("O_TOFF", edges_u32.len()));
    let mut rec_rows = vec![0u32; e_rec];
    for seg in &rec.segments {
        let (a, b) = (seg.start as usize, seg.end as usize);
        for (row, &off) in rec_rows[a..b].iter_mut().zip(&rec.target_off[a..b]) {
            *row = rows.ring_row(off, seg.port, np);
        }
    }
    edges_u32.extend_from_slice(&rec_rows);
    fits_u32("the edge index array", edges_u32.len())?;
    Ok((edges_u32, offsets))
}

/// `net_f32` (binding 1) and `net_f64` (binding 2, `net_wide` in the kernels: float64, or
/// each rounded to float32 for [`Wide::F32`]): the group constants, the surrogate's three
/// slots (written per call) and in float64 the Poisson means and `e^-mean`, the
/// voltage-regularization coefficient (written per call), the rate losses' factors and their
/// targets (`[loss, neuron]`), and the remainders of the groups' float64 constants after
/// rounding to float32 (`O_GDLO`, read by `without_64bit.wgsl`).
struct FloatConstants {
    /// Float32 constants per group.
    gf: usize,
    /// Float64 constants per group.
    gd: usize,
    net_f32: Vec<f32>,
    net_f64: Vec<f64>,
    /// The surrogate's slots in `net_f32`.
    o_sg: usize,
    /// The voltage-regularization coefficient's slot in `net_f64`.
    o_vcoef: usize,
    /// `(name, offset)` of the parts after the groups'.
    offsets: Named,
}

/// The float constants of `groups` (`np` ports, `na` after-spike currents), the Poisson
/// nodes `pois` (node, mean per step) and the rate losses (per loss `[neuron]` targets and
/// the count -> rate factor).
fn float_constants(
    groups: &[crate::network::Group],
    np: usize,
    na: usize,
    pois: &[(u32, f64)],
    rate_losses: &[(Vec<f64>, f64)],
) -> FloatConstants {
    let (gf, gd, mut net_f32, mut net_f64) = group_constants(groups, np, na);
    let o_sg = net_f32.len();
    net_f32.extend_from_slice(&[0.0; 3]);
    let mut offsets = vec![("O_SG", o_sg), ("O_PMEAN", net_f64.len())];
    net_f64.extend(pois.iter().map(|&(_, mean)| mean));
    offsets.push(("O_PP0", net_f64.len()));
    net_f64.extend(pois.iter().map(|&(_, mean)| (-mean).exp()));
    let o_vcoef = net_f64.len();
    offsets.push(("O_VCOEF", o_vcoef));
    net_f64.push(0.0);
    offsets.push(("O_RSCALE", net_f64.len()));
    net_f64.extend(rate_losses.iter().map(|(_, scale)| *scale));
    offsets.push(("O_RTARGET", net_f64.len()));
    for (target, _) in rate_losses {
        net_f64.extend_from_slice(target);
    }
    offsets.push(("O_GDLO", net_f64.len()));
    let lo: Vec<f64> = net_f64[..gd * groups.len()]
        .iter()
        .map(|&x| x - x as f32 as f64)
        .collect();
    net_f64.extend(lo);
    FloatConstants {
        gf,
        gd,
        net_f32,
        net_f64,
        o_sg,
        o_vcoef,
        offsets,
    }
}

/// The per-sample arrays' sizes and offsets (elements): `state` (u, asc, y1, y2,
/// arrivals), `state_u32` (refractory counters, spike counts, Poisson ring), the masks
/// (fired, then active, then the any-sample bitmap), `adj` (the adjoints of u, asc, y1, y2, the ring, gz, gz_rate) and
/// `vreg` (the voltage-regularization sums, then the loss sums per sample).
struct ArrayOffsets {
    /// `(name, offset)` as the kernels name them.
    named: Named,
    state_len: usize,
    boundary_f32: usize,
    state_u32_len: usize,
    masks_len: usize,
    adj_len: usize,
    vreg_len: usize,
    o_loss: usize,
}

impl ArrayOffsets {
    /// The offsets for `dims`, `live_rows` ring rows per sample and `any_words` words of
    /// the any-sample bitmap per step.
    ///
    /// Errors: [`SnnError::Shape`] when an array is beyond 32-bit indices.
    fn of(dims: &Dims, live_rows: usize, any_words: usize) -> Result<ArrayOffsets> {
        let (n, na, np, b) = (dims.n, dims.na, dims.np, dims.b);
        let nb = n * b;
        let (o_u, o_asc) = (0, nb);
        let o_y1 = o_asc + n * na * b;
        let o_y2 = o_y1 + n * np * b;
        let o_arr = o_y2 + n * np * b;
        let state_len = o_arr + n * np * b;
        let (o_refr, o_counts, o_pring) = (0, nb, 2 * nb);
        let state_u32_len = o_pring + dims.rl * dims.nv * b;
        let (o_au, o_aa) = (0, nb);
        let o_a1 = o_aa + n * na * b;
        let o_a2 = o_a1 + n * np * b;
        let o_mu = o_a2 + n * np * b;
        let o_gz = o_mu + dims.rl * live_rows * b;
        let o_gzrate = o_gz + nb;
        let adj_len = o_gzrate + nb;
        let o_loss = nb;
        let vreg_len = o_loss + (dims.n_rate + 2) * b;
        fits_u32("the state", state_len)?;
        fits_u32(
            "the spike masks",
            2 * dims.t * n * dims.w + dims.t * any_words,
        )?;
        fits_u32("the adjoint state", adj_len)?;
        fits_u32("the Poisson ring", state_u32_len)?;
        let named = vec![
            ("O_U", o_u),
            ("O_ASC", o_asc),
            ("O_Y1", o_y1),
            ("O_Y2", o_y2),
            ("O_ARR", o_arr),
            ("O_REFR", o_refr),
            ("O_COUNTS", o_counts),
            ("O_PRING", o_pring),
            ("O_ACTIVE", dims.t * n * dims.w),
            ("O_ANY", 2 * dims.t * n * dims.w),
            ("O_AU", o_au),
            ("O_AA", o_aa),
            ("O_A1", o_a1),
            ("O_A2", o_a2),
            ("O_MU", o_mu),
            ("O_GZ", o_gz),
            ("O_GZRATE", o_gzrate),
            ("O_LOSS", o_loss),
        ];
        Ok(ArrayOffsets {
            named,
            state_len,
            boundary_f32: o_arr,
            state_u32_len,
            masks_len: 2 * dims.t * n * dims.w + dims.t * any_words,
            adj_len,
            vreg_len,
            o_loss,
        })
    }
}

/// Steps per tape buffer: as many as one binding of `max_binding` bytes holds, at most the
/// tape's length (every step, or a checkpointing chunk).
///
/// Errors: [`SnnError::Shape`] when one step alone exceeds `max_binding`.
fn tape_steps(p: &Problem, dims: &Dims, max_binding: u64) -> Result<usize> {
    let (x_step, asc_step) = tape_step_bytes(dims.n, dims.na, dims.b);
    let per_step = x_step.max(asc_step);
    if per_step > max_binding {
        return Err(SnnError::Shape(format!(
            "one step of the GPU tape needs {per_step} bytes, more than the adapter binds ({max_binding}); reduce run.batch_size"
        )));
    }
    let tape_len = match p.opts.gradient_checkpointing {
        Some(k) => k.min(dims.t).max(1),
        None => dims.t.max(1),
    };
    Ok(((max_binding / per_step) as usize).clamp(1, tape_len))
}

/// The WGSL constants `bptt.wgsl` is compiled with: the sizes, the group constants' strides
/// `(gf, gd)`, every named offset, the workgroup counts the fused kernels split at and the
/// model's switches (`has_file`: the inputs have file events).
fn wgsl_header(
    p: &Problem,
    dims: &Dims,
    rows: &Rows,
    (gf, gd): (usize, usize),
    wg: &Workgroups,
    offsets: &[(&str, usize)],
    has_file: bool,
) -> String {
    let mut h = String::new();
    let mut c = |name: &str, v: usize| {
        let _ = writeln!(h, "const {name}: u32 = {v}u;");
    };
    c("N", dims.n);
    c("NP", dims.np);
    c("NA", dims.na.max(1));
    c("NA_MAX", dims.na.max(1));
    c("W", dims.w);
    c("B", dims.b);
    c("D", dims.d);
    c("RL", dims.rl);
    c("T", dims.t);
    c("NV", dims.nv);
    c("NPOIS", dims.n_pois);
    c("E_IN", dims.e_in);
    c("E_REC", dims.e_rec);
    c("GF", gf);
    c("GD", gd);
    c("O_WIN", dims.e_rec);
    c("O_WPERM", dims.e_rec + dims.e_in);
    c("LIVE_ROWS", rows.live_rows);
    c("NRATE", dims.n_rate);
    for (name, o) in offsets {
        c(name, *o);
    }
    c("UWG", UPDATE_WG);
    c("NPW", wg.npw);
    c("WPG", wg.wpg);
    c("ANYW", wg.any_words);
    c("NEURON_WG", wg.neuron as usize);
    c("SPMV_WG", wg.spmv as usize);
    c("INGRAD_WG", wg.input_grad as usize);
    let _ = writeln!(h, "const TRAIN_IN: bool = {};", p.opts.train_input_weights);
    let _ = writeln!(h, "const HAS_FILE: bool = {has_file};");
    let _ = writeln!(h, "const VREG_ON: bool = {};", p.vreg_cost != 0.0);
    h
}

/// The arrays that may exceed one binding, as windows from binding [`FIRST_WINDOW`] on, in
/// this order: the network's (`net_u32`, `net_u32_len` values; the weights, `[2 e_rec +
/// e_in]` f32; the gradient, `[e_rec + e_in]` of the wide type; `edges`, `edges_len`
/// values) and the per-sample ones of `arrays` (`state`, `state_u32`, `masks`, `vreg`,
/// `adj`).
pub(super) struct ArrayWindows {
    /// Every array's windows, in binding order.
    pub all: Vec<Windowed>,
}

/// The windows of every such array for `dims` and `arrays` under a binding limit of
/// `max_binding` bytes.
fn windows(
    (net_u32_len, edges_len): (usize, usize),
    dims: &Dims,
    arrays: &ArrayOffsets,
    max_binding: u64,
    wide: Wide,
) -> ArrayWindows {
    let (wt, wb) = (wide.wgsl_type(), wide.bytes());
    let specs: [(&'static str, &'static str, u64, usize, bool); 9] = [
        ("net_u32", "u32", 4, net_u32_len, true),
        ("weights", "f32", 4, 2 * dims.e_rec + dims.e_in, false),
        ("grad", wt, wb, dims.e_rec + dims.e_in, false),
        ("edges", "u32", 4, edges_len, true),
        ("state", "f32", 4, arrays.state_len, false),
        ("state_u32", "u32", 4, arrays.state_u32_len, false),
        ("masks", "u32", 4, arrays.masks_len, false),
        ("vreg", wt, wb, arrays.vreg_len, false),
        ("adj", "f32", 4, arrays.adj_len, false),
    ];
    let mut all: Vec<Windowed> = Vec::with_capacity(specs.len());
    for (name, ty, bytes, len, read_only) in specs {
        let first = all.last().map_or(FIRST_WINDOW, Windowed::next_binding);
        all.push(Windowed::new(
            name,
            ty,
            bytes,
            len,
            max_binding,
            first,
            read_only,
        ));
    }
    ArrayWindows { all }
}

/// Bytes of float32 after-spike currents and potentials one step of the tape takes.
pub(super) fn tape_step_bytes(n: usize, na: usize, b: usize) -> (u64, u64) {
    (4 * (n * b) as u64, 4 * (n * na.max(1) * b) as u64)
}

impl Layout {
    /// The layout of `p` for `b` samples, with tape buffers of at most `max_binding` bytes,
    /// for kernels whose wide type is `wide`.
    ///
    /// Errors: [`SnnError::Shape`] when one step of the tape alone exceeds `max_binding`, or
    /// when an index would not fit in 32 bits.
    pub fn new(p: &Problem, b: usize, max_binding: u64, wide: Wide) -> Result<Layout> {
        let dims = Dims::of(p, b)?;
        let net = p.net;
        let pois = p.inputs.poisson_nodes();
        let rows = Rows::of(p, &dims)?;
        let (rptr, rin) = in_edge_lists(&net.recurrent, dims.n, dims.np, dims.d);
        let (iptr, iin) = in_edge_lists(&net.input, dims.n, dims.np, dims.d);
        let index = network_indices(p, &dims, &rows, [&rptr, &iptr], &iin, pois, wide)?;
        let (edges_u32, edge_offsets) = edge_indices(p, &rin, &rows, dims.np)?;
        let consts = float_constants(&net.groups, dims.np, dims.na, pois, p.rate_losses);
        let wg0 = Workgroups::new(dims.n, dims.np, b, dims.n_pois, dims.e_in, dims.e_rec);
        let arrays = ArrayOffsets::of(&dims, rows.live_rows, wg0.any_words)?;
        let tape_steps = tape_steps(p, &dims, max_binding)?;
        let mut wg = wg0;
        wg.loss = (dims.n * b + (dims.n_rate + 2) * b).div_ceil(64) as u32;
        let offsets: Vec<(&str, usize)> = [&index.offsets, &edge_offsets, &consts.offsets]
            .into_iter()
            .flatten()
            .chain(&arrays.named)
            .copied()
            .collect();
        let gfd = (consts.gf, consts.gd);
        let mut header = wgsl_header(p, &dims, &rows, gfd, &wg, &offsets, index.has_file);
        header.push_str(&wide.wgsl());
        let lens = (index.data.len(), edges_u32.len());
        let windows = windows(lens, &dims, &arrays, max_binding, wide);
        for w in &windows.all {
            header.push_str(&w.wgsl());
        }
        Ok(Layout {
            b,
            t: dims.t,
            n: dims.n,
            na: dims.na,
            w: dims.w,
            d: dims.d,
            e_rec: dims.e_rec,
            e_in: dims.e_in,
            train_in: p.opts.train_input_weights,
            net_u32: index.data,
            net_f32: consts.net_f32,
            net_f64: consts.net_f64,
            edges_u32,
            o_sg: consts.o_sg,
            o_s0: index.o_s0,
            o_vcoef: consts.o_vcoef,
            state_len: arrays.state_len,
            boundary_f32: arrays.boundary_f32,
            state_u32_len: arrays.state_u32_len,
            masks_len: arrays.masks_len,
            adj_len: arrays.adj_len,
            vreg_len: arrays.vreg_len,
            o_loss: arrays.o_loss,
            loss_parts: dims.n_rate + 2,
            tape_steps,
            wg,
            header,
            windows,
            wide,
        })
    }

    /// The steps the tape holds: all of them, or one chunk of segmented BPTT.
    pub fn tape_len(&self, chunk: Option<usize>) -> usize {
        match chunk {
            Some(k) => k.min(self.t).max(1),
            None => self.t.max(1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{f32_at_or_above, f32_at_or_below};

    /// The float32 thresholds decide every comparison as the CPU's f64 comparison does.
    #[test]
    fn float32_thresholds_match_f64_comparisons() {
        for th in [1.0, 0.1, -0.1, 15.000000001, 1e-40, -3.4e38, 20.0 / 3.0] {
            let (lo, hi) = (f32_at_or_below(th), f32_at_or_above(th));
            let mut x = lo.next_down().next_down();
            for _ in 0..6 {
                assert_eq!((x as f64) > th, x > lo, "{x} > {th}");
                assert_eq!((x as f64) >= th, x >= hi, "{x} >= {th}");
                assert_eq!((x as f64) < th, x < hi, "{x} < {th}");
                x = x.next_up();
            }
        }
    }
}
