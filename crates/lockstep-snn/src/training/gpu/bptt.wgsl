// The float32 BPTT step of lockstep's spiking networks as wgpu compute kernels.
//
// The host prepends the constants of one model and batch (`const N: u32 = ...;` and the
// offsets `O_*` of the packed arrays; see `layout.rs`), then the wide type and the functions
// that need or emulate 64-bit types (`alias wide = f64;` with `with_64bit.wgsl` where the
// adapter has SHADER_F64 and SHADER_INT64, else `alias wide = f32;` with
// `without_64bit.wgsl`; `wide_arith.rs`). Every kernel repeats the float32
// CPU engine's operations in its order (`training/cpu_f32/`), so that on a driver without
// fused multiply-add (Mesa's lavapipe) the forward pass has the CPU engine's bits:
//
// * `draw`: the Poisson counts of one step, keyed by (seed, global sample, node, step) as
//   `Inputs::for_each` draws them (`poisson_count`: splitmix64 and the inversion, in 64-bit
//   types or emulated in 32-bit ones, the CPU's counts either way); also the tail of
//   `update_draw` and `spmv_in` (one dispatch each: the host's workgroup ranges, `*_WG`);
// * `permute_weights` (once per call): the recurrent weights in the in-edge lists' order;
// * `deliver`: the arrivals of one step, pulled per (target, port, sample) over the target's
//   in-edges in the order the CPU ring receives them (steps ascending, i.e. delays
//   descending; within a step the recurrent sources ascending, then the file events, then the
//   Poisson events of the input nodes ascending), skipping the recurrent sources that fired
//   in no sample of the batch by the step's any-sample bitmap (B <= 32);
// * `update_draw`: one neuron and sample through one step (membrane, spike, reset,
//   refractory counter, after-spike currents, alpha PSCs), writing the tape and the spike
//   masks, then the step's Poisson draws; the workgroups of the update (UWG invocations)
//   hold whole 32-lane words of the masks, which one invocation per word assembles from
//   workgroup memory, and with B <= 32 whole neurons, so that they also write the step's
//   any-sample bitmap (a bit per neuron: fired in some sample);
// * `spmv_in`: the spike adjoint of one source and sample, `gz = sum_e w_e mu[target_e]`,
//   with the four partial sums per segment of the CPU's gather form, and the recurrent weight
//   gradient of the source's edges (edge k of the source, counted over its segments, owned by
//   the invocation of lane k mod B: all lanes busy; `wide` accumulator); with trained input
//   weights also the input weight gradient (one invocation per input edge) and the previous
//   step's Poisson draws;
// * `neuron_backward`: the voltage-regularization derivative of one neuron and sample at a
//   step, its adjoint through the step, and the adjoint of the previous step's arrivals;
// * `loss_sums` (once per call, after the forward pass): the loss sums per sample and the
//   rate losses' derivatives per spike, which the backward pass reads.
//
// Two dispatches per step forward (`deliver`, `update_draw`) and two backward (`spmv_in`,
// `neuron_backward`). No atomics: every value has one writer per dispatch and every sum a
// fixed order, so the results do not depend on scheduling; the spike masks are read with
// plain loads.

struct Step {
    // The step.
    t: u32,
    // Its index in the bound tape chunk.
    tl: u32,
    // Bit 0: accumulate the loss sums (spike counts, voltage regularization).
    flags: u32,
}

// The network's constants are bindings 1 and 2. Every array that may exceed one binding is
// declared in the header as windows of one buffer (lockstep_gpu::windows) and read and
// written through `NAME_at(i)` and `NAME_set(i, v)`: the network's arrays `net_u32` (its
// indices), `weights` (parameters' order, then the recurrent ones in in-edge order), `grad`
// (the weight gradient's `wide` accumulators) and `edges` (in-edge sources and weight slots,
// out-edge target rows), and the per-sample arrays `state` (f32: u, asc, y1, y2, arrivals),
// `state_u32` (refractory counters, spike counts, the Poisson ring), `masks` (fired, active,
// the any-sample bitmap), `vreg` (`wide`: voltage-regularization and loss sums) and `adj`
// (the adjoint state). With one window, every array that fits a binding, an accessor is
// the plain index.
@group(0) @binding(1) var<storage, read> net_f32: array<f32>;
@group(0) @binding(2) var<storage, read> net_wide: array<wide>;
@group(1) @binding(0) var<storage, read_write> tape_x: array<f32>;
@group(1) @binding(1) var<storage, read_write> tape_asc: array<f32>;
@group(2) @binding(0) var<uniform> step: Step;

