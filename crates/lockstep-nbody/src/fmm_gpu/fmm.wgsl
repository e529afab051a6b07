// The FMM force evaluation and direct summation of lockstep-nbody as WGSL compute kernels
// (docs/nbody.md, "Forces on the GPU"). Cartesian Taylor expansions of the Plummer-softened
// kernel (Dehnen 2014, Comput. Astrophys. Cosmol. 1:1), the same index tables as the CPU
// code (fmm/expansion.rs), in f32 arithmetic:
//
// - every point (particle, node centre, imported cell centre) is stored as a pair of f32
//   (hi, lo) with hi + lo its position relative to the tree's cube centre; differences of
//   points are formed as (hi_a - hi_b) + (lo_a - lo_b), which keeps about 1e-7 of the
//   difference itself (not of the box) for nearby points;
// - derivative tensors are evaluated at R / s with s a power of two near |R| and scaled
//   back per degree (D_n(R) = s^-(|n|+1) D_n(R/s)), so no intermediate over- or underflows;
// - sums over sources are f32 per source (P2P: per source node), added into (hi, lo)
//   compensated accumulators; no atomics, a fixed order: the same bits on every run.
//
// Outputs per sorted particle: out[2 i] = hi, out[2 i + 1] = lo of (grad Phi, -Phi) (G = 1,
// the host scales by G and adds hi + lo in f64).
//
// Bounded work per invocation: Mesa's llvmpipe (lavapipe) ends every loop of an invocation
// once all its loops together have iterated 65,535 times (gallivm's LP_MAX_TGSI_LOOP_ITERATIONS,
// counted per SIMD group of invocations), silently. So no dispatch gives an invocation more
// than the host's LOOP_BUDGET (half that) loop iterations: long lists, big leaves and many
// sources are split into passes (`chunk` = the pass, `chunk_len` = items per pass), each
// pass adding to what the previous one wrote, in a fixed order.

const WG: u32 = 64u;
const MAXT: u32 = 84u; // nterms(6)

struct Params {
    first: u32, count: u32, n_all: u32, nn: u32,
    nt: u32, p: u32, ngrad: u32, eps2: f32,
    r2min: f32, o_parent: u32, o_axis: u32, o_degree: u32,
    o_shift: u32, n_shift: u32, o_drest: u32, o_dj: u32,
    o_drow: u32, o_rows: u32, o_rstart: u32, o_grad: u32,
    zero: u32, o_p2p_items: u32, o_m2l_off: u32, o_m2l_items: u32,
    o_m2p_off: u32, o_m2p_items: u32, o_leafof: u32, o_list: u32,
    f_inv: u32, f_dc: u32, f_sign: u32, target0: u32,
    chunk: u32, chunk_len: u32, src0: u32, src1: u32,
    o_p2p_off: u32, unused0: u32, unused1: u32, unused2: u32,
}

// Particles, sorted: pts[2 i] = (hi.xyz, mass), pts[2 i + 1] = (lo.xyz, 0).
// Centres of the tree nodes then the imported cells: cen[2 k] = hi, cen[2 k + 1] = lo.
// Nodes: nodes[2 k] = (start, end, first_child, nchild), nodes[2 k + 1] = (parent,
// ntargets, level, 0).
// Index tables, interaction lists (compressed rows per target node: M2L, M2P and P2P, whose
// sources are nodes), leaf lists and P2P tasks (leaf, first target).
// Float tables: 1 / n_axis, derivative coefficients, (-1)^|n|.
// Multipoles [nodes + cells][nt].
// Local expansions [nodes][nt], then the low parts [nodes][nt] of the M2L's compensated sums
// between its passes.
// Field per sorted particle (hi, lo).
@group(1) @binding(0) var<uniform> P: Params;

var<workgroup> sh: array<vec4<f32>, 64>;
var<workgroup> sh_lo: array<vec4<f32>, 64>;
// The P2P tile's source particle indices and row entries.
var<workgroup> shj: array<u32, 64>;
var<workgroup> shn: array<u32, 64>;
// The P2P row's source ranges (first, end) of 64 entries.
var<workgroup> shr: array<vec2<u32>, 64>;

fn flat_id(wg: vec3<u32>, lid: u32) -> u32 {
    return (wg.x + wg.y * 65535u) * WG + lid;
}