const WG: u32 = 64u;
// `update_draw`'s workgroups are UWG invocations (from the header: 256).

// The linear index of an invocation in a dispatch of (x, y) workgroups of WG.
fn linear(wg: vec3<u32>, nwg: vec3<u32>, li: u32) -> u32 {
    return (wg.y * nwg.x + wg.x) * WG + li;
}

// Group constants (f32 at O_GF32 + g * GF, wide at g * GD, u32 at O_GU + g * 4).
fn gf(g: u32, k: u32) -> f32 {
    return net_f32[g * GF + k];
}
fn gd(g: u32, k: u32) -> wide {
    return net_wide[g * GD + k];
}
fn gu(g: u32, k: u32) -> u32 {
    return net_u32_at(O_GU + g * 4u + k);
}
// f32 slots of a group.
const G_P33: u32 = 0u;
const G_P30: u32 = 1u;
const G_EXPM1: u32 = 2u;
const G_IE: u32 = 3u;
const G_IE_P30: u32 = 4u;
const G_TH_GT: u32 = 5u;
const G_TH_GE: u32 = 6u;
const G_TH32: u32 = 7u;
const G_VRESET: u32 = 8u;
const G_TH_MINUS_RESET: u32 = 9u;
const G_LB32: u32 = 10u;
const G_LB_LT: u32 = 11u;
const G_PORTS: u32 = 12u;
// per port k at G_PORTS + 6 k: p11, p21, p22, p31, p32, psc_init
// per after-spike current a at G_PORTS + 6 NP + 5 a: stable, decay, amp, rd, jump_slope
// wide slots: 0 th, then per after-spike current a at 1 + 2 a: amp, refr_decay (float64
// on the host; as float32, their remainders at O_GDLO + g * GD)
// u32 slots: 0 glif, 1 refractory steps, 2 after-spike currents, 3 live-port mask

fn port_c(g: u32, k: u32, q: u32) -> f32 {
    return gf(g, G_PORTS + 6u * k + q);
}
fn asc_c(g: u32, a: u32, q: u32) -> f32 {
    return gf(g, G_PORTS + 6u * NP + 5u * a + q);
}

// ---------------------------------------------------------------------------------------
// Inputs.

// Poisson counts of step `t`: invocation `idx` of (Poisson node, sample), sample fastest.
fn draw_one(idx: u32, t: u32) {
    if (idx >= NPOIS * B) {
        return;
    }
    let l = idx % B;
    let p = idx / B;
    let v = net_u32_at(O_PNODE + p);
    state_u32_set(O_PRING + ((t % RL) * NV + v) * B + l, poisson_count(p, v, l, t));
}

// The Poisson counts of step `step.t` alone (the steps before a recomputed chunk).
@compute @workgroup_size(64)
fn draw(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    draw_one(linear(wg, nwg, li), step.t);
}

// ---------------------------------------------------------------------------------------
// Forward.

// Once per call, before the forward pass: the recurrent weights in the order of the
// in-edge lists (`weights_at(O_WPERM + e)`), so that `deliver` streams them with the edges'
// sources instead of gathering one sector per edge from the parameters' order at every
// step. One invocation per in-edge slot e.
@compute @workgroup_size(64)
fn permute_weights(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_index) li: u32) {
    let e = linear(wg, nwg, li);
    if (e >= E_REC) {
        return;
    }
    weights_set(O_WPERM + e, weights_at(edges_at(O_RW + e)));
}

fn fired_bit(t: u32, s: u32, l: u32) -> bool {
    let m = masks_at((t * N + s) * W + l / 32u);
    return ((m >> (l % 32u)) & 1u) != 0u;
}

// The arrivals of step `step.t` at (target j, port k) in sample l: one invocation per
// (j, k, l), l fastest.
@compute @workgroup_size(64)
fn deliver(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) li: u32) {
    let idx = linear(wg, nwg, li);
    if (idx >= N * NP * B) {
        return;
    }
    let l = idx % B;
    let c = idx / B;
    let tt = step.t;
    var acc = 0.0f;
    for (var q = 0u; q < D; q = q + 1u) {
        let d = D - q;
        if (tt < d) {
            continue;
        }
        let t = tt - d;
        let r = c * D + q;
        let r0 = net_u32_at(O_RPTR + r);
        let r1 = net_u32_at(O_RPTR + r + 1u);
        for (var e = r0; e < r1; e = e + 1u) {
            let s = edges_at(O_RSRC + e);
            // A source that fired in no sample adds nothing: its mask word and weight are
            // not loaded (a bit in a bitmap of at most N / 2 bytes per step, N / 4 at B = 16:
            // L1-resident).
            if (ANYW > 0u && !fired_any(t, s)) {
                continue;
            }
            if (fired_bit(t, s, l)) {
                acc = acc + weights_at(O_WPERM + e);
            }
        }
        let i0 = net_u32_at(O_IPTR + r);
        let i1 = net_u32_at(O_IPTR + r + 1u);
        if (HAS_FILE) {
            for (var e = i0; e < i1; e = e + 1u) {
                let cnt = net_u32_at(O_FILE + t * NV + net_u32_at(O_ISRC + e));
                if (cnt > 0u) {
                    acc = acc + weights_at(O_WIN + net_u32_at(O_IW + e)) * f32(cnt);
                }
            }
        }
        if (NPOIS > 0u) {
            for (var e = i0; e < i1; e = e + 1u) {
                let v = net_u32_at(O_ISRC + e);
                let cnt = state_u32_at(O_PRING + ((t % RL) * NV + v) * B + l);
                if (cnt > 0u) {
                    acc = acc + weights_at(O_WIN + net_u32_at(O_IW + e)) * f32(cnt);
                }
            }
        }
    }
    state_set(O_ARR + c * B + l, acc);
}

// The voltage-regularization term `relu(|v - 0.5| - 0.5)` and its derivative.
fn vreg_r(v: wide) -> vec2<wide> {
    if (v > 1.0) {
        return vec2<wide>(v - 1.0, 1.0);
    } else if (v < 0.0) {
        return vec2<wide>(-v, -1.0);
    }
    return vec2<wide>(0.0, 0.0);
}

// The (neuron, sample) of invocation `li` of workgroup `g` in the kernels that assemble
// spike words: with B <= 32 a workgroup holds NPW whole neurons (B lanes each), else UWG / 32
// 32-lane words of the neurons' samples; `ok` is false for the lanes past them.
struct NeuronLane {
    i: u32,
    l: u32,
    ok: bool,
}

fn neuron_lane(g: u32, li: u32) -> NeuronLane {
    if (B <= 32u) {
        let i = g * NPW + li / B;
        return NeuronLane(i, li % B, li < NPW * B && i < N);
    }
    let gw = g * (UWG / 32u) + li / 32u;
    let i = gw / W;
    let l = (gw % W) * 32u + li % 32u;
    return NeuronLane(i, l, i < N && l < B);
}

// Fired (bit 0) and active (bit 1) of each invocation of a workgroup of `update_draw`.
var<workgroup> lane_bits: array<u32, UWG>;
// Per neuron of the workgroup (B <= 32): whether it fired in some sample.
var<workgroup> neuron_any: array<u32, UWG>;

// Whether source s fired at step t in some sample of the batch: its bit in the any-sample
// bitmap (`O_ANY`; only with B <= 32, ANYW > 0): bit r % 32 of word (s / NPW) * WPG + r / 32,
// r = s % NPW.
fn fired_any(t: u32, s: u32) -> bool {
    let r = s % NPW;
    let word = masks_at(O_ANY + t * ANYW + (s / NPW) * WPG + r / 32u);
    return ((word >> (r % 32u)) & 1u) != 0u;
}