fn pt_hi(i: u32) -> vec3<f32> { return pts_at(2u * i).xyz; }
fn pt_lo(i: u32) -> vec3<f32> { return pts_at(2u * i + 1u).xyz; }
fn cen_hi(k: u32) -> vec3<f32> { return cen_at(2u * k).xyz; }
fn cen_lo(k: u32) -> vec3<f32> { return cen_at(2u * k + 1u).xyz; }

// a - b for points given as (hi, lo) pairs.
fn dd(ah: vec3<f32>, al: vec3<f32>, bh: vec3<f32>, bl: vec3<f32>) -> vec3<f32> {
    return (ah - bh) + (al - bl);
}

// Compensated addition of x into (hi, lo) (Knuth's two-sum).
// x with bits the compiler cannot relate to the expression that made x (an XOR with
// `P.zero`, 0 from the host): shader compilers rewrite float expressions where the source
// does not forbid it (Mesa's NIR turns `(a + b) - a` into `b` unless an operation is marked
// exact, and WGSL cannot mark one), which would make the two-sums' error terms 0.
fn opaque4(x: vec4<f32>) -> vec4<f32> {
    return bitcast<vec4<f32>>(bitcast<vec4<u32>>(x) ^ vec4<u32>(P.zero));
}
fn opaque1(x: f32) -> f32 {
    return bitcast<f32>(bitcast<u32>(x) ^ P.zero);
}
struct Acc { hi: vec4<f32>, lo: vec4<f32> }
fn acc_add(a: Acc, x: vec4<f32>) -> Acc {
    let s = opaque4(a.hi + x);
    let bb = opaque4(s - a.hi);
    let e = (a.hi - (s - bb)) + (x - bb);
    return Acc(s, a.lo + e);
}
fn two_sum1(hi: f32, lo: f32, x: f32) -> vec2<f32> {
    let s = opaque1(hi + x);
    let bb = opaque1(s - hi);
    let e = (hi - (s - bb)) + (x - bb);
    return vec2<f32>(s, lo + e);
}

// Scaled monomials x^n / n! for the nt coefficients.
fn monomials(x: vec3<f32>, out: ptr<function, array<f32, 84>>) {
    (*out)[0] = 1.0;
    for (var i = 1u; i < P.nt; i++) {
        let q = lists_at(P.o_parent + i);
        let ax = lists_at(P.o_axis + i);
        (*out)[i] = (*out)[q] * x[ax] * tabf_at(P.f_inv + i);
    }
}

// The derivative tensor of psi = (r^2 + eps^2)^(-1/2) at r / s, s = 2^floor(log2 |r|)
// (and eps / s); returns 1 / s. D_n(r) = d[n] * (1/s)^(|n| + 1).
fn derivs(r: vec3<f32>, d: ptr<function, array<f32, 84>>) -> f32 {
    let len = sqrt(dot(r, r) + P.eps2);
    let s = exp2(floor(log2(max(len, 1e-30))));
    let inv_s = 1.0 / s;
    let rs = r * inv_s;
    var mono: array<f32, 84>;
    monomials(rs, &mono);
    let q = 1.0 / (dot(rs, rs) + P.eps2 * inv_s * inv_s);
    var h: array<f32, 8>;
    h[0] = sqrt(q);
    for (var j = 1u; j <= P.p; j++) {
        h[j] = -f32(2u * j - 1u) * q * h[j - 1u];
    }
    for (var n = 0u; n < P.nt; n++) {
        var a = 0.0;
        for (var t = lists_at(P.o_drow + n); t < lists_at(P.o_drow + n + 1u); t++) {
            a += tabf_at(P.f_dc + t) * mono[lists_at(P.o_drest + t)] * h[lists_at(P.o_dj + t)];
        }
        (*d)[n] = a;
    }
    return inv_s;
}

// Powers (1/s)^k, k = 0..p+1.
fn powers(inv_s: f32, pw: ptr<function, array<f32, 9>>) {
    (*pw)[0] = 1.0;
    for (var k = 1u; k <= P.p + 1u; k++) {
        (*pw)[k] = (*pw)[k - 1u] * inv_s;
    }
}