// Step `step.t` for the neurons and samples of the first NEURON_WG workgroups, then the
// step's Poisson draws in the next ones. Writes the step's spike masks (fired, active), one
// invocation per 32-lane word assembling it from workgroup memory, and with B <= 32 the
// step's any-sample bitmap: the workgroup's NPW neurons in WPG words, each assembled by one
// invocation after a second barrier. No atomics.
@compute @workgroup_size(UWG)
fn update_draw(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) li: u32) {
    let g = wg.y * nwg.x + wg.x;
    if (g >= NEURON_WG) {
        draw_one((g - NEURON_WG) * UWG + li, step.t);
        return;
    }
    let ln = neuron_lane(g, li);
    var bits = 0u;
    if (ln.ok) {
        bits = update_one(ln.i, ln.l);
    }
    lane_bits[li] = bits;
    neuron_any[li] = 0u;
    workgroupBarrier();
    // The first lane of each word assembles it from its word's lanes, in lane order.
    let j = ln.l % 32u;
    if (ln.ok && j == 0u) {
        let len = min(32u, B - ln.l);
        var fired_word = 0u;
        var active_word = 0u;
        for (var k = 0u; k < len; k = k + 1u) {
            let v = lane_bits[li + k];
            fired_word = fired_word | ((v & 1u) << k);
            active_word = active_word | (((v >> 1u) & 1u) << k);
        }
        let word = (step.t * N + ln.i) * W + ln.l / 32u;
        masks_set(word, fired_word);
        masks_set(O_ACTIVE + word, active_word);
        if (ANYW > 0u) {
            // B <= 32: one word per neuron, assembled by its sample 0's lane li = k B.
            neuron_any[li / B] = select(0u, 1u, fired_word != 0u);
        }
    }
    if (ANYW > 0u) {
        workgroupBarrier();
        if (li < WPG) {
            let first = li * 32u;
            let len = min(32u, NPW - first);
            var any_word = 0u;
            for (var k = 0u; k < len; k = k + 1u) {
                any_word = any_word | (neuron_any[first + k] << k);
            }
            masks_set(O_ANY + step.t * ANYW + g * WPG + li, any_word);
        }
    }
}

// One neuron i and sample l through step `step.t`; returns fired (bit 0) and active (bit 1).
fn update_one(i: u32, l: u32) -> u32 {
    let g = net_u32_at(O_GROUP_OF + i);
    let glif = gu(g, 0u) != 0u;
    let na = gu(g, 2u);
    let live = gu(g, 3u);
    let ui = O_U + i * B + l;
    let u = state_at(ui);
    var adec: array<f32, NA_MAX>;
    var un: f32;
    if (glif) {
        var sum = 0.0f;
        for (var a = 0u; a < na; a = a + 1u) {
            let av = state_at(O_ASC + (i * NA + a) * B + l);
            sum = sum + av * asc_c(g, a, 0u);
            adec[a] = av * asc_c(g, a, 1u);
        }
        un = u * gf(g, G_P33) + (gf(g, G_IE) + sum) * gf(g, G_P30);
        for (var k = 0u; k < NP; k = k + 1u) {
            if (((live >> k) & 1u) == 0u) {
                continue;
            }
            let yi = (i * NP + k) * B + l;
            un = un + (state_at(O_Y1 + yi) * port_c(g, k, 3u) + state_at(O_Y2 + yi) * port_c(g, k, 4u));
        }
    } else {
        un = gf(g, G_IE_P30);
        for (var k = 0u; k < NP; k = k + 1u) {
            if (((live >> k) & 1u) == 0u) {
                continue;
            }
            let yi = (i * NP + k) * B + l;
            un = un + state_at(O_Y1 + yi) * port_c(g, k, 3u);
            un = un + state_at(O_Y2 + yi) * port_c(g, k, 4u);
        }
        let v = un + u * gf(g, G_EXPM1) + u;
        if (v < gf(g, G_LB_LT)) {
            un = gf(g, G_LB32);
        } else {
            un = v;
        }
    }
    // Spike, reset, refractory counter. The thresholds are the float32 numbers that make
    // these comparisons equal to the CPU's comparisons in f64.
    let ri = O_REFR + i * B + l;
    let refr = state_u32_at(ri);
    let act = refr == 0u;
    var fired = false;
    if (act) {
        if (glif) {
            fired = un > gf(g, G_TH_GT);
        } else {
            fired = un >= gf(g, G_TH_GE);
        }
    }
    let held = u;
    var unew = held;
    if (fired) {
        unew = gf(g, G_VRESET);
    } else if (act) {
        unew = un;
    }
    state_set(ui, unew);
    var x = held;
    if (act) {
        x = un;
    }
    tape_x[step.tl * N * B + i * B + l] = x;
    if (fired) {
        state_u32_set(ri, gu(g, 1u));
    } else if (!act) {
        state_u32_set(ri, refr - 1u);
    }
    for (var a = 0u; a < na; a = a + 1u) {
        let ai = O_ASC + (i * NA + a) * B + l;
        let ad = adec[a];
        tape_asc[((step.tl * N + i) * NA + a) * B + l] = ad;
        if (fired) {
            state_set(ai, asc_jump(g, a, ad));
        } else if (act) {
            state_set(ai, ad);
        }
    }
    // Alpha PSCs, then this step's arrivals.
    for (var k = 0u; k < NP; k = k + 1u) {
        if (((live >> k) & 1u) == 0u) {
            continue;
        }
        let yi = (i * NP + k) * B + l;
        let y1v = state_at(O_Y1 + yi);
        state_set(O_Y2 + yi, y1v * port_c(g, k, 1u) + state_at(O_Y2 + yi) * port_c(g, k, 2u));
        state_set(O_Y1 + yi, y1v * port_c(g, k, 0u) + state_at(O_ARR + yi) * port_c(g, k, 5u));
    }
    if ((step.flags & 1u) != 0u) {
        let ci = O_COUNTS + i * B + l;
        if (fired) {
            state_u32_set(ci, state_u32_at(ci) + 1u);
        }
        if (VREG_ON) {
            let r = vreg_r(wide(unew) / gd(g, 0u));
            vreg_set(i * B + l, vreg_at(i * B + l) + r.x * r.x);
        }
    }
    return u32(fired) | (u32(act) << 1u);
}

// ---------------------------------------------------------------------------------------
// Backward.

// Step `step.t` of the backward pass's first dispatch: the spike adjoints and recurrent
// weight gradient (the first SPMV_WG workgroups); with trained input weights (TRAIN_IN) the
// input weight gradient (the next INGRAD_WG) and the Poisson draws of step t - 1 that the
// next step's input gradient reads (the next DRAW_WG; slot t - 1 of the ring is not the
// slot t that this dispatch's input gradient reads).
@compute @workgroup_size(64)
fn spmv_in(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) li: u32) {
    let g = wg.y * nwg.x + wg.x;
    let t = step.t;
    if (g < SPMV_WG) {
        spmv_one(g * WG + li, t);
    } else if (TRAIN_IN) {
        if (g < SPMV_WG + INGRAD_WG) {
            input_grad_one((g - SPMV_WG) * WG + li, t);
        } else if (t > 0u) {
            draw_one((g - SPMV_WG - INGRAD_WG) * WG + li, t - 1u);
        }
    }
}

// The spike adjoint of source s in sample l at step t from the adjoint ring, with the
// recurrent weight gradient of its edges: invocation `idx` of (s, l), l fastest.
fn spmv_one(idx: u32, t: u32) {
    if (idx >= N * B) {
        return;
    }
    let l = idx % B;
    let s = idx / B;
    let g0 = net_u32_at(O_SEGPTR + s);
    let g1 = net_u32_at(O_SEGPTR + s + 1u);
    var acc = 0.0f;
    for (var g = g0; g < g1; g = g + 1u) {
        let start = net_u32_at(O_SEG + 4u * g);
        let end = net_u32_at(O_SEG + 4u * g + 1u);
        let d = net_u32_at(O_SEG + 4u * g + 2u);
        if (t + d >= T || start == end) {
            continue;
        }
        let base = ((t + d) % RL) * LIVE_ROWS;
        var p0 = 0.0f;
        var p1 = 0.0f;
        var p2 = 0.0f;
        var p3 = 0.0f;
        var tail = 0.0f;
        let quads = start + ((end - start) / 4u) * 4u;
        for (var e = start; e < quads; e = e + 4u) {
            p0 = p0 + weights_at(e) * adj_at(O_MU + (base + edges_at(O_TOFF + e)) * B + l);
            p1 = p1 + weights_at(e + 1u) * adj_at(O_MU + (base + edges_at(O_TOFF + e + 1u)) * B + l);
            p2 = p2 + weights_at(e + 2u) * adj_at(O_MU + (base + edges_at(O_TOFF + e + 2u)) * B + l);
            p3 = p3 + weights_at(e + 3u) * adj_at(O_MU + (base + edges_at(O_TOFF + e + 3u)) * B + l);
        }
        for (var e = quads; e < end; e = e + 1u) {
            tail = tail + weights_at(e) * adj_at(O_MU + (base + edges_at(O_TOFF + e)) * B + l);
        }
        acc = acc + ((p0 + p1) + (p2 + p3) + tail);
    }
    adj_set(O_GZ + s * B + l, acc + adj_at(O_GZRATE + s * B + l));
    // The weight gradient of the source's edges where it spiked: edge k (counted from the
    // source's first over its segments) belongs to the invocation of lane k mod B, which
    // visits only its own edges (every lane busy), summing the adjoints of the samples
    // where the source fired in sample order.
    var spiked = false;
    for (var w = 0u; w < W; w = w + 1u) {
        if (masks_at((t * N + s) * W + w) != 0u) {
            spiked = true;
        }
    }
    if (!spiked) {
        return;
    }
    let words = (t * N + s) * W;
    var k0 = 0u;
    for (var g = g0; g < g1; g = g + 1u) {
        let start = net_u32_at(O_SEG + 4u * g);
        let end = net_u32_at(O_SEG + 4u * g + 1u);
        let d = net_u32_at(O_SEG + 4u * g + 2u);
        if (t + d < T) {
            let base = ((t + d) % RL) * LIVE_ROWS;
            // This lane's first edge of the segment: the first k >= k0 with k mod B == l.
            let first = (l + B - k0 % B) % B;
            for (var e = start + first; e < end; e = e + B) {
                let row = O_MU + (base + edges_at(O_TOFF + e)) * B;
                var sum = wide(0.0);
                var bits = 0u;
                for (var m = 0u; m < B; m = m + 1u) {
                    if (m % 32u == 0u) {
                        bits = masks_at(words + m / 32u);
                    }
                    if (((bits >> (m % 32u)) & 1u) != 0u) {
                        sum = sum + wide(adj_at(row + m));
                    }
                }
                grad_set(e, grad_at(e) + sum);
            }
        }
        k0 = k0 + (end - start);
    }
}