// P2M: the multipole of each leaf (list at o_list) about its centre, from the leaf's
// particles chunk * chunk_len .. (chunk + 1) * chunk_len (pass 0 starts from zero, later
// passes add to the multipole).
@compute @workgroup_size(64)
fn p2m(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let id = flat_id(wg, lid);
    if id >= P.count { return; }
    let a = lists_at(P.o_list + id);
    let nd = nodes_at(2u * a);
    let s0 = nd.x + P.chunk * P.chunk_len;
    if P.chunk > 0u && s0 >= nd.y { return; }
    let s1 = min(nd.y, s0 + P.chunk_len);
    let zh = cen_hi(a);
    let zl = cen_lo(a);
    var acc: array<f32, 84>;
    for (var i = 0u; i < P.nt; i++) {
        if P.chunk == 0u { acc[i] = 0.0; } else { acc[i] = mp_at(a * P.nt + i); }
    }
    var mono: array<f32, 84>;
    for (var s = s0; s < s1; s++) {
        monomials(dd(pt_hi(s), pt_lo(s), zh, zl), &mono);
        let m = pts_at(2u * s).w;
        for (var i = 0u; i < P.nt; i++) { acc[i] += m * mono[i]; }
    }
    for (var i = 0u; i < P.nt; i++) { mp_set(a * P.nt + i, acc[i]); }
}

// M2M: the internal nodes first..first+count (one level) from their children.
@compute @workgroup_size(64)
fn m2m(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let id = flat_id(wg, lid);
    if id >= P.count { return; }
    let a = P.first + id;
    let nd = nodes_at(2u * a);
    if nd.w == 0u { return; }
    let zh = cen_hi(a);
    let zl = cen_lo(a);
    var acc: array<f32, 84>;
    for (var i = 0u; i < P.nt; i++) { acc[i] = 0.0; }
    var mono: array<f32, 84>;
    for (var c = nd.z; c < nd.z + nd.w; c++) {
        monomials(dd(cen_hi(c), cen_lo(c), zh, zl), &mono);
        for (var t = 0u; t < P.n_shift; t++) {
            let n = lists_at(P.o_shift + 3u * t);
            let k = lists_at(P.o_shift + 3u * t + 1u);
            let d = lists_at(P.o_shift + 3u * t + 2u);
            acc[n] += mp_at(c * P.nt + k) * mono[d];
        }
    }
    for (var i = 0u; i < P.nt; i++) { mp_set(a * P.nt + i, acc[i]); }
}

// M2L: the local expansion of every node first..first+count from the entries
// chunk * chunk_len .. (chunk + 1) * chunk_len of its M2L row. A pass whose part of the row
// is not its last keeps the compensated sum's (hi, lo) in loc; the pass that ends the row
// writes hi + lo.
@compute @workgroup_size(64)
fn m2l(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let id = flat_id(wg, lid);
    if id >= P.count { return; }
    let a = P.first + id;
    let r1 = lists_at(P.o_m2l_off + a + 1u);
    let r0 = lists_at(P.o_m2l_off + a) + P.chunk * P.chunk_len;
    if P.chunk > 0u && r0 >= r1 { return; }
    let rend = min(r1, r0 + P.chunk_len);
    let lo_at = (P.nn + a) * P.nt;
    var hi: array<f32, 84>;
    var lo: array<f32, 84>;
    for (var i = 0u; i < P.nt; i++) {
        if P.chunk == 0u {
            hi[i] = 0.0;
            lo[i] = 0.0;
        } else {
            hi[i] = loc_at(a * P.nt + i);
            lo[i] = loc_at(lo_at + i);
        }
    }
    let zh = cen_hi(a);
    let zl = cen_lo(a);
    var d: array<f32, 84>;
    var ms: array<f32, 84>;
    var pw: array<f32, 9>;
    for (var r = r0; r < rend; r++) {
        let b = lists_at(P.o_m2l_items + r);
        let inv_s = derivs(dd(zh, zl, cen_hi(b), cen_lo(b)), &d);
        powers(inv_s, &pw);
        for (var i = 0u; i < P.nt; i++) {
            ms[i] = tabf_at(P.f_sign + i) * mp_at(b * P.nt + i) * pw[lists_at(P.o_degree + i)];
        }
        for (var n = 0u; n < P.nt; n++) {
            let k0 = lists_at(P.o_rstart + n);
            let k1 = lists_at(P.o_rstart + n + 1u);
            var s = 0.0;
            for (var k = k0; k < k1; k++) {
                s += ms[k - k0] * d[lists_at(P.o_rows + k)];
            }
            let v = two_sum1(hi[n], lo[n], s * pw[lists_at(P.o_degree + n) + 1u]);
            hi[n] = v.x;
            lo[n] = v.y;
        }
    }
    for (var i = 0u; i < P.nt; i++) {
        if rend == r1 {
            loc_set(a * P.nt + i, hi[i] + lo[i]);
        } else {
            loc_set(a * P.nt + i, hi[i]);
            loc_set(lo_at + i, lo[i]);
        }
    }
}