// The input weight gradient of step t at input edge (CSR slot) e; per sample, the file
// event's term, then the Poisson draw's, as the CPU adds them.
fn input_grad_one(e: u32, t: u32) {
    if (e >= E_IN) {
        return;
    }
    let v = net_u32_at(O_INV + e);
    let dp = net_u32_at(O_INDP + e);
    let d = dp & 0xffffu;
    if (t + d >= T) {
        return;
    }
    let row = O_MU + (((t + d) % RL) * LIVE_ROWS + net_u32_at(O_INOFF + e)) * B;
    var file = 0u;
    if (HAS_FILE) {
        file = net_u32_at(O_FILE + t * NV + v);
    }
    var g = grad_at(E_REC + e);
    for (var l = 0u; l < B; l = l + 1u) {
        if (file > 0u) {
            g = g + wide(adj_at(row + l) * f32(file));
        }
        if (NPOIS > 0u) {
            let cnt = state_u32_at(O_PRING + ((t % RL) * NV + v) * B + l);
            if (cnt > 0u) {
                g = g + wide(adj_at(row + l) * f32(cnt));
            }
        }
    }
    grad_set(E_REC + e, g);
}

// `Surrogate::dz_du_f32`: pseudo_derivative(u / th) / th in float32; the surrogate (kind:
// 0 gauss, 1 triangle; gain; width) is in net_f32 at O_SG, written per call.
fn dz_du(u: f32, th: f32) -> f32 {
    let v = u / th;
    let gain = net_f32[O_SG + 1u];
    let width = net_f32[O_SG + 2u];
    var pd: f32;
    if (net_f32[O_SG] == 0.0f) {
        let x = (v - 1.0f) / width;
        pd = gain * exp(-(x * x));
    } else {
        pd = gain * max(1.0f - abs(v - 1.0f) / width, 0.0f);
    }
    return pd / th;
}

const ACTIVE_BIT: u32 = 1u;

fn flags_of(t: u32, i: u32, l: u32) -> u32 {
    let word = (t * N + i) * W + l / 32u;
    let sh = l % 32u;
    let a = (masks_at(O_ACTIVE + word) >> sh) & 1u;
    let f = (masks_at(word) >> sh) & 1u;
    return a | (f << 1u);
}

// Step `step.t` (tape index `step.tl`) of the backward pass's second dispatch for neuron i
// and sample l, one invocation per (i, l): the voltage-regularization derivative on U after
// the step, the adjoint through the step from the spike adjoints `gz`, then the adjoint of
// step t - 1's arrivals (`mu = psc_init * y1` into ring slot (t - 1) mod RL, which this
// dispatch's invocation alone writes and the next step's `spmv_in` reads). The slot of the
// last step is never written: its arrivals' adjoint is zero, as the cleared ring holds.
@compute @workgroup_size(64)
fn neuron_backward(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_index) li: u32) {
    let idx = linear(wg, nwg, li);
    if (idx >= N * B) {
        return;
    }
    let l = idx % B;
    let i = idx / B;
    voltage_reg_adjoint(i, l);
    local_backward(i, l);
    if (step.t > 0u) {
        arrivals_adjoint(i, l, step.t - 1u);
    }
}

// The adjoint of neuron i in sample l through step `step.t` (tape index `step.tl`).
fn local_backward(i: u32, l: u32) {
    let g = net_u32_at(O_GROUP_OF + i);
    let glif = gu(g, 0u) != 0u;
    let na = gu(g, 2u);
    let live = gu(g, 3u);
    let f = flags_of(step.t, i, l);
    let xv = tape_x[step.tl * N * B + i * B + l];
    let ui = O_AU + i * B + l;
    var p1: array<f32, NP>;
    var p2: array<f32, NP>;
    for (var k = 0u; k < NP; k = k + 1u) {
        if (((live >> k) & 1u) == 0u) {
            continue;
        }
        let yi = (i * NP + k) * B + l;
        let ly1 = adj_at(O_A1 + yi);
        let ly2 = adj_at(O_A2 + yi);
        p1[k] = ly2 * port_c(g, k, 1u) + ly1 * port_c(g, k, 0u);
        p2[k] = ly2 * port_c(g, k, 2u);
    }
    let clamped = !glif && xv == gf(g, G_LB32);
    var sigma = 0.0f;
    if (!clamped) {
        sigma = dz_du(xv, gf(g, G_TH32));
    }
    let u = adj_at(ui);
    var lz = adj_at(O_GZ + i * B + l) - u * gf(g, G_TH_MINUS_RESET);
    for (var a = 0u; a < na; a = a + 1u) {
        let ap = tape_asc[((step.tl * N + i) * NA + a) * B + l];
        let la = adj_at(O_AA + (i * NA + a) * B + l);
        lz = lz + la * (asc_c(g, a, 2u) + ap * asc_c(g, a, 3u) - ap);
    }
    var lun = 0.0f;
    if (!clamped) {
        lun = u + lz * sigma;
    }
    if ((f & ACTIVE_BIT) != 0u) {
        for (var a = 0u; a < na; a = a + 1u) {
            let ai = O_AA + (i * NA + a) * B + l;
            var s = 1.0f;
            if ((f & 2u) != 0u) {
                s = asc_c(g, a, 4u);
            }
            let lap = adj_at(ai) * s;
            adj_set(ai, lap * asc_c(g, a, 1u) + lun * gf(g, G_P30) * asc_c(g, a, 0u));
        }
        if (glif) {
            adj_set(ui, lun * gf(g, G_P33));
        } else {
            adj_set(ui, lun * gf(g, G_EXPM1) + lun);
        }
    }
    for (var k = 0u; k < NP; k = k + 1u) {
        if (((live >> k) & 1u) == 0u) {
            continue;
        }
        let yi = (i * NP + k) * B + l;
        var a = p1[k];
        var b = p2[k];
        if ((f & ACTIVE_BIT) != 0u) {
            a = a + lun * port_c(g, k, 3u);
            b = b + lun * port_c(g, k, 4u);
        }
        adj_set(O_A1 + yi, a);
        adj_set(O_A2 + yi, b);
    }
}