// L2L: adds the parent's local expansion, shifted, to the nodes first..first+count.
@compute @workgroup_size(64)
fn l2l(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let id = flat_id(wg, lid);
    if id >= P.count { return; }
    let a = P.first + id;
    let par = nodes_at(2u * a + 1u).x;
    var mono: array<f32, 84>;
    monomials(dd(cen_hi(a), cen_lo(a), cen_hi(par), cen_lo(par)), &mono);
    var acc: array<f32, 84>;
    for (var i = 0u; i < P.nt; i++) { acc[i] = 0.0; }
    for (var t = 0u; t < P.n_shift; t++) {
        let n = lists_at(P.o_shift + 3u * t);
        let k = lists_at(P.o_shift + 3u * t + 1u);
        let d = lists_at(P.o_shift + 3u * t + 2u);
        acc[k] += loc_at(par * P.nt + n) * mono[d];
    }
    for (var i = 0u; i < P.nt; i++) { loc_set(a * P.nt + i, loc_at(a * P.nt + i) + acc[i]); }
}

// P2P: one workgroup per task (list at o_list: leaf, first target), its up to 64 targets
// (the leaf's particles from the first target) against the source particles of the leaf's
// P2P row (compressed rows at o_p2p_off / o_p2p_items: source nodes, each a contiguous range
// of sorted particles), relative to the leaf centre. Pass `chunk` takes the row's source
// particles chunk * chunk_len .. (chunk + 1) * chunk_len, counted along the row; pass 0
// writes the targets' fields, later passes add.
//
// The row's sources are staged 64 at a time in workgroup memory, packed across source nodes
// (a leaf holds about 10 particles: one tile per node would leave most of a tile empty and
// cost two barriers per node); the source nodes' ranges are loaded 64 entries at a time, one
// per invocation. A task's nt targets share the 64 invocations: each target
// takes k = 64 / nt of them, each summing every k-th source of a tile (a leaf of 10 targets
// keeps 60 of 64 lanes busy instead of 10). With k = 1 an invocation sums each source
// node's pairs plainly and adds that sum to its compensated accumulator when the node ends
// (the order of the CPU's near field); with k > 1 it adds its plain sum once per tile (a
// node's 10 or so sources are spread over the k invocations, and a compensated addition
// per node would cost more than the pairs); the k accumulators of a target are then added
// in slice order. The order is fixed either way, so two runs give the same bits.
// Every value the loops and barriers depend on is read from read-only arrays at
// workgroup-uniform indices, so the control flow around the barriers is uniform.
@compute @workgroup_size(64)
fn p2p(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let w = wg.x + wg.y * 65535u;
    if w >= P.count { return; }
    let task = P.o_list + 2u * w;
    let a = lists_at(task);
    let nd = nodes_at(2u * a);
    let zh = cen_hi(a);
    let zl = cen_lo(a);
    let first = lists_at(task + 1u);
    // Targets of this task (at least 1), slices per target, this invocation's of each.
    let nt = min(WG, nd.y - first);
    let k = WG / nt;
    let t = lid % nt;
    let slice = lid / nt;
    let busy = slice < k;
    let i = first + t;
    let xi = dd(pt_hi(i), pt_lo(i), zh, zl);
    var acc = Acc(vec4<f32>(0.0), vec4<f32>(0.0));
    if P.chunk > 0u && slice == 0u { acc = Acc(outp_at(2u * i), outp_at(2u * i + 1u)); }
    let w0 = P.chunk * P.chunk_len;
    let w1 = w0 + P.chunk_len;
    // This invocation's sum over the current source node's pairs, and that node's entry.
    var part = vec4<f32>(0.0);
    var node = 0xffffffffu;
    // Source particles of the row before entry e; sources staged in the tile.
    var before = 0u;
    var fill = 0u;
    let e_begin = lists_at(P.o_p2p_off + a);
    let e_end = lists_at(P.o_p2p_off + a + 1u);
    // One more round after the last entry (e == e_end) computes a partly filled tile.
    for (var e = e_begin; e <= e_end; e++) {
        var j0 = 0u;
        var s1 = 0u;
        // The source ranges of the next 64 entries, loaded at once (one entry each), so
        // that the walk over the entries below reads workgroup memory, not two dependent
        // loads from device memory per entry. Every invocation reads the same slot after
        // the barrier, so the values (and the tile loop's barriers that depend on them) are
        // uniform at run time; WGSL's analysis counts workgroup loads as non-uniform, which
        // naga (wgpu's compiler) does not enforce for barriers, and Tint would.
        // `workgroupUniformLoad` would satisfy it at the cost of a barrier per entry.
        if e < e_end && (e - e_begin) % WG == 0u {
            workgroupBarrier();
            if e + lid < e_end {
                shr[lid] = nodes_at(2u * lists_at(P.o_p2p_items + e + lid)).xy;
            }
            workgroupBarrier();
        }
        if e < e_end {
            let nb = shr[(e - e_begin) % WG];
            let cnt = nb.y - nb.x;
            let lo = max(before, w0);
            let hi = min(before + cnt, w1);
            before += cnt;
            if lo < hi {
                j0 = nb.x + lo - (before - cnt);
                s1 = nb.x + hi - (before - cnt);
            }
        }
        loop {
            let last = e == e_end && fill > 0u;
            if j0 >= s1 && !last { break; }
            let take = min(s1 - j0, WG - fill);
            if lid >= fill && lid < fill + take {
                let j = j0 + (lid - fill);
                sh[lid] = vec4<f32>(dd(pt_hi(j), pt_lo(j), zh, zl), pts_at(2u * j).w);
                shj[lid] = j;
                shn[lid] = e;
            }
            fill += take;
            j0 += take;
            if fill == WG || last {
                workgroupBarrier();
                if busy {
                    for (var q = slice; q < fill; q += k) {
                        // One invocation per target: the CPU's order, a sum per node.
                        if k == 1u && shn[q] != node {
                            if node != 0xffffffffu { acc = acc_add(acc, part); }
                            part = vec4<f32>(0.0);
                            node = shn[q];
                        }
                        let src = sh[q];
                        let dx = src.xyz - xi;
                        let r2 = max(dot(dx, dx) + P.eps2, P.r2min);
                        let inv = inverseSqrt(r2);
                        var mi = src.w * inv;
                        if shj[q] == i { mi = 0.0; }
                        let mi3 = mi * inv * inv;
                        part += vec4<f32>(dx * mi3, -mi);
                    }
                    // Several per target: a sum per tile (about 64 / k pairs), so that the
                    // compensated addition does not cost more than the pairs it sums.
                    if k > 1u {
                        acc = acc_add(acc, part);
                        part = vec4<f32>(0.0);
                    }
                }
                workgroupBarrier();
                fill = 0u;
                if last { break; }
            }
        }
    }
    if k == 1u && node != 0xffffffffu { acc = acc_add(acc, part); }
    // The k accumulators of each target, added in slice order.
    sh[lid] = acc.hi;
    sh_lo[lid] = acc.lo;
    workgroupBarrier();
    if slice == 0u {
        for (var q = 1u; q < k; q++) {
            acc = acc_add(acc, sh[t + q * nt]);
            acc.lo += sh_lo[t + q * nt];
        }
        outp_set(2u * i, acc.hi);
        outp_set(2u * i + 1u, acc.lo);
    }
}