// The voltage-regularization derivative on U after step `step.t` (tape index `step.tl`).
fn voltage_reg_adjoint(i: u32, l: u32) {
    let g = net_u32_at(O_GROUP_OF + i);
    if (VREG_ON) {
        let f = flags_of(step.t, i, l);
        var u_post = tape_x[step.tl * N * B + i * B + l];
        if (f == 3u) {
            u_post = gf(g, G_VRESET);
        }
        let th = gd(g, 0u);
        let r = vreg_r(wide(u_post) / th);
        if (r.x != 0.0) {
            let ui = O_AU + i * B + l;
            adj_set(ui, adj_at(ui) + f32(net_wide[O_VCOEF] * 2.0 * r.x * r.y / th));
        }
    }
}

// The adjoint of step t's arrivals at neuron i, sample l: `mu = psc_init * y1` into ring
// slot t mod RL, in the neuron's rows of its live ports (`O_MUROW`; the ring holds no rows
// for ports no edge reaches).
fn arrivals_adjoint(i: u32, l: u32, t: u32) {
    let g = net_u32_at(O_GROUP_OF + i);
    let live = gu(g, 3u);
    let row0 = (t % RL) * LIVE_ROWS + net_u32_at(O_MUROW + i);
    var kc = 0u;
    for (var k = 0u; k < NP; k = k + 1u) {
        if (((live >> k) & 1u) == 0u) {
            continue;
        }
        let yi = (i * NP + k) * B + l;
        adj_set(O_MU + (row0 + kc) * B + l, adj_at(O_A1 + yi) * port_c(g, k, 5u));
        kc = kc + 1u;
    }
}

// The batch's loss sums after its last forward step, in the CPU's order
// (`Problem::batch_loss_terms`), so that nothing of them crosses to the host before the
// backward pass: invocations 0..N*B write the rate losses' derivative per spike of (neuron
// i, sample l), `gz_rate = sum_r 2 (c s_r - target_ri) s_r / (B N)` (the rate losses in
// order, wide, then f32); then one invocation per (part, sample l) sums over the neurons in
// order: per rate loss r `sum_i (c_i s_r - target_ri)^2`, then the voltage-regularization
// sums, then the spike count, into `vreg` at `O_LOSS + part * B + l`. A sum is one invocation's
// loop over N neurons: fixed order, no atomics.
@compute @workgroup_size(64)
fn loss_sums(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) li: u32) {
    let idx = linear(wg, nwg, li);
    if (idx < N * B) {
        let i = idx / B;
        let c = wide(state_u32_at(O_COUNTS + idx));
        let bn = wide(B) * wide(N);
        var g = wide(0.0);
        for (var r = 0u; r < NRATE; r = r + 1u) {
            let scale = net_wide[O_RSCALE + r];
            g = g + 2.0 * (c * scale - net_wide[O_RTARGET + r * N + i]) * scale / bn;
        }
        adj_set(O_GZRATE + idx, f32(g));
        return;
    }
    let k = idx - N * B;
    if (k >= (NRATE + 2u) * B) {
        return;
    }
    let part = k / B;
    let l = k % B;
    var s = wide(0.0);
    if (part < NRATE) {
        let scale = net_wide[O_RSCALE + part];
        for (var i = 0u; i < N; i = i + 1u) {
            let c = wide(state_u32_at(O_COUNTS + i * B + l));
            let d = c * scale - net_wide[O_RTARGET + part * N + i];
            s = s + d * d;
        }
    } else if (part == NRATE) {
        for (var i = 0u; i < N; i = i + 1u) {
            s = s + vreg_at(i * B + l);
        }
    } else {
        // The spike count in integers (exact in float32 too below 2^24 spikes per sample).
        var count = 0u;
        for (var i = 0u; i < N; i = i + 1u) {
            count = count + state_u32_at(O_COUNTS + i * B + l);
        }
        s = wide(count);
    }
    vreg_set(O_LOSS + part * B + l, s);
}