// L2P: `acc` plus the field of node a's local expansion at the point (xh, xl).
fn l2p(a: u32, xh: vec3<f32>, xl: vec3<f32>, acc: Acc) -> Acc {
    var mono: array<f32, 84>;
    monomials(dd(xh, xl, cen_hi(a), cen_lo(a)), &mono);
    var phi = 0.0;
    var g = vec3<f32>(0.0);
    for (var k = 0u; k < P.nt; k++) { phi += loc_at(a * P.nt + k) * mono[k]; }
    for (var k = 0u; k < P.ngrad; k++) {
        let s = mono[k];
        g.x += loc_at(a * P.nt + lists_at(P.o_grad + 3u * k)) * s;
        g.y += loc_at(a * P.nt + lists_at(P.o_grad + 3u * k + 1u)) * s;
        g.z += loc_at(a * P.nt + lists_at(P.o_grad + 3u * k + 2u)) * s;
    }
    return acc_add(acc, vec4<f32>(g, -phi));
}

// Far field at the particles first..first+count, added to what P2P wrote: pass 0 (chunk)
// the L2P of their leaf's local expansion, every pass the M2P of the entries
// chunk * chunk_len .. (chunk + 1) * chunk_len of the leaf's M2P row.
@compute @workgroup_size(64)
fn far(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let id = flat_id(wg, lid);
    if id >= P.count { return; }
    let i = P.first + id;
    let a = lists_at(P.o_leafof + i);
    let r1 = lists_at(P.o_m2p_off + a + 1u);
    let r0 = lists_at(P.o_m2p_off + a) + P.chunk * P.chunk_len;
    if P.chunk > 0u && r0 >= r1 { return; }
    let rend = min(r1, r0 + P.chunk_len);
    let xh = pt_hi(i);
    let xl = pt_lo(i);
    var acc = Acc(outp_at(2u * i), outp_at(2u * i + 1u));
    if P.chunk == 0u { acc = l2p(a, xh, xl, acc); }
    var d: array<f32, 84>;
    var pw: array<f32, 9>;
    for (var r = r0; r < rend; r++) {
        let b = lists_at(P.o_m2p_items + r);
        let inv_s = derivs(dd(xh, xl, cen_hi(b), cen_lo(b)), &d);
        powers(inv_s, &pw);
        var ph = 0.0;
        var gb = vec3<f32>(0.0);
        for (var k = 0u; k < P.nt; k++) {
            let sm = tabf_at(P.f_sign + k) * mp_at(b * P.nt + k);
            let deg = lists_at(P.o_degree + k);
            ph += sm * d[k] * pw[deg + 1u];
            if k < P.ngrad {
                let f = sm * pw[deg + 2u];
                gb.x += f * d[lists_at(P.o_grad + 3u * k)];
                gb.y += f * d[lists_at(P.o_grad + 3u * k + 1u)];
                gb.z += f * d[lists_at(P.o_grad + 3u * k + 2u)];
            }
        }
        acc = acc_add(acc, vec4<f32>(gb, -ph));
    }
    outp_set(2u * i, acc.hi);
    outp_set(2u * i + 1u, acc.lo);
}

// Direct summation: targets target0..target0+count against the sources src0..src1 (of the
// n_all), 64 targets per workgroup, the sources staged 64 at a time; (hi, lo) differences, a
// compensated sum per tile. Pass 0 (chunk) writes the fields, later passes (the following
// source ranges) add.
@compute @workgroup_size(64)
fn direct(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let w = wg.x + wg.y * 65535u;
    if w * WG >= P.count { return; }
    let t = w * WG + lid;
    let valid = t < P.count;
    let i = P.target0 + t;
    var xh = vec3<f32>(0.0);
    var xl = vec3<f32>(0.0);
    var acc = Acc(vec4<f32>(0.0), vec4<f32>(0.0));
    if valid {
        xh = pt_hi(i);
        xl = pt_lo(i);
        if P.chunk > 0u { acc = Acc(outp_at(2u * t), outp_at(2u * t + 1u)); }
    }
    for (var t0 = P.src0; t0 < P.src1; t0 += WG) {
        let j = t0 + lid;
        if j < P.src1 {
            sh[lid] = pts_at(2u * j);
            sh_lo[lid] = pts_at(2u * j + 1u);
        } else {
            sh[lid] = vec4<f32>(0.0);
            sh_lo[lid] = vec4<f32>(0.0);
        }
        workgroupBarrier();
        let cnt = min(WG, P.src1 - t0);
        var part = vec4<f32>(0.0);
        for (var k = 0u; k < cnt; k++) {
            let dx = dd(sh[k].xyz, sh_lo[k].xyz, xh, xl);
            let r2 = max(dot(dx, dx) + P.eps2, P.r2min);
            let inv = inverseSqrt(r2);
            var mi = sh[k].w * inv;
            if t0 + k == i { mi = 0.0; }
            let mi3 = mi * inv * inv;
            part += vec4<f32>(dx * mi3, -mi);
        }
        acc = acc_add(acc, part);
        workgroupBarrier();
    }
    if valid {
        outp_set(2u * t, acc.hi);
        outp_set(2u * t + 1u, acc.lo);
    }
}
